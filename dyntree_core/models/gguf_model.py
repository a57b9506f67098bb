"""Build a transformers causal LM straight from a GGUF file, at a chosen precision.

No float32 copy is written anywhere: the skeleton is built on the meta device from the config in
the preset's metadata directory, then every tensor is read from the (memory-mapped) GGUF:

* ``int4``: the file's own blocks where this machine's kernel table (``quant.kernel_table``) says the
  native kernels are fastest: Q4_K/Q6_K/Q5_0/Q8_0 tensors, output head included, stay as they are on
  ``GGMLLinear`` (every weight exactly the float32 model's). Elsewhere torch's kernels: 4-bit GGML blocks
  (Q4_0/Q4_1/Q4_K) go onto ``Int4Linear`` exactly (``quant.ggml``; only the bf16 rounding of scales and
  zeros changes a weight); tensors the file keeps above 4 bits (Q5_0, Q6_K, Q8_0, F16, ...) go onto
  ``Int8Linear``: a Q5_0 draft requantized to int4 drifted from its own float weights by KL 0.30 nats on
  a short code prompt (int8: 0.004), so "int4" never drops below the precision the file ships; the
  output head is int8 (``quant.apply.head_precision``).
* ``int8``: every linear is dequantized and requantized per output channel, the head included.
* ``float32`` / ``bfloat16``: dense, dequantized by the gguf package's reference code.

Supported architectures: ``qwen2`` and ``llama`` (llama.cpp stores llama's Q/K rows permuted for
its rotary layout; they are permuted back here, as transformers' own GGUF loader does).
"""

from __future__ import annotations

import math
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import torch

from . import packed_cache
from .load_progress import LoadProgress
from ..interrupt import LoadStopped, check_load
from ..quant.apply import PRECISION_ATTR, QUANT_PRECISIONS, check_precision, head_precision, set_submodule
from ..quant.ggml import FOUR_BIT_TYPES, decode_4bit, dequantize
from ..quant.ggml_embedding import block_embedding, holds_as_blocks
from ..quant.gguf_file import read_gguf
from ..quant.linear import Int4Linear, Int8Linear, cpu_aligned, int4_shape_ok
from ..quant.native import native_kernels, x8_layout_tag

if TYPE_CHECKING:
    from ..quant.kernel_table import LayerShape

SUPPORTED_ARCHITECTURES = ("qwen2", "llama")
CACHE_FORMAT = 4  # 3: GGMLLinear layers (the file's blocks) where the kernel table chooses them; 4: x8 layers as tiles

_LAYER_MAP = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_MAP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


class GGUFModelError(ValueError):
    """The GGUF cannot be built into a model here (architecture, unexpected tensors)."""


def hf_name(gguf_name: str) -> tuple[str, str]:
    """``blk.3.attn_q.weight`` -> (``model.layers.3.self_attn.q_proj``, ``weight``)."""
    m = _BLK.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        if part not in _LAYER_MAP:
            raise GGUFModelError(f"unexpected GGUF tensor {gguf_name!r}")
        return f"model.layers.{layer}.{_LAYER_MAP[part]}", kind
    base, _, kind = gguf_name.rpartition(".")
    if base not in _TOP_MAP:
        raise GGUFModelError(f"unexpected GGUF tensor {gguf_name!r}")
    return _TOP_MAP[base], kind


