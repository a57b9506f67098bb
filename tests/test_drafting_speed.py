"""Tree-construction overhead at the real vocabulary size (V = 151,936), budget 64.

The source is a cheap lookup of 16 precomputed peaked rows, so ``last_stats`` isolates the
drafters' own work (sampling, top-k, bookkeeping, copying ``draft_probs``). A drafter doing
per-node Python work over the vocabulary would take seconds per tree and fail the bound.
Run with ``-s`` to see the table.
"""

from __future__ import annotations

import pytest
import torch

from dyntree_core.config import DecodeConfig
from dyntree_core.drafting import DRAFTERS, make_drafter
from dyntree_core.methods import REGISTRY

V = 151_936


class LookupSource:
    """Returns one of 16 fixed distributions per node (chosen by node id and token)."""

    vocab_size = V

    def __init__(self, rows: torch.Tensor):
        self.rows = rows
        self._calls = 0

    @property
    def forward_calls(self) -> int:
        return self._calls

    def next_probs(self, tokens, parents, nodes):
        self._calls += 1
        ids = torch.tensor([(7 * n + int(tokens[n])) % self.rows.shape[0] for n in nodes])
        return self.rows.index_select(0, ids)


@pytest.fixture(scope="module")
def rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, V, generator=g) * 1.5
    for i in range(16):  # LLM-like: a few dominant tokens and a long tail
        logits[i, torch.randint(0, V, (4,), generator=g)] += torch.tensor([14.0, 12.0, 11.0, 10.0])
    return torch.softmax(logits, dim=1)


@pytest.mark.parametrize("method", [m for m in DRAFTERS if REGISTRY[m].uses_draft_model])
def test_construction_overhead_at_full_vocabulary(method: str, rows: torch.Tensor):
    cfg = DecodeConfig(method=method, budget=64, depth=8, width=8, threshold=0.01, temperature=1.0)
    drafter = make_drafter(cfg)
    deterministic = method in ("opt_tree", "dynatree")
    tree = drafter.draft(LookupSource(rows), 1, torch.Generator().manual_seed(0), deterministic=deterministic)
    st = drafter.last_stats
    print(
        f"\n{method:17s} nodes={st.nodes:3d} calls={st.forward_calls:2d} requested={st.requested_nodes:3d} "
        f"construction={st.construction_seconds * 1e3:7.1f} ms (source {st.source_seconds * 1e3:6.1f} ms)"
    )
    assert st.nodes == tree.size and tree.draft_probs.shape[1] == V
    assert st.forward_calls <= cfg.depth + 2
    assert st.construction_seconds < 4.0
