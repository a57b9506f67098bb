"""The page's event handlers (``ui.controller.Controller``) on the tiny pair, with the form at the
real app's defaults (``AppDefaults()``: Method, Target and Draft precision = ``auto``)."""

from __future__ import annotations

import time
import types

import gradio as gr
import pytest

from dyntree_core.planning.prediction import MIN_STEPS, Prediction
from ui.controller import Controller
from ui.layout import N_COMPARE, AppDefaults
from ui.session import SessionState
from ui.settings import settings_from_form
from ui.tiny import TinyModelProvider
from ui_form import form_values

DEFAULTS = AppDefaults()


def _form(**kw) -> list:
    """Form values in ``settings_from_form`` order: the real app's defaults, tiny models."""
    d = DEFAULTS
    values = dict(draft="tiny", target="tiny", device=d.device, dtype=d.dtype, prompt="t1 t2 t3 t4 t5",
                  chat=d.chat, method=d.method, verifier="auto", temperature=0.0, top_p=1.0, budget=d.budget,
                  depth=d.depth, width=d.width, threshold=0.05, max_new_tokens=12, seed=0, offload=False,
                  precision=d.precision, draft_precision=d.draft_precision)
    values.update(kw)
    return form_values(**values)


#: the Live tab's components a refresh writes (``Controller.live``)
LIVE_COMPONENTS = ("tree_plot", "mask_bfs", "mask_dfs", "mask_hpd", "phase_plot", "walkthrough", "text_html",
                   "cost_model", "speed_plot", "steps_plot", "status", "step_slider", "error_box", "pause_btn", "memory")


def _name_live_components(controller, *more: str) -> None:
    """Give the fixture's component namespace the Live tab's components (and ``more``), each named by itself."""
    for name in LIVE_COMPONENTS + more:
        setattr(controller.c, name, name)


@pytest.fixture()
def controller(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path))  # a fresh profile cache: auto measures
    comps = types.SimpleNamespace(
        cmp_speed="cmp_speed", cmp_steps="cmp_steps", cmp_status="cmp_status", export_files="export_files",
        cmp_texts=tuple(f"text{i}" for i in range(N_COMPARE)), cmp_stats=tuple(f"stats{i}" for i in range(N_COMPARE)))
    ctl = Controller(TinyModelProvider(), comps, [], stream_interval_s=0.5)
    yield ctl
    assert ctl.planner.close(60)  # the background measurement thread is gone


def test_the_real_defaults_are_auto():
    assert (DEFAULTS.method, DEFAULTS.precision, DEFAULTS.draft_precision) == ("auto", "auto", "auto")


def test_run_with_the_defaults_resolves_auto_and_finishes(controller):
    state = SessionState()
    controller.on_run(state, False, *_form())
    assert state.error == "", state.error
    assert state.worker is not None and state.worker.join(120)
    rec = state.record
    assert rec.status == "finished", (rec.status, state.error)
    assert len(rec.token_ids) == 12
    assert "auto" not in (rec.settings.method, rec.settings.precision, rec.settings.draft_precision)
    assert rec.note.startswith("auto:")


def test_the_footer_names_the_loaded_models_once_a_run_loads_them(controller):
    """The pair's description (``LoadedPair.description``: names, precisions, device, vocabulary, a draft's head
    note) is in the page's footer from the first refresh after the load."""
    state = SessionState()
    before = controller.memory_update(state)
    assert "models:" not in str(before)
    controller.on_run(state, False, *_form())
    assert state.worker is not None and state.worker.join(120)
    footer = controller.memory_update(state)
    assert isinstance(footer, str) and "models: tiny random Llama pair (test only;" in footer, footer


def test_step_with_the_defaults_runs_one_step(controller):
    state = SessionState()
    controller.on_step(state, *_form())
    assert state.error == "", state.error
    assert state.record is not None and len(state.record.traces) == 1
    assert state.record.status == "paused"


def test_compare_with_the_defaults_runs_every_column(controller):
    state = SessionState()
    updates = list(controller.on_compare(state, "dyspec_greedy", False, *_form()))
    assert updates[-1]["cmp_status"].startswith("done"), updates[-1]["cmp_status"]
    assert [r.status for r in state.compare] == ["finished"] * 3
    assert [r.config.method for r in state.compare] == ["autoregressive", "chain", "dyspec_greedy"]


def test_run_and_compare_show_one_prediction_once_the_machine_is_measured(controller, monkeypatch):
    """Run with the defaults twice (before and after auto's background measurement), then Compare with
    its default tree column (auto's choice): the second Run and Compare's auto column carry the same
    prediction, and the status line and the column print it and the check of the same numbers. (The tiny
    pair's millisecond steps are noisy: a run off by more than ``OFF_BY`` would start re-measuring and
    Compare would run the provisional plan meanwhile, which ``test_prediction`` checks; here every run is
    taken as within.)"""
    import html

    from dyntree_core.planning import prediction
    from ui.views import compare_views, status_line

    monkeypatch.setattr(prediction, "OFF_BY", 100.0)
    state = SessionState()
    controller.on_run(state, False, *_form())
    assert state.worker.join(120) and state.record.prediction is None  # provisional: nothing measured to predict
    assert "until this machine is measured" in state.record.note
    controller.planner._thread.join(300)
    assert not controller.planner.busy and not controller.planner.failed
    controller.on_run(state, False, *_form())
    assert state.worker.join(120) and state.error == "", state.error
    run = state.record
    assert run.prediction is not None and run.prediction.text() in run.note, run.note
    assert run.read_window == (None, None)  # (the tiny pair's rows read too little to be probed: no spell)
    updates = list(controller.on_compare(state, "auto", False, *_form()))
    assert updates[-1]["cmp_status"].startswith("done"), updates[-1]["cmp_status"]
    auto_col = state.compare[2]
    assert auto_col.config.method == run.config.method and auto_col.prediction == run.prediction
    _, stats, _, _ = compare_views(state.compare)
    check = run.prediction_check()
    assert html.escape(check.text(run.remeasuring)) in status_line(run)
    assert html.escape(run.prediction.text()) in stats[2]
    assert html.escape(auto_col.prediction_check().text(auto_col.remeasuring)) in stats[2]


