"""Prices: the two rules every price in ``planning`` follows (the step-cost formula and the
interpolation policy, pure functions of numbers that ``auto``, its calibration ``tuning``, the app's
cost panel ``cost_model`` and the GPU projection ``projection`` all call), and ``auto``'s price of
every candidate configuration (``price_candidates``).

**The step cost.** A speculative step runs the draft (forwards of the draft model, or a model-free
suffix-tree build), one target forward of the tree, and everything else (verification, tree build,
mask, KV compaction, bookkeeping); it commits ``tokens_per_step`` tokens (accepted + bonus)::

    seconds per token = (target + draft + other) / tokens per step

``other`` has one definition, ``other_seconds``: what the engine's step spends outside the draft
model's forwards and the target's forward (``step_seconds - draft - target_forward`` of a recorded
step; from the machine profile, the same quantity measured by running the engine's step).

Averages over steps of different kinds (a hybrid's model and suffix steps) are taken *before* the
division, each weighted by how often it happens: the mean step over the mean tokens per step, never a
median step (a median hides the minority of expensive steps).

**Interpolation** between the profile's measured sizes (linear; below the smallest, its time; above the
largest, no price) is ``step_price.interpolate`` / ``row_time``, shared with the engine's fallback rule. A
planner that needs a size measures it (``profiling.load_or_measure_profile`` takes the sizes to cover).

**Per method** (``price_candidates``; forward times from the one ``MachineProfile``, expected tokens
from Sequoia's positional acceptance model with the acceptance vector *measured on this pair*,
``acceptance``; the shapes and replays in ``candidates``):

* ``autoregressive``: one target forward of 1 token, 1 token.
* ``chain`` of at most k tokens, optionally stopping after a token whose draft probability is below
  τ (transformers' assistant_confidence_threshold rule): priced by replaying the chain on every
  position of the calibration continuations (``candidates.simulate_chain``: expected drafted tokens,
  the distribution of the target's forward size, expected committed tokens), so runs of easy tokens
  (code) count as they are; without position data, ``1 + p1 + ... + p1^k`` tokens.
* ``sequoia`` (n, d): the DP-optimal tree; one batched draft forward per level (its internal nodes),
  ``G(n, d)`` tokens (Sequoia's optimizer, with every precision pair).
* ``suffix`` (n, d, q, α): the model-free suffix tree (at most α × match length tokens), priced by
  replaying the method on the calibration continuations (``drafting.suffix_replay``: the trees it
  would build, how many tokens each step commits, the target forward of each tree's size, the
  measured build time). No draft model runs. Only as repetitive as the calibration text (wiki and
  code): a prompt that quotes what is to be written (editing, summaries) favours it more than ``auto``
  can know.
* ``hybrid`` (n, d, q, α): the same replay decides, step by step with the drafter's own rule, whether
  the suffix tree is used (priced as above) or the draft model drafts; a model step is priced as
  Sequoia's (n, d) tree under the measured acceptance vector (``G(n, d)`` tokens, its level forwards
  on the draft model, an n-token target forward). The hybrid's model steps are OPT-Tree trees, which
  this positional model only approximates, and they fall where the text does not repeat, where
  acceptance is likely below the average the vector holds: the model steps' price is optimistic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

from ..memo import BoundedMemo
from ..methods import REGISTRY
from .acceptance import STOP_GRID, Acceptance
from .candidates import (CHAIN_LENGTHS, CHAIN_MAX, HYBRID_BUDGETS, HYBRID_DEPTHS, SEQUOIA_BUDGETS, SEQUOIA_DEPTHS,
                         SUFFIX_BUDGETS, SUFFIX_DEPTHS, SUFFIX_FACTORS, SUFFIX_THRESHOLDS, ChainStats, sequoia_shapes,
                         simulate_chain, simulate_suffix_shapes)

if TYPE_CHECKING:
    from ..trace import StepTrace
    from .machine_profile import MachineProfile

#: the methods ``auto`` prices: those whose ``MethodSpec`` names a pricer (every other tree method is
#: calibrated by ``tuning``)
AUTO_METHODS: tuple[str, ...] = tuple(name for name, spec in REGISTRY.items() if spec.pricer is not None)


def seconds_per_token(target_s: float, draft_s: float, other_s: float, tokens_per_step: float) -> float:
    """``(target_s + draft_s + other_s) / tokens_per_step`` (``inf`` when no token is committed)."""
    if tokens_per_step <= 0:
        return math.inf
    return (target_s + draft_s + other_s) / tokens_per_step


def break_even_tokens(step_s: float, plain_s_per_token: float) -> float:
    """Tokens per step a tree step of ``step_s`` must commit to match plain decoding at ``plain_s_per_token``:
    the step's cost in plain tokens."""
    return step_s / plain_s_per_token


