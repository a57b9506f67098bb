"""Transfer accounting for streamed layers, read lazily (no synchronize per layer)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .backend import Backend, Event


@dataclass(frozen=True)
class TransferStats:
    """Totals since the last ``reset_stats()``.

    Attributes:
        bytes: bytes copied host->device for the streamed layer executions (each streamed layer
            execution copies its whole packed layer once; prefetches are counted when consumed).
        copy_seconds: device time the copies took (copy-stream events: start -> done).
        wait_seconds: time the compute stream stood still waiting for copies (compute-stream
            "ready" event -> copy "done" event, when positive). On the host backend nothing
            overlaps, so it equals ``copy_seconds``.
        forwards: completed forwards of the decoder stack.
        layers: streamed layer executions.
    """

    bytes: int = 0
    copy_seconds: float = 0.0
    wait_seconds: float = 0.0
    forwards: int = 0
    layers: int = 0

    @property
    def gbps(self) -> float:
        """Copy bandwidth in GB/s (1e9 bytes) while copies ran (nan when nothing was copied)."""
        return self.bytes / self.copy_seconds / 1e9 if self.copy_seconds > 0 else float("nan")


@dataclass
class _Record:
    nbytes: int
    start: Event
    done: Event
    ready: Optional[Event]


@dataclass
class StatsAccumulator:
    """Collects per-layer event triples; resolves them when their events have completed."""

    backend: Backend
    serial: bool = False  # copies run on the compute stream (baselines): the wait is the whole copy
    bytes: int = 0
    copy_seconds: float = 0.0
    wait_seconds: float = 0.0
    forwards: int = 0
    layers: int = 0
    _pending: list[_Record] = field(default_factory=list)

    def add(self, nbytes: int, start: Event, done: Event, ready: Optional[Event]) -> None:
        """One consumed streamed layer (its bytes count now, its times once the events finish)."""
        self.bytes += nbytes
        self.layers += 1
        self._pending.append(_Record(nbytes, start, done, ready))

    def poll(self) -> None:
        """Resolve the records whose events already completed (non-blocking)."""
        keep: list[_Record] = []
        for r in self._pending:
            if self.backend.done(r.done) and (r.ready is None or self.backend.done(r.ready)):
                self._resolve(r)
            else:
                keep.append(r)
        self._pending = keep

    def _resolve(self, r: _Record) -> None:
        c = max(0.0, self.backend.elapsed(r.start, r.done))
        self.copy_seconds += c
        if self.serial or not self.backend.overlaps:
            self.wait_seconds += c
        elif r.ready is not None:
            self.wait_seconds += max(0.0, self.backend.elapsed(r.ready, r.done))

    def snapshot(self) -> TransferStats:
        """All totals; blocks until the pending copies' events have completed."""
        for r in self._pending:
            self._resolve(r)
        self._pending = []
        return TransferStats(self.bytes, self.copy_seconds, self.wait_seconds, self.forwards, self.layers)

    def reset(self) -> None:
        self.snapshot()
        self.bytes, self.copy_seconds, self.wait_seconds, self.forwards, self.layers = 0, 0.0, 0.0, 0, 0
