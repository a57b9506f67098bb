"""What this project's engine measured on a GPU, read from the committed results, and the current
run's tree priced with those numbers.

The numbers come from ``python -m dyntree_core.bench gpu`` (and two probes run beside it) on one
NVIDIA H200, committed under ``bench/results/gpu-h200/`` with a README naming the machine and the
commit; the caller names that directory (``GpuResults.load(root)``: the app reads the repository's).
Nothing here is assumed: a GPU row the files do not contain is not shown. The pricing follows
the one step-cost formula and interpolation policy of ``pricing``: a step time measured at a tree
size is used at the sizes between measured ones, the smallest measured size stands for smaller trees
(an upper bound), and a tree larger than any measured one has no price.

* ``offload``: a Llama-2-70B-shaped target (80 layers, bf16, 136.9 GB) streamed from pinned host
  memory for every forward: seconds per forward at 1-768 tokens (``offload.json``).
* ``offload_steps``: whole speculative steps with that offloaded target and a 0.5B-shaped draft on
  the GPU (DySpec greedy, budgets 64-768; ``bench_gpu_decode_step_alone.json``).
* ``resident``: steps with both models in GPU memory (0.5B-shaped draft; 1.5B- and 7B-shaped targets;
  plain decoding, chain and DySpec greedy at budgets 16/64/256; ``bench_gpu_resident.json`` from the
  project's own ``bench gpu`` where present — graph and eager steps, with transformers and the floor as
  peers, and its ``decode_step`` rows for ``offload_steps`` — else the older ``resident_step_probe.json``).
  Random weights accept almost nothing, so every measured step committed ~1 token: the step times are
  the measurement, and a run's own tokens/step turn them into seconds per token.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from ..step_price import interpolate
from .pricing import seconds_per_token


@dataclass(frozen=True)
class OffloadCost:
    """Measured seconds per offloaded target forward as a function of the tree size n.

    Attributes:
        tokens / seconds: ``[k]`` measured sizes (increasing) and the fastest seconds at each.
        gbps: the effective host-to-device bandwidth of those forwards (bytes / seconds), if recorded.
        source: the file and device they came from.
    """

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]
    source: str
    gbps: Optional[float] = None

    def at(self, n: float) -> float:
        return interpolate(self.tokens, self.seconds, n)

    @classmethod
    def from_bench_json(cls, path: Path, engine: str = "ours") -> "OffloadCost":
        """Per-n seconds of ``engine`` from a ``bench offload`` JSON (the fastest configuration per n)."""
        data = json.loads(Path(path).read_text())
        rows = [r for r in data.get("runs", []) if str(r.get("engine", "")).startswith(engine) and r.get("seconds")]
        if not rows:
            raise ValueError(f"{path}: no '{engine}' results")
        best: dict[int, dict] = {}
        for r in rows:
            n = int(r["tokens"])
            if n not in best or float(r["seconds"]) < float(best[n]["seconds"]):
                best[n] = r
        ns = tuple(sorted(best))
        rates = [float(best[n]["effective_gbps"]) for n in ns if best[n].get("effective_gbps")]
        device = data.get("environment", {}).get("backend", "?")
        return cls(ns, tuple(float(best[n]["seconds"]) for n in ns), f"measured: {Path(path).name} ({device})",
                   min(rates) if rates else None)


@dataclass(frozen=True)
class MeasuredStep:
    """One measured decoding step configuration on the GPU (medians over its steps).

    Attributes:
        method / budget / tree_size: what ran (``tree_size`` 1 for plain decoding).
        attention: ``torch`` (SDPA) or ``triton`` (the tree kernel); order: the node order it ran in.
        step_s, draft_s, target_s: seconds per step, of its draft forwards, of its target forward.
        step: how the step ran: ``graph`` (fixed-shape programs as captured CUDA graphs: the CUDA
            default for the methods ``decode.graph_step`` takes), ``graph_inductor``, ``host``
            (the eager step), ``device_side``.
        temperature: the sampling temperature it ran at (the bench's T > 0 row is an A/B of verification).
    """

    method: str
    budget: int
    tree_size: int
    attention: str
    order: str
    step_s: float
    draft_s: float
    target_s: float
    step: str = "host"
    temperature: float = 0.0

    @property
    def other_s(self) -> float:
        return max(0.0, self.step_s - self.draft_s - self.target_s)


#: logical parameter count of each resident target shape
RESIDENT_PARAMS: dict[str, float] = {"1.5B": 1.54e9, "7B": 7.6e9}


@dataclass(frozen=True)
class GpuResults:
    """The committed measurements of one GPU machine (see the module docstring).

    Attributes:
        machine: the GPU and host as the files name them.
        date: when they were measured.
        offload: the offloaded 70B-shaped target's forward.
        offload_steps: whole steps with that target offloaded (DySpec greedy).
        resident: ``{target shape: steps}`` with both models in GPU memory (``"1.5B"``, ``"7B"``).
        resident_params: logical parameter count of each resident target shape.
        peers: other engines on the same GPU, ms per token (transformers ``generate``, ...).
        source: the directory.
    """

    machine: str
    date: str
    offload: Optional[OffloadCost]
    offload_steps: tuple[MeasuredStep, ...]
    resident: dict[str, tuple[MeasuredStep, ...]]
    resident_params: dict[str, float] = field(default_factory=dict)
    peers: dict[str, float] = field(default_factory=dict)
    source: str = ""

    @classmethod
    def load(cls, root: Path) -> Optional["GpuResults"]:
        """The results under ``root``, or None when the directory or its offload file is missing."""
        root = Path(root)
        try:
            offload = OffloadCost.from_bench_json(root / "offload.json")
            env = json.loads((root / "offload.json").read_text())["environment"]
        except (OSError, ValueError, KeyError):
            return None
        mi = env.get("machine_info", {})
        machine = f"{env.get('device_name', mi.get('gpu', 'GPU'))}, {mi.get('cpu_model', '?')} x{mi.get('logical_cpus', '?')}"
        steps: tuple[MeasuredStep, ...] = ()
        try:
            steps = _decode_steps(json.loads((root / "bench_gpu_decode_step_alone.json").read_text())["sections"])
        except (OSError, ValueError, KeyError):
            pass
        bench = _bench_resident(root / "bench_gpu_resident.json")  # the project's own bench: newer than the probes
        if bench is not None:
            date, offload_steps, resident_steps, peers = bench
            return cls(machine, date, offload, offload_steps or steps, resident_steps, RESIDENT_PARAMS, peers,
                       str(root))
        resident: dict[str, list[MeasuredStep]] = {}
        try:
            for r in json.loads((root / "resident_step_probe.json").read_text())["rows"]:
                size = 1 if r["method"] == "autoregressive" else int(r["budget"])
                resident.setdefault(r["target"], []).append(MeasuredStep(
                    r["method"], int(r["budget"]), size, r["attention"], r["order"], r["step_ms"] / 1e3,
                    r["draft_ms"] / 1e3, r["target_forward_ms"] / 1e3))
        except (OSError, ValueError, KeyError):
            pass
        peers: dict[str, float] = {}
        try:
            p = json.loads((root / "resident_hf_peer_probe.json").read_text())
            peers = {"transformers generate (7B shape)": p["hf_generate_ms_per_token"],
                     "ours, plain decoding, SDPA (7B shape)": p["ours_ar_torch_ms_per_token"],
                     "ours, plain decoding, tree kernel (7B shape)": p["ours_ar_triton_ms_per_token"],
                     "weight-streaming floor (7B shape)": p["floor_ms_per_token"]}
        except (OSError, ValueError, KeyError):
            pass
        return cls(machine, env.get("date_utc", ""), offload, steps, {k: tuple(v) for k, v in resident.items()},
                   RESIDENT_PARAMS, peers, str(root))

    def resident_shape_near(self, target_params: float) -> Optional[str]:
        """The measured resident target shape closest to ``target_params`` (log scale)."""
        shapes = [s for s in self.resident if s in self.resident_params]
        if not shapes or target_params <= 0:
            return None
        return min(shapes, key=lambda s: abs(math.log(self.resident_params[s] / target_params)))


def _bench_resident(path: Path) -> Optional[tuple[str, tuple[MeasuredStep, ...], dict[str, tuple[MeasuredStep, ...]],
                                                  dict[str, float]]]:
    """``bench gpu``'s ``gpu.json`` with a resident section: (date, offloaded steps, resident steps per
    target shape, peers in ms/token); None when the file is missing or has no resident rows."""
    try:
        res = json.loads(Path(path).read_text())
        sections = res["sections"]
        targets = sections["resident"]["result"]["targets"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    resident: dict[str, tuple[MeasuredStep, ...]] = {}
    peers: dict[str, float] = {}
    for t in targets:
        rows = []
        for r in t["rows"]:
            ar = r["method"] == "autoregressive"
            rows.append(MeasuredStep(r["method"], 1 if ar else int(r.get("budget", r["tree_size"])),
                                     1 if ar else int(r["tree_size"]), r["attention"], "dfs", r["step_ms"] / 1e3,
                                     r["phases_ms"].get("draft", 0.0) / 1e3, r["phases_ms"]["target_forward"] / 1e3,
                                     r["step"], float(r.get("temperature", 0.0))))
        resident[t["name"]] = tuple(rows)
        shape = f"{t['name']} shape"
        for key, label in (("hf_static_ms_per_token", f"transformers generate, static cache, compiled ({shape})"),
                           ("hf_generate_ms_per_token", f"transformers generate ({shape})"),
                           ("floor_ms_per_token", f"weight-streaming floor ({shape})")):
            if isinstance(t.get(key), (int, float)) and math.isfinite(t[key]):
                peers[label] = float(t[key])
    offload_steps = _decode_steps(sections) if sections.get("decode_step", {}).get("result") else ()
    return res.get("environment", {}).get("date_utc", ""), offload_steps, resident, peers


def _decode_steps(sections: dict) -> tuple[MeasuredStep, ...]:
    """The offloaded DySpec-greedy steps of a ``bench gpu`` JSON's ``decode_step`` section, as the CUDA
    default runs them (the draft on its programs; the eager drafter's row is the section's A/B; rows of
    runs before that A/B have no ``drafting`` and count)."""
    return tuple(MeasuredStep("dyspec_greedy", int(r["budget"]), int(r["tree_size"]), "torch", "dfs",
                              float(r["step_seconds"]), float(r["draft_seconds"]), float(r["target_forward_seconds"]))
                 for r in sections["decode_step"]["result"]["rows"] if r.get("drafting", "programs") == "programs")


def step_time_at(steps: Sequence[MeasuredStep], method: str, n: float, attention: Optional[str] = None,
                 order: Optional[str] = None, step: Optional[str] = None,
                 temperature: float = 0.0) -> tuple[float, Optional[MeasuredStep]]:
    """Seconds per step of ``method`` at tree size ``n`` from measured steps (``step_price.interpolate``
    over their tree sizes), and the measured step nearest to ``n``; ``(inf, None)`` without data.
    ``attention`` / ``order`` / ``step``: only rows that ran so (None: any); ``temperature``: only rows
    sampled at it (greedy by default)."""
    rows = sorted((s for s in steps if s.method == method and s.temperature == temperature
                   and (attention is None or s.attention == attention)
                   and (order is None or s.order == order) and (step is None or s.step == step)),
                  key=lambda s: s.tree_size)
    if not rows:
        return math.inf, None
    t = interpolate([s.tree_size for s in rows], [s.step_s for s in rows], n)
    return t, min(rows, key=lambda s: abs(s.tree_size - n))


@dataclass(frozen=True)
class GpuRow:
    """This run's tree (its tree size and tokens/step) priced with one kind of measured GPU step.

    ``tree_s_per_token`` is the measured step time at the run's tree size divided by the run's
    tokens/step; ``ar_s_per_token`` the measured plain-decoding step (or forward) on that machine.
    """

    setting: str
    ar_s_per_token: float
    tree_s_per_token: float
    inputs: dict[str, str]

    @property
    def speedup(self) -> float:
        return self.ar_s_per_token / self.tree_s_per_token if self.tree_s_per_token > 0 else math.nan


def gpu_rows(gpu: GpuResults, tree_size: float, tokens_per_step: float, target_params: float = 0.0) -> list[GpuRow]:
    """This run's tree on the measured GPU: the offloaded 70B-shaped target and, for the resident
    target shape nearest to ``target_params``, both models in GPU memory. Rows whose sizes were not
    measured (a tree larger than any measured one) are left out."""
    out: list[GpuRow] = []
    where = f"measured on {gpu.machine}, {gpu.date[:10]}"
    if gpu.offload is not None and gpu.offload_steps:
        step, near = step_time_at(gpu.offload_steps, "dyspec_greedy", tree_size)
        ar = gpu.offload.at(1)
        if math.isfinite(step) and math.isfinite(ar):
            rate = f" at {gpu.offload.gbps:.1f} GB/s" if gpu.offload.gbps else ""
            out.append(GpuRow(
                "70B-shaped target offloaded to host memory, 0.5B-shaped draft on the GPU", ar,
                seconds_per_token(step, 0.0, 0.0, tokens_per_step),
                {"machine": where,
                 "plain decoding": f"one offloaded target forward per token: {ar:.3f} s{rate} ({gpu.offload.source})",
                 "tree step": f"{step:.3f} s measured for DySpec greedy trees of {near.tree_size} nodes "
                              f"(draft {near.draft_s * 1e3:.0f} ms, target {near.target_s:.3f} s); "
                              f"this run's tree: {tree_size:.0f} nodes",
                 "tokens/step": f"{tokens_per_step:.2f}, this run's (a 70B target accepts differently)"}))
    shape = gpu.resident_shape_near(target_params)
    if shape is not None:
        steps = gpu.resident[shape]
        graph = any(s.step == "graph" for s in steps)  # the CUDA default where measured
        if graph:
            ar, ar_row = step_time_at(steps, "autoregressive", 1, step="graph")
            tree, near = step_time_at(steps, "dyspec_greedy", tree_size, attention="torch", step="graph")
            ar_how, tree_how = "captured CUDA graphs, SDPA", "captured CUDA graphs, SDPA"
        else:  # the eager step: the faster attention of plain decoding, the tree kernel for trees
            plain = [s for s in steps if s.method == "autoregressive"]
            fastest = min(plain, key=lambda s: s.step_s) if plain else None
            ar, ar_row = step_time_at(steps, "autoregressive", 1, attention=fastest.attention if fastest else None)
            tree, near = step_time_at(steps, "dyspec_greedy", tree_size, attention="triton", order="dfs")
            ar_how = "tree kernel" if fastest is not None and fastest.attention == "triton" else "SDPA"
            tree_how = "tree kernel, DFS"
        peers = {k: v for k, v in gpu.peers.items() if "shape)" not in k or f"({shape} shape)" in k}
        if math.isfinite(ar) and math.isfinite(tree):
            out.append(GpuRow(
                f"both models in GPU memory ({shape}-shaped target, bf16)", ar,
                seconds_per_token(tree, 0.0, 0.0, tokens_per_step),
                {"machine": where,
                 "plain decoding": f"{ar * 1e3:.1f} ms per step (this engine, {ar_how})",
                 "tree step": f"{tree * 1e3:.1f} ms for DySpec greedy at {tree_size:.0f} nodes ({tree_how}; "
                              f"nearest measured {near.tree_size}: draft {near.draft_s * 1e3:.0f} ms, "
                              f"target {near.target_s * 1e3:.0f} ms)",
                 "tokens/step": f"{tokens_per_step:.2f}, this run's",
                 **({"same GPU, other engines": "; ".join(f"{k} {v:.1f} ms/token" for k, v in peers.items())}
                    if peers else {})}))
    return out
