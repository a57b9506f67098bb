"""The verification interface: pure functions of (tree, draft distributions, target
distributions, rng). No model inside, so each verifier is checked by exact enumeration."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Protocol, runtime_checkable

import numpy as np

from ..tree import SampledKind, TokenTree
from .rows import Target


class IncompatibleTreeError(ValueError):
    """A verifier was given a tree whose sibling sampling it cannot verify losslessly."""


#: ``child``: token-level test of a child against the residual at its parent; ``enter``: Traversal
#: enters a child's subtree with the sequence-level probability shown (no draw yet); ``node``:
#: Traversal's own test of a node once its children were rejected; ``sample``: point-mass draw of
#: a target token at a node; ``argmax``: greedy comparison of a child with the target's argmax;
#: ``bonus``: the token the target adds after the accepted path.
DecisionKind = Literal["child", "enter", "node", "sample", "argmax", "bonus"]


@dataclass(frozen=True)
class VerifyDecision:
    """One decision of a verifier, in the order it was made (the verification walkthrough).

    Attributes:
        kind: see ``DecisionKind``.
        node: the node tested / entered / sampled at (``bonus``: the last accepted node).
        token: the node's token (``sample``/``bonus``: the token drawn).
        p_target: the target-side number of the test: the residual's probability of the token
            (token level), ``p_parent * Mb(x)`` (Traversal ``enter``), the node's sequence-level
            probability (Traversal ``node``), the target probability (point mass, greedy, bonus).
        q: the draft-side probability of the token at the test (the sibling distribution after
            earlier draws); NaN where no draft distribution enters.
        accept_prob: probability of acceptance at the test (1/0 for greedy).
        u: the uniform drawn for this decision (None: no draw, or a scripted source).
        drew: whether the verifier consumed a random decision here (``ReplayDecisions`` replays these).
        accepted: the outcome (``sample``: a child matched the drawn token).
        residual_top: after a rejection, the most likely tokens of the updated residual at the
            parent, ``((token, prob), ...)`` (token level and Traversal).
    """

    kind: DecisionKind
    node: int
    token: int
    p_target: float
    q: float
    accept_prob: float
    u: Optional[float]
    drew: bool
    accepted: bool
    residual_top: tuple[tuple[int, float], ...] = ()

    def to_dict(self) -> dict:
        return {"kind": self.kind, "node": self.node, "token": self.token, "p_target": _f(self.p_target),
                "q": _f(self.q), "accept_prob": _f(self.accept_prob), "u": self.u, "drew": self.drew,
                "accepted": self.accepted, "residual_top": [[t, p] for t, p in self.residual_top]}

    @classmethod
    def from_dict(cls, d: dict) -> "VerifyDecision":
        return cls(kind=d["kind"], node=int(d["node"]), token=int(d["token"]), p_target=_nan(d["p_target"]),
                   q=_nan(d["q"]), accept_prob=_nan(d["accept_prob"]), u=d.get("u"), drew=bool(d["drew"]),
                   accepted=bool(d["accepted"]),
                   residual_top=tuple((int(t), float(p)) for t, p in d.get("residual_top", [])))


def _f(x: float) -> Optional[float]:
    return None if x != x else float(x)


def _nan(x: Optional[float]) -> float:
    return float("nan") if x is None else float(x)


@dataclass
class VerifyResult:
    """Outcome of verifying one tree.

    Attributes:
        path: accepted node ids from the root, ``path[0] == 0``.
        bonus_token: the token the target contributes after the last accepted node
            (a residual sample, a resample, or the argmax at T=0).
        accept_prob: ``[N]`` float64 probability with which each node was accepted when it was
            tested (``min(1, p/q)``-style or the traversal ratio); NaN for nodes never tested
            and for the root.
        tested: ``[N]`` bool, nodes that the verifier actually tested.
        p_target: ``[N]`` float64 target probability of each node's token under its parent's
            target distribution (NaN for the root).
        decisions: every test and draw in the order made (``VerifyDecision``).
    """

    path: list[int]
    bonus_token: int
    accept_prob: np.ndarray
    tested: np.ndarray
    p_target: np.ndarray
    decisions: list[VerifyDecision] = field(default_factory=list)


@runtime_checkable
class Verifier(Protocol):
    name: str
    #: tree sampling kinds this verifier is lossless for
    accepts: frozenset[SampledKind]

    def verify(
        self,
        tree: TokenTree,
        target_probs: Target,
        rng: np.random.Generator,
    ) -> VerifyResult:
        """Verify ``tree``.

        Args:
            tree: the draft tree; stochastic verifiers read ``tree.draft_dist(node)`` for each
                internal node (float64 recommended).
            target_probs: ``[N, V]`` target next-token distributions at each node (temperature and
                top-p applied) as a tensor, or ``TargetRows`` that form rows on demand (the engine
                passes ``LogitRows``); for the greedy verifier any scores whose argmax is the greedy token.
            rng: source of uniforms / samples.
        Raises:
            IncompatibleTreeError: when ``tree.sampled`` is not in ``accepts``.
        """
        ...


def check_compatible(verifier: Verifier, tree: TokenTree) -> None:
    if tree.sampled not in verifier.accepts:
        raise IncompatibleTreeError(
            f"verifier {verifier.name!r} cannot verify a tree whose siblings were produced by "
            f"{tree.sampled!r} losslessly; it accepts {sorted(verifier.accepts)}"
        )