def test_a_run_priced_from_a_probed_profile_probes_the_memory_before_and_after(controller, monkeypatch):
    """Where the prediction's profile was measured in a known spell of the memory's bandwidth, the run reads it
    before its first step and after its last (``profiling.run_probe``), and the check sets those against the
    profile's: another spell re-measures nothing."""
    import dataclasses

    import ui.runner as runner
    import ui.session as session
    from dyntree_core.planning.prediction import ProfileRow

    real = runner.resolve_auto

    def probed(*a, **kw):
        got = real(*a, **kw)
        p = got.prediction or Prediction(
            label="autoregressive @ float32", method="autoregressive", s_per_token=1e-6, draft_s=0.0, target_s=1e-6,
            other_s=0.0, tokens_per_step=1.0, target_precision="float32", draft_precision=None,
            reference_label="autoregressive @ float32", reference_s_per_token=1e-6)
        return dataclasses.replace(got, prediction=dataclasses.replace(p, read_gb_per_s=31.0))

    probes = iter((55.0, 54.0))
    monkeypatch.setattr(runner, "resolve_auto", probed)
    monkeypatch.setattr(runner, "run_probe", lambda: next(probes))
    monkeypatch.setattr(session, "run_probe", lambda: next(probes))
    state = SessionState()
    controller.on_run(state, False, *_form(max_new_tokens=40))
    assert state.worker.join(120) and state.error == "", state.error
    run = state.record
    assert run.read_window == (55.0, 54.0)
    check = run.prediction_check()
    assert check.steps >= MIN_STEPS and check.off and check.other_spell and check.rows_to_remeasure() == ()
    assert "nothing is re-measured" in check.text() and run.remeasuring == ()
    assert ProfileRow("target", "float32") not in {r for _, r in controller._remeasured}


def test_a_compare_with_transformers_assisted_prices_it_in_autos_next_note(controller):
    """Compare's transformers column is kept as its ratio to the plain column beside it, and the next Run's
    ``auto`` note prices it at this machine's profile (faster or slower than the run's prediction)."""
    from dyntree_core.planning.peer_prices import load_peer_ratios

    state = SessionState()
    controller.on_run(state, False, *_form())
    assert state.worker.join(120)
    controller.planner._thread.join(300)
    assert not controller.planner.busy and not controller.planner.failed
    updates = list(controller.on_compare(state, "auto", True, *_form()))
    assert updates[-1]["cmp_status"].startswith("done"), updates[-1]["cmp_status"]
    plain, peer = state.compare[0], state.compare[-1]
    assert peer.status == "finished" and peer.precisions.startswith("target ")
    (ratio,) = load_peer_ratios("tiny,tiny", "cpu")
    assert ratio.label == f"transformers assisted @ {peer.precisions}"
    assert ratio.plain_precision == plain.config.precision
    a, b = plain.summary(), peer.summary()
    assert ratio.ratio == pytest.approx((b["seconds"] / b["tokens"]) / (a["seconds"] / a["tokens"]))
    controller.on_run(state, False, *_form())
    assert state.worker.join(120) and state.error == "", state.error
    assert f"peers: {ratio.label} priced " in state.record.note, state.record.note


@pytest.mark.parametrize("field, value, words", [
    ("seed", -1, "seed"),
    ("max_new_tokens", 0, "max new tokens"),
    ("prompt", "   ", "prompt is empty"),
    ("temperature", 11.0, "temperature"),
    ("temperature", -1.0, "temperature must be in [0, 2] (0 = greedy), got -1.0"),
    ("temperature", 5.0, "temperature must be in [0, 2] (0 = greedy), got 5.0"),
    ("top_p", 0.0, "top_p must be in (0, 1], got 0.0"),
])
def test_bad_input_is_refused_before_any_work_and_keeps_the_result(controller, field, value, words):
    state = SessionState()
    controller.on_run(state, False, *_form())
    assert state.worker.join(120)
    before = state.record
    controller.on_run(state, False, *_form(**{field: value}))
    assert words in state.error, state.error
    assert state.record is before and before.status == "finished"


LONG = " ".join(f"t{2 + i % 60}" for i in range(9000))  # 9,000 tokens of the tiny tokenizer
FIXED = dict(method="chain", precision="float32", draft_precision="float32", max_new_tokens=8)


