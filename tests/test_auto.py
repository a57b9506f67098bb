"""``auto``: the cost model picks trees where forwards are flat in n, plain decoding where they are
steep, the fastest precision per model; the machine profile prunes and caches; the speed bench
runs end to end on the tiny pair."""

import json
import math

import pytest
import torch

from dyntree_core.planning.auto import choose
from dyntree_core.planning.candidates import chain_expected_tokens
from dyntree_core.planning.machine_profile import MachineProfile
from dyntree_core.planning.pricing import price_candidates
from dyntree_core.planning.profiling import load_or_measure_profile

NS = [1, 2, 4, 8, 16, 32]


def _profile(target: dict, draft: dict, other=None) -> MachineProfile:
    return MachineProfile(key="k", machine={"cpu_model": "test cpu", "cpu_class": "avx2"}, prefix_len=32, ns=NS,
                          target=target, draft=draft, other=other or [0.0] * len(NS))


def test_chain_expected_tokens_is_the_geometric_sum():
    assert chain_expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert chain_expected_tokens(0.0, 5) == 1.0


def test_flat_forwards_and_a_cheap_draft_choose_a_tree():
    """AMX-like: t(n) flat up to 32, draft 5% of the target -> a tree wins, by the predicted margin."""
    prof = _profile({"bfloat16": [0.1] * 6}, {"bfloat16": [0.005] * 6})
    plan = choose(prof, (0.8, 0.1, 0.05), 0.0, ["bfloat16"], ["bfloat16"])
    assert plan.method in ("chain", "sequoia")
    assert plan.best.seconds_per_token < 0.6 * plan.best_autoregressive.seconds_per_token
    assert "autoregressive" in plan.reason and "x)" in plan.reason


def test_steep_forwards_choose_autoregressive_and_say_why():
    """AVX2 bf16-like: t(n) linear in n and an expensive draft -> plain decoding."""
    prof = _profile({"float32": [0.1 * n for n in NS]}, {"float32": [0.05 * n for n in NS]})
    plan = choose(prof, (0.6, 0.1), 0.0, ["float32"], ["float32"])
    assert plan.method == "autoregressive"
    assert plan.reason.startswith("auto: plain autoregressive decoding") and "outweigh" in plan.reason


def test_the_fastest_precision_is_chosen_and_pruned_sizes_are_never_used():
    prof = _profile({"float32": [0.4, 0.8, 1.0, 1.2, 1.2, 1.5], "int8": [0.13, 0.15, 0.2, 0.4, 0.7, 1.3],
                     "bfloat16": [0.2, 0.35, 0.66, None, None, None]},
                    {"int8": [0.08, 0.08, 0.11, 0.18, 0.32, 0.6]})
    assert math.isinf(prof.target_time("bfloat16", 8)) and math.isinf(prof.target_time("bfloat16", 16))
    assert math.isinf(prof.target_time("int4", 1))  # not profiled at all
    plan = choose(prof, (0.7, 0.1), 0.0, ["float32", "int8", "bfloat16"], ["int8"])
    assert plan.best_autoregressive.target_precision == "int8"
    cands = price_candidates(prof, (0.7, 0.1), ["bfloat16"], ["int8"])
    assert cands and all(math.isfinite(c.seconds_per_token) for c in cands)
    assert max(c.depth for c in cands if c.method == "chain") == 3  # k+1 = 4 tokens: the last measured size


def test_a_tree_barely_ahead_of_autoregressive_is_not_taken():
    """Inside the safety margin (model error) plain decoding is kept."""
    prof = _profile({"int8": [0.1, 0.1, 0.1, 0.1, 0.1, 0.1]}, {"int8": [0.094] * 6})
    plan = choose(prof, (0.1,), 0.0, ["int8"], ["int8"], methods=("autoregressive", "chain"))
    # chain k=1: (0.1 + 0.094) / 1.1 = 0.176 > 0.1 -> AR anyway; make it barely better:
    prof2 = _profile({"int8": [0.1] * 6}, {"int8": [0.0] * 6})
    plan2 = choose(prof2, (0.03,), 0.0, ["int8"], ["int8"], methods=("autoregressive", "chain"))
    assert plan.method == "autoregressive" and plan2.method == "autoregressive"
    plan3 = choose(prof2, (0.5,), 0.0, ["int8"], ["int8"], methods=("autoregressive", "chain"))
    assert plan3.method == "chain"


def test_plan_applies_to_a_config():
    from dyntree_core.config import DecodeConfig

    prof = _profile({"int8": [0.1] * 6}, {"int4": [0.005] * 6})
    plan = choose(prof, (0.8, 0.1), 0.6, ["int8"], ["int4"])
    cfg = plan.apply(DecodeConfig(temperature=0.6, method="dyspec_greedy", verifier="traversal"))
    assert cfg.method == plan.method and cfg.precision == "int8" and cfg.draft_precision == "int4"
    assert cfg.verifier == "auto" and cfg.temperature == 0.6
    json.dumps(plan.to_dict())


def test_auto_never_drafts_at_a_precision_slower_than_another_for_its_shape():
    """Issue 41: a chain drafted at float32 where int4 drafts 4x faster. Every draft-model candidate auto ranks
    drafts at the precision whose measured time is the least for its draft rows (acceptance is measured once, at
    the fastest precisions, and priced for all)."""
    prof = _profile({"int4": [0.05, 0.06, 0.08, 0.12, 0.2, 0.4]},
                    {"int4": [0.01, 0.012, 0.016, 0.03, 0.06, 0.12], "float32": [0.04, 0.04, 0.041, 0.042, 0.045, 0.05],
                     "int8": [0.02] * 6})
    plan = choose(prof, (0.8, 0.5, 0.3), 0.0, ["int4"], ["int4", "float32", "int8"],
                  methods=("autoregressive", "chain", "sequoia"))
    assert plan.best.method in ("chain", "sequoia") and plan.best.draft_precision == "int4"
    drafted = [c for c in (*plan.top, *plan.per_method) if c.method in ("chain", "sequoia")]
    assert drafted and all(c.draft_precision == "int4" for c in drafted), [c.label() for c in drafted]
    assert plan.fastest_draft_precision == "int4"