def _unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row index that undoes llama.cpp's Q/K permutation (``reverse_permute`` in transformers)."""
    dim = n_rows // n_head // 2
    idx = torch.arange(n_rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(n_rows)
    return idx


def quant_cache_path(cache_dir: Path | str, precision: str, plan_tag: str = "") -> Path:
    """Where the packed ``precision`` weights of a GGUF model are kept (keyed by torch version:
    the int4 pack layout is torch's own; and by ``plan_tag``, which layers are on which kernel)."""
    tv = torch.__version__.split("+")[0]
    tag = f"-{plan_tag}" if plan_tag else ""
    return Path(cache_dir) / f"packed-{precision}-torch{tv}-v{CACHE_FORMAT}{tag}.safetensors"


#: where a model's output head is read from: ``output`` (the file's ``output.weight``) or ``embedding`` (a draft's:
#: ``token_embd.weight`` where ``embedding_head_reason`` finds it the same matrix in fewer bytes)
HEADS = ("output", "embedding")
#: rows of the two tensors ``embedding_head_reason`` compares (evenly spaced over the vocabulary)
TIED_CHECK_ROWS = 256
#: the largest ||E - O|| / ||O|| over those rows for which the embedding E is the head O at another precision (two
#: quantizations of one matrix: Q5_0 against Q8_0 0.04, Q4_K against Q6_K ~0.1; two different matrices ~1.4)
TIED_MAX_REL_DIFF = 0.25


def embedding_head_reason(gf, precision: str) -> Optional[str]:
    """Why ``token_embd.weight`` cannot stand in for ``output.weight`` as the head of a model built at
    ``precision`` (``None`` when it can): only at ``int4`` (the file's own blocks; at ``int8`` either is requantized
    to the same bytes), where the file holds both, of one shape, the embedding in fewer bytes and, compared on
    ``TIED_CHECK_ROWS`` rows, the same matrix (``TIED_MAX_REL_DIFF``). A draft's head only proposes tokens, which
    the target accepts or not, so its precision moves acceptance, never the output; its bytes are read on every
    draft forward (the 0.5B draft: Q8_0 145 MB, the embedding's Q5_0 94 MB, 37% and 24% of its forward)."""
    import numpy as np

    if precision != "int4":
        return f"the head keeps its own tensor at {precision}"
    emb, out = gf.tensors.get("token_embd.weight"), gf.tensors.get("output.weight")
    if emb is None or out is None:
        return "the file has one tensor for both (a tied head)"
    if tuple(emb.shape) != tuple(out.shape) or len(emb.shape) != 2:
        return f"token_embd {tuple(emb.shape)} and output {tuple(out.shape)} differ in shape"
    if emb.data.nbytes >= out.data.nbytes:
        return f"token_embd ({emb.type_name}) is not smaller than output ({out.type_name})"
    rows = np.linspace(0, emb.shape[0] - 1, TIED_CHECK_ROWS).astype(np.int64)
    shape = (len(rows), int(emb.shape[1]))
    e = dequantize(np.ascontiguousarray(emb.data[rows]), emb.type_name, shape)
    o = dequantize(np.ascontiguousarray(out.data[rows]), out.type_name, shape)
    rel = float((e - o).norm() / o.norm().clamp_min(1e-30))
    if not rel <= TIED_MAX_REL_DIFF:
        return f"token_embd is not output at another precision (relative difference {rel:.2f} on {len(rows)} rows)"
    return None


def with_head(gf, head: str, precision: str):
    """``gf`` as a model at ``precision`` is built from it: with ``head="embedding"`` and no
    ``embedding_head_reason``, without ``output.weight`` (the embedding then serves as a tied head and shares its
    blocks with it), else ``gf`` itself."""
    from dataclasses import replace

    if head not in HEADS:
        raise ValueError(f"head must be one of {HEADS}, got {head!r}")
    if head == "output" or embedding_head_reason(gf, precision) is not None:
        return gf
    emb, out = gf.tensors["token_embd.weight"], gf.tensors["output.weight"]
    note = (f"head: token_embd.weight ({emb.type_name}, {emb.data.nbytes / 1e6:.0f} MB, shared with the embedding) "
            f"in place of output.weight ({out.type_name}, {out.data.nbytes / 1e6:.0f} MB)")
    return replace(gf, metadata={**gf.metadata, HEAD_NOTE_KEY: note},
                   tensors={n: t for n, t in gf.tensors.items() if n != "output.weight"})


#: ``with_head``'s note in the metadata of the file it returns, and on the model built from it (``head_note``)
HEAD_NOTE_KEY = "dyntree.head"
HEAD_NOTE_ATTR = "_dyntree_head_note"


def head_note(model) -> Optional[str]:
    """What a model built with ``head="embedding"`` reads as its head (``None``: its file's ``output.weight``)."""
    return getattr(model, HEAD_NOTE_ATTR, None)


def linear_shapes(gf) -> dict[str, "LayerShape"]:
    """GGUF tensor name -> ``LayerShape`` of every 2-D weight (the head: ``output.weight``, or the embedding
    standing in for a tied head)."""
    from ..quant.kernel_table import LayerShape

    tensors = dict(gf.tensors)
    if "output.weight" not in tensors:
        tensors["output.weight"] = tensors["token_embd.weight"]
    return {name: LayerShape(t.type_name, int(t.shape[0]), int(t.shape[1]))
            for name, t in tensors.items() if len(t.shape) == 2 and name != "token_embd.weight"}


def kernel_plans(gf, precision: str, say=None) -> dict:
    """``LayerShape -> LayerPlan`` for a model built at ``precision`` (only ``int4`` uses the table: ``int8``
    means torch's per-channel int8 kernel everywhere)."""
    from ..quant.kernel_table import LayerPlan, layer_plans

    by_name = linear_shapes(gf)
    shapes = set(by_name.values())
    if precision != "int4":
        return {s: LayerPlan("aten", 0, f"precision {precision}") for s in shapes}
    head = by_name["output.weight"]
    only_head = {head} - {s for name, s in by_name.items() if name != "output.weight"}
    return layer_plans(shapes, say, heads=only_head)


def plans_tag(plans: dict) -> str:
    """Short digest of which shapes run the file's blocks ("" when none does: the cache name of old)."""
    import hashlib

    ggml = sorted(s.label + ("/q8" if p.int8_activations else "") + ("/x8" if p.x8 else "")
                  for s, p in plans.items() if p.kind == "ggml")
    return hashlib.sha256("|".join(ggml).encode()).hexdigest()[:8] if ggml else ""


def _plans_and_cache_file(gf, precision: str, cache_dir: Optional[Path | str], say) -> tuple[dict, Optional[Path]]:
    """The kernel plans of a model built from ``gf`` at ``precision`` (measuring the table's missing shapes) and
    the packed cache file it is kept in (None: not kept: a dense precision, or no ``cache_dir``)."""
    plans = kernel_plans(gf, precision, say) if precision in QUANT_PRECISIONS else {}
    tag = plans_tag(plans) + ("-embhead" if HEAD_NOTE_KEY in gf.metadata else "")
    if any(p.kind == "ggml" and p.x8 for p in plans.values()):  # (x8 layers are kept as tiles: named by their layout)
        tag += f"-x8{x8_layout_tag(native_kernels())}"
    cached = (quant_cache_path(cache_dir, precision, tag)
              if cache_dir is not None and precision in QUANT_PRECISIONS else None)
    return plans, cached


def packed_cache_ready(gguf_path: Path | str, precision: str, cache_dir: Path | str, head: str = "output",
                       progress: Optional[Callable[[str], None]] = None) -> bool:
    """Whether ``load_gguf_model(gguf_path, ..., precision, cache_dir=cache_dir, head=head)`` would read its
    weights from the packed cache (this machine's kernel table measured first where it lacks the file's shapes)."""
    gf = with_head(read_gguf(gguf_path), head, precision)
    _plans, cached = _plans_and_cache_file(gf, precision, cache_dir, progress or (lambda _m: None))
    return cached is not None and cached.is_file()


def load_gguf_model(
    gguf_path: Path | str,
    config_dir: Path | str,
    precision: str = "float32",
    progress: Optional[Callable[[str], None]] = None,
    cache_dir: Optional[Path | str] = None,
    head: str = "output",
):
    """A CPU causal LM in eval mode from ``gguf_path`` (config from ``config_dir``) at ``precision``.

    ``head``: ``output`` (the file's head) or ``embedding`` (a draft's: ``with_head``; its note in ``head_note``).

    With ``cache_dir``, int8/int4 weights are packed once and kept there (``quant_cache_path``; the older files
    pruned: ``packed_cache``; the embedding is not: it is read from the GGUF, as blocks (``quant.ggml_embedding``)
    where the kernels read its type, else dequantized). The returned model carries
    ``_dyntree_precision`` and ``_dyntree_load_seconds``.
    """
    from transformers import AutoModelForCausalLM

    check_precision(precision, "cpu")
    t0 = time.perf_counter()
    say = progress or (lambda _m: None)
    gf, config, dense_dtype, model = _skeleton(gguf_path, config_dir, precision, head)
    arch = gf.architecture
    plans, cached = _plans_and_cache_file(gf, precision, cache_dir, say)
    if cached is not None and cached.is_file():
        try:
            loaded = _load_packed(model, gf, cached, precision, t0, plans, say)
        except LoadStopped:
            raise
        except Exception as e:  # a damaged cache file is rebuilt, not fatal
            say(f"  packed cache {cached.name} unusable ({type(e).__name__}: {e}); rebuilding")
            cached.unlink(missing_ok=True)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, dtype=dense_dtype, attn_implementation="sdpa")
        else:
            packed_cache.mark_used(cached)
            packed_cache.prune(cached.parent, cached, say)
            return loaded
    say(f"  building {precision} weights from {Path(gguf_path).name} (once; later loads read the packed cache)"
        if cached is not None else f"  reading {Path(gguf_path).name} at {precision}")
    model = _build(model, gf, arch, config, precision, dense_dtype, say, t0, plans)
    if cached is not None:
        _save_packed(model, cached)
        packed_cache.prune(cached.parent, cached, say)
    fuse_native(model)
    model._dyntree_load_seconds = time.perf_counter() - t0
    return _noted(model, gf)


