"""Exact expected acceptance of each verifier on a given tree.

Given a drafted tree, the draft distributions it was drawn from and the target distributions at
its nodes, everything a verifier does is fixed except its own uniforms; so the probability that
each node ends on the accepted path, and the expected number of accepted draft tokens, are
deterministic. Comparing verifiers through these numbers on *the same* trees removes all the
sampling noise of end-to-end runs.

* ``token_level``: the residual after each rejected sibling is deterministic, so
  ``P(c on path) = P(u on path) * prod_{earlier siblings j}(1 - a_j) * a_c`` with
  ``a = min(1, R(x)/D(x))`` at the moment c is tested.
* ``traversal``: the post-order recursion of ``traversal.py`` with probabilities in place of
  draws: a rejected subtree updates its parent's ``(p_u, Mb_u, Ms_u)`` the same way whatever
  happened inside it, so ``P(subtree of c accepts something | c entered with p_c)`` composes.
* ``point_mass``: ``P(c on path) = P(u on path) * target(x_c | u)`` for the first child with
  token x_c, 0 for later duplicates.
* ``greedy``: 1 along the argmax path, 0 elsewhere.

The functions read the same CPU float64 rows and use the same residual and sibling-draft updates
as the verifiers themselves (``common.py``), and touch the target row of a node only when the
node can be reached. Expectations are over the verifier's randomness on the fixed tree; the
tree itself depends on the path the decode took.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..tree import TokenTree
from .base import check_compatible
from .common import (
    DraftUpdate,
    NodeInputs,
    SiblingDraft,
    check_draft_update,
    ratio_accept,
    residual_update,
)
from .greedy import GreedyVerifier
from .rows import Target

EXACT_VERIFIERS: tuple[str, ...] = ("greedy", "token_level", "traversal", "point_mass")


@dataclass(frozen=True)
class ExpectedAcceptance:
    """Exact acceptance of one verifier on one tree.

    Attributes:
        verifier: the verifier's name.
        on_path: ``[N]`` float64 probability that each node is on the accepted path (1 for the root).
        final: ``[N]`` float64 probability that each node is the *last* accepted node (the one the
            bonus token follows); sums to 1.
    """

    verifier: str
    on_path: np.ndarray
    final: np.ndarray

    @property
    def accepted(self) -> float:
        """Expected number of accepted draft tokens (root excluded, bonus excluded)."""
        return float(self.on_path[1:].sum())

    @property
    def tokens_per_step(self) -> float:
        """Expected tokens committed by the step: accepted draft tokens plus the bonus token."""
        return self.accepted + 1.0


def expected_acceptance(
    tree: TokenTree,
    target_probs: Target,
    verifier: str,
    draft_update: Optional[DraftUpdate] = None,
) -> ExpectedAcceptance:
    """Exact per-node acceptance of ``verifier`` on ``tree``.

    Args:
        tree: the draft tree (stochastic verifiers need ``draft_probs`` rows at internal nodes).
        target_probs: ``[N, V]`` target distributions at each node (temperature / top-p applied);
            for ``greedy`` any scores whose argmax is the greedy token.
        verifier: one of ``EXACT_VERIFIERS``.
        draft_update: force the sibling draft update (``"swor"``/``"iid"``) as the verifiers'
            ``draft_update`` does; None follows ``tree.sampled``.
    Raises:
        IncompatibleTreeError: when the verifier cannot verify this kind of tree losslessly.
        ValueError: for an unknown verifier name.
    """
    from . import make_verifier

    if verifier not in EXACT_VERIFIERS:
        raise ValueError(f"no exact expectation for verifier {verifier!r}; choose one of {list(EXACT_VERIFIERS)}")
    check_compatible(make_verifier(verifier), tree)
    mode: DraftUpdate = check_draft_update(draft_update) or tree.sampled  # type: ignore[assignment]
    if verifier == "greedy":
        path = GreedyVerifier().verify(tree, target_probs, None).path  # type: ignore[arg-type]
        on_path = np.zeros(tree.size)
        on_path[path] = 1.0
        return _from_on_path(verifier, on_path, tree)
    inputs = NodeInputs(verifier, tree, target_probs, need_draft=verifier != "point_mass")
    if verifier == "token_level":
        return _from_on_path(verifier, _token_level(inputs, mode), tree)
    if verifier == "point_mass":
        return _from_on_path(verifier, _point_mass(inputs), tree)
    final = np.zeros(tree.size)
    _traversal_visit(inputs, mode, 0, 1.0, 1.0, final)
    return _from_final(verifier, final, tree)


def expected_accepted(tree: TokenTree, target_probs: Target, verifier: str,
                      draft_update: Optional[DraftUpdate] = None) -> float:
    """Expected number of accepted draft tokens of ``verifier`` on ``tree`` (``target_probs``: ``[N, V]``)."""
    return expected_acceptance(tree, target_probs, verifier, draft_update).accepted


def _token_level(inputs: NodeInputs, mode: DraftUpdate) -> np.ndarray:
    on_path = np.zeros(inputs.tree.size)
    on_path[0] = 1.0
    for u in range(inputs.tree.size):  # parents precede children
        kids = inputs.children[u]
        if not kids or on_path[u] <= 0.0:
            continue
        residual = inputs.target_row(u)
        draft = SiblingDraft(inputs.draft_row(u), mode)
        reach = on_path[u]  # P(u on path and every earlier sibling rejected)
        for child in kids:
            x = inputs.tokens[child]
            a = ratio_accept(residual[x], draft.q[x])
            on_path[child] = reach * a
            reach *= 1.0 - a
            if reach <= 0.0:
                break
            _, residual = residual_update(1.0, residual, draft.q)
            draft.after_draw(x)
    return on_path


def _point_mass(inputs: NodeInputs) -> np.ndarray:
    on_path = np.zeros(inputs.tree.size)
    on_path[0] = 1.0
    for u in range(inputs.tree.size):
        kids = inputs.children[u]
        if not kids or on_path[u] <= 0.0:
            continue
        target = inputs.target_row(u)
        seen: set[int] = set()
        for child in kids:
            x = inputs.tokens[child]
            if x not in seen:
                on_path[child] = on_path[u] * float(target[x])
            seen.add(x)
    return on_path


def _traversal_visit(inputs: NodeInputs, mode: DraftUpdate, u: int, p_u: float, weight: float,
                     final: np.ndarray) -> float:
    """``P(the subtree of u accepts a node | u entered with p_u)``; adds ``weight`` times each node's
    probability of being the accepted one to ``final`` (``weight`` = P(u is entered))."""
    if p_u <= 0.0:
        return 0.0
    kids = inputs.children[u]
    accepted_below = 0.0
    all_rejected = 1.0  # P(every child visited so far was rejected | u entered)
    if kids:
        mb = inputs.target_row(u)
        draft = SiblingDraft(inputs.draft_row(u), mode)
        for child in kids:
            if p_u <= 0.0:
                break
            x = inputs.tokens[child]
            a = _traversal_visit(inputs, mode, child, ratio_accept(p_u * mb[x], draft.q[x]),
                                 weight * all_rejected, final)
            accepted_below += all_rejected * a
            all_rejected *= 1.0 - a
            if all_rejected <= 0.0:
                return accepted_below
            p_u, mb = residual_update(p_u, mb, draft.q)
            draft.after_draw(x)
    if u == 0:
        p_u = 1.0  # the root is always accepted in the end
    final[u] += weight * all_rejected * p_u
    return accepted_below + all_rejected * p_u


def _from_on_path(name: str, on_path: np.ndarray, tree: TokenTree) -> ExpectedAcceptance:
    final = on_path.copy()
    parents = tree.parents.tolist()
    for c in range(1, tree.size):  # P(u final) = P(u on path) - sum over children of P(child on path)
        final[parents[c]] -= on_path[c]
    np.maximum(final, 0.0, out=final)
    return ExpectedAcceptance(name, on_path, final)


def _from_final(name: str, final: np.ndarray, tree: TokenTree) -> ExpectedAcceptance:
    on_path = final.copy()
    parents = tree.parents.tolist()
    for c in range(tree.size - 1, 0, -1):  # children follow their parents
        on_path[parents[c]] += on_path[c]
    return ExpectedAcceptance(name, on_path, final)
