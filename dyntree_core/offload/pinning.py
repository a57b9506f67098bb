"""Page-locked host memory with an owner: every ``cudaHostRegister`` has exactly one release.

A ``HostBuffer`` owns its registration: ``close()`` (idempotent) unregisters it, and a finalizer
does the same if the buffer is dropped unclosed. The finalizer holds the tensor until the range is
unregistered, so page-locked memory can never go back to the allocator while still registered —
that is what failed on an H200 when a second offload in one process got an address range the
first had left registered (``cudaErrorHostMemoryAlreadyRegistered (712)``, then "resource already
mapped" from the ``pin_memory`` fallback).

Registrations go through a ``Registrar``: ``CudartRegistrar`` calls the CUDA runtime,
``SimulatedCudart`` reproduces its bookkeeping on machines without a GPU (overlapping ranges are
refused with 712, unknown pointers with 713), so the ownership code runs — and is tested — on the
CPU. Both book every live registration in one process-wide ledger (``pinned_registrations()``),
which benchmarks read before and after each section.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch


class OffloadError(RuntimeError):
    """The offload engine cannot do what was asked (no CUDA, out of memory, bad model...)."""


#: names of the ``cudaError_t`` codes the host-registration calls return (CUDA runtime API)
CUDA_ERROR_NAMES: dict[int, str] = {
    0: "cudaSuccess", 1: "cudaErrorInvalidValue", 2: "cudaErrorMemoryAllocation",
    3: "cudaErrorInitializationError", 4: "cudaErrorCudartUnloading", 100: "cudaErrorNoDevice",
    101: "cudaErrorInvalidDevice", 208: "cudaErrorAlreadyMapped", 304: "cudaErrorOperatingSystem",
    712: "cudaErrorHostMemoryAlreadyRegistered", 713: "cudaErrorHostMemoryNotRegistered",
    800: "cudaErrorNotPermitted", 801: "cudaErrorNotSupported",
}
#: no cudart binding in this torch build (not a CUDA code)
NO_BINDING = -1
CUDART_UNLOADING = 4
#: codes after which ``alloc_pinned`` falls back to ``pin_memory=True`` (registration unsupported
#: here); any other failure is a bug or exhaustion and is raised
FALLBACK_CODES = frozenset({NO_BINDING, 801})


def cuda_error_name(code: int) -> str:
    """``"cudaErrorHostMemoryAlreadyRegistered (712)"`` for 712; unknown codes keep their number."""
    if code == NO_BINDING:
        return "no cudart binding (-1)"
    return f"{CUDA_ERROR_NAMES.get(code, 'cudaError')} ({code})"


class CudaCallError(OffloadError):
    """A CUDA runtime call returned an error code (``code``; the message names it)."""

    def __init__(self, call: str, code: int, detail: str = "") -> None:
        self.call, self.code = call, code
        super().__init__(f"{call} failed: {cuda_error_name(code)}{': ' + detail if detail else ''}")


# ---------------------------------------------------------------------------------------- ledger
@dataclass(frozen=True)
class PinCount:
    """Host registrations of this process at one moment.

    Attributes:
        live: registrations not yet released.
        live_bytes: bytes they page-lock.
        registered: registrations made since the process started.
        unregistered: registrations released since the process started.
        registered_bytes, unregistered_bytes: their bytes.
    """

    live: int
    live_bytes: int
    registered: int
    unregistered: int
    registered_bytes: int
    unregistered_bytes: int

    def to_dict(self) -> dict[str, int]:
        return dict(live=self.live, live_bytes=self.live_bytes, registered=self.registered,
                    unregistered=self.unregistered, registered_bytes=self.registered_bytes,
                    unregistered_bytes=self.unregistered_bytes)


class _Ledger:
    # Finalizers may run inside any allocation (garbage collection), also while this thread holds
    # the lock: hence a re-entrant lock, and iteration only over copies.
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.live: dict[tuple[str, int], int] = {}  # (registrar label, ptr) -> bytes
        self.registered = self.unregistered = self.registered_bytes = self.unregistered_bytes = 0

    def add(self, label: str, ptr: int, nbytes: int) -> None:
        with self.lock:
            self.live[(label, ptr)] = nbytes
            self.registered += 1
            self.registered_bytes += nbytes

    def remove(self, label: str, ptr: int) -> None:
        with self.lock:
            self.unregistered_bytes += self.live.pop((label, ptr), 0)
            self.unregistered += 1

    def count(self) -> PinCount:
        with self.lock:
            live = self.live.copy()
            return PinCount(len(live), sum(live.values()), self.registered, self.unregistered,
                            self.registered_bytes, self.unregistered_bytes)


_LEDGER = _Ledger()


def pinned_registrations() -> PinCount:
    """The process's live host registrations (real and simulated) and the call totals."""
    return _LEDGER.count()


