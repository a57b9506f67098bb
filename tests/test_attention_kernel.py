"""Triton tree-attention kernel vs the vLLM-style per-node path oracle, on ``DEVICE``: the compiled
kernel on a CUDA machine, the Triton interpreter on the CPU (tests/conftest.py chooses)."""

import pytest
import torch
from conftest import DEVICE

from dyntree_core.attention import (
    attention_mask_4d,
    default_block_q,
    interpreting,
    meta_from_mask,
    meta_from_tree,
    path_oracle,
    sdpa_reference,
    tree_attention,
    triton_tree_attention,
)
from dyntree_core.attention.mask import BlockLists
from dyntree_core.attention.trees import chain, dyspec_like_tree, skewed, star, uniform_random_tree
from dyntree_core.attention.triton_kernel import HAS_TRITON, interpreter_usable

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="Triton not installed")

FLOOR = 1e-5  # absolute floor on top of the FlashAttention "2x the reference's own error" rule
BLOCK_N = 16
BLOCK_M = 32

SHAPES = {
    # name: (tree, prefix_len, q heads, kv heads)
    "chain": (chain(24), 40, 2, 2),
    "star": (star(20), 9, 4, 2),
    "random": (uniform_random_tree(45, seed=3), 17, 2, 2),
    "skewed": (skewed(40), 37, 4, 2),
    "dyspec": (dyspec_like_tree(48, seed=1), 0, 4, 2),
}


