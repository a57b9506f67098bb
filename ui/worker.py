"""Background decoding: a thread advances a ``Generation`` one prefill chunk or one step at a time
until it is paused, stopped or finished, while the page pulls snapshots on a timer (so a slow
browser never builds up a backlog of repaints). Every chunk and step takes its own turn on the
``ModelLock`` all sessions of one app share, so several users take turns instead of one long
prefill locking the others out; while it waits, the run's record says for whom."""

from __future__ import annotations

import threading
from typing import Callable, Optional

from dyntree_core.trace import StepTrace

from .app_log import RunClock
from .model_lock import ModelLock
from .session import Generation


class DecodeWorker:
    """Runs ``generation.advance()`` on a daemon thread, one ``model_lock`` turn per item."""

    def __init__(self, generation: Generation, model_lock: ModelLock,
                 on_change: Callable[[], None], on_error: Callable[[BaseException], None],
                 after: Optional[Callable[[], None]] = None, who: str = "",
                 clock: Optional[RunClock] = None) -> None:
        self.generation = generation
        self._lock = model_lock
        self._on_change = on_change
        self._on_error = on_error
        self._after = after
        self._who = who
        self._clock = clock  # told of the first step (the app log)
        self._pause = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dyntree-decode", daemon=True)

    def start(self) -> "DecodeWorker":
        self.generation.record.status = "running"
        self._on_change()
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def request_pause(self) -> None:
        self._pause.set()

    @property
    def pause_requested(self) -> bool:
        return self._pause.is_set()

    def join(self, timeout: Optional[float] = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        gen = self.generation
        try:
            while not self._pause.is_set():
                item = advance_in_turn(gen, self._lock, self._who, self._on_change, unless=self._pause.is_set)
                self._on_change()
                if self._clock is not None and isinstance(item, StepTrace):
                    self._clock.first_step(len(item.committed))
                if item is None or item is NOT_RUN or gen.done:
                    break
            if not gen.done:
                gen.record.status = "paused"
            elif self._after is not None:
                self._after()
        except BaseException as e:  # noqa: BLE001 - reported in the page; the steps so far are kept
            gen.record.message = str(e)
            self._on_error(e)
        finally:
            self._on_change()


#: ``advance_in_turn``'s answer when ``unless`` said no once the turn came
NOT_RUN = object()


def advance_in_turn(gen: Generation, lock: ModelLock, who: str, on_change: Callable[[], None] = lambda: None,
                    unless: Callable[[], bool] = lambda: False):
    """``gen.advance()`` in one turn of ``lock``; while another session holds it the record's
    ``waiting`` names that session, and the time waited adds to ``wait_seconds``. ``unless()`` is
    asked again once the turn has come (a Pause clicked while waiting): True returns ``NOT_RUN``."""
    rec = gen.record

    def waiting(holder: str) -> None:
        rec.waiting = holder or "another session"
        on_change()

    with lock.turn(who, waiting) as waited:
        rec.waiting = ""
        rec.wait_seconds += waited
        return NOT_RUN if unless() else gen.advance()