# ---------------------------------------------------------------------------------------- registrars
class Registrar:
    """Page-locks host address ranges. Subclasses implement the two raw calls (return a cudaError code)."""

    label: str = "registrar"

    def _register(self, ptr: int, nbytes: int) -> int:
        raise NotImplementedError

    def _unregister(self, ptr: int) -> int:
        raise NotImplementedError

    def register(self, ptr: int, nbytes: int) -> None:
        """Page-lock ``[ptr, ptr + nbytes)``; ``CudaCallError`` naming the code on failure."""
        code = self._register(ptr, nbytes)
        if code != 0:
            raise CudaCallError("cudaHostRegister", code, f"{nbytes / 1e9:.3f} GB at {ptr:#x} ({self.label})")
        _LEDGER.add(self.label, ptr, nbytes)

    def unregister(self, ptr: int) -> None:
        """Release the registration starting at ``ptr``; ``CudaCallError`` naming the code on failure
        (``cudaErrorCudartUnloading``, at interpreter exit, is not an error: the driver is gone)."""
        code = self._unregister(ptr)
        if code == CUDART_UNLOADING:
            _LEDGER.remove(self.label, ptr)
            return
        if code != 0:
            raise CudaCallError("cudaHostUnregister", code, f"at {ptr:#x} ({self.label})")
        _LEDGER.remove(self.label, ptr)


def _code(ret: Any) -> int:
    """cudart calls return a ``cudaError`` enum, an int, or a tuple whose first item is one."""
    if isinstance(ret, tuple):
        ret = ret[0]
    return int(getattr(ret, "value", ret))