def _noted(model, gf):
    """``model`` with ``with_head``'s note from ``gf`` (``head_note``), where it has one."""
    if HEAD_NOTE_KEY in gf.metadata:
        setattr(model, HEAD_NOTE_ATTR, gf.metadata[HEAD_NOTE_KEY])
    return model


_EMBED = "model.embed_tokens.weight"


def _block_embedding(model, gf, zeros: bool = False) -> bool:
    """Give a quantized model the GGUF's embedding as blocks (``quant.ggml_embedding``; shared with a head tied
    to it); ``zeros``: blocks of zeros (a shape twin). False where the type needs the dense table."""
    from ..quant.ggml_linear import row_bytes

    emb = gf.tensors["token_embd.weight"]
    if not holds_as_blocks(emb.type_name):
        return False
    vocab, dim = (int(x) for x in emb.shape)

    def read() -> torch.Tensor:
        if zeros:
            return torch.zeros(vocab, row_bytes(emb.type_name, dim), dtype=torch.uint8)
        return cpu_aligned(torch.from_numpy(emb.data.copy()))

    tied = "output.weight" not in gf.tensors
    module = block_embedding(emb.type_name, vocab, dim, read, tied_head=model.lm_head if tied else None)
    set_submodule(model, "model.embed_tokens", module)
    return True


