"""The calibration's search over a grid of shapes: a coordinate search that moves to the best
neighbour (``coordinate_search``), and the one-standard-error rule that picks among points the
calibration cannot tell apart (``select_within_noise``)."""

from __future__ import annotations

import math
import statistics
from typing import Callable, Optional, Sequence

from .tuning_result import TuningPoint

Evaluate = Callable[[int, int, int], TuningPoint]


def coordinate_search(
    evaluate: Evaluate,
    axes: dict[str, Sequence[int]],
    start: dict[str, int],
    fixed: Optional[dict[str, int]] = None,
    max_points: int = 24,
) -> tuple[TuningPoint, list[TuningPoint]]:
    """Minimise ``predicted_seconds_per_token`` over a grid by moving to the best neighbour.

    Args:
        evaluate: ``(budget, depth, width) -> TuningPoint`` (called at most once per point).
        axes: the searched axes among ``budget``, ``depth``, ``width``, each a sorted grid.
        start: a grid point to start from (one value per searched axis).
        fixed: values of the axes that are not searched.
        max_points: evaluation cap.
    Returns:
        (best point, every evaluated point in evaluation order).
    """
    names = list(axes)
    fixed = dict(fixed or {})
    seen: dict[tuple[int, ...], TuningPoint] = {}
    order: list[TuningPoint] = []

    def at(idx: tuple[int, ...]) -> TuningPoint:
        if idx not in seen:
            args = dict(fixed)
            args.update({n: axes[n][i] for n, i in zip(names, idx)})
            seen[idx] = evaluate(args.get("budget", 0), args.get("depth", 0), args.get("width", 0))
            order.append(seen[idx])
        return seen[idx]

    cur = tuple(list(axes[n]).index(start[n]) for n in names)
    best = at(cur)
    while len(seen) < max_points:
        moves = []
        for a in range(len(names)):
            for step in (-1, 1):
                j = cur[a] + step
                if 0 <= j < len(axes[names[a]]):
                    moves.append(cur[:a] + (j,) + cur[a + 1:])
        evaluated = [at(m) for m in moves if m in seen or len(seen) < max_points]
        cand = min(evaluated, key=lambda p: p.predicted_seconds_per_token, default=None)
        if cand is None or cand.predicted_seconds_per_token >= best.predicted_seconds_per_token:
            break
        best = cand
        cur = next(k for k, v in seen.items() if v is cand)
    return best, order


def paired_standard_error(a: TuningPoint, b: TuningPoint) -> float:
    """Standard error of the mean per-prompt difference of predicted seconds/token between two
    points calibrated on the same prompts; 0 when fewer than two paired prompts are recorded."""
    xs, ys = a.per_prompt_seconds_per_token, b.per_prompt_seconds_per_token
    if len(xs) != len(ys) or len(xs) < 2:
        return 0.0
    return statistics.stdev(x - y for x, y in zip(xs, ys)) / math.sqrt(len(xs))


def select_within_noise(points: Sequence[TuningPoint]) -> TuningPoint:
    """The one-standard-error rule: the argmin of predicted seconds/token, unless a point with a
    smaller mean tree (then smaller depth) is within one paired standard error of it.

    Smaller trees cost less to verify on every machine and their acceptance varies less, so
    among configurations the calibration cannot tell apart the cheapest is the safer choice.
    """
    if not points:
        raise ValueError("no tuning points to select from")
    best = min(points, key=lambda p: p.predicted_seconds_per_token)
    tied = [p for p in points
            if p.predicted_seconds_per_token - best.predicted_seconds_per_token <= paired_standard_error(p, best)]
    return min(tied, key=lambda p: (p.mean_tree_size, p.depth, p.predicted_seconds_per_token))


def middle(grid: Sequence[int], preferred: int) -> int:
    """``preferred`` if on the grid, else the grid value closest to it."""
    return min(grid, key=lambda g: (abs(g - preferred), g))
