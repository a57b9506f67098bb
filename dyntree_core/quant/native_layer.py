"""The decoder layers of a GGUF model as one C call each (``decoder_layer.c``): RMSNorm, the q/k/v products,
rotary, the key/value write, attention, the o product, the residuals and the gated MLP, with no torch op in
between. Outside a prefill chunk (``interrupt.armed``) all the layers of a forward go in one call
(``dyntree_decoder_layers``); a prefill chunk calls them one by one, so that a Stop ends it between two.

On a 2-core CPU transformers' per-layer ops cost as much as a layer's products; ``decode.lean_forward`` cut them
to ~35 ops per layer, and this cuts them to one call. ``lean_forward`` uses it whenever ``native_plan(model)``
is not ``None`` and every product of the forward runs on the row kernels (no ``dequant_mm`` at this many rows).

Each row's numbers depend only on that row and on the keys it sees, in cache order (see the C file), so the
accepted path of a tree gets the same logits, bit for bit, as plain decoding of the same tokens.
``DYNTREE_NATIVE_LAYER=0`` (read when a model is planned) keeps the torch glue.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn
from torch.autograd import profiler as _profiler

from .. import interrupt
from .gate_up import FusedGateUp
from .ggml_linear import GGMLLinear

PLAN_ATTR = "_dyntree_native_plan"
#: forwards of up to this many rows keep their scratch buffer in the plan (a 64-row one is ~9 MB for the 1.5B)
KEEP_WORK_ROWS = 64
N_PROJ = 6  # q, k, v, o, gate_up, down


class LayerDesc(ctypes.Structure):
    """``layer_desc`` of ``decoder_layer.c``, field for field."""

    _fields_ = [
        ("type", ctypes.c_int32 * N_PROJ),
        ("w", ctypes.c_void_p * N_PROJ),
        ("bias", ctypes.c_void_p * N_PROJ),
        ("norm1", ctypes.c_void_p),
        ("norm2", ctypes.c_void_p),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("int8_act", ctypes.c_int32),
        ("hidden", ctypes.c_int32),
        ("heads", ctypes.c_int32),
        ("kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("inter", ctypes.c_int32),
        ("vnni_rows", ctypes.c_int32 * N_PROJ),
    ]


def _projections(layer) -> Optional[tuple[GGMLLinear, ...]]:
    """q, k, v, o, gate_up and down of a decoder layer, or ``None`` unless all are ``GGMLLinear`` (gate and up
    fused). Read from ``_modules`` directly: ``nn.Module.__getattr__`` would cost ~10 us per layer, and
    ``NativePlan.current`` calls this for every layer on every forward."""
    mods = layer._modules
    attn, mlp = mods.get("self_attn"), mods.get("mlp")
    if attn is None or not isinstance(mlp, FusedGateUp):
        return None
    a, m = attn._modules, mlp._modules
    lins = (a.get("q_proj"), a.get("k_proj"), a.get("v_proj"), a.get("o_proj"), m.get("gate_up"), m.get("down_proj"))
    return lins if all(isinstance(x, GGMLLinear) for x in lins) else None


def _norm_weight(norm) -> Optional[torch.Tensor]:
    w = getattr(norm, "weight", None)
    ok = (isinstance(w, torch.Tensor) and w.dtype == torch.float32 and w.device.type == "cpu" and w.is_contiguous()
          and hasattr(norm, "variance_epsilon"))
    return w if ok else None


def native_reason(model) -> Optional[str]:
    """Why ``model``'s layers cannot run as C calls (``None`` when they can)."""
    from .lean_mark import lean_enabled

    if os.environ.get("DYNTREE_NATIVE_LAYER", "1") == "0":
        return "turned off by DYNTREE_NATIVE_LAYER=0"
    if not lean_enabled(model):  # (checked the architecture when quant.fused.fuse_forward enabled it)
        return "no lean forward (quant.lean_mark.lean_reason, quant.fused.fuse_forward)"
    inner = model.model
    if inner.embed_tokens.weight.dtype != torch.float32:
        return f"model dtype {inner.embed_tokens.weight.dtype} (the C layer: float32)"
    for i, layer in enumerate(inner.layers):
        lins = _projections(layer)
        if lins is None:
            return f"layer {i}: not every projection is a GGMLLinear with gate and up fused"
        if len({m.int8_activations for m in lins}) != 1 or len({m.kernels.lib._handle for m in lins}) != 1:
            return f"layer {i}: projections on different kernels or activation precisions"
        if type(layer.mlp.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
            return f"layer {i}: activation {type(layer.mlp.act_fn).__name__} (the C layer: SiLU)"
        if _norm_weight(layer.input_layernorm) is None or _norm_weight(layer.post_attention_layernorm) is None:
            return f"layer {i}: norms without float32 weights"
        attn = layer.self_attn
        d = int(attn.head_dim)
        heads, kv_heads = attn.q_proj.out_features // d, attn.k_proj.out_features // d
        if d % 16 or d > 128 or kv_heads == 0 or heads % kv_heads or attn.v_proj.out_features != kv_heads * d:
            return f"layer {i}: head layout ({heads} heads, {kv_heads} kv heads of {d})"
        if attn.o_proj.in_features != heads * d or attn.q_proj.in_features % 8:
            return f"layer {i}: projection widths"
    return None


@dataclass
class NativePlan:
    """One ``LayerDesc`` per layer and what they point into (kept alive and checked before each forward)."""

    descs: list[LayerDesc]
    linears: list[tuple[GGMLLinear, ...]]
    lib: ctypes.CDLL
    #: each projection's ``vnni_rows`` as planned (a plan is remade when a layer's changes)
    vnni_rows: tuple[tuple[int, ...], ...] = ()
    work: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: ``descs`` side by side, and each forward's cache buffers and capacities per layer, for
    #: ``dyntree_decoder_layers`` (all layers in one call)
    desc_array: ctypes.Array = field(init=False, repr=False)
    k_ptrs: ctypes.Array = field(init=False, repr=False)
    v_ptrs: ctypes.Array = field(init=False, repr=False)
    caps: ctypes.Array = field(init=False, repr=False)

    def __post_init__(self):
        n = len(self.descs)
        self.desc_array = (LayerDesc * n)(*self.descs)
        self.k_ptrs, self.v_ptrs = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)()
        self.caps = (ctypes.c_int64 * n)()

    def __reduce__(self):  # copies and pickles of the model plan again: this one points into the original
        return (_no_plan, ())

    def current(self, model) -> bool:
        """Whether the model still has the modules this plan was made from."""
        layers = model.model.layers
        return len(layers) == len(self.linears) and all(
            _projections(layer) == lins for layer, lins in zip(layers, self.linears)) and self.vnni_rows == _vnni_rows(
            self.linears)

    def takes(self, n: int) -> bool:
        """Whether every product of an ``n``-row forward runs on the row kernels (no ``dequant_mm``)."""
        return not any(m.mm_min_rows and n >= m.mm_min_rows for lins in self.linears for m in lins)


