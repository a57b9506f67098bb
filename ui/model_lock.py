"""``ModelLock``: the one lock for the models every session of the app shares, taken in turns
(first come, first served) by sessions' chunks and steps, and in idle moments by background work.

A turn ends by releasing the OpenMP worker threads its thread started (``openmp_team``): the threads that take
turns are many (Gradio's handlers, the background measurer, each run's worker), and a process holding more
OpenMP workers than CPUs makes every forward's parallel regions sleep at their barriers (1.3-1.5x slower on 2
cores)."""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

from dyntree_core.openmp_team import release_thread_team


class TurnCancelled(RuntimeError):
    """Background work waiting for an idle turn was told to stop."""


class ModelLock:
    """One lock for the models all sessions share, handed out first come, first served.

    Each prefill chunk and each decoding step takes a ``turn``; a session that has to wait is told
    so (``on_wait``), and ``waiting`` / ``holder`` say who else is there. A plain ``threading.Lock``
    let the thread that had just released it take it again at once, so a long run starved others."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: deque[object] = deque()
        self._held = False
        self._free_since = time.monotonic()
        self.holder = ""  # what the current turn is for (shown to sessions that wait)

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def acquire(self, who: str = "", on_wait: Optional[Callable[[str], None]] = None,
                timeout_s: Optional[float] = None) -> Optional[float]:
        """Wait for this caller's turn (FIFO); returns the seconds waited, or None where ``timeout_s`` passed first
        (the caller then holds nothing and its place in the queue is gone). ``on_wait(holder)`` is called once if the
        lock is busy."""
        t0 = time.perf_counter()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            ticket = object()
            self._queue.append(ticket)
            if self._held or self._queue[0] is not ticket:
                if on_wait is not None:
                    on_wait(self.holder)
                while self._held or self._queue[0] is not ticket:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        self._queue.remove(ticket)
                        self._cond.notify_all()  # (the one behind it may be first now)
                        return None
                    self._cond.wait(left)
            self._queue.popleft()
            self._held = True
            self.holder = who
        return time.perf_counter() - t0

    def release(self) -> None:
        self._release(session=True)

    def _release(self, session: bool) -> None:
        release_thread_team()  # (on the thread that held the turn: the next holder's regions then spin)
        with self._cond:
            if not self._held:
                raise RuntimeError("release of an unheld ModelLock")
            self._held = False
            self.holder = ""
            if session:  # background turns do not restart the idle clock: they follow each other at once
                self._free_since = time.monotonic()
            self._cond.notify_all()

    @contextmanager
    def idle_turn(self, who: str, idle_s: float = 1.0, stop: Optional[threading.Event] = None) -> Iterator[None]:
        """A turn for background work: taken only once no session has held the models, and nobody
        has waited, for ``idle_s`` seconds (a decoding session comes back for its next step within
        milliseconds, so background work never slips in between its steps). Background turns follow
        each other without that wait: only a session's turn restarts the clock. ``stop`` set while
        waiting raises ``TurnCancelled``."""
        with self._cond:
            while True:
                if stop is not None and stop.is_set():
                    raise TurnCancelled(who)
                if not self._held and not self._queue:
                    left = idle_s - (time.monotonic() - self._free_since)
                    if left <= 0:
                        break
                    self._cond.wait(min(left, 0.5))
                else:
                    self._cond.wait(0.5)
            self._held = True
            self.holder = who
        try:
            yield
        finally:
            self._release(session=False)

    @contextmanager
    def turn(self, who: str = "", on_wait: Optional[Callable[[str], None]] = None) -> Iterator[float]:
        """``with lock.turn("session 3: step"):`` holds the models for one chunk or step."""
        waited = self.acquire(who, on_wait)
        try:
            yield waited
        finally:
            self.release()

    def __enter__(self) -> "ModelLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
