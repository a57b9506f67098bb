"""Weight buffers in 2 MiB pages: a copy of a tensor in a private anonymous mapping advised ``MADV_HUGEPAGE``.

A forward at one row streams every weight from DRAM once; in 4 KiB pages that is a page walk per 4 KiB and a
hardware prefetcher that stops at each page's end. Linux's transparent huge pages in ``madvise`` mode (the
setting of the VMs we measure on) give 2 MiB pages only to memory advised so, which torch's allocator never
does; llama.cpp's ``mmap`` of the GGUF sits in the page cache's huge folios. Measured on a 2-core Zen 4 (x8
products, weights from DRAM, one process alternating the two copies): Q4_K [8960, 1536] at one row 0.262 ->
0.181 ms, the Q6_K head [151936, 1536] 4.48 -> 3.25 ms; at 16 rows 0.773 -> 0.718 ms.

The mapping lives as long as the tensor: ``torch.frombuffer`` holds the ``mmap`` object, which unmaps when the
last tensor on it goes (``tests/test_huge_pages.py``).
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from pathlib import Path

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


def in_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied into a 2 MiB-aligned private mapping advised ``MADV_HUGEPAGE`` (same dtype, shape and
    values; contiguous); ``t`` itself where it is not on the CPU, smaller than a huge page, already at a huge
    page's start, or where the OS has no such pages (``huge_pages_available``)."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or nbytes < HUGE_PAGE or t.data_ptr() % HUGE_PAGE == 0 or not huge_pages_available():
        return t
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    probe = ctypes.c_char.from_buffer(m)
    start = (-ctypes.addressof(probe)) % HUGE_PAGE
    del probe  # (an exported buffer would keep the mapping from ever closing)
    m.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    out = torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=start)
    out.copy_(t.contiguous().reshape(-1).view(torch.uint8))
    return out.view(t.dtype).view(t.shape)
