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
