"""Weight-only low-bit linear layers on torch core's own CPU kernels.

* ``Int8Linear``: symmetric int8 per output channel, ``torch._weight_int8pack_mm``.
* ``Int4Linear``: asymmetric 4-bit in groups of 32 along the input dimension,
  ``torch._weight_int4pack_mm_for_cpu``; the kernel dequantizes ``w = (q - 8) * s + z``.

Both kernels take bfloat16 activations and bfloat16 scales (with float32 activations they run a
scalar path that is 10-30x slower on AVX2). The layers therefore cast their input to bfloat16,
run the kernel, and cast the output back to the input's dtype: the rest of the model (norms,
attention, residual stream) keeps its own dtype. torch core has no such kernels on CUDA in this
release (2.13): asking for one there raises ``PrecisionError``.

The kernels dequantize on the fly and do not use AMX: on an AMX Xeon a [4864, 896] layer at 256 input
rows takes 12.9 ms (int4) / 14.2 ms (int8) against 1.2 ms for one dense bf16 GEMM.
``enable_dense_rows`` gives each layer an exact bf16 split of its float32 weight for inputs with many
rows (tree verification, prefill); ``measure_dense_rows`` finds the row count from which that is
faster on this machine (the split costs 3 GEMMs for int4, 2 for int8: 3.7 ms and 2.5 ms there; the
kernels win at 1-4 rows).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

GROUP_SIZE = 32
_INNER_K_TILES = 2
KERNEL_DTYPE = torch.bfloat16


class PrecisionError(ValueError):
    """A precision that cannot run here (no kernel on the device, a shape the kernel refuses)."""


#: byte alignment of the memory torch's allocator hands out on the CPU; the low-bit kernels' vector loads
#: fault on less (int4), and the dense GEMM kernels choose differently-rounding paths for less
CPU_ALIGN = 64


def cpu_aligned(t: torch.Tensor, align: int = CPU_ALIGN) -> torch.Tensor:
    """``t`` itself when its storage is ``align``-byte aligned (or not on the CPU), else an aligned copy.

    safetensors maps tensors at 8-byte offsets into the file; torch's int4 CPU kernel segfaulted on such
    buffers in a 4-token forward (1- and 2-token forwards ran)."""
    return t if t.device.type != "cpu" or t.data_ptr() % align == 0 else t.clone()


def require_cpu_kernel(precision: str, device: torch.device | str) -> None:
    dev = torch.device(device)
    if dev.type != "cpu":
        raise PrecisionError(
            f"precision {precision!r} uses torch's weight-only CPU kernels; torch {torch.__version__} has "
            f"no {precision} weight-only kernel wired up here for {dev.type!r}: use float16/bfloat16 on {dev.type}"
        )


def _round_up_bf16(x: torch.Tensor) -> torch.Tensor:
    """The smallest bfloat16 values >= ``x`` (> 0): a scale rounded up never lets |q| overflow."""
    b = x.to(KERNEL_DTYPE)
    low = b.float() < x
    if bool(low.any()):
        b = torch.where(low, torch.nextafter(b, torch.full_like(b, float("inf"))), b)
    return b


def _apply(layer: nn.Module, x: torch.Tensor, kernel) -> torch.Tensor:
    """``x`` ``[..., K]`` -> bf16 ``[M, K]`` -> ``kernel`` -> ``[..., N]`` in ``x``'s dtype, plus the bias.

    With ``layer.dense_parts`` set (``enable_dense_rows``) and ``M >= layer.dense_min_rows`` the product runs
    on the dense bf16 GEMM instead: ``[x, x, ...] @ dense_parts^T``, whose parts sum exactly to the
    kernel's float32 weight, so only the order of the float32 sums differs from the kernel."""
    x2 = x.reshape(-1, layer.in_features).to(KERNEL_DTYPE)
    parts = layer.dense_parts
    if parts is not None and x2.shape[0] >= layer.dense_min_rows:
        n_parts = parts.shape[1] // layer.in_features
        y = (torch.cat([x2] * n_parts, dim=1) if n_parts > 1 else x2) @ parts.t()
    else:
        y = kernel(x2)
    y = y.to(x.dtype)
    if layer.bias is not None:
        y = y + layer.bias.to(x.dtype)
    return y.reshape(*x.shape[:-1], layer.out_features)


