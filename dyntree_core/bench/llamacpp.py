"""llama.cpp as a peer in the speed bench: the same GGUF files, the same prompt token ids, the same thread
count, decode time only. Optional: needs ``llama-cpp-python`` (the ``llamacpp`` extra), which builds
llama.cpp from source with cmake; ``llama_cpp_status()`` says how to get it when it is absent.

Rows (all greedy, through llama-cpp-python's Python API on llama.cpp's C library):

* ``plain``: ``Llama.eval`` one token at a time, argmax of the last logits (numpy) between evals;
* ``ngram``: ``Llama.generate(temp=0)`` with llama-cpp-python's ``LlamaPromptLookupDecoding`` (prompt lookup:
  up to ``num_pred_tokens`` tokens copied after the longest matching n-gram, ``max_ngram_size`` 2);
* ``draft``: ``Llama.generate(temp=0)`` with a draft ``Llama`` on the draft GGUF (``DraftLlama``): greedy draft
  tokens until ``n_max`` or until the draft's probability of its token falls below ``p_min`` (llama.cpp's
  ``llama-speculative`` defaults: 16 and 0.75); llama-cpp-python verifies them by greedy sampling of the
  target's logits of every drafted position.

``t(n)``: ``Llama.eval`` of n tokens with logits for every row, on top of a 128-token prefix, the cache rolled
back after each (what a tree verification of n tokens costs; our t(n) is timed the same way).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

INSTALL_HINT = ("pip install 'dyntree[llamacpp]' (llama-cpp-python builds llama.cpp from source with cmake: "
                "set CMAKE_ARGS=\"-DGGML_NATIVE=ON\" for this CPU's instruction set; about 15 minutes on 2 cores)")


@dataclass(frozen=True)
class LlamaCppStatus:
    available: bool
    version: Optional[str]
    system_info: Optional[str]
    message: str

    def to_dict(self) -> dict:
        return {"available": self.available, "version": self.version, "system_info": self.system_info,
                "message": self.message}


def llama_cpp_status() -> LlamaCppStatus:
    """Whether ``llama_cpp`` imports here, its version and llama.cpp's build flags, or how to get it."""
    try:
        import llama_cpp
    except Exception as e:  # ImportError, or a shared library that fails to load
        return LlamaCppStatus(False, None, None, f"llama.cpp rows skipped: llama-cpp-python is not importable "
                                                 f"({type(e).__name__}: {e}); to get them: {INSTALL_HINT}")
    info = llama_cpp.llama_print_system_info()
    info = info.decode() if isinstance(info, bytes) else str(info)
    return LlamaCppStatus(True, getattr(llama_cpp, "__version__", "?"), info.strip(), "llama.cpp available")


def _logits_last(llm) -> np.ndarray:
    import llama_cpp

    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))


def open_llama(path: str, threads: int, n_ctx: int = 1024, draft_model: Any = None, logits_all: bool = False):
    from llama_cpp import Llama

    return Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                 n_ubatch=512, verbose=False, draft_model=draft_model, logits_all=logits_all, seed=0)


class DraftLlama:
    """A ``LlamaDraftModel``: greedy tokens of a second ``Llama`` (its cache kept in step with the target's
    tokens by their longest common prefix)."""

    def __init__(self, llm, n_max: int = 16, p_min: float = 0.75, logits=None):
        self.llm, self.n_max, self.p_min = llm, n_max, p_min
        self.logits = logits or _logits_last
        self.calls = 0
        self.drafted = 0

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        llm = self.llm
        ids = [int(t) for t in input_ids]
        have = llm.input_ids[:llm.n_tokens]
        n = 0
        limit = min(len(have), len(ids) - 1)  # the last token is always fed: its logits draft the first token
        while n < limit and have[n] == ids[n]:
            n += 1
        llm.n_tokens = n
        llm.eval(ids[n:])
        out: list[int] = []
        for _ in range(self.n_max):
            logits = self.logits(llm)
            tok = int(logits.argmax())
            if self.p_min > 0:
                z = logits - logits[tok]
                if 1.0 / float(np.exp(z).sum()) < self.p_min:
                    break
            out.append(tok)
            llm.eval([tok])
        self.calls += 1
        self.drafted += len(out)
        return np.array(out, dtype=np.intc)


def plain_decode(llm, prompt: Sequence[int], n_new: int, eos: Sequence[int] = ()) -> tuple[float, float, int]:
    """Greedy decoding of ``n_new`` tokens; (ms per decoded token after the first, tokens/step = 1, tokens)."""
    llm.reset()
    llm.eval(list(prompt))
    tok = int(_logits_last(llm).argmax())
    t0 = time.perf_counter()
    made = 1
    while made < n_new and tok not in eos:
        llm.eval([tok])
        tok = int(_logits_last(llm).argmax())
        made += 1
    dt = time.perf_counter() - t0
    return dt * 1e3 / max(made - 1, 1), 1.0, made


def generate_decode(llm, prompt: Sequence[int], n_new: int, eos: Sequence[int] = (),
                    draft: Optional[DraftLlama] = None, counter: Optional[list] = None) -> tuple[float, float, int]:
    """``Llama.generate(temp=0)`` with the ``Llama``'s draft model; (ms per token after the first, mean tokens per
    target forward, tokens). Forwards are counted by wrapping ``Llama.eval``."""
    evals = [0]
    orig = llm.eval

    def counted(tokens):
        evals[0] += 1
        return orig(tokens)

    llm.eval = counted
    try:
        llm.reset()
        if draft is not None:
            draft.llm.reset()
        made = 0
        t0 = None
        base = 0
        for tok in llm.generate(list(prompt), temp=0.0, top_k=1, reset=True):
            made += 1
            if made == 1:
                t0, base = time.perf_counter(), evals[0]
            if made >= n_new or tok in eos:
                break
        dt = time.perf_counter() - (t0 or time.perf_counter())
    finally:
        llm.eval = orig
    steps = max(evals[0] - base, 1)
    return dt * 1e3 / max(made - 1, 1), (made - 1) / steps, made


def forward_times(llm, n_values: Sequence[int] = (1, 16, 64), prefix: int = 128, repeats: int = 3,
                  vocab_lo: int = 100, vocab_hi: int = 20000) -> dict[str, float]:
    """``{str(n): ms}``: median time of ``Llama.eval`` of n tokens after a ``prefix``-token cache (rolled back
    after each). ``llm`` must have ``logits_all=True`` for every row's logits to be computed."""
    rng = np.random.default_rng(0)
    ids = rng.integers(vocab_lo, vocab_hi, prefix + max(n_values)).tolist()
    llm.reset()
    llm.eval(ids[:prefix])
    out = {}
    for n in n_values:
        times = []
        for _ in range(repeats + 1):
            llm.n_tokens = prefix
            t = time.perf_counter()
            llm.eval(ids[prefix:prefix + n])
            times.append(time.perf_counter() - t)
        out[str(n)] = statistics.median(times[1:]) * 1e3
    llm.n_tokens = prefix
    return out
