"""Synthetic Llama-shaped decoder stacks whose layers cycle through K host buffers.

Real 70B weights (128 GiB bf16) do not fit in a 128 GB host, so the benchmark builds the
model on the meta device, materialises only the non-layer parts (embeddings, final norm,
lm_head, rotary tables) on the compute device, and gives decoder layer ``i`` the weights in
host buffer ``i % K``. Every layer execution still copies a full layer's bytes (PCIe/DMA cost
does not depend on the contents); the numbers are the same as for distinct weights.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
from torch import nn

from .pinning import HostBuffer
from .layout import HostLayer, LayerLayout


@dataclass(frozen=True)
class StackShape:
    """Decoder-stack shape (defaults: Llama-2-70B)."""

    layers: int = 80
    hidden: int = 8192
    ffn: int = 28672
    heads: int = 64
    kv_heads: int = 8
    head_dim: int = 128
    vocab: int = 32000

    @staticmethod
    def scaled(layers: int, hidden: int, vocab: int = 32000) -> "StackShape":
        """A Llama-2-70B-proportioned shape at another width (ffn = 3.5 h, head dim <= 128, GQA 8:1)."""
        head_dim = min(128, hidden)
        heads = max(1, hidden // head_dim)
        kv = max(1, heads // 8)
        while heads % kv:
            kv -= 1
        return StackShape(layers, hidden, int(hidden * 3.5), heads, kv, head_dim, vocab)

    @property
    def layer_params(self) -> int:
        h, a = self.hidden, self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        return h * a * 2 + h * kv * 2 + 3 * h * self.ffn + 2 * h

    def config(self):
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.ffn,
            num_hidden_layers=self.layers, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim, max_position_embeddings=4096, rms_norm_eps=1e-5,
            tie_word_embeddings=False, attn_implementation="sdpa",
        )

    def as_dict(self) -> dict:
        return asdict(self)


def build_meta_model(shape: StackShape, dtype: torch.dtype, device: torch.device,
                     share_from: Optional[nn.Module] = None, std: float = 0.02) -> nn.Module:
    """A ``LlamaForCausalLM`` whose decoder layers are on ``meta`` (dtype ``dtype``) and whose
    other parameters are real on ``device`` (random, or shared with ``share_from``)."""
    from accelerate import init_empty_weights
    from transformers import LlamaForCausalLM

    with init_empty_weights(include_buffers=False):  # rotary inv_freq stays a real CPU buffer
        model = LlamaForCausalLM(shape.config())
    for layer in model.model.layers:
        layer.to(dtype)
    named = dict(share_from.named_parameters()) if share_from is not None else {}
    layer_mods = {id(m) for layer in model.model.layers for m in layer.modules()}
    for mod_name, mod in model.named_modules():
        if id(mod) in layer_mods:
            continue
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            full = f"{mod_name}.{name}" if mod_name else name
            if full in named:
                mod._parameters[name] = named[full]
            elif p.dim() == 1:
                mod._parameters[name] = nn.Parameter(torch.ones(p.shape, dtype=dtype, device=device), requires_grad=False)
            else:
                w = torch.randn(p.shape, dtype=dtype, device=device).mul_(std)
                mod._parameters[name] = nn.Parameter(w, requires_grad=False)
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = b.to(device)
    return model.eval()


def fill_layer(host: HostLayer, device: torch.device, std: float = 0.02) -> None:
    """Random weights (norm vectors = 1) into a packed host layer, generated on ``device``."""
    for s, v in zip(host.layout.params, host.views):
        if len(s.shape) == 1:
            v.fill_(1.0)
        else:
            v.copy_(torch.randn(s.shape, dtype=s.dtype, device=device).mul_(std))


def cycled_host_layers(layout: LayerLayout, n_layers: int, buffers: list[HostBuffer]) -> dict[int, HostLayer]:
    """``{i: HostLayer over buffers[i % K]}`` for ``i < n_layers`` (views shared per buffer)."""
    wrapped = [HostLayer.wrap(b, layout) for b in buffers]
    return {i: wrapped[i % len(wrapped)] for i in range(n_layers)}


def make_buffers(layout: LayerLayout, k: int, alloc: Callable[[int], HostBuffer], device: torch.device,
                 progress: Callable[[str], None] = lambda s: None) -> list[HostBuffer]:
    """``k`` host buffers holding random layers (one allocation per layer). The caller owns them
    (``close()`` each; ``close_buffers``); on failure the ones made so far are closed here."""
    out: list[HostBuffer] = []
    try:
        for j in range(k):
            buf = alloc(layout.nbytes)
            out.append(buf)
            fill_layer(HostLayer.wrap(buf, layout), device)
            progress(f"host layer buffer {j + 1}/{k} ({buf.pinning}, {layout.nbytes / 1e9:.3f} GB)")
    except BaseException:
        close_buffers(out)
        raise
    return out


def close_buffers(buffers: list[HostBuffer]) -> int:
    """Release every buffer's registration; returns the bytes that were page-locked."""
    freed = sum(b.nbytes for b in buffers if b.owns_registration)
    for b in buffers:
        b.close()
    return freed
