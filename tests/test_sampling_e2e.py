"""End-to-end losslessness: the engine's first two sampled tokens follow the exact target
distribution for every (drafter, verifier) pair of the DESIGN.md matrix, on a tiny peaked
random model pair, run through the engine's lean forward (what the product's CPU models run;
``stat_utils.on_lean_forward``). Seeds are fixed, so every run of this file is deterministic.

Every chi-square test here has false-alarm rate ALPHA = 2e-4 (0.01 for the suite's 43 such tests
together) and draws the fewest samples at which it catches any bias of chi-square divergence
w2 >= MIN_W2 = 0.04 over its cells (every bias of total variation >= 0.1) with power >= 0.99
(``stat_utils.samples_for``; the derivation is in stat_utils' docstring): 1,355 samples at T=1,
1,140 at T=0.6, 1,010 at T=1 with top_p = 0.8. Each test's docstring names the realistic bug it was
checked against (injected by monkeypatching outside the repository) and that bug's power."""

import pytest
import torch

from conftest import torch_threads
from dyntree_core import DecodeConfig, SpeculativeDecoder
from dyntree_core.step_price import FallbackPrice, PricedRows
from dyntree_core.testing import tiny_pair

from stat_utils import ALPHA, chi_square_pvalue, exact_first_two, on_lean_forward, sample_first_two, samples_for

PROMPT = [3, 7]
VOCAB = 16


@pytest.fixture(scope="module")
def pair():
    with torch_threads(1):  # restored after this module
        yield on_lean_forward(tiny_pair(vocab=VOCAB, seed=12, layers=2, hidden=32))


@pytest.fixture(scope="module")
def exact(pair):
    """``exact(temperature, top_p)``: the target's first-two-token joint, computed once per module."""
    cache = {}

    def get(temperature: float, top_p: float = 1.0):
        if (temperature, top_p) not in cache:
            cache[temperature, top_p] = exact_first_two(pair[1], PROMPT, temperature, top_p)
        return cache[temperature, top_p]

    return get


def decoder_factory(pair, **cfg):
    draft, target = pair
    cfg.setdefault("trace_block_counts", False)  # the page's mask statistics: no part of what is sampled
    return lambda: SpeculativeDecoder(draft, target, DecodeConfig(**cfg), eos_token_id=())  # EOS is an ordinary token here


def test_tiny_pair_is_peaked_and_draft_differs(pair):
    draft, target = pair
    with torch.no_grad():
        pt = torch.softmax(target(torch.tensor([PROMPT])).logits[0, -1], -1)
        pd = torch.softmax(draft(torch.tensor([PROMPT])).logits[0, -1], -1)
    assert pt.max() > 4.0 / VOCAB  # far from uniform
    tv = 0.5 * (pt - pd).abs().sum()
    assert 0.05 < tv < 0.9  # correlated but different: rejections and residuals really happen


CHAIN_T1 = dict(method="chain", depth=3, temperature=1.0)


@pytest.mark.slow
def test_chain_T1_first_two_tokens_match_target(pair, exact):
    """1,355 samples (was 20,000): power >= 0.99 against w2 >= 0.04 at false-alarm rate ALPHA.
    Checked against the bonus drawn from the raw target instead of the residual (the negative
    control's bug, w2 = 0.049 here: power 0.999): it fails, p = 3e-12."""
    counts = sample_first_two(decoder_factory(pair, **CHAIN_T1), PROMPT, samples_for(exact(1.0)))
    assert chi_square_pvalue(counts, exact(1.0)) > ALPHA


@pytest.mark.slow
def test_steps_capped_at_the_levels_left_stay_lossless(pair, exact):
    """The product's default (``SpeculativeDecoder.cap_levels``): a 2-token run's first chain drafts one level,
    not 3; the first two tokens still follow the target (1,355 samples, as above)."""
    make = decoder_factory(pair, **CHAIN_T1)
    first = next(make().generate(PROMPT, 2))
    assert first.tree.num_levels - 1 == 1
    counts = sample_first_two(make, PROMPT, samples_for(exact(1.0)), seed0=500, full_trees=False)
    assert chi_square_pvalue(counts, exact(1.0)) > ALPHA


