"""``auto``'s calibration: the tree shape of a method ``auto`` cannot price in closed form (DySpec,
OPT-Tree, DynaTree, SpecInfer, ... chosen with ``--budget auto``), found by short decodes on this
machine.

Latency per token is the one step-cost formula (``pricing.seconds_per_token``): ``t(n)`` the
target forward of an n-node tree at the run's target precision from the one machine profile
(``machine_profile``), everything else a step costs (draft forwards, tree construction,
verification, KV work) measured by the calibration decodes, divided by the tokens per step the
method reaches with this pair.

* ``sequoia``: no decoding is needed: ``auto``'s closed-form price (``pricing.price_candidates``:
  Sequoia's DP under the acceptance vector, one batched draft forward per level) over the grid.
* every other tree method: candidate (budget, depth) points are *calibrated*: short decodes on
  prompts disjoint from any evaluation (the ``calib`` slice), recording tokens/step, tree sizes and
  the measured overhead; the target part comes from the profile at each step's tree size (the
  profile must cover ``CALIBRATION_NS``). A coordinate search over a (budget x depth) grid starts at a
  middle point and moves to the best neighbour until none improves (typically 5-9 calibrated points
  instead of the whole grid). ``chain`` searches its length only, ``specinfer`` its width x depth.
  Calibration is noisy (a few prompts, sampled drafts at T > 0), so the final pick follows the
  one-standard-error rule: the smallest tree whose predicted latency is within one paired standard
  error (over the calibration prompts) of the best point's (``select_within_noise``).
* ``dyspec_threshold``: the chosen budget is enforced by the online ``ThresholdController``
  (``adaptive_threshold=True``), so the threshold is picked too, and keeps adapting per prompt.

Results are cached as JSON per (profile, method, precisions, temperature) next to the profiles.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import math
import statistics
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from ..config import DecodeConfig, default_threshold
from ..methods import method_spec
from .grid_search import coordinate_search, middle, paired_standard_error, select_within_noise
from .machine_profile import MachineProfile
from .pricing import other_seconds, price_candidates
from .tuning_result import TuningPoint, TuningResult

BUDGET_GRID: tuple[int, ...] = (8, 16, 32, 64, 128, 256)
DEPTH_GRID: tuple[int, ...] = (2, 3, 4, 6, 8)
WIDTH_GRID: tuple[int, ...] = (1, 2, 4, 8)
CHAIN_GRID: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8)
TUNING_VERSION = 3  # cached tunings of another version are recomputed (2: one-standard-error pick,
# 3: priced from the one machine profile at the run's precisions)
#: target sizes the profile must cover before a calibration (every tree size up to the largest budget)
CALIBRATION_NS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)


def calibrate_point(
    draft,
    target,
    cfg: DecodeConfig,
    profile: MachineProfile,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    eos_token_id=None,
) -> TuningPoint:
    """Decode ``new_tokens`` after each prompt with ``cfg`` and summarise the steps (the target
    forward of each step priced from ``profile`` at ``cfg.precision``)."""
    from ..decode.engine import SpeculativeDecoder

    decoder = SpeculativeDecoder(draft, target, cfg, eos_token_id=eos_token_id)
    steps = tokens = 0
    sizes: list[int] = []
    per_prompt: list[float] = []
    target_s = overhead_s = wall = 0.0
    for i, ids in enumerate(prompts):
        p_tokens, p_seconds = 0, 0.0
        for tr in decoder.generate(list(ids), new_tokens, seed=cfg.seed + i):
            steps += 1
            sizes.append(tr.tree_size)
            t = profile.target_time(_precision(cfg), tr.tree_size)
            if not math.isfinite(t):
                raise ValueError(f"the machine profile has no target time for {tr.tree_size} tokens at "
                                 f"{_precision(cfg)}: measure it first (profile sizes CALIBRATION_NS)")
            o = tr.timings.draft + other_seconds(tr.tree_size, cfg.method, step=tr)  # draft + the one "other"
            target_s, overhead_s, wall = target_s + t, overhead_s + o, wall + tr.step_seconds
            p_tokens, p_seconds = p_tokens + len(tr.committed), p_seconds + t + o
        tokens += p_tokens
        if p_tokens:
            per_prompt.append(p_seconds / p_tokens)
    if not steps or not tokens:
        raise ValueError("calibration produced no steps: give non-empty prompts and new_tokens > 0")
    return TuningPoint(
        budget=cfg.budget, depth=cfg.depth, width=cfg.width,
        tokens_per_step=tokens / steps, mean_tree_size=statistics.fmean(sizes),
        target_seconds=target_s / steps, overhead_seconds=overhead_s / steps,
        measured_seconds_per_token=wall / tokens,
        per_prompt_seconds_per_token=tuple(per_prompt) if len(per_prompt) == len(prompts) else (),
    )


def tune(
    draft,
    target,
    cfg: DecodeConfig,
    profile: MachineProfile,
    prompts: Sequence[Sequence[int]] = (),
    new_tokens: int = 32,
    budgets: Sequence[int] = BUDGET_GRID,
    depths: Sequence[int] = DEPTH_GRID,
    widths: Sequence[int] = WIDTH_GRID,
    eos_token_id=None,
    progress: Optional[Callable[[str], None]] = None,
) -> TuningResult:
    """Choose ``cfg.method``'s tree configuration for this machine (see the module docstring).

    Args:
        cfg: the base configuration (method, temperature, verifier, dtype, device, seed...).
        profile: this machine's profile of the pair (``auto.profile_for``), covering the tree sizes.
        prompts: calibration prompts (token ids), disjoint from any evaluation; unused by Sequoia.
        new_tokens: tokens decoded per calibration prompt.
    """
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    budgets, depths = sorted(set(budgets)), sorted(set(depths))
    spec = method_spec(cfg.method)
    if spec.tuning == "none":
        raise ValueError(f"{cfg.method!r} has nothing to tune")
    if spec.tuning == "sequoia_dp":
        best, points = _tune_sequoia(cfg, profile, budgets, depths)
        strategy = "auto's closed-form Sequoia price: argmin (t(n) + sum_levels draft(width) + verify(n)) / G(n, d)"
        n_prompts, meta = 0, {}
    else:
        if not prompts:
            raise ValueError(f"tuning {cfg.method!r} needs calibration prompts")

        def evaluate(budget: int, depth: int, width: int) -> TuningPoint:
            c = dataclasses.replace(
                cfg, budget=max(2, budget), depth=depth, width=width or cfg.width, trace_block_counts=False,
                **({"adaptive_threshold": True, "threshold": default_threshold(budget)}
                   if spec.threshold_controlled else {}),
            )
            p = calibrate_point(draft, target, c, profile, prompts, new_tokens, eos_token_id)
            say(f"{cfg.method} budget={c.budget} depth={depth} width={c.width}: {p.tokens_per_step:.2f} tok/step, "
                f"tree {p.mean_tree_size:.1f}, predicted {p.predicted_seconds_per_token * 1e3:.1f} ms/token "
                f"(measured {p.measured_seconds_per_token * 1e3:.1f})")
            return p

        if spec.tuning == "chain_length":
            grid = sorted(set(CHAIN_GRID) | {cfg.depth})
            best, points = coordinate_search(
                lambda b, d, w: evaluate(d + 1, d, cfg.width), {"depth": grid}, {"depth": middle(grid, 4)})
            strategy = "calibrated coordinate search over the chain length"
        elif spec.tuning == "width_depth":
            wgrid = sorted(set(widths))
            best, points = coordinate_search(
                lambda b, d, w: evaluate(w * d + 1, d, w), {"width": wgrid, "depth": depths},
                {"width": middle(wgrid, 4), "depth": middle(depths, 4)})
            strategy = "calibrated coordinate search over width x depth"
        elif spec.tuning == "budget_depth":
            best, points = coordinate_search(
                evaluate, {"budget": budgets, "depth": depths},
                {"budget": middle(budgets, 32), "depth": middle(depths, 4)}, fixed={"width": cfg.width})
            strategy = "calibrated coordinate search over budget x depth"
        else:
            raise ValueError(f"method {cfg.method!r}: unknown tuning kind {spec.tuning!r}")
        argmin = min(points, key=lambda p: p.predicted_seconds_per_token)
        best = select_within_noise(points)
        strategy += "; smallest tree within one paired standard error of the best"
        meta = {"argmin_budget": argmin.budget, "argmin_depth": argmin.depth, "argmin_width": argmin.width,
                "argmin_predicted_seconds_per_token": argmin.predicted_seconds_per_token,
                "paired_standard_error": paired_standard_error(best, argmin)}
        n_prompts = len(prompts)
    return TuningResult(
        method=cfg.method, temperature=float(cfg.temperature), profile_key=profile.key, strategy=strategy,
        best=best, points=tuple(points), calib_prompts=n_prompts, calib_tokens=n_prompts * new_tokens,
        seconds=time.perf_counter() - t0, created=time.strftime("%Y-%m-%d %H:%M:%S"),
        meta={"version": TUNING_VERSION,
              "calibration": calibration_fingerprint(cfg, prompts, new_tokens, budgets, depths, widths), **meta},
    )


def calibration_fingerprint(cfg: DecodeConfig, prompts: Sequence[Sequence[int]], new_tokens: int,
                            budgets: Sequence[int], depths: Sequence[int], widths: Sequence[int]) -> str:
    """A short hash of everything a tuning was computed from besides the machine: calibration
    token ids, tokens per prompt, the searched grids and the base configuration."""
    data = json.dumps([[list(map(int, p)) for p in prompts], new_tokens, sorted(set(budgets)), sorted(set(depths)),
                       sorted(set(widths)), cfg.width, cfg.verifier, cfg.seed, list(cfg.sequoia_acceptance or ())])
    return hashlib.sha1(data.encode()).hexdigest()[:16]


def _precision(cfg: DecodeConfig) -> str:
    return cfg.precision or cfg.dtype


def _tune_sequoia(cfg: DecodeConfig, profile: MachineProfile, budgets: Sequence[int], depths: Sequence[int]):
    from ..drafting.sequoia import default_acceptance_vector

    acc = cfg.sequoia_acceptance or default_acceptance_vector()
    cands = price_candidates(profile, acc, [_precision(cfg)], [cfg.draft_precision or _precision(cfg)],
                             methods=("sequoia",), budgets=budgets, depths=depths)
    if not cands:
        raise ValueError("no Sequoia tree of these budgets could be priced: the profile does not cover them")
    points = [
        TuningPoint(budget=c.budget, depth=c.depth, width=cfg.width, tokens_per_step=c.expected_tokens,
                    mean_tree_size=float(c.tree_size or c.budget), target_seconds=c.target_seconds,
                    overhead_seconds=c.draft_seconds + c.verify_seconds)
        for c in cands
    ]
    return min(points, key=lambda p: p.predicted_seconds_per_token), points


# ------------------------------------------------------------------------------------- cache
def tuning_cache_path(profile_key: str, cfg: DecodeConfig) -> Path:
    from ..paths import cache_file

    return cache_file("tuning", f"{profile_key}|{cfg.method}|{_precision(cfg)}|{cfg.draft_precision}|"
                                f"T{cfg.temperature:g}")


def load_or_tune(draft, target, cfg: DecodeConfig, profile: MachineProfile, refresh: bool = False,
                 same_calibration: bool = True, **kwargs) -> TuningResult:
    """The cached tuning for (profile, method, precisions, temperature), computed and cached when missing,
    made by another version of the tuner or, with ``same_calibration``, from other calibration
    prompts / grids (``kwargs`` are ``tune``'s). ``same_calibration=False`` accepts any current
    tuning of this machine (the interactive ``--budget auto`` path)."""
    path = tuning_cache_path(profile.key, cfg)
    if path.exists() and not refresh:
        cached = TuningResult.from_json(path.read_text())
        call = inspect.signature(tune).bind(draft, target, cfg, profile, **kwargs)
        call.apply_defaults()
        a = call.arguments
        fingerprint = calibration_fingerprint(cfg, a["prompts"], a["new_tokens"], a["budgets"], a["depths"], a["widths"])
        if cached.meta.get("version") == TUNING_VERSION and (
                not same_calibration or cached.meta.get("calibration") == fingerprint):
            return cached
    res = tune(draft, target, cfg, profile, **kwargs)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(res.to_json())
    return res
