"""llama.cpp's own binaries as the speed bench's CPU peer: what each row reads from their logs (lines copied
from llama.cpp 11434's own output), the command lines they get, failures, and the bench without them."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from dyntree_core.bench import llamacpp_native as ln

COMPLETION_LOG = """\
0.04.248.620 I system_info: n_threads = 2 (n_threads_batch = 2) / 2 | CPU : SSE3 = 1 | AVX2 = 1 |
0.08.219.886 I common_perf_print:    samplers time =       9.05 ms /    77 tokens
0.08.219.903 I common_perf_print:        load time =     398.33 ms
0.08.219.920 I common_perf_print: prompt eval time =     398.01 ms /    13 tokens (   30.62 ms per token,    32.66 tokens per second)
0.08.219.936 I common_perf_print:        eval time =    3544.42 ms /    63 runs   (   56.26 ms per token,    17.77 tokens per second)
0.08.219.952 I common_perf_print:       total time =    3971.38 ms /    76 tokens
"""

DRAFT_LOG = """\
0.10.986.359 I encoded   13 tokens in    0.686 seconds, speed:   18.955 t/s
0.10.986.396 I decoded   70 tokens in    5.860 seconds, speed:   11.945 t/s
0.10.986.419 I 
0.10.986.440 I n_draft   = 16
0.10.986.463 I n_predict = 70
0.10.986.486 I n_drafted = 56
0.10.986.508 I n_accept  = 56
0.10.986.532 I accept    = 100.000%
0.10.986.787 I common_perf_print: prompt eval time =    3008.58 ms /    83 tokens (   36.25 ms per token,    27.59 tokens per second)
0.10.986.811 I common_perf_print:        eval time =      84.70 ms /     1 runs   (   84.70 ms per token,    11.81 tokens per second)
"""

NGRAM_LOG = """\
0.06.256.919 I encoded   13 tokens in    0.462 seconds, speed:   28.149 t/s
0.06.256.948 I decoded   65 tokens in    3.911 seconds, speed:   16.620 t/s
0.06.257.009 I n_predict = 65
0.06.257.029 I n_drafted = 0
0.06.257.050 I n_accept  = 0
0.06.257.069 I accept    = -nan%
"""

BENCH_JSON = [
    {"n_prompt": 1, "n_gen": 0, "avg_ns": 55600000, "samples_ns": [55400000, 55700000, 56100000], "avg_ts": 18.0},
    {"n_prompt": 64, "n_gen": 0, "avg_ns": 1131000000, "samples_ns": [1120000000, 1130000000, 1143000000],
     "avg_ts": 56.6},
    {"n_prompt": 0, "n_gen": 64, "avg_ns": 3580000000, "samples_ns": [3560000000, 3570000000, 3610000000],
     "avg_ts": 17.9},
]


def test_the_plain_row_reads_llama_cpps_decode_time_after_the_first_token():
    r = ln.parse_completion(COMPLETION_LOG)
    assert r.ms_per_token == pytest.approx(3544.42 / 63) and r.tokens == 63
    assert r.prompt_tokens == 13 and r.tokens_per_step == 1.0 and r.drafted is None


def test_the_speculative_rows_read_the_decode_loop_and_its_acceptance():
    d = ln.parse_speculative(DRAFT_LOG)
    assert d.ms_per_token == pytest.approx(5860 / 70) and d.tokens == 70 and d.prompt_tokens == 13
    assert (d.drafted, d.accepted) == (56, 56)
    assert d.tokens_per_step == pytest.approx(70 / (70 - 56))  # steps = committed - accepted drafts
    n = ln.parse_speculative(NGRAM_LOG)  # nothing drafted: "accept = -nan%", one token per step
    assert n.tokens_per_step == 1.0 and n.ms_per_token == pytest.approx(3911 / 65)


def test_a_log_without_timings_is_an_error_that_shows_the_log():
    with pytest.raises(ln.NativeRunError, match="no timing lines"):
        ln.parse_completion("error: invalid argument: --bogus\n")
    with pytest.raises(ln.NativeRunError, match="no summary"):
        ln.parse_speculative(COMPLETION_LOG)


def test_llama_bench_gives_ms_per_forward_of_n_rows_and_per_generated_token():
    out = ln.parse_bench("build: 11434\n" + json.dumps(BENCH_JSON))
    assert out["pp"] == {1: pytest.approx(55.7), 64: pytest.approx(1130.0)}
    assert out["tg"] == {64: pytest.approx(3570.0 / 64)}


def _fake_bin(tmp_path: Path, logs: dict[str, str], rc: int = 0) -> Path:
    """Binaries that record their argv and print a real log to stderr (where llama.cpp logs)."""
    d = tmp_path / "bin"
    d.mkdir()
    for name in ln.BINARIES:
        log = tmp_path / f"{name}.log"
        log.write_text(logs.get(name, ""))
        script = d / name
        script.write_text(f'#!/bin/sh\necho "$@" > "{tmp_path}/{name}.argv"\ncat "{log}" >&2\nexit {rc}\n')
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    (d / "BUILD_INFO").write_text("version test\n")
    return d


def test_each_row_runs_its_binary_with_greedy_settings_and_parses_it(tmp_path):
    bench = json.dumps(BENCH_JSON)
    d = _fake_bin(tmp_path, {"llama-completion": COMPLETION_LOG, "llama-speculative-simple": DRAFT_LOG,
                             "llama-bench": bench})
    build = ln.native_build(d)
    assert build.available and build.build_info == "version test"
    plain = ln.decode_prompt(build, "plain", "t.gguf", "def f():", 64, 2)
    assert plain.ms_per_token == pytest.approx(3544.42 / 63)
    argv = (tmp_path / "llama-completion.argv").read_text().split()
    assert argv[:2] == ["-m", "t.gguf"] and "-no-cnv" in argv
    assert not Path(argv[argv.index("-f") + 1]).exists()  # the prompt's temporary file is gone after the run
    assert argv[argv.index("--temp") + 1] == "0" and argv[argv.index("-n") + 1] == "64"
    assert argv[argv.index("-t") + 1] == "2" and argv[argv.index("-tb") + 1] == "2"
    draft = ln.decode_prompt(build, "draft-simple", "t.gguf", "x", 64, 2, draft_model="d.gguf", draft_max=8)
    assert draft.accepted == 56
    argv = (tmp_path / "llama-speculative-simple.argv").read_text().split()
    assert argv[argv.index("--spec-type") + 1] == "draft-simple" and argv[argv.index("-md") + 1] == "d.gguf"
    assert argv[argv.index("--spec-draft-n-max") + 1] == "8" and argv[argv.index("-td") + 1] == "2"
    ln.decode_prompt(build, "ngram-simple", "t.gguf", "x", 64, 2)
    argv = (tmp_path / "llama-speculative-simple.argv").read_text().split()
    assert argv[argv.index("--spec-type") + 1] == "ngram-simple" and "-md" not in argv
    with pytest.raises(ValueError, match="draft model"):
        ln.decode_prompt(build, "draft-simple", "t.gguf", "x", 64, 2)
    assert ln.bench_forwards(build, "t.gguf", [1, 64], 2)["pp"][64] == pytest.approx(1130.0)
    argv = (tmp_path / "llama-bench.argv").read_text().split()
    assert argv[argv.index("-p") + 1] == "1,64" and argv[argv.index("-o") + 1] == "json"


def test_a_failing_binary_says_which_and_what_it_printed(tmp_path):
    d = _fake_bin(tmp_path, {"llama-completion": "error: invalid argument: --no-warmup\n"}, rc=1)
    with pytest.raises(ln.NativeRunError, match=r"llama-completion exited 1:(.|\n)*--no-warmup"):
        ln.decode_prompt(ln.native_build(d), "plain", "t.gguf", "x", 8, 2)


def test_missing_binaries_say_how_to_build_them(tmp_path):
    b = ln.native_build(tmp_path / "nowhere")
    assert not b.available and set(b.missing) == set(ln.BINARIES)
    assert "make peers" in b.message and b.to_dict()["available"] is False


@pytest.mark.slow
def test_speed_bench_records_why_native_rows_are_missing(tmp_path, monkeypatch, capsys, one_torch_thread):
    from dyntree_core.bench.speed import main

    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path / "cache"))
    common = ["--pair", "tiny", "--datasets", "code", "--prompts", "1", "--prompt-tokens", "16", "--new-tokens", "4",
              "--temperatures", "0", "--precisions", "float32", "--auto-precisions", "float32", "--fixed", "--no-hf"]
    out = tmp_path / "speed.json"
    assert main([*common, "--llamacpp-bin", str(tmp_path / "nowhere"), "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert "make peers" in rec["llama_cpp_native"]["skipped"] and "llama_cpp" not in rec
    assert not any(c["row"].startswith("llama") for c in rec["cells"])
    d = _fake_bin(tmp_path, {})
    assert main([*common, "--llamacpp-bin", str(d), "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert "no GGUF" in rec["llama_cpp_native"]["skipped"]
    assert "make peers" in capsys.readouterr().err


def test_per_prompt_ratios_compare_each_row_with_llama_cpp_on_the_same_prompt():
    from dyntree_core.bench.speed import LLAMACPP_PLAIN, per_prompt_ratios

    def cell(row, ms, ds="code"):
        return {"row": row, "dataset": ds, "temperature": 0.0, "per_prompt_ms_per_token": ms}

    cells = [cell(LLAMACPP_PLAIN, [30.0, 40.0]), cell("llama.cpp ngram-simple (n_max 16)", [20.0, 50.0]),
             cell("auto", [15.0, 30.0]), cell("auto", [10.0], ds="wiki")]
    got = per_prompt_ratios(cells)
    auto = got["code T=0"]["auto"]["vs"]
    assert auto[LLAMACPP_PLAIN]["ratios"] == [0.5, 0.75] and auto[LLAMACPP_PLAIN]["median"] == 0.625
    assert auto["llama.cpp's fastest row"]["ratios"] == [0.75, 0.75]  # per prompt: ngram on 1, plain on 2
    assert "wiki T=0" not in got  # no llama.cpp row there: nothing to compare with
    assert "by_spell" not in auto[LLAMACPP_PLAIN]  # no bandwidth probes: no spells


def test_ratios_by_spell_compare_prompts_whose_runs_saw_the_same_bandwidth():
    from dyntree_core.bench.speed import LLAMACPP_PLAIN, per_prompt_ratios, spell_split

    def cell(row, ms, gbps):
        return {"row": row, "dataset": "news", "temperature": 0.0, "per_prompt_ms_per_token": ms,
                "read_gb_per_s_before": gbps}

    # prompt 0 slow for both, 1 fast for both, 2 straddles a spell change, 3 slow for both
    cells = [cell(LLAMACPP_PLAIN, [32.0, 29.0, 33.0, 34.0], [34.0, 57.0, 33.0, 31.0]),
             cell("autoregressive @ int4", [33.0, 23.2, 24.0, 34.0], [33.5, 58.0, 56.0, 32.5])]
    assert spell_split(cells) == round((34.0 * 56.0) ** 0.5, 1)  # between the groups: 34 | 56
    spells = per_prompt_ratios(cells)["news T=0"]["autoregressive @ int4"]["vs"][LLAMACPP_PLAIN]["by_spell"]
    slower, faster = [k for k in spells if k != "prompts across spells"]
    assert slower.startswith("slower (< 43.6") and faster.startswith("faster (> 43.6")
    assert spells[slower] == {"median": (33 / 32 + 1.0) / 2, "prompts": 2}
    assert spells[faster] == {"median": 23.2 / 29.0, "prompts": 1} and spells["prompts across spells"] == 1
    # probes spread without two groups: one spell, no split
    assert spell_split([cell("x", [1.0] * 4, [30.0, 33.0, 36.0, 39.0])]) is None
    # probes taken while the spell changed bridge the gap (37 -> 43 -> 50: no step of 1.2x); the groups still split
    bridged = [31.3, 32.5, 33.4, 34.0, 34.7, 35.6, 37.0, 43.3, 49.7, 55.1, 58.9, 60.4, 61.6, 62.6, 64.2]
    assert 37.0 < spell_split([cell("x", [1.0] * len(bridged), bridged)]) < 49.7


@pytest.mark.slow
def test_interleave_runs_every_row_on_a_prompt_before_the_next_prompt(tmp_path, monkeypatch, capsys,
                                                                        one_torch_thread):
    from dyntree_core.bench import speed

    calls = []
    real = speed._ours

    def logged(dec, ids, n, seed, per_prompt=None, traces=None):
        calls.append((dec.config.method == "autoregressive", seed))
        return real(dec, ids, n, seed, per_prompt, traces)

    monkeypatch.setattr(speed, "_ours", logged)
    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path / "cache"))
    common = ["--pair", "tiny", "--datasets", "code", "--prompts", "2", "--prompt-tokens", "16", "--new-tokens", "4",
              "--temperatures", "0", "--precisions", "float32", "--auto-precisions", "float32", "--fixed",
              "chain:2", "--no-hf", "--llamacpp-rows", "--json", str(tmp_path / "s.json")]
    assert speed.main(common) == 0
    assert [s for _, s in calls] == [0, 1, 0, 1, 0, 1]  # row by row: each row over both prompts
    calls.clear()
    assert speed.main([*common, "--interleave"]) == 0
    assert [s for _, s in calls] == [0, 0, 0, 1, 1, 1]  # prompt by prompt: every row on prompt 0 first
    assert [ar for ar, _ in calls[:3]] == [True, False, False]  # in the rows' order
    rec = json.loads((tmp_path / "s.json").read_text())
    assert [c["row"].split(" ")[0] for c in rec["cells"]] == ["autoregressive", "auto", "fixed:"]
    assert all(len(c["per_prompt_ms_per_token"]) == 2 for c in rec["cells"]) and rec["per_prompt_ratios"] == {}
    assert all(len(c["read_gb_per_s_before"]) == 2 and min(c["read_gb_per_s_before"]) > 0 for c in rec["cells"])


@pytest.mark.slow
@pytest.mark.parametrize("plan_once", [False, True])
def test_auto_plans_each_prompt_in_the_spell_its_probe_saw(tmp_path, monkeypatch, one_torch_thread, plan_once):
    """As the app's Run does: a probe in another spell of the memory's bandwidth gets that spell's plan (its profile
    measured then), and each prompt records the plan it ran, its prediction and the profile's bandwidth;
    ``--plan-once`` runs the first plan throughout."""
    from dyntree_core.bench import speed

    probes = iter([1000.0, 1000.0, 1000.0, 10.0, 10.0])  # the first plan, then prompt 0's two rows, prompt 1's
    monkeypatch.setattr(speed, "read_gb_per_s", lambda **_: next(probes))
    asked = []
    real_plan = speed.plan_auto

    def plan_auto(*a, **kw):
        asked.append(kw.get("read_gb_per_s"))
        plan = real_plan(*a, **kw)
        plan.profile.meta["read_gb_per_s"] = kw["read_gb_per_s"]  # (the tiny pair's profile is not probed)
        return plan

    monkeypatch.setattr(speed, "plan_auto", plan_auto)
    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "s.json"
    assert speed.main(["--pair", "tiny", "--datasets", "code", "--prompts", "2", "--prompt-tokens", "16",
                       "--new-tokens", "4", "--temperatures", "0", "--precisions", "float32", "--auto-precisions",
                       "float32", "--fixed", "--no-hf", "--interleave", "--json", str(out)]
                      + (["--plan-once"] if plan_once else [])) == 0
    rec = json.loads(out.read_text())
    auto = next(c for c in rec["cells"] if c["row"] == "auto")
    assert auto["read_gb_per_s_before"] == [1000.0, 10.0]
    assert len(auto["plan_per_prompt"]) == 2 and all(r > 0 for r in auto["measured_over_predicted"])
    assert all(r > 0 for r in auto["tokens_per_step_over_expected"])
    assert all(set(p) >= {"draft", "target forward", "rest of the step", "tokens per step"}
               for p in auto["parts_over_priced"])
    if plan_once:
        assert asked == [1000.0] and "plans_by_spell" not in rec
        assert auto["profile_read_gb_per_s"] == [1000.0, 1000.0]
    else:
        assert asked == [1000.0, 10.0] and len(rec["plans_by_spell"]["0.0"]) == 1
        assert auto["profile_read_gb_per_s"] == [1000.0, 10.0]
