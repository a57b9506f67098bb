"""Fixed-shape programs compiled once per shape: ``GraphFn``.

A ``GraphFn`` wraps a function of tensors whose shapes are fixed per size bucket and whose work never
reads the device (``decode.dense_forward``, the drafting levels, verification and commit of
``decode.graph_step``). How it runs is a ``CompileMode``:

* on CUDA, by default, one ``torch.cuda.CUDAGraph`` per input-shape signature: the first call runs
  eagerly (on a side stream: the call's real work, and the warm-up) and then captures the program into
  a graph that later calls replay — no compiler, so a bucket costs one eager call and one capture
  (milliseconds), not inductor's tens of seconds per 28-layer forward. Tensor arguments are copied into
  the graph's own input buffers before each replay; the state a program mutates must sit at static
  addresses (``GraphStepper``'s buffers, the models' weights and ``StaticKV``), which it does.
  ``DYNTREE_COMPILE=inductor`` instead compiles with ``torch.compile(fullgraph=True, dynamic=False,
  mode="reduce-overhead")`` (inductor's fused kernels inside CUDA graphs; its cache lives under the
  DynTree cache, so a second start reuses it); ``CompileMode.graphs(device, fuse=names)`` compiles the named
  programs by inductor (without its own CUDA graphs) and captures its fused kernels into this module's graphs:
  ``fuse=DRAFT_PROGRAMS`` is ``bench gpu``'s ``graph_inductor_draft`` row (the draft's ~400 kernels a level);
* on the CPU it runs eagerly by default — the same code, without graph capture to gain from;
  ``DYNTREE_COMPILE=graphs`` runs the capture's bookkeeping with an eager replay (``capture="emulated"``:
  what CPU tests use to check that replays take their arguments through the static inputs);
* ``CompileMode.check()`` compiles with ``fullgraph=True`` through dynamo's ``eager`` backend: it
  proves on the CPU that a program traces whole (no graph break, no host read inside) and lets tests
  count recompiles (``torch._dynamo`` counters) without inductor's minutes of C++ compilation.

Each program gets its own code object, so dynamo's per-function cache (and its recompile limit)
holds only that program's buckets. ``decode.op_count`` counts a call as one graph, whatever runs in it, and
where the program runs its Python code (eager, emulated capture) the kernels CUDA would launch inside it.
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


#: ``DYNTREE_COMPILE`` values
CHOICES = ("graphs", "inductor", "eager", "check")


@dataclass(frozen=True)
class CompileMode:
    """How ``GraphFn`` runs: ``backend`` None and ``capture`` None = eager; ``backend``:
    ``torch.compile``'s backend and ``mode``; ``capture``: ``"cuda"`` (a ``torch.cuda.CUDAGraph`` per
    shape) or ``"emulated"`` (the same bookkeeping, replayed eagerly: CPU tests)."""

    backend: Optional[str] = None
    mode: Optional[str] = None
    capture: Optional[str] = None
    #: programs (by name) compiled by ``fuse_backend`` before their capture: inductor's fused kernels replayed
    #: inside this module's graphs (``capture`` modes only)
    fuse: tuple[str, ...] = ()
    fuse_backend: str = "inductor"

    @classmethod
    def for_device(cls, device: torch.device) -> "CompileMode":
        """CUDA: captured CUDA graphs (``DYNTREE_COMPILE=inductor|eager|check`` overrides); CPU: eager
        (``DYNTREE_COMPILE=check|inductor|graphs`` overrides)."""
        choice = os.environ.get("DYNTREE_COMPILE", "graphs" if device.type == "cuda" else "eager")
        if choice not in CHOICES:
            raise ValueError(f"DYNTREE_COMPILE must be one of {', '.join(CHOICES)}, got {choice!r}")
        if choice == "check":
            return cls.check()
        if choice == "inductor":
            return cls.inductor(device)
        if choice == "graphs":
            return cls.graphs(device)
        return cls()

    @classmethod
    def check(cls) -> "CompileMode":
        return cls("eager", None)

    @classmethod
    def inductor(cls, device: torch.device) -> "CompileMode":
        return cls("inductor", "reduce-overhead" if device.type == "cuda" else None)

    @classmethod
    def graphs(cls, device: torch.device, fuse: tuple[str, ...] = (), fuse_backend: str = "inductor") -> "CompileMode":
        """Captured graphs (CUDA; emulated on the CPU); the programs named in ``fuse`` compiled by
        ``fuse_backend`` first (their kernels are what the graph replays)."""
        return cls(capture="cuda" if device.type == "cuda" else "emulated", fuse=tuple(fuse), fuse_backend=fuse_backend)

    @property
    def compiles(self) -> bool:
        """Whether a new shape costs more than a call (a compilation or a capture)."""
        return self.backend is not None or self.capture is not None

    @property
    def label(self) -> str:
        if self.capture is not None:
            fused = f", {self.fuse_backend} kernels in {', '.join(self.fuse)}" if self.fuse else ""
            return f"graphs ({self.capture}{fused})"
        if self.backend is None:
            return "eager"
        return self.backend + (f" ({self.mode})" if self.mode else "")


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
        pool: ``capture="cuda"``: the memory pool the graphs share (``torch.cuda.graph_pool_handle()``;
            the programs of one owner run one after another, so their intermediates may share it).
        device: ``capture="cuda"``: the device the program runs on (its first call warms up on a side
            stream of it).
    """

    def __init__(self, fn: Callable, name: str, mode: CompileMode,
                 on_compile: Optional[Callable[[CompileEvent], None]] = None, pool=None,
                 device: Optional[torch.device] = None):
        self.name = name
        self.mode = mode
        self.on_compile = on_compile
        self.events: list[CompileEvent] = []
        self._seen: set[tuple] = set()
        self._fn = fn
        self._pool = pool
        self._device = device
        self._graphs: dict[tuple, _Graph] = {}
        backend = mode.backend or (mode.fuse_backend if mode.capture is not None and name in mode.fuse else None)
        if backend is not None:
            _persistent_cache()
            self._run = torch.compile(_own_code(fn, name), fullgraph=True, dynamic=False, backend=backend,
                                      mode=mode.mode)
        else:
            self._run = fn

    @property
    def graphs(self) -> int:
        """Graphs captured and held (``capture`` modes)."""
        return len(self._graphs)

    def release(self) -> None:
        """Frees the captured graphs (and with them their share of the pool); a later call captures anew."""
        for g in self._graphs.values():
            g.release()
        self._seen -= self._graphs.keys()  # (a compiled mode's shapes stay: dynamo keeps their code)
        self._graphs.clear()

    def __call__(self, *args):
        key = _signature(args) if self.mode.compiles else None
        runs_python = self._run is self._fn and self.mode.capture != "cuda"  # what op_count can see inside
        if key is not None and key not in self._seen:
            t0 = time.perf_counter()
            with op_count.graph_call(runs_python):
                if self.mode.capture is not None:  # (a fused program compiles in its warm-up call)
                    out = _warm(self._run, args, self._device if self.mode.capture == "cuda" else None)
                    self._graphs[key] = _Graph.capture(self._run, args, self.mode.capture, self._pool)
                else:
                    out = self._run(*args)
            event = CompileEvent(self.name, key, time.perf_counter() - t0)
            self._seen.add(key)
            self.events.append(event)
            log.info("compiled %s for %s in %.3f s (%s)", self.name, key, event.seconds, self.mode.label)
            if self.on_compile is not None:
                self.on_compile(event)
            return out
        with op_count.graph_call(runs_python):
            if key is not None and self.mode.capture is not None:
                return self._graphs[key].replay(args)
            return self._run(*args)


