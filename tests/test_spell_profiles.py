"""One machine profile per spell of the memory's bandwidth (issue 40): on a host whose read bandwidth jumps
between levels (the Zen 4 VM: ~31 or ~55 GB/s, minutes each) a one-token forward follows the spell and a
32-token one hardly does, so one spell's rows price the other's trees wrongly. A probe before planning picks
the profile of its spell; a spell without one is priced by the nearest, says so, and gets its own measured
(in the app: in the background)."""

from __future__ import annotations

import dataclasses
import os

import pytest

from test_auto import _tiny_loader
from dyntree_core.planning import profiling
from dyntree_core.planning.machine_profile import (MachineProfile, profile_key, profile_path, spell_profile_path,
                                                   spell_profiles)
from dyntree_core.planning.profiling import SPELLS_KEPT, load_or_measure_profile, spell_choice

NS = [1, 2, 4]
#: what the confirming probes read (``profiling.confirmed_probe``): None, the probe asked with
STEADY: dict = {"gb": None}


@pytest.fixture(autouse=True)
def _confirming_probes(monkeypatch):
    confirming: list = []
    monkeypatch.setattr(profiling, "SPELL_CONFIRM_GAP_S", 0.0)
    monkeypatch.setattr(profiling, "run_probe", lambda: confirming.append(STEADY["gb"]) or STEADY["gb"])
    yield confirming


def _stored(key: str, read: float, t1: float, path=None) -> MachineProfile:
    prof = MachineProfile(key=key, machine={"cpu_model": "test cpu", "cpu_class": "avx2"}, prefix_len=128, ns=list(NS),
                          target={"float32": [t1, t1 * 1.1, t1 * 1.3]}, draft={"float32": [t1 / 4] * 3},
                          other=[0.001] * 3, created="2026-11-29 15:00:00", meta={"read_gb_per_s": read})
    prof.save(path or profile_path(key))
    return prof


def _load(read, measure=False, loads=None, steady=None):
    STEADY["gb"] = read if steady is None else steady
    return load_or_measure_profile(_tiny_loader(loads if loads is not None else []), "tiny", "cpu", ["float32"], ns=NS,
                                   measure=measure, read_gb_per_s=read)


def test_each_spell_is_priced_by_its_own_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path))
    key = profile_key("tiny", "cpu")
    _stored(key, 31.0, 0.035)
    _stored(key, 55.0, 0.024, spell_profile_path(key, 55.0))
    assert [p.name for p, _ in spell_profiles(key)] == [f"machine-{key}.json", f"machine-{key}@55GBs.json"]
    loads: list = []
    for read, t1 in ((54.1, 0.024), (47.0, 0.024), (30.2, 0.035), (33.9, 0.035), (None, 0.035)):
        prof = _load(read, loads=loads)
        assert prof.target_time("float32", 1) == t1 and prof.other_spell is None, read
    # 42 GB/s is neither spell (more than SPELL_GAP from both): the nearest prices it and says which probe it was
    between = _load(42.0, loads=loads)
    assert between.read_gb_per_s == 55.0 and between.other_spell == 42.0
    assert loads == []  # nothing was measured: measure=False
    assert spell_choice(spell_profiles(key), 42.0) == (1, False)
    assert spell_choice(spell_profiles(key), None) == (0, True)


def test_a_profile_without_probed_rows_serves_every_spell(tmp_path, monkeypatch):
    """Rows too small to be the memory's (the tiny pair, a GPU) are not probed: one profile, as before."""
    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path))
    loads: list = []
    first = _load(None, measure=True, loads=loads)
    assert first.read_gb_per_s is None and loads
    n = len(loads)
    for read in (31.0, 55.0):
        again = _load(read, measure=True, loads=loads)
        assert again.target == first.target and again.other_spell is None and len(loads) == n
    assert len(spell_profiles(first.key)) == 1


