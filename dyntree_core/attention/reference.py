"""Torch references for tree attention (batch 1, ``[H, L, D]`` tensors like the kernel).

- ``sdpa_reference``: ``F.scaled_dot_product_attention`` with a bool mask (True = attend),
  computed in fp32 by default (the exactness reference) or in the input dtype.
- ``manual_attention``: matmul + masked softmax in fp32, the pure-torch fallback and the
  "manual attention" baseline of the benchmark; rows that see nothing give 0 (as SDPA).
- ``path_oracle``: vLLM's independent oracle: every tree node's output is causal attention over
  ``prefix + path(root -> node)``, computed per node with no mask at all.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from dyntree_core.attention.mask import order_permutation
from dyntree_core.tree import TokenTree


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError("expected [H, L, D] tensors")
    if q.shape[0] % k.shape[0]:
        raise ValueError("query heads must be a multiple of kv heads")
    return q.shape[0] // k.shape[0]


def sdpa_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
    sm_scale: Optional[float] = None, dtype: Optional[torch.dtype] = torch.float32,
) -> torch.Tensor:
    """SDPA with a ``[Q, KV]`` bool mask. q ``[Hq, Q, D]``, k/v ``[Hkv, KV, D]`` -> ``[Hq, Q, D]``.

    ``dtype=None`` computes in the inputs' dtype; the result is returned in that compute dtype.
    """
    _check(q, k, v)
    if dtype is not None:
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out = F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask.to(q.device)[None, None], scale=sm_scale, enable_gqa=True
    )[0]
    # Fully masked rows: SDPA (torch >= 2.5) returns 0; enforce it so every backend agrees.
    dead = ~mask.to(q.device).any(dim=1)
    return out.masked_fill(dead[None, :, None], 0.0)


def manual_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sm_scale: Optional[float] = None,
) -> torch.Tensor:
    """Pure-torch masked attention in fp32, cast back to ``q.dtype``. Shapes as ``sdpa_reference``."""
    g = _check(q, k, v)
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    kf = k.float().repeat_interleave(g, dim=0)
    vf = v.float().repeat_interleave(g, dim=0)
    s = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask.to(q.device)[None], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    l = p.sum(dim=-1, keepdim=True)
    out = torch.matmul(p, vf) / torch.where(l == 0, torch.ones_like(l), l)
    return out.to(q.dtype)


def path_oracle(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tree: TokenTree, prefix_len: int,
    order: str | torch.Tensor, sm_scale: Optional[float] = None, dtype: Optional[torch.dtype] = torch.float32,
) -> torch.Tensor:
    """Per-node causal attention over ``prefix + path(root -> node)``, no mask involved.

    q ``[Hq, T, D]`` and k/v ``[Hkv, P + T, D]`` hold the tree tokens in ``order`` (slot ``i`` =
    node ``order[i]``). Returns ``[Hq, T, D]`` in ``dtype`` (inputs' dtype when None).
    """
    g = _check(q, k, v)
    perm = order_permutation(tree, order)
    slot = torch.empty_like(perm)
    slot[perm] = torch.arange(tree.size)
    if dtype is not None:
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    out = torch.empty_like(q)
    for i in range(tree.size):
        node = int(perm[i])
        cols = list(range(prefix_len)) + [prefix_len + int(slot[n]) for n in tree.path_to(node)]
        idx = torch.tensor(cols, device=k.device)
        kk = k.index_select(1, idx).repeat_interleave(g, dim=0)
        vv = v.index_select(1, idx).repeat_interleave(g, dim=0)
        # The query is the last token of the gathered sequence: plain softmax over all of it.
        out[:, i] = F.scaled_dot_product_attention(q[:, i : i + 1], kk, vv, scale=scale)[:, 0]
    return out
