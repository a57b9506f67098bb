"""Two steps of the dense layer as one op each (``decode.layer_kernels``): their Triton kernels (CUDA, or Triton's
interpreter on the CPU) give the torch ops' numbers and cache writes, each op is one kernel to ``LaunchCounter``,
and a dense forward through them traces whole with ``fullgraph=True`` and equals its torch ops."""

import pytest
import torch
from conftest import DEVICE

from dyntree_core.attention.triton_kernel import HAS_TRITON, interpreter_usable
from dyntree_core.decode.layer_kernels import (rope_write, rope_write_torch, rope_write_triton, silu_mul,
                                               silu_mul_torch, silu_mul_triton)
from dyntree_core.decode.op_count import LaunchCounter

needs_triton = pytest.mark.skipif(not HAS_TRITON or (DEVICE.type == "cpu" and not interpreter_usable()),
                                  reason="Triton (or its interpreter) is not usable here")


def _rope_inputs(n: int, heads: int, kv_heads: int, d: int, dtype, seed: int):
    """The q/k/v heads as the projection leaves them (a transposed view), per-row tables with the value heads'
    identity (as ``DenseForward`` builds them), a cache of 40 slots and distinct slots for the rows."""
    g = torch.Generator().manual_seed(seed)
    nh = heads + 2 * kv_heads
    y = torch.randn(1, n, nh * d, generator=g).to(dtype).view(1, n, nh, d).transpose(1, 2)
    angle = torch.rand(n, d // 2, generator=g) * 6
    cos = torch.cat([angle.cos(), angle.cos()], 1)
    sin = torch.cat([-angle.sin(), angle.sin()], 1)
    tables = torch.stack([cos, sin])[:, None].expand(-1, heads + kv_heads, -1, -1)
    identity = torch.tensor([1.0, 0.0])[:, None, None, None].expand(2, kv_heads, n, d)
    tables = torch.cat([tables, identity], 1).to(dtype)
    buf = torch.randn(2 * kv_heads, 40, d, generator=g).to(dtype)
    slots = torch.randperm(40, generator=g)[:n]
    return [t.to(DEVICE) for t in (y, tables[0][None], tables[1][None], buf, slots)]


@needs_triton
@pytest.mark.parametrize("n,heads,kv_heads,d", [(1, 4, 2, 16), (5, 14, 2, 64), (3, 2, 2, 8), (7, 6, 1, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_kernel_gives_the_torch_ops_queries_and_cache(n, heads, kv_heads, d, dtype):
    """The rotated queries and every cache row (the rows' slots written, the others untouched) equal the torch
    ops': float32 within a fused multiply-add's rounding, bf16 within one rounding (the kernel rounds once where
    the torch ops round the product first); the values are copied exactly (the identity)."""
    y, cos, sin, buf, slots = _rope_inputs(n, heads, kv_heads, d, dtype, seed=n * 100 + d)
    want_buf, got_buf = buf.clone(), buf.clone()
    want = rope_write_torch(y, cos, sin, want_buf, slots, heads)
    got = rope_write_triton(y, cos, sin, got_buf, slots, heads)
    assert got.shape == (1, heads, n, d) and got.is_contiguous()
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got_buf, want_buf, **tol)
    assert torch.equal(got_buf[kv_heads:, slots], y[0, heads + kv_heads:])  # the values, unrotated
    untouched = torch.ones(40, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(got_buf[:, untouched], buf[:, untouched])


@needs_triton
@pytest.mark.parametrize("rows,intermediate", [(1, 40), (6, 1500), (3, 2048), (2, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_kernel_gives_the_torch_ops(rows, intermediate, dtype):
    g = torch.Generator().manual_seed(rows + intermediate)
    gu = (torch.randn(1, rows, 2 * intermediate, generator=g) * 4).to(dtype).to(DEVICE)
    want, got = silu_mul_torch(gu, intermediate), silu_mul_triton(gu, intermediate)
    assert got.shape == (1, rows, intermediate)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tol)


def test_each_op_is_one_kernel_and_does_what_its_torch_ops_do():
    """``LaunchCounter`` counts each op as the one kernel CUDA launches (its torch ops: 4 and 2); on this device
    the ops' results (and cache writes) are their torch ops' within the kernels' rounding."""
    y, cos, sin, buf, slots = _rope_inputs(3, 4, 2, 16, torch.float32, seed=1)
    b1, b2 = buf.clone(), buf.clone()
    with LaunchCounter() as launches:
        q = rope_write(y, cos, sin, b1, slots, 4)
    assert dict(launches.by_op) == {"rope_write": 1}
    with LaunchCounter() as launches:
        want = rope_write_torch(y, cos, sin, b2, slots, 4)
    assert launches.kernels == 4
    torch.testing.assert_close(q, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(b1, b2, rtol=1e-6, atol=1e-6)
    gu = torch.randn(1, 3, 20, device=DEVICE)
    with LaunchCounter() as launches:
        act = silu_mul(gu, 10)
    assert dict(launches.by_op) == {"silu_mul": 1}
    with LaunchCounter() as launches:
        want = silu_mul_torch(gu, 10)
    assert launches.kernels == 2
    torch.testing.assert_close(act, want, rtol=1e-6, atol=1e-6)


def test_a_dense_forward_through_the_ops_traces_whole_and_writes_the_cache():
    """``torch.compile(fullgraph=True)`` (dynamo's ``eager`` backend) takes the forward with both ops (the cache
    write a mutation of the op's ``buf``): the logits and the cache equal the eager forward's exactly."""
    from dyntree_core.bench.resident import synthetic_qwen
    from dyntree_core.decode.dense_forward import DenseForward

    model = synthetic_qwen(64, 2, 4, 2, 128, 512, seed=1, dev=DEVICE)
    eager, traced = DenseForward(model, 64), DenseForward(model, 64)
    rows = torch.arange(4, device=DEVICE)
    visible = torch.ones(4, 64, dtype=torch.bool, device=DEVICE).tril()
    want = eager(rows + 7, rows, rows, visible, rows)
    got = torch.compile(traced.__call__, fullgraph=True, dynamic=False, backend="eager")(rows + 7, rows, rows,
                                                                                         visible, rows)
    assert torch.equal(got, want)
    assert torch.equal(traced.kv.kv, eager.kv.kv) and traced.kv.kv[:, :, :4].abs().sum() > 0
