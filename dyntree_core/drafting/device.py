"""Drafting on the device: every level's draws and DySpec's budgeted selection are tensor ops of
constant shape, so a step's tree is grown without reading the device.

The level functions are what ``decode.graph_step``'s programs run (any T): the candidate slots
(``Candidates``, ``n = budget - 1``) after the root's level (``topn_start``, ``shape_start``) and after
each deeper level (``topn_level``, ``shape_level``), given the level's draft rows. Children come in
draw order (``_children``): at T = 0 the most probable first (ties by token id, the host
``topk_rows`` order); at T > 0 draws without replacement (Gumbel top-k over given uniforms).

* DySpec (``topn_*``, App. D.1 at T = 0, Alg. 1 at T > 0): the ``n`` draws with the largest keys in
  the depth-capped tree of draws (T = 0: the node's weight, the product of draft probabilities along
  the path; T > 0: the probability that the draw is reached). Computed level-synchronously: after
  level l the candidate set C holds the n best draws of depth <= l (keys desc, then depth asc, then
  creation order); the live frontier is C's nodes at depth l; their first n children join C and the
  n best are kept. A draw outside C never re-enters and a draw's key never exceeds its parent's or
  an earlier sibling's, so C after the last level is the host heap's selection (at T = 0 the same
  tree, numbered in (depth, draw order) order; exact ties at the n-th key may resolve differently
  from the host heap, whose third key is its own virtual-node order).
* Static shapes (``shape_*``: chain, Sequoia): each slot takes its parent's ``position``-th child.

The eager ``device_side`` path drives the same functions through a ``LevelSource``
(``decode.draft_source.ModelDraftSource.expand``: one batched draft forward per level, rows that are
not ``live`` being padding): ``chain_greedy``, ``topn_greedy``, returning a ``DeviceTree`` padded to
a fixed size (``valid`` marks the real nodes, which come first; padding nodes hang off the root with
the highest draw ranks, so every node order of the padded tree lists the real nodes as the real
tree's order does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Protocol, Sequence

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


def _children(probs: torch.Tensor, k: int, noise: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row ``k`` children in draw order: ``noise`` None (T = 0) the ``k`` most probable
    (``_top_sorted``); else the first ``k`` draws without replacement, by Gumbel top-k (the order of
    ``log p - log(-log u)`` over ``noise`` = ``[m, V]`` uniforms u in (0, 1) is a sample without
    replacement from ``p``, in draw order; tokens of probability 0 come last)."""
    if noise is None:
        return _top_sorted(probs, k)
    u = noise.clamp(min=torch.finfo(noise.dtype).tiny)  # a uniform of exactly 0 would drop its token
    scores = torch.log(probs) - torch.log(-torch.log(u))
    tok = torch.topk(scores, k, dim=1).indices
    return tok, probs.gather(1, tok)


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


class Candidates(NamedTuple):
    """DySpec's candidate set C on the device: ``n = budget - 1`` slots, the real ones (weight >
    -inf) in (depth, creation) order. Stored as four tensors, so a level's merge chooses every
    integer field with one gather and one ``where`` (and the floats with another) and a graph step
    keeps C in four static buffers; the fields are row views (``[n]`` each unless said otherwise):

    Attributes:
        ints: ``[6, n]`` int64, rows ``tok``, ``depth``, ``cid``, ``pcid``, ``prow``, ``row``.
        reals: ``[3, n]`` float64, rows ``w``, ``key``, ``q``.
        rows: ``[n, V]`` float32 draft distribution at each forwarded candidate.
        next_cid: ``[]`` int64 the next creation id.

    Fields:
        tok: token. depth: depth below the root (empty slots: deeper than any level).
        cid: creation id (root 0); pcid: the parent's.
        prow: source row of the parent; row: own source row once forwarded (-1 before).
        w: weight (product of draft probabilities along the path; -inf: empty slot).
        key: the greedy's key of the draw that made the node: its weight at T = 0; at T > 0
            Alg. 1's reach probability ``w(parent) (1 - sum of the earlier siblings' q)``, which
            never depends on the token drawn (so the choice of draws does not bias the tree).
        q: draft probability of the token under its parent's row.
    """

    ints: torch.Tensor
    reals: torch.Tensor
    rows: torch.Tensor
    next_cid: torch.Tensor

    @classmethod
    def of(cls, *, tok, depth, cid, pcid, prow, row, w, key, q, rows, next_cid) -> "Candidates":
        return cls(torch.stack([tok, depth, cid, pcid, prow, row]), torch.stack([w, key, q]), rows, next_cid)

    tok = property(lambda self: self.ints[_TOK])
    depth = property(lambda self: self.ints[_DEPTH])
    cid = property(lambda self: self.ints[_CID])
    pcid = property(lambda self: self.ints[_PCID])
    prow = property(lambda self: self.ints[_PROW])
    row = property(lambda self: self.ints[_ROW])
    w = property(lambda self: self.reals[_W])
    key = property(lambda self: self.reals[_KEY])
    q = property(lambda self: self.reals[_Q])


