"""Every A/B script's result JSON starts with one header (``bench.result_file``): what wrote it, when, its arguments
and the machine, so a number is never read without the machine it was measured on."""

from __future__ import annotations

import json

from dyntree_core.bench.result_file import result_header, write_result


def test_the_header_names_the_writer_the_time_the_arguments_and_the_machine(monkeypatch):
    monkeypatch.setattr("sys.argv", ["scripts/x.py", "--rounds", "3"])
    head = result_header("scripts/x.py")
    assert list(head) == ["what", "date", "argv", "machine_info"]
    assert head["what"] == "scripts/x.py" and head["argv"] == ["--rounds", "3"] and head["date"].endswith(" UTC")
    assert head["machine_info"]["logical_cpus"] >= 1 and "cpu_flags" in head["machine_info"]
    assert result_header("y", argv=("a",))["argv"] == ["a"]


def test_write_result_puts_the_header_first_and_keeps_the_body(tmp_path):
    path = tmp_path / "r.json"
    body = {"rounds": [1, 2], "summary": {"median": 3.0}, "when": object()}
    out = write_result(path, "scripts/x.py", body, default=lambda o: "obj")
    got = json.loads(path.read_text())
    assert list(got)[:4] == ["what", "date", "argv", "machine_info"] and got["rounds"] == [1, 2]
    assert got["summary"] == {"median": 3.0} and got["when"] == "obj" and out["what"] == "scripts/x.py"
