"""Which kernel runs each GGUF layer shape at each row count, measured once per machine.

For a layer shape (GGML type, N, K) and M input rows the runtime candidates are:

* ``aten``: torch's weight-only kernel on a re-pack of the weight (``Int4Linear`` for Q4_K: bf16 scales
  and zeros; ``Int8Linear`` for the other types: per-channel int8 requantized from the exact weight);
* ``native_rows``: ``GGMLLinear``'s row kernel on the file's own blocks (``native``);
* ``native_dequant_mm``: ``GGMLLinear`` dequantizing chunks of the weight to float32 for torch's GEMM;
* ``native_q8``: ``GGMLLinear``'s row kernel with int8 activations (Q4_K/Q6_K/Q5_0/Q8_0; llama.cpp's arithmetic);
* ``native_q8_vnni``: the same on AVX-512 VNNI (Q4_K/Q6_K/Q5_0, where the CPU has it and the kernels passed their
  load-time bit-identity check): the same outputs, bit for bit, so it may take any row count;
* ``native_x8``: Q4_K/Q6_K with int8 activations on the rows repacked 8 at a time (``GGMLLinear``'s ``x8``): tiles of
  8 weight rows, its own float arithmetic; ``native_x8_vnni`` the same on AVX-512 VNNI, bit for bit.

``plan_for(shape)`` turns the timings into a layer by the fastest at one row (torch's kernel only when it wins
by more than ``NATIVE_LAYER_MARGIN``), keeping one arithmetic at every M: ``aten`` (today's
``Int4Linear``/``Int8Linear`` at every M), ``native_q8`` (``GGMLLinear`` with int8 activations at every M, on
the VNNI row kernels from ``vnni_min_rows``: the smallest measured M from which they beat the AVX2 ones at every
larger measured M), ``native_x8`` (the same with the x8 layout: chosen over the row kernels where it is faster
at one row and at the largest measured M, its VNNI tile from ``vnni_min_rows`` likewise),
or ``native_rows`` (``GGMLLinear`` in float32, with ``mm_min_rows``: the smallest
measured M from which ``native_dequant_mm`` beats the row kernel at every larger measured M; the two agree
to float32 rounding).

The table is cached as JSON under ``$DYNTREE_CACHE/kernels/`` through ``dyntree_core.measured``, keyed by the
machine (CPU model and flags, CPUs, threads), the torch version, the native kernels' digest, the measuring code
and ``TABLE_VERSION``; shapes not yet in it are measured when first asked for (``measure_for_plan``: one row for
every candidate, torch's kernel only where it could win (``aten_out_of_reach``), more rows only where the float32
row kernel wins; about a second per shape here) or all of them by ``bench kernels``. A shape measured while the
machine was busy (``measured.watch``) is used by this process but not stored (``KernelTable.provisional`` says why):
the next process measures it again.
``table_identity()`` names all of that, and how plans are read from it (``plans_digest``), for the machine
profile's cache key.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from .. import measured
from ..interrupt import check_load
from ..memory_bandwidth import largest_cache_bytes, probe_read
from .native import BLOCKS, native_kernels, native_unavailable_reason
from .native import synthetic_blocks as native_synthetic_blocks

TABLE_VERSION = 7  # 2: native_q8; 3: plans from the fastest of 7 calls (measure_for_plan); 4: native_q8_vnni; 5: x8;
#                   6: M = 2 measured; 7: NATIVE_LAYER_MARGIN 1.0 (plans, so the profiles keyed on it, change)
#: the row counts timed. 2 is there for the VNNI switch (``vnni_min_rows``): a tree step of two nodes is common
#: (suffix trees average 1.6), and without it the table put 85 of the target's 169 x8 layers on their VNNI tile
#: only from 4 rows, while the VNNI tile from 1 row made t(2) 10% faster and left t(1) as it was (Zen 4,
#: ``scripts/vnni_rows_ab.py``: t(2) 29.6 -> 26.7 ms, t(1) ratio 0.999); measuring M = 2, the table took it
#: from 1 row on 126 layers and from 2 on 42, and the same script then found t(2) as fast (ratio 1.004)
DEFAULT_MS: tuple[int, ...] = (1, 2, 4, 16, 64, 256)
#: torch's kernel takes a shape only when it beats the fastest GGML kernel by more than this fraction: a decoder
#: layer whose projections are all ``GGMLLinear`` runs as one C call (``quant.native_layer``), which saved
#: 0.35 ms per layer of the 1.5B target and 0.72 ms per layer of the 0.5B draft on a 2-core AVX2 EPYC, while
#: torch's int8 kernel won the draft's gate/up shape by 4% (0.187 vs 0.196 ms): all-GGML draft t(1) 20.7 ms,
#: mixed 38.0 ms. At 25% the choice still flipped with the measuring noise on the Zen 4 VM: torch's kernel won
#: that shape by 19-53% (in cache, one row) from one table to the next, and where it took it the draft's t(1)
#: was 30.8 against 17.4 ms (1.78x; 4 rounds alternated by process): a layer's glue costs ~0.58 ms there, torch's
#: gate/up saved ~0.05. Only a kernel twice as fast at one row wins a shape from the GGML kernels.
NATIVE_LAYER_MARGIN = 1.0
RUNTIME_CANDIDATES: tuple[str, ...] = ("aten", "native_rows", "native_dequant_mm", "native_q8", "native_q8_vnni",
                                       "native_x8", "native_x8_vnni")
#: GGML types with VNNI row kernels
VNNI_TYPES: tuple[str, ...] = ("Q4_K", "Q6_K", "Q5_0")
#: a candidate slower than this (ms) at some M is not timed at larger M
SLOW_MS = 3000.0
#: seconds of timed calls per kernel and row count (``measured.time_call``'s budget), and in ``measure_for_plan``
#: after the first row count
TIME_BUDGET_S = 2.0
FOLLOW_UP_BUDGET_S = 0.5
#: at the first M, a candidate whose warm-up call takes over this many times the best time so far is timed by that
#: call alone (a 150k-row head's float32 row kernel and dequant+GEMM: 59 and 84 ms against 2.4 ms, 1.2 s of calls)
GIVE_UP = 4.0
#: the most rows an output head is measured at: its rows are a tree's nodes (a prefill keeps the last row's logits
#: only), and a tree of more than 64 nodes does not pay on a CPU; 256 rows of a 150k-row head took ~4 s of the
#: table's first measurement per model
HEAD_MAX_ROWS = 64
#: at one row a layer's x8 tiles and its int8 row kernels read the same bytes (Q6_K's x8 layout is the rows' size),
#: so where the weights come from DRAM both run at the memory's rate, and their one-row times differ by the noise of
#: calls timed seconds apart. Within this fraction at one row the layout faster at the most rows takes the shape.
#: The target's Q6_K head (Zen 4 VM, the 27 stored tables that timed both layouts at 1 and 64 rows): x8 behind the
#: row kernels at one row in 4 of them, by 0.2, 2.4, 5.9% and one outlier at 2.1x, and 1.3-2.1x ahead at 64 rows in
#: all (e.g. 65.8 against 131.3 ms); the old rule (x8 faster at one row) then put the head on the row kernels, and
#: t(32) paid ~35 ms for it. 10% of the head's one-row time is 0.57 ms, 2% of the target's t(1)
X8_ONE_ROW_TIE = 0.10
#: torch's kernel is not timed on a shape whose weights (in its own form) are beyond this many times the largest cache
#: and could not be read in half the best GGML kernel's one-row time (``NATIVE_LAYER_MARGIN``) even at
#: ``ATEN_READ_MARGIN`` x the read bandwidth probed then (``aten_out_of_reach``; a probe the CPUs' contention read
#: decides nothing): building it dequantizes the whole weight (a 152k-row head: 0.9 GB of float32, 1.3-3.1 s of the
#: first load) to time a kernel that cannot win. 2x, as the Zen 4 VM's memory reads ~32 or 50-57 GB/s in spells
#: (docs/CPU_KERNELS.md)
ATEN_OUT_OF_CACHE = 2
ATEN_READ_MARGIN = 2.0
#: the probe's buffer (4x the Zen 4 host's 32 MiB L3)
ATEN_PROBE_BYTES = 128 << 20


@dataclass(frozen=True)
class LayerShape:
    """A GGUF linear: GGML ``type_name`` and the torch weight shape ``[n, k]``."""

    type_name: str
    n: int
    k: int

    @property
    def label(self) -> str:
        return f"{self.type_name} [{self.n}, {self.k}]"

    @classmethod
    def parse(cls, label: str) -> "LayerShape":
        t, _, rest = label.partition(" ")
        n, k = (int(v) for v in rest.strip("[]").split(","))
        return cls(t, n, k)


@dataclass(frozen=True)
class LayerPlan:
    """What a layer of one shape runs: ``kind`` ``aten`` or ``ggml``; for ``ggml`` the row count from which it
    dequantizes for torch's GEMM (0: never), whether it quantizes activations to int8 and, if so, the row count
    from which it runs the VNNI kernels (0: never) and whether its rows are repacked 8 at a time (``x8``)."""

    kind: str
    mm_min_rows: int = 0
    why: str = ""
    int8_activations: bool = False
    vnni_min_rows: int = 0
    x8: bool = False


def synthetic_blocks(shape: LayerShape, seed: int = 0) -> torch.Tensor:
    """``native.synthetic_blocks`` of one shape."""
    return native_synthetic_blocks(shape.type_name, shape.n, shape.k, seed)


def _aten_layer(shape: LayerShape, blocks: torch.Tensor):
    from .ggml_linear import GGMLLinear
    from .linear import Int4Linear, Int8Linear, int4_shape_ok

    dense = GGMLLinear(shape.type_name, blocks, shape.k).dequantized_weight()
    if shape.type_name == "Q4_K" and int4_shape_ok(shape.n, shape.k):
        return Int4Linear.from_dense(dense)
    return Int8Linear.from_dense(dense)


def aten_weight_bytes(shape: LayerShape) -> int:
    """Bytes torch's kernel (``_aten_layer``'s layer) reads of this shape's weight in a forward."""
    from .linear import Int4Linear, Int8Linear, int4_shape_ok

    if shape.type_name == "Q4_K" and int4_shape_ok(shape.n, shape.k):
        return Int4Linear.weight_bytes(shape.n, shape.k)
    return Int8Linear.weight_bytes(shape.n, shape.k)


