"""Hardware-aware choices on synthetic profiles with known optima, and the threshold controller."""

import math

import pytest

from dyntree_core.drafting.threshold_control import ThresholdController
from dyntree_core.planning.hardware import (
    HardwareProfile,
    choose_budget,
    sequoia_choose,
)


def synthetic_profile(knee: int = 64) -> HardwareProfile:
    ns = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    # flat up to the knee, then linear in n: the shape of a real GPU/CPU forward
    ts = [1.0 if n <= knee else n / knee for n in ns]
    return HardwareProfile("synthetic", 128, ns, ts, [1, 1024], [0.05, 0.05 + 1023 * 1e-4])


def test_interpolation_and_roundtrip(tmp_path):
    prof = synthetic_profile()
    assert prof.target_time(64) == pytest.approx(1.0)
    assert prof.target_time(192) == pytest.approx(3.0)
    assert prof.target_time(2048) == pytest.approx(32.0)  # linear extrapolation
    prof.save(tmp_path / "p.json")
    again = HardwareProfile.load(tmp_path / "p.json")
    assert again.target_time(192) == prof.target_time(192)


def test_sequoia_choose_finds_the_known_optimum():
    prof = synthetic_profile(knee=64)
    # G grows like log2(n), capped by depth: beyond the knee verification cost grows linearly,
    # so the optimum is the largest budget inside the flat region at the shallowest depth that
    # does not cap G (depth 6 for n=64: G = 7; deeper only adds draft cost).
    def g(n, d):
        return min(1 + math.log2(n), 1 + d)

    def levels(n, d):
        return [max(1, n // d)] * d

    best, cands = sequoia_choose(g, levels, prof, budgets=[8, 16, 32, 64, 128, 256], depths=range(1, 9))
    brute = min(cands, key=lambda c: (c.verify_seconds + c.draft_seconds) / c.expected_tokens)
    assert best == brute
    assert best.budget == 64 and best.depth == 6
    assert best.seconds_per_token == pytest.approx((1.0 + 6 * prof.draft_time(10)) / 7.0)


def test_choose_budget_prefers_the_cheapest_latency_per_token():
    prof = synthetic_profile(knee=32)
    measured = {16: (2.5, 0.2), 32: (3.0, 0.3), 64: (3.3, 0.4), 128: (3.5, 0.6)}
    best, pred = choose_budget(measured, prof)
    assert best == 32
    assert pred[64] == pytest.approx((2.0 + 0.4) / 3.3)


def size_for_threshold(t: float) -> int:
    """A toy draft: the number of tree nodes whose value >= t falls like 1/t (capped)."""
    return max(1, min(4096, int(3.0 / t)))


@pytest.mark.parametrize("target", [32, 64, 768])
def test_threshold_controller_tracks_target_size(target):
    ctl = ThresholdController(target, threshold=0.3)
    sizes = []
    for _ in range(60):
        size = size_for_threshold(ctl.threshold)
        sizes.append(size)
        ctl.update(size)
    tail = sizes[-20:]
    assert abs(sum(tail) / len(tail) - target) / target < 0.05


def test_threshold_controller_backs_off_a_binding_cap():
    cap = 64
    ctl = ThresholdController(cap, threshold=1e-4, cap=cap)
    for _ in range(40):
        ctl.update(min(cap, size_for_threshold(ctl.threshold)))
    # converged to the largest threshold that still fills the cap (3/64 ~ 0.047), not far below
    assert 0.03 < ctl.threshold < 0.06


def test_threshold_controller_rejects_bad_arguments():
    with pytest.raises(ValueError):
        ThresholdController(1, 0.1)
    with pytest.raises(ValueError):
        ThresholdController(64, 1.5)


def test_adaptive_dyspec_threshold_tracks_the_budget_on_a_toy_draft():
    """The drafter's own controller: a too-high fixed threshold under-uses the budget; the
    adaptive one grows the tree to it (DySpec's stated open problem)."""
    import torch

    from dyntree_core.config import DecodeConfig
    from dyntree_core.drafting import make_drafter
    from dyntree_core.drafting.base import PathFunctionSource

    vocab = 12

    def dist(path):
        g = torch.Generator().manual_seed(hash(path) % (2**31))
        return torch.softmax(torch.randn(vocab, generator=g) * 2.0, -1)

    sizes = {}
    for adaptive in (False, True):
        cfg = DecodeConfig(method="dyspec_threshold", temperature=1.0, budget=40, depth=6, threshold=0.2,
                           adaptive_threshold=adaptive)
        drafter = make_drafter(cfg)
        drafter.reset()
        got = []
        for step in range(30):
            tree = drafter.draft(PathFunctionSource(dist, vocab), step % vocab, torch.Generator().manual_seed(step))
            drafter.observe(tree, 0)
            got.append(tree.size)
        sizes[adaptive] = sum(got[-10:]) / 10
    assert sizes[False] < 20
    assert sizes[True] > 0.8 * 40
