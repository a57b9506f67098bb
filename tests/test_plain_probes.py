"""``decode.plain_probes``: a tree run that times plain decoding inside itself decodes one plain step at the probe
steps, commits its token like any step and stays token-identical to plain decoding; its draft catches up on the
probe's token (T > 0: ``test_sampling_e2e::test_plain_probes_inside_a_run_stay_lossless``)."""

from __future__ import annotations

import pytest

from dyntree_core import DecodeConfig, SpeculativeDecoder
from dyntree_core.decode.plain_probes import (PROBE, plain_steps_inside, probe_due, probe_steps,
                                              probed_s_per_token)
from dyntree_core.testing import tiny_pair
from dyntree_core.trace import StepTrace, TokenProvenance


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(vocab=64, seed=4, layers=2, hidden=64, draft_noise=0.6)


def test_the_probe_steps():
    assert [s for s in range(100) if probe_due(s)] == [5, 9, 13, 29, 45, 61, 77, 93]


def _run(draft, target, prompt, n, probes=True, method="chain", **cfg):
    dec = SpeculativeDecoder(draft, target, DecodeConfig(method=method, trace_block_counts=False, **cfg),
                             eos_token_id=())
    dec.plain_probes = probes
    return dec, list(dec.generate(prompt, n))


def _tokens(run):
    return [c.token_id for t in run for c in t.committed]


@pytest.mark.parametrize("method", ["chain", "dyspec_greedy", "sequoia"])
def test_probes_are_plain_steps_at_their_steps_and_the_run_stays_token_identical(pair, one_torch_thread, method):
    """The draft is the target itself, so a chain step accepts its whole chain exactly when the draft's cache holds
    the committed text: after each probe it must catch up on the probe's token."""
    target = pair[1]
    prompt = [5, 9, 2]
    _, plain = _run(target, target, prompt, 94, probes=False, method="autoregressive")
    dec, run = _run(target, target, prompt, 94, method=method, depth=4, budget=8)
    assert dec.probes_plain()
    probes = [t for t in run if t.draft_source == PROBE]
    due = [t.step for t in run if probe_due(t.step)]
    assert due[:3] == [5, 9, 13]
    assert [t.step for t in probes] == due + [run[-1].step]  # and the last token (a tree could commit only it)
    assert all(t.method == "autoregressive" and t.tree is None and t.num_committed == 1 for t in probes)
    assert probe_steps(run) == probes
    trees = [t for t in run if t.draft_source != PROBE]
    assert all(t.tree is not None for t in trees)
    if method == "chain":  # the draft caught up after every probe: each chain step kept its whole chain
        assert all(t.num_committed == 5 for t in trees)
    assert _tokens(run) == _tokens(plain)


def test_no_probe_unless_asked_or_in_plain_decoding(pair, one_torch_thread):
    target = pair[1]
    dec, run = _run(target, target, [5, 9, 2], 40, probes=False, depth=4)
    assert not dec.probes_plain() and not probe_steps(run)
    dec, run = _run(target, target, [5, 9, 2], 8, method="autoregressive")
    assert not dec.probes_plain() and not probe_steps(run)


def test_plain_decoding_inside_the_run_is_the_median_of_its_plain_steps():
    """Its probes and the plain steps after its fallback; none in a run without a tree step (plain decoding itself)."""
    import torch

    from dyntree_core.tree import TokenTree

    tree = TokenTree(tokens=torch.arange(2), parents=torch.tensor([-1, 0]), child_rank=torch.zeros(2, dtype=torch.long),
                     draft_logprob=torch.zeros(2, dtype=torch.float64), sampled="swor")

    def step(k, seconds, source, tokens=1, tree=None):
        committed = [TokenProvenance(7, k, 1, -1, "autoregressive")] * tokens
        return StepTrace(step=k, method="autoregressive", verifier="none", tree=tree, accepted_nodes=[0],
                         bonus_token=7, committed=committed, draft_source=source, step_seconds=seconds)

    first = step(0, 0.2, "model", 2, tree)
    assert probed_s_per_token([]) is None and probed_s_per_token([first]) is None
    traces = [first, step(5, 0.04, PROBE), step(9, 0.095, PROBE), step(13, 0.039, PROBE)]
    assert probed_s_per_token(traces) == pytest.approx(0.04)  # the median: one slow sample does not move it
    assert probed_s_per_token(traces[:2] + [step(9, 0.0, PROBE)]) == pytest.approx(0.04)  # (not yet timed)
    fell_back = traces[:2] + [step(k, 0.03, "") for k in (6, 7)]  # plain steps after a fallback count too
    assert plain_steps_inside(fell_back) == fell_back[1:] and probe_steps(fell_back) == fell_back[1:2]
    assert probed_s_per_token(fell_back) == pytest.approx(0.03)
    assert plain_steps_inside(fell_back[1:]) == []  # (plain decoding's own steps: no tree step in the run)


def test_a_probe_waits_behind_the_texts_repeats_and_the_last_token_is_a_probe(pair, one_torch_thread):
    """Inside a run whose text repeats itself (``drafting.repeats``, priced to pay), a probe due at a repeat step
    is decoded at the next step that would draft; the run's last token, where one is left, is a plain step."""
    from dyntree_core.step_price import FallbackPrice, PricedRows

    target = pair[1]
    prompt = [3, 4, 5, 6, 3, 4, 5]
    _, plain = _run(target, target, prompt, 40, probes=False, method="autoregressive")
    rule = FallbackPrice(PricedRows((1, 4096), (64.0, 64.0), (0.0, 0.0), (0.0, 0.0)), 1e9, tree_s_per_token=32.0)
    _, run = _run(target, target, prompt, 40, depth=4, fallback=rule)
    put_off = [t.step for t in run if probe_due(t.step) and t.draft_source == "repeats"]
    assert put_off and any(t.draft_source == PROBE and t.step > put_off[0] and not probe_due(t.step) for t in run)
    assert run[-1].draft_source == PROBE and run[-1].num_committed == 1 and not probe_due(run[-1].step)
    pending = False
    for t in run:
        pending = pending or probe_due(t.step)
        left = 40 - (t.total_new_tokens - t.num_committed)
        if t.draft_source == "repeats":
            continue
        assert (t.draft_source == PROBE) == (pending or left == 1), (t.step, t.draft_source, left)
        pending = False
    assert _tokens(run) == _tokens(plain)
