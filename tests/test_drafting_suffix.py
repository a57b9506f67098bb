"""The model-free ``suffix`` drafter: the suffix index against brute-force substring counting, the
best-first tree it proposes, greedy token identity with plain decoding and lossless sampling."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from dyntree_core import DecodeConfig, SpeculativeDecoder
from dyntree_core.drafting.suffix import suffix_tree
from dyntree_core.drafting.suffix_index import SuffixIndex
from dyntree_core.testing import tiny_pair
from stat_utils import ALPHA, chi_square_pvalue, exact_first_two, on_lean_forward, sample_first_two, samples_for


def brute_continuations(seq: list[int], context: list[int], max_len: int) -> tuple[int, dict[int, int]]:
    ctx = context[-max_len:]
    for length in range(len(ctx), 0, -1):
        suf = ctx[len(ctx) - length:]
        c = Counter(seq[i + length] for i in range(len(seq) - length) if seq[i:i + length] == suf)
        if c:
            return length, dict(c)
    return 0, {}


@pytest.mark.parametrize("seed", range(6))
def test_index_counts_equal_brute_force_substring_counts(seed):
    rng = random.Random(seed)
    vocab, max_len = rng.choice([2, 3, 5]), rng.choice([1, 3, 6])
    index, seq = SuffixIndex(max_len), []
    for _ in range(12):  # appended in random chunks, as the engine does step by step
        chunk = [rng.randrange(vocab) for _ in range(rng.randrange(0, 9))]
        index.extend(chunk)
        seq += chunk
        for _ in range(5):
            context = [rng.randrange(vocab) for _ in range(rng.randrange(0, 9))] + (seq[-rng.randrange(0, 4):] if seq else [])
            got = index.continuations(context)
            assert (got.match_len, got.counts) == brute_continuations(seq, context, max_len)
    assert index.tokens == seq


def test_tree_is_best_first_over_empirical_continuations():
    text = [1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2, 3, 5, 1, 2]
    index = SuffixIndex(4)
    index.extend(text)
    tree = suffix_tree(index, budget=8, depth=5, threshold=0.01)
    assert tree.sampled == "topk" and int(tree.tokens[0]) == 2 and tree.draft_probs is None
    values = tree.value.tolist()
    assert all(a >= b - 1e-12 for a, b in zip(values[1:], values[2:]))  # added in score order
    for i in range(1, tree.size):
        path = tree.path_to(i)
        ctx = text + tree.tokens[path[1:-1]].tolist()
        _, counts = brute_continuations(text, ctx, 4)
        tok, parent = int(tree.tokens[i]), int(tree.parents[i])
        assert tok in counts  # every node continues text seen before
        p = counts[tok] / sum(counts.values())
        assert math.isclose(values[i], values[parent] * p, rel_tol=1e-12)
        assert math.isclose(math.exp(float(tree.draft_logprob[path[1:]].sum())), values[i], rel_tol=1e-9)
    # after "1 2" the text continued with 3 three times and 4 once: 3 is the first child
    first = [i for i in range(1, tree.size) if int(tree.parents[i]) == 0]
    assert [int(tree.tokens[i]) for i in first[:2]] == [3, 4]
    assert tree.size == 8 and int(tree.depth.max()) <= 5


def test_tree_limits_and_no_match():
    index = SuffixIndex(8)
    index.extend([4, 5, 6, 4, 5, 6, 4, 5, 6, 4])
    assert suffix_tree(index, budget=4, depth=10, threshold=1e-6).size == 4
    assert int(suffix_tree(index, budget=50, depth=2, threshold=1e-6).depth.max()) == 2
    fresh = SuffixIndex(8)
    fresh.extend([1, 2, 3, 9])  # 9 never occurred before: nothing to propose
    assert suffix_tree(fresh, budget=16, depth=4, threshold=1e-6).size == 1


def _repetitive_prompt(seed: int, vocab: int = 64) -> list[int]:
    rng = random.Random(seed)
    motif = [rng.randrange(vocab) for _ in range(rng.randrange(2, 6))]
    return (motif * 4)[: rng.randrange(7, 16)]


@pytest.mark.parametrize("seed", range(20))
def test_greedy_suffix_decoding_equals_autoregressive(seed):
    draft, target = tiny_pair(seed=seed)
    prompt = _repetitive_prompt(seed)
    ar = SpeculativeDecoder(draft, target, DecodeConfig(method="autoregressive")).generate_ids(prompt, 16)
    cfg = DecodeConfig(method="suffix", budget=16, depth=6, threshold=0.01)
    traces = list(SpeculativeDecoder(draft, target, cfg).generate(prompt, 16))
    assert [c.token_id for t in traces for c in t.committed] == ar
    assert all(t.timings.draft == 0.0 for t in traces)  # no draft model forward ran
    assert any(t.tree_size > 1 for t in traces)  # the repeats were proposed


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.6, 1.0])
def test_suffix_sampling_matches_the_target(temperature, one_torch_thread):
    """Chi-square on the first two sampled tokens after a prompt whose repeats make the drafter
    propose a tree (point-mass verification).

    1,010 samples at T=0.6 and 1,390 at T=1 (was 2,500): the fewest at which the test catches any
    bias of chi-square divergence w2 >= 0.04 (every bias of total variation >= 0.1) with power
    >= 0.99 at false-alarm rate ``ALPHA`` (``stat_utils.samples_for``). Checked against point_mass
    reading each node's target row one row off (both fail, p = 0) and, at T=0.6, the target's
    temperature left off (p = 2e-207). After this prompt the first proposal, 7, has target
    probability 0.008 at T=1 (0.0004 at T=0.6), so a bug below a match barely shows (point_mass
    sampling there from the parent's row: w2 = 0.018 at T=1)."""
    draft, target = on_lean_forward(tiny_pair(vocab=16, seed=12, layers=2, hidden=32))
    prompt = [3, 7, 3, 7, 3]
    exact = exact_first_two(target, prompt, temperature)
    cfg = DecodeConfig(method="suffix", temperature=temperature, budget=6, depth=2, threshold=0.01,
                       trace_block_counts=False)
    assert cfg.resolved_verifier() == "point_mass"
    assert SpeculativeDecoder(draft, target, cfg).generate(prompt, 1).__next__().tree_size > 1
    counts = sample_first_two(lambda: SpeculativeDecoder(draft, target, cfg, eos_token_id=()), prompt,
                              samples_for(exact), seed0=4000)
    assert chi_square_pvalue(counts, exact) > ALPHA


def test_spec_factor_is_validated_and_reaches_every_entry_point():
    from dyntree_core import ConfigError
    from dyntree_core.__main__ import _spec_factor_arg
    from dyntree_core.bench.speed import _parse_fixed

    for bad in (0.0, -1.0, 65.0, True, "1"):
        with pytest.raises(ConfigError, match="spec_factor"):
            DecodeConfig(method="suffix", spec_factor=bad)
    assert DecodeConfig(method="suffix", spec_factor=None).spec_factor is None
    assert DecodeConfig().spec_factor == 1.0  # SuffixDecoding's default cap
    assert _spec_factor_arg("none") is None and _spec_factor_arg("2") == 2.0
    assert _parse_fixed("suffix:11:10:0.5") == {"method": "suffix", "budget": 11, "depth": 10, "spec_factor": 0.5}
    assert _parse_fixed("hybrid:32:8:none")["spec_factor"] is None
    assert "spec_factor" not in _parse_fixed("suffix:11:10")
    with pytest.raises(SystemExit, match="spec_factor"):
        _parse_fixed("suffix:1:2:3:4")


def test_a_one_token_match_drafts_one_token_at_the_default_cap():
    """Engine level: with the default cap a weak match proposes a single token, without it a chain."""
    draft, target = tiny_pair(seed=0)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 9]
    sizes = {}
    for f in (1.0, None):
        cfg = DecodeConfig(method="suffix", budget=16, depth=8, threshold=0.01, spec_factor=f)
        sizes[f] = next(iter(SpeculativeDecoder(draft, target, cfg, eos_token_id=()).generate(prompt, 16))).tree_size
    assert sizes == {1.0: 2, None: 9}
