"""Start generations: settings -> model pair -> prompt ids -> engine iterator."""

from __future__ import annotations

import threading
from typing import Optional

from collections.abc import Mapping

from dyntree_core.config import ConfigError
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


def start_generation(provider: ModelProvider, settings: RunSettings,
                     stop_event: Optional[threading.Event] = None) -> Generation:
    """Validate ``settings``, load the pair (lazily, cached by the provider) and return a
    ``Generation`` that has not run any step yet.

    Raises ``ConfigError`` for invalid settings, ``ModelLoadError`` for an unloadable pair.
    """
    cfg = settings.decode_config()
    pair = provider.load(settings.pair_spec())
    ids = encode_prompt(pair.tokenizer, settings.prompt, chat=settings.chat and pair.supports_chat)
    decoder = SpeculativeDecoder(pair.draft, pair.target, cfg, eos_token_id=list(pair.eos_token_ids) or None)
    stop = stop_event or threading.Event()
    steps = decoder.generate(ids, settings.max_new_tokens, stop_event=stop)
    record = RunRecord(settings=settings, config=cfg, prompt_ids=list(ids), texts=TokenTexts(pair.tokenizer))
    return Generation(record, steps, stop)


def run_to_end(provider: ModelProvider, settings: RunSettings,
               stop_event: Optional[threading.Event] = None) -> RunRecord:
    """A whole generation (compare mode, AR baselines, tests)."""
    gen = start_generation(provider, settings, stop_event)
    gen.record.status = "running"
    while gen.advance() is not None:
        pass
    return gen.record
