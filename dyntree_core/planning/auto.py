"""``auto``, the one planner: choose the precision of each model, the method, the tree size and depth
for this machine by minimising predicted milliseconds per token, and say why. For a method it cannot
price in closed form (DySpec, OPT-Tree, DynaTree, SpecInfer with ``--budget auto``) its calibration,
``tuning``, searches the shape by short decodes priced from the same machine profile.

Predicted seconds per token of a configuration = (target forward of the n-node tree at the
target's precision + host-side probability rows for n nodes + the draft forwards) / expected
tokens per step (``pricing.seconds_per_token``). Forward times come from the one measured
``MachineProfile`` (sizes it did not measure have no price: ``pricing.interpolate``); expected tokens from
Sequoia's positional acceptance model with the acceptance vector *measured on this pair*
(``measure_acceptance``):

* ``autoregressive``: one target forward of 1 token, 1 token.
* ``chain`` of at most k tokens, optionally stopping after a token whose draft probability is
  below τ (transformers' assistant_confidence_threshold rule): priced by replaying the chain on
  every position of the calibration continuations (``simulate_chain``: expected drafted tokens,
  the distribution of the target's forward size, expected committed tokens), so runs of easy
  tokens (code) count as they are; without position data, ``1 + p1 + ... + p1^k`` tokens.
* ``sequoia`` (n, d): the DP-optimal tree; one batched draft forward per level (its internal
  nodes), ``G(n, d)`` tokens (Sequoia's optimizer, with every precision pair).
* ``suffix`` (n, d, q, α): the model-free suffix tree (at most α × match length tokens), priced by
  replaying the method on the calibration continuations (``drafting.suffix_replay``: the trees it
  would build, how many tokens each step commits, the target forward of each tree's size, the
  measured build time). No draft model runs. Only as repetitive as the calibration text (wiki and
  code): a prompt that quotes what is to be written (editing, summaries) favours it more than
  ``auto`` can know.
* ``hybrid`` (n, d, q, α): the same replay decides, step by step with the drafter's own rule,
  whether the suffix tree is used (priced as above) or the draft model drafts; a model step is
  priced as Sequoia's (n, d) tree under the measured acceptance vector (``G(n, d)`` tokens, its
  level forwards on the draft model, an n-token target forward). The hybrid's model steps are
  OPT-Tree trees, which this positional model only approximates, and they fall where the text
  does not repeat, where acceptance is likely below the average the vector holds: the model
  steps' price is optimistic.

Plain autoregressive decoding is a candidate like any other: on a machine where no tree pays
for its draft and verification, ``auto`` chooses it and says so. The acceptance vector is
measured once per pair and temperature with the draft and target at the precisions the profile
finds fastest for one token, and is assumed for the other precisions too (int8/int4 of these
models keep the argmax of their float weights on almost every position; see the precision
bench for measured acceptance per precision).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from ..config import DecodeConfig
from .machine_profile import MachineProfile, NotMeasuredYet, Turn
from .pricing import seconds_per_token

AUTO_METHODS: tuple[str, ...] = ("autoregressive", "chain", "sequoia", "suffix", "hybrid")
AUTO = "auto"  # the request value meaning "let the cost model choose"
#: the draft-model tree methods ``auto`` prices (their precisions stand in for methods it cannot price)
MODEL_TREE_METHODS: tuple[str, ...] = ("chain", "sequoia")
CHAIN_LENGTHS: tuple[int, ...] = tuple(range(1, 9))
SEQUOIA_BUDGETS: tuple[int, ...] = (4, 6, 8, 12, 16, 24, 32)
SEQUOIA_DEPTHS: tuple[int, ...] = (1, 2, 3, 4, 6, 8)
ACCEPTANCE_VERSION = 3  # 3: the calibration texts are kept (the suffix method is replayed on them)
TREE_MARGIN = 0.05
#: confidence-stop thresholds the chain is priced at (None = always draft k tokens)
STOP_GRID: tuple[float, ...] = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
CHAIN_MAX = 12
#: suffix-tree shapes priced: budgets x depths x path-probability thresholds
SUFFIX_BUDGETS: tuple[int, ...] = (4, 8, 16, 32)
SUFFIX_DEPTHS: tuple[int, ...] = (4, 8, 16)
SUFFIX_THRESHOLDS: tuple[float, ...] = (0.05, 0.2)
#: match-length caps priced (``DecodeConfig.spec_factor``; None = no cap)
SUFFIX_FACTORS: tuple[Optional[float], ...] = (0.5, 1.0, 2.0, None)
#: hybrid shapes priced (x SUFFIX_THRESHOLDS x SUFFIX_FACTORS): its model steps are OPT-Tree trees
HYBRID_BUDGETS: tuple[int, ...] = (4, 8, 16, 32)
HYBRID_DEPTHS: tuple[int, ...] = (4, 8)


@dataclass(frozen=True)
class Acceptance:
    """What the pair's own continuations say about acceptance.

    Attributes:
        vector: Sequoia's positional acceptance vector p_1..p_W.
        sequences: per calibration continuation, per position ``(accept, cont...)``: ``accept`` the
            probability that a chain token drafted there (given the target's prefix) is accepted
            (T=0: 1 if the draft argmax is the target's token; T>0: ``sum min(p, q)``), ``cont[j]``
            the probability that the drafted token's draft probability is >= ``STOP_GRID[j]``
            (the chain goes on). Runs of easy tokens (code) are kept as they are, not averaged away.
        texts: per calibration continuation, ``(prompt ids, continuation ids)`` (the suffix method
            is replayed on them).
    """

    vector: tuple[float, ...]
    sequences: tuple[tuple[tuple[float, ...], ...], ...] = ()
    texts: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()
Progress = Callable[[str], None]


@dataclass(frozen=True)
class Candidate:
    """One priced configuration."""

    method: str
    target_precision: str
    draft_precision: Optional[str]
    budget: int
    depth: int
    expected_tokens: float
    target_seconds: float
    verify_seconds: float
    draft_seconds: float
    stop_confidence: Optional[float] = None
    threshold: Optional[float] = None  # suffix: the path-probability cut-off
    spec_factor: Optional[float] = None  # suffix: drafted tokens <= ceil(spec_factor x match length)
    model_share: Optional[float] = None  # hybrid: share of steps drafted by the model
    tree_size: Optional[int] = None  # sequoia: nodes of the DP-optimal tree (<= budget)

    @property
    def seconds_per_token(self) -> float:
        return seconds_per_token(self.target_seconds, self.draft_seconds, self.verify_seconds, self.expected_tokens)

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
        kw: dict = dict(method=b.method, verifier="auto")
        if b.method == "chain":
            kw.update(depth=b.depth, budget=max(2, b.depth + 1), stop_confidence=b.stop_confidence)
        elif b.method == "sequoia":
            kw.update(budget=b.budget, depth=b.depth, sequoia_acceptance=tuple(self.acceptance))
        elif b.method in ("suffix", "hybrid"):
            kw.update(budget=b.budget, depth=b.depth, threshold=b.threshold, spec_factor=b.spec_factor)
        return kw

    def apply(self, cfg: DecodeConfig) -> DecodeConfig:
        """``cfg`` with the chosen method, shape and precisions."""
        b = self.best
        return replace(cfg, precision=b.target_precision,
                       draft_precision=b.draft_precision if b.method != "autoregressive" else None,
                       **self.method_fields())

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

    def to_dict(self) -> dict:
        d = asdict(self)
        d["best"]["seconds_per_token"] = self.best.seconds_per_token
        d["best_autoregressive"]["seconds_per_token"] = self.best_autoregressive.seconds_per_token
        return d


# ----------------------------------------------------------------------------------- pricing
def chain_expected_tokens(p1: float, k: int) -> float:
    return sum(p1 ** i for i in range(k + 1))


@dataclass(frozen=True)
class ChainStats:
    """A chain of at most k tokens with a stop rule, started at every calibration position, pooled:
    ``tokens`` committed per step, ``drafted`` draft forwards per step, ``size_probs[m-1]`` the
    probability that m tokens were drafted (the target then runs m + 1)."""

    tokens: float
    drafted: float
    size_probs: tuple[float, ...]


def simulate_chain(sequences: Sequence[Sequence[Sequence[float]]], k: int, stop_index: Optional[int]) -> ChainStats:
    """``ChainStats`` of a chain of at most ``k`` tokens (stop rule ``STOP_GRID[stop_index]`` or none).

    With ``D`` the number drafted, ``P(D >= m) = prod_{l < m-1} cont_l`` and the accepted run reaching
    j needs ``D >= j`` and the first j tokens accepted; at T=0 every factor is 0 or 1, so this is
    exact for the calibration text (positions past its end take the sequence's means).
    """
    tok = dra = 0.0
    sizes = [0.0] * k
    starts = 0
    for seq in sequences:
        if not seq:
            continue
        mean = [sum(col) / len(seq) for col in zip(*seq)]
        for s in range(len(seq)):
            rows = [seq[s + l] if s + l < len(seq) else mean for l in range(k)]
            p_ge = [1.0]  # P(D >= 1), P(D >= 2), ...
            for l in range(k - 1):
                p_ge.append(p_ge[-1] * (1.0 if stop_index is None else rows[l][1 + stop_index]))
            run, e_tok = 1.0, 1.0
            for j in range(1, k + 1):
                run *= rows[j - 1][0]
                e_tok += p_ge[j - 1] * run
            for m in range(1, k + 1):
                sizes[m - 1] += p_ge[m - 1] - (p_ge[m] if m < k else 0.0)
            tok += e_tok
            dra += sum(p_ge)
            starts += 1
    if not starts:
        return ChainStats(1.0, float(k), tuple(1.0 if m == k else 0.0 for m in range(1, k + 1)))
    return ChainStats(tok / starts, dra / starts, tuple(x / starts for x in sizes))


@dataclass(frozen=True)
class SuffixStats:
    """A ``suffix`` or ``hybrid`` shape replayed on the calibration continuations, pooled over steps:
    ``suffix_tokens`` tokens committed by suffix-tree steps per step (all steps counted),
    ``size_probs`` ``{suffix tree size: share of all steps}``, ``model_share`` the share of steps a
    hybrid drafts with the model, ``build_seconds`` the mean time per step to update the index and
    build suffix trees (the whole of the suffix side's drafting)."""

    suffix_tokens: float
    size_probs: dict[int, float]
    build_seconds: float
    model_share: float = 0.0


def simulate_suffix_shapes(texts: Sequence[tuple[Sequence[int], Sequence[int]]], shapes: Sequence,
                           model_commit: Optional[dict] = None) -> dict:
    """``{SuffixShape: SuffixStats or None}`` of every shape on ``(prompt, continuation)`` texts, from
    one lockstep replay per text (``drafting.suffix_replay.replay_shapes``); None without steps."""
    from ..drafting.suffix_replay import replay_shapes

    steps: dict = {s: [] for s in shapes}
    seconds = {s: 0.0 for s in shapes}
    for prompt, cont in texts:
        if not prompt or not cont:
            continue
        for s, rep in replay_shapes(prompt, cont, shapes, model_commit).items():
            steps[s].extend(rep.steps)
            seconds[s] += rep.build_seconds
    out = {}
    for s, st in steps.items():
        if not st:
            out[s] = None
            continue
        suffix = [x for x in st if x.from_suffix]
        sizes = Counter(x.size for x in suffix)
        out[s] = SuffixStats(sum(x.committed for x in suffix) / len(st),
                             {n: c / len(st) for n, c in sorted(sizes.items())},
                             seconds[s] / len(st), (len(st) - len(suffix)) / len(st))
    return out


def simulate_suffix(texts: Sequence[tuple[Sequence[int], Sequence[int]]], budget: int, depth: int,
                    threshold: float, spec_factor: Optional[float] = None) -> Optional[SuffixStats]:
    """``SuffixStats`` of one ``suffix`` shape on ``(prompt, continuation)`` texts (None without texts)."""
    from ..drafting.suffix_replay import SuffixShape

    shape = SuffixShape(budget, depth, threshold, spec_factor)
    return simulate_suffix_shapes(texts, [shape])[shape]


def sequoia_draft_levels(shape) -> list[int]:
    """Nodes fed to each batched draft forward of a Sequoia tree: the internal nodes of each level,
    root level first (one draft forward per level that has children)."""
    depth = shape.depths()
    counts = Counter(depth[p] for p in set(shape.parents) if p >= 0)
    return [counts[k] for k in sorted(counts)]


def sequoia_shapes(acceptance: Sequence[float], budgets: Sequence[int], depths: Sequence[int]) -> dict:
    """``{(budget, depth): (tree size, G, draft level widths)}`` of Sequoia's DP-optimal trees under the
    positional ``acceptance`` vector (``depth`` levels below the root)."""
    from ..drafting.sequoia import best_size, sequoia_dp, sequoia_tree

    table = sequoia_dp(tuple(acceptance), max(budgets), max(depths) + 1)
    out = {}
    for n in budgets:
        for d in depths:
            shape = sequoia_tree(table, best_size(table, n, d + 1), d + 1)
            out[(n, d)] = (shape.size, table.G(shape.size, d + 1), sequoia_draft_levels(shape))
    return out


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
    """Every (method, shape, precision pair) priced from the profile (unmeasured sizes: skipped).

    Chains are priced on the calibration positions (``simulate_chain``) when ``acceptance`` carries
    them, with and without each confidence stop; otherwise with the geometric positional model."""
    cands: list[Candidate] = []
    sequences = acceptance.sequences if isinstance(acceptance, Acceptance) else ()
    texts = acceptance.texts if isinstance(acceptance, Acceptance) else ()
    acceptance = acceptance.vector if isinstance(acceptance, Acceptance) else tuple(acceptance)
    p1 = float(acceptance[0]) if len(acceptance) else 0.0
    budgets = [b for b in budgets if b <= profile.max_tokens]
    shapes = sequoia_shapes(acceptance, budgets, depths) if ("sequoia" in methods and budgets) else {}
    chain_stats = {(k, stop): simulate_chain(sequences, k, stop)
                   for k in range(1, CHAIN_MAX + 1) if k + 1 <= profile.max_tokens
                   for stop in (None, *range(len(STOP_GRID))) if not (stop is not None and k == 1)
                   } if ("chain" in methods and sequences) else {}
    from ..drafting.suffix_replay import SuffixShape

    suffix_shapes = [SuffixShape(n, d, q, f) for n in SUFFIX_BUDGETS if n <= profile.max_tokens
                     for d in SUFFIX_DEPTHS for q in SUFFIX_THRESHOLDS for f in SUFFIX_FACTORS
                     ] if ("suffix" in methods and texts) else []
    hybrid_budgets = [n for n in HYBRID_BUDGETS if n <= profile.max_tokens]
    model_trees = sequoia_shapes(acceptance, hybrid_budgets, HYBRID_DEPTHS) if (
        "hybrid" in methods and texts and hybrid_budgets and len(acceptance)) else {}
    hybrid_shapes = [SuffixShape(n, d, q, f, hybrid=True) for (n, d) in model_trees
                     for q in SUFFIX_THRESHOLDS for f in SUFFIX_FACTORS]
    model_commit = {s: max(1, round(model_trees[(s.budget, s.depth)][1])) for s in hybrid_shapes}
    replayed = simulate_suffix_shapes(texts, suffix_shapes + hybrid_shapes, model_commit) if (
        suffix_shapes or hybrid_shapes) else {}
    for tp in target_precisions:
        for sh, st in replayed.items():
            if st is None:
                continue
            t_s = sum(p * profile.target_time(tp, size) for size, p in st.size_probs.items())
            v_s = sum(p * profile.verify_time(size) for size, p in st.size_probs.items())
            if not sh.hybrid:
                cands.append(Candidate("suffix", tp, None, sh.budget, sh.depth, st.suffix_tokens, t_s, v_s, st.build_seconds,
                                       threshold=sh.threshold, spec_factor=sh.spec_factor))
                continue
            size, g, levels = model_trees[(sh.budget, sh.depth)]
            m = st.model_share
            for dp in draft_precisions:
                cands.append(Candidate(
                    "hybrid", tp, dp, sh.budget, sh.depth, st.suffix_tokens + m * g,
                    t_s + m * profile.target_time(tp, size), v_s + m * profile.verify_time(size),
                    st.build_seconds + m * sum(profile.draft_time(dp, w) for w in levels),
                    threshold=sh.threshold, spec_factor=sh.spec_factor, model_share=m))
        if "autoregressive" in methods:
            cands.append(Candidate("autoregressive", tp, None, 1, 0, 1.0, profile.target_time(tp, 1),
                                   profile.verify_time(1), 0.0))
        for dp in draft_precisions:
            if "chain" in methods and sequences:
                td = profile.draft_time(dp, 1)
                for (k, stop), st in chain_stats.items():
                    sizes = range(2, k + 2)
                    t_s = sum(p * profile.target_time(tp, n) for p, n in zip(st.size_probs, sizes))
                    v_s = sum(p * profile.verify_time(n) for p, n in zip(st.size_probs, sizes))
                    cands.append(Candidate("chain", tp, dp, k + 1, k, st.tokens, t_s, v_s, st.drafted * td,
                                           None if stop is None else STOP_GRID[stop]))
            elif "chain" in methods:
                for k in chain_lengths:
                    if k + 1 > profile.max_tokens:
                        continue
                    cands.append(Candidate("chain", tp, dp, k + 1, k, chain_expected_tokens(p1, k),
                                           profile.target_time(tp, k + 1), profile.verify_time(k + 1),
                                           k * profile.draft_time(dp, 1)))
            for (n, d), (size, g, levels) in shapes.items():
                cands.append(Candidate("sequoia", tp, dp, n, d, g, profile.target_time(tp, size),
                                       profile.verify_time(size), sum(profile.draft_time(dp, w) for w in levels),
                                       tree_size=size))
    return [c for c in cands if math.isfinite(c.seconds_per_token)]


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
    best_ar = ars[0] if ars else min(
        (Candidate("autoregressive", tp, None, 1, 0, 1.0, profile.target_time(tp, 1), profile.verify_time(1), 0.0)
         for tp in target_precisions), key=lambda c: c.seconds_per_token)
    best = ranked[0]
    if best.method != "autoregressive" and ars and best.seconds_per_token > (1.0 - margin) * best_ar.seconds_per_token:
        best = best_ar
    ms = lambda c: c.seconds_per_token * 1e3  # noqa: E731
    machine = profile.machine
    cpu = f"{machine.get('cpu_model', '?')} ({machine.get('cpu_class', '?')})"
    t1 = profile.target_time(best.target_precision, 1)
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
        reason = (f"auto: plain autoregressive decoding at {best.target_precision} ({ms(best):.0f} ms/token predicted) "
                  f"on {cpu}; {why}")
    else:
        n = best.budget
        tn = profile.target_time(best.target_precision, n)
        up_to = best.method in ("suffix", "hybrid") or (best.method == "chain" and best.stop_confidence)
        size = f"an up-to-{n}-token" if up_to else f"a {n}-token"
        reason = (f"auto: {best.label()}: predicted {ms(best):.0f} ms/token vs {ms(best_ar):.0f} for autoregressive "
                  f"@ {best_ar.target_precision} ({ms(best_ar) / ms(best):.2f}x) on {cpu}: {size} target forward "
                  f"costs {tn / t1:.1f}x a 1-token one here, draft {best.draft_seconds * 1e3:.0f} ms/step, "
                  f"{best.expected_tokens:.2f} tokens/step expected " + _where_tokens_come_from(best, acceptance))
    fast_d = min(draft_precisions, key=lambda p: profile.draft_time(p, 1))
    per_method = tuple({c.method: c for c in reversed(ranked)}.values())
    return AutoPlan(best, best_ar, tuple(float(a) for a in acceptance), float(temperature), profile.key,
                    profile.machine, reason, tuple(ranked[:8]), fast_d, per_method)


def _where_tokens_come_from(c: Candidate, acceptance: Sequence[float]) -> str:
    if c.method == "suffix":
        return "(the method replayed on the calibration text)"
    if c.method == "hybrid":
        return (f"(its suffix steps replayed on the calibration text, its model steps at acceptance "
                f"p1={acceptance[0]:.2f})")
    return f"at acceptance p1={acceptance[0]:.2f}"


# ------------------------------------------------------------------------------- acceptance
def measure_acceptance(pair, prompts: Sequence[Sequence[int]], temperature: float, new_tokens: int = 48,
                       width: int = 8, seed: int = 0, progress: Optional[Progress] = None,
                       turn: Turn = nullcontext) -> Acceptance:
    """Acceptance on the pair's *own* continuations: the target continues each prompt
    (autoregressive, at ``temperature``), then draft and target are teacher-forced over prompt +
    continuation; on the continuation positions Sequoia's estimator (notes/sequoia.md §1.5) gives
    the positional vector and each position's chain acceptance / confidence-stop statistics
    (``Acceptance``). Text the models write agrees more than human text does. Each decoding step
    and each prompt's teacher-forced forwards run in a ``turn()`` (the app's shared models)."""
    from ..drafting.sequoia import estimate_acceptance_vector
    from ..decode.engine import SpeculativeDecoder
    from ..sampling import probs_from_logits

    say = progress or (lambda _m: None)
    gen = torch.Generator().manual_seed(seed)
    total, count = None, 0
    sequences = []
    texts = []
    taus = torch.tensor(STOP_GRID, dtype=torch.float64)
    dec = SpeculativeDecoder(pair.draft, pair.target,
                             DecodeConfig(method="autoregressive", temperature=temperature, seed=seed,
                                          dtype=_dense_dtype(pair)),
                             eos_token_id=list(pair.eos_token_ids) or None)
    for i, ids in enumerate(prompts):
        ids = list(ids)
        cont: list[int] = []
        steps = dec.generate(ids, new_tokens, seed=seed + i)
        while True:
            with turn():
                trace = next(steps, None)
            if trace is None:
                break
            cont.extend(c.token_id for c in trace.committed)
        full = ids + cont
        if len(cont) < 2:
            continue
        texts.append((tuple(ids), tuple(int(t) for t in cont)))
        with turn(), torch.inference_mode():
            x = torch.tensor([full])
            tl = pair.target(x).logits[0, len(ids) - 1:-1]
            dl = pair.draft(x).logits[0, len(ids) - 1:-1]
        t = temperature if temperature > 0 else 1.0
        tp, dp = probs_from_logits(tl, t).cpu().double(), probs_from_logits(dl, t).cpu().double()
        acc = estimate_acceptance_vector(dp, tp, width, gen, deterministic=temperature == 0) * tp.shape[0]
        total = acc if total is None else total + acc
        count += tp.shape[0]
        if temperature == 0:
            accept = (dp.argmax(-1) == torch.tensor(cont)).double()
            conf = dp.max(-1).values
            go_on = (conf[:, None] >= taus[None, :]).double()
        else:
            accept = torch.minimum(tp, dp).sum(-1)
            go_on = torch.stack([(dp * (dp >= tau)).sum(-1) for tau in STOP_GRID], dim=-1)
        sequences.append(tuple(tuple([float(a), *map(float, c)]) for a, c in zip(accept, go_on)))
        say(f"    acceptance prompt {i + 1}/{len(prompts)}: p1 so far {float(total[0]) / count:.2f}")
    if not count:
        raise ValueError("no acceptance could be measured: the continuations were empty")
    return Acceptance(tuple(float(a) for a in total / count), tuple(sequences), tuple(texts))


def _dense_dtype(pair) -> str:
    return str(pair.dtype).removeprefix("torch.") if pair.dtype is not None else "float32"


def acceptance_cache_path(key: str) -> Path:
    from ..paths import cache_root

    return cache_root() / "profiles" / f"acceptance-{key}.json"


def _acceptance_path(pair_name: str, draft_precision: str, target_precision: str, temperature: float,
                     new_tokens: int, prompts: Sequence[Sequence[int]]) -> Path:
    raw = json.dumps([pair_name, draft_precision, target_precision, float(temperature), new_tokens,
                      [list(p) for p in prompts], ACCEPTANCE_VERSION])
    return acceptance_cache_path(hashlib.sha256(raw.encode()).hexdigest()[:16])


def cached_acceptance(pair_name: str, draft_precision: str, target_precision: str, temperature: float,
                      prompts: Sequence[Sequence[int]], new_tokens: int = 48) -> Optional[Acceptance]:
    """The acceptance ``load_or_measure_acceptance`` cached for these arguments (None if none)."""
    path = _acceptance_path(pair_name, draft_precision, target_precision, temperature, new_tokens, prompts)
    if not path.is_file():
        return None
    try:
        d = json.loads(path.read_text())
        return Acceptance(tuple(d["acceptance"]), tuple(tuple(tuple(r) for r in seq) for seq in d["sequences"]),
                          tuple((tuple(p), tuple(c)) for p, c in d["texts"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_or_measure_acceptance(pair, pair_name: str, prompts: Sequence[Sequence[int]], temperature: float,
                               new_tokens: int = 48, refresh: bool = False,
                               progress: Optional[Progress] = None, turn: Turn = nullcontext) -> Acceptance:
    path = _acceptance_path(pair_name, pair.draft_precision, pair.target_precision, temperature, new_tokens, prompts)
    if not refresh:
        acc = cached_acceptance(pair_name, pair.draft_precision, pair.target_precision, temperature, prompts,
                                new_tokens)
        if acc is not None:
            return acc
    t0 = time.perf_counter()
    acc = measure_acceptance(pair, prompts, temperature, new_tokens, progress=progress, turn=turn)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"acceptance": acc.vector, "sequences": acc.sequences, "texts": acc.texts,
                                "stop_grid": STOP_GRID,
                                "pair": pair_name, "temperature": temperature,
                                "draft_precision": pair.draft_precision, "target_precision": pair.target_precision,
                                "seconds": time.perf_counter() - t0}))
    return acc


# ------------------------------------------------------------------------------- orchestration
@dataclass
class PairCache:
    """Loads models per (role, precision) once; hands out pairs at a precision pair.

    Holding every precision of both models would need ~15 GB for the embedded pair, so at most
    ``keep`` models stay loaded (least recently used go first)."""

    draft_spec: str
    target_spec: str
    device: str = "cpu"
    keep: int = 2
    _models: dict = field(default_factory=dict)
    _base: object = None

    def model(self, role: str, precision: str):
        key = (role, precision)
        if key in self._models:
            m = self._models.pop(key)
            self._models[key] = m
            return m
        from ..models.load import load_model, resolve_spec

        src = resolve_spec(self.draft_spec if role == "draft" else self.target_spec, role)
        m = load_model(src, "float32", self.device, precision)
        while len(self._models) >= self.keep:
            self._models.pop(next(iter(self._models)))
        self._models[key] = m
        return m

    def text_tokenizer(self):
        """The pair's tokenizer without loading weights (the loaded pair's, else the target's files
        on this machine); ``NotMeasuredYet`` where that would need a download."""
        if self._base is not None:
            return self._base.tokenizer
        from ..models.load import local_text_info

        found = local_text_info(self.target_spec, "target")
        if found is None:
            raise NotMeasuredYet(f"the tokenizer of {self.target_spec!r} is not on this machine yet")
        return found[0]

    def timing_model(self, role: str, precision: str):
        """A model that costs what ``model(role, precision)`` costs per forward: its zero-weight shape
        twin where one can be built (a GGUF preset on the CPU: seconds instead of a full load), else
        the model itself. Twins are not kept."""
        from ..models.load import load_shape_twin, resolve_spec

        src = resolve_spec(self.draft_spec if role == "draft" else self.target_spec, role)
        twin = load_shape_twin(src, self.device, precision)
        return twin if twin is not None else self.model(role, precision)

    def pair(self, target_precision: str, draft_precision: str):
        """A ``ModelPair`` at those precisions (tokenizer and checks from ``load_pair``'s first call)."""
        import dataclasses

        from ..models.load import load_pair

        if self._base is None:
            pair = load_pair(self.draft_spec, self.target_spec, device=self.device,
                             precision=target_precision, draft_precision=draft_precision)
            # the template of later pairs keeps the tokenizer and checks, not these weights: holding
            # them would keep the first precisions in memory beside the ``keep`` models
            self._base = dataclasses.replace(pair, draft=None, target=None)
            self._models[("draft", draft_precision)] = pair.draft
            self._models[("target", target_precision)] = pair.target
            while len(self._models) > max(self.keep, 2):
                self._models.pop(next(iter(self._models)))
            return pair
        t = self.model("target", target_precision)
        d = self.model("draft", draft_precision)
        return dataclasses.replace(self._base, draft=d, target=t, draft_precision=draft_precision,
                                   target_precision=target_precision)


@dataclass(frozen=True)
class ProvisionalPlan:
    """What ``auto`` runs before it has measured this machine: plain decoding at the precision whose
    weights are the fewest bytes (decoding one token streams every weight once, so the smallest
    weights are the metadata's best guess; on a GPU the candidates are floats only)."""

    precision: str
    draft_precision: str
    reason: str

    def resolve(self, method: str, precision: str, draft_precision: str) -> dict:
        """As ``AutoPlan.resolve``: ``auto`` fields become plain decoding at the smallest weights."""
        kw: dict = {}
        if method == AUTO:
            kw.update(method="autoregressive", verifier="auto")
        if precision == AUTO:
            kw["precision"] = self.precision
        if draft_precision == AUTO:
            kw["draft_precision"] = self.draft_precision
        return kw


#: bytes per weight of each precision (what one decoded token streams)
WEIGHT_BYTES = {"int4": 0.5, "int8": 1.0, "float16": 2.0, "bfloat16": 2.0, "float32": 4.0}


def provisional_plan(target_precisions: Sequence[str], draft_precisions: Sequence[str], why: str) -> ProvisionalPlan:
    """``ProvisionalPlan`` among the candidate precisions; ``why`` ends its reason."""
    tp = min(target_precisions, key=WEIGHT_BYTES.__getitem__)
    dp = min(draft_precisions, key=WEIGHT_BYTES.__getitem__)
    return ProvisionalPlan(tp, dp, f"auto: plain decoding at {tp} (the fewest weight bytes) until this machine "
                                   f"is measured: {why}")


def default_precisions(device: str) -> tuple[str, ...]:
    return ("int8", "int4", "float32", "bfloat16") if device == "cpu" else ("float16", "bfloat16")


def search_space(method: str, precision: str, draft_precision: str,
                 device: str) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """``(target precisions, draft precisions, methods)`` that ``plan_auto`` prices for a request in
    which any of the three may be ``"auto"``. A fixed method that ``auto`` can price is priced
    against autoregressive decoding; one it cannot price (a DySpec or other tree method) gets the
    precisions ``auto`` would pick for the draft-model methods it can price."""
    tps = default_precisions(device) if precision == AUTO else (precision,)
    dps = default_precisions(device) if draft_precision == AUTO else (draft_precision,)
    if method == AUTO:
        methods: tuple[str, ...] = tuple(AUTO_METHODS)
    elif method in AUTO_METHODS:
        methods = tuple(dict.fromkeys(("autoregressive", method)))
    else:
        methods = ("autoregressive", *MODEL_TREE_METHODS)
    return tps, dps, methods


def calibration_prompts(tokenizer, n_per_dataset: int = 2, max_tokens: int = 96) -> list[list[int]]:
    """Prompts from the ``calib`` slices of wiki and code (disjoint from every evaluation)."""
    from ..prompts import load_prompts

    return [list(tokenizer(p.text, add_special_tokens=False)["input_ids"])[:max_tokens]
            for ds in ("wiki", "code") for p in load_prompts(ds, n_per_dataset, split="calib")]


def pair_name(cache: PairCache) -> str:
    """The name a pair's profile and acceptance are cached under."""
    return f"{cache.draft_spec},{cache.target_spec}"


def profile_for(cache: PairCache, target_precisions: Sequence[str], draft_precisions: Sequence[str],
                target_ns: Sequence[int] = (), refresh: bool = False,
                progress: Optional[Progress] = None, measure: bool = True, turn: Turn = nullcontext) -> MachineProfile:
    """The one machine profile of ``cache``'s pair (``machine_profile.load_or_measure_profile``): the
    default sizes for both models, ``target_ns`` too for the target; only what the cache lacks is
    measured."""
    from .machine_profile import load_or_measure_profile

    return load_or_measure_profile(cache.timing_model, pair_name(cache), cache.device, tuple(target_precisions),
                                   refresh=refresh, progress=progress, draft_precisions=tuple(draft_precisions),
                                   target_ns=tuple(target_ns), measure=measure, turn=turn)


def plan_auto(cache: PairCache, temperature: float, *, target_precisions: Optional[Sequence[str]] = None,
              draft_precisions: Optional[Sequence[str]] = None, methods: Sequence[str] = AUTO_METHODS,
              refresh: bool = False, progress: Optional[Progress] = None,
              target_ns: Sequence[int] = (), measure: bool = True, turn: Turn = nullcontext) -> AutoPlan:
    """Profile (cached), measure acceptance (cached), choose. Loads models through ``cache``.
    ``target_ns``: target sizes the profile must also cover (a calibration that follows prices
    bigger trees than ``auto`` does: ``tuning.CALIBRATION_NS``). ``measure=False``: only from the
    caches, raising ``NotMeasuredYet`` when something is missing (nothing is loaded then); ``turn``:
    the context each timed measurement runs in (``machine_profile.measure_into``)."""
    say = progress or (lambda _m: None)
    tps = tuple(target_precisions or default_precisions(cache.device))
    dps = tuple(draft_precisions or tps)
    name = pair_name(cache)
    say("machine profile (measured once per machine, pair and torch version, then cached):")
    prof = profile_for(cache, tps, dps, target_ns, refresh=refresh, progress=say, measure=measure, turn=turn)
    fast_t = min(tps, key=lambda p: prof.target_time(p, 1))
    fast_d = min(dps, key=lambda p: prof.draft_time(p, 1))
    if methods == ("autoregressive",):
        acc = Acceptance((0.0,))
    else:
        say(f"acceptance of this pair at T={temperature:g} (target {fast_t}, draft {fast_d}; cached):")
        if not measure:
            acc = cached_acceptance(name, fast_d, fast_t, temperature, calibration_prompts(cache.text_tokenizer()))
            if acc is None:
                raise NotMeasuredYet(f"the acceptance of {name} at T={temperature:g} is not measured yet")
        else:
            with turn():
                pair = cache.pair(fast_t, fast_d)
            acc = load_or_measure_acceptance(pair, name, calibration_prompts(pair.tokenizer), temperature,
                                             refresh=refresh, progress=say, turn=turn)
    plan = choose(prof, acc, temperature, tps, dps, methods)
    say(plan.reason)
    return plan
