"""The Gradio Blocks factory: ``build_app(model_provider) -> gr.Blocks``.

Layout: controls on the left; on the right a *Live* tab (coloured text, step slider, draft tree,
masks in BFS/DFS/HPD order, speed charts, phase timings, export) and a *Compare* tab (AR vs
chain vs a tree method on the same prompt, seed and length). Per-browser state lives in a
``gr.State`` (``SessionState``). Run starts a background ``DecodeWorker``; a ``gr.Timer`` pulls
snapshots while it runs; Pause/Stop/Step act on the worker. One lock per app serialises decoding
steps on the shared models, so sessions take turns instead of clobbering each other.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import gradio as gr

from dyntree_core.config import DTYPES, compatible_verifiers
from dyntree_core.methods import REGISTRY
from dyntree_core.tree import BLOCK_SIZES

from .errors import describe_error, error_markdown
from .export import read_json, write_images, write_json
from .mask_figure import MASK_LEGEND
from .models import ModelProvider
from .runner import HF_ASSISTED_LABEL, run_hf_assisted, start_generation
from .session import ExternalRun, Generation, RunRecord, SessionState
from .worker import DecodeWorker
from .settings import (
    AUTO,
    MAX_NEW_TOKENS,
    METHOD_CHOICES,
    METHOD_PARAMS,
    PRECISION_CHOICES,
    TREE_METHODS,
    RunSettings,
    settings_from_form,
)
from .views import compare_views, export_figures, run_view, step_view

#: while a run decodes, the page pulls a fresh snapshot this often (seconds; DYNTREE_UI_STREAM_INTERVAL
#: overrides). The pull is timer-driven in the browser, so a busy page never builds up a backlog.
STREAM_INTERVAL_S = float(os.environ.get("DYNTREE_UI_STREAM_INTERVAL", "1.0"))
N_COMPARE = 4  # Compare columns: autoregressive, chain, tree, transformers assisted
METHOD_HINTS: dict[str, str] = {
    AUTO: "auto: this machine's measured cost model picks the method, its shape and each model's precision "
          "(plain decoding when no tree pays for itself here); the status line says why.",
    **{m.name: m.hint for m in REGISTRY.values()},
}


@dataclass(frozen=True)
class AppDefaults:
    """Initial values of the form (the CLI fills these)."""

    device: str = "cpu"
    dtype: str = "float32"
    prompt: str = "Write a Python function that returns the n-th Fibonacci number."
    chat: bool = True
    method: str = AUTO
    precision: str = AUTO
    draft_precision: str = AUTO
    max_new_tokens: int = 64
    budget: int = 32
    depth: int = 6
    width: int = 4
    title: str = "DynTree"


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
                label = f"{ds}: {(p.title or p.text)[:60].strip()}"
                out.append((label, p.text))
        return out
    except Exception:  # noqa: BLE001 - prompt files are optional for the app
        return []


def _param_updates(method: str) -> list[Any]:
    used = METHOD_PARAMS.get(method, frozenset())
    return [gr.update(interactive=name in used) for name in ("budget", "depth", "width", "threshold")]


def _verifiers(method: str, temperature: float) -> list[str]:
    return ["auto"] if method == AUTO else compatible_verifiers(method, float(temperature or 0.0))


def _verifier_update(method: str, temperature: float, current: Optional[str]) -> Any:
    choices = _verifiers(method, temperature)
    return gr.Dropdown(choices=choices, value=current if current in choices else "auto")


def build_app(model_provider: ModelProvider, defaults: AppDefaults = AppDefaults()) -> gr.Blocks:
    """The whole UI; ``model_provider`` loads pairs lazily (on the first Run)."""
    cuda = _cuda_available()
    examples = _example_prompts()
    model_lock = threading.Lock()  # one decoding step at a time on the shared models (all sessions)

    with gr.Blocks(title=defaults.title, fill_width=True) as demo:
        session = gr.State(SessionState, delete_callback=lambda s: s.close() if isinstance(s, SessionState) else None)
        timer = gr.Timer(STREAM_INTERVAL_S, active=False)
        gr.Markdown(
            f"# {defaults.title} — see tree-based speculative decoding\n"
            "Each step the draft model proposes a token **tree**; the target verifies it in one forward pass "
            "and keeps an accepted path plus one **bonus** token. Press **Run**, or **Step** through it.",
            elem_id="intro",
        )
        with gr.Row(equal_height=False):
            # ---------------------------------------------------------------- controls
            with gr.Column(scale=1, min_width=330, elem_id="controls"):
                with gr.Accordion("Model pair", open=False, elem_id="model-pair"):
                    draft = gr.Textbox(model_provider.default_draft, label="Draft model",
                                       info="'embedded', a preset, a local dir or a hub id", elem_id="draft-model")
                    target = gr.Textbox(model_provider.default_target, label="Target model", elem_id="target-model")
                    with gr.Row():
                        device = gr.Dropdown(["cpu", "cuda"] if cuda else ["cpu"], value=defaults.device,
                                             label="Device", elem_id="device")
                        dtype = gr.Dropdown(list(DTYPES), value=defaults.dtype, label="dtype", elem_id="dtype")
                    with gr.Row():
                        precision = gr.Dropdown(list(PRECISION_CHOICES), value=defaults.precision,
                                                label="Target precision", elem_id="precision",
                                                info="auto: measured on this machine (first Run profiles it, then cached)")
                        draft_precision = gr.Dropdown(list(PRECISION_CHOICES), value=defaults.draft_precision,
                                                      label="Draft precision", elem_id="draft-precision")
                    offload = gr.Checkbox(False, label="Offload the target's layers to host memory (CUDA)",
                                          visible=cuda, elem_id="offload")
                prompt = gr.Textbox(defaults.prompt, lines=4, label="Prompt", elem_id="prompt")
                with gr.Row():
                    chat = gr.Checkbox(defaults.chat, label="Chat template", elem_id="chat",
                                       info="wrap the prompt when the tokenizer has one")
                    example = gr.Dropdown([label for label, _ in examples], value=None, label="Example prompt",
                                          visible=bool(examples), elem_id="example-prompt")
                method = gr.Dropdown(list(METHOD_CHOICES), value=defaults.method, label="Method", elem_id="method")
                method_hint = gr.Markdown(METHOD_HINTS.get(defaults.method, ""), elem_id="method-hint")
                verifier = gr.Dropdown(_verifiers(defaults.method, 0.0), value="auto",
                                       label="Verifier (lossless choices only)", elem_id="verifier")
                with gr.Row():
                    temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="Temperature (0 = greedy)",
                                            elem_id="temperature")
                    top_p = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="Top-p", elem_id="top-p")
                used = METHOD_PARAMS.get(defaults.method, frozenset())
                with gr.Row():
                    budget = gr.Number(defaults.budget, label="Budget (nodes incl. root)", precision=0, minimum=2,
                                       maximum=4096, interactive="budget" in used, elem_id="budget")
                    depth = gr.Number(defaults.depth, label="Depth", precision=0, minimum=1, maximum=256,
                                      interactive="depth" in used, elem_id="depth")
                with gr.Row():
                    width = gr.Number(defaults.width, label="Width", precision=0, minimum=1, maximum=256,
                                      interactive="width" in used, elem_id="width")
                    threshold = gr.Number(0.05, label="Threshold", minimum=0.0001, maximum=0.9999, step=0.01,
                                          interactive="threshold" in used, elem_id="threshold")
                with gr.Row():
                    max_new = gr.Number(defaults.max_new_tokens, label="Max new tokens", precision=0, minimum=1,
                                        maximum=MAX_NEW_TOKENS, elem_id="max-new-tokens")
                    seed = gr.Number(0, label="Seed", precision=0, elem_id="seed")
                with_baseline = gr.Checkbox(False, label="Then run the autoregressive baseline (same prompt, seed, length)",
                                            elem_id="with-baseline")
                with gr.Row(elem_id="run-controls"):
                    run_btn = gr.Button("Run", variant="primary", elem_id="run-btn", min_width=60)
                    pause_btn = gr.Button("Pause", elem_id="pause-btn", min_width=60)
                    step_btn = gr.Button("Step", elem_id="step-btn", min_width=60)
                    stop_btn = gr.Button("Stop", variant="stop", elem_id="stop-btn", min_width=60)
                status = gr.Markdown("Idle. Models load on the first Run.", elem_id="status")
                error_box = gr.Markdown("", elem_id="error-box")

            # ---------------------------------------------------------------- panels
            with gr.Column(scale=3, min_width=600):
                with gr.Tabs():
                    with gr.Tab("Live", id="live", elem_id="live-tab"):
                        text_html = gr.HTML(run_view(None, None).text_html, elem_id="colored-text")
                        with gr.Row():
                            step_slider = gr.Slider(0, 1, value=0, step=1, label="Step (drag to revisit an earlier step)",
                                                    interactive=False, elem_id="step-slider", scale=4)
                            block_size = gr.Radio(list(BLOCK_SIZES), value=16, label="Mask block size",
                                                  elem_id="block-size", scale=1)
                        empty = step_view(None, None, 16)
                        tree_plot = gr.Plot(empty.tree, label="Draft tree", elem_id="tree-plot")
                        gr.Markdown(f"**Tree attention mask** of the selected step in three node orders. {MASK_LEGEND}",
                                    elem_id="mask-caption")
                        with gr.Row():
                            mask_bfs = gr.Plot(empty.masks[0], label="Mask, BFS (original) order", elem_id="mask-bfs")
                            mask_dfs = gr.Plot(empty.masks[1], label="Mask, DFS order", elem_id="mask-dfs")
                            mask_hpd = gr.Plot(empty.masks[2], label="Mask, HPD order", elem_id="mask-hpd")
                        with gr.Row():
                            speed_plot = gr.Plot(run_view(None, None).speed, label="Tokens/s", elem_id="speed-plot")
                            steps_plot = gr.Plot(run_view(None, None).per_step, label="Tokens per step",
                                                 elem_id="tokens-per-step-plot")
                        phase_plot = gr.Plot(empty.phases, label="Phase timings", elem_id="phase-plot")
                        with gr.Accordion("Export", open=False, elem_id="export"):
                            gr.Markdown("Tree and masks of the selected step, the coloured text and the tokens/s "
                                        "chart as images (headless Chromium via kaleido), or the run's StepTraces as JSON.")
                            with gr.Row():
                                png_btn = gr.Button("PNG", elem_id="export-png")
                                svg_btn = gr.Button("SVG", elem_id="export-svg")
                                json_btn = gr.Button("JSON (StepTraces)", elem_id="export-json")
                            export_files = gr.File(label="Exported files", file_count="multiple", interactive=False,
                                                   elem_id="export-files")
                            open_run = gr.File(label="Open an exported run (JSON): replays its steps, no models needed",
                                               file_types=[".json"], file_count="single", elem_id="open-run")
                    with gr.Tab("Compare", id="compare", elem_id="compare-tab"):
                        gr.Markdown("Autoregressive vs chain vs a tree method on the **same** prompt, seed, "
                                    "sampling settings and token budget, run one after the other; optionally "
                                    "transformers' own assisted generation (`generate(assistant_model=draft)`) "
                                    "on the same models as a fourth column.")
                        with gr.Row():
                            cmp_method = gr.Dropdown(list(TREE_METHODS), value=defaults.method if defaults.method in TREE_METHODS
                                                     else TREE_METHODS[0], label="Tree method", elem_id="compare-method")
                            cmp_hf = gr.Checkbox(value=True, label="+ transformers assisted", elem_id="compare-hf")
                            cmp_btn = gr.Button("Compare", variant="primary", elem_id="compare-btn")
                            cmp_stop = gr.Button("Stop", variant="stop", elem_id="compare-stop")
                        cmp_status = gr.Markdown("", elem_id="compare-status")
                        with gr.Row():
                            cmp_texts, cmp_stats = [], []
                            for i, name in enumerate(("autoregressive", "chain", "tree", HF_ASSISTED_LABEL)):
                                with gr.Column(min_width=240):
                                    cmp_stats.append(gr.Markdown(f"**{name}**", elem_id=f"compare-stats-{i}"))
                                    cmp_texts.append(gr.HTML("", elem_id=f"compare-text-{i}"))
                        with gr.Row():
                            cmp_speed = gr.Plot(label="Tokens/s", elem_id="compare-speed")
                            cmp_steps = gr.Plot(label="Tokens per step", elem_id="compare-steps")

        form = [draft, target, device, dtype, prompt, chat, method, verifier, temperature, top_p,
                budget, depth, width, threshold, max_new, seed, offload, precision, draft_precision]
        live_outputs = [tree_plot, mask_bfs, mask_dfs, mask_hpd, phase_plot, text_html, speed_plot, steps_plot,
                        status, step_slider, error_box, pause_btn]
        step_outputs = [tree_plot, mask_bfs, mask_dfs, mask_hpd, phase_plot]
        compare_outputs = [*cmp_texts, *cmp_stats, cmp_speed, cmp_steps, cmp_status, error_box]

        # ------------------------------------------------------------------ rendering helpers
        def pause_label(state: SessionState, label: str) -> Any:
            """Re-render the Pause/Resume button only when its label changes (a button that is
            re-rendered on every refresh cannot be clicked reliably)."""
            if state.pause_label == label:
                return gr.skip()
            state.pause_label = label
            return gr.Button(label)

        def timer_update(state: SessionState, active: bool) -> Any:
            """Touch the refresh timer only when it must switch on or off."""
            if state.timer_active == active:
                return gr.skip()
            state.timer_active = active
            return gr.Timer(active=active)

        def live(state: SessionState, block: int, error: str = "", step: Optional[int] = None) -> tuple:
            """All Live-tab outputs for the session's current run (latest step unless ``step``)."""
            state.rendered_version = state.version
            rec = state.record
            sv = step_view(rec, step, block)
            rv = run_view(rec, state.baseline_for(rec.settings) if rec is not None else None)
            n = len(rec.traces) if rec is not None else 0
            idx = n - 1 if step is None else step
            slider = gr.Slider(minimum=0, maximum=max(n - 1, 1), value=max(idx, 0), step=1, interactive=n > 1)
            paused = rec is not None and rec.status == "paused" and state.active and not state.running
            status_text = rv.status + ("  \n_running the autoregressive baseline …_" if state.baseline_running else "")
            return (sv.tree, *sv.masks, sv.phases, rv.text_html, rv.speed, rv.per_step, status_text, slider,
                    error_markdown(error), pause_label(state, "Resume" if paused else "Pause"),
                    timer_update(state, state.running))

        def notice(state: SessionState, text: str, timer: bool = False) -> tuple:
            """Only the status line (and the refresh timer) change."""
            return (*[gr.skip()] * 8, text, gr.skip(), "", gr.skip(), timer_update(state, timer))

        def fail(state: SessionState, block: int, exc: BaseException) -> tuple:
            msg = describe_error(exc)
            gr.Warning(msg)
            return live(state, block, msg)

        def halt(state: SessionState, wait_s: float = 120.0) -> None:
            """Pause the background worker (if any) and wait for its current step to end."""
            if state.worker is not None:
                state.worker.request_pause()
                state.worker.join(wait_s)

        def launch(state: SessionState, gen: Optional[Generation] = None,
                   baseline_of: Optional[RunSettings] = None) -> None:
            """Run ``gen`` (default: the session's generation) on a background worker; when
            ``baseline_of`` is given (or was given when this run started) an AR baseline follows."""
            gen = gen or state.generation
            if baseline_of is None:
                baseline_of = state.baseline_request
            assert gen is not None

            def error(e: BaseException) -> None:
                state.error = describe_error(e)

            def after() -> None:
                rec = gen.record
                if rec.config.method == "autoregressive" and rec.status == "finished":
                    state.baselines[rec.settings.baseline_key()] = rec
                if baseline_of is not None and rec.status == "finished" and state.baseline_for(baseline_of) is None:
                    state.baseline_running = True
                    state.bump()
                    try:
                        base = start_generation(model_provider, baseline_of.with_method("autoregressive"))
                        base.record.status = "running"
                        while not gen.stop_event.is_set():
                            with model_lock:
                                if base.advance() is None or base.done:
                                    break
                        if base.record.status == "finished":
                            state.baselines[baseline_of.baseline_key()] = base.record
                    finally:
                        state.baseline_running = False

            state.worker = DecodeWorker(gen, model_lock, state.bump, error, after).start()

        def begin(state: SessionState, settings: RunSettings) -> Iterator[tuple]:
            """Replace the session's generation with a new one (yields a loading notice first)."""
            halt(state)
            if state.generation is not None and not state.generation.done:
                state.generation.stop_now()
            if settings.needs_auto:
                yield notice(state, f"auto: choosing the configuration for this machine ({settings.draft} / "
                                    f"{settings.target}) … the first time it measures the machine profile and "
                                    "the pair's acceptance (a few minutes on a 2-core CPU), then it is cached")
            elif not model_provider.is_loaded(settings.pair_spec()):
                yield notice(state, f"Loading models {settings.draft} / {settings.target} … "
                                    "(the first load can take a while)")
            state.generation = start_generation(model_provider, settings)
            state.record = state.generation.record
            state.error = ""
            state.baseline_request = None
            state.bump()

        # ------------------------------------------------------------------ event handlers
        def on_run(state: SessionState, block: int, baseline: bool, *values) -> Iterator[tuple]:
            try:
                settings = settings_from_form(*values)
                settings.decode_config()
                yield from begin(state, settings)
            except Exception as e:  # noqa: BLE001 - shown in the page; the app stays usable
                yield fail(state, block, e)
                return
            state.baseline_request = settings if baseline else None
            launch(state)
            yield live(state, block)

        def on_tick(state: SessionState, block: int) -> tuple:
            """Timer refresh: repaint only when something changed; stop ticking when idle."""
            if state.error:
                msg, state.error = state.error, ""
                gr.Warning(msg)
                return live(state, block, msg)
            if state.version == state.rendered_version:
                return (*[gr.skip()] * 12, timer_update(state, state.running))
            return live(state, block)

        def on_pause(state: SessionState, block: int) -> tuple:
            rec = state.record
            if state.running and rec is not None and rec.status == "running":
                halt(state, wait_s=0)  # the worker stops after its current step; the timer shows it
                return notice(state, "Pausing after the current step …", timer=True)[:-2] + (
                    pause_label(state, "Resume"), timer_update(state, True))
            if state.active and not state.running and rec is not None and rec.status == "paused":
                launch(state)  # resume
            return live(state, block)

        def on_step(state: SessionState, block: int, *values) -> Iterator[tuple]:
            try:
                halt(state)
                if not state.active:
                    settings = settings_from_form(*values)
                    settings.decode_config()
                    yield from begin(state, settings)
                gen: Generation = state.generation  # type: ignore[assignment]
                with model_lock:
                    gen.advance()
                if not gen.done:
                    gen.record.status = "paused"
                elif gen.record.config.method == "autoregressive" and gen.record.status == "finished":
                    state.baselines[gen.record.settings.baseline_key()] = gen.record
                state.bump()
            except Exception as e:  # noqa: BLE001
                yield fail(state, block, e)
                return
            yield live(state, block)

        def on_stop(state: SessionState, block: int) -> tuple:
            if state.compare_stop is not None:
                state.compare_stop.set()
            gen = state.generation
            if gen is not None and not gen.done:
                if state.running:
                    gen.stop_event.set()  # the worker ends the run after its current step
                    return notice(state, "Stopping after the current step …", timer=True)
                gen.stop_now()
                state.bump()
            return live(state, block)

        def on_open_run(state: SessionState, block: int, path: Optional[str]) -> tuple:
            """Show an exported run (``ui.export.read_json``) in the Live tab; the current generation
            ends first (its steps are kept in its own export, not here)."""
            if not path:  # the file was cleared
                return tuple(gr.skip() for _ in live_io)
            try:
                rec = read_json(Path(path))
            except Exception as e:  # noqa: BLE001 - shown inline, the session goes on
                return fail(state, block, e)
            halt(state)
            if state.generation is not None and not state.generation.done:
                state.generation.stop_now()
            state.generation = None
            state.record = rec
            state.error = ""
            state.bump()
            return live(state, block)

        def on_compare_stop(state: SessionState) -> str:
            if state.compare_stop is not None and not state.compare_stop.is_set():
                state.compare_stop.set()
                return "stopping after the current step …"
            return gr.skip()

        def on_select_step(state: SessionState, step: float, block: int) -> tuple:
            sv = step_view(state.record, step, block)
            return (sv.tree, *sv.masks, sv.phases)

        def on_compare(state: SessionState, tree_method: str, with_hf: bool, *values) -> Iterator[tuple]:
            records: list[RunRecord | ExternalRun] = []
            stop = threading.Event()
            state.compare_stop = stop
            try:
                settings = settings_from_form(*values)
                settings.decode_config()
                for m in ("autoregressive", "chain", tree_method):
                    s = settings.with_method(m)
                    if not model_provider.is_loaded(s.pair_spec()):
                        yield (*[gr.skip()] * (2 * N_COMPARE + 2), "Loading models …", "")
                    gen = start_generation(model_provider, s, stop)
                    records.append(gen.record)
                    gen.record.status = "running"
                    yield compare_tuple(records, f"running {gen.record.label} …")
                    last = time.monotonic()
                    while True:
                        with model_lock:
                            if gen.advance() is None or gen.done:
                                break
                        if time.monotonic() - last >= 2 * STREAM_INTERVAL_S:
                            last = time.monotonic()
                            s_ = gen.record.summary()
                            yield (*[gr.skip()] * (2 * N_COMPARE + 2), f"running {gen.record.label} … {s_['tokens']} tokens", "")
                    if stop.is_set():
                        break
                if with_hf and not stop.is_set():
                    yield from compare_hf_assisted(settings, stop, records)
            except Exception as e:  # noqa: BLE001
                msg = describe_error(e)
                gr.Warning(msg)
                state.compare = records
                yield compare_tuple(records, "", msg)
                return
            state.compare = records
            if records and records[0].status == "finished":
                state.baselines[records[0].settings.baseline_key()] = records[0]
            yield compare_tuple(records, "stopped" if stop.is_set() else "done: same prompt, seed and length")

        def compare_tuple(records: list[RunRecord | ExternalRun], note: str, error: str = "") -> tuple:
            texts, stats, speed, per_step = compare_views(records)
            texts += [""] * (N_COMPARE - len(texts))
            stats += [gr.skip()] * (N_COMPARE - len(stats))
            return (*texts, *stats, speed, per_step, note, error_markdown(error))

        def compare_hf_assisted(settings: RunSettings, stop: threading.Event,
                                records: list[RunRecord | ExternalRun]) -> Iterator[tuple]:
            """Run transformers' assisted generation in a thread (holding the model lock) and
            stream its progress; its result is appended to ``records``."""
            placeholder = ExternalRun(label=HF_ASSISTED_LABEL)
            records.append(placeholder)
            yield compare_tuple(records, f"running {HF_ASSISTED_LABEL} …")
            tokens = [0]
            box: dict = {}

            def work() -> None:
                try:
                    with model_lock:
                        box["run"] = run_hf_assisted(model_provider, settings, stop,
                                                     progress=lambda n: tokens.__setitem__(0, n))
                except Exception as e:  # noqa: BLE001
                    box["error"] = e

            th = threading.Thread(target=work, daemon=True)
            th.start()
            while th.is_alive():
                th.join(2 * STREAM_INTERVAL_S)
                if th.is_alive():
                    yield (*[gr.skip()] * (2 * N_COMPARE + 2), f"running {HF_ASSISTED_LABEL} … {tokens[0]} tokens", "")
            if "error" in box:
                raise box["error"]
            records[-1] = box["run"]

        def on_export(kind: str):
            def export(state: SessionState, step: float, block: int):
                rec = state.record
                if rec is None or not rec.traces:
                    gr.Warning("Nothing to export yet: run a generation first.")
                    return gr.skip(), error_markdown("Nothing to export yet: run a generation first.")
                out = Path(state.export_dir()) / f"export-{time.strftime('%H%M%S')}-{kind}"
                try:
                    if kind == "json":
                        files = [write_json(rec, out / "steptraces.json")]
                    else:
                        files = write_images(export_figures(rec, step, block), out, (kind,))
                except Exception as e:  # noqa: BLE001
                    msg = describe_error(e)
                    gr.Warning(msg)
                    return gr.skip(), error_markdown(msg)
                return [str(f) for f in files], ""
            return export

        # ------------------------------------------------------------------ wiring
        quick = dict(concurrency_limit=None, show_progress="hidden")
        load = dict(concurrency_id="load", concurrency_limit=1, show_progress="hidden")
        live_io = live_outputs + [timer]

        method.change(lambda m, t, v: _verifier_update(m, t, v), [method, temperature, verifier], verifier, **quick)
        method.change(lambda m: (METHOD_HINTS.get(m, ""), *_param_updates(m)), method,
                      [method_hint, budget, depth, width, threshold], **quick)
        temperature.change(lambda m, t, v: _verifier_update(m, t, v), [method, temperature, verifier], verifier, **quick)
        example.change(lambda label: dict(examples).get(label, gr.skip()) if label else gr.skip(), example, prompt, **quick)

        run_btn.click(on_run, [session, block_size, with_baseline, *form], live_io, **load)
        timer.tick(on_tick, [session, block_size], live_io, trigger_mode="once", concurrency_id="render",
                   concurrency_limit=4, show_progress="hidden")
        pause_btn.click(on_pause, [session, block_size], live_io, **quick)
        step_btn.click(on_step, [session, block_size, *form], live_io, **load)
        stop_btn.click(on_stop, [session, block_size], live_io, **quick)
        step_slider.release(on_select_step, [session, step_slider, block_size], step_outputs, **quick)
        block_size.change(on_select_step, [session, step_slider, block_size], step_outputs, **quick)
        cmp_btn.click(on_compare, [session, cmp_method, cmp_hf, *form], compare_outputs, **load)
        cmp_stop.click(on_compare_stop, session, cmp_status, **quick)
        open_run.upload(on_open_run, [session, block_size, open_run], live_io, **load)
        for btn, kind in ((png_btn, "png"), (svg_btn, "svg"), (json_btn, "json")):
            btn.click(on_export(kind), [session, step_slider, block_size], [export_files, error_box],
                      concurrency_id="export", concurrency_limit=1)

    demo.queue(default_concurrency_limit=1)
    return demo
