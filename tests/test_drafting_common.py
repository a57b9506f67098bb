"""Sampling helpers, tree builder and registry of dyntree_core.drafting."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from dyntree_core.config import METHODS, ConfigError, DecodeConfig
from dyntree_core.drafting import DRAFTERS, Drafter, PathFunctionSource, TreeBuilder, iid_draws, make_drafter, sibling_orders
from dyntree_core.methods import REGISTRY

#: drafters that read a draft model (the model-free ones are tested in test_drafting_suffix.py)
MODEL_DRAFTERS = [m for m in DRAFTERS if REGISTRY[m].uses_draft_model]

Q = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])


def test_swor_first_two_draws_match_sequential_sampling():
    """Each of the 12 ordered pairs' frequency lies within 4 standard errors (+ 1e-3) of
    q_a q_b / (1 - q_a). False alarm 7e-5 for the 12 cells together; power 0.99 against a shift of
    0.040 in the most likely pair (0.25, i.e. a sixth of it) or more, at n = 6,000 (kept: the
    tolerance is in standard errors, so the false-alarm rate does not depend on n, and 6,000 is the
    fewest samples at which that shift is caught). A second draw with replacement is caught by the
    distinct-siblings check whatever n."""
    n = 6000
    rows = Q.expand(n, -1).contiguous()
    toks, probs = sibling_orders(rows, 2, torch.Generator().manual_seed(1), deterministic=False)
    counts = torch.zeros(5, 5)
    for a, b in toks.tolist():
        counts[a, b] += 1
    for a, b in itertools.permutations(range(4), 2):
        exact = float(Q[a] * Q[b] / (1 - Q[a]))
        assert abs(counts[a, b].item() / n - exact) < 4 * (exact / n) ** 0.5 + 1e-3, (a, b)
    assert counts[4].sum() == 0 and counts[:, 4].sum() == 0  # zero-probability token never drawn early
    assert torch.allclose(probs, Q.double()[toks])
    assert (toks[:, 0] != toks[:, 1]).all()


def test_swor_uniform_fallback_past_support_and_topk():
    """The third draw from a row with two supported tokens is one of the three zero-probability
    tokens, each with frequency within 0.06 of 1/3 over 1,500 rows: false alarm 2.5e-6, power 0.99
    against a shift of 0.090 or more in one token's share. n is kept: the tolerance is absolute, so
    the false-alarm rate falls only as n grows and 1,500 is the fewest rows that keep today's."""
    rows = torch.tensor([[0.7, 0.3, 0.0, 0.0, 0.0]]).expand(1500, -1).contiguous()
    toks, probs = sibling_orders(rows, 5, torch.Generator().manual_seed(2), deterministic=False)
    assert all(sorted(t) == [0, 1, 2, 3, 4] for t in toks.tolist())  # a permutation of the vocabulary
    third = torch.bincount(toks[:, 2], minlength=5)[2:].float() / 1500
    assert torch.all((third - 1 / 3).abs() < 0.06)  # zero-probability tokens in uniform order
    assert (probs[:, 2:] == 0).all()
    det, dp = sibling_orders(Q.unsqueeze(0), 3, torch.Generator(), deterministic=True)
    assert det.tolist() == [[0, 1, 2]] and torch.allclose(dp, Q[:3].double().unsqueeze(0))


def test_iid_draws_frequencies_and_never_zero_probability():
    """16,000 draws: each token's frequency within 0.01 of q. False alarm 0.015 (mostly the 0.5
    token, at 2.5 standard errors), power 0.99 against a shift of 0.019 or more in any token. n is
    kept: the tolerance is absolute, so the false-alarm rate falls only as n grows and 8,000 rows
    are the fewest that keep today's."""
    rows = Q.expand(8000, -1).contiguous()
    toks, probs = iid_draws(rows, 2, torch.Generator().manual_seed(3))
    freq = torch.bincount(toks.flatten(), minlength=5).float() / toks.numel()
    assert torch.allclose(freq, Q, atol=0.01)
    assert (probs > 0).all() and torch.allclose(probs, Q.double()[toks])


def test_tree_builder_keep_renumbers_with_source_index():
    b = TreeBuilder(7)
    src = PathFunctionSource(lambda path: torch.full((4,), 0.25), 4)
    b.request(src, [0])
    a = b.add(0, 1, 0.25, 0.25)
    c = b.add(0, 2, 0.25, 0.25)
    b.request(src, [a, c])
    d = b.add(c, 3, 0.25, 0.0625)
    tree = b.build("swor", keep=[0, c, d])
    assert tree.tokens.tolist() == [7, 2, 3]
    assert tree.parents.tolist() == [-1, 0, 1]
    assert tree.source_index.tolist() == [0, c, d]
    assert tree.child_rank.tolist() == [0, 0, 0]  # re-densified among kept siblings
    assert tree.draft_probs.shape == (2, 4) and tree.draft_row.tolist() == [0, 1, -1]
    with pytest.raises(ValueError):
        b.build("swor", keep=[0, d])  # parent missing


def test_registry_covers_all_tree_methods():
    assert set(DRAFTERS) == set(METHODS) - {"autoregressive"}
    for m in DRAFTERS:
        d = make_drafter(DecodeConfig(method=m))
        assert d.name == m and isinstance(d, Drafter)
    with pytest.raises(ConfigError):
        make_drafter(DecodeConfig(method="autoregressive"))


