"""What machine a number was measured on.

``machine_info()`` describes the host a benchmark runs on: the CPU model and the SIMD / matrix
extensions that decide which CPU kernels torch can use (AVX2, AVX-512, AVX-512 BF16, AMX), the
CPUs this process may run on, torch's thread count, the software versions, the GPU, if any, and the
host's CPU signature (family, model, stepping, microcode, cache, clock: ``parse_cpu_signature``).
Every benchmark JSON writer stores ``machine_info().to_dict()`` under ``"machine_info"`` so a
latency can always be traced back to its hardware class, and ``short_label()`` gives a
filename-safe label (``cpu-avx2``, ``cpu-amx``, ``cuda-h100``) for result file names.

The parser of ``/proc/cpuinfo`` is the pure function ``parse_cpuinfo`` so it can be tested on
canned text; on systems without ``/proc/cpuinfo`` the model comes from ``platform`` and the flag
set is empty (class ``"other"``). ``available_memory()`` reads ``MemAvailable`` from ``/proc/meminfo``
(its parser, ``parse_meminfo_available``, is pure too).

A leaf module: it imports nothing of the project, so every package may ask what machine it runs on.
"""

from __future__ import annotations

import functools
import os
import platform
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

#: CPU flags recorded (the subset present is kept, in this order)
CPU_FLAGS: tuple[str, ...] = (
    "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
    "amx_tile", "amx_bf16", "amx_int8", "avx_vnni",
)

CPUINFO_PATH = Path("/proc/cpuinfo")
MEMINFO_PATH = Path("/proc/meminfo")


def _first_values(text: str) -> dict[str, str]:
    """Each ``key : value`` line's key (lower case) and its first non-empty value (spaces collapsed)."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key, value = key.strip().lower(), " ".join(value.split())
        if sep and value and key not in found:
            found[key] = value
    return found


def parse_cpuinfo(text: str) -> tuple[Optional[str], tuple[str, ...]]:
    """``(model, flags)`` from the text of ``/proc/cpuinfo``.

    ``model`` is the first ``model name`` value (None when absent); ``flags`` is the subset of
    ``CPU_FLAGS`` present in the first ``flags`` line (``Features`` on ARM), in ``CPU_FLAGS`` order.
    """
    found = _first_values(text)
    present = set((found.get("flags") or found.get("features") or "").split())
    return found.get("model name"), tuple(f for f in CPU_FLAGS if f in present)


#: ``/proc/cpuinfo`` fields of the first CPU that tell hosts with one ``model name`` apart (virtual machines often
#: say only "AMD EPYC"), in this order
SIGNATURE_FIELDS: tuple[tuple[str, str], ...] = (
    ("vendor_id", ""), ("cpu family", "family"), ("model", "model"), ("stepping", "stepping"),
    ("microcode", "microcode"), ("cache size", "cache"), ("cpu mhz", "MHz"),
)


def parse_cpu_signature(text: str) -> str:
    """The first CPU's identity beyond its model name from the text of ``/proc/cpuinfo``:
    ``"AuthenticAMD family 25 model 1 stepping 1 microcode 0x1000065 cache 512 KB MHz 2445"`` ('' when none
    of ``SIGNATURE_FIELDS`` is there, e.g. on ARM). Two runs on one ``cpu_model`` whose signatures differ ran
    on different hosts (seen: a 2-core "AMD EPYC" VM whose llama.cpp pp16 took 288 ms one day, 450 the next)."""
    found = _first_values(text.split("\n\n", 1)[0])
    parts = []
    for key, label in SIGNATURE_FIELDS:
        value = found.get(key)
        if not value:
            continue
        if key == "cpu mhz":
            try:
                value = f"{float(value):.0f}"
            except ValueError:
                continue
        parts.append(f"{label} {value}" if label else value)
    return " ".join(parts)


def cpu_class(flags: tuple[str, ...] | list[str] | set[str]) -> str:
    """The CPU's kernel class: ``amx`` > ``avx512_bf16`` > ``avx512`` > ``avx2`` > ``other``."""
    fs = set(flags)
    if "amx_bf16" in fs:
        return "amx"
    if "avx512_bf16" in fs:
        return "avx512_bf16"
    if "avx512f" in fs:
        return "avx512"
    if "avx2" in fs:
        return "avx2"
    return "other"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def gpu_short_name(name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"h100"``; other names are slugified whole."""
    m = re.search(r"\b([A-Z]{1,3}\d{1,4}[A-Z]?)\b", name.replace("NVIDIA", "").replace("GeForce", ""))
    return m.group(1).lower() if m else (_slug(name) or "gpu")


@dataclass(frozen=True)
class MachineInfo:
    """The machine a measurement was taken on (see the module docstring)."""

    cpu_model: str
    cpu_flags: tuple[str, ...]
    cpu_class: str
    logical_cpus: int
    torch_threads: int
    torch: str
    python: str
    platform: str
    gpu: Optional[str]
    #: ``parse_cpu_signature``: which host, where ``cpu_model`` is generic (recorded, not part of cache keys)
    cpu_signature: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (flags as a list)."""
        d = asdict(self)
        d["cpu_flags"] = list(self.cpu_flags)
        return d

    def short_label(self) -> str:
        """A filename-safe label: ``cuda-h100`` with a GPU, else ``cpu-<cpu_class>`` (``cpu-avx2``)."""
        if self.gpu:
            return "cuda-" + gpu_short_name(self.gpu)
        return "cpu-" + re.sub(r"[^a-z0-9_]+", "-", self.cpu_class.lower()).strip("-")


def _logical_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def parse_meminfo_available(text: str) -> Optional[int]:
    """``MemAvailable`` in bytes from the text of ``/proc/meminfo`` (None when absent or unreadable)."""
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            try:
                return int(line.split()[1]) * 1024
            except (ValueError, IndexError):
                return None
    return None


def available_memory() -> Optional[int]:
    """The memory available to new work on this machine, in bytes (None where ``/proc/meminfo`` is missing)."""
    try:
        return parse_meminfo_available(MEMINFO_PATH.read_text(errors="replace"))
    except OSError:
        return None


def _read_cpuinfo() -> str:
    try:
        return CPUINFO_PATH.read_text(errors="replace")
    except OSError:
        return ""


@functools.lru_cache(maxsize=1)
def machine_info() -> MachineInfo:
    """This machine's ``MachineInfo`` (computed once per process; torch's thread count is the one
    in effect at the first call)."""
    import torch

    text = _read_cpuinfo() if sys.platform.startswith("linux") else ""
    model, flags = parse_cpuinfo(text)
    model = model or platform.processor() or platform.machine() or "unknown"
    gpu = None
    try:
        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name()
    except Exception:  # noqa: BLE001 - a broken driver must not break a benchmark's bookkeeping
        gpu = None
    return MachineInfo(
        cpu_model=model, cpu_flags=flags, cpu_class=cpu_class(flags), logical_cpus=_logical_cpus(),
        torch_threads=torch.get_num_threads(), torch=torch.__version__, python=platform.python_version(),
        platform=platform.platform(), gpu=gpu, cpu_signature=parse_cpu_signature(text),
    )