def test_one_resolution_rule_for_the_cli_and_the_app():
    """``search_space`` + ``AutoPlan.resolve``: method auto takes the plan's method, shape and stop
    rule; a fixed method keeps itself and gets only precisions (AR: the fastest target precision);
    fixed precisions are kept; the app's settings carry the chain's confidence stop to the engine."""
    from dyntree_core.planning.search_space import search_space
    from ui.settings import RunSettings

    assert search_space("auto", "auto", "int4", "cpu") == (
        ("int8", "int4", "float32", "bfloat16"), ("int4",), ("autoregressive", "chain", "sequoia", "suffix", "hybrid"))
    assert search_space("suffix", "auto", "auto", "cpu")[2] == ("autoregressive", "suffix")
    assert search_space("hybrid", "auto", "auto", "cpu")[2] == ("autoregressive", "hybrid")
    assert search_space("chain", "int8", "auto", "cpu")[2] == ("autoregressive", "chain")
    assert search_space("autoregressive", "auto", "auto", "cpu")[2] == ("autoregressive",)
    assert search_space("dyspec_greedy", "auto", "auto", "cpu")[2] == ("autoregressive", "chain", "sequoia")

    prof = _profile({"int8": [0.13, 0.14, 0.16, 0.3, 0.6, 1.2], "float32": [0.4] * 6},
                    {"int4": [0.01] * 6, "int8": [0.02] * 6})
    plan = choose(prof, (0.8, 0.1, 0.05), 0.0, ["int8", "float32"], ["int4", "int8"], methods=("autoregressive", "chain"))
    assert plan.method == "chain"
    kw = plan.resolve("auto", "auto", "auto")
    assert kw["method"] == "chain" and kw["precision"] == "int8" and kw["draft_precision"] == "int4"
    assert kw["stop_confidence"] == plan.best.stop_confidence and kw["depth"] == plan.best.depth
    assert plan.resolve("dyspec_greedy", "auto", "int8") == {"precision": "int8"}
    assert plan.resolve("autoregressive", "auto", "auto") == {"precision": "int8", "draft_precision": "int4"}
    assert plan.resolve("chain", "float32", "float32") == {}

    form = RunSettings(draft="tiny", target="tiny", device="cpu", dtype="float32", prompt="a", chat=False,
                       method="auto", verifier="auto", temperature=0.0, top_p=1.0, budget=8, depth=4, width=2,
                       threshold=0.1, max_new_tokens=8, seed=0)
    from dataclasses import replace

    cfg = replace(form, **kw).decode_config()
    assert cfg.method == "chain" and cfg.depth == plan.best.depth and cfg.precision == "int8"
    kw["stop_confidence"] = 0.8  # what a plan on measured sequences sets (tuple vectors carry none)
    assert replace(form, **kw).decode_config().stop_confidence == 0.8
    assert replace(form, **kw).with_method("autoregressive").decode_config().stop_confidence is None


def _tiny_loader(loads: list):
    from dyntree_core.testing import tiny_pair

    def load(role, precision):
        loads.append((role, precision))
        d, t = tiny_pair(seed=0)
        return (d if role == "draft" else t).to(getattr(torch, precision))

    return load


def test_plan_auto_prices_inside_its_turn(monkeypatch):
    """Pricing is CPU work like a timed forward: in the app's background measurement it takes an idle turn on the
    models, so it never shares the cores with a session's steps."""
    from types import SimpleNamespace

    from dyntree_core.planning import auto

    inside = []

    class Turn:
        def __enter__(self):
            inside.append(True)

        def __exit__(self, *exc):
            inside.append(False)

    prof = _profile({"int8": [0.1 * n for n in NS]}, {"int8": [0.01] * 6})
    monkeypatch.setattr(auto, "profile_for", lambda *a, **k: prof)
    real = auto.choose

    def choose_in_turn(*args, **kwargs):
        assert inside and inside[-1], "priced outside the turn"
        return real(*args, **kwargs)

    monkeypatch.setattr(auto, "choose", choose_in_turn)
    cache = SimpleNamespace(draft_spec="tiny", target_spec="tiny", device="cpu")
    plan = auto.plan_auto(cache, 0.0, target_precisions=("int8",), draft_precisions=("int8",),
                          methods=("autoregressive",), measure=False, turn=Turn)
    assert plan.method == "autoregressive" and inside == [True, False]


def test_a_measuring_plan_finds_a_cached_acceptance_without_loading_the_pair(monkeypatch):
    """The app's background measurement plans with measuring allowed: a cached acceptance is found with the
    tokenizer alone (it had loaded the whole pair, 4-6 s in a turn on the models, a Run clicked meanwhile waiting);
    one not cached still loads the pair and measures it."""
    from types import SimpleNamespace

    from dyntree_core.planning import auto
    from dyntree_core.planning.acceptance import Acceptance

    prof = _profile({"int8": [0.1 * n for n in NS]}, {"int8": [0.01] * 6})
    monkeypatch.setattr(auto, "profile_for", lambda *a, **k: prof)
    monkeypatch.setattr(auto, "calibration_prompts", lambda tok: [[1, 2, 3]])
    stored = {"acc": Acceptance((0.6, 0.3))}
    monkeypatch.setattr(auto, "cached_acceptance", lambda *a, **k: stored["acc"])
    loaded = []

    def pair(tp, dp):
        loaded.append((tp, dp))
        return SimpleNamespace(tokenizer=None)

    monkeypatch.setattr(auto, "load_or_measure_acceptance", lambda *a, **k: Acceptance((0.5,)))
    cache = SimpleNamespace(draft_spec="tiny", target_spec="tiny", device="cpu", text_tokenizer=lambda: "tok",
                            pair=pair)
    kw = dict(target_precisions=("int8",), draft_precisions=("int8",), methods=("autoregressive", "chain"))
    auto.plan_auto(cache, 0.0, **kw)
    assert loaded == []
    stored["acc"] = None
    auto.plan_auto(cache, 0.0, **kw)
    assert loaded == [("int8", "int8")]


