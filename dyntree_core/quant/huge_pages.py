"""Weight buffers in 2 MiB pages: a copy of a tensor in a private anonymous mapping advised ``MADV_HUGEPAGE``.

A forward at one row streams every weight from DRAM once; in 4 KiB pages that is a page walk per 4 KiB and a
hardware prefetcher that stops at each page's end. Linux's transparent huge pages in ``madvise`` mode (the
setting of the VMs we measure on) give 2 MiB pages only to memory advised so, which torch's allocator never
does; llama.cpp's ``mmap`` of the GGUF sits in the page cache's huge folios. Measured on a 2-core Zen 4 (x8
products, weights from DRAM, one process alternating the two copies): Q4_K [8960, 1536] at one row 0.262 ->
0.181 ms, the Q6_K head [151936, 1536] 4.48 -> 3.25 ms; at 16 rows 0.773 -> 0.718 ms.

The mapping lives as long as the tensor: ``torch.frombuffer`` holds the ``mmap`` object, which unmaps when the
last tensor on it goes (``tests/test_huge_pages.py``). Blocks under 2 MiB (the target's q/k/v and o, 95 MB) go
side by side into one such mapping (``packed_in_huge_pages``, through ``ggml_linear.pack_small_blocks`` at load).
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from pathlib import Path
from typing import Sequence

import torch

HUGE_PAGE = 2 << 20
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available(setting: Path = THP_SETTING) -> bool:
    """Whether this OS gives 2 MiB pages to memory advised ``MADV_HUGEPAGE`` (Linux, THP ``always`` or
    ``madvise``)."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        text = setting.read_text()
    except OSError:
        return False
    return "[always]" in text or "[madvise]" in text


def _huge_mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping with ``nbytes`` from a 2 MiB boundary on, advised ``MADV_HUGEPAGE``, and that
    boundary's offset in it."""
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    probe = ctypes.c_char.from_buffer(m)
    start = (-ctypes.addressof(probe)) % HUGE_PAGE
    del probe  # (an exported buffer would keep the mapping from ever closing)
    m.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    return m, start


def _tensor_on(m: mmap.mmap, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A ``shape`` / ``dtype`` tensor on ``m``'s bytes from ``offset`` on (it holds ``m``)."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    return torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype).view(tuple(shape))


def _copy_into(m: mmap.mmap, offset: int, t: torch.Tensor) -> torch.Tensor:
    return _tensor_on(m, offset, t.shape, t.dtype).copy_(t)


def huge_empty(shape: Sequence[int], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """An uninitialized CPU tensor in 2 MiB pages (``torch.empty`` where it is smaller than a huge page or the OS
    has none): for a buffer written once, e.g. by a repack, that ``in_huge_pages`` would otherwise copy."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if nbytes < HUGE_PAGE or not huge_pages_available():
        return torch.empty(tuple(shape), dtype=dtype)
    m, start = _huge_mapping(nbytes)
    return _tensor_on(m, start, shape, dtype)


def in_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied into a 2 MiB-aligned private mapping advised ``MADV_HUGEPAGE`` (same dtype, shape and
    values; contiguous); ``t`` itself where it is not on the CPU, smaller than a huge page, already at a huge
    page's start, or where the OS has no such pages (``huge_pages_available``)."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or nbytes < HUGE_PAGE or t.data_ptr() % HUGE_PAGE == 0 or not huge_pages_available():
        return t
    m, start = _huge_mapping(nbytes)
    return _copy_into(m, start, t)


def packed_in_huge_pages(tensors: Sequence[torch.Tensor], align: int = 64) -> list[torch.Tensor]:
    """Copies of ``tensors`` side by side, in order, each at an ``align``-byte boundary, in one mapping of 2 MiB
    pages (same dtypes, shapes and values; contiguous): for many tensors under 2 MiB each, which
    ``in_huge_pages`` leaves in 4 KiB pages. ``tensors`` themselves (as a list) where one is not on the CPU or
    the OS has no such pages. The mapping goes when the last of the copies does."""
    tensors = list(tensors)
    if not tensors or any(t.device.type != "cpu" for t in tensors) or not huge_pages_available():
        return tensors
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end += -(-t.numel() * t.element_size() // align) * align
    m, start = _huge_mapping(end)
    return [_copy_into(m, start + off, t) for off, t in zip(offsets, tensors)]