def _save_packed(model, path: Path) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    import json

    from ..quant.ggml_linear import GGMLLinear

    sd = {k: v.contiguous() for k, v in model.state_dict().items() if not k.startswith("model.embed_tokens.")}
    # (an x8 layer's blocks are its tiles: a load takes them as they are, in the layout the file's name says)
    ggml = {name: [m.type_name, m.in_features, m.out_features, m.x8] for name, m in model.named_modules()
            if isinstance(m, GGMLLinear)}
    tmp = path.with_name(path.name + ".partial")
    save_file(sd, str(tmp), metadata={"precision": getattr(model, PRECISION_ATTR), "torch": torch.__version__,
                                      "ggml": json.dumps(ggml)})
    tmp.replace(path)


def read_packed(path: Path, as_mapped: frozenset[str] = frozenset(),
                progress: Optional[LoadProgress] = None) -> dict[str, torch.Tensor]:
    """The tensors of a packed cache file, each in CPU memory aligned for the low-bit kernels
    (``quant.linear.cpu_aligned``: safetensors maps them at 8-byte offsets), but those named in ``as_mapped``, left
    as the file maps them for a reader that copies them anyway (``GGMLLinear``: into 2 MiB pages). ``progress`` is
    told each copy."""
    from safetensors.torch import load_file

    out = {}
    for k, v in load_file(str(path)).items():
        if k in as_mapped:
            out[k] = v
            continue
        out[k] = cpu_aligned(v)
        if progress is not None:
            progress.advance(v.nbytes)
    return out


