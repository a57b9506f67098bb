"""``quant.native_layer``: each decoder layer of a GGUF model as one C call gives transformers' logits (float32
row kernels: to rounding), gives a tree's accepted path plain decoding's logits bit for bit (float32 and int8
activations), keeps the engine's greedy identity at int8 activations, and steps aside where it does not apply."""

from __future__ import annotations

import copy

import pytest
import torch

from dyntree_core.decode.forward import causal_forward, masked_forward
from dyntree_core.decode.kv import new_cache
from dyntree_core.quant import native_layer
from dyntree_core.quant.ggml_linear import GGMLLinear
from dyntree_core.quant.lean_mark import LEAN_ATTR
from dyntree_core.quant.native import native_kernels, native_unavailable_reason
from dyntree_core.quant.native_layer import forget_plan, native_plan, native_reason
from dyntree_core.tree import ancestor_matrix

PARENTS = torch.tensor([-1, 0, 0, 2, 2])  # node 0 -> 2 -> 4 is the accepted path; 1 and 3 are rejected siblings
PROMPT = [1, 5, 9, 200, 7, 42]


def _fused_model(int8: bool):
    nk = native_kernels()
    if nk is None:
        pytest.skip(f"no native kernels: {native_unavailable_reason()}")
    from dyntree_core.quant.fused import fuse_forward
    from dyntree_core.testing import tiny_ggml_qwen2

    model = tiny_ggml_qwen2(nk)
    for mod in model.modules():
        if isinstance(mod, GGMLLinear) and int8:
            mod.int8_activations = True
            mod._bind()
    fuse_forward(model)
    return model


@pytest.fixture(scope="module", params=[False, True], ids=["float32-acts", "int8-acts"])
def model(request):
    return _fused_model(request.param)


@pytest.fixture
def spy(monkeypatch):
    calls = []
    real = native_layer.native_forward
    monkeypatch.setattr(native_layer, "native_forward", lambda *a, **k: calls.append(a[2].shape[1]) or real(*a, **k))
    return calls


def _sequence(model):
    """A prefill, two single tokens, a 5-node tree and a 2-token forward keeping one row's logits."""
    cache = new_cache(model, 64)
    with torch.inference_mode():
        out = [causal_forward(model, cache, PROMPT, 0)]
        out += [causal_forward(model, cache, [t], 6 + j) for j, t in enumerate((13, 77))]
        visible = torch.zeros(5, 8 + 5, dtype=torch.bool)
        visible[:, :8] = True
        visible[:, 8:] = ancestor_matrix(PARENTS, 3)
        out.append(masked_forward(model, cache, [3, 8, 21, 55, 89], [8, 9, 9, 10, 10], visible))
        out.append(causal_forward(model, cache, [4, 6], 13, logits_rows=[1]))
    return out


def _with_native(model, on: bool, monkeypatch):
    monkeypatch.setenv("DYNTREE_NATIVE_LAYER", "1" if on else "0")
    forget_plan(model)


def test_native_layers_give_transformers_and_the_torch_glues_logits(model, spy, monkeypatch):
    setattr(model, LEAN_ATTR, False)
    try:
        hf = _sequence(model)
    finally:
        setattr(model, LEAN_ATTR, True)
    _with_native(model, False, monkeypatch)
    glue = _sequence(model)
    assert spy == [] and "DYNTREE_NATIVE_LAYER=0" in native_reason(model)
    _with_native(model, True, monkeypatch)
    native = _sequence(model)
    assert spy == [6, 1, 1, 5, 2]
    int8 = model.model.layers[0].self_attn.q_proj.int8_activations
    for a, b, c in zip(hf, glue, native):
        assert a.shape == b.shape == c.shape
        if not int8:  # float32 activations: every path agrees to float32 rounding
            for other in (b, c):
                assert (a - other).abs().max().item() < 1e-4 * a.abs().max().item()
        else:  # int8 activations: a rounding flip moves a product by up to a quantization step
            assert (b - c).abs().max().item() < 0.05 * b.abs().max().item()


