"""Token-level and point-mass verification as fixed-shape tensor programs over a padded tree, and the
``VerifyResult`` the host rebuilds from the few numbers they leave (``walk_result``).

The tree is padded to ``B`` slots: slot 0 is the root, ``valid`` marks the real slots, ``kids``
(``sibling_table``) lists each slot's children in draw order. Every node's test outcomes are decided
in parallel, each test with its own uniform (a child slot is tested at most once, so one uniform per
slot serves every test), and the accepted path only follows them from the root: a node the walk
never reaches uses nothing, which is why deciding all of them at once samples what the host's
sequential verifier samples. Each program leaves per slot the numbers the host verifier computes at
that test (the walkthrough's decisions) and the bonus token at the deepest accepted node, so a step
reads ``O(B)`` numbers instead of two ``[B, V]`` probability matrices.

**Token level, siblings drawn without replacement, in closed form.** At a node with target row ``p``
and draft row ``q`` whose children ``x_1..x_K`` were drawn without replacement from ``q``, the
verifier's residual after ``j`` rejections is

    R_j = u_j / F(a_j),   u_j(v) = max(p(v) - a_j q(v), 0),   F(a) = sum_v max(p(v) - a q(v), 0),
    a_0 = 0,   a_{j+1} = a_j + F(a_j) / M_j,   M_j = the draft mass not yet drawn,

by induction from ``R <- norm(max(R - D, 0))`` and ``D <- norm(q without the drawn tokens)``: for a token
not yet drawn ``max(max(p - a q, 0) - g q, 0) = max(p - (a + g) q, 0)`` (``g >= 0``), and a drawn token's
residual is 0 once it is rejected, as the formula gives it, because a child is rejected only when
``R_j(x) < D_j(x)``, that is ``p(x) < a_{j+1} q(x)``. ``F(a) = P(a) - a Q(a)``, where P and Q are the
masses of the tokens with ``p / q > a``: one search in the row's tokens sorted by ``p / q`` and two prefix
sums. So the ``K`` sequential rejections of every node cost ``K`` small steps after one sort, not ``K``
passes over the vocabulary, and all of them are one op (``alpha_kernel.token_level_alphas``: one Triton
launch on CUDA). The first test takes the rows as given (``F(a_0) = M_0 = 1``), as the host
verifier does. A residual whose mass falls to ``alpha_kernel.EMPTY`` or below counts as empty (the host's is then
exactly 0: ``R_j = D_j``, so the rejection had probability 0 and only rounding reaches it) and is left
as it was, as the host leaves it.

**Point mass.** Each node draws ``y ~ p`` by inverse CDF from its uniform; its accepted child is the
first child carrying ``y``; at the deepest accepted node ``y`` is the bonus token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ..tree import TokenTree
from .alpha_kernel import token_level_alphas
from .base import VerifyResult
from .common import Outcome

#: tokens of the updated residual the walkthrough shows after a rejection (``common.top_tokens``)
TOP = 5
_TINY = 1e-300  # a floor for the draft mass left (rounding of a mass that is positive)
#: verifiers with a device program here
DEVICE_VERIFIERS = ("token_level", "point_mass")


def sibling_table(parents: torch.Tensor, valid: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """``[B, k]`` int64: the children of each slot in draw order, ``B`` past the last one.

    Args:
        parents: ``[B]`` int64 parent slot (the root's and padding slots' values are ignored).
        valid: ``[B]`` bool real slots.
        order: ``[B]`` int64 draw order among siblings (creation ids).
        k: at least the most children any slot has.
    """
    b = parents.shape[0]
    ids = torch.arange(b, device=parents.device)
    is_kid = valid & (ids > 0)
    same = (parents[:, None] == parents[None, :]) & is_kid[None, :]
    rank = (same & (order[None, :] < order[:, None])).sum(1)
    at = torch.where(is_kid, parents * k + rank, b * k)  # non-children all land in the dropped last cell
    kids = torch.full((b * k + 1,), b, dtype=torch.long, device=parents.device).scatter_(0, at, ids)
    return kids[:b * k].view(b, k)


class SiblingTests(NamedTuple):
    """The token-level tests of every slot's children, each as if all earlier siblings were rejected:
    ``[B, K]`` float64, column ``j`` = the slot's ``(j+1)``-th child ``x``.

    Attributes:
        residual: ``R_j(x)``, the residual's probability of ``x`` at its test.
        draft: ``D_j(x)``, the sibling draft's probability of ``x`` at its test.
        accept: ``min(1, R_j(x) / D_j(x))`` (``common.ratio_accept``'s limits).
        alpha: ``a_{j+1}``, the coefficient after ``x``'s rejection.
    """

    residual: torch.Tensor
    draft: torch.Tensor
    accept: torch.Tensor
    alpha: torch.Tensor


def token_level_tests(target: torch.Tensor, draft: torch.Tensor, kid_tok: torch.Tensor) -> SiblingTests:
    """Every slot's sibling tests (see the module docstring).

    Args:
        target: ``[B, V]`` float32 target distribution at each slot.
        draft: ``[B, V]`` float32 draft distribution each slot's children were drawn from.
        kid_tok: ``[B, K]`` int64 tokens of each slot's children in draw order (any token past the last).
    """
    b = kid_tok.shape[0]
    dev = target.device
    f64 = torch.float64
    px = target.gather(1, kid_tok).to(f64)
    qx = draft.gather(1, kid_tok).to(f64)
    # M_j: the rows as given at the first test, then the draft mass left after the earlier siblings
    left = torch.cat([torch.ones(b, 1, dtype=f64, device=dev),
                      draft.sum(1, dtype=f64)[:, None] - qx.cumsum(1)[:, :-1]], 1).clamp_(min=_TINY)
    ratio = torch.where(target > 0, target / draft, 0.0)  # p > 0 = q: inf, always in F's sum
    key, order = torch.sort(ratio.neg_(), dim=1)  # ascending -p/q: the first c tokens have the c largest p/q
    # [B, V] each: the p and q mass of the first c + 1 sorted tokens (float32 rows summed in float64)
    p_cum, q_cum = (rows.gather(1, order).cumsum(1, dtype=f64) for rows in (target, draft))
    states = token_level_alphas(key, p_cum, q_cum, left)  # [K + 1, 2, B] (-a_j, F(a_j)): one kernel on CUDA
    neg_alpha, mass = states[:-1, 0].T, states[:-1, 1].T  # [B, K] before each test
    num = torch.addcmul(px, neg_alpha, qx).clamp_(min=0.0)
    r = num / mass
    d = qx / left
    accept = torch.where(num <= 0, 0.0, torch.where((d <= 0) | (r >= d), 1.0, r / d))
    return SiblingTests(r, d, accept, states[1:, 0].T.neg())


def first_accepted(accepted: torch.Tensor, kids: torch.Tensor) -> torch.Tensor:
    """``[B]`` the slot of each slot's first accepted child (``B``: none) from ``accepted`` ``[B, K]`` bool."""
    b = kids.shape[0]
    j = torch.argmax(accepted.to(torch.int8), 1, keepdim=True)
    return torch.where(accepted.any(1), kids.gather(1, j)[:, 0], b)


def residual_rows(target: torch.Tensor, draft: torch.Tensor, tests: SiblingTests, nodes: torch.Tensor,
                  rejected: torch.Tensor) -> torch.Tensor:
    """``[m, V]`` float64 unnormalised residuals ``u_r`` at ``nodes`` ``[m]`` after their first
    ``rejected`` ``[m]`` children were rejected (``r = 0``: the target row itself)."""
    p = target.index_select(0, nodes).to(torch.float64)
    q = draft.index_select(0, nodes).to(torch.float64)
    col = (rejected - 1).clamp(min=0)[:, None]
    alpha = torch.where(rejected > 0, tests.alpha.index_select(0, nodes).gather(1, col)[:, 0], 0.0)
    return torch.addcmul(p, alpha[:, None], q, value=-1.0).clamp_(min=0.0)


def sample_rows(rows: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF draws from ``rows`` ``[m, V]`` (non-negative, float64) with uniforms ``u`` ``[m]``:
    ``(tokens [m], probability of each drawn token [m])``; never a token of zero weight
    (``common.sample_index``)."""
    v = rows.shape[1]
    cdf = rows.cumsum(1)
    total = cdf[:, -1]
    tok = torch.searchsorted(cdf, (u * total)[:, None], right=True)[:, 0]
    last_positive = torch.where(rows > 0, torch.arange(v, device=rows.device), 0).amax(1)
    tok = torch.where(tok >= v, last_positive, tok)  # u * total rounded up to the total
    return tok, rows.gather(1, tok[:, None])[:, 0] / total


#: rows of a walk's per-slot output (``Walk.out``, ``[WALK_ROWS, B]`` float64)
P_NODE, RESIDUAL, DRAFT, ACCEPT, U, DRAWN = range(6)
TOP_TOK = 6  # rows TOP_TOK .. TOP_TOK + TOP - 1: the residual's top tokens after each child slot's rejection
TOP_P = TOP_TOK + TOP  # and their probabilities
WALK_ROWS = TOP_P + TOP


class Walk(NamedTuple):
    """A device verification's decisions before the path is followed.

    Attributes:
        chosen: ``[B]`` the accepted child of each slot (``B``: none).
        out: ``[WALK_ROWS, B]`` float64 per-slot numbers for the host (row constants above): the
            target probability of the slot's token under its parent; token level: its test's residual,
            draft probability, acceptance probability and uniform, and the residual's top tokens after
            its rejection; point mass: the slot's own draw (``DRAWN``), the probability of the draw
            (``RESIDUAL``) and its uniform (``U``), and each child's match probability (``ACCEPT``).
    """

    chosen: torch.Tensor
    out: torch.Tensor


def token_level_walk(target: torch.Tensor, draft: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                     kids: torch.Tensor, u: torch.Tensor) -> tuple[Walk, SiblingTests]:
    """Token-level verification's decisions at every slot.

    Args:
        target, draft: ``[B, V]`` float32 (``token_level_tests``).
        tokens, parents: ``[B]`` int64 (padding slots: parent 0).
        kids: ``[B, K]`` ``sibling_table``.
        u: ``[B]`` float64 uniforms, one per child slot (the slot's test).
    Returns:
        the walk and the tests (for ``token_level_bonus``).
    """
    b = tokens.shape[0]
    dev = tokens.device
    kid_ok = kids < b
    pad_tok = torch.cat([tokens, tokens.new_zeros(1)])
    kid_tok = pad_tok.index_select(0, kids.view(-1)).view(kids.shape)
    tests = token_level_tests(target, draft, kid_tok)
    u_kid = torch.cat([u, u.new_ones(1)]).index_select(0, kids.view(-1)).view(kids.shape)
    chosen = first_accepted((u_kid < tests.accept) & kid_ok, kids)
    # each child slot's own test: its parent's tests at its column
    slot, col = _slot_columns(kids)
    per_slot = torch.stack([tests.residual, tests.draft, tests.accept]).view(3, -1)
    own = torch.zeros(3, b + 1, dtype=torch.float64, device=dev).index_copy_(1, slot, per_slot)[:, :b]
    # the residual after each child slot's rejection (row of the slot's parent, its rank + 1 rejected)
    rank = torch.zeros(b + 1, dtype=torch.long, device=dev).index_copy_(0, slot, col)[:b]  # (root, padding: 0)
    rows = residual_rows(target, draft, tests, parents, rank + 1)
    top_p, top_tok = torch.topk(rows, min(TOP, rows.shape[1]), dim=1)
    top_p = top_p / rows.sum(1, keepdim=True)
    if top_p.shape[1] < TOP:  # a vocabulary of fewer tokens: the missing places have probability 0
        top_p = torch.cat([top_p, top_p.new_zeros(b, TOP - top_p.shape[1])], 1)
        top_tok = torch.cat([top_tok, top_tok.new_zeros(b, TOP - top_tok.shape[1])], 1)
    p_node = target[parents, tokens].to(torch.float64)
    out = torch.cat([p_node[None], own, u[None], torch.zeros(1, b, dtype=torch.float64, device=dev),
                     top_tok.T.to(torch.float64), top_p.T])
    return Walk(chosen, out), tests


def token_level_bonus(target: torch.Tensor, draft: torch.Tensor, tests: SiblingTests, kids: torch.Tensor,
                      last: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bonus token at ``last`` (``[1]``, whose children were all rejected) drawn from its residual with
    ``u`` ``[1]``: ``(token [1], its residual probability [1])``."""
    n_kids = (kids.index_select(0, last) < kids.shape[0]).sum(1)
    rows = residual_rows(target, draft, tests, last, n_kids)
    return sample_rows(rows, u)


def point_mass_walk(target: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, kids: torch.Tensor,
                    u: torch.Tensor) -> Walk:
    """Point-mass verification's decisions at every slot (arguments as ``token_level_walk``; ``u``: one
    uniform per slot, its own draw). A slot's bonus token is its draw (``out[DRAWN]``)."""
    b = tokens.shape[0]
    dev = tokens.device
    y, p_y = sample_rows(target.to(torch.float64), u)
    kid_ok = kids < b
    kid_tok = torch.cat([tokens, tokens.new_full((1,), -1)]).index_select(0, kids.view(-1)).view(kids.shape)
    chosen = first_accepted((kid_tok == y[:, None]) & kid_ok, kids)
    p_node = target[parents, tokens].to(torch.float64)
    k = kids.shape[1]
    before = torch.ones(k, k, dtype=torch.bool, device=dev).tril_(-1)
    repeat = ((kid_tok[:, :, None] == kid_tok[:, None, :]) & before[None]).any(2)  # [B, K] an earlier sibling has it
    slot, _ = _slot_columns(kids)
    first = torch.ones(b + 1, dtype=torch.bool, device=dev).index_copy_(0, slot, ~repeat.view(-1))[:b]
    zeros = torch.zeros(b, dtype=torch.float64, device=dev)
    out = torch.cat([torch.stack([p_node, p_y, zeros, torch.where(first, p_node, 0.0), u, y.to(torch.float64)]),
                     torch.zeros(2 * TOP, b, dtype=torch.float64, device=dev)])
    return Walk(chosen, out)


def _slot_columns(kids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``kids`` flattened as ``(slot [B K], column [B K])`` (``slot`` ``B`` past each row's last child)."""
    k = kids.shape[1]
    return kids.reshape(-1), torch.arange(k, device=kids.device).repeat(kids.shape[0])


@dataclass
class WalkRead:
    """A device verification as read by the host (numpy, slot order).

    Attributes:
        verifier: ``token_level`` or ``point_mass``.
        out: ``[WALK_ROWS, B]`` float64 (``Walk.out``).
        path: accepted slots from the root.
        bonus: the bonus token; p_bonus: its probability under the distribution it was drawn from
            (the residual at the last accepted slot; point mass: the target row); u_bonus: its uniform.
    """

    verifier: str
    out: np.ndarray
    path: list[int]
    bonus: int
    p_bonus: float
    u_bonus: float


def walk_result(read: WalkRead, tree: TokenTree, node_of: np.ndarray) -> VerifyResult:
    """The ``VerifyResult`` the host verifier would return for ``tree`` (its real slots as nodes, via
    ``node_of`` ``[B]``), with its decisions in the host's order, from a device walk's numbers."""
    out = read.out
    slot_of = np.flatnonzero(node_of >= 0)
    path = [int(node_of[s]) for s in read.path]
    children = tree.children()
    tokens = tree.tokens.tolist()
    outcome = Outcome(tree.size)
    p_target = out[P_NODE, slot_of].copy()
    p_target[0] = math.nan
    for i, node in enumerate(path):
        nxt = path[i + 1] if i + 1 < len(path) else None
        s = int(slot_of[node])
        if read.verifier == "point_mass":
            for child in children[node]:
                outcome.record(child, float(out[ACCEPT, slot_of[child]]))
            y, p_y, u = int(out[DRAWN, s]), float(out[RESIDUAL, s]), float(out[U, s])
            if nxt is None:
                outcome.decide("bonus", node, y, p_y, math.nan, 1.0, True, u=u)
            else:
                outcome.decide("sample", nxt, y, p_y, math.nan, p_y, True, u=u)
            continue
        for child in children[node]:
            c = int(slot_of[child])
            a = float(out[ACCEPT, c])
            outcome.record(child, a)
            accepted = child == nxt
            top = () if accepted else tuple(
                (int(t), float(p)) for t, p in zip(out[TOP_TOK:TOP_TOK + TOP, c], out[TOP_P:TOP_P + TOP, c]) if p > 0)
            outcome.decide("child", child, tokens[child], float(out[RESIDUAL, c]), float(out[DRAFT, c]), a, accepted,
                           u=float(out[U, c]), residual_top=top)
            if accepted:
                break
    if read.verifier == "token_level":
        outcome.decide("bonus", path[-1], read.bonus, read.p_bonus, math.nan, 1.0, True, u=read.u_bonus)
    return outcome.result(path, read.bonus, p_target)
