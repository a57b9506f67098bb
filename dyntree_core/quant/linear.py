"""Weight-only low-bit linear layers on torch core's own CPU kernels.

* ``Int8Linear``: symmetric int8 per output channel, ``torch._weight_int8pack_mm``.
* ``Int4Linear``: asymmetric 4-bit in groups of 32 along the input dimension,
  ``torch._weight_int4pack_mm_for_cpu``; the kernel dequantizes ``w = (q - 8) * s + z``.

Both kernels take bfloat16 activations and bfloat16 scales (with float32 activations they run a
scalar path that is 10-30x slower on AVX2). The layers therefore cast their input to bfloat16,
run the kernel, and cast the output back to the input's dtype: the rest of the model (norms,
attention, residual stream) keeps its own dtype. torch core has no such kernels on CUDA in this
release (2.13): asking for one there raises ``PrecisionError``.
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
    """``x`` ``[..., K]`` -> bf16 ``[M, K]`` -> ``kernel`` -> ``[..., N]`` in ``x``'s dtype, plus the bias."""
    y = kernel(x.reshape(-1, layer.in_features).to(KERNEL_DTYPE)).to(x.dtype)
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
