"""Triton tree attention: dense prefix loop + block-skipping tree loop, GQA packed into M.

Layout (batch 1; a slice ``x[0]`` of HF's ``[B, H, L, D]`` tensors is passed as is):

- ``q``: ``[Hq, Q, D]``, ``k``/``v``: ``[Hkv, P + W, D]``, ``out``: ``[Hq, Q, D]``. Any strides
  for the head and token dims; the last dim must be contiguous. HF's attention output layout
  ``[1, Q, Hq, D]`` is written directly by passing ``out[0].transpose(0, 1)``.
- ``Hq = G * Hkv``. Query head ``h`` uses KV head ``h // G`` (HF's ``repeat_kv`` convention).

Grid: ``(cdiv(Q, BLOCK_Q), Hkv)``. A program owns ``BLOCK_Q`` query tokens of all ``G`` query
heads of one KV head: row ``r`` of its ``BLOCK_M = next_pow2(BLOCK_Q * G)`` rows is token
``qb * BLOCK_Q + r // G`` of head ``kvh * G + r % G`` (vLLM's packing), so each K/V tile is loaded
once per KV head. Loop 1 streams the ``P`` dense prefix columns in ``PREFIX_BLOCK_N`` tiles (by
default ``BLOCK_N``; a wider prefix tile means fewer sequential iterations) with only a bounds
check. Loop 2 walks the program's *full* tree key blocks (bounds check only), then its
*partial* ones, whose element mask is either read from a ``[Q, W]`` uint8 mask or computed from
``subtree_end`` (interval form, pre-ordered trees: ``k <= q < end[k]``). Empty blocks are never
visited and no block-skip branch sits inside a loop. Online softmax in fp32 (base-2), guarded
for rows that see nothing (output 0, as SDPA). Runtime sizes are ``do_not_specialize``; only tile
sizes, head dim, group and dtype flags are ``constexpr``.

Without CUDA the module sets ``TRITON_INTERPRET=1`` *before* importing Triton (the interpreter
must be selected before any ``@triton.jit`` runs); bf16 is then upcast to fp32 in-kernel because
the interpreter's bf16 ``tl.dot`` is silently wrong.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:  # Triton is a Linux-only dependency.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only on platforms without Triton
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False

from dyntree_core.attention.mask import TreeAttnMeta

LOG2E = 1.4426950408889634


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreter_usable() -> bool:
    """False when interpreting was requested after Triton's own library was compiled for a GPU.

    Triton decides per ``@triton.jit`` decoration whether a function is interpreted, including
    its standard library (``tl.zeros``, ``tl.max``, ...). If Triton was imported before
    ``TRITON_INTERPRET=1`` was set, those stay GPU-only and every interpreted kernel fails.
    """
    if not HAS_TRITON or not interpreting():
        return HAS_TRITON
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.standard.zeros, InterpretedFunction)


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def default_block_q(group: int, block_m: int = 64) -> int:
    """Query tokens per program for ``block_m`` packed rows and GQA group ``group`` (>= 1)."""
    return max(1, block_m // group)


if HAS_TRITON:

    @triton.jit
    def _attend_tile(
        q, acc, m_i, l_i, k_base, v_base, kv_idx, col_ok, visible, skt, svt, offs_d, d_ok, sm_scale,
        CAST_F32: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """One ``[BLOCK_M, BLOCK_N]`` online-softmax step; ``visible`` is the 2D score mask."""
        k = tl.load(k_base + kv_idx[:, None] * skt + offs_d[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_base + kv_idx[:, None] * svt + offs_d[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        if CAST_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return acc, m_new, l_i

    @triton.jit(
        do_not_specialize=[
            "n_q", "prefix_len", "width", "idx_stride", "mask_stride",
            "sqh", "sqt", "skh", "skt", "svh", "svt", "soh", "sot",
        ]
    )
    def _tree_attn_fwd(
        Q, K, V, O, FULL_CNT, FULL_IDX, PART_CNT, PART_IDX, MASK, END,
        sm_scale, n_q, prefix_len, width, idx_stride, mask_stride,
        sqh, sqt, skh, skt, svh, svt, soh, sot,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, PREFIX_BLOCK_N: tl.constexpr,
        INTERVAL: tl.constexpr, CAST_F32: tl.constexpr, PRECISION: tl.constexpr,
    ):
        qb = tl.program_id(0)
        kvh = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_p = tl.arange(0, PREFIX_BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        q_row = qb * BLOCK_Q + offs_m // GROUP
        head = kvh * GROUP + offs_m % GROUP
        row_ok = (offs_m < BLOCK_Q * GROUP) & (q_row < n_q)
        d_ok = offs_d < HEAD_DIM
        q = tl.load(Q + head[:, None] * sqh + q_row[:, None] * sqt + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if CAST_F32:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        k_base = K + kvh * skh
        v_base = V + kvh * svh
        all_rows = offs_m >= 0  # [BLOCK_M] True, to broadcast 1D column masks to 2D

        # Loop 1: dense prefix, no mask beyond the bound.
        for start in range(0, prefix_len, PREFIX_BLOCK_N):
            cols = start + offs_p
            col_ok = cols < prefix_len
            acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_base, v_base, cols, col_ok,
                                         all_rows[:, None] & col_ok[None, :], skt, svt, offs_d, d_ok,
                                         sm_scale, CAST_F32, PRECISION)

        # Loop 2a: full tree blocks (every in-range element visible).
        n_full = tl.load(FULL_CNT + qb)
        for i in range(0, n_full):
            kb = tl.load(FULL_IDX + qb * idx_stride + i)
            cols = kb * BLOCK_N + offs_n
            col_ok = cols < width
            acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_base, v_base, prefix_len + cols, col_ok,
                                         all_rows[:, None] & col_ok[None, :], skt, svt, offs_d, d_ok,
                                         sm_scale, CAST_F32, PRECISION)

        # Loop 2b: partial tree blocks (element mask from the interval form or the mask tensor).
        n_part = tl.load(PART_CNT + qb)
        for i in range(0, n_part):
            kb = tl.load(PART_IDX + qb * idx_stride + i)
            cols = kb * BLOCK_N + offs_n
            col_ok = cols < width
            if INTERVAL:
                end = tl.load(END + cols, mask=col_ok, other=0)
                vis = (cols[None, :] <= q_row[:, None]) & (q_row[:, None] < end[None, :])
            else:
                mt = tl.load(MASK + q_row[:, None] * mask_stride + cols[None, :],
                             mask=row_ok[:, None] & col_ok[None, :], other=0)
                vis = mt != 0
            acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_base, v_base, prefix_len + cols, col_ok,
                                         vis & col_ok[None, :], skt, svt, offs_d, d_ok,
                                         sm_scale, CAST_F32, PRECISION)

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        tl.store(O + head[:, None] * soh + q_row[:, None] * sot + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def triton_tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: TreeAttnMeta,
    sm_scale: Optional[float] = None,
    out: Optional[torch.Tensor] = None,
    exact_fp32: bool = True,
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
    prefix_block_n: Optional[int] = None,
) -> torch.Tensor:
    """Tree attention for one sequence.

    Args:
        q: ``[Hq, Q, D]`` queries (fp16/bf16/fp32), last dim contiguous.
        k, v: ``[Hkv, L, D]`` keys/values with ``L >= meta.prefix_len + meta.blocks.width``;
            columns ``[0, P)`` are the dense prefix, ``[P, P + W)`` the tree part.
        meta: ``TreeAttnMeta`` (block lists built with ``block_q = default_block_q(G, ...)`` or
            any ``block_q``; the kernel packs ``block_q * G`` rows per program).
        sm_scale: softmax scale, ``1/sqrt(D)`` by default.
        out: optional ``[Hq, Q, D]`` output (any head/token strides) written in place.
        exact_fp32: fp32 inputs use IEEE fp32 dots (else TF32) on the GPU.
        prefix_block_n: key columns per tile of the dense prefix loop (a power of two >= 16;
            default ``meta.blocks.block_n``, the tree loop's tile).

    Returns:
        ``[Hq, Q, D]`` attention output in ``q``'s dtype (``out`` when given). Rows that see no key
        are 0.
    """
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed; use the torch backend")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError("q, k, v must be [H, L, D] (one sequence)")
    hq, n_q, d = q.shape
    hkv, kv_len, _ = k.shape
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of kv heads {hkv}")
    group = hq // hkv
    blocks = meta.blocks
    if blocks.n_q != n_q:
        raise ValueError(f"block lists built for {blocks.n_q} query rows, got {n_q}")
    if kv_len < meta.prefix_len + blocks.width:
        raise ValueError(f"k has {kv_len} rows < prefix {meta.prefix_len} + tree {blocks.width}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim")
    if v.shape != k.shape:
        raise ValueError("k and v shapes differ")
    interval = meta.end is not None
    if not interval and meta.mask is None:
        raise ValueError("meta has neither a mask nor subtree_end")
    dev = q.device
    if blocks.full_cnt.device != dev:
        blocks = blocks.to(dev)
    interp = interpreting()
    if interp and not interpreter_usable():
        raise RuntimeError(
            "Triton was imported before TRITON_INTERPRET=1 was set, so its interpreter cannot run; "
            "set TRITON_INTERPRET=1 at process start (e.g. first lines of tests/conftest.py)"
        )
    if not interp and dev.type != "cuda":
        raise RuntimeError("the compiled Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1)")
    cast_f32 = interp and q.dtype == torch.bfloat16
    fp32_math = cast_f32 or q.dtype == torch.float32
    precision = "ieee" if (fp32_math and (exact_fp32 or interp)) else "tf32"

    final = out
    if out is None:
        final = torch.empty(hq, n_q, d, dtype=q.dtype, device=dev)
    target = final
    if cast_f32:  # the interpreter cannot emit bf16 arithmetic: write fp32, cast afterwards
        target = torch.full((hq, n_q, d), float("nan"), dtype=torch.float32, device=dev)
    if n_q == 0:
        return final

    block_q = blocks.block_q
    block_m = max(16, next_pow2(block_q * group))
    block_n = blocks.block_n
    if block_n < 16 or block_n != next_pow2(block_n):
        raise ValueError("block_n must be a power of two >= 16")
    prefix_block = block_n if prefix_block_n is None else int(prefix_block_n)
    if prefix_block < 16 or prefix_block != next_pow2(prefix_block):
        raise ValueError("prefix_block_n must be a power of two >= 16")
    block_d = max(16, next_pow2(d))
    scale = (1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)) * LOG2E

    use_mask = not interval
    mask_t = meta.mask.to(dev).contiguous().view(torch.uint8) if use_mask else blocks.full_cnt  # dummy when unused
    mask_stride = mask_t.stride(0) if use_mask else 0
    end_t = meta.end.to(dev, torch.int32) if interval else blocks.full_cnt
    idx_stride = blocks.full_idx.stride(0)
    if num_warps is None:
        num_warps = 8 if block_m * block_d >= 128 * 128 else 4
    if num_stages is None:
        num_stages = 2
    grid = (triton.cdiv(n_q, block_q), hkv)
    _tree_attn_fwd[grid](
        q, k, v, target, blocks.full_cnt, blocks.full_idx, blocks.part_cnt, blocks.part_idx, mask_t, end_t,
        scale, n_q, meta.prefix_len, blocks.width, idx_stride, mask_stride,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        target.stride(0), target.stride(1),
        HEAD_DIM=d, BLOCK_D=block_d, GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
        PREFIX_BLOCK_N=prefix_block, INTERVAL=interval, CAST_F32=cast_f32, PRECISION=precision,
        num_warps=num_warps, num_stages=num_stages,
    )
    if target is not final:
        final.copy_(target)
    if meta.dead_rows is not None:
        final.masked_fill_(meta.dead_rows.to(dev)[None, :, None], 0.0)
    return final
