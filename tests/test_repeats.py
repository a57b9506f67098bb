"""``drafting.repeats``: after a fallback, the text's own repeats are drafted where the run's profile rows price
them to pay, and the run stays token-identical to plain decoding (T > 0:
``test_sampling_e2e::test_repeats_drafted_after_a_fallback_stay_lossless``)."""

from __future__ import annotations

import pytest
import torch

from dyntree_core import DecodeConfig, SpeculativeDecoder
from dyntree_core.drafting.repeats import REPEAT_BUDGET, RepeatDrafter, best_priced_size
from dyntree_core.step_price import FallbackPrice, PricedRows
from dyntree_core.testing import tiny_pair


def rows(*target: float) -> PricedRows:
    """Target forwards of 1, 2, ... tokens at ``target`` seconds, nothing else."""
    ns = tuple(range(1, len(target) + 1))
    return PricedRows(ns, tuple(target), (0.0,) * len(ns), (0.0,) * len(ns))


def test_the_best_priced_prefix():
    value = torch.tensor([1.0, 0.9, 0.6, 0.3], dtype=torch.float64)
    assert best_priced_size(value, rows(1.0, 1.0, 1.0, 1.0)) == 4  # flat: every node is free
    assert best_priced_size(value, rows(1.0, 1.2, 1.5, 2.0)) == 3  # 2.5 / 1.5 beats 1.9 / 1.2 and 2.8 / 2.0
    assert best_priced_size(value, rows(1.0, 2.0, 3.0, 4.0)) == 1  # priced by its tokens: no prefix beats plain
    assert best_priced_size(value[:1], rows(1.0)) == 1  # the root alone
    # inside a run the prefix must also beat the tree steps' priced rate (seconds per token)
    assert best_priced_size(value, rows(1.0, 1.2, 1.5, 2.0), bar_s_per_token=0.65) == 3  # 2.5 / 1.5 beats 1 / 0.65
    assert best_priced_size(value, rows(1.0, 1.2, 1.5, 2.0), bar_s_per_token=0.55) == 1  # none beats 1 / 0.55
    assert best_priced_size(value, rows(1.0, 1.0, 1.0, 1.0), bar_s_per_token=5.0) == 4  # a plain step's bar holds


def test_the_rule_carries_its_tree_rate_through_an_export():
    rule = FallbackPrice(rows(1.0, 1.0), 1.0, tree_s_per_token=0.4)
    from dataclasses import asdict

    assert FallbackPrice.from_dict(asdict(rule)) == rule
    assert FallbackPrice.from_dict({k: v for k, v in asdict(rule).items() if k != "tree_s_per_token"}
                                   ).tree_s_per_token is None  # (a rule saved before it)
    assert "tree_s_per_token" in FallbackPrice(rows(1.0), 1.0, tree_s_per_token=0.0).problem()
    assert FallbackPrice(rows(1.0), 1.0, tree_s_per_token=None).problem() == ""


def _drafter(text, priced):
    d = RepeatDrafter(DecodeConfig(method="chain"), priced)
    d.reset(text)
    return d


def test_a_repeat_is_drafted_where_it_pays_and_nowhere_else():
    loop = [1, 2, 3, 4, 1, 2, 3, 4, 1]
    tree = _drafter(loop, rows(1.0, 1.0, 1.0, 1.0)).candidate(1)
    assert tree is not None and tree.tokens.tolist() == [1, 2, 3, 4] and tree.size == REPEAT_BUDGET
    assert _drafter(loop, rows(1.0, 2.0, 3.0, 4.0)).candidate(1) is None  # priced by its tokens
    assert _drafter([1, 2, 3, 4], rows(1.0, 1.0, 1.0, 1.0)).candidate(4) is None  # 4 was never followed
    assert _drafter(loop, rows(1.0, 1.0, 1.0, 1.0)).candidate(7) is None  # the text does not end with 7
    two = _drafter(loop, rows(1.0, 1.0, 1.0, 10.0)).candidate(1)  # the fourth node too dear: the first three
    assert two is not None and two.tokens.tolist() == [1, 2, 3]
    strict = RepeatDrafter(DecodeConfig(method="chain"), rows(1.0, 1.0, 1.0, 1.0), min_match=5)
    strict.reset(loop)  # the text ends with "1, 2, 3, 4, 1" (a 5-token match)
    assert strict.match_length() == 5 and strict.candidate(1) is not None
    strict.min_match = 6
    assert strict.candidate(1) is None


def _run(pair, target_row, prompt, n=40):
    flat_draft = (0.0, 0.0)
    rule = FallbackPrice(PricedRows((1, 4096), target_row, flat_draft, flat_draft), 1.0)
    dec = SpeculativeDecoder(*pair, DecodeConfig(method="chain", depth=4, trace_block_counts=False, fallback=rule),
                             eos_token_id=())
    return list(dec.generate(prompt, n))


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(vocab=64, seed=4, layers=2, hidden=64, draft_noise=0.6)


