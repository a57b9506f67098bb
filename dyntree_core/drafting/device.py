"""Greedy (T = 0) drafting on the device: every level's top-k and DySpec's budgeted selection are
tensor ops, so a step's tree is grown without reading the device; the engine reads it once,
together with the verification inputs (``decode.engine``, ``decode.host.fetch``).

Drafters here talk to a ``LevelSource`` (``decode.draft_source.ModelDraftSource.expand``): one
batched draft forward per level over a fixed number of rows, rows that are not ``live`` being
padding (forwarded, never attended to). Static shapes per level make the forwards
graph-capturable.

* ``chain_greedy``: the draft argmax at each of ``depth`` levels (``ChainDrafter`` at T = 0).
* ``topn_greedy``: DySpec's greedy at T = 0 (``DySpecGreedyDrafter``, App. D.1): the ``n =
  budget - 1`` draws with the largest weights (products of draft probabilities along the path)
  in the depth-capped tree of top-k draws. Computed level-synchronously: after level l the
  candidate set C holds the n best nodes of depth <= l (keys ordered weight desc, then depth asc,
  then creation order); the live frontier is C's nodes at depth l; their top-n children join C
  and the n best are kept. A node outside C never re-enters, and a child never beats its parent
  (weight <= parent's, deeper), so C after the last level is the host heap's selection; the tree
  is the same, numbered in (depth, draw order) order. Exact ties at the n-th weight may resolve
  differently from the host heap, whose third key is its own virtual-node order.

Trees come back as a ``DeviceTree`` padded to a fixed size (``valid`` marks the real nodes, which
come first; padding nodes hang off the root with the highest draw ranks, so every node order of
the padded tree lists the real nodes as the real tree's order does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

_NEG = float("-inf")


class LevelSource(Protocol):
    """One batched draft forward per tree level (see ``ModelDraftSource.expand``)."""

    vocab_size: int

    def reserve(self, rows: int) -> None:
        """At most ``rows`` rows will be forwarded this step (sizes the ancestor table)."""
        ...

    def expand(self, tokens: torch.Tensor, parent_rows: torch.Tensor, live: torch.Tensor,
               depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward ``[m]`` ``tokens`` at tree depth ``depth`` whose parents are the earlier rows
        ``parent_rows`` (-1: the root, which has no parent); returns ``([m, V]`` float32 draft
        probabilities, ``[m]`` row ids of the new rows)."""
        ...


@dataclass
class DeviceTree:
    """A drafted tree on the device, padded to ``size`` nodes (real nodes first, root = node 0).

    Attributes (all ``[N]`` on the device unless said otherwise):
        tokens, parents, child_rank: int64 as in ``TokenTree`` (padding: parent 0, rank >= N).
        q: float64 draft probability of the node's token under its parent's row (root 1).
        value: float64 product of ``q`` along the path (the DySpec weight).
        valid: bool, real node.
        row: int64 the source row that forwarded the node (-1: never forwarded).
        internal: bool, the node has real children.
        draft_rows: ``[N, V]`` float32 draft distribution at each forwarded node (rows of nodes
            that were not forwarded are unspecified).
        levels: bound on nodes per root path (max depth + 1), host int.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    child_rank: torch.Tensor
    q: torch.Tensor
    value: torch.Tensor
    valid: torch.Tensor
    row: torch.Tensor
    internal: torch.Tensor
    draft_rows: torch.Tensor
    levels: int

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])


def _top_sorted(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row the ``k`` largest probabilities, in descending order with ties by token id
    (the host ``topk_rows`` order): ``(tokens [m, k] int64, probs [m, k] float32)``."""
    vals, idx = torch.topk(probs, k, dim=1)
    by_id = torch.sort(idx, dim=1, stable=True)
    vals, idx = vals.gather(1, by_id.indices), by_id.values
    order = torch.sort(vals, dim=1, descending=True, stable=True).indices
    return idx.gather(1, order), vals.gather(1, order)


def chain_greedy(source: LevelSource, root_token: int, depth: int, device: torch.device) -> DeviceTree:
    """``depth`` draft argmax tokens below ``root_token``, one forward per level."""
    source.reserve(depth)
    n = depth + 1
    tokens = torch.empty(n, dtype=torch.long, device=device)
    tokens[0] = root_token
    q = torch.ones(n, dtype=torch.float64, device=device)
    rows = torch.empty(n, dtype=torch.long, device=device)
    draft_rows = None
    parent_row = torch.full((1,), -1, dtype=torch.long, device=device)
    live = torch.ones(1, dtype=torch.bool, device=device)
    for level in range(depth):
        probs, row = source.expand(tokens[level:level + 1], parent_row, live, level)
        if draft_rows is None:
            draft_rows = torch.empty(n, probs.shape[1], dtype=probs.dtype, device=device)
        draft_rows[level] = probs[0]
        rows[level] = row[0]
        tok = torch.argmax(probs, dim=1)  # [1]; first index on ties, as numpy's argmax
        tokens[level + 1:level + 2] = tok
        q[level + 1:level + 2] = probs.gather(1, tok[:, None])[:, 0].double()  # no 0-dim index: that reads
        parent_row = row
    rows[depth] = -1
    ids = torch.arange(n, device=device)
    return DeviceTree(tokens=tokens, parents=ids - 1, child_rank=torch.zeros(n, dtype=torch.long, device=device),
                      q=q, value=torch.cumprod(q, 0), valid=torch.ones(n, dtype=torch.bool, device=device),
                      row=rows, internal=ids < depth, draft_rows=draft_rows, levels=n)


