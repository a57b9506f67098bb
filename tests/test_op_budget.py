"""Launch budgets of the eager step, counted on the CPU (``decode.op_count``).

The H200 regression of the device-side drafting merge (budget-64 step 111 -> 262 ms, draft 68 -> 212 ms)
had a cause the CPU can count: ``device_side`` runs one draft forward per level of the envelope (8 at
depth 8) whatever the tree, while the host drafter forwards only what its heap expands. On the bench's
synthetic pair (a flat draft: every tree is the root and its children) that is 9.7 draft forwards' worth of
ops per step against 2.4-3.2 (8-layer draft). The graph step (``decode.graph_step``) runs a fixed number of levels too, but each
as one graph replay; its budget is in ``test_graph_step.py``."""

import pytest
import torch
from conftest import DEVICE

from dyntree_core import DecodeConfig, SpeculativeDecoder
from dyntree_core.bench.resident import synthetic_qwen
from dyntree_core.decode.forward import causal_forward, new_cache
from dyntree_core.decode.op_count import OpCounter, total

#: draft forwards per step allowed beyond the levels the tree expands (the rows a heap evaluates to
#: compare its candidates), and the drafter's own ops per tree node (sibling draws, tree building)
SPARE_FORWARDS = 1
OPS_PER_NODE = 20


@pytest.fixture(scope="module")
def flat_pair():
    """The bench's resident roles at tiny widths and a real draft depth: a flat (sharpen 1) 8-layer
    draft, a peaked target."""
    draft = synthetic_qwen(64, 8, 4, 2, 128, 256, seed=1, dev=DEVICE, sharpen=1.0)
    target = synthetic_qwen(64, 4, 4, 2, 128, 256, seed=2, dev=DEVICE, sharpen=30.0)
    prompt = torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(0)).tolist()
    return draft, target, prompt


def ops_of_one_draft_forward(draft, prompt) -> int:
    cache = new_cache(draft, 64)
    causal_forward(draft, cache, prompt, 0)
    with OpCounter() as counter:
        causal_forward(draft, cache, [3], len(prompt))
        return total(counter.take_step()).ops


def draft_ops(draft, target, prompt, budget: int, **switches) -> tuple[int, list[tuple[int, int]]]:
    """Ops of one draft forward, and per step: (draft-phase ops, levels the tree expanded)."""
    per_forward = ops_of_one_draft_forward(draft, prompt)
    cfg = DecodeConfig(method="dyspec_greedy", budget=budget, depth=8, attention="torch", trace_block_counts=False,
                       device=DEVICE.type)
    dec = SpeculativeDecoder(draft, target, cfg)
    dec.graph_steps = False
    for name, value in switches.items():
        setattr(dec, name, value)
    out = []
    with OpCounter() as counter:
        for tr in dec.generate(prompt, 3):
            counts = counter.take_step()
            depth = tr.tree.depth.tolist()
            out.append((counts["draft"].ops, len({depth[p] for p in tr.tree.parents.tolist()[1:]})))
    return per_forward, out


def within_budget(per_forward: int, ops: int, expanded: int, budget: int) -> bool:
    return ops <= (expanded + SPARE_FORWARDS) * per_forward + OPS_PER_NODE * budget


@pytest.mark.parametrize("budget", [16, 64])
def test_eager_drafting_forwards_at_most_the_levels_it_expands(flat_pair, budget):
    """Host drafting: 2 forwards (+ 250 / 826 ops of its own at budget 16 / 64) for one-level trees."""
    per_forward, steps = draft_ops(*flat_pair, budget)
    for ops, expanded in steps:
        assert within_budget(per_forward, ops, expanded, budget), (ops, expanded, per_forward)


def test_the_budget_catches_a_drafter_that_forwards_every_level(flat_pair):
    """The same budget applied to the device-side drafting of the merge that regressed: 9.7 forwards'
    worth of ops for a one-level tree at depth 8."""
    # (3 tokens: the last steps draft only the levels they can commit, ``cap_levels``; the regression forwarded the
    # envelope's every level, whatever was left)
    per_forward, steps = draft_ops(*flat_pair, 64, device_side=True, cap_levels=False)
    assert all(not within_budget(per_forward, ops, expanded, 64) for ops, expanded in steps), (per_forward, steps)
