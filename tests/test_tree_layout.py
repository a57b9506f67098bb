"""Tree layout from the parent array with tensor ops (what runs on the device): node orders,
ancestor masks, subtree sizes and the kernel metadata equal the per-node host walks the engine
used before, on random trees."""

import random

import pytest
import torch

from dyntree_core.attention.mask import build_block_lists, layout_from_parents, meta_from_tree, subtree_end
from dyntree_core.tree import ORDERS, ancestor_matrix, order_of, tree_from_parents


# ---------------------------------------------------------------- the previous host walks (oracle)
def walk_ancestors(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        anc[i, i] = True
        if parents[i] >= 0:
            anc[i] |= anc[parents[i]]
    return anc


def walk_order(parents: list[int], rank: list[int], kind: str) -> list[int]:
    n = len(parents)
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    if kind == "bfs":
        return sorted(range(n), key=lambda i: depth[i])
    kids: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        kids[parents[i]].append(i)
    for k in kids:
        k.sort(key=lambda c: rank[c])
    if kind == "hpd":
        size = [1] * n
        for i in range(n - 1, 0, -1):
            size[parents[i]] += size[i]
        kids = [sorted(k, key=lambda c: -size[c]) for k in kids]
    out, stack = [], [0]
    while stack:
        v = stack.pop()
        out.append(v)
        stack.extend(reversed(kids[v]))
    return out


def random_tree(rng: random.Random, n: int):
    shape = rng.choice(["uniform", "deep", "wide"])
    parents = [-1]
    for i in range(1, n):
        parents.append({"uniform": rng.randrange(i), "deep": max(0, i - 1 - rng.randrange(2)),
                        "wide": rng.randrange(min(i, 3))}[shape])
    rank = [0] * n  # draw ranks: a random order among each node's children (ties allowed sometimes)
    by_parent: dict[int, list[int]] = {}
    for i in range(1, n):
        by_parent.setdefault(parents[i], []).append(i)
    for kids in by_parent.values():
        r = list(range(len(kids)))
        rng.shuffle(r)
        if rng.random() < 0.2:
            r = [x // 2 for x in r]
        for c, x in zip(kids, r):
            rank[c] = x
    return parents, rank


@pytest.mark.parametrize("seed", range(60))
def test_orders_and_masks_from_parents_equal_the_host_walks(seed):
    rng = random.Random(seed)
    n = rng.choice([1, 2, 3, rng.randrange(4, 40), rng.randrange(40, 200)])
    parents, rank = random_tree(rng, n)
    p = torch.tensor(parents)
    r = torch.tensor(rank)
    depth_max = max(len(tree_from_parents(parents).path_to(i)) for i in range(n))
    anc = ancestor_matrix(p, depth_max)
    assert torch.equal(anc, walk_ancestors(parents))
    for kind in ORDERS:
        assert order_of(p, r, kind, depth_max).tolist() == walk_order(parents, rank, kind), kind
    tree = tree_from_parents(parents, child_rank=rank)
    assert tree.subtree_size().tolist() == walk_ancestors(parents).sum(0).tolist()
    for kind in ORDERS:
        assert tree.order(kind).tolist() == walk_order(parents, rank, kind)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("kind", ORDERS)
def test_layout_from_parents_equals_the_tree_path(seed, kind):
    """``layout_from_parents`` (the engine's device path) gives the permutation, slot map, mask
    and kernel metadata that the TokenTree methods give."""
    rng = random.Random(1000 + seed)
    parents, rank = random_tree(rng, rng.randrange(2, 120))
    tree = tree_from_parents(parents, child_rank=rank)
    lay = layout_from_parents(tree.parents, tree.child_rank, kind, tree.num_levels + 2, kernel_tiles=(16, 32))
    perm = tree.order(kind)
    assert torch.equal(lay.perm, perm)
    assert torch.equal(lay.perm[lay.slot], torch.arange(tree.size))
    assert torch.equal(lay.mask, tree.ancestor_mask(perm))
    assert torch.equal(lay.depth, tree.depth)
    ref = meta_from_tree(tree, 7, perm, 16, 32)
    if kind == "bfs":
        assert lay.end is None
    else:
        assert torch.equal(lay.end, subtree_end(tree, perm)) and torch.equal(lay.end, ref.end)
    got = lay.blocks
    want = build_block_lists(tree.ancestor_mask(perm), 16, 32)
    for f in ("full_cnt", "full_idx", "part_cnt", "part_idx"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f