class CudartRegistrar(Registrar):
    """The CUDA runtime's ``cudaHostRegister`` / ``cudaHostUnregister`` (through torch's binding)."""

    label = "cudart"

    def _register(self, ptr: int, nbytes: int) -> int:
        try:
            return _code(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
        except (AttributeError, RuntimeError, TypeError):  # binding missing in this build
            return NO_BINDING

    def _unregister(self, ptr: int) -> int:
        try:
            return _code(torch.cuda.cudart().cudaHostUnregister(ptr))
        except (AttributeError, RuntimeError, TypeError):
            return NO_BINDING


class SimulatedCudart(Registrar):
    """cudart's host-registration bookkeeping without a GPU (the CPU stand-in backend uses it).

    Registering a range that overlaps a live one returns 712, unregistering a pointer that does not
    start a live range returns 713 — the codes CUDA returns — so a leaked or doubly released
    registration fails on the CPU as it would on a GPU. ``calls`` counts register/unregister calls.
    """

    label = "simulated-cudart"

    def __init__(self) -> None:
        self._ranges: dict[int, int] = {}  # start -> end
        self._lock = threading.RLock()  # re-entrant and iterating copies: see _Ledger
        self.calls = {"register": 0, "unregister": 0}

    def _register(self, ptr: int, nbytes: int) -> int:
        with self._lock:
            self.calls["register"] += 1
            if nbytes <= 0:
                return 1
            end = ptr + nbytes
            if any(s < end and ptr < e for s, e in self._ranges.copy().items()):
                return 712
            self._ranges[ptr] = end
            return 0

    def _unregister(self, ptr: int) -> int:
        with self._lock:
            self.calls["unregister"] += 1
            return 0 if self._ranges.pop(ptr, None) is not None else 713


#: the one simulated runtime of this process (as there is one CUDA runtime per process)
SIMULATED = SimulatedCudart()


# ---------------------------------------------------------------------------------------- buffers
def _release(registrar: Registrar, ptr: int, tensor: torch.Tensor) -> None:
    """Finalizer body. The finalizer holds ``tensor`` until this ran, so the memory cannot return to
    the allocator (and be handed out again) while the range is still registered."""
    registrar.unregister(ptr)


class HostBuffer:
    """One flat host buffer ``[nbytes] uint8`` and, when it is page-locked, its registration.

    Attributes:
        tensor: the buffer.
        pinning: ``"registered"`` (ordinary allocation page-locked with ``cudaHostRegister``: exact
            size; this buffer owns the registration), ``"pinned_alloc"`` (``pin_memory=True``: the
            caching host allocator owns it and may round it up to a power of two), or ``"pageable"``.
    """

    def __init__(self, tensor: torch.Tensor, pinning: str = "pageable") -> None:
        if tensor.dtype != torch.uint8 or tensor.dim() != 1 or tensor.device.type != "cpu":
            raise ValueError("a host buffer is a 1-D uint8 CPU tensor")
        if pinning not in ("pageable", "pinned_alloc"):
            raise ValueError(f"pinning {pinning!r}: a registration is made with pin(), which gives it an owner")
        self.tensor = tensor
        self.pinning = pinning
        self._finalizer: Optional[weakref.finalize] = None

    @property
    def nbytes(self) -> int:
        return int(self.tensor.numel())

    @property
    def owns_registration(self) -> bool:
        return self._finalizer is not None and self._finalizer.alive

    def pin(self, registrar: Registrar) -> bool:
        """Page-lock this buffer in place with ``registrar``; the buffer then owns the registration.

        Returns True when this call registered it, False when it was already page-locked.
        Raises ``CudaCallError`` (naming the CUDA code) when the runtime refuses.
        """
        if self.pinning != "pageable" or self.nbytes == 0:
            return False
        ptr = self.tensor.data_ptr()
        registrar.register(ptr, self.nbytes)
        self._finalizer = weakref.finalize(self, _release, registrar, ptr, self.tensor)
        self.pinning = "registered"
        return True

    def close(self) -> None:
        """Release the registration (idempotent; the memory stays valid, now pageable). The caller
        guarantees no copy from the buffer is in flight. Raises ``CudaCallError`` when the runtime
        refuses (the registration is then considered gone: it is not retried)."""
        fin, self._finalizer = self._finalizer, None
        if self.pinning == "registered":
            self.pinning = "pageable"
        if fin is not None:
            fin()

    def __repr__(self) -> str:
        return f"HostBuffer({self.nbytes} bytes, {self.pinning})"


def alloc_pinned(nbytes: int, registrar: Optional[Registrar]) -> HostBuffer:
    """``[nbytes] uint8`` page-locked host memory.

    With a ``registrar``: an ordinary allocation page-locked with exactly ``nbytes`` (the caching
    host allocator would round a 1.71 GB layer up to 2 GiB); when registration is not supported
    here (no binding, ``cudaErrorNotSupported``) it falls back to ``pin_memory=True`` with a
    warning; any other CUDA error is raised naming its code. Without one: ``pin_memory=True``.
    Raises ``OffloadError`` when host memory runs out.
    """
    if registrar is not None:
        try:
            buf = HostBuffer(torch.empty(nbytes, dtype=torch.uint8))
        except RuntimeError as e:  # host OOM
            raise OffloadError(f"could not allocate {nbytes / 1e9:.2f} GB of host memory: {e}") from e
        try:
            buf.pin(registrar)
            return buf
        except CudaCallError as e:
            if e.code not in FALLBACK_CODES:
                raise
            warnings.warn(f"{e}; falling back to pin_memory=True (the caching host allocator rounds blocks "
                          "up to a power of two)", stacklevel=2)
        del buf
    try:
        return HostBuffer(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), "pinned_alloc")
    except RuntimeError as e:
        raise OffloadError(f"could not allocate {nbytes / 1e9:.2f} GB of pinned host memory: {e}") from e
