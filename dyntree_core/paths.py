"""Where DynTree keeps what it downloads and measures: ``$DYNTREE_CACHE`` or ``~/.cache/dyntree``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$DYNTREE_CACHE`` (``~`` expanded) if set, else ``~/.cache/dyntree``."""
    env = os.environ.get("DYNTREE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dyntree"


def cache_file(subdir: str, key: str, suffix: str = ".json") -> Path:
    """``cache_root()/subdir/<key with unsafe characters as _><suffix>``."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in key)
    return cache_root() / subdir / f"{safe}{suffix}"
