"""An exported run (JSON) reloads into a ``RunRecord`` whose every figure equals the original's: the
step traces round-trip through ``StepTrace.to_dict`` / ``from_dict``."""

from __future__ import annotations

import json
import math
import types

import gradio as gr
import pytest

from dyntree_core.trace import StepTrace
from test_ui_figures import _settings
from ui.export import RunFileError, read_json, write_json
from ui.runner import run_to_end
from ui.tiny import TinyModelProvider
from ui.views import export_figures, run_view, step_view


@pytest.fixture(scope="module")
def runs():
    provider = TinyModelProvider()
    return [run_to_end(provider, _settings(temperature=0.8, method="dyspec_greedy", budget=40, depth=5)),
            run_to_end(provider, _settings(method="sequoia", budget=16, depth=4)),
            run_to_end(provider, _settings(method="autoregressive"))]


def _same(a, b) -> bool:
    """Equal JSON, with NaN equal to NaN."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _fig(fig) -> dict:
    return json.loads(fig.to_json())


def test_step_traces_round_trip(runs):
    for run in runs:
        for t in run.traces:
            d = json.loads(json.dumps(t.to_dict()))
            assert _same(StepTrace.from_dict(d).to_dict(), d)


def test_an_exported_run_reloads_and_redraws_every_figure(runs, tmp_path):
    for i, run in enumerate(runs):
        back = read_json(write_json(run, tmp_path / f"run{i}.json"))
        assert back.settings == run.settings and back.config == run.config
        assert back.prompt_ids == run.prompt_ids and back.token_ids == run.token_ids
        assert back.summary()["tokens"] == run.summary()["tokens"]
        a, b = run_view(run, None), run_view(back, None)
        assert a.text_html == b.text_html and a.status == b.status and a.cost == b.cost
        assert back.prefill_seconds == run.prefill_seconds and back.model_params == run.model_params
        assert _same(_fig(a.speed), _fig(b.speed)) and _same(_fig(a.per_step), _fig(b.per_step))
        for step in range(len(run.traces)):
            for block in (16, 32):
                sa, sb = step_view(run, step, block), step_view(back, step, block)
                assert _same(_fig(sa.tree), _fig(sb.tree)), (i, step)
                assert all(_same(_fig(x), _fig(y)) for x, y in zip(sa.masks, sb.masks))
                assert _same(_fig(sa.phases), _fig(sb.phases))
                walk = len(run.traces[step].decisions) // 2
                assert step_view(run, step, block, walk).walkthrough == step_view(back, step, block, walk).walkthrough
        fa, fb = export_figures(run, 0, 16), export_figures(back, 0, 16)
        assert fa.keys() == fb.keys() and all(_same(_fig(fa[k]), _fig(fb[k])) for k in fa)


def test_a_file_that_is_not_a_run_export_is_refused(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(RunFileError, match="not a DynTree run export"):
        read_json(bad)
    with pytest.raises(RunFileError, match="missing.json could not be read"):
        read_json(tmp_path / "missing.json")


def test_the_app_opens_an_exported_run_without_models(runs, tmp_path):
    """The Live tab's "Open an exported run" handler puts the reloaded run in the session and the
    next refresh tick draws it: the tree of its last step, its text and status, with no model
    provider call."""
    from ui.app import build_app

    class NoModels:
        default_draft = default_target = "tiny"

        def load(self, spec):  # pragma: no cover - the assertion is that this never runs
            raise AssertionError("opening an exported run loaded a model")

        def is_loaded(self, spec):
            return False

        def loaded_description(self):
            return ""

    demo = build_app(NoModels())
    fns = demo.fns.values() if isinstance(demo.fns, dict) else demo.fns
    on_open = next(f.fn for f in fns if getattr(f, "name", None) == "on_open_run")
    on_tick = next(f.fn for f in fns if getattr(f, "name", None) == "on_tick")
    run = runs[0]
    path = write_json(run, tmp_path / "run.json")
    tab = types.SimpleNamespace(session_hash="tab")  # what Gradio passes as the request
    by_id = {getattr(b, "elem_id", None): b for b in demo.blocks.values()}
    on_tick(tab, 16)  # the first tick shows the footer's memory line
    assert on_open(tab, str(path)) is None  # the Live tab's components are the tick's alone
    out = on_tick(tab, 16)
    expected = step_view(run, len(run.traces) - 1, 16)
    assert _same(_fig(out[by_id["tree-plot"]]), _fig(expected.tree))  # the tree of the last step
    assert out[by_id["colored-text"]] == run_view(run, None).text_html
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    on_open(tab, str(bad))
    out = on_tick(tab, 16)
    error = str(out[by_id["error-box"]])
    assert "Cannot open the run" in error and "not a DynTree run export" in error  # the inline error box
    assert out[by_id["colored-text"]] == run_view(run, None).text_html  # the open run stays
    assert list(on_tick(tab, 16).values()) == [gr.skip()]  # nothing changed: nothing redrawn


def test_the_cost_panels_reference_and_waits_survive_the_export(runs, tmp_path):
    """A reloaded run's cost panel says when and under what load its reference was timed, as the
    live one did."""
    from dataclasses import replace

    from dyntree_core.planning.forward_timer import ForwardTiming

    run = replace(runs[0], ar_timing=ForwardTiming(0.05, 0.06, 1, 140, 3, "2026-11-26 05:00:00", 1.5, 2),
                  one_token_forward_s=0.06, wait_seconds=2.5)
    back = read_json(write_json(run, tmp_path / "run.json"))
    assert back.ar_timing == run.ar_timing and back.wait_seconds == 2.5
    assert run_view(back, None).cost == run_view(run, None).cost and "2026-11-26 05:00:00" in run_view(back, None).cost


def test_an_idle_page_refreshes_slowly_and_an_event_brings_the_streaming_interval_back(runs, tmp_path):
    """Each refresh is a round trip that costs the browser and the server CPU: after IDLE_TICKS unchanged
    refreshes without a run the timer's interval becomes IDLE_INTERVAL_S; a page event (opening a run here)
    sets the streaming interval again at once, and a refresh with something to draw keeps it."""
    from ui.app import STREAM_INTERVAL_S, build_app
    from ui.controller import IDLE_INTERVAL_S, IDLE_TICKS

    class NoModels:
        default_draft = default_target = "tiny"

        def load(self, spec):  # pragma: no cover
            raise AssertionError("no model is needed")

        def is_loaded(self, spec):
            return False

        def loaded_description(self):
            return ""

    demo = build_app(NoModels())
    fns = list(demo.fns.values() if isinstance(demo.fns, dict) else demo.fns)
    fn = lambda name: next(f.fn for f in fns if getattr(f, "name", None) == name)  # noqa: E731
    on_tick, on_wake, on_open = fn("on_tick"), fn("on_wake"), fn("on_open_run")
    timer = next(b for b in demo.blocks.values() if isinstance(b, gr.Timer))
    tab = types.SimpleNamespace(session_hash="idle-tab")
    intervals = []
    for _ in range(IDLE_TICKS + 3):
        out = on_tick(tab, 16)
        if timer in out:
            intervals.append(out[timer]["value"] if isinstance(out[timer], dict) else out[timer].value)
    assert intervals == [IDLE_INTERVAL_S]  # slowed once, after IDLE_TICKS unchanged refreshes
    assert on_open(tab, str(write_json(runs[0], tmp_path / "run.json"))) is None
    woke = on_wake(tab)
    assert (woke["value"] if isinstance(woke, dict) else woke.value) == STREAM_INTERVAL_S
    assert on_wake(tab) == gr.skip()  # already fast: nothing to send
    out = on_tick(tab, 16)  # the opened run is drawn; the interval stays
    assert timer not in out and len(out) > 2


def test_the_queue_does_not_poll_every_millisecond():
    """Gradio's queue loops poll every 1 ms on Linux while idle (8.8% of a core here); the app sets Gradio's own
    Windows values."""
    from ui.app import QUEUE_IDLE_SLEEP_S, QUEUE_PROGRESS_IDLE_SLEEP_S, build_app

    class NoModels:
        default_draft = default_target = "tiny"

    demo = build_app(NoModels())
    assert demo._queue.sleep_when_free == QUEUE_IDLE_SLEEP_S
    assert demo._queue.progress_update_sleep_when_free == QUEUE_PROGRESS_IDLE_SLEEP_S
