"""DySpec drafters: greedy heap (Alg. 1 / App. D.1) and threshold (Alg. 2), on toy sources."""

from __future__ import annotations

import math

import torch

from dyntree_core.config import DecodeConfig
from dyntree_core.drafting import DySpecGreedyDrafter, DySpecThresholdDrafter, PathFunctionSource, make_drafter
from drafting_toys import path_tokens, toy, weight


def brute_force_max_subtree(fn, v, depth, size, root=0):
    """Max total weight of a root-connected subtree with ``size`` nodes (root incl.) and at most
    ``depth`` levels below the root, by enumerating every such subtree of the complete tree."""
    best = [-1.0, None]

    def children(p):
        return [p + (t,) for t in range(v)] if len(p) - 1 < depth else []

    def rec(selected, total, frontier):
        if len(selected) == size:
            if total > best[0] + 1e-15:
                best[0], best[1] = total, set(selected)
            return
        if not frontier:
            return
        c, rest = frontier[0], frontier[1:]
        rec(selected + [c], total + weight(fn, c), rest + children(c))
        rec(selected, total, rest)

    rec([(root,)], 0.0, children((root,)))
    return best[0], best[1]


def drafted_weight(tree):
    return float(tree.value[1:].sum())


def test_greedy_topk_equals_brute_force_max_weight_subtree():
    cases = [(3, 3, 4, 0), (3, 3, 7, 1), (4, 2, 6, 2), (3, 2, 9, 3)]
    for v, depth, budget, seed in cases:
        fn = toy(v, seed)
        cfg = DecodeConfig(method="dyspec_greedy", budget=budget, depth=depth)
        tree = make_drafter(cfg).draft(PathFunctionSource(fn, v), 0, torch.Generator(), deterministic=True)
        assert tree.sampled == "topk" and tree.size == budget
        best, nodes = brute_force_max_subtree(fn, v, depth, budget)
        got = {path_tokens(tree, i) for i in range(tree.size)}
        assert math.isclose(drafted_weight(tree), best, rel_tol=1e-6), (v, depth, budget)
        assert got == nodes, (v, depth, budget)
        for i in range(1, tree.size):  # value = product of draft probs along the path
            assert math.isclose(float(tree.value[i]), weight(fn, path_tokens(tree, i)), rel_tol=1e-5)


def test_algorithm1_v_keys_are_not_max_weight_with_topk():
    """Documents why the deterministic mode uses App. D.1 node weights: with Alg. 1's
    sampling-value keys the top-k tree would pick A then A's child (.9), not A, B (1.0)."""
    dists = {(0,): [0.0, 0.6, 0.4, 0.0], (0, 1): [0.0, 0.0, 0.5, 0.5]}
    fn = lambda p: torch.tensor(dists.get(p, [0.25] * 4))  # noqa: E731
    cfg = DecodeConfig(method="dyspec_greedy", budget=3, depth=3)
    tree = make_drafter(cfg).draft(PathFunctionSource(fn, 4), 0, torch.Generator(), deterministic=True)
    assert sorted(tree.tokens.tolist()[1:]) == [1, 2] and math.isclose(drafted_weight(tree), 1.0, rel_tol=1e-6)


def test_greedy_stochastic_budget_swor_keys_and_batched_calls():
    v, budget, depth = 12, 40, 6
    fn = toy(v, 5, peak=2.0)
    cfg = DecodeConfig(method="dyspec_greedy", budget=budget, depth=depth, temperature=1.0)
    drafter = make_drafter(cfg)
    for seed in range(5):
        src = PathFunctionSource(fn, v)
        tree = drafter.draft(src, 3, torch.Generator().manual_seed(seed))
        st = drafter.last_stats
        assert tree.sampled == "swor" and tree.size == budget and tree.num_levels - 1 <= depth
        assert st.forward_calls == src.forward_calls <= 2 * depth < budget // 2
        assert st.requested_nodes <= 2 * budget
        kids = tree.children()
        included, frontier = [], []
        for u in range(tree.size):
            toks = tree.tokens[kids[u]].tolist()
            assert len(set(toks)) == len(toks)  # without replacement
            w_u = float(tree.value[u])
            acc = 1.0
            for c in kids[u]:
                q = math.exp(float(tree.draft_logprob[c]))
                assert math.isclose(q, float(tree.draft_dist(u)[tree.tokens[c]]), rel_tol=1e-5)
                assert math.isclose(float(tree.value[c]), w_u * q, rel_tol=1e-9)
                included.append(w_u * acc)  # Alg. 1 key of the draw that produced c
                acc -= q
            if int(tree.depth[u]) < depth and acc > 1e-9:
                frontier.append(w_u * acc)  # next draw at u (the first one for a leaf)
        # greedy invariant: every performed draw outranks every draw left undone
        assert min(included) >= max(frontier) - 1e-9


