"""The app's log of where a Run's time goes before its first token: the click, each long part of the load (the
lines the status shows: measuring the kernels, building the packed weights), ``auto``'s background measurement,
the models ready and the first step, each with the seconds since the click. A first Run that is slow says which
part was slow (``python app.py`` writes it to stderr beside Gradio's own lines)."""

from __future__ import annotations

import logging
import sys
import time
from typing import Optional

log = logging.getLogger("dyntree.app")


def configure() -> None:
    """Send ``dyntree.app``'s lines to stderr with their wall-clock time (once per process: ``app.main`` may run more
    than once in one)."""
    if any(getattr(h, "_dyntree_app_log", False) for h in log.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s.%(msecs)03d dyntree: %(message)s", "%H:%M:%S"))
    handler._dyntree_app_log = True
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


class RunClock:
    """The seconds since one Run's click, shared by the lines of its load (``phase``) and its first step."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.clicked_at = time.monotonic()
        self.first_step_s: Optional[float] = None
        self._last_line = ""
        log.info("%s: Run clicked", who)

    def seconds(self) -> float:
        return time.monotonic() - self.clicked_at

    def phase(self, line: str) -> None:
        """One line of the load as it starts (a line equal to the previous one is not repeated)."""
        line = line.strip()
        if line and line != self._last_line:
            self._last_line = line
            log.info("%s: %5.1f s after the click: %s", self.who, self.seconds(), line)

    def first_step(self, tokens: int) -> None:
        """The run's first decoding step has come (logged once)."""
        if self.first_step_s is None:
            self.first_step_s = self.seconds()
            log.info("%s: first step (%d token%s) %.1f s after the click", self.who, tokens,
                     "" if tokens == 1 else "s", self.first_step_s)


def background_line(line: str) -> None:
    """A line of ``auto``'s background measurement (it runs beside the Runs, in their idle moments)."""
    if line.strip():
        log.info("auto's background measurement: %s", line.strip())