def test_profile_is_measured_once_then_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path))
    loads = []
    load = _tiny_loader(loads)
    msgs = []
    p1 = load_or_measure_profile(load, "tiny", "cpu", ["float32"], ns=(1, 2, 4), progress=msgs.append)
    assert loads == [("target", "float32"), ("draft", "float32")]
    assert all(t is not None and t > 0 for t in p1.target["float32"])
    assert p1.machine["cpu_model"] and p1.seconds > 0 and any("n=4" in m for m in msgs)
    p2 = load_or_measure_profile(load, "tiny", "cpu", ["float32"], ns=(1, 2, 4))
    assert len(loads) == 2 and p2.target == p1.target  # from the cache


def test_one_profile_per_machine_and_pair_grows_by_what_is_asked(tmp_path, monkeypatch):
    """Other precisions and larger sizes go into the same file: only what it lacks is measured,
    what it has is never measured again."""
    from dyntree_core.planning.machine_profile import profile_key, profile_path

    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path))
    loads = []
    load = _tiny_loader(loads)
    first = load_or_measure_profile(load, "tiny", "cpu", ["float32"], ns=(1, 2, 4))
    both = load_or_measure_profile(load, "tiny", "cpu", ["float32", "bfloat16"], ns=(1, 2, 4),
                                   draft_precisions=["float32"], target_ns=(8, 16))
    # fewest weight bytes first: bfloat16 at every size, the float32 target only at 8 and 16; then the engine's
    # steps at the new sizes (their other cost) on the fastest target and the draft, one model per role in memory
    assert loads[2:4] == [("target", "bfloat16"), ("target", "float32")]
    fast_t = both.fastest("target")
    assert loads[4:] == ([("target", fast_t)] if fast_t != "float32" else []) + [("draft", "float32")]
    assert both.key == first.key == profile_key("tiny", "cpu") and both.ns == [1, 2, 4, 8, 16]
    assert both.target["float32"][:3] == first.target["float32"]  # kept, not re-measured
    # (a precision measured > 2x slower than another at a size is dropped from there on: timing, not this test's subject)
    assert math.isfinite(both.target_time("float32", 16)) or "target:float32" in both.dropped
    assert both.draft_time("float32", 8) == math.inf
    assert both.max_tokens == 16 or "target:bfloat16" in both.dropped
    assert sorted(p.name for p in profile_path(both.key).parent.glob("machine-*.json")) == [profile_path(both.key).name]
    n_loads = len(loads)
    again = load_or_measure_profile(load, "tiny", "cpu", ["bfloat16", "float32"], ns=(1, 4), draft_precisions=["float32"],
                                    target_ns=(16,))
    assert len(loads) == n_loads and again.target == both.target


def test_dropped_sizes_are_never_measured_again(tmp_path, monkeypatch):
    from dyntree_core.planning.machine_profile import empty_profile
    from dyntree_core.planning.profiling import measure_into

    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path))
    prof = empty_profile("k")
    prof.target["float32"] = [None]
    prof.ns = [1]
    prof.other = [0.0]
    prof.dropped["target:int8"] = 4
    assert prof.missing("target", "int8", (1, 2, 4, 8)) == [1, 2]
    assert prof.missing("target", "float32", (1, 2)) == [1, 2]
    loads = []
    assert measure_into(prof, _tiny_loader(loads), {("target", "float32"): (1,)}) == 1
    assert measure_into(prof, _tiny_loader(loads), {("target", "float32"): (1,)}) == 0 and len(loads) == 1


def test_a_precision_too_big_to_read_in_time_is_never_loaded(tmp_path, monkeypatch):
    """A row whose weights alone take longer to read (at 1.25x the measured bandwidth) than twice the best one-token
    forward of its role is dropped without loading it (the 6 GB float32 twin of the 1.5B target); one that could be
    fast enough is measured; a model dropped before the next load of its role is already freed; a row whose weights
    would take the process over its memory budget is never loaded either."""
    import weakref

    from dyntree_core.planning.machine_profile import empty_profile
    from dyntree_core.planning.profiling import READ_MARGIN, measure_into

    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path))
    loads, alive = [], []
    tiny = _tiny_loader(loads)

    def load(role, precision):
        alive.append(sum(r() is not None for r_role, r in refs if r_role == role))  # same-role models in memory
        m = tiny(role, precision)
        refs.append((role, weakref.ref(m)))
        return m

    refs: list = []
    monkeypatch.setenv("DYNTREE_MEMORY_BUDGET_GB", "1e9")  # (the budget rule: below)
    prof = empty_profile("k")
    prof.meta["read_gb_per_s"] = 10.0  # (measured once per profile otherwise: ``read_gb_per_s``)
    gb = {"float32": 1e12, "bfloat16": 1e3}
    msgs = []
    measure_into(prof, load, {("target", p): (1, 2) for p in ("float32", "bfloat16", "float16")},
                 progress=msgs.append, forward_bytes=lambda role, p: gb.get(p))
    assert [p for _, p in loads if _ == "target"][:2] == ["bfloat16", "float16"]  # fewest bytes first (ties as asked)
    assert ("target", "float32") not in loads and prof.dropped["target:float32"] == 1
    assert prof.target["float32"] == [None, None] and prof.target["bfloat16"][0] is not None
    floor_ms = 1e12 / (READ_MARGIN * 10e9) * 1e3
    assert any(f"float32 is not loaded: its 1000.0 GB of weights take >= {floor_ms:.0f} ms" in m for m in msgs)
    assert alive[:2] == [0, 0]  # the bfloat16 target was freed before the float16 one loaded
    # a precision fast enough to read but too big for what is left of the process's memory budget
    from dyntree_core.process_memory import process_memory

    monkeypatch.setenv("DYNTREE_MEMORY_BUDGET_GB", str((process_memory().rss + 5e8) / 1e9))
    loads.clear()
    measure_into(prof, load, {("draft", "bfloat16"): (1,), ("draft", "float16"): (1,)}, progress=msgs.append,
                 forward_bytes=lambda role, p: {"bfloat16": 2e9, "float16": 1e3}[p])
    assert loads[0] == ("draft", "float16") and ("draft", "bfloat16") not in loads
    assert prof.dropped["draft:bfloat16"] == 1
    assert any("bfloat16 is not loaded: its 2.0 GB of weights would take this process" in m and "memory budget" in m
               for m in msgs)


