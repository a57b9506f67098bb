"""The page's event handlers (``ui.controller.Controller``) on the tiny pair, with the form at the
real app's defaults (``AppDefaults()``: Method, Target and Draft precision = ``auto``)."""

from __future__ import annotations

import types

import pytest

from ui.controller import Controller
from ui.layout import N_COMPARE, AppDefaults
from ui.session import SessionState
from ui.tiny import TinyModelProvider

DEFAULTS = AppDefaults()


def _form(**kw) -> list:
    """Form values in ``settings_from_form`` order: the real app's defaults, tiny models."""
    d = DEFAULTS
    values = dict(draft="tiny", target="tiny", device=d.device, dtype=d.dtype, prompt="t1 t2 t3 t4 t5",
                  chat=d.chat, method=d.method, verifier="auto", temperature=0.0, top_p=1.0, budget=d.budget,
                  depth=d.depth, width=d.width, threshold=0.05, max_new_tokens=12, seed=0, offload=False,
                  precision=d.precision, draft_precision=d.draft_precision)
    values.update(kw)
    return list(values.values())


@pytest.fixture()
def controller(tmp_path, monkeypatch) -> Controller:
    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path))  # a fresh profile cache: auto measures
    comps = types.SimpleNamespace(
        cmp_speed="cmp_speed", cmp_steps="cmp_steps", cmp_status="cmp_status",
        cmp_texts=tuple(f"text{i}" for i in range(N_COMPARE)), cmp_stats=tuple(f"stats{i}" for i in range(N_COMPARE)))
    return Controller(TinyModelProvider(), comps, [], stream_interval_s=0.5)


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


@pytest.mark.parametrize("field, value, words", [
    ("seed", -1, "seed"),
    ("max_new_tokens", 0, "max new tokens"),
    ("prompt", "   ", "prompt is empty"),
    ("temperature", 11.0, "temperature"),
])
def test_bad_input_is_refused_before_any_work_and_keeps_the_result(controller, field, value, words):
    state = SessionState()
    controller.on_run(state, False, *_form())
    assert state.worker.join(120)
    before = state.record
    controller.on_run(state, False, *_form(**{field: value}))
    assert words in state.error, state.error
    assert state.record is before and before.status == "finished"
