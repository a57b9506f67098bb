"""A short forward for Qwen2/Llama decoders on ``GGMLLinear`` layers (the GGUF's own blocks on the CPU).

transformers' eager decoder runs ~200 small ops per layer for a one-token forward (attention-interface
dispatch, mask preparation, GQA packing, casts, views, rotary through slices and concatenations); on a
2-core CPU they cost about as much as the file's q/k/v/o products. This forward runs the same layers
(their modules and weights, the engine's ``kv.KVCache``) with one op per step of the papers' layer:

    h += o_proj(SDPA(rope(q_proj(n1(h))), rope(k_proj(n1(h))), v_proj(n1(h)), mask))
    h += mlp(n2(h))

``lean_reason(model)`` says why a model cannot take it (``None``: it can); ``enable_lean(model)`` marks
those that can (``quant.fused.fuse_forward`` calls it), and ``decode.forward.masked_forward`` then calls
``lean_forward`` whenever every layer's attention would be SDPA (``attention.hf_backend.sdpa_runs``; a
forward the Triton kernel takes goes through transformers and the kernel's glue).
The numbers are transformers' own up to float32 rounding (SDPA's grouped-query path instead of repeated
keys; tested against it). Where ``quant.native_layer.native_plan`` allows (every layer on GGML row kernels),
each layer is instead one C call (``decoder_layer.c``), the same steps with no torch op in between.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import rotate_half  # (Qwen2's is the same function)

LEAN_ATTR = "_dyntree_lean"
_ARCHS = ("qwen2", "llama")


def lean_reason(model) -> Optional[str]:
    """Why ``model`` cannot run ``lean_forward`` (``None`` when it can)."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in _ARCHS:
        return f"architecture {getattr(cfg, 'model_type', None)!r} (lean forward: {', '.join(_ARCHS)})"
    if getattr(cfg, "_attn_implementation", "sdpa") != "sdpa":
        return f"attention implementation {cfg._attn_implementation!r} (lean forward: sdpa)"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ())):
        return "sliding-window layers"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "rotary_emb") or not hasattr(inner, "norm"):
        return "not a decoder with model.layers, rotary_emb and norm"
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim")):
            return "a layer without q/k/v/o projections"
        if not all(hasattr(layer, n) for n in ("mlp", "input_layernorm", "post_attention_layernorm")):
            return "a layer without mlp and the two norms"
    return None


def enable_lean(model) -> bool:
    """Mark ``model`` for ``lean_forward`` when ``lean_reason`` allows; returns whether it did."""
    ok = lean_reason(model) is None
    setattr(model, LEAN_ATTR, ok)
    return ok


def lean_enabled(model) -> bool:
    return bool(getattr(model, LEAN_ATTR, False))


def lean_forward(model, ids: torch.Tensor, positions: torch.Tensor, visible: Optional[torch.Tensor], cache,
                 logits_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The decoder over ``ids`` after the cached positions.

    Args:
        model: a model ``enable_lean`` marked.
        ids: ``[1, q]`` int64 token ids.
        positions: ``[1, q]`` int64 position ids.
        visible: ``[1, 1, q, kv_len]`` bool (True = may attend), ``kv_len = cached + q``; ``None`` = every
            cached and new position is visible (one token after the prefix).
        cache: the model's ``kv.KVCache`` (extended in place by ``q`` slots).
        logits_rows: ``[r]`` int64 rows whose logits are wanted (``None``: all).
    Returns:
        ``[r or q, V]`` float logits.
    """
    from .native_layer import native_forward, native_plan

    plan = native_plan(model)
    if plan is not None and plan.takes(int(ids.shape[1])):
        return native_forward(plan, model, ids, positions, visible, cache, logits_rows)
    inner = model.model
    with torch.no_grad():
        h = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(h, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [1, 1, q, d]
        n = ids.shape[1]
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn
            d = attn.head_dim
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(1, n, -1, d).transpose(1, 2)
            k = attn.k_proj(x).view(1, n, -1, d).transpose(1, 2)
            v = attn.v_proj(x).view(1, n, -1, d).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            k, v = cache.update(k, v, i)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=attn.scaling,
                                               enable_gqa=q.shape[1] != k.shape[1])
            h = h + attn.o_proj(o.transpose(1, 2).reshape(1, n, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = inner.norm(h)
        if logits_rows is not None:
            h = h[:, logits_rows]
        return model.lm_head(h)[0]
