"""Sequoia: bounded-depth DP (fixtures of notes/sequoia.md §1.4), reconstruction, the
acceptance-vector estimator (§1.5) and the SWOR-filled static drafter."""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import pytest
import torch

from dyntree_core.config import DecodeConfig
from dyntree_core.drafting import PathFunctionSource, SequoiaDrafter, estimate_acceptance_vector, make_drafter
from dyntree_core.drafting.sequoia import (
    best_size,
    default_acceptance_vector,
    sequoia_dp,
    sequoia_shape,
    sequoia_tree,
    specinfer_expected,
)

# first entries of the Sequoia repo's example vector (notes §1.4); the unknown tail p_10..p_32
# (mass .0509) is set to 0 — the fixtures below are the values that do not depend on it
REPO_P = (0.6342, 0.1079, 0.0570, 0.0225, 0.0195, 0.0150, 0.0045, 0.0030, 0.0120) + (0.0,) * 23


@pytest.fixture(scope="module")
def repo_table():
    return sequoia_dp(REPO_P, 65, 24)


def test_dp_reproduces_notes_fixtures(repo_table):
    fixtures = {
        4: {1: 1.000, 2: 1.634, 4: 2.291, 8: 2.593, 16: 2.865, 32: 3.056},
        7: {1: 1.000, 2: 1.634, 4: 2.291, 8: 2.732, 16: 3.125, 32: 3.463, 64: 3.788},
        10: {1: 1.000, 2: 1.634, 4: 2.291, 8: 2.732, 16: 3.130, 32: 3.501, 64: 3.852},
    }
    for d, row in fixtures.items():
        for n, g in row.items():
            assert round(repo_table.G(n, d), 3) == pytest.approx(g, abs=1e-9), (n, d)
    # the unbounded optimum (depth 24 is not binding) against SpecInfer trees of the same size
    assert round(repo_table.G(41, 24), 3) == 3.631 and round(repo_table.G(65, 24), 3) == 3.863
    assert round(specinfer_expected(REPO_P, 5, 8), 3) == 3.239
    assert round(specinfer_expected(REPO_P, 8, 8), 3) == 3.299


def _brute_force_best(p, n, levels):
    """Exhaustive optimum: every ordered list of root-branch subtree sizes."""
    k = len(p)

    @lru_cache(maxsize=None)
    def best(m, l):
        if m == 1:
            return 1.0
        if l == 1:
            return -math.inf
        out = -math.inf

        def rec(rest, pos, acc):
            nonlocal out
            if rest == 0:
                out = max(out, acc)
                return
            if pos >= k:
                return
            for s in range(1, rest + 1):
                sub = best(s, l - 1)
                if sub > -math.inf:
                    rec(rest - s, pos + 1, acc + p[pos] * sub)

        rec(m - 1, 0, 1.0)
        return out

    return best(n, levels)


def test_dp_matches_exhaustive_search_and_reconstruction():
    for p in ((0.5, 0.3, 0.1), (0.7, 0.0, 0.2), (0.3, 0.35, 0.05, 0.2)):  # incl. a zero and non-monotone p
        table = sequoia_dp(p, 9, 5)
        assert not np.isnan(table.T).any()
        for n in range(1, 10):
            for l in range(1, 6):
                ref = _brute_force_best(p, n, l)
                g = table.G(n, l)
                if ref == -math.inf:
                    assert g == -math.inf
                    with pytest.raises(ValueError):
                        sequoia_tree(table, n, l)
                    continue
                assert g == pytest.approx(ref, abs=1e-12), (p, n, l)
                shape = sequoia_tree(table, n, l)
                assert shape.size == n and max(shape.depths()) <= l - 1
                assert shape.expected == pytest.approx(g, abs=1e-12) == pytest.approx(sum(shape.score))
                assert max(shape.position) <= len(p)


def test_dp_erratum_one_node_trees_have_no_children():
    table = sequoia_dp((0.6, 0.3), 4, 3)
    assert (table.T[1, :, 1:] == -np.inf).all()  # paper's ¬b would put 0 here
    assert table.T[2, 2, 2] == -np.inf  # 2 nodes cannot have 2 root children
    assert table.G(3, 2) == pytest.approx(1 + 0.6 + 0.3)
    chain_only = sequoia_dp((0.5,), 5, 3)  # K = 1: a chain, at most 3 nodes in 3 levels
    assert chain_only.G(3, 3) == pytest.approx(1.75) and chain_only.G(4, 3) == -np.inf
    assert best_size(chain_only, 5, 3) == 3