def test_a_new_spell_is_measured_into_a_file_of_its_own_and_few_are_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path))
    key = profile_key("tiny", "cpu")
    _stored(key, 31.0, 0.035)
    first = profile_path(key).read_text()
    loads: list = []
    new = _load(55.0, measure=True, loads=loads)
    assert loads and new.read_gb_per_s == 55.0 and new.other_spell is None
    assert new.target_time("float32", 1) != 0.035  # measured now, not the other spell's row
    assert spell_profile_path(key, 55.0).is_file() and profile_path(key).read_text() == first  # the first stays
    n = len(loads)
    assert _load(53.0, loads=loads).target == new.target and len(loads) == n  # stored: read back, not measured
    for i, read in enumerate((75.0, 100.0, 135.0)):  # more spells than are kept: the oldest other one goes
        os.utime(spell_profile_path(key, 55.0 if i == 0 else (75.0, 100.0)[i - 1]), ns=(i + 1, i + 1))
        _load(read, measure=True, loads=loads)
    kept = [p.name for p, _ in spell_profiles(key)]
    assert len(kept) == SPELLS_KEPT and kept[0] == f"machine-{key}.json" and f"machine-{key}@135GBs.json" in kept
    assert f"machine-{key}@55GBs.json" not in kept


def test_the_plan_says_when_its_profile_is_another_spells(tmp_path, monkeypatch):
    from dyntree_core.planning.auto import choose

    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path))
    key = profile_key("tiny", "cpu")
    _stored(key, 31.0, 0.035)
    prof = _load(55.0)
    prof.meta["row_gb_per_s"] = {"target:float32": [31.0, 31.0]}  # (the reason names a spell only where rows were probed)
    plan = choose(prof, (0.8, 0.6), 0.0, ["float32"], ["float32"])
    assert ("memory read at 31 GB/s when profiled, 55 GB/s now: another spell of this machine's memory bandwidth, "
            "not profiled yet") in plan.reason
    prof.other_spell = None
    assert "GB/s now" not in choose(prof, (0.8, 0.6), 0.0, ["float32"], ["float32"]).reason


def test_the_app_keeps_a_plan_per_spell_and_measures_a_spell_without_a_profile(tmp_path, monkeypatch):
    """The app's plan cache (one plan per request while the measurements stay) holds one plan per spell; a plan
    priced by another spell's profile starts the measurement of this spell's in the background."""
    from ui.model_lock import ModelLock
    from ui.planner import BackgroundPlanner, plan_auto_for_app

    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path))
    key = profile_key("tiny", "cpu")
    _stored(key, 31.0, 0.035)
    planner = BackgroundPlanner(ModelLock(), idle_s=0.0)
    made, measured = [], []

    def plan(read):
        def cached():
            made.append(dataclasses.make_dataclass("Plan", ["profile"])(_load(read)))
            return made[-1]

        def measure(turn, note):
            measured.append(read)

        return plan_auto_for_app(planner, ("tiny",), ("float32",), ("float32",), cached=cached, measure=measure,
                                 foreground=None, read_gb_per_s=read)

    slow = plan(31.5)
    assert plan(30.0) is slow and plan(None) is slow and len(made) == 1 and measured == []
    fast = plan(55.0)  # no profile of this spell: the slow one prices it, and this spell's is measured
    assert fast is not slow and fast.profile.other_spell == 55.0
    planner._thread.join(10)
    assert measured == [55.0]
    assert plan(53.0) is fast and plan(31.0) is slow and len(made) == 2  # one plan per spell
    assert planner.close(10)


