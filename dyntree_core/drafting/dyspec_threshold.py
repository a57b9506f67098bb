"""DySpec threshold construction, layer by layer (DySpec Algorithm 2, App. A.2; §4.4).

Every node of the current layer whose value reaches the threshold t = ``cfg.threshold`` is
expanded: its distribution is fetched (one batched ``next_probs`` call per layer) and draws
are made from it while the draw's key is >= t. Line 9 of the paper's Algorithm 2 reads
``while v_i < t`` — a typo for ``v_i >= t`` (§4.4: "extend all nodes with estimated
acceptance rate above the threshold"; with ``<`` the root, v = 1, would never expand).

Keys follow the greedy drafter (``dyspec_greedy``) so that the threshold tree is the greedy
tree cut at value t (App. A.1: "If we set the threshold to be the same as the acceptance rate
of the last token, we will exactly get the same result"):

* stochastic (``swor``): Algorithm 2 verbatim — the k-th draw at u is made while
  ``v = w(u)·(1 - Σ_{j<k} q_u(y_j)) >= t``; each child's value is ``w(u)·q_u(y)``.
* deterministic (``topk``): a child is added while its own weight ``w(u)·q_u(y) >= t``, so the
  tree is exactly the set of nodes of weight >= t (root-connected because weights shrink
  along paths) — the App. D.1 max-weight subtree of that size.

Only nodes with ``w(u) >= t`` are requested: in the stochastic mode exactly the nodes that draw
at least once (their first key is ``w(u)``) unless the budget cap binds in that layer (then
at most the r = remaining-budget heaviest parents are requested, and some may lose every slot
to their heavier neighbours' later draws); in the deterministic mode a requested node may still
add no child when ``w(u)·max q_u < t`` (the distribution is needed to know).

Caps: depth ``cfg.depth``; budget ``cfg.budget`` — when a layer's admissible draws exceed the
remaining budget, the draws with the highest keys are kept (a global merge across the layer's
parents; keys fall along each parent's draw sequence, so every parent keeps a prefix of its
draws and no kept draw depends on its own outcome). The deterministic children are found by
one comparison pass (``top_children``: tokens with ``w(u)·q >= t``), not a vocabulary top-k.
Calls per step: at most ``cfg.depth`` (one per expanded layer).
"""

from __future__ import annotations

import heapq
from typing import Sequence

import torch

from ..config import DecodeConfig
from ..tree import TokenTree
from .builder import TreeBuilder
from .drafter import CountingSource, Drafter
from .siblings import SiblingSampler, top_children
from .threshold_control import ThresholdController


class DySpecThresholdDrafter(Drafter):
    """With ``cfg.adaptive_threshold`` the threshold is retuned after every step by a
    ``ThresholdController`` so the tree size tracks ``cfg.budget`` (DySpec's open problem: a
    fixed threshold under-uses the budget); ``reset()`` restores ``cfg.threshold``."""

    name = "dyspec_threshold"

    def __init__(self, cfg: DecodeConfig):
        super().__init__(cfg)
        self.reset()

    def reset(self, prompt: Sequence[int] = ()) -> None:
        self.threshold = float(self.cfg.threshold)
        self.controller = (
            ThresholdController(self.cfg.budget, self.threshold, cap=self.cfg.budget)
            if self.cfg.adaptive_threshold else None
        )

    def observe(self, tree: TokenTree, accepted_nodes: int) -> None:
        if self.controller is not None:
            self.threshold = self.controller.update(tree.size)

    def _draft(
        self, source: CountingSource, root_token: int, generator: torch.Generator, deterministic: bool
    ) -> TokenTree:
        t, budget, max_depth = self.threshold, self.cfg.budget, self.depth
        vocab = int(source.vocab_size)
        b = TreeBuilder(root_token)
        w = b.value
        layer = [0]
        while layer and b.size < budget:
            expand = [u for u in layer if b.depth[u] < max_depth and w[u] >= t]
            if not expand:
                break
            r = budget - b.size
            if not deterministic and len(expand) > r:
                # a parent ranked below r by w(u) cannot win a slot: r others' first keys beat it
                keep = set(sorted(expand, key=lambda u: (-w[u], u))[:r])
                expand = [u for u in expand if u in keep]
            rows = b.request(source, expand)
            draws: list[tuple[int, int, int, float]] = []  # (parent slot, rank, token, q)
            if deterministic:
                # children with w(u)·q >= t only (no top-k over the vocabulary); the budget cap
                # keeps the heaviest across the layer — a prefix of each parent's children
                kids = top_children(rows, [w[u] for u in expand], t * (1 - 1e-12), r)
                cands = [(-w[expand[i]] * q, i, j, tok, q) for i, ks in enumerate(kids) for j, (tok, q) in enumerate(ks) if w[expand[i]] * q >= t]
                draws = [(i, j, tok, q) for _, i, j, tok, q in heapq.nsmallest(r, cands)]
            else:
                sampler = SiblingSampler(rows, generator, False, min(r, vocab))
                # merge the parents' draw sequences by key v = w(u)·(remaining mass)
                heap = [(-w[u], i) for i, u in enumerate(expand)]
                heapq.heapify(heap)
                while heap and len(draws) < r and -heap[0][0] >= t:
                    _, i = heapq.heappop(heap)
                    rank = sampler.count[i]
                    drawn = sampler.draw(i)
                    if drawn is None:
                        continue
                    draws.append((i, rank, drawn[0], drawn[1]))
                    if not sampler.exhausted(i):
                        heapq.heappush(heap, (-w[expand[i]] * sampler.remaining(i), i))
            draws.sort()  # breadth-first: by parent, siblings in draw order
            nxt = []
            for i, _, tok, q in draws:
                u = expand[i]
                nxt.append(b.add(u, tok, q, w[u] * q))
            layer = nxt
        return b.build(self.sampled_kind(deterministic))
