"""The kernel counters a Run's load is logged with (``dyntree_core.system_counters``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dyntree_core.system_counters import (SystemCounters, parse_io, parse_steal, parse_vmstat, read_counters,
                                          spent)

IO = "rchar: 5000\nwchar: 10\nsyscr: 3\nsyscw: 1\nread_bytes: 1300000000\nwrite_bytes: 0\n"
VMSTAT = "nr_free_pages 100\ncompact_stall 7\ncompact_fail 1\nthp_fault_alloc 40\nthp_fault_fallback 3\n"
STAT = "cpu  100 0 50 9000 4 0 2 250 0 0\ncpu0 50 0 25 4500 2 0 1 125 0 0\nintr 1\n"


def test_parsers_read_the_fields_of_procs_texts():
    assert parse_io(IO) == 1_300_000_000
    assert parse_io("rchar: 1\n") is None
    assert parse_vmstat(VMSTAT, "compact_stall") == 7
    assert parse_vmstat(VMSTAT, "thp_fault_fallback") == 3
    assert parse_vmstat(VMSTAT, "compact_fail_x") is None
    assert parse_steal(STAT, 100.0) == 2.5  # the cpu line's eighth number, not cpu0's
    assert parse_steal("cpu  1 2 3\n", 100.0) is None


def test_spent_is_the_difference_and_its_text_names_each_counter():
    a = SystemCounters(10.0, 1.0, 5, 1_000, 2, 0, 3.0)
    b = SystemCounters(19.4, 10.1, 417, 1_300_001_000, 2, 4, 3.5)
    d = spent(a, b)
    assert d.text() == ("9.4 s; process CPU 9.1 s; read from disk 1.30 GB (412 major faults); compaction stalls 0; "
                        "huge-page fallbacks 4; CPU steal 0.5 s")
    unknown = SystemCounters(10.0, 1.0, 5, None, None, None, None)
    assert spent(unknown, b).text() == "9.4 s; process CPU 9.1 s; 412 major faults"


def test_read_counters_from_a_proc_tree(tmp_path: Path):
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "io").write_text(IO)
    (tmp_path / "vmstat").write_text(VMSTAT)
    (tmp_path / "stat").write_text(STAT)
    c = read_counters(tmp_path)
    assert (c.read_bytes, c.compact_stalls, c.thp_fallbacks) == (1_300_000_000, 7, 3)
    assert c.steal_s is not None and c.steal_s > 0
    bare = read_counters(tmp_path / "missing")  # no /proc: the process's own counters only
    assert bare.read_bytes is None and bare.compact_stalls is None and bare.steal_s is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_this_process_counts_its_own_cpu_time():
    before = read_counters()
    x = 0
    for i in range(2_000_000):
        x += i * i
    d = spent(before, read_counters())
    assert d.cpu_s > 0.0 and d.wall_s >= 0.0 and d.read_bytes is not None
