"""Imports point one way: the app (``ui``) uses the core, never the reverse, and the core's
benchmarks import without the app's dependencies."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_core_never_imports_the_app():
    offenders = []
    for path in (ROOT / "dyntree_core").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n == "ui" or n.startswith("ui.")]
    assert not offenders, offenders


def test_benches_and_figure_export_import_without_gradio():
    code = ("import sys; sys.modules['gradio'] = None; "
            "import dyntree_core.bench.decoding, dyntree_core.figure_export, dyntree_core.bench.exact_acceptance")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"})


def test_one_model_load_error_class():
    from dyntree_core.models import ModelLoadError, VocabMismatchError
    from ui.models import ModelLoadError as UiModelLoadError

    assert UiModelLoadError is ModelLoadError and issubclass(VocabMismatchError, ModelLoadError)


def test_build_app_only_wires_layout_to_the_controller():
    import inspect

    from ui import app

    lines, _ = inspect.getsourcelines(app.build_app)
    assert len(lines) < 120, f"build_app has {len(lines)} lines"
    assert "def on_" not in "".join(lines)  # handlers live in ui/controller.py


def test_the_app_imports_transformers_before_it_serves():
    """transformers' lazy imports are not thread-safe: build_app resolves every name the project uses
    first, so the page's concurrent first events never race on them."""
    import ast

    from dyntree_core.models.load import TRANSFORMERS_NAMES

    used = set()
    for path in [*(ROOT / "dyntree_core").rglob("*.py"), *(ROOT / "ui").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "transformers":
                used |= {a.name for a in node.names}
    assert used <= set(TRANSFORMERS_NAMES), sorted(used - set(TRANSFORMERS_NAMES))
    code = ("import sys; from ui.app import build_app; from ui.tiny import TinyModelProvider; "
            "build_app(TinyModelProvider()); import transformers; "
            "print(all(n in transformers.__dict__ for n in "
            "__import__('dyntree_core.models.load', fromlist=['x']).TRANSFORMERS_NAMES))")
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "1"}).stdout
    assert out.strip().endswith("True")


def test_after_the_warm_up_concurrent_imports_of_transformers_names_never_fail():
    """Six threads importing transformers names at once: without the warm-up this failed in 3 of 4
    fresh processes (ImportError: cannot import name 'DynamicCache'); after it, never."""
    code = """
import threading
from dyntree_core.models.load import TRANSFORMERS_NAMES, import_transformers
import_transformers()
errors, barrier = [], threading.Barrier(len(TRANSFORMERS_NAMES))
def one(name):
    barrier.wait()
    try:
        exec(f"from transformers import {name}")
    except Exception as e:
        errors.append(repr(e))
threads = [threading.Thread(target=one, args=(n,)) for n in TRANSFORMERS_NAMES]
[t.start() for t in threads]
[t.join() for t in threads]
print(errors)
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "1"}).stdout
    assert out.strip().splitlines()[-1] == "[]", out