def test_after_a_fallback_repeats_are_verified_token_identical_to_plain_decoding(pair, one_torch_thread):
    prompt = [5, 9, 5, 9, 5]
    dec = SpeculativeDecoder(*pair, DecodeConfig(method="autoregressive"), eos_token_id=())
    plain = [c.token_id for t in dec.generate(prompt, 40) for c in t.committed]
    flat = _run(pair, (64.0, 64.0), prompt)  # every target forward costs 64 plain tokens: a repeat always pays
    switch = next(i for i, t in enumerate(flat) if t.fallback)
    after = flat[switch + 1:]
    repeats = [t for t in after if t.method == "suffix"]
    assert repeats and {t.method for t in after} == {"suffix", "autoregressive"}
    assert all(t.draft_source == "repeats" and t.draft_forwards == 0 and t.verifier == "greedy" for t in repeats)
    assert all(2 <= t.tree_size <= REPEAT_BUDGET for t in repeats)
    assert sum(t.num_committed for t in repeats) > len(repeats)  # some of the repeats were accepted
    assert "repeats" in flat[switch].fallback
    assert [c.token_id for t in flat for c in t.committed] == plain
    steep = _run(pair, (64.0, 64.0 * 4096), prompt)  # priced by its tokens: no repeat beats a plain step
    switch = next(i for i, t in enumerate(steep) if t.fallback)
    assert {t.method for t in steep[switch + 1:]} == {"autoregressive"}
    assert [c.token_id for t in steep for c in t.committed] == plain


def _in_run(draft, target, prompt, tree_s_per_token, n=48, on=True):
    """A chain run (depth 4) whose priced rule never falls back (plain decoding priced dear), its tree steps priced
    at ``tree_s_per_token``; every target forward costs 64 s, so a repeat tree of E expected tokens pays where
    E / 64 > ``REPEAT_EDGE`` / ``tree_s_per_token``."""
    rule = FallbackPrice(PricedRows((1, 4096), (64.0, 64.0), (0.0, 0.0), (0.0, 0.0)), 1e9,
                         tree_s_per_token=tree_s_per_token)
    dec = SpeculativeDecoder(draft, target, DecodeConfig(method="chain", depth=4, trace_block_counts=False,
                                                         fallback=rule), eos_token_id=())
    dec.repeats_in_run = on
    return list(dec.generate(prompt, n))


def test_inside_a_run_repeats_stand_in_for_tree_steps_and_the_draft_catches_up(pair, one_torch_thread):
    """Before any fallback, a step whose text repeats itself verifies the repeat tree where it is priced to beat the
    run's tree steps (no draft forward); the run stays token-identical to plain decoding. The draft here is the
    target itself, so every chain step accepts its whole chain exactly when the draft's cache holds the committed
    text: after each repeat step it must catch up on the tokens that step committed."""
    from dyntree_core.drafting.repeats import REPEAT_IN_RUN_BUDGET

    target = pair[1]
    prompt = [5, 9, 5, 9, 5]
    plain = [c.token_id for t in SpeculativeDecoder(target, target, DecodeConfig(method="autoregressive"),
                                                    eos_token_id=()).generate(prompt, 48) for c in t.committed]
    run = _in_run(target, target, prompt, tree_s_per_token=64.0 / 5)  # a whole chain: 5 tokens per 64 s
    repeats = [t for t in run if t.draft_source == "repeats"]
    chains = [t for t in run if t.draft_source == "model"]
    assert repeats and chains and not any(t.fallback for t in run)
    assert all(t.method == "suffix" and t.draft_forwards == 0 and 2 <= t.tree_size <= REPEAT_IN_RUN_BUDGET
               for t in repeats)
    after_repeat = [b for a, b in zip(run, run[1:]) if a.draft_source == "repeats" and b.draft_source == "model"]
    assert after_repeat and all(t.num_committed == 5 for t in chains if not t.finished)  # the draft caught up
    assert [c.token_id for t in run for c in t.committed] == plain
    # priced against a dearer chain (fewer tokens per step), more repeats pay; with a dear edge none; off: none
    assert sum(t.draft_source == "repeats" for t in _in_run(target, target, prompt, 64.0)) >= len(repeats)
    assert not any(t.draft_source == "repeats" for t in _in_run(target, target, prompt, 64.0 / 64))
    off = _in_run(target, target, prompt, 64.0 / 5, on=False)
    assert not any(t.draft_source == "repeats" for t in off)
    assert [c.token_id for t in off for c in t.committed] == plain


def test_inside_a_run_with_a_noisy_draft_repeats_and_the_fallback_stay_token_identical(pair, one_torch_thread):
    """The module's noisy draft: repeats inside the run, then (plain decoding priced cheap) the fallback, after which
    only the fallback's own repeat drafter (4 nodes, against a plain step) runs; token-identical throughout."""
    prompt = [5, 9, 5, 9, 5]
    dec = SpeculativeDecoder(*pair, DecodeConfig(method="autoregressive"), eos_token_id=())
    plain = [c.token_id for t in dec.generate(prompt, 48) for c in t.committed]
    rule = FallbackPrice(PricedRows((1, 4096), (64.0, 64.0), (0.0, 0.0), (0.0, 0.0)), 64.0 / 2.5, check_from=8,
                         tree_s_per_token=64.0 / 3)
    run = list(SpeculativeDecoder(*pair, DecodeConfig(method="chain", depth=4, trace_block_counts=False,
                                                      fallback=rule), eos_token_id=()).generate(prompt, 48))
    assert [c.token_id for t in run for c in t.committed] == plain
    switch = next(i for i, t in enumerate(run) if t.fallback)
    assert any(t.draft_source == "repeats" for t in run[:switch])
    after = run[switch + 1:]
    assert any(t.draft_source == "repeats" for t in after) and all(t.tree_size <= REPEAT_BUDGET for t in after)
