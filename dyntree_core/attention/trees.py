"""Synthetic token trees for attention tests and benchmarks.

``dyspec_like_tree`` imitates the shape of DySpec's greedy-expansion trees (paper Alg. 1) without
a model: every node ``u`` gets a random draft distribution ``q_u`` over ``vocab`` tokens
(``Dirichlet(concentration)``, sorted in descending order, i.e. the order in which sampling
without replacement most likely draws them), and the estimated value of its ``r``-th child is
``value(u) * q_u[r]`` (root value 1). Expansion is greedy on a max-heap of candidate slots: the
best candidate becomes a node, and then its own first child and its parent's next child become
candidates. The result has DySpec's characteristic shape: earlier siblings own larger subtrees,
the depth grows like a few times ``log(size)``, and the construction order is the greedy (value)
order — a valid topological order but neither BFS nor DFS.

``uniform_random_tree`` attaches every node to a uniformly chosen earlier node (random recursive
tree), a shape with no sibling ordering; ``chain``/``star``/``skewed`` are the extreme shapes the
tests use.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from dyntree_core.tree import TokenTree, tree_from_parents

TREE_FAMILIES: tuple[str, ...] = ("dyspec", "uniform")


def dyspec_like_tree(size: int, seed: int = 0, vocab: int = 32, concentration: float = 0.1) -> TokenTree:
    """A ``size``-node tree grown greedily by estimated value (DySpec Alg. 1 shape, no model).

    Args:
        size: number of nodes including the root (>= 1).
        seed: RNG seed; the tree is a deterministic function of all arguments.
        vocab: number of candidate children per node (the per-node distribution's support).
        concentration: Dirichlet concentration of the per-node distributions; smaller = peakier
            (deeper, thinner trees), larger = flatter (bushier trees).
    """
    if size < 1:
        raise ValueError("size must be >= 1")
    rng = np.random.default_rng(seed)
    dists: list[list[float]] = []
    values: list[float] = []

    def new_dist() -> list[float]:
        return sorted(rng.dirichlet(np.full(vocab, float(concentration))).tolist(), reverse=True)

    parents: list[int] = [-1]
    ranks: list[int] = [0]
    values.append(1.0)
    dists.append(new_dist())
    heap: list[tuple[float, int, int]] = [(-dists[0][0], 0, 0)]  # (-value, parent, child rank)
    while len(parents) < size and heap:
        neg_v, par, rank = heapq.heappop(heap)
        node = len(parents)
        parents.append(par)
        ranks.append(rank)
        values.append(-neg_v)
        dists.append(new_dist())
        heapq.heappush(heap, (-(values[node] * dists[node][0]), node, 0))
        if rank + 1 < vocab:
            heapq.heappush(heap, (-(values[par] * dists[par][rank + 1]), par, rank + 1))
    return tree_from_parents(parents, child_rank=ranks, sampled="swor")


def uniform_random_tree(size: int, seed: int = 0) -> TokenTree:
    """Random recursive tree: node ``i`` picks its parent uniformly among nodes ``0..i-1``."""
    if size < 1:
        raise ValueError("size must be >= 1")
    gen = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, size)]
    return tree_from_parents(parents, sampled="iid")


def chain(size: int) -> TokenTree:
    """Root -> 1 -> 2 -> ... (a single path)."""
    return tree_from_parents(list(range(-1, size - 1)))


def star(size: int) -> TokenTree:
    """Root with ``size - 1`` children (depth 1)."""
    return tree_from_parents([-1] + [0] * (size - 1))


def skewed(size: int, branch: int = 3) -> TokenTree:
    """A long spine (the first child of each spine node) with ``branch - 1`` leaf siblings per level.

    Built in BFS-like construction order so that spine nodes are *not* contiguous, which is the
    case where BFS and DFS orders differ most.
    """
    parents = [-1]
    spine = 0
    while len(parents) < size:
        first = len(parents)
        for _ in range(branch):
            if len(parents) >= size:
                break
            parents.append(spine)
        spine = first
    return tree_from_parents(parents)


def make_tree(family: str, size: int, seed: int) -> TokenTree:
    """Dispatch on a family name from ``TREE_FAMILIES``."""
    if family == "dyspec":
        return dyspec_like_tree(size, seed)
    if family == "uniform":
        return uniform_random_tree(size, seed)
    raise ValueError(f"unknown tree family {family!r}; choose one of {TREE_FAMILIES}")
