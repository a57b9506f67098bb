"""The decoding loop: prompt -> (drafter -> TokenTree -> mask -> target forward -> verifier ->
accepted path -> KV compaction) -> StepTrace. The autoregressive baseline runs the same loop
with a root-only "tree"."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import torch

from .config import ConfigError, DecodeConfig
from .draft_source import ModelDraftSource
from .forward import causal_forward, masked_forward, new_cache
from .kv import cache_length, compact
from .sampling import probs_from_logits
from .trace import NodeStatus, PhaseTimings, StepTrace, TokenProvenance
from .tree import TokenTree, count_nonzero_blocks
from .verify.rows import LogitRows

BLOCK_SIZES = (16, 32, 64)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class VocabMismatchError(ConfigError):
    """Draft and target do not share a vocabulary."""


def model_vocab_size(model) -> int:
    from .quant.apply import output_dim

    return output_dim(model)


def check_same_vocab(draft, target) -> None:
    dv, tv = model_vocab_size(draft), model_vocab_size(target)
    if dv != tv:
        raise VocabMismatchError(
            f"draft and target vocabularies differ: draft has {dv} output tokens, target has {tv}; "
            "speculative decoding needs one shared tokenizer"
        )


def place_model(model, device: Optional[torch.device], dtype: torch.dtype):
    """Move ``model`` in place to ``device`` (None = leave) and ``dtype``, keeping the rotary
    ``inv_freq`` buffers in float32 (``Module.to(dtype)`` would round them to bf16)."""
    if next(model.parameters()).dtype != dtype:
        keep = {name: buf.detach().clone() for name, buf in model.named_buffers() if name.endswith("inv_freq")}
        model.to(dtype=dtype)
        for name, buf in keep.items():
            owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            setattr(owner, name.rsplit(".", 1)[-1], buf.to(torch.float32))
    if device is not None:
        model.to(device=device)
    return model.eval()


def prepare_model(model, device: Optional[torch.device], dtype: torch.dtype, precision: Optional[str], role: str):
    """Bring ``model`` to ``precision`` (None: quantized models stay as loaded, dense ones take
    ``dtype``). A dense model asked for int8/int4 is quantized in place; a quantized model cannot
    become dense again (load it again at that precision)."""
    from .quant.apply import QUANT_PRECISIONS, model_precision, quantize_model
    from .quant.linear import PrecisionError

    current = model_precision(model)
    if precision is None:
        if current in QUANT_PRECISIONS:
            return model.eval() if device is None else model.to(device=device).eval()
        return place_model(model, device, dtype)
    try:
        if precision in QUANT_PRECISIONS:
            if current != precision:
                if current in QUANT_PRECISIONS:
                    raise ConfigError(f"the {role} was loaded at {current}; load it at {precision} "
                                      f"(load_pair(..., {'draft_' if role == 'draft' else ''}precision={precision!r}))")
                place_model(model, device, torch.float32)
                quantize_model(model, precision)
            return model.eval()
        if current in QUANT_PRECISIONS:
            raise ConfigError(f"the {role} was loaded at {current}; a {precision} run needs it loaded at {precision}")
        return place_model(model, device, _DTYPES[precision])
    except PrecisionError as e:
        raise ConfigError(str(e)) from None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available on this machine")
    return torch.device(name)


@dataclass
class _Step:
    """Mutable per-generation state (kept out of the decoder so it is reentrant per call)."""

    committed: list[int]
    prompt_len: int
    draft_cached: int
    step: int = 0


class SpeculativeDecoder:
    """Speculative decoding with a draft and a target HF causal LM.

    Models are moved in place to ``config.device`` / ``config.dtype``. Each ``generate`` call
    owns its KV caches, RNGs and drafter state, so calls are independent and seeded.
    """

    def __init__(self, draft, target, config: DecodeConfig, eos_token_id: Optional[int | Sequence[int]] = None,
                 on_verify: Optional[Callable[[TokenTree, LogitRows, Any], None]] = None):
        """``on_verify(tree, target_rows, result)`` is called after each tree step's verification
        (benchmarks that evaluate other verifiers on the same tree use it; ``target_rows`` forms any
        node's target distribution on demand)."""
        if not isinstance(config, DecodeConfig):
            raise TypeError("config must be a DecodeConfig")
        check_same_vocab(draft, target)
        self.config = config
        self.device = resolve_device(config.device)
        dtype = _DTYPES[config.dtype]
        self.draft = prepare_model(draft, self.device, dtype, config.draft_precision, "draft")
        self.offload = None
        if config.offload_target:
            from .offload import offload_decoder_layers

            if self.device.type != "cuda":
                raise ConfigError("offload_target needs a CUDA device (device='cuda')")
            place_model(target, None, dtype)
            self.offload = offload_decoder_layers(target, device=str(self.device))
            self.target = target.eval()
        else:
            self.target = prepare_model(target, self.device, dtype, config.precision, "target")
        if config.attention == "triton" or (config.attention == "auto" and self.device.type == "cuda"):
            from .attention.hf_backend import use_tree_attention

            for m in (self.draft, self.target):
                use_tree_attention(m, config.attention)
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
    ) -> Iterator[StepTrace]:
        """Decode up to ``max_new_tokens`` new tokens, yielding one ``StepTrace`` per step.

        Args:
            input_ids: the prompt, ``[L]`` or ``[1, L]`` token ids (L >= 1).
            max_new_tokens: > 0; exactly this many tokens are produced unless EOS, the model
                context or ``stop_event`` ends the run first.
            stop_event: set it (from another thread) to stop after the current step.
            seed: RNG seed for this call (default ``config.seed``).
        """
        prompt = self._validate(input_ids, max_new_tokens)
        return self._run(prompt, max_new_tokens, stop_event, self.config.seed if seed is None else int(seed))

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
    def _run(self, prompt: list[int], max_new_tokens: int, stop_event, seed: int) -> Iterator[StepTrace]:
        cfg = self.config
        t_start = time.perf_counter()
        gen = torch.Generator().manual_seed(seed)
        rng = np.random.default_rng(seed)
        is_ar = cfg.method == "autoregressive"
        drafter = None
        verifier = None
        if not is_ar:
            from .drafting import make_drafter
            from .verify import make_verifier

            drafter = make_drafter(cfg)
            drafter.reset()
            verifier = make_verifier(self.verifier_name)
        t_cache = new_cache(self.target)
        d_cache = None if is_ar else new_cache(self.draft)
        if len(prompt) > 1:
            causal_forward(self.target, t_cache, prompt[:-1], 0, logits_rows=[len(prompt) - 2])
            if d_cache is not None:
                causal_forward(self.draft, d_cache, prompt[:-1], 0, logits_rows=[len(prompt) - 2])
        self._sync()
        state = _Step(committed=list(prompt), prompt_len=len(prompt), draft_cached=len(prompt) - 1)
        produced = 0
        while True:
            t_step = time.perf_counter()
            if is_ar:
                trace = self._ar_step(state, t_cache, rng)
            else:
                trace = self._tree_step(state, t_cache, d_cache, drafter, verifier, gen, rng)
            remaining = max_new_tokens - produced
            context_left = self.max_context - len(state.committed)
            committed, reason = self._truncate(trace.committed, remaining, context_left)
            trace.committed = committed
            state.committed.extend(c.token_id for c in committed)
            produced += len(committed)
            if stop_event is not None and stop_event.is_set() and reason is None:
                reason = "stopped"
            self._sync()
            now = time.perf_counter()
            trace.step_seconds = now - t_step
            trace.elapsed = now - t_start
            trace.total_new_tokens = produced
            trace.tokens_per_s = produced / trace.elapsed if trace.elapsed > 0 else 0.0
            trace.finished = reason is not None
            trace.finish_reason = reason
            state.step += 1
            yield trace
            if reason is not None:
                return

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

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ autoregressive step
    def _ar_step(self, state: _Step, t_cache, rng: np.random.Generator) -> StepTrace:
        cfg = self.config
        timings = PhaseTimings()
        root = state.committed[-1]
        pos = len(state.committed) - 1
        t0 = time.perf_counter()
        logits = causal_forward(self.target, t_cache, [root], pos)[0]
        self._sync()
        timings.target_forward = time.perf_counter() - t0
        t0 = time.perf_counter()
        if cfg.greedy:
            token = int(torch.argmax(logits).item())
            p_tok = float(torch.softmax(logits.float(), -1)[token].item())
        else:
            probs = probs_from_logits(logits, cfg.temperature, cfg.top_p).double().cpu().numpy()
            token = _sample(probs, rng)
            p_tok = float(probs[token])
        timings.verify = time.perf_counter() - t0
        prov = TokenProvenance(token, state.step, 1, -1, "autoregressive", p_target=p_tok)
        return StepTrace(
            step=state.step,
            method="autoregressive",
            verifier="none",
            tree=None,
            accepted_nodes=[0],
            bonus_token=token,
            committed=[prov],
            timings=timings,
        )

    # ------------------------------------------------------------------ tree step
    def _tree_step(self, state: _Step, t_cache, d_cache, drafter, verifier, gen, rng) -> StepTrace:
        cfg = self.config
        timings = PhaseTimings()
        root = state.committed[-1]
        prefix_len = len(state.committed)
        cache_len = cache_length(t_cache)

        source = ModelDraftSource(self.draft, d_cache, state.committed[state.draft_cached :], cfg.effective_draft_temperature)
        t0 = time.perf_counter()
        tree: TokenTree = drafter.draft(source, root, gen, deterministic=cfg.greedy)
        self._sync()
        draft_total = time.perf_counter() - t0
        timings.draft = source.forward_seconds
        timings.tree_build = max(0.0, draft_total - source.forward_seconds)

        t0 = time.perf_counter()
        n = tree.size
        anc = tree.ancestor_mask()
        visible = torch.ones(n, cache_len + n, dtype=torch.bool)
        visible[:, cache_len:] = anc
        positions = tree.positions(prefix_len).tolist()
        timings.mask = time.perf_counter() - t0

        t0 = time.perf_counter()
        transfer_before = self._transfer_seconds()
        logits = masked_forward(self.target, t_cache, tree.tokens.tolist(), positions, visible)
        self._sync()
        timings.target_forward = time.perf_counter() - t0
        timings.offload_transfer = self._transfer_seconds() - transfer_before

        t0 = time.perf_counter()
        # rows are formed (and moved to the host) only for the nodes the verifier visits
        target_rows = LogitRows(logits, 0.0 if cfg.greedy else cfg.temperature, cfg.top_p)
        result = verifier.verify(tree, target_rows, rng)
        timings.verify = time.perf_counter() - t0
        if self.on_verify is not None:
            self.on_verify(tree, target_rows, result)

        t0 = time.perf_counter()
        path = list(result.path)
        drafter.observe(tree, len(path) - 1)
        compact(t_cache, cache_len, [cache_len + i for i in path])
        src_ids = tree.source_ids().tolist()
        state.draft_cached = source.commit_path([src_ids[i] for i in path])
        timings.kv_compaction = time.perf_counter() - t0

        committed = self._provenance(tree, result, target_rows, state.step)
        status: list[NodeStatus] = []
        on_path = set(path)
        for i in range(n):
            if i == 0:
                status.append("root")
            elif i in on_path:
                status.append("accepted")
            elif bool(result.tested[i]):
                status.append("rejected")
            else:
                status.append("unverified")
        return StepTrace(
            step=state.step,
            method=cfg.method,
            verifier=self.verifier_name,
            tree=tree,
            accepted_nodes=path,
            bonus_token=int(result.bonus_token),
            committed=committed,
            node_status=status,
            node_p_target=np.asarray(result.p_target, dtype=np.float64),
            node_accept_prob=np.asarray(result.accept_prob, dtype=np.float64),
            block_counts=_block_counts(tree, anc) if cfg.trace_block_counts else {},
            timings=timings,
        )

    def _provenance(self, tree: TokenTree, result, target_rows: LogitRows, step: int) -> list[TokenProvenance]:
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
        if tree.draft_probs is not None and int(tree.draft_row[last]) >= 0:
            p_draft = float(tree.draft_dist(last)[bonus])
        out.append(
            TokenProvenance(
                token_id=bonus,
                step=step,
                depth=depth[last] + 1,
                node=-1,
                kind="bonus",
                p_draft=p_draft,
                p_target=target_rows.prob(last, bonus),
            )
        )
        return out

    def _transfer_seconds(self) -> float:
        if self.offload is None:
            return 0.0
        return float(self.offload.stats().wait_seconds)


def _sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One categorical draw from ``probs`` (``[V]`` float64, sums to 1)."""
    cdf = np.cumsum(probs)
    u = rng.random() * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), len(probs) - 1))


def _block_counts(tree: TokenTree, anc: torch.Tensor) -> dict[str, dict[int, int]]:
    out: dict[str, dict[int, int]] = {}
    for order in ("bfs", "dfs", "hpd"):
        perm = tree.order(order)
        m = anc[perm][:, perm]
        out[order] = {b: count_nonzero_blocks(m, b) for b in BLOCK_SIZES}
    return out