def aten_beyond_cache(shape: LayerShape, cache_bytes: Optional[int]) -> bool:
    """Whether torch's form of ``shape``'s weight is over ``ATEN_OUT_OF_CACHE`` x ``cache_bytes`` (so read from memory
    at every call); False where the cache size is unknown."""
    return bool(cache_bytes) and aten_weight_bytes(shape) > ATEN_OUT_OF_CACHE * cache_bytes


def aten_out_of_reach(shape: LayerShape, best_ms: float, read_gb_per_s: Optional[float],
                      cache_bytes: Optional[int]) -> Optional[str]:
    """Why torch's kernel cannot take ``shape`` from a GGML kernel that runs one row in ``best_ms`` (None: it might,
    time it): its weights are beyond the cache (``aten_beyond_cache``), and reading them at ``ATEN_READ_MARGIN`` x
    ``read_gb_per_s`` takes at least ``best_ms / (1 + NATIVE_LAYER_MARGIN)``. Unknown bandwidth or cache size: None."""
    if not read_gb_per_s or not aten_beyond_cache(shape, cache_bytes):
        return None
    nbytes = aten_weight_bytes(shape)
    floor_ms = nbytes / (ATEN_READ_MARGIN * read_gb_per_s * 1e6)
    need_ms = best_ms / (1 + NATIVE_LAYER_MARGIN)
    if floor_ms < need_ms:
        return None
    return (f"not timed: at one row it reads {nbytes / 1e6:.0f} MB (> {ATEN_OUT_OF_CACHE}x the {cache_bytes >> 20} MiB "
            f"cache), >= {floor_ms:.2f} ms at {ATEN_READ_MARGIN:g}x the {read_gb_per_s:.1f} GB/s read, and it would "
            f"need < {need_ms:.2f} ms ({best_ms:.2f} / {1 + NATIVE_LAYER_MARGIN:g}) to take the shape")