def _wait_for(condition, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_prompt_over_the_limit_is_refused_before_any_work(controller):
    state = SessionState()
    controller.on_run(state, False, *_form(prompt=LONG, **FIXED))
    assert "prompt: 9,000 tokens, over the limit of 4,096" in state.error and "keep the end" in state.error
    assert state.record is None and state.worker is None


def test_the_prompt_line_counts_tokens_before_run(controller):
    state = SessionState()
    assert controller.prompt_info(state, "tiny", "tiny", "t1 t2 t3", False, 8, 16) == "3 tokens"
    line = controller.prompt_info(state, "tiny", "tiny", LONG, False, 8, 16)
    assert "9,000 tokens" in line and "over the limit of 4,096" in line


def test_the_long_prompt_estimate_comes_from_the_profile_or_a_long_prefill(controller, monkeypatch):
    """Before any long prefill the estimate is the stored profile's fastest target forward of its largest size
    (a short prompt's prefill is a few fixed-cost chunks: its rate said an hour for 4,096 tokens); a session's
    own prefill of >= 256 tokens takes over; with neither there is no estimate."""
    from types import SimpleNamespace

    from dyntree_core.planning.machine_profile import empty_profile, pair_name_of, profile_key, profile_path
    from ui.prompt_check import SESSION_RATE_MIN_TOKENS, prefill_rate

    state = SessionState()
    assert prefill_rate(None, "tiny", "tiny") == (None, "")
    prof = empty_profile(profile_key(pair_name_of("tiny", "tiny"), "cpu"))
    prof.ns, prof.other = [1, 32], [0.0, 0.0]
    prof.target = {"int4": [0.05, 0.8], "int8": [0.15, None]}  # int8 was dropped after its first size
    prof.save(profile_path(prof.key))
    rate, source = prefill_rate(None, "tiny", "tiny")
    assert rate == pytest.approx(40.0) and "32-token target forwards at int4" in source
    line = controller.prompt_info(state, "tiny", "tiny", LONG, False, 8, 16)
    assert "prefill ≈ 3.8 min (40 tokens/s: this machine's profile" in line  # 9,000 tokens at 40 tokens/s
    # a prefill predicted under 5 s is not worth a note (the line was "3 tokens · prefill ≈ 0 s (...)")
    assert controller.prompt_info(state, "tiny", "tiny", "t1 t2 t3", False, 8, 16) == "3 tokens"
    from ui.prompt_check import PREFILL_NOTE_MIN_S, check_prompt
    assert PREFILL_NOTE_MIN_S == 5.0
    assert check_prompt([1] * 199, 4096, 8, 16, 40.0, "r").markdown() == "199 tokens"
    assert check_prompt([1] * 200, 4096, 8, 16, 40.0, "r").markdown() == "200 tokens · prefill ≈ 5 s (r)"
    assert "prefill ≈ 0 s (r)" in check_prompt([1] * 30, 20, 8, 16, 1e6, "r").markdown()  # over the limit: always
    short = SimpleNamespace(prefill_seconds=0.5, prompt_ids=[1] * 19, settings=SimpleNamespace(draft="tiny", target="tiny"))
    assert prefill_rate(short, "tiny", "tiny")[0] == pytest.approx(40.0)  # 38 tokens/s from 19 tokens: not used
    long = SimpleNamespace(prefill_seconds=10.0, prompt_ids=[1] * 4000, settings=short.settings)
    assert SESSION_RATE_MIN_TOKENS <= 4000 and prefill_rate(long, "tiny", "tiny") == (
        400.0, "this session's last prefill: 400 tokens/s")


def _interval(timer) -> float:
    return timer["value"] if isinstance(timer, dict) else timer.value


def test_stop_during_a_long_prefill_ends_it_within_one_chunk(controller):
    """9,000 tokens kept to their last 4,096: prefilled in 512-token chunks; a Stop between two
    chunks runs no further chunk and decodes no step. From the Stop until the run has ended the page
    refreshes every ``STOPPING_INTERVAL_S`` (the stopped run shows at once), then at the streaming interval."""
    from ui.controller import STOPPING_INTERVAL_S

    state = SessionState()
    controller.on_run(state, False, *_form(prompt=LONG, long_prompt="keep the end", **FIXED))
    assert state.error == "", state.error
    rec = state.record
    assert len(rec.prompt_ids) == 4096 and "first 4,904 of 9,000 tokens were dropped" in rec.note
    _wait_for(lambda: rec.prefill[0] > 0)
    with controller.model_lock.turn("test: another session's step"):  # the worker now waits between chunks
        done = rec.prefill[0]
        assert 0 < done < rec.prefill[1]
        assert _interval(controller.on_stop(state)) == STOPPING_INTERVAL_S
        assert controller.on_wake(state) == gr.skip()  # still stopping: the fast interval stays
    assert state.worker.join(60)
    assert rec.status == "stopped" and rec.traces == []
    assert rec.prefill[0] == done  # not one more chunk
    assert _interval(controller.on_wake(state)) == 0.5  # ended: the streaming interval again


def test_a_second_session_runs_within_a_few_chunks_of_a_long_prefill(controller, monkeypatch):
    """Sessions take turns chunk by chunk: while A prefills 4,096 tokens in 64-token chunks (128
    chunks for target and draft), each time B asks for a turn (the models' load, the cost model's forward,
    two prefill items, the step) A gets at most one chunk before it, and B decodes its first step while A
    is still prefilling. (Counted in turns: how many chunks A runs while B works outside the lock depends on
    the machine's load; CI saw 9 where a quiet run sees 5-7.)"""
    import dyntree_core.decode.engine as engine

    monkeypatch.setattr(engine, "PREFILL_CHUNK", 64)
    lock, events = controller.model_lock, []
    acquire = lock.acquire

    def logged(who="", on_wait=None):
        events.append(("asks", who))
        waited = acquire(who, on_wait)
        events.append(("holds", who))
        return waited

    monkeypatch.setattr(lock, "acquire", logged)
    a, b = SessionState(), SessionState()
    controller.on_run(a, False, *_form(prompt=LONG, long_prompt="keep the end", **FIXED))
    _wait_for(lambda: a.record.prefill[0] >= 2 * 64)
    start, first = a.record.prefill[0], len(events)
    controller.on_run(b, False, *_form(prompt="t1 t2 t3", **FIXED))
    _wait_for(lambda: bool(b.record.traces) or b.record.status != "running")
    chunks = (a.record.prefill[0] - start) / 64
    assert b.record.traces, (b.record.status, b.error)
    assert a.record.prefill[0] < a.record.prefill[1]  # A was still prefilling
    log = events[first:]
    asks = [i for i, (e, who) in enumerate(log) if e == "asks" and who.startswith(b.name)]
    assert len(asks) >= 2, log
    for i in asks:  # FIFO: B waits behind at most A's turn in progress (+1 for the log's own race)
        j = next((k for k in range(i + 1, len(log)) if log[k] == ("holds", log[i][1])), None)
        if j is None:
            continue  # (a turn B asked for after its first step, not granted yet when the log was read)
        a_turns = sum(1 for e, who in log[i + 1:j] if e == "holds" and who.startswith(a.name))
        assert a_turns <= 2, (a_turns, log[i:j + 1])
    assert chunks <= 32, f"A ran {chunks:.0f} of its 128 chunks before B's first step"  # a starved B: all of them
    for s in (a, b):
        controller.on_stop(s)
        assert s.worker.join(60)


@pytest.mark.parametrize("content, words", [
    ('{"settings": {}}', "is not a DynTree run export"),
    ('["a", "b"]', "is not a DynTree run export"),
    ('{"format": "dyntree.run/1", "settings": {"draft": "tiny"}}', "damaged or from an incompatible version"),
    ('{"format": "dyntree.run/1", "settings": "x"}', "damaged or from an incompatible version"),
    ("not json at all", "is not valid JSON"),
])
def test_a_file_that_is_not_an_exported_run_says_so_without_server_paths(controller, tmp_path, content, words):
    bad = tmp_path / "upload" / "my run.json"
    bad.parent.mkdir()
    bad.write_text(content)
    state = SessionState()
    controller.on_open_run(state, str(bad))
    assert words in state.error and "my run.json" in state.error, state.error
    assert str(tmp_path) not in state.error and "Unexpected error" not in state.error


def test_export_before_any_run_is_not_an_error(controller):
    state = SessionState()
    out = controller.on_export("json")(state, 0, 16)
    assert state.error == "" and list(out.values()) == [gr.skip()]


def test_temp_paths_never_reach_the_page():
    import tempfile

    from ui.errors import describe_error

    path = f"{tempfile.gettempdir()}/gradio/0a1b2c/steptraces.json"
    assert describe_error(OSError(f"cannot open {path}: denied")) == "Unexpected error (OSError): cannot open steptraces.json: denied"


def test_every_event_of_a_tab_sees_one_session_state(controller):
    """The tab's first events arrive together (timer, load, a quick click): they must all get the
    same SessionState, created once (Gradio's own per-session store creates it without a lock)."""
    import threading
    import typing

    from ui.session import SessionRegistry

    registry = SessionRegistry()
    barrier = threading.Barrier(16)
    got = []

    def first_event():
        barrier.wait()
        got.append(registry.get("tab-1"))

    threads = [threading.Thread(target=first_event) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(s) for s in got}) == 1 and len(registry) == 1

    seen = []
    handler = controller.bound(lambda state, *inputs: seen.append((state, inputs)))
    assert typing.get_type_hints(handler)["request"] is gr.Request  # what Gradio injects the request by
    for _ in range(2):
        handler(types.SimpleNamespace(session_hash="tab-2"), 1, 2)
    handler(types.SimpleNamespace(session_hash="tab-3"))
    assert seen[0][0] is seen[1][0] is controller.sessions.get("tab-2") and seen[0][1] == (1, 2)
    assert seen[2][0] is not seen[0][0]
    controller.on_unload(types.SimpleNamespace(session_hash="tab-2"))
    assert controller.sessions.get("tab-2") is not seen[0][0]  # a reloaded tab starts afresh


