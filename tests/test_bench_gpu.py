"""``python -m dyntree_core.bench gpu --dry-run``: every GPU check runs end to end on the CPU (tiny
shapes, Triton interpreter), so whoever has a GPU can run the real thing in one go."""

import json
import os
import subprocess
import sys

import pytest
import torch

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
    assert [r["budget"] for r in dec] == list(gpu.Plan.for_run(True).decode_budgets)
    assert all(r["kernel_blocks"] is not None and r["target_forward_seconds"] > 0 for r in dec)
    assert res["sections"]["offload"]["result"]["runs"]
    for name, sec in res["sections"].items():  # every section released what it registered
        r = sec["resources"]
        assert r["leaked_registrations"] == 0 and r["leaked_pinned_bytes"] == 0, name
        assert r["registrations_released"] == r["registrations_made"], name
        assert r["pinned_bytes_released"] == r["pinned_bytes_made"], name
    for name in ("offload", "decode_step"):  # these page-lock layer buffers (simulated on the CPU)
        assert res["sections"][name]["resources"]["registrations_made"] > 0, name
    md = (tmp_path / "gpu.md").read_text()
    assert "DRY RUN" in md and "| decode_step | ok |" in md


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
