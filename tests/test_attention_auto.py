"""``attention="auto"`` follows the device's measured kernel-vs-SDPA table; without one, today's rule."""

import pytest
import torch

from dyntree_core.attention import auto_table
from dyntree_core.attention.auto_table import AutoCell, AutoTable


def table(key: str) -> AutoTable:
    """Kernel faster than SDPA for big trees after short prefixes; the mask path (BFS) never."""
    cells = (
        AutoCell(64, 0, {"dfs": 2.0, "bfs": 3.0}, 1.0),
        AutoCell(64, 1024, {"dfs": 5.0, "bfs": 6.0}, 4.0),
        AutoCell(1024, 0, {"dfs": 1.0, "bfs": 3.0}, 2.0),
        AutoCell(1024, 1024, {"dfs": 3.0, "bfs": 3.5}, 3.2),
    )
    return AutoTable(key, cells, dict(q=4, kv=2, head_dim=32), "float32", {"cpu_model": "test"})


def test_the_choice_follows_the_table():
    t = table("cpu-test")
    assert t.choose(1024, 0, preorder=True) == "triton" and t.choose(1024, 0, preorder=False) == "torch"
    assert t.choose(64, 0, preorder=True) == "torch"
    assert t.choose(1024, 1024, preorder=True) == "triton" and t.choose(64, 1024, preorder=True) == "torch"
    # between measured points: the nearest cell on log scales
    assert t.choose(700, 10, preorder=True) == "triton" and t.choose(90, 10, preorder=True) == "torch"
    assert t.nearest(2048, 3000).size == 1024 and t.nearest(1, 0).size == 64
    # beyond the measured range: SDPA, not the nearest cell's kernel (no extrapolation)
    assert t.choose(1024, 0, preorder=True) == "triton" and t.choose(2048, 0, preorder=True) == "torch"
    assert t.choose(1024, 3000, preorder=True) == "torch" and t.choose(1, 0, preorder=True) == "torch"
    assert t.uses_kernel()
    assert AutoTable.from_dict(t.to_dict()) == t
    assert t.to_dict()["cells"][2]["choice"] == {"dfs": "triton", "bfs": "torch"}


def test_a_missing_table_keeps_todays_rule(auto_table_store):
    cpu = torch.device("cpu")
    assert auto_table.load_table(cpu) is None
    assert auto_table.choose(cpu, 1024, 0, True) == "torch" and not auto_table.may_use_kernel(cpu)
    assert auto_table.rule(torch.device("cuda")) == "triton" and auto_table.rule(cpu) == "torch"


def test_the_stored_table_of_this_device_is_the_one_read(auto_table_store):
    cpu = torch.device("cpu")
    key = auto_table.device_key(cpu)
    path = auto_table.save_table(table(key))
    assert path.parent.parent == auto_table_store
    assert auto_table.load_table(cpu) == table(key)
    assert auto_table.choose(cpu, 1024, 0, True) == "triton" and auto_table.choose(cpu, 64, 0, True) == "torch"
    assert auto_table.may_use_kernel(cpu)
    auto_table.save_table(table("cuda-another GPU"))  # another device's table changes nothing here
    assert auto_table.choose(cpu, 1024, 0, False) == "torch"
    path.write_text("{not json")
    auto_table.reload()
    with pytest.raises(ValueError, match="bench attention"):
        auto_table.load_table(cpu)
