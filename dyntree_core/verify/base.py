"""The verification interface: pure functions of (tree, draft distributions, target
distributions, rng). No model inside, so each verifier is checked by exact enumeration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from ..tree import SampledKind, TokenTree
from .rows import Target


class IncompatibleTreeError(ValueError):
    """A verifier was given a tree whose sibling sampling it cannot verify losslessly."""


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
    """

    path: list[int]
    bonus_token: int
    accept_prob: np.ndarray
    tested: np.ndarray
    p_target: np.ndarray


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
