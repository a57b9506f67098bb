"""Hardware awareness: measure what a target forward of n tokens and a draft forward cost on
this machine and choose Sequoia's (n, d) and every method's tree budget from those measurements
(the online threshold control that makes DySpec's tree track that budget is
``drafting.threshold_control``).

Profiles are cached per (model pair, device, dtype) as JSON under the DynTree cache directory.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import torch

DEFAULT_TARGET_NS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 768, 1024)
DEFAULT_DRAFT_NS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass
class HardwareProfile:
    """Measured forward costs (seconds, medians) on one machine.

    Attributes:
        key: what was profiled (pair, device, dtype).
        prefix_len: cached prefix length the forwards ran on top of.
        target_ns / target_seconds: target forward time for n new tree tokens, t(n).
        draft_ns / draft_seconds: draft forward time for m new tree nodes (one tree layer).
    """

    key: str
    prefix_len: int
    target_ns: list[int]
    target_seconds: list[float]
    draft_ns: list[int]
    draft_seconds: list[float]
    created: str = ""
    meta: dict = field(default_factory=dict)

    def target_time(self, n: int) -> float:
        return _interp(self.target_ns, self.target_seconds, n)

    def draft_time(self, m: int) -> float:
        return _interp(self.draft_ns, self.draft_seconds, m)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> "HardwareProfile":
        return cls(**json.loads(Path(path).read_text()))


def _interp(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear interpolation, linear extrapolation from the last two points."""
    if len(xs) == 1:
        return float(ys[0])
    if x <= xs[0]:
        return float(ys[0])
    for i in range(1, len(xs)):
        if x <= xs[i]:
            f = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return float(ys[i - 1] + f * (ys[i] - ys[i - 1]))
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return float(ys[-1] + slope * (x - xs[-1]))


def profile_key(pair_name: str, device: str, dtype: str) -> str:
    return f"{pair_name}|{device}|{dtype}".replace("/", "_")


def profile_cache_path(key: str) -> Path:
    from ..paths import cache_file

    return cache_file("profiles", key)


def time_forward(model, prefix_len: int, n: int, repeats: int = 3, warmup: int = 1) -> float:
    """Median seconds of one forward of ``n`` tree tokens (a chain-shaped causal block is as
    costly as any tree mask of the same size) on top of a ``prefix_len``-token cache."""
    from ..decode.forward import causal_forward, new_cache
    from ..decode.kv import compact

    from ..quant.apply import output_dim

    vocab = output_dim(model)
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (prefix_len,), generator=gen).tolist()
    block = torch.randint(0, vocab, (n,), generator=gen).tolist()
    cache = new_cache(model)
    if prefix_len:
        causal_forward(model, cache, prefix, 0, logits_rows=[prefix_len - 1])
    device = model.get_input_embeddings().weight.device
    samples = []
    for i in range(warmup + repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        causal_forward(model, cache, block, prefix_len)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            samples.append(time.perf_counter() - t0)
        compact(cache, prefix_len, [])
    return statistics.median(samples)


def profile_pair(
    draft,
    target,
    key: str,
    prefix_len: int = 128,
    target_ns: Iterable[int] = DEFAULT_TARGET_NS,
    draft_ns: Iterable[int] = DEFAULT_DRAFT_NS,
    repeats: int = 3,
    progress: Optional[Callable[[str], None]] = None,
) -> HardwareProfile:
    """Measure t(n) for the target and the per-layer cost of the draft on this machine."""
    say = progress or (lambda msg: None)
    tn, ts, dn, ds = [], [], [], []
    for n in target_ns:
        ts.append(time_forward(target, prefix_len, n, repeats))
        tn.append(int(n))
        say(f"target n={n}: {ts[-1] * 1e3:.1f} ms")
    for m in draft_ns:
        ds.append(time_forward(draft, prefix_len, m, repeats))
        dn.append(int(m))
        say(f"draft m={m}: {ds[-1] * 1e3:.1f} ms")
    return HardwareProfile(key, prefix_len, tn, ts, dn, ds, created=time.strftime("%Y-%m-%d %H:%M:%S"))


def load_or_profile(draft, target, key: str, refresh: bool = False, **kwargs) -> HardwareProfile:
    """The cached profile for ``key``, measured (and cached) when missing or ``refresh``."""
    path = profile_cache_path(key)
    if path.exists() and not refresh:
        return HardwareProfile.load(path)
    prof = profile_pair(draft, target, key, **kwargs)
    prof.save(path)
    return prof


# ---------------------------------------------------------------------------------------------
# choosing tree sizes


def seconds_per_token(target_seconds: float, other_seconds: float, tokens_per_step: float) -> float:
    """The speculative step's cost model: one target forward of the tree plus everything else in the
    step (draft forwards, construction, verification), divided by the tokens a step commits."""
    return (target_seconds + other_seconds) / tokens_per_step


@dataclass(frozen=True)
class TreeChoice:
    """A tree configuration and its predicted cost.

    ``seconds_per_token = (t(n) + draft_seconds) / expected_tokens``.
    """

    budget: int
    depth: int
    expected_tokens: float
    draft_seconds: float
    verify_seconds: float

    @property
    def seconds_per_token(self) -> float:
        return seconds_per_token(self.verify_seconds, self.draft_seconds, self.expected_tokens)


def sequoia_choose(
    expected_tokens: Callable[[int, int], float],
    level_sizes: Callable[[int, int], Sequence[int]],
    profile: HardwareProfile,
    budgets: Iterable[int],
    depths: Iterable[int],
) -> tuple[TreeChoice, list[TreeChoice]]:
    """Sequoia's optimizer: minimise ``(t(n) + Σ_levels draft(level width)) / G(n, d)``.

    Args:
        expected_tokens: G(n, d) of the DP-optimal tree (tokens per step, bonus included).
        level_sizes: number of nodes on each drafted level of that tree (drives the draft cost:
            one batched draft forward per level, the root's forward included).
        profile: measured t(n) and draft costs.
    Returns:
        (best, all candidates).
    """
    cands = []
    for n in budgets:
        for d in depths:
            g = expected_tokens(n, d)
            if not g or g <= 0 or math.isnan(g):
                continue
            draft_s = sum(profile.draft_time(max(1, w)) for w in level_sizes(n, d))
            cands.append(TreeChoice(n, d, g, draft_s, profile.target_time(n)))
    if not cands:
        raise ValueError("no feasible (budget, depth) pair")
    return min(cands, key=lambda c: c.seconds_per_token), cands


def choose_budget(
    measured: dict[int, tuple[float, float]],
    profile: HardwareProfile,
) -> tuple[int, dict[int, float]]:
    """Pick the budget with the lowest predicted latency per token for a dynamic method.

    Args:
        measured: ``{budget: (mean tokens per step, mean draft seconds per step)}`` from a
            short calibration run of the method at each candidate budget.
    Returns:
        (best budget, predicted seconds per token per budget).
    """
    pred = {b: (profile.target_time(b) + d) / tok for b, (tok, d) in measured.items() if tok > 0}
    if not pred:
        raise ValueError("no calibrated budget")
    return min(pred, key=pred.get), pred