def test_the_first_auto_run_starts_at_once_and_measures_in_idle_turns(controller):
    """On a fresh profile cache the first Run does not wait for auto's measurements: it decodes
    plainly at the smallest weights while they run in the background, in idle turns on the shared
    models only (held by a session, they make no progress); the next Run uses the measured plan."""
    state = SessionState()
    t0 = time.monotonic()
    controller.begin(state, settings_from_form(*_form()))
    assert time.monotonic() - t0 < 30
    rec = state.record
    assert rec.config.method == "autoregressive" and "until this machine is measured" in rec.note
    with controller.model_lock.turn("test: a session decoding"):
        assert controller.planner.busy, controller.planner.failed
        progress = controller.planner.progress
        time.sleep(2.5)  # well past the idle time: nothing measured while the models are held
        assert controller.planner.busy and controller.planner.progress == progress
        assert "measuring this machine for auto" in controller.planner.status()
    _wait_for(lambda: not controller.planner.busy, 300)
    assert not controller.planner.failed
    second = SessionState()
    controller.begin(second, settings_from_form(*_form()))
    assert "until this machine is measured" not in second.record.note and second.record.note.startswith("auto:")
    assert not controller.planner.busy  # nothing left to measure
    # another temperature: the profile stands, the acceptance at T=0.6 is what is measured now
    warm = SessionState()
    controller.begin(warm, settings_from_form(*_form(temperature=0.6)))
    note = warm.record.note
    assert "until the pair's acceptance at T=0.6 is measured" in note and "until this machine" not in note, note
    fastest = controller.provider.auto_plan(settings_from_form(*_form())).best.target_precision
    assert warm.record.config.method == "autoregressive" and warm.record.config.precision == fastest
    assert f"plain decoding at {fastest} (the fastest this machine's profile measured)" in note
    _wait_for(lambda: not controller.planner.busy, 300)


def test_the_background_measurement_stops_when_the_app_closes(controller):
    state = SessionState()
    controller.begin(state, settings_from_form(*_form()))
    with controller.model_lock.turn("test: a session decoding"):
        assert controller.planner.busy
        assert controller.planner.close(30)  # stops while waiting for an idle turn
    assert not controller.planner.busy


def test_pause_during_a_long_prefill_holds_between_chunks_and_resume_goes_on(controller):
    state = SessionState()
    controller.on_run(state, False, *_form(prompt=LONG, long_prompt="keep the end", **FIXED))
    rec = state.record
    _wait_for(lambda: rec.prefill[0] > 0)
    with controller.model_lock.turn("test: another session's step"):
        controller.on_pause(state)
        done = rec.prefill[0]
    assert state.worker.join(60)
    assert rec.status == "paused" and rec.prefill[0] == done < rec.prefill[1] and not rec.traces
    controller.on_pause(state)  # Resume: the same prefill goes on, then the steps
    assert state.worker.join(120)
    assert rec.status == "finished" and rec.prefill[0] == rec.prefill[1] and len(rec.token_ids) == 8


def test_releasing_a_pair_closes_what_preparing_it_acquired_and_its_runs_stop_cleanly():
    """The provider closes a pair's preparation (an offloaded target's pinned memory) when it drops
    the pair; a run still holding it is refused at its next step with a plain message, its steps kept."""
    from dyntree_core.decode.prepared import PreparedPair
    from ui.errors import describe_error
    from ui.models import HubModelProvider, LoadedPair
    from ui.pair_spec import PairSpec
    from ui.runner import start_generation
    from ui.settings import settings_from_form

    tiny = TinyModelProvider()
    gen = start_generation(tiny, settings_from_form(*_form(**FIXED)))
    assert gen.next_step() is not None
    loaded = tiny.load(gen.record.settings.pair_spec())
    prepared = loaded.target.__dict__  # the PreparedPair is attached to its models
    assert any(isinstance(v, PreparedPair) for v in prepared.values())
    hub = HubModelProvider()
    hub._pair = LoadedPair(loaded.draft, loaded.target, loaded.tokenizer, PairSpec("tiny", "tiny"))
    hub._release()
    assert hub._pair is None and not any(isinstance(v, PreparedPair) for v in prepared.values())
    with pytest.raises(Exception) as err:
        gen.next_step()
    assert "models were released" in describe_error(err.value) and len(gen.record.traces) == 1


def test_a_refresh_never_shows_finished_above_a_text_missing_steps(controller):
    """The worker thread appends a run's last step and then marks it finished; a refresh drawing
    the page between those reads must not say 'finished' over the text without that step (seen in
    the browser test: 'finished' with 7 of 8 tokens shown)."""
    state = SessionState()
    controller.on_run(state, False, *_form(method="chain", precision="float32", draft_precision="float32",
                                           max_new_tokens=8))
    assert state.worker is not None and state.worker.join(120)
    rec = state.record
    assert rec.status == "finished" and len(rec.token_ids) == 8
    last = rec.traces.pop()
    rec.status = "running"
    missing = len(last.committed)

    class WorkerRunsNow(list):
        """The first read of the steps sees them as they are, then the worker finishes the run."""

        fired = False

        def __iter__(self):
            it = iter(list(super().__iter__()))
            if not self.fired:
                self.fired = True
                super().append(last)
                rec.status = "finished"
            return it

    rec.traces = WorkerRunsNow(rec.traces)
    _name_live_components(controller)
    first = controller.live(state, 16)
    shown = first["text_html"].count('class="dt-tok ')
    assert ("finished" in first["status"]) == (shown == 8), (first["status"], shown)
    assert shown == 8 - missing  # this refresh drew the run as it was when it began
    second = controller.live(state, 16)  # the next refresh: everything
    assert "finished" in second["status"] and second["text_html"].count('class="dt-tok ') == 8


