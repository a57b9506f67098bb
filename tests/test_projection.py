"""The pricing rules every planner uses (one step-cost formula, one interpolation policy) and the
GPU measurements committed under bench/results/gpu-h200/, read back and priced."""

import json
import math

import pytest

from dyntree_core.planning.pricing import seconds_per_token
from dyntree_core.step_price import interpolate
from dyntree_core.planning.projection import GpuResults, MeasuredStep, OffloadCost, gpu_rows, step_time_at
from ui.cost_view import GPU_RESULTS  # the app's: the repository's committed results


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
    assert "H100" in cost.source and cost.gbps is None
    assert cost.at(64) == 5.7 and cost.at(65) == math.inf


def test_the_committed_h200_offload_row():
    """The measured offload forward of bench/results/gpu-h200/offload.json: a 70B-shaped bf16 target
    streamed from pinned host memory at the PCIe floor, flat in the tree size."""
    raw = json.loads((GPU_RESULTS / "offload.json").read_text())
    assert raw["environment"]["device_name"] == "NVIDIA H200"
    gpu = GpuResults.load(GPU_RESULTS)
    assert gpu is not None and "H200" in gpu.machine and gpu.date.startswith("2026-11-28")
    off = gpu.offload
    assert off.tokens == (1, 64, 256, 768)
    assert off.at(1) == pytest.approx(2.475, abs=5e-4) and off.gbps == pytest.approx(55.3, abs=0.05)
    assert off.at(768) == pytest.approx(2.475, abs=5e-3)
    # the steps come from the project's own bench (bench_gpu_resident.json), newer than the probes; the
    # offloaded steps as the CUDA default runs them (the draft on its programs: the eager drafter's b64 row,
    # the section's A/B at 2.532 s, is left out)
    assert len(gpu.offload_steps) == 3
    steps = {s.budget: s for s in gpu.offload_steps}
    assert sorted(steps) == [64, 256, 768] and steps[64].step_s == pytest.approx(2.494, abs=1e-3)
    assert set(gpu.resident) == {"1.5B", "7B"}
    ar7, _ = step_time_at(gpu.resident["7B"], "autoregressive", 1, step="graph")
    assert ar7 == pytest.approx(0.00529, abs=1e-5)
    host7, _ = step_time_at(gpu.resident["7B"], "autoregressive", 1, attention="torch", step="host")
    assert host7 == pytest.approx(0.0713, abs=1e-4)
    assert not any(s.step == "graph" for s in gpu.resident["1.5B"])
    # the b64 graph step greedy (16.37 ms) and at T = 1, token level verified on the device (20.52 ms): a
    # greedy run is priced with greedy rows only
    assert step_time_at(gpu.resident["7B"], "dyspec_greedy", 64, step="graph")[0] == pytest.approx(0.01637, abs=1e-5)
    assert step_time_at(gpu.resident["7B"], "dyspec_greedy", 64, step="graph", temperature=1.0)[0] == \
        pytest.approx(0.02052, abs=1e-5)
    assert gpu.peers["transformers generate, static cache, compiled (7B shape)"] == pytest.approx(6.90, abs=0.01)
    assert gpu.peers["transformers generate (7B shape)"] == pytest.approx(25.90, abs=0.01)


def test_gpu_rows_price_this_runs_tree_with_the_measured_steps():
    gpu = GpuResults.load(GPU_RESULTS)
    rows = gpu_rows(gpu, tree_size=100, tokens_per_step=3.0, target_params=1.5e9)
    off, resident = rows
    # offload: measured steps at 64 (2.4941 s) and 256 (2.4945 s) nodes, linear between: 100 nodes
    step = 2.4941 + (2.4945 - 2.4941) * (100 - 64) / 192
    assert off.tree_s_per_token == pytest.approx(step / 3.0, abs=1e-3)
    assert off.ar_s_per_token == pytest.approx(2.475, abs=5e-4) and "55.3 GB/s" in off.inputs["plain decoding"]
    assert "1.5B" in resident.setting and "H200" in resident.inputs["machine"]
    # 1.5B: no graph rows measured: the eager step's faster plain decoding (the tree kernel's 35.8 ms)
    assert resident.ar_s_per_token == pytest.approx(0.03585, abs=1e-5) and "tree kernel" in resident.inputs["plain decoding"]
    assert "(7B shape)" not in resident.inputs["same GPU, other engines"]
    seven = gpu_rows(gpu, 100, 3.0, 7e9)[1]
    assert "7B" in seven.setting  # the measured shape nearest the run's target
    # 7B: the CUDA default, graph steps: plain 5.29 ms, DySpec greedy 16.37 ms (64) .. 25.24 ms (256)
    assert seven.ar_s_per_token == pytest.approx(0.00529, abs=1e-5) and "CUDA graphs" in seven.inputs["tree step"]
    assert seven.tree_s_per_token == pytest.approx((16.37 + (25.24 - 16.37) * 36 / 192) / 3e3, rel=1e-3)
    assert len(gpu_rows(gpu, tree_size=1024, tokens_per_step=3.0, target_params=1.5e9)) == 0  # larger than measured


def test_missing_results_give_no_gpu_rows(tmp_path):
    assert GpuResults.load(tmp_path) is None
    steps = (MeasuredStep("dyspec_greedy", 16, 16, "triton", "dfs", 0.1, 0.05, 0.03),)
    assert step_time_at(steps, "chain", 16) == (math.inf, None)