def _toy(v: int, seed: int):
    def fn(path):
        g = torch.Generator().manual_seed(seed * 7919 + hash(path) % (2**31))
        row = torch.softmax(torch.randn(v, generator=g) * 2.0, 0)
        if v > 2 and len(path) % 2 == 0:
            row[torch.randint(0, v, (1,), generator=g)] = 0.0  # some zero-probability tokens
            row = row / row.sum()
        return row

    return fn


@pytest.mark.parametrize("method", MODEL_DRAFTERS)
def test_drafter_contract_on_small_cases(method):
    """Every drafter: valid tree, limits, rows and log-probs consistent with the source,
    distinct SWOR/top-k siblings, call accounting, and no request for an unused distribution
    where the algorithm allows it."""
    exact_requests = {"chain", "specinfer", "sequoia"}
    for v, budget, depth, width, seed in ((1, 5, 3, 2, 0), (3, 2, 1, 1, 1), (4, 9, 3, 3, 2), (7, 17, 4, 2, 3)):
        fn = _toy(v, seed)
        for det in (False, True):
            cfg = DecodeConfig(method=method, budget=budget, depth=depth, width=width, threshold=0.05, temperature=0.0 if det else 1.0)
            drafter = make_drafter(cfg)
            src = PathFunctionSource(fn, v)
            tree = drafter.draft(src, 0, torch.Generator().manual_seed(seed), deterministic=det)
            assert int(tree.tokens[0]) == 0 and tree.sampled == drafter.sampled_kind(det)
            if method == "chain":
                assert tree.size == depth + 1
            elif method == "specinfer":
                assert tree.size == 1 + min(width, v) * depth if det else 1 + width * depth
            else:
                assert tree.size <= budget
            assert tree.num_levels - 1 <= depth
            st = drafter.last_stats
            assert st.forward_calls == src.forward_calls and st.requested_nodes == len(src.requested)
            assert st.nodes == tree.size and st.construction_seconds >= 0
            kids = tree.children()
            si = tree.source_ids().tolist()
            internal = [u for u in range(tree.size) if kids[u]]
            if method in exact_requests or (method == "dyspec_threshold" and not det and tree.size < budget):
                assert sorted(src.requested) == sorted(si[u] for u in internal)
            for u in internal:
                q = fn(tuple(tree.tokens[tree.path_to(u)].tolist()))
                assert torch.allclose(tree.draft_dist(u), q)
                toks = tree.tokens[kids[u]].tolist()
                if tree.sampled != "iid":
                    assert len(set(toks)) == len(toks)
                if tree.sampled == "topk" and method != "specinfer":
                    assert [float(q[t]) for t in toks] == sorted((float(q[t]) for t in toks), reverse=True)
                for c in kids[u]:
                    lp = float(tree.draft_logprob[c])
                    assert lp == pytest.approx(math.log(float(q[tree.tokens[c]]))) if q[tree.tokens[c]] > 0 else lp == -math.inf


#: drafters that grow level by level and cap their depth at a step's ``levels`` (Sequoia's precomputed shape and
#: DynaTree's parameters keep ``cfg.depth``)
CAPPED = sorted({*(m for m in MODEL_DRAFTERS if m not in ("sequoia", "dynatree")), "hybrid"})


@pytest.mark.parametrize("method", CAPPED)
def test_a_step_drafts_no_more_levels_than_it_can_commit(method):
    """``draft(..., levels=L)``: a run with L + 1 tokens left commits at most L drafted tokens and the bonus, so
    the tree is at most L levels deep (and at least 1); without ``levels`` it keeps ``cfg.depth``; the cap lasts one
    call."""
    v, depth = 6, 5
    fn = _toy(v, 4)
    cfg = DecodeConfig(method=method, budget=24, depth=depth, width=2, threshold=0.01, temperature=0.0)
    drafter = make_drafter(cfg)
    deepest = {}
    for levels in (None, 2, 0, None):
        tree = drafter.draft(PathFunctionSource(fn, v), 0, torch.Generator().manual_seed(0), True, levels=levels)
        deepest[levels] = tree.num_levels - 1
        assert drafter.depth == depth  # (outside a call: uncapped)
    assert deepest[None] == depth or method in ("dyspec_threshold", "opt_tree")  # (they may stop earlier)
    assert deepest[2] <= 2 and deepest[0] == 1
    assert deepest[2] == min(2, deepest[None])


def test_topk_rows_matches_torch_topk_on_flat_and_peaked_rows():
    from dyntree_core.drafting.siblings import topk_rows

    g = torch.Generator().manual_seed(0)
    for v, k in ((5, 3), (2000, 1), (2000, 8), (7, 7)):
        scale = torch.tensor([0.01, 1.0, 4.0, 9.0]).unsqueeze(1)  # flat rows take the fallback path
        rows = torch.softmax(torch.randn(4, v, generator=g) * scale, 1)
        idx, vals = topk_rows(rows, k)
        ref = torch.topk(rows, k, dim=1).values
        assert torch.allclose(torch.from_numpy(vals).float(), ref)
        assert torch.equal(rows.gather(1, torch.from_numpy(idx)), ref)
