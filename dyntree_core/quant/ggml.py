"""GGML quantized blocks, read exactly.

4-bit block types map one-to-one onto ``Int4Linear``'s groups of 32 (``w = scale * q + offset``,
``q`` in 0..15), so a GGUF's 4-bit tensors run on torch's int4 kernel without requantization:

* ``Q4_0`` (32 values, fp16 ``d``): ``w = d * (q - 8)``
* ``Q4_1`` (32 values, fp16 ``d``, ``m``): ``w = d * q + m``
* ``Q4_K`` (super-block of 256 = 8 groups of 32; fp16 ``d``, ``dmin``; 6-bit ``sc``, ``m`` per group):
  ``w = d * sc * q - dmin * m``

Every other type is dequantized to float32 with the ``gguf`` package's own reference code.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K")
_CHUNK_ROWS = 16384


@dataclass(frozen=True)
class Groups4:
    """A ``[N, K]`` weight as exact 4-bit groups of 32 along K.

    Attributes:
        q: ``[N, K]`` uint8 in 0..15.
        scale, offset: ``[N, K/32]`` float32; ``w[n, k] = scale[n, k//32] * q[n, k] + offset[n, k//32]``.
    """

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        s = self.scale.repeat_interleave(32, dim=1)
        o = self.offset.repeat_interleave(32, dim=1)
        return self.q.float() * s + o

    def take_rows(self, index: torch.Tensor) -> "Groups4":
        return Groups4(self.q[index], self.scale[index], self.offset[index])


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[..., 16*j]`` packed bytes -> ``[..., 32*j]``: per 32-byte chunk the low nibbles give the
    first 32 values and the high nibbles the next 32 (GGML's layout for Q4_0/Q4_1/Q4_K)."""
    lo = qs & np.uint8(0x0F)
    hi = qs >> np.uint8(4)
    return np.concatenate([lo, hi], axis=-1)


def _f16(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.float16).astype(np.float32)


def decode_4bit(data: np.ndarray, type_name: str, n_rows: int, n_cols: int) -> Groups4:
    """Exact groups of a 4-bit GGML tensor.

    Args:
        data: the tensor's raw bytes as stored in the GGUF, ``[n_rows, bytes_per_row]`` uint8.
        type_name: ``Q4_0``, ``Q4_1`` or ``Q4_K``.
        n_rows, n_cols: the torch weight shape ``[N, K]`` (K = GGUF ``ne0``).
    """
    raw = np.asarray(data, dtype=np.uint8).reshape(n_rows, -1)
    if type_name in ("Q4_0", "Q4_1"):
        head = 2 if type_name == "Q4_0" else 4
        blocks = raw.reshape(n_rows, n_cols // 32, head + 16)
        d = _f16(blocks[..., 0:2])[..., 0]
        q = _nibbles(blocks[..., head:])  # [N, K/32, 32]
        if type_name == "Q4_0":
            scale, offset = d, -8.0 * d
        else:
            scale, offset = d, _f16(blocks[..., 2:4])[..., 0]
    elif type_name == "Q4_K":
        from gguf.quants import Q4_K

        nb = n_cols // 256
        blocks = raw.reshape(n_rows * nb, 144)
        d = _f16(blocks[:, 0:2])[:, 0:1]
        dmin = _f16(blocks[:, 2:4])[:, 0:1]
        sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
        scale = (d * sc.astype(np.float32)).reshape(n_rows, nb * 8)
        offset = (-(dmin * m.astype(np.float32))).reshape(n_rows, nb * 8)
        q = _nibbles(blocks[:, 16:].reshape(n_rows * nb, 4, 32))  # [.., 4, 64]: 2 groups per 32 bytes
        q = q.reshape(n_rows, nb * 8, 32)
    else:
        raise ValueError(f"{type_name} is not a 4-bit GGML type ({', '.join(FOUR_BIT_TYPES)})")
    return Groups4(
        torch.from_numpy(np.ascontiguousarray(q.reshape(n_rows, n_cols))),
        torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32)),
        torch.from_numpy(np.ascontiguousarray(offset, dtype=np.float32)),
    )


def dequantize(data: np.ndarray, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Float32 tensor of torch shape ``shape`` (reversed GGUF ``ne``), via the gguf package."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    if len(shape) == 2 and shape[0] > _CHUNK_ROWS:  # bound the reference code's temporaries (GBs for a head)
        out = torch.empty(shape, dtype=torch.float32)
        raw = np.asarray(data).reshape(shape[0], -1)
        for r in range(0, shape[0], _CHUNK_ROWS):
            part = raw[r:r + _CHUNK_ROWS]
            out[r:r + part.shape[0]] = dequantize(part, type_name, (part.shape[0], shape[1]))
        return out
    if type_name in FOUR_BIT_TYPES and len(shape) == 2:
        return decode_4bit(data, type_name, shape[0], shape[1]).dequantize()
    arr = gguf_dequantize(np.asarray(data), GGMLQuantizationType[type_name])
    return torch.from_numpy(np.array(arr, dtype=np.float32, copy=True).reshape(shape))