def x8_takes(shape: LayerShape) -> bool:
    """Whether the x8 layout takes this shape (Q4_K, Q6_K or Q5_0, N a multiple of 8)."""
    from .native import BLOCKS, X8_TYPES

    return shape.type_name in X8_TYPES and shape.n % 8 == 0 and shape.k % BLOCKS[shape.type_name][1] == 0


class ShapeCandidates:
    """The candidate layers of one shape on synthetic blocks, each built once when first timed (a 150k-row head's
    blocks take ~0.5 s to generate and each x8 layout ~0.4 s to repack), then timed as often as asked."""

    def __init__(self, shape: LayerShape):
        self.shape = shape
        self._blocks: Optional[torch.Tensor] = None
        self._layers: dict[str, object] = {}

    @property
    def blocks(self) -> torch.Tensor:
        """The shape's synthetic blocks, in 2 MiB pages as a model's are (``GGMLLinear`` then takes them as they
        are: its four layouts on the file's rows share one buffer, not four copies)."""
        if self._blocks is None:
            from .huge_pages import in_huge_pages

            self._blocks = in_huge_pages(synthetic_blocks(self.shape))
        return self._blocks

    def layer(self, c: str) -> Optional[object]:
        """Candidate ``c``'s layer (None: no such kernel here)."""
        if c not in self._layers:
            self._layers[c] = self._build(c)
        return self._layers[c]

    def _build(self, c: str) -> Optional[object]:
        from .ggml_linear import GGMLLinear
        from .native import INT8_ACTIVATION_TYPES

        shape, nk = self.shape, native_kernels()
        if c == "aten":
            return _aten_layer(shape, self.blocks)
        if nk is None or not c.startswith("native"):
            return None
        if c == "native_q8":
            if shape.type_name not in INT8_ACTIVATION_TYPES:
                return None
            return GGMLLinear(shape.type_name, self.blocks, shape.k, kernels=nk, int8_activations=True)
        if c == "native_q8_vnni":
            if not (nk.vnni and shape.type_name in VNNI_TYPES):
                return None
            layer = GGMLLinear(shape.type_name, self.blocks, shape.k, kernels=nk, int8_activations=True)
            layer.vnni_min_rows = 1
            return layer
        if c in ("native_x8", "native_x8_vnni"):
            if not (x8_takes(shape) and (c == "native_x8" or nk.vnni)):
                return None
            twin = self._layers.get("native_x8" if c == "native_x8_vnni" else "native_x8_vnni")
            blocks = self.blocks if twin is None else twin.blocks  # (the other x8 kernel's tiles: one repack)
            layer = GGMLLinear(shape.type_name, blocks, shape.k, kernels=nk, int8_activations=True, x8=True,
                               out_features=shape.n)
            layer.vnni_min_rows = int(c == "native_x8_vnni")
            return layer
        return GGMLLinear(shape.type_name, self.blocks, shape.k, kernels=nk)

    def time(self, ms: Iterable[int], candidates: Iterable[str] = RUNTIME_CANDIDATES, stat: str = "median",
             budget_s: float = TIME_BUDGET_S, give_up: Optional[float] = None,
             best_so_far: Optional[dict[str, float]] = None) -> dict[str, dict[str, Optional[float]]]:
        """``{candidate: {str(M): ms or None}}`` (``time_rows``); ``give_up``: a candidate whose first call at some M
        takes more than this many times the best time so far there (``best_so_far``: ``{str(M): ms}`` timed before
        this call) is timed by that one call (``time_rows``)."""
        ms = list(ms)
        gen = torch.Generator().manual_seed(1)
        best: dict[str, float] = dict(best_so_far or {})
        out = {}
        with torch.inference_mode():
            for c in candidates:
                check_load()  # (a Run's Stop while its pair's kernels are measured: a head's shape takes ~5 s)
                layer = self.layer(c)
                limits = {str(m): give_up * best[str(m)] for m in ms if give_up and str(m) in best}
                out[c] = got = time_rows(None if layer is None else _runtime_call(c, layer), self.shape.k, ms, gen,
                                         stat, budget_s, limits)
                for m, t in got.items():
                    if t is not None:
                        best[m] = min(best.get(m, t), t)
        return out