def _join_gate_up(model, held: dict[str, tuple], copied: Callable[[int], None] = lambda _n: None) -> None:
    """Each MLP whose ``gate_proj`` and ``up_proj`` (``held``: name -> type, blocks as the file maps them, K, N,
    plan) run alike becomes a ``FusedGateUp`` with their blocks copied once, straight into one buffer of 2 MiB pages
    (``fuse_forward`` would copy each into its own, then both again); any other is set as it is. ``copied(nbytes)``
    after each MLP."""
    from ..quant.fused import run_alike
    from ..quant.gate_up import FusedGateUp, joined_rows

    def alike(a, b) -> bool:
        (ta, _, ka, _, pa), (tb, _, kb, _, pb) = a, b
        return (ta, ka) == (tb, kb) and run_alike(pa, pb)

    for mlp_name in dict.fromkeys(name.rpartition(".")[0] for name in held):
        gate, up = held.get(f"{mlp_name}.gate_proj"), held.get(f"{mlp_name}.up_proj")
        mlp = model.get_submodule(mlp_name)
        if gate is not None and up is not None and alike(gate, up) and hasattr(mlp, "act_fn"):
            type_name, g, k, n_gate, plan = gate
            layer = _ggml_layer(type_name, joined_rows(g, up[1]), k, None, plan, n_gate + up[3])
            set_submodule(model, mlp_name, FusedGateUp(layer, n_gate, mlp.down_proj, mlp.act_fn))
            copied(g.nbytes + up[1].nbytes)
            continue
        for part in (f"{mlp_name}.gate_proj", f"{mlp_name}.up_proj"):
            if part in held:
                type_name, blocks, k, n, plan = held[part]
                set_submodule(model, part, _ggml_layer(type_name, blocks, k, None, plan, n))
                copied(blocks.nbytes)


def _load_packed(model, gf, path: Path, precision: str, t0: float, plans: dict, say: Callable[[str], None]):
    """``model`` (a meta skeleton) with the packed cache file ``path``'s weights; ``say`` hears its progress
    (``LoadProgress``: it also ends the load where it was stopped)."""
    import json

    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        ggml = json.loads((f.metadata() or {}).get("ggml", "{}"))
    progress = LoadProgress(say, "reading the packed weights", path.stat().st_size)
    sd = read_packed(path, frozenset(f"{mod}.blocks" for mod in ggml), progress)
    by_label = {s.label: p for s, p in plans.items()}
    held: dict[str, tuple] = {}  # gate_proj / up_proj blocks, joined below where the pair runs alike
    for mod, (type_name, k, n, x8) in ggml.items():
        plan = by_label[f"{type_name} [{n}, {k}]"]
        if bool(x8) != plan.x8:
            raise GGUFModelError(f"{mod} is kept {'as x8 tiles' if x8 else 'as rows'}; its plan says otherwise")
        blocks, bias = sd.pop(f"{mod}.blocks"), sd.pop(f"{mod}.bias", None)
        if mod.rpartition(".")[2] in ("gate_proj", "up_proj") and bias is None:
            held[mod] = (type_name, blocks, int(k), int(n), plan)
            continue
        set_submodule(model, mod, _ggml_layer(type_name, blocks, int(k), bias, plan, int(n)))
        progress.advance(blocks.nbytes)
    _join_gate_up(model, held, progress.advance)
    for key in [k for k in sd if k.endswith(".packed")]:
        mod = key.removesuffix(".packed")
        set_submodule(model, mod, Int4Linear.from_buffers(
            sd.pop(key), sd.pop(f"{mod}.scales_and_zeros"), sd.pop(f"{mod}.bias", None)))
    for key in [k for k in sd if k.endswith(".qweight")]:
        mod = key.removesuffix(".qweight")
        set_submodule(model, mod, Int8Linear.from_buffers(
            sd.pop(key), sd.pop(f"{mod}.scales"), sd.pop(f"{mod}.bias", None)))
    if not _block_embedding(model, gf):
        emb = gf.tensors["token_embd.weight"]
        sd[_EMBED] = dequantize(emb.data, emb.type_name, emb.shape)
    _, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    if unexpected:
        raise GGUFModelError(f"packed cache has unknown tensors {unexpected[:5]}")
    _finish(model, precision)
    fuse_native(model)
    model._dyntree_load_seconds = time.perf_counter() - t0
    return _noted(model, gf)


