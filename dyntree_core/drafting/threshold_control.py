"""DySpec threshold control: retune the value threshold online so the tree size tracks a budget."""

from __future__ import annotations

import math
from typing import Optional


class ThresholdController:
    """Adapts DySpec's threshold online so the threshold-built tree tracks a target size.

    The tree size falls monotonically as the threshold rises, so a multiplicative (log-space)
    integral controller converges: ``log t += gain * log(observed / target)``. DySpec's own
    fixed threshold left its 768 budget under-used (551.8 nodes on average at T=0.6).

    When the drafter's hard cap binds (``observed >= cap``) the tree would have been larger than
    the cap, so the step counts as ``cap_overshoot`` times the cap: the threshold then creeps up until the cap just binds
    instead of drafting far more candidates per layer than the cap keeps.
    """

    def __init__(self, target_size: int, threshold: float, gain: float = 0.5,
                 lo: float = 1e-7, hi: float = 0.95, max_step: float = 2.0, cap: Optional[int] = None,
                 cap_overshoot: float = 1.5):
        if target_size < 2:
            raise ValueError("target_size counts the root and must be >= 2")
        if not 0 < threshold < 1:
            raise ValueError("threshold must be in (0, 1)")
        self.target_size = target_size
        self.threshold = threshold
        self.gain = gain
        self.lo, self.hi = lo, hi
        self.max_step = max_step
        self.cap = cap
        self.cap_overshoot = cap_overshoot
        self.history: list[tuple[int, float]] = []

    def update(self, observed_size: int) -> float:
        """Record one step's tree size and return the threshold for the next step."""
        self.history.append((observed_size, self.threshold))
        size = float(observed_size)
        if self.cap is not None and observed_size >= self.cap:
            size = self.cap * self.cap_overshoot
        ratio = max(size, 1.0) / self.target_size
        step = max(-self.max_step, min(self.max_step, self.gain * math.log(ratio)))
        self.threshold = min(self.hi, max(self.lo, self.threshold * math.exp(step)))
        return self.threshold
