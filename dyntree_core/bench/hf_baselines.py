"""transformers' own generation as a timed baseline: plain ``generate`` and assisted generation.

``hf_generate(target, prompt_ids, n, draft=None | draft)`` runs ``target.generate`` (method
``hf_greedy``) or ``target.generate(..., assistant_model=draft)`` (``hf_assisted``) on the same
loaded models, prompt ids and number of new tokens as our engine, and times the DECODE phase
only, as ``bench.decoding.run_generation`` does for ``SpeculativeDecoder`` (which sums the
``step_seconds`` of its steps; the first step starts after the prompt has been prefilled).
At T>0 the method names are the same and the runs sample.

How transformers 5.23 calls a streamer (read from ``generation/utils.py``; any object with
``put(value)`` and ``end()`` is accepted)
----------------------------------------------------------------------------------------------
* Both paths first call ``put(input_ids.cpu())`` with the whole prompt, shape ``[1, L]``, in
  ``generate`` before the prefill. That put carries no new token.
* Plain greedy / sampling (``_sample``): the prefill forward over the prompt yields the first new
  token; then every loop iteration calls ``StopCheck.__call__`` which does
  ``put(next_tokens.cpu())``, shape ``[1]``: ONE token per put, the first one right after the
  prefill. ``end()`` is called once after the loop. (``DeferredStopCheck``, which streams one
  step late and flushes the last token in ``finish()``, is only used on ``mps`` and never for
  an assistant, so not on CPU or CUDA.)
* Assisted (``_assisted_decoding``): each round draws candidates from the assistant
  (``AssistedCandidateGenerator.get_candidates`` -> ``assistant_model.generate``, which gets no
  streamer), verifies them with ONE target forward, then calls ``put(valid_tokens.cpu())``,
  shape ``[1, n_matches + 1]``: SEVERAL tokens per put (the accepted candidates plus the
  target's bonus/correction token, cropped at ``max_length`` and at the first EOS). There is
  no separate prefill: in the first round the target forwards prompt + candidates in one pass
  (``is_first_iteration``) and the assistant prefills the prompt inside its first draft call.
  ``end()`` is called once after the loop.
* Every ``put`` does ``.cpu()`` first, which synchronises a CUDA device, so ``perf_counter``
  at a put is the time that token(s) existed.

Timing rule (both paths): decode seconds = time of the last put carrying new tokens minus the
time of the put that delivered the FIRST new token(s); ``new_tokens`` = all new tokens minus
those delivered in that first put. For plain generation that excludes exactly the prefill
(prompt forward + first token), so ``new_tokens = n - 1`` forwards of one token each are timed,
the same per-token quantity as our engine's decode time. For assisted generation it excludes
the prefill of both models AND the first draft/verify round with the tokens that round
accepted (transformers fuses the two; they cannot be split from outside), so the rate is that of
rounds 2..end. Without EOS, plain runs always report ``new_tokens == n - 1``; assisted runs report
``n - (tokens accepted in round 1)``.

Sampling configuration
----------------------
``temperature == 0`` -> ``do_sample=False``; ``temperature > 0`` -> ``do_sample=True`` with
``temperature`` and ``top_p`` and ``top_k=0`` (transformers' global default is ``top_k=50``; our
engine does not truncate to a top-k, so it is switched off). During the call the target's
``generation_config`` is replaced by a clean ``GenerationConfig`` that keeps only its
bos/eos/pad ids, so a checkpoint's ``generation_config.json`` sampling defaults (Qwen's
``repetition_penalty=1.05``, ``top_k=20``, ...) do not change the distribution: the baseline
decodes exactly the distribution our engine decodes (greedy on the raw logits at T=0).
Assisted generation builds the assistant's generation settings from a copy of the generation
config of the target's call (so the same processors apply to the draft), plus the assistant
fields of the DRAFT's own ``generation_config``. At T=0 a round keeps the candidates up to the
first mismatch with the target's argmax, plus the target's token (lossless: same tokens as plain
greedy); at T>0 the draft's logits are available, so transformers uses speculative sampling
(``_speculative_sampling``, Leviathan et al. Alg. 1), which preserves the target distribution
but not the token sequence of a plain sampling run with the same seed.

Assisted-generation defaults
----------------------------
They are left at transformers' defaults; ``hf_assisted_defaults(draft)`` returns the values in
effect, computed like ``AssistedCandidateGenerator.__init__`` does (the draft's
``generation_config`` with ``GenerationConfig._get_default_generation_params()`` filling unset
fields). In 5.23 with an unset draft config these are ``num_assistant_tokens=20``,
``num_assistant_tokens_schedule="constant"``, ``assistant_confidence_threshold=0.4`` (the draft
ends a round after the first token it picked with probability below 0.4, ``ConfidenceCriteria``,
so rounds are often shorter than 20). The threshold is adapted online from a ROC curve only when scikit-learn
is importable (``confidence_threshold_adapts`` in the returned dict); that adaptation lives in a
copy and never reaches the draft's config.

The draft's ``generation_config`` may be mutated: under the ``"heuristic"`` schedule
``_assisted_decoding`` writes the final ``num_assistant_tokens`` back into
``assistant_model.generation_config`` so it persists across calls. ``hf_generate`` therefore
deep-copies both models' generation configs before each call and restores them afterwards, so
repeated runs are independent; the final value is reported as ``HFRun.assistant_tokens``
(``"heuristic"``: the written-back value; ``"constant"``: the constant; otherwise None).

Side note: the assistant's inner ``generate`` call passes both a ``generation_config`` and
``min_new_tokens``/``max_new_tokens``, which makes transformers log a one-time deprecation warning
("Passing `generation_config` together with generation-related arguments ..."); it is
transformers-internal and harmless.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

METHOD_PLAIN = "hf_greedy"
METHOD_ASSISTED = "hf_assisted"
METHOD_PROMPT_LOOKUP = "hf_prompt_lookup"


@dataclass(frozen=True)
class HFRun:
    """One timed transformers generation (see the module docstring for the timing rule)."""

    method: str  # "hf_greedy" | "hf_assisted" (the same names at T>0, where they sample)
    new_tokens: int  # tokens produced after the first put of new tokens
    seconds: float  # decode seconds: from the first put of new tokens to the last
    token_ids: tuple[int, ...]  # every new token (first put included), EOS included when hit
    assistant_tokens: Optional[int]  # transformers' final num_assistant_tokens, if exposed
    first_put_tokens: int = 0  # tokens delivered by the first put of new tokens (excluded)
    puts: int = 0  # puts of new tokens (plain: tokens; assisted: verification rounds)
    put_seconds: tuple[float, ...] = ()  # per put of new tokens: seconds since generate() was called
    put_tokens: tuple[int, ...] = ()  # per put of new tokens: how many it delivered
    stopped: bool = False  # ended early by ``stop_event``

    @property
    def seconds_per_token(self) -> float:
        return self.seconds / max(1, self.new_tokens)


@dataclass
class _TimingStreamer:
    """Records ``(perf_counter, token count)`` per ``put``; the first put is the prompt."""

    prompt_seen: bool = False
    puts: list[tuple[float, list[int]]] = field(default_factory=list)
    end_time: Optional[float] = None
    on_put: Optional[Callable[[int], None]] = None

    def put(self, value: torch.Tensor) -> None:
        now = time.perf_counter()
        if not self.prompt_seen:  # generate() streams the prompt first
            self.prompt_seen = True
            return
        self.puts.append((now, [int(t) for t in value.reshape(-1).tolist()]))
        if self.on_put is not None:
            self.on_put(sum(len(toks) for _, toks in self.puts))

    def end(self) -> None:
        self.end_time = time.perf_counter()


class _StopOnEvent:
    """A transformers stopping criterion that ends generation once ``event`` is set (checked after
    every decoding step, or every assisted round)."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


