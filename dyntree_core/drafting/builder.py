"""``TreeBuilder``: the append-only working tree a drafter grows, turned into a ``TokenTree``."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from ..tree import SampledKind, TokenTree
from .base import DraftSource

NEG_INF = float("-inf")


class TreeBuilder:
    """Append-only working tree: nodes keep their token and parent once handed to the source.

    Node 0 is the root. ``value`` is the drafter's estimated acceptance value (root 1.0).
    Draft rows are kept as the batches the source returned; ``build`` copies only the rows of
    nodes that are internal in the returned tree into ``TokenTree.draft_probs``.
    """

    def __init__(self, root_token: int):
        self.tokens: list[int] = [int(root_token)]
        self.parents: list[int] = [-1]
        self.child_rank: list[int] = [0]
        self.logprob: list[float] = [0.0]
        self.value: list[float] = [1.0]
        self.depth: list[int] = [0]
        self.num_children: list[int] = [0]
        self._batches: list[torch.Tensor] = []
        self._row: dict[int, tuple[int, int]] = {}

    @property
    def size(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, prob: float, value: float, rank: Optional[int] = None) -> int:
        """Append a child of ``parent``; ``prob`` is its full (unconditioned) draft probability.

        ``rank`` is its draw order among its siblings (default: the order of ``add`` calls).
        """
        node = len(self.tokens)
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.child_rank.append(self.num_children[parent] if rank is None else int(rank))
        self.num_children[parent] += 1
        self.num_children.append(0)
        self.logprob.append(math.log(prob) if prob > 0 else NEG_INF)
        self.value.append(float(value))
        self.depth.append(self.depth[parent] + 1)
        return node

    def has_row(self, node: int) -> bool:
        return node in self._row

    def request(self, source: DraftSource, nodes: Sequence[int]) -> torch.Tensor:
        """One batched ``next_probs`` call for ``nodes``; returns their ``[len(nodes), V]`` rows."""
        nodes = [int(n) for n in nodes]
        rows = source.next_probs(list(self.tokens), list(self.parents), nodes)
        b = len(self._batches)
        self._batches.append(rows)
        for i, n in enumerate(nodes):
            self._row[n] = (b, i)
        return rows

    def row(self, node: int) -> torch.Tensor:
        """``[V]`` draft row of ``node`` (must have been requested)."""
        b, i = self._row[node]
        return self._batches[b][i]

    def build(self, sampled: SampledKind, keep: Optional[Sequence[int]] = None) -> TokenTree:
        """The ``TokenTree`` of the working tree, or of the sub-tree ``keep``.

        Args:
            sampled: sibling sampling kind of the tree.
            keep: working node ids to return, root first, every parent before its children and
                every kept node's parent kept. ``None`` keeps everything (identity numbering).
                With ``keep`` the tree's ``source_index`` maps each node to its working id,
                and child ranks are re-densified in draw order among the kept siblings.
        """
        ids = list(range(self.size)) if keep is None else [int(k) for k in keep]
        if not ids or ids[0] != 0:
            raise ValueError("the kept nodes must start with the root")
        new_of = {old: new for new, old in enumerate(ids)}
        parents = [-1]
        for old in ids[1:]:
            p = self.parents[old]
            if p not in new_of or new_of[p] >= new_of[old]:
                raise ValueError(f"kept node {old} has parent {p} missing or after it")
            parents.append(new_of[p])
        if keep is None:
            ranks = [self.child_rank[i] for i in ids]
        else:
            by_parent: dict[int, list[int]] = {}
            for new, old in enumerate(ids[1:], start=1):
                by_parent.setdefault(parents[new], []).append(new)
            ranks = [0] * len(ids)
            for kids in by_parent.values():
                for r, c in enumerate(sorted(kids, key=lambda c: self.child_rank[ids[c]])):
                    ranks[c] = r
        internal = sorted({p for p in parents[1:]})
        # gather the rows of internal nodes, one index_select per source batch
        draft_row = [-1] * len(ids)
        per_batch: dict[int, list[tuple[int, int]]] = {}
        for new in internal:
            old = ids[new]
            if old not in self._row:
                raise RuntimeError(f"internal node {old} has no draft distribution")
            b, i = self._row[old]
            per_batch.setdefault(b, []).append((new, i))
        draft_probs: Optional[torch.Tensor] = None
        if per_batch:
            first = self._batches[min(per_batch)]
            total = sum(len(e) for e in per_batch.values())
            draft_probs = torch.empty((total, first.shape[1]), dtype=torch.float32, device=first.device)
            next_row = 0
            for bi in sorted(per_batch):  # one copy of each needed row, straight into the output
                entries = per_batch[bi]
                batch = self._batches[bi].float()
                idx = torch.tensor([i for _, i in entries], dtype=torch.long, device=batch.device)
                torch.index_select(batch, 0, idx, out=draft_probs[next_row : next_row + len(entries)])
                for new, _ in entries:
                    draft_row[new] = next_row
                    next_row += 1
        return TokenTree(
            tokens=torch.tensor([self.tokens[i] for i in ids], dtype=torch.long),
            parents=torch.tensor(parents, dtype=torch.long),
            child_rank=torch.tensor(ranks, dtype=torch.long),
            draft_logprob=torch.tensor([self.logprob[i] for i in ids], dtype=torch.float64),
            sampled=sampled,
            draft_probs=draft_probs,
            draft_row=torch.tensor(draft_row, dtype=torch.long),
            value=torch.tensor([self.value[i] for i in ids], dtype=torch.float64),
            source_index=None if keep is None else torch.tensor(ids, dtype=torch.long),
        )
