"""The verification walkthrough panel on real (tiny-model) runs: every verifier's decisions are in
the step trace, the table lists them, the selected one is explained and ringed in the tree, and
the recorded outcomes lead to the step's accepted path."""

from __future__ import annotations

import re

import pytest

from dyntree_core.verify.common import ReplayDecisions
from test_ui_figures import _settings
from ui.runner import run_to_end
from ui.tiny import TinyModelProvider
from ui.views import step_view, walk_node
from ui.walkthrough import walkthrough_html

CASES = {  # verifier -> settings that use it
    "token_level": dict(method="dyspec_greedy", temperature=0.8, budget=24, depth=4, verifier="token_level"),
    "traversal": dict(method="sequoia", temperature=0.8, budget=16, depth=4, verifier="traversal"),
    "point_mass": dict(method="opt_tree", temperature=0.8, budget=16, depth=4, verifier="point_mass"),
    "greedy": dict(method="dyspec_greedy", temperature=0.0, budget=24, depth=4),
}


@pytest.fixture(scope="module")
def runs():
    provider = TinyModelProvider()
    return {name: run_to_end(provider, _settings(max_new_tokens=10, **kw)) for name, kw in CASES.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_each_step_lists_its_decisions_and_rings_the_selected_node(runs, name):
    run = runs[name]
    assert run.traces and all(t.verifier == name for t in run.traces)
    for idx, trace in enumerate(run.traces):
        ds = trace.decisions
        assert ds and ds[-1].kind == "bonus" and ds[-1].token == trace.bonus_token
        page = walkthrough_html(trace, run.texts, None)
        assert len(re.findall(r"<tr>", page)) == len(ds) + 1  # header + one row per decision
        for sel in {0, len(ds) // 2, len(ds) - 1}:
            page = walkthrough_html(trace, run.texts, sel)
            assert page.count("dt-walk-current") == 2  # the style rule + the selected row
            assert f"Decision {sel + 1} of {len(ds)}" in page
            node = walk_node(trace, sel)
            fig = step_view(run, idx, 16, sel).tree
            rings = [t for t in fig.data if (t.name or "").startswith("walkthrough")]
            assert len(rings) == 1
            assert rings[0].name == (f"walkthrough: node {node}" if node < trace.tree.size else "walkthrough: bonus")
        assert not any((t.name or "").startswith("walkthrough") for t in step_view(run, idx, 16).tree.data)


@pytest.mark.parametrize("name", ["token_level", "traversal", "point_mass", "greedy"])
def test_the_recorded_decisions_lead_to_the_steps_accepted_path(runs, name):
    """What the engine stored agrees with the step's outcome: the accepted tests are the accepted
    path (Traversal: its last accepted node test ends the walk and accepts its root path)."""
    run = runs[name]
    for trace in run.traces:
        accepted = [d.node for d in trace.decisions if d.accepted and d.kind in ("child", "node", "sample", "argmax")]
        if name == "traversal":
            assert (trace.tree.path_to(accepted[-1]) if accepted else [0]) == trace.accepted_nodes
        else:
            assert accepted == trace.accepted_nodes[1:]
        assert ReplayDecisions(trace.decisions).exhausted == (not any(d.drew for d in trace.decisions))
