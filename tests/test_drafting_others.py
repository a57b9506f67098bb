"""Chain, SpecInfer, OPT-Tree and DynaTree drafters on toy sources."""

from __future__ import annotations

import pytest
import torch

from dyntree_core.config import DecodeConfig
from dyntree_core.drafting import DynaTreeDrafter, DynaTreeParams, PathFunctionSource, make_drafter
from drafting_toys import path_tokens, toy, weight


class RecordingSource(PathFunctionSource):
    """Keeps the working tree of the last call, to check ``source_index``."""

    def next_probs(self, tokens, parents, nodes):
        self.last_tokens, self.last_parents = list(tokens), list(parents)
        return super().next_probs(tokens, parents, nodes)


def test_chain_lengths_calls_and_greedy_path():
    v, k = 6, 5
    fn = toy(v, 1)
    d = make_drafter(DecodeConfig(method="chain", depth=k, temperature=1.0))
    tree = d.draft(PathFunctionSource(fn, v), 2, torch.Generator().manual_seed(0))
    assert tree.sampled == "iid" and tree.size == k + 1 and tree.parents.tolist() == list(range(-1, k))
    assert d.last_stats.forward_calls == k and tree.draft_probs.shape == (k, v)
    det = d.draft(PathFunctionSource(fn, v), 2, torch.Generator(), deterministic=True)
    path = (2,)
    for i in range(1, k + 1):
        path = path + (int(torch.argmax(fn(path))),)
    assert det.sampled == "topk" and tuple(det.tokens.tolist()) == path


def test_chain_first_token_is_a_draft_sample():
    """The first drafted token's frequencies over 1,500 drafts are within 0.04 of q: false alarm
    2.8e-3, power 0.99 against a shift of 0.070 or more in any token (the argmax instead of a sample
    shifts the top token by 0.5). n is kept: the tolerance is absolute, so the false-alarm rate falls
    only as n grows and 1,500 is the fewest drafts that keep today's."""
    q = torch.tensor([0.5, 0.3, 0.2, 0.0])
    d = make_drafter(DecodeConfig(method="chain", depth=1, temperature=1.0))
    gen = torch.Generator().manual_seed(4)
    counts = torch.zeros(4)
    for _ in range(1500):
        counts[int(d.draft(PathFunctionSource(lambda p: q, 4), 0, gen).tokens[1])] += 1
    assert torch.allclose(counts / 1500, q, atol=0.04)


def test_specinfer_shape_calls_and_modes():
    v, k, L = 5, 4, 3
    fn = toy(v, 2)
    d = make_drafter(DecodeConfig(method="specinfer", width=k, depth=L, budget=2, temperature=1.0))
    tree = d.draft(PathFunctionSource(fn, v), 0, torch.Generator().manual_seed(0))
    assert tree.size == 1 + k * L and tree.sampled == "iid"  # not capped by the budget
    assert d.last_stats.forward_calls == L
    kids = tree.children()
    assert len(kids[0]) == k and all(len(kids[c]) == 1 for c in range(1, tree.size) if tree.depth[c] < L)
    det = d.draft(PathFunctionSource(fn, v), 0, torch.Generator(), deterministic=True)
    first = det.tokens[det.children()[0]].tolist()
    assert first == torch.topk(fn((0,)), k).indices.tolist() and det.sampled == "topk"
    # i.i.d. with replacement: duplicates among the root's children occur
    peaked = lambda p: torch.tensor([0.9, 0.1, 0.0, 0.0, 0.0])  # noqa: E731
    t2 = d.draft(PathFunctionSource(peaked, v), 0, torch.Generator().manual_seed(1))
    assert len(set(t2.tokens[t2.children()[0]].tolist())) < k


def top_n_weights(fn, v, depth, n, root=0):
    ws = []
    frontier = [(root,)]
    for _ in range(depth):
        frontier = [p + (t,) for p in frontier for t in range(v)]
        ws += [weight(fn, p) for p in frontier]
    return sorted(ws, reverse=True)[:n]


def test_opt_tree_is_top_n_of_the_complete_tree():
    for v, depth, budget, seed in ((3, 3, 6, 0), (4, 3, 9, 1), (3, 4, 13, 2), (5, 2, 4, 3)):
        fn = toy(v, seed)
        cfg = DecodeConfig(method="opt_tree", budget=budget, depth=depth, threshold=1e-9)
        src = RecordingSource(fn, v)
        tree = make_drafter(cfg).draft(src, 0, torch.Generator(), deterministic=False)
        assert tree.sampled == "topk" and tree.size == budget
        ref = top_n_weights(fn, v, depth, budget - 1)
        assert sorted(tree.value[1:].tolist(), reverse=True) == pytest.approx(ref, rel=1e-6)
        for i in range(1, tree.size):
            assert float(tree.value[i]) == pytest.approx(weight(fn, path_tokens(tree, i)), rel=1e-5)
        # source_index maps every node back to the working tree the source saw (nodes added
        # after the last call extend that append-only list)
        si = tree.source_index.tolist()
        internal = {int(p) for p in tree.parents[1:].tolist()}
        assert all(si[u] < len(src.last_tokens) for u in internal)
        for i, j in enumerate(si):
            if j < len(src.last_tokens):
                assert src.last_tokens[j] == int(tree.tokens[i])
                if i > 0:
                    assert src.last_parents[j] == si[int(tree.parents[i])]
        # the deterministic DySpec greedy reaches the same optimum
        g = make_drafter(DecodeConfig(method="dyspec_greedy", budget=budget, depth=depth))
        gt = g.draft(PathFunctionSource(fn, v), 0, torch.Generator(), deterministic=True)
        assert {path_tokens(gt, i) for i in range(gt.size)} == {path_tokens(tree, i) for i in range(tree.size)}