def test_cli_method_auto_budget_auto_profiles_the_machine_once(tmp_path, monkeypatch, capsys):
    """``--method auto --budget auto`` goes through the one planner: one machine profile (each model
    timed once), auto's shape for the chosen method, no second tuner; a second run measures nothing."""
    from dyntree_core.__main__ import main
    from dyntree_core.planning import pair_cache, profiling
    from dyntree_core.testing import TinyPairCache
    from ui.tiny import TinyTokenizer

    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path))
    timed = []
    real_timer = profiling.ForwardTimer

    class CountingTimer(real_timer):
        def __init__(self, model, prefix_len, max_tokens=32):
            timed.append(type(model).__name__)
            super().__init__(model, prefix_len, max_tokens)

    monkeypatch.setattr(profiling, "ForwardTimer", CountingTimer)
    monkeypatch.setattr(pair_cache, "PairCache", lambda d, t, device="cpu": TinyPairCache(TinyTokenizer(64), vocab=64))
    tuned = []
    import dyntree_core.planning.tuning as tuning_mod

    monkeypatch.setattr(tuning_mod, "tune", lambda *a, **k: tuned.append(1))
    argv = ["generate", "--prompt", "t1 t2 t3 t1 t2 t3", "--draft", "tiny", "--target", "tiny", "--method", "auto",
            "--budget", "auto", "--precision", "float32", "--draft-precision", "float32", "--max-new-tokens", "6"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert len(timed) == 2, timed  # the target and the draft, once each: one profile
    assert not tuned and "auto:" in err
    assert main(argv) == 0
    assert len(timed) == 2  # cached: the second run measures nothing


@pytest.mark.slow
def test_speed_bench_runs_on_the_tiny_pair(tmp_path, monkeypatch, capsys, one_torch_thread):
    from dyntree_core.bench.speed import main

    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "speed.json"
    rc = main(["--pair", "tiny", "--datasets", "wiki", "code", "--prompts", "2", "--prompt-tokens", "16",
               "--new-tokens", "8", "--temperatures", "0", "0.6", "--precisions", "float32", "int8",
               "--auto-precisions", "float32", "int8", "--fixed", "chain:2", "sequoia:4:2", "suffix:4:2", "--hf-prompt-lookup", "3",
               "--prompt-aware", "--json", str(out)])
    assert rc == 0
    rec = json.loads(out.read_text())
    assert rec["machine_info"]["cpu_model"]
    rows = {(c["row"].split(" @")[0].split(":")[0], c["dataset"], c["temperature"]) for c in rec["cells"]}
    for ds in ("wiki", "code"):
        for t in (0.0, 0.6):
            for row in ("autoregressive", "auto", "fixed", "hf_generate", "hf_assisted"):
                assert (row, ds, t) in rows, (row, ds, t)
    assert all(c["median_ms_per_token"] > 0 for c in rec["cells"])
    assert any(c["row"].startswith("fixed: sequoia:4:2") for c in rec["cells"])
    assert any(c["row"].startswith("fixed: suffix:4:2") for c in rec["cells"])
    assert {(c["dataset"], c["temperature"]) for c in rec["cells"] if c["row"].startswith("hf_prompt_lookup k=3")} \
        == {(ds, t) for ds in ("wiki", "code") for t in (0.0, 0.6)}
    assert set(rec["plans"]) == {"0.0", "0.6"} and all(p["reason"].startswith("auto:") for p in rec["plans"].values())
    aware = [c for c in rec["cells"] if c["row"] == "auto, priced for the prompt"]
    assert len(aware) == 4 and all(len(c["prompt_agreement"]) == 2 and all(0 <= a <= 1 for a in c["prompt_agreement"])
                                   and len(c["measured_over_predicted"]) == 2 for c in aware)
    assert "| auto |" in capsys.readouterr().out


@pytest.mark.slow
def test_speed_bench_runs_only_the_transformers_rows_asked_for(tmp_path, monkeypatch, one_torch_thread):
    from dyntree_core.bench.speed import main

    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "speed.json"
    assert main(["--pair", "tiny", "--datasets", "code", "--prompts", "1", "--prompt-tokens", "16", "--new-tokens", "6",
                 "--temperatures", "0", "--precisions", "float32", "--auto-precisions", "float32", "--fixed",
                 "--hf-rows", "prompt_lookup", "--hf-prompt-lookup", "2", "--json", str(out)]) == 0
    rows = [c["row"] for c in json.loads(out.read_text())["cells"]]
    assert [r.split(" ")[0] for r in rows] == ["autoregressive", "auto", "hf_prompt_lookup"]


def test_chain_replay_is_exact_on_a_deterministic_sequence():
    from dyntree_core.planning.acceptance import STOP_GRID, Acceptance
    from dyntree_core.planning.candidates import simulate_chain

    # accept pattern 1 1 0 1, draft confident (>= every tau) except at position 1
    seq = ((1.0, *[1.0] * len(STOP_GRID)), (1.0, *[0.0] * len(STOP_GRID)),
           (0.0, *[1.0] * len(STOP_GRID)), (1.0, *[1.0] * len(STOP_GRID)))
    st = simulate_chain([seq], 2, None)
    # starts: s=0 -> 2 accepted +1; s=1 -> 1 (+1); s=2 -> 0 (+1); s=3 -> 1 + mean-row acceptance 0.75 (+1)
    assert st.tokens == pytest.approx((3 + 2 + 1 + (1 + 1 + 0.75)) / 4)
    assert st.drafted == 2 and st.size_probs == (0.0, 1.0)
    # every draft accepted (the next step's first draft forward has 2 rows): s=0 yes, s=1/s=2 no, s=3 0.75
    assert st.all_accepted == pytest.approx((1 + 0 + 0 + 0.75) / 4)
    stop = simulate_chain([seq], 3, 0)  # stop after the unsure token at position 1
    # s=0: drafts 0,1 then stops -> D=2, accepts 2 -> 3 tokens; s=1: D=1 -> 2 tokens; s=2: D=3, 0 accepted
    assert stop.size_probs[0] > 0 and stop.drafted < 3
    acc = Acceptance((0.75,), (seq,))
    prof = _profile({"int8": [0.1] * 6}, {"int8": [0.01] * 6})
    cands = price_candidates(prof, acc, ["int8"], ["int8"], methods=("chain",))
    assert any(c.stop_confidence is not None for c in cands) and all(c.method == "chain" for c in cands)
    two_rows = _profile({"int8": [0.1] * 6}, {"int8": [0.01, 0.03, 0.03, 0.03, 0.03, 0.03]})
    k2 = next(c for c in price_candidates(two_rows, acc, ["int8"], ["int8"], methods=("chain",))
              if c.depth == 2 and c.stop_confidence is None)
    assert k2.draft_seconds == pytest.approx(2 * 0.01 + st.all_accepted * (0.03 - 0.01))


def test_confidence_stop_is_lossless_and_shortens_chains():
    from dyntree_core import DecodeConfig, SpeculativeDecoder
    from dyntree_core.testing import tiny_pair

    draft, target = tiny_pair(vocab=64, seed=4, layers=2, hidden=64)
    ar = SpeculativeDecoder(draft, target, DecodeConfig(method="autoregressive"), eos_token_id=()).generate_ids([5, 9], 16)
    dec = SpeculativeDecoder(draft, target, DecodeConfig(method="chain", depth=6, stop_confidence=0.9), eos_token_id=())
    sizes, out = [], []
    for tr in dec.generate([5, 9], 16):
        sizes.append(tr.tree_size)
        out.extend(c.token_id for c in tr.committed)
    assert out == ar and min(sizes) < 7


def test_a_chains_first_draft_forward_has_two_rows_exactly_after_every_draft_was_accepted(monkeypatch):
    """What ``ChainStats.all_accepted`` prices: the draft never forwards a chain's last token, so after a step
    that accepted every drafted token the next step's first draft forward feeds two rows, else one."""
    from dyntree_core import DecodeConfig, SpeculativeDecoder
    from dyntree_core.decode import draft_source
    from dyntree_core.testing import tiny_pair

    pending: list[int] = []
    init = draft_source.ModelDraftSource.__init__

    def spy(self, model, cache, pend, *a, **kw):
        pending.append(len(pend))
        init(self, model, cache, pend, *a, **kw)

    monkeypatch.setattr(draft_source.ModelDraftSource, "__init__", spy)
    draft, target = tiny_pair(vocab=64, seed=4, layers=2, hidden=64, draft_noise=0.1)
    dec = SpeculativeDecoder(draft, target, DecodeConfig(method="chain", depth=3, stop_confidence=0.5),
                             eos_token_id=())
    all_in = [len(tr.accepted_nodes) - 1 == tr.tree_size - 1 for tr in dec.generate([5, 9], 48)]
    assert pending[0] == 1 and len(pending) == len(all_in)
    assert pending[1:] == [2 if full else 1 for full in all_in[:-1]]
    assert 0 < sum(all_in) < len(all_in)  # both cases occur


def test_the_profile_key_is_the_machines_identity(monkeypatch):
    """Keyed by the CPU model and flags (or the GPU on a CUDA device), not by what was asked for: two
    machines never share a profile, two requests on one machine always do."""
    from dyntree_core.planning import machine_profile
    from dyntree_core.machine import MachineInfo

    def info(cpu="EPYC", flags=("avx2",), gpu=None):
        return lambda: MachineInfo(cpu, flags, "avx2", 2, 2, "t", "p", "linux", gpu)

    monkeypatch.setattr(machine_profile, "machine_info", info())
    base = machine_profile.profile_key("pair", "cpu")
    monkeypatch.setattr(machine_profile, "machine_info", info(flags=("avx2", "amx_bf16")))
    assert machine_profile.profile_key("pair", "cpu") != base
    monkeypatch.setattr(machine_profile, "machine_info", info(gpu="NVIDIA H200"))
    h200 = machine_profile.profile_key("pair", "cuda")  # the GPU's name (read from a field that exists)
    monkeypatch.setattr(machine_profile, "machine_info", info(gpu="NVIDIA H100 80GB HBM3"))
    assert machine_profile.profile_key("pair", "cuda") != h200
    assert machine_profile.profile_key("pair", "cpu") == base  # the CPU profile ignores the GPU


def test_cli_budget_auto_for_a_method_auto_cannot_price_calibrates_on_the_same_profile(tmp_path, monkeypatch, capsys):
    """``--method dyspec_greedy --budget auto``: no plan is needed with both precisions fixed; the one
    profile is measured once with the calibration's sizes and handed to ``tuning``; its shape is used."""
    import dyntree_core.planning.tuning as tuning_mod
    from dyntree_core.__main__ import main
    from dyntree_core.planning import machine_profile, pair_cache, profiling
    from dyntree_core.planning.tuning import CALIBRATION_NS
    from dyntree_core.planning.tuning_result import TuningPoint, TuningResult
    from dyntree_core.testing import TinyPairCache
    from ui.tiny import TinyTokenizer

    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path))
    timed = []
    real_timer = profiling.ForwardTimer

    class CountingTimer(real_timer):
        def __init__(self, model, prefix_len, max_tokens=32):
            timed.append(max_tokens)
            super().__init__(model, prefix_len, max_tokens)

    monkeypatch.setattr(profiling, "ForwardTimer", CountingTimer)
    monkeypatch.setattr(pair_cache, "PairCache", lambda d, t, device="cpu": TinyPairCache(TinyTokenizer(64), vocab=64))
    seen = {}

    def fake_tune(draft, target, cfg, profile, **kw):
        seen["profile"], seen["cfg"] = profile, cfg
        best = TuningPoint(12, 3, cfg.width, 2.0, 12.0, 0.01, 0.01)
        return TuningResult(cfg.method, cfg.temperature, profile.key, "test", best, (best,))

    monkeypatch.setattr(tuning_mod, "load_or_tune", fake_tune)
    assert main(["generate", "--prompt", "t1 t2 t3", "--draft", "tiny", "--target", "tiny", "--method", "dyspec_greedy",
                 "--budget", "auto", "--precision", "float32", "--draft-precision", "float32",
                 "--max-new-tokens", "4"]) == 0
    assert sorted(timed) == [max(machine_profile.DEFAULT_NS), max(CALIBRATION_NS)]  # draft, target: once each
    prof = seen["profile"]
    assert all(math.isfinite(prof.target_time("float32", n)) for n in CALIBRATION_NS)
    assert seen["cfg"].precision == "float32" and seen["cfg"].method == "dyspec_greedy"
    assert "tuned: budget 12, depth 3" in capsys.readouterr().err


