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


# --- import cycles --------------------------------------------------------------------------------
# The import graph of every module under dyntree_core/ and ui/, read from the source: absolute and
# relative imports, at module top and inside functions (a lazy import closes a cycle just the same),
# ``from pkg import sub`` counted as importing the submodule. Imports under ``if TYPE_CHECKING:`` are
# left out: they never run. Importing a submodule is not counted as importing its package's
# ``__init__`` (every module of a package would otherwise sit in a cycle with it).

LAYERED = ("dyntree_core", "ui")


def _module_files() -> dict[str, Path]:
    modules = {}
    for top in LAYERED:
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _imported_modules(name: str, is_package: bool, source: str, modules) -> set[str]:
    """The modules of ``modules`` that module ``name`` (of source ``source``; a package's
    ``__init__`` when ``is_package``) imports anywhere in its body."""
    out = set()
    package = name if is_package else name.rpartition(".")[0]
    for node in _import_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                found = [".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in modules]
                out.update(found[:1])
            continue
        if node.level:
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join(base + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        for alias in node.names:
            if f"{base}.{alias.name}" in modules:
                out.add(f"{base}.{alias.name}")
            elif base in modules:
                out.add(base)
    out.discard(name)
    return out


def _module_graph() -> dict[str, set[str]]:
    modules = _module_files()
    return {name: _imported_modules(name, path.name == "__init__.py", path.read_text(encoding="utf-8"), modules)
            for name, path in modules.items()}


def _package_of(module: str, packages: set[str]) -> str:
    """``dyntree_core.quant.fused`` -> ``dyntree_core.quant``; a top-level module of ``dyntree_core``
    is its own node, and ``ui`` is one node."""
    parts = module.split(".")
    if parts[0] == "ui":
        return "ui"
    return ".".join(parts[:2]) if ".".join(parts[:2]) in packages else module


def _package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages = {m for m, p in _module_files().items() if p.name == "__init__.py"}
    out: dict[str, set[str]] = {}
    for src, targets in graph.items():
        a = _package_of(src, packages)
        out.setdefault(a, set()).update(b for b in (_package_of(t, packages) for t in targets) if b != a)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle per strongly connected component of more than one node, through each of
    its nodes (Tarjan, then a breadth-first search from the node back to itself), without repeats."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = set()
    for component in components:
        for start in component:
            previous, frontier = {}, [start]
            while start not in previous:
                nxt = []
                for v in frontier:
                    for w in sorted(graph[v] & component):
                        if w not in previous:
                            previous[w] = v
                            nxt.append(w)
                frontier = nxt
            path, v = [start], previous[start]
            while v != start:
                path.append(v)
                v = previous[v]
            cycle = [start, *reversed(path[1:])]
            first = cycle.index(min(cycle))
            cycles.add(tuple(cycle[first:] + cycle[:first] + [cycle[first]]))
    return sorted(list(c) for c in cycles)


def test_the_cycle_finder_finds_cycles_and_only_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
    packages = {"dyntree_core.quant", "dyntree_core.planning"}
    assert _package_of("dyntree_core.quant.fused", packages) == "dyntree_core.quant"
    assert _package_of("dyntree_core.methods", packages) == "dyntree_core.methods"
    assert _package_of("ui.models", packages) == "ui"


def test_the_import_graph_reads_relative_lazy_and_submodule_imports():
    graph = _module_graph()
    assert "dyntree_core.planning.cost_model" in graph and "ui.app" in graph
    assert all(not t.startswith(("torch", "transformers")) for targets in graph.values() for t in targets)
    modules = _module_files()
    source = ("from . import mask\nfrom .reference import x\nimport dyntree_core.tree\n"
              "def f():\n    from ..planning import pricing\nif TYPE_CHECKING:\n    from dyntree_core import trace\n")
    got = _imported_modules("dyntree_core.attention.probe", False, source, modules)
    assert got == {"dyntree_core.attention.mask", "dyntree_core.attention.reference", "dyntree_core.tree",
                   "dyntree_core.planning.pricing"}



def test_no_import_cycle_between_modules():
    cycles = _cycles(_module_graph())
    assert not cycles, "import cycles between modules:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_import_cycle_between_packages():
    cycles = _cycles(_package_graph(_module_graph()))
    assert not cycles, "import cycles between packages:\n" + "\n".join(" -> ".join(c) for c in cycles)
