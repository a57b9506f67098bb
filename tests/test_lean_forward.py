"""``decode.lean_forward``: the short decoder forward the engine runs on models of GGUF blocks gives
transformers' logits (float32 row kernels: to rounding) for a prefill, one token and a tree, keeps the
engine's greedy identity, and steps aside where it does not apply."""

from __future__ import annotations

import copy

import pytest
import torch

from dyntree_core.decode import forward as fwd
from dyntree_core.decode.forward import causal_forward, masked_forward
from dyntree_core.decode.kv import new_cache
from dyntree_core.quant.lean_mark import LEAN_ATTR, lean_enabled, lean_reason
from dyntree_core.quant.native import native_kernels, native_unavailable_reason
from dyntree_core.tree import ancestor_matrix


@pytest.fixture(scope="module")
def ggml_model():
    """A 2-layer Qwen2 (GQA: 4 query heads, 2 key/value heads) on Q4_K GGMLLinear layers, fused as
    GGUF models are (``fuse_forward``), float32 activations."""
    nk = native_kernels()
    if nk is None:
        pytest.skip(f"no native kernels: {native_unavailable_reason()}")
    from dyntree_core.quant.fused import fuse_forward
    from dyntree_core.testing import tiny_ggml_qwen2

    model = tiny_ggml_qwen2(nk)
    fuse_forward(model)
    assert lean_enabled(model)
    return model


def _run(model, lean: bool):
    """A 6-token prefill, two single tokens and a 5-node tree (root, two children, a grandchild each)."""
    setattr(model, LEAN_ATTR, lean)
    try:
        cache = new_cache(model, 64)
        with torch.inference_mode():
            out = [causal_forward(model, cache, [1, 5, 9, 200, 7, 42], 0)]
            out += [causal_forward(model, cache, [t], 6 + j) for j, t in enumerate((13, 77))]
            visible = torch.zeros(5, 8 + 5, dtype=torch.bool)
            visible[:, :8] = True
            visible[:, 8:] = ancestor_matrix(torch.tensor([-1, 0, 0, 1, 2]), 3)
            out.append(masked_forward(model, cache, [3, 8, 21, 55, 89], [8, 9, 9, 10, 10], visible))
            out.append(causal_forward(model, cache, [4, 6], 13, logits_rows=[1]))
        return out
    finally:
        setattr(model, LEAN_ATTR, True)


def test_lean_forward_gives_transformers_logits(ggml_model):
    hf, lean = _run(ggml_model, False), _run(ggml_model, True)
    assert [t.shape for t in hf] == [t.shape for t in lean]
    for a, b in zip(hf, lean):
        assert (a - b).abs().max().item() < 1e-4 * a.abs().max().item()
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_lean_forward_runs_only_where_every_layer_would_run_sdpa(ggml_model, monkeypatch):
    from dyntree_core.attention.hf_backend import BACKEND_KWARG, DISPATCH_IMPL, META_KWARG, sdpa_runs

    calls = []
    real = fwd.lean_forward
    monkeypatch.setattr(fwd, "lean_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    cache = new_cache(ggml_model, 16)
    with torch.no_grad():  # (the kernel's glue tracks mask versions: not under inference_mode)
        causal_forward(ggml_model, cache, [1, 2, 3], 0)
        assert len(calls) == 1
        # other attention arguments go through transformers
        causal_forward(ggml_model, cache, [4], 3, attn_kwargs={"output_attentions": False})
        assert len(calls) == 1
        # a prepared pair's per-call backend: SDPA ("torch") takes the lean forward ...
        monkeypatch.setattr(ggml_model.config, "_attn_implementation", DISPATCH_IMPL)
        causal_forward(ggml_model, cache, [5], 4, attn_kwargs={BACKEND_KWARG: "torch"})
        assert len(calls) == 2
        # ... the Triton kernel (the interpreter here) does not, nor does a forward given kernel metadata
        causal_forward(ggml_model, cache, [6, 7], 5, attn_kwargs={BACKEND_KWARG: "triton"})
        assert len(calls) == 2
    assert not sdpa_runs(DISPATCH_IMPL, {BACKEND_KWARG: "torch", META_KWARG: object()}, "cpu", 1, 7)
    assert sdpa_runs("sdpa", None, "cpu", 1, 7) and not sdpa_runs("eager", None, "cpu", 1, 7)


def test_the_engines_greedy_identity_holds_on_the_lean_forward(ggml_model):
    from dyntree_core.config import DecodeConfig
    from dyntree_core.decode.engine import SpeculativeDecoder

    target, draft = ggml_model, copy.deepcopy(ggml_model)
    outs = {}
    for method in ("autoregressive", "chain", "dyspec_greedy"):
        cfg = DecodeConfig(method=method, budget=12, depth=4, width=3, trace_block_counts=False)
        dec = SpeculativeDecoder(draft, target, cfg)
        outs[method] = [c.token_id for tr in dec.generate([1, 5, 9, 200, 7], 24) for c in tr.committed]
    assert len(outs["autoregressive"]) == 24
    assert outs["chain"] == outs["autoregressive"] and outs["dyspec_greedy"] == outs["autoregressive"]


def test_models_it_does_not_fit_say_why():
    from dyntree_core.testing import tiny_pair

    _, target = tiny_pair(seed=1)
    assert lean_reason(target) is None  # a Llama decoder: the architecture fits
    eager = copy.deepcopy(target)
    eager.config._attn_implementation = "eager"
    assert "eager" in lean_reason(eager)
    target.config.model_type = "gpt2"
    assert "gpt2" in lean_reason(target)
