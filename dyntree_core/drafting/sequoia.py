"""Sequoia: static tree shape from the bounded-depth DP, filled with SWOR draws.

Pure functions (notes/sequoia.md §1):

* ``sequoia_dp(p, budget, max_depth)`` — Algorithm 5 (App. C.2.2) with the erratum fixed
  (``T[1][l][b>0] = -inf``, not 0), NaN-safe (``p_b · (-inf)`` is kept at ``-inf`` when
  ``p_b = 0``) and with back-pointers. Vectorised as a (max,+) convolution per (level, branch),
  O(M²·L·K) with ``best[m][l] = max_b T[m][l][b]`` cached.
* ``sequoia_tree(table, size, max_depth)`` — rebuilds the optimal tree breadth-first
  (children of a node contiguous, in child-position order) with each node's score
  ``f(v) = Π p_position`` (Def. 3.3); ``Σ f = G(size, depth)`` (Prop. 3.4).
* ``estimate_acceptance_vector(draft, target, k_max, generator)`` — the repo's static
  estimator (``fast_test.py``, §1.5): k_max SWOR draft draws per (draft, target) pair, the
  exact per-draw acceptance ``min(1, R/Q)`` and marginals ``p_j = Π_{i<j}(1-acc_i)·acc_j``.

Conventions: ``p = (p_1..p_K)`` are marginal acceptance probabilities (Def. 3.2, the k-th child
is the accepted one); ``max_depth`` counts levels *including the root* in the DP functions
(the papers' convention); the drafter maps ``cfg.depth`` (levels below the root) to
``cfg.depth + 1``.

Drafting: the static shape is computed once per (p, budget, depth) and cached; each step fills
it level by level — one batched ``next_probs`` call per level that has internal nodes — with
SWOR draws (uniform fallback past a row's support) or the draft top-k when deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence

import numpy as np
import torch

from ..config import DecodeConfig
from ..tree import TokenTree
from .builder import TreeBuilder
from .drafter import CountingSource, Drafter
from .siblings import SiblingSampler

#: power-law default acceptance vector: r_k = 0.37·k^-0.5 rejection after k children
#: (Sequoia Def. 3.5 with b = 0.5), p_k = r_{k-1} - r_k, r_0 = 1, K = 16. It fits the Sequoia
#: repo's example vector (p_1 = .634, r_9 ≈ .124); measure a real one with
#: ``estimate_acceptance_vector`` and pass it as ``DecodeConfig.sequoia_acceptance``.
DEFAULT_ACCEPTANCE_K = 16


def default_acceptance_vector(k: int = DEFAULT_ACCEPTANCE_K, r1: float = 0.37, b: float = 0.5) -> tuple[float, ...]:
    """Marginal acceptance vector of the power-law rejection model ``r_k = r1·k^-b``."""
    r = [1.0] + [r1 * (i ** -b) for i in range(1, k + 1)]
    return tuple(r[i - 1] - r[i] for i in range(1, k + 1))


@dataclass(frozen=True)
class SequoiaTable:
    """Result of the bounded-depth DP.

    Attributes:
        p: the acceptance vector ``(p_1..p_K)``.
        T: ``[M+1, L+1, K+1]`` float64, ``T[m, l, b]`` = best expected generated tokens of a
            tree with exactly m nodes, at most l levels and b root children (``-inf`` =
            infeasible; index 0 rows unused).
        best: ``[M+1, L+1]`` float64, ``G(m, l) = max_b T[m, l, b]``.
        split: ``[M+1, L+1, K+1]`` int64 back-pointer: for b >= 2 the size y of the part that
            keeps the first b-1 root branches (the last branch has m-y nodes); -1 otherwise.
    """

    p: tuple[float, ...]
    T: np.ndarray
    best: np.ndarray
    split: np.ndarray

    @property
    def max_size(self) -> int:
        return self.T.shape[0] - 1

    @property
    def max_depth(self) -> int:
        return self.T.shape[1] - 1

    def G(self, m: int, l: int) -> float:
        """Best expected number of generated tokens for size m and at most l levels."""
        return float(self.best[m, l])


def sequoia_dp(p: Sequence[float], budget: int, max_depth: int) -> SequoiaTable:
    """Algorithm 5 of Sequoia with the erratum fixed, NaN-safe, with back-pointers.

    Args:
        p: marginal acceptance vector ``p_1..p_K`` (values in [0, 1]).
        budget: M, the largest tree size (root included) to tabulate.
        max_depth: L, the largest number of levels (root included) to tabulate.
    Returns:
        The ``SequoiaTable`` for all m <= M, l <= L, b <= K.
    """
    pv = np.asarray([float(x) for x in p], dtype=np.float64)
    if pv.ndim != 1 or pv.size == 0 or np.any(~np.isfinite(pv)) or np.any(pv < 0) or np.any(pv > 1):
        raise ValueError("the acceptance vector must be a non-empty sequence of values in [0, 1]")
    if budget < 1 or max_depth < 1:
        raise ValueError("budget and max_depth must be >= 1")
    M, L, K = int(budget), int(max_depth), int(pv.size)
    T = np.full((M + 1, L + 1, K + 1), -np.inf)
    split = np.full((M + 1, L + 1, K + 1), -1, dtype=np.int64)
    best = np.full((M + 1, L + 1), -np.inf)
    T[1, 1:, 0] = 1.0  # erratum: T[1][l][b>0] stays -inf (infeasible), the paper's ¬b gives 0
    best[1, 1:] = 1.0
    # (max,+) convolution index grids: rows m = 0..M, cols y = 0..M, valid 1 <= y <= m-1
    m_idx = np.arange(M + 1)[:, None]
    y_idx = np.arange(M + 1)[None, :]
    valid = (y_idx >= 1) & (y_idx <= m_idx - 1)
    sub = np.where(valid, m_idx - y_idx, 0)
    for l in range(2, L + 1):
        prev = best[:, l - 1]
        for b in range(1, K + 1):
            # contribution of a root branch at position b with subtree size s: p_b·G(s, l-1);
            # guard 0·(-inf) = NaN: infeasible stays infeasible whatever p_b is
            contrib = np.where(np.isfinite(prev), pv[b - 1] * np.where(np.isfinite(prev), prev, 0.0), -np.inf)
            if b == 1:
                T[2:, l, 1] = 1.0 + contrib[1:M]
                continue
            cand = np.where(valid, T[:, l, b - 1][None, :] + contrib[sub], -np.inf)
            arg = np.argmax(cand, axis=1)
            val = cand[np.arange(M + 1), arg]
            T[:, l, b] = val
            split[:, l, b] = np.where(np.isfinite(val), arg, -1)
        T[1, l, 0] = 1.0
        best[:, l] = T[:, l, :].max(axis=1)
    return SequoiaTable(p=tuple(float(x) for x in pv), T=T, best=best, split=split)


@dataclass(frozen=True)
class SequoiaShape:
    """A static tree in breadth-first order (children of a node contiguous, in position order).

    Attributes:
        parents: parent index per node (-1 for the root).
        position: 1-based child position per node (0 for the root).
        score: ``f(v) = Π p_position`` along the path (root 1.0).
        expected: ``Σ score`` = the DP value of the tree.
    """

    parents: tuple[int, ...]
    position: tuple[int, ...]
    score: tuple[float, ...]
    expected: float

    @property
    def size(self) -> int:
        return len(self.parents)

    def depths(self) -> list[int]:
        d = [0] * self.size
        for i in range(1, self.size):
            d[i] = d[self.parents[i]] + 1
        return d


def _branch_sizes(table: SequoiaTable, m: int, l: int, b: int) -> list[int]:
    """Subtree sizes of the root branches of the optimal (m, l, b) tree, in position order."""
    sizes: list[int] = []
    while b >= 2:
        y = int(table.split[m, l, b])
        if y < 1:
            raise ValueError(f"T[{m},{l},{b}] is infeasible")
        sizes.append(m - y)
        m, b = y, b - 1
    if b == 1:
        sizes.append(m - 1)
    return sizes[::-1]


def sequoia_tree(table: SequoiaTable, size: int, max_depth: int) -> SequoiaShape:
    """Reconstruct the optimal tree of exactly ``size`` nodes and at most ``max_depth`` levels.

    Raises ``ValueError`` when that (size, depth) is infeasible for the vector's length.
    """
    if not (1 <= size <= table.max_size and 1 <= max_depth <= table.max_depth):
        raise ValueError(f"(size={size}, depth={max_depth}) is outside the DP table")
    if not np.isfinite(table.best[size, max_depth]):
        raise ValueError(f"no tree of size {size} fits in {max_depth} levels with {len(table.p)} branches")
    parents, position, score = [-1], [0], [1.0]
    queue = [(0, size, max_depth)]
    head = 0
    while head < len(queue):
        node, m, l = queue[head]
        head += 1
        if m == 1:
            continue
        b = int(np.argmax(table.T[m, l, :]))
        for pos, s in enumerate(_branch_sizes(table, m, l, b), start=1):
            child = len(parents)
            parents.append(node)
            position.append(pos)
            score.append(score[node] * table.p[pos - 1])
            queue.append((child, s, l - 1))
    return SequoiaShape(tuple(parents), tuple(position), tuple(score), float(sum(score)))


def best_size(table: SequoiaTable, budget: int, max_depth: int) -> int:
    """The smallest size m <= budget reaching the best feasible ``G(m, max_depth)``."""
    g = table.best[1 : budget + 1, max_depth]
    top = np.max(g)
    return int(np.flatnonzero(g >= top - 1e-12)[0]) + 1


@lru_cache(maxsize=64)
def sequoia_shape(p: tuple[float, ...], budget: int, max_depth: int) -> SequoiaShape:
    """Cached optimal static tree for (p, budget, levels incl. root)."""
    table = sequoia_dp(p, budget, max_depth)
    return sequoia_tree(table, best_size(table, budget, max_depth), max_depth)


def specinfer_expected(p: Sequence[float], k: int, length: int) -> float:
    """Expected generated tokens of k independent chains of ``length`` under the positional
    model: ``1 + (Σ_{i<=k} p_i)·Σ_{j<length} p_1^j`` (notes/sequoia.md §1.4)."""
    return 1.0 + float(sum(p[:k])) * sum(float(p[0]) ** j for j in range(length))


# ---------------------------------------------------------------------------------- estimator
def estimate_acceptance_vector(
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    k_max: int,
    generator: torch.Generator,
    deterministic: bool = False,
) -> torch.Tensor:
    """Marginal acceptance vector from (draft, target) distribution pairs (notes §1.5).

    Per pair: draw ``k_max`` tokens from the draft without replacement (uniform over the
    undrawn tokens once the draft's support is used up, as Sequoia's Algorithm 1), and
    with ``R`` the target residual (``R <- norm(max(R - Q_j, 0))`` after each rejection, using
    the renormalised without-replacement draft ``Q_j`` of that draw)
    ``acc_j = min(1, R(x_j)/Q_j(x_j))``, ``rate_j = Π_{i<j}(1 - acc_i)·acc_j``; average over
    pairs. Deterministic (T = 0): child j is the draft's j-th most likely token and
    ``rate_j = 1`` iff it is the target argmax.

    Args:
        draft_probs: ``[N, V]`` draft distributions.
        target_probs: ``[N, V]`` target distributions at the same positions.
        k_max: number of child positions W.
        generator: torch RNG.
        deterministic: greedy (T = 0) estimator.
    Returns:
        ``[k_max]`` float64 ``p_1..p_W``; ``1 - sum`` is the all-rejected mass.
    """
    if draft_probs.shape != target_probs.shape or draft_probs.dim() != 2:
        raise ValueError("draft_probs and target_probs must both be [N, V]")
    n_all, v_all = draft_probs.shape
    chunk = max(1, (1 << 22) // max(v_all, 1))  # bound the float64 working set (~32 MB a tensor)
    if n_all > chunk:
        parts = [
            estimate_acceptance_vector(draft_probs[i : i + chunk], target_probs[i : i + chunk], k_max, generator, deterministic)
            * min(chunk, n_all - i)
            for i in range(0, n_all, chunk)
        ]
        return torch.stack(parts).sum(dim=0) / n_all
    q = draft_probs.double().cpu()
    q = q / q.sum(dim=1, keepdim=True)
    r = target_probs.double().cpu()
    r = r / r.sum(dim=1, keepdim=True)
    n, v = q.shape
    k_max = min(int(k_max), v)
    rates = torch.zeros(n, k_max, dtype=torch.float64)
    if deterministic:
        top = torch.topk(q, k_max, dim=1).indices
        rates = (top == r.argmax(dim=1, keepdim=True)).double()
        return rates.mean(dim=0)
    drawn = torch.zeros(n, v, dtype=torch.bool)
    alive = torch.ones(n, dtype=torch.float64)  # Π_{i<j}(1 - acc_i)
    rows = torch.arange(n)
    for j in range(k_max):
        qj = q.masked_fill(drawn, 0.0)
        mass = qj.sum(dim=1, keepdim=True)
        uniform = (~drawn).double()
        qj = torch.where(mass > 1e-15, qj / mass.clamp_min(1e-300), uniform / uniform.sum(dim=1, keepdim=True))
        x = torch.multinomial(qj.float(), 1, generator=generator).squeeze(1)
        qx = qj[rows, x]
        rx = r[rows, x]
        acc = torch.clamp(rx / qx, max=1.0)
        rates[:, j] = alive * acc
        alive = alive * (1.0 - acc)
        res = torch.clamp(r - qj, min=0.0)
        rs = res.sum(dim=1, keepdim=True)
        r = torch.where(rs > 1e-15, res / rs.clamp_min(1e-300), r)  # rs = 0 only when alive = 0
        drawn[rows, x] = True
    return rates.mean(dim=0)


# ---------------------------------------------------------------------------------- drafter
class SequoiaDrafter(Drafter):
    """Fills the cached DP tree for (``cfg.sequoia_acceptance`` or the default vector,
    ``cfg.budget``, ``cfg.depth + 1`` levels); node values are the DP scores ``f(v)``."""

    name = "sequoia"

    def __init__(self, cfg: DecodeConfig, acceptance: Optional[Sequence[float]] = None):
        super().__init__(cfg)
        acc = acceptance if acceptance is not None else cfg.sequoia_acceptance
        self.acceptance: tuple[float, ...] = tuple(float(x) for x in (acc if acc is not None else default_acceptance_vector()))
        self.shape = sequoia_shape(self.acceptance, cfg.budget, cfg.depth + 1)

    def _draft(
        self, source: CountingSource, root_token: int, generator: torch.Generator, deterministic: bool
    ) -> TokenTree:
        shape = self.shape
        kids: list[list[int]] = [[] for _ in range(shape.size)]
        for i in range(1, shape.size):
            kids[shape.parents[i]].append(i)
        b = TreeBuilder(root_token)
        level = [(0, 0)]  # (shape id, builder id); they differ only when V < a node's branching
        while level:
            internal = [(s, n) for s, n in level if kids[s]]
            if not internal:
                break
            rows = b.request(source, [n for _, n in internal])
            kmax = max(len(kids[s]) for s, _ in internal)
            sampler = SiblingSampler(rows, generator, deterministic, kmax, uniform_fallback=True)
            nxt = []
            for i, (s, n) in enumerate(internal):
                for c in kids[s]:
                    drawn = sampler.draw(i)
                    if drawn is None:  # a vocabulary smaller than the branching drops the surplus
                        break
                    nxt.append((c, b.add(n, drawn[0], drawn[1], shape.score[c])))
            level = nxt
        return b.build(self.sampled_kind(deterministic))
