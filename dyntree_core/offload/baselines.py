"""Baselines measured in the same process as the streamer.

* ``sync_offload_layers``: the naive scheme — before each streamed layer, ``.to(device)`` of
  every parameter from (pageable) host memory on the compute stream (blocking); after it, the
  device copies are dropped (parameters point back at host memory). No prefetch, no overlap.
  (``offload_decoder_layers(..., slots=1)`` is the other synchronous variant: pinned, one slot.)
* ``accelerate_offload_layers``: ``accelerate.cpu_offload`` applied to each decoder layer, the
  rest of the model resident on the device (weights on ``meta`` between forwards, copied per
  parameter from the CPU state dict in the pre-forward hook).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch import nn

from .backend import Backend, OffloadError, make_backend
from .layout import HostLayer, LayerLayout, iter_params, point_params
from .model import decoder_stack, move_except
from .stats import StatsAccumulator, TransferStats
from .streamer import check_inference


@dataclass
class BaselineHandle:
    """Handle of a baseline wrapping (``stats()`` only counts what the baseline can see)."""

    model: nn.Module
    backend: Backend
    kind: str
    streamed: list[int]
    bytes_per_forward: int
    _acc: StatsAccumulator
    _close: list[Any] = field(default_factory=list)

    def stats(self) -> TransferStats:
        return self._acc.snapshot()

    def reset_stats(self) -> None:
        self._acc.reset()

    def close(self) -> None:
        for c in self._close:
            c()
        self._close.clear()
        self.backend.synchronize()


def _host_tensors(layer: nn.Module, layout: LayerLayout, host: Optional[HostLayer]) -> list[torch.Tensor]:
    if host is not None:
        point_params(layer, host.layout, host.views)
        return list(host.views)
    out = []
    for mod, name in iter_params(layer, layout):
        p = mod._parameters[name]
        if p.device.type != "cpu":
            raise OffloadError("baseline offload expects the decoder layers' weights on the CPU")
        p.requires_grad_(False)
        out.append(p.data)
    return out


def sync_offload_layers(model: nn.Module, device: Union[str, torch.device] = "cuda",
                        host_layers: Optional[dict[int, HostLayer]] = None) -> BaselineHandle:
    """Naive synchronous per-layer ``.to(device)`` of every decoder layer (see module doc)."""
    backend = make_backend(device)
    dev = backend.device
    stack = decoder_stack(model)
    layers = list(stack.layers)
    move_except(model, layers, dev)
    acc = StatsAccumulator(backend, serial=True)
    total = 0
    hooks: list[Any] = []
    for i, layer in enumerate(layers):
        layout = host_layers[i].layout if host_layers and i in host_layers else LayerLayout.of(layer)
        host = _host_tensors(layer, layout, (host_layers or {}).get(i))
        nbytes = sum(s.nbytes for s in layout.params)
        total += nbytes
        for m in layer.modules():
            for name, b in m._buffers.items():
                if b is not None:
                    m._buffers[name] = b.to(dev)

        def pre(module: nn.Module, args: tuple[Any, ...], layout: LayerLayout = layout,
                host: list[torch.Tensor] = host, nbytes: int = nbytes) -> None:
            check_inference(args)
            cur = backend.current_stream()
            start, done = backend.event(True), backend.event(True)
            backend.record(start, cur)
            point_params(module, layout, [t.to(dev, copy=True) for t in host])  # blocking copies
            backend.record(done, cur)
            acc.add(nbytes, start, done, None)

        def post(module: nn.Module, args: tuple[Any, ...], output: Any, layout: LayerLayout = layout,
                 host: list[torch.Tensor] = host) -> None:
            point_params(module, layout, host)

        hooks.append(layer.register_forward_pre_hook(pre))
        hooks.append(layer.register_forward_hook(post, always_call=True))

    def stack_done(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        acc.forwards += 1
        acc.poll()

    hooks.append(stack.register_forward_hook(stack_done))
    return BaselineHandle(model, backend, "sync_to_device", list(range(len(layers))), total, acc,
                          [h.remove for h in hooks])


def accelerate_offload_layers(model: nn.Module, device: Union[str, torch.device] = "cuda",
                              host_layers: Optional[dict[int, HostLayer]] = None) -> BaselineHandle:
    """``accelerate.cpu_offload`` on each decoder layer; the rest of the model on ``device``.

    ``stats()`` counts forwards and the nominal bytes only (accelerate exposes no transfer timing).
    """
    from accelerate import cpu_offload
    from accelerate.hooks import remove_hook_from_module

    backend = make_backend(device)
    dev = backend.device
    stack = decoder_stack(model)
    layers = list(stack.layers)
    move_except(model, layers, dev)
    total = 0
    for i, layer in enumerate(layers):
        layout = host_layers[i].layout if host_layers and i in host_layers else LayerLayout.of(layer)
        host = _host_tensors(layer, layout, (host_layers or {}).get(i))
        total += sum(s.nbytes for s in layout.params)
        sd = {(f"{s.module}.{s.name}" if s.module else s.name): t for s, t in zip(layout.params, host)}
        for name, b in layer.named_buffers():
            sd.setdefault(name, b.to("cpu"))
        cpu_offload(layer, execution_device=dev, state_dict=sd)
    acc = StatsAccumulator(backend, serial=True)

    def stack_done(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        acc.forwards += 1
        acc.bytes += total
        acc.layers += len(layers)

    hook = stack.register_forward_hook(stack_done)

    def undo() -> None:
        hook.remove()
        for layer in layers:
            remove_hook_from_module(layer, recurse=True)

    return BaselineHandle(model, backend, "accelerate_cpu_offload", list(range(len(layers))), total, acc, [undo])
