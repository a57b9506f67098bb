"""The token-level recurrence of ``verify.device.token_level_tests`` as one kernel launch: ``token_level_alphas``.

Each slot's ``K`` sibling tests need the coefficients ``a_1 .. a_K`` of its residuals, one after the other
(``a_{j+1} = a_j + F(a_j) / M_j``, the module docstring of ``verify.device``). Written as torch ops that is
6 kernels a sibling position: a DySpec tree's slot may have ``budget - 1`` children, so a sampled budget-64
verify launched ~380 kernels for it (~1,500 at budget 256), each a few microseconds of GPU time inside the
step's graph. Here the whole recurrence is one op:

* on CUDA, one Triton program per slot runs its ``K`` steps; the search of ``-a`` among the row's sorted
  keys is two vector loads a step (every ``STEP``-th key, loaded once, then one ``STEP``-wide block), not a
  ``log2 V`` chain of dependent loads;
* elsewhere (the CPU), the same arithmetic as torch ops (``alphas_loop``, also the reference the kernel is
  tested against, in Triton's interpreter on the CPU).

``DYNTREE_ALPHAS=loop`` runs the torch ops on CUDA too (``bench gpu``'s ``graph_alphas_loop`` rows: the A/B).

It is registered as the custom op ``dyntree::token_level_alphas`` (with a fake for tracing), so
``torch.compile(fullgraph=True)`` and CUDA-graph capture take it whole and ``decode.op_count.LaunchCounter``
counts it as the one kernel CUDA launches.
"""

from __future__ import annotations

import math
import os

import torch

from ..attention.triton_kernel import HAS_TRITON, next_pow2

if HAS_TRITON:
    import triton
    import triton.language as tl

#: residual masses at or below this count as empty (see ``verify.device``'s docstring)
EMPTY = 1e-12


def alphas_loop(key: torch.Tensor, p_cum: torch.Tensor, q_cum: torch.Tensor, left: torch.Tensor) -> torch.Tensor:
    """The recurrence as torch ops (6 kernels a sibling position).

    Args:
        key: ``[B, V]`` float32 each row's ``-p/q`` in ascending order.
        p_cum, q_cum: ``[B, V]`` float64 the p and q mass of each row's first ``c + 1`` sorted tokens.
        left: ``[B, K]`` float64 the draft mass ``M_j`` before each sibling test.
    Returns:
        ``[K + 1, 2, B]`` float64: ``(-a_j, F(a_j))`` before test ``j`` (row 0: ``(0, 1)``) and after the last.
    """
    b, k = left.shape
    f64 = dict(dtype=torch.float64, device=key.device)
    key = key.to(torch.float64)  # (exact: the search compares float64 coefficients, as the kernel does)
    state = torch.stack([torch.zeros(b, **f64), torch.ones(b, **f64)])
    step = torch.empty_like(state)
    states = [state]
    for j in range(k):
        torch.addcdiv(state[0], state[1], left[:, j], value=-1.0, out=step[0])  # -a_{j+1}
        above = torch.searchsorted(key, step[0][:, None])  # [B, 1] tokens with p/q > a_{j+1}
        at = (above - 1).clamp(min=0)
        pq = torch.where(above > 0, torch.cat([p_cum.gather(1, at), q_cum.gather(1, at)], 1), 0.0)  # [B, 2] their mass
        torch.addcmul(pq[:, 0], step[0], pq[:, 1], out=step[1])  # F(a_{j+1})
        state = torch.where(step[1] > EMPTY, step, state)
        states.append(state)
    return torch.stack(states)


