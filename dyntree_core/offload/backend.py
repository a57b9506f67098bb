"""A tiny stream/event/host-memory abstraction so ONE streaming code path runs on CUDA and on CPU.

``CudaBackend`` is the real thing: page-locked host buffers, a dedicated copy stream, CUDA events
(with timing) for the handshakes and the accounting. ``HostBackend`` exists only so the streaming
engine can be tested bit for bit on machines without a GPU: "pinned" buffers are ordinary host
buffers registered with a simulated runtime (``pinning.SIMULATED``), copies are synchronous
``copy_`` calls, streams are ``None`` and events are wall-clock stamps. Nothing overlaps on the
host backend, and it says so (``overlaps = False``). Host memory and its ownership: ``pinning``.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Union

import torch

from .pinning import SIMULATED, CudartRegistrar, HostBuffer, OffloadError, Registrar, alloc_pinned


# ---------------------------------------------------------------------------------------- events
class HostEvent:
    """Host-backend stand-in for a CUDA event: the wall-clock time at which it was recorded."""

    def __init__(self) -> None:
        self.t: Optional[float] = None
        self.tick: int = 0  # used by tests that check the stream protocol


Event = Union["torch.cuda.Event", HostEvent]


class Backend:
    """Common interface. ``overlaps``: copies can run concurrently with compute."""

    device: torch.device
    overlaps: bool
    label: str
    registrar: Registrar

    def alloc_host(self, nbytes: int) -> HostBuffer:
        """``[nbytes] uint8`` host memory page-locked for this backend (the buffer owns the
        registration: ``close()`` it)."""
        raise NotImplementedError

    def pin(self, buf: HostBuffer) -> bool:
        """Page-lock a caller's pageable buffer in place (True when this call registered it; whoever
        asked for it then owns the registration and ``close()``-s the buffer)."""
        return buf.pin(self.registrar)

    def alloc_device(self, nbytes: int) -> torch.Tensor:
        """``[nbytes] uint8`` on the compute device; ``OffloadError`` on OOM."""
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError as e:
            raise OffloadError(f"out of device memory allocating {nbytes / 1e9:.2f} GB on {self.device}: {e}") from e

    def copy_stream(self) -> Any:
        raise NotImplementedError

    def current_stream(self) -> Any:
        raise NotImplementedError

    def event(self, timing: bool) -> Event:
        raise NotImplementedError

    def record(self, event: Event, stream: Any) -> None:
        raise NotImplementedError

    def wait(self, stream: Any, event: Optional[Event]) -> None:
        raise NotImplementedError

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        """Enqueue ``dst.copy_(src)`` on ``stream`` (asynchronous on CUDA)."""
        raise NotImplementedError

    def done(self, event: Event) -> bool:
        raise NotImplementedError

    def elapsed(self, start: Event, end: Event) -> float:
        """Seconds from ``start`` to ``end`` (blocks until ``end`` has completed; may be < 0)."""
        raise NotImplementedError

    def synchronize(self) -> None:
        raise NotImplementedError


class CudaBackend(Backend):
    """Real CUDA streams and events on ``device``."""

    overlaps = True

    def __init__(self, device: torch.device, register_host: bool = True):
        if not torch.cuda.is_available():
            raise OffloadError(
                f"device={str(device)!r} was requested but CUDA is not available "
                f"(torch {torch.__version__}, cuda build: {torch.version.cuda}); "
                "use device='cpu' only for functional tests of the streaming code path"
            )
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.register_host = register_host
        self.registrar = CudartRegistrar()
        self.label = f"cuda ({torch.cuda.get_device_name(self.device)})"
        with torch.cuda.device(self.device):
            self._copy_stream = torch.cuda.Stream(self.device)

    def alloc_host(self, nbytes: int) -> HostBuffer:
        return alloc_pinned(nbytes, self.registrar if self.register_host else None)

    def copy_stream(self) -> Any:
        return self._copy_stream

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def event(self, timing: bool) -> Event:
        return torch.cuda.Event(enable_timing=timing)

    def record(self, event: Event, stream: Any) -> None:
        event.record(stream)  # type: ignore[union-attr]

    def wait(self, stream: Any, event: Optional[Event]) -> None:
        if event is not None:
            stream.wait_event(event)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def done(self, event: Event) -> bool:
        return bool(event.query())  # type: ignore[union-attr]

    def elapsed(self, start: Event, end: Event) -> float:
        start.synchronize()  # type: ignore[union-attr]
        end.synchronize()  # type: ignore[union-attr]
        return float(start.elapsed_time(end)) / 1e3  # type: ignore[union-attr, arg-type]

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


class HostBackend(Backend):
    """CPU stand-in used by tests: same bookkeeping, synchronous copies, wall-clock events.

    NOT an offload engine: there is no second memory and nothing overlaps; numbers measured with
    it are host memcpy costs, not PCIe transfers. Host buffers are "page-locked" through
    ``pinning.SIMULATED`` (cudart's registration bookkeeping, no GPU), so ownership of pinned
    memory is exercised exactly as on CUDA.
    """

    overlaps = False
    label = "cpu (functional stand-in: synchronous host copies, no streams; timings not meaningful)"

    def __init__(self, registrar: Registrar = SIMULATED) -> None:
        self.device = torch.device("cpu")
        self.registrar = registrar

    def alloc_host(self, nbytes: int) -> HostBuffer:
        return alloc_pinned(nbytes, self.registrar)

    def alloc_device(self, nbytes: int) -> torch.Tensor:
        try:
            return torch.empty(nbytes, dtype=torch.uint8)
        except RuntimeError as e:
            raise OffloadError(f"could not allocate {nbytes / 1e9:.2f} GB of host memory: {e}") from e

    def copy_stream(self) -> Any:
        return None

    def current_stream(self) -> Any:
        return None

    def event(self, timing: bool) -> Event:
        return HostEvent()

    def record(self, event: Event, stream: Any) -> None:
        event.t = time.perf_counter()  # type: ignore[union-attr]

    def wait(self, stream: Any, event: Optional[Event]) -> None:
        return None  # copies already completed synchronously

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        dst.copy_(src)

    def done(self, event: Event) -> bool:
        return event.t is not None  # type: ignore[union-attr]

    def elapsed(self, start: Event, end: Event) -> float:
        return float(end.t - start.t)  # type: ignore[union-attr, operator]

    def synchronize(self) -> None:
        return None


def make_backend(device: Union[str, torch.device], register_host: bool = True) -> Backend:
    """``cuda``/``cuda:N`` -> ``CudaBackend`` (raises ``OffloadError`` without CUDA); ``cpu`` -> ``HostBackend``."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return CudaBackend(dev, register_host=register_host)
    if dev.type == "cpu":
        return HostBackend()
    raise OffloadError(f"unsupported offload device {str(device)!r}: use 'cuda', 'cuda:N' or 'cpu' (tests)")
