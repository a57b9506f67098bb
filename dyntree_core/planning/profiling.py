"""Measuring the machine profile: what a request lacks of it is timed once and written back.

Forwards run on top of a 128-token prefix whose keys and values are zeros (attention costs the same
for any values, and a real 128-token prefill of a bf16 model on an AVX2 CPU alone takes tens of
seconds); with a 32-token prefix, bf16 on an AVX2 CPU measured 201 ms for one target token, but
decoding after a 128-token prompt took 435 ms/token (its attention cost grows with the context).
Profiling is kept short: one warm-up forward, two or three timed samples per size, the fastest kept
(interference only adds time). A precision more than ``prune_factor`` times slower than the best
precision at some size is timed once at the largest size asked for (a tree's forward) before it is
dropped: where it is the fastest there (bf16 on a CPU with AMX: slower than int4 for one token,
several times faster for 32), every size is measured; where it is not (bf16 on AVX2: 11x at 16
tokens), the sizes between are dropped and never measured again, and its two measured ends stay in
its row (slower at both ends, it is not the best between them either).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from .. import measured
from ..machine import machine_info
from ..memory_bandwidth import probe_read, read_gb_per_s
from ..process_memory import memory_budget, process_memory, release_freed_memory
from .forward_timer import ForwardTimer, Progress, Turn
from .pricing import other_seconds
from .provisional import WEIGHT_BYTES
from .machine_profile import (DEFAULT_NS, PREFIX_LEN, MachineProfile, NotMeasuredYet, empty_profile,
                              other_spell_paths, profile_key, profile_path, spell_profile_path, spell_profiles)

#: loads one model ("draft" | "target") at a precision
ModelLoader = Callable[[str, str], object]
#: weight bytes a one-token forward of (role, precision) reads, known without loading it (None: unknown)
ForwardBytes = Callable[[str, str], Optional[int]]
#: how much faster than the measured read of one big buffer a forward is assumed to read its weights
READ_MARGIN = 1.25
#: two read-bandwidth probes this far apart are two spells of a host whose memory bandwidth jumps between levels
#: (docs/CPU_KERNELS.md: the Zen 4 VM reads ~32 or ~50-57 GB/s on 2 threads, seconds to minutes at a time, and a
#: one-token forward follows it: 33 vs 24 ms); ``bench speed`` splits its prompts by the same gap
SPELL_GAP = 1.3
#: a memory-bound row measured outside the profile's spell is measured again, at most this many times, each after
#: SPELL_WAIT_S (a spell lasts seconds to minutes)
SPELL_RETRIES = 3
SPELL_WAIT_S = 5.0
#: times a profile measured from nothing may move to the spell the memory has gone to and stays in (the probes around
#: two rows or attempts one after the other all read it, away from the profile's): the rows it had are measured again
#: there, instead of every later row waiting out SPELL_RETRIES for a spell that does not come back (the browser test's
#: Zen 4 run: 59 GB/s at the Run's probe, 35 for the next two minutes: 140 s of waits in a 164 s measurement). One
#: row's probes alone are not enough: a fast spell of 6 s moved a profile that then waited out every later row. Two
#: moves, not one: the memory going back after the first move left a row mixed (6 alternated rounds, Zen 4: median
#: 43 against 47 s, rows measured again 3 against 6, rows mixed 0 against 1)
SPELL_MOVES = 2
#: rows whose forward reads less than this are not probed (their time is not the memory's)
SPELL_MIN_BYTES = 64 << 20
#: the probe's buffer: beyond any cache
PROBE_BYTES = 256 << 20
#: a run's probes read less (4x the 32 MiB L3 of the Zen 4 host), once before its first step and once after its last
RUN_PROBE_BYTES = 128 << 20
#: profiles kept per machine and pair, one per spell of its memory bandwidth (the least recently written other
#: spell's goes first)
SPELLS_KEPT = 3
#: a probe outside every stored profile's spell is confirmed before a profile is measured for it: this many more
#: probes, this far apart, and their median with it decides (one `bench speed` run on the Zen 4 VM measured
#: profiles at 18.4 and 39.0 GB/s beside the host's two levels, ~29 and ~52, each from a single probe)
SPELL_CONFIRM_PROBES = 3
SPELL_CONFIRM_GAP_S = 0.5
#: a size whose forward measured more than this x the next larger measured size's is timed again (a forward of more
#: rows reads the same weights and does more work; one sample slowed by the host, kept as the fastest of all of its
#: samples, made a Zen 4 profile say target int4 t(8) = 146.9 ms > t(16) = 130.7), at most MONOTONE_RETRIES times, where
#: the two differ by MONOTONE_MIN_GAP_S or more too (a tiny model's sub-millisecond forwards differ by their noise)
MONOTONE_TOLERANCE = 1.05
MONOTONE_MIN_GAP_S = 1e-3
MONOTONE_RETRIES = 2


OTHER_STEPS = 3


def engine_steps(draft, target, n: int, steps: int = OTHER_STEPS, prompt_len: int = 16) -> list:
    """``steps`` recorded steps of the engine on ``(draft, target)`` as loaded, whose trees have ``n``
    nodes: the autoregressive step at n = 1, else one-level trees of the root's n - 1 most likely
    children (DySpec greedy at depth 1: one draft forward per step, where a chain of n nodes would
    cost n - 1 sequential ones; greedy, the engine's defaults otherwise). The profile's other cost at n
    is the fastest of their ``pricing.other_seconds`` (like its forwards: interference only adds time)."""
    from ..config import DTYPES, DecodeConfig
    from ..decode import prepared
    from ..decode.engine import SpeculativeDecoder
    from ..quant.apply import model_precision, output_dim

    tp, dp = model_precision(target), model_precision(draft)
    cfg = DecodeConfig(method="autoregressive" if n <= 1 else "dyspec_greedy", depth=1, budget=max(2, n),
                       dtype=tp if tp in DTYPES else "float32", precision=tp, draft_precision=dp,
                       device=next(target.parameters()).device.type)
    pair = target.__dict__.get(prepared._ATTR)  # the pair these models were prepared as: borrowed, not redone
    if pair is not None and pair.draft is draft and not (pair.stale or pair.closed):
        st = pair.settings
        cfg = dataclasses.replace(cfg, device=st.device, dtype=st.dtype, precision=st.precision,
                                  draft_precision=st.draft_precision, offload_target=st.offload_target)
    prompt = torch.randint(2, output_dim(target), (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    room = int(getattr(target.config, "max_position_embeddings", 1 << 30)) - prompt_len - n - 1
    new_tokens = max(1, min(steps * max(1, n), room))
    decoder = SpeculativeDecoder(draft, target, cfg, eos_token_id=-1)  # nothing ends the run early
    run = decoder.generate(prompt, new_tokens)
    out = list(itertools.islice(run, steps))
    run.close()  # (the steps asked for, not the whole run)
    sized = [t for t in out if max(1, t.tree_size) == n]
    return sized or out


def _widen(prof: MachineProfile, ns: Sequence[int]) -> None:
    """Add the columns ``ns`` to every row (None where not measured)."""
    new = sorted(set(prof.ns) | set(int(n) for n in ns))
    if new == prof.ns:
        return

    def remap(row: list[Optional[float]]) -> list[Optional[float]]:
        old = dict(zip(prof.ns, row))
        return [old.get(n) for n in new]

    for table in (prof.target, prof.draft):
        for prec in table:
            table[prec] = remap(table[prec])
    prof.other = remap(prof.other)
    prof.ns = new


def same_spell(a: float, b: float) -> bool:
    """Whether two read-bandwidth probes (GB/s) are one spell of this host's memory (less than ``SPELL_GAP``
    apart)."""
    return max(a, b) < SPELL_GAP * min(a, b)


def spell_choice(stored: Sequence[tuple[object, MachineProfile]], now: Optional[float]) -> tuple[int, bool]:
    """Which of the ``stored`` profiles (``machine_profile.spell_profiles``) prices a run in the spell a probe of
    ``now`` GB/s is in: ``(index, True)`` for the one measured nearest ``now`` in its spell, ``(index of the nearest,
    False)`` when no profile is of that spell, ``(0, True)`` without a probe or without probed profiles."""
    probed = [(max(p.read_gb_per_s, now) / min(p.read_gb_per_s, now), i)
              for i, (_, p) in enumerate(stored) if now and p.read_gb_per_s]
    if not probed:
        return 0, True
    _, i = min(probed)
    return i, same_spell(stored[i][1].read_gb_per_s, now)


def _prune_spells(key: str, keep: Path) -> None:
    """At most ``SPELLS_KEPT`` profiles of ``key``: the first spell's and ``keep`` stay, the other spells' least
    recently written go."""
    others = sorted((p for p in other_spell_paths(key) if p != keep), key=lambda p: p.stat().st_mtime)
    for path in others[:max(0, len(others) - (SPELLS_KEPT - 1 - int(keep != profile_path(key))))]:
        path.unlink(missing_ok=True)


def confirmed_probe(first: float, probe: Optional[Callable[[], Optional[float]]] = None) -> float:
    """The median of ``first`` and ``SPELL_CONFIRM_PROBES`` more probes (``run_probe``; those the CPUs' contention
    read, None, left out), ``SPELL_CONFIRM_GAP_S`` apart: a new spell is one the memory stays in, not one probe read
    while it changed or while another process read memory."""
    probe = probe or run_probe
    got = [first]
    for _ in range(SPELL_CONFIRM_PROBES):
        time.sleep(SPELL_CONFIRM_GAP_S)
        got.append(probe())
    got = [g for g in got if g is not None]  # (a probe the CPUs' contention read: ``run_probe``)
    return sorted(got)[len(got) // 2]


def run_probe() -> Optional[float]:
    """The read bandwidth (GB/s) before planning a run and around it (``RUN_PROBE_BYTES``, 3 reads: 54-66 ms on the
    2-core Zen 4 host, allocation included), to set against its profile's spell; None when tasks waited for a CPU
    through every read (``memory_bandwidth.probe_read``): a browser drawing the page beside the run read 15 GB/s
    against the profile's 36, and the page called it another spell of the memory."""
    got = probe_read(RUN_PROBE_BYTES, samples=3)
    return None if got.contended else round(got.gb_per_s, 2)


