"""The drafting interface: a ``DraftSource`` answers next-token distributions for tree nodes,
a ``Drafter`` (``drafter.py``) grows a ``TokenTree`` from it. Drafters never touch a model directly, so every
drafter can be tested exhaustively against a toy source (``PathFunctionSource``)."""

from __future__ import annotations

from typing import Callable, Protocol, Sequence, runtime_checkable

import torch



@runtime_checkable
class DraftSource(Protocol):
    """Next-token distributions of the draft model at nodes of a growing tree.

    The tree is described by ``tokens``/``parents`` (node 0 = root = last committed token,
    parents precede children). The tree only ever grows between calls within one step: a node,
    once passed, keeps its token and parent. A model-backed source forwards every not-yet-seen
    ancestor of the requested nodes in one batched call with a tree mask, caching their KV.
    """

    vocab_size: int

    def next_probs(
        self, tokens: Sequence[int], parents: Sequence[int], nodes: Sequence[int]
    ) -> torch.Tensor:
        """Return ``[len(nodes), V]`` float32 draft distributions (draft temperature applied)."""
        ...

    @property
    def forward_calls(self) -> int:
        """Number of batched draft forwards issued so far (for overhead accounting)."""
        ...


class PathFunctionSource:
    """A toy ``DraftSource`` defined by a function of the token path (root token first).

    ``fn(path: tuple[int, ...]) -> [V] probabilities``. Used in tests and documentation.
    """

    def __init__(self, fn: Callable[[tuple[int, ...]], torch.Tensor], vocab_size: int):
        self.fn = fn
        self.vocab_size = vocab_size
        self._calls = 0
        self.requested: list[int] = []

    @property
    def forward_calls(self) -> int:
        return self._calls

    def next_probs(
        self, tokens: Sequence[int], parents: Sequence[int], nodes: Sequence[int]
    ) -> torch.Tensor:
        self._calls += 1
        rows = []
        for n in nodes:
            path = []
            v = n
            while v >= 0:
                path.append(int(tokens[v]))
                v = int(parents[v])
            rows.append(torch.as_tensor(self.fn(tuple(reversed(path))), dtype=torch.float32))
            self.requested.append(int(n))
        return torch.stack(rows)
