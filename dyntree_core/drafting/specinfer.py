"""SpecInfer k×L drafting: k = ``cfg.width`` independent chains of length L = ``cfg.depth``
sharing the root, i.e. ``1 + k·L`` nodes (not capped by the budget).

Stochastic: the k first-level tokens are i.i.d. draws *with replacement* from the root's draft
distribution (duplicates possible, ``iid``), and each chain continues with one i.i.d. draw per
level. Deterministic: the root's top-k distinct tokens, then the argmax per chain (k identical
greedy chains would be pointless), marked ``topk``.
Calls: one batched ``next_probs`` per level, L in total (the root, then the k chain tips).
"""

from __future__ import annotations

import torch

from ..tree import TokenTree
from .builder import TreeBuilder
from .drafter import CountingSource, Drafter
from .siblings import iid_draws, sibling_orders


class SpecInferDrafter(Drafter):
    name = "specinfer"

    def _draft(
        self, source: CountingSource, root_token: int, generator: torch.Generator, deterministic: bool
    ) -> TokenTree:
        k, depth = self.cfg.width, self.depth
        b = TreeBuilder(root_token)
        rows = b.request(source, [0])
        if deterministic:
            toks, probs = sibling_orders(rows, k, generator, True)
        else:
            toks, probs = iid_draws(rows, k, generator)
        tips = []
        for t, p in zip(toks[0].tolist(), probs[0].tolist()):
            tips.append(b.add(0, t, p, p))
        for _ in range(depth - 1):
            rows = b.request(source, tips)
            if deterministic:
                toks, probs = sibling_orders(rows, 1, generator, True)
            else:
                toks, probs = iid_draws(rows, 1, generator)
            new_tips = []
            for i, node in enumerate(tips):
                p = float(probs[i, 0])
                new_tips.append(b.add(node, int(toks[i, 0]), p, b.value[node] * p))
            tips = new_tips
        return b.build(self.sampled_kind(deterministic))
