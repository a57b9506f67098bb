"""``FusedGateUp``: a gated MLP whose ``gate_proj`` and ``up_proj`` run as one ``GGMLLinear`` of both
weights' rows (one kernel call over ``2 * intermediate`` rows; each output computed exactly as before,
rows do not interact). ``quant.fused.fuse_forward`` puts it in place; ``quant.native_layer`` reads it."""

from __future__ import annotations

import torch
from torch import nn

from .ggml_linear import GGMLLinear
from .huge_pages import huge_empty


def joined_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """uint8 ``[rows of gate + rows of up, ...]``: the two layers' blocks one after the other, written straight into 2
    MiB pages (``huge_empty``: ``GGMLLinear`` keeps them as they are). x8 blocks are groups of 8 rows in row order:
    joined, they are the x8 layout of the joined rows."""
    out = huge_empty((gate.shape[0] + up.shape[0], *gate.shape[1:]), gate.dtype)
    out[:gate.shape[0]].copy_(gate)
    out[gate.shape[0]:].copy_(up)
    return out


class FusedGateUp(nn.Module):
    """``down(act(gate(x)) * up(x))`` with ``gate`` and ``up`` as one ``GGMLLinear`` (``gate_up``: gate rows first,
    ``intermediate`` of them)."""

    def __init__(self, gate_up: GGMLLinear, intermediate: int, down_proj: nn.Module, act_fn: nn.Module):
        super().__init__()
        self.intermediate = int(intermediate)
        self.gate_up = gate_up
        self.down_proj = down_proj
        self.act_fn = act_fn

    @classmethod
    def from_mlp(cls, mlp: nn.Module) -> "FusedGateUp":
        """The fused form of a gated MLP whose ``gate_proj`` and ``up_proj`` are ``GGMLLinear`` of one kind
        (``quant.fused``)."""
        g, u = mlp.gate_proj, mlp.up_proj
        gate_up = GGMLLinear(g.type_name, joined_rows(g.blocks, u.blocks), g.in_features, None, g.kernels,
                             g.int8_activations, g.x8, g.out_features + u.out_features)
        gate_up.mm_min_rows = g.mm_min_rows
        gate_up.vnni_min_rows = g.vnni_min_rows
        return cls(gate_up, g.out_features, mlp.down_proj, mlp.act_fn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up(x)
        return self.down_proj(self.act_fn(gu[..., :self.intermediate]) * gu[..., self.intermediate:])
