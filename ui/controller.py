"""What the page's events do: start, step, pause, stop and replay runs, compare methods, export.

Every handler returns ``{component: update}`` for the components it changes (``Components`` names
them), so an event's outputs can be reordered or extended without touching the handlers.
Per-browser state is the ``SessionState`` the event passes in; one lock per app serialises
decoding steps on the shared models, so sessions take turns instead of clobbering each other.
"""

from __future__ import annotations

import inspect
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import gradio as gr

from dyntree_core.interrupt import LoadStopped, stops_loads_on
from dyntree_core.openmp_team import release_thread_team
from dyntree_core.process_memory import process_memory
from dyntree_core.system_counters import read_counters, spent
from dyntree_core.trace import PrefillProgress

from .app_log import RunClock
from .errors import describe_error, error_markdown
from .export import read_json, write_images, write_json
from .layout import METHOD_HINTS, N_COMPARE, Components, verifier_choices
from .model_lock import ModelLock
from .models import ModelProvider
from .runner import HF_ASSISTED_LABEL, remember_peer, run_hf_assisted, start_generation
from .session import ExternalRun, Generation, RunRecord, SessionRegistry, SessionState
from .settings import METHOD_PARAMS, RunSettings, settings_from_form
from .views import compare_views, export_figures, run_view, stale_figures_html, step_view
from .memory import memory_line
from .planner import BackgroundPlanner
from .worker import DecodeWorker, advance_in_turn

Updates = dict[Any, Any]


#: unchanged refreshes without a run after which the page refreshes every ``IDLE_INTERVAL_S`` seconds (an
#: event of the page that changes what it shows brings the streaming interval back at once: ``on_wake``)
IDLE_TICKS = 5
IDLE_INTERVAL_S = float(os.environ.get("DYNTREE_UI_IDLE_INTERVAL", "5.0"))
#: after a Stop, until the run has ended (at most ``STOPPING_FOR_S`` seconds), the page refreshes this often, so
#: the stopped run shows at once instead of up to a streaming interval later
STOPPING_INTERVAL_S = 0.2
STOPPING_FOR_S = 5.0


def figures_due(state: SessionState, rec: Optional[RunRecord], looking_at: tuple) -> bool:
    """Whether this refresh redraws the figures (and the walkthrough): always once a run is not
    streaming (finished, paused, stopped) or the user picked another step, decision or block size; else at the
    page's ``FigurePacing`` interval (``FIGURE_INTERVAL_S`` where redraws cost decoding little), the first one
    that interval after the run began (a run that ends sooner is drawn once, at its end): the redraw at a run's
    first refresh cost the default Run in Chromium on the 2-core Zen 4 VM ~10% of its ms/token, prefill included
    (medians of 16 Runs each way in two A/Bs: 37.6 vs 32.9 and 38.9 vs 34.8 ms/token; its decoding steps alone
    moved within the noise). ``Controller.live`` dims the previous run's figures until then
    (``views.stale_figures_html``)."""
    now = time.monotonic()
    streaming = rec is not None and rec.status == "running" and state.running
    pacing = state.figure_pacing
    if not streaming:
        pacing.sent(None)  # (a redraw of a run no longer streaming measures nothing)
    elif pacing.probe_at is not None:
        pacing.read([(t.elapsed, t.step_seconds) for t in rec.traces])
    picked = state.figures_key is not None and looking_at != state.figures_key  # another step, decision or block
    if streaming and not picked and now - max(state.figures_at, state.run_started_at) < pacing.interval_s:
        return False
    state.figures_at, state.figures_key = now, looking_at
    if streaming and pacing.probe_at is None:
        pacing.sent(rec.traces[-1].elapsed if rec.traces else None)
    return True


#: the status's line while a Run whose Pause was clicked during its load still loads
PAUSED_AFTER_LOAD = "paused: the run starts paused once the models are ready (Resume starts it)"


