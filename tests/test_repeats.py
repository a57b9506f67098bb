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
    assert all(t.draft_source == "suffix" and t.draft_forwards == 0 and t.verifier == "greedy" for t in repeats)
    assert all(2 <= t.tree_size <= REPEAT_BUDGET for t in repeats)
    assert sum(t.num_committed for t in repeats) > len(repeats)  # some of the repeats were accepted
    assert "repeats" in flat[switch].fallback
    assert [c.token_id for t in flat for c in t.committed] == plain
    steep = _run(pair, (64.0, 64.0 * 4096), prompt)  # priced by its tokens: no repeat beats a plain step
    switch = next(i for i, t in enumerate(steep) if t.fallback)
    assert {t.method for t in steep[switch + 1:]} == {"autoregressive"}
    assert [c.token_id for t in steep for c in t.committed] == plain
