"""Model forwards with explicit 4D masks: the one place the engine talks to an HF model."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch

from ..attention.hf_backend import sdpa_runs
from ..quant.lean_mark import lean_enabled
from .lean_forward import lean_forward
from .kv import new_cache  # noqa: F401  (the cache the forwards take; re-exported for callers of this module)


def masked_forward(
    model,
    cache,
    tokens: Sequence[int],
    positions: Sequence[int],
    visible: torch.Tensor,
    logits_rows: Optional[Sequence[int]] = None,
    attn_kwargs: Optional[Mapping[str, Any]] = None,
) -> torch.Tensor:
    """Feed ``tokens`` after the cached positions with an explicit visibility mask.

    Args:
        model: an HF causal LM.
        cache: its ``kv.KVCache`` (extended in place by ``len(tokens)`` slots).
        tokens: ``[q]`` token ids (a sequence, or an int64 tensor on any device).
        positions: ``[q]`` position ids (same).
        visible: ``[q, kv_len]`` bool, ``kv_len = cached + q``; True = may attend.
        logits_rows: rows whose logits are wanted (None = all).
        attn_kwargs: extra keyword arguments for the model call that transformers passes down to
            the attention function (the tree-attention backend and kernel metadata:
            ``attention.hf_backend.BACKEND_KWARG`` / ``META_KWARG``).
    Returns:
        ``[len(logits_rows) or q, V]`` logits (model dtype, model device).
    """
    device = model.get_input_embeddings().weight.device
    ids = _ids(tokens, device)
    pos = _ids(positions, device)
    mask = visible.to(device)[None, None]
    if lean_enabled(model) and sdpa_runs(getattr(model.config, "_attn_implementation", "sdpa"), attn_kwargs, device,
                                         ids.shape[1], mask.shape[-1] - ids.shape[1]):
        # GGUF blocks on the CPU and SDPA in every layer: ``decode.lean_forward`` instead of transformers' code
        rows = None if logits_rows is None else torch.tensor(list(logits_rows), dtype=torch.long, device=device)
        return lean_forward(model, ids, pos, None if ids.shape[1] == 1 and bool(mask.all()) else mask, cache, rows)
    if getattr(model.config, "_attn_implementation", "sdpa") == "eager":
        dtype = model.get_input_embeddings().weight.dtype
        mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, torch.finfo(dtype).min)
    kwargs: dict[str, Any] = dict(attn_kwargs or {})
    if logits_rows is not None:
        kwargs["logits_to_keep"] = torch.tensor(list(logits_rows), dtype=torch.long, device=device)
    with torch.no_grad():
        out = model(
            input_ids=ids,
            position_ids=pos,
            attention_mask=mask,
            past_key_values=cache,
            use_cache=True,
            **kwargs,
        )
    return out.logits[0]


def _ids(x, device: torch.device) -> torch.Tensor:
    """``[1, q]`` int64 on ``device`` from a sequence or a ``[q]`` tensor (no host round trip)."""
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=torch.long).reshape(1, -1)
    return torch.tensor([list(x)], dtype=torch.long, device=device)


def causal_forward(model, cache, tokens: Sequence[int], start: int, logits_rows: Optional[Sequence[int]] = None,
                   attn_kwargs: Optional[Mapping[str, Any]] = None) -> torch.Tensor:
    """Feed a plain causal run of ``tokens`` at positions ``start, start+1, ...``.

    Returns ``[rows, V]`` logits (all rows when ``logits_rows`` is None).
    """
    q = len(tokens)
    visible = torch.ones(q, start + q, dtype=torch.bool)
    visible[:, start:] = torch.tril(torch.ones(q, q, dtype=torch.bool))
    return masked_forward(model, cache, tokens, range(start, start + q), visible, logits_rows, attn_kwargs)
