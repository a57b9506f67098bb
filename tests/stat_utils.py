"""Exact first-two-token target distributions and the chi-square test used by the
end-to-end losslessness tests."""

from __future__ import annotations

import numpy as np
import torch
from scipy import stats

from dyntree_core.sampling import probs_from_logits


def exact_first_two(target, prompt: list[int], temperature: float, top_p: float = 1.0) -> np.ndarray:
    """``[V, V]`` exact joint P(x1, x2 | prompt) of the target at ``temperature`` / ``top_p``."""
    with torch.no_grad():
        p1 = probs_from_logits(target(torch.tensor([prompt])).logits[0, -1], temperature, top_p).double()
        v = p1.shape[0]
        batch = torch.tensor([prompt + [x] for x in range(v)])
        p2 = probs_from_logits(target(batch).logits[:, -1], temperature, top_p).double()
    return (p1[:, None] * p2).numpy()


def chi_square_pvalue(counts: np.ndarray, expected_probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Pearson chi-square p-value; cells with expected count < ``min_expected`` are pooled.

    A sample in a cell of probability 0 makes the p-value 0 (an impossible outcome).
    """
    counts = counts.ravel().astype(float)
    probs = expected_probs.ravel() / expected_probs.sum()
    n = counts.sum()
    if np.any(counts[probs <= 0] > 0):
        return 0.0
    exp = probs * n
    big = exp >= min_expected
    obs = list(counts[big]) + [counts[~big].sum()]
    ex = list(exp[big]) + [exp[~big].sum()]
    if ex[-1] == 0:
        obs, ex = obs[:-1], ex[:-1]
    return float(stats.chisquare(obs, ex).pvalue)


def sample_first_two(make_decoder, prompt: list[int], n: int, seed0: int = 0) -> np.ndarray:
    """Run ``n`` independent seeded generations of 2 tokens; return ``[V, V]`` counts."""
    dec = make_decoder()
    v = dec.vocab_size
    counts = np.zeros((v, v))
    for s in range(n):
        out = dec.generate_ids(prompt, 2, seed=seed0 + s)
        counts[out[0], out[1]] += 1
    return counts
