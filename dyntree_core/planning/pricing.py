"""The two rules every price in ``planning`` follows: the step-cost formula and the interpolation
policy. Pure functions of numbers; ``auto``, its calibration (``tuning``), the app's cost panel
(``cost_model``) and the offload projection (``projection``) all call these and nothing else.

**The step cost.** A speculative step runs the draft (forwards of the draft model, or a model-free
suffix-tree build), one target forward of the tree, and everything else (verification, tree build,
mask, KV compaction, bookkeeping); it commits ``tokens_per_step`` tokens (accepted + bonus)::

    seconds per token = (target + draft + other) / tokens per step

Averages over steps of different kinds (a hybrid's model and suffix steps) are taken *before* the
division, each weighted by how often it happens: the mean step over the mean tokens per step, never a
median step (a median hides the minority of expensive steps).

**Interpolation.** Times are measured at a few sizes ``n`` (tokens per forward). Between two measured
sizes the time is linear in ``n``; below the smallest measured size it is the smallest's time (a
forward never gets cheaper with more tokens, so that is an upper bound); **above the largest measured
size there is no price** (``math.inf``: never chosen). Extrapolating would price exactly the sizes
where forwards stop being flat (the knee of t(n) on a GPU, compute-bound int4 rows on a CPU) from
numbers that do not contain the knee, and clamping would make every larger tree look free. A planner
that needs a size measures it (``machine_profile.load_or_measure_profile`` takes the sizes to cover).
"""

from __future__ import annotations

import math
from typing import Sequence


def seconds_per_token(target_s: float, draft_s: float, other_s: float, tokens_per_step: float) -> float:
    """``(target_s + draft_s + other_s) / tokens_per_step`` (``inf`` when no token is committed)."""
    if tokens_per_step <= 0:
        return math.inf
    return (target_s + draft_s + other_s) / tokens_per_step


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """The time at ``x`` from times ``ys`` measured at sorted sizes ``xs`` (the module's policy).

    Args:
        xs: ``[k]`` measured sizes, increasing, ``k >= 1``.
        ys: ``[k]`` seconds at those sizes.
    Returns:
        linear between measured sizes, ``ys[0]`` below ``xs[0]``, ``math.inf`` above ``xs[-1]``.
    """
    if not xs or len(xs) != len(ys):
        raise ValueError("interpolate needs as many measured times as sizes, at least one")
    if x > xs[-1]:
        return math.inf
    if x <= xs[0]:
        return float(ys[0])
    for i in range(1, len(xs)):
        if x <= xs[i]:
            f = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return float(ys[i - 1] + f * (ys[i] - ys[i - 1]))
    return float(ys[-1])  # unreachable: x <= xs[-1]
