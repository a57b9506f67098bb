"""Everything the Live and Compare panels show, computed from RunRecords (pure functions)."""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import plotly.graph_objects as go

from dyntree_core.tree import ORDERS

from .charts import phase_figure, speed_figure, tokens_per_step_figure
from .cost_view import cost_model_html
from .colored_text import TEXT_STYLE, TextSpan, build_spans, legend_html, render_html
from .fmt import count
from .mask_figure import mask_figure, masks_figure
from .prediction_view import prediction_lines
from .session import ExternalRun, RunRecord
from .text_figure import text_figure
from .tokens import group_pieces
from .tree_figure import empty_figure, tree_figure
from .walkthrough import STYLE as WALK_STYLE, walkthrough_html


@dataclass
class StepView:
    """The per-step panels (tree, masks, phase bar) for one selected step."""

    tree: go.Figure
    masks: tuple[go.Figure, go.Figure, go.Figure]
    phases: go.Figure
    walkthrough: str


@dataclass
class RunView:
    """The whole-run panels (text, speed charts) plus a status line."""

    text_html: str
    speed: Optional[go.Figure]
    per_step: Optional[go.Figure]
    status: str
    cost: str


def clamp_step(record: Optional[RunRecord], step: Optional[float]) -> Optional[int]:
    if record is None or not record.traces:
        return None
    n = len(record.traces)
    if step is None or (isinstance(step, float) and math.isnan(step)):
        return n - 1
    return max(0, min(n - 1, int(step)))


def walk_node(trace, decision: Optional[int]) -> Optional[int]:
    """The tree node the walkthrough's ``decision`` is about (the bonus marker for a bonus draw)."""
    if decision is None or trace is None or not trace.decisions or trace.tree is None:
        return None
    d = trace.decisions[max(0, min(len(trace.decisions) - 1, decision))]
    drawn = any(c.kind == "bonus" for c in trace.committed)  # (not when the length limit cut it off)
    return trace.tree.size if d.kind == "bonus" and drawn else d.node


def step_view(record: Optional[RunRecord], step: Optional[float], block_size: int,
              decision: Optional[int] = None) -> StepView:
    """Tree (the walkthrough's ``decision`` ringed), masks, phases and walkthrough of one step."""
    idx = clamp_step(record, step)
    if record is None or idx is None:
        note = "press Run (or Step) to decode"
        return StepView(empty_figure(f"draft tree: {note}"),
                        tuple(empty_figure(f"{o.upper()} mask", height=360) for o in ORDERS),  # type: ignore[arg-type]
                        empty_figure("phase timings", height=260), walkthrough_html(None, None, None))
    trace = record.traces[idx]
    return StepView(
        tree=tree_figure(trace, record.texts, record.root_token(idx), highlight=walk_node(trace, decision)),
        masks=tuple(mask_figure(trace, o, int(block_size)) for o in ORDERS),  # type: ignore[arg-type]
        phases=phase_figure(record.traces, idx, record.prefill_seconds),
        walkthrough=walkthrough_html(trace, record.texts, decision),
    )


#: the Live tab's figure panels, by element id (``layout.build_layout``)
FIGURE_IDS = ("tree-plot", "mask-bfs", "mask-dfs", "mask-hpd", "speed-plot", "tokens-per-step-plot", "phase-plot")


def stale_figures_html(interval_s: float) -> str:
    """What a streaming run's first refresh sends until its figures are first drawn ``interval_s`` into it
    (``controller.figures_due``): the walkthrough's note and a style that dims the previous run's figures and labels
    each. Sending seven blank figures instead had Chromium redraw them (~120 ms of its main thread on the 2-core
    Zen 4 VM) while the run's first steps ran, and the run's two-thread forward stalled behind it (a 9-row forward
    took 238-262 ms instead of ~60). The next redraw's walkthrough replaces this, style and all."""
    panels = ",".join(f"#{i}" for i in FIGURE_IDS)
    dimmed = ",".join(f"#{i} > *" for i in FIGURE_IDS)
    labels = ",".join(f"#{i}::after" for i in FIGURE_IDS)
    when = f"drawn {interval_s:.0f} s into the run and when it ends"
    return (f"<style>{dimmed}{{opacity:0.25}}{panels}{{position:relative}}"
            f'{labels}{{content:"the previous run\'s figure (this run\'s is drawn {interval_s:.0f} s into it and when '
            'it ends)";position:absolute;top:45%;'
            "left:0;right:0;text-align:center;color:#555;font-size:14px;pointer-events:none}</style>"
            + WALK_STYLE + f"<p><i>The verifier's decisions: {when} (until then the figures are the previous "
            "run's, dimmed).</i></p>")


