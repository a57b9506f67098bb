"""HF glue: the registered tree-attention implementation on a tiny random Llama (fp32, on ``DEVICE``)."""

import pytest
import torch
from conftest import DEVICE

from dyntree_core.attention import hf_backend
from dyntree_core.attention.hf_backend import IMPL_NAMES, use_tree_attention
from dyntree_core.attention.mask import meta_from_mask, tree_mask
from dyntree_core.attention.trees import dyspec_like_tree
from dyntree_core.attention.triton_kernel import HAS_TRITON

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="Triton not installed")

PROMPT = 19  # cached prefix
CAUSAL = 3  # ordinary causal tokens before the tree nodes in the same forward


@pytest.fixture(scope="module")
def model():
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval().to(DEVICE)


@pytest.fixture(scope="module")
def step():
    """A verify step: prompt ids, then (causal tokens + DFS-ordered tree) ids, positions and 4D mask."""
    gen = torch.Generator().manual_seed(1)
    tree = dyspec_like_tree(29, seed=2)
    order = tree.order("dfs")
    prompt = torch.randint(0, 64, (1, PROMPT), generator=gen)
    causal = torch.randint(0, 64, (CAUSAL,), generator=gen)
    tree_tok = torch.randint(0, 64, (tree.size,), generator=gen)  # token of slot i
    q = CAUSAL + tree.size
    ids = torch.cat([causal, tree_tok])[None]
    pos = torch.cat([torch.arange(PROMPT, PROMPT + CAUSAL), PROMPT + CAUSAL + tree.depth[order]])[None]
    mask = torch.zeros(q, PROMPT + q, dtype=torch.bool)
    mask[:, :PROMPT] = True
    mask[:, PROMPT : PROMPT + CAUSAL] = torch.ones(q, CAUSAL, dtype=torch.bool).tril()
    mask[CAUSAL:, PROMPT + CAUSAL :] = tree_mask(tree, order)
    return dict(tree=tree, order=order, prompt=prompt.to(DEVICE), ids=ids.to(DEVICE), pos=pos.to(DEVICE),
                mask=mask[None, None].to(DEVICE), causal=causal.to(DEVICE), tree_tok=tree_tok.to(DEVICE))


def _forward(model, step, backend, **extra):
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=step["prompt"], past_key_values=cache, use_cache=True)
        with use_tree_attention(model, backend):
            out = model(input_ids=step["ids"], position_ids=step["pos"], attention_mask=step["mask"],
                        past_key_values=cache, use_cache=True, **extra)
    return out.logits[0]


def test_triton_glue_matches_sdpa(model, step, kernel_calls):
    ref = _forward(model, step, "torch")
    assert kernel_calls == []
    got = _forward(model, step, "triton")
    assert len(kernel_calls) == model.config.num_hidden_layers  # the kernel really ran in every layer
    assert kernel_calls[0] is kernel_calls[1]  # metadata derived once per forward
    assert (got - ref).abs().max().item() <= 1e-4
    assert model.config._attn_implementation == "sdpa"  # restored