@pytest.mark.slow
def test_chain_without_residual_step_is_detected(pair, exact, monkeypatch):
    """Negative control: sampling the bonus from the raw target instead of the residual
    max(p - q, 0) biases the output, and the same chi-square test catches it at p < 1e-4.

    1,417 samples (was 4,000): the fewest at which a level-1e-4 test catches w2 >= 0.04 with power
    0.99; this bug's w2 is 0.049 (X^2 - df over the former 4,000 samples): power 0.999."""
    import dyntree_core.verify.token_level as tl

    monkeypatch.setattr(tl, "residual_update", lambda p, mb, ms: (p, mb))
    n = samples_for(exact(1.0), alpha=1e-4)
    counts = sample_first_two(decoder_factory(pair, **CHAIN_T1), PROMPT, n)
    assert chi_square_pvalue(counts, exact(1.0)) < 1e-4


MATRIX = [
    ("chain", "token_level"),
    ("chain", "traversal"),
    ("specinfer", "token_level"),
    ("specinfer", "traversal"),
    ("sequoia", "token_level"),
    ("sequoia", "traversal"),
    ("dyspec_greedy", "token_level"),
    ("dyspec_greedy", "traversal"),
    ("dyspec_threshold", "token_level"),
    ("dyspec_threshold", "traversal"),
    ("opt_tree", "point_mass"),
    ("dynatree", "point_mass"),
    ("dyspec_greedy", "point_mass"),
]


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.6, 1.0])
@pytest.mark.parametrize("method, verifier", MATRIX)
def test_first_two_tokens_match_target(pair, exact, method, verifier, temperature):
    """1,355 samples at T=1, 1,140 at T=0.6 (was 2,500 each): power >= 0.99 against w2 >= 0.04 at
    false-alarm rate ALPHA. Checked against, per pair: the residual max(p - q, 0) left unnormalised
    (token_level / traversal on trees with siblings; w2 1.2-10 measured), the bonus drawn from the
    raw target instead of the residual (chain, where the residual's norm cannot matter; w2
    0.04-0.11), the min(1, p/q) test in place of point_mass on top-k trees (opt_tree, dynatree; w2
    0.6-0.8) and point_mass sampling below a matched node from its parent's row (dyspec_greedy,
    whose sampled trees the ratio test verifies exactly; w2 > 30). Each of the 26 fails under its
    bug: p <= 1.2e-7 (chain), <= 2e-152 (top-k), below double precision (the others)."""
    cfg = dict(method=method, verifier=verifier, temperature=temperature, budget=6, depth=2, width=2, threshold=0.1)
    counts = sample_first_two(decoder_factory(pair, **cfg), PROMPT, samples_for(exact(temperature)), seed0=1000)
    assert chi_square_pvalue(counts, exact(temperature)) > ALPHA


@pytest.mark.slow
def test_top_p_is_applied_to_the_target(pair, exact):
    """1,010 samples (was 2,500): power >= 0.99 against w2 >= 0.04 at false-alarm rate ALPHA.
    Checked against top_p left off the target's rows: a token outside the nucleus is drawn, p = 0."""
    assert (exact(1.0, 0.8) == 0).any()  # the nucleus really cuts tokens
    cfg = dict(method="dyspec_greedy", verifier="token_level", temperature=1.0, top_p=0.8, budget=6, depth=2)
    counts = sample_first_two(decoder_factory(pair, **cfg), PROMPT, samples_for(exact(1.0, 0.8)), seed0=7)
    assert chi_square_pvalue(counts, exact(1.0, 0.8)) > ALPHA


@pytest.mark.slow
def test_draft_temperature_differs_from_target_and_stays_lossless(pair, exact):
    """1,140 samples (was 2,500): power >= 0.99 against w2 >= 0.04 at false-alarm rate ALPHA.
    Checked against a verifier that takes the draft distribution at the target's temperature while
    the drafts were drawn at the draft's (w2 = 0.15 measured): it fails, p = 4e-44."""
    cfg = dict(method="chain", temperature=0.6, draft_temperature=1.3, depth=2)
    counts = sample_first_two(decoder_factory(pair, **cfg), PROMPT, samples_for(exact(0.6)), seed0=3)
    assert chi_square_pvalue(counts, exact(0.6)) > ALPHA


def test_autoregressive_sampling_matches_target(pair, exact):
    """1,140 samples (was 3,000): power >= 0.99 against w2 >= 0.04 at false-alarm rate ALPHA.
    Checked against the target sampled at T=1 instead of 0.6 (w2 = 0.87 measured): it fails, p = 3e-143."""
    counts = sample_first_two(decoder_factory(pair, method="autoregressive", temperature=0.6), PROMPT,
                              samples_for(exact(0.6)))
    assert chi_square_pvalue(counts, exact(0.6)) > ALPHA