def fuse_native(model) -> None:
    """``quant.fused.fuse_forward`` on models with ``GGMLLinear`` layers (after any packed cache was written:
    the cache keeps the unfused layout), then their blocks under 2 MiB into 2 MiB pages
    (``quant.ggml_linear.pack_small_blocks``: the fused ones, before any forward plans the C layers)."""
    from ..quant.fused import fuse_forward
    from ..quant.ggml_linear import GGMLLinear, pack_small_blocks

    if any(isinstance(m, GGMLLinear) for m in model.modules()):
        fuse_forward(model)
        pack_small_blocks(model)


def _finish(model, precision: str) -> None:
    _rebuild_rotary(model)
    left = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if left:
        raise GGUFModelError(f"the GGUF has no values for {left[:5]} ({len(left)} in all)")
    if getattr(model.config, "tie_word_embeddings", False) and precision in ("float32", "bfloat16"):
        model.tie_weights()
    setattr(model, PRECISION_ATTR, precision)
    model.eval()


def linear_precision(module: str, type_name: str, n_rows: int, n_cols: int, precision: str) -> str:
    """Which kernel one GGUF linear gets under a quantized model ``precision``: ``int4`` only for
    4-bit blocks of a shape the int4 kernel takes (never requantize below what the file ships),
    else ``int8``; the head follows ``head_precision``."""
    p = head_precision(precision) if module == "lm_head" else precision
    return "int4" if (p == "int4" and type_name in FOUR_BIT_TYPES and int4_shape_ok(n_rows, n_cols)) else "int8"


def _mapped_rows(data) -> torch.Tensor:
    """A GGUF tensor's rows as a uint8 tensor on the file's read-only mapping, not copied: only for a reader that
    writes nothing into them (``GGMLLinear``'s x8 repack)."""
    import warnings

    with warnings.catch_warnings():  # (torch warns that the array is not writable; nothing writes it)
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(data)


def _ggml_layer(type_name: str, blocks: torch.Tensor, k: int, bias, plan, out_features: Optional[int] = None):
    """A ``GGMLLinear`` on ``plan``'s kernels (its blocks: GGML rows, or x8 tiles of ``out_features`` rows as a packed
    file keeps them); it copies them into 2 MiB pages or aligns them itself."""
    from ..quant.ggml_linear import GGMLLinear

    layer = GGMLLinear(type_name, blocks.contiguous(), k, bias, int8_activations=plan.int8_activations, x8=plan.x8,
                       out_features=out_features)
    layer.mm_min_rows = plan.mm_min_rows
    layer.vnni_min_rows = plan.vnni_min_rows
    return layer


def _skeleton(gguf_path: Path | str, config_dir: Path | str, precision: str, head: str = "output"):
    from transformers import AutoConfig, AutoModelForCausalLM

    gf = read_gguf(gguf_path)
    if gf.architecture not in SUPPORTED_ARCHITECTURES:
        raise GGUFModelError(f"GGUF architecture {gf.architecture!r} is not supported here "
                             f"({', '.join(SUPPORTED_ARCHITECTURES)})")
    gf = with_head(gf, head, precision)
    config = AutoConfig.from_pretrained(str(config_dir), local_files_only=True)
    dense_dtype = torch.bfloat16 if precision == "bfloat16" else torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dense_dtype, attn_implementation="sdpa")
    return gf, config, dense_dtype, model


