"""This process's memory: its resident and peak sizes (``/proc/self/status``) and handing freed heap back to the
OS.

Freed tensors go back to the C allocator, not always to the OS: glibc keeps freed chunks below its mmap threshold
(which grows to 32 MiB after a big free) in its heaps, and a thread's heap is returned only from its top. After a
model is dropped ``release_freed_memory`` asks glibc to return every free page (``malloc_trim(0)``); where that
is not glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

STATUS_PATH = Path("/proc/self/status")


@dataclass(frozen=True)
class ProcessMemory:
    """Resident bytes now (``VmRSS``) and the peak since the process started (``VmHWM``)."""

    rss: int
    peak: int

    def text(self) -> str:
        return f"memory {self.rss / 1e9:.1f} GB (peak {self.peak / 1e9:.1f} GB)"


def parse_status(text: str) -> Optional[ProcessMemory]:
    """``ProcessMemory`` from the text of ``/proc/<pid>/status`` (None when a field is missing)."""
    fields: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
                fields[key] = int(parts[0]) * 1024
    if len(fields) != 2:
        return None
    return ProcessMemory(fields["VmRSS"], fields["VmHWM"])


def process_memory() -> Optional[ProcessMemory]:
    """This process's ``ProcessMemory`` (None where ``/proc`` has none)."""
    try:
        return parse_status(STATUS_PATH.read_text(errors="replace"))
    except OSError:
        return None


def memory_budget() -> int:
    """Bytes this process may hold at its peak (``DYNTREE_MEMORY_BUDGET_GB``, default 8): a measurement that would
    load more than what is left of it is not made."""
    try:
        return int(float(os.environ.get("DYNTREE_MEMORY_BUDGET_GB", "8")) * 1e9)
    except ValueError:
        return int(8e9)


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim`` (None where the C library has none)."""
    name = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None


def release_freed_memory() -> bool:
    """Collect garbage, then hand the C heap's free pages back to the OS (glibc's ``malloc_trim``); True if glibc
    did so."""
    gc.collect()
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
