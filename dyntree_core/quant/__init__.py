"""Weight-only low-bit precision on torch core's kernels, and exact GGUF block reading."""

from .apply import (
    FLOAT_PRECISIONS,
    PRECISIONS,
    QUANT_PRECISIONS,
    check_precision,
    head_precision,
    model_precision,
    output_dim,
    quantize_model,
)
from .linear import GROUP_SIZE, Int4Linear, Int8Linear, PrecisionError, int4_reference_weight

__all__ = [
    "FLOAT_PRECISIONS", "PRECISIONS", "QUANT_PRECISIONS", "GROUP_SIZE", "Int4Linear", "Int8Linear",
    "PrecisionError", "check_precision", "head_precision", "int4_reference_weight", "model_precision",
    "output_dim", "quantize_model",
]