class Controller:
    """The handlers of one app (``build_app`` wires them to ``c``'s components)."""

    def __init__(self, provider: ModelProvider, c: Components, examples: list[tuple[str, str]],
                 stream_interval_s: float, timer: Optional[gr.Timer] = None):
        self.provider = provider
        self.c = c
        self.examples = dict(examples)
        self.stream_interval_s = stream_interval_s
        self.timer = timer  # the page's refresh timer (its interval is paced by ``on_tick`` / ``on_wake``)
        self.model_lock = ModelLock()  # one prefill chunk or decoding step at a time on the shared models
        self.sessions = SessionRegistry()  # each tab's SessionState
        self.planner = BackgroundPlanner(self.model_lock)  # auto's measurements, in idle turns
        self._remeasured: set = set()  # profile rows measured again after a run off its prediction

    def close(self, timeout_s: float = 60.0) -> bool:
        """Stop every session's run and the background measurement, and wait for them (the app is shutting down: a
        thread still inside torch while the interpreter exits aborts the process, "terminate called without an
        active exception"). Then one turn on the models, so a Compare's step or a load under way has ended too (its
        stop is set: it takes no other). True once everything stopped within ``timeout_s`` each."""
        stopped = self.planner.close(timeout_s)
        for state in [self.sessions.close(key) for key in self.sessions.keys()]:
            joined = state is None or state.join(timeout_s)
            stopped = stopped and joined
        if self.model_lock.acquire("the app shutting down", timeout_s=timeout_s) is None:
            return False  # (a step that never ends: the app exits beside it rather than hang)
        self.model_lock.release()
        return stopped

    def bound(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn(state, *inputs)`` as a Gradio handler: the tab's ``SessionState`` is found by the
        request's session (``SessionRegistry``), so every event of a tab sees the same state. Gradio's worker
        thread leaves no OpenMP workers behind (a figure's torch ops start a team: ``openmp_team``)."""
        if inspect.isgeneratorfunction(fn):
            def handler(request: gr.Request, *inputs):
                try:
                    yield from fn(self.sessions.get(request.session_hash), *inputs)
                finally:
                    release_thread_team()
        else:
            def handler(request: gr.Request, *inputs):
                try:
                    return fn(self.sessions.get(request.session_hash), *inputs)
                finally:
                    release_thread_team()
        handler.__name__ = getattr(fn, "__name__", "handler")
        return handler

    def on_unload(self, request: gr.Request) -> None:
        """The tab was closed or reloaded: its run stops and its state goes."""
        self.sessions.close(request.session_hash)

    # ------------------------------------------------------------------ form helpers
    def method_changed(self, method: str) -> Updates:
        used = METHOD_PARAMS.get(method, frozenset())
        c = self.c
        return {c.method_hint: METHOD_HINTS.get(method, ""),
                **{getattr(c, name): gr.update(interactive=name in used) for name in ("budget", "depth", "width", "threshold")}}

    @staticmethod
    def verifier_update(method: str, temperature: float, current: Optional[str]) -> Any:
        choices = verifier_choices(method, temperature)
        return gr.Dropdown(choices=choices, value=current if current in choices else "auto")

    def prompt_info(self, state: SessionState, draft: str, target: str, prompt: str, chat: bool,
                    max_new_tokens: Any, budget: Any) -> str:
        """The line under the prompt box: its token count, the limit, and the predicted prefill time
        (``prompt_check.prefill_rate``; nothing is loaded or measured for it)."""
        if not prompt or not prompt.strip():
            return ""
        try:
            info = self.provider.text_info(str(draft), str(target))
        except Exception:  # noqa: BLE001 - a bad model name is reported on Run
            info = None
        if info is None:
            return "token count: known once the models are loaded (first Run)"
        from .prompt_check import check_prompt, prefill_rate
        from .runner import encode_prompt

        ids = encode_prompt(info.tokenizer, prompt, chat=bool(chat) and info.supports_chat)
        rate, source = prefill_rate(state.record, str(draft).strip(), str(target).strip())
        try:
            new, size = int(float(max_new_tokens)), int(float(budget))
        except (TypeError, ValueError):
            new, size = 0, 0
        return check_prompt(ids, info.context, new, size, rate, source).markdown()

    def example_chosen(self, label: Optional[str]) -> Any:
        return self.examples.get(label, gr.skip()) if label else gr.skip()

    # ------------------------------------------------------------------ rendering
    def pause_label(self, state: SessionState, label: str) -> Any:
        """Re-render the Pause/Resume button only when its label changes (a button that is
        re-rendered on every refresh cannot be clicked reliably)."""
        if state.pause_label == label:
            return gr.skip()
        state.pause_label = label
        return gr.Button(label)

    def load_line(self, state: SessionState) -> str:
        """The provider's latest load line, shown under the notice while models load ("" without a notice)."""
        return getattr(self.provider, "progress", "") if state.notice else ""

    def status_line(self, state: SessionState, status: str) -> str:
        if state.notice:
            line = self.load_line(state)
            if state.load_stop is not None and state.load_stop.is_set():
                line = "stopping the load …"
            lines = [state.notice] + [f"_{x}_" for x in (line, state.pause_after_load and PAUSED_AFTER_LOAD) if x]
            return "  \n".join(lines)
        if state.load_stopped:
            status = f"{state.load_stopped}  \n{status}"
        if state.running and state.generation is not None and state.generation.stop_event.is_set():
            status += "  \n_stopping after the current step …_"
        elif state.running and state.worker is not None and state.worker.pause_requested:
            status += "  \n_pausing after the current step …_"
        if state.baseline_running:
            status += "  \n_running the autoregressive baseline …_"
        paced = state.figure_pacing.note() if state.running else ""
        if paced:
            status += f"  \n_{paced}_"
        return status

    def live(self, state: SessionState, block: int) -> Updates:
        """All Live-tab updates for the session's current run, at the step the user picked
        (``state.view_step``) or else the latest."""
        state.rendered_version = state.version
        live_rec = state.record
        rec = live_rec.snapshot() if live_rec is not None else None  # (a worker may be extending it)
        baseline = state.baseline_for(rec.settings) if rec is not None else None
        n = len(rec.traces) if rec is not None else 0
        idx = n - 1 if state.view_step is None else min(state.view_step, n - 1)
        paused = (rec is not None and rec.status == "paused" and state.active and not state.running) or \
            state.pause_after_load
        decision = state.walk[1] if state.walk is not None and state.walk[0] == idx else None
        figures = figures_due(state, rec, (state.view_step, decision, block))
        rv = run_view(rec, rec if baseline is not None and baseline is live_rec else baseline, figures)
        c = self.c
        drawn: Updates = dict.fromkeys((c.tree_plot, c.mask_bfs, c.mask_dfs, c.mask_hpd, c.phase_plot, c.walkthrough,
                                        c.speed_plot, c.steps_plot), gr.skip())
        if figures:
            sv = step_view(rec, None if state.view_step is None else idx, block, decision)
            drawn = {c.tree_plot: sv.tree, c.mask_bfs: sv.masks[0], c.mask_dfs: sv.masks[1], c.mask_hpd: sv.masks[2],
                     c.phase_plot: sv.phases, c.walkthrough: sv.walkthrough, c.speed_plot: rv.speed,
                     c.steps_plot: rv.per_step}
        elif state.figures_stale:  # a new run whose first redraw is not due yet: the previous run's figures, dimmed
            drawn[c.walkthrough] = stale_figures_html(state.figure_pacing.interval_s)
        state.figures_stale = False
        return {
            **drawn,
            c.text_html: rv.text_html,
            c.cost_model: rv.cost,  # (every refresh, as the status line: both show the run's measured ms/token)
            c.status: self.status_line(state, rv.status),
            c.step_slider: gr.Slider(minimum=0, maximum=max(n - 1, 1), value=max(idx, 0), step=1, interactive=n > 1),
            c.error_box: error_markdown(state.error),
            c.pause_btn: self.pause_label(state, "Resume" if paused else "Pause"),
            c.memory: self.memory_update(state),
        }

    def memory_update(self, state: SessionState) -> Any:
        """The footer: the app's memory, auto's background measurement and the loaded models, re-sent only
        when a line changed or the memory moved by 0.1 GB or more since the page last showed it (no
        repaint for the noise between two ticks)."""
        now = process_memory()
        rss = None if now is None else now.rss
        loaded = self.provider.loaded_description()
        lines = (self.planner.status(), f"models: {loaded}" if loaded else "")
        if (rss is None or abs(rss - state.rendered_memory) < 1e8) and lines == state.rendered_background:
            return gr.skip()
        state.rendered_memory, state.rendered_background = rss or 0, lines
        return " · ".join(x for x in (memory_line(now), *lines) if x)

    def fail(self, state: SessionState, exc: BaseException) -> None:
        """Show ``exc`` as a pop-up now and in the inline error line from the next refresh on."""
        state.notice = ""
        state.error = describe_error(exc)
        gr.Warning(state.error)
        state.bump()

    # ------------------------------------------------------------------ run lifecycle
    def acknowledge(self, state: SessionState) -> None:
        """A new Run/Step click: the previous error goes at the next refresh, not after the models load."""
        state.error = ""
        state.load_stopped = ""
        state.pause_after_load = False
        state.bump()

    def halt(self, state: SessionState, wait_s: float = 120.0) -> None:
        """Pause the background worker (if any) and wait for its current step to end."""
        if state.worker is not None:
            state.worker.request_pause()
            state.worker.join(wait_s)

    def launch(self, state: SessionState, gen: Optional[Generation] = None,
               baseline_of: Optional[RunSettings] = None) -> None:
        """Run ``gen`` (default: the session's generation) on a background worker; when
        ``baseline_of`` is given (or was given when this run started) an AR baseline follows."""
        gen = gen or state.generation
        if baseline_of is None:
            baseline_of = state.baseline_request
        assert gen is not None

        def error(e: BaseException) -> None:
            state.error = describe_error(e)
            state.error_popup = True

        def after() -> None:
            rec = gen.record
            self.check_prediction(rec)
            if rec.config.method == "autoregressive" and rec.status == "finished":
                state.baselines[rec.settings.baseline_key()] = rec
            if baseline_of is not None and rec.status == "finished" and state.baseline_for(baseline_of) is None:
                state.baseline_running = True
                state.bump()
                try:
                    with self.model_lock.turn(f"{state.name}: loading the models"):
                        base = start_generation(self.provider, baseline_of.with_method("autoregressive"),
                                                planner=self.planner)
                    base.record.status = "running"
                    while not gen.stop_event.is_set():
                        if advance_in_turn(base, self.model_lock, f"{state.name}: AR baseline",
                                           state.bump) is None or base.done:
                            break
                    if base.record.status == "finished":
                        state.baselines[baseline_of.baseline_key()] = base.record
                finally:
                    state.baseline_running = False

        clock = state.run_clock if gen is state.generation else None
        state.worker = DecodeWorker(gen, self.model_lock, state.bump, error, after, who=state.name,
                                    clock=clock).start()

    def check_prediction(self, rec: RunRecord) -> None:
        """A finished run off its prediction by more than ``prediction.OFF_BY``: the profile rows that
        priced its wrong parts are measured again in the background (each at most once per app)."""
        check = rec.prediction_check()
        if check is None or rec.status != "finished" or rec.form is None:
            return
        pair = rec.form.pair_spec()
        rows = [r for r in check.rows_to_remeasure() if (pair, r) not in self._remeasured]
        if not rows:
            return
        self._remeasured.update((pair, r) for r in rows)
        try:
            rec.remeasuring = self.provider.remeasure(rec.form, rows, self.planner, rec.prediction.read_gb_per_s)
        except Exception as e:  # noqa: BLE001 - the run stands; the page says the rows were not re-measured
            rec.note = f"{rec.note}; re-measuring the profile failed: {describe_error(e)}"

    def begin(self, state: SessionState, settings: RunSettings) -> bool:
        """Replace the session's generation with a new one (the page shows a loading notice meanwhile). False where
        the load was stopped (Stop, the tab closed, the app shutting down: ``state.load_stop``): the session keeps
        its previous run and the status says nothing ran."""
        self.halt(state)
        if state.generation is not None and not state.generation.done:
            state.generation.stop_now()
        state.error = ""
        state.view_step = None
        self.provider.progress = ""  # (the last load's line would show under this load's notice)
        if settings.needs_auto:
            state.notice = (f"auto: choosing the configuration for this machine ({settings.draft} / "
                            f"{settings.target}) and loading the models … (a pair the set-up did not prepare "
                            "has its kernels measured and its weights packed once)")
        elif not self.provider.is_loaded(settings.pair_spec()):
            state.notice = (f"Loading models {settings.draft} / {settings.target} at target {settings.precision}, "
                            f"draft {settings.draft_precision} … (a precision not loaded before is read from "
                            "the model files: the first load can take a while)")
        stop = state.load_stop = threading.Event()
        state.bump()
        clock = state.run_clock
        before = read_counters()
        gen: Optional[Generation] = None
        try:
            with self.model_lock.turn(f"{state.name}: loading the models"):  # (not beside another's step)
                # (set inside the turn: a session waiting for it must not hear another session's load)
                self.provider.progress_listener = None if clock is None else clock.phase
                try:
                    with stops_loads_on(stop):  # (the load ends at its next tensor: ``load_progress``)
                        gen = start_generation(self.provider, settings, planner=self.planner, plain_probes=True)
                except LoadStopped:
                    pass
                finally:
                    self.provider.progress_listener = None
            if gen is not None:
                state.generation = gen  # (before the last look at ``stop``: ``SessionState.close`` stops one or the other)
                if stop.is_set():
                    gen.stop_now()
        finally:
            state.notice = ""
            state.load_stop = None
            paused, state.pause_after_load = state.pause_after_load, False  # (a Pause clicked during the load)
        if stop.is_set():
            waited = spent(before, read_counters())
            state.load_stopped = f"Stopped while loading the models ({waited.wall_s:.1f} s in): nothing ran."
            if clock is not None:
                clock.phase(f"load stopped ({waited.text()})")
            state.bump()
            return False
        assert state.generation is gen and gen is not None
        if clock is not None:
            run = state.generation.record.settings
            clock.phase(f"models ready: {run.method}, target {run.precision}, draft {run.draft_precision} (planning "
                        f"and loading: {spent(before, read_counters()).text()})")
        self.measure_costs(state.generation.record)
        # (Run or Step: it runs at once, but for a Pause clicked during its load)
        state.generation.record.status = "paused" if paused else "running"
        state.record = state.generation.record
        state.baseline_request = None
        state.run_started_at, state.figures_stale = time.monotonic(), True
        state.bump()
        return True

    def measure_costs(self, rec: RunRecord) -> None:
        """What the cost-model panel needs besides the run's own timings: the pair's parameter
        counts and, for a tree method that does not time plain decoding inside the run
        (``RunRecord.plain_probed``), the plain-decoding reference timed now, next to the run, on
        its mean context (the prompt and half the new tokens), under the model lock."""
        try:
            pair = self.provider.load(rec.settings.pair_spec())
            with self.model_lock:
                rec.model_params = pair.params()
                if rec.config.method != "autoregressive" and not rec.plain_probed:
                    context = len(rec.prompt_ids) + max(0, int(rec.settings.max_new_tokens)) // 2
                    rec.ar_timing = pair.time_one_token_forward(rec.config, context)
                    rec.one_token_forward_s = rec.ar_timing.mean_seconds
        except Exception:  # noqa: BLE001 - the panel then asks for the AR baseline instead
            rec.one_token_forward_s, rec.ar_timing = None, None

    # ------------------------------------------------------------------ Live tab events
    # The Live tab has one writer: ``on_tick``. The other events change the session's state and
    # bump its version; the next tick (at most one timer interval later) draws it. Two events
    # writing the same components at once can leave the page waiting forever (seen with Gradio
    # 6.31 when Pause was clicked while a refresh was in flight: no refresh came after it).
    def on_tick(self, state: SessionState, block: int) -> Updates:
        """Timer refresh: repaint only when something changed; after ``IDLE_TICKS`` refreshes with nothing
        to show and no run going, the page refreshes every ``IDLE_INTERVAL_S`` only (``_pace``)."""
        if state.error_popup:
            state.error_popup = False
            gr.Warning(state.error)
            return {**self.live(state, block), **self._pace(state, changed=True)}
        prefill = state.record.prefill if state.record is not None else None
        loading = self.load_line(state)
        if (state.version == state.rendered_version and prefill == state.rendered_prefill
                and loading == state.rendered_loading):
            footer = self.memory_update(state)
            # (an empty dict is refused as "too few outputs")
            return {self.c.memory: footer, **self._pace(state, changed=footer != gr.skip())}
        state.rendered_prefill, state.rendered_loading = prefill, loading
        return {**self.live(state, block), **self._pace(state, changed=True)}

    def on_wake(self, state: SessionState) -> Any:
        """After an event of the page that changes what it shows (Run, Step, Pause, the step slider, the
        walkthrough, an opened run): refresh at the streaming interval again at once (Stop: ``on_stop``)."""
        state.idle_ticks = 0
        timer = self._retime(state)
        return gr.skip() if timer is None else timer

    def _interval(self, state: SessionState) -> float:
        """The refresh interval the page should poll at now (``_pace``)."""
        gen = state.generation
        if (gen is not None and not gen.done and gen.stop_event.is_set()
                and time.monotonic() - state.stop_clicked_at < STOPPING_FOR_S):
            return STOPPING_INTERVAL_S
        return IDLE_INTERVAL_S if state.idle_ticks >= IDLE_TICKS else self.stream_interval_s

    def _retime(self, state: SessionState) -> Optional[gr.Timer]:
        """The timer's update for ``_interval`` (None when it already polls at it)."""
        want = self._interval(state)
        if want == (state.timer_interval or self.stream_interval_s):
            return None
        state.timer_interval = want
        return gr.Timer(value=want)

    def _pace(self, state: SessionState, changed: bool) -> Updates:
        """The refresh timer's interval: the streaming interval while anything moves; ``IDLE_INTERVAL_S``
        after ``IDLE_TICKS`` unchanged refreshes without a run (each refresh is a round trip: one per second cost
        Chromium ~3% of a core of the 2-core AVX2 machine, ``scripts/idle_cpu.py``); ``STOPPING_INTERVAL_S``
        from a Stop until the run has ended."""
        if self.timer is None:
            return {}
        state.idle_ticks = 0 if changed or state.running else state.idle_ticks + 1
        timer = self._retime(state)
        return {} if timer is None else {self.timer: timer}

    def on_run(self, state: SessionState, baseline: bool, *values) -> None:
        self.acknowledge(state)
        state.run_clock = RunClock(state.name)
        try:
            settings = settings_from_form(*values)
            settings.validate()
            if not self.begin(state, settings):
                return
        except Exception as e:  # noqa: BLE001 - shown in the page; the app stays usable
            self.fail(state, e)
            return
        state.baseline_request = settings if baseline else None
        if state.record.status != "paused":  # (Pause clicked while the models loaded: Resume starts it)
            self.launch(state)

    def on_pause(self, state: SessionState) -> None:
        if state.load_stop is not None:  # (the Run's models are loading: it starts paused; a second click undoes it)
            state.pause_after_load = not state.pause_after_load
            state.bump()
            return
        rec = state.record
        if state.running and rec is not None and rec.status == "running":
            self.halt(state, wait_s=0)  # the worker stops after its current step
        elif state.active and not state.running and rec is not None and rec.status == "paused":
            self.launch(state)  # resume
        state.bump()

    def on_step(self, state: SessionState, *values) -> None:
        self.acknowledge(state)
        try:
            self.halt(state)
            if not state.active:
                settings = settings_from_form(*values)
                settings.validate()
                if not self.begin(state, settings):
                    return
            gen: Generation = state.generation  # type: ignore[assignment]
            state.view_step = None
            while isinstance(advance_in_turn(gen, self.model_lock, state.name, state.bump), PrefillProgress):
                state.bump()  # through the prefill's chunks, one turn each, up to one step
            if not gen.done:
                gen.record.status = "paused"
            elif gen.record.config.method == "autoregressive" and gen.record.status == "finished":
                state.baselines[gen.record.settings.baseline_key()] = gen.record
            state.bump()
        except Exception as e:  # noqa: BLE001
            self.fail(state, e)

    def on_stop(self, state: SessionState) -> Any:
        """Stop the run (the worker ends it after its current step, or within its prefill chunk); the page then
        refreshes every ``STOPPING_INTERVAL_S`` until the run has ended (the returned timer update)."""
        if state.compare_stop is not None:
            state.compare_stop.set()
        if state.load_stop is not None:  # (a Run still loading its models: the load ends at its next tensor)
            state.load_stop.set()
        gen = state.generation
        if gen is not None and not gen.done:
            if state.running:
                state.stop_clicked_at = time.monotonic()
                gen.stop_event.set()
            else:
                gen.stop_now()
        state.bump()
        return self.on_wake(state)

    def on_select_step(self, state: SessionState, step: Optional[float]) -> None:
        """The slider moved (mouse, keyboard or its number box, unprocessed: a box being typed in may
        be empty, ``None``, or past either end): show that step; past the last one, follow the run."""
        if step is None:
            return
        n = len(state.record.traces) if state.record is not None else 0
        state.view_step = None if n == 0 or int(step) >= n - 1 else max(int(step), 0)
        state.bump()

    def on_walk(self, delta: int):
        """Previous (``delta = -1``) / next (``+1``) decision of the shown step's verification."""
        def walk(state: SessionState) -> None:
            rec = state.record
            if rec is None or not rec.traces:
                return
            n = len(rec.traces)
            step = n - 1 if state.view_step is None else min(state.view_step, n - 1)
            count = len(rec.traces[step].decisions)
            if count == 0:
                return
            if state.walk is None or state.walk[0] != step:
                state.walk = (step, 0 if delta > 0 else count - 1)
            else:
                state.walk = (step, max(0, min(count - 1, state.walk[1] + delta)))
            state.bump()

        walk.__name__ = "on_walk_next" if delta > 0 else "on_walk_prev"
        return walk

    def on_block_size(self, state: SessionState) -> None:
        state.bump()

    def on_open_run(self, state: SessionState, path: Optional[str]) -> None:
        """Show an exported run (``ui.export.read_json``) in the Live tab; the current generation
        ends first (its steps are kept in its own export, not here)."""
        if not path:  # the file was cleared
            return
        try:
            rec = read_json(Path(path))
        except Exception as e:  # noqa: BLE001 - shown inline, the session goes on
            self.fail(state, e)
            return
        self.halt(state)
        if state.generation is not None and not state.generation.done:
            state.generation.stop_now()
        state.generation = None
        state.record = rec
        state.error = ""
        state.view_step = None
        state.bump()

    def on_export(self, kind: str):
        def export(state: SessionState, step: float, block: int) -> Updates:
            rec = state.record
            c = self.c
            if rec is None or not rec.traces:
                gr.Info("Nothing to export yet: Run (or Step) first, then export the steps you see.")
                return {c.export_files: gr.skip()}
            out = Path(state.export_dir()) / f"export-{time.strftime('%H%M%S')}-{kind}"
            try:
                if kind == "json":
                    files = [write_json(rec, out / "steptraces.json")]
                else:
                    files = write_images(export_figures(rec, step, block), out, (kind,))
            except Exception as e:  # noqa: BLE001
                self.fail(state, e)
                return {c.export_files: gr.skip()}
            if state.error:
                state.error = ""
                state.bump()
            return {c.export_files: [str(f) for f in files]}

        export.__name__ = f"on_export_{kind}"
        return export

    # ------------------------------------------------------------------ Compare tab events
    def compare_updates(self, records: list[RunRecord | ExternalRun], note: str, error: str = "") -> Updates:
        texts, stats, speed, per_step = compare_views(records)
        c = self.c
        out: Updates = {c.cmp_speed: speed, c.cmp_steps: per_step,
                        c.cmp_status: f"{note}\n\n{error_markdown(error)}" if error else note}
        for i in range(N_COMPARE):
            out[c.cmp_texts[i]] = texts[i] if i < len(texts) else ""
            if i < len(stats):
                out[c.cmp_stats[i]] = stats[i]
        return out

    def compare_progress(self, note: str) -> Updates:
        return {self.c.cmp_status: note}

    def on_compare(self, state: SessionState, tree_method: str, with_hf: bool, *values) -> Iterator[Updates]:
        records: list[RunRecord | ExternalRun] = []
        stop = threading.Event()
        state.compare_stop = stop
        yield self.compare_progress("starting …")  # the previous status goes at once
        try:
            settings = settings_from_form(*values)
            settings.validate()
            for m in ("autoregressive", "chain", tree_method):
                s = settings.with_method(m)
                if not self.provider.is_loaded(s.pair_spec()):
                    yield self.compare_progress("Loading models …")
                try:
                    with self.model_lock.turn(f"{state.name}: loading the models"), stops_loads_on(stop):
                        gen = start_generation(self.provider, s, stop, planner=self.planner)
                except LoadStopped:
                    break
                records.append(gen.record)
                gen.record.status = "running"
                yield self.compare_updates(records, f"running {gen.record.label} …")
                last = time.monotonic()
                while True:
                    if advance_in_turn(gen, self.model_lock, f"{state.name}: compare") is None or gen.done:
                        break
                    if time.monotonic() - last >= 2 * self.stream_interval_s:  # partial text as it grows
                        last = time.monotonic()
                        yield self.compare_updates(records, f"running {gen.record.label} … "
                                                            f"{gen.record.summary()['tokens']} tokens")
                if stop.is_set():
                    break
            if with_hf and not stop.is_set():
                yield from self.compare_hf_assisted(settings, stop, records, f"{state.name}: transformers assisted")
                remember_peer(records[0], records[-1])
        except Exception as e:  # noqa: BLE001
            msg = describe_error(e)
            gr.Warning(msg)
            state.compare = records
            yield self.compare_updates(records, "", msg)
            return
        state.compare = records
        if records and records[0].status == "finished":
            state.baselines[records[0].settings.baseline_key()] = records[0]
        yield self.compare_updates(records, "stopped" if stop.is_set() else
                                   f"done: same prompt, seed and max new tokens ({settings.max_new_tokens})")

    def compare_hf_assisted(self, settings: RunSettings, stop: threading.Event,
                            records: list[RunRecord | ExternalRun], who: str) -> Iterator[Updates]:
        """Run transformers' assisted generation in a thread (holding the model lock) and stream
        its progress; its result is appended to ``records``."""
        records.append(ExternalRun(label=HF_ASSISTED_LABEL))
        yield self.compare_updates(records, f"running {HF_ASSISTED_LABEL} …")
        tokens = [0]
        box: dict = {}

        def work() -> None:
            try:
                with self.model_lock.turn(who):
                    box["run"] = run_hf_assisted(self.provider, settings, stop,
                                                 progress=lambda n: tokens.__setitem__(0, n), planner=self.planner)
            except Exception as e:  # noqa: BLE001
                box["error"] = e

        th = threading.Thread(target=work, daemon=True)
        th.start()
        while th.is_alive():
            th.join(2 * self.stream_interval_s)
            if th.is_alive():
                yield self.compare_progress(f"running {HF_ASSISTED_LABEL} … {tokens[0]} tokens")
        if "error" in box:
            raise box["error"]
        records[-1] = box["run"]

    def on_compare_stop(self, state: SessionState) -> Any:
        if state.compare_stop is not None and not state.compare_stop.is_set():
            state.compare_stop.set()
            return "stopping after the current step …"
        return gr.skip()
