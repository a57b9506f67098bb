"""The exact-acceptance benchmark end to end on the tiny random pair."""

from __future__ import annotations

import json

import pytest

from dyntree_core.bench.exact_acceptance import main


def test_scores_every_compatible_verifier_on_the_decoded_trees(tmp_path) -> None:
    out = tmp_path / "exact.json"
    rc = main(["--pair", "tiny", "--methods", "specinfer", "dyspec_greedy", "dynatree", "--budgets", "8",
               "--temperatures", "0", "1.0", "--datasets", "wiki", "--prompts", "2", "--new-tokens", "12",
               "--json", str(out)])
    assert rc == 0
    rec = json.loads(out.read_text())
    assert rec["machine_info"]["cpu_flags"] is not None
    cells = {(c["method"], c["temperature"]): c for c in rec["cells"]}
    assert len(cells) == 6 and all(c["prompts"] == 2 and c["steps"] > 0 for c in cells.values())
    for m in ("specinfer", "dyspec_greedy", "dynatree"):
        assert set(cells[(m, 0.0)]["expected_accepted"]) == {"greedy"}
    sampled = cells[("dyspec_greedy", 1.0)]
    assert set(sampled["expected_accepted"]) == {"token_level", "traversal", "point_mass"}
    assert "traversal_minus_token_level" in sampled
    # top-k trees: only point_mass is lossless, and the decode follows it
    topk = cells[("dynatree", 1.0)]
    assert set(topk["expected_accepted"]) == {"point_mass"} and topk["decode_verifier"] == "point_mass"
    # SpecInfer with k = budget has depth 1, where Traversal is RRS(w): identical expectations
    spec = cells[("specinfer", 1.0)]
    assert spec["traversal_minus_token_level"]["mean"] == pytest.approx(0.0, abs=1e-12)
    # T = 0: the greedy expectation is the realised acceptance, step by step
    g = cells[("dyspec_greedy", 0.0)]
    assert g["expected_accepted"]["greedy"]["mean"] == pytest.approx(g["realised_accepted"], abs=1e-12)


def test_step_phases_bench_reports_the_share_outside_the_forwards(tmp_path) -> None:
    from dyntree_core.bench.step_phases import PHASES
    from dyntree_core.bench.step_phases import main as step_phases

    out = tmp_path / "phases.json"
    assert step_phases(["--pair", "tiny", "--budgets", "8", "32", "--temperatures", "0", "1", "--steps", "2",
                        "--prompts", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["temperature"], r["budget"]) for r in rows] == [(0.0, 8), (0.0, 32), (1.0, 8), (1.0, 32)]
    for r in rows:
        assert r["steps"] == 4 and set(r["phases"]) == set(PHASES)
        assert 0.0 < r["outside_share"] < 1.0
        assert r["outside_forwards_seconds"] == pytest.approx(
            r["step_seconds"] - r["phases"]["draft"] - r["phases"]["target_forward"])


def test_disjoint_prompt_slices_merge_into_the_run_over_all_prompts(tmp_path) -> None:
    common = ["--pair", "tiny", "--methods", "dyspec_greedy", "--budgets", "8", "--temperatures", "1.0",
              "--datasets", "wiki", "news", "--new-tokens", "8"]
    whole, a, b, merged = (tmp_path / f"{n}.json" for n in ("whole", "a", "b", "merged"))
    assert main(common + ["--prompts", "3", "--json", str(whole)]) == 0
    assert main(common + ["--prompts", "1", "--json", str(a)]) == 0
    assert main(common + ["--prompts", "2", "--prompt-start", "1", "--json", str(b)]) == 0
    assert main(["--merge", str(a), str(b), str(a), "--json", str(merged)]) == 0  # a twice: kept once
    cells_whole = {c["dataset"]: c for c in json.loads(whole.read_text())["cells"]}
    cells_merged = {c["dataset"]: c for c in json.loads(merged.read_text())["cells"]}
    assert set(cells_whole) == set(cells_merged) == {"wiki", "news", "news+wiki"}
    for ds, c in cells_whole.items():
        m = cells_merged[ds]
        assert m["prompts"] == c["prompts"] == (6 if "+" in ds else 3) and m["steps"] == c["steps"]
        for v, e in c["expected_accepted"].items():
            assert m["expected_accepted"][v]["mean"] == pytest.approx(e["mean"], abs=1e-12)
        assert m["traversal_minus_token_level"]["ci95"] == pytest.approx(c["traversal_minus_token_level"]["ci95"])


