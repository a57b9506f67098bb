"""The device-side greedy tree step's one read: a ``DeviceTree`` and the target's logits become
the host ``TokenTree`` and the verifier's target rows with a single ``host.fetch``.

On the device: the target argmax at every node, ``p_target`` of every node's token under its
parent (softmax of the logits: the same float32 log-sum-exp and ``exp(logit - lse)`` as
``verify.rows.LogitRows.token_probs``), the probability of each node's argmax (the bonus
token's ``p_target``) and the draft's probability of it at internal nodes (the bonus token's
``p_draft``). On the host, the greedy verifier reads them through ``FetchedRows``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from . import host
from ..drafting.device import DeviceTree
from ..tree import TokenTree
from ..verify.rows import LogitRows, row_logsumexp


@dataclass
class StepRead:
    """What the host needs after a device-side tree forward (real nodes only, node ids).

    Attributes:
        tree: the drafted tree (``draft_probs`` stay on the device and are not attached).
        rows: the verifier's target rows.
        slot: ``[n]`` forward slot of each node (padding slots excluded).
        perm: ``[n]`` node at each slot, padding slots removed.
        source_rows: ``[n]`` draft source row of each node (-1: never forwarded).
        p_draft_bonus: ``[n]`` draft probability of the node's target argmax (NaN at leaves).
    """

    tree: TokenTree
    rows: "FetchedRows"
    slot: list[int]
    perm: list[int]
    source_rows: list[int]
    p_draft_bonus: np.ndarray


class FetchedRows:
    """``TargetRows`` of a greedy step from values read once: ``argmax``, ``token_probs`` of the
    tree's own (parent, token) pairs and of each node's argmax. Anything else (a whole row, other
    pairs: an ``on_verify`` consumer evaluating another verifier) falls back to ``fallback``,
    which reads the device again (a graph step has none: its logits stay on the device)."""

    def __init__(self, argmax: np.ndarray, p_node: np.ndarray, p_argmax: np.ndarray, parents: np.ndarray,
                 tokens: np.ndarray, vocab: int, fallback: Optional[LogitRows]):
        self._argmax, self._p_node, self._p_argmax = argmax, p_node, p_argmax
        self._parents, self._tokens = parents, tokens
        self._vocab = vocab
        self.fallback = fallback

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self._argmax.shape[0]), self._vocab)

    def argmax(self) -> np.ndarray:
        return self._argmax.copy()

    def row(self, r: int) -> np.ndarray:
        return self._fallback().row(r)

    def token_probs(self, parents: torch.Tensor, tokens: torch.Tensor) -> np.ndarray:
        par = parents.cpu().numpy()
        tok = tokens.cpu().numpy()
        n = self._parents.shape[0]
        if par.shape == (n - 1,) and np.array_equal(par, self._parents[1:]) and np.array_equal(tok, self._tokens[1:]):
            return self._p_node[1:].copy()
        if np.array_equal(tok, self._argmax[par]):
            return self._p_argmax[par].copy()
        return self._fallback().token_probs(parents, tokens)

    def _fallback(self) -> LogitRows:
        if self.fallback is None:
            raise RuntimeError("this step read only the greedy verifier's numbers; its target logits stayed on the device")
        return self.fallback


def read_greedy_step(dtree: DeviceTree, logits: torch.Tensor, slot: torch.Tensor, perm: torch.Tensor) -> StepRead:
    """One ``host.fetch`` of the step (see the module docstring).

    Args:
        dtree: the padded device tree.
        logits: ``[N, V]`` target logits in slot order (``N = dtree.size``).
        slot, perm: ``[N]`` node -> slot and slot -> node of the forward (device).
    """
    n = dtree.size
    lse = row_logsumexp(logits)
    am = logits.argmax(dim=-1)[slot]  # [N] node order
    par_slot = slot[dtree.parents.clamp(min=0)]
    p_node = torch.exp(logits[par_slot, dtree.tokens].float() - lse[par_slot])
    p_am = torch.exp(logits[slot, am].float() - lse[slot])
    p_draft = torch.where(dtree.internal, dtree.draft_rows[torch.arange(n, device=logits.device), am].double(),
                          torch.full((n,), math.nan, dtype=torch.float64, device=logits.device))
    count = dtree.valid.sum()
    (count, tokens, parents, rank, q, value, row, am, p_node, p_am, p_draft, slot_h, perm_h) = host.fetch(
        count, dtree.tokens, dtree.parents, dtree.child_rank, dtree.q, dtree.value, dtree.row, am, p_node, p_am,
        p_draft, slot, perm)
    k = int(count)
    tree = TokenTree(
        tokens=torch.from_numpy(tokens[:k].copy()),
        parents=torch.from_numpy(parents[:k].copy()),
        child_rank=torch.from_numpy(rank[:k].copy()),
        draft_logprob=torch.tensor([0.0] + [math.log(x) if x > 0 else -math.inf for x in q[1:k].tolist()],
                                   dtype=torch.float64),
        sampled="topk",
        value=torch.from_numpy(value[:k].copy()),
    )
    p_node64 = p_node[:k].astype(np.float64)
    p_node64[0] = math.nan
    rows = FetchedRows(am[:k], p_node64, p_am[:k].astype(np.float64), parents[:k], tokens[:k],
                       int(logits.shape[1]), LogitRows(logits, 0.0, 1.0, row_of_node=slot))
    return StepRead(tree=tree, rows=rows, slot=slot_h[:k].tolist(), perm=[int(x) for x in perm_h if x < k],
                    source_rows=row[:k].tolist(), p_draft_bonus=p_draft[:k])
