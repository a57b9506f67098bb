"""Token-level recursive rejection sampling (SpecInfer / Sequoia Alg. 1 / DySpec Alg. 3).

Top-down from the root: the children of the current node are tested in draw order, child x
with probability ``min(1, R(x) / D(x))`` where R is the target residual at the node and D the
distribution that child was drawn from. After a rejection ``R <- norm(max(R - D, 0))`` and, for
trees sampled without replacement, ``D <- norm(D with D(x) = 0)`` (uniform over undrawn tokens
once no draft mass is left); for i.i.d. trees D is unchanged. An accepted child becomes the
current node; when every child is rejected (or the node is a leaf) the bonus token is drawn
from R, which is the raw target distribution when no child was rejected there.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ..tree import SampledKind, TokenTree
from .base import VerifyResult, check_compatible
from .common import (
    Decisions,
    DraftUpdate,
    NodeInputs,
    Outcome,
    ScriptedVerifier,
    SiblingDraft,
    check_new_sibling,
    ratio_accept,
    residual_update,
)
from .rows import Target


class TokenLevelVerifier(ScriptedVerifier):
    """Recursive rejection sampling node by node.

    ``accept_prob[c]`` is ``min(1, R(x)/D(x))`` at the moment child c was tested.

    ``draft_update``: see ``ScriptedVerifier``.
    """

    name = "token_level"
    accepts: frozenset[SampledKind] = frozenset({"swor", "iid"})

    def run(self, tree: TokenTree, target_probs: Target, decisions: Decisions) -> VerifyResult:
        """``verify`` with an explicit source of randomness (``target_probs``: ``[N, V]``)."""
        check_compatible(self, tree)
        inputs = NodeInputs(self.name, tree, target_probs, need_draft=True)
        mode: DraftUpdate = self.draft_update or tree.sampled  # type: ignore[assignment]
        outcome = Outcome(tree.size, decisions)
        path = [0]
        while True:
            accepted, residual = self._test_children(inputs, path[-1], mode, outcome, decisions)
            if accepted is None:
                break
            path.append(accepted)
        bonus = decisions.categorical(residual)
        outcome.decide("bonus", path[-1], bonus, residual[bonus] / residual.sum(), math.nan, 1.0, True)
        return outcome.result(path, bonus, inputs.p_target)

    def _test_children(
        self, inputs: NodeInputs, node: int, mode: DraftUpdate, outcome: Outcome, decisions: Decisions
    ) -> tuple[Optional[int], np.ndarray]:
        """Test ``node``'s children in draw order.

        Returns the accepted child (None if all were rejected) and the ``[V]`` target residual
        at ``node`` after the rejections.
        """
        residual = inputs.target_row(node)
        kids = inputs.children[node]
        if not kids:
            return None, residual
        draft = SiblingDraft(inputs.draft_row(node), mode)
        check_distinct = inputs.tree.sampled == "swor"
        seen: set[int] = set()
        for child in kids:
            x = inputs.tokens[child]
            if check_distinct:
                check_new_sibling(node, child, x, seen)
            a = ratio_accept(residual[x], draft.q[x])
            outcome.record(child, a)
            accepted = decisions.bernoulli(a)
            outcome.decide("child", child, x, residual[x], draft.q[x], a, accepted)
            if accepted:
                return child, residual
            _, residual = residual_update(1.0, residual, draft.q)
            outcome.after_rejection(residual)
            draft.after_draw(x)
        return None, residual