#: prompts longer than this (tokens) get a warning while their prefill runs
LONG_PROMPT_TOKENS = 2048


def status_line(record: Optional[RunRecord]) -> str:
    if record is None:
        return "Idle. Press Run, or Step through one step at a time."
    s = record.summary()
    note = f"  \n_{html.escape(record.note)}_" if record.note else ""
    prec = record.config.precision
    label = f"{record.label} @ {prec}" if prec else record.label
    shared = ""
    if record.status == "running" and record.waiting:
        shared = f" · ⏳ waiting for {html.escape(record.waiting)} (the models take one chunk or step at a time)"
    elif record.wait_seconds >= 0.5:
        own = s["seconds"] - record.wait_seconds
        alone = f", {s['tokens'] / own:.2f} tok/s without the waits" if s["tokens"] and own > 0 else ""
        shared = f" · {record.wait_seconds:.1f} s of it waiting for other sessions{alone}"
    if not s["steps"]:
        if record.status != "running":
            done, total = record.prefill
            cut = f" after {done:,} of {total:,} prefill tokens" if 0 < done < total else ""
            return f"**{label}** · {record.status} · no step yet{cut}{shared}{note}"
        n = len(record.prompt_ids)
        long = (" — a long prompt: on a CPU its prefill alone can take minutes" if n > LONG_PROMPT_TOKENS else "")
        done, total = record.prefill
        share = f" {100 * done / total:.0f}%" if total else ""
        if record.compiling:
            return f"**{label}** · running · {html.escape(record.compiling)} …{shared}{note}"
        return f"**{label}** · running · prefilling {n:,} prompt tokens …{share}{long}{shared}{note}"
    reason = f" ({s['finish_reason']})" if s["finish_reason"] and s["finish_reason"] != record.status else ""
    mixed = (f" · {s['suffix_steps']} of {s['steps']} steps drafted from the text (no draft forward)"
             if record.config.method == "hybrid" else "")
    if s["fallback"]:
        mixed += f" · fell back to plain decoding {html.escape(s['fallback'])}"
    if s["repeat_steps"]:
        mixed += (f" · {s['repeat_steps']} of its steps verified the text's own repeats where they were priced to pay "
                  "(no draft forward)")
    checked = prediction_lines(record)[1:]
    check = f"  \n{html.escape(checked[0])}" if checked else ""
    return (f"**{label}** · {record.status}{reason} · {count(s['tokens'], 'token')} in {count(s['steps'], 'step')} · "
            f"{s['tokens_per_s']:.2f} tok/s · {s['mean_tokens_per_step']:.2f} tokens/step{mixed}{shared}{check}{note}")


def text_html(record: Optional[RunRecord], show_legend: bool = True) -> str:
    if record is None:
        body = render_html([], placeholder="The generated text appears here, coloured by where each token came from.")
    else:
        prompt = record.settings.prompt + ("\n" if record.settings.chat else "")
        body = render_html(build_spans(record.traces, record.texts), prompt=prompt)
    return (legend_html() if show_legend else "") + body


def run_view(record: Optional[RunRecord], baseline: Optional[RunRecord], figures: bool = True) -> RunView:
    """The whole-run panels; ``figures=False`` leaves the two charts out (``None``: not drawn this time)."""
    if record is None or not record.traces:
        return RunView(text_html(record), empty_figure("tokens/s") if figures else None,
                       empty_figure("tokens per step") if figures else None, status_line(record),
                       cost_model_html(record, None))
    runs = [(record.label, record.traces)]
    base = baseline.traces if baseline is not None and baseline is not record else None
    return RunView(
        text_html=text_html(record),
        speed=speed_figure(runs, base) if figures else None,
        per_step=tokens_per_step_figure(runs, base) if figures else None,
        status=status_line(record),
        cost=cost_model_html(record, baseline if baseline is not record else None),
    )


