"""The token-level recurrence as one op (``verify.alpha_kernel``): its Triton kernel (CUDA, or Triton's
interpreter on the CPU) gives the torch ops' coefficients, the op is one kernel to ``LaunchCounter`` and
traces whole with ``fullgraph=True``."""

import pytest
import torch
from conftest import DEVICE

from dyntree_core.attention.triton_kernel import HAS_TRITON, interpreter_usable
from dyntree_core.decode.op_count import LaunchCounter
from dyntree_core.verify.alpha_kernel import EMPTY, alphas_loop, alphas_triton, search_blocks, token_level_alphas
from dyntree_core.verify.device import token_level_tests

needs_triton = pytest.mark.skipif(not HAS_TRITON or (DEVICE.type == "cpu" and not interpreter_usable()),
                                  reason="Triton (or its interpreter) is not usable here")


def _rows(b: int, v: int, k: int, seed: int):
    """Target and draft rows with tokens the draft never proposes (``p / q`` infinite), rows where the draft
    equals the target (the residual empties at the first rejection: ``EMPTY``) and the recurrence's inputs
    as ``token_level_tests`` makes them."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(b, v, generator=g) * 3, 1)
    q = torch.softmax(torch.randn(b, v, generator=g) * 3, 1)
    q[:, : v // 5] = 0
    q = q / q.sum(1, keepdim=True)
    q[0] = p[0]  # p = q: F(a_1) = 0
    kids = torch.randint(0, v, (b, k), generator=g)
    f64 = torch.float64
    qx = q.gather(1, kids).to(f64)
    left = torch.cat([torch.ones(b, 1, dtype=f64), q.sum(1, dtype=f64)[:, None] - qx.cumsum(1)[:, :-1]],
                     1)[:, :k].clamp_(min=1e-300)
    ratio = torch.where(p > 0, p / q, 0.0)
    key, order = torch.sort(ratio.neg_(), dim=1)
    p_cum, q_cum = p.gather(1, order).cumsum(1, dtype=f64), q.gather(1, order).cumsum(1, dtype=f64)
    return (p.to(DEVICE), q.to(DEVICE), kids.to(DEVICE)), tuple(t.to(DEVICE) for t in (key, p_cum, q_cum, left))


@needs_triton
@pytest.mark.parametrize("b,v,k", [(5, 7, 3), (12, 50, 11), (8, 1000, 7), (6, 300, 40), (4, 3, 0), (3, 1, 2)])
def test_the_triton_kernel_gives_the_torch_recurrence(b, v, k):
    """Equal up to the rounding of a fused multiply-add (torch's ``addcmul`` and Triton may each fuse
    ``p + (-a) q``): 4e-15 at most over these rows; the searches agree (a wrong block would be off by whole
    masses), and a residual that empties keeps its last coefficient in both."""
    _, args = _rows(b, v, k, seed=b * 1000 + v)
    want = alphas_loop(*args)
    got = alphas_triton(*args)
    assert got.shape == (k + 1, 2, b)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-14)
    # row 0 (draft = target): the first rejection empties the residual (F(1) = 0 <= EMPTY), so every later
    # state is the first one, (-a, F) = (0, 1)
    start = torch.tensor([0.0, 1.0], dtype=torch.float64, device=DEVICE).expand(k + 1, 2)
    assert torch.equal(got[:, :, 0], start) and torch.equal(want[:, :, 0], start)
    assert EMPTY == 1e-12


@pytest.mark.parametrize("v", list(range(1, 70)) + [151_936])
def test_the_search_blocks_cover_every_key(v):
    coarse, step, fine = search_blocks(v)
    assert coarse * step >= v and step <= fine  # the blocks reach the last key; a block fits its load
    assert coarse & (coarse - 1) == 0 and fine & (fine - 1) == 0


def test_the_op_is_one_kernel_and_traces_whole():
    """``LaunchCounter`` counts the op as the one kernel CUDA launches (the torch ops it runs on the CPU are
    not counted: 6 a sibling position, 42 here); dynamo traces it without a graph break."""
    (p, q, kids), args = _rows(6, 40, 7, seed=3)
    with LaunchCounter() as launches:
        token_level_alphas(*args)
    assert dict(launches.by_op) == {"token_level_alphas": 1}
    with LaunchCounter() as launches:
        alphas_loop(*args)
    assert launches.kernels >= 6 * 7
    eager = token_level_tests(p, q, kids)
    traced = torch.compile(token_level_tests, fullgraph=True, dynamic=False, backend="eager")(p, q, kids)
    for a, b in zip(traced, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
