"""``attention="auto"``: the tree-attention backend measured fastest on this device.

``bench attention`` times the Triton kernel (per node order) and SDPA with the tree mask at a grid
of (tree size, cached prefix) and writes an ``AutoTable`` for the device it ran on, keyed through
``dyntree_core.measured`` by this machine's identity (CPU model and flags, CPUs, threads, and the GPU
for a CUDA table), torch and Triton's versions, the kernel's source and the device's name
(``cache_root()/attention/<digest>.json``, the same store as the machine profiles); timings taken
while the machine was busy are not stored (``save_table`` with a busy verdict). For a
forward of ``n`` tree tokens after a ``prefix``-token cache, ``choose`` looks up the nearest
measured cell (log scale in both) and returns the faster backend for the node order's kernel
path: the interval form for pre-orders (DFS/HPD), the mask tensor otherwise; beyond the measured
sizes or prefixes it returns SDPA (never extrapolated). With no table for
the device, today's rule holds: the kernel on CUDA, SDPA elsewhere.

On a CPU the kernel runs in Triton's interpreter and loses everywhere; a CPU table says so
(every cell ``torch``), and ``auto`` then picks SDPA there as the rule does.
"""

from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from .. import measured

Choice = str  # "triton" | "torch"
#: the kernel column a node order reads: pre-orders use the interval form, others the mask tensor
KERNEL_PATHS: dict[bool, str] = {True: "dfs", False: "bfs"}


@dataclass(frozen=True)
class AutoCell:
    """One measured point: median milliseconds of one attention call.

    Attributes:
        size: tree tokens (query rows).
        prefix: cached tokens before the tree (dense columns).
        kernel_ms: the Triton kernel per node order (``{"dfs": ..., "bfs": ...}``).
        sdpa_ms: ``F.scaled_dot_product_attention`` with the bool tree mask.
    """

    size: int
    prefix: int
    kernel_ms: dict[str, float]
    sdpa_ms: float

    def choice(self, preorder: bool) -> Choice:
        kernel = self.kernel_ms.get(KERNEL_PATHS[preorder])
        return "triton" if kernel is not None and kernel < self.sdpa_ms else "torch"


@dataclass(frozen=True)
class AutoTable:
    """Measured backend choices for one device.

    Attributes:
        device_key: ``device_key(device)`` of the device it was measured on.
        cells: the measured grid.
        heads: ``{"q": .., "kv": .., "head_dim": ..}`` of the measurement.
        dtype: dtype of the measurement.
        machine: ``machine.machine_info().to_dict()`` plus the torch / Triton versions.
    """

    device_key: str
    cells: tuple[AutoCell, ...]
    heads: dict[str, int]
    dtype: str
    machine: dict[str, Any]

    def nearest(self, n: int, prefix: int) -> AutoCell:
        """The measured cell closest to (``n``, ``prefix``) on log2 scales (prefix as log2(1 + P))."""
        if not self.cells:
            raise ValueError("empty table")

        def dist(c: AutoCell) -> float:
            return (math.log2(max(n, 1) / max(c.size, 1))) ** 2 + (math.log2((1 + prefix) / (1 + c.prefix))) ** 2

        return min(self.cells, key=dist)

    def covers(self, n: int, prefix: int) -> bool:
        """Whether (``n``, ``prefix``) lies within the measured sizes and prefixes (below the smallest counts:
        the smallest cell stands for it, as the pricing's interpolation policy does for forward times)."""
        return bool(self.cells) and n <= max(c.size for c in self.cells) and prefix <= max(c.prefix for c in self.cells)

    def choose(self, n: int, prefix: int, preorder: bool) -> Choice:
        """The nearest measured cell's choice inside the measured range; SDPA beyond it (never extrapolated:
        a kernel faster at 1,024 nodes says nothing about 4,096)."""
        if not self.covers(n, prefix):
            return "torch"
        return self.nearest(n, prefix).choice(preorder)

    def uses_kernel(self) -> bool:
        """Whether any cell picks the kernel (callers then build its metadata)."""
        return any(c.choice(p) == "triton" for c in self.cells for p in (True, False))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cells"] = [dict(asdict(c), choice={o: c.choice(p) for p, o in KERNEL_PATHS.items()}) for c in self.cells]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "AutoTable":
        cells = tuple(AutoCell(int(c["size"]), int(c["prefix"]), {k: float(v) for k, v in c["kernel_ms"].items()
                                                                  if v is not None}, float(c["sdpa_ms"]))
                      for c in d["cells"])
        return cls(str(d["device_key"]), cells, dict(d.get("heads", {})), str(d.get("dtype", "")),
                   dict(d.get("machine", {})))

    @classmethod
    def from_timing_rows(cls, device: torch.device, rows: list[dict[str, Any]], machine: dict[str, Any]) -> "AutoTable":
        """From ``bench.attention.timing_rows`` rows (``kernel_<order>_ms``, ``sdpa_ms``)."""
        if not rows:
            raise ValueError("no timing rows")
        cells = tuple(AutoCell(int(r["size"]), int(r["prefix"]),
                               {o: float(r[f"kernel_{o}_ms"]) for o in KERNEL_PATHS.values()
                                if isinstance(r.get(f"kernel_{o}_ms"), (int, float))},
                               float(r["sdpa_ms"])) for r in rows)
        r0 = rows[0]
        return cls(device_key(device), cells, dict(q=int(r0["heads"]), kv=int(r0["kv_heads"]), head_dim=int(r0["head_dim"])),
                   str(r0["dtype"]), machine)


