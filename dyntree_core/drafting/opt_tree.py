"""OPT-Tree (Wang et al., TACL 2025; notes/opttree.md §1): layer-wise global top-n by path
probability p̂ with the δ stopping rule, final selection of the n best nodes.

Decisions:

* n = ``cfg.budget - 1`` (the paper's node budget n excludes the root; our budget includes it).
  Each layer is the global top-n over all children of the previous layer (Algorithm 1,
  ``topk(P_d(T), n)``), so the layer width is n, as in the paper — ``cfg.width`` is *not* used:
  a narrower layer breaks the optimality result (the final T_opt is the exact maximiser of
  Σ p̂ over n-node root subtrees of depth <= d, notes §1.2).
* δ = ``cfg.threshold``: drafting continues while the new layer raised ``E_sub(T, n)`` (sum of the
  n largest p̂) by more than δ, and while the depth is below ``cfg.depth``.
* Pruning that changes nothing: only last-layer nodes whose p̂ exceeds the current n-th largest
  p̂ of T are forwarded (children of the others can never enter the top n: at least n shallower
  nodes already beat them), so a draft forward never carries hopeless nodes; likewise children
  at or below that cut are never created (one comparison pass instead of a top-k). Neither
  changes the result. Zero-probability candidates are never added.
* Ties in the final top-n break towards shallower, then earlier nodes, so the selection is
  always ancestor-closed even when a draft probability is exactly 1 (Theorem 3.1 is strict only
  for p_d < 1).
* The tree is deterministic top-k (``topk``) whatever the temperature; p̂ uses the source's
  rows (draft temperature applied by the source). The returned tree is the selected subset, so
  ``source_index`` maps it back to the working tree the source saw.

Calls per step: 1 (root) + one per additional layer (<= ``cfg.depth``).
"""

from __future__ import annotations

import heapq

import torch

from ..tree import TokenTree
from .builder import TreeBuilder
from .drafter import CountingSource, Drafter
from .siblings import top_children


class OptTreeDrafter(Drafter):
    name = "opt_tree"

    def _draft(
        self, source: CountingSource, root_token: int, generator: torch.Generator, deterministic: bool
    ) -> TokenTree:
        n, delta, max_depth = self.cfg.budget - 1, float(self.cfg.threshold), self.depth
        b = TreeBuilder(root_token)
        p_hat = b.value
        values: list[float] = []  # p̂ of all non-root nodes, kept sorted descending

        def e_sub() -> float:
            return sum(values[:n])

        def add_layer(parents: list[int]) -> list[int]:
            rows = b.request(source, parents)
            cut = values[n - 1] if len(values) >= n else 0.0  # children at or below can never count
            kids = top_children(rows, [p_hat[u] for u in parents], cut, n)
            cands = [(-p_hat[u] * q, i, j) for i, u in enumerate(parents) for j, (_, q) in enumerate(kids[i])]
            chosen = sorted((i, j) for _, i, j in heapq.nsmallest(n, cands))  # global top-n, then BFS
            layer = []
            for i, j in chosen:
                u = parents[i]
                tok, q = kids[i][j]
                layer.append(b.add(u, tok, q, p_hat[u] * q))
            values.extend(p_hat[x] for x in layer)
            values.sort(reverse=True)
            return layer

        layer = add_layer([0])
        depth, e_prev = 1, 0.0
        while layer and depth < max_depth and e_sub() - e_prev > delta:
            e_prev = e_sub()
            cut = values[n - 1] if len(values) >= n else 0.0
            expand = [u for u in layer if p_hat[u] > cut]
            if not expand:
                break
            layer = add_layer(expand)
            depth += 1
        # final selection: n largest p̂, ties -> shallower, then earlier
        ranked = sorted(range(1, b.size), key=lambda x: (-p_hat[x], b.depth[x], x))[:n]
        keep = [0] + sorted(ranked)
        return b.build("topk", keep=keep)
