"""What ``auto`` runs before it has measured this machine (``ProvisionalPlan``): plain decoding at the
precision whose weights are the fewest bytes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from .machine_profile import AcceptanceNotMeasured, NotMeasuredYet
from .search_space import AUTO


@dataclass(frozen=True)
class ProvisionalPlan:
    """What ``auto`` runs before it has measured this machine: plain decoding at the precision whose
    weights are the fewest bytes (decoding one token streams every weight once, so the smallest
    weights are the metadata's best guess; on a GPU the candidates are floats only)."""

    precision: str
    draft_precision: str
    reason: str

    def resolve(self, method: str, precision: str, draft_precision: str) -> dict:
        """As ``AutoPlan.resolve``: ``auto`` fields become plain decoding at the smallest weights."""
        kw: dict = {}
        if method == AUTO:
            kw.update(method="autoregressive", verifier="auto")
        if precision == AUTO:
            kw["precision"] = self.precision
        if draft_precision == AUTO:
            kw["draft_precision"] = self.draft_precision
        return kw


#: bytes per weight of each precision (what one decoded token streams)
WEIGHT_BYTES = {"int4": 0.5, "int8": 1.0, "float16": 2.0, "bfloat16": 2.0, "float32": 4.0}


def provisional_plan(target_precisions: Sequence[str], draft_precisions: Sequence[str], why: str,
                     missing: Optional[NotMeasuredYet] = None) -> ProvisionalPlan:
    """``ProvisionalPlan`` among the candidate precisions; ``why`` ends its reason. Where the profile is measured
    and only the pair's acceptance at this temperature is missing (``missing``: ``AcceptanceNotMeasured``), plain
    decoding at the fastest precisions it measured."""
    if isinstance(missing, AcceptanceNotMeasured):
        tp, dp = missing.target_precision, missing.draft_precision
        return ProvisionalPlan(tp, dp, f"auto: plain decoding at {tp} (the fastest this machine's profile measured) "
                                       f"until the pair's acceptance at T={missing.temperature:g} is measured: {why}")
    tp = min(target_precisions, key=WEIGHT_BYTES.__getitem__)
    dp = min(draft_precisions, key=WEIGHT_BYTES.__getitem__)
    return ProvisionalPlan(tp, dp, f"auto: plain decoding at {tp} (the fewest weight bytes) until this machine "
                                   f"is measured: {why}")
