"""The offload benchmark's CPU smoke path (tiny shapes): runs end to end and writes honest JSON."""

from __future__ import annotations

import json

import pytest
import torch

from dyntree_core.bench.offload import CPU_NOTE, main
from dyntree_core.offload.layout import ALIGN
from dyntree_core.offload.synthetic import StackShape


def test_cpu_smoke_run_writes_json(tmp_path, capsys):
    out = tmp_path / "offload.json"
    rc = main(["--device", "cpu", "--layers", "3", "--hidden", "64", "--vocab", "96", "--buffers", "2",
               "--tokens", "1", "5", "--prefix", "6", "--reps", "2", "--slots", "2", "3",
               "--accelerate-tokens", "1", "--accelerate-layers", "2", "--bw-mib", "1", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert CPU_NOTE in printed and res["note"] == CPU_NOTE
    assert res["environment"]["machine_info"]["cpu_model"]
    shape = StackShape.scaled(3, 64, 96)
    assert res["shape"]["hidden"] == 64 and res["shape"]["ffn"] == shape.ffn
    # the packed layer holds every parameter, each padded to ALIGN bytes
    assert shape.layer_params * 2 <= res["layer_bytes"] <= shape.layer_params * 2 + 9 * ALIGN
    runs = [r for r in res["runs"] if "seconds" in r]
    assert {(r["engine"], r["slots"], r["tokens"]) for r in runs} == {
        ("ours", 2, 1), ("ours", 2, 5), ("ours", 3, 1), ("ours", 3, 5),
        ("naive", "-", 1), ("naive", "-", 5), ("accelerate", "-", 1)}
    for r in runs:
        # every layer execution copies a full layer (ours: the packed buffer incl. alignment padding;
        # baselines: the parameters one by one), also for the accelerate run scaled from 2 to 3 layers
        want = 3 * res["layer_bytes"] if r["engine"] == "ours" else 3 * shape.layer_params * 2
        assert r["bytes_per_forward"] == want
        assert r["stats_bytes_per_forward"] == r["bytes_per_forward"]
        assert r["seconds"] > 0 and r["ratio_to_floor"] > 0
    assert any("scaled x1.50" in n for n in res["notes"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA; with CUDA "
                    "tests/test_offload_cuda.py runs the real path")
def test_cuda_request_without_cuda_fails_cleanly(capsys):
    assert main(["--device", "cuda", "--layers", "2", "--hidden", "64"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
