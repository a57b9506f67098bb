"""The native GGML block kernels (``quant.native``), ``GGMLLinear``, the kernel table and a tiny GGUF model
built on them: every weight is the gguf package's dequantization, products agree with float32 up to the
order of sums, and the loader puts each layer on the kernel the table chose."""

from __future__ import annotations

import json
import time
from typing import Optional

import numpy as np
import pytest
import torch

from dyntree_core.quant import kernel_table as kt
from dyntree_core.quant.ggml_linear import GGMLLinear, row_bytes
from dyntree_core.quant.native import BLOCKS, native_kernels, native_unavailable_reason, reset_native_kernels

TYPES = tuple(BLOCKS)


@pytest.fixture(scope="module")
def nk():
    got = native_kernels()
    if got is None:  # the project's machines have AVX2 and gcc; say so loudly where they do not
        pytest.fail(f"native kernels unavailable: {native_unavailable_reason()}")
    return got


def _blocks(type_name: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    return kt.synthetic_blocks(kt.LayerShape(type_name, n, k), seed)


def _reference(type_name: str, blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(blocks.numpy(), GGMLQuantizationType[type_name]).reshape(n, k).astype(np.float32))


@pytest.mark.parametrize("type_name", TYPES)
def test_dequantize_is_bit_identical_to_the_gguf_package(nk, type_name):
    n, k = 24, 512
    blocks = _blocks(type_name, n, k, seed=1)
    ref = _reference(type_name, blocks, n, k)
    assert torch.isfinite(ref).all() and ref.abs().max() > 0
    assert torch.equal(nk.dequantize(type_name, blocks, n, k), ref)


@pytest.mark.parametrize("type_name", TYPES)
def test_both_ways_of_multiplying_agree_with_the_float64_product(nk, type_name):
    n, k = 40, 768
    blocks = _blocks(type_name, n, k, seed=2)
    w = _reference(type_name, blocks, n, k).double()
    bias = torch.randn(n)
    layer = GGMLLinear(type_name, blocks, k, bias, kernels=nk)
    for m in (1, 2, 3, 5, 9):  # row blocks of 4, 2 and 1
        x = torch.randn(m, k)
        expect = x.double() @ w.t() + bias.double()
        tol = 1e-5 * (x.double().abs() @ w.abs().t()).max().item()
        for got in (layer.rows(x), layer.dequant_mm(x), layer(x)):
            assert got.shape == (m, n) and got.dtype == torch.float32
            assert (got.double() - expect).abs().max().item() <= tol
    # rows do not see each other: a row's output is the same alone and in a batch
    x = torch.randn(6, k)
    assert torch.equal(layer.rows(x)[4:5], layer.rows(x[4:5].clone()))


@pytest.mark.parametrize("type_name", TYPES)
def test_int8_activations_err_by_at_most_the_activation_rounding_and_rows_stay_independent(nk, type_name):
    n, k = 50, 768  # 50: decoding takes weight rows four at a time, and two are left over
    blocks = _blocks(type_name, n, k, seed=4)
    w = _reference(type_name, blocks, n, k).double()
    bias = torch.randn(n)
    layer = GGMLLinear(type_name, blocks, k, bias, kernels=nk, int8_activations=True)
    x = torch.randn(7, k)
    x[2] = 0.0  # an all-zero row quantizes to zeros
    got = layer(x)
    expect = x.double() @ w.t() + bias.double()
    # each activation moves by at most half its block's step d = max|x| / 127 (blocks of 256 for the K-quants,
    # of 32 for Q5_0/Q8_0)
    blk = 256 if type_name.endswith("_K") else 32
    d = x.double().abs().reshape(7, -1, blk).amax(-1) / 127
    bound = (w.abs().reshape(n, -1, blk).sum(-1) @ (d / 2).t()).t() + 1e-4 * (x.double().abs() @ w.abs().t())
    assert ((got.double() - expect).abs() <= bound).all()
    assert torch.equal(got[2], bias)
    assert (got.double() - expect).abs().max() > 1e-6  # the activations really are rounded
    for m in (1, 2, 3, 5):  # the same arithmetic for every batch size
        assert torch.equal(layer(x[:m].clone())[m - 1], got[m - 1])


def test_forward_reshapes_casts_and_picks_dequant_mm_from_its_threshold(nk, monkeypatch):
    k, n = 256, 32
    layer = GGMLLinear("Q4_K", _blocks("Q4_K", n, k), k, kernels=nk)
    calls = []
    monkeypatch.setattr(layer, "rows", lambda x2: calls.append(("rows", x2.shape[0])) or torch.zeros(x2.shape[0], n))
    monkeypatch.setattr(layer, "dequant_mm", lambda x2: calls.append(("mm", x2.shape[0])) or torch.zeros(x2.shape[0], n))
    layer.mm_min_rows = 4
    y = layer(torch.randn(1, 3, k, dtype=torch.bfloat16))
    assert y.shape == (1, 3, n) and y.dtype == torch.bfloat16
    layer(torch.randn(2, 2, k))
    layer.mm_min_rows = 0
    layer(torch.randn(k, 64).t())  # not contiguous: made so, then the row kernel
    assert calls == [("rows", 3), ("mm", 4), ("rows", 64)]


@pytest.mark.parametrize("int8_activations", [False, True])
def test_the_fast_path_is_the_row_kernel(nk, int8_activations):
    k, n = 512, 48
    layer = GGMLLinear("Q4_K", _blocks("Q4_K", n, k, seed=7), k, torch.randn(n), kernels=nk,
                       int8_activations=int8_activations)
    x = torch.randn(2, 3, k)
    got = layer(x)  # float32, contiguous: one direct C call
    assert got.shape == (2, 3, n) and torch.equal(got, layer.rows(x.reshape(6, k)).reshape(2, 3, n))


def test_bad_shapes_and_types_are_refused(nk):
    with pytest.raises(ValueError, match="Q4_K rows need"):
        row_bytes("Q4_K", 100)
    with pytest.raises(ValueError, match="must be uint8"):
        GGMLLinear("Q4_K", torch.zeros(4, 10, dtype=torch.uint8), 256, kernels=nk)
    with pytest.raises(ValueError, match="takes"):
        GGMLLinear("Q2_K", torch.zeros(4, 10, dtype=torch.uint8), 256, kernels=nk)


def test_native_kernels_can_be_turned_off_and_then_every_layer_stays_on_torch(monkeypatch):
    monkeypatch.setenv("DYNTREE_NATIVE_KERNELS", "0")
    reset_native_kernels()
    try:
        assert native_kernels() is None and "DYNTREE_NATIVE_KERNELS=0" in native_unavailable_reason()
        plans = kt.layer_plans([kt.LayerShape("Q4_K", 32, 256)])
        assert [p.kind for p in plans.values()] == ["aten"]
    finally:
        monkeypatch.delenv("DYNTREE_NATIVE_KERNELS")
        reset_native_kernels()


def _table(timings: dict, ms: tuple[int, ...] = (1, 4, 16, 64)) -> kt.KernelTable:
    return kt.KernelTable("k", {}, torch.__version__, "d", None, list(ms), timings)


def test_plan_takes_torchs_kernel_when_it_wins_at_one_row_and_dequant_mm_from_where_it_keeps_winning():
    s = kt.LayerShape("Q4_K", 8, 256)
    rows = {"1": 1.0, "4": 2.0, "16": 6.0, "64": 20.0}
    table = _table({s.label: {"aten": {"1": 0.4, "4": 1.0, "16": 3.0, "64": 9.0}, "native_rows": rows,
                              "native_dequant_mm": {"1": 5.0, "4": 5.0, "16": 5.5, "64": 8.0}}})
    assert table.plan_for(s).kind == "aten"
    assert table.winners(s.label) == {"1": "aten", "4": "aten", "16": "aten", "64": "native_dequant_mm"}
    table.timings[s.label]["aten"] = {"1": 2.0, "4": 3.0, "16": 9.0, "64": 30.0}
    assert table.plan_for(s) == kt.LayerPlan("ggml", 16, table.plan_for(s).why)
    # int8 activations fastest at one row: used at every M (no switch to the float32 GEMM)
    table.timings[s.label]["native_q8"] = {"1": 0.8, "4": 2.5, "16": 7.0, "64": 25.0}
    assert (table.plan_for(s).kind, table.plan_for(s).mm_min_rows, table.plan_for(s).int8_activations) == ("ggml", 0, True)
    # torch's kernel ahead by less than NATIVE_LAYER_MARGIN: the GGML kernel keeps the layer one C call
    table.timings[s.label]["aten"] = {"1": 0.8 / (1 + kt.NATIVE_LAYER_MARGIN) * 1.01, "4": 1.0, "16": 3.0, "64": 9.0}
    assert table.plan_for(s).int8_activations
    table.timings[s.label]["aten"]["1"] = 0.8 / (1 + kt.NATIVE_LAYER_MARGIN) * 0.99
    assert table.plan_for(s).kind == "aten"
    table.timings[s.label]["aten"] = {"1": 2.0, "4": 3.0, "16": 9.0, "64": 30.0}
    del table.timings[s.label]["native_q8"]
    # the Zen 4 VM's draft gate/up, one table's timings: torch's int8 kernel 1.37x faster in cache at one row
    # would cost the draft its C layers (t(1) 30.8 against 17.4 ms): the GGML kernel keeps it
    g = kt.LayerShape("Q5_0", 4864, 896)
    table.timings[g.label] = {"aten": {"1": 0.1297}, "native_rows": {"1": 1.8677}, "native_q8": {"1": 0.1775}}
    assert (table.plan_for(g).kind, table.plan_for(g).int8_activations) == ("ggml", True)
    # a win at 4 rows that is lost again at 16 does not count: the threshold is where it keeps winning
    table.timings[s.label]["native_dequant_mm"] = {"1": 5.0, "4": 1.5, "16": 7.0, "64": 8.0}
    assert table.plan_for(s).mm_min_rows == 64


def test_policies_force_a_kernel_and_unknown_ones_are_refused(monkeypatch, nk):
    shapes = [kt.LayerShape("Q6_K", 16, 256), kt.LayerShape("F16", 16, 256)]
    monkeypatch.setenv("DYNTREE_KERNELS", "native_mm")
    got = kt.layer_plans(shapes)
    assert (got[shapes[0]].kind, got[shapes[0]].mm_min_rows, got[shapes[1]].kind) == ("ggml", 2, "aten")
    monkeypatch.setenv("DYNTREE_KERNELS", "native_q8")
    got = kt.layer_plans(shapes + [kt.LayerShape("Q8_0", 16, 256)])
    assert [p.int8_activations for p in got.values()] == [True, False, True]
    monkeypatch.setenv("DYNTREE_KERNELS", "aten")
    assert {p.kind for p in kt.layer_plans(shapes).values()} == {"aten"}
    assert "-aten-" in kt.table_identity()
    monkeypatch.setenv("DYNTREE_KERNELS", "fastest")
    with pytest.raises(ValueError, match="DYNTREE_KERNELS"):
        kt.layer_plans(shapes)


def test_the_table_is_measured_once_and_read_back_from_the_cache(monkeypatch, tmp_path, nk):
    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path))
    measured = []

    def fake_measure(self, ms=kt.DEFAULT_MS, candidates=kt.RUNTIME_CANDIDATES, stat="median", budget_s=2.0,
                     give_up=None, best_so_far=None):
        measured.append(self.shape.label)
        return {"aten": {str(m): 2.0 * m for m in ms}, "native_rows": {str(m): 1.0 * m for m in ms},
                "native_dequant_mm": {str(m): 50.0 for m in ms}, "native_q8": {str(m): None for m in ms}}

    monkeypatch.setattr(kt.ShapeCandidates, "time", fake_measure)
    s = kt.LayerShape("Q4_K", 16, 256)
    first = kt.layer_plans([s])
    again = kt.layer_plans([s])
    # one row for the GGML kernels, then torch's, then the other rows for the float32 row kernel (it won at one row)
    assert measured == [s.label] * 3 and first == again
    assert first[s].kind == "ggml" and first[s].mm_min_rows == 64
    saved = json.loads(kt.table_path().read_text())
    assert saved["digest"] == kt.table_key() and saved["verdict"]["quiet"]
    saved = saved["value"]
    assert saved["key"] == kt.table_key() and s.label in saved["timings"] and saved["machine"]["cpu_model"]


