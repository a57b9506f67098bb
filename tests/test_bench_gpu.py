"""``python -m dyntree_core.bench gpu --dry-run``: every GPU check runs end to end on the CPU (tiny
shapes, Triton interpreter), so whoever has a GPU can run the real thing in one go."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import DEVICE

from dyntree_core.bench import gpu


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU mode; with CUDA run the real command")
def test_dry_run_runs_every_section(tmp_path, capsys):
    assert gpu.main(["--dry-run", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "gpu.json").read_text())
    assert res["environment"]["dry_run"] and res["environment"]["machine_info"]["cpu_model"] is not None
    assert set(res["sections"]) == set(gpu.SECTIONS)
    for name, sec in res["sections"].items():
        assert sec["status"] == "ok", (name, sec.get("summary"), sec.get("traceback"))
    oracle = res["sections"]["kernel_oracle"]["result"]
    assert {r["order"] for r in oracle["rows"]} == {"bfs", "dfs", "hpd"}
    assert {r["dtype"] for r in oracle["rows"]} == {"bfloat16", "float16"}
    ident = res["sections"]["greedy_identity"]["result"]["rows"]
    assert {r["order"] for r in ident} == {"bfs", "dfs", "hpd"} and all(r["kernel_ran"] for r in ident)
    assert any(r["case"].startswith("real-shape") for r in ident)
    dec = res["sections"]["decode_step"]["result"]["rows"]
    budgets = list(gpu.Plan.for_run(True).decode_budgets)
    assert [(r["budget"], r["drafting"]) for r in dec] == [(b, "programs") for b in budgets] + [(budgets[0], "eager")]
    assert all(r["kernel_blocks"] is not None and r["target_forward_seconds"] > 0 for r in dec)
    assert all(r["step_vs_target_forward"] >= 1 and r["draft_forwards"] >= 1 for r in dec)
    assert res["sections"]["offload"]["result"]["runs"]
    for name, sec in res["sections"].items():  # every section released what it registered
        r = sec["resources"]
        assert r["leaked_registrations"] == 0 and r["leaked_pinned_bytes"] == 0, name
        assert r["registrations_released"] == r["registrations_made"], name
        assert r["pinned_bytes_released"] == r["pinned_bytes_made"], name
    for name in ("offload", "decode_step"):  # these page-lock layer buffers (simulated on the CPU)
        assert res["sections"][name]["resources"]["registrations_made"] > 0, name
    att = res["sections"]["attention"]["result"]
    assert att["auto_table"]["device_key"].startswith("cpu-") and att["auto_table"]["cells"]
    assert all(c["choice"] == {"dfs": "torch", "bfs": "torch"} for c in att["auto_table"]["cells"])  # interpreter
    _check_resident(res["sections"]["resident"]["result"])
    md = (tmp_path / "gpu.md").read_text()
    assert "DRY RUN" in md and "| decode_step | ok |" in md
    assert "## Resident" in md and "ar_vs_hf_generate" in md


def _numbers(x, path="resident"):
    """Every leaf of the section's JSON: a finite number, a string or a bool (no None, NaN, placeholder)."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _numbers(v, f"{path}.{k}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _numbers(v, f"{path}[{i}]")
    else:
        assert isinstance(x, (int, float, str, bool)) and x == x and x not in (float("inf"), float("-inf")), path
        yield path, x


