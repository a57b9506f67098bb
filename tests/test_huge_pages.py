"""Weights in 2 MiB pages (``quant/huge_pages.py``): a copy in a 2 MiB-aligned mapping advised MADV_HUGEPAGE,
the same values, the mapping released with the last tensor on it; GGMLLinear keeps its blocks there."""

from __future__ import annotations

import gc

import pytest
import torch

from dyntree_core.quant import huge_pages
from dyntree_core.quant.huge_pages import HUGE_PAGE, huge_pages_available, in_huge_pages

from test_ggml_kernels import nk  # noqa: F401 (a fixture)

needs_thp = pytest.mark.skipif(not huge_pages_available(), reason="no transparent huge pages (madvise) here")


def _mapping(addr: int) -> list[str] | None:
    """The /proc/self/smaps lines of the mapping holding ``addr`` (None: not mapped)."""
    lines, hit = [], False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if hit:
                break
            hit = lo <= addr < hi
        if hit:
            lines.append(line.strip())
    return lines or None


def test_the_setting_is_read_from_the_kernel_s_thp_switch(tmp_path):
    f = tmp_path / "enabled"
    for text, want in (("always [madvise] never", True), ("[always] madvise never", True),
                       ("always madvise [never]", False)):
        f.write_text(text + "\n")
        assert huge_pages_available(f) is (want and huge_pages_available())  # (and only on Linux)
    assert not huge_pages_available(tmp_path / "missing")