def test_a_probe_the_memory_does_not_stay_at_measures_no_new_spell(tmp_path, monkeypatch, _confirming_probes):
    """One probe outside every stored spell (the memory changing level, another process reading it) is confirmed
    by ``SPELL_CONFIRM_PROBES`` more before a profile is measured for it: where their median is a stored spell,
    that spell's profile prices the plan and nothing is measured."""
    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path))
    key = profile_key("tiny", "cpu")
    _stored(key, 31.0, 0.035)
    _stored(key, 55.0, 0.024, spell_profile_path(key, 55.0))
    loads: list = []
    transient = _load(18.4, measure=True, loads=loads, steady=30.0)
    assert loads == [] and transient.read_gb_per_s == 31.0 and transient.other_spell is None
    assert _confirming_probes == [30.0] * profiling.SPELL_CONFIRM_PROBES
    assert len(spell_profiles(key)) == 2  # no file for 18.4
    _confirming_probes.clear()
    assert _load(54.0, measure=True, loads=loads).read_gb_per_s == 55.0 and _confirming_probes == []  # a stored spell
    stays = _load(18.4, measure=True, loads=loads, steady=18.0)  # the memory stays there: its own profile
    assert loads and stays.read_gb_per_s == 18.0 and spell_profile_path(key, 18.0).is_file()


def test_another_spells_profile_with_rows_measured_outside_it_is_not_stored(tmp_path, monkeypatch):
    """The memory changed spell right after the probes confirmed one and stayed out of it for every retry of a row
    (``meta["mixed_spells"]``): that profile would price the spell it names with the other spell's rows, so it is
    provisional and not stored; the first profile of a machine is kept as measured (auto needs one)."""
    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path))
    real = profiling.measure_into

    def outside(prof, *a, **kw):
        timed = real(prof, *a, **kw)
        prof.meta["read_gb_per_s"] = prof.meta.get("read_gb_per_s") or 31.0
        prof.meta["mixed_spells"] = ["target:float32"]
        return timed

    monkeypatch.setattr(profiling, "measure_into", outside)
    key = profile_key("tiny", "cpu")
    first = _load(None, measure=True, loads=[])
    assert not first.provisional and profile_path(key).is_file()
    _stored(key, 31.0, 0.035)
    new = _load(55.0, measure=True, loads=[])
    assert "outside its spell of 55 GB/s: target:float32" in new.provisional
    assert not spell_profile_path(key, 55.0).is_file()


def test_a_profile_measured_from_nothing_is_stored_as_the_spell_it_moved_to(tmp_path, monkeypatch):
    """The memory leaves the spell a profile is being measured for and stays in another (``SPELL_MOVES``): the
    profile is stored as that spell's (over its stored file where it has one, so no spell gets two), and prices the
    probe the request came with as another spell's; the first profile of a machine keeps its file."""
    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path))
    monkeypatch.setattr(profiling, "PROBE_BYTES", 1 << 12)
    monkeypatch.setattr(profiling.time, "sleep", lambda _s: None)
    reads = {"gb": 55.0}
    monkeypatch.setattr(profiling, "read_gb_per_s", lambda **_kw: reads["gb"])
    key = profile_key("tiny", "cpu")

    def measure(read):
        STEADY["gb"] = read
        return load_or_measure_profile(_tiny_loader([]), "tiny", "cpu", ["float32"], ns=NS, measure=True,
                                       read_gb_per_s=read, forward_bytes=lambda role, p: 1 << 30)

    first = measure(31.0)  # no stored profile: the reference is the first probe (55), where the memory stays
    assert profile_path(key).is_file() and first.read_gb_per_s == 55.0 and "spell_moved_from" not in first.meta
    reads["gb"] = 31.0  # a probe of 18 confirmed; the memory then reads 31 around every row
    old = _stored(key, 31.0, 0.035, spell_profile_path(key, 31.0)).created
    moved = measure(18.0)
    assert moved.meta["spell_moved_from"] == [18.0] and moved.read_gb_per_s == 31.0 and moved.other_spell == 18.0
    assert not spell_profile_path(key, 18.0).is_file()
    again = MachineProfile.load(spell_profile_path(key, 31.0))
    assert again.created != old and again.meta["spell_moved_from"] == [18.0]
    assert len(spell_profiles(key)) == 2