def test_greedy_stochastic_first_child_is_a_draft_sample():
    """The first child's token frequencies over 1,500 drafts are within 0.04 of q: false alarm
    2.6e-3, power 0.99 against a shift of 0.070 or more in any token (a deterministic first child,
    the argmax, shifts the top token by 0.55). n is kept: the tolerance is absolute, so the
    false-alarm rate falls only as n grows and 1,500 is the fewest drafts that keep today's."""
    v = 5
    q = torch.tensor([0.45, 0.3, 0.15, 0.1, 0.0])
    fn = lambda p: q  # noqa: E731
    drafter = DySpecGreedyDrafter(DecodeConfig(method="dyspec_greedy", budget=3, depth=2, temperature=1.0))
    counts = torch.zeros(v)
    gen = torch.Generator().manual_seed(0)
    n = 1500
    for _ in range(n):
        tree = drafter.draft(PathFunctionSource(fn, v), 0, gen)
        counts[int(tree.tokens[tree.children()[0][0]])] += 1
    assert torch.allclose(counts / n, q, atol=0.04)


def threshold_nodes(fn, v, depth, t, root=0):
    """All paths of weight >= t within the depth cap (the deterministic threshold tree)."""
    out, stack = {(root,)}, [(root,)]
    while stack:
        p = stack.pop()
        if len(p) - 1 >= depth:
            continue
        for tok in range(v):
            c = p + (tok,)
            if weight(fn, c) >= t:
                out.add(c)
                stack.append(c)
    return out


def test_threshold_topk_is_all_nodes_above_t_and_matches_greedy():
    v, depth, t = 4, 4, 0.04
    fn = toy(v, 7)
    cfg = DecodeConfig(method="dyspec_threshold", budget=4096, depth=depth, threshold=t)
    src = PathFunctionSource(fn, v)
    drafter = make_drafter(cfg)
    tree = drafter.draft(src, 0, torch.Generator(), deterministic=True)
    expected = threshold_nodes(fn, v, depth, t)
    assert {path_tokens(tree, i) for i in range(tree.size)} == expected
    assert drafter.last_stats.forward_calls <= depth
    greedy = make_drafter(DecodeConfig(method="dyspec_greedy", budget=len(expected), depth=depth))
    g_tree = greedy.draft(PathFunctionSource(fn, v), 0, torch.Generator(), deterministic=True)
    assert {path_tokens(g_tree, i) for i in range(g_tree.size)} == expected


def test_threshold_stochastic_layers_keys_and_budget_cap():
    v, depth, t = 10, 5, 0.03
    fn = toy(v, 11, peak=2.0)
    for budget in (4096, 12):
        drafter = DySpecThresholdDrafter(DecodeConfig(method="dyspec_threshold", budget=budget, depth=depth, threshold=t, temperature=1.0))
        for seed in range(4):
            src = PathFunctionSource(fn, v)
            tree = drafter.draft(src, 0, torch.Generator().manual_seed(seed))
            st = drafter.last_stats
            assert tree.sampled == "swor" and tree.size <= budget and tree.num_levels - 1 <= depth
            assert st.forward_calls <= tree.num_levels <= depth + 1  # one call per expanded layer
            kids = tree.children()
            internal = [u for u in range(tree.size) if kids[u]]
            assert set(src.requested) >= set(internal)
            if budget == 4096:
                assert set(src.requested) == set(internal)  # no wasted request
            for u in internal:
                w_u, acc = float(tree.value[u]), 1.0
                toks = tree.tokens[kids[u]].tolist()
                assert len(set(toks)) == len(toks)
                for c in kids[u]:
                    assert w_u * acc >= t - 1e-12  # every draw was made at key >= t
                    acc -= math.exp(float(tree.draft_logprob[c]))
                if budget == 4096:
                    assert w_u * acc < t  # and drawing stopped at the first key below t
            if budget == 12:
                assert tree.size == 12


def test_greedy_topk_certifies_unlikely_nodes():
    """A node whose children look hopeless from the running mean confidence (C: weight .06)
    must still be evaluated: its point-mass child (.06) beats the flat children of A and B."""
    v = 8
    dists = {
        (0,): [0.0, 0.45, 0.45, 0.06, 0.04, 0.0, 0.0, 0.0],
        (0, 3): [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    }
    fn = lambda p: torch.tensor(dists.get(p, [1 / v] * v))  # noqa: E731
    cfg = DecodeConfig(method="dyspec_greedy", budget=5, depth=3)
    tree = make_drafter(cfg).draft(PathFunctionSource(fn, v), 0, torch.Generator(), deterministic=True)
    best, nodes = brute_force_max_subtree(fn, v, 3, 5)
    assert {path_tokens(tree, i) for i in range(tree.size)} == nodes
    assert (0, 3, 1) in nodes and math.isclose(drafted_weight(tree), best, rel_tol=1e-6)


def test_greedy_calls_stay_near_depth():
    v = 60
    fn = toy(v, 21, peak=3.0)
    for det in (False, True):
        drafter = make_drafter(DecodeConfig(method="dyspec_greedy", budget=64, depth=8, temperature=0.0 if det else 1.0))
        for seed in range(3):
            drafter.draft(PathFunctionSource(fn, v), 0, torch.Generator().manual_seed(seed), deterministic=det)
            st = drafter.last_stats
            assert st.nodes == 64 and st.forward_calls <= 2 * 8, (det, st)