#: the rows of ``Candidates.ints`` and ``Candidates.reals`` (the order of ``Candidates.of``)
_TOK, _DEPTH, _CID, _PCID, _PROW, _ROW = range(6)
_W, _KEY, _Q = range(3)


def topn_start(root_probs: torch.Tensor, root_row: torch.Tensor, n: int, depth: int,
               noise: Optional[torch.Tensor] = None) -> Candidates:
    """C after the root's level: its ``n`` first children (``root_probs`` ``[1, V]``, ``root_row`` ``[1]``;
    ``noise`` ``[1, V]`` uniforms at T > 0, see ``_children``)."""
    device = root_probs.device
    i64 = dict(dtype=torch.long, device=device)
    f64 = dict(dtype=torch.float64, device=device)
    empty = Candidates.of(
        tok=torch.zeros(n, **i64), w=torch.full((n,), _NEG, **f64), key=torch.full((n,), _NEG, **f64),
        q=torch.zeros(n, **f64), depth=torch.full((n,), depth + 1, **i64), cid=torch.zeros(n, **i64), pcid=torch.zeros(n, **i64),
        prow=torch.full((n,), -1, **i64), row=torch.full((n,), -1, **i64),
        rows=torch.zeros(n, root_probs.shape[1], dtype=root_probs.dtype, device=device),
        next_cid=torch.ones((), **i64))
    live = torch.ones(1, dtype=torch.bool, device=device)
    return _merge(empty, root_probs, root_row, live, torch.ones(1, **f64), torch.zeros(1, **i64),
                  torch.zeros((), **i64), noise)


def topn_level(c: Candidates, probs: torch.Tensor, row: torch.Tensor, level: torch.Tensor,
               noise: Optional[torch.Tensor] = None, live: Optional[torch.Tensor] = None) -> Candidates:
    """C after forwarding its nodes at depth ``level`` (a ``[]`` int64 tensor, >= 1).

    Args:
        c: the candidate set before the level.
        probs: ``[n, V]`` draft distributions of the ``n`` candidate slots (rows of slots not at
            depth ``level`` are ignored: they were forwarded as padding).
        row: ``[n]`` int64 source row of each slot's forward.
        noise: ``[n, V]`` uniforms at T > 0 (``_children``), None at T = 0.
        live: ``[n]`` bool ``live_slots(c, level)`` when the caller has it (None: computed here).
    """
    c, live = _forwarded(c, probs, row, level, live)
    return _merge(c, probs, row, live, c.w, c.cid, level, noise)


def live_slots(c: Candidates, level: torch.Tensor) -> torch.Tensor:
    """``[n]`` bool: the real candidates at depth ``level`` (the rows a level's forward is for)."""
    return (c.depth == level) & (c.w > _NEG)


def _forwarded(c: Candidates, probs: torch.Tensor, row: torch.Tensor, level: torch.Tensor,
               live: Optional[torch.Tensor] = None) -> tuple[Candidates, torch.Tensor]:
    """Record the rows of the candidates at depth ``level`` (the live rows of the level's forward)."""
    if live is None:
        live = live_slots(c, level)
    ints = torch.cat([c.ints[:_ROW], torch.where(live, row, c.row)[None]])
    return c._replace(ints=ints, rows=torch.where(live[:, None], probs, c.rows)), live