def test_the_pair_cache_keeps_at_most_keep_models_and_drops_the_least_recently_used(monkeypatch):
    """The app loads pairs through one PairCache: after pairs at three precisions, the first
    precision's models are gone from memory (only ``keep`` models and the tokenizer stay)."""
    import dataclasses
    import gc
    import weakref

    import dyntree_core.models.load as load

    class Model:
        def __init__(self, role, precision):
            self.role, self.precision = role, precision

    @dataclasses.dataclass
    class Pair:
        draft: object
        target: object
        tokenizer: object = "tok"
        draft_precision: str = ""
        target_precision: str = ""

    monkeypatch.setattr(load, "load_pair", lambda d, t, device, precision, draft_precision, progress=None: Pair(
        Model("draft", draft_precision), Model("target", precision), "tok", draft_precision, precision))
    monkeypatch.setattr(load, "resolve_spec", lambda spec, role: role)
    monkeypatch.setattr(load, "load_model", lambda src, dtype, device, precision, progress=None: Model(src, precision))
    from dyntree_core.planning.pair_cache import PairCache

    cache = PairCache("d", "t", keep=2)
    first = cache.pair("int4", "int4")
    refs = [weakref.ref(first.draft), weakref.ref(first.target)]
    del first
    cache.pair("int8", "int8")
    last = cache.pair("float32", "float32")
    gc.collect()
    assert [r() for r in refs] == [None, None]
    assert len(cache._models) == 2 and last.tokenizer == "tok" and last.target.precision == "float32"


