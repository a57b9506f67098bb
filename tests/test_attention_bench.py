"""The attention benchmark CLI (CPU: block counts only) and the bench dispatcher."""

import json

from dyntree_core.attention.trees import make_tree
from dyntree_core.bench.__main__ import SUBCOMMANDS, main as bench_main


def test_attention_bench_cpu_block_counts(tmp_path, capsys):
    out = tmp_path / "blocks.json"
    trees = tmp_path / "trees.json"
    trees.write_text(json.dumps({"trees": [{"parents": [-1, 0, 0, 1, 1, 2]}, [-1, 0, 1, 2]]}))
    rc = bench_main(["attention", "--device", "cpu", "--sizes", "64", "96", "--seeds", "2", "--prefixes", "0", "40",
                     "--block-sizes", "16", "32", "--trees", str(trees), "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["env"]["device"] == "cpu" and data["env"]["torch"] and "date" in data["env"]
    assert data["env"]["machine_info"]["cpu_model"] and data["env"]["machine_info"]["cpu_class"]
    rows = {(r["family"], r["size"], r["scope"], r["order"], r["block"], r["prefix"]): r for r in data["block_counts"]}
    expect = sum(make_tree("dyspec", 96, s).block_count("dfs", 16) for s in range(2)) / 2
    assert rows[("dyspec", 96, "tree", "dfs", 16, 0)]["mean_blocks"] == expect
    assert ("uniform", 64, "full", "bfs", 32, 40) in rows
    assert rows[("recorded", 6, "tree", "bfs", 16, 0)]["mean_blocks"] == 1
    assert "gpu_timings" not in data
    assert str(out) in capsys.readouterr().out  # it names the file it wrote


def test_dispatcher_table_and_errors(capsys):
    assert "attention" in SUBCOMMANDS
    assert bench_main(["no-such-bench"]) == 2
    assert bench_main(["attention", "--device", "cpu", "--sizes", "0"]) == 2


def test_recorded_engine_trees_feed_the_block_count_table(tmp_path, capsys):
    from dyntree_core.bench.attention import main as attention_main
    from dyntree_core.bench.record_trees import main as record_main

    rec = tmp_path / "trees.json"
    assert record_main(["--pair", "tiny", "--budgets", "16", "40", "--depth", "6", "--prompts", "1", "--steps", "2",
                        "--dtype", "float32", "--json", str(rec)]) == 0
    data = json.loads(rec.read_text())
    assert len(data["trees"]) == 4
    for t in data["trees"]:
        assert t["size"] == len(t["parents"]) <= t["budget"] and t["parents"][0] == -1
        assert all(0 <= p < i for i, p in enumerate(t["parents"]) if i)
    out = tmp_path / "blocks.json"
    assert attention_main(["--device", "cpu", "--sizes", "16", "--seeds", "1", "--prefixes", "0", "--block-sizes", "16",
                           "--trees", str(rec), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["block_counts"]
    assert {r["family"] for r in rows} >= {"recorded"}


def test_cpu_auto_table_is_measured_and_says_sdpa(tmp_path, auto_table_store, capsys):
    """On the CPU the kernel runs in Triton's interpreter: the measured table says SDPA in every
    cell, and attention='auto' then picks SDPA (as the rule without a table does)."""
    import torch

    from dyntree_core.attention import auto_table

    out = tmp_path / "table.json"
    assert bench_main(["attention", "--device", "cpu", "--sizes", "16", "--seeds", "1", "--prefixes", "0",
                       "--block-sizes", "16", "--families", "dyspec", "--auto-table", "yes", "--table-sizes", "16",
                       "--table-prefixes", "0", "16", "--dtype", "float32", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    table = data["auto_table"]
    assert table["device_key"] == auto_table.device_key("cpu") and table["machine"]["cpu_model"]
    assert [(c["size"], c["prefix"]) for c in table["cells"]] == [(16, 0), (16, 16)]
    for c in table["cells"]:  # measured numbers, and the interpreter loses everywhere
        assert c["sdpa_ms"] > 0 and all(v > c["sdpa_ms"] for v in c["kernel_ms"].values())
        assert c["choice"] == {"dfs": "torch", "bfs": "torch"}
    cpu = torch.device("cpu")
    assert auto_table.load_table(cpu) is not None and auto_table.choose(cpu, 16, 8, True) == "torch"
    assert str(out) in capsys.readouterr().out