def _streaming_chain_run(controller) -> SessionState:
    """A session whose 8-token chain run has finished but reads as streaming (its worker alive), the controller's
    Live components named."""
    state = SessionState()
    controller.on_run(state, False, *_form(method="chain", precision="float32", draft_precision="float32",
                                           max_new_tokens=8))
    assert state.worker is not None and state.worker.join(120)
    state.record.status = "running"
    state.worker = types.SimpleNamespace(alive=True, pause_requested=False)
    _name_live_components(controller)
    return state


def test_a_streaming_refresh_without_figures_still_sends_the_cost_panel(controller):
    """Figures are redrawn seldom while a run streams (``ui.figure_pacing``), but the cost panel is sent with every
    refresh, as the status line is: both show the run's measured ms/token, and must not disagree for 30 s."""
    state = _streaming_chain_run(controller)
    controller.live(state, 16)  # (the run's first refresh dims the previous figures: ``figures_due``)
    second = controller.live(state, 16)
    assert second["tree_plot"] == gr.skip()  # no figure this time
    assert isinstance(second["cost_model"], str) and "ms/token" in second["cost_model"]


def test_a_new_run_dims_the_previous_figures_until_its_first_redraw_is_due(controller):
    """A streaming run's figures are first drawn a pacing interval after it began (a redraw at its first refresh
    cost the default Run ~10% in Chromium): its first refresh sends no figure, only a walkthrough note whose style
    dims the previous run's figures and labels each (seven blank figures drawn there stalled the run's first
    forward ~200 ms in Chromium), the next refreshes send none, and the figures are drawn once the interval has
    passed, or at once when the run stops streaming or the user picks a step."""
    from ui.figure_pacing import FIGURE_INTERVAL_S
    from ui.views import FIGURE_IDS

    state = _streaming_chain_run(controller)
    first = controller.live(state, 16)
    assert all(first[k] == gr.skip() for k in ("tree_plot", "mask_bfs", "mask_dfs", "mask_hpd", "phase_plot",
                                                "speed_plot", "steps_plot"))
    note = first["walkthrough"]
    assert f"drawn {FIGURE_INTERVAL_S:.0f} s into the run and when it ends" in note
    style = note[note.index("<style>"):note.index("</style>")]
    assert all(f"#{i} > *" in style and f"#{i}::after" in style for i in FIGURE_IDS) and "opacity:0.25" in style
    second = controller.live(state, 16)
    assert all(second[k] == gr.skip() for k in ("tree_plot", "mask_bfs", "speed_plot", "steps_plot", "walkthrough"))
    assert "ms/token" in second["cost_model"]  # (the text, status and cost panel: every refresh)
    state.run_started_at -= FIGURE_INTERVAL_S
    third = controller.live(state, 16)
    assert third["tree_plot"].layout.title.text.startswith(f"step {len(state.record.traces) - 1} ")
    assert controller.live(state, 16)["tree_plot"] == gr.skip()  # then paced as before (``FigurePacing``)

    # a run that stops streaming before the interval is drawn at its next refresh, with no blank step between
    state.worker = None
    controller.on_run(state, False, *_form(method="chain", precision="float32", draft_precision="float32",
                                           max_new_tokens=8))
    assert state.worker.join(120) and state.record.status == "finished"
    drawn = controller.live(state, 16)
    assert drawn["tree_plot"].layout.title.text.startswith("step ") and not state.figures_stale


def test_the_step_slider_takes_whatever_its_box_sends():
    """The slider's input event arrives unprocessed (a box being typed in may be empty or past the
    last step): a step picks that step, past the last one follows the run, below 0 is step 0, an
    empty box changes nothing."""
    ctl = Controller(TinyModelProvider(), types.SimpleNamespace(), [], stream_interval_s=0.5)
    state = SessionState()
    state.record = types.SimpleNamespace(traces=[object()] * 5)
    for value, view in ((2, 2), (3.0, 3), (None, 3), (99, None), (-4, 0), (4, None), (0, 0)):
        version = state.version
        ctl.on_select_step(state, value)
        assert state.view_step == view, (value, state.view_step)
        assert state.version == version + (value is not None), value
    ctl.planner.close(10)


def test_the_status_names_the_tree_auto_chose_and_why_the_budget_field_is_not_it():
    """auto chose Sequoia with n=4, d=2 while the Budget field says 32: the run's note says which
    tree the run uses (the drafter's own DP tree: 3 nodes, the acceptance vector has nothing past
    the first child) and that the Budget and Depth fields are not what auto sizes by."""
    from dyntree_core.planning.auto import AutoPlan
    from dyntree_core.planning.pricing import Candidate
    from ui.runner import resolve_auto, tree_note

    def cand(method, n, d, size=None):
        return Candidate(method=method, target_precision="int4", draft_precision=None if n == 1 else "int4",
                         budget=n, depth=d, expected_tokens=1.6, target_seconds=0.05, verify_seconds=0.001,
                         draft_seconds=0.01, tree_size=size)

    reason = "auto: sequoia (n=4, d=2) @ target int4, draft int4: predicted 40 ms/token"
    plan = AutoPlan(cand("sequoia", 4, 2, 3), cand("autoregressive", 1, 0), (0.6, 0.0, 0.0), 0.0, "key", {}, reason)
    provider = types.SimpleNamespace(auto_plan=lambda settings, planner=None, read_gb_per_s=None: plan)
    form = settings_from_form(*_form(budget=32, depth=6))
    got = resolve_auto(provider, form)
    resolved, note = got.settings, got.note
    assert (resolved.method, resolved.budget, resolved.depth) == ("sequoia", 4, 2) and note == reason
    # the run auto priced carries its prediction, against the plan's plain decoding (no profile reference here)
    assert got.prediction is not None and got.prediction.method == "sequoia"
    assert got.prediction.reference_label == "autoregressive @ int4"
    line = tree_note(form, resolved.decode_config())
    assert line.startswith("the run's tree: 3 nodes, 2 levels below the root: Sequoia's DP picks the best tree of "
                           "at most 4 nodes and 2 levels for the measured acceptance vector (0.60, 0.00, 0.00)"), line
    assert "more nodes add no expected tokens under it" in line
    assert "not the Budget and Depth fields (32, 6)" in line
    # a method chosen by hand whose DP tree is the budget: nothing to say
    by_hand = settings_from_form(*_form(method="sequoia", precision="float32", draft_precision="float32",
                                        budget=16, depth=4))
    assert tree_note(by_hand, by_hand.decode_config()) == ""