def int4_shape_ok(out_features: int, in_features: int) -> bool:
    """torch's CPU int4 pack needs N % 16 == 0; the groups need K % 32 == 0."""
    return out_features % 16 == 0 and in_features % GROUP_SIZE == 0


class Int8Linear(nn.Module):
    """``y = x @ (q * s)^T + b`` with ``q`` int8 ``[N, K]`` and ``s`` bf16 ``[N]``."""

    precision = "int8"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: Optional[torch.Tensor]):
        super().__init__()
        if qweight.dtype != torch.int8 or qweight.ndim != 2:
            raise PrecisionError("Int8Linear needs an int8 [N, K] weight")
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.to(KERNEL_DTYPE).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.dense_parts: Optional[torch.Tensor] = None
        self.dense_min_rows = 0

    @staticmethod
    def weight_bytes(out_features: int, in_features: int) -> int:
        """Bytes a forward reads of an ``[N, K]`` layer's weight: ``qweight`` and ``scales``."""
        return out_features * in_features + 2 * out_features

    @classmethod
    def from_dense(cls, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> "Int8Linear":
        """Quantize a dense ``[N, K]`` weight, symmetric per row; |error| <= s/2 per element."""
        w = weight.detach().float()
        amax = w.abs().amax(dim=1).clamp_min(1e-12)
        s = _round_up_bf16(amax / 127.0)
        q = torch.round(w / s.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q, s, bias)

    @classmethod
    def from_buffers(cls, qweight: torch.Tensor, scales: torch.Tensor, bias: Optional[torch.Tensor]) -> "Int8Linear":
        """Rebuild from saved buffers (``state_dict`` keys ``qweight``, ``scales``, ``bias``)."""
        return cls(qweight, scales, bias)

    def dequantized_weight(self) -> torch.Tensor:
        """``[N, K]`` float32, exactly what the kernel multiplies by."""
        return self.qweight.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _apply(self, x, lambda x2: torch._weight_int8pack_mm(x2, self.qweight, self.scales))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel"


_PACK_SOURCES: dict[tuple[int, int], torch.Tensor] = {}


def int4_pack_sources(n: int, k: int) -> torch.Tensor:
    """int64 ``[N*K/2*2]``: for each nibble of torch's CPU int4 pack of an ``[N, K]`` weight (byte ``b``'s low
    nibble is slot ``2b``, its high nibble ``2b+1``), the flat index ``n*K + k`` of the value it holds.

    Found by packing the base-16 digits of every index (one pack per digit), so it follows whatever layout
    this torch build uses instead of restating it; cached per shape, and checked to be a permutation."""
    key = (n, k)
    if key not in _PACK_SOURCES:
        index = torch.arange(n * k, dtype=torch.int64)
        sources = torch.zeros(n * k, dtype=torch.int64)
        for digit in range(max(1, ((n * k - 1).bit_length() + 3) // 4)):
            q = ((index >> (4 * digit)) & 15).to(torch.int32).reshape(n, k)
            packed = torch._convert_weight_to_int4pack_for_cpu(q, _INNER_K_TILES).reshape(-1)
            nibbles = torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1).to(torch.int64)
            sources |= nibbles << (4 * digit)
        if sources.numel() != n * k or not torch.equal(torch.sort(sources).values, index):
            raise PrecisionError(f"torch's int4 pack of [{n}, {k}] is not a permutation of nibbles")
        _PACK_SOURCES[key] = sources
    return _PACK_SOURCES[key]


class Int4Linear(nn.Module):
    """4-bit weights in groups of ``GROUP_SIZE`` along K: ``w = (q - 8) * s + z``.

    Buffers: ``packed`` (torch's CPU int4 pack of ``q``, uint8 ``[N, K/2]``),
    ``scales_and_zeros`` bf16 ``[K/g, N, 2]``.
    """

    precision = "int4"

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bias: Optional[torch.Tensor]):
        """``q``: ``[N, K]`` integers in 0..15; ``scales`` / ``zeros``: ``[N, K/g]`` (any float dtype)."""
        super().__init__()
        n, k = q.shape
        if not int4_shape_ok(n, k):
            raise PrecisionError(f"int4 needs in_features divisible by {GROUP_SIZE} and out_features by 16, got [{n}, {k}]")
        if scales.shape != (n, k // GROUP_SIZE) or zeros.shape != scales.shape:
            raise PrecisionError(f"int4 scales/zeros must be [{n}, {k // GROUP_SIZE}], got {tuple(scales.shape)}")
        self.out_features, self.in_features = n, k
        packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), _INNER_K_TILES)
        sz = torch.stack([scales.to(KERNEL_DTYPE), zeros.to(KERNEL_DTYPE)], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", sz)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.dense_parts: Optional[torch.Tensor] = None
        self.dense_min_rows = 0

    @staticmethod
    def weight_bytes(out_features: int, in_features: int) -> int:
        """Bytes a forward reads of an ``[N, K]`` layer's weight: ``packed`` and ``scales_and_zeros``."""
        return out_features * in_features // 2 + 4 * out_features * (in_features // GROUP_SIZE)

    @classmethod
    def from_buffers(cls, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                     bias: Optional[torch.Tensor]) -> "Int4Linear":
        """Rebuild from saved buffers (``state_dict`` keys ``packed``, ``scales_and_zeros``, ``bias``)
        without repacking (the pack layout is torch's; caches are keyed by torch version)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.out_features, self.in_features = int(packed.shape[0]), int(packed.shape[1]) * 2
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.register_buffer("bias", bias)
        self.dense_parts = None
        self.dense_min_rows = 0
        return self

    @classmethod
    def from_groups(cls, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                    bias: Optional[torch.Tensor] = None) -> "Int4Linear":
        """Exact 4-bit groups ``w = scale * q + offset`` (``q`` 0..15, group 32), e.g. GGUF Q4_K/Q4_0/Q4_1
        blocks: the kernel's ``z`` is ``offset + 8 * scale``; only the bf16 rounding of ``s`` and
        ``z`` changes the weights."""
        scale, offset = scale.float(), offset.float()
        return cls(q, scale, offset + 8.0 * scale, bias)

    @classmethod
    def from_dense(cls, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> "Int4Linear":
        """Min-max asymmetric quantization per group of 32 (the bf16-rounded ``s`` and ``z`` are the
        ones used to round ``q``, so ``int4_reference_weight`` of the result is what the kernel uses)."""
        w = weight.detach().float()
        n, k = w.shape
        if not int4_shape_ok(n, k):
            raise PrecisionError(f"int4 needs in_features divisible by {GROUP_SIZE} and out_features by 16, got [{n}, {k}]")
        g = w.reshape(n, k // GROUP_SIZE, GROUP_SIZE)
        lo, hi = g.amin(-1), g.amax(-1)
        s = ((hi - lo) / 15.0).clamp_min(1e-12).to(KERNEL_DTYPE).float()
        z = (lo + 8.0 * s).to(KERNEL_DTYPE).float()
        q = torch.round((g - z[..., None]) / s[..., None] + 8.0).clamp_(0, 15).reshape(n, k)
        return cls(q, s, z, bias)

    def quantized_values(self) -> torch.Tensor:
        """``q`` int32 ``[N, K]`` (0..15) read back from the pack (``int4_pack_sources``)."""
        n, k = self.out_features, self.in_features
        packed = self.packed.reshape(-1)
        nibbles = torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1).to(torch.int32)
        q = torch.empty(n * k, dtype=torch.int32)
        q[int4_pack_sources(n, k)] = nibbles
        return q.reshape(n, k)

    def dequantized_weight(self) -> torch.Tensor:
        """``[N, K]`` float32 ``(q - 8) * s + z``, what the kernel multiplies by."""
        s = self.scales_and_zeros[..., 0].t()
        z = self.scales_and_zeros[..., 1].t()
        return int4_reference_weight(self.quantized_values(), s, z)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _apply(self, x, lambda x2: torch._weight_int4pack_mm_for_cpu(
            x2, self.packed, GROUP_SIZE, self.scales_and_zeros))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group {GROUP_SIZE}"


def int4_reference_weight(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """What ``Int4Linear(q, scales, zeros)`` multiplies by, in float32: ``(q - 8) * bf16(s) + bf16(z)``."""
    s = scales.to(KERNEL_DTYPE).float().repeat_interleave(GROUP_SIZE, dim=1)
    z = zeros.to(KERNEL_DTYPE).float().repeat_interleave(GROUP_SIZE, dim=1)
    return (q.float() - 8.0) * s + z


def split_bf16(w: torch.Tensor, max_parts: int = 3, rows: int = 4096) -> torch.Tensor:
    """``w`` float32 ``[N, K]`` -> bf16 ``[N, P*K]``: ``P`` parts (concatenated along K) whose float32 sum is
    ``w`` exactly; bf16 keeps float32's exponent range, so each part takes the next 8+ mantissa bits and
    three always suffice. ``P`` is the fewest that are exact for every row (int8 weights need two)."""
    n, k = w.shape
    out = torch.zeros(n, max_parts * k, dtype=KERNEL_DTYPE)
    used = 1
    for start in range(0, n, rows):
        rest = w[start:start + rows].float()
        for i in range(max_parts):
            part = rest.to(KERNEL_DTYPE)
            out[start:start + rows, i * k:(i + 1) * k] = part
            rest = rest - part.float()
            if not bool(rest.any()):
                used = max(used, i + 1)
                break
        else:
            raise PrecisionError(f"{max_parts} bf16 parts do not represent these weights exactly")
    return out[:, :used * k].contiguous()


def low_bit_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (Int8Linear, Int4Linear))]


def dense_rows_bytes(model: nn.Module) -> int:
    """Upper bound of the memory ``enable_dense_rows`` adds: three bf16 copies of every low-bit weight."""
    return sum(3 * 2 * m.out_features * m.in_features for m in low_bit_layers(model))


def enable_dense_rows(model: nn.Module, min_rows: int) -> int:
    """From ``min_rows`` input rows on, the model's low-bit layers multiply on the dense bf16 GEMM by an exact
    split of their float32 weight (``split_bf16``); fewer rows keep the weight-only kernel. On CPUs with
    AMX the dense GEMM is ~10x faster than torch's int4/int8 kernels at 256 rows while the kernels win at
    1 row, and the outputs agree up to the order of float32 sums. ``min_rows <= 0`` turns it off.
    Returns the bytes the parts take."""
    total = 0
    for m in low_bit_layers(model):
        if min_rows <= 0:
            m.dense_parts, m.dense_min_rows = None, 0
            continue
        if m.dense_parts is None:
            m.dense_parts = split_bf16(m.dequantized_weight())
        m.dense_min_rows = int(min_rows)
        total += m.dense_parts.numel() * m.dense_parts.element_size()
    return total


def measure_dense_rows(model: nn.Module, rows: tuple[int, ...] = (2, 4, 8, 16, 32, 64, 128)) -> tuple[int, dict]:
    """Time the model's largest low-bit layer on its kernel and on the dense split at each row count; the
    threshold is the smallest count from which the dense split is faster at every larger count tried
    (0 when it never is, e.g. without AMX, where bf16 GEMMs are slow). Returns it and the timings."""
    from ..measured import time_call

    layers = low_bit_layers(model)
    if not layers:
        return 0, {}
    layer = max(layers, key=lambda m: m.out_features * m.in_features)
    saved = layer.dense_parts, layer.dense_min_rows
    if layer.dense_parts is None:
        layer.dense_parts = split_bf16(layer.dequantized_weight())
    timings = {}
    with torch.inference_mode():
        for m in rows:
            x = torch.randn(m, layer.in_features)
            layer.dense_min_rows = 1 << 62
            kernel_ms = time_call(lambda: layer(x)).median_ms
            layer.dense_min_rows = 1
            dense_ms = time_call(lambda: layer(x)).median_ms
            timings[m] = {"kernel_ms": kernel_ms, "dense_ms": dense_ms}
    layer.dense_parts, layer.dense_min_rows = saved
    threshold = 0
    for m in reversed(rows):
        if timings[m]["dense_ms"] >= timings[m]["kernel_ms"]:
            break
        threshold = m
    shape = f"{type(layer).__name__} [{layer.out_features}, {layer.in_features}]"
    return threshold, {"layer": shape, "timings": timings}
