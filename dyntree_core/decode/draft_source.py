"""``ModelDraftSource``: the draft model behind the ``DraftSource`` protocol.

Every ``next_probs`` call is one batched draft forward over the requested nodes and their
not-yet-cached ancestors, with a tree mask; the KV of every forwarded node stays in the draft
cache so later calls (deeper layers, lazily evaluated heap nodes) only feed new nodes. After
verification ``commit_path`` keeps the accepted path's KV and drops the rest.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Optional, Sequence

import torch

from .forward import masked_forward
from .kv import cache_length, compact
from ..sampling import probs_from_logits


class ModelDraftSource:
    """Draft distributions for one decoding step.

    Args:
        model: the draft HF model.
        cache: its ``kv.KVCache`` holding the first ``cache_length(cache)`` committed tokens.
        pending: committed tokens not yet in the cache; ``pending[-1]`` is the tree root.
        temperature: draft temperature (> 0).
        attn_kwargs: extra model-call keyword arguments for the attention function
            (``forward.masked_forward``).
    """

    def __init__(self, model, cache, pending: Sequence[int], temperature: float,
                 attn_kwargs: Optional[Mapping[str, Any]] = None):
        if not pending:
            raise ValueError("the draft source needs at least the root token pending")
        self.model = model
        self.cache = cache
        self.pending = list(pending)
        self.temperature = temperature
        self.attn_kwargs = attn_kwargs
        from ..quant.apply import output_dim

        self.vocab_size = output_dim(model)
        self.base = cache_length(cache)
        self.slot: dict[int, int] = {}  # tree node -> absolute cache slot
        self._pre_fed = False
        self._calls = 0
        self.forward_seconds = 0.0

    @property
    def forward_calls(self) -> int:
        return self._calls

    @property
    def root_position(self) -> int:
        return self.base + len(self.pending) - 1

    def next_probs(self, tokens: Sequence[int], parents: Sequence[int], nodes: Sequence[int]) -> torch.Tensor:
        """``[len(nodes), V]`` float32 CPU draft distributions at ``nodes``."""
        t0 = time.perf_counter()
        need: set[int] = set()
        for n in nodes:
            v = int(n)
            while v >= 0 and v not in self.slot and v not in need:
                need.add(v)
                v = int(parents[v])
        new = sorted(need)
        pre = [] if self._pre_fed else self.pending[:-1]
        start = cache_length(self.cache)
        q = len(pre) + len(new)
        kv_len = start + q
        visible = torch.zeros(q, kv_len, dtype=torch.bool)
        prefix_end = self.base + len(self.pending) - 1  # committed tokens before the root
        positions: list[int] = []
        feed: list[int] = []
        for j, tok in enumerate(pre):
            visible[j, : start + j + 1] = True
            positions.append(start + j)
            feed.append(tok)
        new_slot = {n: start + len(pre) + i for i, n in enumerate(new)}
        for i, n in enumerate(new):
            row = len(pre) + i
            visible[row, :prefix_end] = True
            v, depth = n, 0
            while v >= 0:
                visible[row, self.slot.get(v, new_slot.get(v, -1))] = True
                v = int(parents[v])
                depth += 1
            positions.append(self.root_position + depth - 1)
            feed.append(int(tokens[n]))
        self.slot.update(new_slot)
        self._pre_fed = True
        rows = [new_slot[int(n)] - start if int(n) in new_slot else None for n in nodes]
        if any(r is None for r in rows):
            raise RuntimeError("next_probs asked twice for a node; drafters must cache distributions")
        logits = masked_forward(self.model, self.cache, feed, positions, visible, logits_rows=rows,
                                attn_kwargs=self.attn_kwargs)
        probs = probs_from_logits(logits, self.temperature).cpu()
        self._calls += 1
        self.forward_seconds += time.perf_counter() - t0
        return probs

    # ------------------------------------------------------------------ device-side drafting
    def reserve(self, rows: int) -> None:
        """At most ``rows`` tree rows will be forwarded this step through ``expand``."""
        dev = self.model.get_input_embeddings().weight.device
        self._anc = torch.zeros(rows, rows, dtype=torch.bool, device=dev)
        self._rows = 0

    def expand(self, tokens: torch.Tensor, parent_rows: torch.Tensor, live: torch.Tensor,
               depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One batched draft forward of a tree level, entirely on the device (``drafting.device``).

        Args:
            tokens: ``[m]`` int64 tokens of the level's rows (device).
            parent_rows: ``[m]`` int64 row id (an earlier ``expand``'s) of each row's parent, -1 for
                the root.
            live: ``[m]`` bool; dead rows are forwarded (static shapes) but see only the prefix and
                themselves, and no row ever sees them.
            depth: the level's depth below the root (every row of a level has the same position).
        Returns:
            ``([m, V]`` float32 draft probabilities on the device, ``[m]`` int64 row ids).
        """
        dev = tokens.device
        m = int(tokens.shape[0])
        first, r0 = self._rows, self._rows
        if r0 + m > self._anc.shape[0]:
            raise RuntimeError(f"expand: {r0 + m} rows exceed the {self._anc.shape[0]} reserved")
        ids = torch.arange(r0, r0 + m, device=dev)
        par = torch.where(live & (parent_rows >= 0), parent_rows, ids)  # dead rows: no ancestors
        self._anc[r0:r0 + m, : r0 + m] = self._anc[par, : r0 + m]
        self._anc[ids, ids] = True
        self._rows = r0 + m
        pre = [] if self._pre_fed else self.pending[:-1]
        start = cache_length(self.cache)
        tree_start = start + len(pre) - first  # cache slot of row 0
        q = len(pre) + m
        visible = torch.zeros(q, start + q, dtype=torch.bool, device=dev)
        prefix_end = self.base + len(self.pending) - 1
        if pre:
            visible[: len(pre), : start + len(pre)] = torch.ones(len(pre), start + len(pre), dtype=torch.bool,
                                                                 device=dev).tril(start)
        visible[len(pre):, :prefix_end] = True
        visible[len(pre):, tree_start:tree_start + r0 + m] = self._anc[r0:r0 + m, : r0 + m]
        feed = torch.cat([torch.tensor(pre, dtype=torch.long, device=dev), tokens]) if pre else tokens
        positions = torch.arange(start, start + q, device=dev)
        positions[len(pre):] = self.root_position + depth
        self._pre_fed = True
        self._tree_start = tree_start
        t0 = time.perf_counter()  # the forward's host time (its launches on CUDA)
        logits = masked_forward(self.model, self.cache, feed, positions, visible,
                                logits_rows=range(len(pre), q) if pre else None, attn_kwargs=self.attn_kwargs)
        probs = probs_from_logits(logits, self.temperature)
        self.forward_seconds += time.perf_counter() - t0
        self._calls += 1
        return probs, ids

    def commit_rows(self, path_rows: Sequence[int]) -> int:
        """``commit_path`` for a tree drafted through ``expand``: ``path_rows`` are the accepted
        nodes' row ids, root first (-1: never forwarded). Returns the committed tokens now cached."""
        keep = self.base + (len(self.pending) - 1 if self._pre_fed else 0)
        extra: list[int] = []
        if self._pre_fed:
            for r in path_rows:
                if r < 0:
                    break
                extra.append(self._tree_start + int(r))
        compact(self.cache, keep, extra)
        return keep + len(extra)

    def commit_path(self, path_source_ids: Sequence[int]) -> int:
        """Keep the committed prefix and the forwarded nodes of the accepted path.

        Args:
            path_source_ids: accepted node ids (root first) in this source's numbering.
        Returns:
            the number of committed tokens now cached.
        """
        keep = self.base + (len(self.pending) - 1 if self._pre_fed else 0)
        extra: list[int] = []
        if self._pre_fed:
            for n in path_source_ids:
                if n not in self.slot:
                    break
                extra.append(self.slot[n])
        compact(self.cache, keep, extra)
        return keep + len(extra)


class NoModelSource:
    """The ``DraftSource`` of model-free drafters (``methods.MethodSpec.uses_draft_model`` False):
    asking it for a distribution is a bug, and there is no draft cache to keep."""

    def __init__(self, vocab_size: int):
        self.vocab_size = int(vocab_size)
        self.forward_calls = 0
        self.forward_seconds = 0.0

    def next_probs(self, tokens: Sequence[int], parents: Sequence[int], nodes: Sequence[int]) -> torch.Tensor:
        raise RuntimeError("a model-free drafter asked for draft-model distributions")

    def commit_path(self, path_source_ids: Sequence[int]) -> int:
        return 0