def _check_resident(r):
    import math

    list(_numbers(r))
    assert r["ok"] and not r["skipped"] and not r["failed"] and r["bandwidth"]["gbps"] > 0
    assert [t["name"] for t in r["targets"]] == ["7B", "1.5B"]  # the must-shows' target first
    from dyntree_core.bench.resident import ResidentPlan

    plan = ResidentPlan.for_run(True)
    kernels = r["forward_kernels"]["0.5B"]
    assert [k["rows"] for k in kernels] == [1, 63] and all(k["modelled"] > 0 and k["math_sdpa"] == 0 for k in kernels)
    for t in r["targets"]:
        assert t["floor_ms_per_token"] > 0 and t["weight_bytes"] > 0 and t["hf_static_warmup_s"] > 0
        # per token = a difference of two timed calls: only a real run's is meaningful (a dry run's tiny model on a
        # loaded CI machine gave -0.24 ms); a dry run holds it finite (``_numbers``)
        if r["timings_meaningful"]:
            assert t["hf_generate_ms_per_token"] > 0 and t["hf_static_ms_per_token"] > 0
        assert set(t["ar_vs_hf_generate"]) == set(t["ar_vs_hf_static"]) == {
            "torch graph", "torch graph_no_cudnn", "torch graph_torch_layers", "torch host", "triton host"}
        for kind, ratio in t["ar_vs_hf_generate"].items():
            assert math.isclose(ratio, t["ar_ms_per_token"][kind] / t["hf_generate_ms_per_token"])
            assert math.isclose(t["ar_vs_hf_static"][kind], t["ar_ms_per_token"][kind] / t["hf_static_ms_per_token"])
        assert t["ar_vs_hf_generate_best"] == min(t["ar_vs_hf_generate"].values())
        got = {(x["method"], x.get("budget"), x["attention"], x["step"], x.get("temperature", 0)) for x in t["rows"]}
        want = {(m, None, "torch", "graph", 0) for m in ("autoregressive", "chain")}
        want |= {(m, None, "triton", "host", 0) for m in ("autoregressive", "chain")}
        want |= {("dyspec_greedy", b, "torch", step, 0) for b in plan.budgets for step in ("graph", "graph_every_level")}
        want |= {("dyspec_greedy", b, "triton", "host", 0) for b in plan.budgets}
        want |= {("autoregressive", None, "torch", "host", 0), ("dyspec_greedy", plan.ab_budget, "torch", "host", 0),
                 ("dyspec_greedy", plan.ab_budget, "torch", "device_side", 0)}  # inductor's rows: CUDA only
        # the A/B of T > 0 verification on the device and on the host from the read rows
        want |= {("dyspec_greedy", plan.ab_budget, "torch", step, 1.0) for step in ("graph", "graph_host_verify")}
        # and with the token-level recurrence as torch ops instead of one kernel (verify.alpha_kernel)
        want.add(("dyspec_greedy", plan.ab_budget, "torch", "graph_alphas_loop", 1.0))
        # the graphs captured without cuDNN's attention, plain and at the A/B budget
        want |= {("autoregressive", None, "torch", "graph_no_cudnn", 0),
                 ("dyspec_greedy", plan.ab_budget, "torch", "graph_no_cudnn", 0)}
        # and with the dense layers' rotation + cache write and silu * mul as torch ops (decode.layer_kernels)
        want |= {("autoregressive", None, "torch", "graph_torch_layers", 0),
                 ("dyspec_greedy", plan.ab_budget, "torch", "graph_torch_layers", 0)}
        assert got == want
        for x in t["rows"]:
            assert x["step_ms"] > 0 and x["tokens_per_step"] >= 1 and x["phases_ms"]["target_forward"] > 0
            assert x["step_vs_ar_step"] > 0 and all(v > 0 for v in x["phases_ms"].values())
            assert (x["compile_s"] > 0) == x["step"].startswith("graph") or plan.dry_run
            if x["method"] != "autoregressive":
                assert x["phases_ms"]["draft"] > 0 and x["tree_size"] > 1 and x["draft_forwards"] >= 1
        every = {x["budget"]: x["draft_forwards"] for x in t["rows"] if x["step"] == "graph_every_level"}
        stops = {x["budget"]: x["draft_forwards"] for x in t["rows"]
                 if x["step"] == "graph" and x["method"] == "dyspec_greedy" and "temperature" not in x}
        assert every == {b: 8 for b in plan.budgets} and all(stops[b] < 8 for b in plan.budgets), (every, stops)


