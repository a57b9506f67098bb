"""The decode KV cache: per-layer key/value buffers preallocated to the run's maximum length,
filled in place, and the accepted path compacted in place by index copies.

``KVCache`` is a transformers ``Cache`` whose layers (``PreallocLayer``) hold ``[B, H_kv, C, D]``
buffers of capacity ``C`` and a length ``L``: a forward of ``q`` tokens copies their keys/values
into slots ``[L, L + q)`` and attends over the views ``buffer[:, :, :L + q]`` (same shapes and
values as a growing cache; no per-forward allocation, no ``torch.cat``). After a tree forward the
cache holds ``prefix + fed tree nodes``; ``compact`` moves the accepted path's slots right after the
prefix (one gather into a preallocated scratch and one copy per layer, on the cache's device) and
sets the length. A write past the capacity grows the buffers (doubling) — the engine sizes them so
that a run never does; ``new_cache(model)`` without a capacity starts small and grows (profiling,
tests).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

#: capacity of a cache made without one (it grows by doubling)
DEFAULT_CAPACITY = 256


def _filled(buffer: str) -> property:
    """The filled part ``[B, H_kv, L, D]`` of ``buffer`` (None before the first write). Assigning a
    tensor (as code written for ``DynamicLayer`` does, e.g. the machine profile's zero prefix) adopts
    it as the buffer."""

    def filled(layer: "PreallocLayer") -> Optional[torch.Tensor]:
        data = getattr(layer, buffer)
        return None if data is None else data[:, :, : layer.length]

    def adopt(layer: "PreallocLayer", value: Optional[torch.Tensor]) -> None:
        layer._adopt(buffer, value)

    return property(filled, adopt)


class PreallocLayer(CacheLayerMixin):
    """One decoder layer's keys and values in preallocated buffers (see the module docstring)."""

    is_sliding = False
    is_croppable = True

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self._k: Optional[torch.Tensor] = None
        self._v: Optional[torch.Tensor] = None
        self.capacity = max(1, int(capacity))
        self.length = 0
        self.grown = 0  # reallocations (a sized run has none)
        self._checked: Optional[torch.Tensor] = None  # the key buffer ``reserve`` last checked
        super().__init__()

    keys = _filled("_k")
    values = _filled("_v")

    def _adopt(self, name: str, value: Optional[torch.Tensor]) -> None:
        if value is None:
            return
        setattr(self, name, value)
        self._checked = None
        self.length = self.capacity = int(value.shape[-2])
        self.dtype, self.device = value.dtype, value.device
        self.is_initialized = self._k is not None and self._v is not None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h = key_states.shape[:2]
        self._k = torch.empty(b, h, self.capacity, key_states.shape[-1], dtype=self.dtype, device=self.device)
        self._v = torch.empty(b, h, self.capacity, value_states.shape[-1], dtype=self.dtype, device=self.device)
        self.is_initialized = True

    def _grow(self, needed: int) -> None:
        cap = max(needed, 2 * self.capacity)
        for name in ("_k", "_v"):
            old = getattr(self, name)
            new = torch.empty(*old.shape[:2], cap, old.shape[-1], dtype=old.dtype, device=old.device)
            new[:, :, : self.length].copy_(old[:, :, : self.length])
            setattr(self, name, new)
        self.capacity = cap
        self.grown += 1
        self._checked = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states``/``value_states`` ``[B, H_kv, q, D]``; returns the ``[B, H_kv, L + q, D]`` views."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            self._grow(end)
        self._k[:, :, self.length:end].copy_(key_states)
        self._v[:, :, self.length:end].copy_(value_states)
        self.length = end
        return self.keys, self.values

    def reserve(self, q: int, heads: int, head_dim: int, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Room for ``q`` more positions, for a writer that fills the slots itself (``quant.native_layer``).

        Returns the contiguous CPU ``[1, heads, C, head_dim]`` key and value buffers (C >= length + q) and the
        first free slot; the writer sets ``length`` once the slots hold the new positions.
        """
        if self.is_initialized and self.length + q <= self.capacity and self._checked is self._k:
            return self._k, self._v, self.length  # (the buffers were checked when they were made)
        if not self.is_initialized:
            self.dtype, self.device = dtype, torch.device("cpu")
            self._k = torch.empty(1, heads, self.capacity, head_dim, dtype=dtype)
            self._v = torch.empty(1, heads, self.capacity, head_dim, dtype=dtype)
            self.is_initialized = True
        if self.length + q > self.capacity or not (self._k.is_contiguous() and self._v.is_contiguous()):
            self._grow(self.length + q)
        for buf in (self._k, self._v):
            if (tuple(buf.shape) != (1, heads, self.capacity, head_dim) or buf.dtype != dtype
                    or buf.device.type != "cpu"):
                raise ValueError(f"cache buffer {tuple(buf.shape)} {buf.dtype} on {buf.device}, "
                                 f"not [1, {heads}, {self.capacity}, {head_dim}] {dtype} on the CPU")
        self._checked = self._k
        return self._k, self._v, self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1  # grows when a write exceeds the capacity

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' convention: a negative count removes that many slots, a positive value is the new length."""
        self.set_length(self.length + tokens_to_remove if tokens_to_remove < 0 else min(tokens_to_remove, self.length))

    def set_length(self, length: int) -> None:
        self.length = max(0, min(int(length), self.length))

    def reset(self) -> None:
        self.length = 0

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole ``[B, H_kv, C, D]`` key and value buffers (for tests and in-place compaction)."""
        return self._k, self._v


class KVCache(Cache):
    """One ``PreallocLayer`` per decoder layer of ``config``, each of ``capacity`` slots.

    Args:
        config: the model's config (its decoder's ``num_hidden_layers``).
        capacity: slots to preallocate per layer (prompt + new tokens + the largest tree for a run).
    """

    def __init__(self, config, capacity: int = DEFAULT_CAPACITY):
        text = config.get_text_config(decoder=True)
        super().__init__(layers=[PreallocLayer(capacity) for _ in range(int(text.num_hidden_layers))])
        self._scratch: Optional[torch.Tensor] = None
        self._index: Optional[torch.Tensor] = None

    @property
    def capacity(self) -> int:
        return min(layer.capacity for layer in self.layers)

    @property
    def reallocations(self) -> int:
        """Buffer reallocations so far, summed over layers (0 for a cache sized for its run)."""
        return sum(layer.grown for layer in self.layers)

    def compact(self, keep: int, extra_slots: Sequence[int]) -> None:
        """Keep slots ``[0, keep)`` followed by ``extra_slots`` (in that order); drop the rest.

        ``extra_slots``: absolute slot indices ``>= keep`` in increasing order (an accepted path's
        nodes were fed parents first), so ``keep + j <= extra_slots[j]``. A contiguous run right
        after ``keep`` only sets the length.
        """
        extra = [int(x) for x in extra_slots]
        m = len(extra)
        if any(b <= a for a, b in zip(extra, extra[1:])) or (extra and extra[0] < keep):
            raise ValueError(f"extra slots must be increasing and >= keep={keep}, got {extra}")
        if extra == list(range(keep, keep + m)):
            for layer in self.layers:
                layer.set_length(keep + m)
            return
        live = [layer for layer in self.layers if layer.is_initialized]
        if live:
            idx = self._index_of(extra, live[0].device)
            for layer in live:
                for buf in layer.buffers():
                    scratch = self._scratch_for(buf, m)
                    torch.index_select(buf, 2, idx, out=scratch)
                    buf[:, :, keep:keep + m].copy_(scratch)
        for layer in self.layers:
            layer.set_length(keep + m)

    def _index_of(self, slots: list[int], device: torch.device) -> torch.Tensor:
        m = len(slots)
        if self._index is None or self._index.numel() < m or self._index.device != device:
            self._index = torch.empty(max(m, 64), dtype=torch.long, device=device)
        host = torch.tensor(slots, dtype=torch.long)
        self._index[:m].copy_(host, non_blocking=True)
        return self._index[:m]

    def _scratch_for(self, buf: torch.Tensor, m: int) -> torch.Tensor:
        """A contiguous ``[B, H, m, D]`` view of a flat scratch buffer kept across steps."""
        b, h, _, d = buf.shape
        need = b * h * m * d
        if (self._scratch is None or self._scratch.numel() < need or self._scratch.dtype != buf.dtype
                or self._scratch.device != buf.device):
            self._scratch = torch.empty(max(need, b * h * 64 * d), dtype=buf.dtype, device=buf.device)
        return self._scratch[:need].view(b, h, m, d)


def new_cache(model, capacity: int = DEFAULT_CAPACITY) -> KVCache:
    """An empty ``KVCache`` for ``model`` with ``capacity`` slots per layer."""
    return KVCache(model.config, capacity)


def cache_length(cache) -> int:
    """Number of cached positions (0 for an empty cache)."""
    return int(cache.get_seq_length()) if cache is not None else 0


def compact(cache: KVCache, keep: int, extra_slots: Sequence[int]) -> None:
    """``cache.compact(keep, extra_slots)``: keep ``[0, keep)`` then ``extra_slots``, drop the rest."""
    cache.compact(keep, extra_slots)