# ---------------------------------------------------------------------------------------- store
_lock = threading.Lock()
_keys: dict[str, str] = {}
_mkeys: dict[tuple[str, int], measured.MeasureKey] = {}
_tables: dict[str, Optional[AutoTable]] = {}
_choices: dict[tuple[str, int, int, bool], Choice] = {}


def device_key(device: torch.device | str) -> str:
    """``cuda-<GPU name>`` or ``cpu-<CPU model>``: which device a table is for (its file is keyed by
    ``measure_key``: this machine's identity too)."""
    dev = torch.device(device)
    name = str(dev)
    with _lock:
        key = _keys.get(name)
    if key is None:
        if dev.type == "cuda":
            key = "cuda-" + torch.cuda.get_device_name(dev)
        else:
            from ..machine import machine_info

            key = f"{dev.type}-{machine_info().cpu_model}"
        with _lock:
            _keys[name] = key
    return key


def _triton_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:
        return "none"


def measure_key(key: str) -> measured.MeasureKey:
    """The ``measured.MeasureKey`` of device key ``key``'s table on this machine (cached per process and
    torch thread count)."""
    memo = (key, torch.get_num_threads())
    with _lock:
        got = _mkeys.get(memo)
    if got is None:
        got = measured.measure_key("attention", device="cuda" if key.startswith("cuda") else "cpu",
                                   code=[Path(__file__).with_name("triton_kernel.py")],
                                   versions={"triton": _triton_version()}, extra={"device": key})
        with _lock:
            _mkeys[memo] = got
    return got


def table_path(key: str) -> Path:
    """The file of device key ``key``'s table on this machine."""
    return measure_key(key).path


def save_table(table: AutoTable, verdict: Optional[measured.Verdict] = None) -> Optional[Path]:
    """Write ``table`` to the store (replacing this machine's previous one for its device) and forget
    cached lookups; returns the file. With a busy ``verdict`` (``measured.watch`` around the timings)
    nothing is written and None is returned."""
    key = measure_key(table.device_key)
    if not measured.store(key, table.to_dict(), verdict or measured.Verdict(True)):
        return None
    reload()
    return key.path


def load_table(device: torch.device | str) -> Optional[AutoTable]:
    """The device's table on this machine, or None (cached per process; ``reload()`` re-reads)."""
    key = device_key(device)
    mkey = measure_key(key)
    with _lock:
        if mkey.digest in _tables:
            return _tables[mkey.digest]
    try:
        data = measured.load(mkey, strict=True)
        table = AutoTable.from_dict(data) if data is not None else None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{mkey.path}: not an attention auto table ({e}); delete it or rerun `bench attention`") from e
    if table is not None and (table.device_key != key or not table.cells):
        table = None
    with _lock:
        _tables[mkey.digest] = table
    return table


def reload() -> None:
    """Forget loaded tables and cached choices (after a new table was written, or in tests)."""
    with _lock:
        _tables.clear()
        _choices.clear()
        _mkeys.clear()


def rule(device: torch.device) -> Choice:
    """Today's rule without a measurement: the kernel on CUDA, SDPA elsewhere."""
    return "triton" if device.type == "cuda" else "torch"


def choose(device: torch.device | str, n: int, prefix: int, preorder: bool) -> Choice:
    """The backend ``auto`` runs for ``n`` tree tokens after ``prefix`` cached ones on ``device``."""
    dev = torch.device(device)
    key = (device_key(dev), int(n), int(prefix), bool(preorder))
    with _lock:
        hit = _choices.get(key)
    if hit is not None:
        return hit
    table = load_table(dev)
    out = table.choose(n, prefix, preorder) if table is not None else rule(dev)
    with _lock:
        if len(_choices) > 4096:
            _choices.clear()
        _choices[key] = out
    return out


def may_use_kernel(device: torch.device | str) -> bool:
    """Whether ``auto`` can pick the kernel anywhere on ``device`` (then its metadata is worth building)."""
    dev = torch.device(device)
    table = load_table(dev)
    return table.uses_kernel() if table is not None else rule(dev) == "triton"
