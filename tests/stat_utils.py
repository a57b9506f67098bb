"""Exact first-two-token target distributions, the chi-square test used by the end-to-end
losslessness tests, and the power analysis that sizes them.

Power analysis. A test draws ``n`` first-two-token pairs and passes when Pearson's chi-square
p-value over its cells (joint cells of expected count >= 5, the rest pooled into one) is above
``ALPHA``. When the engine really samples some other distribution ``q`` instead of the exact ``p``,
the statistic is approximately noncentral chi-square with ``df`` = cells - 1 and noncentrality
``n * w2``, ``w2 = sum_i (q_i - p_i)^2 / p_i`` over the same cells (Cohen's effect size squared).
``samples_for`` returns the fewest ``n`` at which every ``q`` with ``w2 >= MIN_W2`` is rejected with
probability >= ``POWER``.

False alarms. The seeds are fixed, so a run is deterministic, but any change to how the engine
draws re-rolls every test at once. ``ALPHA`` = 2e-4 is the Bonferroni level for up to 50
chi-square acceptance tests (47 today: test_sampling_e2e 38, test_graph_step_sampling 5,
test_drafting_hybrid 2, test_drafting_suffix 2): a correct engine fails one of them with probability
<= 0.01 per re-roll. At 0.01 per test, as before, that was 1 - 0.99^42 = 34% for the 42 there
were then: re-rolled by smaller samples, the matrix's dyspec_threshold/traversal/T=0.6 test failed
a correct engine at p = 0.0079 (3,000 fresh samples of it: p = 0.22, w2 = 0.0007).

``MIN_W2`` = 0.04, the smallest bias every such test must catch, is two things at once:
  * every ``q`` at total-variation distance ``TV >= 0.1`` from ``p`` over the cells, whatever its
    shape: ``w2 >= 4 TV^2`` (Cauchy-Schwarz: ``(sum |q - p|)^2 <= sum (q - p)^2 / p * sum p``);
  * the negative control's bug, a chain whose verifier draws the bonus token from the raw target
    instead of the residual ``norm(max(p - q, 0))`` (``test_chain_without_residual_step_is_detected``):
    w2 = 0.049 on the T=1 depth-3 chain of ``test_sampling_e2e`` (X^2 - df over the 4,000 samples
    that control drew before; +- 2 standard errors 0.029-0.069).
Smaller biases (a verifier's draft update or residual slightly off on a larger tree) are caught
exactly, with no sampling, by ``test_verify_exact.py``, which enumerates every outcome of the
verifiers on path-dependent toy models.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from scipy import optimize, stats

from dyntree_core.sampling import probs_from_logits

#: false-alarm rate of each chi-square test (it passes when the p-value is above this): 0.01 for
#: up to 50 such tests together (module docstring)
ALPHA = 2e-4
#: the probability with which each test must catch a bias of ``MIN_W2``
POWER = 0.99
#: the smallest bias (chi-square divergence over the test's cells) each test must catch (module docstring)
MIN_W2 = 0.04
#: cells whose expected count is below this are pooled into one cell
MIN_EXPECTED = 5.0


def on_lean_forward(pair):
    """``pair`` (draft, target) with both models on the engine's lean forward (``decode.lean_forward``): the
    forward the product's CPU models run (every GGUF preset), transformers' own numbers to float32 rounding
    (tests/test_lean_forward.py), and 1.6x fewer milliseconds per sample than transformers' code on these tiny
    models (8.7 vs 14.0 ms, dyspec_greedy / token_level). ``exact_first_two`` keeps transformers' forward."""
    from dyntree_core.quant.lean_mark import enable_lean, lean_reason

    for model in pair:
        assert enable_lean(model), lean_reason(model)
    return pair


