"""``python -m dyntree_core.bench gpu --dry-run``: every GPU check runs end to end on the CPU (tiny
shapes, Triton interpreter), so whoever has a GPU can run the real thing in one go."""

import json
import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede any Triton import (see tests/conftest.py)

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
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "TRITON_INTERPRET": "1"})