def shape_twin(gguf_path: Path | str, config_dir: Path | str, precision: str = "float32", head: str = "output"):
    """A model with the architecture, layer kinds and buffer shapes ``load_gguf_model(gguf_path,
    config_dir, precision, head=head)`` would build, every weight zero.

    A forward costs what the real model's costs (dense and int8/int4 kernels do not look at the
    values, and zeros are not denormals) and it builds in seconds with no GGUF decoding: the
    machine profile times these instead of loading every precision of both models. Its outputs
    are meaningless. Carries ``_dyntree_precision`` and ``_dyntree_shape_twin = True``.
    """
    from ..quant.kernel_table import LayerShape
    from ..quant.ggml_linear import row_bytes

    check_precision(precision, "cpu")
    gf, config, dense_dtype, model = _skeleton(gguf_path, config_dir, precision, head)
    plans = kernel_plans(gf, precision) if precision in QUANT_PRECISIONS else {}
    tensors = dict(gf.tensors)
    if "output.weight" not in tensors:
        tensors = {**tensors, "output.weight": tensors["token_embd.weight"]}
    linears = {name for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)}
    state: dict[str, torch.Tensor] = {}
    for gname, t in tensors.items():
        module, kind = hf_name(gname)
        if kind == "bias":
            continue
        has_bias = gname.rsplit(".", 1)[0] + ".bias" in tensors
        shape = tuple(int(x) for x in t.shape)
        if module in linears and precision in QUANT_PRECISIONS:
            n, k = shape
            bias = torch.zeros(n) if has_bias else None
            plan = plans.get(LayerShape(t.type_name, n, k))
            if plan is not None and plan.kind == "ggml":
                new = _ggml_layer(t.type_name, torch.zeros(n, row_bytes(t.type_name, k), dtype=torch.uint8), k, bias, plan)
            elif linear_precision(module, t.type_name, n, k, precision) == "int4":
                new = Int4Linear.from_buffers(torch.zeros(n, k // 2, dtype=torch.uint8),
                                              torch.zeros(k // 32, n, 2, dtype=torch.bfloat16), bias)
            else:
                new = Int8Linear.from_buffers(torch.zeros(n, k, dtype=torch.int8), torch.ones(n), bias)
            set_submodule(model, module, new)
        elif not (module == "model.embed_tokens" and precision in QUANT_PRECISIONS
                  and holds_as_blocks(t.type_name)):
            state[f"{module}.{kind}"] = torch.zeros(shape, dtype=dense_dtype)
            if has_bias:
                state[f"{module}.bias"] = torch.zeros(shape[0], dtype=dense_dtype)
    if precision in QUANT_PRECISIONS and not _block_embedding(model, gf, zeros=True):
        state[_EMBED] = torch.zeros(gf.tensors["token_embd.weight"].shape, dtype=dense_dtype)
    model.load_state_dict(state, strict=False, assign=True)
    _finish(model, precision)
    fuse_native(model)
    model._dyntree_shape_twin = True
    return _noted(model, gf)


def _build(model, gf, arch: str, config, precision: str, dense_dtype, say, t0: float, plans: dict):
    from ..quant.kernel_table import LayerShape

    tensors = dict(gf.tensors)
    n_head, n_kv = int(config.num_attention_heads), int(config.num_key_value_heads)
    if "output.weight" not in tensors:  # tied head: the embedding serves both
        tensors = {**tensors, "output.weight": tensors["token_embd.weight"]}

    def rows_fix(module: str, n_rows: int) -> Optional[torch.Tensor]:
        if arch != "llama":
            return None
        if module.endswith("q_proj"):
            return _unpermute_rows(n_rows, n_head)
        if module.endswith("k_proj"):
            return _unpermute_rows(n_rows, n_kv)
        return None

    def dense(t, module: str) -> torch.Tensor:
        shape = t.shape
        w = dequantize(t.data, t.type_name, shape)
        fix = rows_fix(module, shape[0]) if len(shape) >= 1 else None
        return w[fix] if fix is not None else w

    state: dict[str, torch.Tensor] = {}
    linears = {name for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)}
    done = 0
    for gname, t in tensors.items():
        check_load()  # (a Stop, a closed tab or the app's shutdown ends the build here)
        module, kind = hf_name(gname)
        if kind == "bias":
            continue  # taken together with its weight
        if module == "model.embed_tokens" and precision in QUANT_PRECISIONS and holds_as_blocks(t.type_name):
            continue  # its blocks, after the head (``_block_embedding``)
        if module in linears and precision not in ("float32", "bfloat16"):
            bias_t = tensors.get(gname.rsplit(".", 1)[0] + ".bias")
            bias = dense(bias_t, module) if bias_t is not None else None
            type_name = t.type_name
            n_rows, n_cols = t.shape
            plan = plans.get(LayerShape(type_name, n_rows, n_cols))
            if plan is not None and plan.kind == "ggml":
                fix = rows_fix(module, n_rows)
                if plan.x8 and fix is None:  # the repack reads the file's rows where they are and writes its tiles
                    blocks = _mapped_rows(t.data)
                else:  # rows of whole blocks: llama's Q/K un-permute moves rows
                    blocks = torch.from_numpy(t.data.copy())
                new = _ggml_layer(type_name, blocks[fix] if fix is not None else blocks, n_cols, bias, plan)
            elif linear_precision(module, type_name, n_rows, n_cols, precision) == "int4":
                g = decode_4bit(t.data, type_name, n_rows, n_cols)
                fix = rows_fix(module, n_rows)
                if fix is not None:
                    g = g.take_rows(fix)
                new = Int4Linear.from_groups(g.q, g.scale, g.offset, bias)
            else:  # int8, and int4 for tensors the file keeps above 4 bits: never requantize below the file
                new = Int8Linear.from_dense(dense(t, module), bias)
            set_submodule(model, module, new)
        else:
            state[f"{module}.{kind}"] = dense(t, module).to(dense_dtype)
            bias_t = tensors.get(gname.rsplit(".", 1)[0] + ".bias")
            if bias_t is not None:
                state[f"{module}.bias"] = dense(bias_t, module).to(dense_dtype)
        done += 1
        if done % 50 == 0:
            say(f"  {done}/{len(tensors)} tensors ({time.perf_counter() - t0:.1f}s)")
    if precision in QUANT_PRECISIONS and not _block_embedding(model, gf) and _EMBED not in state:
        state[_EMBED] = dense(gf.tensors["token_embd.weight"], "model.embed_tokens")
    _, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected:
        raise GGUFModelError(f"GGUF tensors without a place in the model: {unexpected[:5]}")
    _finish(model, precision)
    return model


def _rebuild_rotary(model) -> None:
    """Rotary ``inv_freq`` buffers are computed in ``__init__``; rebuild those modules on the CPU."""
    for name, mod in list(model.named_modules()):
        if any(b.is_meta for b in mod.buffers(recurse=False)) and hasattr(mod, "inv_freq"):
            set_submodule(model, name, type(mod)(config=model.config))


def write_metadata_dir(gguf_path: Path | str, out_dir: Path | str) -> dict:
    """The small part of a model directory: ``config.json``, tokenizer files and generation config
    read from the GGUF's metadata (weights stay in the GGUF). Returns a summary record."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
        tid = getattr(tok, name, None)
        if tid is not None and getattr(config, name, None) is None:
            setattr(config, name, tid)
    config.dtype = torch.float32
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
    gen = GenerationConfig.from_model_config(config)
    if gen.eos_token_id is None and tok.eos_token_id is not None:
        gen.eos_token_id = tok.eos_token_id
    if gen.pad_token_id is None and tok.pad_token_id is not None:
        gen.pad_token_id = tok.pad_token_id
    gen.save_pretrained(str(out_dir))
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    return {"vocab_size": vocab, "tokenizer_len": len(tok), "eos_token_id": tok.eos_token_id}


def gguf_forward_bytes(gguf_path: Path | str, precision: str, head: str = "output") -> Optional[int]:
    """Weight bytes one token's forward reads at ``precision``: every matrix but an embedding the head does not
    share (a forward reads only its rows), at 4 / 2 / 1 bytes per weight (``float32`` / ``bfloat16`` / ``int8``),
    or as the file's own blocks (``int4``: the GGUF's types); ``None`` at other precisions. From the GGUF's header
    and tensor table (the file is mapped, not read; ``head="embedding"`` compares a few rows: ``with_head``)."""
    size = {"float32": 4, "bfloat16": 2, "int8": 1}.get(precision)
    if size is None and precision != "int4":
        return None
    tensors = with_head(read_gguf(gguf_path), head, precision).tensors
    untied = "output.weight" in tensors
    read = [t for name, t in tensors.items() if len(t.shape) == 2 and not (untied and name == "token_embd.weight")]
    if size is None:
        return int(sum(t.data.nbytes for t in read))
    return int(sum(math.prod(t.shape) for t in read)) * size


def gguf_vocab_size(gguf_path: Path | str) -> int:
    """Rows of the output head (or the embedding) read from the GGUF header alone (no weights)."""
    names = read_gguf(gguf_path).tensors
    t = names.get("output.weight") or names.get("token_embd.weight")
    if t is None:
        raise GGUFModelError(f"{gguf_path}: no output or embedding tensor")
    return int(t.shape[0])