def test_without_cuda_the_real_run_refuses_and_says_why(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    assert gpu.main(["--out", str(tmp_path)]) == 2
    assert "--dry-run" in capsys.readouterr().err


def test_imports_without_gradio_or_plotly():
    code = ("import sys; sys.modules['gradio'] = None; sys.modules['plotly'] = None; "
            "import dyntree_core.bench.gpu, dyntree_core.bench.attention, dyntree_core.bench.offload")
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ))


def test_a_section_that_leaks_pinned_memory_is_flagged(tmp_path, monkeypatch):
    """A section that leaves a host registration behind fails (the next one would inherit it), and
    the JSON says what it made and left; the next section still runs."""
    from dyntree_core.offload.backend import HostBackend

    kept = []

    def leaky(plan, dev):
        kept.append(HostBackend().alloc_host(1 << 16))  # registered and never closed
        return dict(ok=True, rows=[])

    monkeypatch.setattr(gpu, "decode_step", leaky)
    monkeypatch.setattr(gpu, "attention_timings", lambda plan, dev: dict(ok=True, rows=[], timings_meaningful=False))
    assert gpu.main(["--dry-run", "--out", str(tmp_path), "--sections", "attention", "decode_step"]) == 1
    secs = json.loads((tmp_path / "gpu.json").read_text())["sections"]
    leak = secs["decode_step"]
    assert leak["status"] == "failed" and "leaked 1 pinned host registrations" in leak["summary"]
    assert leak["resources"]["registrations_made"] == 1 and leak["resources"]["registrations_released"] == 0
    assert leak["resources"]["leaked_pinned_bytes"] == 1 << 16
    assert secs["attention"]["status"] == "ok" and secs["attention"]["resources"]["leaked_registrations"] == 0
    kept.pop().close()


def test_a_resident_row_that_raises_is_recorded_and_the_others_still_run(monkeypatch):
    """A row that fails on the GPU (a capture or compile error) must not cost the section its other rows;
    each row measured is saved as it lands (a run killed by its time limit keeps them)."""
    from dyntree_core.bench import resident as res_mod

    real = res_mod.run_decoder

    def flaky(draft, target, cfg, prompt, steps, step="host"):
        if step == "device_side":
            raise RuntimeError("capture failed")
        return real(draft, target, cfg, prompt, steps, step)

    monkeypatch.setattr(res_mod, "run_decoder", flaky)
    saved = []
    r = res_mod.resident(DEVICE, 600.0, True, log=lambda m: None,
                         save=lambda x: saved.append(json.loads(json.dumps(x, default=str))))  # as gpu.json does
    assert not r["ok"] and [f["row"] for f in r["failed"]] == ["7B dyspec_greedy b4 torch device_side",
                                                               "1.5B dyspec_greedy b4 torch device_side"]
    assert all("RuntimeError: capture failed" in f["error"] for f in r["failed"])
    want = len(res_mod.resident_configs(res_mod.ResidentPlan.for_run(True), "7B", DEVICE)) - 1
    assert [len(t["rows"]) for t in r["targets"]] == [want, want]
    assert saved and saved[-1]["partial"] and len(saved[-1]["current"]["rows"]) == want
    assert saved[0]["current"]["name"] == "7B" and len(saved[0]["current"]["rows"]) == 1


def test_the_no_cudnn_rows_capture_with_every_sdpa_backend_but_cudnns():
    """``graph_no_cudnn`` rows run (and capture their graphs) with cuDNN's attention switched off and the other
    backends on; every other kind leaves torch's choice alone, and the switch ends with the row."""
    from dyntree_core.bench.resident import sdpa_backends

    flags = lambda: (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),  # noqa: E731
                     torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.math_sdp_enabled())
    before = flags()
    with sdpa_backends("graph_no_cudnn"):
        assert flags() == (False, True, True, True)
    assert flags() == before
    for step in ("graph", "graph_every_level", "host"):
        with sdpa_backends(step):
            assert flags() == before
