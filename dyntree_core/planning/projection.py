"""Projected tokens/s of a CPU-offloaded 70B-class target.

This is a *projection*, not a measurement: it combines measured acceptance (tokens per step
of each method at a tree size) with a per-step cost of the offloaded target forward (measured
by ``python -m dyntree_core.bench offload`` where a GPU was available, else the physical floor
``bytes / H2D bandwidth``) and a draft cost per step. Every input is returned with the result so
the UI and the bench can show them next to the number.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

LLAMA2_70B_BF16_BYTES = 137.95e9  # decoder + embeddings + lm_head, bf16 (notes/kernels.md §3.1)


@dataclass(frozen=True)
class OffloadCost:
    """Seconds per offloaded target forward as a function of the tree size n.

    ``source`` says where the numbers come from (a bench JSON with its device, or the floor).
    """

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]
    source: str

    def at(self, n: int) -> float:
        pts = sorted(zip(self.tokens, self.seconds))
        if n <= pts[0][0]:
            return pts[0][1]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if n <= x1:
                return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
        return pts[-1][1]

    @classmethod
    def floor(cls, bandwidth_gb_s: float, model_bytes: float = LLAMA2_70B_BF16_BYTES) -> "OffloadCost":
        """Transfer-bound floor: every forward streams all weights once, whatever n (n << 16k)."""
        if bandwidth_gb_s <= 0:
            raise ValueError("bandwidth must be positive")
        s = model_bytes / (bandwidth_gb_s * 1e9)
        return cls((1, 1024), (s, s), f"floor: {model_bytes / 1e9:.2f} GB / {bandwidth_gb_s:g} GB/s")

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


@dataclass(frozen=True)
class Projection:
    method: str
    tree_size: int
    tokens_per_step: float
    target_seconds: float
    draft_seconds: float
    cost_source: str

    @property
    def seconds_per_token(self) -> float:
        from .hardware import seconds_per_token

        return seconds_per_token(self.target_seconds, self.draft_seconds, self.tokens_per_step)

    @property
    def tokens_per_second(self) -> float:
        return 1.0 / self.seconds_per_token

    def as_dict(self) -> dict:
        return asdict(self) | {"seconds_per_token": self.seconds_per_token,
                               "tokens_per_second": self.tokens_per_second, "kind": "projection"}


def project(method: str, tree_size: int, tokens_per_step: float, cost: OffloadCost,
            draft_seconds: float = 0.0) -> Projection:
    """Projected decoding speed of ``method`` with an offloaded target.

    Args:
        tokens_per_step: measured mean tokens per step (accepted + bonus) at ``tree_size``.
        cost: offloaded target forward cost.
        draft_seconds: draft cost per step (the draft runs on the GPU).
    """
    if tokens_per_step <= 0:
        raise ValueError("tokens_per_step must be positive")
    return Projection(method, tree_size, tokens_per_step, cost.at(tree_size), draft_seconds, cost.source)


def speedup_table(measured: dict[str, tuple[int, float]], cost: OffloadCost,
                  draft_seconds: Optional[dict[str, float]] = None) -> list[dict]:
    """Projections for several methods plus the autoregressive baseline (1 token per step)."""
    draft_seconds = draft_seconds or {}
    base = project("autoregressive", 1, 1.0, cost)
    rows = [base.as_dict() | {"speedup": 1.0}]
    for m, (n, tps) in measured.items():
        p = project(m, n, tps, cost, draft_seconds.get(m, 0.0))
        rows.append(p.as_dict() | {"speedup": base.seconds_per_token / p.seconds_per_token})
    return rows