def measure_shape(shape: LayerShape, ms: Iterable[int] = DEFAULT_MS,
                  candidates: Iterable[str] = RUNTIME_CANDIDATES, stat: str = "median",
                  budget_s: float = TIME_BUDGET_S) -> dict[str, dict[str, Optional[float]]]:
    """``{candidate: {str(M): ms or None}}`` for one shape (None: not run, e.g. slower than ``SLOW_MS`` at a
    smaller M, or no native kernels here); ``stat``: ``median`` or ``min`` of the timed calls, fewer where they
    would take longer than ``budget_s`` (``time_rows``)."""
    return ShapeCandidates(shape).time(ms, candidates, stat, budget_s)


def _runtime_call(candidate: str, layer) -> Callable[[torch.Tensor], Callable[[], object]]:
    def at(x: torch.Tensor) -> Callable[[], object]:
        if candidate in ("native_rows", "native_q8", "native_q8_vnni", "native_x8", "native_x8_vnni"):
            return lambda: layer.rows(x)
        if candidate == "native_dequant_mm":
            return lambda: layer.dequant_mm(x)
        return lambda: layer(x)

    return at


def time_rows(call: Optional[Callable[[torch.Tensor], Callable[[], object]]], k: int, ms: Iterable[int],
              gen: torch.Generator, stat: str = "median", budget_s: float = TIME_BUDGET_S,
              give_up_ms: Optional[dict[str, float]] = None) -> dict[str, Optional[float]]:
    """``{str(M): ms}`` of ``call(x)()`` for ``x`` of M random rows of ``k`` columns, timed by
    ``measured.time_call`` (``stat``: the median of 5 or the fastest of 7 after a warm-up, fewer where they would
    take longer than ``budget_s``; one where the warm-up took longer than ``give_up_ms[str(M)]``); None at every M
    after one slower than ``SLOW_MS``, and everywhere when ``call`` is None (no such kernel here). The one loop
    over row counts of the table and of ``bench kernels``."""
    out: dict[str, Optional[float]] = {}
    slow = call is None
    for m in ms:
        if slow:
            out[str(m)] = None
            continue
        x = torch.randn(m, k, generator=gen)
        limit = (give_up_ms or {}).get(str(m))
        timing = measured.time_call(call(x), 7 if stat == "min" else 5, budget_s,
                                    give_up_s=None if limit is None else limit / 1e3)
        out[str(m)] = t = timing.min_ms if stat == "min" else timing.median_ms
        slow = t > SLOW_MS
    return out


