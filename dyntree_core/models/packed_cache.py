"""The packed-weights cache of a GGUF model: its files' names, and how many of them a model keeps.

A packed file is named by precision, torch version, cache format, the kernel plans of its layers and the head it
reads (``gguf_model.quant_cache_path``), so a new kernel table, torch or format writes a new file beside the old
ones: ~1 GB each for the 1.5B target at int4. A model's directory keeps the ``KEEP_PER_PRECISION`` files of each
precision used last (a load marks its file used: ``mark_used``) and the file just written; ``prune`` deletes the
rest, with any ``.partial`` file a killed writer left behind more than ``PARTIAL_AGE_S`` ago.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

#: packed files of one precision kept per model (the one in use, and the one before it: a table measured again, or
#: another checkout of the code on the same cache, does not rebuild at once)
KEEP_PER_PRECISION = 2
#: a ``.partial`` file older than this is a killed writer's, not one being written
PARTIAL_AGE_S = 3600.0
_PACKED = re.compile(r"^packed-(?P<precision>[a-z0-9]+)-.*\.safetensors$")


@dataclass(frozen=True)
class Pruned:
    """What ``prune`` deleted: the files and their bytes."""

    files: tuple[Path, ...]
    nbytes: int

    def text(self) -> str:
        return f"removed {len(self.files)} older packed file(s) ({self.nbytes / 1e9:.1f} GB)"


def mark_used(path: Path) -> None:
    """Mark a packed file used now (its modification time: ``prune`` keeps the files used last)."""
    try:
        os.utime(path)
    except OSError:  # (a read-only cache is used as it is)
        pass


def precision_of(path: Path) -> Optional[str]:
    """The precision a packed file's name says (None: not a packed file)."""
    m = _PACKED.match(path.name)
    return m.group("precision") if m else None


def prune(cache_dir: Path, keep: Path, progress: Optional[Callable[[str], None]] = None) -> Pruned:
    """Delete the packed files of ``cache_dir`` beyond the ``KEEP_PER_PRECISION`` used last of each precision
    (``keep``, the file just written or loaded, always stays), and stale ``.partial`` files. A file another process
    has open stays readable to it; one it was about to open is rebuilt there (a missing cache is not an error)."""
    groups: dict[str, list[tuple[float, Path]]] = {}
    doomed: list[Path] = []
    now = time.time()
    try:
        entries = list(Path(cache_dir).iterdir())
    except OSError:
        return Pruned((), 0)
    for p in entries:
        try:
            mtime = p.stat().st_mtime
        except OSError:
            continue
        if p.name.endswith(".partial"):
            if now - mtime > PARTIAL_AGE_S:
                doomed.append(p)
            continue
        prec = precision_of(p)
        if prec is not None and p != keep:
            groups.setdefault(prec, []).append((mtime, p))
    keep_prec = precision_of(keep)
    for prec, files in groups.items():
        files.sort(key=lambda f: f[0], reverse=True)
        room = KEEP_PER_PRECISION - (1 if prec == keep_prec else 0)
        doomed.extend(p for _, p in files[room:])
    removed, nbytes = [], 0
    for p in doomed:
        try:
            size = p.stat().st_size
            p.unlink()
        except OSError:
            continue
        removed.append(p)
        nbytes += size
    pruned = Pruned(tuple(sorted(removed)), nbytes)
    if removed and progress is not None:
        progress(f"  {pruned.text()}")
    return pruned
