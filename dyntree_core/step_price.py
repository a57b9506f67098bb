"""A step's price from the machine profile's rows, in one leaf module that the engine (``decode``) and
``planning`` both use.

* ``interpolate`` / ``row_time``: the interpolation policy every price follows. Times are measured at a
  few sizes ``n`` (tokens per forward). Between two measured sizes the time is linear in ``n``; below the
  smallest measured size it is the smallest's time (a forward never gets cheaper with more tokens, so that
  is an upper bound); **above the largest measured size there is no price** (``math.inf``: never chosen).
  Extrapolating would price exactly the sizes where forwards stop being flat (the knee of t(n) on a GPU,
  compute-bound int4 rows on a CPU) from numbers that do not contain the knee, and clamping would make
  every larger tree look free.
* ``PricedRows``: the rows one configuration was priced from (its precisions), and
  ``PricedRows.step_seconds``: a recorded step priced at its own shape (its draft levels and their width,
  its tree size), as ``planning.prediction.check_prediction`` prices a run's steps.
* ``FallbackPrice``: those rows and the fastest plain decoding's seconds per token, the rule by which a
  draft-tree run stops drafting (``DecodeConfig.fallback``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:
    from .planning.machine_profile import MachineProfile
    from .trace import StepTrace


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """The time at ``x`` from times ``ys`` measured at sorted sizes ``xs`` (the module's policy).

    Args:
        xs: ``[k]`` measured sizes, increasing, ``k >= 1``.
        ys: ``[k]`` seconds at those sizes.
    Returns:
        linear between measured sizes, ``ys[0]`` below ``xs[0]``, ``math.inf`` above ``xs[-1]``.
    """
    if not xs or len(xs) != len(ys):
        raise ValueError("interpolate needs as many measured times as sizes, at least one")
    if x > xs[-1]:
        return math.inf
    if x <= xs[0]:
        return float(ys[0])
    for i in range(1, len(xs)):
        if x <= xs[i]:
            f = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return float(ys[i - 1] + f * (ys[i] - ys[i - 1]))
    return float(ys[-1])  # unreachable: x <= xs[-1]


def row_time(ns: Sequence[float], row: Optional[Sequence[Optional[float]]], n: float) -> float:
    """The time at ``n`` from a profile row: ``interpolate`` over the sizes ``ns`` whose entry in ``row`` is
    measured (``None`` entries skipped); ``math.inf`` for no row or no measured entry."""
    pts = [(x, y) for x, y in zip(ns, row or ()) if y is not None]
    return interpolate([x for x, _ in pts], [y for _, y in pts], n) if pts else math.inf


@dataclass(frozen=True)
class StepShape:
    """What a recorded step's price depends on: ``levels`` draft-model forwards of ``width`` rows each
    (0 levels for plain decoding and model-free suffix drafts) and a target forward of ``size`` tokens
    (the tree's nodes; 1 for plain decoding), which also sizes the rest of the step."""

    levels: int
    width: float
    size: int

    @classmethod
    def of(cls, step: "StepTrace") -> "StepShape":
        size = max(1, step.tree_size)
        if step.tree is None or step.draft_source in ("suffix", "repeats"):
            return cls(0, 1.0, size)
        levels = int(step.tree.depth.max())
        return cls(levels, max(1, size - 1) / max(levels, 1), size)


@dataclass(frozen=True)
class PricedRows:
    """The profile rows a prediction was priced from (its precisions only), to price the run's actual
    sizes after it.

    Attributes:
        ns: the profile's sizes (tokens per forward).
        target, draft: seconds per size of the target / draft at the prediction's precisions (None: not
            measured); draft empty for a run without a draft model.
        other: seconds per size of the engine's step outside the forwards.
    """

    ns: tuple[int, ...]
    target: tuple[Optional[float], ...]
    draft: tuple[Optional[float], ...]
    other: tuple[Optional[float], ...]

    @classmethod
    def of(cls, profile: "MachineProfile", target_precision: str, draft_precision: Optional[str]) -> "PricedRows":
        row = lambda table, p: tuple(table.get(p) or [None] * len(profile.ns)) if p else ()  # noqa: E731
        return cls(tuple(profile.ns), row(profile.target, target_precision), row(profile.draft, draft_precision),
                   tuple(profile.other))

    def time(self, row: tuple[Optional[float], ...], n: float) -> float:
        """``row_time`` of one of these rows (inf where none is measured)."""
        return row_time(self.ns, row, n)

    def step_seconds(self, shape: StepShape) -> float:
        """A step of ``shape`` at these rows: its draft forwards, its target forward and the rest."""
        draft = shape.levels * self.time(self.draft, shape.width) if shape.levels else 0.0
        return draft + self.time(self.target, shape.size) + self.time(self.other, shape.size)


#: tree steps a run decodes before ``DecodeConfig.fallback`` holds its steps to the plain price (then after every step)
FALLBACK_AFTER = 8
#: before that, from this step on, a run whose steps cost more than EARLY_MARGIN x the plain price per token falls
#: back already (Zen 4, 30 prompts, auto's chain: news 1.12 -> 1.05 x plain decoding, wiki 1.08 -> 1.06, no code
#: prompt fell back; at 1.1x one code prompt did). 1.25 ended the app's default prompt after its first 3 steps
#: (1 + 8 + 4 tokens under a 12-deep chain: 1.33x) and that run took 1.08x plain decoding against 0.81x without;
#: at 1.5x, 91 prompt runs (raw and chat-templated) differ from 1.25x by 1.4% at most elsewhere
#: (docs/CPU_KERNELS.md, "An earlier fallback", "The early margin on the app's prompts")
EARLY_CHECK_FROM = 3
EARLY_MARGIN = 1.5


@dataclass(frozen=True)
class FallbackPrice:
    """When a draft-tree run stops drafting: once its tree steps, each priced at ``rows`` at its own shape,
    cost more per committed token than ``plain_s_per_token`` (the fastest plain decoding the same profile
    measured), the rest of the run decodes plainly (``DecodeConfig.fallback``). Priced, not timed: the
    decision compares like with like whatever else the machine runs meanwhile, and a text that grows
    longer chains pays for their extra draft forwards in the comparison."""

    rows: PricedRows
    plain_s_per_token: float
    #: the first tree step after which the run may fall back; before ``FALLBACK_AFTER`` only where its steps cost
    #: more than ``early_margin`` x the plain price per token (few steps: a noisy average)
    check_from: int = EARLY_CHECK_FROM
    early_margin: float = EARLY_MARGIN
    #: the plan's price per token of the run's own tree steps (None: not priced). Where set, a step whose text
    #: repeats itself verifies a tree of those repeats instead of drafting, where that tree is priced to beat it
    #: (``drafting.repeats.RepeatDrafter``, ``REPEAT_EDGE``)
    tree_s_per_token: Optional[float] = None

    @classmethod
    def from_dict(cls, d: dict) -> "FallbackPrice":
        r = d["rows"]
        early = {k: d[k] for k in ("check_from", "early_margin", "tree_s_per_token") if k in d}
        return cls(PricedRows(*(tuple(r[k]) for k in ("ns", "target", "draft", "other"))),
                   float(d["plain_s_per_token"]), **early)

    def falls_back(self, tree_steps: int, s_per_token: float) -> bool:
        """Whether a run whose first ``tree_steps`` tree steps cost ``s_per_token`` each committed token (priced at
        ``rows``) decodes plainly from the next step on."""
        if tree_steps < self.check_from:
            return False
        margin = self.early_margin if tree_steps < FALLBACK_AFTER else 1.0
        return s_per_token > margin * self.plain_s_per_token

    def problem(self) -> str:
        """Why these numbers cannot decide anything ('' when they can)."""
        if not (isinstance(self.plain_s_per_token, (int, float)) and math.isfinite(self.plain_s_per_token)
                and self.plain_s_per_token > 0):
            return f"plain_s_per_token must be a positive number of seconds, got {self.plain_s_per_token!r}"
        if not self.rows.ns or not math.isfinite(self.rows.time(self.rows.target, 1)):
            return "the target row has no measured size"
        if not (1 <= int(self.check_from) <= FALLBACK_AFTER) or not self.early_margin >= 1.0:
            return (f"check_from must be 1..{FALLBACK_AFTER} and early_margin >= 1, got {self.check_from!r}, "
                    f"{self.early_margin!r}")
        t = self.tree_s_per_token
        if t is not None and not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
            return f"tree_s_per_token must be a positive number of seconds or None, got {t!r}"
        return ""