def external_text_html(run: ExternalRun) -> str:
    """An external run's prompt and text coloured by round like the other columns (each round's
    tokens: the accepted draft tokens, then the target's own), and its note."""
    if run.texts is not None:
        provs = run.provenance()
        ids = [p.token_id for p in provs]
        body = render_html([TextSpan(text, tuple(provs[a:b])) for a, b, text in group_pieces(run.texts, ids)],
                           prompt=run.prompt)
    else:
        body = f'<div class="dt-text" style="{TEXT_STYLE}">{html.escape(run.text)}</div>'
    return body + f'<div style="color:#666;font-size:0.85em;margin-top:4px">{html.escape(run.note)}</div>'


def column_label(rec: RunRecord | ExternalRun) -> str:
    """A Compare column's heading: the method and the precisions it ran at."""
    if isinstance(rec, ExternalRun):
        return f"{rec.label} @ {rec.precisions}" if rec.precisions else rec.label
    c = rec.config
    if c.method == "autoregressive" or not c.precision:
        return f"{rec.label} @ {c.precision}" if c.precision else rec.label
    return f"{rec.label} @ target {c.precision}, draft {c.draft_precision or c.precision}"


def compare_views(records: Sequence[RunRecord | ExternalRun]) -> tuple[list[str], list[str], go.Figure, go.Figure]:
    """Per-run text + stats, and the shared speed / tokens-per-step charts (an ``ExternalRun``'s
    rounds are plotted like steps)."""
    texts, stats = [], []
    for rec in records:
        texts.append(external_text_html(rec) if isinstance(rec, ExternalRun) else text_html(rec, show_legend=False))
        s = rec.summary()
        lines = "" if isinstance(rec, ExternalRun) else "".join(
            f"  \n{html.escape(line)}" for line in prediction_lines(rec))
        stats.append(
            f"**{html.escape(column_label(rec))}** · {rec.status}  \n"
            f"{s['tokens']} tokens · {s['steps']} target steps · {s['seconds']:.2f} s  \n"
            f"**{s['tokens_per_s']:.2f} tok/s** · **{s['mean_tokens_per_step']:.2f} tokens/step**{lines}"
            if s["steps"] else f"**{html.escape(column_label(rec))}** · waiting"
        )
    runs = [(r.label, r.traces) for r in records if r.traces]
    if runs:
        return texts, stats, speed_figure(runs), tokens_per_step_figure(runs)
    return texts, stats, empty_figure("tokens/s"), empty_figure("tokens per step")


def export_figures(record: RunRecord, step: Optional[float], block_size: int) -> dict[str, go.Figure]:
    """Figures written by the export buttons (tree and masks of the selected step, whole run)."""
    idx = clamp_step(record, step)
    figs: dict[str, go.Figure] = {}
    if idx is not None:
        trace = record.traces[idx]
        tree = tree_figure(trace, record.texts, record.root_token(idx))
        tree.update_layout(width=1100)
        figs[f"tree_step{idx}"] = tree
        figs[f"masks_step{idx}_b{int(block_size)}"] = masks_figure(trace, int(block_size))
    spans = build_spans(record.traces, record.texts)
    prompt = record.settings.prompt + ("\n" if record.settings.chat else "")
    summ = record.summary()
    title = (f"{record.label} · {summ['tokens']} tokens in {summ['steps']} steps · "
             f"{summ['mean_tokens_per_step']:.2f} tokens/step" if summ["steps"] else record.label)
    figs["colored_text"] = text_figure(spans, prompt=prompt, title=title)
    if record.traces:
        speed = speed_figure([(record.label, record.traces)])
        speed.update_layout(width=900)
        figs["tokens_per_s"] = speed
    return figs
