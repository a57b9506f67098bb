"""Model providers: load a (draft, target, tokenizer) pair lazily, on the first Run.

The app never loads a model at import or build time. ``HubModelProvider`` wraps
``dyntree_core.models.load_pair`` (embedded preset, hub id or local dir) and keeps the most
recently used pair in memory; a lock serialises loads so two sessions never load at once.
"""

from __future__ import annotations

import gc
import threading
from dataclasses import dataclass
from typing import Any, Optional, Protocol


class ModelLoadError(RuntimeError):
    """The requested pair cannot be loaded; the message says why and what to try."""


@dataclass(frozen=True)
class PairSpec:
    """Which pair to load and where."""

    draft: str
    target: str
    device: str = "cpu"
    dtype: str = "float32"
    offload: bool = False


@dataclass
class LoadedPair:
    draft: Any
    target: Any
    tokenizer: Any
    spec: PairSpec
    description: str = ""
    supports_chat: bool = False
    eos_token_ids: tuple[int, ...] = ()  # ids that end generation (empty: the engine's defaults)


class ModelProvider(Protocol):
    """What the app needs from model loading."""

    default_draft: str
    default_target: str

    def load(self, spec: PairSpec) -> LoadedPair: ...

    def is_loaded(self, spec: PairSpec) -> bool: ...


class HubModelProvider:
    """Loads pairs through ``dyntree_core.models.load_pair`` and caches the last one."""

    def __init__(self, default_draft: str = "embedded", default_target: str = "embedded") -> None:
        self.default_draft = default_draft
        self.default_target = default_target
        self._lock = threading.Lock()
        self._pair: Optional[LoadedPair] = None

    def is_loaded(self, spec: PairSpec) -> bool:
        pair = self._pair
        return pair is not None and pair.spec == spec

    def load(self, spec: PairSpec) -> LoadedPair:
        if not spec.draft.strip() or not spec.target.strip():
            raise ModelLoadError("give both a draft and a target model ('embedded', a preset, a local dir or a hub id)")
        with self._lock:
            if self._pair is not None and self._pair.spec == spec:
                return self._pair
            self._release()
            try:
                from dyntree_core.models import load_pair  # lazy: nothing is loaded at import
            except ImportError as e:
                raise ModelLoadError(f"model loading is not available in this build ({e})") from e
            # an offloaded target is streamed from host memory: load it on the CPU
            device = "cpu" if spec.offload else spec.device
            try:
                pair = load_pair(spec.draft.strip(), spec.target.strip(), dtype=spec.dtype, device=device)
            except (OSError, ValueError, KeyError) as e:
                raise ModelLoadError(f"could not load draft {spec.draft!r} / target {spec.target!r}: {e}") from e
            tok = pair.tokenizer
            self._pair = LoadedPair(
                draft=pair.draft,
                target=pair.target,
                tokenizer=tok,
                spec=spec,
                description=str(getattr(pair, "description", "") or f"{spec.draft} → {spec.target}"),
                supports_chat=bool(getattr(tok, "chat_template", None)),
                eos_token_ids=tuple(int(i) for i in getattr(pair, "eos_token_ids", ()) or ()),
            )
            return self._pair

    def _release(self) -> None:
        if self._pair is None:
            return
        self._pair = None
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:  # pragma: no cover - torch is a hard dependency
            pass
