"""Which models run the engine's short decoder forward (``decode.lean_forward``): the mark
``quant.fused.fuse_forward`` sets on a model of GGUF blocks whose architecture allows it, read by the
engine's forward and by ``quant.native_layer`` (a leaf, so neither imports the other for it)."""

from __future__ import annotations

from typing import Optional

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
