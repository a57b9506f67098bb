"""The app process's memory, for the page footer (Linux ``/proc``; elsewhere nothing is shown)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from dyntree_core.machine import available_memory


def process_rss() -> Optional[int]:
    """This process's resident memory in bytes (None where ``/proc`` is missing)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def memory_line(rss: Optional[int] = None) -> str:
    """``"app memory 3.4 GB · 17.9 GB available on this machine"`` (empty where ``/proc`` is missing)."""
    rss = process_rss() if rss is None else rss
    if rss is None:
        return ""
    text = f"app memory {rss / 1e9:.1f} GB"
    avail = available_memory()
    return text + (f" · {avail / 1e9:.1f} GB available on this machine" if avail is not None else "")
