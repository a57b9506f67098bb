"""Target distributions of a tree's nodes as the verifiers read them: row by row.

A verifier visits few of a large tree's nodes, so the engine does not form (or copy to the host) the
full ``[N, V]`` probability matrix: ``LogitRows`` keeps the target's logits where the forward left
them and forms a node's distribution only when a verifier asks for that row. ``DenseRows`` wraps an
explicit ``[N, V]`` matrix (tests, exact enumeration, benchmarks); both give the same answers.

Every verifier accepts either (``as_rows``).
"""

from __future__ import annotations

from typing import Optional, Protocol, Union, runtime_checkable

import numpy as np
import torch

from ..sampling import probs_from_logits


@runtime_checkable
class TargetRows(Protocol):
    """Target next-token distributions at the ``n`` nodes of a tree."""

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, V)``."""
        ...

    def row(self, r: int) -> np.ndarray:
        """``[V]`` float64 fresh copy of node ``r``'s distribution (callers may modify it)."""
        ...

    def token_probs(self, parents: torch.Tensor, tokens: torch.Tensor) -> np.ndarray:
        """``[M]`` float64 ``p(tokens[i] | parents[i])`` (``parents``, ``tokens``: ``[M]`` int64)."""
        ...

    def argmax(self) -> np.ndarray:
        """``[N]`` int64 most likely token of every row (first index on ties)."""
        ...


class DenseRows:
    """Rows of an explicit ``[N, V]`` probability (or score) matrix.

    The matrix is moved to the CPU once (a single device sync); each requested row is widened to
    float64 on use, so a 768 x 151936 target never exists as one float64 array.
    """

    def __init__(self, probs: torch.Tensor):
        if probs.dim() != 2:
            raise ValueError(f"target_probs must be a [N, V] matrix, got shape {tuple(probs.shape)}")
        self._dev = probs.detach()
        t = self._dev if self._dev.dtype in (torch.float32, torch.float64) else self._dev.float()
        self._cpu = t.cpu()

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self._cpu.shape[0]), int(self._cpu.shape[1]))

    def row(self, r: int) -> np.ndarray:
        return np.array(self._cpu[r].numpy(), dtype=np.float64)

    def token_probs(self, parents: torch.Tensor, tokens: torch.Tensor) -> np.ndarray:
        dev = self._dev.device
        return self._dev[parents.to(dev), tokens.to(dev)].to(torch.float64).cpu().numpy()

    def argmax(self) -> np.ndarray:
        return row_argmax(self._cpu)


_LSE_CHUNK = 64  # rows per log-sum-exp batch (bounds the float32 copy: 64 x 151936 x 4 B = 39 MB)


def row_logsumexp(logits: torch.Tensor, rows: Optional[torch.Tensor] = None, scale: float = 1.0) -> torch.Tensor:
    """``[R]`` float32 log-sum-exp of ``scale * logits[r]`` for each ``r`` of ``rows`` (``[R]`` int64 on the logits'
    device; None: every row of ``[N, V]`` ``logits``), ``_LSE_CHUNK`` rows at a time."""
    n = int(logits.shape[0] if rows is None else rows.numel())
    out = torch.empty(n, dtype=torch.float32, device=logits.device)
    for s in range(0, n, _LSE_CHUNK):
        if rows is None:  # a slice may be the logits themselves: scaled out of place
            x = logits[s:s + _LSE_CHUNK].float()
            x = x * scale if scale != 1.0 else x
        else:  # an index copy: scaled in place
            x = logits[rows[s:s + _LSE_CHUNK]].float()
            x = x.mul_(scale) if scale != 1.0 else x
        out[s:s + _LSE_CHUNK] = torch.logsumexp(x, dim=-1)
    return out