def test_a_streaming_run_redraws_its_figures_at_most_every_interval(monkeypatch):
    """While a run streams, each refresh sends its text and status but its eight figures only every
    ``FigurePacing.interval_s`` (with the cost panel; the browser redrawing them every tick halved decoding speed on 2
    cores), or at once when the user picks another step, decision or block size; a run that is not streaming is
    drawn in full."""
    from ui import controller as ctl_mod

    state = SessionState()
    rec = types.SimpleNamespace(status="running", traces=[])
    state.worker = types.SimpleNamespace(alive=True)
    assert ctl_mod.figures_due(state, rec, (None, None, 64))
    assert not ctl_mod.figures_due(state, rec, (None, None, 64))  # the next tick: text and status only
    assert ctl_mod.figures_due(state, rec, (3, None, 64))  # the user picked step 3
    assert not ctl_mod.figures_due(state, rec, (3, None, 64))
    state.figures_at -= state.figure_pacing.interval_s
    assert ctl_mod.figures_due(state, rec, (3, None, 64))  # the interval passed
    rec.status = "finished"
    assert ctl_mod.figures_due(state, rec, (3, None, 64)) and ctl_mod.figures_due(state, rec, (3, None, 64))
    rec.status, state.worker = "running", None  # paused between steps (no worker): drawn in full
    assert ctl_mod.figures_due(state, rec, (3, None, 64))


def test_redraws_that_slow_the_steps_after_them_are_spaced_out_and_the_status_says_so(controller):
    """A streaming run's redraw is followed by steps 0.1 s slower than its median for 2 s: the next redraw waits
    until such redraws cost at most 5% of decoding (here 0.4 s / 0.05 = 8 s), and the status line says so."""
    from ui import controller as ctl_mod
    from ui.figure_pacing import FIGURE_INTERVAL_S

    state = SessionState()
    traces: list = []
    rec = types.SimpleNamespace(status="running", traces=traces)
    state.worker = types.SimpleNamespace(alive=True, pause_requested=False)

    def steps(n, seconds):
        for _ in range(n):
            end = (traces[-1].elapsed if traces else 0.0) + seconds
            traces.append(types.SimpleNamespace(elapsed=end, step_seconds=seconds))

    steps(20, 0.05)  # 1 s of steps at 50 ms
    assert ctl_mod.figures_due(state, rec, (None, None, 64))  # a redraw goes out at 1.0 s
    steps(4, 0.15)  # the 4 steps after it take 0.1 s more each
    steps(40, 0.05)  # then 2 s at the median again
    state.figures_at -= FIGURE_INTERVAL_S
    assert not ctl_mod.figures_due(state, rec, (None, None, 64))  # its cost read: the interval is now longer
    assert state.figure_pacing.cost_s == pytest.approx(0.4)
    assert state.figure_pacing.interval_s == pytest.approx(8.0)
    state.figures_at -= 8.0
    assert ctl_mod.figures_due(state, rec, (None, None, 64))
    assert "figures redrawn every 8 s while it runs: each redraw cost decoding 0.40 s" in \
        controller.status_line(state, "running")
    rec.status = "finished"
    assert ctl_mod.figures_due(state, rec, (None, None, 64)) and state.figure_pacing.probe_at is None


def test_loading_another_precision_names_it_while_it_loads(controller, monkeypatch):
    """Issue 41: switching precision reloaded the models for 21 s with no message: the notice shown while a pair
    that is not loaded yet loads names both precisions."""
    from ui import controller as ctl_mod

    seen = []
    real = ctl_mod.start_generation

    def spy(provider, settings, **kw):
        seen.append(state.notice)
        return real(provider, settings, **kw)

    monkeypatch.setattr(ctl_mod, "start_generation", spy)
    state = SessionState()
    controller.begin(state, settings_from_form(*_form(method="chain", precision="float32", draft_precision="bfloat16")))
    assert seen[0].startswith("Loading models tiny / tiny at target float32, draft bfloat16 …"), seen
    assert state.notice == ""  # gone once loaded


def test_a_new_loads_notice_does_not_show_the_last_loads_line(controller, monkeypatch):
    """The progress line of a load that ended ("the target: 250/339 tensors (2.6s)") showed again under the next
    Run's notice until that load said something: a Run clears it."""
    from ui import controller as ctl_mod

    shown = []
    real = ctl_mod.start_generation

    def spy(provider, settings, **kw):
        shown.append(controller.status_line(state, "idle"))
        return real(provider, settings, **kw)

    monkeypatch.setattr(ctl_mod, "start_generation", spy)
    controller.provider.progress = "the target: 250/339 tensors (2.6s)"
    state = SessionState()
    controller.begin(state, settings_from_form(*_form(method="chain", precision="float32", draft_precision="bfloat16")))
    assert len(shown) == 1 and shown[0].startswith("Loading models tiny / tiny") and "250/339" not in shown[0], shown


def test_the_notice_while_models_load_shows_the_loads_latest_line(controller):
    """A pair's first Run without the set-up's ``prepare`` measures its kernels and packs its weights (23 s on a
    2-core VM):
    the status line shows the provider's latest progress line under the notice, and only while there is one."""
    state = SessionState()
    state.notice = "auto: choosing the configuration for this machine (embedded / embedded) and loading the models …"
    assert controller.status_line(state, "idle") == state.notice
    controller.provider.progress = "the target: measuring this machine's kernels for Q6_K [151936, 1536] (7/7, once)"
    assert controller.status_line(state, "idle") == f"{state.notice}  \n_{controller.provider.progress}_"
    state.notice = ""
    assert controller.status_line(state, "idle") == "idle"
    # each new line is drawn at the next refresh, though nothing else changed (the load bumps no version)
    _name_live_components(controller, "timer")
    state.notice = "loading the models …"
    assert "status" in controller.on_tick(state, 16)
    assert "status" not in controller.on_tick(state, 16)  # (nothing new)
    controller.provider.progress = "the draft: building int4 weights (once)"
    drawn = controller.on_tick(state, 16)
    assert drawn["status"] == "loading the models …  \n_the draft: building int4 weights (once)_"


