"""``auto``'s calibration (``planning.tuning``): the coordinate search on functions with a known
optimum, Sequoia through auto's closed-form price on a synthetic machine profile, calibrated tuning of
real drafters on the tiny pair priced from the one machine profile, and DySpec's threshold controller
that makes a threshold tree track the tuned budget."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from dyntree_core.config import DecodeConfig
from dyntree_core.drafting.threshold_control import ThresholdController
from dyntree_core.planning.machine_profile import MachineProfile
from dyntree_core.testing import tiny_pair
from dyntree_core.planning.grid_search import coordinate_search, paired_standard_error, select_within_noise
from dyntree_core.planning.tuning import CALIBRATION_NS, TUNING_VERSION, load_or_tune, tune, tuning_cache_path
from dyntree_core.planning.tuning_result import TuningPoint, TuningResult


def point(budget: int, depth: int, width: int, latency: float) -> TuningPoint:
    return TuningPoint(budget, depth, width, tokens_per_step=1.0, mean_tree_size=float(budget),
                       target_seconds=latency, overhead_seconds=0.0)


def knee_profile(knee: int, ns=CALIBRATION_NS) -> MachineProfile:
    """t(n) flat up to the knee, then linear in n (a real GPU/CPU forward's shape), at float32; a
    draft forward of m tokens costs 0.05 s + 1e-4 s per token."""
    return MachineProfile("synthetic", {"cpu_model": "test"}, 128, list(ns),
                          {"float32": [1.0 if n <= knee else n / knee for n in ns]},
                          {"float32": [0.05 + (n - 1) * 1e-4 for n in ns]}, [0.0] * len(ns))


@pytest.mark.parametrize("opt", [(8, 2), (64, 4), (256, 8), (32, 6)])
def test_coordinate_search_finds_the_optimum_of_a_separable_bowl(opt):
    budgets, depths = (8, 16, 32, 64, 128, 256), (2, 3, 4, 6, 8)
    calls = []

    def evaluate(b, d, w):
        calls.append((b, d))
        return point(b, d, w, 1.0 + (math.log2(b) - math.log2(opt[0])) ** 2 + 0.3 * (d - opt[1]) ** 2)

    best, order = coordinate_search(evaluate, {"budget": budgets, "depth": depths}, {"budget": 32, "depth": 4},
                                    fixed={"width": 8})
    assert (best.budget, best.depth) == opt
    assert len(calls) == len(set(calls)) == len(order)  # each point calibrated once
    assert len(calls) < len(budgets) * len(depths)
    assert best.width == 8


def test_coordinate_search_respects_the_evaluation_cap():
    best, order = coordinate_search(lambda b, d, w: point(b, d, w, -b - d), {"budget": (8, 16, 32, 64, 128, 256),
                                    "depth": (2, 3, 4, 6, 8)}, {"budget": 8, "depth": 2}, max_points=4)
    assert len(order) <= 4
    assert best.predicted_seconds_per_token == min(p.predicted_seconds_per_token for p in order)


def noisy(budget: int, per_prompt: tuple[float, ...]) -> TuningPoint:
    mean = sum(per_prompt) / len(per_prompt)
    return TuningPoint(budget, 4, 8, tokens_per_step=1.0, mean_tree_size=float(budget), target_seconds=mean,
                       overhead_seconds=0.0, per_prompt_seconds_per_token=per_prompt)


def test_paired_standard_error_of_a_known_difference():
    a, b = noisy(16, (1.0, 2.0, 3.0, 4.0)), noisy(64, (1.1, 1.9, 3.3, 3.9))
    # differences (-.1, .1, -.3, .1): stdev .1915, / sqrt(4)
    assert paired_standard_error(a, b) == pytest.approx(0.19148542 / 2, rel=1e-6)
    assert paired_standard_error(a, point(8, 2, 8, 1.0)) == 0.0  # nothing recorded: no noise estimate


def test_one_standard_error_rule_prefers_the_smaller_tree_only_when_tied():
    big = noisy(64, (1.00, 1.20, 0.90, 1.10))  # mean 1.05, the argmin
    # +0.01 on average, differences (+.06, -.04, +.06, -.04): SE .0289 > .01 -> tied -> smaller wins
    tied_small = noisy(16, (1.06, 1.16, 0.96, 1.06))
    assert select_within_noise([big, tied_small]) is tied_small
    # +0.1 on every prompt: SE 0 -> a real difference -> the argmin stays
    worse_small = noisy(16, (1.10, 1.30, 1.00, 1.20))
    assert select_within_noise([big, worse_small]) is big
    # a bigger tree tied with the argmin is never preferred
    tied_bigger = noisy(128, (1.06, 1.16, 0.96, 1.06))
    assert select_within_noise([big, tied_bigger]) is big
    # among several tied points the smallest tree wins, without per-prompt data plain argmin
    tiny = noisy(8, (1.02, 1.18, 0.94, 1.10))  # differences (.02, -.02, .04, 0)
    assert select_within_noise([big, tied_small, tiny]) is tiny
    assert select_within_noise([point(64, 4, 8, 1.0), point(16, 4, 8, 1.001)]).budget == 64
    with pytest.raises(ValueError):
        select_within_noise([])


def test_sequoia_tuning_is_the_brute_force_optimum_of_its_model():
    """Flat target cost up to the knee: Sequoia's optimizer never verifies a bigger tree than
    the knee, and its choice is the argmin of the same model over the whole grid."""
    prof = knee_profile(knee=32)
    cfg = DecodeConfig(method="sequoia", temperature=0.6)
    res = tune(None, None, cfg, prof, budgets=(8, 16, 32, 64, 128), depths=(2, 3, 4, 6))
    assert res.best.budget <= 32
    assert res.best.predicted_seconds_per_token == min(p.predicted_seconds_per_token for p in res.points)
    assert len(res.points) == 5 * 4
    # more budget never lowers G: the DP value grows with the budget at a fixed depth
    by_depth = {}
    for p in res.points:
        by_depth.setdefault(p.depth, []).append((p.budget, p.tokens_per_step))
    for pts in by_depth.values():
        g = [t for _, t in sorted(pts)]
        assert all(a <= b + 1e-12 for a, b in itertools.pairwise(g))


def test_sequoia_prices_one_draft_forward_per_level_with_internal_nodes():
    prof = knee_profile(knee=1024)
    cfg = DecodeConfig(method="sequoia", temperature=0.6, sequoia_acceptance=(0.8, 0.1, 0.05))
    res = tune(None, None, cfg, prof, budgets=(4,), depths=(3,))
    # p_1 = .8 dominates: the 4-node tree is a chain of 4, three internal levels, one node each
    assert res.best.mean_tree_size == 4
    assert res.best.overhead_seconds == pytest.approx(3 * prof.draft_time("float32", 1))


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(seed=3)


def prompts(n=2, length=6):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, 60, (length,), generator=g).tolist() for _ in range(n)]


@pytest.mark.parametrize("method", ["dyspec_greedy", "dyspec_threshold", "chain", "specinfer"])
def test_calibrated_tuning_on_the_tiny_pair(pair, method):
    draft, target = pair
    prof = knee_profile(knee=16)  # verifying more than 16 nodes costs proportionally more
    cfg = DecodeConfig(method=method, temperature=0.0, budget=64, depth=4, width=4)
    res = tune(draft, target, cfg, prof, prompts(), new_tokens=12, budgets=(8, 16, 32, 64), depths=(2, 3, 4))
    assert res.best in res.points
    argmin = min(res.points, key=lambda p: p.predicted_seconds_per_token)
    assert res.best.predicted_seconds_per_token <= argmin.predicted_seconds_per_token + paired_standard_error(
        res.best, argmin) + 1e-12
    assert res.best.mean_tree_size <= argmin.mean_tree_size
    assert res.meta["version"] == TUNING_VERSION and res.meta["argmin_budget"] == argmin.budget
    for p in res.points:
        assert p.tokens_per_step >= 1.0 and p.mean_tree_size >= 2 and p.overhead_seconds > 0
        assert math.isfinite(p.measured_seconds_per_token)
        assert len(p.per_prompt_seconds_per_token) == 2
        assert min(p.per_prompt_seconds_per_token) <= p.predicted_seconds_per_token <= max(
            p.per_prompt_seconds_per_token) + 1e-12
    tuned = res.apply(cfg)
    assert (tuned.budget, tuned.depth) == (res.best.budget, res.best.depth)
    if method == "dyspec_threshold":
        assert tuned.adaptive_threshold and tuned.threshold == pytest.approx(1.0 / res.best.budget)
    if method == "chain":
        assert all(p.budget == p.depth + 1 for p in res.points)
    if method == "specinfer":
        assert all(p.budget == p.width * p.depth + 1 for p in res.points)
    with pytest.raises(ValueError):
        res.apply(dataclasses.replace(cfg, method="opt_tree"))


def test_tuning_needs_calibration_prompts_and_a_tree_method(pair):
    draft, target = pair
    with pytest.raises(ValueError, match="calibration prompts"):
        tune(draft, target, DecodeConfig(method="dyspec_greedy"), knee_profile(16), [])
    with pytest.raises(ValueError, match="nothing to tune"):
        tune(draft, target, DecodeConfig(method="autoregressive"), knee_profile(16), prompts())


def test_tuning_is_cached_per_profile_method_and_temperature(pair, tmp_path, monkeypatch):
    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path))
    draft, target = pair
    prof = knee_profile(16)
    cfg = DecodeConfig(method="dyspec_greedy", temperature=0.0, depth=3)
    kw = dict(prompts=prompts(1), new_tokens=6, budgets=(8, 16), depths=(2, 3))
    first = load_or_tune(draft, target, cfg, prof, **kw)
    path = tuning_cache_path(prof.key, cfg)
    assert path.exists() and str(tmp_path) in str(path)
    again = load_or_tune(None, None, cfg, prof, **kw)  # from the cache: no model needed
    assert again == first
    assert TuningResult.from_json(first.to_json()) == first
    assert tuning_cache_path(prof.key, dataclasses.replace(cfg, temperature=0.6)) != path
    assert tuning_cache_path(prof.key, dataclasses.replace(cfg, precision="int8")) != path  # precisions are keyed
    # other calibration prompts: recomputed, unless any tuning of this machine will do
    other = dict(kw, prompts=prompts(1, length=5))
    assert load_or_tune(None, None, cfg, prof, same_calibration=False, **other) == first
    assert load_or_tune(draft, target, cfg, prof, **other).meta["calibration"] != first.meta["calibration"]
    first = load_or_tune(draft, target, cfg, prof, **kw)
    # a tuning cached by an older tuner (other selection rule) is recomputed, not trusted
    stale = dataclasses.replace(first, meta={"version": TUNING_VERSION - 1}, seconds=-1.0)
    path.write_text(stale.to_json())
    redone = load_or_tune(draft, target, cfg, prof, **kw)
    assert redone.seconds >= 0 and redone.meta["version"] == TUNING_VERSION
    assert TuningResult.from_json(path.read_text()).meta["version"] == TUNING_VERSION


def test_calibration_refuses_a_tree_size_the_profile_does_not_cover(pair):
    """The one interpolation policy: no price above the largest measured size, so a calibration on a
    profile that stops at 4 tokens fails by name instead of extrapolating."""
    draft, target = pair
    cfg = DecodeConfig(method="dyspec_greedy", temperature=0.0, budget=16, depth=3, precision="float32")
    with pytest.raises(ValueError, match="no target time for"):
        tune(draft, target, cfg, knee_profile(16, ns=(1, 2, 4)), prompts(1), new_tokens=6, budgets=(16,), depths=(3,))


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
