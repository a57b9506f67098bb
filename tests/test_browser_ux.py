"""The small UX defects of issue 41 (item 6), each driven in Chromium on ``app.py --tiny``: the step
slider redraws the step on every kind of input, out-of-range sampling settings get the inline error
(and no traceback in the server's log), no progress timer in the status and error boxes, a Sequoia
tree smaller than the budget is named in the status line, and auto's explanation is on the first
screen at 1280x800."""

from __future__ import annotations

import re
import types

import pytest

from test_browser import (STREAM_INTERVAL_S, _error_line, _opened, _plot_title, _status, _tokens, _wait_status,
                          tiny_app)
from ui.page_driver import choose, set_field

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    log = tmp_path_factory.mktemp("app") / "app.log"
    with tiny_app(log) as url:
        yield types.SimpleNamespace(url=url, log=log)


def _fixed(page, method: str, **fields) -> None:
    """A fixed method at float32 (no auto: the run does not depend on the tiny pair's profile),
    with ``fields`` (elem id -> value) set."""
    choose(page, "method", method)
    page.click("#model-pair")
    choose(page, "precision", "float32")
    choose(page, "draft-precision", "float32")
    page.click("#model-pair")
    for elem, value in fields.items():
        set_field(page, elem, value)


def _run_to_end(page, timeout_s: float = 120) -> int:
    """Run, wait until it finished; the run's number of steps."""
    page.click("#run-btn")
    _wait_status(page, "finished", timeout_s)
    return int(re.search(r"tokens? in (\d+) steps? ·", _status(page)).group(1))


def _wait_tree_step(page, step: int, how: str) -> None:
    try:
        page.wait_for_function("s => (document.querySelector('#tree-plot .gtitle') || {}).textContent"
                               "?.startsWith(`step ${s} `)", arg=step, timeout=20_000)
    except Exception as e:
        raise AssertionError(f"{how}: the tree still shows {_plot_title(page, 'tree-plot')!r}, "
                             f"not step {step}") from e


def _no_traceback(app) -> None:
    log = app.log.read_text()
    assert "Traceback" not in log, log[log.index("Traceback") - 200:][:3000]


def test_every_way_of_moving_the_step_slider_redraws_the_step(app):
    """Keyboard (Home/End/arrows on the range), a number typed in its box (no blur) and the mouse
    all redraw the tree of the step the slider shows; a box left empty or over the last step
    changes nothing for the worse (no error in the server's log)."""
    with _opened(app.url, 1400, 1200) as page:
        _fixed(page, "chain", depth=2)
        n = _run_to_end(page)
        assert n >= 4, _status(page)
        _wait_tree_step(page, n - 1, "after the run")
        rng = page.locator("#step-slider input[type=range]").first
        rng.focus()
        page.keyboard.press("Home")
        _wait_tree_step(page, 0, "Home")
        page.keyboard.press("ArrowRight")
        _wait_tree_step(page, 1, "ArrowRight")
        page.keyboard.press("End")
        _wait_tree_step(page, n - 1, "End")
        page.keyboard.press("ArrowLeft")
        _wait_tree_step(page, n - 2, "ArrowLeft")

        box = page.locator("#step-slider input[type=number]").first
        box.click()
        page.keyboard.press("Control+A")
        page.keyboard.type("2")  # typed, the box keeps the focus
        _wait_tree_step(page, 2, "typed 2")
        page.keyboard.press("Control+A")
        page.keyboard.press("Backspace")  # an empty box: the tree stays where it was
        page.keyboard.type("99")  # past the last step: the last step
        _wait_tree_step(page, n - 1, "typed 99")

        rect = rng.bounding_box()  # the mouse still works: a click at the track's left end
        page.mouse.click(rect["x"] + 2, rect["y"] + rect["height"] / 2)
        _wait_tree_step(page, 0, "mouse click at the left end")
        assert "finished" in _status(page) and _error_line(page).strip() == ""
    _no_traceback(app)


@pytest.mark.parametrize("elem, value, words", [
    ("temperature", -1, "temperature must be in [0, 2]"),
    ("temperature", 5, "temperature must be in [0, 2]"),
    ("top-p", 0, "top_p must be in (0, 1]"),
    ("top-p", 1.5, "top_p must be in (0, 1]"),
])
def test_an_out_of_range_sampling_setting_gets_the_inline_error_and_keeps_the_result(app, elem, value, words):
    """The value typed is the value refused (not clamped into range and run), by the app's own
    inline error; the shown run stays and the server logs no traceback."""
    with _opened(app.url, 1400, 1200) as page:
        _fixed(page, "chain", depth=2)
        steps = _run_to_end(page)
        shown, status = _tokens(page), _status(page)
        set_field(page, elem, value)
        page.click("#run-btn")
        try:
            page.wait_for_function("w => document.querySelector('#error-box').innerText.includes(w)",
                                   arg=words, timeout=30_000)
        except Exception as e:
            raise AssertionError(f"no inline error for {elem} = {value}: the error line says "
                                 f"{_error_line(page)!r}, the status {_status(page)!r}") from e
        assert f"got {float(value)}" in _error_line(page)
        assert float(page.locator(f"#{elem} input").first.input_value()) == value  # not clamped
        assert _tokens(page) == shown and _status(page) == status and f"{steps} steps" in status
    _no_traceback(app)