#: the order candidates are timed in at the first M: the int8 kernels (fastest on every shape measured so far) first,
#: so the others are measured against them (``GIVE_UP``, ``aten_out_of_reach``), torch's kernel last
FIRST_PASS: tuple[str, ...] = ("native_x8_vnni", "native_x8", "native_q8_vnni", "native_q8", "native_rows",
                               "native_dequant_mm")
assert set(FIRST_PASS) | {"aten"} == set(RUNTIME_CANDIDATES)


def measure_for_plan(shape: LayerShape, ms: Iterable[int] = DEFAULT_MS,
                     notes: Optional[dict[str, str]] = None) -> dict[str, dict[str, Optional[float]]]:
    """What ``plan_for`` needs, quickly: every candidate at the first M; the other Ms only where the float32 row
    kernel wins there (they set its switch to ``native_dequant_mm``), where the VNNI kernels ran, for the
    int8-activation kernels (they set ``vnni_min_rows``), and the largest M for the two int8 layouts (the x8
    layout is chosen only where it also wins there); the other plans use one kernel at every M. Where the x8
    layout wins at the first M, the int8 row kernels are timed between the first and the largest M only if they
    win at the largest (their VNNI switch matters only then). After the first M each timing stops at
    ``FOLLOW_UP_BUDGET_S`` (a 150k-row head at 256 rows takes ~0.6 s a call); at the first M a candidate whose
    warm-up call takes over ``GIVE_UP`` x the best so far is timed by that call, and torch's kernel, timed last, is
    not built where ``aten_out_of_reach`` says it cannot win (``notes["aten"]`` says why). Each layer is built once
    (``ShapeCandidates``). Unmeasured entries are None. ``bench kernels`` measures everything."""
    ms = list(ms)
    layers = ShapeCandidates(shape)
    # the fastest of 7 calls: interference (a scheduler quantum on a busy 2-core machine) only adds time
    first = layers.time(ms[:1], FIRST_PASS, "min", give_up=GIVE_UP)
    timed = [v[str(ms[0])] for v in first.values() if v.get(str(ms[0])) is not None]
    why = None
    if timed:
        cache = largest_cache_bytes()
        read = probe_read(ATEN_PROBE_BYTES, samples=3) if aten_beyond_cache(shape, cache) else None  # (~60 ms)
        why = aten_out_of_reach(shape, min(timed), read.gb_per_s if read and not read.contended else None, cache)
    if why is None:
        first.update(layers.time(ms[:1], ("aten",), "min", give_up=GIVE_UP,
                                 best_so_far={str(ms[0]): min(timed)} if timed else None))
    else:
        first["aten"] = {str(ms[0]): None}
        if notes is not None:
            notes["aten"] = why
    out = {c: {**first.get(c, {}), **{str(m): None for m in ms[1:]}} for c in RUNTIME_CANDIDATES}
    got = {c: v[str(ms[0])] for c, v in first.items() if v.get(str(ms[0])) is not None}
    if len(ms) < 2:
        return out

    def more(at: list[int], candidates: tuple[str, ...]) -> None:
        for c, v in layers.time(at, candidates, "min", FOLLOW_UP_BUDGET_S).items():
            out[c].update(v)

    def best(cands: tuple[str, ...], m: int) -> Optional[float]:
        return min((out[c][str(m)] for c in cands if out[c].get(str(m)) is not None), default=None)

    q8s, x8s = ("native_q8", "native_q8_vnni"), ("native_x8", "native_x8_vnni")
    if got and min(got, key=got.get) == "native_rows":
        more(ms[1:], ("native_rows", "native_dequant_mm"))
    if "native_x8_vnni" in got:
        more(ms[1:], x8s)
    if "native_q8_vnni" in got:
        x8_first = best(x8s, ms[0]) is not None and best(x8s, ms[0]) < best(q8s, ms[0])
        more(ms[-1:] if x8_first else ms[1:], q8s)
        last_x8, last_q8 = best(x8s, ms[-1]), best(q8s, ms[-1])
        if x8_first and last_q8 is not None and (last_x8 is None or last_q8 <= last_x8):
            more(ms[1:-1], q8s)  # the row kernels are chosen: their switch rows
    if "native_x8" in got and "native_x8_vnni" not in got:
        more(ms[-1:], ("native_q8", "native_x8"))
    return out


