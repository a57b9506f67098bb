"""``GGMLLinear``: a linear layer that keeps a GGUF tensor's own blocks (Q4_K, Q6_K, Q5_0, Q8_0) and multiplies
float32 activations by them (``native.NativeKernels``), with no re-pack, no activation cast and the bias
added in the kernel.

Two ways to run it, both from the same bytes (no extra memory kept):

* ``rows``: the row kernel (every weight row read once per call, each activation row against it); with
  ``int8_activations`` (Q4_K/Q6_K) each activation row is first quantized to int8 per 256 values and the
  products are integer dot products, as llama.cpp does on x86 (faster where the float kernel is
  compute-bound; the activations' rounding is the price);
* ``dequant_mm``: the weight dequantized to float32 a chunk of rows at a time into a reused buffer, then
  torch's float32 GEMM (``torch.mm``); wins once enough rows share each dequantized weight.

* ``x8`` (Q4_K, Q6_K and Q5_0 with int8 activations): the rows repacked 8 at a time at construction
  (``native.repack_x8``: a tile of 8 weight rows against up to 4 activation rows, one output column per lane;
  docs/CPU_KERNELS.md). Its own arithmetic (float rounding apart from the row kernel's), the same at every M.

``mm_min_rows`` (from the kernel table) picks ``dequant_mm`` from that many input rows on (0: never; always 0
with ``int8_activations``, so every M rounds the same way). ``vnni_min_rows`` (int8 activations; Q4_K/Q6_K/Q5_0) runs
the AVX-512 VNNI row kernels from that many rows on where the kernels have them: the same outputs, bit for bit.
Without ``int8_activations`` both use the float32 weight the gguf package's dequantization gives, so they agree
with each other and with the float32 model up to the order of float32 sums.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.autograd import profiler as _profiler

from .huge_pages import HUGE_PAGE, in_huge_pages, packed_in_huge_pages
from .linear import cpu_aligned
from .native import BLOCKS, INT8_ACTIVATION_TYPES, X8, X8_TYPES, NativeKernels, native_kernels, x8_shape

#: floats of float32 weight dequantized per ``dequant_mm`` chunk (16 MiB): fits in L3, bounds the buffer
CHUNK_FLOATS = 1 << 22
_SCRATCH: dict[str, torch.Tensor] = {}


def _scratch(n: int) -> torch.Tensor:
    buf = _SCRATCH.get("buf")
    if buf is None or buf.numel() < n:
        buf = torch.empty(max(n, CHUNK_FLOATS), dtype=torch.float32)
        _SCRATCH["buf"] = buf
    return buf[:n]


def row_bytes(type_name: str, k: int) -> int:
    _, elems, nbytes = BLOCKS[type_name]
    if k % elems:
        raise ValueError(f"{type_name} rows need K % {elems} == 0, got K={k}")
    return k // elems * nbytes


class GGMLLinear(nn.Module):
    """``y = x @ W^T + b`` with ``W`` ``[N, K]`` in GGML blocks.

    Buffers: ``blocks`` uint8 ``[N, row_bytes]`` (the GGUF's bytes of each row; with ``x8`` the x8 layout,
    ``native.x8_shape(type_name, N, K)``), ``bias`` float32 ``[N]`` or None. ``type_name``: ``Q4_K``, ``Q6_K``,
    ``Q5_0`` or ``Q8_0``. ``x8``: GGML rows given are repacked (a new tensor: a buffer shared with an embedding stays as it
    is); blocks already in the x8 layout (``x8_shape``) are taken as they are (``out_features`` then says N).
    """

    precision = "ggml"

    def __init__(self, type_name: str, blocks: torch.Tensor, in_features: int, bias: Optional[torch.Tensor] = None,
                 kernels: Optional[NativeKernels] = None, int8_activations: bool = False, x8: bool = False,
                 out_features: Optional[int] = None):
        super().__init__()
        if type_name not in BLOCKS:
            raise ValueError(f"GGMLLinear takes {', '.join(BLOCKS)}, got {type_name}")
        self.kernels = kernels or native_kernels()
        if self.kernels is None:
            raise RuntimeError("GGMLLinear needs the native kernels (quant.native.native_kernels())")
        if int8_activations and type_name not in INT8_ACTIVATION_TYPES:
            raise ValueError(f"int8 activations are for {', '.join(INT8_ACTIVATION_TYPES)}, not {type_name}")
        if x8 and (type_name not in X8_TYPES or not int8_activations):
            raise ValueError(f"the x8 layout is for {', '.join(X8_TYPES)} with int8 activations, not {type_name}"
                             + ("" if int8_activations else " with float32 activations"))
        n = int(out_features if out_features is not None else blocks.shape[0])
        packed = x8 and blocks.dtype == torch.uint8 and tuple(blocks.shape) == x8_shape(type_name, n, in_features)
        if not packed and (blocks.dtype != torch.uint8 or blocks.ndim != 2 or blocks.shape[0] != n
                           or blocks.shape[1] != row_bytes(type_name, in_features)):
            layouts = f"[{n}, {row_bytes(type_name, in_features)}]" + (
                f" or x8 {x8_shape(type_name, n, in_features)}" if x8 else "")
            raise ValueError(f"{type_name} blocks of [{n}, {in_features}] must be uint8 {layouts}, "
                             f"got {tuple(blocks.shape)} {blocks.dtype}")
        if x8 and not packed:
            blocks = self.kernels.repack_x8(type_name, blocks.contiguous(), n, int(in_features))
        self.type_name = type_name
        self.x8 = bool(x8)
        self.out_features, self.in_features = n, int(in_features)
        self.register_buffer("blocks", _resident(blocks.contiguous()))  # (one forward reads each once: DRAM)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.int8_activations = bool(int8_activations)
        self.mm_min_rows = 0
        self._vnni_min_rows = 0
        self._bind()

    @property
    def vnni_min_rows(self) -> int:
        """From how many rows the int8 products take the VNNI row kernels (0: never; the kernel table sets it)."""
        return self._vnni_min_rows

    @vnni_min_rows.setter
    def vnni_min_rows(self, rows: int) -> None:
        self._vnni_min_rows = max(0, int(rows))
        self._bind()

    @property
    def effective_vnni_rows(self) -> int:
        """``vnni_min_rows`` where it can take effect here (int8 activations, VNNI kernels loaded), else 0."""
        return self._vnni_min_rows if self.int8_activations and self.kernels.vnni else 0

    def _bind(self) -> None:
        """The C entry point, type id and trailing arguments the fast path of ``forward`` calls directly."""
        lib = self.kernels.lib
        self._entry = lib.dyntree_ggml_matmul_q8v if self.int8_activations else lib.dyntree_ggml_matmul
        self._extra = (self.effective_vnni_rows,) if self.int8_activations else ()
        self._type_id = X8[self.type_name][0] if self.x8 else BLOCKS[self.type_name][0]

    def __getstate__(self):  # copies and pickles: the ctypes library is this process's, found again on load
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        state = dict(state)
        state["kernels"] = state["_entry"] = state["_extra"] = None
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        if self.kernels is None:
            self.kernels = native_kernels()
        self._bind()

    def ggml_blocks(self) -> torch.Tensor:
        """uint8 ``[N, row_bytes]``: the GGUF's rows (unpacked from the x8 layout where ``x8``)."""
        if self.x8:
            return self.kernels.unpack_x8(self.type_name, self.blocks, self.out_features, self.in_features)
        return self.blocks

    def dequantized_weight(self) -> torch.Tensor:
        """``[N, K]`` float32, bit-identical to the gguf package's dequantization of the blocks."""
        return self.kernels.dequantize(self.type_name, self.ggml_blocks(), self.out_features, self.in_features)

    def rows(self, x2: torch.Tensor) -> torch.Tensor:
        """float32 ``[M, K]`` -> ``[M, N]`` on the row kernel."""
        return self.kernels.matmul(self.type_name, x2, self.blocks, self.out_features, self.in_features, self.bias,
                                   self.int8_activations, self.effective_vnni_rows, self.x8)

    def dequant_mm(self, x2: torch.Tensor) -> torch.Tensor:
        """float32 ``[M, K]`` -> ``[M, N]``: chunks of the weight dequantized into a shared buffer, then GEMMs."""
        n, k = self.out_features, self.in_features
        out = torch.empty(n, x2.shape[0], dtype=torch.float32)
        chunk = max(1, min(n, CHUNK_FLOATS // k))
        xt = x2.t()
        for n0 in range(0, n, chunk):
            n1 = min(n, n0 + chunk)
            w = self.kernels.dequantize(self.type_name, self.ggml_blocks()[n0:n1], n1 - n0, k,
                                        out=_scratch((n1 - n0) * k))
            torch.mm(w.view(n1 - n0, k), xt, out=out[n0:n1])
        y = out.t()
        return y + self.bias if self.bias is not None else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, n = self.in_features, self.out_features
        if x.dtype is torch.float32 and x.is_contiguous() and not _profiler._is_profiler_enabled:
            m = x.numel() // k
            if not (self.mm_min_rows and m >= self.mm_min_rows):
                # the decode path: one C call, no reshapes or checks (float32 rows, contiguous buffers)
                y = torch.empty(x.shape[:-1] + (n,), dtype=torch.float32)
                bias = self.bias
                if self._entry(self._type_id, x.data_ptr(), k, self.blocks.data_ptr(),
                               None if bias is None else bias.data_ptr(), y.data_ptr(), n, m, n, k, *self._extra):
                    raise ValueError(f"{self.type_name} kernel refused [{m}, {k}] x [{n}, {k}]")
                return y
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        if x2.stride(1) != 1 or x2.stride(0) != self.in_features:
            x2 = x2.contiguous()
        run = self.dequant_mm if self.mm_min_rows and x2.shape[0] >= self.mm_min_rows else self.rows
        if _profiler._is_profiler_enabled:  # the kernels are ctypes calls: name them for torch.profiler
            with torch.profiler.record_function(f"dyntree::ggml_{self.type_name}_{run.__name__}"):
                y = run(x2)
        else:
            y = run(x2)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.type_name} blocks"
                + (" in the x8 layout, " if self.x8 else ", ")
                + ((f"int8 activations, VNNI from {self.effective_vnni_rows or 'never'} rows" if self.int8_activations
                    else f"dequant_mm from {self.mm_min_rows or 'never'} rows")))


