"""The decoding loop: prompt -> prefill -> steps -> StepTraces.

A tree step (``_tree_step``) is the papers' step in order: draft a ``TokenTree`` -> node order and
attention metadata -> one target forward over the tree -> verification -> drafter feedback ->
commit (the tokens, the target's and the draft's KV caches together). The autoregressive baseline
shares the loop (prefill, commit rules, traces) but its step (``_ar_step``) is one causal target
forward of the last token and a sample: no tree, no draft model, no verifier."""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Generator, Iterator, Optional, Sequence

import numpy as np
import torch

from .. import interrupt
from ..config import ConfigError, DecodeConfig
from .draft_source import ModelDraftSource, NoModelSource
from .forward import causal_forward, masked_forward
from .kv import cache_length, compact, new_cache
from . import host
from .device_step import FetchedRows, read_greedy_step
from .timer import StepTimer
from .prepared import PreparedPair, model_vocab_size
from .plain_probes import PROBE, probe_due
from ..sampling import probs_from_logits
from ..step_price import StepShape
from ..trace import NodeStatus, PrefillProgress, StepTrace, TokenProvenance
from ..tree import BLOCK_SIZES, ORDERS, TokenTree, count_nonzero_blocks
from ..verify.common import sample_index
from ..verify.rows import DenseRows, LogitRows

if TYPE_CHECKING:
    from ..drafting.repeats import RepeatDrafter



__all__ = ["SpeculativeDecoder"]


log = logging.getLogger(__name__)
_logged: set[str] = set()


def _log_once(message: str) -> None:
    """Why graph steps were asked for (the CUDA default) but do not run: once per process and reason."""
    if message not in _logged:
        _logged.add(message)
        log.warning("%s", message)


@dataclass
class _Step:
    """Mutable per-generation state (kept out of the decoder so it is reentrant per call)."""

    committed: list[int]
    prompt_len: int
    draft_cached: int
    max_new_tokens: int
    step: int = 0
    produced: int = 0
    tree_steps: int = 0  # tree steps decoded, the tokens they committed and their price (DecodeConfig.fallback)
    tree_tokens: int = 0
    tree_priced_s: float = 0.0
    plain: bool = False  # the run fell back to plain decoding
    #: the text's own repeats, where priced to pay (inside the run, then after the fallback), and their verifier
    #: (greedy at T = 0, else point mass: the trees are deterministic)
    repeats: Optional["RepeatDrafter"] = None
    repeat_verifier: Any = None
    #: a plain probe is due (``plain_probes.probe_due``); a step that verifies the text's repeats puts it off
    probe_pending: bool = False

#: at most this many prompt tokens per prefill forward: long prompts report progress and keep peak
#: activation memory bounded; the KV cache is the same as one forward's
PREFILL_CHUNK = 512
#: the first chunk of each model (it measures the model's prefill rate on this machine) ...
PREFILL_FIRST = 32
#: ... and every later chunk is sized to take about this long, so a Stop (checked between chunks) acts
#: within about this much time whatever the machine (chunks of fixed tokens took 29 s on a slow CPU)
PREFILL_CHUNK_SECONDS = 0.5
#: a forward of mostly fixed cost grows its chunks by at most this factor per chunk (``prefill_chunks``)
FIXED_COST_GROWTH = 4


def prefill_chunks(tokens: int) -> Generator[int, tuple[float, int], None]:
    """Chunk sizes for a prefill of ``tokens`` prompt tokens: ``PREFILL_FIRST`` first, then after each
    chunk (``send`` its ``(seconds, tokens)``) the size that takes ``PREFILL_CHUNK_SECONDS`` at the rate
    just measured, within [1, ``PREFILL_CHUNK``].

    A forward whose time hardly depends on its tokens (a target streamed from host memory: ~2.5 s for
    1 or 512 tokens) cannot be cut to that time; the rate rule shrank such a prefill to one token per
    forward (128 tokens: ~100 streamed forwards). So when the last two chunks, of different sizes, both
    took over twice the chunk time and a line through them has a fixed part ``a`` over half of it, the
    next size is ``a / b`` tokens (``b`` per token: the tokens' part at most the fixed part), at most
    ``FIXED_COST_GROWTH`` times the largest chunk so far (a timing spike on a fast model mis-fits a line
    once; it costs one larger chunk, not a ``PREFILL_CHUNK``-token one)."""
    size = max(1, min(PREFILL_FIRST, PREFILL_CHUNK, tokens))
    last: Optional[tuple[int, float]] = None  # the previous chunk: (tokens, seconds)
    largest = size
    while True:
        seconds, fed = yield size
        fed = max(fed, 1)
        size = max(1, min(PREFILL_CHUNK, int(PREFILL_CHUNK_SECONDS / max(seconds / fed, 1e-12))))
        if last is not None and last[0] != fed and min(seconds, last[1]) > 2 * PREFILL_CHUNK_SECONDS:
            b = (seconds - last[1]) / (fed - last[0])
            a = seconds - b * fed
            if a > PREFILL_CHUNK_SECONDS / 2:
                grown = PREFILL_CHUNK if b <= 0 else int(a / b)
                size = max(fed, min(PREFILL_CHUNK, FIXED_COST_GROWTH * largest, grown))
        last = (fed, seconds)
        largest = max(largest, size)


