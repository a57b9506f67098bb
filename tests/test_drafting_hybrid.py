"""The hybrid drafter: suffix tree where the text supports it (no draft forward), OPT-Tree on the
draft model elsewhere; lossless either way (greedy identity, chi-square of sampled tokens)."""

from __future__ import annotations

import random

import pytest
import torch

from dyntree_core import DecodeConfig, SpeculativeDecoder
from dyntree_core.drafting import make_drafter
from dyntree_core.drafting.base import PathFunctionSource
from dyntree_core.drafting.hybrid import SUFFIX_MIN_EXPECTED
from dyntree_core.testing import tiny_pair
from stat_utils import ALPHA, chi_square_pvalue, exact_first_two, on_lean_forward, sample_first_two, samples_for


def _flat(v: int):
    return lambda path: torch.full((v,), 1.0 / v)


def test_the_source_follows_the_support_of_the_text():
    cfg = DecodeConfig(method="hybrid", budget=8, depth=4, threshold=0.01)
    drafter = make_drafter(cfg)
    src = PathFunctionSource(_flat(16), 16)
    drafter.reset([3, 7, 3, 7, 3, 7, 3])  # "3 7" repeats: after 3 comes 7, then 3, ...
    tree = drafter.draft(src, 3, torch.Generator().manual_seed(0))
    assert drafter.last_source == "suffix" and src.forward_calls == 0 and drafter.last_stats.forward_calls == 0
    assert drafter.last_stats.source == "suffix"
    assert tree.tokens[1:3].tolist() == [7, 3] and float(tree.value[1:].sum()) >= SUFFIX_MIN_EXPECTED
    drafter.reset([1, 2, 4, 5, 6, 9])  # nothing repeats: the draft model drafts
    tree = drafter.draft(src, 9, torch.Generator().manual_seed(0))
    assert drafter.last_source == "model" and src.forward_calls > 0 and tree.size > 1
    assert drafter.last_stats.source == "model"
    assert tree.sampled == "topk"


def _prompt(seed: int, vocab: int = 64) -> list[int]:
    rng = random.Random(seed)
    motif = [rng.randrange(vocab) for _ in range(rng.randrange(2, 5))]
    return (motif * 3)[: rng.randrange(6, 12)] + [rng.randrange(vocab) for _ in range(3)]


def test_greedy_hybrid_decoding_equals_autoregressive():
    sources = set()
    for seed in range(10):
        draft, target = tiny_pair(seed=seed)
        prompt = _prompt(seed)
        ar = SpeculativeDecoder(draft, target, DecodeConfig(method="autoregressive")).generate_ids(prompt, 20)
        cfg = DecodeConfig(method="hybrid", budget=12, depth=5, threshold=0.01)
        traces = list(SpeculativeDecoder(draft, target, cfg).generate(prompt, 20))
        assert [c.token_id for t in traces for c in t.committed] == ar, seed
        # the trace names the source; suffix steps ran no draft forward
        assert all((t.draft_source == "suffix") == (t.timings.draft == 0.0) for t in traces), seed
        sources.update(t.draft_source for t in traces)
    assert sources == {"suffix", "model"}  # both sources drafted some steps


@pytest.mark.slow
@pytest.mark.parametrize("prompt", [[3, 7, 3, 7, 3], [3, 7, 5]], ids=["suffix-step", "model-step"])
def test_hybrid_sampling_matches_the_target(prompt, one_torch_thread):
    """Chi-square on the first two sampled tokens at T = 0.6 (point-mass verification), once with a
    first step the suffix tree drafts and once with one the draft model drafts.

    1,010 (suffix step) and 1,237 (model step) samples, was 2,500: the fewest at which the test
    catches any bias of chi-square divergence w2 >= 0.04 (every bias of total variation >= 0.1)
    with power >= 0.99 at false-alarm rate ``ALPHA`` (``stat_utils.samples_for``). Checked against
    the target's temperature left off (both fail: p = 5e-243, 2e-182), point_mass reading each
    node's target row one row off (both fail, p = 0) and point_mass sampling below a matched node
    from its parent's row (the model step fails, p = 0). After the suffix-step prompt the suffix
    tree's first proposal, 7, has target probability 0.0004 at T=0.6, so a bug below a match barely
    shows there (the last one: w2 = 0.001)."""
    draft, target = on_lean_forward(tiny_pair(vocab=16, seed=12, layers=2, hidden=32))
    exact = exact_first_two(target, prompt, 0.6)
    cfg = DecodeConfig(method="hybrid", temperature=0.6, budget=6, depth=2, threshold=0.01,
                       trace_block_counts=False)
    assert cfg.resolved_verifier() == "point_mass"
    dec = SpeculativeDecoder(draft, target, cfg)
    dec.cap_levels = False  # (a 1-token run's tree would be capped to one level: the 2-level suffix tree is tested)
    first = next(dec.generate(prompt, 1))
    assert first.tree_size > 1 and (first.timings.draft == 0.0) == (prompt == [3, 7, 3, 7, 3])
    counts = sample_first_two(lambda: SpeculativeDecoder(draft, target, cfg, eos_token_id=()), prompt,
                              samples_for(exact), seed0=7000)
    assert chi_square_pvalue(counts, exact) > ALPHA
