"""Speed charts: tokens/s and tokens per step over the run, and the phase-time breakdown."""

from __future__ import annotations

import statistics
from typing import Optional, Sequence

import plotly.graph_objects as go

from dyntree_core.trace import PHASES, StepTrace

from .palette import BASELINE_COLOR, METHOD_COLORS, PHASE_COLORS, PHASE_LABELS


def _series(traces: Sequence[StepTrace]) -> tuple[list[int], list[float], list[int]]:
    steps = [t.step for t in traces]
    return steps, [t.tokens_per_s for t in traces], [t.num_committed for t in traces]


def speed_figure(runs: Sequence[tuple[str, Sequence[StepTrace]]], baseline: Optional[Sequence[StepTrace]] = None,
                 title: str = "tokens/s (cumulative, prefill included)") -> go.Figure:
    """Cumulative tokens/s against tokens generated, one line per run, the AR baseline dashed:
    runs that take different numbers of steps share one x axis."""
    fig = go.Figure()
    for i, (name, traces) in enumerate(runs):
        fig.add_trace(go.Scatter(x=[t.total_new_tokens for t in traces], y=[t.tokens_per_s for t in traces],
                                 mode="lines+markers", name=name,
                                 line=dict(color=METHOD_COLORS[i % len(METHOD_COLORS)], width=2), marker=dict(size=4)))
    if baseline:
        fig.add_trace(go.Scatter(x=[t.total_new_tokens for t in baseline], y=[t.tokens_per_s for t in baseline],
                                 mode="lines", name="autoregressive baseline",
                                 line=dict(color=BASELINE_COLOR, dash="dash", width=2)))
    _style(fig, title, "tokens generated", "tokens/s")
    return fig


def tokens_per_step_figure(runs: Sequence[tuple[str, Sequence[StepTrace]]],
                           baseline: Optional[Sequence[StepTrace]] = None,
                           title: str = "tokens per step (accepted + bonus)") -> go.Figure:
    """Committed tokens per target step (bars for a single run, lines for several) + means."""
    fig = go.Figure()
    single = len(runs) == 1
    for i, (name, traces) in enumerate(runs):
        steps, _, per = _series(traces)
        color = METHOD_COLORS[i % len(METHOD_COLORS)]
        if single:
            fig.add_trace(go.Bar(x=steps, y=per, name=name, marker_color=color))
        else:
            fig.add_trace(go.Scatter(x=steps, y=per, mode="lines+markers", name=name, line=dict(color=color),
                                     marker=dict(size=4)))
        if per:
            mean = statistics.fmean(per)
            fig.add_trace(go.Scatter(x=[steps[0], steps[-1]], y=[mean, mean], mode="lines",
                                     name=f"{name} mean {mean:.2f}", line=dict(color=color, dash="dot")))
    if baseline:  # one token per step, drawn over this chart's own steps (not the baseline's many more)
        steps = [t.step for _, traces in runs for t in traces] or [t.step for t in baseline]
        fig.add_trace(go.Scatter(x=[min(steps), max(steps)], y=[1, 1], mode="lines", name="autoregressive (1 / step)",
                                 line=dict(color=BASELINE_COLOR, dash="dash")))
    _style(fig, title, "step", "tokens")
    return fig


def phase_figure(traces: Sequence[StepTrace], step: Optional[int] = None,
                 prefill_s: Optional[float] = None) -> go.Figure:
    """Stacked milliseconds per phase: the selected step and the mean over the run, and the
    prompt's prefill (once per run) when ``prefill_s`` is given."""
    fig = go.Figure()
    if not traces:
        _style(fig, "phase timings", "ms", "")
        return fig
    sel = traces[step if step is not None and 0 <= step < len(traces) else -1]
    rows = [f"step {sel.step}", "run mean"]
    def ms(t: StepTrace, phase: str) -> float:  # the forward's bar leaves out its wait for offloaded weights
        v = getattr(t.timings, phase)
        return 1e3 * (v - t.timings.offload_transfer if phase == "target_forward" else v)

    for phase in PHASES:
        this = ms(sel, phase)
        mean = statistics.fmean(ms(t, phase) for t in traces)
        fig.add_trace(go.Bar(y=rows, x=[this, mean], orientation="h", name=PHASE_LABELS[phase],
                             marker_color=PHASE_COLORS[phase],
                             hovertemplate=f"{PHASE_LABELS[phase]}: %{{x:.2f}} ms<extra></extra>"))
    other = max(0.0, sel.step_seconds - sel.timings.total) * 1e3
    other_mean = statistics.fmean(max(0.0, t.step_seconds - t.timings.total) for t in traces) * 1e3
    fig.add_trace(go.Bar(y=rows, x=[other, other_mean], orientation="h", name="other", marker_color="#dddddd",
                         hovertemplate="other: %{x:.2f} ms<extra></extra>"))
    if prefill_s is not None:
        fig.add_trace(go.Bar(y=["prefill (once)"], x=[prefill_s * 1e3], orientation="h", name="prefill",
                             marker_color="#9e9e9e", hovertemplate="prefill: %{x:.1f} ms<extra></extra>"))
    fig.update_layout(barmode="stack")
    _style(fig, f"phase timings (ms) · step {sel.step}: {sel.step_seconds * 1e3:.1f} ms total", "", "")
    fig.update_layout(height=260)
    return fig


def _style(fig: go.Figure, title: str, xlabel: str, ylabel: str) -> None:
    fig.update_layout(
        title=dict(text=title, font=dict(size=13)), height=320, margin=dict(l=50, r=10, t=50, b=40),
        xaxis_title=xlabel, yaxis_title=ylabel, plot_bgcolor="white", paper_bgcolor="white",
        legend=dict(orientation="h", y=-0.25, yanchor="top"),
    )
    fig.update_xaxes(showgrid=True, gridcolor="#eeeeee", tickformat="d")
    if xlabel in ("step", "tokens generated"):  # whole numbers only (no ticks at 0.5, 1.5)
        xs = [x for tr in fig.data for x in (tr.x or []) if x is not None]
        if xs and max(xs) - min(xs) <= 8:
            fig.update_xaxes(dtick=1)
    fig.update_yaxes(showgrid=True, gridcolor="#eeeeee", rangemode="tozero")
