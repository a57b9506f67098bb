"""Pieces shared by the pure verifiers: the randomness interface, CPU float64 row access,
per-call bookkeeping, the sibling draft state (without / with replacement) and the residual
update.

Every random choice a verifier makes goes through a ``Decisions`` object. In production it is
``RngDecisions`` (a ``numpy.random.Generator``); the exact-enumeration tests drive the very same
verifier code with a scripted ``Decisions`` that replays every possible branch with its
probability.
"""

from __future__ import annotations

from typing import Literal, Optional, Protocol

import numpy as np

from ..tree import TokenTree
from .base import DecisionKind, VerifyDecision, VerifyResult
from .rows import DenseRows, Target, TargetRows, as_rows, node_token_probs

#: how the draft distribution at a node changes after one of its siblings was drawn
DraftUpdate = Literal["swor", "iid"]


def check_draft_update(value: Optional[str]) -> Optional[DraftUpdate]:
    """Validate a forced draft update (None = follow ``tree.sampled``)."""
    if value not in (None, "swor", "iid"):
        raise ValueError(f"draft_update must be None, 'swor' or 'iid', got {value!r}")
    return value  # type: ignore[return-value]


class Decisions(Protocol):
    """Source of a verifier's randomness."""

    def bernoulli(self, p: float) -> bool:
        """True with probability ``p`` (``p`` in [0, 1])."""
        ...

    def categorical(self, probs: np.ndarray) -> int:
        """An index drawn proportionally to the non-negative weights ``probs`` ``[V]``."""
        ...


