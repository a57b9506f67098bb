"""The decoding benchmark CLI end to end on the tiny pair: table, JSON, curve, Sequoia calibration."""

import json

from dyntree_core.bench.decoding import main


def test_all_mode_on_tiny_pair_writes_summary_and_curve(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["all", "--pair", "tiny", "--methods", "chain", "sequoia", "dyspec_greedy", "--temperatures", "0", "0.6",
               "--datasets", "wiki", "--prompts", "2", "--new-tokens", "6", "--budget", "8",
               "--curve-budgets", "4", "8", "16", "--calib-prompts", "1", "--tune-methods", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    methods = {(r["method"], r["temperature"]) for r in data["summary"]}
    assert ("autoregressive", 0.0) in methods and ("dyspec_greedy", 0.6) in methods
    assert all(r["tokens_per_step"] >= 1.0 for r in data["summary"])
    ar = [r for r in data["summary"] if r["method"] == "autoregressive"]
    assert all(r["tokens_per_step"] == 1.0 and r["speedup_vs_ar"] == 1.0 for r in ar)
    assert {r["budget"] for r in data["curve"] if r["method"] == "chain"} == {4, 8, 16}
    assert len(data["sequoia_acceptance"]["0.6"]) > 1
    assert data["machine"]["processor"] is not None and data["machine_info"]["cpu_class"]  # old and new keys
    assert len(data["runs"]) == 2 * (2 * 4 + 3 * 3)
    assert "tok/step" in capsys.readouterr().out


def test_acceptance_mode_skips_the_autoregressive_baseline(tmp_path):
    out = tmp_path / "a.json"
    assert main(["acceptance", "--pair", "tiny", "--methods", "chain", "--temperatures", "0", "--datasets", "code",
                 "--prompts", "1", "--new-tokens", "4", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["method"] for r in data["summary"]] == ["chain"]


def test_tuned_configuration_is_compared_with_fixed_budgets_in_the_same_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "t.json"
    rc = main(["latency", "--pair", "tiny", "--methods", "dyspec_greedy", "--temperatures", "0", "--datasets", "wiki",
               "--prompts", "2", "--new-tokens", "6", "--tune-methods", "dyspec_greedy", "sequoia",
               "--tune-fixed-budgets", "4", "8", "--tune-calib-prompts", "1", "--tune-new-tokens", "6",
               "--calib-prompts", "1", "--dtype", "float32", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    rows = data["tuned_vs_fixed"]
    for m in ("dyspec_greedy", "sequoia"):
        mine = [r for r in rows if r["method"] == m]
        assert sorted(r["budget"] for r in mine if r["label"] == "fixed") == [4, 8]
        tuned = [r for r in mine if r["label"] == "tuned"]
        assert len(tuned) == 1 and tuned[0]["prompts"] == 2
    assert [r["label"] for r in rows if r["method"] == "autoregressive"] == [""]
    assert {t["method"] for t in data["tuning"]} == {"dyspec_greedy", "sequoia"}
    for t in data["tuning"]:
        assert t["verdict"]["beats_all_fixed"] in (True, False)
        best = t["result"]["best"]
        assert [r for r in rows if r["label"] == "tuned" and r["method"] == t["method"]][0]["budget"] == best["budget"]
    assert list((tmp_path / "cache" / "profiles").glob("*.json")) and list((tmp_path / "cache" / "tuning").glob("*.json"))
    assert "hardware-tuned vs fixed budgets" in capsys.readouterr().out


def test_tuning_needs_a_latency_mode(tmp_path):
    assert main(["acceptance", "--pair", "tiny", "--methods", "chain", "--datasets", "wiki", "--prompts", "1",
                 "--tune-methods", "dyspec_greedy"]) == 2


def test_curve_methods_and_prompts_are_their_own_section(tmp_path):
    out = tmp_path / "c.json"
    assert main(["all", "--pair", "tiny", "--methods", "--curve-methods", "dyspec_greedy", "--curve-budgets", "4", "8",
                 "--curve-prompts", "1", "--temperatures", "0", "--datasets", "wiki", "--prompts", "2",
                 "--new-tokens", "4", "--tune-methods", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["method"] for r in data["summary"]] == ["autoregressive"]
    assert [(r["method"], r["budget"], r["prompts"]) for r in data["curve"]] == [("dyspec_greedy", 4, 1), ("dyspec_greedy", 8, 1)]
