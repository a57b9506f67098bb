"""The decoder forward of a dense Qwen2/Llama model over a ``StaticKV``, in constant shapes.

One forward serves plain decoding, every draft level and the target's tree: ``R`` rows with their
tokens, positions and cache slots (device tensors), a ``[R, S]`` visibility mask over the buffer's
first ``S`` slots (a span bucket the caller picks), and the rows whose logits are wanted. Per layer, the papers' steps with one op each:

    h += o_proj(SDPA(rope(q_proj(n1(h))), K, V, mask))   K, V = the buffers after writing rope(k), v
    h += mlp(n2(h))

Each step is one CUDA kernel where torch has a fused one: the norms are ``F.rms_norm`` (one fused kernel on
CUDA, float32 inside; transformers' module runs 8 ops), and attention over a mask with grouped KV heads
folds each KV head's query heads into its rows (``fold_gqa``) instead of asking SDPA for ``enable_gqa`` with a
mask, which CUDA's fused kernels refuse: it runs the math path there (KV repeated, scores materialized, 13
kernels; transformers' ``use_gqa_in_sdpa`` states the same rule); the residual sums are the o and down
GEMMs' accumulators (``add_linear``); q, k and v take one rotation (the values by the identity) fused with
the keys' and values' cache write, and the gated MLP's ``silu(gate) * up`` is one op (``layer_kernels``: one
Triton kernel each on CUDA); the rotary tables are gathered (``rope_tables``), not recomputed.
``decode.op_count.LaunchCounter`` counts the kernels on the CPU: 10 per layer.

Nothing in it depends on a Python value of the device's data, so ``torch.compile(fullgraph=True,
dynamic=False)`` traces it whole for each row count (``decode.compiled.GraphFn``), and the same code
runs eagerly on the CPU and for prefill chunks. The numbers are transformers' own up to float
rounding (the span is attended with the unused slots masked, where transformers slices the cache
at its length; tested against it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from . import layer_kernels
from .static_kv import StaticKV

_ARCHS = ("qwen2", "llama")
_ROPES = ("default", "linear", "llama3", "yarn")  # inv_freq fixed at init (dynamic types rescale per call)


def dense_reason(model) -> Optional[str]:
    """Why ``model`` cannot run ``DenseForward`` (``None`` when it can)."""
    cfg = getattr(model, "config", None)
    arch = getattr(cfg, "model_type", None)
    if arch not in _ARCHS:
        return f"architecture {arch!r} (the compiled forward takes {', '.join(_ARCHS)})"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ())):
        return "sliding-window layers"
    if getattr(model, "hf_device_map", None):
        return "a model dispatched over several devices"
    inner = getattr(model, "model", None)
    rope = getattr(inner, "rotary_emb", None)
    if rope is None or getattr(rope, "rope_type", "default") not in _ROPES:
        return f"rotary type {getattr(rope, 'rope_type', None)!r} (the compiled forward takes {', '.join(_ROPES)})"
    for i, layer in enumerate(getattr(inner, "layers", ())):
        attn = getattr(layer, "self_attn", None)
        mlp = getattr(layer, "mlp", None)
        projs = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        projs += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(type(p) is not torch.nn.Linear for p in projs):
            kinds = sorted({type(p).__name__ for p in projs if type(p) is not torch.nn.Linear})
            return f"layer {i} has {', '.join(kinds)} projections (the compiled forward takes dense nn.Linear layers)"
        if getattr(attn, "q_norm", None) is not None or getattr(attn, "k_norm", None) is not None:
            return "per-head q/k norms"
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        return f"output head {type(head).__name__} (the compiled forward takes a dense nn.Linear head)"
    return None


class DenseForward:
    """``model``'s decoder over its own ``StaticKV`` of ``capacity`` slots (see the module docstring).

    The model's modules are used as they are (no copy of the weights)."""

    def __init__(self, model, capacity: int):
        reason = dense_reason(model)
        if reason is not None:
            raise ValueError(f"{type(model).__name__} cannot run the compiled dense forward: {reason}")
        inner = model.model
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.head = model.get_output_embeddings()
        self.fused = [fuse_projections(layer) for layer in self.layers]
        self.kv = StaticKV.for_model(model, capacity)
        self.vocab_size = int(self.head.weight.shape[0])
        dtype, dev = self.embed.weight.dtype, self.embed.weight.device
        self.rope = torch.stack(rope_tables(inner.rotary_emb, capacity, dtype, dev), dim=1)  # [C, cos | sin_signed, d]
        self._visible_hidden = torch.tensor([0.0, float("-inf")], dtype=dtype, device=dev)
        qkv = self.fused[0][0]
        self._heads_rotated = qkv.heads + qkv.kv_heads  # q and k; the values' heads take the identity (cos 1, sin 0)
        self._identity = torch.tensor([1.0, 0.0], dtype=dtype, device=dev)[:, None, None, None].expand(
            2, qkv.kv_heads, 1, self.rope.shape[2])  # [cos | sin, H_kv, 1, d]
        #: the gated MLP's activation is SiLU in every layer: ``layer_kernels.silu_mul`` takes it with the product
        self._silu = all(type(layer.mlp.act_fn).__name__ in ("SiLU", "SiLUActivation") for layer in self.layers)

    @property
    def capacity(self) -> int:
        return self.kv.capacity

    @property
    def device(self) -> torch.device:
        return self.kv.kv.device

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, visible: torch.Tensor,
                 rows: torch.Tensor) -> torch.Tensor:
        """One forward.

        Args:
            tokens: ``[R]`` int64 token ids.
            positions: ``[R]`` int64 position ids (``< C``: the rotary tables are made for the buffer's slots).
            slots: ``[R]`` int64 cache slots the rows' keys and values are written to (distinct).
            visible: ``[R, S]`` bool over the first ``S <= C`` slots (the attention's span: a bucket the
                caller picks so a short run does not attend the whole buffer), True = the row may attend to
                the slot (its own slot included; each row must see at least one; every slot written < S).
            rows: ``[M]`` int64 rows whose logits are returned.
        Returns:
            ``[M, V]`` logits (model dtype).
        """
        with torch.no_grad():
            return self._forward(tokens, positions, slots, visible, rows)

    def _forward(self, tokens, positions, slots, visible, rows):
        h = self.embed(tokens)[None]  # [1, R, hidden]
        r = tokens.shape[0]
        # [cos | sin, H + 2 H_kv, R, d]: the rows' tables for the q and k heads, the identity for the value heads
        tables = self.rope.index_select(0, positions).transpose(0, 1)[:, None].expand(-1, self._heads_rotated, -1, -1)
        tables = torch.cat([tables, self._identity.expand(-1, -1, r, -1)], dim=1)
        cos, sin_signed = tables[0][None], tables[1][None]
        buf = self.kv.kv
        kv_heads = self.kv.kv_heads
        span = visible.shape[1]

        heads = self.fused[0][0].heads

        def rotate_and_write(i: int, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            q = layer_kernels.rope_write(y, cos, sin_signed, buf[i], slots, heads)  # one kernel on CUDA
            return q, buf[i][None, :kv_heads, :span], buf[i][None, kv_heads:, :span]

        # once, in the model's dtype (not converted by every layer's SDPA): one kernel
        mask = torch.where(visible, self._visible_hidden[0], self._visible_hidden[1])
        h = decoder_layers(self.layers, h, cos, sin_signed, mask[None, None], None, self.fused, sin_signed=True,
                           rotate_and_write=rotate_and_write, silu_op=self._silu)
        h = rms_norm(self.norm, h[0].index_select(0, rows))
        return self.head(h)


def rope_tables(rotary, positions: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``([P, d] cos, [P, d] sin_signed)`` of positions ``0 .. P-1`` in ``dtype``: transformers' rotary
    numbers (float32 ``position * inv_freq``, times ``attention_scaling``, then cast), with the sine's first
    half negated for ``decoder_layers``' 3-op rotation. Made once, so a forward gathers its rows' (one
    kernel each) instead of computing them (~10 kernels)."""
    inv_freq = rotary.inv_freq.to(device=device, dtype=torch.float32)
    freqs = torch.arange(positions, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = float(rotary.attention_scaling)
    cos, sin = (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
    half = sin.shape[-1] // 2
    return cos, torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)


@dataclass(frozen=True)
class FusedQKV:
    """A layer's q/k/v projections as one ``[(H + 2 H_kv) * d, hidden]`` weight (and bias)."""

    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    heads: int
    kv_heads: int


@dataclass(frozen=True)
class FusedGateUp:
    """A gated MLP's gate and up projections as one ``[2 F, hidden]`` weight (gate rows first)."""

    weight: torch.Tensor
    intermediate: int


def fuse_projections(layer) -> tuple[FusedQKV, FusedGateUp]:
    """Put ``layer``'s q/k/v weights (and biases) and its gate/up weights in one tensor each and make the
    modules' parameters row views of it (values and the modules' own forward unchanged, no copy kept),
    so ``decoder_layers`` runs one matmul for q, k and v and one for gate and up. Idempotent (the fused
    tensors are remembered on the modules); a layer whose parameters were replaced since (a reload, a
    dtype or device change) is fused anew. Dense ``nn.Linear`` only."""
    attn, mlp = layer.self_attn, layer.mlp
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    g, u = mlp.gate_proj, mlp.up_proj
    with torch.no_grad():
        if not _backs(getattr(attn, "dyntree_qkv", None), (q, k, v)):
            biased = all(p.bias is not None for p in (q, k, v))
            weight = _rows_of_one((q, k, v), "weight")
            bias = _rows_of_one((q, k, v), "bias") if biased else None
            attn.dyntree_qkv = FusedQKV(weight, bias, q.out_features // attn.head_dim, k.out_features // attn.head_dim)
        if not _backs(getattr(mlp, "dyntree_gate_up", None), (g, u)):
            mlp.dyntree_gate_up = FusedGateUp(_rows_of_one((g, u), "weight"), g.out_features)
    return attn.dyntree_qkv, mlp.dyntree_gate_up


def fuse_model(model) -> None:
    """``fuse_projections`` on every decoder layer of ``model`` (a dense model: ``dense_reason`` None)."""
    for layer in model.model.layers:
        fuse_projections(layer)


def _rows_of_one(mods, name: str) -> torch.Tensor:
    fused = torch.cat([getattr(m, name).detach() for m in mods])
    start = 0
    for m in mods:
        rows = getattr(m, name).shape[0]
        setattr(m, name, torch.nn.Parameter(fused[start:start + rows], requires_grad=False))
        start += rows
    return fused


def _backs(fused, mods) -> bool:
    """Whether ``fused`` (a ``FusedQKV``/``FusedGateUp`` or None) still holds ``mods``' weights."""
    if fused is None:
        return False
    ptr = fused.weight.untyped_storage().data_ptr()
    return all(m.weight.untyped_storage().data_ptr() == ptr for m in mods) and \
        (not isinstance(fused, FusedQKV) or fused.bias is None
         or all(m.bias.untyped_storage().data_ptr() == fused.bias.untyped_storage().data_ptr() for m in mods))


def decoder_layers(layers, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Optional[torch.Tensor],
                   write: Optional[Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]],
                   fused: Optional[list[tuple[FusedQKV, FusedGateUp]]] = None, sin_signed: bool = False,
                   rotate_and_write: Optional[Callable] = None,
                   silu_op: bool = False) -> torch.Tensor:
    """Qwen2/Llama decoder layers with one op per step (transformers' numbers up to float rounding).

    Args:
        layers: the model's decoder layers.
        h: ``[1, q, hidden]`` hidden states.
        cos, sin: ``[1, 1, q, head_dim]`` rotary tables of the rows' positions.
        mask: ``[1, 1, q, kv]`` bool visibility or additive float mask (None: every key visible).
        write: ``write(i, k, v)`` stores layer ``i``'s new rotated keys and values ``[1, H_kv, q, d]``
            and returns the ``[1, H_kv, kv, d]`` keys and values to attend over.
        fused: per layer, its ``fuse_projections`` (None: the modules' own projections, one matmul each).
        sin_signed: ``sin`` already has its first half negated (``rope_tables``).
        rotate_and_write: (with ``fused``; ``cos``/``sin`` then ``[1, H + 2 H_kv, q, d]``, the identity on the
            value heads; ``write`` unused) ``rotate_and_write(i, y)`` rotates the q/k/v output ``y``
            ``[1, H + 2 H_kv, q, d]``, stores layer ``i``'s keys and values and returns ``(q, keys, values)``
            (``layer_kernels.rope_write``: one kernel on CUDA).
        silu_op: the gated MLP's ``silu(gate) * up`` as ``layer_kernels.silu_mul`` (its activation is SiLU).
    Returns:
        ``[1, q, hidden]`` hidden states after the last layer.
    """
    n = h.shape[1]
    folded = None  # the mask for query rows folded per KV head (built by the first layer, shared by all)
    half = sin.shape[-1] // 2
    if not sin_signed:
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)

    def rope(x: torch.Tensor) -> torch.Tensor:
        """x * cos + rotate_half(x) * sin, as x * cos + swap(x) * sin_signed with swap = cat(x2, x1) and
        sin_signed = cat(-sin1, sin2): 3 ops (cat, mul, addcmul) instead of 5. The result is contiguous (the
        first operand sets the layout: cat's output), so ``fold_gqa`` views it without a copy."""
        return torch.addcmul(torch.cat([x[..., half:], x[..., :half]], dim=-1) * sin, x, cos)

    for i, layer in enumerate(layers):
        attn = layer.self_attn
        d = attn.head_dim
        x = rms_norm(layer.input_layernorm, h)
        qkv, gate_up = fused[i] if fused is not None else (None, None)
        if qkv is not None and rotate_and_write is not None:  # one matmul, then one op
            q, keys, values = rotate_and_write(i, F.linear(x, qkv.weight, qkv.bias).view(1, n, -1, d).transpose(1, 2))
        else:
            if qkv is not None:  # one matmul; q and k rotated together
                y = F.linear(x, qkv.weight, qkv.bias).view(1, n, -1, d).transpose(1, 2)  # [1, H + 2 H_kv, n, d]
                qk = rope(y[:, :qkv.heads + qkv.kv_heads])
                q, k, v = qk[:, :qkv.heads], qk[:, qkv.heads:], y[:, qkv.heads + qkv.kv_heads:]
            else:
                q = rope(attn.q_proj(x).view(1, n, -1, d).transpose(1, 2))
                k = rope(attn.k_proj(x).view(1, n, -1, d).transpose(1, 2))
                v = attn.v_proj(x).view(1, n, -1, d).transpose(1, 2)
            keys, values = write(i, k, v)
        group = q.shape[1] // keys.shape[1]
        if mask is not None and group > 1:
            if folded is None:
                folded = fold_gqa_mask(mask, group)
            o = F.scaled_dot_product_attention(fold_gqa(q, group), keys, values, attn_mask=folded, scale=attn.scaling)
            o = unfold_gqa(o, group)
        else:
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scaling,
                                               enable_gqa=group > 1).transpose(1, 2)
        h = add_linear(h, o.reshape(1, n, -1), attn.o_proj)
        mlp = layer.mlp
        x = rms_norm(layer.post_attention_layernorm, h)
        if gate_up is not None:
            gu = F.linear(x, gate_up.weight)
            act = layer_kernels.silu_mul(gu, gate_up.intermediate) if silu_op else \
                mlp.act_fn(gu[..., :gate_up.intermediate]) * gu[..., gate_up.intermediate:]
            h = add_linear(h, act, mlp.down_proj)
        else:
            h = h + mlp(x)
    return h