class RngDecisions:
    """``Decisions`` backed by a ``numpy.random.Generator`` (one uniform per decision);
    ``last_u`` is the uniform of the latest decision (the walkthrough shows it)."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.last_u: Optional[float] = None

    def bernoulli(self, p: float) -> bool:
        self.last_u = float(self.rng.random())
        return self.last_u < p

    def categorical(self, probs: np.ndarray) -> int:
        self.last_u = float(self.rng.random())
        return sample_index(probs, self.last_u)


class ReplayDecisions:
    """``Decisions`` that replay a recorded run (``VerifyResult.decisions``): each draw returns
    what was recorded, so the verifier retraces the recorded path."""

    def __init__(self, decisions: list[VerifyDecision]):
        self._draws = [d for d in decisions if d.drew]
        self._next = 0

    def _take(self, kinds: tuple[str, ...]) -> VerifyDecision:
        if self._next >= len(self._draws):
            raise ValueError("the verifier asked for more decisions than were recorded")
        d = self._draws[self._next]
        self._next += 1
        if d.kind not in kinds:
            raise ValueError(f"recorded decision {self._next - 1} is a {d.kind!r}, the verifier asked for {kinds}")
        return d

    def bernoulli(self, p: float) -> bool:
        return self._take(("child", "node")).accepted

    def categorical(self, probs: np.ndarray) -> int:
        return self._take(("sample", "bonus")).token

    @property
    def exhausted(self) -> bool:
        return self._next == len(self._draws)


def top_tokens(dist: np.ndarray, k: int = 5) -> tuple[tuple[int, float], ...]:
    """The ``k`` most likely tokens of ``dist`` ``[V]`` with their probabilities, most likely first."""
    k = min(k, dist.shape[0])
    idx = np.argpartition(dist, -k)[-k:]
    idx = idx[np.argsort(-dist[idx], kind="stable")]
    return tuple((int(i), float(dist[i])) for i in idx if dist[i] > 0.0)


def sample_index(probs: np.ndarray, u: float) -> int:
    """Inverse-CDF draw from ``probs`` ``[V]`` (non-negative, any positive total) for ``u`` in [0, 1).

    Never returns an index of zero weight.
    """
    cdf = np.cumsum(probs, dtype=np.float64)
    total = float(cdf[-1])
    if not total > 0.0:
        raise ValueError("cannot sample from a distribution with no mass")
    idx = int(np.searchsorted(cdf, u * total, side="right"))
    if idx >= probs.shape[0]:  # u * total rounded up to total
        idx = int(np.flatnonzero(probs > 0)[-1])
    return idx


def ratio_accept(num: float, den: float) -> float:
    """``min(1, num / den)`` with the limits ``num > 0, den = 0 -> 1`` and ``num = 0 -> 0``."""
    if num <= 0.0:
        return 0.0
    if den <= 0.0 or num >= den:
        return 1.0
    return num / den


def residual_update(p: float, mb: np.ndarray, ms: np.ndarray) -> tuple[float, np.ndarray]:
    """State of a node after one of its children (drawn from ``ms``) was rejected.

    Traversal Verification eqs. (1) and (3); with ``p = 1`` this is the token-level residual
    ``norm(max(mb - ms, 0))`` of SpecInfer / Sequoia / DySpec.

    Args:
        p: the node's current sequence-level acceptance probability (1 for token-level).
        mb: ``[V]`` current target (residual) distribution at the node.
        ms: ``[V]`` distribution the rejected child was drawn from.
    Returns:
        ``(p', mb')``: ``p' = S / (S + 1 - p)`` with ``S = sum(max(p * mb - ms, 0))`` (``p' = 1``
        when ``p = 1``) and ``mb' = max(p * mb - ms, 0) / S`` (``mb`` unchanged when ``S = 0``:
        then either ``p' = 0`` and ``mb'`` is never used, or the rejection had probability 0).
    """
    res = mb * p if p < 1.0 else mb.copy()
    res -= ms
    np.maximum(res, 0.0, out=res)
    s = float(res.sum())
    p_new = 1.0 if p >= 1.0 else s / (s + 1.0 - p)
    if s <= 0.0:
        return p_new, mb
    res /= s
    return p_new, res


class SiblingDraft:
    """The distribution the next sibling at one node was drawn from, ``q`` ``[V]`` float64.

    ``swor``: after a sibling with token x is drawn, ``q <- norm(q with q[x] = 0)``; when no
    draft mass is left, later siblings are uniform over the tokens not yet drawn (Sequoia's
    fallback; a drafter that keeps drawing past the draft support must draw the same way).
    ``iid``: ``q`` never changes.
    """

    def __init__(self, q: np.ndarray, mode: DraftUpdate):
        self.q = q
        self.mode = mode
        self._drawn: list[int] = []

    def after_draw(self, token: int) -> None:
        if self.mode == "iid":
            return
        self._drawn.append(token)
        self.q[token] = 0.0
        total = float(self.q.sum())
        if total > 0.0:
            self.q /= total
            return
        uniform = np.ones_like(self.q)
        uniform[self._drawn] = 0.0
        left = float(uniform.sum())
        self.q = uniform / left if left > 0 else uniform  # left == 0: every token drawn, no sibling can follow


class NodeInputs:
    """Per-call inputs of a stochastic verifier: tree structure as Python lists, target rows
    (``[N, V]`` tensor or ``TargetRows``, read lazily) and draft rows for internal nodes, all read as
    CPU float64."""

    def __init__(self, verifier_name: str, tree: TokenTree, target_probs: Target, need_draft: bool):
        self.verifier_name = verifier_name
        self.tree = tree
        self.target = as_rows(target_probs)
        check_target_shape(tree, self.target)
        self.tokens: list[int] = tree.tokens.tolist()
        self.children: list[list[int]] = tree.children()
        self.p_target = node_token_probs(self.target, tree.parents, tree.tokens)
        self._draft: Optional[DenseRows] = None
        self._draft_row: list[int] = tree.draft_row.tolist() if tree.draft_row is not None else []
        if need_draft and tree.size > 1:
            if tree.draft_probs is None:
                raise ValueError(
                    f"verifier {verifier_name!r} needs the draft distributions of internal nodes, "
                    "but the tree has no draft_probs"
                )
            self._draft = DenseRows(tree.draft_probs)
            if self._draft.shape[1] != self.target.shape[1]:
                raise ValueError(
                    f"draft distributions have {self._draft.shape[1]} tokens but target_probs has "
                    f"{self.target.shape[1]}"
                )

    def target_row(self, node: int) -> np.ndarray:
        """``[V]`` float64 target distribution at ``node``."""
        return self.target.row(node)

    def draft_row(self, node: int) -> np.ndarray:
        """``[V]`` float64 full draft distribution the children of ``node`` were drawn from."""
        row = self._draft_row[node] if node < len(self._draft_row) else -1
        if self._draft is None or row < 0:
            raise ValueError(
                f"verifier {self.verifier_name!r} needs the draft distribution of internal node "
                f"{node}, but the drafter did not record one (tree.draft_row[{node}] = {row})"
            )
        return self._draft.row(row)


class Outcome:
    """Per-call bookkeeping: which nodes were tested, with what acceptance probability, and every
    decision in order (``VerifyDecision``)."""

    def __init__(self, n: int, decisions: Optional[Decisions] = None):
        self.accept_prob = np.full(n, np.nan, dtype=np.float64)
        self.tested = np.zeros(n, dtype=bool)
        self.decisions: list[VerifyDecision] = []
        self._source = decisions

    def record(self, node: int, prob: float) -> None:
        self.accept_prob[node] = prob
        self.tested[node] = True

    def decide(self, kind: DecisionKind, node: int, token: int, p_target: float, q: float, accept_prob: float,
               accepted: bool, drew: bool = True, u: Optional[float] = None,
               residual_top: tuple[tuple[int, float], ...] = ()) -> None:
        """Append one decision; its uniform is ``u``, or (None) the source's latest when ``drew``."""
        if u is None and drew:
            u = getattr(self._source, "last_u", None)
        self.decisions.append(VerifyDecision(kind, int(node), int(token), float(p_target), float(q),
                                             float(accept_prob), u, drew, bool(accepted), residual_top))

    def after_rejection(self, residual: np.ndarray) -> None:
        """Attach the updated residual's top tokens to the latest decision (the rejection)."""
        if self.decisions:
            last = self.decisions[-1]
            self.decisions[-1] = VerifyDecision(last.kind, last.node, last.token, last.p_target, last.q,
                                                last.accept_prob, last.u, last.drew, last.accepted,
                                                top_tokens(residual))

    def result(self, path: list[int], bonus_token: int, p_target: np.ndarray) -> VerifyResult:
        return VerifyResult(
            path=path,
            bonus_token=int(bonus_token),
            accept_prob=self.accept_prob,
            tested=self.tested,
            p_target=p_target,
            decisions=self.decisions,
        )