#: every frame, what the status and error boxes show besides their own text (a progress timer)
WATCH_BOXES = """() => { window.__extra = [];
  const boxes = ['#status', '#error-box'];
  const frame = () => {
    for (const sel of boxes) {
      const box = document.querySelector(sel);
      const md = box && box.querySelector('[data-testid=markdown]');
      if (!box) continue;
      const extra = box.innerText.replace(md ? md.innerText : '', '').trim();
      if (extra) window.__extra.push(`${sel}: ${extra}`);
    }
    requestAnimationFrame(frame);
  };
  requestAnimationFrame(frame); }"""


def test_no_progress_timer_in_the_status_and_error_boxes(app):
    """Through a Run, a refused Run and a Step, no frame shows Gradio's 'processing | 0.2/0.2s'
    timer (or any text but their own) in the status line or the error line."""
    with _opened(app.url, 1400, 1200) as page:
        _fixed(page, "chain", depth=2)
        page.evaluate(WATCH_BOXES)
        _run_to_end(page)
        set_field(page, "seed", -1)
        page.click("#run-btn")
        page.wait_for_function("() => document.querySelector('#error-box').innerText.includes('seed')",
                               timeout=30_000)
        set_field(page, "seed", 0)
        page.click("#step-btn")
        _wait_status(page, "paused", 60)
        page.click("#stop-btn")
        _wait_status(page, "stopped", 30)
        extra = page.evaluate("window.__extra")
        assert extra == [], f"{len(extra)} frames, e.g. {sorted(set(extra))[:5]}"


def test_a_sequoia_tree_smaller_than_the_budget_is_named_in_the_status_line(app):
    """Budget 32 at depth 1: Sequoia's DP tree has 17 nodes (the root and one child per position of
    the default 16-long acceptance vector); the status line says so and why, as the tree does."""
    with _opened(app.url, 1400, 1200) as page:
        _fixed(page, "sequoia", budget=32, depth=1)
        _run_to_end(page)
        note = page.inner_text("#status em")
        assert "the run's tree: 17 nodes, 1 level below the root" in note, note
        assert "best tree of at most 32 nodes and 1 level" in note, note
        assert "tree of 17 nodes" in _plot_title(page, "tree-plot")


def test_autos_explanation_is_on_the_first_screen_at_1280x800(app, tmp_path):
    """After a Run with the app's defaults (Method auto) the status line's explanation of auto's
    choice is whole on a 1280x800 screen without scrolling, as are the prompt, Run and the status
    line; the draft tree's panel starts on that screen before the run."""
    with _opened(app.url, 1280, 800) as page:
        def box(sel):
            b = page.locator(sel).first.bounding_box()
            assert b is not None, sel
            return b

        tree = box("#tree-plot")
        assert tree["y"] <= 800 - 150, tree  # at least 150 px of the (empty) tree on the first screen
        page.click("#run-btn")
        _wait_status(page, "finished", 300)
        note = page.locator("#status em").first
        assert note.inner_text().startswith("auto:"), note.inner_text()
        assert page.evaluate("window.scrollY") == 0
        for sel in ("#status em", "#status", "#prompt", "#run-btn", "#method-hint"):
            b = box(sel)
            assert b["y"] >= 0 and b["y"] + b["height"] <= 800, (sel, b)
        page.screenshot(path=str(tmp_path / "after_run_1280x800.png"))


def test_a_page_left_idle_answers_a_click_at_the_streaming_pace(tmp_path):
    """After IDLE_TICKS unchanged refreshes the page refreshes every IDLE_INTERVAL_S only (here 120 s, so that
    nothing but the wake can explain a prompt redraw); a key on the step slider (an event that changes the Live
    tab) brings the streaming interval back at once: the tree redraws within 10 s (2.2-2.5 s measured on the
    2-core machine), not at the next idle refresh ~2 min later."""
    import time

    from ui.controller import IDLE_TICKS

    log = tmp_path / "app.log"
    with tiny_app(log, DYNTREE_UI_IDLE_INTERVAL="120") as url, _opened(url, 1400, 1200) as page:
        _fixed(page, "chain", depth=2)
        n = _run_to_end(page)
        _wait_tree_step(page, n - 1, "after the run")
        time.sleep((IDLE_TICKS + 3) * STREAM_INTERVAL_S + 1)  # the page polls every 120 s by now
        rng = page.locator("#step-slider input[type=range]").first
        rng.focus()
        t0 = time.monotonic()
        page.keyboard.press("Home")
        _wait_tree_step(page, 0, "Home on an idle page")
        assert time.monotonic() - t0 < 10, time.monotonic() - t0
    _no_traceback(types.SimpleNamespace(log=log))