def search_blocks(v: int) -> tuple[int, int, int]:
    """``(COARSE, STEP, FINE)`` for a row of ``v`` sorted keys: every ``STEP``-th key (``COARSE`` of them, a
    power of two) narrows the search to one block of ``STEP <= FINE`` keys (``FINE`` a power of two)."""
    coarse = next_pow2(max(1, math.isqrt(max(1, v - 1)) + 1))
    step = -(-v // coarse)
    return coarse, step, next_pow2(step)


if HAS_TRITON:
    @triton.jit
    def _alphas_kernel(key_ptr, p_ptr, q_ptr, left_ptr, out_ptr, B, V, K, key_stride, cum_stride, left_stride,
                       EMPTY_MASS: tl.constexpr, COARSE: tl.constexpr, STEP: tl.constexpr, FINE: tl.constexpr):
        row = tl.program_id(0)
        key_row = key_ptr + row * key_stride
        p_row = p_ptr + row * cum_stride
        q_row = q_ptr + row * cum_stride
        coarse_at = tl.arange(0, COARSE) * STEP
        coarse = tl.load(key_row + coarse_at, mask=coarse_at < V, other=float("inf")).to(tl.float64)  # every step's
        fine_at = tl.arange(0, FINE)
        neg_a = tl.zeros((), dtype=tl.float64)
        mass = neg_a + 1.0
        tl.store(out_ptr + row, neg_a)
        tl.store(out_ptr + B + row, mass)
        for j in range(0, K):
            m_j = tl.load(left_ptr + row * left_stride + j)
            nxt = neg_a - mass / m_j  # -a_{j+1}
            base = tl.maximum(tl.sum((coarse < nxt).to(tl.int32), axis=0) - 1, 0) * STEP
            at = base + fine_at
            block = tl.load(key_row + at, mask=(fine_at < STEP) & (at < V), other=float("inf")).to(tl.float64)
            above = base + tl.sum((block < nxt).to(tl.int32), axis=0)  # = searchsorted(row keys, nxt)
            last = tl.maximum(above - 1, 0)  # the first `above` tokens' masses: the prefix sums at above - 1
            p = tl.where(above > 0, tl.load(p_row + last), 0.0)
            q = tl.where(above > 0, tl.load(q_row + last), 0.0)
            f = p + nxt * q  # F(a_{j+1})
            keep = f > EMPTY_MASS
            neg_a = tl.where(keep, nxt, neg_a)
            mass = tl.where(keep, f, mass)
            tl.store(out_ptr + (j + 1) * 2 * B + row, neg_a)
            tl.store(out_ptr + (j + 1) * 2 * B + B + row, mass)


def alphas_triton(key: torch.Tensor, p_cum: torch.Tensor, q_cum: torch.Tensor, left: torch.Tensor) -> torch.Tensor:
    """``alphas_loop``'s result from one Triton launch (CUDA, or Triton's interpreter on the CPU)."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed")
    b, v = key.shape
    k = left.shape[1]
    key, p_cum, q_cum, left = key.contiguous(), p_cum.contiguous(), q_cum.contiguous(), left.contiguous()
    out = torch.empty(k + 1, 2, b, dtype=torch.float64, device=key.device)
    if b == 0:
        return out
    coarse, step, fine = search_blocks(v)
    _alphas_kernel[(b,)](key, p_cum, q_cum, left, out, b, v, k, key.stride(0), p_cum.stride(0), left.stride(0),
                         EMPTY_MASS=EMPTY, COARSE=coarse, STEP=step, FINE=fine)
    return out


@torch.library.custom_op("dyntree::token_level_alphas", mutates_args=())
def token_level_alphas(key: torch.Tensor, p_cum: torch.Tensor, q_cum: torch.Tensor, left: torch.Tensor) -> torch.Tensor:
    """``alphas_loop``'s result as one op: one Triton launch on CUDA, ``alphas_loop`` elsewhere."""
    return alphas_loop(key, p_cum, q_cum, left)


@token_level_alphas.register_kernel("cuda")
def _token_level_alphas_cuda(key: torch.Tensor, p_cum: torch.Tensor, q_cum: torch.Tensor,
                             left: torch.Tensor) -> torch.Tensor:
    if HAS_TRITON and os.environ.get("DYNTREE_ALPHAS", "triton") == "triton":
        return alphas_triton(key, p_cum, q_cum, left)
    return alphas_loop(key, p_cum, q_cum, left)


@token_level_alphas.register_fake
def _token_level_alphas_fake(key: torch.Tensor, p_cum: torch.Tensor, q_cum: torch.Tensor,
                             left: torch.Tensor) -> torch.Tensor:
    return p_cum.new_empty(left.shape[1] + 1, 2, key.shape[0])
