"""KV-cache bookkeeping for tree steps: length queries and accepted-path compaction.

Works on transformers' ``DynamicCache`` (per-layer ``keys``/``values`` of shape
``[B, H_kv, L, D]``). After a tree forward the cache holds ``prefix + fed tree nodes``; the
accepted path is gathered into contiguous slots right after the prefix and the rest dropped.
"""

from __future__ import annotations

from typing import Sequence

import torch


def cache_length(cache) -> int:
    """Number of cached positions (0 for an empty cache)."""
    return int(cache.get_seq_length()) if cache is not None else 0


def compact(cache, keep: int, extra_slots: Sequence[int]) -> None:
    """Keep slots ``[0, keep)`` followed by ``extra_slots`` (in that order); drop the rest.

    ``extra_slots`` are absolute slot indices >= ``keep`` in increasing order (an accepted path's
    nodes were fed parents first). A contiguous run right after ``keep`` is the common case and
    costs only a crop.
    """
    extra = list(extra_slots)
    if extra and extra == list(range(keep, keep + len(extra))):
        _crop_to(cache, keep + len(extra))
        return
    if not extra:
        _crop_to(cache, keep)
        return
    for layer in cache.layers:
        if layer.keys is None or layer.keys.numel() == 0:
            continue
        idx = torch.tensor(extra, dtype=torch.long, device=layer.keys.device)
        layer.keys = torch.cat([layer.keys[:, :, :keep], layer.keys.index_select(2, idx)], dim=2)
        layer.values = torch.cat([layer.values[:, :, :keep], layer.values.index_select(2, idx)], dim=2)


def _crop_to(cache, length: int) -> None:
    for layer in cache.layers:
        if layer.keys is not None and layer.keys.shape[-2] > length:
            layer.keys = layer.keys[:, :, :length]
            layer.values = layer.values[:, :, :length]