def _no_plan() -> None:
    return None


def _vnni_rows(linears: list[tuple[GGMLLinear, ...]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(m.effective_vnni_rows for m in lins) for lins in linears)


def _plan(model) -> NativePlan:
    descs, linears = [], []
    for layer in model.model.layers:
        lins = _projections(layer)
        attn = layer.self_attn
        d = int(attn.head_dim)
        desc = LayerDesc()
        for p, m in enumerate(lins):
            desc.type[p] = m._type_id
            desc.w[p] = m.blocks.data_ptr()
            desc.bias[p] = None if m.bias is None else m.bias.data_ptr()
            desc.vnni_rows[p] = m.effective_vnni_rows
        desc.norm1 = layer.input_layernorm.weight.data_ptr()
        desc.norm2 = layer.post_attention_layernorm.weight.data_ptr()
        desc.eps = float(layer.input_layernorm.variance_epsilon)
        desc.scale = float(attn.scaling)
        desc.int8_act = int(lins[0].int8_activations)
        desc.hidden = lins[0].in_features
        desc.heads, desc.kv_heads, desc.head_dim = lins[0].out_features // d, lins[1].out_features // d, d
        desc.inter = lins[5].in_features
        descs.append(desc)
        linears.append(lins)
    return NativePlan(descs, linears, linears[0][0].kernels.lib, vnni_rows=_vnni_rows(linears))


def native_plan(model) -> Optional[NativePlan]:
    """The model's plan (made on first use and again when its modules change), or ``None`` (``native_reason``)."""
    plan = getattr(model, PLAN_ATTR, None)
    if plan is False:
        return None
    if plan is not None and plan.current(model):
        return plan
    plan = _plan(model) if native_reason(model) is None else False
    setattr(model, PLAN_ATTR, plan)
    return plan or None


def forget_plan(model: nn.Module) -> None:
    """Drop the cached plan (the next forward plans again, re-reading ``DYNTREE_NATIVE_LAYER``)."""
    if hasattr(model, PLAN_ATTR):
        delattr(model, PLAN_ATTR)


def _reserve(cache, i: int, desc: LayerDesc, n: int, past: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``i``'s key and value buffers with room for ``n`` rows after its ``past`` (every layer's) positions."""
    k_buf, v_buf, start = cache.layers[i].reserve(n, desc.kv_heads, desc.head_dim, torch.float32)
    if start != past:
        raise ValueError(f"layer {i} holds {start} positions, layer 0 {past}")
    return k_buf, v_buf


def native_forward(plan: NativePlan, model, ids: torch.Tensor, positions: torch.Tensor,
                   visible: Optional[torch.Tensor], cache, logits_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``lean_forward`` with each decoder layer one C call (same arguments, same result up to float32 rounding).

    Args:
        ids: ``[1, q]`` int64 token ids.
        positions: ``[1, q]`` int64 position ids.
        visible: ``[1, 1, q, kv_len]`` bool, ``kv_len = cached + q`` (``None``: causal).
        cache: the model's ``kv.KVCache`` (its layers' buffers written in place, lengths advanced by ``q``).
        logits_rows: ``[r]`` int64 rows whose logits are wanted (``None``: all).
    Returns:
        ``[r or q, V]`` float32 logits.
    """
    inner = model.model
    n = int(ids.shape[1])
    with torch.no_grad(), plan.lock:
        h = inner.embed_tokens(ids)[0].contiguous()  # [q, hidden], written in place layer by layer
        cos, sin = inner.rotary_emb(h[None], positions)
        cos, sin = cos[0].contiguous(), sin[0].contiguous()  # [q, head_dim]
        past = cache.layers[0].length
        kv_len = past + n
        vis_ptr, ldvis = None, 0
        if visible is not None:
            if tuple(visible.shape[-2:]) != (n, kv_len):
                raise ValueError(f"visibility mask {tuple(visible.shape)} for {n} rows after {past} cached")
            if visible.dtype != torch.bool:
                raise ValueError(f"the visibility mask must be bool, got {visible.dtype}")
            vis = visible[0, 0].contiguous()
            vis_ptr, ldvis = vis.data_ptr(), kv_len
        need = plan.lib.dyntree_decoder_layer_work(ctypes.byref(plan.descs[0]), n, kv_len)
        work = plan.work
        if work.numel() < need:
            work = torch.empty(int(need * 1.25) + 4096, dtype=torch.float32)
            if n <= KEEP_WORK_ROWS:  # decode steps and trees keep theirs; a prefill chunk's is freed after it
                plan.work = work
        record = _profiler._is_profiler_enabled
        if not interrupt.armed() and not record:  # (not a prefill chunk, which a Stop ends between two layers)
            for i, desc in enumerate(plan.descs):
                k_buf, v_buf = _reserve(cache, i, desc, n, past)
                plan.k_ptrs[i], plan.v_ptrs[i], plan.caps[i] = k_buf.data_ptr(), v_buf.data_ptr(), k_buf.shape[-2]
            failed = ctypes.c_int64(-1)
            rc = plan.lib.dyntree_decoder_layers(plan.desc_array, len(plan.descs), h.data_ptr(), n, cos.data_ptr(),
                                                 sin.data_ptr(), plan.k_ptrs, plan.v_ptrs, plan.caps, past, vis_ptr,
                                                 ldvis, work.data_ptr(), work.numel(), ctypes.byref(failed))
            if rc:
                raise RuntimeError(f"decoder layer {failed.value} refused {n} rows after {past} (code {rc})")
            for i in range(len(plan.descs)):
                cache.layers[i].length = past + n
        else:
            for i, desc in enumerate(plan.descs):
                interrupt.check()  # a Stop during a prefill chunk ends it here, between two layers
                k_buf, v_buf = _reserve(cache, i, desc, n, past)
                args = (ctypes.byref(desc), h.data_ptr(), n, cos.data_ptr(), sin.data_ptr(), k_buf.data_ptr(),
                        v_buf.data_ptr(), k_buf.shape[-2], past, vis_ptr, ldvis, work.data_ptr(), work.numel())
                if record:
                    with torch.profiler.record_function("dyntree::decoder_layer"):
                        rc = plan.lib.dyntree_decoder_layer(*args)
                else:
                    rc = plan.lib.dyntree_decoder_layer(*args)
                if rc:
                    raise RuntimeError(f"decoder layer {i} refused {n} rows after {past} (code {rc})")
                cache.layers[i].length = past + n
        h = inner.norm(h)
        if logits_rows is not None:
            h = h[logits_rows]
        return model.lm_head(h)
