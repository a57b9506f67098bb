"""Turning logits into the distributions the verifiers and drafters use."""

from __future__ import annotations

import torch


def probs_from_logits(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Next-token distributions from logits.

    Args:
        logits: ``[..., V]`` scores (any float dtype, any device).
        temperature: > 0.
        top_p: nucleus mass in (0, 1]; the smallest set of tokens whose mass reaches ``top_p``
            is kept (the token that crosses the threshold included) and renormalised.
    Returns:
        ``[..., V]`` float32 probabilities on the logits' device.
    """
    if temperature <= 0:
        raise ValueError("probs_from_logits needs temperature > 0 (use argmax for greedy)")
    if temperature == 1.0:  # (x / 1 is x: one kernel, the cast inside the softmax)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        probs = top_p_filter(probs, top_p)
    return probs


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the nucleus of ``probs`` (``[..., V]``) with mass ``top_p`` and renormalise."""
    sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
    cum = torch.cumsum(sorted_p, dim=-1)
    remove = (cum - sorted_p) >= top_p  # mass strictly before this token already reaches top_p
    sorted_p = sorted_p.masked_fill(remove, 0.0)
    out = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    return out / out.sum(dim=-1, keepdim=True)
