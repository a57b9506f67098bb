"""Precisions: what each name means, and turning a dense model's linear layers into low-bit ones.

``float32`` / ``bfloat16`` / ``float16``: dense weights in that dtype (float16 on CUDA only).
``int8``: every linear layer of the decoder and the output head on ``Int8Linear`` (per channel).
``int4``: every decoder linear layer on ``Int4Linear`` (group 32; a layer whose shape the kernel
refuses, N % 16 or K % 32 != 0, stays int8); the output head stays int8 (the
logits feed verification directly; llama.cpp's Q4_K_M keeps it at 6-8 bits for the same reason).
Embeddings, norms and biases stay dense float32 in both.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .linear import Int4Linear, Int8Linear, PrecisionError, int4_shape_ok, require_cpu_kernel

FLOAT_PRECISIONS: tuple[str, ...] = ("float32", "bfloat16", "float16")
QUANT_PRECISIONS: tuple[str, ...] = ("int8", "int4")
PRECISIONS: tuple[str, ...] = FLOAT_PRECISIONS + QUANT_PRECISIONS
PRECISION_ATTR = "_dyntree_precision"


def head_precision(precision: str) -> str:
    """Precision of the output head under ``precision`` (int4 keeps an int8 head)."""
    return "int8" if precision in QUANT_PRECISIONS else precision


def check_precision(precision: str, device: torch.device | str = "cpu") -> None:
    if precision not in PRECISIONS:
        raise PrecisionError(f"precision must be one of {', '.join(PRECISIONS)} (or auto); got {precision!r}")
    dev = torch.device(device)
    if precision in QUANT_PRECISIONS:
        require_cpu_kernel(precision, dev)
    if precision == "float16" and dev.type == "cpu":
        raise PrecisionError("float16 is for CUDA; on the CPU use float32, bfloat16, int8 or int4")


def model_precision(model: nn.Module) -> str:
    """The precision a model was prepared at (dense models: their parameter dtype)."""
    tag = getattr(model, PRECISION_ATTR, None)
    if tag is not None:
        return tag
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def quantized_linear(precision: str, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> nn.Module:
    if precision == "int8":
        return Int8Linear.from_dense(weight, bias)
    if precision == "int4":
        if not int4_shape_ok(*weight.shape):  # the kernel's shape rules: such layers stay int8
            return Int8Linear.from_dense(weight, bias)
        return Int4Linear.from_dense(weight, bias)
    raise PrecisionError(f"not a quantized precision: {precision!r}")


def _decoder_linears(model: nn.Module) -> list[str]:
    head = model.get_output_embeddings()
    return [name for name, mod in model.named_modules() if isinstance(mod, nn.Linear) and mod is not head]


def _head_name(model: nn.Module) -> Optional[str]:
    head = model.get_output_embeddings()
    for name, mod in model.named_modules():
        if mod is head:
            return name
    return None


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def quantize_model(model: nn.Module, precision: str) -> nn.Module:
    """Replace a dense float32 model's linear layers in place (weights quantized from the dense
    values: int8 per channel, int4 min-max per group of 32); returns the model, tagged."""
    check_precision(precision, next(model.parameters()).device)
    if precision not in QUANT_PRECISIONS:
        raise PrecisionError(f"quantize_model takes int8 or int4, got {precision!r}")
    current = model_precision(model)
    if current == precision:
        return model
    if current in QUANT_PRECISIONS:
        raise PrecisionError(f"the model is already {current}; load it again to get {precision}")
    if current != "float32":
        model.float()
    for name in _decoder_linears(model):
        lin = model.get_submodule(name)
        set_submodule(model, name, quantized_linear(precision, lin.weight, lin.bias))
    head = _head_name(model)
    if head is not None:
        lin = model.get_submodule(head)
        # a head tied to the embedding gets its own quantized copy; the embedding stays dense
        set_submodule(model, head, Int8Linear.from_dense(lin.weight, getattr(lin, "bias", None)))
    setattr(model, PRECISION_ATTR, precision)
    return model


def output_dim(model: nn.Module) -> int:
    """Number of output logits, for dense and quantized heads alike."""
    from .ggml_linear import GGMLLinear

    head = model.get_output_embeddings()
    if isinstance(head, (Int8Linear, Int4Linear, GGMLLinear)):
        return int(head.out_features)
    if head is not None and getattr(head, "weight", None) is not None:
        return int(head.weight.shape[0])
    return int(model.config.get_text_config().vocab_size)
