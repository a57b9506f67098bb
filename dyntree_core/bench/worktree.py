"""Another commit's source tree beside this one, for the A/B scripts that run both (``scripts/*_ab.py``)."""

from __future__ import annotations

import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def base_worktree(root: Path, rev: str) -> Iterator[Path]:
    """A temporary detached ``git worktree`` of ``rev`` in the repository at ``root``; removed on exit."""
    with tempfile.TemporaryDirectory() as tmp:
        wt = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(wt), rev], cwd=root, check=True)
        try:
            yield wt
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(wt)], cwd=root, check=False)