@needs_thp
def test_a_big_tensor_lands_in_an_advised_aligned_mapping_that_goes_with_it():
    t = torch.arange(3 * HUGE_PAGE // 4, dtype=torch.int32).view(-1, 1024)
    h = in_huge_pages(t)
    assert torch.equal(h, t) and h.dtype == t.dtype and h.shape == t.shape and h.data_ptr() != t.data_ptr()
    addr = h.data_ptr()
    assert addr % HUGE_PAGE == 0
    flags = next(line for line in _mapping(addr) if line.startswith("VmFlags:")).split()
    assert "hg" in flags  # advised MADV_HUGEPAGE (whether the kernel found free 2 MiB pages is its business)
    view = h[1:]  # a view keeps the mapping too
    del h
    gc.collect()
    assert _mapping(addr) is not None and int(view[0, 0]) == 1024
    del view
    gc.collect()
    assert _mapping(addr) is None  # unmapped with the last tensor on it


@needs_thp
def test_a_repack_writes_its_tiles_straight_into_an_advised_mapping_that_goes_with_them(nk, monkeypatch):
    """``huge_empty``: a buffer written once (an x8 repack) lands in 2 MiB pages, so ``GGMLLinear`` keeps the
    repack's own tensor (no second copy, 1.5 s of the target's load); the mapping goes with the last tensor on it.
    The repack reads the rows where they are: a read-only view of the file's mapping serves as well as a copy."""
    import numpy as np

    from dyntree_core.quant.ggml_linear import GGMLLinear
    from dyntree_core.quant.huge_pages import huge_empty
    from dyntree_core.quant.native import synthetic_blocks

    e = huge_empty((3, HUGE_PAGE), torch.uint8)
    addr = e.data_ptr()
    assert addr % HUGE_PAGE == 0 and e.shape == (3, HUGE_PAGE) and "hg" in next(
        line for line in _mapping(addr) if line.startswith("VmFlags:")).split()
    del e
    gc.collect()
    assert _mapping(addr) is None
    assert huge_empty((10,)).shape == (10,)  # (small: torch's own)
    n, k = 4096, 1024
    blocks = synthetic_blocks("Q4_K", n, k, seed=3)
    tiles = nk.repack_x8("Q4_K", blocks, n, k)
    assert tiles.data_ptr() % HUGE_PAGE == 0
    frozen = blocks.numpy().copy()
    frozen.setflags(write=False)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        mapped = torch.from_numpy(frozen)
    copies = []
    real_copy = huge_pages._copy_into
    monkeypatch.setattr(huge_pages, "_copy_into", lambda *a: copies.append(1) or real_copy(*a))
    layer = GGMLLinear("Q4_K", mapped, k, kernels=nk, int8_activations=True, x8=True)
    assert torch.equal(layer.blocks, tiles) and np.array_equal(frozen, blocks.numpy())
    assert copies == []  # the repack's tensor is kept as it is
    GGMLLinear("Q4_K", blocks, k, kernels=nk, int8_activations=True)  # (rows: copied into 2 MiB pages, as before)
    assert copies == [1]


def test_small_tensors_and_aligned_ones_stay_as_they_are(monkeypatch):
    small = torch.zeros(1000, dtype=torch.uint8)
    assert in_huge_pages(small) is small
    monkeypatch.setattr(huge_pages, "huge_pages_available", lambda: False)
    big = torch.zeros(HUGE_PAGE + 1, dtype=torch.uint8)
    assert in_huge_pages(big) is big


@needs_thp
def test_ggml_linear_keeps_its_blocks_in_huge_pages_and_a_tied_embedding_shares_them(nk):
    from dyntree_core.quant.ggml_embedding import block_embedding
    from dyntree_core.quant.ggml_linear import GGMLLinear
    from dyntree_core.quant.native import synthetic_blocks

    n, k = 4096, 1024  # Q4_K rows: 2.25 MiB
    blocks = synthetic_blocks("Q4_K", n, k, seed=2)
    x = torch.randn(3, k)
    for x8 in (False, True):
        layer = GGMLLinear("Q4_K", blocks, k, kernels=nk, int8_activations=True, x8=x8)
        assert layer.blocks.data_ptr() % HUGE_PAGE == 0
        plain = nk.matmul("Q4_K", x, nk.repack_x8("Q4_K", blocks, n, k) if x8 else blocks, n, k, None, True, x8=x8)
        assert torch.equal(layer(x), plain)
        emb = block_embedding("Q4_K", n, k, lambda: blocks, tied_head=layer)
        assert emb.blocks.data_ptr() == layer.blocks.data_ptr()


@needs_thp
def test_small_tensors_pack_side_by_side_into_one_advised_mapping_that_goes_with_the_last():
    from dyntree_core.quant.huge_pages import packed_in_huge_pages

    ts = [torch.arange(n, dtype=dt) for n, dt in ((1000, torch.int32), (77, torch.uint8), (5000, torch.float32))]
    got = packed_in_huge_pages(ts)
    assert all(torch.equal(g, t) and g.dtype == t.dtype and g.data_ptr() != t.data_ptr() for g, t in zip(got, ts))
    addrs = [g.data_ptr() for g in got]
    assert addrs[0] % HUGE_PAGE == 0 and all(a % 64 == 0 for a in addrs)
    assert addrs == sorted(addrs) and addrs[1] == addrs[0] + 4032 and addrs[2] == addrs[1] + 128  # in order, 64-byte steps
    maps = {tuple(_mapping(a)[:1]) for a in addrs}
    assert len(maps) == 1 and "hg" in next(x for x in _mapping(addrs[0]) if x.startswith("VmFlags:")).split()
    keep = got.pop()
    del got
    gc.collect()
    assert _mapping(addrs[0]) is not None  # one copy left holds the whole mapping
    del keep
    gc.collect()
    assert _mapping(addrs[0]) is None


def test_packing_leaves_tensors_where_the_os_has_no_huge_pages(monkeypatch):
    from dyntree_core.quant.huge_pages import packed_in_huge_pages

    monkeypatch.setattr(huge_pages, "huge_pages_available", lambda: False)
    ts = [torch.zeros(10), torch.ones(3)]
    assert all(a is b for a, b in zip(packed_in_huge_pages(ts), ts))


@needs_thp
def test_a_model_s_small_blocks_move_into_one_mapping_with_the_same_outputs_and_shared_blocks_stay_shared(nk):
    from torch import nn

    from dyntree_core.quant.ggml_embedding import block_embedding
    from dyntree_core.quant.ggml_linear import GGMLLinear, pack_small_blocks
    from dyntree_core.quant.native import synthetic_blocks

    k = 256
    small = [GGMLLinear("Q4_K", synthetic_blocks("Q4_K", n, k, seed=n), k, kernels=nk, int8_activations=True)
             for n in (64, 32)]
    big = GGMLLinear("Q4_K", synthetic_blocks("Q4_K", 16384, k, seed=1), k, kernels=nk, int8_activations=True)
    twin = GGMLLinear("Q4_K", small[0].blocks, k, kernels=nk, int8_activations=True)  # shares small[0]'s blocks
    emb = block_embedding("Q4_K", 32, k, lambda: small[1].blocks, tied_head=small[1])
    model = nn.ModuleList([*small, big, twin, emb])
    x = torch.randn(3, k)
    ids = torch.tensor([[0, 5, 31]])
    before = [m(x) for m in model[:4]] + [emb(ids)]
    big_at = big.blocks.data_ptr()
    moved = pack_small_blocks(model)
    assert moved == sum(m.blocks.numel() for m in small)  # the shared block counted once
    assert big.blocks.data_ptr() == big_at and big_at % HUGE_PAGE == 0  # (already in its own mapping)
    assert twin.blocks.data_ptr() == small[0].blocks.data_ptr()  # still shared, moved once
    assert small[0].blocks.data_ptr() % HUGE_PAGE == 0
    assert small[1].blocks.data_ptr() == small[0].blocks.data_ptr() + small[0].blocks.numel()  # (64-byte multiple)
    assert emb.blocks.data_ptr() == small[1].blocks.data_ptr()  # the tied embedding follows its head
    assert all(torch.equal(m(x), b) for m, b in zip(model[:4], before)) and torch.equal(emb(ids), before[4])
    assert pack_small_blocks(nn.ModuleList([nn.Linear(2, 2)])) == 0
