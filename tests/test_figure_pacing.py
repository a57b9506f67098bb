"""A redraw's cost to decoding, read from the steps after it (``ui.figure_pacing``)."""

import pytest

from ui.figure_pacing import (FIGURE_BUDGET, FIGURE_INTERVAL_S, MAX_FIGURE_INTERVAL_S, FigurePacing,
                              redraw_cost)


def _steps(*runs: tuple[int, float]) -> list[tuple[float, float]]:
    out, end = [], 0.0
    for n, seconds in runs:
        for _ in range(n):
            end += seconds
            out.append((end, seconds))
    return out


def test_the_cost_is_the_time_beyond_the_median_in_the_window_after_the_redraw():
    steps = _steps((20, 0.05), (3, 0.25), (60, 0.05))  # redraw at 1.0 s; 3 steps 0.2 s slower after it
    assert redraw_cost(steps, 1.0) == pytest.approx(0.6)
    assert redraw_cost(steps, 2.0) == pytest.approx(0.0)  # a window of median steps costs nothing


def test_no_cost_before_the_window_has_passed_or_with_too_few_steps():
    assert redraw_cost(_steps((20, 0.05), (10, 0.05)), 1.0) is None  # the last step ends at 1.5 s < 3.0 s
    assert redraw_cost(_steps((7, 0.5)), 0.0, window_s=1.0) is None  # 7 steps: no median to trust
    assert redraw_cost(_steps((10, 0.05), (1, 3.0)), 0.5) is None  # one step in the window: nothing to read


def test_the_interval_keeps_the_redraws_within_the_budget_between_its_bounds():
    pacing = FigurePacing()
    pacing.sent(1.0)
    pacing.read(_steps((20, 0.05), (3, 0.25), (60, 0.05)))
    assert pacing.probe_at is None and pacing.cost_s == pytest.approx(0.6)
    assert pacing.interval_s == pytest.approx(0.6 / FIGURE_BUDGET)
    assert "every 12 s" in pacing.note()
    pacing.sent(1.0)
    pacing.read(_steps((20, 0.05), (60, 0.05)))  # a free redraw: the mean of the last two
    assert pacing.cost_s == pytest.approx(0.3) and pacing.interval_s == pytest.approx(6.0)
    cheap = FigurePacing(cost_s=0.0)
    cheap.sent(1.0)
    cheap.read(_steps((80, 0.05)))
    assert cheap.interval_s == FIGURE_INTERVAL_S and cheap.note() == ""
    slow = FigurePacing()
    slow.sent(1.0)
    slow.read(_steps((8, 1.0), (1, 1.0)))  # 9 steps of 1 s: a window of 3 s after 1.0 s; 3 steps in it
    assert slow.cost_s == pytest.approx(0.0)
    sparse = FigurePacing()
    sparse.sent(0.5)
    sparse.read(_steps((10, 0.05), (1, 3.0)))  # the window passed with one step in it: nothing read, next one is
    assert sparse.probe_at is None and sparse.cost_s is None
    dear = FigurePacing()
    dear.sent(1.0)
    dear.read(_steps((20, 0.05), (5, 2.0), (40, 0.05)))
    assert dear.interval_s == MAX_FIGURE_INTERVAL_S
