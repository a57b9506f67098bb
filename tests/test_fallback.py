"""``DecodeConfig.fallback``: a draft-tree run whose steps, priced at the profile rows at their own shapes, cost
more per committed token than plain decoding decodes plainly for the rest; ``auto`` sets the rule from the rows
that priced its plan (the sampled case's losslessness is
``test_sampling_e2e::test_a_run_that_falls_back_to_plain_decoding_stays_lossless``)."""

from __future__ import annotations

import pytest

from dyntree_core import DecodeConfig, SpeculativeDecoder
from dyntree_core.config import ConfigError
from dyntree_core.step_price import EARLY_CHECK_FROM, EARLY_MARGIN, FALLBACK_AFTER, FallbackPrice, PricedRows, StepShape
from dyntree_core.testing import tiny_pair


def below(tokens_per_step: float, draft_s: float = 0.0, early: bool = False) -> FallbackPrice:
    """A rule that falls back under ``tokens_per_step`` when draft forwards are free: every target forward
    costs ``tokens_per_step`` plain tokens; each draft forward adds ``draft_s`` of them. Checked from step
    ``FALLBACK_AFTER`` on only, unless ``early`` (the default rule's early check)."""
    flat = lambda s: (float(s), float(s))  # noqa: E731  (flat from 1 to 4,096 tokens)
    rows = PricedRows(ns=(1, 4096), target=flat(tokens_per_step), draft=flat(draft_s), other=flat(0))
    return FallbackPrice(rows, 1.0) if early else FallbackPrice(rows, 1.0, check_from=FALLBACK_AFTER, early_margin=1.0)


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(vocab=64, seed=4, layers=2, hidden=64, draft_noise=0.6)


def _run(pair, n=40, **cfg):
    draft, target = pair
    dec = SpeculativeDecoder(draft, target, DecodeConfig(trace_block_counts=False, **cfg), eos_token_id=())
    return list(dec.generate([5, 9], n))


def test_a_tree_run_below_its_break_even_decodes_plainly_from_then_on_token_identical(pair, one_torch_thread):
    plain = [c.token_id for t in _run(pair, method="autoregressive") for c in t.committed]
    traces = _run(pair, method="chain", depth=4, fallback=below(4.5))
    methods = [t.method for t in traces]
    switch = next(i for i, t in enumerate(traces) if t.fallback)
    assert switch >= FALLBACK_AFTER - 1 and methods[:switch + 1] == ["chain"] * (switch + 1)
    assert set(methods[switch + 1:]) <= {"autoregressive", "suffix"} and len(methods) > switch + 1
    tree = traces[:switch + 1]
    mean = sum(t.num_committed for t in tree) / len(tree)
    assert mean < 4.5 and f"{mean:.2f} tokens each over {len(tree)} steps" in traces[switch].fallback
    assert f"{4.5 / mean * 1e3:.0f} ms per token against 1000 for plain decoding" in traces[switch].fallback
    assert sum(bool(t.fallback) for t in traces) == 1
    assert [c.token_id for t in traces for c in t.committed] == plain  # greedy: identical to plain decoding


def test_a_tree_that_pays_keeps_drafting(pair, one_torch_thread):
    for rule in (None, below(1.0)):  # a step commits at least one token: 1.0 is never undercut
        traces = _run(pair, method="chain", depth=4, fallback=rule)
        assert {t.method for t in traces} == {"chain"} and not any(t.fallback for t in traces)


def test_after_the_fallback_the_repeat_drafter_indexes_the_whole_text(one_torch_thread):
    """The repeats are drafted from the text so far: the drafter made at the fallback is given the prompt and every
    token committed until then, and each token committed after it (plain steps and its own steps alike)."""
    from dyntree_core.drafting.repeats import RepeatDrafter

    seen: list[int] = []
    reset, extend = RepeatDrafter.reset, RepeatDrafter.extend

    def spy_reset(self, prompt=()):
        seen[:] = list(prompt)
        return reset(self, prompt)

    def spy_extend(self, tokens):
        seen.extend(tokens)
        return extend(self, tokens)

    import unittest.mock as mock

    with mock.patch.object(RepeatDrafter, "reset", spy_reset), mock.patch.object(RepeatDrafter, "extend", spy_extend):
        traces = _run(tiny_pair(vocab=64, seed=4, layers=2, hidden=64), n=30, method="suffix", budget=8, depth=4,
                      fallback=below(64.0))
    assert traces[FALLBACK_AFTER - 1].fallback
    assert seen == [5, 9] + [c.token_id for t in traces for c in t.committed]


def test_a_chain_pays_for_the_draft_forwards_its_steps_ran(pair, one_torch_thread):
    """The same steps, the same tokens per step: free draft forwards keep the tree, draft forwards that cost
    half a target forward each make its steps dearer than plain decoding (a text that accepts more grows longer
    chains: each step is priced at its own number of draft levels)."""
    free = _run(pair, method="chain", depth=4, fallback=below(1.2))
    assert {t.method for t in free} == {"chain"}
    steps = free[:FALLBACK_AFTER]
    tps = sum(t.num_committed for t in steps) / len(steps)
    levels = sum(StepShape.of(t).levels for t in steps) / len(steps)
    assert tps < 1.2 + 0.5 * levels  # so the dear draft must fall back at step FALLBACK_AFTER
    dear = _run(pair, method="chain", depth=4, fallback=below(1.2, draft_s=0.5))
    switch = next(i for i, t in enumerate(dear) if t.fallback)
    assert switch == FALLBACK_AFTER - 1 and dear[switch + 1].method in ("autoregressive", "suffix")