def test_tree_logits_match_independent_root_paths(model, step):
    """Every tree node's logits equal a plain causal forward over prompt + causal + its root path."""
    got = _forward(model, step, "triton")
    tree, order = step["tree"], step["order"]
    slot = torch.empty_like(order)
    slot[order] = torch.arange(tree.size)
    for node in (0, int(order[-1]), int(order[tree.size // 2]), tree.size - 1):
        path = torch.tensor([int(slot[n]) for n in tree.path_to(node)], device=DEVICE)
        seq = torch.cat([step["prompt"][0], step["causal"], step["tree_tok"][path]])[None]
        with torch.no_grad():
            ref = model(input_ids=seq).logits[0, -1]
        assert (got[CAUSAL + int(slot[node])] - ref).abs().max().item() <= 1e-4


def test_metadata_kwarg_reaches_attention(model, step, kernel_calls):
    G = model.config.num_attention_heads // model.config.num_key_value_heads
    meta = meta_from_mask(step["mask"][0, 0], 64 // G, 16)
    got = _forward(model, step, "triton", tree_attention_meta=meta)
    assert len(kernel_calls) == 2 and all(m is meta for m in kernel_calls)
    ref = _forward(model, step, "torch")
    assert (got - ref).abs().max().item() <= 1e-4


def test_auto_without_a_measured_table_follows_the_rule(model, step, kernel_calls, auto_table_store):
    """No table for this device: the kernel on CUDA, SDPA (bit-identical to 'torch') elsewhere."""
    got = _forward(model, step, "auto")
    if DEVICE.type == "cuda":
        assert len(kernel_calls) == model.config.num_hidden_layers
        assert (got - _forward(model, step, "torch")).abs().max().item() <= 1e-4
    else:
        assert kernel_calls == []
        assert torch.equal(got, _forward(model, step, "torch"))


def test_auto_follows_the_devices_measured_table(model, step, kernel_calls, auto_table_store):
    """A table saying the kernel wins from 16 tree tokens on and loses below: the 32-token verify
    forward runs the kernel, a 4-token one SDPA — whatever the device."""
    from dyntree_core.attention import auto_table
    from dyntree_core.attention.auto_table import AutoCell, AutoTable

    cells = (AutoCell(4, PROMPT, {"dfs": 2.0, "bfs": 2.0}, 1.0), AutoCell(32, PROMPT, {"dfs": 1.0, "bfs": 1.0}, 2.0))
    auto_table.save_table(AutoTable(auto_table.device_key(DEVICE), cells, {}, "float32", {}))
    ref = _forward(model, step, "torch")
    got = _forward(model, step, "auto")
    assert len(kernel_calls) == model.config.num_hidden_layers
    assert (got - ref).abs().max().item() <= 1e-4
    n = len(kernel_calls)
    small = dict(step, ids=step["ids"][:, :4], pos=step["pos"][:, :4], mask=step["mask"][:, :, :4, : PROMPT + 4])
    assert torch.equal(_forward(model, small, "auto"), _forward(model, small, "torch"))
    assert len(kernel_calls) == n
    assert hf_backend.kernel_runs("auto", DEVICE)


def test_prefill_without_4d_mask_falls_back(model, step, kernel_calls):
    """A plain prefill (no mask) under the triton implementation goes through SDPA unchanged."""
    with torch.no_grad():
        ref = model(input_ids=step["prompt"]).logits
        with use_tree_attention(model, "triton"):
            got = model(input_ids=step["prompt"]).logits
    assert kernel_calls == []
    assert torch.equal(got, ref)


def test_use_tree_attention_is_reversible_and_validates(model):
    before = model.config._attn_implementation
    handle = use_tree_attention(model, "auto")
    assert model.config._attn_implementation == IMPL_NAMES["auto"]
    handle.restore()
    assert model.config._attn_implementation == before
    with pytest.raises(ValueError):
        use_tree_attention(model, "cuda")


def test_an_explicit_triton_request_the_kernel_cannot_take_raises_with_its_reason():
    """``attention='triton'`` never turns into SDPA silently: a call the kernel cannot take (here a
    float64 query) raises naming why; ``auto`` takes SDPA for the same call; a call without a tree
    mask (ordinary causal attention) is SDPA for every backend."""
    forward = hf_backend._make_forward("triton")
    q = torch.randn(1, 4, 3, 16, dtype=torch.float64, device=DEVICE)
    k = v = torch.randn(1, 2, 3, 16, dtype=torch.float64, device=DEVICE)
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool, device=DEVICE).tril()
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups, module.training = False, 2, False
    with pytest.raises(hf_backend.KernelRefused, match="dtype torch.float64"):
        forward(module, q, k, v, mask)
    auto_out, _ = hf_backend._make_forward("auto")(module, q, k, v, mask)
    none_out, _ = forward(module, q, k, v, None)
    assert auto_out.shape == none_out.shape == (1, 3, 4, 16)


def test_the_kernels_device_reason_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(hf_backend, "interpreting", lambda: False)
    assert "needs CUDA, or TRITON_INTERPRET=1" in hf_backend.device_reason("cpu")
    assert not hf_backend.kernel_runs("triton", torch.device("cpu"))
    if HAS_TRITON:
        assert hf_backend.device_reason("cuda") is None
