"""The pricing rules every planner uses (one step-cost formula, one interpolation policy) and the
offload projection: labelled, driven by its inputs, and reading the bench JSON."""

import json
import math

import pytest

from dyntree_core.planning.pricing import interpolate, seconds_per_token
from dyntree_core.planning.projection import LLAMA2_70B_BF16_BYTES, OffloadCost


def test_the_step_cost_formula():
    assert seconds_per_token(0.5, 0.2, 0.1, 4.0) == pytest.approx(0.2)
    assert seconds_per_token(0.5, 0.0, 0.0, 0.0) == math.inf  # nothing committed: no price


def test_the_interpolation_policy_never_prices_an_unmeasured_larger_size():
    xs, ys = [1, 4, 16], [1.0, 2.0, 5.0]
    assert interpolate(xs, ys, 4) == 2.0
    assert interpolate(xs, ys, 10) == pytest.approx(3.5)  # linear between measured sizes
    assert interpolate(xs, ys, 0.5) == 1.0  # below the smallest: its time (an upper bound)
    assert interpolate(xs, ys, 17) == math.inf  # above the largest: no price (not extrapolated)
    with pytest.raises(ValueError):
        interpolate([], [], 1)


def test_floor_cost_is_bytes_over_bandwidth():
    cost = OffloadCost.floor(25.0)
    assert cost.at(1) == pytest.approx(LLAMA2_70B_BF16_BYTES / 25e9)
    assert cost.at(768) == cost.at(1)
    assert "floor" in cost.source and "25" in cost.source


def test_cost_from_offload_bench_json(tmp_path):
    path = tmp_path / "offload.json"
    path.write_text(json.dumps({
        "environment": {"backend": "cuda:NVIDIA H100"},
        "runs": [
            {"engine": "ours", "tokens": 1, "seconds": 6.0}, {"engine": "ours", "tokens": 1, "seconds": 5.5},
            {"engine": "ours", "tokens": 64, "seconds": 5.7}, {"engine": "naive", "tokens": 1, "seconds": 9.0},
            {"engine": "ours", "tokens": 768, "skipped": "time budget"},
        ],
    }))
    cost = OffloadCost.from_bench_json(path)
    assert cost.tokens == (1, 64) and cost.seconds == (5.5, 5.7)
    assert "H100" in cost.source
    assert cost.at(64) == 5.7 and cost.at(65) == math.inf
