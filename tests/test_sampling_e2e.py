"""End-to-end losslessness: the engine's first two sampled tokens follow the exact target
distribution for every (drafter, verifier) pair of the DESIGN.md matrix, on a tiny peaked
random model pair. Seeds are fixed, so every run of this file is deterministic."""

import pytest
import torch

from conftest import torch_threads
from dyntree_core import DecodeConfig, SpeculativeDecoder
from dyntree_core.testing import tiny_pair

from stat_utils import chi_square_pvalue, exact_first_two, sample_first_two

PROMPT = [3, 7]
VOCAB = 16


@pytest.fixture(scope="module")
def pair():
    with torch_threads(1):  # restored after this module
        yield tiny_pair(vocab=VOCAB, seed=12, layers=2, hidden=32)


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


@pytest.mark.slow
def test_chain_T1_first_two_tokens_match_target(pair):
    exact = exact_first_two(pair[1], PROMPT, 1.0)
    counts = sample_first_two(decoder_factory(pair, method="chain", depth=3, temperature=1.0), PROMPT, 20_000)
    assert chi_square_pvalue(counts, exact) > 0.01


@pytest.mark.slow
def test_chain_without_residual_step_is_detected(pair, monkeypatch):
    """Negative control: sampling the bonus from the raw target instead of the residual
    max(p - q, 0) biases the output, and the same chi-square test catches it."""
    import dyntree_core.verify.token_level as tl

    monkeypatch.setattr(tl, "residual_update", lambda p, mb, ms: (p, mb))
    exact = exact_first_two(pair[1], PROMPT, 1.0)
    counts = sample_first_two(decoder_factory(pair, method="chain", depth=3, temperature=1.0), PROMPT, 4_000)
    assert chi_square_pvalue(counts, exact) < 1e-4


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
def test_first_two_tokens_match_target(pair, method, verifier, temperature):
    exact = exact_first_two(pair[1], PROMPT, temperature)
    cfg = dict(method=method, verifier=verifier, temperature=temperature, budget=6, depth=2, width=2, threshold=0.1)
    counts = sample_first_two(decoder_factory(pair, **cfg), PROMPT, 2_500, seed0=1000)
    assert chi_square_pvalue(counts, exact) > 0.01


@pytest.mark.slow
def test_top_p_is_applied_to_the_target(pair):
    exact = exact_first_two(pair[1], PROMPT, 1.0, top_p=0.8)
    assert (exact == 0).any()  # the nucleus really cuts tokens
    cfg = dict(method="dyspec_greedy", verifier="token_level", temperature=1.0, top_p=0.8, budget=6, depth=2)
    counts = sample_first_two(decoder_factory(pair, **cfg), PROMPT, 2_500, seed0=7)
    assert chi_square_pvalue(counts, exact) > 0.01


@pytest.mark.slow
def test_draft_temperature_differs_from_target_and_stays_lossless(pair):
    exact = exact_first_two(pair[1], PROMPT, 0.6)
    cfg = dict(method="chain", temperature=0.6, draft_temperature=1.3, depth=2)
    counts = sample_first_two(decoder_factory(pair, **cfg), PROMPT, 2_500, seed0=3)
    assert chi_square_pvalue(counts, exact) > 0.01


def test_autoregressive_sampling_matches_target(pair):
    exact = exact_first_two(pair[1], PROMPT, 0.6)
    counts = sample_first_two(decoder_factory(pair, method="autoregressive", temperature=0.6), PROMPT, 3_000)
    assert chi_square_pvalue(counts, exact) > 0.01


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
        yield request.param, (quantize_model(draft, request.param), target)


@pytest.mark.slow
@pytest.mark.parametrize("method, verifier", QUANT_MATRIX)
def test_quantized_draft_stays_lossless(quant_draft_pair, method, verifier):
    precision, pair = quant_draft_pair
    from dyntree_core.quant import model_precision

    assert model_precision(pair[0]) == precision
    exact = exact_first_two(pair[1], PROMPT, 1.0)
    cfg = dict(method=method, verifier=verifier, temperature=1.0, budget=6, depth=2, width=2, threshold=0.1)
    counts = sample_first_two(decoder_factory(pair, **cfg), PROMPT, 2_500, seed0=2000)
    assert chi_square_pvalue(counts, exact) > 0.01