class _Graph:
    """One captured program: its own copies of the tensor arguments, the graph, its output tensors."""

    def __init__(self, fn: Callable, inputs: list, graph, outputs):
        self.fn, self.inputs, self.graph, self.outputs = fn, inputs, graph, outputs

    @classmethod
    def capture(cls, fn: Callable, args: tuple, kind: str, pool) -> "_Graph":
        inputs = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        if kind == "emulated":
            return cls(fn, inputs, None, None)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            outputs = fn(*inputs)
        return cls(fn, inputs, graph, outputs)

    def replay(self, args: tuple):
        for mine, a in zip(self.inputs, args):
            if isinstance(a, torch.Tensor):
                mine.copy_(a)
        if self.graph is not None:
            self.graph.replay()
            return self.outputs
        out = self.fn(*self.inputs)  # emulated: the outputs stay the same tensors, as a graph's do
        if self.outputs is None:
            self.outputs = out
        else:
            for mine, new in zip(_tensors(self.outputs), _tensors(out)):
                mine.copy_(new)
        return self.outputs

    def release(self) -> None:
        if self.graph is not None:
            self.graph.reset()
        self.graph = self.outputs = None
        self.inputs = []


def _tensors(out) -> list[torch.Tensor]:
    if out is None:
        return []
    return [out] if isinstance(out, torch.Tensor) else list(out)


def _warm(fn: Callable, args: tuple, dev: Optional[torch.device]):
    """``fn(*args)`` eagerly; on a CUDA ``dev`` on a side stream (what capture needs before it: cuBLAS
    and the allocator warmed outside the graph), joined back to the current stream."""
    if dev is None:
        return fn(*args)
    main = torch.cuda.current_stream(dev)
    side = torch.cuda.Stream(dev)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        out = fn(*args)
    main.wait_stream(side)
    return out


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