def measure_key() -> measured.MeasureKey:
    """The table's ``measured.MeasureKey``: this machine, torch, the native kernels' digest (or ``no-native``),
    the code that times them and ``TABLE_VERSION``."""
    nk = native_kernels()
    code = (nk.digest if nk is not None else "no-native", synthetic_blocks, _aten_layer, ShapeCandidates, _runtime_call,
            time_rows, measure_for_plan, measured.time_call, Path(__file__).with_name("ggml_linear.py"), HEAD_MAX_ROWS,
            GIVE_UP)
    return measured.measure_key("kernels", code=code, extra={"version": TABLE_VERSION}, prefix="table-")


def table_key() -> str:
    return measure_key().digest


def table_identity() -> str:
    """What the kernels chosen here depend on, for caches of measurements that run them (the machine
    profile): table version, native kernels' digest (or why there are none) and the table key."""
    nk = native_kernels()
    return (f"kt{TABLE_VERSION}-{kernel_policy()}-{nk.digest if nk is not None else 'none'}-{table_key()}-"
            f"{plans_digest()}")


def plans_digest() -> str:
    """A digest of how plans are read from the table (``KernelTable.plan_for``, its rules and their constants): a
    profile measured on other plans is another profile, while the table's timings stay valid. The rest of the class
    (what the table stores) does not change plans."""
    return measured.code_digest((KernelTable.plan_for, KernelTable._last_both, KernelTable._x8_wins,
                                 KernelTable._switch_rows, _best, f"{NATIVE_LAYER_MARGIN} {X8_ONE_ROW_TIE}"))


def table_path(key: Optional[str] = None) -> Path:
    return measure_key().path if key is None else measure_key().path.with_name(f"table-{key}.json")


def _best(m: Optional[str], *cols: dict) -> Optional[float]:
    """The fastest of ``cols`` (candidate timings ``{str(M): ms}``) at M, None where none was measured."""
    return min((c[m] for c in cols if c.get(m) is not None), default=None)


