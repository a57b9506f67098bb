"""How often a streaming run's figures are redrawn: every ``FIGURE_INTERVAL_S`` where that is cheap, and as
seldom as it takes for the redraws to cost decoding at most ``FIGURE_BUDGET`` of its time where it is not,
measured on the run's own steps.

A redraw (the tree, three masks, the phase, speed and steps charts, the walkthrough; the cost panel went with
them until it moved to every refresh) costs the app 70-110 ms of Python and the browser a few hundred
milliseconds of rendering. Where those CPUs are the ones decoding, the steps around a redraw take longer: on
the 2-core AVX2 EPYC with the page in Chromium on the same machine, 128 plain int4 steps summed 6.5-6.8 s with
no redraw while the run streamed and 7.15-8.1 s with one every 3 s (medians per step 44-48 ms both ways). A
redraw's cost is read from the steps that end in the ``PROBE_WINDOW_S`` (or 3 median steps) after it was sent:
their time beyond the run's median step.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

#: the shortest interval between two redraws of a streaming run's figures (its text and status: every tick)
FIGURE_INTERVAL_S = 3.0
#: the longest: a run whose figures cost more still shows its tree at least this often
MAX_FIGURE_INTERVAL_S = 30.0
#: the share of decoding time the redraws may cost
FIGURE_BUDGET = 0.05
#: how long after a redraw the steps are read for its cost (the browser draws for up to ~1 s after the app sends)
PROBE_WINDOW_S = 2.0
#: steps a run needs before a redraw's cost is read (its median step is the reference)
MIN_STEPS = 8


def probe_window(steps: Sequence[tuple[float, float]], window_s: float = PROBE_WINDOW_S) -> float:
    """The window after a redraw its cost is read over: ``window_s``, or 3 median steps where steps are slower."""
    return max(window_s, 3 * statistics.median(s for _, s in steps)) if steps else window_s


def redraw_cost(steps: Sequence[tuple[float, float]], sent_at: float, window_s: float = PROBE_WINDOW_S
                ) -> Optional[float]:
    """Seconds of decoding a redraw cost: of ``steps`` (each ``(elapsed, step_seconds)``, ``elapsed`` the
    generation's time at the step's end, as ``StepTrace`` has them), those ending in the ``probe_window`` after
    ``sent_at``, beyond the median of all of them. None until a step ends after the window, or with fewer than
    ``MIN_STEPS`` steps or fewer than 2 in the window."""
    if len(steps) < MIN_STEPS:
        return None
    window = probe_window(steps, window_s)
    if steps[-1][0] <= sent_at + window:
        return None
    inside = [s for end, s in steps if sent_at < end <= sent_at + window]
    if len(inside) < 2:
        return None
    median = statistics.median(s for _, s in steps)
    return max(0.0, sum(inside) - median * len(inside))


@dataclass
class FigurePacing:
    """One page's redraw interval while a run streams, from the costs measured so far."""

    interval_s: float = FIGURE_INTERVAL_S
    cost_s: Optional[float] = None  # a redraw's cost to decoding (seconds; the mean of the last two measured)
    probe_at: Optional[float] = None  # generation time at which the last redraw went out, until its cost is read

    def sent(self, elapsed: Optional[float]) -> None:
        """A redraw went out at the generation's time ``elapsed`` (None before its first step)."""
        self.probe_at = elapsed

    def read(self, steps: Sequence[tuple[float, float]]) -> None:
        """Read the last redraw's cost once the steps after it are in; set the interval from it."""
        if self.probe_at is None:
            return
        cost = redraw_cost(steps, self.probe_at)
        if cost is None:
            if len(steps) >= MIN_STEPS and steps[-1][0] > self.probe_at + probe_window(steps):
                self.probe_at = None  # (the window passed with too few steps in it: the next redraw is read)
            return
        self.probe_at = None
        self.cost_s = cost if self.cost_s is None else (self.cost_s + cost) / 2
        self.interval_s = min(MAX_FIGURE_INTERVAL_S, max(FIGURE_INTERVAL_S, self.cost_s / FIGURE_BUDGET))

    def note(self) -> str:
        """What the page says while a run streams with redraws slowed down ('' at the shortest interval)."""
        if self.interval_s <= FIGURE_INTERVAL_S or self.cost_s is None:
            return ""
        return (f"figures redrawn every {self.interval_s:.0f} s while it runs: each redraw cost decoding "
                f"{self.cost_s:.2f} s on this machine (the text: every refresh)")
