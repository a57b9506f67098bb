"""Per-browser-session state: the current run, its live generator, AR baselines, compare runs.

A ``SessionState`` belongs to one browser tab (``SessionRegistry``); nothing here is global.
``Generation`` wraps the engine's ``Iterator[StepTrace]`` so Run, Step, Pause and Stop can
advance or end the same generation from different events.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import statistics
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Literal, Optional

from dyntree_core.config import DecodeConfig
from dyntree_core.drafting.repeats import repeat_steps
from dyntree_core.measured import others_share, sample
from dyntree_core.planning.cost_model import ar_reference
from dyntree_core.planning.forward_timer import ForwardTiming
from dyntree_core.planning.prediction import Prediction, PredictionCheck, check_prediction
from dyntree_core.planning.profiling import run_probe
from dyntree_core.trace import PrefillProgress, StepTrace, TokenProvenance

from .app_log import RunClock
from .figure_pacing import FigurePacing
from .settings import RunSettings
from .tokens import TokenTexts

RunStatus = Literal["running", "paused", "finished", "stopped", "error"]


@dataclass
class RunRecord:
    """One generation: settings, prompt, the StepTraces so far and how it ended."""

    settings: RunSettings
    config: DecodeConfig
    prompt_ids: list[int]
    texts: TokenTexts
    traces: list[StepTrace] = field(default_factory=list)
    status: RunStatus = "paused"
    message: str = ""
    note: str = ""  # why auto chose this configuration (empty when nothing was auto)
    one_token_forward_s: Optional[float] = None  # the target's measured 1-token forward (cost model)
    ar_timing: Optional[ForwardTiming] = None  # that forward's timing: when, on what context, under what load
    plain_probed: bool = False  # plain decoding is timed inside this run (``decode.plain_probes``), not beside it
    model_params: tuple[int, int] = (0, 0)  # logical parameter counts (draft, target)
    prefill: tuple[int, int] = (0, 0)  # prompt tokens prefilled so far / in all (target + draft)
    prefill_seconds: Optional[float] = None  # wall time of the prefill once it ended
    compiling: str = ""  # what the first step compiles (graph steps on a GPU), shown while it runs
    waiting: str = ""  # while this run waits for the shared models: what holds them
    wait_seconds: float = 0.0  # time spent waiting for other sessions' chunks and steps
    prediction: Optional[Prediction] = None  # what auto priced this run at (None: not a run auto priced)
    form: Optional[RunSettings] = None  # the settings as the form gave them (``auto`` unresolved)
    remeasuring: tuple = ()  # profile rows (``ProfileRow``) being measured again because this run was off
    cpu_window: tuple = (None, None)  # ``measured.Sample``s at its first decoding step and at its end
    read_window: tuple = (None, None)  # the memory's read GB/s before its first step and after its end (probed
    # only where its prediction's profile was: ``PredictionCheck.other_spell``)

    def snapshot(self) -> "RunRecord":
        """A copy to draw from while a worker thread extends this record. The status is read before
        the steps: the worker appends a step's trace and only then sets the status the run ends
        with, so a snapshot that says finished holds every step (a page that read the steps first
        could show 'finished' above a text one step short)."""
        status = self.status
        return dataclasses.replace(self, status=status, traces=list(self.traces))

    def prediction_check(self) -> Optional[PredictionCheck]:
        """The run's steps so far against its prediction (None without one, or before a step), with how much of
        the CPUs other processes used from its first step to its end (or now), and its speed over plain decoding
        timed inside it or beside it (the cost panel's reference where no baseline run was made)."""
        if self.prediction is None:
            return None
        import torch

        start, end = self.cpu_window
        end = end or (sample() if start is not None else None)
        plain = ar_reference(None, self.ar_timing, self.one_token_forward_s, inside=self.traces)
        return check_prediction(self.prediction, self.traces, others_share(start, end),
                                cpus=end.cpus_counted if end is not None else None, threads=torch.get_num_threads(),
                                read_gb_per_s=self.read_window,
                                plain_s_per_token=plain.seconds_per_token if plain is not None else None,
                                plain_inside=plain.inside if plain is not None else 0)

    @property
    def label(self) -> str:
        v = self.config.resolved_verifier()
        return self.config.method if v == "none" else f"{self.config.method} / {v}"

    @property
    def token_ids(self) -> list[int]:
        return [c.token_id for t in self.traces for c in t.committed]

    def root_token(self, step: int) -> int:
        """The last committed token before ``step`` (the root of that step's tree)."""
        for t in reversed(self.traces[:step]):
            if t.committed:
                return t.committed[-1].token_id
        return self.prompt_ids[-1]

    def summary(self) -> dict:
        n = len(self.traces)
        per_step = [t.num_committed for t in self.traces]
        last = self.traces[-1] if self.traces else None
        return {
            "steps": n,
            "tokens": sum(per_step),
            "seconds": last.elapsed if last else 0.0,
            "tokens_per_s": last.tokens_per_s if last else math.nan,
            "mean_tokens_per_step": statistics.fmean(per_step) if per_step else math.nan,
            "finish_reason": last.finish_reason if last else None,
            "suffix_steps": sum(1 for t in self.traces if t.draft_source == "suffix"),
            "repeat_steps": repeat_steps(self.traces),
            "fallback": next((f"after step {t.step + 1}: {t.fallback}" for t in self.traces if t.fallback), ""),
        }


@dataclass(frozen=True)
class RoundPoint:
    """One decoding round of a run that has no StepTraces (transformers' assisted generation):
    the fields the speed and tokens-per-step charts read from a ``StepTrace``."""

    step: int
    num_committed: int
    elapsed: float  # seconds since generation started (prefill included)
    total_new_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.total_new_tokens / self.elapsed if self.elapsed > 0 else 0.0


@dataclass
class ExternalRun:
    """A Compare column produced by another implementation on the same models, prompt and
    sampling settings (transformers' ``generate(assistant_model=draft)``): its text, and per
    round the tokens delivered and the time. No tree and no per-token provenance."""

    label: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    rounds: list[RoundPoint] = field(default_factory=list)
    status: RunStatus = "running"
    note: str = ""
    prompt: str = ""  # shown before the text, as in the other columns
    texts: Optional[TokenTexts] = None  # token pieces (None: show ``text`` plain)
    precisions: str = ""  # what it ran at ("target int4, draft int4"; '' before it started)

    @property
    def traces(self) -> list[RoundPoint]:  # what the charts plot
        return self.rounds

    def provenance(self) -> list[TokenProvenance]:
        """Each round's tokens as the speculative columns show theirs: a round of n tokens is n - 1
        draft tokens the target accepted and the target's own token (assisted generation ends
        every round with one)."""
        out: list[TokenProvenance] = []
        ids = iter(self.token_ids)
        for r in self.rounds:
            for j in range(r.num_committed):
                tok = next(ids, None)
                if tok is None:
                    return out
                last = j == r.num_committed - 1
                out.append(TokenProvenance(int(tok), r.step, j + 1, -1, "bonus" if last else "accepted"))
        return out

    def summary(self) -> dict:
        per = [r.num_committed for r in self.rounds]
        last = self.rounds[-1] if self.rounds else None
        return {
            "steps": len(per),
            "tokens": sum(per),
            "seconds": last.elapsed if last else 0.0,
            "tokens_per_s": last.tokens_per_s if last else math.nan,
            "mean_tokens_per_step": statistics.fmean(per) if per else math.nan,
            "finish_reason": None,
        }


class GenerationBusy(RuntimeError):
    """Another event is advancing this generation right now."""


class Generation:
    """The live engine iterator of a ``RunRecord``: each ``advance()`` runs one prefill chunk or one
    decoding step, so whoever advances it can let other sessions use the models in between."""

    def __init__(self, record: RunRecord, steps: Iterator[StepTrace | PrefillProgress],
                 stop_event: threading.Event) -> None:
        self.record = record
        self._steps = steps
        self.stop_event = stop_event
        self._lock = threading.Lock()
        self.done = False

    def advance(self) -> Optional[StepTrace | PrefillProgress]:
        """Run exactly one prefill chunk or one decoding step; None when the generation has ended."""
        if self.done:
            return None
        if not self._lock.acquire(blocking=False):
            raise GenerationBusy("a step of this generation is already running")
        try:
            try:
                item = next(self._steps)
            except StopIteration:
                self._finish("stopped" if self.stop_event.is_set() else "finished")
                return None
            except BaseException:
                self._finish("error")
                raise
            if isinstance(item, PrefillProgress):
                self.record.prefill = (item.done, item.total)
                self.record.compiling = item.compiling
                if item.stopped:
                    self._finish("stopped")
                elif item.done == item.total:
                    self.record.prefill_seconds = item.seconds
                return item
            if not self.record.traces:
                self.record.cpu_window = (sample(), None)
            self.record.traces.append(item)
            if item.finished:
                self._finish("stopped" if item.finish_reason == "stopped" else "finished")
            return item
        finally:
            self._lock.release()

    def next_step(self) -> Optional[StepTrace]:
        """Advance through any prefill chunks left to the next decoding step (no turns taken)."""
        while isinstance(item := self.advance(), PrefillProgress):
            pass
        return item

    def stop_now(self) -> None:
        """End the generation without running another step (used while paused)."""
        self.stop_event.set()
        if self._lock.acquire(blocking=False):
            try:
                close = getattr(self._steps, "close", None)
                if close is not None:
                    close()
            finally:
                self._lock.release()
        if not self.done:
            self._finish("stopped")

    def _finish(self, status: RunStatus) -> None:
        self.done = True
        start = self.record.cpu_window[0]
        if start is not None:
            self.record.cpu_window = (start, sample())
        before = self.record.read_window[0]
        if before is not None and status == "finished":
            self.record.read_window = (before, run_probe())
        self.record.status = status


_session_numbers = iter(range(1, 1 << 62))


class SessionState:
    """Mutable state of one browser session (kept in a ``gr.State``)."""

    def __init__(self) -> None:
        self.name = f"session {next(_session_numbers)}"  # how other sessions waiting for the models see it
        self.record: Optional[RunRecord] = None
        self.generation: Optional[Generation] = None
        self.baselines: dict[tuple, RunRecord] = {}
        self.compare: list[RunRecord] = []
        self.compare_stop: Optional[threading.Event] = None
        self.pause_label = "Pause"  # what the page's Pause/Resume button shows
        self.notice = ""  # shown instead of the run's status while models load
        self.load_stop: Optional[threading.Event] = None  # set to end the Run's model load under way (None: none)
        self.load_stopped = ""  # said above the status after a load was stopped (until the next Run or Step)
        self.pause_after_load = False  # Pause clicked while the Run's models loaded: it starts paused
        self.rendered_loading = ""  # the load's progress line the page last showed under the notice
        self.view_step: Optional[int] = None  # the step the user picked on the slider (None: the latest)
        self.walk: Optional[tuple[int, int]] = None  # (step, decision) the walkthrough shows
        self.baseline_running = False  # the worker is running the AR baseline after the run
        self.baseline_request = None  # RunSettings whose AR baseline should follow the current run
        self.worker = None  # the DecodeWorker running the current generation, if any
        self.version = 0  # bumped on every change the page should show
        self.rendered_version = 0  # the page starts with the layout's own initial values
        self.rendered_prefill: Optional[tuple[int, int]] = None  # prefill progress the page shows
        self.rendered_memory = 0  # the app's memory (bytes) the page's footer shows
        self.rendered_background: tuple[str, ...] = ()  # the footer's lines: auto's background measurement, models
        self.idle_ticks = 0  # refreshes in a row with nothing to show and no run going (Controller._pace)
        self.timer_interval: Optional[float] = None  # the page's refresh interval (None: the streaming one)
        self.stop_clicked_at = -math.inf  # when Stop was clicked during the current run (time.monotonic)
        self.figures_at = -math.inf  # when the page last got the run's figures (time.monotonic)
        self.figures_key: Optional[tuple] = None  # what the user was looking at then (step, walkthrough decision, block)
        self.figure_pacing = FigurePacing()  # how often a streaming run's figures are redrawn on this page
        self.run_started_at = -math.inf  # when the current run began (time.monotonic): its first redraw is paced from it
        self.figures_stale = False  # the page shows the previous run's figures: the next refresh dims them
        self.run_clock: Optional[RunClock] = None  # the app log's clock of the current Run, from its click
        self.error = ""  # the inline error line (cleared by the next run)
        self.error_popup = False  # a background error the next refresh also shows as a pop-up
        self._export_dir: Optional[Path] = None

    def __deepcopy__(self, memo) -> "SessionState":
        # gr.State deep-copies its initial value for every new session: start empty
        return SessionState()

    def bump(self) -> None:
        self.version += 1

    @property
    def running(self) -> bool:
        return self.worker is not None and self.worker.alive

    @property
    def active(self) -> bool:
        return self.generation is not None and not self.generation.done

    def baseline_for(self, settings: RunSettings) -> Optional[RunRecord]:
        rec = self.baselines.get(settings.baseline_key())
        return rec if rec is not None and rec.traces else None

    def export_dir(self) -> Path:
        if self._export_dir is None or not self._export_dir.exists():
            self._export_dir = Path(tempfile.mkdtemp(prefix="dyntree-export-"))
        return self._export_dir

    def close(self) -> None:
        """Stop anything running and delete exported files (session ended)."""
        if self.load_stop is not None:
            self.load_stop.set()
        if self.generation is not None and not self.generation.done:
            self.generation.stop_event.set()
        if self.worker is not None:
            self.worker.request_pause()
        if self.compare_stop is not None:
            self.compare_stop.set()
        if self._export_dir is not None:
            shutil.rmtree(self._export_dir, ignore_errors=True)

    def join(self, timeout_s: float) -> bool:
        """Wait for this tab's decoding thread to end (after ``close``); True once none runs."""
        return self.worker is None or self.worker.join(timeout_s)


class SessionRegistry:
    """Each browser tab's ``SessionState``, created exactly once per tab.

    Gradio's own per-session state store creates a session's values without a lock: two events
    of a tab that has just opened (the timer's first refresh and a quick Run click, or the page's
    load event) could each get a fresh ``SessionState``, and the run then wrote to one the page
    never read again (the page stayed "Idle"). Here one lock guards the creation."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions: dict[str, SessionState] = {}

    def get(self, key: str) -> SessionState:
        with self._lock:
            state = self._sessions.get(key)
            if state is None:
                state = self._sessions[key] = SessionState()
            return state

    def close(self, key: str) -> Optional["SessionState"]:
        """The tab was closed or reloaded: stop what it runs and forget it; returns its state (None: unknown tab)."""
        with self._lock:
            state = self._sessions.pop(key, None)
        if state is not None:
            state.close()
        return state

    def __len__(self) -> int:
        return len(self._sessions)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._sessions)