def test_estimator_known_answers():
    gen = torch.Generator().manual_seed(0)
    # V = 2: first draw a (q=.6) accepted w.p. .5 else b surely; draw b accepted surely -> (.7, .3)
    p_t = torch.tensor([[0.3, 0.7]]).expand(6000, -1)
    q_d = torch.tensor([[0.6, 0.4]]).expand(6000, -1)
    est = estimate_acceptance_vector(q_d, p_t, 2, gen)
    assert est.tolist() == pytest.approx([0.7, 0.3], abs=0.025)
    # identical distributions: the first child is always accepted
    same = torch.softmax(torch.randn(50, 7, generator=gen), 1)
    assert estimate_acceptance_vector(same, same, 4, gen).tolist() == pytest.approx([1, 0, 0, 0], abs=1e-9)
    # cover property: draft support of size 3 containing the target support -> Σ_{j<=3} p_j = 1
    tgt = torch.tensor([[0.2, 0.5, 0.3, 0.0, 0.0]]).expand(200, -1)
    drf = torch.tensor([[0.6, 0.2, 0.2, 0.0, 0.0]]).expand(200, -1)
    assert float(estimate_acceptance_vector(drf, tgt, 3, gen).sum()) == pytest.approx(1.0, abs=1e-9)
    # p_1 = 1 - TV(p, q) in expectation (optimal transport property)
    a = torch.softmax(torch.randn(1, 6, generator=gen) * 2, 1).expand(8000, -1)
    b = torch.softmax(torch.randn(1, 6, generator=gen) * 2, 1).expand(8000, -1)
    p1 = float(estimate_acceptance_vector(b, a, 1, gen)[0])
    assert p1 == pytest.approx(float(torch.minimum(a[0], b[0]).sum()), abs=0.02)
    # greedy: child j is the draft's j-th most likely token, accepted iff it is the target argmax
    det = estimate_acceptance_vector(
        torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.2, 0.7]]), torch.tensor([[0.1, 0.8, 0.1], [0.1, 0.2, 0.7]]), 3, gen, deterministic=True
    )
    assert det.tolist() == [0.5, 0.5, 0.0]


def toy(v, seed=0):
    def fn(path):
        g = torch.Generator().manual_seed(seed * 7919 + hash(path) % (2**31))
        return torch.softmax(torch.randn(v, generator=g) * 1.5, 0)

    return fn


def test_sequoia_drafter_fills_cached_shape_level_by_level():
    cfg = DecodeConfig(method="sequoia", budget=24, depth=4, temperature=1.0)
    drafter = make_drafter(cfg)
    assert isinstance(drafter, SequoiaDrafter) and drafter.acceptance == default_acceptance_vector()
    shape = sequoia_shape(drafter.acceptance, 24, 5)
    assert drafter.shape is shape  # computed once, cached
    v = 40
    for det in (False, True):
        src = PathFunctionSource(toy(v, 3), v)
        tree = drafter.draft(src, 5, torch.Generator().manual_seed(1), deterministic=det)
        assert tree.sampled == ("topk" if det else "swor")
        assert tree.parents.tolist() == list(shape.parents) and tree.value.tolist() == pytest.approx(shape.score)
        levels_with_children = len({d for u, d in enumerate(shape.depths()) if u in shape.parents})
        assert drafter.last_stats.forward_calls == levels_with_children <= cfg.depth
        kids = tree.children()
        assert sorted(src.requested) == [u for u in range(tree.size) if kids[u]]  # no leaf requested
        for u in range(tree.size):
            toks = tree.tokens[kids[u]].tolist()
            assert len(set(toks)) == len(toks)
            if det and kids[u]:
                q = tree.draft_dist(u)
                assert toks == torch.topk(q, len(toks)).indices.tolist()
            for c in kids[u]:
                assert float(tree.draft_logprob[c]) == pytest.approx(math.log(float(tree.draft_dist(u)[tree.tokens[c]])), rel=1e-6)


def test_sequoia_uses_config_acceptance_vector():
    cfg = DecodeConfig(method="sequoia", budget=10, depth=3, sequoia_acceptance=(0.9,))
    tree = make_drafter(cfg).draft(PathFunctionSource(toy(6), 6), 0, torch.Generator(), deterministic=True)
    assert tree.size == 4 and tree.parents.tolist() == [-1, 0, 1, 2]  # K = 1 -> a chain of 3