@dataclass
class KernelTable:
    """Per layer shape (``LayerShape.label``): candidate -> {M: ms}; ``provisional``: shapes measured on a busy
    machine (label -> why), used here but never stored."""

    key: str
    machine: dict
    torch: str
    native: Optional[str]
    native_unavailable: Optional[str]
    ms: list[int]
    timings: dict[str, dict[str, dict[str, Optional[float]]]] = field(default_factory=dict)
    version: int = TABLE_VERSION
    provisional: dict[str, str] = field(default_factory=dict)
    #: label -> candidate -> why it was not timed (``measure_for_plan``'s ``notes``)
    not_timed: dict[str, dict[str, str]] = field(default_factory=dict)

    def winners(self, label: str) -> dict[str, Optional[str]]:
        """``{str(M): fastest runtime candidate}`` for one measured shape."""
        t = self.timings[label]
        out = {}
        for m in map(str, self.ms):
            got = {c: t[c][m] for c in RUNTIME_CANDIDATES if c in t and t[c].get(m) is not None}
            out[m] = min(got, key=got.get) if got else None
        return out

    def plan_for(self, shape: LayerShape) -> LayerPlan:
        t = self.timings[shape.label]
        rows = t.get("native_rows", {})
        aten = t.get("aten", {})
        one = str(self.ms[0])
        if rows.get(one) is None:
            return LayerPlan("aten", 0, f"no native kernels ({self.native_unavailable})")
        q8, vnni = t.get("native_q8", {}), t.get("native_q8_vnni", {})
        int8_one = _best(one, q8, vnni)
        ggml_ms, best = min((v, c) for c, v in (("native_rows", rows[one]), ("native_q8", int8_one)) if v is not None)
        if aten.get(one) is not None and aten[one] * (1 + NATIVE_LAYER_MARGIN) < ggml_ms:
            return LayerPlan("aten", 0, f"torch's kernel {aten[one]:.3f} ms < native {ggml_ms:.3f} ms / "
                                        f"{1 + NATIVE_LAYER_MARGIN:g} at {one} row")
        if best == "native_q8":
            x8, x8v = t.get("native_x8", {}), t.get("native_x8_vnni", {})
            if self._x8_wins(q8, vnni, x8, x8v):
                vnni_rows = self._switch_rows(x8v, x8)
                last = self._last_both(q8, vnni, x8, x8v)
                x8_one, x8_last = _best(one, x8, x8v), _best(last, x8, x8v)
                at_one = ("<" if x8_one < int8_one else f"within {X8_ONE_ROW_TIE:.0%} of")
                return LayerPlan("ggml", 0, f"x8 tiles {x8_one:.3f} ms {at_one} int8 rows {int8_one:.3f} ms at {one} "
                                            f"row and {x8_last:.3f} < {_best(last, q8, vnni):.3f} ms at {last} rows "
                                            f"(used at every M)"
                                 + (f"; AVX-512 VNNI from {vnni_rows} rows" if vnni_rows else ""),
                                 int8_activations=True, vnni_min_rows=vnni_rows, x8=True)
            vnni_rows = self._switch_rows(vnni, q8)
            return LayerPlan("ggml", 0, f"int8-activation kernel {int8_one:.3f} ms < float32 {rows[one]:.3f} ms at "
                                        f"{one} row (used at every M)"
                             + (f"; AVX-512 VNNI from {vnni_rows} rows" if vnni_rows else ""),
                             int8_activations=True, vnni_min_rows=vnni_rows)
        threshold = self._switch_rows(t.get("native_dequant_mm", {}), rows)
        return LayerPlan("ggml", threshold, f"native {rows[one]:.3f} ms at {one} row"
                         + (f"; dequant+GEMM from {threshold} rows" if threshold else ""))

    def _last_both(self, q8: dict, vnni: dict, x8: dict, x8v: dict) -> Optional[str]:
        """The largest M measured for both int8 layouts (None: none)."""
        both = [m for m in map(str, self.ms) if _best(m, x8, x8v) is not None and _best(m, q8, vnni) is not None]
        return both[-1] if both else None

    def _x8_wins(self, q8: dict, vnni: dict, x8: dict, x8v: dict) -> bool:
        """The x8 layout (the faster of its two kernels at each M) is faster than the int8 row kernels (likewise) at
        the largest M measured for both and at one row no slower than ``X8_ONE_ROW_TIE`` allows: one arithmetic
        serves every M, so it must pay for trees and keep plain decoding's price."""
        one, last = str(self.ms[0]), self._last_both(q8, vnni, x8, x8v)
        if last is None or _best(one, x8, x8v) is None or _best(one, q8, vnni) is None:
            return False
        return (_best(one, x8, x8v) <= _best(one, q8, vnni) * (1 + X8_ONE_ROW_TIE)
                and _best(last, x8, x8v) < _best(last, q8, vnni))

    def _switch_rows(self, new: dict[str, Optional[float]], old: dict[str, Optional[float]]) -> int:
        """The smallest measured M from which ``new`` is faster than ``old`` at every larger measured M (0: none);
        the largest Ms where neither was measured (an output head's, above ``HEAD_MAX_ROWS``) are not in the walk."""
        threshold, started = 0, False
        for m in reversed(self.ms):
            a, b = new.get(str(m)), old.get(str(m))
            if not started and a is None and b is None:
                continue
            started = True
            if a is None or b is None or a >= b:
                break
            threshold = m
        return threshold

    def stored(self) -> dict:
        """What is stored: every shape measured on a quiet machine."""
        d = asdict(self)
        d.pop("provisional")
        d["timings"] = {k: v for k, v in self.timings.items() if k not in self.provisional}
        d["not_timed"] = {k: v for k, v in self.not_timed.items() if k not in self.provisional}
        return d


def save_table(table: KernelTable) -> Path:
    """Store ``table``'s quiet shapes (atomically) under this machine's key; returns the file."""
    key = measure_key()
    measured.store(key, table.stored(), measured.Verdict(True))
    return key.path


def _new_table(key: str) -> KernelTable:
    from ..machine import machine_info

    nk = native_kernels()
    return KernelTable(key, machine_info().to_dict(), torch.__version__, nk.digest if nk is not None else None,
                       native_unavailable_reason(), list(DEFAULT_MS))