def test_the_app_log_times_a_runs_load_and_first_step_from_its_click(controller, monkeypatch, caplog):
    """A slow first Run says where its time went: the app log has the click, each line the load reported (as the
    status line shows it), the models ready (with what planning and loading spent: ``system_counters``) and the first
    step, each timed from the click, in that order."""
    import logging

    provider = controller.provider
    real_load = provider.load

    def load(spec):
        listener = provider.progress_listener
        assert listener is not None and listener.__self__ is state.run_clock  # this Run's clock hears the load's lines
        listener("the target: building int4 weights from t.gguf (once)")
        listener("the target: building int4 weights from t.gguf (once)")  # a repeated line is logged once
        return real_load(spec)

    state = SessionState()
    monkeypatch.setattr(provider, "load", load)
    caplog.set_level(logging.INFO, logger="dyntree.app")
    controller.on_run(state, False, *_form())
    assert state.worker is not None and state.worker.join(120)
    lines = [r.getMessage() for r in caplog.records
             if r.name == "dyntree.app" and r.getMessage().startswith(state.name)]
    want = ["Run clicked", "s after the click: the target: building int4 weights", "s after the click: models ready: ",
            "first step ("]
    assert len(lines) == len(want), lines
    for line, words in zip(lines, want):
        assert words in line, lines
    assert "(planning and loading: " in lines[2] and "process CPU " in lines[2], lines[2]  # what the load spent
    assert state.run_clock.first_step_s is not None and state.run_clock.first_step_s <= state.run_clock.seconds()
    assert provider.progress_listener is None  # the load's listener goes with the load


def test_the_hub_provider_tells_its_listener_each_load_line():
    from ui.models import HubModelProvider

    provider = HubModelProvider("embedded", "embedded")
    heard: list[str] = []
    provider.progress_listener = heard.append
    provider._say("  the draft: measuring this machine's kernels (1/7)  ")
    assert provider.progress == "the draft: measuring this machine's kernels (1/7)"
    assert heard == ["  the draft: measuring this machine's kernels (1/7)  "]


def test_close_stops_and_waits_for_every_run_and_the_background_measurement(controller, monkeypatch):
    """The app's shutdown (``ui.app.shut_down`` after Ctrl-C ends ``launch``): a thread left inside torch while the
    interpreter exits aborted the app ("terminate called without an active exception", exit status -6, seen with
    auto's background measurement under way). ``close`` stops each tab's run and the measurement and joins them."""
    import ui.worker

    real = ui.worker.advance_in_turn

    def slow(*a, **k):  # (a tiny step takes milliseconds: 100 ms more after each, outside its turn on the models)
        item = real(*a, **k)
        time.sleep(0.1)
        return item

    monkeypatch.setattr(ui.worker, "advance_in_turn", slow)
    states = [SessionState(), SessionState()]
    for i, state in enumerate(states):
        controller.sessions._sessions[f"tab{i}"] = state
        controller.on_run(state, False, *_form(max_new_tokens=2048, method="autoregressive"))
    workers = [s.worker for s in states]
    assert all(w is not None and w.alive for w in workers)  # (still decoding)
    assert controller.close(60)
    assert not any(w.alive for w in workers)  # stopped and joined, not only told to stop
    assert all(s.generation.record.status != "running" for s in states)
    assert controller.planner._thread is None or not controller.planner._thread.is_alive()
    assert len(controller.sessions) == 0


def test_the_app_closes_its_controller_then_the_app_on_ctrl_c(monkeypatch):
    """``app.main`` serves until Ctrl-C (``ui.app.serve``), then stops the runs (``shut_down``: the controller's
    ``close``) and only then closes the app with its event streams (``Blocks.close``). Gradio's own wait closed only
    the server, which the page's open streams held 5 s, before the runs were told to stop."""
    import app
    import ui

    done: list[str] = []

    class FakeBlocks:
        def launch(self, prevent_thread_lock=False, **_kw):
            done.append(f"launch {prevent_thread_lock}")

        @property
        def is_running(self):
            raise KeyboardInterrupt  # (Ctrl-C in the wait)

        def close(self):
            done.append("closed the app")

    def build(_provider, _defaults):
        demo = FakeBlocks()
        demo.dyntree_close = lambda: done.append("stopped the runs") or True
        return demo

    monkeypatch.setattr(ui, "build_app", build)
    # (main's process-wide settings stay out of the other tests: the thread count keys the kernel table)
    monkeypatch.setattr("ui.switch_interval.favour_decoding", lambda: None)
    monkeypatch.setattr("ui.app_log.configure", lambda: None)
    monkeypatch.setattr("torch.set_num_threads", lambda _n: None)
    assert app.main(["--tiny", "--port", "1"]) == 0
    assert done == ["launch True", "stopped the runs", "closed the app"]


def _slow_load(provider, monkeypatch, seconds: float = 30.0) -> dict:
    """``provider.load`` that takes ``seconds`` in 20 ms pieces, each ending in a load's stop point
    (``interrupt.check_load``, as ``load_progress`` does between tensors), then loads; ``started`` is set as it
    begins, ``ended`` holds how it ended."""
    import threading

    from dyntree_core import interrupt

    real = provider.load
    seen: dict = {"started": threading.Event()}

    def load(spec):
        seen["started"].set()
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < seconds:
                time.sleep(0.02)
                interrupt.check_load()
        except interrupt.LoadStopped:
            seen["ended"] = ("stopped", time.monotonic())
            raise
        seen["ended"] = ("loaded", time.monotonic())
        return real(spec)

    monkeypatch.setattr(provider, "load", load)
    return seen


def _run_in_thread(controller, state, **form):
    import threading

    th = threading.Thread(target=controller.on_run, args=(state, False, *_form(**form)), daemon=True)
    th.start()
    return th


def test_stop_while_a_run_loads_its_models_ends_the_load_and_nothing_runs(controller, monkeypatch):
    """A Stop clicked while the Run's models loaded did nothing: the load went on (4 s for the real pair from the page
    cache, 40 s once from the disk) and the run then decoded to its end. Now the load ends at its next tensor, the
    session keeps its previous run, and the status says nothing ran; the next Run loads and runs."""
    _name_live_components(controller, "timer")
    real_load = controller.provider.load
    seen = _slow_load(controller.provider, monkeypatch)
    state = SessionState()
    th = _run_in_thread(controller, state, method="autoregressive")
    assert seen["started"].wait(30)
    assert "stopping" not in controller.status_line(state, "idle")
    controller.on_stop(state)
    stopped_at = time.monotonic()
    assert "stopping the load …" in controller.status_line(state, "idle") or not state.notice
    th.join(30)
    assert not th.is_alive()
    how, when = seen["ended"]
    assert how == "stopped" and when - stopped_at < 1.0
    assert state.worker is None and state.generation is None and state.load_stop is None
    assert state.load_stopped.startswith("Stopped while loading the models (")
    assert controller.on_tick(state, 16)["status"].startswith("Stopped while loading the models (")
    monkeypatch.setattr(controller.provider, "load", real_load)
    controller.on_run(state, False, *_form(method="autoregressive"))  # the next Run loads and runs
    assert state.load_stopped == "" and state.worker is not None and state.worker.join(120)
    assert state.record.status == "finished"


