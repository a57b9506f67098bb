"""Pricing a run in a spell of the memory's bandwidth that has no profile of its own yet.

A host whose memory bandwidth jumps between spells (docs/CPU_KERNELS.md: the Zen 4 VM reads ~32 or 50-66 GB/s
on 2 threads, minutes at a time) keeps one profile per spell (``profiling.load_or_measure_profile``). Until the
app has measured the spell a Run starts in, the nearest spell's profile prices it (``MachineProfile.other_spell``).
Where that spell is slower, a forward of few rows is bound by reading its weights: it cannot take less than its
weight bytes at the probed bandwidth, while a forward of many rows is bound by arithmetic and keeps its time.
``floor_priced`` raises each row to that floor, so plain decoding and the draft's one-row levels are priced at
the memory's rate now, and a big tree's target forward is not. A faster spell keeps the slower spell's rows
(an upper bound: what its compute needs is not known from a memory-bound time).
"""

from __future__ import annotations

import copy
from typing import Optional

from .machine_profile import MachineProfile
from .profiling import ForwardBytes

#: the share of a read probe's bandwidth (``profiling.run_probe``) a one-row forward reads its weights at, at most,
#: where it is bound by them: on the Zen 4 VM's slow-spell profiles (probes 32.7-36.6 GB/s) weight bytes over t(1)
#: came to 0.80-0.93 of the probe for the target at int4 and 0.71-0.87 for the draft, and plain decoding beside
#: probes of 33.6-34.8 GB/s to 0.84-0.90 (docs/PLANNING.md, "A spell without a profile"). A floor is a bound the
#: forward cannot beat: the high end, not the median
FORWARD_READ_SHARE = 0.9


def weight_floor_s(nbytes: int, read_gb_per_s: float) -> float:
    """Seconds a forward that reads ``nbytes`` of weights takes at least when the memory reads ``read_gb_per_s``."""
    return nbytes / (FORWARD_READ_SHARE * read_gb_per_s * 1e9)


def floor_priced(profile: MachineProfile, read_gb_per_s: float, forward_bytes: ForwardBytes) -> MachineProfile:
    """A copy of ``profile`` (another spell's: measured at ``profile.read_gb_per_s``) that prices forwards in a
    spell probed at ``read_gb_per_s``: where that is slower, every time of a row whose weight bytes are known is
    raised to ``weight_floor_s`` of them; ``meta["floor_priced"]`` says at what bandwidth and which sizes were
    raised. The profile itself is unchanged, and so is a faster spell's pricing (``profile`` returned as it is)."""
    ref = profile.read_gb_per_s
    if not ref or not read_gb_per_s or read_gb_per_s >= ref:
        return profile
    out = copy.deepcopy(profile)
    raised: dict[str, list[int]] = {}
    for role in ("target", "draft"):
        table = getattr(out, role)
        for prec, row in table.items():
            nbytes = forward_bytes(role, prec)
            if not nbytes:
                continue
            floor = weight_floor_s(nbytes, read_gb_per_s)
            ns = [n for n, t in zip(out.ns, row) if t is not None and t < floor]
            if ns:
                table[prec] = [None if t is None else max(t, floor) for t in row]
                raised[f"{role}:{prec}"] = ns
    out.meta["floor_priced"] = {"read_gb_per_s": round(read_gb_per_s, 2), "share": FORWARD_READ_SHARE,
                                "raised": raised}
    return out


def floor_gb_per_s(profile: Optional[MachineProfile]) -> Optional[float]:
    """The probe ``floor_priced`` raised rows of ``profile`` for (None: it raised none)."""
    floor = profile.meta.get("floor_priced") if profile is not None else None
    return floor["read_gb_per_s"] if floor and floor["raised"] else None


def floor_text(profile: MachineProfile) -> str:
    """How ``floor_priced`` priced ``profile`` ('' where it did not raise a row)."""
    if floor_gb_per_s(profile) is None:
        return ""
    floor = profile.meta["floor_priced"]
    rows = ", ".join(f"{key.replace(':', ' ')} at {'/'.join(map(str, ns))} row{'s' if ns != [1] else ''}"
                     for key, ns in floor["raised"].items())
    return (f"forwards priced at no less than reading their weights at {floor['share']:.0%} of "
            f"{floor['read_gb_per_s']:.0f} GB/s ({rows})")