def other_seconds(n: float, method: str, *, step: Optional[StepTrace] = None,
                  profile: Optional[MachineProfile] = None) -> float:
    """Seconds a step of ``method`` with an ``n``-node tree spends outside the draft model's forwards
    and the target's forward: tree build, mask, verification, KV compaction, drafter update, commit,
    trace. The one "other" cost ``auto``, ``tuning`` and ``cost_model`` price.

    Args:
        step: a recorded ``StepTrace``: its ``step_seconds - timings.draft - timings.target_forward``
            (never below 0; ``n`` and ``method`` are then the step's own).
        profile: without a step, the machine profile's row of the same quantity (its ``other_time``
            row, measured by ``profiling.measure_into`` as this function of the engine's own steps:
            one-level trees of n nodes, the autoregressive step at n = 1; ``autoregressive`` prices n = 1).
    """
    if step is not None:
        t = step.timings
        return max(0.0, step.step_seconds - t.draft - t.target_forward)
    if profile is None:
        raise ValueError("other_seconds needs a recorded step or a machine profile")
    return profile.other_time(1 if method == "autoregressive" else n)


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One priced configuration (built by keyword: nine of its fields are numbers)."""

    method: str
    target_precision: str
    draft_precision: Optional[str]
    budget: int
    depth: int
    expected_tokens: float
    target_seconds: float
    verify_seconds: float  # the step's other cost (``other_seconds``), not verification alone
    draft_seconds: float
    stop_confidence: Optional[float] = None
    threshold: Optional[float] = None  # suffix: the path-probability cut-off
    spec_factor: Optional[float] = None  # suffix: drafted tokens <= ceil(spec_factor x match length)
    model_share: Optional[float] = None  # hybrid: share of steps drafted by the model
    tree_size: Optional[int] = None  # sequoia: nodes of the DP-optimal tree (<= budget)

    @property
    def seconds_per_token(self) -> float:
        return seconds_per_token(self.target_seconds, self.draft_seconds, self.verify_seconds, self.expected_tokens)

    @property
    def step_seconds(self) -> float:
        return self.target_seconds + self.draft_seconds + self.verify_seconds

    def label(self) -> str:
        if self.method == "autoregressive":
            return f"autoregressive @ {self.target_precision}"
        cap = "" if self.spec_factor is None else f", <={self.spec_factor:g}x match length"
        if self.method == "chain":
            shape = f"k<={self.depth}, stop below q={self.stop_confidence:g}" if self.stop_confidence else f"k={self.depth}"
        elif self.method == "suffix":
            return (f"suffix (n<={self.budget}, d={self.depth}, paths with p>={self.threshold:g}{cap}; no draft model) "
                    f"@ target {self.target_precision}")
        elif self.method == "hybrid":
            shape = (f"n<={self.budget}, d={self.depth}, suffix paths with p>={self.threshold:g}{cap}; "
                     f"the draft model on {self.model_share or 0:.0%} of steps")
        else:
            shape = f"n={self.budget}, d={self.depth}"
        return f"{self.method} ({shape}) @ target {self.target_precision}, draft {self.draft_precision}"


def autoregressive_candidate(profile: MachineProfile, tp: str) -> Candidate:
    """Plain decoding at target precision ``tp``: one 1-token target forward per token."""
    return Candidate(method="autoregressive", target_precision=tp, draft_precision=None, budget=1, depth=0,
                     expected_tokens=1.0, target_seconds=profile.target_time(tp, 1),
                     verify_seconds=other_seconds(1, "autoregressive", profile=profile), draft_seconds=0.0)


@dataclass(frozen=True)
class PricingInputs:
    """What every pricer reads: the profile, the draft precisions, and the acceptance-derived tables of
    the methods asked for (empty for the others).

    Attributes:
        p1: the acceptance vector's first entry (the geometric chain model's acceptance rate).
        chains: ``{(k, stop index or None): ChainStats}`` on the calibration positions (None without them).
        sequoia: ``{(n, d): (tree size, G, draft level widths)}`` of Sequoia's DP trees.
        model_trees: the hybrid shapes' Sequoia model trees, same form.
        replayed: ``{SuffixShape: SuffixStats or None}`` of every suffix and hybrid shape (one replay).
    """

    profile: MachineProfile
    draft_precisions: tuple[str, ...]
    chain_lengths: tuple[int, ...]
    p1: float
    chains: Optional[dict]
    sequoia: dict
    model_trees: dict
    replayed: dict

    @classmethod
    def build(cls, profile: MachineProfile, acceptance: Sequence[float] | Acceptance, draft_precisions: Sequence[str],
              methods: Sequence[str], chain_lengths: Sequence[int], budgets: Sequence[int],
              depths: Sequence[int]) -> "PricingInputs":
        acc = acceptance if isinstance(acceptance, Acceptance) else Acceptance(tuple(acceptance))
        budgets = [b for b in budgets if b <= profile.max_tokens]
        sequoia = sequoia_shapes(acc.vector, budgets, depths) if ("sequoia" in methods and budgets) else {}
        chains = _DERIVED.get(("chains", acc.sequences, profile.max_tokens),
                              lambda: _chain_stats(acc.sequences, profile.max_tokens)
                              ) if ("chain" in methods and acc.sequences) else None
        model_trees, replayed = _replays(acc, methods, profile.max_tokens)
        return cls(profile, tuple(draft_precisions), tuple(chain_lengths),
                   float(acc.vector[0]) if len(acc.vector) else 0.0, chains, sequoia, model_trees, replayed)


def _chain_stats(sequences, max_tokens: int) -> dict[tuple[int, Optional[int]], ChainStats]:
    """``{(k, stop index or None): ChainStats}`` of every chain up to ``CHAIN_MAX`` that fits ``max_tokens``."""
    return {(k, stop): simulate_chain(sequences, k, stop)
            for k in range(1, CHAIN_MAX + 1) if k + 1 <= max_tokens
            for stop in (None, *range(len(STOP_GRID))) if not (stop is not None and k == 1)}


#: what pricing derives from the calibration alone, by what it depends on (the texts, the sequences, the positional
#: vector, the methods, the size cap): the suffix and hybrid replays and the chains' statistics. Those were 0.8 and
#: 0.15 s of a 1.2 s plan on the 2-core Zen 4 VM, paid again by every plan (each new profile, each spell; in the app
#: the Run after a background measurement, beside it). A replay's steps are fixed by the texts; its build seconds are
#: the suffix side's CPU time, measured once per process here, so a request priced twice picks the same shape.
_DERIVED = BoundedMemo(keep=16)


def _replays(acc: Acceptance, methods: Sequence[str], max_tokens: int) -> tuple[dict, dict]:
    """``(model trees, replayed)``: the hybrid shapes' Sequoia model trees ``{(n, d): (size, G, levels)}``
    and ``{SuffixShape: SuffixStats or None}`` of every suffix and hybrid shape, from one replay (once per
    process for the same inputs: ``_DERIVED``)."""
    return _DERIVED.get(("replays", acc.texts, acc.vector, "suffix" in methods, "hybrid" in methods, max_tokens),
                        lambda: _replayed(acc, methods, max_tokens))


def _replayed(acc: Acceptance, methods: Sequence[str], max_tokens: int) -> tuple[dict, dict]:
    from ..drafting.suffix_replay import SuffixShape

    suffix_shapes = [SuffixShape(n, d, q, f) for n in SUFFIX_BUDGETS if n <= max_tokens
                     for d in SUFFIX_DEPTHS for q in SUFFIX_THRESHOLDS for f in SUFFIX_FACTORS
                     ] if ("suffix" in methods and acc.texts) else []
    hybrid_budgets = [n for n in HYBRID_BUDGETS if n <= max_tokens]
    model_trees = sequoia_shapes(acc.vector, hybrid_budgets, HYBRID_DEPTHS) if (
        "hybrid" in methods and acc.texts and hybrid_budgets and len(acc.vector)) else {}
    hybrid_shapes = [SuffixShape(n, d, q, f, hybrid=True) for (n, d) in model_trees
                     for q in SUFFIX_THRESHOLDS for f in SUFFIX_FACTORS]
    model_commit = {s: max(1, round(model_trees[(s.budget, s.depth)][1])) for s in hybrid_shapes}
    replayed = simulate_suffix_shapes(acc.texts, suffix_shapes + hybrid_shapes, model_commit) if (
        suffix_shapes or hybrid_shapes) else {}
    return model_trees, replayed


def price_candidates(
    profile: MachineProfile,
    acceptance: Sequence[float] | Acceptance,
    target_precisions: Sequence[str],
    draft_precisions: Sequence[str],
    methods: Sequence[str] = AUTO_METHODS,
    chain_lengths: Sequence[int] = CHAIN_LENGTHS,
    budgets: Sequence[int] = SEQUOIA_BUDGETS,
    depths: Sequence[int] = SEQUOIA_DEPTHS,
) -> list[Candidate]:
    """Every (method, shape, precision pair) priced from the profile (unmeasured sizes: skipped), each
    method by the pricer its ``MethodSpec`` names (``methods.REGISTRY``; ``planning.method_prices``).

    Chains are priced on the calibration positions (``simulate_chain``) when ``acceptance`` carries
    them, with and without each confidence stop; otherwise with the geometric positional model."""
    from ..interrupt import check_load
    from ..methods import method_spec

    inputs = PricingInputs.build(profile, acceptance, draft_precisions, methods, chain_lengths, budgets, depths)
    cands: list[Candidate] = []
    for tp in target_precisions:
        for m in methods:
            check_load()  # (a Run's Stop during its plan: 0.25-1.2 s of pricing on a 2-core CPU)
            pricer = method_spec(m).pricer_fn()
            if pricer is None:
                raise ValueError(f"auto cannot price {m!r} in closed form (it prices {', '.join(AUTO_METHODS)})")
            cands += pricer(inputs, tp)
    return [c for c in cands if math.isfinite(c.seconds_per_token)]
