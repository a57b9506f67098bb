"""The machine profile: what a forward of n tokens costs here, per model and per precision.

Measured once and cached (JSON under ``$DYNTREE_CACHE/profiles/``), keyed by the CPU model and
flags (or GPU name), the thread count, the torch version, the pair and the candidate
precisions. The cost model of ``dyntree_core.planning.auto`` reads nothing else about the machine: an
AVX2 laptop, an AMX server and a GPU each get their own numbers.

Forwards run on top of a 128-token prefix: with a 32-token one, bf16 on an AVX2 CPU measured 201 ms
for one target token, but decoding after a 128-token prompt took 435 ms/token (its attention
cost grows with the context). Profiling is kept short: one warm-up forward, two timed
samples per size (the faster one is kept: interference only adds time), and a precision is
dropped for the larger sizes once it is more than ``prune_factor`` times slower than the best
precision at the same size (bf16 on AVX2: 11x at 16 tokens); dropped sizes are ``None`` and never
chosen.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from .hardware import _interp
from .machine import machine_info

PROFILE_VERSION = 3  # 2: forwards on a 128-token prefix (bf16 attention on AVX2 grows with the context)
# 3: timed on zero-weight shape twins of GGUF presets, prefix keys/values filled without a prefill
DEFAULT_NS: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
Progress = Callable[[str], None]
#: loads one model ("draft" | "target") at a precision
ModelLoader = Callable[[str, str], object]


@dataclass
class MachineProfile:
    """Median-free minimum-of-two forward times (seconds) per model and precision.

    Attributes:
        key: cache key (machine, threads, torch, pair, precisions).
        machine: ``machine_info().to_dict()`` of the machine that measured it.
        ns: tree sizes measured (tokens per forward).
        target / draft: ``{precision: [seconds or None per n]}``.
        verify: ``[seconds per n]`` forming probabilities of n vocabulary rows on the host (the
            engine's per-step work outside the forwards that grows with the tree).
        seconds: how long profiling took.
    """

    key: str
    machine: dict
    prefix_len: int
    ns: list[int]
    target: dict[str, list[Optional[float]]]
    draft: dict[str, list[Optional[float]]]
    verify: list[float]
    seconds: float = 0.0
    created: str = ""
    version: int = PROFILE_VERSION
    meta: dict = field(default_factory=dict)

    def _time(self, table: dict[str, list[Optional[float]]], precision: str, n: int) -> float:
        row = table.get(precision)
        if row is None:
            return math.inf
        pts = [(x, y) for x, y in zip(self.ns, row) if y is not None]
        if not pts or n > self.ns[-1] * 2 or (n > pts[-1][0] and len(pts) < len(self.ns)):
            return math.inf  # pruned sizes: never chosen
        return _interp([p[0] for p in pts], [p[1] for p in pts], n)

    def target_time(self, precision: str, n: int) -> float:
        return self._time(self.target, precision, n)

    def draft_time(self, precision: str, n: int) -> float:
        return self._time(self.draft, precision, n)

    def verify_time(self, n: int) -> float:
        return _interp(self.ns, self.verify, n)

    @property
    def max_tokens(self) -> int:
        return self.ns[-1]

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> "MachineProfile":
        return cls(**json.loads(Path(path).read_text()))


def profile_key(pair_name: str, device: str, precisions: Sequence[str], ns: Sequence[int]) -> str:
    mi = machine_info()
    hw = mi.gpu_name if (device.startswith("cuda") and mi.gpu_name) else f"{mi.cpu_model}|{','.join(mi.cpu_flags)}"
    raw = "|".join([hw, f"threads={torch.get_num_threads()}", torch.__version__, pair_name, device,
                    ",".join(precisions), ",".join(map(str, ns)), f"v{PROFILE_VERSION}"])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def profile_path(key: str) -> Path:
    from ..paths import cache_root

    return cache_root() / "profiles" / f"machine-{key}.json"


class _Timer:
    """Forwards of n new tokens on top of one prefilled cache (rolled back after each)."""

    def __init__(self, model, prefix_len: int):
        from ..decode.forward import causal_forward, new_cache
        from ..quant.apply import output_dim

        self.model, self.prefix_len = model, prefix_len
        self.vocab = output_dim(model)
        gen = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, self.vocab, (prefix_len + max(DEFAULT_NS) * 4,), generator=gen).tolist()
        self.cache = new_cache(model)
        # the prefix's keys and values are zeros: attention costs the same for any values, and a
        # real 128-token prefill of a bf16 model on an AVX2 CPU alone takes tens of seconds
        causal_forward(model, self.cache, self.tokens[:1], 0, logits_rows=[0])
        for layer in self.cache.layers:
            b, h, _, d = layer.keys.shape
            layer.keys = torch.zeros(b, h, prefix_len, d, dtype=layer.keys.dtype, device=layer.keys.device)
            layer.values = torch.zeros_like(layer.keys)
        self.device = model.get_input_embeddings().weight.device

    def once(self, n: int) -> float:
        from ..decode.forward import causal_forward
        from ..decode.kv import compact

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        causal_forward(self.model, self.cache, self.tokens[self.prefix_len:self.prefix_len + n], self.prefix_len)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        compact(self.cache, self.prefix_len, [])
        return dt

    def best(self, n: int, samples: int = 2) -> float:
        return min(self.once(n) for _ in range(samples))


def _verify_seconds(vocab: int, n: int) -> float:
    from ..sampling import probs_from_logits

    logits = torch.randn(n, vocab)
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        probs_from_logits(logits, 1.0).cpu().max(dim=-1)
        best = min(best, time.perf_counter() - t0)
    return best


def measure_profile(
    load: ModelLoader,
    precisions: Sequence[str],
    key: str,
    ns: Sequence[int] = DEFAULT_NS,
    prefix_len: int = 128,
    prune_factor: float = 2.0,
    progress: Optional[Progress] = None,
    draft_precisions: Optional[Sequence[str]] = None,
) -> MachineProfile:
    """Measure t(n) of both models at every precision (loading one model at a time)."""
    say = progress or (lambda _m: None)
    t_start = time.perf_counter()
    ns = sorted(set(int(n) for n in ns))
    tables: dict[str, dict[str, list[Optional[float]]]] = {"target": {}, "draft": {}}
    vocab = 0
    roles = (("target", list(precisions)), ("draft", list(draft_precisions or precisions)))
    total = sum(len(p) for _, p in roles)
    done = 0
    for role, precs in roles:
        for prec in precs:
            done += 1
            say(f"[{done}/{total}] loading the {role} at {prec} ...")
            model = load(role, prec)
            timer = _Timer(model, prefix_len)
            vocab = timer.vocab
            timer.once(1)  # warm-up (allocations, first-call paths)
            row: list[Optional[float]] = []
            for n in ns:
                best_here = [tab[i] for tab in tables[role].values() for i in [ns.index(n)] if tab[i] is not None]
                if row and row[-1] is None:
                    row.append(None)
                    continue
                t = timer.best(n, 3 if n <= 4 else 2)
                if best_here and t > prune_factor * min(best_here):
                    say(f"    {role} {prec} n={n}: {t * 1e3:.0f} ms, > {prune_factor:g}x the best precision: dropped from here on")
                    row.append(None)
                    continue
                row.append(t)
                say(f"    {role} {prec} n={n}: {t * 1e3:.1f} ms  ({time.perf_counter() - t_start:.0f} s)")
            tables[role][prec] = row
            del model, timer
    verify = [_verify_seconds(vocab, n) for n in ns]
    return MachineProfile(
        key=key, machine=machine_info().to_dict(), prefix_len=prefix_len, ns=ns,
        target=tables["target"], draft=tables["draft"], verify=verify,
        seconds=time.perf_counter() - t_start, created=time.strftime("%Y-%m-%d %H:%M:%S"),
    )


def load_or_measure_profile(load: ModelLoader, pair_name: str, device: str, precisions: Sequence[str],
                            ns: Sequence[int] = DEFAULT_NS, refresh: bool = False,
                            progress: Optional[Progress] = None,
                            draft_precisions: Optional[Sequence[str]] = None) -> MachineProfile:
    """The cached profile of this machine for the pair, measured on first use."""
    key = profile_key(pair_name, device, list(precisions) + ["|"] + list(draft_precisions or precisions), ns)
    path = profile_path(key)
    if path.is_file() and not refresh:
        try:
            prof = MachineProfile.load(path)
            if prof.version == PROFILE_VERSION:
                return prof
        except (OSError, ValueError, TypeError):
            pass
    prof = measure_profile(load, precisions, key, ns, progress=progress, draft_precisions=draft_precisions)
    prof.save(path)
    return prof
