"""A profile row whose smaller size measured slower than a larger one is timed again before it is kept."""

from contextlib import nullcontext

from dyntree_core.planning import profiling
from dyntree_core.planning.machine_profile import empty_profile


class ScriptedTimer:
    """``best(n)`` answers the next of ``times[n]`` (ms), repeating the last; ``calls`` records every size timed."""

    def __init__(self, times: dict[int, list[float]]):
        self.times, self.calls = {n: list(ts) for n, ts in times.items()}, []

    def best(self, n: int, samples: int = 2) -> float:
        self.calls.append(n)
        ts = self.times[n]
        return (ts.pop(0) if len(ts) > 1 else ts[0]) / 1e3


def _measure(times: dict[int, list[float]]):
    prof = empty_profile("k")
    prof.ns = sorted(times)
    row = [None] * len(prof.ns)
    prof.target["int4"] = row
    timer, said = ScriptedTimer(times), []
    profiling._measure_sizes(prof, "target", "int4", row, prof.ns, timer, nullcontext, 2.0, said.append, 0.0)
    return prof, [round(t * 1e3, 1) for t in row], timer.calls, said


def test_a_size_slower_than_a_larger_one_is_timed_again_and_the_fastest_kept():
    """The Zen 4 profile's t(8) = 146.9 > t(16) = 130.7: one slow spell at n = 8; timed again it is 47 ms."""
    prof, row, calls, said = _measure({1: [32.0], 4: [38.0], 8: [146.9, 47.0], 16: [130.7]})
    assert row == [32.0, 38.0, 47.0, 130.7]
    assert calls == [1, 4, 8, 16, 8]  # only the inverted size again
    assert "inversions" not in prof.meta
    assert any("n=8: 146.9 ms, more than n=16 (130.7 ms): timed again, 47.0 ms" in m for m in said)


def test_within_the_tolerance_nothing_is_timed_again():
    prof, row, calls, _ = _measure({1: [27.1], 2: [26.7], 4: [37.0]})  # 1.5 % apart: the noise of one sample
    assert calls == [1, 2, 4] and row == [27.1, 26.7, 37.0] and "inversions" not in prof.meta


def test_an_inversion_that_stays_is_kept_as_measured_and_named():
    """Kernels chosen per row count can make 8 rows genuinely slower than 16: after the retries it is recorded."""
    prof, row, calls, _ = _measure({4: [20.0], 8: [60.0, 59.0, 58.0], 16: [50.0]})
    assert calls == [4, 8, 16] + [8] * profiling.MONOTONE_RETRIES
    assert row == [20.0, 58.0 if profiling.MONOTONE_RETRIES >= 2 else 59.0, 50.0]
    assert prof.meta["inversions"] == {"target:int4": [8]}


def test_gaps_left_by_pruning_compare_the_measured_neighbours():
    prof = empty_profile("k")
    prof.ns = [1, 2, 4, 32]
    row = [0.2, None, None, 0.1]
    prof.target["bfloat16"] = row
    timer = ScriptedTimer({1: [150.0]})
    profiling._recheck_inversions(prof, "target", "bfloat16", row, timer, nullcontext, lambda _m: None, fresh={0, 3})
    assert timer.calls == [1] * profiling.MONOTONE_RETRIES and row == [0.15, None, None, 0.1] and prof.meta["inversions"] == {"target:bfloat16": [1]}


def test_a_stored_time_is_never_replaced_and_a_tiny_gap_is_noise():
    """A row grown by new sizes keeps its stored times (a profile is measured once): an inversion between a stored
    size and a new one is named, not re-timed; sub-millisecond forwards (a tiny model's) differing by less than
    MONOTONE_MIN_GAP_S are not inversions."""
    prof = empty_profile("k")
    prof.ns = [1, 2, 4, 8]
    row = [0.020, 0.030, None, None]
    prof.target["int4"] = row
    timer = ScriptedTimer({4: [25.0], 8: [40.0]})
    profiling._measure_sizes(prof, "target", "int4", row, [4, 8], timer, nullcontext, 2.0, lambda _m: None, 0.0)
    assert timer.calls == [4, 8] and row == [0.020, 0.030, 0.025, 0.040]
    assert prof.meta["inversions"] == {"target:int4": [2]}
    assert profiling._inversions([1, 2, 4], [0.00094, 0.00096, 0.00081]) == []
