"""Greedy (temperature 0) tree verification, vectorised.

The accepted path is the longest root path whose every token is the target argmax at its
parent (the first such child in draw order when siblings repeat a token); the bonus token is
the argmax at the last accepted node. One argmax over ``[N, V]`` (on the logits' device for
``LogitRows``) and one transfer of N integers; the walk itself touches only matching nodes.
"""

from __future__ import annotations

import math

import numpy as np

from ..tree import SampledKind, TokenTree
from .base import VerifyResult, check_compatible
from .common import Outcome, check_target_shape
from .rows import Target, as_rows, node_token_probs


class GreedyVerifier:
    """Argmax matching; ``rng`` is not used.

    ``tested`` marks, for each node on the accepted path, its children in draw order up to and
    including the matching one (all of them at the last node); ``accept_prob`` is 1 for the
    match and 0 for the others. ``p_target`` is ``target_probs`` gathered at each node's token
    (a probability when ``target_probs`` holds probabilities, a score otherwise).
    """

    name = "greedy"
    accepts: frozenset[SampledKind] = frozenset({"swor", "iid", "topk"})

    def verify(self, tree: TokenTree, target_probs: Target, rng: np.random.Generator) -> VerifyResult:
        check_compatible(self, tree)
        rows = as_rows(target_probs)
        check_target_shape(tree, rows)
        argmax = rows.argmax()
        tokens = tree.tokens.cpu().numpy()
        parents = tree.parents.cpu().numpy()
        rank = tree.child_rank.cpu().numpy()
        match = np.zeros(tree.size, dtype=bool)
        match[1:] = tokens[1:] == argmax[parents[1:]]
        path = _greedy_path(match, parents, rank)
        outcome = _record_tests(match, parents, rank, path)
        p_target = node_token_probs(rows, tree.parents, tree.tokens)
        _record_decisions(outcome, path, parents, rank, tokens, p_target)
        bonus = int(argmax[path[-1]])
        outcome.decide("bonus", path[-1], bonus, math.nan, math.nan, 1.0, True, drew=False)
        return outcome.result(path, bonus, p_target)


def _greedy_path(match: np.ndarray, parents: np.ndarray, rank: np.ndarray) -> list[int]:
    """Root path following, at each node, the matching child of lowest draw rank.

    Args:
        match: ``[N]`` bool, node's token is the argmax at its parent.
        parents, rank: ``[N]`` parent ids and sibling draw ranks.
    """
    best: dict[int, int] = {}
    for c in np.flatnonzero(match).tolist():
        p = int(parents[c])
        if p not in best or rank[c] < rank[best[p]]:
            best[p] = c
    path = [0]
    while path[-1] in best:
        path.append(best[path[-1]])
    return path


def _record_decisions(outcome: Outcome, path: list[int], parents: np.ndarray, rank: np.ndarray,
                      tokens: np.ndarray, p_target: np.ndarray) -> None:
    """The comparisons ``_record_tests`` marked, in the order a walk down the path makes them."""
    tested = np.flatnonzero(outcome.tested)
    by_parent: dict[int, list[int]] = {}
    for c in tested.tolist():
        by_parent.setdefault(int(parents[c]), []).append(c)
    for u in path:
        for c in sorted(by_parent.get(u, []), key=lambda c: rank[c]):
            hit = bool(outcome.accept_prob[c] == 1.0)
            outcome.decide("argmax", c, int(tokens[c]), p_target[c], math.nan, float(hit), hit, drew=False)


def _record_tests(match: np.ndarray, parents: np.ndarray, rank: np.ndarray, path: list[int]) -> Outcome:
    """Mark the children compared at each path node (draw order, up to the match)."""
    n = match.shape[0]
    on_path = np.zeros(n, dtype=bool)
    on_path[path] = True
    rank_limit = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
    for u, v in zip(path[:-1], path[1:]):
        rank_limit[u] = rank[v]
    outcome = Outcome(n)
    outcome.tested[1:] = on_path[parents[1:]] & (rank[1:] <= rank_limit[parents[1:]])
    outcome.accept_prob[outcome.tested] = match[outcome.tested].astype(np.float64)
    return outcome
