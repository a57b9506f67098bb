"""The prompt's length before anything runs: its token count, the app's limit for it and the
predicted prefill time, shown under the prompt box and checked again on Run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from dyntree_core.config import ConfigError

#: the most prompt tokens a run takes, whatever the model's context: a CPU prefills a 1.5B model at
#: tens of tokens per second, so a 9,524-token prompt kept the models (and every other session)
#: busy for over ten minutes. Longer prompts are refused, or cut from the start when the user asks.
MAX_PROMPT_TOKENS = 4096
#: the form's choices for a prompt over the limit
LONG_PROMPT_CHOICES: tuple[str, ...] = ("refuse", "keep the end")
#: a predicted prefill shorter than this (s) is not shown: the note is there to warn of a long prompt, and under the
#: real pair's default prompt it took three lines to say "41 tokens · prefill ≈ 1 s (38 tokens/s: ...)"
PREFILL_NOTE_MIN_S = 5.0


@dataclass(frozen=True)
class TextInfo:
    """What the prompt check needs from a pair without loading its weights."""

    tokenizer: Any
    context: int  # the target's maximum positions
    supports_chat: bool


@dataclass(frozen=True)
class PromptCheck:
    """A prompt measured against the limit (``tokens`` and ``limit`` in tokens)."""

    tokens: int
    limit: int
    prefill_seconds: Optional[float] = None  # predicted, when a prefill rate is known
    rate_source: str = ""  # where the rate came from

    @property
    def too_long(self) -> bool:
        return self.tokens > self.limit

    def markdown(self) -> str:
        text = f"{self.tokens:,} tokens"
        if self.prefill_seconds is not None and (self.prefill_seconds >= PREFILL_NOTE_MIN_S or self.too_long):
            text += f" · prefill ≈ {_duration(self.prefill_seconds)} ({self.rate_source})"
        if self.too_long:
            text = (f"⚠️ **{text} — over the limit of {self.limit:,}**: Run refuses it, or keeps its last "
                    f"{self.limit:,} tokens if *Long prompt* says 'keep the end'")
        return text


def prompt_limit(context: int, max_new_tokens: int, budget: int) -> int:
    """Prompt tokens a run can take: the context must hold the prompt, the new tokens and one
    tree; never more than ``MAX_PROMPT_TOKENS``."""
    return max(1, min(MAX_PROMPT_TOKENS, int(context) - int(max_new_tokens) - int(budget) - 1))


def check_prompt(ids: list[int], context: int, max_new_tokens: int, budget: int,
                 rate_tokens_per_s: Optional[float] = None, rate_source: str = "") -> PromptCheck:
    limit = prompt_limit(context, max_new_tokens, budget)
    seconds = len(ids) / rate_tokens_per_s if rate_tokens_per_s else None
    return PromptCheck(len(ids), limit, seconds, rate_source)


#: a session's last prefill predicts the next one's rate from this many prompt tokens on (a short prompt's prefill
#: is a few chunks of fixed cost: a 19-token prompt said 4,096 tokens would take an hour)
SESSION_RATE_MIN_TOKENS = 256


def prefill_rate(record: Any, draft: str, target: str) -> tuple[Optional[float], str]:
    """``(tokens/s, where it came from)`` for the long-prompt estimate: this session's last prefill of at least
    ``SESSION_RATE_MIN_TOKENS`` tokens on the same pair, else the stored machine profile's fastest target forward
    of its largest size (the chunks a prefill runs; CPU only: nothing is measured here), else ``(None, "")``."""
    if (record is not None and record.prefill_seconds and len(record.prompt_ids) >= SESSION_RATE_MIN_TOKENS
            and (record.settings.draft, record.settings.target) == (draft, target)):
        rate = len(record.prompt_ids) / record.prefill_seconds
        return rate, f"this session's last prefill: {rate:,.0f} tokens/s"
    import torch

    from dyntree_core.planning.machine_profile import pair_name_of, stored_profile

    prof = None if torch.cuda.is_available() else stored_profile(pair_name_of(draft, target), "cpu")
    got = prof.prefill_rate() if prof is not None else None
    if got is None:
        return None, ""
    rate, n, precision = got
    return rate, (f"{rate:,.0f} tokens/s: this machine's profile, {n}-token target forwards at {precision}; a long "
                  "prompt's attention adds to it")


def fit_prompt(ids: list[int], check: PromptCheck, long_prompt: str) -> tuple[list[int], str]:
    """``ids`` as the run takes them, and a note when they were cut; raises ``ConfigError`` for a
    prompt over the limit unless ``long_prompt`` is 'keep the end'."""
    if not check.too_long:
        return ids, ""
    if long_prompt != "keep the end":
        raise ConfigError(f"prompt: {check.tokens:,} tokens, over the limit of {check.limit:,} (the model's context "
                          f"less the new tokens and one tree, at most {MAX_PROMPT_TOKENS:,}): shorten it, or set "
                          "'Long prompt' to 'keep the end' to drop its beginning")
    dropped = check.tokens - check.limit
    return ids[dropped:], f"the prompt's first {dropped:,} of {check.tokens:,} tokens were dropped (limit {check.limit:,})"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