def test_merge_refuses_runs_at_different_precisions(tmp_path) -> None:
    for name, prec in (("x", "int4"), ("y", "float32")):
        (tmp_path / f"{name}.json").write_text(json.dumps({"precision": prec, "prompt_records": []}))
    assert main(["--merge", str(tmp_path / "x.json"), str(tmp_path / "y.json")]) == 2
    for name, draft in (("u", "int4"), ("v", "int8")):  # same target precision, different drafts
        (tmp_path / f"{name}.json").write_text(json.dumps({"precision": "int4", "draft_precision": draft,
                                                          "prompt_records": []}))
    assert main(["--merge", str(tmp_path / "u.json"), str(tmp_path / "v.json")]) == 2


def test_slices_reuse_the_first_slices_sequoia_acceptance_and_merge_refuses_mixed_vectors(tmp_path) -> None:
    common = ["--pair", "tiny", "--methods", "sequoia", "--budgets", "8", "--temperatures", "1.0",
              "--datasets", "wiki", "--new-tokens", "6", "--calib-prompts", "1"]
    first, second, other = (tmp_path / f"{n}.json" for n in ("first", "second", "other"))
    assert main(common + ["--prompts", "1", "--json", str(first)]) == 0
    vec = json.loads(first.read_text())["sequoia_acceptance"]["1.0"]
    assert len(vec) > 1 and all(0.0 <= a <= 1.0 for a in vec)
    assert main(common + ["--prompts", "1", "--prompt-start", "1", "--sequoia-acceptance-from", str(first),
                          "--json", str(second)]) == 0
    assert json.loads(second.read_text())["sequoia_acceptance"]["1.0"] == vec
    fresh = tmp_path / "fresh.json"  # the same slice calibrating on its own grows the same trees
    assert main(common + ["--prompts", "1", "--prompt-start", "1", "--json", str(fresh)]) == 0
    assert json.loads(fresh.read_text())["prompt_records"] == json.loads(second.read_text())["prompt_records"]
    assert main(["--merge", str(first), str(second)]) == 0
    # a calibration on other prompts is refused as a source, and a slice grown from it cannot be pooled
    assert main(common[:-1] + ["2", "--prompts", "1", "--sequoia-acceptance-from", str(first)]) == 2
    forged = json.loads(second.read_text())
    forged["sequoia_acceptance"]["1.0"] = [a * 0.5 for a in vec]
    other.write_text(json.dumps(forged))
    assert main(["--merge", str(first), str(other)]) == 2


