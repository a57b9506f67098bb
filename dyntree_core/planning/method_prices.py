"""One pricer per method ``auto`` prices in closed form, named by the method's ``MethodSpec.pricer``.

Each pricer is ``price(inputs, tp) -> list[Candidate]``: every shape of its method at target precision
``tp`` (and each draft precision the method runs a draft model at), priced from the machine profile and
what ``pricing.PricingInputs`` derived once from the measured acceptance (the chain simulations, Sequoia's DP
trees, the suffix / hybrid replays). Adding a method ``auto`` can price = a pricer here and its name in
the method's registry entry (``methods.REGISTRY``).
"""

from __future__ import annotations

from .acceptance import STOP_GRID
from .candidates import chain_expected_tokens
from .pricing import Candidate, PricingInputs, autoregressive_candidate, other_seconds


def price_autoregressive(inputs: PricingInputs, tp: str) -> list[Candidate]:
    return [autoregressive_candidate(inputs.profile, tp)]


def price_chain(inputs: PricingInputs, tp: str) -> list[Candidate]:
    """``chain`` candidates: replayed on the calibration positions (``inputs.chains``), or with the
    geometric positional model where there are none."""
    profile, cands = inputs.profile, []
    for dp in inputs.draft_precisions:
        if inputs.chains is not None:
            td, td2 = profile.draft_time(dp, 1), profile.draft_time(dp, 2)
            for (k, stop), st in inputs.chains.items():
                sizes = range(2, k + 2)
                cands.append(Candidate(
                    method="chain", target_precision=tp, draft_precision=dp, budget=k + 1, depth=k,
                    expected_tokens=st.tokens,
                    target_seconds=sum(p * profile.target_time(tp, n) for p, n in zip(st.size_probs, sizes)),
                    verify_seconds=sum(p * other_seconds(n, "chain", profile=profile)
                                       for p, n in zip(st.size_probs, sizes)),
                    draft_seconds=st.drafted * td + st.all_accepted * (td2 - td),
                    stop_confidence=None if stop is None else STOP_GRID[stop]))
            continue
        for k in inputs.chain_lengths:
            if k + 1 > profile.max_tokens:
                continue
            cands.append(Candidate(method="chain", target_precision=tp, draft_precision=dp, budget=k + 1, depth=k,
                                   expected_tokens=chain_expected_tokens(inputs.p1, k),
                                   target_seconds=profile.target_time(tp, k + 1),
                                   verify_seconds=other_seconds(k + 1, "chain", profile=profile),
                                   draft_seconds=k * profile.draft_time(dp, 1) + inputs.p1 ** k * (
                                       profile.draft_time(dp, 2) - profile.draft_time(dp, 1))))
    return cands


def price_sequoia(inputs: PricingInputs, tp: str) -> list[Candidate]:
    """``sequoia`` candidates from Sequoia's DP trees (``inputs.sequoia``)."""
    profile = inputs.profile
    return [Candidate(method="sequoia", target_precision=tp, draft_precision=dp, budget=n, depth=d, expected_tokens=g,
                      target_seconds=profile.target_time(tp, size),
                      verify_seconds=other_seconds(size, "sequoia", profile=profile),
                      draft_seconds=sum(profile.draft_time(dp, w) for w in levels), tree_size=size)
            for dp in inputs.draft_precisions for (n, d), (size, g, levels) in inputs.sequoia.items()]


def price_suffix(inputs: PricingInputs, tp: str) -> list[Candidate]:
    """``suffix`` candidates from their replays (no draft model)."""
    cands = []
    for sh, st in inputs.replayed.items():
        if st is None or sh.hybrid:
            continue
        cands.append(Candidate(method="suffix", target_precision=tp, draft_precision=None,
                               expected_tokens=st.suffix_tokens, target_seconds=_target_s(inputs, st, tp),
                               verify_seconds=_other_s(inputs, st, "suffix"), draft_seconds=st.build_seconds,
                               **_shape(sh)))
    return cands


def price_hybrid(inputs: PricingInputs, tp: str) -> list[Candidate]:
    """``hybrid`` candidates from their replays: the suffix tree's steps plus the model-drafted share."""
    profile, cands = inputs.profile, []
    for sh, st in inputs.replayed.items():
        if st is None or not sh.hybrid:
            continue
        size, g, levels = inputs.model_trees[(sh.budget, sh.depth)]
        m = st.model_share
        for dp in inputs.draft_precisions:
            cands.append(Candidate(
                method="hybrid", target_precision=tp, draft_precision=dp, expected_tokens=st.suffix_tokens + m * g,
                target_seconds=_target_s(inputs, st, tp) + m * profile.target_time(tp, size),
                verify_seconds=_other_s(inputs, st, "hybrid") + m * other_seconds(size, "hybrid", profile=profile),
                draft_seconds=st.build_seconds + m * sum(profile.draft_time(dp, w) for w in levels),
                model_share=m, **_shape(sh)))
    return cands


def _target_s(inputs: PricingInputs, st, tp: str) -> float:
    return sum(p * inputs.profile.target_time(tp, size) for size, p in st.size_probs.items())


def _other_s(inputs: PricingInputs, st, method: str) -> float:
    return sum(p * other_seconds(size, method, profile=inputs.profile) for size, p in st.size_probs.items())


def _shape(sh) -> dict:
    return dict(budget=sh.budget, depth=sh.depth, threshold=sh.threshold, spec_factor=sh.spec_factor)