def test_a_shape_measured_on_a_busy_machine_is_used_but_not_stored(monkeypatch, tmp_path, nk):
    from dyntree_core import measured

    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path))
    measured_shapes = []

    def fake_measure(self, ms=kt.DEFAULT_MS, candidates=kt.RUNTIME_CANDIDATES, stat="median", budget_s=2.0,
                     give_up=None, best_so_far=None):
        measured_shapes.append(self.shape.label)
        return {c: {str(m): 1.0 for m in ms} for c in candidates}

    monkeypatch.setattr(kt.ShapeCandidates, "time", fake_measure)
    monkeypatch.setattr(measured, "busy_detector", lambda w: "busy: simulated load")
    s, msgs = kt.LayerShape("Q4_K", 16, 256), []
    table = kt.ensure_shapes([s], msgs.append)
    assert s.label in table.timings and "simulated" in table.provisional[s.label] and any("provisional" in m for m in msgs)
    assert not kt.table_path().exists()
    monkeypatch.setattr(measured, "busy_detector", lambda w: None)
    n = len(measured_shapes)
    table = kt.ensure_shapes([s])  # measured again, now stored
    assert len(measured_shapes) > n and not table.provisional and kt.table_path().exists()
    assert s.label in kt.load_table().timings


def test_measure_for_plan_times_more_rows_only_where_the_float32_kernel_wins(monkeypatch):
    calls = []

    def fake(self, ms=kt.DEFAULT_MS, candidates=kt.RUNTIME_CANDIDATES, stat="median", budget_s=2.0, give_up=None,
             best_so_far=None):
        calls.append((tuple(ms), tuple(candidates), stat))
        fast = {"aten": 3.0, "native_rows": 2.0, "native_dequant_mm": 9.0, "native_q8": 1.0}  # no VNNI here
        return {c: {str(m): fast[c] * m if c in fast else None for m in ms} for c in candidates}

    monkeypatch.setattr(kt.ShapeCandidates, "time", fake)
    got = kt.measure_for_plan(kt.LayerShape("Q4_K", 8, 256), (1, 4, 16))
    assert calls == [((1,), kt.FIRST_PASS, "min"), ((1,), ("aten",), "min")]  # int8 activations won: nothing more
    assert got["native_q8"] == {"1": 1.0, "4": None, "16": None}
    plan = _table({"Q4_K [8, 256]": got}).plan_for(kt.LayerShape("Q4_K", 8, 256))
    assert plan.int8_activations and plan.vnni_min_rows == 0


