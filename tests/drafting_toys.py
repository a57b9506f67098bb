"""Toy draft distributions for the drafter tests (shared by test_drafting_*.py)."""

from __future__ import annotations

import torch


def toy(v: int, seed: int = 0, peak: float = 1.5):
    """Path-dependent random distributions (no ties), deterministic in (seed, path)."""

    def fn(path: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 1_000_003 + hash(path) % (2**31))
        return torch.softmax(torch.randn(v, generator=g, dtype=torch.float64) * peak, 0).float()

    return fn


def path_tokens(tree, node):
    """The token path root -> ``node``."""
    return tuple(tree.tokens[tree.path_to(node)].tolist())


def weight(fn, path):
    """The draft probability of ``path`` (root token first) under ``fn``."""
    w = 1.0
    for i in range(1, len(path)):
        w *= float(fn(path[:i])[path[i]])
    return w
