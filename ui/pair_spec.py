"""``PairSpec``: which draft/target pair to load, on which device and at which precisions (what the
form asks for, and what a model provider loads)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PairSpec:
    """Which pair to load and where."""

    draft: str
    target: str
    device: str = "cpu"
    dtype: str = "float32"
    offload: bool = False
    precision: str = "auto"  # target: a concrete precision once resolved
    draft_precision: str = "auto"
