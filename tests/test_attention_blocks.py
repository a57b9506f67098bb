"""Mask helpers: block lists, interval (subtree_end) form, dense prefix, synthetic trees."""

import pytest
import torch

from dyntree_core.attention.mask import (attention_mask_4d, build_block_lists, dense_prefix_len, interval_mask,
                                         is_preorder, meta_from_mask, subtree_end, tree_mask)
from dyntree_core.attention.trees import chain, dyspec_like_tree, make_tree, skewed, star, uniform_random_tree
from dyntree_core.tree import count_nonzero_blocks

TREES = {
    "chain": chain(37),
    "star": star(29),
    "skewed": skewed(50),
    "random": uniform_random_tree(64, seed=2),
    "dyspec": dyspec_like_tree(100, seed=4),
}


def _brute_force_classes(mask, bq, bn):
    q, w = mask.shape
    classes = {}
    for i in range(-(-q // bq)):
        for j in range(-(-w // bn)):
            tile = mask[i * bq : (i + 1) * bq, j * bn : (j + 1) * bn]
            if tile.any():
                classes[(i, j)] = "full" if tile.all() else "partial"
    return classes


@pytest.mark.parametrize("name", list(TREES))
@pytest.mark.parametrize("order", ["bfs", "dfs", "hpd"])
@pytest.mark.parametrize("bq,bn", [(16, 16), (10, 16), (32, 16)])
def test_block_lists_exact(name, order, bq, bn):
    mask = tree_mask(TREES[name], order)
    bl = build_block_lists(mask, bq, bn)
    listed = {}
    for i in range(bl.full_cnt.shape[0]):
        fc, pc = int(bl.full_cnt[i]), int(bl.part_cnt[i])
        full = bl.full_idx[i, :fc].tolist()
        part = bl.part_idx[i, :pc].tolist()
        assert bl.full_idx[i, fc:].eq(-1).all() and bl.part_idx[i, pc:].eq(-1).all()
        assert full == sorted(full) and part == sorted(part)
        for j in full:
            listed[(i, j)] = "full"
        for j in part:
            assert (i, j) not in listed, "a block listed twice"
            listed[(i, j)] = "partial"
    assert listed == _brute_force_classes(mask, bq, bn)
    if bq == bn:
        assert bl.num_nonzero == count_nonzero_blocks(mask, bn)


@pytest.mark.parametrize("name", list(TREES))
@pytest.mark.parametrize("order", ["dfs", "hpd"])
def test_interval_form_equals_ancestor_mask(name, order):
    tree = TREES[name]
    end = subtree_end(tree, order)
    assert torch.equal(interval_mask(end), tree.ancestor_mask(tree.order(order)))


def test_interval_form_refuses_non_preorder():
    tree = TREES["skewed"]
    assert not is_preorder(tree, tree.order("bfs"))
    with pytest.raises(ValueError, match="pre-order"):
        subtree_end(tree, "bfs")


def test_4d_mask_layout():
    tree = TREES["random"]
    m = attention_mask_4d(tree, 7, "dfs")
    assert m.shape == (1, 1, tree.size, 7 + tree.size) and m.dtype == torch.bool
    assert m[0, 0, :, :7].all()
    assert torch.equal(m[0, 0, :, 7:], tree.ancestor_mask(tree.order("dfs")))


def test_dense_prefix_len_and_mask_meta():
    tree = TREES["skewed"]
    m = attention_mask_4d(tree, 12, "bfs")[0, 0]
    assert dense_prefix_len(m) == 13  # prefix + the root column (an ancestor of every node)
    meta = meta_from_mask(m, 16, 16)
    assert meta.prefix_len == 13 and meta.blocks.width == tree.size - 1
    assert torch.equal(meta.mask, m[:, 13:]) and not meta.dead_rows.any()
    assert dense_prefix_len(torch.zeros(3, 5, dtype=torch.bool)) == 0
    causal = torch.ones(4, 9, dtype=torch.bool).tril(5)
    assert dense_prefix_len(causal) == 6


def test_block_lists_empty_tree_part():
    bl = build_block_lists(torch.zeros(5, 0, dtype=torch.bool), 16, 16)
    assert int(bl.full_cnt.sum()) == 0 and int(bl.part_cnt.sum()) == 0


def test_dfs_reduces_blocks_on_dyspec_like_trees():
    """The DySpec appendix-C effect on our synthetic generator: DFS needs fewer 32-blocks than BFS."""
    for seed in range(3):
        tree = make_tree("dyspec", 512, seed)
        bfs, dfs = tree.block_count("bfs", 32), tree.block_count("dfs", 32)
        assert dfs < bfs


def test_synthetic_trees_are_deterministic_and_valid():
    a, b = dyspec_like_tree(200, seed=9), dyspec_like_tree(200, seed=9)
    assert torch.equal(a.parents, b.parents) and a.size == 200
    assert (a.parents[1:] < torch.arange(1, 200)).all()
    assert not torch.equal(a.parents, dyspec_like_tree(200, seed=10).parents)
    with pytest.raises(ValueError):
        make_tree("nope", 10, 0)


def test_a_steps_block_counts_skip_the_mask_where_one_tile_holds_it_and_stay_exact():
    """``engine._block_counts`` (each step's trace): a tree of at most the smallest block size is one tile of every
    size in every order, counted without building its mask; on random trees of 1..40 nodes the counts equal the
    tiles of the ancestor mask in each node order, counted the long way."""
    import random

    from dyntree_core.decode.engine import _block_counts
    from dyntree_core.tree import BLOCK_SIZES, ORDERS, tree_from_parents

    rng = random.Random(0)
    for n in range(1, 41):
        for _ in range(3):
            tree = tree_from_parents([-1] + [rng.randrange(i) for i in range(1, n)])
            anc = tree.ancestor_mask()
            want = {}
            for order in ORDERS:
                perm = tree.order(order)
                m = anc[perm][:, perm]
                want[order] = {}
                for b in BLOCK_SIZES:
                    k = -(-n // b)
                    padded = torch.zeros(k * b, k * b, dtype=torch.bool)
                    padded[:n, :n] = m
                    want[order][b] = int(padded.view(k, b, k, b).any(3).any(1).sum())
            assert _block_counts(tree) == want, n
    assert count_nonzero_blocks(torch.zeros(3, 5, dtype=torch.bool), 16) == 0  # one empty tile
