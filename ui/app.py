"""The Gradio Blocks factory: ``build_app(model_provider) -> gr.Blocks``.

Layout (``layout.py``): controls on the left; on the right a *Live* tab (the run's status line, coloured
text, step slider, draft tree, masks in BFS/DFS/HPD order, speed charts, phase timings, export and replay) and a
*Compare* tab (AR vs chain vs a tree method on the same prompt, seed and max new tokens). What the events
do is ``controller.py``; this module only wires components to handlers. Per-browser state is a
``SessionState`` per tab (``Controller.sessions``). Run starts a background ``DecodeWorker``; Pause/Stop/Step act on
the worker and the session's state; a ``gr.Timer`` is the Live tab's only writer: each tick draws
the session's state if it changed since the last one.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import gradio as gr

from .controller import Controller
from .layout import AppDefaults, build_layout
from .models import ModelProvider

#: the page pulls a fresh snapshot this often when something changed (seconds; DYNTREE_UI_STREAM_INTERVAL
#: overrides). The pull is timer-driven in the browser, so a busy page never builds up a backlog; an
#: idle tick returns nothing.
STREAM_INTERVAL_S = float(os.environ.get("DYNTREE_UI_STREAM_INTERVAL", "1.0"))


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:  # pragma: no cover
        return False


def _example_prompts() -> list[tuple[str, str]]:
    """A few prompts from the shipped prompt sets (text files, no models)."""
    try:
        from dyntree_core.prompts import load_prompts

        out = []
        for ds in ("code", "wiki", "news"):
            for p in load_prompts(ds, n=3):
                out.append((f"{ds}: {(p.title or p.text)[:60].strip()}", p.text))
        return out
    except Exception:  # noqa: BLE001 - prompt files are optional for the app
        return []


def build_app(model_provider: ModelProvider, defaults: AppDefaults = AppDefaults()) -> gr.Blocks:
    """The whole UI; ``model_provider`` loads pairs lazily (on the first Run)."""
    from dyntree_core.models.load import import_transformers

    import_transformers()  # before any event thread can import it (not thread-safe); no model is built
    examples = _example_prompts()
    with gr.Blocks(title=defaults.title, fill_width=True) as demo:
        timer = gr.Timer(STREAM_INTERVAL_S)
        gr.Markdown(
            f"# {defaults.title} — see tree-based speculative decoding\n"
            "Each step the draft model proposes a token **tree**; the target verifies it in one forward pass "
            "and keeps an accepted path plus one **bonus** token. Press **Run**, or **Step** through it.",
            elem_id="intro",
        )
        c = build_layout(model_provider.default_draft, model_provider.default_target, defaults, _cuda_available(),
                         examples)
        ctl = Controller(model_provider, c, examples, STREAM_INTERVAL_S, timer)

        # no progress on any output: show_progress="hidden" alone still sends the outputs their
        # loading status, whose overlay keeps Gradio's timer text ("processing | 0.2/0.2s") inside the
        # status and error lines (transparent, but in their text); an empty show_progress_on sends none
        silent = dict(show_progress="hidden", show_progress_on=[])
        quick = dict(concurrency_limit=None, **silent)
        load = dict(concurrency_id="load", concurrency_limit=1, **silent)
        on = ctl.bound  # handlers take the tab's SessionState first (ctl.sessions), then the inputs
        view = [c.block_size]

        c.method.change(ctl.verifier_update, [c.method, c.temperature, c.verifier], c.verifier, **quick)
        c.method.change(ctl.method_changed, c.method, [c.method_hint, c.budget, c.depth, c.width, c.threshold], **quick)
        c.temperature.change(ctl.verifier_update, [c.method, c.temperature, c.verifier], c.verifier, **quick)
        c.example.change(ctl.example_chosen, c.example, c.prompt, **quick)
        prompt_inputs = [c.draft, c.target, c.prompt, c.chat, c.max_new, c.budget]
        for trigger in (c.prompt.change, c.chat.change, c.max_new.change):
            trigger(on(ctl.prompt_info), prompt_inputs, c.prompt_info, trigger_mode="always_last", **quick)
        demo.load(on(ctl.prompt_info), prompt_inputs, c.prompt_info, **quick)
        demo.unload(ctl.on_unload)

        # the Live tab's components have one writer, the timer; the other events only change state
        timer.tick(on(ctl.on_tick), view, [*c.live_outputs, timer], trigger_mode="once", concurrency_id="render",
                   concurrency_limit=4, **silent)
        c.run_btn.click(on(ctl.on_run), [c.with_baseline, *c.form], None, **load)
        c.pause_btn.click(on(ctl.on_pause), None, None, **quick)
        c.step_btn.click(on(ctl.on_step), c.form, None, **load)
        c.stop_btn.click(on(ctl.on_stop), None, timer, **quick)  # (it also sets the refresh interval)
        # every move of the slider is an input event (mouse, keys on the range, each digit typed in its
        # box); release fires only on pointer up or the box's blur, change also on the tick's own
        # updates. Unprocessed: a box being typed in may hold nothing or a step past either end.
        c.step_slider.input(on(ctl.on_select_step), c.step_slider, None, preprocess=False,
                            trigger_mode="always_last", **quick)
        c.block_size.change(on(ctl.on_block_size), None, None, **quick)
        c.walk_prev.click(on(ctl.on_walk(-1)), None, None, **quick)
        c.walk_next.click(on(ctl.on_walk(+1)), None, None, **quick)
        c.open_run.upload(on(ctl.on_open_run), c.open_run, None, **load)
        for btn, kind in ((c.png_btn, "png"), (c.svg_btn, "svg"), (c.json_btn, "json")):
            btn.click(on(ctl.on_export(kind)), [c.step_slider, c.block_size], [c.export_files],
                      concurrency_id="export", concurrency_limit=1)
        # what changes the Live tab also brings its refresh back to the streaming interval, beside the handler
        # (not after it: Run may load models for a while, and the page says so meanwhile)
        for trigger in (c.run_btn.click, c.pause_btn.click, c.step_btn.click, c.step_slider.input,
                        c.block_size.change, c.walk_prev.click, c.walk_next.click, c.open_run.upload):
            trigger(on(ctl.on_wake), None, timer, **quick)
        c.cmp_btn.click(on(ctl.on_compare), [c.cmp_method, c.cmp_hf, *c.form], c.compare_outputs, **load)
        c.cmp_stop.click(on(ctl.on_compare_stop), None, c.cmp_status, **quick)

    demo.queue(default_concurrency_limit=1)
    _calm_queue(demo)
    demo.dyntree_close = ctl.close  # (``shut_down``)
    return demo


def serve(demo: gr.Blocks, say: Callable[[str], None] = print, **launch_kwargs) -> None:
    """``demo.launch(**launch_kwargs)`` until Ctrl-C; then the runs stop (``shut_down``) and the server closes without
    waiting for the pages' open event streams. Gradio's own wait (``block_thread``) closed the server first, and
    uvicorn waited for those streams until Gradio's 5 s join timeout, before the runs were even told to stop."""
    try:
        demo.launch(prevent_thread_lock=True, **launch_kwargs)
        while demo.is_running:
            time.sleep(0.1)
    except KeyboardInterrupt:
        say("Keyboard interruption: DynTree closes the app")
    finally:
        shut_down(demo, say)
        server = getattr(demo, "server", None)
        if server is not None:
            server.force_exit = True  # (uvicorn: no wait for open connections; the runs they showed have ended)
        demo.close()