def _merge(c: Candidates, probs: torch.Tensor, row: torch.Tensor, live: torch.Tensor, f_w: torch.Tensor,
           f_cid: torch.Tensor, level: torch.Tensor, noise: Optional[torch.Tensor]) -> Candidates:
    """The ``n`` best of C and the ``n`` first children of the ``live`` forwarded rows, by (key
    desc, depth asc, cid asc): the pool is in (depth, cid) order for its real entries, so a stable
    sort by key is that order."""
    n = c.tok.shape[0]
    m = probs.shape[0]
    k = min(n, probs.shape[1])
    kid_tok, kid_p = _children(probs, k, noise)
    real = live[:, None] & (kid_p > 0)
    kid_p = kid_p.double()
    kid_w = torch.where(real, f_w[:, None] * kid_p, _NEG)
    if noise is None:
        kid_key = kid_w
    else:  # Alg. 1: the probability that the draw is reached, w(parent) (1 - mass of the earlier draws)
        kid_key = torch.where(real, f_w[:, None] * (1.0 - (torch.cumsum(kid_p, 1) - kid_p)), _NEG)
    kid_reals = torch.stack([kid_w.reshape(-1), kid_key.reshape(-1), kid_p.reshape(-1)])  # [3, m k], as reals
    pick = torch.sort(torch.sort(-torch.cat([c.key, kid_reals[_KEY]]), stable=True).indices[:n]).values
    from_kid = pick >= n
    old = pick.clamp(max=n - 1)
    kid = (pick - n).clamp(min=0)
    parent_slot = kid // k
    parents = torch.stack([f_cid, row]).index_select(1, parent_slot)  # [2, n]: the kid's pcid, prow
    kid_ints = torch.cat([kid_tok.reshape(1, -1).index_select(1, kid), (level + 1).expand(1, n),
                          (c.next_cid + kid)[None], parents, torch.full_like(kid, -1)[None]])  # as ints; row -1
    return Candidates(
        ints=torch.where(from_kid, kid_ints, c.ints.index_select(1, old)),
        reals=torch.where(from_kid, kid_reals.index_select(1, kid), c.reals.index_select(1, old)),
        rows=c.rows.index_select(0, old),  # children's rows are filled when they are forwarded
        next_cid=c.next_cid + m * k,
    )


class ShapeSlots(NamedTuple):
    """A static tree shape (chain, Sequoia) in the candidate layout: node ``i`` is slot ``i - 1``.
    At T = 0 each node's children are its draft row's most probable tokens, in position order.

    Attributes (``[n]`` each):
        parent: int64 the parent's slot (-1: the root).
        position: int64 0-based rank among its siblings (the top-k index it takes).
        depth: int64 depth below the root.
        score: float64 the node's value (Sequoia's DP score); NaN: the path's draft probability.
    """

    parent: torch.Tensor
    position: torch.Tensor
    depth: torch.Tensor
    score: torch.Tensor

    @classmethod
    def build(cls, parents: Sequence[int], scores: Optional[Sequence[float]], device: torch.device) -> "ShapeSlots":
        """From a parent list in breadth-first order (root first, siblings contiguous)."""
        n = len(parents) - 1
        depth = [0] * len(parents)
        position = [0] * len(parents)
        seen: dict[int, int] = {}
        for i in range(1, len(parents)):
            depth[i] = depth[parents[i]] + 1
            position[i] = seen.get(parents[i], 0)
            seen[parents[i]] = position[i] + 1
        score = [math.nan] * n if scores is None else [float(x) for x in scores[1:]]
        return cls(torch.tensor([p - 1 for p in parents[1:]], dtype=torch.long, device=device),
                   torch.tensor(position[1:], dtype=torch.long, device=device),
                   torch.tensor(depth[1:], dtype=torch.long, device=device),
                   torch.tensor(score, dtype=torch.float64, device=device))

    @property
    def kmax(self) -> int:
        return int(self.position.max()) + 1 if self.position.numel() else 1


