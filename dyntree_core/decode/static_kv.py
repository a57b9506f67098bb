"""A fixed-capacity KV cache whose every operation has a constant shape: what a compiled step writes.

``StaticKV`` holds one model's keys and values as one ``[layers, 2 H_kv, C, D]`` buffer (each layer's keys, then
its values: a forward writes both with one ``index_copy_``, the commit keeps both with one gather), zero-filled
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
        kv: ``[layers, 2 H_kv, C, D]`` buffer (model dtype, model device): per layer the ``H_kv`` key heads,
            then the ``H_kv`` value heads.
    """

    kv: torch.Tensor

    @property
    def kv_heads(self) -> int:
        return int(self.kv.shape[1]) // 2

    @classmethod
    def for_model(cls, model, capacity: int) -> "StaticKV":
        cfg = model.config.get_text_config(decoder=True)
        heads = int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        weight = model.get_input_embeddings().weight
        shape = (int(cfg.num_hidden_layers), 2 * kv_heads, int(capacity), head_dim)
        kv = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        if kv.is_cuda:
            torch._dynamo.mark_static_address(kv)
        return cls(kv)

    @property
    def capacity(self) -> int:
        return int(self.kv.shape[2])

    def keep_path(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the slots ``src`` to the slots ``dst`` in every layer (``[P]`` int64 device tensors;
        gathered first, so the two may overlap). A path shorter than ``P`` pads ``src`` with any
        slot and ``dst`` with slots past the new length: their copies are never seen."""
        self.kv.index_copy_(2, dst, self.kv.index_select(2, src))