class LogitRows:
    """Distributions formed from the target's logits on demand, on the logits' device.

    Args:
        logits: ``[N, V]`` target logits at the tree's nodes (any float dtype, any device).
        temperature: > 0 for sampling (``probs_from_logits(.., temperature, top_p)``); 0 means
            greedy decoding, whose rows are the plain softmax (what ``p_target`` reports at T=0).
        top_p: nucleus mass (sampling only).
        row_of_node: ``[N]`` int64, the logits row holding node i (the forward ran the tree in
            another order); None = row i.

    Only the rows a verifier asks for are formed and moved to the host; ``token_probs`` reduces the
    parent rows on the device and moves one value per node; ``argmax`` moves N integers.
    """

    def __init__(self, logits: torch.Tensor, temperature: float, top_p: float = 1.0,
                 row_of_node: Optional[torch.Tensor] = None):
        if logits.dim() != 2:
            raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
        if row_of_node is not None and tuple(row_of_node.shape) != (logits.shape[0],):
            raise ValueError(f"row_of_node must be [N] = [{logits.shape[0]}], got {tuple(row_of_node.shape)}")
        self.logits = logits.detach()
        self._map = None if row_of_node is None else row_of_node.to(torch.long)
        self._map_dev = None if row_of_node is None else self._map.to(logits.device)
        self.temperature = float(temperature)
        self.top_p = float(top_p) if temperature > 0 else 1.0
        self._rows: dict[int, np.ndarray] = {}
        self.rows_formed = 0  # distinct rows formed (for tests and traces)

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.logits.shape[0]), int(self.logits.shape[1]))

    def _probs(self, x: torch.Tensor) -> torch.Tensor:
        if self.temperature > 0:
            return probs_from_logits(x, self.temperature, self.top_p)
        return torch.softmax(x.float(), dim=-1)

    def row(self, r: int) -> np.ndarray:
        r = int(r)
        if r not in self._rows:
            self._rows[r] = self._probs(self.logits[r if self._map is None else int(self._map[r])]).to(torch.float64).cpu().numpy()
            self.rows_formed += 1
        return self._rows[r].copy()

    def token_probs(self, parents: torch.Tensor, tokens: torch.Tensor) -> np.ndarray:
        if parents.numel() == 0:
            return np.zeros(0)
        dev = self.logits.device
        par, tok = parents.to(dev), tokens.to(dev)
        if self._map_dev is not None:
            par = self._map_dev[par]
        uniq, inv = torch.unique(par, return_inverse=True)
        if self.top_p < 1.0:
            vals = probs_from_logits(self.logits[uniq], self.temperature, self.top_p)[inv, tok]
            return vals.to(torch.float64).cpu().numpy()
        scale = 1.0 / self.temperature if self.temperature > 0 else 1.0
        lse = row_logsumexp(self.logits, uniq, scale)  # only rows that are some node's parent
        num = self.logits[par, tok].float() * scale
        return torch.exp(num - lse[inv]).to(torch.float64).cpu().numpy()

    def argmax(self) -> np.ndarray:
        out = row_argmax(self.logits)
        return out if self._map is None else out[self._map.numpy()]


def row_argmax(scores: torch.Tensor) -> np.ndarray:
    """``[N]`` argmax of each row of ``scores`` ``[N, V]`` (first index on ties): NumPy on CPU float
    tensors (several times faster than torch's CPU argmax at V = 151936), torch on other devices."""
    if scores.device.type == "cpu" and scores.dtype in (torch.float32, torch.float64):
        return np.argmax(scores.numpy(), axis=-1)
    return scores.argmax(dim=-1).cpu().numpy()


Target = Union[torch.Tensor, TargetRows]


def as_rows(target: Target) -> TargetRows:
    """``target`` as ``TargetRows`` (a ``[N, V]`` tensor is wrapped in ``DenseRows``)."""
    if isinstance(target, torch.Tensor):
        return DenseRows(target)
    if isinstance(target, TargetRows):
        return target
    raise TypeError(f"target distributions must be a [N, V] tensor or TargetRows, got {type(target).__name__}")


def node_token_probs(rows: TargetRows, parents: torch.Tensor, tokens: torch.Tensor) -> np.ndarray:
    """``[N]`` float64 target probability of each node's token under its parent's row; NaN for the root
    (``parents``, ``tokens``: the tree's ``[N]`` tensors)."""
    return np.concatenate([[np.nan], rows.token_probs(parents[1:], tokens[1:])])
