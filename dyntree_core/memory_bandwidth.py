"""How fast this process reads memory, and how much of it the caches hold: what a one-row matmul of weights beyond
every cache cannot beat (``read_gb_per_s``, ``largest_cache_bytes``)."""

from __future__ import annotations

import math
import re
import time
from pathlib import Path
from typing import Optional

import torch

SYS_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


def read_gb_per_s(nbytes: int = 1 << 29, samples: int = 5, buffer: Optional[torch.Tensor] = None) -> float:
    """This process's read bandwidth from memory (GB/s): the fastest of ``samples`` sums of an ``nbytes`` float32
    buffer (bigger than any cache), on torch's threads. ``buffer``: a float32 tensor to sum instead (its size
    counts; a caller that probes often keeps one rather than allocate and fault in ``nbytes`` each time)."""
    x = buffer if buffer is not None else torch.ones(nbytes // 4)
    nbytes = x.numel() * x.element_size()
    if buffer is None:
        x.sum()  # (a fresh allocation: its first pass)
    best = math.inf
    for _ in range(samples):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def parse_cache_size(text: str) -> Optional[int]:
    """Bytes of a sysfs cache ``size`` (``"32768K"``, ``"1M"``, ``"512"``); None when unreadable."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)\s*", text)
    if not m:
        return None
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]


def largest_cache_bytes(root: Path = SYS_CACHES) -> Optional[int]:
    """The largest data or unified cache CPU 0 reports (its last level), None where sysfs does not say."""
    sizes = []
    for d in root.glob("index*"):
        try:
            if (d / "type").read_text().strip() == "Instruction":
                continue
            sizes.append(parse_cache_size((d / "size").read_text()))
        except OSError:
            continue
    return max((s for s in sizes if s), default=None)
