"""``bench.worktree.base_worktree``: the A/B scripts' other commit, checked out beside the repository and removed on
exit, an exception included (a leftover worktree would stay registered in the repository)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from dyntree_core.bench.worktree import base_worktree

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")


def _git(repo, *args) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_the_base_commit_is_checked_out_and_removed_even_on_an_error(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "f.txt").write_text("base\n")
    _git(repo, "add", "f.txt")
    _git(repo, "commit", "-qm", "base")
    base = _git(repo, "rev-parse", "HEAD")
    (repo / "f.txt").write_text("this\n")
    _git(repo, "commit", "-qam", "this")

    with base_worktree(repo, base) as wt:
        assert (wt / "f.txt").read_text() == "base\n" and (repo / "f.txt").read_text() == "this\n"
        assert str(wt) in _git(repo, "worktree", "list")
    assert not wt.exists() and str(wt) not in _git(repo, "worktree", "list")

    with pytest.raises(RuntimeError), base_worktree(repo, base) as wt2:
        raise RuntimeError("a side failed")
    assert not wt2.exists() and str(wt2) not in _git(repo, "worktree", "list")
