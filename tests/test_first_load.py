"""The set-up's last step (``python -m dyntree_core prepare``): the app's first load done before the app starts,
so that the first Run with the defaults reads the kernel table and the packed weights instead of making them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dyntree_core.planning.first_load import prepare_first_load
from dyntree_core.planning.provisional import provisional_plan
from dyntree_core.planning.search_space import AUTO, search_space

pytestmark = pytest.mark.realpair
ROOT = Path(__file__).resolve().parents[1]


def _fresh_cache(tmp_path: Path) -> Path:
    """A cache with the fetched pair, the compiled kernels and this machine's kernel table, nothing packed."""
    from dyntree_core.paths import cache_root

    fresh = tmp_path / "cache"
    (fresh / "kernels").mkdir(parents=True)
    for sub in ("models", "gguf"):
        (fresh / sub).symlink_to(cache_root() / sub)
    for f in (cache_root() / "kernels").glob("*"):
        (fresh / "kernels" / f.name).symlink_to(f)
    return fresh


def test_prepare_packs_what_autos_first_run_loads_once(tmp_path, monkeypatch, embedded_fetched):
    from dyntree_core.models.load import load_model, resolve_spec

    fresh = _fresh_cache(tmp_path)
    monkeypatch.setenv("DYNTREE_CACHE", str(fresh))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    run = [sys.executable, "-m", "dyntree_core", "prepare"]
    out = subprocess.run(run, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("building int4 weights") == 2, out.stdout
    assert "the app's first load is ready: draft int4, target int4 (built: the draft and the target;" in out.stdout
    packed = sorted(p.parent.name for p in (fresh / "packed").glob("*/*.safetensors"))
    assert packed == ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"], packed

    tps, dps, _ = search_space(AUTO, AUTO, AUTO, "cpu")
    plan = provisional_plan(tps, dps, "")
    again = prepare_first_load()  # what auto's first Run loads: its provisional plan's precisions
    assert (again.target_precision, again.draft_precision) == (plan.precision, plan.draft_precision)
    assert again.loaded == (), again
    heard: list[str] = []
    load_model(resolve_spec("embedded", "target"), precision="int4", progress=heard.append)
    assert not any("building" in x or "measuring" in x for x in heard), heard  # the first Run only reads them
    out = subprocess.run(run, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "(it was ready;" in out.stdout, out.stdout + out.stderr