class _TableTimer:
    """A ``ForwardTimer`` whose forwards take ``TIMES[precision][n]`` seconds (the model stands for its
    precision); records the sizes timed."""

    TIMES: dict = {}
    timed: list = []

    def __init__(self, model, prefix_len, max_tokens):
        self.prec = model

    def once(self, n):
        return self.TIMES[self.prec][n]

    def best(self, n, reps):
        self.timed.append((self.prec, n))
        return self.TIMES[self.prec][n]


def _measure_table(monkeypatch, tmp_path, times, sizes=(1, 2, 4, 8, 16, 32), forward_bytes=None, read_gbps=None,
                   spell_moves=0):
    from dyntree_core.planning import profiling
    from dyntree_core.planning.machine_profile import empty_profile

    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path))
    monkeypatch.setenv("DYNTREE_MEMORY_BUDGET_GB", "1e9")  # (not this process's size after earlier tests' models)
    monkeypatch.setattr(profiling, "ForwardTimer", _TableTimer)
    monkeypatch.setattr(profiling, "engine_steps", lambda draft, target, n: [None])
    monkeypatch.setattr(profiling, "other_seconds", lambda n, _s, step: 0.0)
    _TableTimer.TIMES, _TableTimer.timed = times, []
    prof = empty_profile("k")
    if read_gbps is not None:
        prof.meta["read_gb_per_s"] = read_gbps
    prof.other = [0.0] * len(prof.ns)
    msgs = []
    profiling.measure_into(prof, lambda role, p: p, {("target", p): sizes for p in times}, progress=msgs.append,
                           forward_bytes=forward_bytes, spell_moves=spell_moves)
    return prof, _TableTimer.timed, msgs


