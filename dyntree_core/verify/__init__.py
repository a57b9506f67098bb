"""Pure tree verifiers (no model inside) and their registry.

``make_verifier(name)`` returns a fresh verifier: ``greedy`` (T=0 argmax matching),
``token_level`` (recursive rejection sampling, with or without replacement), ``traversal``
(Traversal Verification) or ``point_mass`` (sample-and-match, lossless for top-k trees too).
"""

from __future__ import annotations

from typing import Callable

from .base import IncompatibleTreeError, Verifier, VerifyResult, check_compatible
from .common import Decisions, RngDecisions
from .greedy import GreedyVerifier
from .rows import DenseRows, LogitRows, Target, TargetRows, as_rows
from .point_mass import PointMassVerifier
from .token_level import TokenLevelVerifier
from .traversal import TraversalVerifier

_FACTORIES: dict[str, Callable[[], Verifier]] = {
    "greedy": GreedyVerifier,
    "token_level": TokenLevelVerifier,
    "traversal": TraversalVerifier,
    "point_mass": PointMassVerifier,
}
VERIFIER_NAMES: tuple[str, ...] = tuple(_FACTORIES)


def make_verifier(name: str) -> Verifier:
    """A new verifier by name; raises ``ValueError`` naming the choices for an unknown name."""
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(f"unknown verifier {name!r}; choose one of {list(VERIFIER_NAMES)}") from None
    return factory()


__all__ = [
    "Decisions",
    "DenseRows",
    "LogitRows",
    "Target",
    "TargetRows",
    "as_rows",
    "GreedyVerifier",
    "IncompatibleTreeError",
    "PointMassVerifier",
    "RngDecisions",
    "TokenLevelVerifier",
    "TraversalVerifier",
    "VERIFIER_NAMES",
    "Verifier",
    "VerifyResult",
    "check_compatible",
    "make_verifier",
]
