"""The step's tree-attention mask as a heatmap, in BFS, DFS or HPD node order.

Cell values: 0 = inside an all-zero block (a block-skipping kernel never touches it),
1 = masked-out cell inside a non-zero block (computed, then masked), 2 = visible ancestor,
3 = visible ancestor on an accepted node's row. The block grid for the chosen block size is drawn
over it and the title gives the number of non-zero blocks, which is what DFS reordering shrinks.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from dyntree_core.trace import StepTrace
from dyntree_core.tree import count_nonzero_blocks

from .plotly_spec import Spec, figure
from .tree_figure import empty_figure

ORDER_TITLES = {"bfs": "BFS (original)", "dfs": "DFS", "hpd": "HPD"}
MAX_CELLS = 256  # larger masks are shown downsampled (any() over tiles)
#: colour of each cell value 0..3 (see the module docstring)
MASK_COLORS: tuple[str, ...] = ("#ffffff", "#f9c784", "#2b6cb0", "#2ca02c")
MASK_LEGEND = ("white: all-zero block, **skipped** by the kernel · amber: a masked cell inside a **computed** block "
               "(work done, then thrown away) · blue: visible ancestor · green: accepted path rows · "
               "grey lines: block grid. HPD is DFS with each node's heaviest subtree first: it differs from "
               "DFS only where a later-drawn sibling has the larger subtree; its title says when no sibling "
               "did on the shown step.")


def _colorscale() -> list[list]:
    """One flat band per value: z in {0..3} sits at 0, 1/3, 2/3, 1 of the scale (zmin 0, zmax 3)."""
    k = len(MASK_COLORS) - 1
    scale: list[list] = []
    for v, color in enumerate(MASK_COLORS):
        lo, hi = max(0.0, (v - 0.5) / k), min(1.0, (v + 0.5) / k)
        scale += [[lo, color], [hi, color]]
    return scale


_COLORSCALE = _colorscale()


def mask_matrix(trace: StepTrace, order: str, block_size: int) -> tuple[np.ndarray, torch.Tensor, int]:
    """``(values [N,N] uint8, order permutation, non-zero block count)`` for one order."""
    tree = trace.tree
    assert tree is not None
    perm = tree.order(order)
    mask = tree.ancestor_mask(perm)
    blocks = count_nonzero_blocks(mask, block_size)
    n = tree.size
    nb = -(-n // block_size)
    padded = torch.zeros(nb * block_size, nb * block_size, dtype=torch.bool)
    padded[:n, :n] = mask
    tiles = padded.view(nb, block_size, nb, block_size).any(dim=3).any(dim=1)
    in_block = tiles.repeat_interleave(block_size, 0).repeat_interleave(block_size, 1)[:n, :n]
    values = in_block.numpy().astype(np.uint8)
    values[mask.numpy()] = 2
    accepted = set(int(v) for v in trace.accepted_nodes)
    rows = [j for j, node in enumerate(perm.tolist()) if node in accepted]
    if rows:
        r = np.asarray(rows)
        sub = values[r]
        sub[sub == 2] = 3
        values[r] = sub
    return values, perm, blocks


def _downsample(values: np.ndarray) -> tuple[np.ndarray, int]:
    n = values.shape[0]
    if n <= MAX_CELLS:
        return values, 1
    s = -(-n // MAX_CELLS)
    m = -(-n // s)
    padded = np.zeros((m * s, m * s), dtype=np.uint8)
    padded[:n, :n] = values
    return padded.reshape(m, s, m, s).max(axis=(1, 3)), s


def mask_heatmap(trace: StepTrace, order: str, block_size: int) -> tuple[Spec, list[dict], str, int]:
    """``(heatmap trace, block-grid lines, title, non-zero blocks)`` of one order."""
    values, perm, blocks = mask_matrix(trace, order, block_size)
    n = values.shape[0]
    shown, scale = _downsample(values)
    nb = -(-n // block_size)
    template = ("query slot %{y}<br>key slot %{x}<extra></extra>" if scale == 1
                else f"query tile %{{y}} (×{scale})<br>key tile %{{x}}<extra></extra>")
    heat = dict(type="heatmap", z=shown, zmin=0, zmax=3, colorscale=_COLORSCALE, showscale=False,
                hovertemplate=template, xgap=0, ygap=0)
    lines: list[dict] = []
    edge = n / scale
    for b in range(1, nb):
        c = b * block_size / scale - 0.5
        lines.append(dict(type="line", x0=c, x1=c, y0=-0.5, y1=edge - 0.5, line=dict(color="#7a7a7a", width=1)))
        lines.append(dict(type="line", y0=c, y1=c, x0=-0.5, x1=edge - 0.5, line=dict(color="#7a7a7a", width=1)))
    note = f" · shown ÷{scale}" if scale > 1 else ""
    if order == "hpd" and torch.equal(perm, trace.tree.order("dfs")):
        note += " · same order as DFS (every heaviest subtree was drawn first)"
    title = f"{ORDER_TITLES[order]}: {blocks} of {nb * nb} blocks non-zero ({block_size}×{block_size}){note}"
    return heat, lines, title, blocks


def mask_figure(trace: Optional[StepTrace], order: str, block_size: int) -> go.Figure:
    """One order's mask heatmap for ``trace`` (a note for autoregressive steps)."""
    if trace is None or trace.tree is None:
        return empty_figure(f"{ORDER_TITLES[order]}: no tree mask (autoregressive step)", height=360)
    heat, lines, title, _ = mask_heatmap(trace, order, block_size)
    return figure([heat], dict(
        title=dict(text=title, font=dict(size=13)), height=380, margin=dict(l=40, r=10, t=50, b=30),
        **(dict(shapes=lines) if lines else {}), plot_bgcolor="white", paper_bgcolor="white",
        xaxis=dict(title=dict(text="key slot"), constrain="domain", showgrid=False, zeroline=False),
        yaxis=dict(title=dict(text="query slot"), autorange="reversed", scaleanchor="x", showgrid=False,
                   zeroline=False),
    ))


def masks_figure(trace: StepTrace, block_size: int, orders: tuple[str, ...] = ("bfs", "dfs", "hpd")) -> go.Figure:
    """All orders side by side in one figure (for export)."""
    if trace.tree is None:
        return empty_figure("no tree mask (autoregressive step)")
    parts = [mask_heatmap(trace, o, block_size) for o in orders]
    fig = make_subplots(rows=1, cols=len(orders), subplot_titles=[p[2] for p in parts], horizontal_spacing=0.04)
    for i, (heat, lines, _, _) in enumerate(parts, start=1):
        fig.add_trace(heat, row=1, col=i)
        axis = "" if i == 1 else str(i)
        for ln in lines:
            fig.add_shape(dict(ln, xref=f"x{axis}", yref=f"y{axis}"))
        fig.update_yaxes(autorange="reversed", scaleanchor=f"x{axis}", showgrid=False, row=1, col=i)
        fig.update_xaxes(constrain="domain", showgrid=False, row=1, col=i)
    fig.update_annotations(font_size=12)
    fig.update_layout(title=f"step {trace.step} · tree attention mask · {trace.tree.size} nodes",
                      height=480, width=1400, plot_bgcolor="white", paper_bgcolor="white",
                      margin=dict(l=30, r=20, t=80, b=30))
    return fig