class SpeculativeDecoder:
    """Speculative decoding with a draft and a target HF causal LM.

    The models are prepared once per settings (``prepared.PreparedPair``: device, dtype/precision,
    attention dispatch, offload) and only borrowed by decoders: ``SpeculativeDecoder(draft, target,
    config)`` reuses the preparation those model objects already have when ``config`` matches it,
    ``SpeculativeDecoder.on_pair(pair, config)`` borrows a given pair. Each ``generate`` call owns
    its KV caches, RNGs and drafter state, so calls are independent and seeded.
    """

    def __init__(self, draft, target, config: DecodeConfig, eos_token_id: Optional[int | Sequence[int]] = None,
                 on_verify: Optional[Callable[[TokenTree, LogitRows, Any], None]] = None):
        """``on_verify(tree, target_rows, result)`` is called after each tree step's verification
        (benchmarks that evaluate other verifiers on the same tree use it; ``target_rows`` forms any
        node's target distribution on demand)."""
        if not isinstance(config, DecodeConfig):
            raise TypeError("config must be a DecodeConfig")
        self._borrow(PreparedPair.for_models(draft, target, config), config, eos_token_id, on_verify)

    @classmethod
    def on_pair(cls, pair: PreparedPair, config: DecodeConfig, eos_token_id: Optional[int | Sequence[int]] = None,
                on_verify: Optional[Callable[[TokenTree, LogitRows, Any], None]] = None) -> "SpeculativeDecoder":
        """A decoder borrowing ``pair`` (whose settings must match ``config``)."""
        if not isinstance(config, DecodeConfig):
            raise TypeError("config must be a DecodeConfig")
        self = cls.__new__(cls)
        self._borrow(pair, config, eos_token_id, on_verify)
        return self

    def _borrow(self, pair: PreparedPair, config: DecodeConfig, eos_token_id, on_verify) -> None:
        from ..attention.hf_backend import BACKEND_KWARG, check_backend, device_reason, kernel_runs

        pair.check(config)
        self.pair = pair
        self.config = config
        self.device = pair.device
        self.draft = pair.draft
        self.target = pair.target
        self.offload = pair.offload
        backend = config.attention
        if backend == "triton":
            try:
                check_backend(backend)
            except RuntimeError as e:
                raise ConfigError(f"attention='triton': {e}") from None
            reason = device_reason(pair.device)
            if reason is not None:
                raise ConfigError(f"attention='triton' cannot run here: {reason}; use attention='auto' or 'torch'")
        self.attn_kwargs = {BACKEND_KWARG: backend}
        self.kernel = kernel_runs(backend, self.device)
        #: steps run as fixed-shape programs over device state (``graph_step``) when the models and the
        #: configuration allow it (``graph_reason``): the default on CUDA; settable (CPU tests, A/B benches)
        self.graph_steps = self.device.type == "cuda"
        #: the padded device-side drafting of greedy dyspec_greedy / chain through the HF forward
        #: (``drafting.device``, one read per step): opt-in, for models the graph steps cannot take
        self.device_side = False
        #: told of each program compiled for a bucket (``compiled.CompileEvent``): the app shows it
        self.on_compile = None
        #: how the graph steps' programs run (None: ``compiled.CompileMode.for_device``)
        self.compile_mode = None
        #: graph steps forward every draft level of the envelope, as they did before DySpec's stop at its
        #: tree's depth (``GraphStepper.draft``): same trees; the A/B of ``bench gpu`` and the tests
        self.draft_every_level = False
        #: T > 0 graph steps verify token level and point mass on the device (``verify.device``); False: on
        #: the host from the read rows, as Traversal does (the A/B of ``bench gpu``)
        self.device_verify = True
        #: after a fallback (``DecodeConfig.fallback``) verify the text's own repeats where they are priced to pay
        #: (``drafting.repeats``); False: plain steps only, as before them (the A/B of ``bench speed --fallback-ab``)
        self.repeats_after_fallback = True
        #: inside a draft-model run whose tree steps were priced (``FallbackPrice.tree_s_per_token``), verify the
        #: text's own repeats instead of a tree step where they are priced to beat it (``drafting.repeats``; eager
        #: steps only); False: every step drafts, as before them (the A/B of ``bench speed --repeats-ab``)
        self.repeats_in_run = True
        #: time plain decoding inside the run: a plain step at ``plain_probes.probe_due`` steps of an eager tree run
        #: (the app's Live runs: their speed over plain decoding; ``probes_plain``)
        self.plain_probes = False
        #: an eager step drafts no more levels than its run can commit (``Drafter.depth``: the tokens left less the
        #: bonus); False: ``cfg.depth`` to the last step, as before (the A/B of ``scripts/levels_left_ab.py``)
        self.cap_levels = True
        self.verifier_name = config.resolved_verifier()
        self.on_verify = on_verify
        self.vocab_size = model_vocab_size(self.target)
        self.max_context = int(getattr(self.target.config, "max_position_embeddings", 1 << 30))
        if eos_token_id is None:
            eos_token_id = getattr(self.target.generation_config, "eos_token_id", None)
            if eos_token_id is None:
                eos_token_id = getattr(self.target.config, "eos_token_id", None)
        if eos_token_id is None:
            self.eos_ids: frozenset[int] = frozenset()
        elif isinstance(eos_token_id, int):
            self.eos_ids = frozenset({eos_token_id})
        else:
            self.eos_ids = frozenset(int(e) for e in eos_token_id)

    # ------------------------------------------------------------------ public API
    def generate(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        max_new_tokens: int,
        stop_event: Optional[threading.Event] = None,
        seed: Optional[int] = None,
        prefill_progress: bool = False,
    ) -> Iterator[StepTrace | PrefillProgress]:
        """Decode up to ``max_new_tokens`` new tokens, yielding one ``StepTrace`` per step.

        Args:
            input_ids: the prompt, ``[L]`` or ``[1, L]`` token ids (L >= 1).
            max_new_tokens: > 0; exactly this many tokens are produced unless EOS, the model
                context or ``stop_event`` ends the run first.
            stop_event: set it (from another thread) to stop after the current step, or after the
                current prefill chunk (then the iterator ends without a step).
            seed: RNG seed for this call (default ``config.seed``).
            prefill_progress: also yield a ``PrefillProgress`` before the prefill and after each
                chunk (``prefill_chunks``: about ``PREFILL_CHUNK_SECONDS`` each, at most
                ``PREFILL_CHUNK`` tokens; target and draft chunks both count towards ``total``), so a
                caller can report progress, stop, pause or let others use the models between chunks.
        """
        prompt = self._validate(input_ids, max_new_tokens)
        self.pair.check(self.config)
        steps = self._run(prompt, max_new_tokens, stop_event, self.config.seed if seed is None else int(seed))
        return steps if prefill_progress else (s for s in steps if isinstance(s, StepTrace))

    def generate_ids(
        self, input_ids: Sequence[int] | torch.Tensor, max_new_tokens: int, seed: Optional[int] = None
    ) -> list[int]:
        """The new token ids only (exactly ``max_new_tokens`` unless EOS or context end)."""
        out: list[int] = []
        for trace in self.generate(input_ids, max_new_tokens, seed=seed):
            out.extend(c.token_id for c in trace.committed)
        return out

    # ------------------------------------------------------------------ validation
    def _validate(self, input_ids, max_new_tokens: int) -> list[int]:
        if isinstance(input_ids, torch.Tensor):
            if input_ids.ndim == 2:
                if input_ids.shape[0] != 1:
                    raise ConfigError(f"batch size must be 1, got input_ids of shape {tuple(input_ids.shape)}")
                input_ids = input_ids[0]
            prompt = [int(x) for x in input_ids.tolist()]
        else:
            prompt = [int(x) for x in input_ids]
        if not prompt:
            raise ConfigError("the prompt is empty: give at least one token")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ConfigError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        if len(prompt) >= self.max_context:
            raise ConfigError(
                f"the prompt has {len(prompt)} tokens but the model context is {self.max_context}: "
                "shorten the prompt"
            )
        if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise ConfigError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        return prompt

    # ------------------------------------------------------------------ the loop
    def _prefill(self, feeds: list[Callable[[list[int], int], Any]], prompt: list[int],
                 stop_event: Optional[threading.Event] = None) -> Iterator[PrefillProgress]:
        """Feed ``prompt[:-1]`` through each ``feed(chunk, start)`` (one per model) in chunks sized by
        time (``prefill_chunks``), yielding the progress before the first chunk and after each; it
        ends early (with ``stopped=True`` progress) when ``stop_event`` is set: between two chunks, or within a
        chunk at the CPU forwards' next layer (``interrupt``; that chunk's tokens do not count as done)."""
        body = prompt[:-1]
        total = len(body) * len(feeds)
        done = 0
        t0 = time.perf_counter()
        yield PrefillProgress(0, total, 0.0)
        for feed in feeds:
            chunks = prefill_chunks(len(body))
            start, size = 0, next(chunks)
            while start < len(body):
                if stop_event is not None and stop_event.is_set():
                    yield PrefillProgress(done, total, time.perf_counter() - t0, stopped=True)
                    return
                chunk = body[start:start + size]
                t = time.perf_counter()
                try:
                    with interrupt.stops_on(stop_event):  # the CPU forwards end at their next layer
                        feed(chunk, start)
                except interrupt.Interrupted:
                    yield PrefillProgress(done, total, time.perf_counter() - t0, stopped=True)
                    return
                size = chunks.send((time.perf_counter() - t, len(chunk)))
                start += len(chunk)
                done += len(chunk)
                yield PrefillProgress(done, total, time.perf_counter() - t0)

    def _hf_feed(self, model, cache) -> Callable[[list[int], int], Any]:
        return lambda chunk, start: causal_forward(model, cache, chunk, start, logits_rows=[len(chunk) - 1],
                                                   attn_kwargs=self.attn_kwargs)

    def _stepper(self, tokens: int, draft_only: bool = False):
        """The pair's graph stepper for this configuration and a run of ``tokens`` committed tokens
        (capacities in buckets, so runs of similar lengths share compiled programs); ``draft_only``: the
        draft's programs only (``draft_graph_reason``)."""
        from .compiled import CompileMode
        from .graph_step import Envelope, GraphStepper, capacity_bucket

        cfg = self.config
        env = None if cfg.method == "autoregressive" else Envelope.of(cfg)
        mode = self.compile_mode or CompileMode.for_device(self.device)
        capacity = capacity_bucket(tokens)
        draft_t = cfg.effective_draft_temperature
        verifier, on_device = self.verifier_name, self.device_verify
        target = None if draft_only else self.target
        return self.pair.stepper(("graph", env, capacity, cfg.temperature, cfg.top_p, draft_t, mode, verifier, on_device,
                                  draft_only),
                                 lambda: GraphStepper(self.draft, target, env, capacity, cfg.temperature, cfg.top_p,
                                                      mode, draft_t, verifier, on_device))

    def graph_reason(self) -> Optional[str]:
        """Why this decoder's steps do not run as fixed-shape programs (None: they do)."""
        from .graph_step import graph_reason

        if not self.graph_steps:
            return "graph steps are off (graph_steps=False; the default off the GPU)"
        if self.on_verify is not None:
            return "an on_verify consumer reads the target's logits"
        return graph_reason(self.config, self.draft, self.target, self.offload is not None)

    def probes_plain(self) -> bool:
        """Whether this decoder's runs time plain decoding inside them (``plain_probes``): asked for, a tree method,
        every step eager (graph steps keep plain decoding timed beside the run)."""
        return (self.plain_probes and self.config.method != "autoregressive" and self.graph_reason() is not None
                and self.draft_graph_reason() is not None)

    def draft_graph_reason(self) -> Optional[str]:
        """Why a step whose target runs eagerly (it streams from host memory) cannot draft with the draft's
        fixed-shape programs (None: it does: ``GraphStepper`` without a target, a few graph replays per step
        where the eager draft forwards each level through transformers)."""
        from .dense_forward import dense_reason
        from .graph_step import Envelope

        if not self.graph_steps:
            return "graph steps are off"
        if self.offload is None:
            return "the target is resident (the whole step runs as programs, or eagerly: graph_reason)"
        if Envelope.of(self.config) is None:  # (plain decoding has none)
            return f"method {self.config.method!r} has no fixed envelope"
        reason = dense_reason(self.draft)
        return None if reason is None else f"draft: {reason}"

    def _run(self, prompt: list[int], max_new_tokens: int, stop_event,
             seed: int) -> Iterator[StepTrace | PrefillProgress]:
        cfg = self.config
        t_start = time.perf_counter()
        gen = torch.Generator().manual_seed(seed)
        rng = np.random.default_rng(seed)
        is_ar = cfg.method == "autoregressive"
        drafter = None
        verifier = None
        if not is_ar:
            from ..drafting import make_drafter
            from ..verify import make_verifier

            drafter = make_drafter(cfg)
            drafter.reset(prompt)
            verifier = make_verifier(self.verifier_name)
        from ..methods import method_spec

        graph = None
        reason = self.graph_reason()
        if reason is not None and self.graph_steps:
            _log_once(f"steps run eagerly: {reason}")
        device_gen = None
        gdraft = None  # the draft's programs, for an eagerly forwarded target
        if reason is not None and not is_ar and self.draft_graph_reason() is None:
            gdraft = self._stepper(min(len(prompt) + max_new_tokens, self.max_context), draft_only=True)
            if not cfg.greedy:
                device_gen = torch.Generator(device=self.device).manual_seed(seed)
            gdraft.begin(self.on_compile)
            _log_once("the draft runs as fixed-shape programs; the target (streamed) eagerly")
        if reason is None:
            graph = self._stepper(min(len(prompt) + max_new_tokens, self.max_context))
            if not is_ar and not cfg.greedy:  # T > 0 drafting draws its uniforms on the device
                device_gen = torch.Generator(device=self.device).manual_seed(seed)
            graph.begin(self.on_compile)
            t_cache = d_cache = None
            feeds = [lambda chunk, start: graph.prefill("target", chunk, start)]
            if graph.df is not None:
                feeds.append(lambda chunk, start: graph.prefill("draft", chunk, start))
        else:
            # sized for the whole run: prompt, new tokens and the largest tree in flight (the draft's
            # forwarded nodes may exceed the kept tree); a cache only grows if a drafter exceeds this
            tree_cap = 0 if is_ar else max(cfg.budget, cfg.depth + 1, cfg.width * cfg.depth + 1)
            if cfg.fallback is not None and not is_ar:  # the repeat trees inside the run and after a fallback
                from ..drafting.repeats import REPEAT_BUDGET, REPEAT_IN_RUN_BUDGET

                tree_cap = max(tree_cap, REPEAT_BUDGET, REPEAT_IN_RUN_BUDGET)
            capacity = len(prompt) + max_new_tokens + tree_cap
            t_cache = new_cache(self.target, capacity)
            if cfg.method in ("dyspec_greedy", "chain"):  # device-side drafting forwards padded levels
                tree_cap = max(tree_cap, 1 + (cfg.depth - 1) * (cfg.budget - 1), cfg.depth)
            d_cache = (new_cache(self.draft, capacity + tree_cap)
                       if not is_ar and method_spec(cfg.method).uses_draft_model and gdraft is None else None)
            feeds = [self._hf_feed(self.target, t_cache)] + ([self._hf_feed(self.draft, d_cache)]
                                                             if d_cache is not None else [])
            if gdraft is not None:
                feeds.append(lambda chunk, start: gdraft.prefill("draft", chunk, start))
        try:
            if len(prompt) > 1:
                for progress in self._prefill(feeds, prompt, stop_event):
                    yield progress
                    if progress.stopped:
                        return  # stopped during the prefill: no step was decoded
            stepper = graph if graph is not None else gdraft
            if stepper is not None:
                stepper.start(prompt)
                todo = stepper.to_compile()
                if todo:
                    n = len(prompt) - 1
                    yield PrefillProgress(n * len(feeds), n * len(feeds), time.perf_counter() - t_start,
                                          compiling=f"compiling the step programs for this {self.device.type.upper()}: "
                                                    + ", ".join(todo) + " (once per size bucket; minutes)")
            self._sync()
            state = _Step(committed=list(prompt), prompt_len=len(prompt), draft_cached=len(prompt) - 1,
                          max_new_tokens=max_new_tokens)
            if graph is None and gdraft is None and not is_ar:
                self._repeats_in_run(state)
            probes = self.probes_plain()  # (only where every step is eager: graph and gdraft are None)
            while True:
                self.pair.check(self.config)  # a pair closed since the last step (the app released it) is refused
                t_step = time.perf_counter()
                state.probe_pending = state.probe_pending or (probes and probe_due(state.step))
                if graph is not None:
                    trace, timer = (self._graph_ar_step(state, graph, rng) if is_ar
                                    else self._graph_tree_step(state, graph, verifier, rng, device_gen))
                elif state.repeats is not None and self._repeat_pays(state):
                    trace, timer = self._tree_step(state, t_cache, None if state.plain else d_cache, state.repeats,
                                                   state.repeat_verifier, gen, rng, repeats=True)
                    trace.method, trace.verifier = state.repeats.name, state.repeat_verifier.name
                elif is_ar or state.plain:
                    trace, timer = self._ar_step(state, t_cache, rng, state.repeats or drafter)
                elif probes and (state.probe_pending or state.max_new_tokens - state.produced == 1):
                    trace, timer = self._ar_step(state, t_cache, rng, drafter)
                    trace.draft_source = PROBE
                    state.probe_pending = False
                else:
                    trace, timer = self._tree_step(state, t_cache, d_cache, drafter, verifier, gen, rng, gdraft,
                                                   device_gen)
                    trace.fallback = self._fall_back(state, trace)
                if stop_event is not None and stop_event.is_set() and trace.finish_reason is None:
                    trace.finish_reason = "stopped"
                self._sync()  # the step's last wait: its phases' CUDA events are complete after it
                trace.timings = timer.timings()
                now = time.perf_counter()
                trace.step_seconds = now - t_step
                trace.elapsed = now - t_start
                trace.total_new_tokens = state.produced
                trace.tokens_per_s = state.produced / trace.elapsed if trace.elapsed > 0 else 0.0
                trace.finished = trace.finish_reason is not None
                state.step += 1
                yield trace
                if trace.finished:
                    return
        finally:
            for stepper in (graph, gdraft):
                if stepper is not None:
                    self.pair.give_back(stepper)

    def _truncate(self, committed: list[TokenProvenance], remaining: int, context_left: int):
        out: list[TokenProvenance] = []
        for c in committed:
            if len(out) >= remaining:
                return out, "length"
            if len(out) >= context_left:
                return out, "context"
            out.append(c)
            if c.token_id in self.eos_ids:
                return out, "eos"
        if len(out) >= remaining:
            return out, "length"
        if len(out) >= context_left:
            return out, "context"
        return out, None

    def _commit_tokens(self, state: _Step, proposed: list[TokenProvenance], drafter) -> tuple[list[TokenProvenance], Optional[str]]:
        """Append the step's tokens (cut at EOS, ``max_new_tokens`` or the model context) to the
        output; the drafter indexes them. Returns the committed tokens and why the run ends (or None)."""
        committed, reason = self._truncate(proposed, state.max_new_tokens - state.produced,
                                           self.max_context - len(state.committed))
        state.committed.extend(c.token_id for c in committed)
        state.produced += len(committed)
        if drafter is not None:
            drafter.extend([c.token_id for c in committed])
        return committed, reason

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ the text's repeats
    def _repeats_in_run(self, state: _Step) -> None:
        """Set up the repeats inside a draft-model run whose tree steps ``auto`` priced (``drafting.repeats``)."""
        rule = self.config.fallback
        from ..methods import method_spec

        if (not self.repeats_in_run or rule is None or rule.tree_s_per_token is None
                or self.config.method == "hybrid"  # (it drafts from the text itself)
                or not method_spec(self.config.method).uses_draft_model):
            return
        from ..drafting.repeats import RepeatDrafter
        from ..verify import make_verifier

        state.repeats = RepeatDrafter.in_run(self.config, rule.rows, rule.tree_s_per_token)
        state.repeats.reset(state.committed)
        state.repeat_verifier = make_verifier("greedy" if self.config.greedy else "point_mass")

    @staticmethod
    def _repeat_pays(state: _Step) -> bool:
        """Whether this step verifies the text's repeats (``RepeatDrafter.candidate``), the index first brought up
        to every committed token."""
        state.repeats.follow(state.committed)
        return state.repeats.candidate(state.committed[-1]) is not None

    # ------------------------------------------------------------------ autoregressive step
    def _fall_back(self, state: _Step, trace: StepTrace) -> str:
        """Count a tree step at its price (``DecodeConfig.fallback``); once the tree steps cost more per committed
        token than the rule allows (``FallbackPrice.falls_back``), switch the rest of the run to plain decoding and
        say why ('' otherwise)."""
        rule = self.config.fallback
        if rule is None:
            return ""
        priced = rule.rows.step_seconds(StepShape.of(trace))
        if not math.isfinite(priced):  # a size the profile did not measure: this step decides nothing
            return ""
        state.tree_steps += 1
        state.tree_tokens += trace.num_committed
        state.tree_priced_s += priced
        per_token = state.tree_priced_s / max(1, state.tree_tokens)
        if not rule.falls_back(state.tree_steps, per_token) or trace.finish_reason is not None:
            return ""
        from ..drafting.repeats import RepeatDrafter
        from ..verify import make_verifier

        state.plain = True
        said = (f"{self.config.method} steps committed {state.tree_tokens / state.tree_steps:.2f} tokens each over "
                f"{state.tree_steps} steps; priced at this machine's profile that is {per_token * 1e3:.0f} ms per token "
                f"against {rule.plain_s_per_token * 1e3:.0f} for plain decoding: plain decoding from the next step on")
        state.repeats = None  # (the repeats inside the run were priced against its tree steps)
        if not self.repeats_after_fallback:
            return said
        state.repeats = RepeatDrafter(self.config, rule.rows)
        state.repeats.reset(state.committed)
        state.repeat_verifier = make_verifier("greedy" if self.config.greedy else "point_mass")
        return f"{said}, drafting only the text's own repeats where they are priced to pay (no draft model)"

    def _ar_step(self, state: _Step, t_cache, rng: np.random.Generator, drafter=None) -> tuple[StepTrace, StepTimer]:
        """One causal target forward of the last committed token and one sample (argmax at T=0):
        no tree, no draft, no verification (``drafter``: a tree run that fell back, whose drafter still
        indexes the text)."""
        cfg = self.config
        timer = StepTimer(self.device)
        root = state.committed[-1]
        with timer.phase("target_forward"):
            logits = causal_forward(self.target, t_cache, [root], len(state.committed) - 1,
                                    attn_kwargs=self.attn_kwargs)[0]
        with timer.phase("verify"):
            if cfg.greedy:
                am = torch.argmax(logits, dim=-1, keepdim=True)  # [1]: a 0-dim index would read the device
                token, p_tok = host.fetch(am, torch.softmax(logits.float(), -1).gather(-1, am))  # the step's one read
                token, p_tok = int(token[0]), float(p_tok[0])
            else:
                (probs,) = host.fetch(probs_from_logits(logits, cfg.temperature, cfg.top_p).double())
                token = sample_index(probs, rng.random())
                p_tok = float(probs[token])
        prov = TokenProvenance(token, state.step, 1, -1, "autoregressive", p_target=p_tok)
        committed, reason = self._commit_tokens(state, [prov], drafter)
        return StepTrace(step=state.step, method="autoregressive", verifier="none", tree=None, accepted_nodes=[0],
                         bonus_token=token, committed=committed, finish_reason=reason), timer

    # ------------------------------------------------------------------ tree step
    def _tree_step(self, state: _Step, t_cache, d_cache, drafter, verifier, gen, rng, gdraft=None,
                   device_gen=None, repeats: bool = False) -> tuple[StepTrace, StepTimer]:
        """draft -> node order and attention metadata -> target forward -> verify -> drafter
        feedback -> commit (tokens and both caches); the trace is built after the step.

        With ``device_side`` (greedy dyspec_greedy and chain) the tree is grown on the device
        (``drafting.device``), laid out there, and the host reads the step once
        (``device_step.read_greedy_step``) before verifying. With ``gdraft`` (a draft-only ``GraphStepper``:
        ``draft_graph_reason``) the draft's programs grow the tree (T > 0: their uniforms from
        ``device_gen``), one read brings it (and at T > 0 its draft rows), and the accepted path is kept in
        the draft's cache by its commit program. With ``repeats`` the drafter is the text's repeats
        (``drafting.repeats``): no draft forward; the draft's cache (``d_cache``, inside a run) keeps what it had and
        catches up on the committed tokens in its next forward."""
        cfg = self.config
        timer = StepTimer(self.device)
        cache_len = cache_length(t_cache)
        on_device = not repeats and self._device_drafting(d_cache)
        with timer.phase("draft"):
            if gdraft is not None:
                draft_forwards = gdraft.draft(len(state.committed) - 1, device_gen)
                read_tree = gdraft.read_tree()
                drafted, _ = read_tree.token_tree()
                slot_of_node = np.flatnonzero(read_tree.valid)
            else:
                source = self._draft_source(state, d_cache)
                levels = self._levels_left(state)
                if on_device:
                    drafted = self._draft_on_device(source, state.committed[-1], levels)
                else:
                    drafted = drafter.draft(source, state.committed[-1], gen, deterministic=cfg.greedy, levels=levels)
        if gdraft is None:
            timer.split("draft", "tree_build", source.forward_seconds)
            draft_forwards = source.forward_calls
        with timer.phase("mask"):
            fwd = self._forward_layout(drafted, drafted.levels if on_device else drafted.num_levels, cache_len,
                                       len(state.committed))
        transfer_before = self._transfer_seconds()
        with timer.phase("target_forward"):
            logits = masked_forward(self.target, t_cache, fwd.tokens, fwd.positions, fwd.visible,
                                    attn_kwargs=fwd.attn_kwargs)
        timer.add("offload_transfer", self._transfer_seconds() - transfer_before)
        with timer.phase("verify"):
            if on_device:
                read = read_greedy_step(drafted, logits, fwd.slot, fwd.perm)  # the step's one device read
                tree, target_rows, slot, perm = read.tree, read.rows, read.slot, read.perm
                p_draft_bonus = read.p_draft_bonus.__getitem__
            else:
                # rows are formed (and moved to the host) only for the nodes the verifier visits; the
                # forward ran in ``node_order``, so node i's logits are row ``slot[i]``
                tree, slot, perm = drafted, fwd.slot.tolist(), fwd.perm.tolist()
                target_rows = LogitRows(logits, 0.0 if cfg.greedy else cfg.temperature, cfg.top_p,
                                        row_of_node=fwd.slot)
                p_draft_bonus = None
            result = verifier.verify(tree, target_rows, rng)
            if gdraft is not None and tree.draft_probs is None:  # T = 0: the draft's rows stayed on the device
                p_draft_bonus = lambda node: gdraft.draft_prob(int(slot_of_node[node]), int(result.bonus_token))  # noqa: E731
            proposed = self._provenance(tree, result, target_rows, state.step, p_draft_bonus)
        if self.on_verify is not None:
            self.on_verify(tree, target_rows, result)
        path = list(result.path)
        drafter.observe(tree, len(path) - 1)
        with timer.phase("kv_compaction"):
            committed, reason = self._commit_tokens(state, proposed, drafter)
            compact(t_cache, cache_len, [cache_len + slot[i] for i in path])
            if gdraft is not None:
                gdraft.set_outcome([int(slot_of_node[i]) for i in path], int(result.bonus_token))
                gdraft.commit()
            elif on_device:
                state.draft_cached = source.commit_rows([read.source_rows[i] for i in path])
            else:
                src_ids = tree.source_ids().tolist()
                state.draft_cached = source.commit_path([src_ids[i] for i in path])
        return self._tree_trace(state.step, tree, result, committed, reason, perm, self.config.node_order,
                                kernel_blocks=fwd.meta.blocks.num_nonzero if fwd.meta is not None else None,
                                draft_source=drafter.last_stats.source if drafter.last_stats is not None else "model",
                                draft_forwards=draft_forwards), timer

    # ------------------------------------------------------------------ graph steps
    def _graph_ar_step(self, state: _Step, graph, rng: np.random.Generator) -> tuple[StepTrace, StepTimer]:
        """``_ar_step`` as one program and one read (``graph_step.GraphStepper.ar_step``)."""
        timer = StepTimer(self.device)
        with timer.phase("target_forward"):
            out = graph.ar_forward(len(state.committed) - 1)
        with timer.phase("verify"):
            token, p_tok, probs = graph.ar_read(out)
            if probs is not None:
                token = sample_index(probs, rng.random())
                p_tok = float(probs[token])
                graph.set_root(token)
        prov = TokenProvenance(token, state.step, 1, -1, "autoregressive", p_target=p_tok)
        committed, reason = self._commit_tokens(state, [prov], None)
        return StepTrace(step=state.step, method="autoregressive", verifier="none", tree=None, accepted_nodes=[0],
                         bonus_token=token, committed=committed, finish_reason=reason), timer

    def _graph_tree_step(self, state: _Step, graph, verifier, rng, generator) -> tuple[StepTrace, StepTimer]:
        """A tree step as fixed-shape programs (``graph_step``): draft, target forward, verification and
        commit, one read. T = 0: verified on the device; the host verifier re-walks the read numbers for
        the trace's decisions and must find the device's path. T > 0 (siblings drawn without replacement
        on the device with ``generator``): token-level and point-mass verification run on the device with
        uniforms from ``generator`` and the host rebuilds the verifier's result from the read numbers
        (``verify.device.walk_result``); Traversal decides on the host from the read rows and tells the device."""
        timer = StepTimer(self.device)
        cached = len(state.committed) - 1  # the root is the last committed token
        with timer.phase("draft"):
            draft_forwards = graph.draft(cached, generator, every_level=self.draft_every_level)
        with timer.phase("target_forward"):
            graph.target_forward(cached)
        if not graph.device_verifies:
            with timer.phase("verify"):
                read = graph.read()  # the step's one device read
                tree, node_of = read.token_tree()
                keep = np.flatnonzero(read.valid)
                rows = DenseRows(torch.from_numpy(read.target_probs[keep]))
                result = verifier.verify(tree, rows, rng)
                graph.set_outcome([int(keep[i]) for i in result.path], int(result.bonus_token))
                proposed = self._provenance(tree, result, rows, state.step)
            with timer.phase("kv_compaction"):
                graph.commit()
        elif graph.stochastic:
            from ..verify.device import walk_result

            with timer.phase("verify"):
                graph.verify(generator)
            with timer.phase("kv_compaction"):
                graph.commit()
            with timer.phase("verify"):
                read = graph.read()  # the step's one device read
                tree, node_of = read.token_tree()
                result = walk_result(read.walk, tree, node_of)
                proposed = self._provenance(tree, result, None, state.step, lambda _node: read.p_draft_bonus,
                                            p_target_bonus=read.p_target_bonus)
        else:
            with timer.phase("verify"):
                graph.verify()
            with timer.phase("kv_compaction"):
                graph.commit()
            with timer.phase("verify"):
                read = graph.read()  # the step's one device read
                tree, node_of = read.token_tree()
                keep = np.flatnonzero(read.valid)
                p_node = read.p_node[keep].copy()
                p_node[0] = math.nan
                rows = FetchedRows(read.argmax[keep], p_node, read.p_argmax[keep], tree.parents.numpy(),
                                   tree.tokens.numpy(), self.vocab_size, fallback=None)
                result = verifier.verify(tree, rows, rng)
                device_path = [int(node_of[s]) for s in read.path]
                if list(result.path) != device_path or int(result.bonus_token) != read.bonus:
                    raise RuntimeError(f"the device accepted {device_path} + {read.bonus}, the host walk "
                                       f"{list(result.path)} + {result.bonus_token}: a bug in graph_step's verify")
                proposed = self._provenance(tree, result, rows, state.step, lambda _node: read.p_draft_bonus)
        committed, reason = self._commit_tokens(state, proposed, None)
        return self._tree_trace(state.step, tree, result, committed, reason, list(range(tree.size)), "bfs",
                                kernel_blocks=None, draft_source="model", draft_forwards=draft_forwards), timer

    def _device_drafting(self, d_cache) -> bool:
        """Whether this step drafts on the device: ``device_side`` is on, the step is greedy and
        the method has a device drafter (dyspec_greedy; chain without a confidence stop)."""
        cfg = self.config
        return (self.device_side and cfg.greedy and d_cache is not None
                and (cfg.method == "dyspec_greedy" or (cfg.method == "chain" and cfg.stop_confidence is None)))

    def _levels_left(self, state: _Step) -> Optional[int]:
        """The levels a tree step can still commit (``cap_levels``): the tokens left less the bonus."""
        return state.max_new_tokens - state.produced - 1 if self.cap_levels else None

    def _draft_on_device(self, source: ModelDraftSource, root: int, levels: Optional[int] = None):
        from ..drafting.device import chain_greedy, topn_greedy
        from ..drafting.drafter import capped_depth

        cfg = self.config
        depth = capped_depth(cfg.depth, levels)
        if cfg.method == "chain":
            tree = chain_greedy(source, root, depth, self.device)
        else:
            tree = topn_greedy(source, root, cfg.budget, depth, self.device)
        return tree

    def _draft_source(self, state: _Step, d_cache):
        if d_cache is None:  # a model-free drafter
            return NoModelSource(self.vocab_size)
        return ModelDraftSource(self.draft, d_cache, state.committed[state.draft_cached:],
                                self.config.effective_draft_temperature, attn_kwargs=self.attn_kwargs)

    def _tree_trace(self, step: int, tree: TokenTree, result, committed: list[TokenProvenance],
                    reason: Optional[str], perm: list[int], node_order: str, kernel_blocks: Optional[int],
                    draft_source: str, draft_forwards: int) -> StepTrace:
        """The step's record (its ``timings`` are filled in by ``_run`` after the step's last wait);
        ``perm``: the node at each slot of the target's forward, in ``node_order``."""
        cfg = self.config
        path = list(result.path)
        on_path = set(path)
        status: list[NodeStatus] = ["root"] + [
            "accepted" if i in on_path else "rejected" if bool(result.tested[i]) else "unverified"
            for i in range(1, tree.size)]
        counts = cfg.trace_block_counts
        return StepTrace(
            step=step,
            method=cfg.method,
            verifier=self.verifier_name,
            tree=tree,
            accepted_nodes=path,
            bonus_token=int(result.bonus_token),
            committed=committed,
            node_status=status,
            node_p_target=np.asarray(result.p_target, dtype=np.float64),
            node_accept_prob=np.asarray(result.accept_prob, dtype=np.float64),
            block_counts=_block_counts(tree) if counts else {},
            node_order=node_order,
            node_slots=perm,
            order_blocks=_order_blocks(tree, perm) if counts else {},
            kernel_blocks=kernel_blocks if counts else None,
            decisions=result.decisions,
            draft_source=draft_source,
            draft_forwards=draft_forwards,
            finish_reason=reason,
        )

    def _forward_layout(self, tree, levels: int, cache_len: int, prefix_len: int) -> "_TreeForward":
        """The target's tree forward with the nodes in ``config.node_order``, laid out from the
        parent array where the tree lives (``mask.layout_from_parents``): tokens and positions in
        slot order, and the attention's input in the one form it reads — for SDPA the
        ``[n, cache_len + n]`` visibility mask, for the kernel its metadata (interval form for
        DFS/HPD, block lists for BFS) and a placeholder mask with no storage."""
        from ..attention.hf_backend import META_KWARG, kernel_chosen, kernel_tiles
        from ..attention.mask import layout_from_parents, placeholder_mask

        n = tree.size
        order = self.config.node_order
        # the kernel reads the interval form in the pre-orders; ``auto`` may pick SDPA for this size
        use_kernel = self.kernel and kernel_chosen(self.config.attention, self.device, n, cache_len, order != "bfs")
        lay = layout_from_parents(tree.parents, tree.child_rank, order, levels,
                                  kernel_tiles(self.target) if use_kernel else None)
        kwargs = dict(self.attn_kwargs)
        meta = None
        if use_kernel:
            meta = lay.meta(cache_len)
            if meta.blocks.full_cnt.device != self.device:
                meta = _meta_to(meta, self.device)
            kwargs[META_KWARG] = meta
            visible = placeholder_mask(n, cache_len + n, self.device)
        else:
            visible = torch.ones(n, cache_len + n, dtype=torch.bool, device=lay.mask.device)
            visible[:, cache_len:] = lay.mask
        return _TreeForward(
            perm=lay.perm, slot=lay.slot, tree_mask=lay.mask, visible=visible,
            tokens=tree.tokens[lay.perm], positions=lay.depth[lay.perm] + (prefix_len - 1),
            attn_kwargs=kwargs, meta=meta,
        )

    def _provenance(self, tree: TokenTree, result, target_rows, step: int,
                    p_draft_bonus: Optional[Callable[[int], float]] = None,
                    p_target_bonus: Optional[float] = None) -> list[TokenProvenance]:
        """The accepted tokens and the bonus token with their probabilities; ``p_draft_bonus(node)``
        gives the draft probability of the bonus token at ``node`` when the tree does not carry
        its draft distributions (a device-side step read it with the rest), ``p_target_bonus`` the target's
        when there are no ``target_rows`` (a step verified on the device)."""
        out: list[TokenProvenance] = []
        tokens = tree.tokens.tolist()
        depth = tree.depth.tolist()
        logq = tree.draft_logprob.tolist()
        for node in result.path[1:]:
            out.append(
                TokenProvenance(
                    token_id=tokens[node],
                    step=step,
                    depth=depth[node],
                    node=node,
                    kind="accepted",
                    p_draft=math.exp(logq[node]),
                    p_target=float(result.p_target[node]),
                    accept_prob=float(result.accept_prob[node]),
                )
            )
        last = result.path[-1]
        bonus = int(result.bonus_token)
        p_draft = math.nan
        if p_draft_bonus is not None:
            p_draft = float(p_draft_bonus(last))
        elif tree.draft_probs is not None and int(tree.draft_row[last]) >= 0:
            p_draft = float(tree.draft_dist(last)[bonus])
        out.append(
            TokenProvenance(
                token_id=bonus,
                step=step,
                depth=depth[last] + 1,
                node=-1,
                kind="bonus",
                p_draft=p_draft,
                p_target=(float(target_rows.token_probs(torch.tensor([last]), torch.tensor([bonus]))[0])
                          if p_target_bonus is None else float(p_target_bonus)),
            )
        )
        return out

    def _transfer_seconds(self) -> float:
        if self.offload is None:
            return 0.0
        return float(self.offload.stats().wait_seconds)


