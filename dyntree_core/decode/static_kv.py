"""A fixed-capacity KV cache whose every operation has a constant shape: what a compiled step writes.

``StaticKV`` holds one model's keys and values as two ``[layers, H_kv, C, D]`` buffers, zero-filled
(a slot that no row may see still enters the attention's dot products, and must not be NaN). The
length lives on the device, not in Python: forwards write at slots given as a device tensor
(``index_copy_``), attend over a span of the buffer with the unused slots masked out, and the accepted
path is kept by a fixed-size gather (``keep_path``). No operation here reads the device.

On CUDA the buffers are marked as static addresses, so a CUDA graph captured over a forward that
writes them replays into the same memory (what transformers' ``StaticCache`` does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StaticKV:
    """One model's keys and values.

    Attributes:
        k, v: ``[layers, H_kv, C, D]`` buffers (model dtype, model device).
    """

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def for_model(cls, model, capacity: int) -> "StaticKV":
        cfg = model.config.get_text_config(decoder=True)
        heads = int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        weight = model.get_input_embeddings().weight
        shape = (int(cfg.num_hidden_layers), kv_heads, int(capacity), head_dim)
        k = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        v = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        if k.is_cuda:
            torch._dynamo.mark_static_address(k)
            torch._dynamo.mark_static_address(v)
        return cls(k, v)

    @property
    def capacity(self) -> int:
        return int(self.k.shape[2])

    def keep_path(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the slots ``src`` to the slots ``dst`` in every layer (``[P]`` int64 device tensors;
        gathered first, so the two may overlap). A path shorter than ``P`` pads ``src`` with any
        slot and ``dst`` with slots past the new length: their copies are never seen."""
        for buf in (self.k, self.v):
            buf.index_copy_(2, dst, buf.index_select(2, src))
