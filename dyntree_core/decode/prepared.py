"""A draft/target pair prepared once: device, dtype/precision, attention implementation, offload.

Decoders borrow a ``PreparedPair`` and never change its models. Preparation is the one place that
moves, casts or quantizes models in place, switches their attention to the per-call dispatcher
(``attention.hf_backend.DISPATCH_IMPL``: each decoder names its backend on every forward, so a
torch-attention decoder after a Triton one really runs SDPA) and wraps an offloaded target.

``PreparedPair.for_models(draft, target, config)`` returns the pair already prepared for those
model objects when its settings match ``config`` (so consecutive decoders, offloaded ones included,
share one preparation) and prepares them otherwise; a re-preparation with other settings marks the
previous pair stale, and decoders built on a stale pair refuse to run.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..config import ConfigError, DecodeConfig
from ..models.load import VocabMismatchError

_ATTR = "_dyntree_prepared_pair"
#: graph steppers a pair keeps (``PreparedPair.stepper``)
MAX_STEPPERS = 4
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_vocab_size(model) -> int:
    from ..quant.apply import output_dim

    return output_dim(model)


def check_same_vocab(draft, target) -> None:
    dv, tv = model_vocab_size(draft), model_vocab_size(target)
    if dv != tv:
        raise VocabMismatchError(
            f"draft and target vocabularies differ: draft has {dv} output tokens, target has {tv}; "
            "speculative decoding needs one shared tokenizer"
        )


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available on this machine")
    return torch.device(name)


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
    from ..quant.apply import QUANT_PRECISIONS, model_precision, quantize_model
    from ..quant.linear import PrecisionError

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


class PairClosedError(ConfigError):
    """A decoder used a ``PreparedPair`` after ``close()`` (the app released its models)."""


@dataclass(frozen=True)
class PairSettings:
    """What preparing a pair fixes (the ``DecodeConfig`` fields that change the models)."""

    device: str
    dtype: str
    precision: Optional[str]
    draft_precision: Optional[str]
    offload_target: bool

    @classmethod
    def of(cls, config: DecodeConfig) -> "PairSettings":
        return cls(str(resolve_device(config.device)), config.dtype, config.precision, config.draft_precision,
                   bool(config.offload_target))

    def differences(self, other: "PairSettings") -> list[str]:
        return [f"{k}: {getattr(self, k)!r} vs {getattr(other, k)!r}"
                for k in self.__dataclass_fields__ if getattr(self, k) != getattr(other, k)]


class PreparedPair:
    """A draft and a target on one device at fixed precisions, attention dispatched per call,
    the target optionally streamed from host memory (CUDA).

    Build with ``PreparedPair.prepare`` (always prepares) or ``PreparedPair.for_models`` (reuses
    the preparation these model objects already have when the settings match).
    """

    def __init__(self, draft, target, settings: PairSettings, offload: Any, undo: list[Any]):
        self.draft = draft
        self.target = target
        self.settings = settings
        self.device = torch.device(settings.device)
        self.offload = offload
        self.vocab_size = model_vocab_size(target)
        self.stale = False
        self.closed = False
        self._undo = undo
        #: graph steppers (``decode.graph_step``) kept between runs, so a run reuses compiled programs
        self._steppers: "OrderedDict[tuple, Any]" = OrderedDict()

    @classmethod
    def prepare(cls, draft, target, config: DecodeConfig, offload_options: Optional[dict[str, Any]] = None,
                allow_cpu_offload: bool = False) -> "PreparedPair":
        """Prepare ``draft`` and ``target`` (in place) for decoders with ``config``'s device,
        dtype, precisions and offload setting.

        ``offload_options``: keyword arguments for ``offload.offload_decoder_layers`` (``slots``,
        ``resident_layers``, ``host_layers`` for synthetic stacks). ``allow_cpu_offload``: let the
        layer streamer run with the CPU as the "device" (functional runs such as ``bench gpu
        --dry-run`` and tests; it measures nothing).
        """
        if not isinstance(config, DecodeConfig):
            raise TypeError("config must be a DecodeConfig")
        check_same_vocab(draft, target)
        settings = PairSettings.of(config)
        old = target.__dict__.get(_ATTR)
        if old is not None and old.offload is not None:
            raise ConfigError("this target was prepared with offload_target=True and is streamed from host "
                              "memory; load the pair again to prepare it with other settings "
                              f"({'; '.join(old.settings.differences(settings)) or 'same settings'})")
        device = torch.device(settings.device)
        dtype = _DTYPES[settings.dtype]
        prepare_model(draft, device, dtype, settings.draft_precision, "draft")
        offload = None
        if settings.offload_target:
            from ..offload import offload_decoder_layers

            if device.type != "cuda" and not allow_cpu_offload:
                raise ConfigError("offload_target needs a CUDA device (device='cuda')")
            if offload_options is None or "host_layers" not in offload_options:
                place_model(target, None, dtype)
            offload = offload_decoder_layers(target, device=str(device), **(offload_options or {}))
            target.eval()
        else:
            prepare_model(target, device, dtype, settings.precision, "target")
        if device.type == "cuda":  # the graph steps' dense forward (the CUDA default) fuses q/k/v and gate/up:
            from .dense_forward import dense_reason, fuse_model  # once here, not moving weights at a first run

            for m in (draft,) if offload is not None else (draft, target):
                if dense_reason(m) is None:
                    fuse_model(m)
        from ..attention.hf_backend import use_dispatch

        undo = [h for h in (use_dispatch(draft), use_dispatch(target)) if h is not None]
        pair = cls(draft, target, settings, offload, undo)
        for m in (draft, target):
            prev = m.__dict__.get(_ATTR)
            if prev is not None and prev is not pair:
                prev.stale = True
            m.__dict__[_ATTR] = pair  # plain attribute: not a submodule, not in state_dict
        return pair

    @classmethod
    def for_models(cls, draft, target, config: DecodeConfig) -> "PreparedPair":
        """The pair these two model objects were last prepared as, when its settings match
        ``config`` (nothing is touched); otherwise ``prepare``."""
        pair = target.__dict__.get(_ATTR)
        if (pair is not None and not pair.stale and pair.draft is draft
                and draft.__dict__.get(_ATTR) is pair and pair.settings == PairSettings.of(config)):
            return pair
        return cls.prepare(draft, target, config)

    def check(self, config: DecodeConfig) -> None:
        """Raise ``ConfigError`` when a decoder with ``config`` cannot borrow this pair."""
        if self.closed:
            raise PairClosedError("this prepared pair was closed (its offloaded target released); prepare the models "
                                  "again")
        if self.stale:
            raise ConfigError("these models were prepared again with other settings after this pair was made; "
                              "use PreparedPair.for_models(...) for the current preparation")
        diff = self.settings.differences(PairSettings.of(config))
        if diff:
            raise ConfigError("the decoder's settings differ from the prepared pair's ("
                              + "; ".join(diff) + "): prepare a pair for these settings")

    def stepper(self, key: tuple, make: Callable[[], Any]) -> Any:
        """The graph stepper for ``key`` (its programs' shapes and constants), made by ``make()`` when
        there is none free; the last ``MAX_STEPPERS`` used are kept (each holds its KV buffers and
        compiled programs), the pair's ``close`` releases them. A stepper in use by a running
        generation is not shared: a second concurrent run gets one of its own, not kept."""
        stepper = self._steppers.get(key)
        if stepper is not None and stepper.in_use:
            return make()
        if stepper is None:
            stepper = make()
            self._steppers[key] = stepper
            while len(self._steppers) > MAX_STEPPERS:
                _release(self._steppers.popitem(last=False)[1])
        self._steppers.move_to_end(key)
        return stepper

    def give_back(self, stepper) -> None:
        """A run is done with ``stepper`` (from ``stepper``): it is free for the next run when the pair keeps
        it; one the pair does not keep (a concurrent run's own, or evicted meanwhile) has its graphs freed."""
        stepper.end()
        if all(s is not stepper for s in self._steppers.values()):
            stepper.close()

    def restore_attention(self) -> None:
        """Put back the attention implementations the models had before preparation."""
        for h in self._undo:
            h.restore()
        self._undo = []

    def close(self) -> None:
        """Release what preparing acquired: the offloaded target's pinned host memory and device
        slots (``OffloadedModel.close``) and the attention switch. Idempotent; decoders on a closed
        pair refuse to run, and the models may be prepared again (or dropped)."""
        if self.closed:
            return
        self.closed = self.stale = True
        for stepper in self._steppers.values():
            _release(stepper)
        self._steppers.clear()
        for m in (self.draft, self.target):
            if m.__dict__.get(_ATTR) is self:
                del m.__dict__[_ATTR]
        try:
            if self.offload is not None:
                self.offload.close()
        finally:
            self.restore_attention()

    @staticmethod
    def close_attached(*models: Any) -> int:
        """Close the prepared pairs these models belong to (the app calls it with a pair's draft and
        target before dropping them); returns how many were closed."""
        pairs = {id(p): p for p in (m.__dict__.get(_ATTR) for m in models if m is not None) if p is not None}
        for p in pairs.values():
            p.close()
        return len(pairs)


def _release(stepper) -> None:
    """A dropped stepper's captured graphs freed now (one a run still holds is freed when that run drops it)."""
    if not stepper.in_use:
        stepper.close()
