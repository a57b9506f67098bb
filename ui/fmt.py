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


def count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless n is 1 ("1 step", "64 tokens")."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
