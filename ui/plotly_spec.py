"""Figures for the live panels built as plain plotly dicts, wrapped once without validation.

plotly's validating constructors and ``update_layout`` took ~50 ms of Python per redraw of the step and run panels
(tree, three masks, phases, two charts) on the Zen 4 host, while a run decodes in another thread; the same
figures as dicts, wrapped with ``_validate=False``, take ~5 ms and serialize to the same JSON.
``tests/test_ui_figures.py`` rebuilds every figure through the validating constructor, so a misspelt property
still fails a test.
"""

from __future__ import annotations

from typing import Any, Sequence

import plotly.graph_objects as go

Spec = dict[str, Any]


def figure(traces: Sequence[Spec], layout: Spec) -> go.Figure:
    """A figure of ``traces`` (each a dict with its ``type``) and ``layout`` (nested dicts, no magic underscores)."""
    return go.Figure({"data": list(traces), "layout": layout}, _validate=False)
