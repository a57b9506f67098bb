"""``DecodeConfig.fallback_below``: a draft-tree run whose steps commit fewer tokens than its plan's break-even
decodes plainly for the rest; ``auto`` sets the break-even from its prediction (the sampled case's losslessness is
``test_sampling_e2e::test_a_run_that_falls_back_to_plain_decoding_stays_lossless``)."""

from __future__ import annotations

import pytest

from dyntree_core import DecodeConfig, SpeculativeDecoder
from dyntree_core.config import FALLBACK_AFTER, ConfigError
from dyntree_core.testing import tiny_pair


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(vocab=64, seed=4, layers=2, hidden=64, draft_noise=0.6)


def _run(pair, n=40, **cfg):
    draft, target = pair
    dec = SpeculativeDecoder(draft, target, DecodeConfig(trace_block_counts=False, **cfg), eos_token_id=())
    return list(dec.generate([5, 9], n))


def test_a_tree_run_below_its_break_even_decodes_plainly_from_then_on_token_identical(pair, one_torch_thread):
    plain = [c.token_id for t in _run(pair, method="autoregressive") for c in t.committed]
    traces = _run(pair, method="chain", depth=4, fallback_below=4.5)
    methods = [t.method for t in traces]
    switch = next(i for i, t in enumerate(traces) if t.fallback)
    assert switch >= FALLBACK_AFTER - 1 and methods[:switch + 1] == ["chain"] * (switch + 1)
    assert set(methods[switch + 1:]) == {"autoregressive"} and len(methods) > switch + 1
    tree = traces[:switch + 1]
    mean = sum(t.num_committed for t in tree) / len(tree)
    assert mean < 4.5 and f"{mean:.2f} tokens each over {len(tree)} steps" in traces[switch].fallback
    assert sum(bool(t.fallback) for t in traces) == 1
    assert [c.token_id for t in traces for c in t.committed] == plain  # greedy: identical to plain decoding


def test_a_tree_that_pays_keeps_drafting(pair, one_torch_thread):
    for below in (None, 1.0):  # a step commits at least one token: 1.0 is never undercut
        traces = _run(pair, method="chain", depth=4, fallback_below=below)
        assert {t.method for t in traces} == {"chain"} and not any(t.fallback for t in traces)


def test_a_suffix_run_that_falls_back_keeps_its_index_of_the_text(one_torch_thread):
    """The drafter still sees every committed token (a model-free drafter indexes the text)."""
    from dyntree_core.drafting import suffix

    seen: list[int] = []
    orig = suffix.SuffixDrafter.extend

    def spy(self, tokens):
        seen.extend(tokens)
        return orig(self, tokens)

    import unittest.mock as mock

    with mock.patch.object(suffix.SuffixDrafter, "extend", spy):
        traces = _run(tiny_pair(vocab=64, seed=4, layers=2, hidden=64), n=30, method="suffix", budget=8, depth=4,
                      fallback_below=64.0)
    assert traces[FALLBACK_AFTER - 1].fallback and traces[-1].method == "autoregressive"
    assert seen[-30:] == [c.token_id for t in traces for c in t.committed]


def test_the_threshold_is_checked(pair):
    with pytest.raises(ConfigError, match="fallback_below"):
        DecodeConfig(method="chain", fallback_below=0.5)
    with pytest.raises(ConfigError, match="fallback_below"):
        DecodeConfig(method="chain", fallback_below=True)


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
    assert cfg.fallback_below == plan.break_even_tokens()
    assert plan.break_even_tokens(plan.best_autoregressive) is None
    assert plan.method_fields(plan.best_autoregressive)["fallback_below"] is None