def add_linear(h: torch.Tensor, x: torch.Tensor, linear) -> torch.Tensor:
    """``h + linear(x)`` for ``[1, n, *]`` ``h`` and ``x``: one GEMM with the residual as its accumulator
    (``addmm``) for a bias-free dense ``nn.Linear``, where the sum costs a second kernel otherwise."""
    if type(linear) is not torch.nn.Linear or linear.bias is not None or linear.weight.dtype != x.dtype:
        return h + linear(x)
    return torch.addmm(h[0], x[0], linear.weight.t())[None]


def rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """``norm`` (transformers' Qwen2/Llama RMSNorm: ``weight``, ``variance_epsilon``) applied to ``x`` as one
    ``F.rms_norm``: float32 inside, rounded once to ``x``'s dtype (transformers rounds the normalized value
    before multiplying by the weight: the same numbers in float32, within one rounding in bf16/fp16). Any
    other norm runs its own forward."""
    eps = getattr(norm, "variance_epsilon", None)
    weight = getattr(norm, "weight", None)
    if eps is None or not isinstance(weight, torch.Tensor) or weight.dtype != x.dtype or weight.dim() != 1:
        return norm(x)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def fold_gqa(q: torch.Tensor, group: int) -> torch.Tensor:
    """Query heads as rows of their KV head: ``[B, H, n, d]`` -> ``[B, H / group, group * n, d]`` (query head
    ``h`` reads KV head ``h // group``, as transformers' ``repeat_kv``). Row ``g * n + r`` of KV head ``j`` is
    row ``r`` of query head ``j * group + g``. A view when ``q`` is contiguous."""
    b, heads, n, d = q.shape
    return q.reshape(b, heads // group, group * n, d)


def unfold_gqa(o: torch.Tensor, group: int) -> torch.Tensor:
    """``fold_gqa``'s attention output back in row-major head order: ``[B, H_kv, group * n, d]`` ->
    ``[B, n, H, d]`` (one copy at most, as the unfolded ``transpose`` of SDPA's output)."""
    b, kv_heads, rows, d = o.shape
    n = rows // group
    return o.view(b, kv_heads, group, n, d).permute(0, 3, 1, 2, 4).reshape(b, n, kv_heads * group, d)


def fold_gqa_mask(mask: torch.Tensor, group: int) -> torch.Tensor:
    """The ``[B, 1, n, S]`` mask of ``fold_gqa``'s rows: ``[B, 1, group * n, S]`` (each row's mask repeated
    per query head of the group)."""
    return mask.repeat(1, 1, group, 1)
