"""``dyntree_core.measured``: measured once per machine, cached only when the machine was quiet.

Load is simulated by replacing the busy detector (``measured.busy_detector`` or ``watch(busy=...)``)
and by canned counter samples: no sleeps, no real load, no timing thresholds."""

from __future__ import annotations

import json

import pytest
import torch

from dyntree_core import measured
from dyntree_core.machine import MachineInfo


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path))
    return tmp_path


def _info(cpu="EPYC", flags=("avx2",), cpus=2, gpu=None) -> MachineInfo:
    return MachineInfo(cpu, flags, "avx2", cpus, 2, "t", "p", "linux", gpu)


def _counter():
    calls = []

    def measure():
        calls.append(1)
        return {"ms": 1.5 * len(calls)}

    return calls, measure


def _busy(reason="busy: simulated load of 3.0 on 2 CPUs"):
    return lambda w: reason


# ------------------------------------------------------------------------------ measure_once
def test_a_busy_measurement_is_provisional_says_why_and_is_not_cached(cache, monkeypatch):
    monkeypatch.setattr(measured, "busy_detector", _busy())
    calls, measure = _counter()
    key = measured.measure_key("demo", code=[measure])
    first = measured.measure_once(key, measure)
    assert first.provisional and not first.quiet and not first.cached
    assert "simulated load" in first.reason and first.value == {"ms": 1.5}
    assert not key.path.exists() and not list(cache.rglob("*.json"))
    again = measured.measure_once(key, measure)  # not cached: measured again
    assert len(calls) == 2 and again.provisional and again.value == {"ms": 3.0}


def test_a_quiet_measurement_is_cached_and_read_back_without_measuring(cache):
    calls, measure = _counter()
    key = measured.measure_key("demo", code=[measure], extra={"n": 4})
    first = measured.measure_once(key, measure, busy=lambda w: None)
    assert first.quiet and not first.cached and key.path.is_file()
    second = measured.measure_once(key, measure, busy=_busy())  # read back: the detector is never asked
    assert len(calls) == 1 and second.cached and second.quiet and second.value == first.value
    stored = json.loads(key.path.read_text())
    assert stored["key"] == key.fields and stored["verdict"]["quiet"] and stored["value"] == {"ms": 1.5}
    measured.measure_once(key, measure, refresh=True)
    assert len(calls) == 2


def test_the_per_call_detector_overrides_the_hook(cache, monkeypatch):
    monkeypatch.setattr(measured, "busy_detector", lambda w: None)
    calls, measure = _counter()
    key = measured.measure_key("demo")
    assert measured.measure_once(key, measure, busy=_busy("busy: mine")).reason == "busy: mine"
    assert not key.path.exists()


def test_a_file_of_another_key_is_not_read(cache):
    calls, measure = _counter()
    a, b = measured.measure_key("demo", extra={"v": 1}), measured.measure_key("demo", extra={"v": 2})
    measured.measure_once(a, measure)
    b.path.parent.mkdir(parents=True, exist_ok=True)
    b.path.write_text(a.path.read_text())  # a's content under b's name
    assert measured.load(b) is None and measured.measure_once(b, measure).cached is False and len(calls) == 2


# ------------------------------------------------------------------------------------- key
def test_the_key_changes_with_the_code_digest():
    def one():
        return 1

    def two():
        return 2

    base = measured.measure_key("demo", code=[one], info=_info())
    assert measured.measure_key("demo", code=[one], info=_info()) == base
    assert measured.measure_key("demo", code=[two], info=_info()).digest != base.digest
    assert measured.measure_key("demo", code=[one, "native-abc"], info=_info()).digest != base.digest
    assert measured.measure_key("other", code=[one], info=_info()).digest != base.digest
    assert measured.code_digest(["x"]) != measured.code_digest(["y"])


