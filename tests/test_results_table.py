"""The committed latency results form the full table (every method, three datasets, T = 0 and
0.6, >= 20 prompts), and the Markdown renderer shows what the JSON says."""

from __future__ import annotations

import json
from pathlib import Path

from dyntree_core.bench.results_table import load_rows, main, markdown
from dyntree_core.config import METHODS

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


#: methods added after the committed bf16 latency runs, with why their rows are not there yet; an
#: entry must go as soon as its rows exist (checked below)
RESULTS_PENDING: dict[str, str] = {}


def test_committed_results_cover_every_method_dataset_and_temperature():
    rows = load_rows(sorted(RESULTS.glob("latency_*_cpu_bf16*.json")))
    for ds in ("wiki", "news", "code"):
        for t in (0.0, 0.6):
            for m in METHODS:
                if m in RESULTS_PENDING:
                    assert rows.get((ds, t, m)) is None, f"{m} has results now: remove it from RESULTS_PENDING"
                    continue
                r = rows.get((ds, t, m))
                assert r is not None, f"missing {m} on {ds} at T={t}"
                assert r["prompts"] >= 20 and r["tokens_per_step"] >= 1.0 and r["median_seconds_per_token"] > 0
            assert rows[(ds, t, "autoregressive")]["tokens_per_step"] == 1.0


def test_markdown_table_shows_the_numbers_and_marks_short_rows(tmp_path, capsys, monkeypatch):
    summary = [
        {"dataset": "wiki", "temperature": 0.0, "method": "autoregressive", "prompts": 20,
         "tokens_per_step": 1.0, "median_seconds_per_token": 0.2},
        {"dataset": "wiki", "temperature": 0.0, "method": "sequoia", "prompts": 19,
         "tokens_per_step": 3.891, "median_seconds_per_token": 0.29612},
    ]
    first = tmp_path / "latency_a.json"
    first.write_text(json.dumps({"summary": summary}))
    text = markdown(load_rows([first]))
    assert "| sequoia | 3.89 · 296 (19/20 prompts) |" in text
    assert text.index("autoregressive") < text.index("sequoia")
    # a file that completes the short row replaces it, whichever order they are given in
    second = tmp_path / "latency_b.json"
    second.write_text(json.dumps({"summary": [dict(summary[1], prompts=20, tokens_per_step=3.5)]}))
    for order in ([first, second], [second, first]):
        assert main([str(p) for p in order]) == 0
        out = capsys.readouterr().out
        assert "| sequoia | 3.50 · 296 (no AR in its run) [1] |" in out
        assert "[1] measured in a separate run, `latency_b.json`." in out
    monkeypatch.chdir(tmp_path)  # no bench/results here: a clear refusal
    assert main([]) == 1
    assert "no bench/results/latency_" in capsys.readouterr().err


def test_each_cell_is_compared_with_the_plain_decoding_of_its_own_run(tmp_path):
    def row(ds, t, m, ms, prompts=20, tps=1.0):
        return {"dataset": ds, "temperature": t, "method": m, "prompts": prompts, "tokens_per_step": tps,
                "median_seconds_per_token": ms / 1e3}

    main_run = tmp_path / "latency_main.json"
    main_run.write_text(json.dumps({"summary": [row("wiki", 0.0, "autoregressive", 200), row("wiki", 0.0, "chain", 300, tps=2.5),
                                                row("wiki", 0.0, "sequoia", 250, tps=3.5)]}))
    later = tmp_path / "latency_later.json"  # another machine: faster AR, more prompts, one new method
    later.write_text(json.dumps({"machine_info": {"cpu_model": "Some CPU", "cpu_class": "amx"},
                                 "summary": [row("wiki", 0.0, "autoregressive", 160, prompts=40),
                                             row("wiki", 0.0, "suffix", 128, tps=1.3)]}))
    for order in ([main_run, later], [later, main_run]):
        rows = load_rows(order)
        # the column's AR is the main run's (it supplies most of the column), not the one with more prompts
        assert rows[("wiki", 0.0, "autoregressive")]["source"] == "latency_main.json"
        assert rows[("wiki", 0.0, "suffix")]["own_ar_ms"] == 160
        text = markdown(rows)
        assert "| autoregressive | 1.00 · 200 |" in text and "| sequoia | 3.50 · 250 |" in text
        assert "| suffix | 1.30 · 128 (1.25x its own AR) [1] |" in text
        assert ("[1] measured in a separate run, `latency_later.json` on Some CPU (amx); its own plain decoding, "
                "ms/token: wiki T=0 160.") in text


def test_the_committed_results_stay_few_and_each_is_documented():
    """At most 30 files at the top level of bench/results/ (slices of one run merged, superseded runs
    in archive/), each named in docs/RESULTS.md's file list or the README; each archived file says
    what superseded it."""
    root = RESULTS.parents[1]
    top = sorted(p.name for p in RESULTS.glob("*.json"))
    assert len(top) <= 30, f"{len(top)} JSON files at the top of bench/results/: merge slices, archive superseded runs"
    documented = "".join(p.read_text() for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))])
    assert [n for n in top if n not in documented] == []
    archive = (RESULTS / "archive" / "README.md").read_text()
    assert [p.name for p in sorted((RESULTS / "archive").glob("*.json")) if f"`{p.name}`" not in archive] == []