def test_vnni_rows_start_where_the_vnni_kernels_win_at_every_larger_row_count(monkeypatch):
    """Where the VNNI row kernels ran, both int8 kernels are timed at every M and the plan switches to VNNI from
    the smallest M from which it wins at every larger one (here: slower at 1 row, faster from 4)."""
    calls = []

    def fake(self, ms=kt.DEFAULT_MS, candidates=kt.RUNTIME_CANDIDATES, stat="median", budget_s=2.0, give_up=None,
             best_so_far=None):
        calls.append((tuple(ms), tuple(candidates)))
        per_row = {"aten": 3.0, "native_rows": 2.0, "native_dequant_mm": 9.0, "native_q8": 1.0, "native_q8_vnni": 0.5}
        return {c: {str(m): (1.1 if c == "native_q8_vnni" and m == 1 else per_row[c] * m if c in per_row else None)
                    for m in ms} for c in candidates}  # (no x8 kernel for this shape here)

    monkeypatch.setattr(kt.ShapeCandidates, "time", fake)
    shape = kt.LayerShape("Q4_K", 8, 256)
    got = kt.measure_for_plan(shape, (1, 4, 16))
    assert calls == [((1,), kt.FIRST_PASS), ((1,), ("aten",)), ((4, 16), ("native_q8", "native_q8_vnni"))]
    plan = _table({shape.label: got}, (1, 4, 16)).plan_for(shape)
    assert plan.int8_activations and plan.vnni_min_rows == 4 and "VNNI from 4 rows" in plan.why
    got["native_q8_vnni"]["16"] = 99.0  # slower at the largest M: never switch
    assert _table({shape.label: got}, (1, 4, 16)).plan_for(shape).vnni_min_rows == 0
    got["native_q8_vnni"] = {"1": 0.9, "4": 2.0, "16": 8.0}  # faster everywhere: from one row
    assert _table({shape.label: got}, (1, 4, 16)).plan_for(shape).vnni_min_rows == 1


def test_an_output_head_is_measured_up_to_the_rows_a_tree_gives_it(monkeypatch, tmp_path):
    """A head's rows are a tree's nodes (a prefill keeps the last row's logits): ``ensure_shapes`` measures a shape
    used only as a head up to ``HEAD_MAX_ROWS``, other shapes at every M; the head's switch rows come from the Ms
    it was measured at (the unmeasured largest ones are not a loss for the VNNI tile)."""
    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path))
    asked = {}

    def fake(self, ms=kt.DEFAULT_MS, candidates=kt.RUNTIME_CANDIDATES, stat="median", budget_s=2.0, give_up=None,
             best_so_far=None):
        asked.setdefault(self.shape.label, set()).update(ms)
        per_row = {"aten": 30.0, "native_rows": 20.0, "native_dequant_mm": 90.0, "native_q8": 1.0,
                   "native_q8_vnni": 0.9, "native_x8": 0.5, "native_x8_vnni": 0.4}
        return {c: {str(m): per_row[c] * m for m in ms} for c in candidates}

    monkeypatch.setattr(kt.ShapeCandidates, "time", fake)
    head, layer = kt.LayerShape("Q6_K", 151936, 256), kt.LayerShape("Q4_K", 256, 256)
    plans = kt.layer_plans([head, layer], heads=[head])
    assert kt.HEAD_MAX_ROWS == 64
    assert asked[head.label] == {m for m in kt.DEFAULT_MS if m <= 64} and asked[layer.label] == set(kt.DEFAULT_MS)
    assert plans[head].x8 and plans[head].vnni_min_rows == 1 and plans[layer].vnni_min_rows == 1
    assert kt.load_table().timings[head.label]["native_x8"].keys() == {"1", "2", "4", "16", "64"}


def test_a_candidate_far_behind_at_one_row_is_timed_by_one_call_and_each_layer_is_built_once(monkeypatch, nk):
    """``measure_for_plan``'s first pass gives up on a candidate whose warm-up call is over ``GIVE_UP`` x the best so
    far (one timed call, not seven); its follow-ups time the layers the first pass built."""
    from dyntree_core import measured

    calls = []
    real = measured.time_call

    def spy(fn, repeats=5, budget_s=2.0, warmup=1, give_up_s=None):
        out = real(fn, repeats, budget_s, warmup, give_up_s)
        calls.append((give_up_s, out.samples))
        return out

    assert real(lambda: time.sleep(0.002), 7, 2.0, 1, give_up_s=0.001).samples == 1
    assert real(lambda: None, 7, 2.0, 1, give_up_s=0.001).samples == 7
    monkeypatch.setattr(measured, "time_call", spy)
    shape = kt.LayerShape("Q4_K", 64, 256)
    kt.ShapeCandidates(shape).time((1,), stat="min", give_up=kt.GIVE_UP)
    assert calls[0][0] is None and calls[1:] and all(g is not None for g, _ in calls[1:])  # (a limit after the first)
    built = []
    monkeypatch.setattr(kt.ShapeCandidates, "_build", lambda self, c, b=kt.ShapeCandidates._build: (
        built.append(c), b(self, c))[1])
    got = kt.measure_for_plan(shape, (1, 4, 16))
    assert sorted(built) == sorted(kt.RUNTIME_CANDIDATES)  # (follow-ups reuse them)
    assert got["aten"]["1"] is not None


def test_measure_shape_times_every_candidate(nk):
    got = kt.measure_shape(kt.LayerShape("Q4_K", 16, 256), ms=(1, 3))
    assert set(got) == set(kt.RUNTIME_CANDIDATES)
    here = [c for c in kt.RUNTIME_CANDIDATES if not c.endswith("_vnni") or nk.vnni]  # VNNI: only where it runs
    assert all(v is not None and v > 0 for c in here for v in got[c].values())
    assert all(v is None for c in set(kt.RUNTIME_CANDIDATES) - set(here) for v in got[c].values())
    q8_0 = kt.measure_shape(kt.LayerShape("Q8_0", 16, 64), ms=(1,))  # no VNNI or x8 kernel for Q8_0
    assert all(q8_0[c]["1"] > 0 for c in kt.RUNTIME_CANDIDATES if c not in ("native_q8_vnni", "native_x8",
                                                                              "native_x8_vnni"))
    assert q8_0["native_q8_vnni"]["1"] is None and q8_0["native_x8"]["1"] is None