def topn_greedy(source: LevelSource, root_token: int, budget: int, depth: int, device: torch.device) -> DeviceTree:
    """DySpec's greedy tree at T = 0 (see the module docstring): ``budget`` nodes with the root."""
    n = budget - 1
    k = min(n, int(source.vocab_size))
    source.reserve(1 + (depth - 1) * n)
    i64 = dict(dtype=torch.long, device=device)
    f64 = dict(dtype=torch.float64, device=device)
    # candidates C (n slots; the real ones in (depth, cid) order); cid = creation id, root = 0
    c_tok = torch.zeros(n, **i64)
    c_w = torch.full((n,), _NEG, **f64)
    c_q = torch.zeros(n, **f64)
    c_depth = torch.full((n,), depth + 1, **i64)
    c_cid = torch.zeros(n, **i64)
    c_pcid = torch.zeros(n, **i64)
    c_prow = torch.full((n,), -1, **i64)  # source row of the parent
    c_row = torch.full((n,), -1, **i64)  # own source row once forwarded
    next_cid = 1
    for level in range(depth):
        if level == 0:
            live = torch.ones(1, dtype=torch.bool, device=device)
            probs, row = source.expand(torch.full((1,), root_token, **i64), torch.full((1,), -1, **i64), live, 0)
            root_rows, root_row_id = probs, row
            c_rows = torch.zeros(n, probs.shape[1], dtype=probs.dtype, device=device)  # [n, V] forwarded candidates' rows
            f_w, f_cid = torch.ones(1, **f64), torch.zeros(1, **i64)
        else:
            live = (c_depth == level) & (c_w > _NEG)
            probs, row = source.expand(c_tok, c_prow, live, level)
            c_row = torch.where(live, row, c_row)
            c_rows = torch.where(live[:, None], probs, c_rows)
            f_w, f_cid = c_w, c_cid
        m = probs.shape[0]
        kid_tok, kid_p = _top_sorted(probs, k)
        kid_w = torch.where(live[:, None] & (kid_p > 0), f_w[:, None] * kid_p.double(), _NEG).reshape(-1)
        # the n best of C and the new children by (weight desc, depth asc, cid asc): the pool is
        # in (depth, cid) order for its real entries, so a stable sort by weight is that order
        pick = torch.sort(torch.sort(-torch.cat([c_w, kid_w]), stable=True).indices[:n]).values
        from_kid = pick >= n
        old = pick.clamp(max=n - 1)
        kid = (pick - n).clamp(min=0)
        parent_slot = kid // k

        def choose(c: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
            return torch.where(from_kid, new, c[old])

        c_tok = choose(c_tok, kid_tok.reshape(-1)[kid])
        c_q = choose(c_q, kid_p.double().reshape(-1)[kid])
        c_w = choose(c_w, kid_w[kid])
        c_depth = choose(c_depth, torch.full_like(kid, level + 1))
        c_cid = choose(c_cid, next_cid + kid)
        c_pcid = choose(c_pcid, f_cid[parent_slot])
        c_prow = choose(c_prow, row[parent_slot])
        c_row = choose(c_row, torch.full_like(kid, -1))
        c_rows = c_rows[old]  # children's rows are filled when they are forwarded
        next_cid += m * k
    return _assemble(root_token, root_rows[0], root_row_id, c_tok, c_w, c_q, c_cid, c_pcid, c_row, c_rows,
                     depth, device)


def _assemble(root_token: int, root_dist: torch.Tensor, root_row: torch.Tensor, c_tok, c_w, c_q, c_cid, c_pcid,
              c_row, c_rows, depth: int, device: torch.device) -> DeviceTree:
    """Root + candidates as a ``DeviceTree``: real nodes first, in (depth, creation) order."""
    n = c_tok.shape[0]
    valid_c = c_w > _NEG
    order = torch.sort((~valid_c).to(torch.int8), stable=True).indices
    tok, w, q, cid, pcid = c_tok[order], c_w[order], c_q[order], c_cid[order], c_pcid[order]
    row, rows, valid = c_row[order], c_rows[order], valid_c[order]
    all_cid = torch.cat([torch.zeros(1, dtype=torch.long, device=device), cid])
    parent = torch.argmax(((pcid[:, None] == all_cid[None, :]) & valid[:, None]).to(torch.int8), dim=1)
    size = n + 1
    same = (parent[:, None] == parent[None, :]) & valid[:, None] & valid[None, :]
    rank = (same & (cid[None, :] < cid[:, None])).sum(dim=1)
    rank = torch.where(valid, rank, size + torch.arange(n, device=device))  # padding: after every real child
    kids = torch.zeros(size, dtype=torch.long, device=device).index_add_(0, parent, valid.long())
    return DeviceTree(
        tokens=torch.cat([torch.full((1,), root_token, dtype=torch.long, device=device), tok]),
        parents=torch.cat([torch.full((1,), -1, dtype=torch.long, device=device), parent]),
        child_rank=torch.cat([torch.zeros(1, dtype=torch.long, device=device), rank]),
        q=torch.cat([torch.ones(1, dtype=torch.float64, device=device), q]),
        value=torch.cat([torch.ones(1, dtype=torch.float64, device=device), w.clamp(min=0.0)]),
        valid=torch.cat([torch.ones(1, dtype=torch.bool, device=device), valid]),
        row=torch.cat([root_row, row]),
        internal=kids > 0,
        draft_rows=torch.cat([root_dist[None], rows]),
        levels=depth + 1,
    )