def test_a_row_measured_in_another_bandwidth_spell_is_measured_again(tmp_path, monkeypatch):
    """The Zen 4 host's memory reads ~32 or ~50 GB/s by spells: a memory-bound row whose probes around it are not
    the profile's spell is measured again after a wait, its probes recorded; one that never finds the spell is
    kept and named; a model too small to be memory-bound is not probed at all."""
    from dyntree_core.planning import profiling

    probes = iter([50.0,  # the profile's spell (the probe's first read)
                   50.0, 49.0,  # int4: in the spell
                   51.0, 33.0,  # int8: the spell changed while it was measured -> again
                   32.0, 32.5,  # ... still the slower spell -> again
                   48.0, 50.5])  # ... back: kept
    monkeypatch.setattr(profiling, "read_gb_per_s", lambda **_kw: next(probes))
    monkeypatch.setattr(profiling, "PROBE_BYTES", 1 << 12)
    waits = []
    monkeypatch.setattr(profiling.time, "sleep", waits.append)
    ns = (1, 2, 4)
    times = {"int4": {n: 0.03 * n for n in ns}, "int8": {n: 0.05 * n for n in ns}}
    prof, timed, msgs = _measure_table(monkeypatch, tmp_path, times, sizes=ns,
                                       forward_bytes=lambda role, p: 1 << 30)
    assert next(probes, None) is None  # every probe was taken
    assert [n for p, n in timed if p == "int4"] == [1, 2, 4] and [n for p, n in timed if p == "int8"] == [1, 2, 4] * 3
    assert prof.target["int8"] == [times["int8"][n] for n in ns]
    assert prof.meta["read_gb_per_s"] == 50.0 and waits == [profiling.SPELL_WAIT_S] * 2
    assert prof.meta["row_gb_per_s"] == {"target:int4": [50.0, 49.0], "target:int8": [48.0, 50.5]}
    assert "mixed_spells" not in prof.meta
    assert sum("another spell of this host's bandwidth" in m for m in msgs) == 2
    from dyntree_core.planning.auto import choose

    plan = choose(prof, (0.0,), 0.0, ["int4", "int8"], ["int4"], methods=("autoregressive",))
    assert "memory read at 50 GB/s when profiled" in plan.reason  # (which spell its predictions are for)

    # a row that never finds the profile's spell is kept as measured and named
    never = iter([50.0] + [32.0] * (2 * (profiling.SPELL_RETRIES + 1)))
    monkeypatch.setattr(profiling, "read_gb_per_s", lambda **_kw: next(never))
    prof, timed, msgs = _measure_table(monkeypatch, tmp_path / "b", {"int4": times["int4"]}, sizes=ns,
                                       forward_bytes=lambda role, p: 1 << 30)
    assert len(timed) == 3 * (profiling.SPELL_RETRIES + 1) and prof.meta["mixed_spells"] == ["target:int4"]
    assert prof.target["int4"] == [times["int4"][n] for n in ns] and any("kept as measured" in m for m in msgs)

    # a model that reads less than SPELL_MIN_BYTES per forward: no probe (the byte rule's bandwidth given)
    monkeypatch.setattr(profiling, "read_gb_per_s", lambda **_kw: pytest.fail("probed a small model"))
    prof, timed, _ = _measure_table(monkeypatch, tmp_path / "c", times, sizes=ns, forward_bytes=lambda role, p: 1 << 20,
                                    read_gbps=50.0)
    assert len(timed) == 6 and "row_gb_per_s" not in prof.meta


def test_a_profile_from_nothing_moves_to_the_spell_the_memory_stays_in(tmp_path, monkeypatch):
    """The browser test's Zen 4 run: the profile's spell was the Run's probe (59 GB/s), then the memory read 35 for
    minutes, and every row waited out its retries (140 s of a 164 s measurement). Where two rows or attempts one
    after the other read one spell away from the profile's on both sides, a profile measured from nothing moves
    there: the second is kept, the rows timed before it are timed again next (before the rows after it). One row's
    probes alone move nothing (a fast spell of 6 s had moved a profile that then waited out every later row), and it
    moves at most ``spell_moves`` times: a later row outside the last spell is measured again as before."""
    from dyntree_core.planning import profiling

    probes = iter([50.0,  # the profile's spell
                   50.0, 49.0,  # int4: in it
                   33.0, 32.0,  # int8: both probes in another spell: once is not enough -> again after a wait
                   32.0, 33.0,  # ... the same spell again -> the profile moves to 32.5
                   32.0, 33.0,  # int4 timed again there
                   50.0, 51.0,  # bfloat16: outside the new spell -> again after a wait
                   50.5, 50.0,  # ... the same spell again, but spell_moves=1 allows no second move -> again
                   32.5, 32.0])  # ... back in it
    monkeypatch.setattr(profiling, "read_gb_per_s", lambda **_kw: next(probes))
    monkeypatch.setattr(profiling, "PROBE_BYTES", 1 << 12)
    waits = []
    monkeypatch.setattr(profiling.time, "sleep", waits.append)
    ns = (1, 2, 4)
    times = {"int4": {n: 0.03 * n for n in ns}, "int8": {n: 0.05 * n for n in ns},
             "bfloat16": {n: 0.055 * n for n in ns}}
    gb = lambda role, p: 1 << 30  # noqa: E731
    prof, timed, msgs = _measure_table(monkeypatch, tmp_path, times, sizes=ns, forward_bytes=gb, spell_moves=1)
    assert next(probes, None) is None
    assert [p for p, _ in timed] == ["int4"] * 3 + ["int8"] * 6 + ["int4"] * 3 + ["bfloat16"] * 9
    assert prof.meta["read_gb_per_s"] == 32.5 and prof.meta["spell_moved_from"] == [50.0]
    assert prof.meta["row_gb_per_s"] == {"target:int8": [32.0, 33.0], "target:int4": [32.0, 33.0],
                                         "target:bfloat16": [32.5, 32.0]}
    assert waits == [profiling.SPELL_WAIT_S] * 3 and "mixed_spells" not in prof.meta
    assert all(prof.target[p] == [times[p][n] for n in ns] for p in times)
    assert any("the spell it read 32 in before, not the profile's 50: the profile moves to it; timed again there: "
               "target int4" in m for m in msgs)

    # the product's SPELL_MOVES = 2: the memory back in the first spell for two attempts moves the profile back
    assert profiling.SPELL_MOVES == 2
    back = iter([50.0, 50.0, 49.0, 33.0, 32.0, 32.0, 33.0, 32.0, 33.0, 50.0, 51.0, 50.5, 50.0, 50.0, 50.5, 49.5, 50.0])
    monkeypatch.setattr(profiling, "read_gb_per_s", lambda **_kw: next(back))
    prof, timed, msgs = _measure_table(monkeypatch, tmp_path / "back", times, sizes=ns, forward_bytes=gb,
                                       spell_moves=profiling.SPELL_MOVES)
    assert next(back, None) is None and prof.meta["spell_moved_from"] == [50.0, 32.5]
    assert prof.meta["read_gb_per_s"] == 50.25 and "mixed_spells" not in prof.meta
    assert [p for p, _ in timed] == (["int4"] * 3 + ["int8"] * 6 + ["int4"] * 3 + ["bfloat16"] * 6 + ["int4"] * 3
                                     + ["int8"] * 3)  # (each row once, in the order it was first timed)
    assert any("the profile moves to it; timed again there: target int4, target int8" in m for m in msgs)

    # one row in another spell, then the profile's again (a short fast spell); probes that disagree (the memory
    # changing while a row was timed); without spell_moves, the same spell on every probe: none moves the profile
    for moves, seq in ((1, [50.0, 50.0, 49.0, 33.0, 32.0, 50.0, 50.5]), (1, [50.0, 50.0, 33.0, 32.0, 50.5]),
                       (0, [50.0] + [32.0] * 8)):
        it = iter(seq + [50.0] * 8)
        monkeypatch.setattr(profiling, "read_gb_per_s", lambda **_kw: next(it))
        prof, _, msgs = _measure_table(monkeypatch, tmp_path / f"m{len(seq)}", times, sizes=ns, forward_bytes=gb,
                                       spell_moves=moves)
        assert prof.meta["read_gb_per_s"] == 50.0 and "spell_moved_from" not in prof.meta
        assert not any("moves to it" in m for m in msgs)

    # a dropped row (3x the best at both ends: so in either spell) is kept as timed, whatever its probes read, and
    # is not timed again when the profile moves
    slow = iter([50.0, 50.0, 49.0, 33.0, 32.0, 32.0, 33.0, 32.0, 33.0])
    monkeypatch.setattr(profiling, "read_gb_per_s", lambda **_kw: next(slow))
    waits.clear()
    prof, timed, msgs = _measure_table(monkeypatch, tmp_path / "d", {"int4": times["int4"],
                                                                     "int8": {n: 0.1 * n for n in ns},
                                                                     "bfloat16": times["bfloat16"]},
                                       sizes=ns, forward_bytes=gb, spell_moves=profiling.SPELL_MOVES)
    assert next(slow, None) is None and waits == [] and "target:int8" in prof.dropped
    assert [p for p, _ in timed] == ["int4"] * 3 + ["int8"] * 2 + ["bfloat16"] * 3 + ["int4"] * 3
    assert prof.meta["spell_moved_from"] == [50.0] and "mixed_spells" not in prof.meta


