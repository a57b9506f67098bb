"""A prefill chunk stopped between two decoder layers, not after the whole chunk.

A Stop during the prefill used to act between chunks: a chunk of ~0.5 s (``engine.PREFILL_CHUNK_SECONDS``; the
first one, which measures the rate, ~0.9 s for the real pair on a 2-core CPU) ran to its end first. The engine
runs each prefill chunk inside ``stops_on(stop_event)``; the CPU forwards call ``check()`` once per layer
(``native_layer`` before each layer's C call, ``lean_forward`` before each layer's cache write), which raises
``Interrupted`` once the event is set, so the chunk ends within one layer. The run ends there (its caches, half
written by the chunk, are dropped with it); outside ``stops_on`` (decoding steps, measurements) ``check()`` never
raises, and the C layers of a forward run in one call (``armed``).

A model load is stopped the same way in its own scope: ``stops_loads_on(event)`` around a load (the app's Run
while it loads its pair, ``auto``'s background measurement), and ``check_load()`` between the tensors a load reads
or builds, which raises ``LoadStopped``. It is a scope of its own so that the forwards a load or a plan times
(probes, profile rows) stay unarmed, as in a decoding step.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from contextvars import ContextVar
from typing import ContextManager, Iterator, Optional

_EVENT: ContextVar[Optional[threading.Event]] = ContextVar("dyntree_prefill_stop", default=None)
_LOAD_EVENT: ContextVar[Optional[threading.Event]] = ContextVar("dyntree_load_stop", default=None)


class Interrupted(Exception):
    """The stop event of the enclosing ``stops_on`` was set while a forward ran."""


class LoadStopped(Exception):
    """The stop event of the enclosing ``stops_loads_on`` was set while models loaded."""


@contextmanager
def _scope(var: ContextVar[Optional[threading.Event]], event: Optional[threading.Event]) -> Iterator[None]:
    token = var.set(event)
    try:
        yield
    finally:
        var.reset(token)


def _raise_if_set(var: ContextVar[Optional[threading.Event]], stopped: type[Exception]) -> None:
    event = var.get()
    if event is not None and event.is_set():
        raise stopped


def stops_on(event: Optional[threading.Event]) -> ContextManager[None]:
    """Forwards run inside this block end at their next layer once ``event`` is set (None: never)."""
    return _scope(_EVENT, event)


def armed() -> bool:
    """Whether forwards here run inside ``stops_on`` with an event (a prefill chunk): they must check each layer."""
    return _EVENT.get() is not None


def check() -> None:
    """Raise ``Interrupted`` when the enclosing ``stops_on`` event is set (called between layers)."""
    _raise_if_set(_EVENT, Interrupted)


def stops_loads_on(event: Optional[threading.Event]) -> ContextManager[None]:
    """Model loads inside this block end at their next ``check_load`` once ``event`` is set (None: never)."""
    return _scope(_LOAD_EVENT, event)


def check_load() -> None:
    """Raise ``LoadStopped`` when the enclosing ``stops_loads_on`` event is set (called between a load's tensors)."""
    _raise_if_set(_LOAD_EVENT, LoadStopped)
