"""The generated text coloured by provenance (never by matching strings in the output).

Every committed token carries a ``TokenProvenance``; its id is decoded on its own
(``TokenTexts``), so the colour of each piece is exactly the kind of the token that produced it:
accepted draft token, bonus token or autoregressive token, in two shades alternating by step.
All text is HTML-escaped and shown with ``white-space: pre-wrap``, so code, markdown and
whitespace appear literally.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from dyntree_core.trace import StepTrace, TokenProvenance

from .fmt import prob
from .palette import PROMPT_COLOR, TEXT_KIND_LABELS, TEXT_SHADES, text_shade
from .tokens import TokenTexts, group_pieces

TEXT_STYLE = ("white-space:pre-wrap;word-break:break-word;font-family:'DejaVu Sans Mono',ui-monospace,monospace;"
              "font-size:14px;line-height:1.7;padding:8px;border:1px solid #e5e5e5;border-radius:6px;"
              "background:#ffffff;color:#111111;max-height:420px;overflow-y:auto")
#: a longer prompt shows only its end (the page stays readable; the export keeps it whole)
PROMPT_SHOWN_CHARS = 1500


@dataclass(frozen=True)
class TextSpan:
    """A piece of output text and the committed token(s) it came from (several only when one
    character was split over byte-level tokens)."""

    text: str
    tokens: tuple[TokenProvenance, ...]

    @property
    def kind(self) -> str:
        return self.tokens[0].kind

    @property
    def step(self) -> int:
        return self.tokens[0].step


def build_spans(traces: Sequence[StepTrace], texts: TokenTexts) -> list[TextSpan]:
    provs = [c for t in traces for c in t.committed]
    ids = [p.token_id for p in provs]
    return [TextSpan(text, tuple(provs[a:b])) for a, b, text in group_pieces(texts, ids)]


def token_tooltip(p: TokenProvenance) -> str:
    where = f"node {p.node}" if p.node >= 0 else "not a tree node"
    lines = [f"step {p.step} · {TEXT_KIND_LABELS.get(p.kind, p.kind)} · token id {p.token_id}",
             f"depth {p.depth} · {where}",
             f"p_draft {prob(p.p_draft)} · p_target {prob(p.p_target)} · accept prob {prob(p.accept_prob)}"]
    return "\n".join(lines)


def span_tooltip(span: TextSpan) -> str:
    return "\n--\n".join(token_tooltip(p) for p in span.tokens)


def legend_html(kinds: Iterable[str] = ("accepted", "bonus", "autoregressive")) -> str:
    items = []
    for kind in kinds:
        a, b = TEXT_SHADES[kind]
        items.append(
            f'<span style="display:inline-block;margin-right:14px"><span style="background:{a};padding:0 6px">'
            f'&nbsp;</span><span style="background:{b};padding:0 6px">&nbsp;</span> {html.escape(TEXT_KIND_LABELS[kind])}'
            "</span>"
        )
    return ('<div class="dt-legend" style="font-size:12px;color:#444;margin:4px 0">'
            + "".join(items) + " · shades alternate by step · hover a token for its provenance</div>")


def render_html(spans: Sequence[TextSpan], prompt: Optional[str] = None, placeholder: str = "") -> str:
    """The coloured text as a self-contained HTML fragment (inline styles, escaped content)."""
    parts = [f'<div id="dt-colored-text" class="dt-text" style="{TEXT_STYLE}">']
    if prompt:
        if len(prompt) > PROMPT_SHOWN_CHARS:
            parts.append(f'<span class="dt-prompt-cut" style="color:#999">[… {len(prompt) - PROMPT_SHOWN_CHARS:,} '
                         f'earlier prompt characters not shown …] </span>')
            prompt = prompt[-PROMPT_SHOWN_CHARS:]
        parts.append(f'<span class="dt-prompt" style="color:{PROMPT_COLOR}" title="prompt">{html.escape(prompt)}</span>')
    if not spans and placeholder:
        parts.append(f'<span class="dt-placeholder" style="color:#999">{html.escape(placeholder)}</span>')
    for span in spans:
        cls = f"dt-tok dt-{span.kind} dt-s{span.step % 2}"
        parts.append(
            f'<span class="{cls}" data-step="{span.step}" style="background:{text_shade(span.kind, span.step)};'
            f'border-radius:2px" title="{html.escape(span_tooltip(span), quote=True)}">{html.escape(span.text)}</span>'
        )
    parts.append("</div>")
    return "".join(parts)
