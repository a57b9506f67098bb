"""``GGMLEmbedding``: a token embedding kept as the GGUF tensor's own blocks, the looked-up rows dequantized
per call.

The dense float32 table of a 152k-token vocabulary is 0.93 GB for a 1.5B Qwen2.5 and 0.54 GB for the 0.5B,
more than all their int4 layers together, to serve a handful of rows per forward. The blocks are 0.19 and
0.14 GB, and a model whose head is tied to its embedding already holds them (``lm_head.blocks``): the two
modules then share one tensor (in the x8 layout where the head runs the x8 tiles: a looked-up row is unpacked from
its group of 8 first). The rows are those of the dense table exactly (``NativeKernels.dequantize`` is the gguf
package's dequantization, bit for bit).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from .native import BLOCKS, NativeKernels, native_kernels, x8_shape


class GGMLEmbedding(nn.Module):
    """``ids [..] -> float32 [.., dim]``: rows of a ``[vocab, dim]`` table held as GGML blocks.

    Buffers: ``blocks`` uint8 ``[vocab, row_bytes]`` (one GGUF row per token; ``x8``: ``native.x8_shape(type_name,
    vocab, dim)``, a tied head's x8 layout, ``vocab`` then given). ``weight`` is a stand-in with
    the dense table's shape, dtype and device for code that asks for those (``model.get_input_embeddings()
    .weight.device``); it holds no values (a zero-stride view, so writing to it fails) — rows come from
    calling the module.
    """

    def __init__(self, type_name: str, blocks: torch.Tensor, dim: int, kernels: Optional[NativeKernels] = None,
                 x8: bool = False, vocab: Optional[int] = None):
        super().__init__()
        from .ggml_linear import row_bytes

        if type_name not in BLOCKS:
            raise ValueError(f"GGMLEmbedding takes {', '.join(BLOCKS)}, got {type_name}")
        if x8:
            if vocab is None or blocks.dtype != torch.uint8 or tuple(blocks.shape) != x8_shape(type_name, vocab, dim):
                raise ValueError(f"x8 {type_name} blocks of [{vocab}, {dim}] must be uint8 "
                                 f"{x8_shape(type_name, vocab or 8, dim)}, got {tuple(blocks.shape)} {blocks.dtype}")
        elif blocks.dtype != torch.uint8 or blocks.ndim != 2 or blocks.shape[1] != row_bytes(type_name, dim):
            raise ValueError(f"{type_name} rows of {dim} values must be uint8 [vocab, {row_bytes(type_name, dim)}], "
                             f"got {tuple(blocks.shape)} {blocks.dtype}")
        self.type_name = type_name
        self.x8 = bool(x8)
        self.num_embeddings, self.embedding_dim = int(vocab if x8 else blocks.shape[0]), int(dim)
        self.register_buffer("blocks", blocks.contiguous())
        self.kernels = kernels or native_kernels()
        if self.kernels is None:
            raise RuntimeError("GGMLEmbedding needs the native kernels (quant.native.native_kernels())")

    @property
    def weight(self) -> torch.Tensor:
        """``[vocab, dim]`` float32 on the blocks' device, zero-stride: shape, dtype and device only."""
        return torch.zeros((), dtype=torch.float32, device=self.blocks.device).expand(self.num_embeddings,
                                                                                      self.embedding_dim)

    def __getstate__(self):  # copies and pickles: the ctypes library is this process's, found again on load
        state = dict(super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__)
        state["kernels"] = None
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        if self.kernels is None:
            self.kernels = native_kernels()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token ids must be in [0, {self.num_embeddings}), got {flat.min()}..{flat.max()}")
        if self.x8:  # each id's group of 8 rows back to GGML rows, then its own row of the group
            groups = self.kernels.unpack_x8(self.type_name, self.blocks.index_select(0, flat // 8),
                                            8 * int(flat.numel()), self.embedding_dim)
            rows = groups.index_select(0, torch.arange(flat.numel()) * 8 + flat % 8)
        else:
            rows = self.blocks.index_select(0, flat)
        out = self.kernels.dequantize(self.type_name, rows, int(flat.numel()), self.embedding_dim)
        return out.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.type_name} blocks" + (" (x8)" if self.x8 else "")


def holds_as_blocks(type_name: str) -> bool:
    """Whether an embedding of this GGML type can be kept as blocks here (a type the kernels read, and the kernels
    built on this machine); else the caller keeps a dense table."""
    return type_name in BLOCKS and native_kernels() is not None


def block_embedding(type_name: str, vocab: int, dim: int, read_blocks: Callable[[], torch.Tensor],
                    tied_head=None) -> GGMLEmbedding:
    """A ``GGMLEmbedding`` of a ``[vocab, dim]`` GGUF tensor of a type ``holds_as_blocks`` takes: ``tied_head``'s
    blocks where the head is a ``GGMLLinear`` built from the same tensor (a tied head: pass it only then; in its
    x8 layout where it has one), else ``read_blocks()`` (``[vocab, row_bytes]`` uint8)."""
    from .ggml_linear import GGMLLinear

    if (isinstance(tied_head, GGMLLinear) and tied_head.type_name == type_name
            and (tied_head.out_features, tied_head.in_features) == (vocab, dim)):
        return GGMLEmbedding(type_name, tied_head.blocks, dim, x8=tied_head.x8, vocab=vocab)
    return GGMLEmbedding(type_name, read_blocks(), dim)
