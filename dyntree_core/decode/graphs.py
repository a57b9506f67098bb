"""Size buckets for graph-captured forwards, and the decision whether forwards are captured.

A captured forward (CUDA graph, or ``torch.compile(mode="reduce-overhead")``) replays fixed
shapes, so a tree of ``n`` nodes is run as a tree of ``bucket(n)`` nodes (1, 2, 4, ..., 1024):
``pad_tree`` appends padding rows that see only themselves (no real row sees them; their logits
are dropped and their KV slots, written after the real ones, are removed by the step's
compaction). ``PaddedForward`` runs a tree forward through its bucket and returns the real rows;
it is what a captured graph per bucket replays, and on the CPU it is tested against the unpadded
eager forward.

``capture_support(device)`` says whether forwards are captured and, when not, why; the engine
logs that reason once per process and runs eager forwards (the CPU path, and today every path:
capture needs KV views of a fixed length — attention over the whole preallocated buffer with the
unused slots masked, and a device-side write offset — which ``kv.KVCache`` does not offer yet).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

log = logging.getLogger(__name__)

#: largest bucket; a larger tree runs unpadded (eager)
MAX_BUCKET = 1024
_reported: set[str] = set()


def bucket(n: int) -> int:
    """The bucket of a ``n``-row forward: the next power of two (``n`` itself above ``MAX_BUCKET``)."""
    if n < 1:
        raise ValueError(f"a forward has at least one row, got {n}")
    if n > MAX_BUCKET:
        return n
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class CaptureSupport:
    """Whether forwards are graph-captured on a device, and if not, why."""

    enabled: bool
    reason: str


def capture_support(device: torch.device) -> CaptureSupport:
    """Graph capture is off on the CPU (no CUDA graphs; eager forwards are the CPU path) and,
    for now, on CUDA (see the module docstring)."""
    if device.type != "cuda":
        return CaptureSupport(False, f"graph-captured forwards need a CUDA device; running eager forwards on {device.type}")
    return CaptureSupport(False, "graph-captured forwards are not implemented yet (they need fixed-length KV views "
                                 "over the preallocated cache); running eager forwards")


def report_once(support: CaptureSupport) -> None:
    """Log why forwards are not captured, once per process and reason."""
    if support.enabled or support.reason in _reported:
        return
    _reported.add(support.reason)
    log.warning("%s", support.reason)


@dataclass
class PaddedTree:
    """A tree forward's inputs padded to its bucket (``b`` rows, the first ``n`` real)."""

    tokens: torch.Tensor  # [b] int64
    positions: torch.Tensor  # [b] int64
    visible: torch.Tensor  # [b, cache_len + b] bool
    n: int


def pad_tree(tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor, cache_len: int,
             rows: Optional[int] = None) -> PaddedTree:
    """Pad a tree forward to ``rows`` (default ``bucket(n)``) rows.

    Args:
        tokens, positions: ``[n]`` int64 in slot order.
        visible: ``[n, cache_len + n]`` bool mask of the real rows.
        cache_len: cached positions before the tree.
    Padding rows repeat the last real token and position and see only themselves.
    """
    n = int(tokens.shape[0])
    b = bucket(n) if rows is None else int(rows)
    if b < n:
        raise ValueError(f"cannot pad {n} rows to {b}")
    dev = visible.device
    out = torch.zeros(b, cache_len + b, dtype=torch.bool, device=dev)
    out[:n, : cache_len + n] = visible
    pad = torch.arange(n, b, device=dev)
    out[pad, cache_len + pad] = True
    tok = torch.cat([tokens, tokens[-1:].expand(b - n)])
    pos = torch.cat([positions, positions[-1:].expand(b - n)])
    return PaddedTree(tok, pos, out, n)


class PaddedForward:
    """Tree forwards run through their size bucket (the shapes a captured graph replays).

    ``forward(model, cache, tokens, positions, visible, attn_kwargs)`` pads, runs
    ``forward.masked_forward``, drops the padding rows' logits and the padding's KV slots, and
    returns the ``[n, V]`` logits of the real rows.
    """

    def __call__(self, model, cache, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor,
                 attn_kwargs: Optional[Mapping[str, Any]] = None) -> torch.Tensor:
        from .forward import masked_forward
        from .kv import cache_length

        cache_len = cache_length(cache)
        p = pad_tree(tokens, positions, visible, cache_len)
        logits = masked_forward(model, cache, p.tokens, p.positions, p.visible, attn_kwargs=attn_kwargs)
        for layer in cache.layers:
            layer.set_length(cache_len + p.n)
        return logits[: p.n]
