"""A model load says how far it is and ends where it was stopped (``models.load_progress``, ``interrupt``'s load
scope): a packed load reports its bytes and the disk's share at most once per ``EVERY_S``; ``check_load`` raises only
inside ``stops_loads_on`` with its event set, and never arms the forwards' per-layer checks."""

from __future__ import annotations

import threading

import pytest
import torch

from dyntree_core import interrupt
from dyntree_core.models import load_progress
from dyntree_core.models.load_progress import LoadProgress

from test_ggml_kernels import _write_tiny_qwen2


def test_check_load_raises_only_inside_its_scope_with_the_event_set():
    event = threading.Event()
    interrupt.check_load()
    with interrupt.stops_loads_on(event):
        interrupt.check_load()
        event.set()
        with pytest.raises(interrupt.LoadStopped):
            interrupt.check_load()
        assert not interrupt.armed()  # (a load's scope leaves the forwards a plan times unarmed)
        interrupt.check()  # and the prefill's check does not hear it
    interrupt.check_load()


def test_progress_says_bytes_share_and_disk_at_most_every_interval(monkeypatch):
    lines: list[str] = []
    clock = iter([0.0, 0.4, 1.2, 1.5, 2.6])
    monkeypatch.setattr(load_progress, "_now", lambda: next(clock))
    reads = iter([1_000_000_000, 1_300_000_000, 1_450_000_000])
    monkeypatch.setattr(load_progress, "_read_bytes", lambda: next(reads))
    p = LoadProgress(lines.append, "reading the packed weights", 2_000_000_000)
    p.advance(500_000_000)  # t = 0.4: too soon
    p.advance(500_000_000)  # t = 1.2
    p.advance(500_000_000)  # t = 1.5: too soon after the last line
    p.advance(500_000_000)  # t = 2.6
    assert lines == ["  reading the packed weights: 1.00 of 2.00 GB (50%; 0.30 GB from the disk; 1.2 s)",
                     "  reading the packed weights: 2.00 of 2.00 GB (100%; 0.45 GB from the disk; 2.6 s)"]


def test_a_progress_without_disk_counters_leaves_them_out(monkeypatch):
    monkeypatch.setattr(load_progress, "_read_bytes", lambda: None)
    assert LoadProgress(print, "x", 0).line().startswith("  x: 0.00 of 0.00 GB (100%; ")


@pytest.mark.parametrize("cached", [False, True], ids=["built from the GGUF", "read from the packed cache"])
def test_a_gguf_load_reports_and_stops_between_its_tensors(tmp_path, monkeypatch, cached):
    """Built from the GGUF or read from the packed cache, a load stopped after its n-th report ends there, leaves
    no packed file half written, and the next load (not stopped) gives the same logits as before."""
    from dyntree_core.models import gguf_model
    from dyntree_core.models.gguf_model import load_gguf_model

    path, cfg = _write_tiny_qwen2(tmp_path)
    packed = tmp_path / "packed"
    ids = torch.tensor([[3, 17, 99, 5]])
    monkeypatch.setattr(load_progress, "EVERY_S", 0.0)
    if cached:
        with torch.inference_mode():
            want = load_gguf_model(path, cfg, "int4", cache_dir=packed)(ids).logits
    files = sorted(packed.rglob("*")) if cached else []
    event, lines = threading.Event(), []
    # (the build says "building int4 weights", then every 50 tensors; a worker whose kernel table lacks the tiny
    # shapes first says it measures them)
    said = "  reading the packed weights: " if cached else "  building int4 weights"
    stop_at = 3 if cached else 1

    def say(line):
        if line.startswith(said):
            lines.append(line)
        if len(lines) == stop_at:
            event.set()  # (a Stop clicked while this line shows)

    advanced = []
    real_advance = LoadProgress.advance
    monkeypatch.setattr(LoadProgress, "advance", lambda self, n: advanced.append(n) or real_advance(self, n))
    real_check = gguf_model.check_load
    checks = []
    monkeypatch.setattr(gguf_model, "check_load", lambda: checks.append(1) or real_check())
    with interrupt.stops_loads_on(event), pytest.raises(interrupt.LoadStopped):
        load_gguf_model(path, cfg, "int4", progress=say, cache_dir=packed)
    if cached:
        assert len(lines) == 3 and len(advanced) == 4  # stopped at the tensor after the report the Stop came in
    else:
        assert lines == [f"  building int4 weights from {path.name} (once; later loads read the packed cache)"]
        assert len(checks) == 1  # stopped before its first tensor
    assert sorted(packed.rglob("*")) == files  # nothing written by the stopped load
    with torch.inference_mode():
        again = load_gguf_model(path, cfg, "int4", cache_dir=packed)(ids).logits
    if cached:
        assert torch.equal(again, want)


def test_a_stopped_load_leaves_nothing_it_copied_alive(tmp_path, monkeypatch):
    """The layers a stopped packed load had already copied (2 MiB-page mappings in the real pair, ~1 GB) go with
    the load: nothing keeps them once ``LoadStopped`` has been handled."""
    import gc
    import weakref

    from dyntree_core.models import gguf_model
    from dyntree_core.models.gguf_model import load_gguf_model

    path, cfg = _write_tiny_qwen2(tmp_path)
    load_gguf_model(path, cfg, "int4", cache_dir=tmp_path / "packed")  # (writes the packed file)
    made: list[weakref.ref] = []
    real_layer = gguf_model._ggml_layer

    def layer(*a, **k):
        out = real_layer(*a, **k)
        made.append(weakref.ref(out))
        made.append(weakref.ref(out.blocks))
        if len(made) >= 4:
            event.set()  # (a Stop after two layers were copied)
        return out

    monkeypatch.setattr(gguf_model, "_ggml_layer", layer)
    event = threading.Event()
    try:
        with interrupt.stops_loads_on(event):
            load_gguf_model(path, cfg, "int4", cache_dir=tmp_path / "packed")
    except interrupt.LoadStopped:
        pass
    gc.collect()
    assert len(made) == 4 and all(r() is None for r in made), sum(r() is not None for r in made)
