"""The GGML block kernels (``ggml_kernels.c``) and the decoder layer on them (``decoder_layer.c``): compiled
once per machine with the system C compiler into one shared object and loaded with ``ctypes``.

Available where the CPU has AVX2, FMA and F16C and a C compiler (``cc``/``gcc``) is on the ``PATH``;
elsewhere ``native_kernels()`` returns ``None`` and says why in ``native_unavailable_reason()``, and the
models keep torch's kernels. The shared object is cached under ``$DYNTREE_CACHE/kernels/`` keyed by the
sources and header, the flags and the compiler's version. It is linked with ``-fopenmp`` and resolves
``libgomp.so.1`` to the copy torch already loaded, so both share one thread pool (and its thread count).

``ggml_vnni.c`` (the Q4_K/Q6_K int8-activation row kernels on AVX-512 VNNI, bit-identical to the AVX2 ones) is
compiled into the same object with its own ISA flags; a compiler that cannot build it leaves it out and says so
(``NativeKernels.vnni_reason``). Where the CPU has AVX-512 F/BW/VL/VNNI, the first load checks the VNNI path
against the AVX2 path bit for bit on synthetic blocks before ``NativeKernels.vnni`` says it may run (the kernel
table then times it like any candidate). ``build_simde_kernels()`` builds the VNNI file against SIMDe's portable
intrinsics instead, for tests on CPUs without AVX-512.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch

#: the block products, and the decoder layer built on them (``native_layer``), one shared object
SOURCES = (Path(__file__).with_name("ggml_kernels.c"), Path(__file__).with_name("decoder_layer.c"))
#: the AVX-512 VNNI row kernels: compiled apart with ``VNNI_FLAGS`` (or against SIMDe), linked into the same object
VNNI_SOURCE = Path(__file__).with_name("ggml_vnni.c")
#: headers they include (part of the digest)
HEADERS = (Path(__file__).with_name("avx2_sum.h"), Path(__file__).with_name("q8_blocks.h"),
           Path(__file__).with_name("q5_0_x8.h"))
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-std=c11")
VNNI_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")
#: where Debian's libsimde-dev puts SIMDe (``build_simde_kernels``)
SIMDE_HEADER = Path("/usr/include/simde/x86/avx512.h")
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")

#: types with an int8-activation kernel (``matmul(..., int8_activations=True)``)
INT8_ACTIVATION_TYPES = ("Q4_K", "Q6_K", "Q5_0", "Q8_0")
#: GGML type ids (``gguf.GGMLQuantizationType``) the kernels read, with (block elements, block bytes)
BLOCKS: dict[str, tuple[int, int, int]] = {"Q4_K": (12, 256, 144), "Q6_K": (14, 256, 210),
                                           "Q5_0": (6, 32, 22), "Q8_0": (8, 32, 34)}
#: rows repacked 8 at a time (``NativeKernels.repack_x8``; ``ggml_kernels.c``, "Q4_K x8", "Q6_K x8" and "Q5_0 x8"):
#: per GGML type, the kernels' own type id (not GGML's) and the bytes per group of 8 rows and block (``BLOCKS``)
X8: dict[str, tuple[int, int]] = {"Q4_K": (112, 1184), "Q6_K": (114, 1680), "Q5_0": (106, 176)}
X8_TYPES = tuple(X8)
#: their repack / unpack functions: dyntree_<name>_x8_repack
X8_C_NAMES = {"Q4_K": "q4k", "Q6_K": "q6k", "Q5_0": "q5_0"}


def x8_shape(type_name: str, n: int, k: int) -> tuple[int, int]:
    """The uint8 shape of an ``[n, k]`` weight in the x8 layout: one row per group of 8 weight rows."""
    elems = BLOCKS[type_name][1] if type_name in X8 else 0
    if type_name not in X8 or n % 8 or k % elems:
        raise ValueError(f"the x8 layout takes {', '.join(X8)} with N % 8 == 0 and K a multiple of their blocks "
                         f"(256 values; Q5_0: 32), got {type_name} [{n}, {k}]")
    return n // 8, k // elems * X8[type_name][1]


class NativeKernelError(RuntimeError):
    """The C kernels returned an error (a type or shape they do not take)."""


@dataclass(frozen=True)
class NativeKernels:
    """The loaded library and its identity (``digest``: source + flags + compiler)."""

    lib: ctypes.CDLL
    path: Path
    digest: str
    #: the VNNI row kernels may run here: built, the CPU has AVX-512 F/BW/VL/VNNI (or SIMDe emulates them) and
    #: they matched the AVX2 kernels bit for bit at load
    vnni: bool = False
    #: why not (None when ``vnni``)
    vnni_reason: Optional[str] = None
    #: built against SIMDe (``build_simde_kernels``, tests only)
    emulated: bool = False

    def matmul(self, type_name: str, x: torch.Tensor, blocks: torch.Tensor, n: int, k: int,
               bias: Optional[torch.Tensor] = None, int8_activations: bool = False,
               vnni_min_rows: int = 0, x8: bool = False) -> torch.Tensor:
        """``x`` float32 ``[M, K]`` (rows contiguous) @ the ``[N, K]`` weight in ``blocks`` (uint8, GGML rows)
        ``^T`` (+ ``bias`` float32 ``[N]``) -> float32 ``[M, N]``. ``int8_activations``: each row of ``x``
        quantized to int8 first (per 256 values for Q4_K/Q6_K, llama.cpp's Q8_K; per 32 for Q5_0/Q8_0, its Q8_0)
        and integer dot products; from ``vnni_min_rows`` rows on (0: never) Q4_K/Q6_K/Q5_0 take the AVX-512 VNNI
        kernels where ``vnni`` (the same outputs, bit for bit). ``x8``: ``blocks`` is in the x8 layout
        (``repack_x8``; int8 activations only): 8 weight rows per tile, its own arithmetic (outputs differ from
        the row kernels' by float rounding, and are the same at every M)."""
        m = x.shape[0]
        if x8 and (not int8_activations or tuple(blocks.shape) != x8_shape(type_name, n, k)):
            raise NativeKernelError(f"the x8 kernel takes blocks of shape {x8_shape(type_name, n, k)} with int8 "
                                    f"activations, got {type_name} {tuple(blocks.shape)}")
        if x.dtype != torch.float32 or x.stride(1) != 1 or not blocks.is_contiguous() or x.shape[1] != k:
            raise NativeKernelError(f"matmul needs float32 [M, {k}] rows with unit stride and contiguous blocks")
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous() or bias.numel() != n):
            raise NativeKernelError(f"bias must be contiguous float32 [{n}]")
        y = torch.empty(m, n, dtype=torch.float32)
        args = (X8[type_name][0] if x8 else BLOCKS[type_name][0], x.data_ptr(), x.stride(0), blocks.data_ptr(),
                bias.data_ptr() if bias is not None else None, y.data_ptr(), n, m, n, k)
        if int8_activations:
            rc = self.lib.dyntree_ggml_matmul_q8v(*args, vnni_min_rows if self.vnni else 0)
        else:
            rc = self.lib.dyntree_ggml_matmul(*args)
        if rc:
            raise NativeKernelError(f"{type_name} matmul of [{m}, {k}] x [{n}, {k}] refused")
        return y

    def repack_x8(self, type_name: str, blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """uint8 ``x8_shape(type_name, n, k)``: ``blocks`` (GGML rows ``[n, k]``) in the x8 layout (a new tensor, in 2
        MiB pages where it fills one: ``huge_pages.huge_empty``, so ``GGMLLinear`` keeps it without a copy)."""
        from .huge_pages import huge_empty

        out = huge_empty(x8_shape(type_name, n, k))
        fn = getattr(self.lib, f"dyntree_{X8_C_NAMES[type_name]}_x8_repack")
        if not blocks.is_contiguous() or blocks.numel() != n * (k // BLOCKS[type_name][1]) * BLOCKS[type_name][2] or \
                fn(blocks.data_ptr(), n, k, out.data_ptr()):
            raise NativeKernelError(f"{type_name} x8 repack of [{n}, {k}] refused")
        return out

    def unpack_x8(self, type_name: str, x8: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """uint8 ``[n, row bytes]``: the GGML rows ``repack_x8`` made ``x8`` from, byte for byte."""
        out = torch.empty(n, k // BLOCKS[type_name][1] * BLOCKS[type_name][2], dtype=torch.uint8)
        fn = getattr(self.lib, f"dyntree_{X8_C_NAMES[type_name]}_x8_unpack")
        if not x8.is_contiguous() or tuple(x8.shape) != x8_shape(type_name, n, k) or \
                fn(x8.data_ptr(), n, k, out.data_ptr()):
            raise NativeKernelError(f"{type_name} x8 unpack of [{n}, {k}] refused")
        return out

    def vnni_products(self) -> int:
        """How many products took the VNNI row kernels in this process (tests: which path ran)."""
        return int(self.lib.dyntree_ggml_vnni_products())

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


def kernel_digest(cc: str, variant: str = "native") -> str:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout.splitlines()[:1]
    raw = b"".join(p.read_bytes() for p in (*SOURCES, VNNI_SOURCE, *HEADERS))
    raw += " ".join((*FLAGS, *VNNI_FLAGS, variant)).encode() + "".join(version).encode()
    return hashlib.sha256(raw).hexdigest()[:16]


def _run_cc(cc: str, args: list[str]) -> Optional[str]:
    """The compiler's complaint (its last 400 characters), or None when it succeeded."""
    proc = subprocess.run([cc, *args], capture_output=True, text=True)
    return f"{cc} failed: {proc.stderr.strip()[-400:]}" if proc.returncode else None


def _build(cc: str, digest: str, variant: str = "native") -> tuple[Path, Optional[str]]:
    """The shared object (built now unless cached) and why it has no VNNI kernels (None when it has them; a
    cached object remembers the reason in a ``.novnni`` file beside it). ``variant``: ``native`` (the VNNI file
    on the real instructions) or ``simde`` (against SIMDe's portable intrinsics, tests only)."""
    from ..paths import cache_root

    out = cache_root() / "kernels" / f"ggml_kernels-{digest}.so"
    note = out.with_suffix(".novnni")
    if out.is_file():
        return out, (note.read_text() if note.is_file() else None)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        obj, tmp_so = Path(tmp) / "ggml_vnni.o", Path(tmp) / "kernels.so"
        isa = ["-DDYNTREE_VNNI_SIMDE"] if variant == "simde" else list(VNNI_FLAGS)
        compile_flags = [f for f in FLAGS if f != "-shared"]
        complaint = _run_cc(cc, [*compile_flags, *isa, "-c", str(VNNI_SOURCE), "-o", str(obj)])
        extra = ["-DDYNTREE_NO_VNNI"] if complaint else [str(obj)]
        failed = _run_cc(cc, [*FLAGS, *extra, "-o", str(tmp_so), *map(str, SOURCES), "-lm"])
        if failed:
            raise NativeKernelError(failed)
        vnni_reason = f"the VNNI kernels did not compile: {complaint}" if complaint else None
        if vnni_reason:
            note.write_text(vnni_reason)
        tmp_so.replace(out)
    return out, vnni_reason


def _load(path: Path, digest: str, vnni_reason: Optional[str] = None, emulated: bool = False) -> NativeKernels:
    lib = ctypes.CDLL(str(path))
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    lib.dyntree_ggml_matmul.argtypes = [ctypes.c_int, vp, i64, vp, vp, vp, i64, i64, i64, i64]
    lib.dyntree_ggml_matmul.restype = ctypes.c_int
    lib.dyntree_ggml_matmul_q8.argtypes = lib.dyntree_ggml_matmul.argtypes
    lib.dyntree_ggml_matmul_q8.restype = ctypes.c_int
    lib.dyntree_ggml_matmul_q8v.argtypes = [*lib.dyntree_ggml_matmul.argtypes, i64]
    lib.dyntree_ggml_matmul_q8v.restype = ctypes.c_int
    lib.dyntree_ggml_vnni.argtypes = []
    lib.dyntree_ggml_vnni.restype = ctypes.c_int
    lib.dyntree_ggml_vnni_products.argtypes = []
    lib.dyntree_ggml_vnni_products.restype = i64
    lib.dyntree_ggml_dequantize.argtypes = [ctypes.c_int, vp, vp, i64, i64]
    lib.dyntree_ggml_dequantize.restype = ctypes.c_int
    for t in X8_C_NAMES.values():
        for op in ("repack", "unpack"):
            fn = getattr(lib, f"dyntree_{t}_x8_{op}")
            fn.argtypes, fn.restype = [vp, i64, i64, vp], ctypes.c_int
    lib.dyntree_decoder_layer_work.argtypes = [vp, i64, i64]
    lib.dyntree_decoder_layer_work.restype = i64
    lib.dyntree_decoder_layer.argtypes = [vp, vp, i64, vp, vp, vp, vp, i64, i64, vp, i64, vp, i64]
    lib.dyntree_decoder_layer.restype = ctypes.c_int
    lib.dyntree_decoder_layers.argtypes = [vp, i64, vp, i64, vp, vp, vp, vp, vp, i64, vp, i64, vp, i64, vp]
    lib.dyntree_decoder_layers.restype = ctypes.c_int
    kernels = NativeKernels(lib, path, digest, emulated=emulated)
    if vnni_reason is None and not lib.dyntree_ggml_vnni():
        vnni_reason = "the CPU lacks AVX-512 F/BW/VL/VNNI"
    if vnni_reason is None:
        vnni_reason = vnni_mismatch(kernels)
    return replace(kernels, vnni=vnni_reason is None, vnni_reason=vnni_reason)


def synthetic_blocks(type_name: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """uint8 ``[N, row bytes]`` of random GGML blocks with small finite fp16 scales (timing and equality checks
    need no real values; a NaN or denormal scale would)."""
    _, elems, nbytes = BLOCKS[type_name]
    if k % elems:
        raise ValueError(f"{type_name} rows need K % {elems} == 0, got K={k}")
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, k // elems * nbytes), dtype=torch.uint8, generator=gen)
    blocks = raw.view(n, -1, nbytes)
    half = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    for off in {"Q4_K": (0, 2), "Q6_K": (208,), "Q5_0": (0,), "Q8_0": (0,)}[type_name]:
        blocks[:, :, off:off + 2] = half
    return raw


#: (type, N, K) and row counts of the load-time check: every row grouping of the row kernels (1..8, a remainder)
VNNI_CHECK_SHAPES = (("Q4_K", 24, 512), ("Q6_K", 24, 512), ("Q5_0", 24, 512))
VNNI_CHECK_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 11, 17)


def vnni_mismatch(kernels: NativeKernels) -> Optional[str]:
    """None when the VNNI row kernels give the AVX2 kernels' outputs bit for bit on synthetic blocks (with a bias
    and a row stride wider than K), and the VNNI x8 tiles the AVX2 tiles', else what differed. ``kernels.vnni``
    need not be set: this decides it."""
    gen = torch.Generator().manual_seed(7)
    trial = replace(kernels, vnni=True)
    for x8 in (False, True):
        what = "the VNNI x8 tile differs from the AVX2 one" if x8 else "the VNNI kernels differ from the AVX2 kernels"
        for type_name, n, k in VNNI_CHECK_SHAPES:
            if x8 and type_name not in X8:
                continue
            blocks = synthetic_blocks(type_name, n, k, seed=3)
            if x8:
                blocks = trial.repack_x8(type_name, blocks, n, k)
            bias = torch.randn(n, generator=gen)
            for m in VNNI_CHECK_ROWS:
                x = torch.randn(m, k + 32, generator=gen)[:, :k] * 3
                ref = trial.matmul(type_name, x, blocks, n, k, bias, True, vnni_min_rows=0, x8=x8)
                got = trial.matmul(type_name, x, blocks, n, k, bias, True, vnni_min_rows=1, x8=x8)
                if not torch.equal(ref.view(torch.int32), got.view(torch.int32)):
                    worst = (ref - got).abs().max().item()
                    return f"{what} ({type_name}, {m} rows, max |d| {worst:.3g})"
    return None


#: ``x8_layout_tag`` per kernels' digest (computed once per process)
_X8_TAGS: dict[str, str] = {}


def x8_layout_tag(kernels: NativeKernels) -> str:
    """8 hex digits naming the x8 layout ``kernels`` write: a digest of ``repack_x8`` on fixed rows of each x8 type.
    A packed cache keeps its x8 layers in this layout, under this name: kernels that lay the tiles out otherwise
    read a file of their own instead of misreading one."""
    tag = _X8_TAGS.get(kernels.digest)
    if tag is None:
        g = torch.Generator().manual_seed(8)
        h = hashlib.sha256()
        for type_name in X8_TYPES:
            n, k = 16, 2 * 256
            rows = torch.randint(0, 256, (n, k // BLOCKS[type_name][1] * BLOCKS[type_name][2]), dtype=torch.uint8,
                                 generator=g)
            h.update(type_name.encode() + kernels.repack_x8(type_name, rows, n, k).numpy().tobytes())
        tag = _X8_TAGS[kernels.digest] = h.hexdigest()[:8]
    return tag


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
            path, vnni_reason = _build(cc, digest)
            _STATE["kernels"] = _load(path, digest, vnni_reason)
            return _STATE["kernels"]  # type: ignore[return-value]
        except (OSError, NativeKernelError) as e:
            reason = f"{type(e).__name__}: {e}"
    _STATE["reason"] = reason
    return None


def build_simde_kernels() -> Optional[NativeKernels]:
    """The kernels with ``ggml_vnni.c`` compiled against SIMDe's portable AVX-512 intrinsics (Debian's
    libsimde-dev), which any AVX2 CPU runs: the tests check the VNNI row kernels' arithmetic with it where the
    CPU has no AVX-512. None where SIMDe, a compiler or the AVX2 kernels are missing. Never what a model uses."""
    if not SIMDE_HEADER.is_file() or _cpu_ok() is not None or _compiler() is None:
        return None
    cc = _compiler()
    digest = kernel_digest(cc, "simde")
    path, reason = _build(cc, digest, "simde")
    if reason is not None:
        raise NativeKernelError(reason)
    return _load(path, digest, None, emulated=True)


def native_unavailable_reason() -> Optional[str]:
    native_kernels()
    return _STATE.get("reason")  # type: ignore[return-value]


def reset_native_kernels() -> None:
    """Forget the loaded state (tests: re-read ``DYNTREE_NATIVE_KERNELS``)."""
    _STATE.clear()