def _assistant_config(draft):
    cfg = copy.deepcopy(draft.generation_config)
    cfg.update(**cfg._get_default_generation_params(), defaults_only=True)
    return cfg


def hf_assisted_defaults(draft) -> dict[str, Any]:
    """The assisted-generation settings transformers will use with ``draft`` as the assistant:
    ``num_assistant_tokens``, ``num_assistant_tokens_schedule``, ``assistant_confidence_threshold``
    (computed as ``AssistedCandidateGenerator`` does), plus ``confidence_threshold_adapts``
    (scikit-learn importable: the threshold is retuned online) and the transformers version."""
    import transformers
    from transformers.utils import is_sklearn_available

    cfg = _assistant_config(draft)
    return {
        "num_assistant_tokens": cfg.num_assistant_tokens,
        "num_assistant_tokens_schedule": cfg.num_assistant_tokens_schedule,
        "assistant_confidence_threshold": cfg.assistant_confidence_threshold,
        "confidence_threshold_adapts": bool(is_sklearn_available() and cfg.assistant_confidence_threshold),
        "transformers": transformers.__version__,
    }


def _first_id(ids) -> Optional[int]:
    if ids is None:
        return None
    if isinstance(ids, (list, tuple)):
        return int(ids[0]) if ids else None
    return int(ids)


def _clean_generation_config(model, eos_token_id, pad_token_id):
    from transformers import GenerationConfig

    old = model.generation_config
    return GenerationConfig(bos_token_id=getattr(old, "bos_token_id", None), eos_token_id=eos_token_id,
                            pad_token_id=pad_token_id, decoder_start_token_id=getattr(old, "decoder_start_token_id", None))


