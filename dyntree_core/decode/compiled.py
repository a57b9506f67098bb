"""Fixed-shape programs compiled once per shape: ``GraphFn``.

A ``GraphFn`` wraps a function of tensors whose shapes are fixed per size bucket and whose work never
reads the device (``decode.dense_forward``, the drafting levels, verification and commit of
``decode.graph_step``). How it runs is a ``CompileMode``:

* on CUDA, ``torch.compile(fullgraph=True, dynamic=False, mode="reduce-overhead")``: one CUDA graph
  replayed per call, compiled on the first call of each bucket (reported through ``on_compile``;
  inductor's cache lives under the DynTree cache, so a second start reuses it);
* on the CPU it runs eagerly by default — the same code, without graph capture to gain from;
* ``CompileMode.check()`` compiles with ``fullgraph=True`` through dynamo's ``eager`` backend: it
  proves on the CPU that a program traces whole (no graph break, no host read inside) and lets tests
  count recompiles (``torch._dynamo`` counters) without inductor's minutes of C++ compilation.

Each program gets its own code object, so dynamo's per-function cache (and its recompile limit)
holds only that program's buckets. ``decode.op_count`` counts a call as one graph, whatever runs in it.
"""

from __future__ import annotations

import logging
import os
import time
import types
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import op_count

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompileMode:
    """How ``GraphFn`` runs: ``backend`` None = eager; else ``torch.compile``'s backend and mode."""

    backend: Optional[str] = None
    mode: Optional[str] = None

    @classmethod
    def for_device(cls, device: torch.device) -> "CompileMode":
        """CUDA: inductor with CUDA graphs; CPU: eager (``DYNTREE_COMPILE=check|inductor`` overrides)."""
        if device.type == "cuda":
            return cls("inductor", "reduce-overhead")
        choice = os.environ.get("DYNTREE_COMPILE", "eager")
        if choice == "check":
            return cls.check()
        if choice == "inductor":
            return cls("inductor", None)
        if choice != "eager":
            raise ValueError(f"DYNTREE_COMPILE must be eager, check or inductor, got {choice!r}")
        return cls()

    @classmethod
    def check(cls) -> "CompileMode":
        return cls("eager", None)

    @property
    def compiles(self) -> bool:
        return self.backend is not None


@dataclass(frozen=True)
class CompileEvent:
    """One program compiled for one bucket."""

    program: str
    shapes: tuple
    seconds: float


class GraphFn:
    """``fn`` as a fixed-shape program (see the module docstring).

    Args:
        fn: a function of tensors (and constants) returning tensors.
        name: the program's name (logs, compile events, dynamo's cache).
        mode: how it runs.
        on_compile: called after each first call of a new input-shape signature.
    """

    def __init__(self, fn: Callable, name: str, mode: CompileMode,
                 on_compile: Optional[Callable[[CompileEvent], None]] = None):
        self.name = name
        self.mode = mode
        self.on_compile = on_compile
        self.events: list[CompileEvent] = []
        self._seen: set[tuple] = set()
        if mode.compiles:
            _persistent_cache()
            self._run = torch.compile(_own_code(fn, name), fullgraph=True, dynamic=False, backend=mode.backend,
                                      mode=mode.mode)
        else:
            self._run = fn

    def __call__(self, *args):
        key = _signature(args) if self.mode.compiles else None
        if key is not None and key not in self._seen:
            t0 = time.perf_counter()
            with op_count.graph_call():
                out = self._run(*args)
            event = CompileEvent(self.name, key, time.perf_counter() - t0)
            self._seen.add(key)
            self.events.append(event)
            log.info("compiled %s for %s in %.1f s", self.name, key, event.seconds)
            if self.on_compile is not None:
                self.on_compile(event)
            return out
        with op_count.graph_call():
            return self._run(*args)


def _signature(args) -> tuple:
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)


def _own_code(fn: Callable, name: str) -> Callable:
    """A wrapper of ``fn`` with a code object of its own (dynamo caches compiled graphs per code object)."""
    def program(*args):
        return fn(*args)

    code = program.__code__.replace(co_name=f"graph_{name}")
    return types.FunctionType(code, program.__globals__, f"graph_{name}", None, program.__closure__)


def _persistent_cache() -> None:
    """inductor's compiled-code cache under the DynTree cache (not /tmp), unless the user set one."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        from ..paths import cache_root

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root() / "inductor")
