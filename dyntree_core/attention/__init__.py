"""Tree attention: masks and block metadata, Triton kernel, torch references, HF glue.

Typical direct use (one sequence, ``[H, L, D]`` tensors)::

    meta = meta_from_tree(tree, prefix_len, "dfs", block_q=default_block_q(G), block_n=32, device="cuda")
    out = tree_attention(q, k, v, meta, backend="auto")

HF models: ``use_tree_attention(model, "auto")`` (see ``hf_backend``); importing
``dyntree_core.attention.hf_backend`` needs transformers.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch

from dyntree_core.attention.mask import (
    BlockLists,
    TreeAttnMeta,
    attention_mask_4d,
    build_block_lists,
    dense_prefix_len,
    interval_mask,
    is_preorder,
    meta_from_mask,
    meta_from_tree,
    order_permutation,
    subtree_end,
    tree_mask,
)
from dyntree_core.attention import auto_table
from dyntree_core.attention.reference import manual_attention, path_oracle, sdpa_reference
from dyntree_core.attention.triton_kernel import HAS_TRITON, default_block_q, interpreting, triton_tree_attention


def meta_full_mask(meta: TreeAttnMeta, device: torch.device | str) -> torch.Tensor:
    """``[Q, P + W]`` bool mask equivalent to ``meta`` (dense prefix + tree part)."""
    q, w = meta.blocks.n_q, meta.blocks.width
    if meta.end is not None:
        tree_part = interval_mask(meta.end.cpu())
    else:
        tree_part = meta.mask.cpu()
    full = torch.cat([torch.ones(q, meta.prefix_len, dtype=torch.bool), tree_part[:, :w]], dim=1)
    if meta.dead_rows is not None:
        full[meta.dead_rows.cpu()] = False
    return full.to(device)


def tree_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: TreeAttnMeta,
    backend: Literal["auto", "triton", "torch"] = "auto", sm_scale: Optional[float] = None,
) -> torch.Tensor:
    """q ``[Hq, Q, D]``, k/v ``[Hkv, P + W, D]`` -> ``[Hq, Q, D]``.

    ``auto`` runs what ``auto_table`` chooses for this size, prefix and device (without a measured
    table: the Triton kernel on CUDA, the pure-torch path ``manual_attention`` elsewhere).
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown backend {backend!r}")
    if backend == "auto" and HAS_TRITON and (q.is_cuda or interpreting()):
        backend = auto_table.choose(q.device, q.shape[1], meta.prefix_len, meta.end is not None)
    if backend == "triton":
        return triton_tree_attention(q, k, v, meta, sm_scale=sm_scale)
    mask = meta_full_mask(meta, q.device)
    return manual_attention(q, k[:, : mask.shape[1]], v[:, : mask.shape[1]], mask, sm_scale)


__all__ = [
    "BlockLists", "TreeAttnMeta", "attention_mask_4d", "build_block_lists", "dense_prefix_len",
    "interval_mask", "is_preorder", "meta_from_mask", "meta_from_tree", "order_permutation",
    "subtree_end", "tree_mask", "manual_attention", "path_oracle", "sdpa_reference", "HAS_TRITON",
    "default_block_q", "interpreting", "triton_tree_attention", "tree_attention", "meta_full_mask",
]
