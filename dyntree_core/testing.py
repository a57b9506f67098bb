"""Tiny random model pairs for tests and examples (no network, no files).

``tiny_pair`` builds two Llama-architecture HF models that share a vocabulary. The target has a
*peaked* init (next-token distributions far from uniform, so speculative decoding accepts often
and distribution tests have power); the draft is the target with fewer layers and perturbed
weights, so it is correlated with the target but different from it.
"""

from __future__ import annotations

import torch

from .quant.linear import CPU_ALIGN, cpu_aligned


def tiny_config(vocab: int = 64, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                max_positions: int = 512):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
        attn_implementation="sdpa",
    )


def tiny_pair(
    vocab: int = 64,
    seed: int = 0,
    peak: float = 4.0,
    draft_noise: float = 0.3,
    layers: int = 2,
    hidden: int = 64,
    eos: bool = False,
    dtype: torch.dtype = torch.float32,
    max_positions: int = 512,
):
    """Return ``(draft, target)``: tiny random Llama models with a shared vocabulary.

    Args:
        vocab: vocabulary size shared by both models.
        seed: everything is deterministic given the seed.
        peak: scale applied to the target's output head (larger = peakier distributions).
        draft_noise: relative std of the noise added to the draft's copy of the weights.
        layers: target decoder layers (the draft keeps ``max(1, layers // 2)``).
        hidden: hidden size.
        eos: when False the EOS token's logit is pushed down so runs reach ``max_new_tokens``
            (EOS behaviour is then tested explicitly with ``eos=True``).
        max_positions: the models' context length.
    """
    from transformers import LlamaForCausalLM

    gen = torch.Generator().manual_seed(seed)
    tcfg = tiny_config(vocab=vocab, layers=layers, hidden=hidden, max_positions=max_positions)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        target = LlamaForCausalLM(tcfg)
    with torch.no_grad():
        for p in target.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 / p.shape[-1] ** 0.5 if p.ndim > 1 else 0.0) + (1.0 if p.ndim == 1 else 0.0))
        target.model.embed_tokens.weight.mul_(hidden**0.5)
        target.lm_head.weight.mul_(peak * 2.0)
        if not eos:
            target.lm_head.weight[tcfg.eos_token_id].zero_()
            target.lm_head.bias = None
    dcfg = tiny_config(vocab=vocab, layers=max(1, layers // 2), hidden=hidden, max_positions=max_positions)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        draft = LlamaForCausalLM(dcfg)
    with torch.no_grad():
        tstate = target.state_dict()
        for name, p in draft.named_parameters():
            src = tstate[name]
            noise = torch.randn(src.shape, generator=gen) * src.std().clamp(min=1e-3) * draft_noise
            p.copy_(src + (noise if src.ndim > 1 else 0.0))
    target = target.to(dtype).eval()
    draft = draft.to(dtype).eval()
    for m in (draft, target):
        m.generation_config.eos_token_id = m.config.eos_token_id
        m.generation_config.pad_token_id = m.config.eos_token_id
    return draft, target


#: byte alignment CPU GEMM kernels get from torch's allocator (oneDNN/MKL pick kernels by it)
CPU_PARAM_ALIGN = CPU_ALIGN


def align_cpu_parameters(module: torch.nn.Module, align: int = CPU_PARAM_ALIGN) -> int:
    """Copy every CPU parameter of ``module`` whose storage is not ``align``-byte aligned into
    fresh (aligned) memory; returns how many were copied.

    safetensors memory-maps tensors at arbitrary header offsets, and on the CPU the
    matrix-vector kernel chosen for such memory differs from the aligned one in the last bits.
    Bit-for-bit comparisons against a copy of the weights (the offload engine's packed buffers)
    therefore align the reference first. The loader keeps the mapping on purpose: file-backed
    pages are reclaimable, anonymous copies of an fp32 pair are not.
    """
    moved = 0
    for p in module.parameters():
        data = p.data  # a new view object on every access
        aligned = cpu_aligned(data, align)
        if aligned is not data:
            p.data = aligned
            moved += 1
    return moved


class TinyPairCache:
    """The tiny pair at any precision, with the interface of ``dyntree_core.planning.pair_cache.PairCache``
    (``model`` / ``timing_model(role, precision)``, ``pair(target_precision, draft_precision)``), so ``auto`` and the
    speed bench run on it in tests. Each call builds fresh models (quantizing mutates them)."""

    device = "cpu"
    draft_spec = target_spec = "tiny"

    def __init__(self, tokenizer, vocab: int = 64, seed: int = 0, max_positions: int = 512):
        self.tokenizer, self.vocab, self.seed, self.max_positions = tokenizer, vocab, seed, max_positions

    def model(self, role: str, precision: str):
        from .quant import QUANT_PRECISIONS, quantize_model

        draft, target = tiny_pair(vocab=self.vocab, seed=self.seed, max_positions=self.max_positions)
        m = draft if role == "draft" else target
        if precision in QUANT_PRECISIONS:
            return quantize_model(m, precision)
        return m.to(getattr(torch, precision))

    timing_model = model  # the tiny models build in milliseconds: no shape twin needed

    def text_tokenizer(self):
        return self.tokenizer

    def pair(self, target_precision: str, draft_precision: str):
        from types import SimpleNamespace

        return SimpleNamespace(draft=self.model("draft", draft_precision), target=self.model("target", target_precision),
                               tokenizer=self.tokenizer, eos_token_ids=(), dtype=torch.float32,
                               draft_precision=draft_precision, target_precision=target_precision,
                               description=f"tiny random pair (draft {draft_precision}, target {target_precision})")


def tiny_ggml_qwen2(kernels, seed: int = 0):
    """A 2-layer Qwen2 (width 256, 4 query and 2 key/value heads, vocabulary 300) whose every linear
    layer is a Q4_K ``GGMLLinear`` on synthetic blocks (float32 activations), unfused; ``kernels``:
    ``quant.native.native_kernels()``."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from .quant import kernel_table as kt
    from .quant.apply import set_submodule
    from .quant.ggml_linear import GGMLLinear

    cfg = Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=300, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    for i, (name, mod) in enumerate(list(model.named_modules())):
        if isinstance(mod, torch.nn.Linear):
            shape = kt.LayerShape("Q4_K", mod.out_features, mod.in_features)
            set_submodule(model, name, GGMLLinear("Q4_K", kt.synthetic_blocks(shape, seed=i), mod.in_features,
                                                  mod.bias, kernels=kernels))
    return model