def shut_down(demo: gr.Blocks, say: Callable[[str], None] = print) -> bool:
    """After ``demo.launch()`` returned (Ctrl-C): stop every run and ``auto``'s background measurement and wait for
    them (``Controller.close``), so no thread is inside torch while the interpreter exits. True once all stopped."""
    close = getattr(demo, "dyntree_close", None)
    if close is None:
        return True
    t0 = time.monotonic()
    say("DynTree: stopping the runs and auto's background measurement …")
    stopped = close()
    say(f"DynTree: {'stopped' if stopped else 'not everything stopped'} in {time.monotonic() - t0:.1f} s")
    return stopped


#: how long Gradio's queue loops sleep while no event waits (seconds): Gradio's own values on Windows; on Linux it
#: polls every 1 ms (and its progress loop every 10 ms), 8.8% of a core of the 2-core AVX2 machine with nothing to
#: do, taken from decoding; this adds at most 50 ms before an event starts
QUEUE_IDLE_SLEEP_S = 0.05
QUEUE_PROGRESS_IDLE_SLEEP_S = 0.1


def _calm_queue(demo: gr.Blocks) -> None:
    queue = getattr(demo, "_queue", None)
    if queue is not None and hasattr(queue, "sleep_when_free"):  # (private: a later Gradio may differ)
        queue.sleep_when_free = max(queue.sleep_when_free, QUEUE_IDLE_SLEEP_S)
        queue.progress_update_sleep_when_free = max(getattr(queue, "progress_update_sleep_when_free", 0.0),
                                                    QUEUE_PROGRESS_IDLE_SLEEP_S)
