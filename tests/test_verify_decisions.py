"""The verifiers' decision records (the verification walkthrough): replaying the recorded
decisions retraces the recorded path and bonus, each draw is consistent with its uniform and
acceptance probability, and the records survive the StepTrace JSON round trip."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dyntree_core.trace import StepTrace
from dyntree_core.verify import make_verifier
from dyntree_core.verify.base import VerifyDecision
from dyntree_core.verify.common import ReplayDecisions, RngDecisions, top_tokens
from test_verify_expected import _random_tree

STOCHASTIC = ("token_level", "traversal", "point_mass")


def _trees(seed: int, sampled: str, count: int = 30):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        n = int(rng.integers(2, 14))
        yield _random_tree(rng, n, 9, sampled, peak=0.4)


@pytest.mark.parametrize("sampled", ["swor", "iid"])
@pytest.mark.parametrize("name", STOCHASTIC)
def test_replaying_the_decisions_retraces_the_path(name: str, sampled: str) -> None:
    verifier = make_verifier(name)
    rng = np.random.default_rng(5)
    kinds_seen: set[str] = set()
    for tree, target in _trees(11, sampled):
        for _ in range(4):
            res = verifier.run(tree, target, RngDecisions(rng))
            d = res.decisions
            kinds_seen.update(x.kind for x in d)
            assert d[-1].kind == "bonus" and d[-1].token == res.bonus_token and d[-1].node == res.path[-1]
            replay = ReplayDecisions(d)
            again = verifier.run(tree, target, replay)
            assert again.path == res.path and again.bonus_token == res.bonus_token
            assert replay.exhausted
            for x in d:
                if x.drew and x.kind in ("child", "node"):
                    assert x.u is not None and x.accepted == (x.u < x.accept_prob)
                if not x.drew:
                    assert x.u is None
    expected = {"token_level": {"child", "bonus"}, "traversal": {"enter", "node", "bonus"},
                "point_mass": {"sample", "bonus"}}[name]
    assert expected <= kinds_seen


def test_token_level_records_each_test_and_the_residual_after_each_rejection() -> None:
    verifier = make_verifier("token_level")
    rng = np.random.default_rng(3)
    rejections = 0
    for tree, target in _trees(21, "swor"):
        res = verifier.run(tree, target, RngDecisions(rng))
        tests = [x for x in res.decisions if x.kind == "child"]
        assert [x.node for x in tests if x.accepted] == res.path[1:]
        for x in tests:
            assert x.accept_prob == pytest.approx(min(1.0, x.p_target / x.q) if x.q > 0 else float(x.p_target > 0))
            assert x.accept_prob == pytest.approx(res.accept_prob[x.node])
            if not x.accepted:
                rejections += 1
                probs = [p for _, p in x.residual_top]
                assert x.residual_top and probs == sorted(probs, reverse=True) and sum(probs) <= 1 + 1e-9
        first = [x for x in tests if x.node in tree.children()[0]][:1]
        if first:  # the first test at the root uses the raw target and draft rows
            x = first[0]
            assert x.p_target == pytest.approx(float(target[0, x.token]))
            assert x.q == pytest.approx(float(tree.draft_probs[tree.draft_row[0], x.token]))
    assert rejections > 10


def test_the_residual_shown_after_a_rejection_is_the_next_tests_numerator() -> None:
    """Two children of the root, the first rejected: the second child's ``p_target`` is the
    residual ``norm(max(p - q, 0))`` at its token, as the first decision's top tokens say."""
    p = torch.tensor([[0.1, 0.6, 0.3], [1 / 3, 1 / 3, 1 / 3], [1 / 3, 1 / 3, 1 / 3]], dtype=torch.float64)
    q = torch.tensor([[0.7, 0.2, 0.1]], dtype=torch.float64)
    from dyntree_core.tree import TokenTree

    tree = TokenTree(tokens=torch.tensor([0, 0, 1]), parents=torch.tensor([-1, 0, 0]),
                     child_rank=torch.tensor([0, 0, 1]), draft_logprob=torch.zeros(3, dtype=torch.float64),
                     sampled="swor", draft_probs=q, draft_row=torch.tensor([0, -1, -1]))

    class RejectFirst:
        last_u = None

        def __init__(self):
            self.calls = 0

        def bernoulli(self, prob: float) -> bool:
            self.calls += 1
            return self.calls > 1

        def categorical(self, probs: np.ndarray) -> int:
            return int(np.argmax(probs))

    res = make_verifier("token_level").run(tree, p, RejectFirst())
    first, second = res.decisions[0], res.decisions[1]
    assert (first.node, first.accepted, first.accept_prob) == (1, False, pytest.approx(0.1 / 0.7))
    residual = np.maximum(p[0].numpy() - q[0].numpy(), 0)
    residual /= residual.sum()  # [0, 2/3, 1/3]
    assert dict(first.residual_top) == pytest.approx({1: 2 / 3, 2: 1 / 3})
    assert second.p_target == pytest.approx(residual[1])
    assert second.q == pytest.approx(0.2 / 0.3)  # token 0 drawn: q renormalised without it
    assert second.accepted and res.path == [0, 2]


def test_greedy_records_its_comparisons_in_walk_order() -> None:
    rng = np.random.default_rng(8)
    verifier = make_verifier("greedy")
    for tree, target in _trees(31, "swor"):
        res = verifier.verify(tree, target, rng)
        comps = [x for x in res.decisions if x.kind == "argmax"]
        assert [x.node for x in comps if x.accepted] == res.path[1:]
        assert all(not x.drew and x.u is None for x in res.decisions)
        assert res.decisions[-1].kind == "bonus" and res.decisions[-1].token == res.bonus_token
        assert sorted(x.node for x in comps) == sorted(np.flatnonzero(res.tested).tolist())


def test_top_tokens() -> None:
    dist = np.array([0.0, 0.5, 0.1, 0.4])
    assert top_tokens(dist, 2) == ((1, 0.5), (3, 0.4))
    assert top_tokens(dist, 10) == ((1, 0.5), (3, 0.4), (2, 0.1))  # zero-probability tokens left out


def test_decisions_survive_the_json_round_trip() -> None:
    d = VerifyDecision("child", 3, 7, 0.25, 0.5, 0.5, 0.7, True, False, ((1, 0.6), (2, 0.4)))
    bonus = VerifyDecision("bonus", 0, 1, math.nan, math.nan, 1.0, None, False, True)
    trace = StepTrace(step=0, method="chain", verifier="token_level", tree=None, accepted_nodes=[0],
                      bonus_token=1, committed=[], decisions=[d, bonus])
    back = StepTrace.from_dict(trace.to_dict())
    assert back.decisions[0] == d
    b = back.decisions[1]
    assert (b.kind, b.node, b.token, b.u, b.drew, b.accepted) == ("bonus", 0, 1, None, False, True)
    assert math.isnan(b.p_target) and math.isnan(b.q)