def test_a_tab_closed_while_its_run_loads_starts_no_run(controller, monkeypatch):
    """A reload during a Run's load: the closed tab's load went on and its run then decoded all its tokens in the
    background for a session no page showed, beside the reloaded tab's runs. Now the load ends and nothing starts."""
    seen = _slow_load(controller.provider, monkeypatch)
    state = controller.sessions.get("tab")
    th = _run_in_thread(controller, state, method="autoregressive", max_new_tokens=2048)
    assert seen["started"].wait(30)
    controller.sessions.close("tab")
    th.join(30)
    assert not th.is_alive() and seen["ended"][0] == "stopped"
    assert state.worker is None and state.generation is None


def test_a_load_that_ends_as_its_tab_closes_starts_no_run(controller, monkeypatch):
    """The tab closed after the load's last stop point but before the run started: its generation is stopped."""
    seen = _slow_load(controller.provider, monkeypatch, seconds=0.0)
    state = controller.sessions.get("tab")
    real = controller.provider.load

    def then_close(spec):
        out = real(spec)
        controller.sessions.close("tab")  # (between the load's end and the run's start)
        return out

    monkeypatch.setattr(controller.provider, "load", then_close)
    controller.on_run(state, False, *_form(method="autoregressive", max_new_tokens=2048))
    assert seen["ended"][0] == "loaded"
    assert state.worker is None and state.load_stopped.startswith("Stopped while loading")
    assert state.generation is not None and state.generation.done


def test_close_during_a_runs_load_ends_it_at_once(controller, monkeypatch):
    """Ctrl-C during a Run's load: ``close`` waited for the whole load in its last turn on the models."""
    seen = _slow_load(controller.provider, monkeypatch)
    state = controller.sessions.get("tab")
    th = _run_in_thread(controller, state, method="autoregressive")
    assert seen["started"].wait(30)
    t0 = time.monotonic()
    assert controller.close(60)
    assert time.monotonic() - t0 < 2.0 and seen["ended"][0] == "stopped"
    th.join(30)
    assert not th.is_alive() and state.worker is None


def test_stop_during_a_compare_load_ends_it(controller, monkeypatch):
    """Compare's Stop while a column's models load: the load ends, and the tab says stopped."""
    seen = _slow_load(controller.provider, monkeypatch)
    state = SessionState()
    updates: list = []
    import threading

    def compare():
        for u in controller.on_compare(state, "dyspec_greedy", False, *_form()):
            updates.append(u)

    th = threading.Thread(target=compare, daemon=True)
    th.start()
    assert seen["started"].wait(30)
    controller.on_compare_stop(state)
    th.join(30)
    assert not th.is_alive() and seen["ended"][0] == "stopped"
    assert updates[-1][controller.c.cmp_status] == "stopped"


def test_closing_the_planner_ends_a_model_load_inside_its_turn():
    """``auto``'s background measurement loads its models in one idle turn; Ctrl-C (``BackgroundPlanner.close``)
    waited for that whole load. Now the load ends at its next tensor, and the measurement is not counted as failed."""
    import threading

    from dyntree_core import interrupt
    from ui.model_lock import ModelLock
    from ui.planner import BackgroundPlanner

    planner = BackgroundPlanner(ModelLock(), idle_s=0.0)
    loading = threading.Event()

    def measure(turn, note):
        with turn():
            loading.set()
            t0 = time.monotonic()
            while time.monotonic() - t0 < 30:  # (a load: a stop point after each tensor)
                time.sleep(0.02)
                interrupt.check_load()
        return object()

    assert planner.start("key", measure)
    assert loading.wait(10)
    t0 = time.monotonic()
    assert planner.close(60)
    assert time.monotonic() - t0 < 1.0 and "key" not in planner.failed


def test_pause_while_a_run_loads_starts_it_paused_and_resume_runs_it(controller, monkeypatch):
    """Pause clicked while the Run's models loaded was ignored: the run then streamed. Now the button reads Resume at
    once, the status says the run starts paused, the loaded run waits at its first step, and Resume runs it; a
    second Pause during the load takes the first back."""
    from ui.controller import PAUSED_AFTER_LOAD

    _name_live_components(controller, "timer")
    seen = _slow_load(controller.provider, monkeypatch, seconds=1.0)
    state = SessionState()
    th = _run_in_thread(controller, state, method="autoregressive")
    assert seen["started"].wait(30)
    controller.on_pause(state)
    assert PAUSED_AFTER_LOAD in controller.status_line(state, "idle")
    assert controller.on_tick(state, 16)["pause_btn"].value == "Resume"
    th.join(30)
    assert not th.is_alive() and seen["ended"][0] == "loaded"
    assert state.worker is None and state.record.status == "paused" and state.active and not state.pause_after_load
    assert "· paused · no step yet" in controller.on_tick(state, 16)["status"]
    controller.on_pause(state)  # Resume
    assert state.worker is not None and state.worker.join(120) and state.record.status == "finished"

    # Pause, then Pause again, during the load: it runs as if never paused
    seen = _slow_load(controller.provider, monkeypatch, seconds=1.0)
    th = _run_in_thread(controller, state, method="autoregressive")
    assert seen["started"].wait(30)
    controller.on_pause(state)
    controller.on_pause(state)
    assert PAUSED_AFTER_LOAD not in controller.status_line(state, "idle")
    th.join(30)
    assert state.worker is not None and state.worker.join(120) and state.record.status == "finished"


def test_pause_while_a_steps_models_load_leaves_nothing_behind(controller, monkeypatch):
    """Step loads the models as Run does; a Pause clicked meanwhile is spent by that load (the step leaves the run
    paused anyway): Resume then runs it, and the button does not keep reading Resume while it runs."""
    import threading

    _name_live_components(controller, "timer")
    seen = _slow_load(controller.provider, monkeypatch, seconds=1.0)
    state = SessionState()
    th = threading.Thread(target=controller.on_step, args=(state, *_form(method="autoregressive",
                                                                           max_new_tokens=2048)), daemon=True)
    th.start()
    assert seen["started"].wait(30)
    controller.on_pause(state)
    th.join(60)
    assert state.record.status == "paused" and not state.pause_after_load
    assert controller.on_tick(state, 16)["pause_btn"].value == "Resume"
    controller.on_pause(state)  # Resume
    assert state.running
    assert controller.on_tick(state, 16)["pause_btn"].value == "Pause"
    controller.on_stop(state)
    assert state.worker.join(60)
