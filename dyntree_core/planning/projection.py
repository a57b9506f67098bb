"""Projected tokens/s of a CPU-offloaded 70B-class target.

This is a *projection*, not a measurement: it combines measured acceptance (tokens per step
of each method at a tree size) with a per-step cost of the offloaded target forward (measured
by ``python -m dyntree_core.bench offload`` where a GPU was available, else the physical floor
``bytes / H2D bandwidth``) and a draft cost per step. Every input is returned with the result so
the UI and the bench can show them next to the number.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .pricing import interpolate

LLAMA2_70B_BF16_BYTES = 137.95e9  # decoder + embeddings + lm_head, bf16 (notes/kernels.md §3.1)


@dataclass(frozen=True)
class OffloadCost:
    """Seconds per offloaded target forward as a function of the tree size n.

    ``source`` says where the numbers come from (a bench JSON with its device, or the floor).
    """

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]
    source: str

    def at(self, n: float) -> float:
        """``pricing.interpolate`` over the measured sizes (no price above the largest)."""
        pts = sorted(zip(self.tokens, self.seconds))
        return interpolate([p[0] for p in pts], [p[1] for p in pts], n)

    @classmethod
    def floor(cls, bandwidth_gb_s: float, model_bytes: float = LLAMA2_70B_BF16_BYTES) -> "OffloadCost":
        """Transfer-bound floor: every forward streams all weights once, whatever n (n << 16k)."""
        if bandwidth_gb_s <= 0:
            raise ValueError("bandwidth must be positive")
        s = model_bytes / (bandwidth_gb_s * 1e9)
        return cls((1, 16384), (s, s), f"floor: {model_bytes / 1e9:.2f} GB / {bandwidth_gb_s:g} GB/s")

    @classmethod
    def from_bench_json(cls, path: Path, engine: str = "ours") -> "OffloadCost":
        """Read per-n seconds of our engine from an offload bench JSON."""
        data = json.loads(Path(path).read_text())
        rows = [r for r in data.get("runs", []) if str(r.get("engine", "")).startswith(engine) and r.get("seconds")]
        if not rows:
            raise ValueError(f"{path}: no '{engine}' results")
        best: dict[int, float] = {}
        for r in rows:
            n = int(r["tokens"])
            best[n] = min(best.get(n, float("inf")), float(r["seconds"]))
        ns = tuple(sorted(best))
        device = data.get("environment", {}).get("backend", "?")
        return cls(ns, tuple(best[n] for n in ns), f"measured: {Path(path).name} ({device})")
