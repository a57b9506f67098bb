"""The app process's memory, for the page footer (Linux ``/proc``; elsewhere nothing is shown)."""

from __future__ import annotations

from typing import Optional

from dyntree_core.machine import available_memory
from dyntree_core.process_memory import ProcessMemory, process_memory


def memory_line(now: Optional[ProcessMemory] = None) -> str:
    """``"app memory 3.4 GB (peak 5.5 GB) · 17.9 GB available on this machine"`` (empty where ``/proc`` is
    missing)."""
    now = process_memory() if now is None else now
    if now is None:
        return ""
    text = f"app {now.text()}"
    avail = available_memory()
    return text + (f" · {avail / 1e9:.1f} GB available on this machine" if avail is not None else "")