QUANT_MATRIX = [
    ("chain", "token_level"),
    ("sequoia", "traversal"),
    ("dyspec_greedy", "token_level"),
    ("opt_tree", "point_mass"),
]


@pytest.fixture(scope="module", params=["int8", "int4"])
def quant_draft_pair(request):
    """The same tiny pair with the draft on torch's weight-only int8/int4 kernels: verification
    uses the distribution the quantized draft really produced, so the output stays the target's."""
    from dyntree_core.quant import quantize_model

    with torch_threads(1):  # restored after this module
        draft, target = tiny_pair(vocab=VOCAB, seed=12, layers=2, hidden=32)
        yield request.param, on_lean_forward((quantize_model(draft, request.param), target))


@pytest.mark.slow
@pytest.mark.parametrize("method, verifier", QUANT_MATRIX)
def test_quantized_draft_stays_lossless(quant_draft_pair, exact, method, verifier):
    """1,355 samples (was 2,500): power >= 0.99 against w2 >= 0.04 at false-alarm rate ALPHA.
    Checked against the full matrix's bugs for the same pairs: the raw-target bonus on
    the chain (p = 5e-16 int8, 1e-16 int4), the unnormalised residual on sequoia/traversal and
    dyspec_greedy/token_level (p below double precision) and the min(1, p/q) test on opt_tree's
    top-k trees (p = 2e-242); all 8 fail."""
    precision, pair = quant_draft_pair
    from dyntree_core.quant import model_precision

    assert model_precision(pair[0]) == precision
    cfg = dict(method=method, verifier=verifier, temperature=1.0, budget=6, depth=2, width=2, threshold=0.1)
    counts = sample_first_two(decoder_factory(pair, **cfg), PROMPT, samples_for(exact(1.0)), seed0=2000)
    assert chi_square_pvalue(counts, exact(1.0)) > ALPHA


#: every token of the vocabulary once, each followed by another: whatever the first token, the text so far has repeated
#: it, so a step after a fallback drafts its repeat (``drafting.repeats``)
EVERY_TOKEN = [3, 7] + [t for t in range(VOCAB) if t not in (3, 7)] + [3, 7]


@pytest.mark.slow
def test_repeats_drafted_after_a_fallback_stay_lossless(pair, monkeypatch, one_torch_thread):
    """A one-token chain step, the fallback (its rule's rows are flat, so a repeat tree always pays), then the
    second token from a repeat tree verified by point mass whenever the chain step committed one token (33 of the
    first 40 runs; at least 21 checked). 1,355 samples: power >= 0.99 against w2 >= 0.04 at false-alarm rate ALPHA. Checked against
    the repeat trees verified greedily at T = 1 (their token accepted where it is the target's argmax): it fails,
    p < 1e-30."""
    noisy = on_lean_forward(tiny_pair(vocab=VOCAB, seed=12, layers=2, hidden=32, draft_noise=1.0))
    truth = exact_first_two(noisy[1], EVERY_TOKEN, 1.0)
    make = decoder_factory(noisy, method="chain", depth=1, temperature=1.0,
                           fallback=FallbackPrice(PricedRows((1, 64), (64.0, 64.0), (0.0, 0.0), (0.0, 0.0)), 1.0,
                                                  check_from=1))
    second = [[t.method for t in make().generate(EVERY_TOKEN, 2, seed=s)][1:] for s in range(40)]
    assert sum(m == ["suffix"] for m in second) > 20
    counts = sample_first_two(make, EVERY_TOKEN, samples_for(truth))
    assert chi_square_pvalue(counts, truth) > ALPHA


