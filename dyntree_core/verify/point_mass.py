"""Point-mass (sample-and-match) verification.

At the current node draw ``y ~ target(. | node)``; if a child carries token y, move to the first
such child in draw order, otherwise y is the bonus token. Every committed token is a plain
target sample, so this is lossless whatever produced the siblings: deterministic top-k trees
(OPT-Tree, DynaTree, Sequoia-greedy), sampled trees, and trees with duplicate siblings.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ..tree import SampledKind, TokenTree
from .base import VerifyResult, check_compatible
from .common import Decisions, NodeInputs, Outcome, RngDecisions
from .rows import Target


class PointMassVerifier:
    """Sample-and-match verification.

    ``tested`` marks every child of every node on the accepted path (each is compared with the
    target sample there). ``accept_prob[c]`` is the probability that the sample matched c:
    ``target(x_c | parent)`` for the first child carrying x_c and 0 for later duplicates; it is
    the a-priori match probability, not a 1/0 record of the outcome (``path`` says which matched).
    """

    name = "point_mass"
    accepts: frozenset[SampledKind] = frozenset({"swor", "iid", "topk"})

    def verify(self, tree: TokenTree, target_probs: Target, rng: np.random.Generator) -> VerifyResult:
        return self.run(tree, target_probs, RngDecisions(rng))

    def run(self, tree: TokenTree, target_probs: Target, decisions: Decisions) -> VerifyResult:
        """``verify`` with an explicit source of randomness (``target_probs``: ``[N, V]``)."""
        check_compatible(self, tree)
        inputs = NodeInputs(self.name, tree, target_probs, need_draft=False)
        outcome = Outcome(tree.size, decisions)
        path = [0]
        while True:
            target = inputs.target_row(path[-1])
            y = decisions.categorical(target)
            match = _match_child(inputs, path[-1], target, y, outcome)
            p_y = float(target[y] / target.sum())
            if match is None:  # the sample itself is the bonus token
                outcome.decide("bonus", path[-1], y, p_y, math.nan, 1.0, True)
                return outcome.result(path, y, inputs.p_target)
            outcome.decide("sample", match, y, p_y, math.nan, p_y, True)
            path.append(match)


def _match_child(inputs: NodeInputs, node: int, target: np.ndarray, y: int, outcome: Outcome) -> Optional[int]:
    """Record ``node``'s children as tested and return the first one with token ``y``."""
    match: Optional[int] = None
    seen: set[int] = set()
    for child in inputs.children[node]:
        x = inputs.tokens[child]
        outcome.record(child, 0.0 if x in seen else float(target[x]))
        seen.add(x)
        if match is None and x == y:
            match = child
    return match