@dataclass
class _TreeForward:
    """One tree forward laid out in a node order (slot ``j`` holds node ``perm[j]``)."""

    perm: torch.Tensor  # [n] slot -> node
    slot: torch.Tensor  # [n] node -> slot
    tree_mask: torch.Tensor  # [n, n] bool ancestor-or-self mask, slot order
    visible: torch.Tensor  # [n, cache_len + n] bool, slot order (a placeholder when the kernel reads ``meta``)
    tokens: torch.Tensor  # [n] slot order
    positions: torch.Tensor  # [n] slot order
    attn_kwargs: dict
    meta: Any


def _meta_to(meta, device: torch.device):
    from ..attention.mask import TreeAttnMeta

    return TreeAttnMeta(meta.prefix_len, meta.blocks.to(device), None if meta.mask is None else meta.mask.to(device),
                        None if meta.end is None else meta.end.to(device))


def _order_blocks(tree: TokenTree, perm: list[int]) -> dict[int, int]:
    m = tree.ancestor_mask(torch.tensor(perm, dtype=torch.long))
    return {b: count_nonzero_blocks(m, b) for b in BLOCK_SIZES}


def _block_counts(tree: TokenTree) -> dict[str, dict[int, int]]:
    if tree.size <= min(BLOCK_SIZES):  # one tile of every size in any order (each node sees itself): no mask needed
        return {order: {b: 1 for b in BLOCK_SIZES} for order in ORDERS}
    anc = tree.ancestor_mask()
    out: dict[str, dict[int, int]] = {}
    for order in ORDERS:
        perm = tree.order(order)
        m = anc[perm][:, perm]
        out[order] = {b: count_nonzero_blocks(m, b) for b in BLOCK_SIZES}
    return out