@pytest.mark.parametrize("vnni", [False, True])
def test_measure_for_plan_times_the_x8_layout_at_the_most_rows_or_with_its_vnni_tile_at_every_row_count(
        monkeypatch, vnni):
    """The x8 layout serves every M, so the plan needs it beside the row kernels at the largest M as well (and, where
    its VNNI tile ran, both x8 kernels at every M for the switch)."""
    calls = []

    def fake(self, ms=kt.DEFAULT_MS, candidates=kt.RUNTIME_CANDIDATES, stat="median", budget_s=2.0, give_up=None,
             best_so_far=None):
        calls.append((tuple(ms), tuple(candidates)))
        per_row = {"aten": 3.0, "native_rows": 2.0, "native_dequant_mm": 9.0, "native_q8": 1.0, "native_x8": 0.5,
                   **({"native_x8_vnni": 0.4} if vnni else {})}
        return {c: {str(m): per_row[c] * m if c in per_row else None for m in ms} for c in candidates}

    monkeypatch.setattr(kt.ShapeCandidates, "time", fake)
    shape = kt.LayerShape("Q4_K", 8, 256)
    got = kt.measure_for_plan(shape, (1, 4, 16))
    more = ((4, 16), ("native_x8", "native_x8_vnni")) if vnni else ((16,), ("native_q8", "native_x8"))
    assert calls == [((1,), kt.FIRST_PASS), ((1,), ("aten",)), more]
    plan = _table({shape.label: got}, (1, 4, 16)).plan_for(shape)
    assert plan.x8 and plan.int8_activations and plan.vnni_min_rows == (1 if vnni else 0), plan


@pytest.mark.parametrize("x8_at_most_rows", [True, False])
def test_where_x8_wins_at_one_row_the_int8_rows_are_timed_between_only_if_they_win_at_the_most_rows(
        monkeypatch, x8_at_most_rows):
    """Both int8 layouts on VNNI: the x8 pair at every M (its VNNI switch), the row kernels at the largest M only
    (for ``_x8_wins``), and at the Ms between only where they beat x8 there (then their own VNNI switch is used).
    Every timing after the first M has ``FOLLOW_UP_BUDGET_S`` (a 150k-row head at 256 rows: ~0.6 s a call; the
    draft's Q5_0 head went from 19 to 12 s of measuring)."""
    calls = []

    def fake(self, ms=kt.DEFAULT_MS, candidates=kt.RUNTIME_CANDIDATES, stat="median", budget_s=2.0, give_up=None,
             best_so_far=None):
        calls.append((tuple(ms), tuple(candidates), budget_s))
        per_row = {"aten": 3.0, "native_rows": 2.0, "native_dequant_mm": 9.0, "native_q8": 1.0, "native_q8_vnni": 0.9,
                   "native_x8": 0.5, "native_x8_vnni": 0.4}

        def t(c, m):
            slope = 0.2 if (c.startswith("native_q8") and not x8_at_most_rows) else per_row[c]
            return per_row[c] + slope * (m - 1)

        return {c: {str(m): t(c, m) for m in ms} for c in candidates}

    monkeypatch.setattr(kt.ShapeCandidates, "time", fake)
    shape = kt.LayerShape("Q4_K", 8, 256)
    got = kt.measure_for_plan(shape, (1, 4, 16))
    q8s, x8s, follow = ("native_q8", "native_q8_vnni"), ("native_x8", "native_x8_vnni"), kt.FOLLOW_UP_BUDGET_S
    expect = [((1,), kt.FIRST_PASS, kt.TIME_BUDGET_S), ((1,), ("aten",), kt.TIME_BUDGET_S), ((4, 16), x8s, follow),
              ((16,), q8s, follow)]
    if not x8_at_most_rows:
        expect.append(((4,), q8s, follow))
    assert calls == expect
    plan = _table({shape.label: got}, (1, 4, 16)).plan_for(shape)
    assert plan.x8 == x8_at_most_rows and plan.vnni_min_rows == 1, plan


@pytest.mark.parametrize("x8_at_one_row, takes_x8", [(5.681, True), (5.671 * (1 + kt.X8_ONE_ROW_TIE) * 1.01, False)])
def test_a_one_row_tie_goes_to_the_layout_faster_at_the_most_rows(x8_at_one_row, takes_x8):
    """The target's Q6_K head as one table measured it (ms): at one row the x8 tiles 0.2% behind the row kernels (the
    same bytes from DRAM: a tie), at 64 rows 2.0x ahead. Within ``X8_ONE_ROW_TIE`` the x8 layout takes it; beyond,
    the rows keep it. The rule is in the profiles' key: another rule, other plans, another profile."""
    head = kt.LayerShape("Q6_K", 151936, 1536)
    got = {"aten": {"1": 13.02}, "native_rows": {"1": 11.93}, "native_dequant_mm": {"1": 34.8},
           "native_q8": {"1": 6.035, "4": 9.39, "16": 43.11, "64": 159.2},
           "native_q8_vnni": {"1": 5.671, "4": 7.80, "16": 34.93, "64": 131.3},
           "native_x8": {"1": x8_at_one_row, "4": 6.06, "16": 24.37, "64": 103.9},
           "native_x8_vnni": {"1": max(5.849, x8_at_one_row), "4": 6.09, "16": 15.25, "64": 65.77}}
    plan = _table({head.label: got}).plan_for(head)
    assert (plan.x8, plan.int8_activations) == (takes_x8, True), plan
    if takes_x8:
        assert plan.vnni_min_rows == 16 and "within 10% of int8 rows 5.671 ms at 1 row and 65.770 < 131.300" in plan.why


def test_the_plan_rules_key_the_profiles(monkeypatch):
    """Another rule or constant of ``plan_for``: another profile key; another field the table stores: the same."""
    from dyntree_core import measured

    before = kt.table_identity()
    monkeypatch.setattr(kt, "X8_ONE_ROW_TIE", 0.0)
    assert kt.table_identity() != before and kt.table_key() in before
    monkeypatch.undo()
    digest, real = kt.plans_digest(), measured._source
    for method, changes_plans in ((kt.KernelTable._x8_wins, True), (kt.KernelTable.plan_for, True),
                                  (kt.KernelTable.stored, False), (kt.KernelTable.winners, False)):
        # (an edit of a method is an edit of its class's source too)
        monkeypatch.setattr(measured, "_source", lambda o, m=method: "edited" if o is m else (
            real(o) + "edited" if o is kt.KernelTable else real(o)))
        assert (kt.plans_digest() != digest) == changes_plans, method


# ------------------------------------------------------------------ a tiny GGUF model on these kernels

