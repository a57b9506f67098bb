"""What a decoding step launches, counted per phase on any device: torch ops, compiled-graph calls
and device -> host reads.

A GPU step's time is dominated by what it launches and how often the host waits, not by FLOPs, and
both are properties of the code that the CPU can count. ``OpCounter`` is a ``TorchDispatchMode``:

* **ops**: every aten op dispatched eagerly, attributed to the step phase that runs it
  (``decode.timer.StepTimer.phase`` reports phase changes here; ops outside a phase count as
  ``"other"``);
* **graphs**: calls of a fixed-shape program (``decode.compiled.GraphFn``): one launch each on CUDA
  (a CUDA-graph replay), whatever it runs inside, so its inner ops are not counted;
* **flag reads**: ``decode.host.Flags.read`` calls: the host waits for one small copy queued behind
  the programs that made it while the programs launched after them run (a graph step's draft reads
  whether its tree still grows, one level behind the level running);
* **host reads**: ``decode.host.fetch`` calls (one wait each), aten ops that make the host wait
  (``SYNC_OPS``: a scalar read, an output size known only on the device) and Tensor -> Python
  conversions (``tolist``, ``numpy``). They are counted from a step's start until its first
  ``fetch``: after the fetch a device-side step works on host copies. A step with no fetch (the
  host-side paths) counts every conversion, an upper bound of its device reads.

Ops after a step's ``fetch`` are counted apart (``host_ops``): on a GPU they run on host tensors.

    with OpCounter() as counter:
        for trace in decoder.generate(prompt, 16):
            per_phase = counter.take_step()   # {phase: PhaseOps}
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

#: aten ops that make a CUDA host wait (a scalar read, or an output size known only on the device)
SYNC_OPS = frozenset(("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2",
                      "unique_consecutive", "repeat_interleave", "_assert_async", "equal", "is_nonzero"))
OTHER = "other"
_active: Optional["OpCounter"] = None


@dataclass
class PhaseOps:
    """One phase's count over a step (or summed over steps)."""

    ops: int = 0
    graphs: int = 0
    host_reads: int = 0
    host_ops: int = 0
    flag_reads: int = 0

    def __add__(self, other: "PhaseOps") -> "PhaseOps":
        return PhaseOps(self.ops + other.ops, self.graphs + other.graphs, self.host_reads + other.host_reads,
                        self.host_ops + other.host_ops, self.flag_reads + other.flag_reads)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def total(counts: dict[str, PhaseOps], phases: Optional[tuple[str, ...]] = None) -> PhaseOps:
    """The sum over ``phases`` (default: all) of a ``take_step`` result."""
    out = PhaseOps()
    for name, c in counts.items():
        if phases is None or name in phases:
            out = out + c
    return out


class OpCounter(TorchDispatchMode):
    """Counts per phase (see the module docstring). One counter is active at a time."""

    def __init__(self) -> None:
        super().__init__()
        self._phase = OTHER
        self._step: dict[str, PhaseOps] = {}
        self._fetched = False
        self._patched: list[tuple[str, object]] = []

    # ------------------------------------------------------------------ results
    def take_step(self) -> dict[str, PhaseOps]:
        """The counts since the last call (one decoding step when called per yielded trace)."""
        out, self._step, self._fetched = self._step, {}, False
        return out

    # ------------------------------------------------------------------ recording
    def _at(self, phase: Optional[str] = None) -> PhaseOps:
        return self._step.setdefault(phase or self._phase, PhaseOps())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        c = self._at()
        if self._fetched:
            c.host_ops += 1
        else:
            c.ops += 1
            if name in SYNC_OPS or (name == "_to_copy" and _to_host(args, kwargs)):
                c.host_reads += 1
        return func(*args, **(kwargs or {}))

    def _conversion(self) -> None:
        if not self._fetched:
            self._at().host_reads += 1

    def __enter__(self) -> "OpCounter":
        global _active
        if _active is not None:
            raise RuntimeError("an OpCounter is already active")
        _active = self
        for name in ("tolist", "numpy"):
            real = getattr(torch.Tensor, name)
            self._patched.append((name, real))

            def spy(tensor, *a, _real=real, **k):
                if _active is not None:
                    _active._conversion()
                return _real(tensor, *a, **k)

            setattr(torch.Tensor, name, spy)
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        global _active
        try:
            super().__exit__(*exc)
        finally:
            for name, real in self._patched:
                setattr(torch.Tensor, name, real)
            self._patched.clear()
            _active = None


def _to_host(args, kwargs) -> bool:
    src = args[0] if args else None
    dev = (kwargs or {}).get("device")
    return isinstance(src, torch.Tensor) and src.device.type != "cpu" and dev is not None and torch.device(dev).type == "cpu"


# ------------------------------------------------------------------ hooks (no-ops without a counter)
def enter_phase(name: str) -> Optional[str]:
    """The step entered ``name``; returns the phase to restore on exit (None: no counter)."""
    if _active is None:
        return None
    previous, _active._phase = _active._phase, name
    return previous


def exit_phase(previous: Optional[str]) -> None:
    if _active is not None and previous is not None:
        _active._phase = previous


def on_fetch() -> None:
    """A ``host.fetch``: one host read, and the step's data is on the host from here on."""
    if _active is not None:
        _active._conversion()
        _active._fetched = True


def on_flag_read() -> None:
    """A ``host.Flags.read``: the host waited for one flag while later programs ran."""
    if _active is not None:
        _active._at().flag_reads += 1


@contextmanager
def graph_call() -> Iterator[None]:
    """Run a fixed-shape program as one counted graph call (its inner ops are not counted)."""
    global _active
    counter = _active
    if counter is None:
        yield
        return
    counter._at().graphs += 1
    with _disable_current_modes():
        _active = None  # conversions inside the graph are not the step's
        try:
            yield
        finally:
            _active = counter