def test_a_trees_accepted_path_gets_plain_decodings_logits_bit_for_bit(model, spy):
    path_tokens, path_nodes = [3, 21, 89], [0, 2, 4]
    with torch.inference_mode():
        cache = new_cache(model, 64)
        causal_forward(model, cache, PROMPT, 0)
        plain = [causal_forward(model, cache, [t], 6 + j)[-1] for j, t in enumerate(path_tokens)]
        cache = new_cache(model, 64)
        causal_forward(model, cache, PROMPT, 0)
        visible = torch.zeros(5, 6 + 5, dtype=torch.bool)
        visible[:, :6] = True
        visible[:, 6:] = ancestor_matrix(PARENTS, 3)
        tree = masked_forward(model, cache, [3, 8, 21, 55, 89], [6, 7, 7, 8, 8], visible)
    assert spy == [6, 1, 1, 1, 6, 5]
    for node, logits in zip(path_nodes, plain):
        assert torch.equal(tree[node], logits), node
    assert not torch.equal(tree[1], plain[1])  # the rejected sibling saw other keys


def test_the_engines_greedy_identity_holds_at_int8_activations():
    from dyntree_core.config import DecodeConfig
    from dyntree_core.decode.engine import SpeculativeDecoder

    target = _fused_model(int8=True)
    draft = copy.deepcopy(target)
    outs = {}
    for method in ("autoregressive", "chain", "dyspec_greedy"):
        cfg = DecodeConfig(method=method, budget=12, depth=4, width=3, trace_block_counts=False)
        dec = SpeculativeDecoder(draft, target, cfg)
        outs[method] = [c.token_id for tr in dec.generate([1, 5, 9, 200, 7], 24) for c in tr.committed]
    assert native_plan(target) is not None and native_plan(draft) is not None
    assert len(outs["autoregressive"]) == 24
    assert outs["chain"] == outs["autoregressive"] and outs["dyspec_greedy"] == outs["autoregressive"]


def test_a_cache_that_must_grow_and_a_copied_model_give_the_same_logits(model, spy):
    with torch.inference_mode():
        big = new_cache(model, 64)
        ref = [causal_forward(model, big, PROMPT, 0), causal_forward(model, big, [13], 6)]
        small = new_cache(model, 4)
        got = [causal_forward(model, small, PROMPT, 0), causal_forward(model, small, [13], 6)]
        assert small.reallocations > 0 and small.get_seq_length() == 7
        twin = copy.deepcopy(model)  # the plan is not copied: it points into the original's tensors
        assert getattr(twin, native_layer.PLAN_ATTR) is None
        copied = new_cache(twin, 64)
        again = [causal_forward(twin, copied, PROMPT, 0), causal_forward(twin, copied, [13], 6)]
    assert native_plan(twin) is not native_plan(model)
    for a, b, c in zip(ref, got, again):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert len(spy) == 6


def test_it_steps_aside_for_dequant_gemms_and_follows_replaced_modules(model, spy):
    plan = native_plan(model)
    assert plan is not None and plan.takes(1) and plan.takes(64)
    down = model.model.layers[1].mlp.down_proj
    old_rows = down.mm_min_rows
    down.mm_min_rows = 3  # the kernel table's dequantize-then-GEMM from 3 rows on (float32 activations only)
    try:
        assert plan.takes(2) and not plan.takes(3)
        with torch.inference_mode():
            causal_forward(model, new_cache(model, 16), [1, 2, 3], 0)
            causal_forward(model, new_cache(model, 16), [1, 2], 0)
        assert spy == [2]
    finally:
        down.mm_min_rows = old_rows
    layer = model.model.layers[0]
    original = layer.self_attn.o_proj
    layer.self_attn.o_proj = copy.deepcopy(original)
    try:
        assert not plan.current(model)
        fresh = native_plan(model)
        assert fresh is not plan and fresh.current(model)
    finally:
        layer.self_attn.o_proj = original
        forget_plan(model)


def test_models_it_does_not_fit_say_why():
    from dyntree_core.testing import tiny_pair

    _, target = tiny_pair(seed=1)  # nn.Linear layers
    assert "lean forward" in native_reason(target)
    setattr(target, LEAN_ATTR, True)
    assert "GGMLLinear" in native_reason(target)
    assert native_plan(target) is None


def test_a_long_prefill_does_not_keep_its_scratch_buffer(model):
    import ctypes

    plan = native_plan(model)
    rows = native_layer.KEEP_WORK_ROWS + 6
    with torch.inference_mode():
        causal_forward(model, new_cache(model, 128), list(range(1, rows + 1)), 0)
        kept = plan.work.numel()
        need = plan.lib.dyntree_decoder_layer_work(ctypes.byref(plan.descs[0]), rows, rows)
        assert kept < need  # the prefill's buffer was temporary
        causal_forward(model, new_cache(model, 16), [1, 2, 3], 0)
        assert plan.work.numel() >= plan.lib.dyntree_decoder_layer_work(ctypes.byref(plan.descs[0]), 3, 3)
