"""A long load's progress line and its stop points.

A packed load copies ~1 GB per model into memory: 2-4 s from the page cache, 40 s once seen where the disk had to
give it, and it said nothing meanwhile. ``LoadProgress`` is told each tensor as it is done: it checks whether the load
was stopped (``interrupt.check_load``: a Stop or a closed tab during a Run's load, the app shutting down) and, at most
once per ``EVERY_S``, says how far the load is and how much of it the disk gave (``/proc/self/io``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from .. import interrupt
from ..system_counters import read_counters

#: the first line after this long, then at most one per this interval (seconds)
EVERY_S = 1.0


def _read_bytes() -> Optional[int]:
    return read_counters().read_bytes


def _now() -> float:
    return time.monotonic()


@dataclass
class LoadProgress:
    """``advance(nbytes)`` after each tensor of a load of ``total_bytes``; ``say`` hears a line now and then, e.g.
    ``reading the packed weights: 0.46 of 1.03 GB (45%; 0.30 GB from the disk; 2.1 s)``."""

    say: Callable[[str], None]
    what: str
    total_bytes: int
    every_s: Optional[float] = None  # (None: ``EVERY_S``)
    done_bytes: int = 0
    _t0: float = field(init=False)
    _last: float = field(init=False)
    _read0: Optional[int] = field(init=False)

    def __post_init__(self) -> None:
        interrupt.check_load()  # (a load stopped before it began)
        self.every_s = EVERY_S if self.every_s is None else self.every_s
        self._t0 = self._last = _now()
        self._read0 = _read_bytes()

    def advance(self, nbytes: int) -> None:
        """``nbytes`` more are done; raises ``interrupt.LoadStopped`` if the load was stopped meanwhile."""
        self.done_bytes += int(nbytes)
        interrupt.check_load()
        now = _now()
        if now - self._last >= self.every_s:
            self._last = now
            self.say(self.line(now))

    def line(self, now: Optional[float] = None) -> str:
        now = _now() if now is None else now
        share = self.done_bytes / self.total_bytes if self.total_bytes else 1.0
        read = _read_bytes()
        disk = "" if read is None or self._read0 is None else f"; {(read - self._read0) / 1e9:.2f} GB from the disk"
        return (f"  {self.what}: {self.done_bytes / 1e9:.2f} of {self.total_bytes / 1e9:.2f} GB ({share:.0%}{disk}; "
                f"{now - self._t0:.1f} s)")
