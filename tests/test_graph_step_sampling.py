"""Losslessness of graph steps at T > 0 (``decode.graph_step``): siblings drawn without replacement on
the device (Gumbel top-k over uniforms from the run's device generator), DySpec's reach-probability
keys, token-level and point-mass verification on the device (``verify.device``; Traversal on the host
from the read rows), the commit on the device. The engine's first two sampled
tokens follow the exact target distribution, on the flat tiny pair of ``test_sampling_e2e``.

Each chi-square test has the suite's false-alarm rate ``ALPHA`` and the fewest samples that catch any
bias of chi-square divergence ``MIN_W2`` = 0.04 with power 0.99 (``stat_utils.samples_for``; its
docstring has the analysis). The negative control shows the same test catches a realistic bug of
this path: sibling draws taken as the draft's top-k (no Gumbel noise) under the token-level verifier,
whose residual updates assume draws without replacement."""

import pytest

from dyntree_core import DecodeConfig, SpeculativeDecoder

from stat_utils import ALPHA, chi_square_pvalue, sample_first_two, samples_for
from test_sampling_e2e import PROMPT, exact, pair  # noqa: F401  (the same flat pair and exact joints)

def graph_factory(pair, **cfg):
    draft, target = pair

    def make():
        dec = SpeculativeDecoder(draft, target, DecodeConfig(trace_block_counts=False, attention="torch", **cfg),
                                 eos_token_id=())
        dec.graph_steps = True
        assert dec.graph_reason() is None
        return dec

    return make


CASES = [
    dict(method="dyspec_greedy", verifier="token_level", temperature=1.0, budget=6, depth=2),
    dict(method="dyspec_greedy", verifier="traversal", temperature=0.6, budget=6, depth=2),
    dict(method="dyspec_greedy", verifier="point_mass", temperature=1.0, budget=6, depth=2),
    dict(method="sequoia", verifier="token_level", temperature=1.0, budget=6, depth=2),
    # SpecInfer's k chains: the root's k tokens drawn without replacement on the device (i.i.d. on the host)
    dict(method="specinfer", verifier="token_level", temperature=1.0, width=3, depth=2),
    dict(method="chain", verifier="token_level", temperature=0.6, draft_temperature=1.3, depth=2),
    dict(method="dyspec_greedy", verifier="token_level", temperature=1.0, top_p=0.8, budget=6, depth=2),
    # depth 4: most trees stop at depth 2 (3 draft levels of 4 run, ``GraphStepper.draft``; checked once:
    # 25 of 40 first steps), so the run draws fewer uniforms than every level would
    dict(method="dyspec_greedy", verifier="token_level", temperature=1.0, budget=6, depth=4),
]


@pytest.mark.slow
@pytest.mark.parametrize("cfg", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_graph_steps_at_t_above_0_sample_the_target(pair, exact, cfg):
    """1,355 samples at T=1 (1,010 with top_p=0.8), 1,140 at T=0.6: power >= 0.99 against w2 >= 0.04
    at false-alarm rate ALPHA. The negative control below is this path's realistic bug: its w2 is 0.85 less ~0.08 of sampling noise
    (3,000 samples, X^2 p < 1e-300)."""
    target = exact(cfg["temperature"], cfg.get("top_p", 1.0))
    counts = sample_first_two(graph_factory(pair, **cfg), PROMPT, samples_for(target), seed0=500)
    assert chi_square_pvalue(counts, target) > ALPHA


@pytest.mark.slow
def test_draws_without_gumbel_noise_are_detected(pair, exact, monkeypatch):
    """Negative control: the same test at level 1e-4 rejects a graph step whose T > 0 siblings are the
    draft's top-k (``_children`` ignoring its uniforms) while the verifier assumes draws without
    replacement. Detectable bias: ``samples_for(alpha=1e-4)`` draws the fewest samples at which a level-1e-4
    test catches w2 >= 0.04 with power 0.99; this bug's w2 is ~0.77 (0.85 over 3,000 samples less ~0.08 of
    sampling noise), so it is caught with power ~1."""
    from dyntree_core.drafting import device

    real = device._children
    monkeypatch.setattr(device, "_children", lambda probs, k, noise: real(probs, k, None))
    cfg = CASES[0]
    n = samples_for(exact(1.0), alpha=1e-4)
    counts = sample_first_two(graph_factory(pair, **cfg), PROMPT, n, seed0=500)
    assert chi_square_pvalue(counts, exact(1.0)) < 1e-4
