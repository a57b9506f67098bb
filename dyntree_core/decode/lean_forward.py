"""A short forward for Qwen2/Llama decoders on ``GGMLLinear`` layers (the GGUF's own blocks on the CPU).

transformers' eager decoder runs ~200 small ops per layer for a one-token forward (attention-interface
dispatch, mask preparation, GQA packing, casts, views, rotary through slices and concatenations); on a
2-core CPU they cost about as much as the file's q/k/v/o products. This forward runs the same layers
(their modules and weights, the engine's ``kv.KVCache``) with one op per step of the papers' layer:

    h += o_proj(SDPA(rope(q_proj(n1(h))), rope(k_proj(n1(h))), v_proj(n1(h)), mask))
    h += mlp(n2(h))

``quant.lean_mark.lean_reason(model)`` says why a model cannot take it (``None``: it can); ``enable_lean``
marks those that can (``quant.fused.fuse_forward`` calls it), and ``decode.forward.masked_forward`` then
calls ``lean_forward`` whenever every layer's attention would be SDPA (``attention.hf_backend.sdpa_runs``; a
forward the Triton kernel takes goes through transformers and the kernel's glue). The layers are
``decode.dense_forward.decoder_layers``, the steps the compiled dense forward runs, writing the engine's
``kv.KVCache`` here.
The numbers are transformers' own up to float32 rounding (SDPA's grouped-query path instead of repeated
keys; tested against it). Where ``quant.native_layer.native_plan`` allows (every layer on GGML row kernels),
each layer is instead one C call (``decoder_layer.c``), the same steps with no torch op in between.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import interrupt
from ..quant import native_layer
from .dense_forward import decoder_layers


def lean_forward(model, ids: torch.Tensor, positions: torch.Tensor, visible: Optional[torch.Tensor], cache,
                 logits_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The decoder over ``ids`` after the cached positions.

    Args:
        model: a model ``quant.lean_mark.enable_lean`` marked.
        ids: ``[1, q]`` int64 token ids.
        positions: ``[1, q]`` int64 position ids.
        visible: ``[1, 1, q, kv_len]`` bool (True = may attend), ``kv_len = cached + q``; ``None`` = every
            cached and new position is visible (one token after the prefix).
        cache: the model's ``kv.KVCache`` (extended in place by ``q`` slots).
        logits_rows: ``[r]`` int64 rows whose logits are wanted (``None``: all).
    Returns:
        ``[r or q, V]`` float logits.
    """
    plan = native_layer.native_plan(model)
    if plan is not None and plan.takes(int(ids.shape[1])):
        return native_layer.native_forward(plan, model, ids, positions, visible, cache, logits_rows)
    inner = model.model
    with torch.no_grad():
        h = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(h, positions)
        def write(i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            interrupt.check()  # a Stop during a prefill chunk ends it here, before layer i's attention
            return cache.update(k, v, i)

        h = decoder_layers(inner.layers, h, cos.unsqueeze(1), sin.unsqueeze(1), visible, write)
        h = inner.norm(h)
        if logits_rows is not None:
            h = h[:, logits_rows]
        return model.lm_head(h)[0]
