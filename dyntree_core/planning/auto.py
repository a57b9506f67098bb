"""``auto``, the one planner: choose the precision of each model, the method, the tree size and depth
for this machine by minimising predicted milliseconds per token, and say why (``AutoPlan``). For a
method it cannot price in closed form (DySpec, OPT-Tree, DynaTree, SpecInfer with ``--budget auto``)
its calibration, ``tuning``, searches the shape by short decodes priced from the same machine profile.

``plan_auto``: the machine profile (``profiling``, cached), the acceptance of the pair (``acceptance``,
cached), every candidate priced (``pricing.price_candidates``: predicted seconds per token = (target
forward of the n-node tree + host-side probability rows for n nodes + the draft) / expected tokens per
step), and the choice (``choose``). Plain autoregressive decoding is a candidate like any other: on a
machine where no tree pays for its draft and verification, ``auto`` chooses it and says so. The
acceptance vector is measured once per pair and temperature with the draft and target at the
precisions the profile finds fastest for one token, and is assumed for the other precisions too
(int8/int4 of these models keep the argmax of their float weights on almost every position; see the
precision bench for measured acceptance per precision).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from typing import Optional, Sequence

from ..config import DecodeConfig
from ..step_price import EARLY_CHECK_FROM, EARLY_MARGIN, FALLBACK_AFTER, FallbackPrice, PricedRows
from .acceptance import (Acceptance, cached_acceptance, calibration_prompts, load_or_measure_acceptance,
                         prompt_agreement)
from .forward_timer import Progress, Turn
from .machine_profile import AcceptanceNotMeasured, MachineProfile, NotMeasuredYet, pair_name_of
from .pair_cache import PairCache
from .prediction import Prediction, fastest_plain, prediction_for
from .pricing import AUTO_METHODS, Candidate, autoregressive_candidate, break_even_tokens, price_candidates
from .profiling import load_or_measure_profile, same_spell
from .search_space import AUTO, MODEL_TREE_METHODS, default_precisions
from .spell_pricing import floor_priced, floor_text

TREE_MARGIN = 0.05


@dataclass(frozen=True)
class AutoPlan:
    """What ``auto`` chose, the best autoregressive alternative, and the one-line reason."""

    best: Candidate
    best_autoregressive: Candidate
    acceptance: tuple[float, ...]
    temperature: float
    profile_key: str
    machine: dict
    reason: str
    top: tuple[Candidate, ...] = ()
    fastest_draft_precision: str = ""
    per_method: tuple[Candidate, ...] = ()  # the cheapest candidate of each priced method
    reference: Optional[Candidate] = None  # the fastest plain decoding in the profile, any precision
    profile: Optional[MachineProfile] = field(default=None, repr=False, compare=False)  # what priced it
    #: the prompt's draft/target agreement it was priced for (``acceptance.prompt_agreement``; None: every
    #: calibration text priced it)
    prompt_agreement: Optional[float] = None

    @property
    def method(self) -> str:
        return self.best.method

    def best_of(self, method: str) -> Optional[Candidate]:
        """The cheapest priced candidate of ``method`` (None when ``auto`` did not price it)."""
        return next((c for c in self.per_method if c.method == method), None)

    def method_fields(self, candidate: Optional[Candidate] = None) -> dict:
        """The method and shape of ``candidate`` (default: the chosen one) as ``DecodeConfig``
        fields (no precisions)."""
        b = candidate or self.best
        kw: dict = dict(method=b.method, verifier="auto", fallback=self.fallback_price(b))
        if b.method == "chain":
            kw.update(depth=b.depth, budget=max(2, b.depth + 1), stop_confidence=b.stop_confidence)
        elif b.method == "sequoia":
            kw.update(budget=b.budget, depth=b.depth, sequoia_acceptance=tuple(self.acceptance))
        elif b.method in ("suffix", "hybrid"):
            kw.update(budget=b.budget, depth=b.depth, threshold=b.threshold, spec_factor=b.spec_factor)
        return kw

    def break_even_tokens(self, candidate: Optional[Candidate] = None) -> Optional[float]:
        """Tokens per step ``candidate`` (default: the chosen one) must commit to beat the fastest plain
        decoding priced (its step's predicted cost in plain tokens, at least 1); None where there is no
        draft model to stop paying for (plain decoding; suffix / hybrid steps without a match cost about a
        plain step, and their matches come in bursts later in a text). At the run's own step shapes the
        same rule is ``fallback_price``."""
        return _fallback_below(candidate or self.best, self.reference or self.best_autoregressive)

    def fallback_price(self, candidate: Optional[Candidate] = None) -> Optional[FallbackPrice]:
        """When a run of ``candidate`` (default: the chosen one) stops drafting (``DecodeConfig.fallback``):
        the profile rows that priced it and the fastest plain decoding's price. A run whose tree steps, priced
        at those rows at their own shapes, cost more per token decodes plainly for the rest: the
        calibration text's acceptance was not this text's, and a text that accepts more grows longer chains
        whose extra draft forwards the plan did not price. Its tree steps' own price per token is the bar the
        text's repeats must beat to stand in for one (``FallbackPrice.tree_s_per_token``). None where
        ``break_even_tokens`` is None or without the profile."""
        c = candidate or self.best
        if self.profile is None or self.break_even_tokens(c) is None:
            return None
        return FallbackPrice(PricedRows.of(self.profile, c.target_precision, c.draft_precision),
                             (self.reference or self.best_autoregressive).seconds_per_token,
                             tree_s_per_token=c.seconds_per_token)

    def apply(self, cfg: DecodeConfig, candidate: Optional[Candidate] = None) -> DecodeConfig:
        """``cfg`` with the method, shape and precisions of ``candidate`` (default: the chosen one)."""
        b = candidate or self.best
        return replace(cfg, precision=b.target_precision,
                       draft_precision=b.draft_precision if b.method != "autoregressive" else None,
                       **self.method_fields(b))

    def resolve(self, method: str, precision: str, draft_precision: str) -> dict:
        """Fields to set for a request in which any of ``method``, ``precision`` (target) and
        ``draft_precision`` may be ``"auto"`` (the CLI and the app both use this):

        * method ``auto``: the plan's method and shape (``method_fields``), precisions of that choice;
        * a fixed method: only the precisions, those of the best priced candidate of that kind
          (autoregressive: the fastest target precision; a method ``auto`` does not price: the best
          draft-model tree's);
        * a fixed precision is kept. The draft precision of an autoregressive choice is the fastest
          draft precision (unused by AR decoding, but a Compare run of the same settings uses it).
        """
        kw: dict = {}
        if method == AUTO:
            kw.update(self.method_fields())
            choice = self.best
        elif method == "autoregressive":
            choice = self.best_autoregressive
        else:
            choice = self.best_of(method) or min(
                (c for c in self.per_method if c.method in MODEL_TREE_METHODS),
                key=lambda c: c.seconds_per_token, default=self.best)
        if precision == AUTO:
            kw["precision"] = choice.target_precision
        if draft_precision == AUTO:
            kw["draft_precision"] = choice.draft_precision or self.fastest_draft_precision
        return kw

    def prediction(self, method: str, precision: str, draft_precision: Optional[str]) -> Optional[Prediction]:
        """The ``Prediction`` of a run of ``method`` as the form asked for it (``auto`` or a fixed one) at the
        resolved precisions: the chosen candidate for ``auto``, the best plain decoding for
        ``autoregressive``; None where the run is not what was priced (a fixed tree method's shape is the
        form's own, or a fixed precision the plan did not choose)."""
        if method == AUTO:
            c = self.best
        elif method == "autoregressive":
            c = self.best_autoregressive
        else:
            return None
        if c.target_precision != precision or (c.draft_precision is not None and c.draft_precision != draft_precision):
            return None
        return prediction_for(c, self.reference or self.best_autoregressive, self.profile)

    def to_dict(self) -> dict:
        d = asdict(replace(self, profile=None))
        d.pop("profile")
        d["best"]["seconds_per_token"] = self.best.seconds_per_token
        d["best_autoregressive"]["seconds_per_token"] = self.best_autoregressive.seconds_per_token
        return d


def choose(profile: MachineProfile, acceptance: Sequence[float] | Acceptance, temperature: float,
           target_precisions: Sequence[str], draft_precisions: Sequence[str],
           methods: Sequence[str] = AUTO_METHODS, margin: float = TREE_MARGIN) -> AutoPlan:
    """The cheapest candidate (``price_candidates``) and a one-line reason. A tree is taken only
    when it is predicted at least ``margin`` faster than plain decoding (the model's own error:
    positional acceptance, host overhead, timing noise), else plain decoding is kept."""
    cands = price_candidates(profile, acceptance, target_precisions, draft_precisions, methods)
    acceptance = acceptance.vector if isinstance(acceptance, Acceptance) else tuple(acceptance)
    if not cands:
        raise ValueError("no configuration could be priced: the profile has no measured sizes")
    ranked = sorted(cands, key=lambda c: c.seconds_per_token)
    ars = [c for c in ranked if c.method == "autoregressive"]
    best_ar = ars[0] if ars else min((autoregressive_candidate(profile, tp) for tp in target_precisions),
                                     key=lambda c: c.seconds_per_token)
    best = ranked[0]
    if best.method != "autoregressive" and ars and best.seconds_per_token > (1.0 - margin) * best_ar.seconds_per_token:
        best = best_ar
    ms = lambda c: c.seconds_per_token * 1e3  # noqa: E731
    machine = profile.machine
    read = profile.read_gb_per_s if profile.meta.get("row_gb_per_s") else None  # (rows it bracketed)
    now = profile.other_spell
    floor = floor_text(profile)
    cpu = (f"{machine.get('cpu_model', '?')} ({machine.get('cpu_class', '?')}"
           + (f"; memory read at {read:.0f} GB/s when profiled" if read else "")
           + (f", {now:.0f} GB/s now: another spell of this machine's memory bandwidth, not profiled yet"
              + (f"; {floor}" if floor else "") if read and now else "") + ")")
    t1 = profile.target_time(best.target_precision, 1)
    reference = min((fastest_plain(profile), best_ar), key=lambda c: c.seconds_per_token)
    if best.method == "autoregressive":
        tree = min((c for c in ranked if c.method != "autoregressive"), key=lambda c: c.seconds_per_token, default=None)
        why = ""
        if tree is not None:
            tn = profile.target_time(tree.target_precision, tree.budget) / profile.target_time(tree.target_precision, 1)
            verdict = ("is not enough faster to be worth it" if tree.seconds_per_token < best.seconds_per_token
                       else "is slower")
            why = (f"the best tree, {tree.label()}, {verdict} ({ms(tree):.0f} ms/token predicted): its draft "
                   f"({tree.draft_seconds * 1e3:.0f} ms/step) and a {tree.budget}-token target forward "
                   f"({tn:.1f}x a 1-token one here) outweigh {tree.expected_tokens:.2f} tokens/step "
                   + _where_tokens_come_from(tree, acceptance))
        reason = (f"auto: plain autoregressive decoding at {best.target_precision}: "
                  f"{prediction_for(best, reference).text()} on {cpu}; {why}")
    else:
        n = best.budget
        tn = profile.target_time(best.target_precision, n)
        up_to = best.method in ("suffix", "hybrid") or (best.method == "chain" and best.stop_confidence)
        size = f"an up-to-{n}-token" if up_to else f"a {n}-token"
        reason = (f"auto: {best.label()}: {prediction_for(best, reference).text()} on {cpu}: {size} target forward "
                  f"costs {tn / t1:.1f}x a 1-token one here, draft {best.draft_seconds * 1e3:.0f} ms/step, "
                  f"{best.expected_tokens:.2f} tokens/step expected " + _where_tokens_come_from(best, acceptance))
        even = _fallback_below(best, reference)
        if even is not None:
            from ..drafting.repeats import REPEAT_EDGE

            reason += (f"; where this text's steps, priced at their own size, cost more per token than plain decoding "
                       f"(at this shape: under {even:.2f} tokens/step, the tree's break-even; checked from step "
                       f"{FALLBACK_AFTER} on, and from step {EARLY_CHECK_FROM} on at {EARLY_MARGIN:g}x the plain price) "
                       f"the run decodes plainly from then on; before that, where the text repeats itself, a step "
                       f"verifies those repeats instead of drafting wherever they are priced to beat this tree's rate by "
                       f"{REPEAT_EDGE:g}x (no draft forward)")
    fast_d = profile.fastest("draft", draft_precisions) or draft_precisions[0]
    per_method = tuple({c.method: c for c in reversed(ranked)}.values())
    return AutoPlan(best, best_ar, tuple(float(a) for a in acceptance), float(temperature), profile.key,
                    profile.machine, reason, tuple(ranked[:8]), fast_d, per_method, reference=reference,
                    profile=profile)


def _fallback_below(c: Candidate, plain: Candidate) -> Optional[float]:
    """``AutoPlan.break_even_tokens`` of ``c`` against ``plain`` (see there)."""
    if c.method not in MODEL_TREE_METHODS:
        return None
    return round(max(1.0, break_even_tokens(c.step_seconds, plain.seconds_per_token)), 3)


def _where_tokens_come_from(c: Candidate, acceptance: Sequence[float]) -> str:
    if c.method == "suffix":
        return "(the method replayed on the calibration text)"
    if c.method == "hybrid":
        return (f"(its suffix steps replayed on the calibration text, its model steps at acceptance "
                f"p1={acceptance[0]:.2f})")
    return f"at acceptance p1={acceptance[0]:.2f}"


def pair_name(cache: PairCache) -> str:
    """The name a pair's profile and acceptance are cached under."""
    return pair_name_of(cache.draft_spec, cache.target_spec)


def profile_for(cache: PairCache, target_precisions: Sequence[str], draft_precisions: Sequence[str],
                target_ns: Sequence[int] = (), refresh: bool = False,
                progress: Optional[Progress] = None, measure: bool = True, turn: Turn = nullcontext,
                remeasure: Sequence = (), read_gb_per_s: Optional[float] = None) -> MachineProfile:
    """The machine profile of ``cache``'s pair (``profiling.load_or_measure_profile``; ``read_gb_per_s``: the spell
    a probe just found, which has a profile of its own): the default sizes for both models, ``target_ns`` too for
    the target; only what the cache lacks is measured. Where that spell has no profile yet and is slower than the
    nearest one's, that profile's forwards are priced at no less than reading their weights now
    (``spell_pricing.floor_priced``)."""
    forward_bytes = getattr(cache, "forward_bytes", None)
    prof = load_or_measure_profile(cache.timing_model, pair_name(cache), cache.device, tuple(target_precisions),
                                   refresh=refresh, progress=progress, draft_precisions=tuple(draft_precisions),
                                   target_ns=tuple(target_ns), measure=measure, turn=turn, remeasure=remeasure,
                                   forward_bytes=forward_bytes, read_gb_per_s=read_gb_per_s)
    if prof.other_spell and forward_bytes is not None:
        prof = floor_priced(prof, prof.other_spell, forward_bytes)
    return prof


def priced_for_spell(plan: object, read_gb_per_s: Optional[float]) -> bool:
    """Whether ``plan`` (an ``AutoPlan``, or a plan without a profile) was priced for the spell a probe of
    ``read_gb_per_s`` GB/s is in: by that spell's profile, or, while that spell has none, by the nearest one for the
    same missing spell (no probe, or a profile without probed rows: any plan fits)."""
    prof = getattr(plan, "profile", None)
    ref = getattr(prof, "read_gb_per_s", None)
    if not read_gb_per_s or not ref:
        return True
    return same_spell(prof.other_spell or ref, read_gb_per_s)


def _cached_acceptance(cache: PairCache, name: str, target_precision: str, draft_precision: str, temperature: float,
                       required: bool) -> Optional[Acceptance]:
    """The pair's cached acceptance, found with its tokenizer alone (no weights loaded: the app's background
    measurement had loaded the whole pair, 4-6 s in a turn on the models, to find it cached); None when not cached,
    or when the tokenizer is not on this machine and not ``required`` (loading the pair fetches it)."""
    try:
        tokenizer = cache.text_tokenizer()
    except NotMeasuredYet:
        if required:
            raise
        return None
    return cached_acceptance(name, draft_precision, target_precision, temperature, calibration_prompts(tokenizer))


def plan_auto(cache: PairCache, temperature: float, *, target_precisions: Optional[Sequence[str]] = None,
              draft_precisions: Optional[Sequence[str]] = None, methods: Sequence[str] = AUTO_METHODS,
              refresh: bool = False, progress: Optional[Progress] = None,
              target_ns: Sequence[int] = (), measure: bool = True, turn: Turn = nullcontext,
              remeasure: Sequence = (), read_gb_per_s: Optional[float] = None,
              prompt_ids: Optional[Sequence[int]] = None) -> AutoPlan:
    """Profile (cached), measure acceptance (cached), choose. Loads models through ``cache``.
    ``target_ns``: target sizes the profile must also cover (a calibration that follows prices
    bigger trees than ``auto`` does: ``tuning.CALIBRATION_NS``). ``measure=False``: only from the
    caches, raising ``NotMeasuredYet`` when something is missing (nothing is loaded then); ``turn``:
    the context each timed measurement runs in (``profiling.measure_into``), and the pricing; ``remeasure``: profile rows
    (``prediction.ProfileRow``) to measure anew, the cached ones serving until then; ``read_gb_per_s``: the
    memory's read bandwidth probed just before (``profiling.run_probe``): the profile of that spell prices the
    plan (``profiling.load_or_measure_profile``); ``prompt_ids``: the prompt to be decoded: its draft/target
    agreement (``acceptance.prompt_agreement``, one forward of each model over its last tokens, the models loaded
    even with ``measure=False``) picks the calibration texts that price it (``Acceptance.nearest``)."""
    say = progress or (lambda _m: None)
    tps = tuple(target_precisions or default_precisions(cache.device))
    dps = tuple(draft_precisions or tps)
    name = pair_name(cache)
    say("machine profile (measured once per machine, pair and torch version, then cached):")
    prof = profile_for(cache, tps, dps, target_ns, refresh=refresh, progress=say, measure=measure, turn=turn,
                       remeasure=remeasure, read_gb_per_s=read_gb_per_s)
    fast_t = prof.fastest("target", tps) or tps[0]
    fast_d = prof.fastest("draft", dps) or dps[0]
    if methods == ("autoregressive",):
        acc = Acceptance((0.0,))
    else:
        say(f"acceptance of this pair at T={temperature:g} (target {fast_t}, draft {fast_d}; cached):")
        acc = None if refresh else _cached_acceptance(cache, name, fast_t, fast_d, temperature, required=not measure)
        if acc is None and not measure:
            raise AcceptanceNotMeasured(f"the acceptance of {name} at T={temperature:g} is not measured yet",
                                        fast_t, fast_d, temperature)
        if acc is None:
            with turn():
                pair = cache.pair(fast_t, fast_d)
            acc = load_or_measure_acceptance(pair, name, calibration_prompts(pair.tokenizer), temperature,
                                             refresh=refresh, progress=say, turn=turn)
    agreement = None
    if prompt_ids and acc.prompt_agreement:
        with turn():
            agreement = prompt_agreement(cache.pair(fast_t, fast_d), prompt_ids)
        acc = acc.nearest(agreement)
    with turn():  # (pricing is CPU work too: in the app's background it waits for an idle moment like a forward)
        plan = choose(prof, acc, temperature, tps, dps, methods)
    if agreement is not None:
        plan = replace(plan, prompt_agreement=round(agreement, 3), reason=(
            f"{plan.reason}; priced on the {len(acc.prompt_agreement)} calibration texts whose prompts' draft/target "
            f"agreement ({', '.join(f'{a:.2f}' for a in acc.prompt_agreement)}) is nearest this prompt's "
            f"({agreement:.2f})"))
    say(plan.reason)
    return plan