def test_a_precision_slow_for_one_token_is_timed_at_the_largest_size_before_it_is_dropped(tmp_path, monkeypatch):
    """Issue 40's AMX case: bf16 2.5x int4's time for one token but a third of it for 32 is measured at every
    size (and a tree of 32 is priced at bf16); one slower at both ends (by 2.5x, or by 3x and 1.2x) keeps its
    two times and skips the sizes between."""
    ns = (1, 2, 4, 8, 16, 32)
    int4 = {n: 0.1 * n for n in ns}  # (linear in n, as int4 on AVX2)
    amx = {n: 0.25 + 0.003 * n for n in ns}  # 2.5x at n = 1, 0.28x at n = 32
    prof, timed, _ = _measure_table(monkeypatch, tmp_path, {"int4": int4, "bfloat16": amx})
    assert prof.target["bfloat16"] == [amx[n] for n in ns] and "target:bfloat16" not in prof.dropped
    assert [n for p, n in timed if p == "bfloat16"] == [1, 32, 2, 4, 8, 16]
    assert prof.target_time("bfloat16", 32) < prof.target_time("int4", 32)

    avx2 = {n: 0.25 * n for n in ns}  # 2.5x at every size
    prof, timed, msgs = _measure_table(monkeypatch, tmp_path / "b", {"int4": int4, "bfloat16": avx2})
    assert [n for p, n in timed if p == "bfloat16"] == [1, 32]
    assert prof.dropped["target:bfloat16"] == 1
    row = prof.target["bfloat16"]
    assert row[0] == avx2[1] and row[-1] == avx2[32] and row[1:-1] == [None] * 4
    assert any("> 2x the best precision (100 ms); n=32: 8000 ms, the best there 3200 ms: the sizes between not "
               "measured" in m for m in msgs)

    int8 = {n: 0.3 + 0.11 * n for n in ns}  # 3x at n = 1, 1.2x at n = 32 (int8 beside int4 on AVX2)
    prof, timed, _ = _measure_table(monkeypatch, tmp_path / "c", {"int4": int4, "int8": int8})
    assert [n for p, n in timed if p == "int8"] == [1, 32] and prof.dropped["target:int8"] == 1


def test_the_byte_rule_compares_with_the_largest_size(tmp_path, monkeypatch):
    """Reading a precision's weights bounds its forward at every size from below, so it rules a precision out
    only against the best forward at the largest size asked for (one 2.5x slower to read than int4's one-token
    forward can still win at 32 tokens); a precision whose read alone is > 2x that is never loaded."""
    ns = (1, 2, 4, 8, 16, 32)
    int4 = {n: 0.1 * n for n in ns}
    amx = {n: 0.25 + 0.003 * n for n in ns}
    gb = {"int4": 1e9, "bfloat16": 3e9, "float32": 1e13}
    monkeypatch.setenv("DYNTREE_MEMORY_BUDGET_GB", "1e9")  # (the byte rule, not the memory budget's)
    prof, timed, msgs = _measure_table(monkeypatch, tmp_path, {"int4": int4, "bfloat16": amx, "float32": amx},
                                       forward_bytes=lambda role, p: gb[p], read_gbps=10.0)
    # bfloat16: a 240 ms floor (3 GB at 1.25 x 10 GB/s) > 2 x 100 ms for one token, < 2 x 3.2 s for 32: loaded
    assert "target:bfloat16" not in prof.dropped and prof.target["bfloat16"] == [amx[n] for n in ns]
    assert prof.dropped["target:float32"] == 1 and not [n for p, n in timed if p == "float32"]
    assert any("float32 is not loaded" in m and "the best 32-token forward (346 ms)" in m for m in msgs)  # bf16's
