"""What the system spent on a stretch of this process's work, from the kernel's counters: the process's CPU time,
the bytes it had read from the disk, its major page faults, and, machine-wide, the memory compaction stalls, the
transparent huge pages that fell back to 4 KiB pages, and the CPU time a VM's host took (steal).

A first Run's load that takes 40 s where it usually takes 7 says through these which it waited for: the disk (bytes
read, major faults), the kernel assembling 2 MiB pages for the weights (``quant.huge_pages``; compaction stalls), the
host or other processes (steal, and process CPU well under the wall time). Where a counter cannot be read (not Linux,
a restricted ``/proc``) it is None and left out of the text.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

PROC = Path("/proc")


@dataclass(frozen=True)
class SystemCounters:
    """The counters at one moment (``read_counters``)."""

    wall_s: float  # time.monotonic()
    cpu_s: float  # this process's user + system CPU seconds, all threads
    major_faults: int  # this process's page faults that read the disk
    read_bytes: Optional[int]  # bytes this process caused to be read from storage (/proc/self/io)
    compact_stalls: Optional[int]  # machine-wide: allocations that waited for memory compaction (/proc/vmstat)
    thp_fallbacks: Optional[int]  # machine-wide: huge-page faults served with 4 KiB pages instead
    steal_s: Optional[float]  # machine-wide: CPU seconds the hypervisor ran others on this VM's CPUs (/proc/stat)


@dataclass(frozen=True)
class SystemSpent:
    """What went by between two ``SystemCounters`` (``spent``)."""

    wall_s: float
    cpu_s: float
    major_faults: int
    read_bytes: Optional[int]
    compact_stalls: Optional[int]
    thp_fallbacks: Optional[int]
    steal_s: Optional[float]

    def text(self) -> str:
        """E.g. ``9.4 s; process CPU 9.1 s; read from disk 1.3 GB (412 major faults); compaction stalls 0; huge-page
        fallbacks 0; CPU steal 0.0 s``."""
        parts = [f"{self.wall_s:.1f} s", f"process CPU {self.cpu_s:.1f} s"]
        if self.read_bytes is not None:
            parts.append(f"read from disk {self.read_bytes / 1e9:.2f} GB ({self.major_faults} major faults)")
        else:
            parts.append(f"{self.major_faults} major faults")
        if self.compact_stalls is not None:
            parts.append(f"compaction stalls {self.compact_stalls}")
        if self.thp_fallbacks is not None:
            parts.append(f"huge-page fallbacks {self.thp_fallbacks}")
        if self.steal_s is not None:
            parts.append(f"CPU steal {self.steal_s:.1f} s")
        return "; ".join(parts)


def parse_io(text: str) -> Optional[int]:
    """``read_bytes`` of a ``/proc/<pid>/io`` text (None when absent)."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "read_bytes":
            return int(value)
    return None


def parse_vmstat(text: str, key: str) -> Optional[int]:
    """One counter of a ``/proc/vmstat`` text (None when absent)."""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return None


def parse_steal(text: str, ticks_per_s: float) -> Optional[float]:
    """The steal seconds of all CPUs from a ``/proc/stat`` text: the eighth number of its ``cpu`` line."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            return int(fields[8]) / ticks_per_s if len(fields) > 8 else None
    return None


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text()
    except OSError:
        return None


def read_counters(proc: Path = PROC) -> SystemCounters:
    """The counters now."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    io, vmstat, stat = _read(proc / "self" / "io"), _read(proc / "vmstat"), _read(proc / "stat")
    try:
        ticks = float(os.sysconf("SC_CLK_TCK"))
    except (ValueError, OSError):
        ticks = 100.0
    return SystemCounters(
        wall_s=time.monotonic(),
        cpu_s=usage.ru_utime + usage.ru_stime,
        major_faults=int(usage.ru_majflt),
        read_bytes=None if io is None else parse_io(io),
        compact_stalls=None if vmstat is None else parse_vmstat(vmstat, "compact_stall"),
        thp_fallbacks=None if vmstat is None else parse_vmstat(vmstat, "thp_fault_fallback"),
        steal_s=None if stat is None else parse_steal(stat, ticks),
    )


def _delta(a, b):
    return None if a is None or b is None else b - a


def spent(before: SystemCounters, after: SystemCounters) -> SystemSpent:
    """What went by from ``before`` to ``after``: each counter's difference (None where either was not read)."""
    return SystemSpent(**{f.name: _delta(getattr(before, f.name), getattr(after, f.name))
                          for f in fields(SystemCounters)})