def load_table() -> KernelTable:
    """This machine's cached table (an empty one when none is cached or the cache is unreadable)."""
    key = measure_key()
    data = measured.load(key)
    if isinstance(data, dict) and data.get("version") == TABLE_VERSION and data.get("key") == key.digest:
        try:
            return KernelTable(**data)
        except TypeError:
            pass
    return _new_table(key.digest)


def ensure_shapes(shapes: Iterable[LayerShape], progress: Optional[Callable[[str], None]] = None,
                  heads: Iterable[LayerShape] = ()) -> KernelTable:
    """The table with every shape in ``shapes`` measured: missing ones are measured now and stored when the
    machine was quiet while they ran; a shape measured on a busy machine is in the table returned, marked in
    ``provisional`` with the reason, and not stored. ``heads``: shapes used only as an output head, measured up
    to ``HEAD_MAX_ROWS`` rows."""
    heads = set(heads)
    table = load_table()
    missing = sorted({s for s in shapes if s.type_name in BLOCKS and s.label not in table.timings},
                     key=lambda s: s.label)
    quiet = 0
    try:
        for i, s in enumerate(missing, 1):
            if progress:
                progress(f"  measuring this machine's kernels for {s.label} ({i}/{len(missing)}, once per machine)")
            notes: dict[str, str] = {}
            with measured.watch() as w:
                table.timings[s.label] = measure_for_plan(
                    s, [m for m in table.ms if s not in heads or m <= HEAD_MAX_ROWS], notes)
            if notes:
                table.not_timed[s.label] = notes
            verdict = w.verdict()
            if verdict.quiet:
                quiet += 1
            else:
                table.provisional[s.label] = verdict.reason
                if progress:
                    progress(f"  {s.label}: provisional, not stored ({verdict.reason})")
    finally:  # (a stopped load keeps the shapes it finished: ``interrupt.LoadStopped`` from ``ShapeCandidates.time``)
        if quiet:
            save_table(table)
    return table


#: ``DYNTREE_KERNELS``: ``table`` (default: the measured winners), ``aten`` (torch's kernels everywhere, as
#: before the table), ``native`` (the float32 row kernel at every M), ``native_mm`` (dequant + GEMM at every
#: M > 1), ``native_q8`` (int8 activations at every M where the type has them, else ``native``; AVX2 row
#: kernels), ``native_q8_vnni`` (``native_q8`` on the VNNI row kernels at every M where they run), ``native_x8``
#: (``native_q8`` with the x8 layout wherever it takes the shape; AVX2 tiles)
POLICIES: tuple[str, ...] = ("table", "aten", "native", "native_mm", "native_q8", "native_q8_vnni", "native_x8")


def kernel_policy() -> str:
    policy = os.environ.get("DYNTREE_KERNELS", "table")
    if policy not in POLICIES:
        raise ValueError(f"DYNTREE_KERNELS must be one of {', '.join(POLICIES)}, got {policy!r}")
    return policy


def layer_plans(shapes: Iterable[LayerShape], progress: Optional[Callable[[str], None]] = None,
                heads: Iterable[LayerShape] = ()) -> dict[LayerShape, LayerPlan]:
    """``plan_for`` of each shape (measuring those not yet in this machine's table; ``heads`` as in
    ``ensure_shapes``) under ``kernel_policy()``. Without native kernels every shape is ``aten`` and nothing is
    measured."""
    shapes = list(shapes)
    policy = kernel_policy()
    if policy == "aten" or native_kernels() is None:
        why = "DYNTREE_KERNELS=aten" if policy == "aten" else f"no native kernels ({native_unavailable_reason()})"
        return {s: LayerPlan("aten", 0, why) for s in shapes}
    if policy in ("native", "native_mm", "native_q8", "native_q8_vnni", "native_x8"):
        from .native import INT8_ACTIVATION_TYPES

        rows = 2 if policy == "native_mm" else 0
        int8 = policy.startswith("native_q8") or policy == "native_x8"
        return {s: (LayerPlan("ggml", rows, f"DYNTREE_KERNELS={policy}", int8 and s.type_name in INT8_ACTIVATION_TYPES,
                              int(policy == "native_q8_vnni"), x8=policy == "native_x8" and x8_takes(s))
                    if s.type_name in BLOCKS else LayerPlan("aten", 0, "type without a native kernel")) for s in shapes}
    table = ensure_shapes(shapes, progress, heads)
    return {s: (table.plan_for(s) if s.type_name in BLOCKS else LayerPlan("aten", 0, "type without a native kernel"))
            for s in shapes}
