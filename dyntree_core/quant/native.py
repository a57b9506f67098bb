"""The GGML block kernels (``ggml_kernels.c``) and the decoder layer on them (``decoder_layer.c``): compiled
once per machine with the system C compiler into one shared object and loaded with ``ctypes``.

Available where the CPU has AVX2, FMA and F16C and a C compiler (``cc``/``gcc``) is on the ``PATH``;
elsewhere ``native_kernels()`` returns ``None`` and says why in ``native_unavailable_reason()``, and the
models keep torch's kernels. The shared object is cached under ``$DYNTREE_CACHE/kernels/`` keyed by the
sources and header, the flags and the compiler's version. It is linked with ``-fopenmp`` and resolves
``libgomp.so.1`` to the copy torch already loaded, so both share one thread pool (and its thread count).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

#: the block products, and the decoder layer built on them (``native_layer``), one shared object
SOURCES = (Path(__file__).with_name("ggml_kernels.c"), Path(__file__).with_name("decoder_layer.c"))
#: headers they include (part of the digest)
HEADERS = (Path(__file__).with_name("avx2_sum.h"),)
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-std=c11")
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")

#: types with an int8-activation kernel (``matmul(..., int8_activations=True)``)
INT8_ACTIVATION_TYPES = ("Q4_K", "Q6_K", "Q5_0", "Q8_0")
#: GGML type ids (``gguf.GGMLQuantizationType``) the kernels read, with (block elements, block bytes)
BLOCKS: dict[str, tuple[int, int, int]] = {"Q4_K": (12, 256, 144), "Q6_K": (14, 256, 210),
                                           "Q5_0": (6, 32, 22), "Q8_0": (8, 32, 34)}


class NativeKernelError(RuntimeError):
    """The C kernels returned an error (a type or shape they do not take)."""


@dataclass(frozen=True)
class NativeKernels:
    """The loaded library and its identity (``digest``: source + flags + compiler)."""

    lib: ctypes.CDLL
    path: Path
    digest: str

    def matmul(self, type_name: str, x: torch.Tensor, blocks: torch.Tensor, n: int, k: int,
               bias: Optional[torch.Tensor] = None, int8_activations: bool = False) -> torch.Tensor:
        """``x`` float32 ``[M, K]`` (rows contiguous) @ the ``[N, K]`` weight in ``blocks`` (uint8, GGML rows)
        ``^T`` (+ ``bias`` float32 ``[N]``) -> float32 ``[M, N]``. ``int8_activations``: each row of ``x``
        quantized to int8 first (per 256 values for Q4_K/Q6_K, llama.cpp's Q8_K; per 32 for Q5_0/Q8_0, its Q8_0)
        and integer dot products."""
        m = x.shape[0]
        if x.dtype != torch.float32 or x.stride(1) != 1 or not blocks.is_contiguous() or x.shape[1] != k:
            raise NativeKernelError(f"matmul needs float32 [M, {k}] rows with unit stride and contiguous blocks")
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous() or bias.numel() != n):
            raise NativeKernelError(f"bias must be contiguous float32 [{n}]")
        y = torch.empty(m, n, dtype=torch.float32)
        fn = self.lib.dyntree_ggml_matmul_q8 if int8_activations else self.lib.dyntree_ggml_matmul
        rc = fn(
            BLOCKS[type_name][0], x.data_ptr(), x.stride(0), blocks.data_ptr(),
            bias.data_ptr() if bias is not None else None, y.data_ptr(), n, m, n, k)
        if rc:
            raise NativeKernelError(f"{type_name} matmul of [{m}, {k}] x [{n}, {k}] refused")
        return y

    def dequantize(self, type_name: str, blocks: torch.Tensor, n: int, k: int,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """float32 ``[N, K]``: exactly the gguf package's dequantization of these blocks (into ``out``, a
        contiguous float32 tensor of N*K elements, when given)."""
        if out is None:
            out = torch.empty(n, k, dtype=torch.float32)
        elif out.dtype != torch.float32 or out.numel() != n * k or not out.is_contiguous():
            raise NativeKernelError(f"dequantize needs a contiguous float32 out of {n * k} elements")
        if not blocks.is_contiguous():
            raise NativeKernelError("blocks must be contiguous")
        if self.lib.dyntree_ggml_dequantize(BLOCKS[type_name][0], blocks.data_ptr(), out.data_ptr(), n, k):
            raise NativeKernelError(f"{type_name} dequantize of [{n}, {k}] refused")
        return out


_STATE: dict[str, object] = {}


def _compiler() -> Optional[str]:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_ok() -> Optional[str]:
    from ..machine import machine_info

    flags = set(machine_info().cpu_flags)
    missing = [f for f in REQUIRED_CPU_FLAGS if f not in flags]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


def kernel_digest(cc: str) -> str:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout.splitlines()[:1]
    raw = b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    raw += " ".join(FLAGS).encode() + "".join(version).encode()
    return hashlib.sha256(raw).hexdigest()[:16]


def _build(cc: str, digest: str) -> Path:
    from ..paths import cache_root

    out = cache_root() / "kernels" / f"ggml_kernels-{digest}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out.parent, suffix=".so.partial", delete=False) as tmp:
        tmp_path = Path(tmp.name)
    try:
        proc = subprocess.run([cc, *FLAGS, "-o", str(tmp_path), *map(str, SOURCES), "-lm"], capture_output=True,
                              text=True)
        if proc.returncode:
            raise NativeKernelError(f"{cc} failed: {proc.stderr.strip()[-400:]}")
        tmp_path.replace(out)
    finally:
        tmp_path.unlink(missing_ok=True)
    return out


def _load(path: Path, digest: str) -> NativeKernels:
    lib = ctypes.CDLL(str(path))
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    lib.dyntree_ggml_matmul.argtypes = [ctypes.c_int, vp, i64, vp, vp, vp, i64, i64, i64, i64]
    lib.dyntree_ggml_matmul.restype = ctypes.c_int
    lib.dyntree_ggml_matmul_q8.argtypes = lib.dyntree_ggml_matmul.argtypes
    lib.dyntree_ggml_matmul_q8.restype = ctypes.c_int
    lib.dyntree_ggml_dequantize.argtypes = [ctypes.c_int, vp, vp, i64, i64]
    lib.dyntree_ggml_dequantize.restype = ctypes.c_int
    lib.dyntree_decoder_layer_work.argtypes = [vp, i64, i64]
    lib.dyntree_decoder_layer_work.restype = i64
    lib.dyntree_decoder_layer.argtypes = [vp, vp, i64, vp, vp, vp, vp, i64, i64, vp, i64, vp, i64]
    lib.dyntree_decoder_layer.restype = ctypes.c_int
    return NativeKernels(lib, path, digest)


def native_kernels() -> Optional[NativeKernels]:
    """The compiled kernels, or ``None`` where they cannot run here (``native_unavailable_reason``).
    ``DYNTREE_NATIVE_KERNELS=0`` turns them off."""
    if "kernels" in _STATE or "reason" in _STATE:
        return _STATE.get("kernels")  # type: ignore[return-value]
    reason = None
    if os.environ.get("DYNTREE_NATIVE_KERNELS", "1") == "0":
        reason = "turned off by DYNTREE_NATIVE_KERNELS=0"
    else:
        reason = _cpu_ok()
    cc = _compiler() if reason is None else None
    if reason is None and cc is None:
        reason = "no C compiler (cc/gcc) on the PATH"
    if reason is None:
        try:
            digest = kernel_digest(cc)
            _STATE["kernels"] = _load(_build(cc, digest), digest)
            return _STATE["kernels"]  # type: ignore[return-value]
        except (OSError, NativeKernelError) as e:
            reason = f"{type(e).__name__}: {e}"
    _STATE["reason"] = reason
    return None


def native_unavailable_reason() -> Optional[str]:
    native_kernels()
    return _STATE.get("reason")  # type: ignore[return-value]


def reset_native_kernels() -> None:
    """Forget the loaded state (tests: re-read ``DYNTREE_NATIVE_KERNELS``)."""
    _STATE.clear()
