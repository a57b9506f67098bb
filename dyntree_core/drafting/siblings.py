"""Sibling sampling for the drafters: top-k rows, without-replacement (SWOR) draws by blocked
inverse CDF, i.i.d. draws, and the order of a node's children.

No helper loops over the vocabulary in Python: full-row work is one vectorised numpy/torch pass
per batch (block sums, comparisons, top-k), and per-draw work is O(V/1024 + 1024), so tree
construction stays cheap at V = 151,936. Rows are read on the CPU (numpy is single-threaded,
which on an oversubscribed CPU is several times faster than torch's intra-op threads here).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

def topk_rows(rows: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact per-row top-k by descending probability, cheaper than ``torch.topk`` at large V.

    k = 1 is a numpy argmax. Otherwise a comparison pass keeps the tokens above a cut-off
    (``1/(2k)``: a distribution has fewer than 2k of them; then 1e-3/k and 1e-6/k for rows
    with fewer than k survivors) and sorts only the survivors; rows still short of k (flat
    rows, k close to V) fall back to ``torch.topk``.

    Args:
        rows: ``[n, V]`` float distributions (any device; read on the CPU).
        k: tokens per row (clipped to V).
    Returns:
        ``(tokens [n, k] int64, probs [n, k] float64)`` numpy arrays.
    """
    q = rows.detach().to("cpu", torch.float32).numpy()
    n, v = q.shape
    k = max(0, min(int(k), v))
    if k == 0:
        return np.zeros((n, 0), dtype=np.int64), np.zeros((n, 0), dtype=np.float64)
    if k == 1:
        idx = q.argmax(axis=1)
        return idx[:, None].astype(np.int64), q[np.arange(n), idx][:, None].astype(np.float64)
    out_idx = np.empty((n, k), dtype=np.int64)
    out_val = np.empty((n, k), dtype=np.float64)
    todo = np.arange(n)
    for thr in (1.0 / (2 * k), 1e-3 / k, 1e-6 / k):  # shrink the cut-off for peaked rows
        sub = q[todo]
        flat = np.flatnonzero(sub > np.float32(thr))
        r, c = flat // v, flat % v
        starts = np.searchsorted(r, np.arange(todo.size + 1))
        left = []
        for j, i in enumerate(todo.tolist()):
            cand = c[starts[j] : starts[j + 1]]
            if cand.size < k:
                left.append(i)
                continue
            vals = q[i, cand]
            if cand.size > 4 * k:  # many survivors: partition first, sort only k of them
                part = np.argpartition(-vals, k - 1)[:k]
                cand, vals = cand[part], vals[part]
            order = np.argsort(-vals, kind="stable")[:k]
            out_idx[i], out_val[i] = cand[order], vals[order]
        todo = np.asarray(left, dtype=np.int64)
        if todo.size == 0:
            break
    for i in todo.tolist():  # flat rows or k close to V
        vals_t, idx_t = torch.topk(torch.from_numpy(q[i]), k)
        out_idx[i], out_val[i] = idx_t.numpy(), vals_t.numpy()
    return out_idx, out_val


BLOCK = 1024


