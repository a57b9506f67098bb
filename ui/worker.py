"""Background decoding: a thread advances a ``Generation`` step by step until it is paused,
stopped or finished, while the page pulls snapshots on a timer (so a slow browser never builds
up a backlog of repaints). A lock shared by all sessions of one app serialises steps on the
shared models, so several users take turns step by step instead of clobbering each other."""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from .session import Generation


class DecodeWorker:
    """Runs ``generation.advance()`` on a daemon thread under ``model_lock``."""

    def __init__(self, generation: Generation, model_lock: threading.Lock,
                 on_change: Callable[[], None], on_error: Callable[[BaseException], None],
                 after: Optional[Callable[[], None]] = None) -> None:
        self.generation = generation
        self._lock = model_lock
        self._on_change = on_change
        self._on_error = on_error
        self._after = after
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
                with self._lock:
                    trace = gen.advance()
                self._on_change()
                if trace is None or gen.done:
                    break
                time.sleep(0.001)  # let the web server's threads in between fast steps
            if not gen.done:
                gen.record.status = "paused"
            elif self._after is not None:
                self._after()
        except BaseException as e:  # noqa: BLE001 - reported in the page; the steps so far are kept
            gen.record.message = str(e)
            self._on_error(e)
        finally:
            self._on_change()