def check_new_sibling(node: int, child: int, token: int, seen: set[int]) -> None:
    """Raise if a tree sampled without replacement repeats a token among ``node``'s children."""
    if token in seen:
        raise ValueError(
            f"tree is marked sampled='swor' but node {node} has two children with token {token} "
            f"(the second is node {child}); siblings drawn without replacement are distinct"
        )
    seen.add(token)


def check_target_shape(tree: TokenTree, target: TargetRows) -> None:
    if target.shape[0] != tree.size:
        raise ValueError(
            f"target_probs must have shape [{tree.size}, V] (one row per tree node), "
            f"got {tuple(target.shape)}"
        )


class ScriptedVerifier:
    """Base of the stochastic verifiers: ``verify`` draws through ``RngDecisions``; ``run`` takes
    any ``Decisions`` (the exact-enumeration tests script it). ``draft_update`` forces the
    draft update (``"swor"`` or ``"iid"``) instead of following ``tree.sampled``; only the
    negative-control tests use it, since a mismatched update is not lossless."""

    def __init__(self, draft_update: Optional[DraftUpdate] = None):
        self.draft_update = check_draft_update(draft_update)

    def verify(self, tree: TokenTree, target_probs: Target, rng: np.random.Generator) -> VerifyResult:
        return self.run(tree, target_probs, RngDecisions(rng))

    def run(self, tree: TokenTree, target_probs: Target, decisions: Decisions) -> VerifyResult:
        raise NotImplementedError
