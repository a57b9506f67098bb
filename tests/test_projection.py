"""The offload projection: labelled, driven by its inputs, and reading the bench JSON."""

import json

import pytest

from dyntree_core.planning.projection import LLAMA2_70B_BF16_BYTES, OffloadCost, project, speedup_table


def test_floor_cost_is_bytes_over_bandwidth():
    cost = OffloadCost.floor(25.0)
    assert cost.at(1) == pytest.approx(LLAMA2_70B_BF16_BYTES / 25e9)
    assert cost.at(768) == cost.at(1)
    assert "floor" in cost.source and "25" in cost.source


def test_projection_divides_step_cost_by_tokens_per_step():
    cost = OffloadCost((1, 64, 768), (5.0, 5.2, 6.0), "measured: x.json (cuda)")
    p = project("dyspec_greedy", 64, 8.0, cost, draft_seconds=0.4)
    assert p.seconds_per_token == pytest.approx((5.2 + 0.4) / 8.0)
    assert p.as_dict()["kind"] == "projection"
    rows = speedup_table({"dyspec_greedy": (64, 8.0), "chain": (8, 3.0)}, cost, {"dyspec_greedy": 0.4})
    assert rows[0]["method"] == "autoregressive" and rows[0]["speedup"] == 1.0
    assert rows[1]["speedup"] == pytest.approx(5.0 / ((5.2 + 0.4) / 8.0))
    assert cost.at(416) == pytest.approx(5.6)  # linear between measured points
    with pytest.raises(ValueError):
        project("chain", 8, 0.0, cost)


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