def exact_first_two(target, prompt: list[int], temperature: float, top_p: float = 1.0) -> np.ndarray:
    """``[V, V]`` exact joint P(x1, x2 | prompt) of the target at ``temperature`` / ``top_p``."""
    with torch.no_grad():
        p1 = probs_from_logits(target(torch.tensor([prompt])).logits[0, -1], temperature, top_p).double()
        v = p1.shape[0]
        batch = torch.tensor([prompt + [x] for x in range(v)])
        p2 = probs_from_logits(target(batch).logits[:, -1], temperature, top_p).double()
    return (p1[:, None] * p2).numpy()


def _cells(probs: np.ndarray, n: float, min_expected: float) -> np.ndarray:
    """Boolean mask of the cells kept on their own (expected count ``>= min_expected``)."""
    return probs * n >= min_expected


def chi_square_pvalue(counts: np.ndarray, expected_probs: np.ndarray, min_expected: float = MIN_EXPECTED) -> float:
    """Pearson chi-square p-value; cells with expected count < ``min_expected`` are pooled.

    A sample in a cell of probability 0 makes the p-value 0 (an impossible outcome).
    """
    counts = counts.ravel().astype(float)
    probs = expected_probs.ravel() / expected_probs.sum()
    n = counts.sum()
    if np.any(counts[probs <= 0] > 0):
        return 0.0
    exp = probs * n
    big = _cells(probs, n, min_expected)
    obs = list(counts[big]) + [counts[~big].sum()]
    ex = list(exp[big]) + [exp[~big].sum()]
    if ex[-1] == 0:
        obs, ex = obs[:-1], ex[:-1]
    return float(stats.chisquare(obs, ex).pvalue)


def degrees_of_freedom(expected_probs: np.ndarray, n: int, min_expected: float = MIN_EXPECTED) -> int:
    """Cells of ``chi_square_pvalue`` at ``n`` samples, minus one."""
    probs = expected_probs.ravel() / expected_probs.sum()
    big = _cells(probs, n, min_expected)
    return int(big.sum()) + int(probs[~big].sum() > 0) - 1


@lru_cache(maxsize=None)
def required_noncentrality(df: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """The noncentrality at which a level-``alpha`` chi-square test with ``df`` degrees of freedom
    rejects with probability ``power``."""
    crit = stats.chi2.isf(alpha, df)
    return float(optimize.brentq(lambda lam: stats.ncx2.sf(crit, df, lam) - power, 1e-9, 1e4))


def chi_square_power(expected_probs: np.ndarray, n: int, w2: float, alpha: float = ALPHA) -> float:
    """Probability that ``n`` samples of a distribution at chi-square divergence ``w2`` from
    ``expected_probs`` fail the test at level ``alpha``."""
    df = degrees_of_freedom(expected_probs, n)
    return float(stats.ncx2.sf(stats.chi2.isf(alpha, df), df, n * w2))


def samples_for(expected_probs: np.ndarray, w2: float = MIN_W2, alpha: float = ALPHA, power: float = POWER) -> int:
    """The fewest samples at which the test of ``chi_square_pvalue`` at level ``alpha`` catches
    every bias of chi-square divergence ``w2`` with probability ``power`` (the cells, hence the
    degrees of freedom, depend on ``n``)."""
    n = 1
    while True:
        df = degrees_of_freedom(expected_probs, n)
        if df >= 1 and n * w2 >= required_noncentrality(df, alpha, power):
            return n
        n += 1


def sample_first_two(make_decoder, prompt: list[int], n: int, seed0: int = 0, full_trees: bool = True) -> np.ndarray:
    """Run ``n`` independent seeded generations of 2 tokens; return ``[V, V]`` counts. ``full_trees``: every step
    drafts ``cfg.depth`` levels (``SpeculativeDecoder.cap_levels`` off): capped, a 2-token run's first tree would
    have one level, and the verification of deeper levels would go untested."""
    dec = make_decoder()
    if full_trees and hasattr(dec, "cap_levels"):
        dec.cap_levels = False
    v = dec.vocab_size
    counts = np.zeros((v, v))
    for s in range(n):
        out = dec.generate_ids(prompt, 2, seed=seed0 + s)
        counts[out[0], out[1]] += 1
    return counts
