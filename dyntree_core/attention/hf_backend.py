"""Hugging Face glue: tree attention as a transformers ``AttentionInterface`` implementation.

Contract with the engine: the model is called with ``input_ids [1, q]``, ``position_ids [1, q]``,
``attention_mask`` = a 4D bool tensor ``[1, 1, q, kv_len]`` (True = attend, ``kv_len = cache_len +
q``) and the model's KV cache. When ``tree_attention_meta`` is given the mask may be
``mask.placeholder_mask`` (a stride-0 view: the kernel reads only the metadata); a call the kernel
cannot take then rebuilds the real mask from the metadata. transformers 5.23 returns a 4D mask untouched from
``create_causal_mask`` (``_preprocess_mask_arguments`` early exit), so the same tensor object
reaches every layer's attention function.

Registered implementations (``register()`` is idempotent and runs at import):

- ``"dyntree_tree"`` (auto): per forward, the backend measured faster on this device for this tree
  size and cached prefix (``auto_table``: the kernel's node-order path vs SDPA); without a
  measured table the Triton kernel when the tensors are on CUDA, SDPA otherwise;
- ``"dyntree_tree_triton"``: always the Triton kernel (the CPU interpreter without CUDA: slow,
  for tests);
- ``"dyntree_tree_torch"``: always SDPA;
- ``"dyntree_tree_dispatch"``: the backend named per call by the ``tree_attention_backend``
  keyword argument (``"torch"``, ``"triton"`` or ``"auto"``), SDPA when none is given. A model
  prepared once (``dyntree_core.decode.prepared.PreparedPair``) is switched to this implementation, so
  decoders with different attention settings share it without switching it again.

In every implementation an explicit ``tree_attention_backend=...`` keyword argument to
``model(...)`` overrides the implementation's own backend for that call.

Each is also registered in ``AttentionMaskInterface`` with SDPA's mask builder, so ordinary
calls (prefill with a 2D mask or none) build exactly the masks SDPA would get. Any call the kernel
does not cover (no/float/per-head mask, batch > 1, dropout, softcap, position bias, sinks)
delegates to ``sdpa_attention_forward`` unchanged, so the result is always what SDPA gives.

Kernel metadata (dense prefix length, block lists, dead rows) is derived generically from the
bool mask, once per forward (cached on the mask tensor's identity and version, and the cache
holds a reference so the identity cannot be reused), or taken from an optional
``tree_attention_meta=TreeAttnMeta`` keyword argument passed to ``model(...)`` (transformers
forwards extra keyword arguments down to the attention function).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch

from dyntree_core.attention import auto_table
from dyntree_core.attention.mask import TreeAttnMeta, is_placeholder, meta_from_mask
from dyntree_core.attention.triton_kernel import (
    HAS_TRITON,
    default_block_q,
    interpreter_usable,
    interpreting,
    triton_tree_attention,
)

Backend = Literal["torch", "triton", "auto"]
IMPL_NAMES: dict[str, str] = {
    "auto": "dyntree_tree",
    "triton": "dyntree_tree_triton",
    "torch": "dyntree_tree_torch",
}
#: the per-call implementation (backend from ``BACKEND_KWARG``, SDPA by default)
DISPATCH_IMPL = "dyntree_tree_dispatch"
META_KWARG = "tree_attention_meta"
BACKEND_KWARG = "tree_attention_backend"


@dataclass
class KernelTiles:
    """Tile sizes used by the HF glue: ``block_m`` packed rows (q tokens x GQA group), ``block_n``."""

    block_m: int = 64
    block_n: int = 32


TILES = KernelTiles()
_cache: dict[str, Any] = {}


def _meta_for(mask2d: torch.Tensor, mask4d: torch.Tensor, block_q: int, block_n: int) -> TreeAttnMeta:
    key = (mask4d._version, block_q, block_n)
    if _cache.get("mask") is mask4d and _cache.get("key") == key:
        return _cache["meta"]
    meta = meta_from_mask(mask2d, block_q, block_n)
    _cache.update(mask=mask4d, key=key, meta=meta)
    return meta


def clear_cache() -> None:
    """Drop the cached metadata (and the reference it holds to the last mask)."""
    _cache.clear()


#: why a call without a tree mask goes to SDPA: ordinary attention, not a refused kernel request
NO_TREE_MASK = "no 4D bool mask (an ordinary causal or padded call)"


def kernel_reason(
    backend: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: Optional[torch.Tensor], dropout: float, kwargs: dict[str, Any], preorder: bool = False,
) -> Optional[str]:
    """Why this call does not run the kernel (None: it does). ``preorder``: the given metadata is the
    interval form."""
    if backend == "torch":
        return "backend 'torch' (SDPA)"
    reason = device_reason(query.device)
    if reason is not None:
        return reason
    if attention_mask is None or not isinstance(attention_mask, torch.Tensor):
        return NO_TREE_MASK
    if attention_mask.dtype != torch.bool or attention_mask.dim() != 4:
        return NO_TREE_MASK
    if attention_mask.shape[0] != 1 or attention_mask.shape[1] != 1 or query.shape[0] != 1:
        return f"batch {query.shape[0]} or a per-head mask {tuple(attention_mask.shape[:2])} (the kernel takes batch 1, one mask)"
    if attention_mask.shape[2] != query.shape[2] or attention_mask.shape[3] != key.shape[2]:
        return f"mask {tuple(attention_mask.shape[2:])} does not match {query.shape[2]} queries x {key.shape[2]} keys"
    if dropout and dropout > 0.0:
        return f"dropout {dropout}"
    if key.shape[-1] != value.shape[-1] or key.shape[-1] != query.shape[-1]:
        return f"head dims q {query.shape[-1]}, k {key.shape[-1]}, v {value.shape[-1]} differ"
    if query.shape[1] % key.shape[1]:
        return f"{query.shape[1]} query heads are not a multiple of {key.shape[1]} key heads"
    for unsupported in ("softcap", "position_bias", "s_aux", "sinks", "cache"):
        if kwargs.get(unsupported) is not None:
            return f"{unsupported} (not in the kernel)"
    if kwargs.get("output_attentions"):
        return "output_attentions (the kernel returns no weights)"
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {query.dtype}"
    if not kernel_chosen(backend, query.device, query.shape[2], key.shape[2] - query.shape[2], preorder):
        return "the measured table chose SDPA for this size"
    return None


def device_reason(device: torch.device | str) -> Optional[str]:
    """Why the kernel cannot run on ``device`` in this process (None: it can)."""
    if not HAS_TRITON:
        return "Triton is not installed"
    dev = torch.device(device)
    if dev.type == "cuda":
        return None
    if not interpreting():
        return f"tensors on {dev.type}: the kernel needs CUDA, or TRITON_INTERPRET=1 set at process start"
    if not interpreter_usable():
        return "TRITON_INTERPRET=1 was set after Triton was imported for a GPU"
    return None


def kernel_chosen(backend: str, device: torch.device | str, n: int, prefix: int, preorder: bool) -> bool:
    """Whether a tree forward of ``n`` tokens after ``prefix`` cached ones runs the kernel for
    ``backend`` on ``device`` (``auto``: the measured table's choice), before the per-call checks of
    shapes and dtypes. The engine asks it to pass the kernel only its metadata."""
    if backend == "torch" or device_reason(device) is not None:
        return False
    dev = torch.device(device)
    if backend == "auto":
        return auto_table.choose(dev, n, prefix, preorder) == "triton"
    return True


def _make_forward(backend: str):
    def forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        dropout: float = 0.0,
        scaling: Optional[float] = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """query ``[1, Hq, q, D]``, key/value ``[1, Hkv, kv, D]`` -> (``[1, q, Hq, D]``, None)."""
        meta: Optional[TreeAttnMeta] = kwargs.pop(META_KWARG, None)
        chosen = kwargs.pop(BACKEND_KWARG, None) or backend
        preorder = meta is not None and meta.end is not None
        reason = kernel_reason(chosen, query, key, value, attention_mask, dropout, kwargs, preorder)
        if reason is not None:
            if chosen == "triton" and reason != NO_TREE_MASK:
                raise KernelRefused(f"attention='triton' cannot run this call: {reason}")
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            if meta is not None and attention_mask is not None and is_placeholder(attention_mask):
                from dyntree_core.attention import meta_full_mask

                attention_mask = meta_full_mask(meta, query.device)[None, None]

            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
        hq, hkv = query.shape[1], key.shape[1]
        if meta is None:
            block_q = default_block_q(hq // hkv, TILES.block_m)
            meta = _meta_for(attention_mask[0, 0], attention_mask, block_q, TILES.block_n)
        out = torch.empty(1, query.shape[2], hq, query.shape[3], dtype=query.dtype, device=query.device)
        triton_tree_attention(query[0], key[0], value[0], meta, sm_scale=scaling, out=out[0].transpose(0, 1))
        return out, None

    forward.__name__ = f"dyntree_tree_attention_{backend}"
    return forward


def register() -> None:
    """Register the four implementations with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    for backend, name in (*IMPL_NAMES.items(), ("torch", DISPATCH_IMPL)):
        AttentionInterface.register(name, _make_forward(backend))
        AttentionMaskInterface.register(name, sdpa_mask)


def sdpa_runs(attn_implementation: str, attn_kwargs: Optional[dict[str, Any]], device: torch.device | str,
              n: int, prefix: int) -> bool:
    """Whether every layer of a forward of ``n`` tokens after ``prefix`` cached ones, called with
    ``attn_kwargs`` on a model whose attention implementation is ``attn_implementation``, runs SDPA on
    the bool mask it is given (so a caller may call SDPA itself: ``decode.lean_forward``)."""
    kwargs = dict(attn_kwargs or {})
    if kwargs.pop(META_KWARG, None) is not None:
        return False
    chosen = kwargs.pop(BACKEND_KWARG, None)
    if kwargs:
        return False
    if attn_implementation == "sdpa":
        return True
    own = {name: backend for backend, name in IMPL_NAMES.items()} | {DISPATCH_IMPL: "torch"}
    if attn_implementation not in own:
        return False
    return not kernel_chosen(chosen or own[attn_implementation], device, n, prefix, preorder=False)


class KernelRefused(RuntimeError):
    """A call asked for the Triton kernel (``attention='triton'``) that it cannot take; the message
    names why. Asking for ``auto`` or ``torch`` never raises: those choose SDPA where it must run."""


def kernel_runs(backend: str, device: torch.device) -> bool:
    """Whether tree forwards (4D bool mask) on ``device`` may run the Triton kernel for ``backend``
    (for ``auto``: whether the device's measured table, or the rule without one, ever picks it)."""
    if backend == "torch" or device_reason(device) is not None:
        return False
    return backend == "triton" or auto_table.may_use_kernel(device)


def kernel_tiles(model: Any) -> tuple[int, int]:
    """``(block_q, block_n)`` the glue uses for ``model`` (query rows per tile follow its GQA group)."""
    cfg = model.config
    hq = int(cfg.num_attention_heads)
    hkv = int(getattr(cfg, "num_key_value_heads", None) or hq)
    return default_block_q(hq // hkv, TILES.block_m), TILES.block_n


def is_tree_attention(model: Any) -> bool:
    """Whether ``model`` runs one of this module's implementations (so ``BACKEND_KWARG`` and
    ``META_KWARG`` reach it)."""
    impl = getattr(model.config, "_attn_implementation", None)
    return impl == DISPATCH_IMPL or impl in IMPL_NAMES.values()


def check_backend(backend: str) -> None:
    """Raise when ``backend`` cannot run in this process (Triton missing, or the interpreter
    requested after Triton was imported without it)."""
    if backend not in IMPL_NAMES:
        raise ValueError(f"backend must be one of {tuple(IMPL_NAMES)}, got {backend!r}")
    if backend == "triton" and not HAS_TRITON:
        raise RuntimeError("backend='triton' needs Triton installed")
    if backend == "triton" and interpreting() and not interpreter_usable():
        raise RuntimeError(
            "backend='triton' without CUDA needs the Triton interpreter, but Triton was imported before "
            "TRITON_INTERPRET=1 was set; set it at process start"
        )


def use_dispatch(model: Any) -> Optional[TreeAttentionHandle]:
    """Switch ``model`` to the per-call implementation unless it already runs one of ours;
    returns the undo handle, or None when nothing changed."""
    if is_tree_attention(model):
        return None
    register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(DISPATCH_IMPL)
    if model.config._attn_implementation != DISPATCH_IMPL:
        raise RuntimeError(f"{type(model).__name__} refused attention implementation {DISPATCH_IMPL!r}")
    return TreeAttentionHandle(model, previous)


class TreeAttentionHandle:
    """Undo token returned by ``use_tree_attention``; also a context manager."""

    def __init__(self, model: Any, previous: str) -> None:
        self.model = model
        self.previous = previous

    def restore(self) -> None:
        """Put back the attention implementation the model had before."""
        self.model.set_attn_implementation(self.previous)
        clear_cache()

    def __enter__(self) -> "TreeAttentionHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


def use_tree_attention(model: Any, backend: Backend = "auto") -> TreeAttentionHandle:
    """Switch ``model`` (an HF ``PreTrainedModel``) to the tree-attention implementation.

    Returns a handle whose ``restore()`` (or ``with`` exit) reverts to the previous
    implementation. ``backend``: ``"auto"`` (the measured faster one, see ``auto_table``), ``"triton"``
    (always the kernel; CPU interpreter without CUDA), ``"torch"`` (always SDPA).
    """
    check_backend(backend)
    register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(IMPL_NAMES[backend])
    if model.config._attn_implementation != IMPL_NAMES[backend]:
        raise RuntimeError(f"{type(model).__name__} refused attention implementation {IMPL_NAMES[backend]!r}")
    return TreeAttentionHandle(model, previous)


register()
