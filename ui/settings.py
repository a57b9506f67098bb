"""Form values -> validated run settings (``DecodeConfig`` + what the UI adds around it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Optional

from dyntree_core.config import (DEFAULT_SPEC_FACTOR, METHODS, PRECISIONS, ConfigError, DecodeConfig,
                                 compatible_verifiers)
from dyntree_core.methods import REGISTRY
from dyntree_core.step_price import FallbackPrice

from .pair_spec import PairSpec
from .prompt_check import LONG_PROMPT_CHOICES

MAX_NEW_TOKENS = 2048
#: the form's temperature range, 0 to this (DecodeConfig itself accepts up to 10)
TEMPERATURE_MAX = 2.0
AUTO = "auto"
#: the Method dropdown: ``auto`` (the measured cost model decides) and every method
METHOD_CHOICES: tuple[str, ...] = (AUTO,) + METHODS
PRECISION_CHOICES: tuple[str, ...] = (AUTO,) + PRECISIONS
TREE_METHODS: tuple[str, ...] = tuple(m for m in METHODS if m not in ("autoregressive", "chain"))

#: which ``DecodeConfig`` knobs each method reads (the others are greyed out in the form)
METHOD_PARAMS: dict[str, frozenset[str]] = {AUTO: frozenset(), **{m.name: m.params for m in REGISTRY.values()}}


@dataclass(frozen=True)
class RunSettings:
    """Everything one Run needs; ``decode_config()`` validates the decoding part."""

    draft: str
    target: str
    device: str
    dtype: str
    prompt: str
    chat: bool
    method: str
    verifier: str
    temperature: float
    top_p: float
    budget: int
    depth: int
    width: int
    threshold: float
    max_new_tokens: int
    seed: int
    offload: bool = False
    precision: str = AUTO
    draft_precision: str = AUTO
    # set by `auto` (dyntree_core.planning.auto.AutoPlan.resolve), never by the form
    stop_confidence: Optional[float] = None
    sequoia_acceptance: Optional[tuple[float, ...]] = None
    spec_factor: Optional[float] = DEFAULT_SPEC_FACTOR
    fallback: Optional[FallbackPrice] = None
    long_prompt: str = "refuse"  # a prompt over the limit: "refuse" or "keep the end" (ui.prompt_check)

    @property
    def needs_auto(self) -> bool:
        """Something is left to ``dyntree_core.planning.auto`` (resolve with the provider first)."""
        return AUTO in (self.method, self.precision, self.draft_precision)

    def decode_config(self) -> DecodeConfig:
        """The ``DecodeConfig`` of these settings; ``auto`` must have been resolved
        (``ui.runner.resolve_auto``)."""
        if self.needs_auto:
            raise ConfigError("method/precision 'auto' must be resolved before decoding (the app does this on Run)")
        return self._config(self.method, self.precision, self.draft_precision)

    def validate(self) -> None:
        """Check everything the form sets, before any model work. What ``auto`` will choose (the
        method and its shape, the precisions) is checked once chosen; the rest is checked now."""
        if self.long_prompt not in LONG_PROMPT_CHOICES:
            raise ConfigError(f"long prompt must be one of {', '.join(LONG_PROMPT_CHOICES)}, got {self.long_prompt!r}")
        if self.method == AUTO and self.verifier != "auto":
            raise ConfigError(f"verifier: with method 'auto' the verifier is chosen with the method; "
                              f"set it to 'auto' (got {self.verifier!r})")
        self._config("autoregressive" if self.method == AUTO else self.method,
                     None if self.precision == AUTO else self.precision,
                     None if self.draft_precision == AUTO else self.draft_precision)

    def _config(self, method: str, precision: Optional[str], draft_precision: Optional[str]) -> DecodeConfig:
        if not isinstance(self.max_new_tokens, int) or not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise ConfigError(f"max new tokens must be an integer in [1, {MAX_NEW_TOKENS}], got {self.max_new_tokens!r}")
        if not self.prompt or not self.prompt.strip():
            raise ConfigError("the prompt is empty: type some text first")
        if not 0.0 <= self.temperature <= TEMPERATURE_MAX:
            raise ConfigError(f"temperature must be in [0, {TEMPERATURE_MAX:g}] (0 = greedy), got {self.temperature!r}")
        return DecodeConfig(
            method=method,
            verifier=self.verifier,
            temperature=float(self.temperature),
            top_p=float(self.top_p),
            budget=self.budget,
            depth=self.depth,
            width=self.width,
            threshold=float(self.threshold),
            seed=self.seed,
            dtype=self.dtype,
            device=self.device,
            offload_target=self.offload,
            precision=precision,
            draft_precision=None if method == "autoregressive" else draft_precision,
            stop_confidence=self.stop_confidence if method == "chain" else None,
            sequoia_acceptance=self.sequoia_acceptance if method == "sequoia" else None,
            spec_factor=self.spec_factor if method in ("suffix", "hybrid") else DEFAULT_SPEC_FACTOR,
            fallback=None if method == "autoregressive" else self.fallback,
        )

    def pair_spec(self) -> PairSpec:
        return PairSpec(self.draft.strip(), self.target.strip(), self.device, self.dtype, self.offload,
                        self.precision, self.draft_precision)

    def with_method(self, method: str) -> "RunSettings":
        """The same run with another method; the verifier falls back to ``auto`` if incompatible."""
        verifier = ("auto" if method == AUTO or self.verifier not in compatible_verifiers(method, self.temperature)
                    else self.verifier)
        return replace(self, method=method, verifier=verifier, stop_confidence=None, sequoia_acceptance=None,
                       spec_factor=DEFAULT_SPEC_FACTOR, fallback=None)

    def baseline_key(self) -> tuple:
        """Runs with equal keys are comparable (same pair, prompt, seed, length, sampling)."""
        return (self.pair_spec(), self.prompt, self.chat, self.seed, self.max_new_tokens,
                float(self.temperature), float(self.top_p))

    def to_dict(self) -> dict:
        return asdict(self)


def _int(value, name: str) -> int:
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be an integer, got {value!r}") from None
    if f != int(f):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    return int(f)


def settings_from_form(draft, target, device, dtype, prompt, chat, method, verifier, temperature, top_p,
                       budget, depth, width, threshold, max_new_tokens, seed, offload,
                       precision=AUTO, draft_precision=AUTO, long_prompt="refuse") -> RunSettings:
    """Build ``RunSettings`` from raw component values (numbers may arrive as floats or None)."""
    return RunSettings(
        draft=str(draft or ""),
        target=str(target or ""),
        device=str(device or "cpu"),
        dtype=str(dtype or "float32"),
        prompt=str(prompt or ""),
        chat=bool(chat),
        method=str(method),
        verifier=str(verifier or "auto"),
        temperature=float(temperature if temperature is not None else 0.0),
        top_p=float(top_p if top_p is not None else 1.0),
        budget=_int(budget, "budget"),
        depth=_int(depth, "depth"),
        width=_int(width, "width"),
        threshold=float(threshold if threshold is not None else 0.05),
        max_new_tokens=_int(max_new_tokens, "max new tokens"),
        seed=_int(seed, "seed"),
        offload=bool(offload),
        precision=str(precision or AUTO),
        draft_precision=str(draft_precision or AUTO),
        long_prompt=str(long_prompt or "refuse"),
    )
