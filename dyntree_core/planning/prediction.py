"""One prediction per run, and its check against the run.

``Prediction``: what ``auto`` priced the configuration it chose at (seconds per token, and the step's
parts: draft, target forward, the rest, tokens per step), against **the fastest plain decoding this
machine's profile measured, at any precision** (``fastest_plain``), never a reference of the panel's
own. ``PredictionCheck``: the same parts measured on the run's steps (the mean step over the mean tokens
per step, as ``pricing`` prices; waits for other sessions are not in a step), how far the run fell from
the prediction, and which profile rows priced the parts that were off (``rows_to_remeasure``). The
status line, the cost panel and Compare all show these two objects' ``text()``; none computes a
prediction of its own.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

from ..measured import crowding
from ..step_price import PricedRows, StepShape
from .pricing import Candidate, autoregressive_candidate, other_seconds, seconds_per_token
from .profiling import same_spell
from .spell_pricing import floor_gb_per_s

if TYPE_CHECKING:
    from ..trace import StepTrace
    from .machine_profile import MachineProfile

#: a run whose measured seconds per token are off the prediction by more than this fraction (either way)
#: has the profile rows behind its wrong parts measured again
OFF_BY = 0.25
#: a part of the step counts as wrong when it moved the step by more than this share of its predicted time
PART_SHARE = 0.1
#: fewer measured steps than this say how far the run was, but re-measure nothing
MIN_STEPS = 8
#: the part that is the prompt's, not a profile row's
TOKENS = "tokens per step"


@dataclass(frozen=True)
class ProfileRow:
    """A row of the machine profile: ``role`` target / draft (at ``precision``) or ``other`` (precision "")."""

    role: str
    precision: str = ""

    def text(self) -> str:
        return "the step's other-cost row" if self.role == "other" else f"the {self.role}'s {self.precision} row"


@dataclass(frozen=True)
class Prediction:
    """What a run is predicted to cost, against the fastest plain decoding measured here.

    Attributes:
        label: the configuration priced (``Candidate.label``).
        method: its method.
        s_per_token: predicted seconds per token (``pricing.seconds_per_token`` of the parts below).
        draft_s, target_s, other_s: predicted seconds per step of the draft, the target forward, the rest.
        tokens_per_step: expected tokens committed per step.
        target_precision, draft_precision: the precisions priced (draft None for plain decoding).
        reference_label, reference_s_per_token: the fastest plain decoding in the profile, any precision.
        reference_precision: its target precision ("" where not recorded).
        profile_created: when the profile was first measured (the numbers' age).
        rows: the profile rows it was priced from (None: the parts are checked at the predicted sizes).
        read_gb_per_s: the memory read bandwidth the profile's rows were measured at (its spell:
            ``profiling.same_spell``; None: its rows were not probed).
        floor_gb_per_s: the slower spell's bandwidth its rows were raised to the weight-read floor of
            (``spell_pricing.floor_priced``; None: priced as measured).
    """

    label: str
    method: str
    s_per_token: float
    draft_s: float
    target_s: float
    other_s: float
    tokens_per_step: float
    target_precision: str
    draft_precision: Optional[str]
    reference_label: str
    reference_s_per_token: float
    profile_created: str = ""
    rows: Optional[PricedRows] = None
    read_gb_per_s: Optional[float] = None
    reference_precision: str = ""
    floor_gb_per_s: Optional[float] = None

    @property
    def speedup(self) -> float:
        return self.reference_s_per_token / self.s_per_token

    @property
    def is_reference(self) -> bool:
        return self.method == "autoregressive" and self.label == self.reference_label

    def part_rows(self) -> dict[str, Optional[ProfileRow]]:
        """The profile row that priced each part."""
        return {"draft": ProfileRow("draft", self.draft_precision) if self.draft_precision and self.draft_s > 0 else None,
                "target forward": ProfileRow("target", self.target_precision),
                "rest of the step": ProfileRow("other"),
                TOKENS: None}

    def text(self) -> str:
        """One line, the same wherever the run's prediction is shown (status line, cost panel, Compare); a run in a
        slower spell of the memory than any profile says so (another spell's run is priced otherwise)."""
        ms = self.s_per_token * 1e3
        spell = ("" if self.floor_gb_per_s is None
                 else f", priced for the memory's slower spell now ({self.floor_gb_per_s:.0f} GB/s)")
        if self.is_reference:
            return (f"predicted {ms:.0f} ms/token: {self.label}, the fastest plain decoding measured on this machine"
                    + spell)
        return (f"predicted {ms:.0f} ms/token vs {self.reference_s_per_token * 1e3:.0f} for {self.reference_label}, "
                f"the fastest plain decoding measured on this machine ({self.speedup:.2f}x){spell}")


def fastest_plain(profile: MachineProfile) -> Candidate:
    """Plain decoding at the target precision the profile measured fastest (every precision it has)."""
    cands = [autoregressive_candidate(profile, p) for p in profile.target]
    cands = [c for c in cands if math.isfinite(c.seconds_per_token)]
    if not cands:
        raise ValueError("the profile has no measured one-token target forward")
    return min(cands, key=lambda c: c.seconds_per_token)


def prediction_for(candidate: Candidate, reference: Candidate, profile: Optional[MachineProfile] = None) -> Prediction:
    """``candidate``'s prediction against ``reference`` (``fastest_plain`` of ``profile``, which priced it)."""
    ref = reference
    dp = candidate.draft_precision if candidate.method != "autoregressive" else None
    return Prediction(
        label=candidate.label(), method=candidate.method, s_per_token=candidate.seconds_per_token,
        draft_s=candidate.draft_seconds, target_s=candidate.target_seconds, other_s=candidate.verify_seconds,
        tokens_per_step=candidate.expected_tokens, target_precision=candidate.target_precision,
        draft_precision=dp, reference_label=ref.label(), reference_s_per_token=ref.seconds_per_token,
        reference_precision=ref.target_precision, profile_created=profile.created if profile is not None else "",
        rows=PricedRows.of(profile, candidate.target_precision, dp) if profile is not None else None,
        read_gb_per_s=profile.read_gb_per_s if profile is not None else None,
        floor_gb_per_s=floor_gb_per_s(profile))


@dataclass(frozen=True)
class PartCheck:
    """One part of the step, predicted and measured (seconds per step, or tokens per step)."""

    name: str
    predicted: float
    measured: float
    row: Optional[ProfileRow]
    steps: int = 0  # the steps it was measured over (0: all of the run's)

    @property
    def ratio(self) -> float:
        if self.predicted <= 0:
            return 1.0 if self.measured <= 0 else math.inf
        return self.measured / self.predicted

    @property
    def off(self) -> bool:
        return abs(self.ratio - 1.0) > OFF_BY


@dataclass(frozen=True)
class PredictionCheck:
    """A finished (or stopped) run's steps against its ``Prediction``.

    Attributes:
        prediction: what was predicted.
        measured_s_per_token: the run's mean step over its mean tokens per step.
        steps: how many steps were measured.
        parts: draft, target forward, rest of the step (seconds per step), tokens per step, over the steps of the
            predicted method; after a fallback to plain decoding (``DecodeConfig.fallback``) also the plain
            steps' target forward against its row's one-token price.
        fell_back_after: the steps the run decoded before it fell back to plain decoding (None: it did not).
        repeat_steps: the steps that verified the text's own repeats instead of the method's tree or a plain step
            (``drafting.repeats``: inside the run where priced to beat its tree steps, and after its fallback);
            the parts are checked over the other steps.
        plain_steps: the plain steps after the fallback.
        plain_s_per_token: plain decoding at the run's target precision, timed inside the run or beside it (the
            cost panel's reference, ``cost_model.ar_reference``; None: not timed). The run's measured speed-up is
            against it, whatever the profile priced plain decoding at.
        plain_inside: the plain steps inside the run that timed it (``decode.plain_probes.plain_steps_inside``: its
            probes and the plain steps after its fallback; 0: timed beside the run). The probes are plain
            decoding's, not the run's: ``measured_s_per_token``, ``steps`` and the parts leave them out.
    """

    prediction: Prediction
    measured_s_per_token: float
    steps: int
    parts: tuple[PartCheck, ...]
    others_share: Optional[float] = None  # share of the CPUs other processes used while the run decoded
    cpus: Optional[int] = None  # the CPUs counted, and the threads the run decoded on (None: not known)
    threads: Optional[int] = None
    read_gb_per_s: tuple[float, ...] = ()  # the memory's read bandwidth probed before and after the run
    fell_back_after: Optional[int] = None
    repeat_steps: int = 0  # the steps that verified the text's repeats (inside the run and after its fallback)
    plain_s_per_token: Optional[float] = None
    plain_steps: int = 0  # the plain steps after the fallback
    plain_inside: int = 0  # the plain steps inside the run that timed plain decoding

    @property
    def speedup(self) -> Optional[float]:
        """The run's speed over plain decoding timed inside it or beside it (None: not timed)."""
        if not self.plain_s_per_token or self.measured_s_per_token <= 0:
            return None
        return self.plain_s_per_token / self.measured_s_per_token

    @property
    def plain_ratio(self) -> Optional[float]:
        """Plain decoding timed inside or beside the run over the price of the prediction's reference, where both
        are the same precision (None: not timed, or the reference is another precision)."""
        p = self.prediction
        if not self.plain_s_per_token or p.is_reference or p.reference_precision != p.target_precision:
            return None
        return self.plain_s_per_token / p.reference_s_per_token

    @property
    def plain_off(self) -> bool:
        """Plain decoding timed inside or beside the run cost more than ``OFF_BY`` off the profile's price of it."""
        r = self.plain_ratio
        return r is not None and abs(r - 1.0) > OFF_BY

    def speedup_text(self) -> str:
        """The clause on the run's measured speed-up over plain decoding timed inside or beside it ('' when not
        timed); where plain decoding cost more than ``OFF_BY`` off its price, it names the predicted speed-up it
        replaces and why (another spell of the memory's bandwidth, other processes)."""
        x = self.speedup
        if x is None:
            return ""
        p = self.prediction
        ms = self.plain_s_per_token * 1e3
        n = self.plain_inside
        plain = (f"plain decoding at {p.target_precision} timed inside it ({n} plain step{'s' if n > 1 else ''}: "
                 f"{ms:.1f} ms/token)" if n else f"plain decoding at {p.target_precision} timed beside it "
                                                 f"({ms:.1f} ms/token)")
        ratio = self.plain_ratio
        if not self.plain_off:
            return f"{x:.2f}x the speed of {plain}"
        why = "; ".join(self.plain_off_because(slower=ratio > 1.0))
        return (f"{x:.2f}x the speed of {plain}, not the predicted {p.speedup:.2f}x: plain decoding cost {ratio:.2f}x "
                f"its price of {p.reference_s_per_token * 1e3:.0f} ms" + (f" ({why})" if why else ""))

    def plain_off_because(self, slower: bool) -> list[str]:
        """What can explain plain decoding costing more (``slower``) or less than its price: a probe around the run
        in a spell of the memory's bandwidth on that side of the profile's (a faster spell does not make it
        slower: the app's default Run in Chromium, probes 32 / 54 GB/s against a 36 GB/s profile, plain decoding
        1.70x its price beside a page that took a quarter of a core), and, for costing more, other processes."""
        ref = self.prediction.read_gb_per_s
        beyond = [x for x in self.read_gb_per_s if x and ref and not same_spell(x, ref) and (x < ref) == slower]
        why = [self.other_spell] if beyond else []
        if slower and self.busy:
            why.append(f"{self.crowded} while it ran")
        return why

    @property
    def other_spell(self) -> Optional[str]:
        """How the run's read-bandwidth probes fell outside the spell its profile was measured in (a host whose
        memory bandwidth jumps between levels, minutes each: a one-token forward follows it, so the profile's
        rows are right for their own spell and measuring them again now would mix two spells in one profile;
        None: the same spell, or nothing probed)."""
        ref = self.prediction.read_gb_per_s
        if not ref or not self.read_gb_per_s or all(same_spell(x, ref) for x in self.read_gb_per_s):
            return None
        around = " / ".join(f"{x:.0f}" for x in self.read_gb_per_s)
        floor = self.prediction.floor_gb_per_s
        floor = (f"; its forwards priced at no less than reading their weights at {floor:.0f} GB/s" if floor else "")
        return (f"the memory read {around} GB/s around the run against the {ref:.0f} GB/s its profile was measured "
                f"at (another spell of this machine's memory bandwidth{floor})")

    @property
    def crowded(self) -> Optional[str]:
        """How other processes (a browser redrawing the page on a small machine) crowded the run
        (``measured.crowding``: more than ``OTHERS_LIMIT`` of the CPUs, or more cores than the run's threads
        left free): the profile's quiet rows are not what it could get, and measuring them again beside the
        same load would store the load (None: they did not)."""
        return crowding(self.others_share, self.cpus, self.threads)

    @property
    def busy(self) -> bool:
        return self.crowded is not None

    @property
    def ratio(self) -> float:
        return self.measured_s_per_token / self.prediction.s_per_token

    @property
    def off(self) -> bool:
        return abs(self.ratio - 1.0) > OFF_BY

    def wrong_parts(self) -> tuple[PartCheck, ...]:
        """When the whole run is off: the parts off by more than ``OFF_BY`` that moved the step by more
        than ``PART_SHARE`` of its predicted time (a part of a few milliseconds may be off by half and
        explain nothing), tokens per step whenever it is off; where no part is off alone, the part
        that moved the step most. None when the run is within."""
        if not self.off:
            return ()
        p = self.prediction
        step = p.draft_s + p.target_s + p.other_s
        moved = lambda c: abs(c.measured - c.predicted)  # noqa: E731
        tree, plain = self.parts[:4], tuple(c for c in self.parts[4:] if c.off)
        wrong = tuple(c for c in tree if c.off and (c.name == TOKENS or moved(c) > PART_SHARE * step))
        if wrong or plain or self.fell_back_after is not None or self.repeat_steps:
            return wrong + plain  # (a fallback or the repeats explain the rest: those steps were not the ones priced)
        timed = [c for c in tree if c.name != TOKENS and moved(c) > PART_SHARE * step]
        if timed:
            return (max(timed, key=moved),)
        return tuple(c for c in tree if c.name == TOKENS)

    def rows_to_remeasure(self) -> tuple[ProfileRow, ...]:
        """The profile rows that priced the wrong parts (tokens per step has none: it is the prompt's), and the
        target's row when plain decoding timed inside or beside the run was off its price (``plain_off``: the
        predicted speed-up stood on it); none from fewer than ``MIN_STEPS`` steps, a crowded run or another
        spell."""
        if self.steps < MIN_STEPS or self.busy or self.other_spell:
            return ()
        rows = [p.row for p in self.wrong_parts() if p.row is not None and (p.steps or self.steps) >= MIN_STEPS]
        if self.plain_off:
            rows.append(ProfileRow("target", self.prediction.target_precision))
        return tuple(dict.fromkeys(rows))

    @staticmethod
    def _remeasure_tail(rows: Sequence[ProfileRow], remeasuring: Sequence[ProfileRow]) -> str:
        if remeasuring:
            return ("; re-measuring " + ", ".join(r.text() for r in remeasuring)
                    + " of the profile in idle moments (the next Run uses it)")
        if rows:
            return "; " + ", ".join(r.text() for r in rows) + " of the profile priced it (re-measured once per app session)"
        return ""

    def text(self, remeasuring: Sequence[ProfileRow] = (), so_far: bool = False) -> str:
        """One line; ``remeasuring``: the profile rows being measured again because of this run; ``so_far``: the
        run goes on, and before ``MIN_STEPS`` steps its line gives the ratio without judging it (one step in, the
        default Run read "7.30x the prediction: off by more than 25%")."""
        ms = self.measured_s_per_token * 1e3
        steps = f"{self.steps} step" + ("s" if self.steps != 1 else "")
        speed = self.speedup_text()
        speed = f"; {speed}" if speed else ""
        if so_far and self.steps < MIN_STEPS:
            return (f"measured {ms:.0f} ms/token over its first {steps}, {self.ratio:.2f}x the prediction so far "
                    f"(checked from step {MIN_STEPS} on, or when it ends){speed}")
        head = f"measured {ms:.0f} ms/token over {steps}, {self.ratio:.2f}x the prediction"
        if not self.off:
            return f"{head} (within {OFF_BY:.0%}){speed}{self._remeasure_tail(self.rows_to_remeasure(), remeasuring)}"
        wrong = self.wrong_parts()
        parts = "; ".join(f"{p.name} {p.ratio:.2f}x its price" for p in wrong)
        if any(p.name == TOKENS for p in wrong):
            parts += " (tokens per step depend on the prompt: the acceptance was measured on other text)"
        repeats = "verified the text's own repeats (no draft forward)"
        fell = ""
        if self.fell_back_after is not None:
            fell = (f"it fell back to plain decoding after step {self.fell_back_after}: {self.plain_steps} of its "
                    f"{self.steps} steps were plain" + (f", {self.repeat_steps} {repeats}" if self.repeat_steps else ""))
        elif self.repeat_steps:
            fell = f"{self.repeat_steps} of its {self.steps} steps {repeats}"
        if fell:
            parts = f"{fell}; its tree steps: {parts}" if parts else fell
        parts = parts or "no single part"
        rows = self.rows_to_remeasure()
        if self.busy:
            tail = (f"; {self.crowded} while it ran (the profile was measured on a quiet machine: nothing is "
                    "re-measured)")
        elif self.other_spell:
            tail = (f"; {self.other_spell}: its rows stand for their spell, nothing is re-measured (a Run that starts "
                    "in a spell without a profile of its own has auto measure one in idle moments)")
        elif self.steps < MIN_STEPS:
            tail = f"; too few steps to re-measure anything (fewer than {MIN_STEPS})"
        else:
            tail = self._remeasure_tail(rows, remeasuring)
        return f"{head}: off by more than {OFF_BY:.0%} ({parts}){tail}{speed}"


def _step_means(steps: Sequence[StepTrace]) -> tuple[float, float, float, float]:
    """Mean seconds per step of the draft, the target forward and the rest (``other_seconds``), and mean tokens."""
    mean = statistics.fmean
    return (mean(t.timings.draft for t in steps), mean(t.timings.target_forward for t in steps),
            mean(other_seconds(t.tree_size, t.method, step=t) for t in steps), mean(t.num_committed for t in steps))


def check_prediction(prediction: Prediction, traces: Sequence[StepTrace], others_share: Optional[float] = None,
                     cpus: Optional[int] = None, threads: Optional[int] = None,
                     read_gb_per_s: Sequence[float] = (),
                     plain_s_per_token: Optional[float] = None, plain_inside: int = 0) -> Optional[PredictionCheck]:
    """``prediction`` against the measured steps of ``traces`` (None before the first step); ``others_share``:
    the share of the CPUs other processes used meanwhile (``measured.others_share``) of ``cpus`` CPUs, the run on
    ``threads`` threads (``PredictionCheck.crowded``); ``read_gb_per_s``: the memory's read bandwidth probed around
    the run (``profiling.run_probe``; ``PredictionCheck.other_spell``); ``plain_s_per_token``: plain decoding at the
    run's target precision timed beside it, or inside it by ``plain_inside`` plain steps (``PredictionCheck.speedup``;
    its probes, ``decode.plain_probes``, are left out of the run's steps).

    With the profile rows the prediction was priced from (``Prediction.rows``), each timed part is
    compared with those rows' price **at the sizes the run had**: each step priced at its own shape
    (``StepShape``: its tree size for the target forward and the rest of the step, its draft levels and their
    width for the draft), then averaged as the measured parts are. A prompt that is easier than the calibration
    text grows longer chains and bigger trees, which is its tokens per step, not a wrong row; and a run whose
    steps alternate 13-node and 2-node trees costs the mean of those two prices, not the price of a 7.5-node
    tree (t(n) is convex: headless, the default Run's target forward read 1.21-1.23x its row at the mean size
    and 1.15-1.17x at its steps' own, 3 runs). Without rows the parts are compared with the predicted ones."""
    from ..decode.plain_probes import PROBE
    from ..drafting.repeats import repeat_steps

    everything = [t for t in traces if t.step_seconds > 0 and t.draft_source != PROBE]
    if not everything:
        return None
    switch = next((i for i, t in enumerate(everything) if t.fallback), None)
    # the steps of the method priced: up to its fallback, less those that verified the text's repeats instead
    # (``drafting.repeats``: inside the run and after the fallback; no draft forward)
    steps = [t for t in (everything if switch is None else everything[:switch + 1]) if t.draft_source != "repeats"]
    steps = steps or everything  # (a run whose only steps so far were repeats)
    after = [] if switch is None else everything[switch + 1:]
    plain = [t for t in after if t.tree is None]
    mixed = len(steps) != len(everything)
    mean = statistics.fmean
    draft, target, other, tokens = means = _step_means(steps)
    p, rows = prediction, prediction.part_rows()
    priced = (p.draft_s, p.target_s, p.other_s)
    names = ("draft", "target forward", "rest of the step")
    if p.rows is not None:
        size = max(1.0, mean(t.tree_size for t in steps))
        shapes = [StepShape.of(t) for t in steps]
        modeled = [x for x in shapes if x.levels]
        levels = mean(x.levels for x in modeled) if modeled else 0.0
        width = mean(x.width * x.levels for x in modeled) / max(levels, 1.0) if modeled else 1.0
        at = (mean(x.levels * p.rows.time(p.rows.draft, x.width) for x in modeled) if p.rows.draft and modeled
              else p.draft_s,
              mean(p.rows.time(p.rows.target, x.size) for x in shapes),
              mean(p.rows.time(p.rows.other, x.size) for x in shapes))
        if all(math.isfinite(x) for x in at):
            priced = at
            names = (f"draft ({levels:.1f} levels of {width:.1f})" if levels else "draft",
                     f"target forward ({size:.1f} tokens)", f"rest of the step ({size:.1f}-node trees)")
    n = len(steps) if mixed else 0
    parts = (PartCheck(names[0], priced[0], draft, rows["draft"], n),
             PartCheck(names[1], priced[1], target, rows["target forward"], n),
             PartCheck(names[2], priced[2], other, rows["rest of the step"], n),
             PartCheck(TOKENS, p.tokens_per_step, tokens, None, n))
    one = p.rows.time(p.rows.target, 1) if p.rows is not None else math.inf
    if plain and math.isfinite(one):
        parts += (PartCheck(f"target forward of the {len(plain)} plain steps", one,
                            mean(t.timings.target_forward for t in plain), rows["target forward"], len(plain)),)
    whole_draft, whole_target, whole_other, whole_tokens = _step_means(everything) if mixed else means
    measured = seconds_per_token(whole_target, whole_draft, whole_other, whole_tokens)
    return PredictionCheck(p, measured, len(everything), parts, others_share, cpus, threads,
                           tuple(x for x in read_gb_per_s if x is not None), None if switch is None else switch + 1,
                           repeat_steps(everything), plain_s_per_token, len(plain), plain_inside)