def shape_start(root_probs: torch.Tensor, root_row: torch.Tensor, shape: ShapeSlots, kmax: int,
                noise: Optional[torch.Tensor] = None) -> Candidates:
    """The shape's slots after the root's level: its children drawn from ``root_probs`` ``[1, V]``
    (``noise``: ``[1, V]`` uniforms at T > 0, see ``_children``)."""
    n = shape.parent.shape[0]
    device = root_probs.device
    ids = torch.arange(1, n + 1, dtype=torch.long, device=device)
    c = Candidates.of(
        tok=torch.zeros(n, dtype=torch.long, device=device), w=torch.full((n,), _NEG, dtype=torch.float64, device=device),
        key=torch.full((n,), _NEG, dtype=torch.float64, device=device), q=torch.zeros(n, dtype=torch.float64, device=device), depth=shape.depth, cid=ids, pcid=shape.parent + 1,
        prow=torch.full((n,), -1, dtype=torch.long, device=device), row=torch.full((n,), -1, dtype=torch.long, device=device),
        rows=torch.zeros(n, root_probs.shape[1], dtype=root_probs.dtype, device=device),
        next_cid=torch.full((), n + 1, dtype=torch.long, device=device))
    return _draw(c, root_probs, root_row, torch.zeros_like(shape.parent), torch.zeros((), dtype=torch.long, device=device),
                 shape, kmax, noise)


def shape_level(c: Candidates, probs: torch.Tensor, row: torch.Tensor, level: torch.Tensor, shape: ShapeSlots,
                kmax: int, noise: Optional[torch.Tensor] = None, live: Optional[torch.Tensor] = None) -> Candidates:
    """The shape's slots after forwarding its nodes at depth ``level`` (``[]`` int64, >= 1); ``probs``
    ``[n, V]``, ``row`` ``[n]``, ``noise`` and ``live`` as in ``topn_level``."""
    c, _ = _forwarded(c, probs, row, level, live)
    return _draw(c, probs, row, shape.parent.clamp(min=0), level, shape, kmax, noise)


def _draw(c: Candidates, probs: torch.Tensor, row: torch.Tensor, src: torch.Tensor, level: torch.Tensor,
          shape: ShapeSlots, kmax: int, noise: Optional[torch.Tensor]) -> Candidates:
    """Children at depth ``level + 1``: each takes its parent's (row ``probs[src]``) ``position``-th
    child in draw order (``_children``; an empty slot when its probability is 0 or the parent is empty)."""
    kid_tok, kid_p = _children(probs, kmax, noise)
    tok = kid_tok[src, shape.position]
    q = kid_p[src, shape.position].double()
    has_parent = shape.parent >= 0
    parent_w = torch.where(has_parent, c.w[shape.parent.clamp(min=0)], 1.0)
    drawn = (shape.depth == level + 1) & (q > 0) & (parent_w > _NEG)
    value = torch.where(torch.isnan(shape.score), parent_w * q, shape.score)
    w = torch.where(drawn, value, c.w)
    ints = torch.stack([torch.where(drawn, tok, c.tok), c.depth, c.cid, c.pcid, torch.where(drawn, row[src], c.prow),
                        c.row])
    return c._replace(ints=ints, reals=torch.stack([w, w, torch.where(drawn, q, c.q)]))


def topn_greedy(source: LevelSource, root_token: int, budget: int, depth: int, device: torch.device) -> DeviceTree:
    """DySpec's greedy tree at T = 0 (see the module docstring): ``budget`` nodes with the root."""
    n = budget - 1
    source.reserve(1 + (depth - 1) * n)
    live = torch.ones(1, dtype=torch.bool, device=device)
    root_probs, root_row = source.expand(torch.full((1,), root_token, dtype=torch.long, device=device),
                                         torch.full((1,), -1, dtype=torch.long, device=device), live, 0)
    c = topn_start(root_probs, root_row, n, depth)
    for level in range(1, depth):
        live = live_slots(c, level)
        probs, row = source.expand(c.tok, c.prow, live, level)
        c = topn_level(c, probs, row, torch.tensor(level, device=device))
    return _assemble(root_token, root_probs[0], root_row, c.tok, c.w, c.q, c.cid, c.pcid, c.row, c.rows,
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