def hf_generate(target, prompt_ids: Sequence[int], new_tokens: int, *, draft=None, temperature: float = 0.0,
                top_p: float = 1.0, seed: int = 0, eos_token_id=None,
                stop_event: Optional[threading.Event] = None,
                on_put: Optional[Callable[[int], None]] = None,
                prompt_lookup_tokens: Optional[int] = None) -> HFRun:
    """Generate ``new_tokens`` tokens after ``prompt_ids`` with transformers and time the decode.

    Args:
        target: the HF causal LM that generates.
        prompt_ids: the prompt token ids (non-empty).
        new_tokens: ``max_new_tokens`` (> 0); fewer come only when EOS is produced.
        draft: None for plain ``generate`` (``hf_greedy``), else the assistant model
            (``hf_assisted``).
        temperature: 0 = greedy, > 0 = sampling at this temperature.
        top_p: nucleus mass in (0, 1] at T>0.
        seed: torch's global RNG is seeded with it before the call.
        eos_token_id: int or list of ints that stop generation; None = the target's
            ``generation_config.eos_token_id`` (then ``config.eos_token_id``), as our engine does.
        stop_event: once set, generation ends after the current step / assisted round (the
            tokens so far are returned, ``stopped=True``).
        on_put: called with the number of new tokens so far after every step / round (progress).
        prompt_lookup_tokens: with ``draft=None``, transformers' prompt-lookup decoding
            (``prompt_lookup_num_tokens``: candidates copied after the last n-gram match in the
            prompt + output, a chain with no model; ``hf_prompt_lookup``); it streams like assisted.
    """
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt is empty")
    if not isinstance(new_tokens, int) or new_tokens <= 0:
        raise ValueError(f"new_tokens must be a positive integer, got {new_tokens!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if eos_token_id is None:
        eos_token_id = getattr(target.generation_config, "eos_token_id", None)
        if eos_token_id is None:
            eos_token_id = getattr(target.config, "eos_token_id", None)
    pad_token_id = getattr(target.generation_config, "pad_token_id", None)
    if pad_token_id is None:
        pad_token_id = _first_id(eos_token_id)
    if pad_token_id is None:
        pad_token_id = 0

    kwargs: dict[str, Any] = dict(max_new_tokens=new_tokens, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=float(temperature), top_p=float(top_p), top_k=0)
    else:
        kwargs.update(do_sample=False)
    assisted = draft is not None
    if prompt_lookup_tokens is not None:
        if assisted:
            raise ValueError("prompt lookup and an assistant model are exclusive")
        if not isinstance(prompt_lookup_tokens, int) or prompt_lookup_tokens <= 0:
            raise ValueError(f"prompt_lookup_tokens must be a positive integer, got {prompt_lookup_tokens!r}")
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup_tokens
    if assisted:
        kwargs["assistant_model"] = draft
        in_effect = _assistant_config(draft)
        schedule, constant_tokens = in_effect.num_assistant_tokens_schedule, in_effect.num_assistant_tokens

    device = target.get_input_embeddings().weight.device
    input_ids = torch.tensor([prompt], dtype=torch.long, device=device)
    streamer = _TimingStreamer(on_put=on_put)
    if stop_event is not None:
        from transformers import StoppingCriteriaList

        kwargs["stopping_criteria"] = StoppingCriteriaList([_StopOnEvent(stop_event)])
    saved_target = target.generation_config
    saved_draft = copy.deepcopy(draft.generation_config) if assisted else None
    assistant_tokens: Optional[int] = None
    try:
        target.generation_config = _clean_generation_config(target, eos_token_id, pad_token_id)
        torch.manual_seed(seed)
        t_call = time.perf_counter()
        with torch.inference_mode():
            out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), streamer=streamer, **kwargs)
        if assisted:
            if schedule == "heuristic":
                assistant_tokens = int(draft.generation_config.num_assistant_tokens)
            elif schedule == "constant" and constant_tokens is not None:
                assistant_tokens = int(constant_tokens)
    finally:
        target.generation_config = saved_target
        if assisted:
            draft.generation_config = saved_draft

    token_ids = tuple(int(t) for t in out[0, len(prompt):].tolist())
    streamed = [t for _, toks in streamer.puts for t in toks]
    if streamed != list(token_ids):  # the timing rule relies on this; fail loudly if transformers changes
        raise RuntimeError(f"streamed tokens {streamed[:8]}... differ from generate()'s output {list(token_ids[:8])}...")
    if streamer.puts:
        first_time, first = streamer.puts[0]
        seconds = streamer.puts[-1][0] - first_time
        first_n = len(first)
    else:
        seconds, first_n = 0.0, 0
    return HFRun(
        method=METHOD_ASSISTED if assisted else METHOD_PROMPT_LOOKUP if prompt_lookup_tokens else METHOD_PLAIN,
        new_tokens=len(token_ids) - first_n,
        seconds=seconds,
        token_ids=token_ids,
        assistant_tokens=assistant_tokens,
        first_put_tokens=first_n,
        puts=len(streamer.puts),
        put_seconds=tuple(t - t_call for t, _ in streamer.puts),
        put_tokens=tuple(len(toks) for _, toks in streamer.puts),
        stopped=stop_event is not None and stop_event.is_set() and len(token_ids) < new_tokens,
    )
