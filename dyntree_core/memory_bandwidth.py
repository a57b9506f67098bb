"""How fast this process reads memory, and how much of it the caches hold: what a one-row matmul of weights beyond
every cache cannot beat (``probe_read``, ``largest_cache_bytes``). A read during which tasks waited for a CPU
(``cpu_wait_us``) measured the CPUs' contention, not the memory: ``probe_read`` says so."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import Optional

import torch

SYS_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
PSI_CPU = Path("/proc/pressure/cpu")
#: a sum during which tasks waited for a CPU longer than this share of its time read the CPUs' contention
CONTENDED_SHARE = 0.05


def cpu_wait_us(path: Path = PSI_CPU) -> Optional[int]:
    """Microseconds some task of this machine has waited for a CPU since boot (the kernel's pressure stall
    information, ``some total``); None where the kernel does not keep it."""
    try:
        m = re.search(r"^some .*total=(\d+)", path.read_text(), re.M)
    except OSError:
        return None
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class ReadProbe:
    """A read-bandwidth probe: ``gb_per_s`` the fastest sample whose tasks did not wait for a CPU (the fastest of
    all when each did: then ``contended``, and the number is the CPUs' contention, not the memory's)."""

    gb_per_s: float
    contended: bool = False


def probe_read(nbytes: int = 1 << 29, samples: int = 5, buffer: Optional[torch.Tensor] = None) -> ReadProbe:
    """This process's read bandwidth from memory (GB/s): the fastest of ``samples`` sums of an ``nbytes`` float32
    buffer (bigger than any cache), on torch's threads, counting only sums during which tasks waited for a CPU less
    than ``CONTENDED_SHARE`` of the sum's time (``cpu_wait_us``; every sum where the kernel does not say). On the
    2-core Zen 4 VM a process spinning on one core halves the read (17 against 30 GB/s) while tasks wait half of
    each sum. ``buffer``: a float32 tensor to sum instead (its size counts; a caller that probes often keeps one
    rather than allocate and fault in ``nbytes`` each time)."""
    x = buffer if buffer is not None else torch.ones(nbytes // 4)
    nbytes = x.numel() * x.element_size()
    if buffer is None:
        x.sum()  # (a fresh allocation: its first pass)
    clean, best = math.inf, math.inf
    for _ in range(samples):
        w0, t0 = cpu_wait_us(), perf_counter()
        x.sum()
        dt, w1 = perf_counter() - t0, cpu_wait_us()
        best = min(best, dt)
        if w0 is None or w1 is None or (w1 - w0) * 1e-6 <= CONTENDED_SHARE * dt:
            clean = min(clean, dt)
    return ReadProbe(nbytes / (clean if clean < math.inf else best) / 1e9, contended=clean == math.inf)


def read_gb_per_s(nbytes: int = 1 << 29, samples: int = 5, buffer: Optional[torch.Tensor] = None) -> float:
    """``probe_read``'s GB/s (contended or not)."""
    return probe_read(nbytes, samples, buffer).gb_per_s


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