def _block_sums(q: np.ndarray) -> np.ndarray:
    """``[n, ceil(V/BLOCK)]`` float64 sums of consecutive BLOCK-token slices of ``q [n, V]``."""
    n, v = q.shape
    nb = -(-v // BLOCK)
    full = (nb - 1) * BLOCK
    out = np.empty((n, nb), dtype=np.float64)
    out[:, : nb - 1] = q[:, :full].reshape(n, nb - 1, BLOCK).sum(axis=2, dtype=np.float64)
    out[:, nb - 1] = q[:, full:].sum(axis=1, dtype=np.float64)
    return out


def _pick(weights: np.ndarray, x: float) -> int:
    """Index j with ``cumsum(weights)[j-1] <= x < cumsum(weights)[j]``, clipped to a positive weight."""
    c = np.cumsum(weights)
    j = int(np.searchsorted(c, x, side="right"))
    if j >= weights.size or weights[j] <= 0:  # float rounding at the upper edge
        pos = np.flatnonzero(weights > 0)
        j = int(pos[np.searchsorted(pos, min(j, weights.size - 1), side="left").clip(max=pos.size - 1)])
        if weights[j] <= 0:
            j = int(pos[-1])
    return j


class SiblingSampler:
    """Sibling draws for the rows of one source batch, made lazily, one at a time.

    Stochastic: sequential sampling without replacement (SWOR) — draw k is exactly a sample of
    the row with the k-1 drawn tokens removed and the rest renormalised — by two-level
    inverse-CDF sampling: float64 sums of 1024-token blocks (one vectorised pass over the
    batch, on first use), pick a block by its residual mass, then a token inside it. A draw
    costs O(V/1024 + 1024); no full-vocabulary noise is generated and draws that are never
    needed cost nothing. Once a row's positive support is used up a draw returns ``None``, or
    with ``uniform_fallback`` a uniformly random undrawn zero-probability token (Sequoia's
    Algorithm 1 fallback).
    Deterministic: the row's tokens in descending probability order (SWOR -> top-k), from one
    ``topk_rows`` with ``k = max_draws``; zero-probability tokens only with the fallback.

    Args:
        rows: ``[n, V]`` float draft distributions (any device; copied to the CPU once).
        generator: torch RNG for the uniforms (any device).
        deterministic: top-k order instead of sampling.
        max_draws: most draws that will be asked of any row (sizes the deterministic top-k).
        uniform_fallback: continue past the support with uniform draws instead of stopping.
    """

    def __init__(
        self,
        rows: torch.Tensor,
        generator: torch.Generator,
        deterministic: bool,
        max_draws: int,
        uniform_fallback: bool = False,
    ):
        self.n, self.vocab = int(rows.shape[0]), int(rows.shape[1])
        self.generator = generator
        self.deterministic = deterministic
        self.fallback = uniform_fallback
        self.max_draws = max(0, min(int(max_draws), self.vocab))
        self.count = [0] * self.n
        if deterministic:
            idx, vals = topk_rows(rows, self.max_draws)
            self._top_tok = idx.tolist()
            self._top_q = vals.tolist()
            return
        self.q = rows.detach().to("cpu", torch.float32).numpy()
        self._blocks: Optional[np.ndarray] = None  # residual block masses [n, nb]
        self._total: Optional[np.ndarray] = None  # initial row masses [n]
        self._res: list[float] = []  # residual row masses, updated per draw
        self._live: list[int] = []  # blocks with positive residual mass, per row
        self._drawn: list[set[int]] = [set() for _ in range(self.n)]
        self._u: list[float] = []

    # ------------------------------------------------------------------ helpers
    def _uniform(self) -> float:
        if not self._u:
            g = self.generator
            self._u = torch.rand(64, dtype=torch.float64, generator=g, device=g.device).cpu().tolist()
        return self._u.pop()

    def _residual_blocks(self) -> np.ndarray:
        if self._blocks is None:
            self._blocks = _block_sums(self.q)
            self._total = self._blocks.sum(axis=1)
            self._res = self._total.tolist()
            self._live = np.count_nonzero(self._blocks > 0, axis=1).tolist()
        return self._blocks

    def _residual(self, i: int) -> float:
        self._residual_blocks()
        return self._res[i] if self._live[i] > 0 else 0.0

    def remaining(self, i: int) -> float:
        """Fraction of row i's probability mass not drawn yet (1 before the first draw)."""
        if self.deterministic:
            return max(1.0 - sum(self._top_q[i][: self.count[i]]), 0.0)
        res = self._residual(i)
        return max(res / float(self._total[i]), 0.0) if res > 0 else 0.0

    def exhausted(self, i: int) -> bool:
        """No further draw is possible (all tokens drawn, or the support without fallback)."""
        k = self.count[i]
        if self.deterministic:
            return k >= self.max_draws or (not self.fallback and self._top_q[i][k] <= 0.0)
        if k >= self.vocab:
            return True
        return not self.fallback and self._residual(i) <= 0.0

    # ------------------------------------------------------------------ drawing
    def draw(self, i: int) -> Optional[tuple[int, float]]:
        """Next sibling draw of row i: ``(token, probability under the full row)`` or ``None``."""
        if self.exhausted(i):
            return None
        k = self.count[i]
        self.count[i] = k + 1
        if self.deterministic:
            return self._top_tok[i][k], self._top_q[i][k]
        q, drawn, blocks = self.q[i], self._drawn[i], self._residual_blocks()[i]
        res = self._residual(i)
        if res <= 0.0:  # uniform fallback over the undrawn zero-probability tokens
            while True:
                t = int(torch.randint(self.vocab, (1,), generator=self.generator, device=self.generator.device))
                if q[t] <= 0 and t not in drawn:
                    break
        else:
            x = self._uniform() * res
            j = _pick(blocks, x)
            x -= float(blocks[:j].sum())
            lo = j * BLOCK
            inner = q[lo : lo + BLOCK].astype(np.float64)
            for d in drawn:
                if lo <= d < lo + BLOCK:
                    inner[d - lo] = 0.0
            t = lo + _pick(inner, min(max(x, 0.0), float(inner.sum())))
            inner[t - lo] = 0.0
            new = float(inner.sum())  # recomputed exactly: 0 once the block is used up
            self._res[i] = max(self._res[i] - (float(blocks[j]) - new), 0.0)
            if new <= 0.0:
                self._live[i] -= 1
            blocks[j] = new
        drawn.add(t)
        return t, float(q[t])


def sibling_orders(
    rows: torch.Tensor,
    k: int,
    generator: torch.Generator,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``k`` sibling draws at each of ``n`` nodes, in draw order (``SiblingSampler``
    with the uniform fallback, so every row yields ``min(k, V)`` distinct tokens).

    Args:
        rows: ``[n, V]`` float draft distributions.
        k: number of draws per row (clipped to V).
        generator: torch RNG (unused when deterministic).
        deterministic: top-k instead of sampling without replacement.
    Returns:
        ``(tokens [n, k] int64, probs [n, k] float64)`` on the CPU, ``probs`` being each drawn
        token's probability under its row's full (unconditioned) distribution.
    """
    n, v = rows.shape
    k = max(0, min(int(k), v))
    if deterministic:
        idx, vals = topk_rows(rows, k)
        return torch.from_numpy(idx), torch.from_numpy(vals)
    sampler = SiblingSampler(rows, generator, False, k, uniform_fallback=True)
    toks = torch.zeros(n, k, dtype=torch.long)
    probs = torch.zeros(n, k, dtype=torch.float64)
    for i in range(n):
        for j in range(k):
            t, q = sampler.draw(i)  # type: ignore[misc]  # never None with the fallback
            toks[i, j], probs[i, j] = t, q
    return toks, probs


def top_children(
    rows: torch.Tensor, weights: Sequence[float], cut: float, k: int
) -> list[list[tuple[int, float]]]:
    """Deterministic children worth keeping: per row u, the tokens with ``weights[u]·q > cut``
    (all top-k when ``cut <= 0``), by descending probability, at most ``k``, none with q = 0.

    With ``cut > 0`` one comparison pass over ``[n, V]`` replaces the top-k (only the few
    survivors are sorted). Used by the top-n tree builders, where nodes at or below the current
    n-th best weight can never enter the result.

    Args:
        rows: ``[n, V]`` float draft distributions.
        weights: ``n`` parent weights (path probabilities).
        cut: exclusive weight threshold for the children.
        k: most children per row.
    Returns:
        ``n`` lists of ``(token, probability)``.
    """
    n, v = rows.shape
    k = max(0, min(int(k), v))
    out: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    if cut <= 0.0:
        idx, vals = topk_rows(rows, k)
        for i, (ts, qs) in enumerate(zip(idx.tolist(), vals.tolist())):
            out[i] = [(t, q) for t, q in zip(ts, qs) if q > 0.0]
        return out
    q_all = rows.detach().to("cpu", torch.float32).numpy()
    thr = np.array([cut / w * (1 - 1e-6) if w > 0 else np.inf for w in weights], dtype=np.float32)
    flat = np.flatnonzero(q_all > thr[:, None])  # numpy: single-threaded, ~4x faster than torch here
    r, c = flat // v, flat % v
    for i, t, q in zip(r.tolist(), c.tolist(), q_all[r, c].astype(np.float64).tolist()):
        if weights[i] * q > cut:
            out[i].append((t, q))
    for i in range(n):
        out[i].sort(key=lambda tq: -tq[1])
        del out[i][k:]
    return out


def iid_draws(rows: torch.Tensor, num: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``num`` independent draws (with replacement) from each row, by the same two-level
    (1024-token blocks, float64) inverse-CDF sampling as ``SiblingSampler``.

    Args:
        rows: ``[n, V]`` float draft distributions.
        num: draws per row.
        generator: torch RNG (its device need not match ``rows``).
    Returns:
        ``(tokens [n, num] int64, probs [n, num] float64)`` on the CPU.
    """
    q = rows.detach().to("cpu", torch.float32).numpy()
    n, v = q.shape
    blocks = _block_sums(q)
    u = torch.rand((n, num), dtype=torch.float64, generator=generator, device=generator.device).cpu().tolist()
    idx = np.empty((n, num), dtype=np.int64)
    for i in range(n):
        total = float(blocks[i].sum())
        for s in range(num):
            x = u[i][s] * total
            j = _pick(blocks[i], x)
            x -= float(blocks[i, :j].sum())
            inner = q[i, j * BLOCK : (j + 1) * BLOCK].astype(np.float64)
            idx[i, s] = j * BLOCK + _pick(inner, min(max(x, 0.0), float(inner.sum())))
    probs = np.take_along_axis(q, idx, axis=1).astype(np.float64)
    return torch.from_numpy(idx), torch.from_numpy(probs)
