"""The machine profile: what a forward of n tokens costs here, per model, precision and size, and
the one timer every measurement of a forward in ``planning`` goes through.

One profile per machine and pair: cached as JSON under ``cache_root()/profiles/``, keyed by the
machine's identity (the CPU model and flags, or the GPU name), the thread count, the torch version,
the pair and the device (``profile_key``). It holds a row of seconds per size for each (model,
precision) measured so far; a request for sizes or precisions it lacks measures only those and
writes them into the same file (``load_or_measure_profile``), so every planner on this machine reads
the same numbers: ``auto`` (its closed-form prices), ``tuning`` (auto's calibration of the methods it
cannot price in closed form) and the app.

Forwards run on top of a 128-token prefix whose keys and values are zeros (attention costs the same
for any values, and a real 128-token prefill of a bf16 model on an AVX2 CPU alone takes tens of
seconds); with a 32-token prefix, bf16 on an AVX2 CPU measured 201 ms for one target token, but
decoding after a 128-token prompt took 435 ms/token (its attention cost grows with the context).
Profiling is kept short: one warm-up forward, two or three timed samples per size, the fastest kept
(interference only adds time), and a precision is dropped for the larger sizes once it is more than
``prune_factor`` times slower than the best precision at the same size (bf16 on AVX2: 11x at 16
tokens). Sizes that were dropped or never measured have no time and are never priced
(``pricing.interpolate``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from contextlib import nullcontext
from typing import Callable, ContextManager, Optional, Sequence

import torch

from ..machine import machine_info
from .pricing import interpolate

PROFILE_VERSION = 5  # 2: forwards on a 128-token prefix (bf16 attention on AVX2 grows with the context)
# 3: timed on zero-weight shape twins of GGUF presets, prefix keys/values filled without a prefill
# 4: one profile per machine and pair; rows per (model, precision) merged as sizes are asked for
# 5: models on GGUF blocks run quant.lean_forward (shorter forwards than transformers' own)
DEFAULT_NS: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
PREFIX_LEN = 128
Progress = Callable[[str], None]
#: loads one model ("draft" | "target") at a precision
ModelLoader = Callable[[str, str], object]
#: a context each timed measurement runs in (the app: a turn on its shared models)
Turn = Callable[[], ContextManager]


class NotMeasuredYet(LookupError):
    """A profile or acceptance was asked for from the cache only, and the cache lacks it."""
ROLES = ("target", "draft")


@dataclass
class MachineProfile:
    """Minimum-of-samples forward times (seconds) per model, precision and size on one machine.

    Attributes:
        key: cache key (``profile_key``: machine, threads, torch, pair, device).
        machine: ``machine_info().to_dict()`` of the machine that measured it.
        prefix_len: cached (zero) prefix the forwards ran on top of.
        ns: sizes (tokens per forward) of the columns of every row, increasing.
        target / draft: ``{precision: [seconds or None per n]}``; None = not measured or dropped.
        verify: ``[seconds or None per n]`` forming probabilities of n vocabulary rows on the host
            (the engine's per-step work outside the forwards that grows with the tree).
        dropped: ``{"role:precision": n}``: that precision was dropped from size n on (slower than
            ``prune_factor`` x the best precision there); larger sizes are never measured for it.
        seconds: how long profiling took (all passes).
    """

    key: str
    machine: dict
    prefix_len: int
    ns: list[int]
    target: dict[str, list[Optional[float]]]
    draft: dict[str, list[Optional[float]]]
    verify: list[Optional[float]]
    dropped: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    created: str = ""
    version: int = PROFILE_VERSION
    meta: dict = field(default_factory=dict)

    def _time(self, table: dict[str, list[Optional[float]]], precision: str, n: float) -> float:
        row = table.get(precision)
        if row is None:
            return math.inf
        pts = [(x, y) for x, y in zip(self.ns, row) if y is not None]
        if not pts:
            return math.inf
        return interpolate([p[0] for p in pts], [p[1] for p in pts], n)

    def target_time(self, precision: str, n: float) -> float:
        return self._time(self.target, precision, n)

    def draft_time(self, precision: str, n: float) -> float:
        return self._time(self.draft, precision, n)

    def verify_time(self, n: float) -> float:
        return self._time({"": self.verify}, "", n)

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

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> "MachineProfile":
        return cls(**json.loads(Path(path).read_text()))


def profile_key(pair_name: str, device: str) -> str:
    mi = machine_info()
    hw = mi.gpu if (device.startswith("cuda") and mi.gpu) else f"{mi.cpu_model}|{','.join(mi.cpu_flags)}"
    from ..quant.kernel_table import table_identity  # the kernels each int4 layer runs (issue 30)

    raw = "|".join([hw, f"threads={torch.get_num_threads()}", torch.__version__, pair_name, device,
                    f"v{PROFILE_VERSION}", table_identity()])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def profile_path(key: str) -> Path:
    from ..paths import cache_root

    return cache_root() / "profiles" / f"machine-{key}.json"


# ------------------------------------------------------------------------------------- the timer
@dataclass(frozen=True)
class ForwardTiming:
    """One timed forward size, with when and under what load it was measured.

    Attributes:
        seconds: the fastest of ``samples`` forwards of ``tokens`` new tokens (what the machine can
            do: interference only adds time).
        mean_seconds: their mean (what a run under the same load pays per forward, on average).
        tokens: tokens per forward.
        prefix_len: cached (zero) context the forwards ran on top of.
        samples: timed forwards (after one warm-up).
        measured_at: local time of the measurement, ``YYYY-MM-DD HH:MM:SS``.
        load_1min: the 1-minute load average then (None where the OS has none).
        cpus: CPUs this process may run on.
    """

    seconds: float
    mean_seconds: float
    tokens: int
    prefix_len: int
    samples: int
    measured_at: str
    load_1min: Optional[float]
    cpus: int

    def load_text(self) -> str:
        if self.load_1min is None:
            return f"load unknown, {self.cpus} CPUs"
        return f"load {self.load_1min:.1f} on {self.cpus} CPUs"


class ForwardTimer:
    """Forwards of n new tokens on top of one cached prefix of zeros (rolled back after each).

    The only place ``planning`` times a model forward: the machine profile and the app's
    plain-decoding reference both use it.
    """

    def __init__(self, model, prefix_len: int, max_tokens: int = max(DEFAULT_NS)):
        from ..decode.forward import causal_forward, new_cache
        from ..quant.apply import output_dim

        self.model, self.prefix_len = model, max(1, int(prefix_len))
        self.vocab = output_dim(model)
        gen = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, self.vocab, (self.prefix_len + max(1, max_tokens),), generator=gen).tolist()
        self.cache = new_cache(model)
        # one real token creates each layer's cache; then the prefix's keys and values become zeros
        causal_forward(model, self.cache, self.tokens[:1], 0, logits_rows=[0])
        for layer in self.cache.layers:
            b, h, _, d = layer.keys.shape
            layer.keys = torch.zeros(b, h, self.prefix_len, d, dtype=layer.keys.dtype, device=layer.keys.device)
            layer.values = torch.zeros_like(layer.keys)
        self.device = model.get_input_embeddings().weight.device

    def once(self, n: int) -> float:
        from ..decode.forward import causal_forward
        from ..decode.kv import compact

        if n + self.prefix_len > len(self.tokens):
            self.tokens += self.tokens[self.prefix_len:] * (1 + n // max(1, len(self.tokens) - self.prefix_len))
        self._sync()
        t0 = time.perf_counter()
        causal_forward(self.model, self.cache, self.tokens[self.prefix_len:self.prefix_len + n], self.prefix_len)
        self._sync()
        dt = time.perf_counter() - t0
        compact(self.cache, self.prefix_len, [])
        return dt

    def best(self, n: int, samples: int = 2) -> float:
        return min(self.once(n) for _ in range(samples))

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def machine_load() -> tuple[Optional[float], int]:
    """``(1-minute load average or None, CPUs this process may run on)``."""
    try:
        load: Optional[float] = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    return load, machine_info().logical_cpus


def time_forward(model, prefix_len: int, n: int = 1, samples: int = 3) -> ForwardTiming:
    """``ForwardTiming`` of ``model``'s forward of ``n`` tokens after ``prefix_len`` cached tokens
    (one warm-up, then ``samples`` timed), stamped with the time and the machine's load."""
    with torch.inference_mode():
        timer = ForwardTimer(model, prefix_len, n)
        timer.once(n)
        xs = [timer.once(n) for _ in range(max(1, samples))]
    load, cpus = machine_load()
    return ForwardTiming(min(xs), sum(xs) / len(xs), n, timer.prefix_len, len(xs),
                         time.strftime("%Y-%m-%d %H:%M:%S"), load, cpus)


def _verify_seconds(vocab: int, n: int) -> float:
    from ..sampling import probs_from_logits

    logits = torch.randn(n, vocab)
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        probs_from_logits(logits, 1.0).cpu().max(dim=-1)
        best = min(best, time.perf_counter() - t0)
    return best


# ------------------------------------------------------------------------------------- profiling
def empty_profile(key: str, prefix_len: int = PREFIX_LEN) -> MachineProfile:
    return MachineProfile(key=key, machine=machine_info().to_dict(), prefix_len=prefix_len, ns=[], target={},
                          draft={}, verify=[], created=time.strftime("%Y-%m-%d %H:%M:%S"))


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
    prof.verify = remap(prof.verify)
    prof.ns = new


def measure_into(prof: MachineProfile, load: ModelLoader, wanted: dict[tuple[str, str], Sequence[int]],
                 prune_factor: float = 2.0, progress: Optional[Progress] = None, turn: Turn = nullcontext) -> int:
    """Measure what ``prof`` lacks of ``wanted`` (``{(role, precision): sizes}``), loading each model
    once, and write it into ``prof``. Returns the number of (role, precision) rows timed (0 when
    everything asked for was there). Each size is timed inside ``turn()`` (the app passes a turn on
    its shared models, so nothing is timed while a session decodes)."""
    say = progress or (lambda _m: None)
    todo = [(role, prec, prof.missing(role, prec, ns)) for (role, prec), ns in wanted.items()]
    todo = [t for t in todo if t[2]]
    all_ns = {n for ns in wanted.values() for n in ns}
    _widen(prof, all_ns)
    verify_todo = [n for n in sorted(all_ns) if prof.verify[prof.ns.index(n)] is None]
    if not todo and not verify_todo:
        return 0
    t_start = time.perf_counter()
    vocab = 0
    for done, (role, prec, sizes) in enumerate(todo, 1):
        say(f"[{done}/{len(todo)}] loading the {role} at {prec} ...")
        with turn(), torch.inference_mode():  # (loading is model work too: not beside a session's step)
            model = load(role, prec)
            timer = ForwardTimer(model, prof.prefix_len, max(sizes))
            vocab = timer.vocab
            timer.once(1)  # warm-up (allocations, first-call paths)
        with torch.inference_mode():
            table = getattr(prof, role)
            row = table.setdefault(prec, [None] * len(prof.ns))
            for n in sizes:
                i = prof.ns.index(n)
                others = [r[i] for p, r in table.items() if p != prec and r[i] is not None]
                with turn():
                    t = timer.best(n, 3 if n <= 4 else 2)
                if others and t > prune_factor * min(others):
                    say(f"    {role} {prec} n={n}: {t * 1e3:.0f} ms, > {prune_factor:g}x the best precision: "
                        "dropped from here on")
                    prof.dropped[f"{role}:{prec}"] = n
                    break
                row[i] = t
                say(f"    {role} {prec} n={n}: {t * 1e3:.1f} ms  ({time.perf_counter() - t_start:.0f} s)")
        del model, timer
    if verify_todo:
        with turn():
            if not vocab:
                from ..quant.apply import output_dim

                vocab = output_dim(load("target", next(iter(prof.target), "float32")))
            for n in verify_todo:
                prof.verify[prof.ns.index(n)] = _verify_seconds(vocab, n)
    prof.seconds += time.perf_counter() - t_start
    prof.machine = machine_info().to_dict()
    return len(todo)


def measure_profile(load: ModelLoader, precisions: Sequence[str], key: str, ns: Sequence[int] = DEFAULT_NS,
                    prefix_len: int = PREFIX_LEN, prune_factor: float = 2.0, progress: Optional[Progress] = None,
                    draft_precisions: Optional[Sequence[str]] = None) -> MachineProfile:
    """A new profile of both models at every precision and size (nothing read from or written to the
    cache; ``bench profile`` uses it)."""
    prof = empty_profile(key, prefix_len)
    wanted = {(role, p): ns for role, precs in (("target", precisions), ("draft", draft_precisions or precisions))
              for p in precs}
    measure_into(prof, load, wanted, prune_factor, progress)
    return prof


def load_or_measure_profile(load: ModelLoader, pair_name: str, device: str, precisions: Sequence[str],
                            ns: Sequence[int] = DEFAULT_NS, refresh: bool = False,
                            progress: Optional[Progress] = None,
                            draft_precisions: Optional[Sequence[str]] = None,
                            target_ns: Optional[Sequence[int]] = None, measure: bool = True,
                            turn: Turn = nullcontext) -> MachineProfile:
    """This machine's profile of the pair with at least ``ns`` for both models at their precisions
    (and ``target_ns`` too for the target): read from the cache, and what it lacks measured once and
    written back. ``refresh`` measures everything asked for anew; ``measure=False`` raises
    ``NotMeasuredYet`` instead of measuring; ``turn`` as in ``measure_into``."""
    key = profile_key(pair_name, device)
    path = profile_path(key)
    prof: Optional[MachineProfile] = None
    if path.is_file() and not refresh:
        try:
            prof = MachineProfile.load(path)
            if prof.version != PROFILE_VERSION:
                prof = None
        except (OSError, ValueError, TypeError):
            prof = None
    prof = prof or empty_profile(key)
    t_ns = sorted(set(ns) | set(target_ns or ()))
    wanted = {("target", p): t_ns for p in precisions}
    wanted.update({("draft", p): list(ns) for p in (draft_precisions or precisions)})
    if not measure and (refresh or any(prof.missing(role, p, ns) for (role, p), ns in wanted.items())
                        or any(n not in prof.ns or prof.verify[prof.ns.index(n)] is None for n in t_ns)):
        raise NotMeasuredYet(f"the machine profile of {pair_name} on {device} is not measured yet")
    if measure_into(prof, load, wanted, progress=progress, turn=turn) or not path.is_file() or refresh:
        prof.save(path)
    return prof
