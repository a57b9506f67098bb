"""The coloured text as a plotly figure, so that it exports to PNG/SVG like the other panels.

Layout is a monospace character grid computed here: each span becomes one background rectangle
per line segment and one text item per segment, placed at its exact column (so widths never
drift). Wide (East Asian) characters take two columns; tabs expand to 4 spaces.
"""

from __future__ import annotations

import unicodedata
from typing import Optional, Sequence

import plotly.graph_objects as go

from .colored_text import TextSpan, span_tooltip
from .palette import PROMPT_COLOR, TEXT_KIND_LABELS, TEXT_SHADES, text_shade

FONT = "DejaVu Sans Mono, monospace"
CHAR_W = 0.6  # advance of DejaVu Sans Mono, in em


def _width(ch: str) -> int:
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1


def layout_segments(items: Sequence[tuple[str, Optional[TextSpan]]], columns: int):
    """``[(line, col, text, span)]`` segments: ``items`` are ``(text, span)`` pieces in order
    (span None for the prompt); lines wrap at ``columns`` and at newlines."""
    segs: list[tuple[int, int, str, Optional[TextSpan]]] = []
    line, col = 0, 0
    for text, span in items:
        cur, start = "", col
        for ch in text.replace("\t", "    "):
            if ch == "\n":
                if cur:
                    segs.append((line, start, cur, span))
                cur, line, col, start = "", line + 1, 0, 0
                continue
            w = _width(ch)
            if col + w > columns:
                if cur:
                    segs.append((line, start, cur, span))
                cur, line, col, start = "", line + 1, 0, 0
            cur += ch
            col += w
        if cur:
            segs.append((line, start, cur, span))
    return segs, line + 1


def _plot_text(text: str) -> str:
    # plotly parses a little HTML and collapses runs of spaces: escape and use no-break spaces
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace(" ", "\u00a0")


def text_figure(spans: Sequence[TextSpan], prompt: Optional[str] = None, columns: int = 96,
                font_size: int = 14, title: Optional[str] = None) -> go.Figure:
    items: list[tuple[str, Optional[TextSpan]]] = []
    if prompt:
        items.append((prompt, None))
    items.extend((s.text, s) for s in spans)
    segs, lines = layout_segments(items, columns)
    line_h = 1.0
    fig = go.Figure()
    # backgrounds: one filled trace per colour
    boxes: dict[str, tuple[list, list]] = {}
    for line, col, text, span in segs:
        if span is None:
            continue
        w = sum(_width(c) for c in text)
        xs, ys = boxes.setdefault(text_shade(span.kind, span.step), ([], []))
        y0, y1 = -line * line_h - 0.42, -line * line_h + 0.42
        xs += [col, col + w, col + w, col, col, None]
        ys += [y0, y0, y1, y1, y0, None]
    for color, (xs, ys) in boxes.items():
        fig.add_trace(go.Scatter(x=xs, y=ys, fill="toself", fillcolor=color, mode="none", hoverinfo="skip",
                                 showlegend=False))
    for is_prompt in (True, False):
        chosen = [s for s in segs if (s[3] is None) == is_prompt]
        if not chosen:
            continue
        fig.add_trace(go.Scatter(
            x=[c for _, c, _, _ in chosen], y=[-ln * line_h for ln, _, _, _ in chosen],
            text=[_plot_text(t) for _, _, t, _ in chosen], mode="text", textposition="middle right",
            textfont=dict(family=FONT, size=font_size, color=PROMPT_COLOR if is_prompt else "#111111"),
            hovertext=None if is_prompt else [span_tooltip(s).replace("\n", "<br>") for _, _, _, s in chosen],
            hoverinfo="skip" if is_prompt else "text", showlegend=False,
        ))
    for kind in ("accepted", "bonus", "autoregressive"):
        if any(s.kind == kind for s in spans):
            fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=TEXT_KIND_LABELS[kind],
                                     marker=dict(symbol="square", size=14, color=TEXT_SHADES[kind][1])))
    char_px = CHAR_W * font_size
    margin = dict(l=20, r=20, t=50 if title else 20, b=50)
    width = int(columns * char_px + margin["l"] + margin["r"]) + 2
    height = int(lines * font_size * 1.7 + margin["t"] + margin["b"])
    fig.update_layout(
        title=dict(text=title, font=dict(size=13)) if title else None, width=width, height=max(height, 160), margin=margin,
        xaxis=dict(visible=False, range=[0, columns], fixedrange=True),
        yaxis=dict(visible=False, range=[-(lines - 1) * line_h - 0.6, 0.6], fixedrange=True),
        plot_bgcolor="white", paper_bgcolor="white",
        legend=dict(orientation="h", y=0, yanchor="top", x=0),
    )
    return fig