def test_the_key_changes_with_the_machine_identity(tmp_path):
    base = measured.measure_key("demo", info=_info())
    assert measured.measure_key("demo", info=_info(flags=("avx2", "amx_bf16"))).digest != base.digest
    assert measured.measure_key("demo", info=_info(cpu="Xeon")).digest != base.digest
    assert measured.measure_key("demo", info=_info(cpus=4)).digest != base.digest
    # the GPU is part of a CUDA measurement's identity, not of a CPU one's
    assert measured.measure_key("demo", info=_info(gpu="NVIDIA H200")).digest == base.digest
    h200 = measured.measure_key("demo", device="cuda", info=_info(gpu="NVIDIA H200"))
    assert measured.measure_key("demo", device="cuda", info=_info(gpu="NVIDIA H100")).digest != h200.digest
    assert base.fields["versions"]["torch"] == torch.__version__
    assert base.fields["machine"]["torch_threads"] == torch.get_num_threads()


def test_a_changed_file_changes_the_digest(tmp_path):
    f = tmp_path / "kernel.c"
    f.write_text("int a;")
    before = measured.code_digest([f])
    f.write_text("int b;")
    assert measured.code_digest([f]) != before


# ---------------------------------------------------------------------------- atomic write
class Unserializable:
    pass


def test_an_atomic_write_that_raises_leaves_no_partial_file(tmp_path):
    path = tmp_path / "sub" / "m.json"
    with pytest.raises(TypeError):
        measured.write_json(path, {"a": 1, "b": Unserializable()})  # json.dump fails halfway through
    assert not path.exists() and list(path.parent.iterdir()) == []
    measured.write_json(path, {"a": 1})
    with pytest.raises(TypeError):
        measured.write_json(path, {"a": 2, "b": Unserializable()})
    assert json.loads(path.read_text()) == {"a": 1} and [p.name for p in path.parent.iterdir()] == ["m.json"]


# -------------------------------------------------------------------------- timer and check
def test_the_timer_reports_median_fastest_and_spread_and_feeds_the_watch():
    calls = []
    with measured.watch() as w:
        t = measured.time_call(lambda: calls.append(1), repeats=5, warmup=1)
    assert len(calls) == 6 and t.samples == 5 and t.min_s <= t.median_s <= t.max_s and w.timings == [t]
    s = measured.summarize([1.0, 1.0, 1.0, 1.1, 5.0])
    assert (s.median_s, s.min_s, s.max_s) == (1.0, 1.0, 5.0) and s.spread == pytest.approx(0.1)
    assert measured.summarize([1.0, 2.0]).spread == pytest.approx(1 / 1.5)  # two samples: the whole range
    assert measured.summarize([2.0, 1.0, 3.0, 4.0]).median_s == 2.5


def _window(wall_s, others_s, cpus=2, load=0.1):
    w = measured.Watch()
    w.before = measured.Sample(100.0, 10.0, 50.0, cpus, load, cpus)
    w.after = measured.Sample(100.0 + wall_s, 10.0 + wall_s, 50.0 + wall_s + others_s, cpus, load, cpus)
    return w  # this process ran one CPU for the whole window; others used ``others_s`` CPU-seconds


def test_the_default_detector_on_canned_counters():
    assert measured.default_busy_reason(_window(2.0, 0.1)) is None
    busy = measured.default_busy_reason(_window(2.0, 2.0))  # others took half of 2 CPUs
    assert busy and "other processes used 50% of 2 CPUs" in busy
    short = _window(0.1, 0.0, load=5.0)  # too short for the counters: the load average before decides
    assert "load 5.0 on 2 CPUs" in measured.default_busy_reason(short)
    assert measured.default_busy_reason(_window(0.1, 0.0, load=1.0)) is None
    spread = _window(0.1, 0.0, load=1.0)  # too short for the counters, a quiet load: the repeats decide
    spread.timings.append(measured.summarize([1.0, 1.0, 2.5, 2.5, 2.5]))  # IQR 1.5 over median 2.5
    assert "spread" in measured.default_busy_reason(spread)
    jitter = _window(0.1, 0.0, load=1.0)  # the same spread of a 20 us kernel call is the timer's, not a load's
    jitter.timings.append(measured.summarize([2e-5, 2e-5, 5e-5, 5e-5, 5e-5]))
    assert measured.MIN_SPREAD_CALL_S == 1e-4 and measured.default_busy_reason(jitter) is None
    # where the counters cover the window they decide: the first forwards of a model just loaded spread
    # without any load (a profile measured on a quiet 2-core EPYC was refused for a 67% spread)
    counted = _window(2.0, 0.0)
    counted.timings.append(measured.summarize([0.22, 0.367]))
    assert measured.default_busy_reason(counted) is None


