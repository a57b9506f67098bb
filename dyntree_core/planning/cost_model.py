"""Why speculation wins or loses on a machine: a run's measured step cost against autoregressive
decoding, the break-even tokens per step, and the same tree priced on other hardware.

Everything here is a pure function of numbers: the measured per-step phase times of a run
(``StepTrace.timings``), an autoregressive reference (measured), and for other hardware the
stated assumptions below (``Assumption``), returned with every projection so a page can show its
inputs. Projections are labelled as such; nothing here is a measurement of that hardware.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from .pricing import seconds_per_token
from .projection import LLAMA2_70B_BF16_BYTES, OffloadCost
from ..trace import StepTrace

OVERHEAD_PHASES = ("tree_build", "mask", "verify", "kv_compaction", "offload_transfer")


@dataclass(frozen=True)
class StepCost:
    """Median per-step seconds of a run's tree steps, and its mean tokens per step.

    Attributes:
        steps: tree steps measured.
        tree_size: median nodes per tree (the target forward's tokens).
        depth: median tree depth (≈ the number of draft forwards per step).
        draft_s, target_s, overhead_s: median seconds of the draft forwards, the target's tree
            forward, and everything else (tree build, mask, verify, KV compaction, transfers).
        tokens_per_step: mean tokens committed per step (accepted + bonus).
        measured_s_per_token: the run's own wall time per token (prefill included).
    """

    steps: int
    tree_size: float
    depth: float
    draft_s: float
    target_s: float
    overhead_s: float
    tokens_per_step: float
    measured_s_per_token: float

    @property
    def total_s(self) -> float:
        return self.draft_s + self.target_s + self.overhead_s

    @property
    def predicted_s_per_token(self) -> float:
        """Median step cost / mean tokens per step (what the step model predicts)."""
        return seconds_per_token(self.target_s, self.draft_s, self.overhead_s, self.tokens_per_step)


def step_cost(traces: Sequence[StepTrace]) -> Optional[StepCost]:
    """``StepCost`` of the tree steps in ``traces`` (None when there is none)."""
    tree_steps = [t for t in traces if t.tree is not None]
    if not tree_steps:
        return None
    med = statistics.median
    last = traces[-1]
    return StepCost(
        steps=len(tree_steps),
        tree_size=med(t.tree_size for t in tree_steps),
        depth=med(int(t.tree.depth.max()) for t in tree_steps),
        draft_s=med(t.timings.draft for t in tree_steps),
        target_s=med(t.timings.target_forward for t in tree_steps),
        overhead_s=med(sum(getattr(t.timings, p) for p in OVERHEAD_PHASES) for t in tree_steps),
        tokens_per_step=statistics.fmean(t.num_committed for t in tree_steps),
        measured_s_per_token=last.elapsed / max(last.total_new_tokens, 1),
    )


@dataclass(frozen=True)
class ArReference:
    """Seconds per token of autoregressive decoding with the same target, and where it came from."""

    seconds_per_token: float
    source: str


def ar_reference(baseline: Optional[Sequence[StepTrace]], one_token_forward_s: Optional[float]) -> Optional[ArReference]:
    """A measured AR baseline run (same settings) if there is one, else the target's measured
    one-token forward time (what an AR step costs apart from sampling), else None."""
    if baseline:
        steps = [t.step_seconds for t in baseline if t.step_seconds > 0]
        if steps:
            return ArReference(statistics.median(steps), f"measured: the autoregressive baseline run (median of "
                                                         f"{len(steps)} steps)")
    if one_token_forward_s is not None and one_token_forward_s > 0:
        return ArReference(one_token_forward_s, "measured: the target's one-token forward (median of 3)")
    return None


@dataclass(frozen=True)
class Verdict:
    """The tree's step against autoregressive decoding on the machine that ran it."""

    cost: StepCost
    ar: ArReference

    @property
    def break_even_tokens_per_step(self) -> float:
        """Tokens per step the tree must deliver to match AR: one step's cost in AR tokens."""
        return self.cost.total_s / self.ar.seconds_per_token

    @property
    def predicted_speedup(self) -> float:
        return self.ar.seconds_per_token / self.cost.predicted_s_per_token

    @property
    def wins(self) -> bool:
        return self.cost.tokens_per_step >= self.break_even_tokens_per_step


@dataclass(frozen=True)
class Assumption:
    name: str
    value: float
    unit: str
    why: str


#: H100 SXM (bf16, both models in HBM): bandwidth-bound forwards plus a fixed per-forward cost.
H100_ASSUMPTIONS = (
    Assumption("HBM bandwidth reached", 2.4e12, "B/s", "~70% of the H100 SXM's 3.35 TB/s for weight streaming"),
    Assumption("bf16 tensor throughput reached", 4.0e14, "FLOP/s", "~40% of 989 dense TFLOP/s at 16-1024 tokens"),
    Assumption("fixed cost per forward", 4e-3, "s", "eager PyTorch launches of a ~24-28 layer model, no CUDA graphs"),
    Assumption("overhead per step", 2e-3, "s", "tree build, verify and KV compaction on the GPU"),
)
#: a Llama-2-70B-class target streamed from host memory each forward; the draft stays on the GPU
OFFLOAD_ASSUMPTIONS = (
    Assumption("target weights streamed per forward", LLAMA2_70B_BF16_BYTES, "B", "Llama-2-70B bf16 (notes/kernels.md)"),
    Assumption("PCIe 4.0 x16 host-to-device", 25e9, "B/s", "~80% of 32 GB/s, pinned memory"),
    Assumption("PCIe 5.0 x16 host-to-device", 50e9, "B/s", "~80% of 64 GB/s, pinned memory"),
)


@dataclass(frozen=True)
class HardwareProjection:
    """The run's tree (its size, depth and measured tokens/step) priced on other hardware."""

    hardware: str
    tree_s_per_token: float
    ar_s_per_token: float
    inputs: dict[str, str] = field(default_factory=dict)
    source: str = "projection"

    @property
    def speedup(self) -> float:
        return self.ar_s_per_token / self.tree_s_per_token


def _gpu_forward_s(params: float, tokens: float, assume: dict[str, float]) -> float:
    bytes_ = 2.0 * params  # bf16
    return (max(bytes_ / assume["HBM bandwidth reached"], 2.0 * params * tokens / assume["bf16 tensor throughput reached"])
            + assume["fixed cost per forward"])


def project_hardware(cost: StepCost, draft_params: float, target_params: float,
                     offload_bench: Optional[Path] = None) -> list[HardwareProjection]:
    """The run's tree on an H100 with both models in memory and with a 70B-class target offloaded
    over PCIe 4/5 (measured offload seconds from ``offload_bench`` when given, else the
    bytes/bandwidth floor). ``draft_params``/``target_params``: parameter counts of this run's pair."""
    a = {x.name: x.value for x in H100_ASSUMPTIONS}
    n, depth, tps = cost.tree_size, max(cost.depth, 1.0), cost.tokens_per_step
    width = n / depth  # tokens per draft forward, on average
    draft_step = depth * _gpu_forward_s(draft_params, width, a)
    out = []
    t_tree = _gpu_forward_s(target_params, n, a)
    t_ar = _gpu_forward_s(target_params, 1, a)
    out.append(HardwareProjection(
        "H100, both models in HBM (bf16)", seconds_per_token(t_tree, draft_step, a["overhead per step"], tps), t_ar,
        {"draft forwards/step": f"{depth:.0f} × {width:.0f} tokens", "target forward": f"{t_tree * 1e3:.1f} ms for {n:.0f} tokens",
         "AR step": f"{t_ar * 1e3:.1f} ms", **{x.name: f"{_fmt(x)} ({x.why})" for x in H100_ASSUMPTIONS}}))
    offload = {x.name: x.value for x in OFFLOAD_ASSUMPTIONS}
    for link in ("PCIe 4.0 x16 host-to-device", "PCIe 5.0 x16 host-to-device"):
        c = OffloadCost.floor(offload[link] / 1e9)
        if offload_bench is not None and link.startswith("PCIe 4"):
            try:
                c = OffloadCost.from_bench_json(offload_bench)
            except (OSError, ValueError, KeyError):
                pass
        t_tree70, t_ar70 = c.at(int(n)), c.at(1)
        out.append(HardwareProjection(
            f"70B target offloaded over {link.split(' host')[0]}",
            seconds_per_token(t_tree70, draft_step, a["overhead per step"], tps),
            t_ar70,
            {"target forward": f"{t_tree70:.2f} s ({c.source})", "draft on the GPU": f"{draft_step * 1e3:.1f} ms/step",
             "tokens/step": f"{tps:.2f} measured with this run's pair (a 70B target accepts differently)"}))
    return out


def logical_params(model) -> int:
    """Parameter count as the unquantised model has it (int4/int8 layers count ``in x out``)."""
    from ..quant.linear import Int4Linear, Int8Linear

    total, seen = 0, set()
    for mod in model.modules():
        if isinstance(mod, (Int4Linear, Int8Linear)):
            total += mod.in_features * mod.out_features
            seen.update(id(p) for p in mod.parameters(recurse=False))
            seen.update(id(b) for b in mod.buffers(recurse=False))
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def _fmt(a: Assumption) -> str:
    if a.unit == "B/s":
        return f"{a.value / 1e12:.2f} TB/s" if a.value >= 1e12 else f"{a.value / 1e9:.0f} GB/s"
    if a.unit == "FLOP/s":
        return f"{a.value / 1e12:.0f} TFLOP/s"
    if a.unit == "s":
        return f"{a.value * 1e3:.1f} ms"
    return f"{a.value / 1e9:.1f} GB" if a.unit == "B" else f"{a.value:g} {a.unit}"
