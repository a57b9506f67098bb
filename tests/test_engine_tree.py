"""Tree forwards, KV compaction and greedy exactness of every drafter on tiny_pair."""

import random

import pytest
import torch

from dyntree_core import DecodeConfig, SpeculativeDecoder
from dyntree_core.config import METHODS
from dyntree_core.decode.draft_source import ModelDraftSource
from dyntree_core.decode.forward import causal_forward, masked_forward, new_cache
from dyntree_core.decode.kv import cache_length, compact
from dyntree_core.testing import tiny_pair
from dyntree_core.tree import tree_from_parents

TREE_METHODS = [m for m in METHODS if m != "autoregressive"]


def random_tree(n: int, vocab: int, rng: random.Random):
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    tokens = [rng.randrange(vocab) for _ in range(n)]
    return tree_from_parents(parents, tokens)


def sequential_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1].float()


@pytest.mark.parametrize("seed", range(4))
def test_tree_forward_logits_equal_sequential_forward_on_root_path(seed):
    rng = random.Random(seed)
    _, target = tiny_pair(seed=seed)
    prompt = [rng.randrange(64) for _ in range(7)]
    tree = random_tree(12, 64, rng)
    tree.tokens[0] = prompt[-1]
    cache = new_cache(target)
    causal_forward(target, cache, prompt[:-1], 0)
    n = tree.size
    visible = torch.ones(n, len(prompt) - 1 + n, dtype=torch.bool)
    visible[:, len(prompt) - 1 :] = tree.ancestor_mask()
    logits = masked_forward(target, cache, tree.tokens.tolist(), tree.positions(len(prompt)).tolist(), visible)
    for node in range(n):
        path_tokens = [int(tree.tokens[i]) for i in tree.path_to(node)]
        ref = sequential_logits(target, prompt[:-1] + path_tokens)
        torch.testing.assert_close(logits[node].float(), ref, atol=1e-5, rtol=0)


def test_compaction_keeps_accepted_path_kv():
    rng = random.Random(7)
    _, target = tiny_pair(seed=7)
    prompt = [rng.randrange(64) for _ in range(5)]
    tree = random_tree(10, 64, rng)
    tree.tokens[0] = prompt[-1]
    cache = new_cache(target)
    causal_forward(target, cache, prompt[:-1], 0)
    base = cache_length(cache)
    n = tree.size
    visible = torch.ones(n, base + n, dtype=torch.bool)
    visible[:, base:] = tree.ancestor_mask()
    masked_forward(target, cache, tree.tokens.tolist(), tree.positions(len(prompt)).tolist(), visible)
    leaf = n - 1
    path = tree.path_to(leaf)
    compact(cache, base, [base + i for i in path])
    assert cache_length(cache) == base + len(path)
    nxt = 11
    committed = prompt + [int(tree.tokens[i]) for i in path[1:]]
    got = causal_forward(target, cache, [nxt], len(committed))[0].float()
    ref = sequential_logits(target, committed + [nxt])
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_draft_source_batches_and_reuses_kv():
    draft, _ = tiny_pair(seed=2)
    prompt = [4, 8, 15, 16]
    cache = new_cache(draft)
    causal_forward(draft, cache, prompt[:2], 0)  # draft cache lags: two committed tokens pending
    src = ModelDraftSource(draft, cache, prompt[2:], temperature=1.0)
    tokens, parents = [16, 23, 42, 5], [-1, 0, 0, 1]
    p_root = src.next_probs(tokens[:1], parents[:1], [0])
    p_rest = src.next_probs(tokens, parents, [1, 2, 3])
    assert src.forward_calls == 2
    for row, node_path in zip([p_root[0], *p_rest], [[16], [16, 23], [16, 42], [16, 23, 5]]):
        ref = torch.softmax(sequential_logits(draft, prompt[:-1] + node_path), -1)
        torch.testing.assert_close(row, ref, atol=1e-5, rtol=0)
    kept = src.commit_path([0, 1, 3])
    assert kept == len(prompt) + 2 == cache_length(cache)


