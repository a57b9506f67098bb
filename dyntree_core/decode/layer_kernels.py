"""Two steps of ``decode.dense_forward``'s layer as one kernel each on CUDA, where torch ops take 6.

A captured forward is launch-bound on a GPU (the H200: ~6 us a kernel inside a graph, 417 kernels a 24-layer
0.5B-shaped draft forward, 2.5 ms; docs/GPU_RESULTS.md), so a kernel less per layer is ~24 launches less per
draft level and ~28 per 7B forward:

* ``rope_write``: the q/k/v heads rotated (the value heads by the identity) and the keys and values written
  to the layer's cache slots: ``cat``, ``mul``, ``addcmul`` and ``index_copy_`` as torch ops; one Triton
  program per (row, head) on CUDA;
* ``silu_mul``: ``silu(gate) * up`` from the fused gate/up projection's output: ``silu`` and ``mul`` as torch
  ops; one Triton launch on CUDA.

Elsewhere (the CPU) each runs its torch ops, the reference the kernels are tested against (in Triton's
interpreter on the CPU). Both are custom ops with fakes, so ``torch.compile(fullgraph=True)`` and CUDA-graph
capture take them whole and ``decode.op_count.LaunchCounter`` counts each as the one kernel CUDA launches.
``DYNTREE_LAYER_KERNELS=torch`` runs the torch ops on CUDA too (an A/B). The kernels compute in float32 and
round once, where the torch ops round each intermediate to the model's dtype: within one rounding of them.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ..attention.triton_kernel import HAS_TRITON, next_pow2

if HAS_TRITON:
    import triton
    import triton.language as tl


def rope_write_torch(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, buf: torch.Tensor, slots: torch.Tensor,
                     heads: int) -> torch.Tensor:
    """``rope_write`` as torch ops (4 kernels).

    Args:
        y: ``[1, NH, n, d]`` the q/k/v projection's heads (``NH = H + 2 H_kv``; a transposed view is fine).
        cos, sin: ``[1, NH, n, d]`` each row's rotary tables (``sin`` with its first half negated; cos 1 and
            sin 0 on the value heads).
        buf: ``[2 H_kv, C, d]`` the layer's cache (keys, then values); written at ``slots``.
        slots: ``[n]`` int64 distinct cache slots of the rows.
        heads: ``H``, the query heads.
    Returns:
        ``[1, H, n, d]`` the rotated queries (contiguous).
    """
    half = y.shape[-1] // 2
    r = torch.addcmul(torch.cat([y[..., half:], y[..., :half]], dim=-1) * sin, y, cos)
    buf.index_copy_(1, slots, r[0, heads:])
    return r[:, :heads]


def silu_mul_torch(gu: torch.Tensor, intermediate: int) -> torch.Tensor:
    """``silu(gu[..., :F]) * gu[..., F:]`` (``F = intermediate``) as torch ops (2 kernels)."""
    return F.silu(gu[..., :intermediate]) * gu[..., intermediate:]


def _use_triton(t: torch.Tensor) -> bool:
    return HAS_TRITON and t.is_cuda and os.environ.get("DYNTREE_LAYER_KERNELS", "triton") == "triton"


if HAS_TRITON:
    @triton.jit
    def _rope_write_kernel(y_ptr, cos_ptr, sin_ptr, buf_ptr, slots_ptr, q_ptr, N, NH, H,
                           sy_h, sy_n, sc_h, sc_n, ss_h, ss_n, sb_h, sb_c,
                           D: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        r = pid // NH
        h = pid % NH
        offs = tl.arange(0, BLOCK)
        ok = offs < D
        swapped = tl.where(offs < HALF, offs + HALF, offs - HALF)  # cat(x2, x1)
        row = y_ptr + h * sy_h + r * sy_n
        x = tl.load(row + offs, mask=ok, other=0.0).to(tl.float32)
        xs = tl.load(row + swapped, mask=ok, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + h * sc_h + r * sc_n + offs, mask=ok, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + h * ss_h + r * ss_n + offs, mask=ok, other=0.0).to(tl.float32)
        out = (x * c + xs * s).to(q_ptr.dtype.element_ty)
        is_q = offs * 0 + h < H  # (as a vector: a scalar condition in a mask is refused by the interpreter)
        tl.store(q_ptr + (h * N + r) * D + offs, out, mask=ok & is_q)
        slot = tl.load(slots_ptr + r)
        kv_head = tl.maximum(h - H, 0)
        tl.store(buf_ptr + kv_head * sb_h + slot * sb_c + offs, out, mask=ok & ~is_q)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, FF, s_row, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < FF
        g = tl.load(gu_ptr + row * s_row + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * s_row + FF + offs, mask=ok, other=0.0).to(tl.float32)
        out = g / (1.0 + tl.exp(-g)) * u
        tl.store(out_ptr + row * FF + offs, out.to(out_ptr.dtype.element_ty), mask=ok)


def _last_dim_dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rope_write_triton(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, buf: torch.Tensor, slots: torch.Tensor,
                      heads: int) -> torch.Tensor:
    """``rope_write_torch``'s result (and cache writes) from one Triton launch (CUDA, or the interpreter)."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed")
    _, nh, n, d = y.shape
    y, cos, sin = (_last_dim_dense(t) for t in (y, cos, sin))
    if buf.stride(-1) != 1:
        raise ValueError("the cache's head dimension must be dense")
    q = torch.empty(1, heads, n, d, dtype=y.dtype, device=y.device)
    if n == 0:
        return q
    _rope_write_kernel[(n * nh,)](y, cos, sin, buf, slots, q, n, nh, heads,
                                  y.stride(1), y.stride(2), cos.stride(1), cos.stride(2), sin.stride(1), sin.stride(2),
                                  buf.stride(0), buf.stride(1), D=d, HALF=d // 2, BLOCK=next_pow2(d))
    return q


def silu_mul_triton(gu: torch.Tensor, intermediate: int) -> torch.Tensor:
    """``silu_mul_torch``'s result from one Triton launch (CUDA, or the interpreter)."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed")
    gu = gu.contiguous()
    rows = gu.numel() // gu.shape[-1]
    out = gu.new_empty(*gu.shape[:-1], intermediate)
    if rows == 0:
        return out
    block = min(1024, next_pow2(intermediate))
    _silu_mul_kernel[(rows, triton.cdiv(intermediate, block))](gu, out, intermediate, gu.shape[-1], BLOCK=block)
    return out


@torch.library.custom_op("dyntree::rope_write", mutates_args=("buf",))
def rope_write(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, buf: torch.Tensor, slots: torch.Tensor,
               heads: int) -> torch.Tensor:
    """``rope_write_torch`` as one op: one Triton launch on CUDA, the torch ops elsewhere."""
    return rope_write_torch(y, cos, sin, buf, slots, heads)


@rope_write.register_kernel("cuda")
def _rope_write_cuda(y, cos, sin, buf, slots, heads):
    if _use_triton(y):
        return rope_write_triton(y, cos, sin, buf, slots, heads)
    return rope_write_torch(y, cos, sin, buf, slots, heads)


@rope_write.register_fake
def _rope_write_fake(y, cos, sin, buf, slots, heads):
    return y.new_empty(1, heads, y.shape[2], y.shape[3])


@torch.library.custom_op("dyntree::silu_mul", mutates_args=())
def silu_mul(gu: torch.Tensor, intermediate: int) -> torch.Tensor:
    """``silu_mul_torch`` as one op: one Triton launch on CUDA, the torch ops elsewhere."""
    return silu_mul_torch(gu, intermediate)


@silu_mul.register_kernel("cuda")
def _silu_mul_cuda(gu, intermediate):
    if _use_triton(gu):
        return silu_mul_triton(gu, intermediate)
    return silu_mul_torch(gu, intermediate)


@silu_mul.register_fake
def _silu_mul_fake(gu, intermediate):
    return gu.new_empty(*gu.shape[:-1], intermediate)
