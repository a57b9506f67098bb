"""Speed charts: tokens/s and tokens per step over the run, and the phase-time breakdown."""

from __future__ import annotations

import statistics
from typing import Optional, Sequence

import plotly.graph_objects as go

from dyntree_core.trace import PHASES, StepTrace

from .palette import BASELINE_COLOR, METHOD_COLORS, PHASE_COLORS, PHASE_LABELS
from .plotly_spec import Spec, figure


def _series(traces: Sequence[StepTrace]) -> tuple[list[int], list[float], list[int]]:
    steps = [t.step for t in traces]
    return steps, [t.tokens_per_s for t in traces], [t.num_committed for t in traces]


def speed_figure(runs: Sequence[tuple[str, Sequence[StepTrace]]], baseline: Optional[Sequence[StepTrace]] = None,
                 title: str = "tokens/s (cumulative, prefill included)") -> go.Figure:
    """Cumulative tokens/s against tokens generated, one line per run, the AR baseline dashed:
    runs that take different numbers of steps share one x axis."""
    traces: list[Spec] = []
    for i, (name, steps) in enumerate(runs):
        traces.append(dict(type="scatter", x=[t.total_new_tokens for t in steps], y=[t.tokens_per_s for t in steps],
                           mode="lines+markers", name=name,
                           line=dict(color=METHOD_COLORS[i % len(METHOD_COLORS)], width=2), marker=dict(size=4)))
    if baseline:
        traces.append(dict(type="scatter", x=[t.total_new_tokens for t in baseline],
                           y=[t.tokens_per_s for t in baseline], mode="lines", name="autoregressive baseline",
                           line=dict(color=BASELINE_COLOR, dash="dash", width=2)))
    return figure(traces, _style(traces, title, "tokens generated", "tokens/s"))


def tokens_per_step_figure(runs: Sequence[tuple[str, Sequence[StepTrace]]],
                           baseline: Optional[Sequence[StepTrace]] = None,
                           title: str = "tokens per step (accepted + bonus)") -> go.Figure:
    """Committed tokens per target step (bars for a single run, lines for several) + means."""
    traces: list[Spec] = []
    single = len(runs) == 1
    for i, (name, run) in enumerate(runs):
        steps, _, per = _series(run)
        color = METHOD_COLORS[i % len(METHOD_COLORS)]
        if single:
            traces.append(dict(type="bar", x=steps, y=per, name=name, marker=dict(color=color)))
        else:
            traces.append(dict(type="scatter", x=steps, y=per, mode="lines+markers", name=name,
                               line=dict(color=color), marker=dict(size=4)))
        if per:
            mean = statistics.fmean(per)
            traces.append(dict(type="scatter", x=[steps[0], steps[-1]], y=[mean, mean], mode="lines",
                               name=f"{name} mean {mean:.2f}", line=dict(color=color, dash="dot")))
    if baseline:  # one token per step, drawn over this chart's own steps (not the baseline's many more)
        steps = [t.step for _, run in runs for t in run] or [t.step for t in baseline]
        traces.append(dict(type="scatter", x=[min(steps), max(steps)], y=[1, 1], mode="lines",
                           name="autoregressive (1 / step)", line=dict(color=BASELINE_COLOR, dash="dash")))
    return figure(traces, _style(traces, title, "step", "tokens"))


def phase_figure(traces: Sequence[StepTrace], step: Optional[int] = None,
                 prefill_s: Optional[float] = None) -> go.Figure:
    """Stacked milliseconds per phase: the selected step and the mean over the run, and the
    prompt's prefill (once per run) when ``prefill_s`` is given."""
    if not traces:
        return figure([], _style([], "phase timings", "ms", ""))
    sel = traces[step if step is not None and 0 <= step < len(traces) else -1]
    rows = [f"step {sel.step}", "run mean"]

    def ms(t: StepTrace, phase: str) -> float:  # the forward's bar leaves out its wait for offloaded weights
        v = getattr(t.timings, phase)
        return 1e3 * (v - t.timings.offload_transfer if phase == "target_forward" else v)

    bars: list[Spec] = []
    for phase in PHASES:
        this = ms(sel, phase)
        mean = statistics.fmean(ms(t, phase) for t in traces)
        bars.append(dict(type="bar", y=rows, x=[this, mean], orientation="h", name=PHASE_LABELS[phase],
                         marker=dict(color=PHASE_COLORS[phase]),
                         hovertemplate=f"{PHASE_LABELS[phase]}: %{{x:.2f}} ms<extra></extra>"))
    other = max(0.0, sel.step_seconds - sel.timings.total) * 1e3
    other_mean = statistics.fmean(max(0.0, t.step_seconds - t.timings.total) for t in traces) * 1e3
    bars.append(dict(type="bar", y=rows, x=[other, other_mean], orientation="h", name="other",
                     marker=dict(color="#dddddd"), hovertemplate="other: %{x:.2f} ms<extra></extra>"))
    if prefill_s is not None:
        bars.append(dict(type="bar", y=["prefill (once)"], x=[prefill_s * 1e3], orientation="h", name="prefill",
                         marker=dict(color="#9e9e9e"), hovertemplate="prefill: %{x:.1f} ms<extra></extra>"))
    layout = _style(bars, f"phase timings (ms) · step {sel.step}: {sel.step_seconds * 1e3:.1f} ms total", "", "")
    return figure(bars, dict(layout, barmode="stack", height=260))


def _style(traces: Sequence[Spec], title: str, xlabel: str, ylabel: str) -> Spec:
    """The charts' shared layout (whole-number ticks on a step or token axis spanning at most 8)."""
    xaxis: Spec = dict(title=dict(text=xlabel), showgrid=True, gridcolor="#eeeeee", tickformat="d")
    if xlabel in ("step", "tokens generated"):  # whole numbers only (no ticks at 0.5, 1.5)
        xs = [x for tr in traces for x in (tr.get("x") or []) if x is not None]
        if xs and max(xs) - min(xs) <= 8:
            xaxis["dtick"] = 1
    return dict(
        title=dict(text=title, font=dict(size=13)), height=320, margin=dict(l=50, r=10, t=50, b=40),
        xaxis=xaxis, yaxis=dict(title=dict(text=ylabel), showgrid=True, gridcolor="#eeeeee", rangemode="tozero"),
        plot_bgcolor="white", paper_bgcolor="white", legend=dict(orientation="h", y=-0.25, yanchor="top"),
    )