@pytest.mark.parametrize("method", TREE_METHODS)
def test_greedy_output_token_identical_to_target_greedy(method):
    mismatches = []
    for seed in range(20):
        draft, target = tiny_pair(seed=seed)
        prompt = [seed % 60 + 2, 7, 11]
        ar = SpeculativeDecoder(draft, target, DecodeConfig(method="autoregressive")).generate_ids(prompt, 24)
        cfg = DecodeConfig(method=method, budget=16, depth=4, width=3, seed=seed)
        ours = SpeculativeDecoder(draft, target, cfg).generate_ids(prompt, 24)
        if ours != ar:
            mismatches.append((seed, ours, ar))
    assert not mismatches, mismatches[:2]


@pytest.mark.parametrize("method", ["chain", "dyspec_greedy", "specinfer", "hybrid"])
def test_a_run_drafts_no_level_it_cannot_commit(method):
    """With k tokens left a step commits at most k - 1 drafted tokens and the bonus: no tree is deeper than that
    (at least 1 level), the run's text is the same as with ``cfg.depth`` to the end (T = 0), and it forwarded fewer
    draft levels (``SpeculativeDecoder.cap_levels``; off: the trees reach ``cfg.depth``); chains also fewer target
    rows, while DySpec's and OPT-Tree's budgets fill the shallower levels."""
    cfg = DecodeConfig(method=method, budget=16, depth=6, width=2, seed=3)
    ran = {}
    for cap in (True, False):
        draft, target = tiny_pair(seed=3)
        dec = SpeculativeDecoder(draft, target, cfg)
        dec.cap_levels = cap
        ran[cap] = list(dec.generate([9, 4, 4, 7], 13))
    left = 13
    for t in ran[True]:
        assert t.tree.num_levels - 1 <= max(1, left - 1), (t.step, left, t.tree.num_levels)
        left -= len(t.committed)
    ids = {cap: [c.token_id for t in traces for c in t.committed] for cap, traces in ran.items()}
    assert ids[True] == ids[False] and len(ids[True]) == 13
    cost = {cap: (sum(t.draft_forwards for t in traces), sum(t.tree.size for t in traces)) for cap, traces in ran.items()}
    assert cost[True][0] < cost[False][0], cost  # fewer draft forwards
    if method in ("chain", "specinfer"):  # fewer target rows; a budget drafter fills shallower levels instead
        assert cost[True][1] < cost[False][1], cost
    assert any(t.tree.num_levels - 1 == 6 for t in ran[False])


@pytest.mark.parametrize("method", ["chain", "dyspec_greedy"])
def test_no_reprefill_target_sees_each_token_once_per_step(method):
    draft, target = tiny_pair(seed=5)
    fed = []
    hook = target.model.embed_tokens.register_forward_hook(lambda m, i, o: fed.append(i[0].shape[1]))
    try:
        prompt = [3, 4, 5, 6, 7, 8]
        traces = list(SpeculativeDecoder(draft, target, DecodeConfig(method=method, budget=8)).generate(prompt, 20))
    finally:
        hook.remove()
    assert fed[0] == len(prompt) - 1  # prefill once
    assert fed[1:] == [t.tree.size for t in traces]  # then exactly one tree per step, nothing re-fed


def test_trace_of_tree_step_is_consistent():
    draft, target = tiny_pair(seed=9)
    traces = list(SpeculativeDecoder(draft, target, DecodeConfig(method="dyspec_greedy", budget=12)).generate([5, 6], 30))
    assert sum(len(t.committed) for t in traces) == 30
    for t in traces:
        assert t.accepted_nodes[0] == 0 and t.node_status[0] == "root"
        accepted = [c.node for c in t.committed if c.kind == "accepted"]
        assert accepted == t.accepted_nodes[1 : 1 + len(accepted)]  # the last step may be cut short
        for node in t.accepted_nodes[1:]:
            assert t.node_status[node] == "accepted"
        assert set(t.block_counts) == {"bfs", "dfs", "hpd"}
        assert t.block_counts["dfs"][16] >= 1
