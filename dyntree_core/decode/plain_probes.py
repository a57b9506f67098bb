"""Plain decoding timed inside a tree run: at a few fixed steps the run decodes one plain step (one target
forward of its last token, committed like any step) instead of a tree, so its speed over plain decoding is
read from steps that ran under the same load, in the same spell of the machine's memory, as its tree steps.

Timed beside the run instead (three one-token forwards before its first step), the reference swung with
what else ran at that moment: in the app on the 2-core Zen 4 VM with the page in Chromium, the forwards
before four Runs gave means of 62, 83, 38 and 63 ms (one sample of 95 ms among 35-39), while the page's own
plain Runs between them measured 41-57 ms/token; the status line called the same tree 0.82x to 1.55x
plain decoding. A probe costs the run only the difference between a plain token and a tree token; its
token is the run's own (the output is the plain step's: lossless, and at T = 0 the same tokens).

A probe due where the text's repeats pay (``drafting.repeats``: a step of many tokens for one target forward) waits
for the next step that would draft. The run's last token is a probe too: a tree step could commit only that one
token, at more than a plain step's cost.

Eager steps only: graph steps (a GPU) keep the forwards timed beside the run.
"""

from __future__ import annotations

import statistics
from typing import Optional, Sequence

from ..trace import StepTrace

#: the steps that probe first (a run of 64 tokens has 11-15 chain steps here), then every ``PROBE_EVERY``-th. Not
#: before step 5: the fallback rule (``DecodeConfig.fallback``) decides on the first tree steps, and a probe among
#: them moves where each starts in the text (the app's default prompt fell back after step 4 with probes at 1, 5, 9,
#: at 4.00 tokens per tree step against 4.33 without; with probes from step 5 on it ran as without them)
FIRST_PROBES = (5, 9, 13)
PROBE_EVERY = 16
#: ``StepTrace.draft_source`` of a probe step
PROBE = "plain probe"


def probe_due(step: int) -> bool:
    """Whether a plain probe falls due at step ``step`` (0-based) of a tree run: ``FIRST_PROBES``, then steps
    29, 45, 61, …"""
    return step in FIRST_PROBES or (step > FIRST_PROBES[-1] and step % PROBE_EVERY == FIRST_PROBES[-1] % PROBE_EVERY)


def _timed_plain(t: StepTrace) -> bool:
    """A plain step that was timed and committed its one token."""
    return t.tree is None and t.step_seconds > 0 and t.num_committed == 1


def probe_steps(traces: Sequence[StepTrace]) -> list[StepTrace]:
    """The run's plain probes that were timed."""
    return [t for t in traces if t.draft_source == PROBE and _timed_plain(t)]


def plain_steps_inside(traces: Sequence[StepTrace]) -> list[StepTrace]:
    """The plain steps of a tree run that time plain decoding inside it: its probes, and the plain steps after its
    fallback (``DecodeConfig.fallback``), which ran under the same load (none in a run without a tree step)."""
    if not any(t.tree is not None for t in traces):
        return []
    return [t for t in traces if _timed_plain(t)]


def probed_s_per_token(traces: Sequence[StepTrace]) -> Optional[float]:
    """Plain decoding's seconds per token inside the run: the median of ``plain_steps_inside`` (None before one)."""
    steps = [t.step_seconds for t in plain_steps_inside(traces)]
    return statistics.median(steps) if steps else None
