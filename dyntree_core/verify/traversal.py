"""Traversal Verification (Weng et al.): leaf-to-root, sequence-level acceptance.

Implemented in the recursive post-order form of ``notes/traversal.md`` §1.4, which is
equivalent to the paper's Algorithm 3. Each node u carries a sequence-level acceptance
probability ``p_u`` (1 at the root), its current target distribution ``Mb_u`` and the sibling
draft state ``Ms_u``. Children are visited in draw order with
``p_c = min(1, p_u * Mb_u(x_c) / Ms_u(x_c))``. When child c (and so its whole subtree) is
rejected, u is updated by eqs. (1)-(3):
``R = max(p_u Mb_u - Ms_u, 0)``, ``S = sum R``, ``p_u <- S / (S + 1 - p_u)``, ``Mb_u <- R / S``,
and ``Ms_u`` drops x_c (``swor``, eq. (2)) or stays (``iid``). Once all children are rejected,
u itself is accepted with probability ``p_u`` and the bonus token is drawn from ``Mb_u``.

Special rules: ``p = 1`` stays 1 (so the root is always accepted), ``p = 0`` rejects the node
and its whole subtree without drawing anything, ``S = 0`` leaves ``Mb_u`` unchanged.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ..tree import SampledKind, TokenTree
from .base import VerifyResult, check_compatible
from .common import (Decisions, DraftUpdate, NodeInputs, Outcome, ScriptedVerifier, SiblingDraft, check_new_sibling,
                     ratio_accept, residual_update)
from .rows import Target


class TraversalVerifier(ScriptedVerifier):
    """Traversal Verification for trees sampled with or without replacement.

    ``accept_prob[u]`` is the sequence-level probability ``p_u`` with which u's own test was
    run (after the updates from its rejected children); a node reached with ``p_u = 0`` is
    recorded as tested with probability 0 and its subtree is skipped. Nodes on the accepted
    path above the accepted node are accepted through their descendant's sequence-level test
    and carry no test of their own (NaN, ``tested`` False) unless they were tested earlier.

    ``draft_update``: see ``ScriptedVerifier``.
    """

    name = "traversal"
    accepts: frozenset[SampledKind] = frozenset({"swor", "iid"})

    def run(self, tree: TokenTree, target_probs: Target, decisions: Decisions) -> VerifyResult:
        """``verify`` with an explicit source of randomness (``target_probs``: ``[N, V]``)."""
        check_compatible(self, tree)
        walk = _Traversal(
            inputs=NodeInputs(self.name, tree, target_probs, need_draft=True),
            mode=self.draft_update or tree.sampled,  # type: ignore[arg-type]
            decisions=decisions,
        )
        hit = walk.visit(0, 1.0)
        if hit is None:
            raise RuntimeError("traversal rejected the root, whose p is 1 by construction")
        node, bonus_dist = hit
        bonus = decisions.categorical(bonus_dist)
        walk.outcome.decide("bonus", node, bonus, bonus_dist[bonus] / bonus_dist.sum(), math.nan, 1.0, True)
        return walk.outcome.result(tree.path_to(node), bonus, walk.inputs.p_target)


class _Traversal:
    """One traversal of one tree (the recursion depth is the tree depth)."""

    def __init__(self, inputs: NodeInputs, mode: DraftUpdate, decisions: Decisions):
        self.inputs = inputs
        self.mode = mode
        self.decisions = decisions
        self.outcome = Outcome(inputs.tree.size, decisions)

    def visit(self, u: int, p_u: float) -> Optional[tuple[int, np.ndarray]]:
        """Verify the subtree of ``u`` entered with sequence-level probability ``p_u``.

        Returns ``(accepted node, [V] bonus distribution)`` or None when the subtree is rejected.
        """
        if p_u <= 0.0:
            self.outcome.record(u, 0.0)
            self.outcome.decide("node", u, self.inputs.tokens[u], 0.0, math.nan, 0.0, False, drew=False)
            return None
        kids = self.inputs.children[u]
        mb: Optional[np.ndarray] = None  # a leaf's target row is read only if the leaf is accepted
        if kids:
            hit, p_u, mb = self._visit_children(u, p_u, self.inputs.target_row(u), kids)
            if hit is not None:
                return hit
        if u != 0:
            self.outcome.record(u, p_u)
            drew = p_u > 0.0
            accepted = drew and self.decisions.bernoulli(p_u)
            self.outcome.decide("node", u, self.inputs.tokens[u], p_u, math.nan, p_u, accepted, drew=drew)
            if not accepted:
                return None
        return u, (mb if mb is not None else self.inputs.target_row(u))

    def _visit_children(
        self, u: int, p_u: float, mb: np.ndarray, kids: list[int]
    ) -> tuple[Optional[tuple[int, np.ndarray]], float, np.ndarray]:
        """Visit ``u``'s children in draw order, updating ``(p_u, Mb_u)`` after each rejection."""
        draft = SiblingDraft(self.inputs.draft_row(u), self.mode)
        check_distinct = self.inputs.tree.sampled == "swor"
        seen: set[int] = set()
        for child in kids:
            if p_u <= 0.0:
                break  # every remaining child has p = 0: u is rejected whatever they do
            x = self.inputs.tokens[child]
            if check_distinct:
                check_new_sibling(u, child, x, seen)
            p_c = ratio_accept(p_u * mb[x], draft.q[x])
            self.outcome.decide("enter", child, x, p_u * mb[x], draft.q[x], p_c, p_c > 0.0, drew=False)
            hit = self.visit(child, p_c)
            if hit is not None:
                return hit, p_u, mb
            p_u, mb = residual_update(p_u, mb, draft.q)
            self.outcome.after_rejection(mb)
            draft.after_draw(x)
        return None, p_u, mb
