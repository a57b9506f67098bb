"""The per-step draft tree as a plotly figure (layered layout computed here, no graphviz).

Nodes are coloured by their verification status (root / accepted / rejected / never verified)
plus the step's bonus token, drawn as an extra child of the last accepted node. The accepted
path root -> ... -> bonus is drawn with thick edges. The draft nodes' shape says what proposed them:
circles the draft model, teal-edged squares the text so far (suffix / hybrid steps). Hover shows the
token, p_draft, p_target, acceptance probability, depth and draw rank.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import networkx as nx
import plotly.graph_objects as go

from dyntree_core.decode.plain_probes import PROBE
from dyntree_core.trace import StepTrace

from .fmt import prob
from .palette import NODE_COLORS, NODE_LABELS, SOURCE_EDGE, SOURCE_LABELS, SOURCE_SYMBOLS
from .plotly_spec import Spec, figure
from .tokens import TokenTexts, visible_whitespace

LABEL_LIMIT = 80  # nodes; above this only the accepted path is labelled


#: more siblings than this under one node and only the accepted path is labelled
WIDE_FAN = 12


def tree_layout(parents: Sequence[int], child_rank: Sequence[int]) -> dict[int, tuple[float, float]]:
    """Layered positions: y = -depth; leaves get consecutive x in DFS order (children in draw
    order), a parent sits midway between its first and last child."""
    n = len(parents)
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    g.add_edges_from((int(p), i) for i, p in enumerate(parents) if p >= 0)
    rank = [int(r) for r in child_rank]

    def by_rank(nodes):
        return sorted(nodes, key=lambda v: (rank[v], v))

    depth = nx.single_source_shortest_path_length(g, 0)
    x: dict[int, float] = {}
    next_leaf = 0
    for v in nx.dfs_postorder_nodes(g, 0, sort_neighbors=by_rank):
        kids = by_rank(g.successors(v))
        if kids:
            x[v] = (x[kids[0]] + x[kids[-1]]) / 2.0
        else:
            x[v] = float(next_leaf)
            next_leaf += 1
    return {v: (x[v], -float(depth[v])) for v in range(n)}


@dataclass
class _Node:
    label: str
    status: str
    hover: str


def tree_figure(trace: StepTrace, texts: TokenTexts, root_token: int, title: Optional[str] = None,
                highlight: Optional[int] = None) -> go.Figure:
    """The draft tree of ``trace`` with the accepted path and the bonus token; ``highlight`` rings
    one node (the verification walkthrough's current decision; ``n`` = the bonus token)."""
    if trace.tree is None:
        return _ar_figure(trace, texts, root_token, title)
    tree = trace.tree
    n = tree.size
    tokens = tree.tokens.tolist()
    parents = tree.parents.tolist()
    ranks = tree.child_rank.tolist()
    depth = tree.depth.tolist()
    logq = tree.draft_logprob.tolist()
    status = list(trace.node_status) or ["unverified"] * n
    p_target = list(trace.node_p_target) if len(trace.node_p_target) == n else [math.nan] * n
    p_acc = list(trace.node_accept_prob) if len(trace.node_accept_prob) == n else [math.nan] * n
    path = [int(v) for v in trace.accepted_nodes] or [0]
    last = path[-1]
    for i in trace.cut_nodes:  # accepted by the verifier, dropped by the run's limit
        status[i] = "cut"

    bonus = next((c for c in trace.committed if c.kind == "bonus"), None)
    drawn_bonus = bonus is not None or trace.bonus_cut
    all_parents = parents + ([last] if drawn_bonus else [])
    all_ranks = ranks + ([10**9] if drawn_bonus else [])
    pos = tree_layout(all_parents, all_ranks)

    nodes: list[_Node] = []
    for i in range(n):
        tok_text = texts.piece(tokens[i])
        p_draft = math.exp(logq[i]) if i > 0 else math.nan
        hover = (
            f"<b>{_hover_escape(visible_whitespace(tok_text, 30))}</b> (id {tokens[i]})<br>"
            f"node {i} · {NODE_LABELS.get(status[i], status[i])}<br>"
            f"depth {depth[i]} · draw rank {ranks[i]}<br>"
            f"p_draft {prob(p_draft)} · p_target {prob(p_target[i])}<br>"
            f"accept prob {prob(p_acc[i])}"
            + (f"<br>{SOURCE_LABELS[trace.draft_source or 'model']}" if i > 0 else "")
        )
        nodes.append(_Node(visible_whitespace(tok_text, 10), status[i], hover))
    if bonus is not None:
        tok_text = texts.piece(bonus.token_id)
        nodes.append(_Node(
            visible_whitespace(tok_text, 10), "bonus",
            f"<b>{_hover_escape(visible_whitespace(tok_text, 30))}</b> (id {bonus.token_id})<br>"
            f"bonus token after node {last}<br>depth {bonus.depth}<br>"
            f"p_draft {prob(bonus.p_draft)} · p_target {prob(bonus.p_target)}",
        ))
    elif drawn_bonus:
        tok_text = texts.piece(trace.bonus_token)
        nodes.append(_Node(
            visible_whitespace(tok_text, 10), "cut",
            f"<b>{_hover_escape(visible_whitespace(tok_text, 30))}</b> (id {trace.bonus_token})<br>"
            f"bonus token after node {last}, drawn but not kept: {_why_cut(trace)}",
        ))

    on_path = set(path)
    traces: list[Spec] = []
    # edges: ordinary ones thin and grey, the accepted path thick and green
    ex, ey, px, py = [], [], [], []
    for child in range(1, len(all_parents)):
        par = all_parents[child]
        (x0, y0), (x1, y1) = pos[par], pos[child]
        accepted_edge = (child in on_path and par in on_path) or (child >= n)
        xs, ys = (px, py) if accepted_edge else (ex, ey)
        xs += [x0, x1, None]
        ys += [y0, y1, None]
    traces.append(dict(type="scatter", x=ex, y=ey, mode="lines", line=dict(color="#bbbbbb", width=1),
                       hoverinfo="skip", showlegend=False))
    traces.append(dict(type="scatter", x=px, y=py, mode="lines", line=dict(color=NODE_COLORS["accepted"], width=4),
                       hoverinfo="skip", name="accepted path"))
    fan = max((all_parents.count(u) for u in set(all_parents[1:])), default=0)
    # a wide fan (e.g. T = 2: 31 children of one node) would print its labels over each other:
    # then only the path and the bonus are labelled and the others keep their hover text
    show_all_labels = len(nodes) <= LABEL_LIMIT and fan <= WIDE_FAN
    origin = trace.draft_source or "model"
    size = 16 if len(nodes) <= 128 else 9

    def symbol(i: int) -> str:
        if i >= n:
            return "diamond"
        return SOURCE_SYMBOLS[origin] if i > 0 else "circle"

    def edge(i: int) -> str:
        return SOURCE_EDGE[origin] if 0 < i < n else SOURCE_EDGE["model"]

    for st in ("root", "accepted", "cut", "rejected", "unverified", "bonus"):
        idx = [i for i, nd in enumerate(nodes) if nd.status == st]
        if not idx:
            continue
        labels = [_hover_escape(nodes[i].label) if (show_all_labels or i in on_path or i >= n) else "" for i in idx]
        traces.append(dict(
            type="scatter", x=[pos[i][0] for i in idx], y=[pos[i][1] for i in idx],
            mode="markers+text", text=labels, textposition="bottom center",
            textfont=dict(size=11, family="DejaVu Sans Mono, monospace"),
            marker=dict(size=size, color=NODE_COLORS[st],
                        line=dict(color=[edge(i) for i in idx], width=[2 if edge(i) != SOURCE_EDGE["model"] else 1 for i in idx]),
                        symbol=[symbol(i) for i in idx]),
            hovertext=[nodes[i].hover for i in idx], hoverinfo="text", name=NODE_LABELS[st],
        ))
    if n > 1:
        # the shape says which source proposed the draft tokens (hybrid switches per step)
        traces.append(dict(
            type="scatter", x=[None], y=[None], mode="markers", hoverinfo="skip", name=SOURCE_LABELS[origin],
            marker=dict(size=12, color="white", symbol=SOURCE_SYMBOLS[origin],
                        line=dict(color=SOURCE_EDGE[origin], width=2)),
        ))
    if highlight is not None and highlight in pos:
        hx, hy = pos[highlight]
        traces.append(dict(type="scatter", x=[hx], y=[hy], mode="markers", hoverinfo="skip",
                           marker=dict(size=30, color="rgba(0,0,0,0)", line=dict(color="#e6a100", width=4)),
                           name=f"walkthrough: node {highlight}" if highlight < n else "walkthrough: bonus"))
    levels = int(max(-y for _, y in pos.values())) + 1
    accepted = len(path) - 1
    cut = len(trace.cut_nodes) + int(trace.bonus_cut)
    kept = (f" · {trace.num_committed} kept ({_why_cut(trace)})" if cut else "")
    return figure(traces, dict(
        title=dict(text=title or (f"step {trace.step} · {trace.method}/{trace.verifier} · tree of {n} nodes · "
                                  f"accepted {accepted}" + (" + bonus" if drawn_bonus else "") + kept
                                  + (" · drafted from the text (no draft forward)" if origin in ("suffix", "repeats")
                                     else ""))),
        height=max(320, min(900, 110 * levels + 140)),
        margin=dict(l=20, r=20, t=60, b=20),
        xaxis=dict(visible=False), yaxis=dict(visible=False, range=[-(levels - 1) - 0.6, 0.4]),
        legend=dict(orientation="h", y=-0.02, yanchor="top"),
        plot_bgcolor="white", paper_bgcolor="white", hovermode="closest",
    ))


def _why_cut(trace: StepTrace) -> str:
    return {"length": "max new tokens reached", "context": "the model's context is full",
            "eos": "end of sequence came first"}.get(trace.finish_reason or "", "the run ended")


def _ar_figure(trace: StepTrace, texts: TokenTexts, root_token: int, title: Optional[str]) -> go.Figure:
    """Autoregressive steps have no draft tree: root -> the target's token."""
    tok = trace.committed[0] if trace.committed else None
    traces: list[Spec] = [
        dict(type="scatter", x=[0, 0], y=[0, -1], mode="lines", line=dict(color=NODE_COLORS["accepted"], width=4),
             hoverinfo="skip", showlegend=False),
        dict(type="scatter", x=[0], y=[0], mode="markers+text",
             text=[_hover_escape(visible_whitespace(texts.piece(root_token), 10))],
             textposition="middle right", marker=dict(size=16, color=NODE_COLORS["root"]),
             hovertext=[f"root: last committed token (id {root_token})"], hoverinfo="text", name=NODE_LABELS["root"]),
    ]
    if tok is not None:
        traces.append(dict(
            type="scatter", x=[0], y=[-1], mode="markers+text",
            text=[_hover_escape(visible_whitespace(texts.piece(tok.token_id), 10))],
            textposition="middle right", marker=dict(size=16, color=NODE_COLORS["bonus"], symbol="diamond"),
            hovertext=[f"id {tok.token_id} · p_target {prob(tok.p_target)}"], hoverinfo="text",
            name="target token"))
    return figure(traces, dict(
        title=dict(text=title or (f"step {trace.step} · a plain step timing plain decoding inside this run (no draft "
                                  "tree; its token is the run's)" if trace.draft_source == PROBE else
                                  f"step {trace.step} · autoregressive: no draft tree, one target token per step")),
        height=320, margin=dict(l=20, r=20, t=60, b=20), xaxis=dict(visible=False, range=[-1, 2]),
        yaxis=dict(visible=False, range=[-1.6, 0.5]), plot_bgcolor="white", paper_bgcolor="white",
        legend=dict(orientation="h", y=-0.02, yanchor="top"),
    ))


@functools.lru_cache(maxsize=64)
def empty_figure(message: str, height: int = 320) -> go.Figure:
    """A blank figure with a centred note (before the first run, for missing data). Built once per note and
    shared: do not modify it."""
    return figure([], dict(
        annotations=[dict(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper",
                          font=dict(size=14, color="#777777"))],
        height=height, xaxis=dict(visible=False), yaxis=dict(visible=False),
        plot_bgcolor="white", paper_bgcolor="white", margin=dict(l=20, r=20, t=40, b=20)))


def _hover_escape(text: str) -> str:
    """Plotly hover text understands a few HTML tags; show token text literally."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