def test_depth_profile_accounts_for_every_node_and_the_whole_expectation(tmp_path) -> None:
    out = tmp_path / "profile.json"
    assert main(["--pair", "tiny", "--methods", "dyspec_greedy", "specinfer", "--budgets", "8", "--temperatures", "0",
                 "1.0", "--datasets", "wiki", "--prompts", "2", "--new-tokens", "8", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    for r in rec["prompt_records"]:
        assert len(r["depth_nodes"]) == len(r["depth_accepted"]) == r["steps"] > 0
        decode = r["decode_verifier"]
        assert len(r["depth_forecast"]) == r["steps"]
        for nodes, acc, fc, size, exp in zip(r["depth_nodes"], r["depth_accepted"], r["depth_forecast"], r["tree_sizes"],
                                             r["expected"][decode]):
            assert sum(nodes) == size - 1 and all(n > 0 for n in nodes)  # every depth up to the deepest is used
            assert len(fc) == len(nodes) and all(0.0 < f <= n + 1e-9 for f, n in zip(fc, nodes))
            assert sum(acc) == pytest.approx(exp, abs=1e-12)
            # P(on path) cannot grow with depth: a node is on the path only if its parent is
            assert all(a >= b - 1e-12 for a, b in zip(acc, acc[1:]))
    for c in rec["cells"]:
        prof = c["depth_profile"]
        assert sum(prof["accepted"]) == pytest.approx(c["expected_accepted"][c["decode_verifier"]]["mean"], abs=1e-12)
        sizes = [sum(r["tree_sizes"]) / r["steps"] - 1 for r in rec["prompt_records"]
                 if (r["method"], r["temperature"]) == (c["method"], c["temperature"])]
        assert sum(prof["nodes"]) == pytest.approx(sum(sizes) / len(sizes), abs=1e-9)
        if c["method"] == "specinfer":  # i.i.d. siblings: a sum of repeated draws' path probabilities is no forecast
            assert "forecast" not in prof
        else:
            assert len(prof["forecast"]) == len(prof["nodes"])
    assert {c["method"] for c in rec["cells"] if "forecast" in c["depth_profile"]} == {"dyspec_greedy"}
    merged = tmp_path / "merged.json"
    assert main(["--merge", str(out), "--json", str(merged)]) == 0
    assert [c["depth_profile"] for c in json.loads(merged.read_text())["cells"]] == [c["depth_profile"] for c in rec["cells"]]
    # pooled with a run recorded before profiles existed: the profile covers the prompts that have one
    old = tmp_path / "old.json"
    older = dict(rec, prompt_records=[{k: v for k, v in dict(r, prompt_id=r["prompt_id"] + "-old").items()
                                       if not k.startswith("depth_")} for r in rec["prompt_records"]])
    old.write_text(json.dumps(older))
    assert main(["--merge", str(out), str(old), "--json", str(merged)]) == 0
    cells = {(c["method"], c["temperature"]): c for c in json.loads(merged.read_text())["cells"]}
    for c in rec["cells"]:
        pooled = cells[(c["method"], c["temperature"])]
        assert pooled["prompts"] == 2 * c["prompts"] and pooled["depth_profile"] == dict(c["depth_profile"])


def test_methods_are_compared_paired_by_prompt(tmp_path) -> None:
    import statistics

    out = tmp_path / "pairs.json"
    assert main(["--pair", "tiny", "--methods", "specinfer", "dyspec_greedy", "dynatree", "--budgets", "8",
                 "--temperatures", "1.0", "--datasets", "wiki", "news", "--prompts", "2", "--new-tokens", "8",
                 "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    diffs = {(d["dataset"], d["a"], d["b"]): d for d in rec["method_differences"]}
    assert {k[0] for k in diffs} == {"wiki", "news", "news+wiki"} and len(diffs) == 9
    per_prompt = {(r["dataset"], r["prompt_id"], r["method"]): statistics.fmean(r["expected"][r["decode_verifier"]])
                  for r in rec["prompt_records"]}
    d = diffs[("news+wiki", "dyspec_greedy", "specinfer")]
    assert d["prompts"] == 4 and (d["a_verifier"], d["b_verifier"]) == ("token_level", "token_level")
    want = [per_prompt[(ds, pid, "dyspec_greedy")] - per_prompt[(ds, pid, "specinfer")]
            for (ds, pid, m) in per_prompt if m == "specinfer"]
    assert d["mean"] == pytest.approx(statistics.fmean(want), abs=1e-12) and d["ci95"] > 0
    # a top-k tree is scored under point-mass, the verifier its decode followed
    assert diffs[("wiki", "dynatree", "dyspec_greedy")]["a_verifier"] == "point_mass"
    merged = tmp_path / "merged.json"
    assert main(["--merge", str(out), "--json", str(merged)]) == 0
    assert json.loads(merged.read_text())["method_differences"] == rec["method_differences"]


def test_budget_gains_pair_each_budget_with_the_next_smaller_on_the_same_prompts(tmp_path) -> None:
    import statistics

    out = tmp_path / "gains.json"
    assert main(["--pair", "tiny", "--methods", "dyspec_greedy", "--budgets", "4", "16", "8", "--temperatures", "1.0",
                 "--datasets", "wiki", "--prompts", "2", "--new-tokens", "8", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert [(g["from_budget"], g["budget"]) for g in rec["budget_gains"]] == [(4, 8), (8, 16)]
    mean = {(r["budget"], r["prompt_id"]): statistics.fmean(r["expected"]["token_level"]) for r in rec["prompt_records"]}
    g = rec["budget_gains"][1]
    want = statistics.fmean(mean[(16, p)] - mean[(8, p)] for (b, p) in mean if b == 16)
    assert g["prompts"] == 2 and g["mean"] == pytest.approx(want, abs=1e-12)


def test_merge_refuses_two_different_records_of_one_prompt_and_mixed_dense_rows(tmp_path) -> None:
    common = ["--pair", "tiny", "--methods", "dyspec_greedy", "--budgets", "8", "--temperatures", "1.0",
              "--datasets", "wiki", "--new-tokens", "6"]
    a, b, c = (tmp_path / f"{n}.json" for n in ("a", "b", "c"))
    assert main(common + ["--prompts", "1", "--json", str(a)]) == 0
    assert main(common + ["--prompts", "1", "--seed", "1", "--json", str(b)]) == 0  # same prompt, other draws
    assert json.loads(a.read_text())["prompt_records"] != json.loads(b.read_text())["prompt_records"]
    assert main(["--merge", str(a), str(b)]) == 2
    assert main(common + ["--prompts", "1", "--prompt-start", "1", "--json", str(c)]) == 0
    other_kernel = json.loads(c.read_text())
    other_kernel["dense_rows"] = {"setting": "8", "min_rows": 8}
    c.write_text(json.dumps(other_kernel))
    assert main(["--merge", str(a), str(c)]) == 2  # one cell, two kernels
    merged = tmp_path / "m.json"
    other_kernel["prompt_records"] = [dict(r, budget=16) for r in other_kernel["prompt_records"]]
    c.write_text(json.dumps(other_kernel))
    assert main(["--merge", str(a), str(c), "--json", str(merged)]) == 0  # per budget: allowed, and recorded
    assert {(r["budget"], r["dense_rows"]) for r in json.loads(merged.read_text())["dense_rows_by_cell"]} == {(8, 0), (16, 8)}


def test_dense_rows_setting_is_checked_and_enables_the_split_on_both_models() -> None:
    from types import SimpleNamespace

    from dyntree_core.bench.exact_acceptance import apply_dense_rows
    from dyntree_core.quant import quantize_model
    from dyntree_core.testing import tiny_pair

    draft, target = tiny_pair(vocab=64, seed=0, layers=2, hidden=64)
    pair = SimpleNamespace(draft=quantize_model(draft, "int4"), target=quantize_model(target, "int8"))
    for bad in ("-1", "many"):
        with pytest.raises(ValueError, match="row count"):
            apply_dense_rows(pair, bad)
    assert apply_dense_rows(pair, "0") == {"setting": "0", "min_rows": 0}
    info = apply_dense_rows(pair, "4")
    layers = [m for model in (pair.draft, pair.target) for m in model.modules() if hasattr(m, "dense_parts")]
    assert layers and all(m.dense_parts is not None and m.dense_min_rows == 4 for m in layers)
    assert info["bytes"] == sum(m.dense_parts.numel() * 2 for m in layers)
    auto = apply_dense_rows(pair, "auto")
    assert auto["min_rows"] >= 0 and auto["measured"]["timings"]


def test_a_merged_file_records_its_inputs_provenance_and_stands_in_for_them(tmp_path) -> None:
    """The merge can replace its slices: it records its command and, per slice, what the slice told
    beyond its records (machine, argv, prompt range, seconds, --dense-rows, Sequoia vector); a later
    slice can take its Sequoia vector from it, and merging it with that slice equals merging all."""
    common = ["--pair", "tiny", "--methods", "sequoia", "dyspec_greedy", "--budgets", "8", "--temperatures", "1.0",
              "--datasets", "wiki", "--new-tokens", "6", "--calib-prompts", "1"]
    a, b, c, ab, abc, whole = (tmp_path / f"{n}.json" for n in ("a", "b", "c", "ab", "abc", "whole"))
    assert main(common + ["--prompts", "1", "--json", str(a)]) == 0
    assert main(common + ["--prompts", "1", "--prompt-start", "1", "--sequoia-acceptance-from", str(a),
                          "--json", str(b)]) == 0
    assert main(["--merge", str(a), str(b), "--json", str(ab)]) == 0
    m = json.loads(ab.read_text())
    assert m["merge"]["command"] == f"python -m dyntree_core.bench exact-acceptance --merge {a} {b} --json {ab}"
    slice_b = json.loads(b.read_text())
    entry = m["merged_from"][1]
    assert entry["file"] == "b.json" and entry["prompt_range"] == {"datasets": ["wiki"], "prompt_start": 1, "prompts": 1}
    for k in ("date", "argv", "machine_info", "seconds", "dense_rows", "sequoia_acceptance", "new_tokens"):
        assert entry[k] == slice_b[k], k
    assert entry["measured"] == [{"temperature": 1.0, "method": meth, "budget": 8, "dataset": "wiki",
                                  "decode_verifier": "token_level", "prompt_ids": [slice_b["prompt_records"][0]["prompt_id"]]}
                                 for meth in ("sequoia", "dyspec_greedy")]
    assert m["sequoia_acceptance"] == slice_b["sequoia_acceptance"] and entry["set_aside"] == []
    # a third slice grown from the merged file's vector; the merge of (merge, slice) = the merge of all three
    assert main(common + ["--prompts", "1", "--prompt-start", "2", "--sequoia-acceptance-from", str(ab),
                          "--json", str(c)]) == 0
    assert json.loads(c.read_text())["sequoia_acceptance"] == slice_b["sequoia_acceptance"]
    assert main(["--merge", str(ab), str(c), "--json", str(abc)]) == 0
    assert main(["--merge", str(a), str(b), str(c), "--json", str(whole)]) == 0
    nested, flat = json.loads(abc.read_text()), json.loads(whole.read_text())
    assert nested["cells"] == flat["cells"] and nested["prompt_records"] == flat["prompt_records"]
    assert nested["merged_from"][0]["merged_from"] == m["merged_from"]
    # a merged input's cells keep their --dense-rows threshold (from its dense_rows_by_cell)
    for f in (a, b, c):
        run = json.loads(f.read_text())
        run["dense_rows"] = {"setting": "8", "min_rows": 8}
        (tmp_path / f"dense_{f.name}").write_text(json.dumps(run))
    dense_ab = tmp_path / "dense_ab.json"
    assert main(["--merge", str(tmp_path / "dense_a.json"), str(tmp_path / "dense_b.json"), "--json", str(dense_ab)]) == 0
    assert main(["--merge", str(dense_ab), str(tmp_path / "dense_c.json")]) == 0
    assert main(["--merge", str(dense_ab), str(c)]) == 2  # one cell, two kernels


def test_merge_on_conflict_first_pools_the_first_record_and_sets_the_other_aside(tmp_path) -> None:
    common = ["--pair", "tiny", "--methods", "dyspec_greedy", "--budgets", "8", "--temperatures", "1.0",
              "--datasets", "wiki", "--new-tokens", "6"]
    a, b, alone, both = (tmp_path / f"{n}.json" for n in ("a", "b", "alone", "both"))
    assert main(common + ["--prompts", "1", "--json", str(a)]) == 0
    assert main(common + ["--prompts", "2", "--seed", "1", "--json", str(b)]) == 0  # prompt 0 again, other draws
    assert main(["--merge", str(a), str(b)]) == 2
    assert main(["--merge", str(a), str(b), "--on-conflict", "first", "--json", str(both)]) == 0
    merged = json.loads(both.read_text())
    pid = json.loads(a.read_text())["prompt_records"][0]["prompt_id"]
    assert merged["merged_from"][0]["set_aside"] == []
    assert merged["merged_from"][1]["set_aside"] == [{"temperature": 1.0, "method": "dyspec_greedy", "budget": 8,
                                                      "dataset": "wiki", "decode_verifier": "token_level",
                                                      "prompt_id": pid, "pooled_from": "a.json"}]
    assert len(merged["prompt_records"]) == 3  # nothing dropped from the file, one record not pooled
    # the pooled cell is a's prompt 0 and b's prompt 1
    b_only = json.loads(b.read_text())
    b_only["prompt_records"] = b_only["prompt_records"][1:]
    (tmp_path / "b1.json").write_text(json.dumps(b_only))
    assert main(["--merge", str(a), str(tmp_path / "b1.json"), "--json", str(alone)]) == 0
    assert merged["cells"] == json.loads(alone.read_text())["cells"]