def _write_tiny_qwen2(tmp_path, embed_type: str = "F32", tied: bool = False, head_type: Optional[str] = None):
    """A 2-layer qwen2 GGUF (hidden 256, Q4_K projections, Q6_K down/head, F32 norms and biases; the embedding
    ``embed_type``, the head the embedding itself when ``tied``) and its config directory. ``head_type`` (Q8_0,
    Q5_0): the embedding and the head quantized from one float matrix, the embedding at ``embed_type``, the head
    at ``head_type`` (an untied file of a tied model, as llama.cpp writes Qwen2.5's)."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants
    from transformers import Qwen2Config

    h, inter, vocab, heads, kv = 256, 512, 320, 4, 2
    cfg = Qwen2Config(hidden_size=h, intermediate_size=inter, num_hidden_layers=2, num_attention_heads=heads,
                      num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=256,
                      tie_word_embeddings=tied)
    cfg.save_pretrained(tmp_path / "cfg")
    path = tmp_path / "tiny.gguf"
    w = GGUFWriter(str(path), "qwen2")
    rng = np.random.default_rng(0)
    seed = iter(range(100))

    def quant(name, type_name, n, k):
        raw = _blocks(type_name, n, k, seed=next(seed)).numpy()
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType[type_name])

    def dense(name, *shape, scale=0.1):
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    if head_type is not None:
        table = (rng.standard_normal((vocab, h)) * 0.5).astype(np.float32)
        for name, t in (("token_embd.weight", embed_type), ("output.weight", head_type)):
            raw = quants.quantize(table, GGMLQuantizationType[t])
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType[t])
    elif embed_type == "F32":
        dense("token_embd.weight", vocab, h, scale=0.5)
    else:
        quant("token_embd.weight", embed_type, vocab, h)
    dense("output_norm.weight", h, scale=1.0)
    if not tied and head_type is None:
        quant("output.weight", "Q6_K", vocab, h)
    hd = h // heads
    for i in range(2):
        p = f"blk.{i}."
        quant(p + "attn_q.weight", "Q4_K", h, h)
        quant(p + "attn_k.weight", "Q4_K", kv * hd, h)
        quant(p + "attn_v.weight", "Q6_K" if i else "Q4_K", kv * hd, h)
        quant(p + "attn_output.weight", "Q4_K", h, h)
        quant(p + "ffn_gate.weight", "Q4_K", inter, h)
        quant(p + "ffn_up.weight", "Q4_K", inter, h)
        quant(p + "ffn_down.weight", "Q6_K", h, inter)
        for b, n in (("attn_q", h), ("attn_k", kv * hd), ("attn_v", kv * hd)):
            dense(p + b + ".bias", n)
        dense(p + "attn_norm.weight", h, scale=1.0)
        dense(p + "ffn_norm.weight", h, scale=1.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, tmp_path / "cfg"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return _write_tiny_qwen2(tmp_path_factory.mktemp("tiny_gguf"))


def _kinds(model) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in model.modules():
        if "Linear" in type(m).__name__:
            out[type(m).__name__] = out.get(type(m).__name__, 0) + 1
    return out


def test_int4_on_native_kernels_is_the_float32_model_and_twins_and_caches_match(tiny_gguf, tmp_path, monkeypatch, nk):
    from dyntree_core.models.gguf_model import load_gguf_model, shape_twin

    path, cfg = tiny_gguf
    ids = torch.tensor([[3, 17, 99, 5, 250, 31, 8]])
    ref = load_gguf_model(path, cfg, "float32")
    with torch.inference_mode():
        expect = ref(ids).logits[0]
    monkeypatch.setenv("DYNTREE_KERNELS", "native")
    native = load_gguf_model(path, cfg, "int4", cache_dir=tmp_path / "packed")
    assert _kinds(native) == {"GGMLLinear": 13} and native._dyntree_fused == {"rms_norm": 5, "gate_up": 2, "lean_forward": 1}
    with torch.inference_mode():
        got = native(ids).logits[0]
    assert (got - expect).abs().max().item() < 1e-4 * expect.abs().max().item()
    # the packed cache holds the blocks and gives the same model back
    again = load_gguf_model(path, cfg, "int4", cache_dir=tmp_path / "packed")
    with torch.inference_mode():
        assert torch.equal(again(ids).logits[0], got)

    def layout(model):
        return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}

    assert layout(shape_twin(path, cfg, "int4")) == layout(native)
    monkeypatch.setenv("DYNTREE_KERNELS", "aten")
    aten = load_gguf_model(path, cfg, "int4")
    assert _kinds(aten) == {"Int4Linear": 11, "Int8Linear": 4}  # Q6_K layers and the head on int8
    with torch.inference_mode():
        loose = aten(ids).logits[0]
    assert (loose - expect).abs().max() > (got - expect).abs().max()  # bf16 scales and activations


def test_a_presets_load_reports_its_long_parts_by_role(tmp_path, monkeypatch, nk):
    """``load_model``'s ``progress`` gets the GGUF build's lines, named by role (the app's status line shows the
    latest while the first Run loads); a second load reads the packed cache and has nothing long to report.
    ``PairCache`` passes its own ``progress`` to every load."""
    from dyntree_core.models import load as load_mod
    from dyntree_core.models.load import ModelSource, load_model
    from dyntree_core.planning.pair_cache import PairCache

    path, cfg = _write_tiny_qwen2(tmp_path)
    monkeypatch.setenv("DYNTREE_KERNELS", "native")
    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path / "cache"))
    src = ModelSource("tiny", "preset", str(cfg), "tiny-q4k", gguf=str(path), role="draft")
    lines: list[str] = []
    load_model(src, precision="int4", progress=lines.append)
    assert lines and all(x.startswith("the draft: ") for x in lines), lines
    assert any("building int4 weights from" in x for x in lines), lines
    lines.clear()
    load_model(src, precision="int4", progress=lines.append)
    assert lines == []
    seen = []
    monkeypatch.setattr(load_mod, "resolve_spec", lambda spec, role: src)
    monkeypatch.setattr(load_mod, "load_model", lambda *a: seen.append(a[-1]))
    PairCache("tiny", "tiny", progress=print).model("draft", "int4")
    assert seen == [print]


def test_a_new_packed_file_prunes_the_files_used_least_lately(tmp_path, monkeypatch, nk):
    """Each kernel table, torch or cache format writes a packed file of its own (~1 GB for the 1.5B target):
    loading keeps the ``KEEP_PER_PRECISION`` used last of a precision and deletes the older ones."""
    import os

    from dyntree_core.models.gguf_model import load_gguf_model

    path, cfg = _write_tiny_qwen2(tmp_path)
    monkeypatch.setenv("DYNTREE_KERNELS", "native")
    packed = tmp_path / "packed"
    packed.mkdir()
    old = []
    for i, age in enumerate((300, 200, 100)):  # three older tables' files
        p = packed / f"packed-int4-torch0.0.0-v3-{i:08x}.safetensors"
        p.write_bytes(b"0" * 64)
        os.utime(p, (p.stat().st_atime, p.stat().st_mtime - age))
        old.append(p)
    load_gguf_model(path, cfg, "int4", cache_dir=packed)  # writes its own file
    kept = sorted(p.name for p in packed.iterdir())
    assert len(kept) == 2 and old[2].name in kept  # its own, and the one used last before it
    load_gguf_model(path, cfg, "int4", cache_dir=packed)  # reads it back: nothing else to prune
    assert sorted(p.name for p in packed.iterdir()) == kept


@pytest.mark.parametrize("embed_type,tied", [("Q6_K", True), ("Q8_0", False)])
def test_a_quantized_models_embedding_stays_in_blocks_with_the_dense_tables_rows(tmp_path, monkeypatch, nk,
                                                                               embed_type, tied):
    """int8/int4 models keep the GGUF's embedding as blocks (a 152k-token table is 0.93 GB dense for the 1.5B
    target, 0.19 GB as Q6_K blocks); a tied head shares them; every row is the dense table's row exactly, so
    the logits are those of the same model on a dense table; the shape twin and the packed cache match."""
    import copy

    from dyntree_core.models.gguf_model import load_gguf_model, shape_twin
    from dyntree_core.quant.ggml_embedding import GGMLEmbedding

    path, cfg = _write_tiny_qwen2(tmp_path, embed_type, tied)
    monkeypatch.setenv("DYNTREE_KERNELS", "native")
    ids = torch.tensor([[3, 17, 99, 5, 250, 31, 8, 319, 0]])
    for precision in ("int4", "int8"):
        model = load_gguf_model(path, cfg, precision, cache_dir=tmp_path / "packed")
        emb = model.model.embed_tokens
        assert isinstance(emb, GGMLEmbedding) and emb.type_name == embed_type
        shared = isinstance(model.lm_head, GGMLLinear) and emb.blocks.data_ptr() == model.lm_head.blocks.data_ptr()
        assert shared == (tied and isinstance(model.lm_head, GGMLLinear))
        table = _reference(embed_type, emb.blocks, 320, 256)
        assert torch.equal(emb(ids), table[ids])
        assert emb.weight.shape == (320, 256) and emb.weight.dtype == torch.float32
        dense = copy.deepcopy(model)
        dense.model.embed_tokens = torch.nn.Embedding.from_pretrained(table)
        with torch.inference_mode():
            got = model(ids).logits
            assert torch.equal(got, dense(ids).logits)
            again = load_gguf_model(path, cfg, precision, cache_dir=tmp_path / "packed")  # from the packed cache
            assert isinstance(again.model.embed_tokens, GGMLEmbedding) and torch.equal(again(ids).logits, got)
        twin = shape_twin(path, cfg, precision)
        assert isinstance(twin.model.embed_tokens, GGMLEmbedding)
        assert ({k: (tuple(v.shape), v.dtype) for k, v in twin.state_dict().items()}
                == {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()})
    with pytest.raises(IndexError, match=r"\[0, 320\)"):
        emb(torch.tensor([[320]]))
    assert not isinstance(load_gguf_model(path, cfg, "float32").model.embed_tokens, GGMLEmbedding)


def test_a_drafts_head_reads_the_embedding_where_that_is_the_head_in_fewer_bytes(tmp_path, monkeypatch, nk):
    """head="embedding" (a draft's, ``ModelSource.head``): where the file's Q8_0 head and its Q5_0 embedding are one
    matrix, the head is the embedding's blocks (shared, 22 bytes per 32 values against 34), so a forward reads
    fewer bytes, with logits near the file head's; the shape twin, the packed cache (a file of its own) and the
    forward bytes agree. Nothing changes at int8, for a file whose head is another matrix, or with head="output"."""
    from dyntree_core.config import DecodeConfig
    from dyntree_core.decode.engine import SpeculativeDecoder
    from dyntree_core.models.gguf_model import (embedding_head_reason, gguf_forward_bytes, head_note, load_gguf_model,
                                                read_gguf, shape_twin)
    from dyntree_core.quant.ggml_embedding import GGMLEmbedding

    path, cfg = _write_tiny_qwen2(tmp_path, "Q5_0", head_type="Q8_0")
    monkeypatch.setenv("DYNTREE_KERNELS", "native")
    gf = read_gguf(path)
    assert embedding_head_reason(gf, "int4") is None
    assert "int8" in embedding_head_reason(gf, "int8")
    packed = tmp_path / "packed"
    full = load_gguf_model(path, cfg, "int4", cache_dir=packed)
    draft = load_gguf_model(path, cfg, "int4", cache_dir=packed, head="embedding")
    assert full.lm_head.type_name == "Q8_0" and head_note(full) is None
    assert draft.lm_head.type_name == "Q5_0" and isinstance(draft.model.embed_tokens, GGMLEmbedding)
    assert draft.model.embed_tokens.blocks.data_ptr() == draft.lm_head.blocks.data_ptr()
    assert "token_embd.weight (Q5_0" in head_note(draft) and "output.weight (Q8_0" in head_note(draft)
    assert len(list(packed.glob("*.safetensors"))) == 2  # the two heads are cached apart
    ids = torch.tensor([[3, 17, 99, 5, 250, 31, 8, 319, 0]])
    with torch.inference_mode():
        a, b = full(ids).logits[0], draft(ids).logits[0]
        again = load_gguf_model(path, cfg, "int4", cache_dir=packed, head="embedding")
        assert torch.equal(again(ids).logits[0], b) and head_note(again) == head_note(draft)
    assert 0 < ((a - b).norm() / a.norm()).item() < 0.1  # Q5_0 against Q8_0 of one matrix
    twin = shape_twin(path, cfg, "int4", head="embedding")
    assert twin.lm_head.type_name == "Q5_0" and head_note(twin) == head_note(draft)
    assert ({k: (tuple(v.shape), v.dtype) for k, v in twin.state_dict().items()}
            == {k: (tuple(v.shape), v.dtype) for k, v in draft.state_dict().items()})
    saved = gf.tensors["output.weight"].data.nbytes - gf.tensors["token_embd.weight"].data.nbytes
    assert gguf_forward_bytes(path, "int4") - gguf_forward_bytes(path, "int4", head="embedding") == saved > 0
    assert gguf_forward_bytes(path, "int8", head="embedding") == gguf_forward_bytes(path, "int8")
    assert load_gguf_model(path, cfg, "int8", head="embedding").lm_head.__class__.__name__ == "Int8Linear"

    # the draft only proposes: greedy decoding with it gives the file-head target's own tokens
    prompt = [3, 17, 99, 5, 250]
    plain = SpeculativeDecoder(draft, full, DecodeConfig(method="autoregressive")).generate_ids(prompt, 12)
    chain = SpeculativeDecoder(draft, full, DecodeConfig(method="chain", depth=4, budget=4)).generate_ids(prompt, 12)
    assert chain == plain

    other, ocfg = _write_tiny_qwen2(tmp_path / "untied", "Q4_K")  # the Q6_K head a different matrix
    assert "not output at another precision" in embedding_head_reason(read_gguf(other), "int4")
    assert load_gguf_model(other, ocfg, "int4", head="embedding").lm_head.type_name == "Q6_K"


def test_a_draft_source_reads_its_head_from_the_embedding_unless_told_and_a_target_source_from_the_file(
        monkeypatch):
    from dataclasses import replace

    from dyntree_core.config import ConfigError
    from dyntree_core.models.load import ModelSource
    from dyntree_core.planning.acceptance import _acceptance_path
    from dyntree_core.planning.machine_profile import profile_key

    src = ModelSource("embedded", "preset", "/x", "m")
    draft = replace(src, role="draft")
    assert src.head == "output" and draft.head == "embedding"
    key, acc = profile_key("embedded,embedded", "cpu"), _acceptance_path("p", "int4", "int4", 0.0, 48, [[1]])
    monkeypatch.setenv("DYNTREE_DRAFT_HEAD", "output")  # the file's own head, for a draft exactly as shipped
    assert draft.head == "output" and src.head == "output"
    assert profile_key("embedded,embedded", "cpu") != key  # timings and acceptance measured apart
    assert _acceptance_path("p", "int4", "int4", 0.0, 48, [[1]]) != acc
    monkeypatch.setenv("DYNTREE_DRAFT_HEAD", "tied")
    with pytest.raises(ConfigError, match="DYNTREE_DRAFT_HEAD must be one of output, embedding"):
        draft.head


def test_the_machine_profile_key_follows_the_kernels(monkeypatch, nk):
    from dyntree_core.planning.machine_profile import profile_key

    keys = set()
    for policy in ("table", "aten", "native", "native_q8"):
        monkeypatch.setenv("DYNTREE_KERNELS", policy)
        keys.add(profile_key("embedded", "cpu"))
    assert len(keys) == 4


def test_fused_norms_and_gate_up_give_the_same_logits(nk):
    import copy

    from dyntree_core.quant.fused import FusedGateUp, fuse_forward
    from dyntree_core.testing import tiny_ggml_qwen2

    model = tiny_ggml_qwen2(nk)
    fused = copy.deepcopy(model)
    assert fuse_forward(fused) == {"rms_norm": 5, "gate_up": 2, "lean_forward": 1}
    assert isinstance(fused.model.layers[0].mlp, FusedGateUp)
    ids = torch.tensor([[1, 5, 9, 200, 7]])
    with torch.inference_mode():
        assert torch.equal(fused(ids).logits, model(ids).logits)


def test_the_cost_panels_parameter_count_counts_ggml_layers(nk):
    """A GGMLLinear (the GGUF's own blocks) counts in x out weights, like the dense layer it replaces."""
    from dyntree_core.planning.cost_model import logical_params

    n, k = 24, 512
    model = torch.nn.Sequential(GGMLLinear("Q4_K", _blocks("Q4_K", n, k), k, kernels=nk), torch.nn.Linear(n, 3))
    assert logical_params(model) == n * k + 3 * n + 3


# ------------------------------------------------- int8 activations: the kernels' exact arithmetic, in numpy

def _fma32(a, b, c):
    """float32 fma(a, b, c): a*b is exact in float64 (24 + 24 bits); the sum is rounded twice, which differs from
    one rounding only on a float32 tie (about 2^-29 of the time; the seeds below do not hit one)."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def _hsum(v):
    """The kernels' horizontal sum of 8 (or 4) float32 lanes: halves added, then pairs, then the last two."""
    if v.shape[-1] == 8:
        v = v[..., :4] + v[..., 4:]
    t = v[..., :2] + v[..., 2:]
    return t[..., 0] + t[..., 1]


def _quantize_q8k(x, block: int = 256):
    """llama.cpp's Q8_K per 256 values (``block`` 32: its Q8_0), the kernels' way: d = max|x| / 127,
    q = round-half-even(x * (127 / max))."""
    xb = x.numpy().astype(np.float32).reshape(x.shape[0], -1, block)
    mx = np.abs(xb).max(-1, keepdims=True)
    safe = np.where(mx == 0, np.float32(1), mx)
    q = np.where(mx == 0, 0, np.rint(xb * (np.float32(127) / safe))).astype(np.int64)
    return q, (mx / np.float32(127))[..., 0]  # [M, nb, block], [M, nb]


def _k_quant_ints(type_name, blocks, n, k):
    """Per block: unsigned quants u [N, nb, 256], scales per value [N, nb, 256], d (and dmin, mins per 32 for
    Q4_K) as float32, read from the bytes as the GGUF layout defines them."""
    raw = blocks.numpy().reshape(n, k // 256, -1).astype(np.int64)

    def f16(b):
        return b.astype(np.uint8).copy().view(np.float16)[..., 0].astype(np.float32)

    if type_name == "Q4_K":
        sc12, qs = raw[..., 4:16], raw[..., 16:]
        scale = np.concatenate([sc12[..., 0:4] & 63, (sc12[..., 8:12] & 0xF) | ((sc12[..., 0:4] >> 6) << 4)], -1)
        mins = np.concatenate([sc12[..., 4:8] & 63, (sc12[..., 8:12] >> 4) | ((sc12[..., 4:8] >> 6) << 4)], -1)
        u = np.stack([qs.reshape(n, -1, 4, 32) & 0xF, qs.reshape(n, -1, 4, 32) >> 4], 3).reshape(n, -1, 256)
        return u, np.repeat(scale, 32, -1), f16(raw[..., 0:2]), f16(raw[..., 2:4]), mins
    ql, qh, sc = raw[..., :128], raw[..., 128:192], raw[..., 192:208]
    sc = np.where(sc > 127, sc - 256, sc)
    u = np.empty((n, k // 256, 256), dtype=np.int64)
    for h in range(2):
        l0, l1, hb = ql[..., 64 * h:64 * h + 32], ql[..., 64 * h + 32:64 * h + 64], qh[..., 32 * h:32 * h + 32]
        for g, low in enumerate((l0 & 0xF, l1 & 0xF, l0 >> 4, l1 >> 4)):
            u[..., 128 * h + 32 * g:128 * h + 32 * g + 32] = low | (((hb >> (2 * g)) & 3) << 4)
    return u, np.repeat(sc, 16, -1), f16(raw[..., 208:210]), None, None


def _q8k_reference(type_name, blocks, n, k, x, bias):
    """y [M, N] of the int8-activation kernel, bit for bit: per block, 8 int32 lanes (lane i takes values v with
    v % 32 in [4i, 4i + 4)) converted to float and fma'd with d * dx into 8 float lanes; Q4_K's mins per 32
    values into 4 lanes (pairs of mins); block order; the kernels' horizontal sums."""
    u, scale, d, dmin, mins = _k_quant_ints(type_name, blocks, n, k)
    q, dx = _quantize_q8k(x)
    m, nb = q.shape[0], k // 256
    lane = (np.arange(256) % 32) // 4
    onehot = (lane[:, None] == np.arange(8)[None, :]).astype(np.int64)  # [256, 8]
    tot = np.zeros((n, m, 8), np.float32)
    mins_acc = np.zeros((n, m, 4), np.float32)
    for b in range(nb):
        prod = (u[:, None, b] * scale[:, None, b]) * q[None, :, b]  # [N, M, 256]
        acc = prod @ onehot
        if type_name == "Q6_K":  # the -32 of every quant, from the activations' sums per 16
            s16 = q[:, b].reshape(m, 16, 16).sum(-1)
            sc16 = scale[:, b, ::16]
            acc = acc - 32 * (sc16[:, None] * s16[None]).reshape(n, m, 8, 2).sum(-1)
        else:
            s32 = q[:, b].reshape(m, 8, 32).sum(-1)
            pm = (mins[:, None, b] * s32[None]).reshape(n, m, 4, 2).sum(-1)
            mins_acc = _fma32((dmin[:, b, None] * dx[None, :, b])[..., None], pm.astype(np.float32), mins_acc)
        tot = _fma32(acc.astype(np.float32), (d[:, b, None] * dx[None, :, b])[..., None], tot)
    out = _hsum(tot) - (_hsum(mins_acc) if type_name == "Q4_K" else np.float32(0))
    return torch.from_numpy((out + bias.numpy()[:, None]).T.copy())


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_int8_activation_kernels_are_bit_identical_to_their_arithmetic_at_every_row_count(nk, type_name):
    n, k = 37, 768  # 37 weight rows: no multiple of any blocking; 3 blocks per row
    blocks = _blocks(type_name, n, k, seed=11)
    u, scale, d, dmin, mins = _k_quant_ints(type_name, blocks, n, k)
    # the reference reads the blocks the way the gguf package does
    w = (d[..., None] * scale * (u - (32 if type_name == "Q6_K" else 0))).reshape(n, k).astype(np.float64)
    if type_name == "Q4_K":
        w -= (dmin[..., None] * np.repeat(mins, 32, -1)).reshape(n, k)
    assert np.allclose(w, _reference(type_name, blocks, n, k).double().numpy(), rtol=1e-6, atol=1e-7)
    bias = torch.randn(n)
    x = torch.randn(17, k) * torch.rand(17, 1) * 4
    x[3] = 0.0
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 11, 16, 17):  # every row-block size (1..8) and combinations
        got = nk.matmul(type_name, x[:m].clone(), blocks, n, k, bias, int8_activations=True)
        assert torch.equal(got, _q8k_reference(type_name, blocks, n, k, x[:m], bias)), m


def test_the_set_up_step_compiles_the_kernels_or_says_why_not(monkeypatch, capsys):
    """``python -m dyntree_core kernels`` (``make run``/``make test`` run it after the fetch) never fails
    the set-up: it reports the compiled library, or the reason torch's kernels run instead."""
    from dyntree_core.__main__ import main
    from dyntree_core.quant.native import native_kernels, reset_native_kernels

    reset_native_kernels()
    assert main(["kernels"]) == 0
    out = capsys.readouterr().out
    lib = native_kernels()
    assert (f"C kernels ready: {lib.path}" in out) if lib is not None else ("C kernels not used" in out)
    monkeypatch.setenv("DYNTREE_NATIVE_KERNELS", "0")
    reset_native_kernels()
    try:
        assert main(["kernels"]) == 0
        assert "not used on this machine: turned off by DYNTREE_NATIVE_KERNELS=0" in capsys.readouterr().out
    finally:
        monkeypatch.delenv("DYNTREE_NATIVE_KERNELS")
        reset_native_kernels()


HEAD = kt.LayerShape("Q6_K", 151936, 1536)  # the target's output head: int8 in torch's form, 234 MB


def test_torch_kernel_is_out_of_reach_only_beyond_the_cache_and_the_read_bandwidth():
    """The target's head: x8's one row 5.2 ms; torch's int8 layer reads 234 MB, >= 3.6 ms at 2x 32 GB/s, and would
    need < 2.6 ms to take the shape. A faster memory, a bigger cache, a slower GGML kernel or an unknown machine:
    time it."""
    assert kt.aten_weight_bytes(HEAD) == 151936 * 1536 + 2 * 151936
    why = kt.aten_out_of_reach(HEAD, 5.2, 32.0, 32 << 20)
    assert why and "234 MB" in why and "2.60 ms" in why, why
    assert kt.aten_out_of_reach(HEAD, 5.2, 60.0, 32 << 20) is None
    assert kt.aten_out_of_reach(HEAD, 5.2, 32.0, 256 << 20) is None
    assert kt.aten_out_of_reach(HEAD, 9.0, 32.0, 32 << 20) is None
    assert kt.aten_out_of_reach(HEAD, 5.2, None, 32 << 20) is None and kt.aten_out_of_reach(HEAD, 5.2, 32.0, None) is None
    q4 = kt.LayerShape("Q4_K", 8960, 1536)  # a layer's weight: 8.6 MB in torch's int4 form, in cache
    assert kt.aten_weight_bytes(q4) == 8960 * 1536 // 2 + 4 * 8960 * 1536 // 32
    assert kt.aten_out_of_reach(q4, 0.01, 1.0, 32 << 20) is None


@pytest.mark.parametrize("read_gb_per_s, timed", [(32.0, False), (500.0, True)])
def test_a_head_torch_cannot_win_is_never_built_and_the_table_says_why(monkeypatch, tmp_path, read_gb_per_s, timed):
    """``ensure_shapes`` on the head: with the memory read at 32 GB/s torch's layer is not built (a 0.9 GB float32
    dequantization) nor timed, and the table keeps the reason; at 500 GB/s it is timed."""
    from dyntree_core import memory_bandwidth

    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path))
    monkeypatch.setattr(kt, "largest_cache_bytes", lambda: 32 << 20)
    monkeypatch.setattr(kt, "probe_read", lambda nbytes, samples: memory_bandwidth.ReadProbe(read_gb_per_s))
    asked = []

    def fake(self, ms=kt.DEFAULT_MS, candidates=kt.RUNTIME_CANDIDATES, stat="median", budget_s=2.0, give_up=None,
             best_so_far=None):
        asked.extend(candidates)
        per_row = {"aten": 13.0, "native_rows": 11.9, "native_dequant_mm": 34.8, "native_q8": 6.0,
                   "native_q8_vnni": 5.7, "native_x8": 5.3, "native_x8_vnni": 5.2}
        return {c: {str(m): per_row[c] * m for m in ms} for c in candidates}

    monkeypatch.setattr(kt.ShapeCandidates, "time", fake)
    plans = kt.layer_plans([HEAD], heads=[HEAD])
    assert ("aten" in asked) == timed and plans[HEAD].x8
    stored = kt.load_table()
    assert (stored.timings[HEAD.label]["aten"]["1"] is not None) == timed
    assert (HEAD.label in stored.not_timed) != timed
    if not timed:
        assert "would need < 2.60 ms" in stored.not_timed[HEAD.label]["aten"]


def test_a_stopped_load_ends_the_kernel_measurement_between_candidates_and_keeps_the_shapes_it_finished(
        monkeypatch, tmp_path, nk):
    """A Run's Stop while its pair's kernels are measured (a pair the set-up did not prepare; the head's shape
    alone takes ~5 s on a 2-core Zen 4): the measurement ends before its next candidate, the shapes finished before
    are stored, the one it was in is not."""
    import threading

    from dyntree_core import measured
    from dyntree_core.interrupt import LoadStopped, stops_loads_on

    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path))
    monkeypatch.setattr(measured, "busy_detector", lambda w: None)
    stop, timed = threading.Event(), []
    first, second = kt.LayerShape("Q4_K", 16, 256), kt.LayerShape("Q4_K", 24, 256)
    real_time_rows = kt.time_rows

    def time_rows(call, *a, **kw):  # the Stop comes while the second shape's first candidate is timed
        timed.append(call)
        if len(timed) > len(kt.RUNTIME_CANDIDATES) and measuring[-1] == second.label:
            stop.set()
        return real_time_rows(call, *a, **kw)

    measuring = []
    real_measure = kt.measure_for_plan

    def measure_for_plan(shape, *a, **kw):
        measuring.append(shape.label)
        return real_measure(shape, *a, **kw)

    monkeypatch.setattr(kt, "time_rows", time_rows)
    monkeypatch.setattr(kt, "measure_for_plan", measure_for_plan)
    with stops_loads_on(stop), pytest.raises(LoadStopped):
        kt.ensure_shapes([first, second])
    assert measuring == [first.label, second.label]
    stopped_at = len(timed)
    assert stop.is_set() and timed[-1] is not None  # the candidate under way finished; no other began
    stored = kt.load_table().timings
    assert first.label in stored and second.label not in stored
    kt.ensure_shapes([first, second])  # outside a stopped scope: the rest is measured, the first shape read back
    assert measuring == [first.label, second.label, second.label] and len(timed) > stopped_at
    assert {first.label, second.label} <= set(kt.load_table().timings)
