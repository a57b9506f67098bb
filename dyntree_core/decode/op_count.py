"""What a decoding step launches, counted per phase on any device: torch ops, compiled-graph calls
and device -> host reads.

A GPU step's time is dominated by what it launches and how often the host waits, not by FLOPs, and
both are properties of the code that the CPU can count. ``OpCounter`` is a ``TorchDispatchMode``:

* **ops**: every aten op dispatched eagerly, attributed to the step phase that runs it
  (``decode.timer.StepTimer.phase`` reports phase changes here; ops outside a phase count as
  ``"other"``);
* **graphs**: calls of a fixed-shape program (``decode.compiled.GraphFn``): one launch each on CUDA
  (a CUDA-graph replay), whatever it runs inside, so its inner ops are not counted as ``ops``;
* **graph kernels**: what those programs run inside, as the kernels CUDA would launch in them
  (``LaunchCounter``), counted where a program runs its Python code (the CPU's eager and emulated modes;
  a CUDA replay runs none, so there it stays 0). Inside a CUDA graph each kernel still costs a few
  microseconds of GPU time: the H200's 0.5B-shaped draft forward took ~4 ms for ~1,000 of them;
* **flag reads**: ``decode.host.Flags.read`` calls: the host waits for one small copy queued behind
  the programs that made it while the programs launched after them run (a graph step's draft reads
  whether its tree still grows, one level behind the level running);
* **read bytes**: what ``decode.host.fetch`` calls copy to the host (a T > 0 step verified on the host
  reads two ``[B, V]`` probability matrices, ~79 MB at budget 64 with a 152k vocabulary; one verified on
  the device reads ``O(B)`` numbers);
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

from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
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
    graph_kernels: int = 0
    read_bytes: int = 0

    def __add__(self, other: "PhaseOps") -> "PhaseOps":
        return PhaseOps(self.ops + other.ops, self.graphs + other.graphs, self.host_reads + other.host_reads,
                        self.host_ops + other.host_ops, self.flag_reads + other.flag_reads,
                        self.graph_kernels + other.graph_kernels, self.read_bytes + other.read_bytes)

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


def on_fetch(nbytes: int = 0) -> None:
    """A ``host.fetch`` of ``nbytes``: one host read, and the step's data is on the host from here on."""
    if _active is not None:
        _active._conversion()
        _active._at().read_bytes += int(nbytes)
        _active._fetched = True


def on_flag_read() -> None:
    """A ``host.Flags.read``: the host waited for one flag while later programs ran."""
    if _active is not None:
        _active._at().flag_reads += 1


@contextmanager
def graph_call(runs_python: bool = True) -> Iterator[None]:
    """Run a fixed-shape program as one counted graph call: its inner ops are not the step's ``ops``;
    where it runs its Python code (``runs_python``) they are counted as ``graph_kernels``."""
    global _active
    counter = _active
    if counter is None:
        yield
        return
    at = counter._at()
    at.graphs += 1
    with _disable_current_modes():
        _active = None  # conversions inside the graph are not the step's
        try:
            if runs_python:
                with LaunchCounter() as inner:
                    yield
                at.graph_kernels += inner.kernels
            else:
                yield
        finally:
            _active = counter


# ------------------------------------------------------------------ kernels a program launches on CUDA
def _cuda_runs_math_sdpa(args, kwargs) -> bool:
    """Whether CUDA's SDPA takes its unfused math path for this call: a mask together with grouped KV heads
    (flash attention takes no mask, memory-efficient attention no ``enable_gqa``; transformers'
    ``use_gqa_in_sdpa`` states the same rule), or a head dim over 256."""
    q = args[0]
    k = args[1] if len(args) > 1 else kwargs.get("key")
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    gqa = bool(kwargs.get("enable_gqa", False)) and q.shape[-3] != k.shape[-3]
    return (mask is not None and gqa) or q.shape[-1] > 256


class LaunchCounter:
    """The kernels a block of torch code launches on CUDA, counted on any device (the CPU included).

    Every aten op that makes or writes data counts one (views and ``_NO_KERNEL``, which launch nothing, are
    left out), with two corrections where CUDA's kernels differ from what the CPU dispatches:

    * ``F.rms_norm`` is one fused kernel on CUDA (torch >= 2.8) where the CPU runs its 8-op decomposition;
    * ``F.scaled_dot_product_attention`` is one kernel (flash or memory-efficient attention) unless CUDA would
      run its math path (``_cuda_runs_math_sdpa``), where it counts the ops of that path (torch's
      ``_scaled_dot_product_attention_math``, run once more for the count; the CPU has one fused kernel for
      both).

    ``kernels`` is the total, ``by_op`` per aten op (``"rms_norm"``, ``"sdpa"``, ``"sdpa_math"`` for the
    corrected calls), ``math_sdpa`` the calls CUDA would run unfused.

        with LaunchCounter() as launches:
            forward(...)
        launches.kernels
    """

    def __init__(self) -> None:
        self.by_op: Counter = Counter()
        self.math_sdpa = 0
        self._paused = 0
        self._modes: list = []

    @property
    def kernels(self) -> int:
        return sum(self.by_op.values())

    def _count(self, name: str, n: int = 1) -> None:
        if not self._paused:
            self.by_op[name] += n

    def __enter__(self) -> "LaunchCounter":
        self._modes = [_KernelDispatch(self), _FusedCalls(self)]
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)
        self._modes = []


#: aten ops that launch no device kernel: a view of a fresh tensor, and the CPU scalar a Python number is
#: wrapped in (``torch.where(c, x, 0.0)``: the kernel takes it as an argument)
_NO_KERNEL = frozenset(("_unsafe_view", "scalar_tensor"))


class _KernelDispatch(TorchDispatchMode):
    def __init__(self, owner: LaunchCounter) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if not (func.is_view or name in _NO_KERNEL):
            self.owner._count(name)
        return func(*args, **(kwargs or {}))


class _FusedCalls(TorchFunctionMode):
    def __init__(self, owner: LaunchCounter) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = self.owner
        if func in (F.rms_norm, torch.rms_norm):
            owner._count("rms_norm")
            return self._uncounted(func, args, kwargs)
        if func is F.scaled_dot_product_attention:
            if _cuda_runs_math_sdpa(args, kwargs) and not owner._paused:
                owner.math_sdpa += 1
                owner._count("sdpa_math", self._math_sdpa_kernels(*args, **kwargs))
            else:
                owner._count("sdpa")
            return self._uncounted(func, args, kwargs)
        return func(*args, **kwargs)

    def _uncounted(self, func, args, kwargs):
        self.owner._paused += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.owner._paused -= 1

    def _math_sdpa_kernels(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                           enable_gqa=False) -> int:
        owner = self.owner
        saved, owner.by_op = owner.by_op, Counter()
        try:
            torch.ops.aten._scaled_dot_product_attention_math(query, key, value, attn_mask, dropout_p, is_causal,
                                                               None, scale=scale, enable_gqa=enable_gqa)
            return owner.kernels
        finally:
            owner.by_op = saved
