"""Per-phase step timing: ``with timer.phase("draft"): ...`` (SpecExec ``spec_base.py`` style).

On a CUDA device each phase records a pair of CUDA events and nothing is synchronised inside the
step: the durations are read by ``timings()`` after the step's one synchronisation, so timing
does not add host syncs. On the CPU the phases are wall-clock ``perf_counter`` intervals.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch

from ..trace import PHASES, PhaseTimings
from . import op_count


class StepTimer:
    """Seconds per phase of one step (``trace.PHASES`` names); a phase entered twice adds up."""

    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        self._host: dict[str, float] = {}
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._splits: list[tuple[str, str, float]] = []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; phases: {PHASES}")
        counted = op_count.enter_phase(name)
        try:
            with self._timed(name):
                yield
        finally:
            op_count.exit_phase(counted)

    @contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        if self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events.append((name, start, end))
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        """Host-measured seconds for ``name`` (e.g. the offload engine's transfer wait)."""
        self._host[name] = self._host.get(name, 0.0) + float(seconds)

    def split(self, name: str, rest: str, seconds: float) -> None:
        """Phase ``name`` keeps ``seconds`` of its time, the remainder is reported as ``rest``
        (the draft phase keeps the draft model's forwards, the rest is tree construction)."""
        self._splits.append((name, rest, float(seconds)))

    def timings(self) -> PhaseTimings:
        """The phases' seconds; on CUDA call it after the step's synchronisation (the events are
        complete then, so reading them does not wait)."""
        out = dict(self._host)
        for name, start, end in self._events:
            out[name] = out.get(name, 0.0) + start.elapsed_time(end) / 1000.0
        for name, rest, seconds in self._splits:
            total = out.get(name, 0.0)
            out[name] = min(seconds, total)
            out[rest] = out.get(rest, 0.0) + max(0.0, total - seconds)
        return PhaseTimings(**out)
