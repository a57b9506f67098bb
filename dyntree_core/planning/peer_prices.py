"""Peers' rows priced on this machine: what a peer (transformers' assisted generation, run in the app's
Compare tab) measured against our plain decoding in the same comparison, kept per machine and pair, and priced
at this machine's profile so ``auto`` can say where it stands.

A peer's speed is stored as a ratio to our plain decoding measured beside it (same prompt, seed, tokens and
page), not as seconds: both ran under the same load, so the ratio holds where the seconds would not (on a
2-core machine the app's own page slows every run in it ~1.4x). Its price is that ratio times the profile's
plain decoding at the precision it was measured against.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from .. import measured
from .machine_profile import MachineProfile
from .pricing import autoregressive_candidate


@dataclass(frozen=True)
class PeerRatio:
    """One peer measured beside our plain decoding.

    Attributes:
        label: the peer and its precisions ("transformers assisted @ target int4, draft int4").
        plain_precision: the target precision of the plain decoding it was measured against.
        ratio: its seconds per token over that plain decoding's (> 1: slower), prefill included in both.
        tokens: tokens the peer generated.
        written: when it was measured.
    """

    label: str
    plain_precision: str
    ratio: float
    tokens: int
    written: str


@dataclass(frozen=True)
class PeerPrice:
    """A peer priced at this machine's profile: ``ratio`` x the profile's plain decoding at ``plain_precision``."""

    ratio: PeerRatio
    s_per_token: float

    def text(self) -> str:
        r = self.ratio
        return (f"{r.label} priced {self.s_per_token * 1e3:.0f} ms/token ({r.ratio:.2f}x our plain decoding at "
                f"{r.plain_precision} beside it in Compare, {r.written[:10]})")


def _key(pair: str, device: str) -> measured.MeasureKey:
    import transformers

    return measured.measure_key("peer-ratios", device=device, extra={"pair": pair},
                                versions={"transformers": transformers.__version__})


def load_peer_ratios(pair: str, device: str) -> list[PeerRatio]:
    """Every peer measured for ``pair`` on this machine's ``device`` (latest per label)."""
    return _stored(_key(pair, device))


def _stored(key: measured.MeasureKey) -> list[PeerRatio]:
    value = measured.load(key)
    if not isinstance(value, dict):
        return []
    out = []
    for d in value.values():
        try:
            out.append(PeerRatio(**d))
        except TypeError:  # (a row written by another version of this record)
            continue
    return out


def record_peer_ratio(pair: str, device: str, label: str, plain_precision: str, peer_s_per_token: float,
                      plain_s_per_token: float, tokens: int) -> Optional[PeerRatio]:
    """Keep ``label``'s ratio to our plain decoding measured beside it (None: nothing to divide)."""
    if not (peer_s_per_token > 0 and plain_s_per_token > 0 and tokens > 0):
        return None
    row = PeerRatio(label, plain_precision, peer_s_per_token / plain_s_per_token, int(tokens),
                    time.strftime("%Y-%m-%d %H:%M"))
    key = _key(pair, device)
    rows = {r.label: asdict(r) for r in _stored(key)}
    rows[label] = asdict(row)
    # two runs side by side under one load: the ratio is what was measured, quiet or not
    measured.store(key, rows, measured.Verdict(quiet=True))
    return row


def price_peers(ratios: Sequence[PeerRatio], profile: MachineProfile) -> list[PeerPrice]:
    """Each ratio priced at ``profile``'s plain decoding at its precision (skipped where the profile has no
    row at that precision), fastest first."""
    out = []
    for r in ratios:
        plain_s = autoregressive_candidate(profile, r.plain_precision).seconds_per_token
        if math.isfinite(plain_s):
            out.append(PeerPrice(r, r.ratio * plain_s))
    return sorted(out, key=lambda p: p.s_per_token)


def peer_sentence(prices: Sequence[PeerPrice], predicted_s_per_token: float) -> str:
    """What the peers' prices say against a run predicted at ``predicted_s_per_token`` ('' without peers)."""
    if not prices:
        return ""
    faster = [p for p in prices if p.s_per_token < predicted_s_per_token]
    parts = "; ".join(p.text() for p in prices)
    run = f"this run (predicted {predicted_s_per_token * 1e3:.0f} ms/token)"
    if faster:
        return f"peers: {parts}: {faster[0].ratio.label} is priced faster than {run}: run it in the Compare tab"
    return f"peers: {parts}: slower than {run}"
