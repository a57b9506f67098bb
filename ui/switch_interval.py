"""The app's decoding thread and its page's handlers share one interpreter lock: how long a handler keeps it
before the decoding thread gets it back.

A decoding step releases the lock in every torch op and needs it back between two (a forward: hundreds of
times). While a handler runs Python (a redraw builds its plotly figures: ~70 ms of CPU; Gradio's event loop
encodes and sends them), the waiting thread gets the lock only when the holder is asked to drop it, after the
interpreter's switch interval (5 ms by default): a step that overlaps a redraw then stalls for about as long
as the redraw runs, and longer where the OpenMP threads also lose their cores. In the page on the 2-core Zen 4 VM,
a 137 ms refresh that drew the figures made the step it overlapped 771 ms instead of ~190
(``scripts/switch_interval_ab.py`` measures the effect headless: a decoding thread beside a thread that runs
Python for 100 ms of every 500).

The app asks for a 0.5 ms interval (``DYNTREE_UI_SWITCH_INTERVAL`` overrides it, in seconds): the decoding
thread then waits at most that long per op for the lock; the handlers' work takes a little longer in wall time.
"""

from __future__ import annotations

import os
import sys

#: seconds a thread holding the interpreter lock runs before a waiting thread is let in (Python's default: 0.005)
DECODE_SWITCH_INTERVAL_S = 0.0005
ENV = "DYNTREE_UI_SWITCH_INTERVAL"


def favour_decoding() -> float:
    """Set the process's switch interval for an app whose handlers run beside a decoding thread; returns the
    interval set (``DECODE_SWITCH_INTERVAL_S``, or ``$DYNTREE_UI_SWITCH_INTERVAL`` when set)."""
    raw = os.environ.get(ENV, "")
    try:
        interval = float(raw) if raw else DECODE_SWITCH_INTERVAL_S
    except ValueError:
        raise SystemExit(f"error: {ENV} must be seconds (e.g. 0.0005), got {raw!r}") from None
    if not 1e-6 <= interval <= 1.0:
        raise SystemExit(f"error: {ENV} must be between 1e-06 and 1 second, got {raw!r}")
    sys.setswitchinterval(interval)
    return sys.getswitchinterval()
