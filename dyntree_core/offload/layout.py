"""Packing one decoder layer's parameters into one flat byte buffer, and views back into it.

A layer with parameters ``p_0 .. p_{m-1}`` becomes one ``[nbytes] uint8`` buffer; ``p_j`` lives at
byte offset ``offset_j`` (aligned to ``ALIGN`` bytes) as a contiguous tensor of its dtype/shape.
The same layout is used for the pinned host buffer and for every GPU slot buffer, so one
``copy_`` moves the whole layer and parameters are re-pointed by building views.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from .pinning import HostBuffer

#: byte alignment of every parameter inside a packed layer (>= any GEMM kernel's requirement)
ALIGN = 256


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter sits in the packed buffer.

    Attributes:
        module: dotted path of the owning submodule inside the layer ("" = the layer itself).
        name: attribute name in that submodule's ``_parameters``.
        dtype, shape: of the parameter.
        offset: byte offset (multiple of ``ALIGN``).
        nbytes: ``numel * element_size``.
    """

    module: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class LayerLayout:
    """The packed layout of one decoder layer; ``nbytes`` = total buffer size (bytes)."""

    params: tuple[ParamSlot, ...]
    nbytes: int

    @staticmethod
    def of(layer: nn.Module) -> "LayerLayout":
        """Layout of ``layer``'s parameters (shared parameters are packed once; works on meta)."""
        slots: list[ParamSlot] = []
        seen: set[int] = set()
        off = 0
        for mod_name, mod in layer.named_modules():
            for name, p in mod._parameters.items():
                if p is None or id(p) in seen:
                    continue
                seen.add(id(p))
                nb = p.numel() * p.element_size()
                slots.append(ParamSlot(mod_name, name, p.dtype, tuple(p.shape), off, nb))
                off += (nb + ALIGN - 1) // ALIGN * ALIGN
        if not slots:
            raise ValueError("layer has no parameters to offload")
        return LayerLayout(tuple(slots), off)

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Typed views ``[shape_j]`` of ``buf`` (``[>= nbytes] uint8``), one per parameter."""
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < self.nbytes:
            raise ValueError(f"need a 1-D uint8 buffer of >= {self.nbytes} bytes")
        return [buf[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in self.params]

    def compatible(self, other: "LayerLayout") -> bool:
        return self == other


def iter_params(layer: nn.Module, layout: LayerLayout) -> Iterator[tuple[nn.Module, str]]:
    """``(owning module, attribute name)`` for each parameter of ``layout``, in layout order."""
    for s in layout.params:
        yield layer.get_submodule(s.module), s.name


def point_params(layer: nn.Module, layout: LayerLayout, tensors: list[torch.Tensor]) -> None:
    """Re-point ``layer``'s parameters at ``tensors`` (``.data`` swap; Parameter objects are kept)."""
    for (mod, name), t in zip(iter_params(layer, layout), tensors):
        p = mod._parameters[name]
        if p is None or p.device.type == "meta" or p.dtype != t.dtype:
            mod._parameters[name] = nn.Parameter(t, requires_grad=False)
        else:
            p.data = t


@dataclass
class HostLayer:
    """A layer's weights in one host buffer.

    Attributes:
        buffer: the ``[>= layout.nbytes] uint8`` host buffer (pinned on CUDA).
        layout: where each parameter sits.
        views: typed views of ``buffer`` (what the parameters point at between forwards).
    """

    buffer: HostBuffer
    layout: LayerLayout
    views: list[torch.Tensor]

    @staticmethod
    def wrap(buffer: HostBuffer, layout: LayerLayout) -> "HostLayer":
        return HostLayer(buffer, layout, layout.views(buffer.tensor))


def pack_layer(layer: nn.Module, buffer: HostBuffer) -> HostLayer:
    """Copy ``layer``'s parameters into ``buffer`` and re-point them at the packed host views."""
    layout = LayerLayout.of(layer)
    host = HostLayer.wrap(buffer, layout)
    with torch.no_grad():
        for (mod, name), v in zip(iter_params(layer, layout), host.views):
            v.copy_(mod._parameters[name].detach())
    point_params(layer, layout, host.views)
    for mod, name in iter_params(layer, layout):
        mod._parameters[name].requires_grad_(False)
    return host