# ------------------------------------------------------------------------ the three caches
def test_a_busy_profile_is_returned_provisional_and_not_written(cache, monkeypatch):
    from dyntree_core.planning import profiling
    from dyntree_core.planning.machine_profile import profile_key, profile_path

    runs = []

    def fake_measure_into(prof, load, wanted, prune_factor=2.0, progress=None, turn=None, forward_bytes=None,
                          spell_moves=0):
        if prof.target.get("float32"):  # read from the cache: nothing lacks
            return 0
        runs.append(1)
        profiling._widen(prof, [1, 2])
        prof.target["float32"] = [0.01, 0.02]
        prof.draft["float32"] = [0.001, 0.002]
        prof.other = [0.0001, 0.0002]
        return 2

    monkeypatch.setattr(profiling, "measure_into", fake_measure_into)
    monkeypatch.setattr(measured, "busy_detector", _busy())
    msgs = []
    prof = profiling.load_or_measure_profile(None, "tiny", "cpu", ["float32"], ns=(1, 2), progress=msgs.append)
    path = profile_path(profile_key("tiny", "cpu"))
    assert "simulated load" in prof.provisional and not path.exists() and any("provisional" in m for m in msgs)
    monkeypatch.setattr(measured, "busy_detector", lambda w: None)
    quiet = profiling.load_or_measure_profile(None, "tiny", "cpu", ["float32"], ns=(1, 2))
    assert len(runs) == 2 and quiet.provisional == "" and path.is_file()
    assert "provisional" not in json.loads(path.read_text())
    again = profiling.load_or_measure_profile(None, "tiny", "cpu", ["float32"], ns=(1, 2))
    assert again.target == quiet.target and again.key == quiet.key and len(runs) == 2  # read back
    assert path.name == f"machine-{profile_key('tiny', 'cpu')}.json"
    # nothing left to time: a busy machine now does not make the stored profile provisional (a T=0.6 request
    # after a long run was told "not stored (busy: load 2.4 on 2 CPUs)" for a profile it did not measure)
    monkeypatch.setattr(measured, "busy_detector", _busy())
    msgs.clear()
    stored = profiling.load_or_measure_profile(None, "tiny", "cpu", ["float32"], ns=(1, 2), progress=msgs.append)
    assert stored.provisional == "" and not any("provisional" in m for m in msgs) and len(runs) == 2


def test_the_attention_table_is_keyed_by_the_machine_and_not_stored_when_busy(auto_table_store, monkeypatch):
    from dyntree_core.attention import auto_table
    from dyntree_core.attention.auto_table import AutoCell, AutoTable

    cpu = torch.device("cpu")
    key = auto_table.device_key(cpu)
    table = AutoTable(key, (AutoCell(64, 0, {"dfs": 1.0, "bfs": 3.0}, 2.0),), {}, "float32", {})
    assert auto_table.save_table(table, measured.Verdict(False, "busy: simulated")) is None
    assert auto_table.load_table(cpu) is None and not list(auto_table_store.rglob("*.json"))
    path = auto_table.save_table(table, measured.Verdict(True))
    assert path is not None and auto_table.load_table(cpu) == table
    # the same device name on another machine (other CPU flags) reads no table
    mi = measured.machine_info()
    monkeypatch.setattr(measured, "machine_info", lambda: MachineInfo(
        mi.cpu_model, (*mi.cpu_flags, "amx_bf16"), mi.cpu_class, mi.logical_cpus, mi.torch_threads, mi.torch,
        mi.python, mi.platform, mi.gpu))
    auto_table.reload()
    assert auto_table.device_key(cpu) == key and auto_table.table_path(key) != path
    assert auto_table.load_table(cpu) is None and auto_table.choose(cpu, 64, 0, True) == "torch"