def _resident(blocks: torch.Tensor) -> torch.Tensor:
    """``blocks`` in 2 MiB pages (``in_huge_pages``), else aligned for the kernels (``cpu_aligned``): a tensor on a
    file's mapping (``gguf_model.read_packed``) is copied once either way."""
    moved = in_huge_pages(blocks)
    return moved if moved is not blocks else cpu_aligned(blocks)


def pack_small_blocks(model: nn.Module) -> int:
    """Move the blocks of ``model``'s ``GGMLLinear`` layers under 2 MiB (``in_huge_pages`` leaves them in 4 KiB
    pages: q/k/v and o of a 1.5B model) side by side, in module order, into one mapping of 2 MiB pages
    (``packed_in_huge_pages``); a block shared by two layers, or with a tied ``GGMLEmbedding``, moves once and
    stays shared. Call it at load, before any forward plans the C decoder layers (they keep the blocks'
    addresses). Returns how many bytes moved (0 where the OS has no 2 MiB pages)."""
    small: dict[int, torch.Tensor] = {}
    for m in model.modules():
        b = m.blocks if isinstance(m, GGMLLinear) else None
        if b is not None and b.device.type == "cpu" and b.numel() * b.element_size() < HUGE_PAGE:
            small.setdefault(b.data_ptr(), b)
    if not small:
        return 0
    copies = dict(zip(small, packed_in_huge_pages(list(small.values()))))
    if all(copies[k] is small[k] for k in small):
        return 0
    for m in model.modules():
        b = m._buffers.get("blocks")
        if b is not None and b.data_ptr() in copies:
            m.blocks = copies[b.data_ptr()]
    return sum(b.numel() * b.element_size() for b in small.values())
