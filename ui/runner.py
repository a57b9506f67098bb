"""Start generations: settings -> model pair -> prompt ids -> engine iterator."""

from __future__ import annotations

import threading
from typing import Optional

from collections.abc import Mapping

from dyntree_core.config import ConfigError, DecodeConfig
from dyntree_core.engine import SpeculativeDecoder

from .models import ModelProvider
from .session import Generation, RunRecord
from .settings import RunSettings
from .tokens import TokenTexts


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """Prompt text -> token ids, optionally through the tokenizer's chat template.

    (transformers 5 returns a ``BatchEncoding`` from ``apply_chat_template(tokenize=True)``;
    both that and a plain id list are accepted.)
    """
    if not text or not text.strip():
        raise ConfigError("the prompt is empty: type some text first")
    if chat:
        out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
    else:
        out = tokenizer(text, add_special_tokens=False)
    if isinstance(out, Mapping) or hasattr(out, "keys"):
        out = out["input_ids"]
    ids = list(out)
    if ids and isinstance(ids[0], (list, tuple)):
        ids = list(ids[0])
    return [int(i) for i in ids]


def resolve_auto(provider: ModelProvider, settings: RunSettings) -> tuple[RunSettings, str]:
    """``settings`` with every ``auto`` replaced by the provider's plan, and the plan's reason."""
    if not settings.needs_auto:
        return settings, ""
    if not settings.prompt or not settings.prompt.strip():
        raise ConfigError("the prompt is empty: type some text first")
    from dataclasses import replace

    plan = provider.auto_plan(settings)
    b = plan.best
    kw: dict = {}
    if settings.method == "auto":
        cfg = plan.apply(DecodeConfig(temperature=float(settings.temperature), top_p=float(settings.top_p)))
        kw.update(method=cfg.method, verifier="auto", budget=cfg.budget, depth=cfg.depth)
        tp, dp = b.target_precision, b.draft_precision or plan.fastest_draft_precision
    else:  # the user's method and shape: auto picks the precisions only
        tree = next((c for c in plan.top if c.method != "autoregressive"), b)
        tp = tree.target_precision if settings.method != "autoregressive" else plan.best_autoregressive.target_precision
        dp = tree.draft_precision or plan.fastest_draft_precision
    if settings.precision == "auto":
        kw["precision"] = tp
    if settings.draft_precision == "auto":
        kw["draft_precision"] = dp
    return replace(settings, **kw), plan.reason


def start_generation(provider: ModelProvider, settings: RunSettings,
                     stop_event: Optional[threading.Event] = None) -> Generation:
    """Validate ``settings``, load the pair (lazily, cached by the provider) and return a
    ``Generation`` that has not run any step yet.

    ``auto`` (method and/or precisions) is resolved first by the provider's measured cost model;
    the record's ``note`` carries the one-line reason. Raises ``ConfigError`` for invalid settings,
    ``ModelLoadError`` for an unloadable pair.
    """
    settings, note = resolve_auto(provider, settings)
    cfg = settings.decode_config()
    pair = provider.load(settings.pair_spec())
    ids = encode_prompt(pair.tokenizer, settings.prompt, chat=settings.chat and pair.supports_chat)
    decoder = SpeculativeDecoder(pair.draft, pair.target, cfg, eos_token_id=list(pair.eos_token_ids) or None)
    stop = stop_event or threading.Event()
    steps = decoder.generate(ids, settings.max_new_tokens, stop_event=stop)
    record = RunRecord(settings=settings, config=cfg, prompt_ids=list(ids), texts=TokenTexts(pair.tokenizer), note=note)
    return Generation(record, steps, stop)


def run_to_end(provider: ModelProvider, settings: RunSettings,
               stop_event: Optional[threading.Event] = None) -> RunRecord:
    """A whole generation (compare mode, AR baselines, tests)."""
    gen = start_generation(provider, settings, stop_event)
    gen.record.status = "running"
    while gen.advance() is not None:
        pass
    return gen.record
