"""The app's interpreter switch interval (``ui.switch_interval``): set by ``app.main`` before the page is
served, overridable, refused out of range; each test puts the process's interval back."""

from __future__ import annotations

import sys

import pytest

from ui import switch_interval
from ui.switch_interval import DECODE_SWITCH_INTERVAL_S, ENV, favour_decoding


@pytest.fixture(autouse=True)
def _restore():
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_the_app_asks_for_a_short_interval(monkeypatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert DECODE_SWITCH_INTERVAL_S < 0.005  # shorter than Python's default, or it changes nothing
    assert favour_decoding() == pytest.approx(DECODE_SWITCH_INTERVAL_S)
    assert sys.getswitchinterval() == pytest.approx(DECODE_SWITCH_INTERVAL_S)


def test_the_environment_overrides_it(monkeypatch) -> None:
    monkeypatch.setenv(ENV, "0.005")
    assert favour_decoding() == pytest.approx(0.005)


@pytest.mark.parametrize("raw", ["fast", "0", "-1", "5"])
def test_a_bad_value_is_refused_with_its_name(monkeypatch, raw) -> None:
    monkeypatch.setenv(ENV, raw)
    before = sys.getswitchinterval()
    with pytest.raises(SystemExit, match=ENV):
        favour_decoding()
    assert sys.getswitchinterval() == before


def test_app_main_sets_it_before_serving(monkeypatch) -> None:
    import app

    seen = {}

    class Stop(Exception):
        pass

    def build_app(provider, defaults):
        seen["interval"] = sys.getswitchinterval()
        raise Stop

    import ui

    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(ui, "build_app", build_app)
    monkeypatch.setattr(ui, "HubModelProvider", lambda draft, target: None)
    sys.setswitchinterval(0.005)
    with pytest.raises(Stop):
        app.main([])
    assert seen["interval"] == pytest.approx(switch_interval.DECODE_SWITCH_INTERVAL_S)
