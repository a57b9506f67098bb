"""The machine profile: what a forward of n tokens costs here, per model, precision and size.

One profile per machine and pair: cached as JSON under ``cache_root()/profiles/``, keyed through
``dyntree_core.measured`` by the machine's identity (the CPU model and flags, CPUs and threads, plus
the GPU on a CUDA device), the torch version, the code that times it, the kernels its int4 layers run,
the pair and the device (``profile_key``). Rows measured while the machine was busy are used by the
request that measured them but not written (``MachineProfile.provisional`` says why). It holds a row of seconds per size for each (model,
precision) measured so far (``profiling.load_or_measure_profile`` measures what a request lacks and
writes it into the same file), so every planner on this machine reads the same numbers: ``auto`` (its
closed-form prices), ``tuning`` (auto's calibration of the methods it cannot price in closed form)
and the app. Sizes never measured are priced by interpolating between the sizes that were
(``step_price.interpolate``), and not at all past the largest one.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from .. import measured
from ..machine import machine_info
from ..step_price import row_time

PROFILE_VERSION = 8  # 2: forwards on a 128-token prefix (bf16 attention on AVX2 grows with the context)
# 3: timed on zero-weight shape twins of GGUF presets, prefix keys/values filled without a prefill
# 4: one profile per machine and pair; rows per (model, precision) merged as sizes are asked for
# 5: models on GGUF blocks run decode.lean_forward (shorter forwards than transformers' own)
# 6: the per-size row "other" is the engine step outside its forwards (was "verify": n probability rows)
# 7: a precision too slow at one size is timed at the largest before it is dropped (issue 40: bf16 with AMX)
# 8: an int4 draft reads its head from the embedding where that is the same matrix in fewer bytes
DEFAULT_NS: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
PREFIX_LEN = 128


class NotMeasuredYet(LookupError):
    """A profile or acceptance was asked for from the cache only, and the cache lacks it."""


class AcceptanceNotMeasured(NotMeasuredYet):
    """The machine profile is measured; the pair's acceptance at ``temperature`` is not. ``target_precision`` /
    ``draft_precision``: the fastest one-token forwards the profile measured (plain decoding's best meanwhile)."""

    def __init__(self, message: str, target_precision: str, draft_precision: str, temperature: float):
        super().__init__(message)
        self.target_precision, self.draft_precision, self.temperature = target_precision, draft_precision, temperature


@dataclass
class MachineProfile:
    """Minimum-of-samples forward times (seconds) per model, precision and size on one machine.

    Attributes:
        key: cache key (``profile_key``: machine, threads, torch, pair, device).
        machine: ``machine_info().to_dict()`` of the machine that measured it.
        prefix_len: cached (zero) prefix the forwards ran on top of.
        ns: sizes (tokens per forward) of the columns of every row, increasing.
        target / draft: ``{precision: [seconds or None per n]}``; None = not measured or dropped.
        other: ``[seconds or None per n]`` the engine's step outside its draft forwards and target forward
            at a tree of n nodes (``pricing.other_seconds`` of recorded steps: tree build, mask,
            verification, KV compaction, drafter update, commit; ``profiling.engine_steps``).
        dropped: ``{"role:precision": n}``: that precision was dropped from size n on (slower than
            ``prune_factor`` x the best precision there and at the largest size asked for, both
            kept in its row); the sizes between are never measured for it.
        seconds: how long profiling took (all passes).
        provisional: why rows measured in this process were not written (the machine was busy while
            they ran); empty when everything in it is stored. Never written itself.
        other_spell: the read bandwidth (GB/s) of a probe whose spell has no profile of its own: this one is the
            nearest spell's (``profiling.load_or_measure_profile``); None when it is the probe's own spell or
            nothing was probed. Never written.
    """

    key: str
    machine: dict
    prefix_len: int
    ns: list[int]
    target: dict[str, list[Optional[float]]]
    draft: dict[str, list[Optional[float]]]
    other: list[Optional[float]]
    dropped: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    created: str = ""
    version: int = PROFILE_VERSION
    meta: dict = field(default_factory=dict)
    provisional: str = ""
    other_spell: Optional[float] = None

    @property
    def read_gb_per_s(self) -> Optional[float]:
        """The memory read bandwidth its rows were measured at (its spell; None: its rows were not probed)."""
        return self.meta.get("read_gb_per_s")

    def target_time(self, precision: str, n: float) -> float:
        return row_time(self.ns, self.target.get(precision), n)

    def draft_time(self, precision: str, n: float) -> float:
        return row_time(self.ns, self.draft.get(precision), n)

    def other_time(self, n: float) -> float:
        return row_time(self.ns, self.other, n)

    def fastest(self, role: str, among: Optional[Sequence[str]] = None) -> Optional[str]:
        """The precision of ``role`` (``target`` / ``draft``) with the fastest one-token forward, among ``among``
        (default: every precision of its table); None when none of them has a time."""
        time_at = self.target_time if role == "target" else self.draft_time
        timed = [(time_at(p, 1), i, p) for i, p in enumerate(among if among is not None else getattr(self, role))]
        best = min(timed, default=None)
        return best[2] if best is not None and math.isfinite(best[0]) else None

    @property
    def max_tokens(self) -> int:
        """The largest size any row measured (larger trees have no price)."""
        sizes = [n for rows in (self.target, self.draft) for row in rows.values()
                 for n, t in zip(self.ns, row) if t is not None]
        return max(sizes, default=0)

    def missing(self, role: str, precision: str, ns: Sequence[int]) -> list[int]:
        """Sizes of ``ns`` with no time for (role, precision) that were not dropped."""
        row = getattr(self, role).get(precision)
        stop = self.dropped.get(f"{role}:{precision}", math.inf)
        have = {n for n, t in zip(self.ns, row or []) if t is not None}
        return sorted(n for n in set(ns) if n not in have and n < stop)

    def forget(self, role: str, precision: str = "") -> bool:
        """Clear the row of ``role`` (``target`` / ``draft`` at ``precision``, or ``other``) so that
        ``load_or_measure_profile`` measures it again (its ``remeasure``); True if it held a time."""
        if role == "other":
            had, self.other = any(t is not None for t in self.other), [None] * len(self.other)
            return had
        row = getattr(self, role).get(precision)
        self.dropped.pop(f"{role}:{precision}", None)
        if row is None:
            return False
        had = any(t is not None for t in row)
        getattr(self, role)[precision] = [None] * len(row)
        return had

    def prefill_rate(self) -> Optional[tuple[float, int, str]]:
        """``(tokens/s, n, precision)`` of the fastest target forward of the largest size measured: what a
        prefill's chunks of ``n`` tokens run at on a short context (a long prompt's attention adds to it);
        None before a target row is measured."""
        best: Optional[tuple[float, int, str]] = None
        for prec, row in self.target.items():
            sized = [(n, t) for n, t in zip(self.ns, row) if t]
            if sized:
                n, t = sized[-1]
                if best is None or (n, n / t) > (best[1], best[0]):
                    best = (n / t, n, prec)
        return best

    def save(self, path: Path) -> None:
        """Write the profile atomically (``measured.write_json``); ``provisional`` and ``other_spell`` are not
        written."""
        d = asdict(self)
        d.pop("provisional")
        d.pop("other_spell")
        measured.write_json(path, d)

    @classmethod
    def load(cls, path: Path) -> "MachineProfile":
        return cls(**json.loads(Path(path).read_text()))


def profile_measure_key(pair_name: str, device: str) -> measured.MeasureKey:
    """The profile's ``measured.MeasureKey``: this machine (the GPU too on a CUDA device), torch, the code
    that times forwards, the kernels each int4 layer runs (issue 30), the pair, the device, where the draft's head
    is read from (``models.load.draft_head``) and ``PROFILE_VERSION``."""
    from ..models.load import draft_head
    from ..quant.kernel_table import table_identity

    here = Path(__file__).parent
    code = [here / "forward_timer.py", here / "profiling.py", here.parent / "decode" / "forward.py",
            here.parent / "decode" / "lean_forward.py", table_identity()]
    return measured.measure_key("profiles", device=device, code=code, info=machine_info(), prefix="machine-",
                                extra={"pair": pair_name, "device": device, "version": PROFILE_VERSION,
                                       "draft_head": draft_head()})


def profile_key(pair_name: str, device: str) -> str:
    return profile_measure_key(pair_name, device).digest


def profile_path(key: str) -> Path:
    from ..paths import cache_root

    return cache_root() / "profiles" / f"machine-{key}.json"  # = profile_measure_key(...).path


def spell_profile_path(key: str, read_gb_per_s: float) -> Path:
    """Where the profile of another spell of this machine's memory bandwidth is kept (``profile_path`` holds the
    first spell measured)."""
    return profile_path(key).with_name(f"machine-{key}@{read_gb_per_s:.0f}GBs.json")


def other_spell_paths(key: str) -> list[Path]:
    """The files of ``key``'s profiles of spells other than the first (``spell_profile_path``), by name."""
    return sorted(profile_path(key).parent.glob(f"machine-{key}@*GBs.json"))


def spell_profiles(key: str) -> list[tuple[Path, MachineProfile]]:
    """The stored profiles of ``key``, the first spell measured first, then the others' (``other_spell_paths``),
    each of this ``PROFILE_VERSION`` and readable."""
    out = []
    for path in [profile_path(key), *other_spell_paths(key)]:
        try:
            prof = MachineProfile.load(path)
        except (OSError, ValueError, TypeError):
            continue
        if prof.version == PROFILE_VERSION:
            out.append((path, prof))
    return out


def pair_name_of(draft_spec: str, target_spec: str) -> str:
    """The name a pair's profile and acceptance are cached under."""
    return f"{draft_spec},{target_spec}"


def stored_profile(pair_name: str, device: str) -> Optional[MachineProfile]:
    """The stored profile of ``pair_name`` on ``device`` on this machine (None when none is, or it is of another
    ``PROFILE_VERSION``); nothing is measured."""
    try:
        prof = MachineProfile.load(profile_path(profile_key(pair_name, device)))
    except (OSError, ValueError, TypeError):
        return None
    return prof if prof.version == PROFILE_VERSION else None


def empty_profile(key: str, prefix_len: int = PREFIX_LEN) -> MachineProfile:
    return MachineProfile(key=key, machine=machine_info().to_dict(), prefix_len=prefix_len, ns=[], target={},
                          draft={}, other=[], created=time.strftime("%Y-%m-%d %H:%M:%S"))
