"""Small number formatting helpers for hover texts and tooltips."""

from __future__ import annotations

import math


def prob(x: float) -> str:
    """A probability as text; NaN (not applicable) shows as an em dash."""
    x = float(x)
    if math.isnan(x):
        return "—"
    return f"{x:.3f}" if x >= 1e-3 else f"{x:.1e}"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"