def test_the_early_check_ends_a_run_far_below_its_break_even_and_waits_near_it():
    rule = below(2.0, early=True)
    assert (rule.check_from, rule.early_margin) == (EARLY_CHECK_FROM, EARLY_MARGIN)
    assert 1 < EARLY_CHECK_FROM < FALLBACK_AFTER
    just_over = 1.0 + (EARLY_MARGIN - 1.0) / 2  # dearer than plain decoding, within the early margin
    assert not rule.falls_back(EARLY_CHECK_FROM - 1, 10.0)  # too few steps to say anything
    assert rule.falls_back(EARLY_CHECK_FROM, EARLY_MARGIN * 1.01) and not rule.falls_back(EARLY_CHECK_FROM, just_over)
    assert not rule.falls_back(FALLBACK_AFTER - 1, just_over) and rule.falls_back(FALLBACK_AFTER, just_over)
    assert not rule.falls_back(FALLBACK_AFTER, 1.0)  # as dear as plain decoding: the tree stays


def test_a_run_far_below_its_break_even_falls_back_at_the_early_check(pair, one_torch_thread):
    """The tiny pair's chain commits under 2 tokens a step against a break-even of 4.5: with the early check the
    run decodes plainly after step EARLY_CHECK_FROM, token-identical to plain decoding."""
    plain = [c.token_id for t in _run(pair, method="autoregressive") for c in t.committed]
    traces = _run(pair, method="chain", depth=4, fallback=below(4.5, early=True))
    switch = next(i for i, t in enumerate(traces) if t.fallback)
    mean = sum(t.num_committed for t in traces[:switch + 1]) / (switch + 1)
    assert mean * EARLY_MARGIN < 4.5 and switch == EARLY_CHECK_FROM - 1
    assert [c.token_id for t in traces for c in t.committed] == plain


def test_a_steps_price_is_its_own_shape():
    rows = PricedRows(ns=(1, 2, 4), target=(0.10, 0.12, 0.16), draft=(0.05, 0.06, 0.08), other=(0.01, 0.01, 0.02))
    assert rows.step_seconds(StepShape(levels=3, width=1.0, size=4)) == pytest.approx(3 * 0.05 + 0.16 + 0.02)
    assert rows.step_seconds(StepShape(levels=2, width=2.0, size=5)) == float("inf")  # no price above 4 tokens
    assert rows.step_seconds(StepShape(levels=0, width=1.0, size=3)) == pytest.approx(0.14 + 0.015)


def test_the_rule_is_checked_and_survives_an_export(pair):
    with pytest.raises(ConfigError, match="fallback"):
        DecodeConfig(method="chain", fallback=4.5)
    with pytest.raises(ConfigError, match="plain_s_per_token"):
        DecodeConfig(method="chain", fallback=FallbackPrice(below(2.0).rows, 0.0))
    with pytest.raises(ConfigError, match="target row"):
        DecodeConfig(method="chain", fallback=FallbackPrice(PricedRows((1,), (None,), (0.0,), (0.0,)), 1.0))
    with pytest.raises(ConfigError, match="early_margin"):
        DecodeConfig(method="chain", fallback=FallbackPrice(below(2.0).rows, 1.0, early_margin=0.5))
    import json
    for rule in (FallbackPrice(PricedRows((1, 2), (0.1, None), (0.05, 0.06), (0.0, 0.001)), 0.09),
                 FallbackPrice(PricedRows((1, 2), (0.1, None), (0.05, 0.06), (0.0, 0.001)), 0.09, 5, 1.5)):
        exported = json.loads(json.dumps(DecodeConfig(method="chain", fallback=rule).to_dict()))["fallback"]
        assert FallbackPrice.from_dict(exported) == rule


def test_auto_sets_its_break_even_for_draft_model_trees_only():
    from dyntree_core.planning.auto import choose
    from dyntree_core.planning.machine_profile import MachineProfile

    ns = [1, 2, 4, 8, 16, 32]
    prof = MachineProfile(key="k", machine={"cpu_model": "t", "cpu_class": "avx2"}, prefix_len=32, ns=ns,
                          target={"bfloat16": [0.1] * 6}, draft={"bfloat16": [0.005] * 6}, other=[0.0] * 6)
    plan = choose(prof, (0.8, 0.1, 0.05), 0.0, ["bfloat16"], ["bfloat16"])
    b = plan.best
    assert b.method in ("chain", "sequoia")
    expected = b.step_seconds / plan.best_autoregressive.seconds_per_token  # the step's cost in plain tokens
    assert plan.break_even_tokens() == pytest.approx(expected, abs=1e-3) and 1 < expected < b.expected_tokens
    cfg = plan.apply(DecodeConfig())
    assert cfg.fallback == FallbackPrice(PricedRows.of(prof, b.target_precision, b.draft_precision),
                                         plan.best_autoregressive.seconds_per_token,
                                         tree_s_per_token=b.seconds_per_token)  # (the bar of the repeats inside it)
    # at the planned shape the rule is the break-even
    shape = StepShape(levels=b.depth, width=1.0, size=b.depth + 1) if b.method == "chain" else None
    if shape is not None:
        assert cfg.fallback.rows.step_seconds(shape) / cfg.fallback.plain_s_per_token == pytest.approx(
            b.step_seconds / plan.best_autoregressive.seconds_per_token, rel=0.05)
    assert plan.break_even_tokens(plan.best_autoregressive) is None
    assert plan.method_fields(plan.best_autoregressive)["fallback"] is None