def test_opt_tree_delta_rule_hand_example():
    A, B, C, D, E, F, X = 1, 2, 3, 4, 5, 6, 7
    table = {(0,): {A: 0.6, B: 0.3, C: 0.1}, (0, A): {D: 0.55, E: 0.40, X: 0.05}, (0, B): {F: 0.9, X: 0.1}}

    def fn(path):
        row = torch.zeros(8)
        for t, p in table.get(path, {X: 0.5, D: 0.5}).items():
            row[t] = p
        return row

    def run(delta):
        d = make_drafter(DecodeConfig(method="opt_tree", budget=4, depth=6, threshold=delta))
        tree = d.draft(PathFunctionSource(fn, 8), 0, torch.Generator())
        return tree, d.last_stats

    tree, st = run(0.5)  # layer 2 raises E_sub 1.0 -> 1.23 (gain .23 <= .5): stop
    assert st.forward_calls == 2
    assert {path_tokens(tree, i) for i in range(1, 4)} == {(0, A), (0, A, D), (0, B)}
    assert float(tree.value.sum()) - 1 == pytest.approx(1.23)
    _, st = run(0.2)  # gain .23 > .2: a third layer is drafted
    assert st.forward_calls >= 3


def test_dynatree_rule_tables():
    p = DynaTreeParams(n_max=64, d_max=8, d0=5, rho_stop=0.1, rho_deep=0.5, tau_prune=0.05)
    assert [p.branches(c) for c in (0.95, 0.9, 0.5, 0.4, 0.39)] == [1, 1, 2, 2, 3]
    assert p.expandable(4, 0.2) and not p.expandable(5, 0.2) and p.expandable(5, 0.6)
    assert not p.expandable(8, 1.0) and not p.expandable(1, 0.05)
    cfg_p = DynaTreeParams.from_config(DecodeConfig(method="dynatree", depth=8, width=2, threshold=0.05, budget=30))
    assert (cfg_p.d0, cfg_p.d_max, cfg_p.n_max, cfg_p.b_max, cfg_p.tau_prune) == (5, 8, 30, 2, 0.05)


def test_dynatree_tree_invariants():
    v = 12
    fn = toy(v, 9, peak=2.5)
    for budget in (64, 9):
        cfg = DecodeConfig(method="dynatree", budget=budget, depth=6, width=3, threshold=0.05)
        d = make_drafter(cfg)
        src = PathFunctionSource(fn, v)
        tree = d.draft(src, 0, torch.Generator())
        prm = d.params
        assert tree.sampled == "topk" and tree.size <= budget and tree.num_levels - 1 <= 6
        assert d.last_stats.forward_calls <= 6
        kids = tree.children()
        for u in range(tree.size):
            pu = float(tree.value[u])
            assert pu == pytest.approx(weight(fn, path_tokens(tree, u)), rel=1e-5)
            if u > 0:
                assert pu >= prm.tau_prune  # pruned nodes never enter the tree
            if kids[u]:
                assert prm.expandable(int(tree.depth[u]), pu)
                q = fn(path_tokens(tree, u))
                b = prm.branches(float(q.max()))
                top = torch.topk(q, b).indices.tolist()
                assert tree.tokens[kids[u]].tolist() == top[: len(kids[u])]
                if budget == 64:  # no budget truncation: exactly the top-B children above τ
                    assert len(kids[u]) == sum(1 for t in top if pu * float(q[t]) >= prm.tau_prune)
        if budget == 9:
            assert tree.size == 9


def test_dynatree_history_adjustment_and_reset():
    cfg = DecodeConfig(method="dynatree", budget=32, depth=8, threshold=0.05)
    d = DynaTreeDrafter(cfg)
    tree = d.draft(PathFunctionSource(toy(6, 1, peak=3.0), 6), 0, torch.Generator())
    depth = tree.num_levels - 1
    start = d.params
    for _ in range(4):
        d.observe(tree, depth)
    assert d.params == start  # fewer than 5 observations: no change
    d.observe(tree, depth)
    assert d.params.d0 == min(start.d0 + 1, cfg.depth - 1) and d.params.tau_h == pytest.approx(start.tau_h - 0.05)
    for _ in range(40):
        d.observe(tree, depth)
    assert d.params.d0 == cfg.depth - 1 and d.params.tau_h == pytest.approx(0.5) and d.params.rho_deep == pytest.approx(0.3)
    for _ in range(60):
        d.observe(tree, 0)
    assert d.params.d0 == 2 and d.params.tau_h == pytest.approx(0.95) and d.params.rho_deep == pytest.approx(0.8)
    d.reset()
    assert d.params == start and d.history == []
