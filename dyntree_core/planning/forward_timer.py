"""The one timer every measurement of a forward in ``planning`` goes through, and the two callbacks
every measurement takes.

``ForwardTimer`` runs forwards of n new tokens on top of a cached prefix whose keys and values are
zeros (attention costs the same for any values), rolled back after each; ``time_forward`` stamps one
timed size with the time and the machine's load (``ForwardTiming``: the app's plain-decoding
reference). The machine profile (``profiling.measure_into``) times its rows with the same timer.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, ContextManager, Optional

import torch

from ..machine import machine_info
from ..measured import summarize

#: receives one line of progress
Progress = Callable[[str], None]
#: a context each timed measurement runs in (the app: a turn on its shared models)
Turn = Callable[[], ContextManager]


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

    def __init__(self, model, prefix_len: int, max_tokens: int):
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
        """The fastest of ``samples`` forwards (``measured.summarize``: their spread goes to the quiet check)."""
        return summarize([self.once(n) for _ in range(max(1, samples))]).min_s

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
    return ForwardTiming(summarize(xs).min_s, sum(xs) / len(xs), n, timer.prefix_len, len(xs),
                         time.strftime("%Y-%m-%d %H:%M:%S"), load, cpus)
