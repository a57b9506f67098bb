"""What a calibration found: ``TuningPoint`` (one calibrated or modelled configuration) and
``TuningResult`` (the chosen one and every point evaluated), with their JSON form."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field

from ..config import DecodeConfig, default_threshold
from ..methods import method_spec
from .pricing import seconds_per_token


@dataclass(frozen=True)
class TuningPoint:
    """One calibrated (or, for Sequoia, modelled) configuration.

    Attributes:
        budget, depth, width: the configuration (``DecodeConfig`` fields).
        tokens_per_step: mean committed tokens per step (accepted + bonus).
        mean_tree_size: mean drafted tree size (root included).
        target_seconds: mean profiled target forward per step, ``t(tree size)``.
        overhead_seconds: mean measured (Sequoia: profiled) seconds per step outside the target
            forward: draft forwards, tree construction, verification, KV compaction.
        measured_seconds_per_token: wall seconds per token of the calibration decodes (NaN for
            modelled points).
        per_prompt_seconds_per_token: predicted seconds per token of each calibration prompt, in
            prompt order (the same prompts and seeds for every point, so two points can be
            compared prompt by prompt); empty for modelled points.
    """

    budget: int
    depth: int
    width: int
    tokens_per_step: float
    mean_tree_size: float
    target_seconds: float
    overhead_seconds: float
    measured_seconds_per_token: float = float("nan")
    per_prompt_seconds_per_token: tuple[float, ...] = ()

    @property
    def predicted_seconds_per_token(self) -> float:
        return seconds_per_token(self.target_seconds, 0.0, self.overhead_seconds, self.tokens_per_step)


@dataclass(frozen=True)
class TuningResult:
    """The chosen configuration and every point that was evaluated to choose it."""

    method: str
    temperature: float
    profile_key: str
    strategy: str
    best: TuningPoint
    points: tuple[TuningPoint, ...]
    calib_prompts: int = 0
    calib_tokens: int = 0
    seconds: float = 0.0
    created: str = ""
    meta: dict = field(default_factory=dict)

    def apply(self, cfg: DecodeConfig) -> DecodeConfig:
        """``cfg`` with the tuned budget / depth / width (and the threshold controller for the methods
        the registry marks ``threshold_controlled``)."""
        if cfg.method != self.method:
            raise ValueError(f"tuned for {self.method!r}, not {cfg.method!r}")
        extra = {}
        if method_spec(cfg.method).threshold_controlled:
            extra = {"adaptive_threshold": True, "threshold": default_threshold(self.best.budget)}
        return dataclasses.replace(cfg, budget=self.best.budget, depth=self.best.depth, width=self.best.width, **extra)

    def to_json(self) -> str:
        d = asdict(self)
        d["best"]["predicted_seconds_per_token"] = self.best.predicted_seconds_per_token
        return json.dumps(d, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "TuningResult":
        d = json.loads(text)
        d["best"].pop("predicted_seconds_per_token", None)
        d["best"] = _point_from_dict(d["best"])
        d["points"] = tuple(_point_from_dict(p) for p in d["points"])
        return cls(**d)


def _point_from_dict(d: dict) -> TuningPoint:
    d = dict(d)
    d["per_prompt_seconds_per_token"] = tuple(d.get("per_prompt_seconds_per_token", ()))
    return TuningPoint(**d)
