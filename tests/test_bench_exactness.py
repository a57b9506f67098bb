"""``bench exactness``'s account of a divergence: the target's two candidates and their gap."""

from __future__ import annotations

import torch

from dyntree_core.bench.exactness import divergence_gap
from dyntree_core.testing import tiny_pair


def test_the_gap_at_a_divergence_is_the_targets_logits_of_both_tokens():
    _, target = tiny_pair(seed=3)
    prompt, reference = [5, 9, 12], [7, 30, 2]
    with torch.inference_mode():
        logits = target(torch.tensor([prompt + reference[:2]])).logits[0, -1]
    ranked = torch.argsort(logits, descending=True).tolist()
    out = reference[:2] + [ranked[1]]  # the method took the runner-up where plain decoding took reference[2]
    info = divergence_gap(target, prompt, reference, out, 2)
    assert (info["position"], info["plain_token"], info["method_token"]) == (2, reference[2], ranked[1])
    assert abs(info["gap"] - float(logits[reference[2]] - logits[ranked[1]])) < 1e-5
    assert abs(info["top2_gap"] - float(logits[ranked[0]] - logits[ranked[1]])) < 1e-5
    assert info["top2_gap"] >= 0
