"""The memory read probe: its samples taken while tasks waited for a CPU are not the memory's bandwidth, and a
probe with no other sample says so (``probe_read``, ``profiling.run_probe``); the largest cache from sysfs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dyntree_core import memory_bandwidth as mb
from dyntree_core.planning import profiling


def test_the_cpu_wait_is_read_from_the_pressure_file(tmp_path):
    f = tmp_path / "cpu"
    f.write_text("some avg10=1.48 avg60=0.62 avg300=0.49 total=21651294\nfull avg10=0.00 avg60=0.00 avg300=0.00 "
                 "total=0\n")
    assert mb.cpu_wait_us(f) == 21651294
    assert mb.cpu_wait_us(tmp_path / "none") is None


def _scripted(monkeypatch, samples):
    """``probe_read``'s clock and CPU-wait counter read ``samples``: per sum ``(seconds, waited seconds)``."""
    clock, waits, t, w = [], [], 0.0, 0
    for dt, waited in samples:
        clock += [t, t + dt]
        waits += [w, w + int(waited * 1e6)]
        t, w = t + dt + 1.0, w + int(waited * 1e6) + 10**6  # (waits between the sums are not theirs)
    monkeypatch.setattr(mb, "perf_counter", iter(clock).__next__)
    monkeypatch.setattr(mb, "cpu_wait_us", iter(waits).__next__)


def test_a_sum_during_which_tasks_waited_for_a_cpu_is_not_read(monkeypatch):
    buf = mb.torch.ones(1 << 18)  # 1 MiB
    _scripted(monkeypatch, [(0.001, 0.0005), (0.002, 0.00005), (0.0005, 0.0004)])
    got = mb.probe_read(buffer=buf, samples=3)
    assert not got.contended and got.gb_per_s == pytest.approx((1 << 20) / 0.002 / 1e9)  # the quiet sum, though slowest
    _scripted(monkeypatch, [(0.001, 0.0005), (0.0005, 0.0004)])
    got = mb.probe_read(buffer=buf, samples=2)
    assert got.contended and got.gb_per_s == pytest.approx((1 << 20) / 0.0005 / 1e9)


def test_without_the_pressure_file_every_sum_counts(monkeypatch):
    monkeypatch.setattr(mb, "cpu_wait_us", lambda: None)
    got = mb.probe_read(buffer=mb.torch.ones(1 << 18), samples=2)
    assert not got.contended and got.gb_per_s > 0


def test_a_contended_probe_names_no_spell(monkeypatch):
    """``run_probe`` gives None for a contended probe (then the stored profile prices the run and the page names no
    other spell), and ``confirmed_probe`` leaves such probes out of its median."""
    monkeypatch.setattr(profiling, "probe_read", lambda nbytes, samples: mb.ReadProbe(15.0, contended=True))
    assert profiling.run_probe() is None
    monkeypatch.setattr(profiling, "probe_read", lambda nbytes, samples: mb.ReadProbe(36.123))
    assert profiling.run_probe() == 36.12
    monkeypatch.setattr(profiling, "SPELL_CONFIRM_GAP_S", 0.0)
    probes = iter([None, 50.0, None])
    assert profiling.confirmed_probe(30.0, lambda: next(probes)) == 50.0  # the median of 30 and 50, not of None


@pytest.mark.skipif(mb.cpu_wait_us() is None, reason="the kernel keeps no CPU pressure stall information")
def test_a_probe_beside_a_process_spinning_on_every_cpu_is_contended():
    """On the machine itself: one spinning process per CPU. Our sums' threads then wait for a CPU all along, so every
    sum is contended and ``run_probe`` says nothing of the memory (on the 2-core Zen 4 VM one spinner alone halved the
    read, 17 against 30 GB/s, with tasks waiting half of each sum)."""
    n = os.cpu_count() or 1
    spin = [subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 20: pass"])
            for _ in range(n)]
    try:
        import time

        time.sleep(0.3)
        assert all(p.poll() is None for p in spin)
        assert mb.probe_read(profiling.RUN_PROBE_BYTES, samples=3).contended
        assert profiling.run_probe() is None
    finally:
        for p in spin:
            p.kill()
            p.wait()
    assert all(p.poll() is not None for p in spin)


def test_the_cache_size_is_read_from_sysfs(tmp_path):
    largest_cache_bytes, parse_cache_size = mb.largest_cache_bytes, mb.parse_cache_size
    assert (parse_cache_size("32768K"), parse_cache_size("1M"), parse_cache_size("512"),
            parse_cache_size("big")) == (32 << 20, 1 << 20, 512, None)
    for i, (kind, size) in enumerate([("Data", "32K"), ("Instruction", "64M"), ("Unified", "1024K"),
                                      ("Unified", "32768K")]):
        (tmp_path / f"index{i}").mkdir()
        (tmp_path / f"index{i}" / "type").write_text(kind + "\n")
        (tmp_path / f"index{i}" / "size").write_text(size + "\n")
    assert largest_cache_bytes(tmp_path) == 32 << 20  # (not the instruction cache)
    assert largest_cache_bytes(tmp_path / "nowhere") is None
