"""``FusedGateUp``: a gated MLP whose ``gate_proj`` and ``up_proj`` run as one ``GGMLLinear`` of both
weights' rows (one kernel call over ``2 * intermediate`` rows; each output computed exactly as before,
rows do not interact). ``quant.fused.fuse_forward`` puts it in place; ``quant.native_layer`` reads it."""

from __future__ import annotations

import torch
from torch import nn

from .ggml_linear import GGMLLinear
from .huge_pages import huge_empty


class FusedGateUp(nn.Module):
    """``down(act(gate(x)) * up(x))`` with ``gate`` and ``up`` as one ``GGMLLinear`` (``gate_up``: gate rows first)."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        g, u = mlp.gate_proj, mlp.up_proj
        self.intermediate = g.out_features
        # (x8 blocks are groups of 8 rows in row order: joined, they are the x8 layout of the joined rows)
        joined = huge_empty((g.blocks.shape[0] + u.blocks.shape[0], *g.blocks.shape[1:]), g.blocks.dtype)
        joined[:g.blocks.shape[0]].copy_(g.blocks)  # (written in its 2 MiB pages: GGMLLinear keeps it as it is)
        joined[g.blocks.shape[0]:].copy_(u.blocks)
        self.gate_up = GGMLLinear(g.type_name, joined, g.in_features, None, g.kernels, g.int8_activations, g.x8,
                                  g.out_features + u.out_features)
        self.gate_up.mm_min_rows = g.mm_min_rows
        self.gate_up.vnni_min_rows = g.vnni_min_rows
        self.down_proj = mlp.down_proj
        self.act_fn = mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up(x)
        return self.down_proj(self.act_fn(gu[..., :self.intermediate]) * gu[..., self.intermediate:])