def _inputs(tree, prefix, hq, hkv, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(hq, tree.size, d, generator=gen).to(DEVICE, dtype)
    k = torch.randn(hkv, prefix + tree.size, d, generator=gen).to(DEVICE, dtype)
    v = torch.randn(hkv, prefix + tree.size, d, generator=gen).to(DEVICE, dtype)
    return q, k, v


def _randn(*shape, gen):
    return torch.randn(*shape, generator=gen).to(DEVICE)


def _check_against_oracle(q, k, v, tree, prefix, order, out):
    """FlashAttention rule: kernel error <= 2 x (same reference in the low dtype) + floor."""
    oracle = path_oracle(q, k, v, tree, prefix, order)  # fp32, no mask involved
    mask = attention_mask_4d(tree, prefix, order, device=DEVICE)[0, 0]
    low = sdpa_reference(q, k, v, mask, dtype=None).float()
    err = (out.float() - oracle).abs().max().item()
    ref_err = (low - oracle).abs().max().item()
    assert err <= 2 * ref_err + FLOOR, f"kernel err {err:.3e} > 2 x reference err {ref_err:.3e} + {FLOOR}"


def _poisoned(hq, n, d, dtype):
    return torch.full((hq, n, d), float("nan"), dtype=dtype, device=DEVICE)


def test_the_kernel_is_compiled_on_cuda_and_interpreted_only_without_it():
    """On a GPU machine the suite must run the compiled kernel on CUDA tensors (on the H200 every
    kernel test ran through the interpreter on CPU tensors); without CUDA the interpreter must be
    usable (chosen before Triton was imported)."""
    assert interpreting() == (DEVICE.type == "cpu")
    assert interpreter_usable(), "Triton was imported before TRITON_INTERPRET=1; set it in tests/conftest.py"
    tree = chain(5)
    q, k, v = _inputs(tree, 3, 2, 2, 16, torch.float32)
    out = triton_tree_attention(q, k, v, meta_from_tree(tree, 3, "dfs", 16, 16, device=DEVICE))
    assert out.device.type == DEVICE.type


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("order", ["bfs", "dfs"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernel_matches_path_oracle(shape, order, dtype):
    tree, prefix, hq, hkv = SHAPES[shape]
    q, k, v = _inputs(tree, prefix, hq, hkv, 64, dtype)
    # dfs: interval (subtree_end) form; bfs: the mask tensor for partial blocks.
    meta = meta_from_tree(tree, prefix, order, default_block_q(hq // hkv, BLOCK_M), BLOCK_N, interval=order == "dfs",
                          device=DEVICE)
    out = _poisoned(hq, tree.size, 64, dtype)
    triton_tree_attention(q, k, v, meta, out=out)
    assert not out.isnan().any(), "some output element was not written"
    _check_against_oracle(q, k, v, tree, prefix, order, out)


def test_head_dim_128_hpd_order():
    tree = dyspec_like_tree(33, seed=5)
    q, k, v = _inputs(tree, 21, 4, 2, 128, torch.float16, seed=1)
    meta = meta_from_tree(tree, 21, "hpd", default_block_q(2, BLOCK_M), BLOCK_N, device=DEVICE)
    out = _poisoned(4, tree.size, 128, torch.float16)
    triton_tree_attention(q, k, v, meta, out=out)
    assert not out.isnan().any()
    _check_against_oracle(q, k, v, tree, 21, "hpd", out)


def test_non_power_of_two_group_and_mask_mode_dfs():
    """G = 3 (BLOCK_Q = BLOCK_M // 3 is not a power of two); DFS tree through the mask path."""
    tree = uniform_random_tree(30, seed=7)
    q, k, v = _inputs(tree, 13, 6, 2, 64, torch.float32, seed=2)
    meta = meta_from_tree(tree, 13, "dfs", default_block_q(3, BLOCK_M), BLOCK_N, interval=False, device=DEVICE)
    assert meta.end is None and meta.blocks.block_q == 10
    out = _poisoned(6, tree.size, 64, torch.float32)
    triton_tree_attention(q, k, v, meta, out=out)
    assert not out.isnan().any()
    _check_against_oracle(q, k, v, tree, 13, "dfs", out)


def test_generic_mask_with_dead_padding_rows():
    """Mask-derived metadata: fully masked (padding) rows give 0, never NaN; others match SDPA."""
    tree = skewed(21)
    prefix = 11
    full = attention_mask_4d(tree, prefix, "dfs", device=DEVICE)[0, 0]
    pad = 5  # padding query rows that see nothing at all
    mask = torch.cat([full, torch.zeros(pad, full.shape[1], dtype=torch.bool, device=DEVICE)], dim=0)
    mask = torch.cat([mask, torch.zeros(mask.shape[0], pad, dtype=torch.bool, device=DEVICE)], dim=1)
    mask[tree.size :, :prefix] = False
    n = tree.size + pad
    gen = torch.Generator().manual_seed(4)
    q, k, v = _randn(4, n, 64, gen=gen), _randn(2, prefix + n, 64, gen=gen), _randn(2, prefix + n, 64, gen=gen)
    meta = meta_from_mask(mask, default_block_q(2, BLOCK_M), BLOCK_N)
    assert meta.prefix_len == prefix + 1  # the root column is visible to every live row
    out = _poisoned(4, n, 64, torch.float32)
    triton_tree_attention(q, k, v, meta, out=out)
    assert not out.isnan().any()
    assert torch.equal(out[:, tree.size :], torch.zeros_like(out[:, tree.size :]))
    ref = sdpa_reference(q, k, v, mask)
    assert (out - ref).abs().max().item() <= 1e-5


def test_kernel_dead_rows_without_fixup():
    """A row whose only visible keys are in a skipped region gets 0 from the kernel itself."""
    mask = torch.zeros(3, 20, dtype=torch.bool, device=DEVICE)
    mask[0, :5] = True
    mask[2, 3] = True  # row 1 sees nothing
    meta = meta_from_mask(mask, 16, 16)
    meta.dead_rows = None  # rely on the kernel's l == 0 guard only
    gen = torch.Generator().manual_seed(0)
    q, k, v = _randn(2, 3, 64, gen=gen), _randn(2, 20, 64, gen=gen), _randn(2, 20, 64, gen=gen)
    out = triton_tree_attention(q, k, v, meta)
    assert not out.isnan().any()
    assert torch.equal(out[:, 1], torch.zeros_like(out[:, 1]))
    assert (out - sdpa_reference(q, k, v, mask)).abs().max().item() <= 1e-5


def test_oracle_catches_a_dropped_block():
    """Negative control: removing one listed partial block must make the oracle check fail."""
    tree, prefix, hq, hkv = SHAPES["skewed"]
    q, k, v = _inputs(tree, prefix, hq, hkv, 64, torch.float32)
    meta = meta_from_tree(tree, prefix, "dfs", default_block_q(2, BLOCK_M), BLOCK_N, device=DEVICE)
    b = meta.blocks
    assert int(b.part_cnt[1]) > 0
    part_cnt = b.part_cnt.clone()
    part_cnt[1] -= 1
    meta.blocks = BlockLists(b.full_cnt, b.full_idx, part_cnt, b.part_idx, b.block_q, b.block_n, b.n_q, b.width)
    out = triton_tree_attention(q, k, v, meta)
    with pytest.raises(AssertionError):
        _check_against_oracle(q, k, v, tree, prefix, "dfs", out)


def test_torch_fallback_matches_oracle():
    tree, prefix, hq, hkv = SHAPES["random"]
    q, k, v = _inputs(tree, prefix, hq, hkv, 64, torch.float32)
    for order, interval in (("bfs", False), ("dfs", True)):
        meta = meta_from_tree(tree, prefix, order, 16, 16, interval=interval, device=DEVICE)
        out = tree_attention(q, k, v, meta, backend="torch")
        _check_against_oracle(q, k, v, tree, prefix, order, out)


@pytest.mark.parametrize("prefix_block_n", [16, 64])
@pytest.mark.parametrize("shape", ["chain", "skewed", "random"])
def test_wider_prefix_tiles_match_the_oracle(shape, prefix_block_n):
    """The dense prefix loop with its own tile width (prefixes 40, 37, 17: none a multiple of 64)."""
    tree, prefix, hq, hkv = SHAPES[shape]
    q, k, v = _inputs(tree, prefix, hq, hkv, 64, torch.float16, seed=3)
    meta = meta_from_tree(tree, prefix, "dfs", default_block_q(hq // hkv, BLOCK_M), BLOCK_N, device=DEVICE)
    out = _poisoned(hq, tree.size, 64, torch.float16)
    triton_tree_attention(q, k, v, meta, out=out, prefix_block_n=prefix_block_n)
    assert not out.isnan().any()
    _check_against_oracle(q, k, v, tree, prefix, "dfs", out)
    with pytest.raises(ValueError, match="prefix_block_n"):
        triton_tree_attention(q, k, v, meta, prefix_block_n=48)