class SpellProbe:
    """The read bandwidth ``measure_into`` probes before and after each memory-bound row, against the profile's
    own (``reference``, GB/s: its ``meta["read_gb_per_s"]``, else the first probe). Its buffer lives while rows are
    measured and goes with the probe."""

    def __init__(self, reference: Optional[float] = None):
        self.buffer = torch.ones(PROBE_BYTES // 4)
        self.reference = float(reference) if reference else self.read()

    def read(self) -> float:
        return round(read_gb_per_s(samples=3, buffer=self.buffer), 2)

    def in_spell(self, gb_per_s: float) -> bool:
        """Whether a probe of ``gb_per_s`` is the reference's spell (less than ``SPELL_GAP`` apart)."""
        return same_spell(gb_per_s, self.reference)


def _ruled_out(prof: MachineProfile, role: str, prec: str, sizes: Sequence[int], prune_factor: float,
               forward_bytes: Optional[ForwardBytes]) -> Optional[str]:
    """Why (role, prec) is not loaded at all: its weights would take the process over its memory budget
    (``process_memory.memory_budget``), or reading them once takes longer than ``prune_factor`` x the best forward
    of its role measured so far at the largest of ``sizes``, even at ``READ_MARGIN`` x the measured read bandwidth
    (a forward of any size reads every weight, so no size of it could be within the factor). None: measure it."""
    if forward_bytes is None or not sizes:
        return None
    nbytes = forward_bytes(role, prec)
    now = process_memory()
    if nbytes and now is not None and now.rss + nbytes > memory_budget():
        return (f"its {nbytes / 1e9:.1f} GB of weights would take this process ({now.rss / 1e9:.1f} GB now) over its "
                f"{memory_budget() / 1e9:.0f} GB memory budget")
    n = max(sizes)
    best = _best_other(prof, role, prec, n)
    if not nbytes or best is None:
        return None
    if "read_gb_per_s" not in prof.meta:
        prof.meta["read_gb_per_s"] = round(read_gb_per_s(), 2)
    floor = nbytes / (READ_MARGIN * prof.meta["read_gb_per_s"] * 1e9)
    if floor <= prune_factor * best:
        return None
    return (f"its {nbytes / 1e9:.1f} GB of weights take >= {floor * 1e3:.0f} ms to read at {READ_MARGIN:g}x the "
            f"measured {prof.meta['read_gb_per_s']:.1f} GB/s, > {prune_factor:g}x the best {n}-token forward "
            f"({best * 1e3:.0f} ms)")


def _best_other(prof: MachineProfile, role: str, prec: str, n: int) -> Optional[float]:
    """The fastest measured time at size ``n`` of ``role``'s other precisions (None: none measured there)."""
    if n not in prof.ns:
        return None
    i = prof.ns.index(n)
    return min((r[i] for p, r in getattr(prof, role).items() if p != prec and r[i] is not None), default=None)


def _fastest_at_the_largest(prof: MachineProfile, role: str, prec: str, largest: int, timer: ForwardTimer,
                            turn: Turn) -> tuple[bool, str]:
    """A precision found too slow at some size, timed once at ``largest`` (kept in its row): whether no
    other precision was faster there (then every size is measured), and what it was."""
    i = prof.ns.index(largest)
    row = getattr(prof, role)[prec]
    if row[i] is None:
        with turn():
            row[i] = timer.best(largest, 1)
    best = _best_other(prof, role, prec, largest)
    t = row[i]
    if best is None or t < best:
        return True, f"the fastest at n={largest} ({t * 1e3:.0f} ms): every size measured"
    return False, (f"n={largest}: {t * 1e3:.0f} ms, the best there {best * 1e3:.0f} ms: the sizes between not "
                   "measured (dropped)")


def _measure_sizes(prof: MachineProfile, role: str, prec: str, row: list, sizes: Sequence[int], timer: ForwardTimer,
                   turn: Turn, prune_factor: float, say: Progress, t_start: float) -> list[int]:
    """Time the sizes ``row`` lacks of ``sizes`` (``measure_into``'s pruning: a precision more than ``prune_factor``
    x the best at some size is timed at the largest before the sizes between are dropped); the indices it filled."""
    largest = max(sizes)
    filled = []
    for n in sizes:
        i = prof.ns.index(n)
        if row[i] is not None:
            continue  # (the largest size, timed ahead of its turn)
        with turn():
            t = row[i] = timer.best(n, 3 if n <= 4 else 2)
        filled.append(i)
        best = _best_other(prof, role, prec, n)
        say(f"    {role} {prec} n={n}: {t * 1e3:.1f} ms  ({time.perf_counter() - t_start:.0f} s)")
        if best is not None and t > prune_factor * best:
            at_largest = row[prof.ns.index(largest)] is None
            fastest, verdict = _fastest_at_the_largest(prof, role, prec, largest, timer, turn)
            if at_largest:
                filled.append(prof.ns.index(largest))
            say(f"      > {prune_factor:g}x the best precision ({best * 1e3:.0f} ms); {verdict}")
            if not fastest:
                prof.dropped[f"{role}:{prec}"] = n
                break
    _recheck_inversions(prof, role, prec, row, timer, turn, say, fresh=set(filled))
    return filled


def _inversions(ns: Sequence[int], row: Sequence[Optional[float]]) -> list[tuple[int, int]]:
    """Index pairs (i, j) of neighbouring measured sizes, ns[i] < ns[j], where t(ns[i]) exceeds both
    ``MONOTONE_TOLERANCE`` x t(ns[j]) and t(ns[j]) + ``MONOTONE_MIN_GAP_S``."""
    measured_at = sorted((i for i, t in enumerate(row) if t is not None), key=lambda i: ns[i])
    return [(i, j) for i, j in zip(measured_at, measured_at[1:])
            if row[i] > max(MONOTONE_TOLERANCE * row[j], row[j] + MONOTONE_MIN_GAP_S)]


def _recheck_inversions(prof: MachineProfile, role: str, prec: str, row: list, timer: ForwardTimer, turn: Turn,
                        say: Progress, fresh: set[int]) -> None:
    """Time again each size measured in this call (index in ``fresh``: a stored time is never replaced) that was
    slower than a larger one, the fastest of its old and new samples kept, up to ``MONOTONE_RETRIES`` rounds; an
    inversion that stays (the kernels at two row counts may genuinely differ, or a stored time was slow) is named in
    ``meta["inversions"]``."""
    key = f"{role}:{prec}"
    for _ in range(MONOTONE_RETRIES):
        slow = [(i, j) for i, j in _inversions(prof.ns, row) if i in fresh]
        if not slow:
            break
        for i, j in slow:
            with turn():
                again = timer.best(prof.ns[i], 2)
            say(f"    {role} {prec} n={prof.ns[i]}: {row[i] * 1e3:.1f} ms, more than n={prof.ns[j]} "
                f"({row[j] * 1e3:.1f} ms): timed again, {again * 1e3:.1f} ms")
            row[i] = min(row[i], again)
    left = _inversions(prof.ns, row)
    inversions = prof.meta.setdefault("inversions", {})
    if left:
        inversions[key] = [prof.ns[i] for i, _ in left]
    else:
        inversions.pop(key, None)
    if not inversions:
        del prof.meta["inversions"]


def measure_into(prof: MachineProfile, load: ModelLoader, wanted: dict[tuple[str, str], Sequence[int]],
                 prune_factor: float = 2.0, progress: Optional[Progress] = None, turn: Turn = nullcontext,
                 forward_bytes: Optional[ForwardBytes] = None, spell_moves: int = 0) -> int:
    """Measure what ``prof`` lacks of ``wanted`` (``{(role, precision): sizes}``), loading each model
    once, and write it into ``prof``. Returns the number of (role, precision) rows timed (0 when
    everything asked for was there). Each size is timed inside ``turn()`` (the app passes a turn on
    its shared models, so nothing is timed while a session decodes). ``forward_bytes``: a precision
    whose weights alone are too slow to read (``_ruled_out``) is dropped without being loaded.

    Rows are measured fewest weight bytes first, so the best time of a role is known before the big
    precisions are considered. The engine's step (``other``) runs on the fastest precision of each
    role; at most one model per role is in memory.

    On a host whose memory bandwidth jumps between spells, rows measured in different spells would price a
    tree in one spell against plain decoding in another: each row that reads at least ``SPELL_MIN_BYTES``
    (``forward_bytes``) is bracketed by two read probes (``SpellProbe``, recorded in ``meta["row_gb_per_s"]``),
    and measured again (up to ``SPELL_RETRIES`` times, ``SPELL_WAIT_S`` apart) where either is not the
    profile's spell (``meta["read_gb_per_s"]``); a row that never was is kept and named in
    ``meta["mixed_spells"]``. A dropped row (slower than the best by ``prune_factor`` at both ends, so in either spell)
    is not measured again. ``spell_moves`` (a profile with no rows from before: ``SPELL_MOVES``): where two probed
    rows or attempts one after the other read one spell away from the profile's on both sides, the profile moves to
    it (``meta["read_gb_per_s"]``; the old one in ``meta["spell_moved_from"]``), the second row is kept and the rows
    timed before it (not dropped) are timed again next."""
    say = progress or (lambda _m: None)
    todo = [(role, prec, prof.missing(role, prec, ns)) for (role, prec), ns in wanted.items()]
    todo = [t for t in todo if t[2]]
    all_ns = {n for ns in wanted.values() for n in ns}
    _widen(prof, all_ns)
    other_todo = [n for n in sorted(all_ns) if prof.other[prof.ns.index(n)] is None]
    if not todo and not other_todo:
        return 0
    t_start = time.perf_counter()
    todo.sort(key=lambda t: (t[0] != "target", WEIGHT_BYTES.get(t[1], math.inf)))  # (stable: ties as asked)
    kept: dict[str, tuple[str, object]] = {}  # role -> (precision, model): the fastest one loaded so far
    probe: Optional[SpellProbe] = None
    pending: Optional[float] = None  # the spell (GB/s) the last probed row read on both sides, away from the profile's
    moves = done = 0
    while done < len(todo):
        role, prec, sizes = todo[done]
        done += 1
        why = _ruled_out(prof, role, prec, sizes, prune_factor, forward_bytes)
        if why is not None:
            say(f"[{done}/{len(todo)}] the {role} at {prec} is not loaded: {why}")
            prof.dropped[f"{role}:{prec}"] = 1
            getattr(prof, role).setdefault(prec, [None] * len(prof.ns))
            continue
        say(f"[{done}/{len(todo)}] loading the {role} at {prec} ...")
        kept.pop(role, None)  # (at most one model per role in memory, as when decoding)
        with turn(), torch.inference_mode():  # (loading is model work too: not beside a session's step)
            release_freed_memory()
            model = load(role, prec)
            timer = ForwardTimer(model, prof.prefix_len, max(sizes))
            timer.once(1)  # warm-up (allocations, first-call paths)
        with torch.inference_mode():
            table = getattr(prof, role)
            row = table.setdefault(prec, [None] * len(prof.ns))
            nbytes = forward_bytes(role, prec) if forward_bytes is not None else None
            probed = bool(nbytes) and nbytes >= SPELL_MIN_BYTES
            if probed and probe is None:
                with turn():
                    probe = SpellProbe(prof.read_gb_per_s)
                prof.meta.setdefault("read_gb_per_s", probe.reference)
            for attempt in range(SPELL_RETRIES + 1 if probed else 1):
                if attempt:
                    time.sleep(SPELL_WAIT_S)
                with turn():
                    before = probe.read() if probed else None
                filled = _measure_sizes(prof, role, prec, row, sizes, timer, turn, prune_factor, say, t_start)
                if not probed:
                    break
                with turn():
                    after = probe.read()
                key = f"{role}:{prec}"
                prof.meta.setdefault("row_gb_per_s", {})[key] = [before, after]
                mixed = prof.meta.setdefault("mixed_spells", [])
                if key in mixed:
                    mixed.remove(key)  # (measured anew)
                elsewhere = not (probe.in_spell(before) or probe.in_spell(after)) and same_spell(before, after)
                seen, pending = pending, round((before + after) / 2, 2) if elsewhere else None
                if seen and pending and same_spell(seen, pending) and moves < spell_moves:
                    again = _move_spell(prof, probe, pending, key, todo[:done - 1])
                    todo[done:done] = again
                    moves, pending = moves + 1, None
                    say(f"    {role} {prec}: memory read {before:.0f} / {after:.0f} GB/s around it, the spell it read "
                        f"{seen:.0f} in before, not the profile's {prof.meta['spell_moved_from'][-1]:.0f}: the "
                        f"profile moves to it" + (f"; timed again there: {', '.join(f'{r} {p}' for r, p, _ in again)}"
                                                  if again else ""))
                if key in prof.dropped or (probe.in_spell(before) and probe.in_spell(after)):
                    if not mixed:  # (a dropped row, slower than the best by prune_factor at both ends, stays dropped
                        del prof.meta["mixed_spells"]  # in either spell: its two times are not measured again)
                    break
                around = (f"memory read {before:.0f} / {after:.0f} GB/s around it against the profile's "
                          f"{probe.reference:.0f}")
                if attempt == SPELL_RETRIES:
                    mixed.append(key)
                    say(f"    {role} {prec}: {around}, {SPELL_RETRIES + 1} times: kept as measured")
                    break
                say(f"    {role} {prec}: {around} (another spell of this host's bandwidth): measured again "
                    f"in {SPELL_WAIT_S:g} s")
                for i in filled:
                    row[i] = None
                prof.dropped.pop(key, None)
        if prof.fastest(role) == prec:  # (a slower one is not kept: the engine's steps below reload the fastest)
            kept[role] = (prec, model)
        del model, timer
    if other_todo:  # the step's other cost at each size, measured by running the engine's step
        with turn(), torch.inference_mode():
            for role in ("target", "draft"):
                if role not in kept:
                    release_freed_memory()
                    prec = prof.fastest(role) or next(iter(prof.target), "float32")
                    kept[role] = (prec, load(role, prec))
            for n in other_todo:
                o = min(other_seconds(n, "", step=t) for t in engine_steps(kept["draft"][1], kept["target"][1], n))
                prof.other[prof.ns.index(n)] = o
                say(f"    the engine's step outside the forwards, n={n}: {o * 1e3:.1f} ms")
    kept.clear()
    probe = None  # (its buffer)
    release_freed_memory()
    prof.seconds += time.perf_counter() - t_start
    prof.machine = machine_info().to_dict()
    return len(todo)


def _move_spell(prof: MachineProfile, probe: SpellProbe, gb_per_s: float, moving: str,
                before: Sequence[tuple[str, str, Sequence[int]]]) -> list[tuple[str, str, Sequence[int]]]:
    """Move ``prof`` (and ``probe``'s reference) to the spell of ``gb_per_s``, where the row ``moving``
    ("role:precision") was just timed; the probed rows of ``before`` (``measure_into``'s todo entries timed so far)
    that were not dropped are emptied and returned, to be timed again in it."""
    prof.meta.setdefault("spell_moved_from", []).append(probe.reference)
    probe.reference = prof.meta["read_gb_per_s"] = gb_per_s
    probed = prof.meta.get("row_gb_per_s", {})
    again: dict[str, tuple[str, str, Sequence[int]]] = {}
    for role, prec, sizes in before:
        key = f"{role}:{prec}"
        if key in probed and key != moving and key not in prof.dropped:  # (a dropped row stays: dropped in either spell)
            again.setdefault(key, (role, prec, sizes))  # (a row timed again after a first move is in ``before`` twice)
    for key, (role, prec, _) in again.items():
        getattr(prof, role)[prec] = [None] * len(prof.ns)
        del probed[key]
        if key in prof.meta.get("mixed_spells", ()):
            prof.meta["mixed_spells"].remove(key)
    return list(again.values())


def measure_profile(load: ModelLoader, precisions: Sequence[str], key: str, ns: Sequence[int] = DEFAULT_NS,
                    prefix_len: int = PREFIX_LEN, prune_factor: float = 2.0, progress: Optional[Progress] = None,
                    draft_precisions: Optional[Sequence[str]] = None) -> MachineProfile:
    """A new profile of both models at every precision and size (nothing read from or written to the
    cache; ``bench profile`` uses it)."""
    prof = empty_profile(key, prefix_len)
    wanted = {(role, p): ns for role, precs in (("target", precisions), ("draft", draft_precisions or precisions))
              for p in precs}
    measure_into(prof, load, wanted, prune_factor, progress, spell_moves=SPELL_MOVES)
    return prof


def load_or_measure_profile(load: ModelLoader, pair_name: str, device: str, precisions: Sequence[str],
                            ns: Sequence[int] = DEFAULT_NS, refresh: bool = False,
                            progress: Optional[Progress] = None,
                            draft_precisions: Optional[Sequence[str]] = None,
                            target_ns: Optional[Sequence[int]] = None, measure: bool = True,
                            turn: Turn = nullcontext, remeasure: Sequence = (),
                            forward_bytes: Optional[ForwardBytes] = None,
                            read_gb_per_s: Optional[float] = None) -> MachineProfile:
    """This machine's profile of the pair with at least ``ns`` for both models at their precisions
    (and ``target_ns`` too for the target): read from the cache, and what it lacks measured once and
    written back when the machine was quiet while it ran (``measured.watch``; else the profile is
    returned with ``provisional`` saying why, and the next call measures again). ``refresh`` measures
    everything asked for anew; ``measure=False`` raises ``NotMeasuredYet`` instead of measuring;
    ``turn`` and ``forward_bytes`` as in ``measure_into``; ``remeasure``: rows (``prediction.ProfileRow``) to measure anew (a run
    was off its prediction): the stored file keeps their old times until the new ones are written.

    ``read_gb_per_s``: the memory's read bandwidth probed just before (``run_probe``). A host whose bandwidth jumps
    between spells keeps a profile per spell (a one-token forward follows the spell, a 32-token one hardly does,
    so one spell's rows price the other's trees wrongly): the profile of the probe's spell is used; where there
    is none, ``measure`` confirms the probe (``confirmed_probe``: a spell it stays in) and measures one
    (``spell_profile_path``), else the nearest spell's is returned with ``other_spell`` set to the probe."""
    key = profile_key(pair_name, device)
    path = profile_path(key)
    prof: Optional[MachineProfile] = None
    other_spell: Optional[float] = None
    stored = spell_profiles(key) if not refresh else []
    if stored:
        i, same = spell_choice(stored, read_gb_per_s)
        if not same and measure:
            with turn():
                read_gb_per_s = confirmed_probe(read_gb_per_s)
            i, same = spell_choice(stored, read_gb_per_s)
        path, prof = stored[i]
        if not same and measure:
            path, prof = spell_profile_path(key, read_gb_per_s), empty_profile(key)
            prof.meta["read_gb_per_s"] = round(read_gb_per_s, 2)
        elif not same:
            other_spell = read_gb_per_s
    prof = prof or empty_profile(key)
    prof.other_spell = other_spell
    for row in remeasure if measure else ():
        prof.forget(row.role, row.precision)
    t_ns = sorted(set(ns) | set(target_ns or ()))
    wanted = {("target", p): t_ns for p in precisions}
    wanted.update({("draft", p): list(ns) for p in (draft_precisions or precisions)})
    if not measure and (refresh or any(prof.missing(role, p, ns) for (role, p), ns in wanted.items())
                        or any(n not in prof.ns or prof.other[prof.ns.index(n)] is None for n in t_ns)):
        raise NotMeasuredYet(f"the machine profile of {pair_name} on {device} is not measured yet")
    rows_before = (repr(prof.target), repr(prof.draft), repr(prof.other))
    from_nothing = not any(t is not None for table in (prof.target, prof.draft) for row in table.values() for t in row)
    moves_before = len(prof.meta.get("spell_moved_from", ()))
    with measured.watch() as w:  # (written only when the machine was quiet while it was measured)
        timed = measure_into(prof, load, wanted, progress=progress, turn=turn, forward_bytes=forward_bytes,
                             spell_moves=SPELL_MOVES if from_nothing else 0)
    if rows_before == (repr(prof.target), repr(prof.draft), repr(prof.other)) and path.is_file() and not refresh:
        return prof  # nothing was timed: the stored rows stand, whatever the machine's load just now
    if len(prof.meta.get("spell_moved_from", ())) > moves_before:  # (measured in the spell the memory went to)
        if path != profile_path(key):
            path = next((p for p, s in stored if s.read_gb_per_s and same_spell(s.read_gb_per_s, prof.read_gb_per_s)),
                        spell_profile_path(key, prof.read_gb_per_s))
        if read_gb_per_s and not same_spell(read_gb_per_s, prof.read_gb_per_s):
            prof.other_spell = read_gb_per_s
    verdict = w.verdict()
    # another spell's profile exists to price that spell: rows that never were measured in it make it worse than
    # the nearest spell's (the first profile is kept as measured: auto needs one)
    mixed = prof.meta.get("mixed_spells") if path != profile_path(key) else None
    if not verdict.quiet or mixed:
        prof.provisional = verdict.reason if not verdict.quiet else (
            f"rows measured outside its spell of {prof.read_gb_per_s:.0f} GB/s: {', '.join(mixed)}")
        (progress or (lambda _m: None))(f"the profile is provisional, not stored: {prof.provisional}")
    elif timed or not path.is_file() or refresh:
        prof.save(path)
        if path != profile_path(key):
            _prune_spells(key, path)
    return prof
