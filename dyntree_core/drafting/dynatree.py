"""DynaTree (Chen, Liu, Li; notes/dynatree.md §1): confidence-aware branching, depth gating,
probability pruning and a node budget, with history-based retuning.

Breadth-first, one batched ``next_probs`` call per layer (the paper forwards node by node).
For a node u with cumulative draft path probability p(u) (root 1) at depth d(u) (root 0):

* expandable(u) ⟺ d(u) < D_max ∧ p(u) >= ρ_stop ∧ p(u) >= τ ∧ (d(u) < D0 ∨ p(u) >= ρ_deep)
  (§3.3). Our root is the committed bonus token, not the draft's top-1 guess (notes §5:
  rooting at the known token wastes no iteration), so drafted tokens sit at depths 1..D_max —
  the code's convention (longest path = D_max drafted tokens).
* branching from the confidence c(u) = max q(·|u): B_min if c >= τ_h, B_max if c < τ_ℓ, else
  B_mid (the paper's >= for τ_h; the code uses >). Children = the top-B(u) tokens.
* pruning: a child whose path probability falls below τ is not added (the paper's text
  "prune u"; adding then removing it would only waste budget — its own children could never be
  expanded since τ bounds expansion too).
* budget: at most N_max nodes incl. the root; children are added in breadth-first order until
  the budget is reached (Algorithm 1 line 28). Of a layer's expandable nodes only the first
  ``N_max - |T|`` are requested (each expanded node adds at least one child unless pruned).

Config mapping (``DynaTreeParams.from_config``): N_max = ``cfg.budget``; D_max = ``cfg.depth``;
D0 = ⌈5/8·D_max⌉ clamped to [1, D_max-1] (the paper's 5 of 8); τ = ρ_stop = ``cfg.threshold``
(both are plain "do not expand" cut-offs, so the effective threshold is max(τ, ρ_stop), notes §7;
the code default 0.05 is the config default); ρ_deep = max(0.5, τ); (τ_ℓ, τ_h) = (0.4, 0.9)
(App. A); (B_min, B_mid, B_max) = (1, 2, 3) (App. A / code), each capped by ``cfg.width``.

History adjustment (decision: per iteration within one generation, as in the paper §3.3;
``reset()`` restores the initial parameters for a new prompt — the official code instead
updates once per prompt and keeps the history across prompts). After each verification
``observe(tree, accepted)`` appends a_r = accepted / (max depth of the drafted tree) ∈ [0, 1] (the
fraction of the drafted depth that was committed; the paper's "fraction of drafted tokens"
cannot reach the code's 0.7 target with bushy trees). With >= 5 entries, ā = mean of the last
W = 10: ā > 0.8 -> D0+1, τ_h-0.05, ρ_deep-0.05; ā < 0.6 -> the reverse; clamps D0 ∈ [2, D_max-1],
τ_h ∈ [0.5, 0.95], ρ_deep ∈ [0.3, 0.8] (the code's schedule and clamps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

from ..config import DecodeConfig
from ..tree import TokenTree
from .builder import TreeBuilder
from .drafter import CountingSource, Drafter
from .siblings import top_children


@dataclass(frozen=True)
class DynaTreeParams:
    """DynaTree hyper-parameters (see the module docstring for the defaults' sources)."""

    n_max: int
    d_max: int
    d0: int
    b_min: int = 1
    b_mid: int = 2
    b_max: int = 3
    tau_h: float = 0.9
    tau_l: float = 0.4
    rho_stop: float = 0.05
    rho_deep: float = 0.5
    tau_prune: float = 0.05
    window: int = 10
    min_history: int = 5
    target_rate: float = 0.7
    band: float = 0.1
    step: float = 0.05

    def __post_init__(self) -> None:
        if not (1 <= self.b_min <= self.b_mid <= self.b_max):
            raise ValueError("DynaTree needs 1 <= B_min <= B_mid <= B_max")
        if not (0.0 < self.tau_l < self.tau_h < 1.0):
            raise ValueError("DynaTree needs 0 < tau_l < tau_h < 1")
        if self.n_max < 2 or self.d_max < 1 or self.d0 < 1:
            raise ValueError("DynaTree needs n_max >= 2, d_max >= 1, d0 >= 1")

    @staticmethod
    def from_config(cfg: DecodeConfig) -> "DynaTreeParams":
        d_max = cfg.depth
        d0 = max(1, min(math.ceil(5 * d_max / 8), d_max - 1)) if d_max > 1 else 1
        w = cfg.width
        return DynaTreeParams(
            n_max=cfg.budget,
            d_max=d_max,
            d0=d0,
            b_min=1,
            b_mid=min(2, w),
            b_max=min(3, w),
            rho_stop=cfg.threshold,
            tau_prune=cfg.threshold,
            rho_deep=max(0.5, cfg.threshold),
        )

    def branches(self, confidence: float) -> int:
        """B(u) from the confidence c(u) (paper rule, >= at τ_h)."""
        if confidence >= self.tau_h:
            return self.b_min
        if confidence < self.tau_l:
            return self.b_max
        return self.b_mid

    def expandable(self, depth: int, prob: float) -> bool:
        """Depth gating and early stopping for a node at ``depth`` with path probability ``prob``."""
        if depth >= self.d_max or prob < self.rho_stop or prob < self.tau_prune:
            return False
        return depth < self.d0 or prob >= self.rho_deep


class DynaTreeDrafter(Drafter):
    name = "dynatree"

    def __init__(self, cfg: DecodeConfig, params: Optional[DynaTreeParams] = None):
        super().__init__(cfg)
        self.initial_params = params if params is not None else DynaTreeParams.from_config(cfg)
        self.params = self.initial_params
        self.history: list[float] = []

    def reset(self, prompt: Sequence[int] = ()) -> None:
        self.params = self.initial_params
        self.history = []

    def observe(self, tree: TokenTree, accepted_nodes: int) -> None:
        depth = int(tree.depth.max().item()) if tree.size > 1 else 0
        self.history.append(min(1.0, accepted_nodes / depth) if depth > 0 else 0.0)
        self.history = self.history[-self.params.window :]
        if len(self.history) < self.params.min_history:
            return
        mean = sum(self.history) / len(self.history)
        p = self.params
        lo_d0 = max(1, min(2, p.d_max - 1))
        hi_d0 = max(lo_d0, p.d_max - 1)
        if mean > p.target_rate + p.band:
            self.params = replace(
                p, d0=min(p.d0 + 1, hi_d0), tau_h=max(p.tau_h - p.step, 0.5, p.tau_l + 1e-6), rho_deep=max(p.rho_deep - p.step, 0.3)
            )
        elif mean < p.target_rate - p.band:
            self.params = replace(
                p, d0=max(p.d0 - 1, lo_d0), tau_h=min(p.tau_h + p.step, 0.95), rho_deep=min(p.rho_deep + p.step, 0.8)
            )

    def _draft(
        self, source: CountingSource, root_token: int, generator: torch.Generator, deterministic: bool
    ) -> TokenTree:
        prm = self.params
        b = TreeBuilder(root_token)
        prob = b.value  # cumulative draft path probability p(u)
        layer = [0]
        while layer and b.size < prm.n_max:
            expand = [u for u in layer if prm.expandable(b.depth[u], prob[u])]
            expand = expand[: prm.n_max - b.size]
            if not expand:
                break
            rows = b.request(source, expand)
            kids = top_children(rows, [prob[u] for u in expand], 0.0, prm.b_max)
            nxt = []
            for i, u in enumerate(expand):
                if not kids[i]:
                    continue
                for tok, q in kids[i][: prm.branches(kids[i][0][1])]:
                    child_p = prob[u] * q
                    if child_p < prm.tau_prune or b.size >= prm.n_max:
                        break
                    nxt.append(b.add(u, tok, q, child_p))
            layer = nxt
        return b.build("topk")
