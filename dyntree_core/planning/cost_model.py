"""Why speculation wins or loses on a machine: a run's measured step cost against plain decoding,
the break-even tokens per step, and the same tree priced with what a GPU measured.

Everything here is a pure function of numbers: the measured per-step times of a run
(``StepTrace.step_seconds`` and its phases), a plain-decoding reference measured next to the run
(``ArReference``: the autoregressive baseline run, or the target's one-token forward timed on the
run's context by ``forward_timer.time_forward``), and the committed GPU measurements
(``projection.GpuResults``). Prices follow ``pricing``: mean step over mean tokens per step, steps
of each kind (a hybrid's model and suffix steps) averaged separately and weighted by how often they
happened, never a median step.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

from ..trace import StepTrace
from ..decode.plain_probes import plain_steps_inside, probe_steps, probed_s_per_token
from .forward_timer import ForwardTiming
from .pricing import break_even_tokens, other_seconds, seconds_per_token

#: named phases besides the draft and the target forward (``offload_transfer`` is part of the
#: target forward's time, the wait for weights inside it, so it is not added again)
OTHER_PHASES = ("tree_build", "mask", "verify", "kv_compaction")


@dataclass(frozen=True)
class KindCost:
    """Mean per-step seconds of the tree steps drafted one way.

    Attributes:
        source: ``model`` (the draft model drafted), ``suffix`` (the suffix tree, no draft forward)
            or ``""`` (methods that do not record it).
        steps: how many steps of this kind.
        tree_size / depth: mean nodes per tree (the target forward's tokens) / mean tree depth.
        draft_s, target_s: mean seconds of the drafting and of the target's tree forward.
        phases_s: mean seconds of the other named phases (tree build, mask, verify, KV compaction).
        rest_s: mean seconds of the step outside every named phase (drafter update, commit, trace);
            ``other_s`` (= phases_s + rest_s) is the mean of ``pricing.other_seconds`` over the steps.
        tokens_per_step: mean tokens committed per step (accepted + bonus).
    """

    source: str
    steps: int
    tree_size: float
    depth: float
    draft_s: float
    target_s: float
    phases_s: float
    rest_s: float
    tokens_per_step: float

    @property
    def other_s(self) -> float:
        return self.phases_s + self.rest_s

    @property
    def step_s(self) -> float:
        return self.draft_s + self.target_s + self.other_s


def _kind(source: str, steps: Sequence[StepTrace]) -> KindCost:
    mean = statistics.fmean
    phases = [sum(getattr(t.timings, p) for p in OTHER_PHASES) for t in steps]
    others = [other_seconds(t.tree_size, t.method, step=t) for t in steps]  # the one "other" (pricing)
    return KindCost(
        source=source, steps=len(steps),
        tree_size=mean(t.tree_size for t in steps),
        depth=mean(int(t.tree.depth.max()) for t in steps),
        draft_s=mean(t.timings.draft for t in steps),
        target_s=mean(t.timings.target_forward for t in steps),
        phases_s=mean(phases),
        rest_s=mean(o - p for o, p in zip(others, phases)),  # so other_s is the mean of other_seconds
        tokens_per_step=mean(t.num_committed for t in steps),
    )


def _weighted(kinds: Sequence[KindCost]) -> KindCost:
    """The mean step over all steps: every kind weighted by how many steps it had."""
    n = sum(k.steps for k in kinds)

    def mean(attr: str) -> float:
        return sum(k.steps * getattr(k, attr) for k in kinds) / n

    return KindCost("all", n, *(mean(a) for a in ("tree_size", "depth", "draft_s", "target_s", "phases_s", "rest_s",
                                                   "tokens_per_step")))


@dataclass(frozen=True)
class StepCost:
    """A run's tree steps, per kind, and what the run measured.

    Attributes:
        kinds: ``KindCost`` of each kind of step that happened (model steps first).
        mean: all steps together (``_weighted``: each kind weighted by its number of steps).
        decode_s_per_token: measured wall clock from the first step's start to the last step's end,
            per token (the prefill excluded; pauses and waits between steps included).
        with_prefill_s_per_token: the run's whole wall time per token (prefill included).
    """

    kinds: tuple[KindCost, ...]
    mean: KindCost
    decode_s_per_token: float
    with_prefill_s_per_token: float

    def share(self, kind: KindCost) -> float:
        return kind.steps / self.mean.steps

    @property
    def step_model_s_per_token(self) -> float:
        """The step model's seconds per token (``pricing.seconds_per_token`` of the mean step)."""
        m = self.mean
        return seconds_per_token(m.target_s, m.draft_s, m.other_s, m.tokens_per_step)


def step_cost(traces: Sequence[StepTrace]) -> Optional[StepCost]:
    """``StepCost`` of the tree steps in ``traces`` (None when there is none)."""
    tree_steps = [t for t in traces if t.tree is not None]
    if not tree_steps:
        return None
    by_source: dict[str, list[StepTrace]] = {}
    for t in tree_steps:
        by_source.setdefault(t.draft_source, []).append(t)
    order = sorted(by_source, key=lambda s: (s != "model", s))
    first, last = traces[0], traces[-1]
    tokens = max(last.total_new_tokens, 1)
    decode_s = last.elapsed - (first.elapsed - first.step_seconds)
    kinds = tuple(_kind(s, by_source[s]) for s in order)
    return StepCost(kinds, _weighted(kinds), decode_s / tokens, last.elapsed / tokens)


@dataclass(frozen=True)
class ArReference:
    """Seconds per token of plain decoding with the same target, where and when it was measured.

    Attributes:
        seconds_per_token: the reference.
        source: how it was measured.
        timing: the one-token forward timing behind it (its time and the machine's load), if any.
        inside: the plain steps inside the run it is the median of (``decode.plain_probes.plain_steps_inside``: its
            probes and the plain steps after its fallback; 0: not from them).
    """

    seconds_per_token: float
    source: str
    timing: Optional[ForwardTiming] = None
    inside: int = 0


def ar_reference(baseline: Optional[Sequence[StepTrace]], timing: Optional[ForwardTiming],
                 untimed_forward_s: Optional[float] = None, inside: Sequence[StepTrace] = ()) -> Optional[ArReference]:
    """A measured autoregressive baseline run of the same settings if there is one (its mean step), else plain
    decoding timed inside the run (``inside``: its traces; the median of its plain probes and the plain steps after
    its fallback, ``decode.plain_probes``), else the target's one-token forward timed next to the run on its context
    (``timing``), else a one-token forward whose time and load were not recorded (``untimed_forward_s``: a run
    reloaded from a file), else None."""
    if baseline:
        steps = [t.step_seconds for t in baseline if t.step_seconds > 0]
        if steps:
            return ArReference(statistics.fmean(steps), f"measured: the autoregressive baseline run of the same "
                                                        f"settings (mean of {len(steps)} steps)", timing)
    probed = probed_s_per_token(inside)
    if probed is not None:
        n, probes = len(plain_steps_inside(inside)), len(probe_steps(inside))
        kinds = (f"{probes} probe{'s' if probes > 1 else ''}" if probes else "",
                 f"{n - probes} after its fallback" if n > probes else "")
        return ArReference(probed, f"measured: the median of {n} plain step{'s' if n > 1 else ''} inside this run "
                                   f"({', '.join(k for k in kinds if k)}), under its load", inside=n)
    if timing is not None and timing.mean_seconds > 0:
        # the mean, not the fastest: the run's steps are means under whatever load there was too
        return ArReference(timing.mean_seconds, f"measured: the target's one-token forward after "
                                                f"{timing.prefix_len} cached tokens (mean of {timing.samples})", timing)
    if untimed_forward_s is not None and untimed_forward_s > 0:
        return ArReference(untimed_forward_s, "measured: the target's one-token forward (when and under what load "
                                              "was not recorded with this run)")
    return None


@dataclass(frozen=True)
class Verdict:
    """The tree's step against plain decoding on the machine that ran it."""

    cost: StepCost
    ar: ArReference

    @property
    def break_even_tokens_per_step(self) -> float:
        """Tokens per step the tree must deliver to match AR: one mean step's cost in AR tokens."""
        return break_even_tokens(self.cost.mean.step_s, self.ar.seconds_per_token)

    @property
    def speedup(self) -> float:
        return self.ar.seconds_per_token / self.cost.step_model_s_per_token

    @property
    def wins(self) -> bool:
        return self.cost.mean.tokens_per_step >= self.break_even_tokens_per_step


def logical_params(model) -> int:
    """Parameter count as the unquantised model has it (low-bit layers count ``in x out``)."""
    from ..quant.ggml_linear import GGMLLinear
    from ..quant.linear import Int4Linear, Int8Linear

    total, seen = 0, set()
    for mod in model.modules():
        if isinstance(mod, (Int4Linear, Int8Linear, GGMLLinear)):
            total += mod.in_features * mod.out_features
            seen.update(id(p) for p in mod.parameters(recurse=False))
            seen.update(id(b) for b in mod.buffers(recurse=False))
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total
