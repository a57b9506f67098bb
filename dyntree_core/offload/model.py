"""``offload_decoder_layers``: wrap an HF decoder-only model in place with the layer streamer.

After wrapping, the caller still has an ordinary HF model: embeddings, norms, rotary tables,
``lm_head`` (and therefore the KV cache and all activations) live on ``device``; the first
``R`` decoder layers are resident on ``device``; the remaining layers' parameters point into
one packed (pinned) host buffer per layer and are streamed through ``slots`` device buffers by
forward hooks on each decoder layer. ``model(input_ids=..., position_ids=..., attention_mask=4D,
past_key_values=DynamicCache, use_cache=True)`` works unchanged for 1 to many query tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch import nn

from .backend import Backend, make_backend
from .pinning import HostBuffer, OffloadError
from .layout import HostLayer, LayerLayout, pack_layer, point_params
from .stats import StatsAccumulator, TransferStats
from .streamer import LayerStreamer, check_inference

GiB = 1 << 30


def decoder_stack(model: nn.Module) -> nn.Module:
    """The module holding ``.layers`` (``model.model`` for Llama/Qwen2-style causal LMs)."""
    for cand in (getattr(model, "model", None), model):
        if cand is not None and isinstance(getattr(cand, "layers", None), nn.ModuleList):
            return cand
    dec = model.get_decoder() if hasattr(model, "get_decoder") else None
    if dec is not None and isinstance(getattr(dec, "layers", None), nn.ModuleList):
        return dec
    raise OffloadError(f"{type(model).__name__} has no decoder ModuleList at .model.layers")


def move_except(model: nn.Module, skip: list[nn.Module], device: torch.device) -> None:
    """Move every parameter/buffer of ``model`` not inside a ``skip`` module to ``device``
    (tied parameters are moved once; buffers inside ``skip`` modules are moved too — they are small)."""
    skip_ids = {id(m) for s in skip for m in s.modules()}
    for m in model.modules():
        if id(m) not in skip_ids:
            for p in m._parameters.values():
                if p is not None and p.device != device:
                    if p.device.type == "meta":
                        raise OffloadError(f"parameter of {type(m).__name__} is on the meta device")
                    p.data = p.data.to(device)
        for name, buf in m._buffers.items():
            if buf is not None and buf.device != device:
                m._buffers[name] = buf.to(device)


def auto_resident(backend: Backend, n_layers: int, layer_bytes: int, slot_bytes: int, slots: int,
                  reserve_bytes: Optional[int]) -> int:
    """How many layers fit permanently on the device next to the slots and a reserve.

    ``reserve_bytes`` (default ``max(4 GiB, 10% of device memory)``) is left for the KV cache,
    activations and workspace. Host stand-in: 0 (the point of it is to exercise streaming).
    """
    if not backend.overlaps:
        return 0
    free, total = torch.cuda.mem_get_info(backend.device)
    reserve = reserve_bytes if reserve_bytes is not None else max(4 * GiB, total // 10)
    room = free - reserve - slots * slot_bytes
    if room >= n_layers * layer_bytes:  # everything fits: no slots needed at all
        return n_layers
    return max(0, min(n_layers, room // max(1, layer_bytes)))


@dataclass
class OffloadedModel:
    """Handle returned by ``offload_decoder_layers``; the model itself is modified in place.

    Attributes:
        model: the wrapped HF model.
        backend: CUDA or host stand-in (``backend.label`` says which).
        slots: device slot buffers.
        resident: indices of layers kept on the device.
        streamed: indices of layers streamed from host memory, in execution order.
        layer_bytes: packed bytes of each streamed layer (``{index: bytes}``).
        host_pinning: how the host buffers are page-locked (``registered``/``pinned_alloc``/``pageable``).

    Ownership: the handle owns the host buffers it allocated and the registrations it made on
    caller-given pageable ``host_layers``; ``close()`` releases all of them. Caller-given buffers
    that were already page-locked stay the caller's to close.
    """

    model: nn.Module
    backend: Backend
    slots: int
    resident: list[int]
    streamed: list[int]
    layer_bytes: dict[int, int]
    host_pinning: str
    _streamer: Optional[LayerStreamer]
    _acc: StatsAccumulator
    _host: dict[int, HostLayer]
    _owned: list[HostBuffer]
    _hooks: list[Any] = field(default_factory=list)
    closed: bool = False

    @property
    def device(self) -> torch.device:
        return self.backend.device

    @property
    def bytes_per_forward(self) -> int:
        """Bytes streamed host->device by one forward (sum over streamed layers)."""
        return sum(self.layer_bytes[i] for i in self.streamed)

    def stats(self) -> TransferStats:
        """Totals since the last reset (blocks only on the copies still in flight)."""
        return self._acc.snapshot()

    def reset_stats(self) -> None:
        self._acc.reset()

    def drop_prefetch(self) -> None:
        """Discard layers prefetched for the next forward (it will copy all streamed layers itself)."""
        if self._streamer is not None:
            self._streamer.drop_prefetch()

    def summary(self) -> dict[str, Any]:
        return {
            "backend": self.backend.label, "slots": self.slots, "resident": len(self.resident),
            "streamed": len(self.streamed), "bytes_per_forward": self.bytes_per_forward,
            "host_pinning": self.host_pinning,
        }

    def close(self) -> None:
        """Remove the hooks, drop the device slots and release every host registration this handle
        owns (idempotent). The model stays usable on the CPU: streamed parameters keep pointing at
        their host buffers, which are ordinary pageable memory afterwards. Raises ``CudaCallError``
        when the runtime refuses to unregister a buffer (after trying all of them)."""
        if self.closed:
            return
        self.closed = True
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        try:
            if self._streamer is not None:
                self._streamer.close()  # waits for the copies in flight
                self._streamer = None
            self.backend.synchronize()
        finally:
            self._host.clear()
            owned, self._owned = self._owned, []
            if getattr(self.model, "_dyntree_offload", None) is self:
                del self.model._dyntree_offload
            _close_all(owned)

    def __enter__(self) -> "OffloadedModel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_all(buffers: list[HostBuffer]) -> None:
    """Close every buffer, then raise the first failure (one refusal must not leak the rest)."""
    errors = []
    for buf in buffers:
        try:
            buf.close()
        except OffloadError as e:
            errors.append(e)
    if errors:
        raise errors[0]


def offload_decoder_layers(
    model: nn.Module,
    device: Union[str, torch.device] = "cuda",
    slots: int = 2,
    resident_layers: Union[str, int] = "auto",
    reserve_bytes: Optional[int] = None,
    register_host: bool = True,
    host_layers: Optional[dict[int, HostLayer]] = None,
) -> OffloadedModel:
    """Wrap ``model`` in place so its decoder layers stream from host memory.

    Args:
        model: HF decoder-only model with ``model.model.layers`` (Llama, Qwen2, Mistral...),
            weights on the CPU (or on the meta device for layers given in ``host_layers``).
        device: ``"cuda"``/``"cuda:N"``; ``"cpu"`` runs the same code with the host stand-in
            backend (tests only). ``"cuda"`` without CUDA raises ``OffloadError``.
        slots: device slot buffers (2 = double, 3 = triple buffering; 1 = no overlap baseline).
        resident_layers: ``"auto"`` (as many leading layers as device memory allows after
            ``reserve_bytes``; 0 on the host stand-in) or a number of leading layers.
        reserve_bytes: device memory left free by ``"auto"`` (default max(4 GiB, 10%)).
        register_host: page-lock exact-size allocations with ``cudaHostRegister`` (else
            ``pin_memory=True``, which rounds each layer up to a power of two).
        host_layers: pre-packed host weights for some layers (e.g. benchmark layers sharing K
            buffers); those layers' current parameters are ignored and re-pointed at them.
            Pageable buffers among them are page-locked in place and released by ``close()``;
            already page-locked ones remain the caller's to close.
    Returns:
        the ``OffloadedModel`` handle (stats, close).
    """
    if getattr(model, "_dyntree_offload", None) is not None:
        raise OffloadError("model is already offloaded (close() the previous handle first)")
    if not isinstance(slots, int) or not 1 <= slots <= 8:
        raise OffloadError(f"slots must be an integer in [1, 8], got {slots!r}")
    stack = decoder_stack(model)
    layers = list(stack.layers)
    n = len(layers)
    if resident_layers != "auto" and not (isinstance(resident_layers, int) and not isinstance(resident_layers, bool)
                                          and 0 <= resident_layers <= n):
        raise OffloadError(f"resident_layers must be 'auto' or an integer in [0, {n}], got {resident_layers!r}")
    backend = make_backend(device, register_host=register_host)  # raises before anything is moved
    dev = backend.device
    host_layers = dict(host_layers or {})
    layouts = {i: host_layers[i].layout if i in host_layers else LayerLayout.of(layers[i]) for i in range(n)}
    max_bytes = max(lay.nbytes for lay in layouts.values())
    try:
        move_except(model, layers, dev)
        r = auto_resident(backend, n, max_bytes, max_bytes, slots, reserve_bytes) if resident_layers == "auto" \
            else int(resident_layers)
        for i in range(r):
            if i in host_layers:
                h = host_layers.pop(i)
                point_params(layers[i], h.layout, [v.to(dev) for v in h.views])
            else:
                layers[i].to(dev)
    except torch.OutOfMemoryError as e:
        raise OffloadError(f"out of device memory placing the non-layer parts / {resident_layers} resident "
                           f"layers on {dev}: {e}; lower resident_layers or raise reserve_bytes") from e
    streamed = list(range(r, n))
    owned: list[HostBuffer] = []  # registrations this handle makes: released by close()
    host: dict[int, HostLayer] = {}
    try:
        for i in streamed:
            if i in host_layers:
                h = host_layers[i]
                if backend.pin(h.buffer):  # a caller's pageable buffer (shared ones are pinned once)
                    owned.append(h.buffer)
                point_params(layers[i], h.layout, h.views)
            else:
                buf = backend.alloc_host(layouts[i].nbytes)  # one allocation per layer (no rounding blow-up)
                owned.append(buf)
                h = pack_layer(layers[i], buf)
            host[i] = h
            for p in layers[i].parameters():
                p.requires_grad_(False)
            for m in layers[i].modules():
                for name, b in m._buffers.items():
                    if b is not None and b.device != dev:
                        m._buffers[name] = b.to(dev)
        acc = StatsAccumulator(backend)
        streamer = LayerStreamer(backend, {i: layers[i] for i in streamed}, host, streamed, slots, acc) if streamed \
            else None
    except BaseException:
        _close_all(owned)  # layers packed so far keep pointing at their (now pageable) buffers
        raise
    pinning = sorted({h.buffer.pinning for h in host.values()})
    handle = OffloadedModel(model, backend, slots, list(range(r)), streamed, {i: host[i].layout.nbytes for i in streamed},
                            ",".join(pinning) or "none", streamer, acc, host, owned)
    if streamer is not None:
        for i in streamed:
            handle._hooks.append(layers[i].register_forward_pre_hook(_pre_hook(streamer, i)))
            handle._hooks.append(layers[i].register_forward_hook(_post_hook(streamer, i)))
    handle._hooks.append(stack.register_forward_hook(_stack_done(handle), always_call=True))
    model._dyntree_offload = handle
    return handle


def _pre_hook(streamer: LayerStreamer, idx: int):
    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        check_inference(args)
        streamer.before(idx)

    return hook


def _post_hook(streamer: LayerStreamer, idx: int):
    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        streamer.after(idx)

    return hook


def _stack_done(handle: OffloadedModel):
    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if output is None and handle._streamer is not None:  # the forward raised
            handle._streamer.abort()
            return
        handle._acc.forwards += 1
        handle._acc.poll()

    return hook