@pytest.mark.slow
def test_repeats_drafted_inside_a_run_stay_lossless(pair, one_torch_thread):
    """Inside a chain run (``FallbackPrice.tree_s_per_token``; plain decoding priced too dear to fall back): the first
    token from the prompt's repeat of its last two tokens (a 3-node repeat tree, priced to pay, verified by point
    mass), the second from a chain step whose draft catches up on what the repeat step committed, wherever that
    committed one token (a one-token match's 2-node tree is priced not to pay). 1,355 samples: power >= 0.99 against
    w2 >= 0.04 at false-alarm rate ALPHA. Checked against the repeat trees verified greedily at T = 1: it fails,
    p = 1e-85."""
    noisy = on_lean_forward(tiny_pair(vocab=VOCAB, seed=12, layers=2, hidden=32, draft_noise=1.0))
    truth = exact_first_two(noisy[1], EVERY_TOKEN, 1.0)
    rule = FallbackPrice(PricedRows((1, 64), (64.0, 64.0), (0.0, 0.0), (0.0, 0.0)), 1e9,
                         tree_s_per_token=64.0 * 1.2 / 2.5)  # a repeat step pays at > 2.5 expected tokens
    make = decoder_factory(noisy, method="chain", depth=1, temperature=1.0, fallback=rule)
    runs = [[(t.draft_source, t.num_committed) for t in make().generate(EVERY_TOKEN, 2, seed=s)] for s in range(40)]
    assert all(r[0][0] == "repeats" for r in runs)
    assert sum(len(r) > 1 and r[1][0] == "model" for r in runs) > 20
    counts = sample_first_two(make, EVERY_TOKEN, samples_for(truth))
    assert chi_square_pvalue(counts, truth) > ALPHA


@pytest.mark.slow
def test_plain_probes_inside_a_run_stay_lossless(pair, exact, monkeypatch, one_torch_thread):
    """``decode.plain_probes`` with the probe moved to step 0: the first token from a plain probe, the second from a
    chain step (depth 1, a noisier draft than the module's, same target) whose draft catches up on the probe's
    token (runs of 3 tokens, so that step is not the run's last token, itself a probe). 1,355 samples: power >= 0.99
    against w2 >= 0.04 at false-alarm rate ALPHA. Checked against a probe that draws with one fixed uniform
    (``sample_index(probs, 0.5)``): it fails, p = 5e-224."""
    from dyntree_core.decode import engine
    from dyntree_core.decode.plain_probes import PROBE

    monkeypatch.setattr(engine, "probe_due", lambda step: step == 0)
    noisy = on_lean_forward(tiny_pair(vocab=VOCAB, seed=12, layers=2, hidden=32, draft_noise=1.0))
    base = decoder_factory(noisy, method="chain", depth=1, temperature=1.0)

    def make():
        dec = base()
        dec.plain_probes = True
        dec.generate_ids = lambda prompt, n, seed=None: SpeculativeDecoder.generate_ids(dec, prompt, n + 1, seed)[:n]
        return dec

    sources = [t.draft_source for t in make().generate(PROMPT, 3, seed=0)]
    assert sources[:2] == [PROBE, "model"]
    counts = sample_first_two(make, PROMPT, samples_for(exact(1.0)))
    assert chi_square_pvalue(counts, exact(1.0)) > ALPHA


@pytest.mark.slow
def test_a_run_that_falls_back_to_plain_decoding_stays_lossless(pair, exact, monkeypatch, one_torch_thread):
    """``DecodeConfig.fallback``: a one-token chain step, then (the threshold unreachable, checked after one
    step) plain steps; when the chain step's draft is rejected the second token comes from a plain step on the
    cache the tree step left (a noisier draft than the module's, same target, so that happens often).
    1,355 samples: power >= 0.99 against w2 >= 0.04 at false-alarm rate ALPHA. Checked against plain steps that
    draw with a generator never advanced (one fixed uniform): it fails, p = 7e-72 (with the module's draft,
    whose first draft token is mostly accepted, the same bug went unseen: p = 0.09)."""
    noisy = on_lean_forward(tiny_pair(vocab=VOCAB, seed=12, layers=2, hidden=32, draft_noise=1.0))
    assert all(torch.equal(a, b) for a, b in zip(noisy[1].parameters(), pair[1].parameters()))  # the module's target
    make = decoder_factory(noisy, method="chain", depth=1, temperature=1.0,
                           fallback=FallbackPrice(PricedRows((1, 64), (64.0, 64.0 * 64), (0.0, 0.0), (0.0, 0.0)), 1.0,
                                                  check_from=1))  # (a target forward priced by its tokens: no repeats)
    methods = [t.method for t in make().generate(PROMPT, 4, seed=0)]
    assert methods[0] == "chain" and set(methods[1:]) == {"autoregressive"}
    counts = sample_first_two(make, PROMPT, samples_for(exact(1.0)))
    assert chi_square_pvalue(counts, exact(1.0)) > ALPHA
