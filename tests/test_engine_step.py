"""The tree step's structure: phases timed by one context manager, mask block counts only when
the trace asks for them, and no dense ``[n, cache + n]`` mask when the kernel reads metadata."""

import os

import pytest
import torch
from conftest import DEVICE

from dyntree_core import DecodeConfig, SpeculativeDecoder
from dyntree_core.attention.hf_backend import BACKEND_KWARG, META_KWARG
from dyntree_core.attention.mask import is_placeholder, meta_from_tree, placeholder_mask
from dyntree_core.attention.triton_kernel import HAS_TRITON
from dyntree_core.decode.forward import causal_forward, masked_forward, new_cache
from dyntree_core.decode.prepared import PreparedPair
from dyntree_core.decode.timer import StepTimer
from dyntree_core.testing import tiny_pair
from dyntree_core.tree import BLOCK_SIZES, count_nonzero_blocks, tree_from_parents

needs_kernel = pytest.mark.skipif(
    not HAS_TRITON or (not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs Triton with CUDA or the Triton interpreter (tests/conftest.py sets it on CPU)")


def test_timer_phases_add_up_and_split():
    timer = StepTimer(torch.device("cpu"))
    with timer.phase("draft"):
        sum(range(20000))
    with timer.phase("draft"):
        sum(range(20000))
    timer.split("draft", "tree_build", 0.0)
    timer.add("offload_transfer", 0.25)
    t = timer.timings()
    assert t.draft == 0.0 and t.tree_build > 0 and t.offload_transfer == 0.25
    with pytest.raises(ValueError, match="unknown phase"):
        with timer.phase("drafting"):
            pass


@pytest.mark.parametrize("counts", [False, True])
def test_mask_block_counts_only_when_the_trace_asks(monkeypatch, counts):
    """Before: ``order_blocks`` was counted on every step whatever ``trace_block_counts`` said."""
    import dyntree_core.decode.engine as engine

    calls = []
    real = engine.count_nonzero_blocks
    monkeypatch.setattr(engine, "count_nonzero_blocks", lambda m, b: calls.append(b) or real(m, b))
    draft, target = tiny_pair(seed=4)
    cfg = DecodeConfig(method="dyspec_greedy", budget=12, depth=3, trace_block_counts=counts, node_order="hpd")
    traces = list(SpeculativeDecoder(draft, target, cfg).generate([3, 4, 5], 12))
    if not counts:
        assert not calls and all(not t.order_blocks and not t.block_counts for t in traces)
        return
    for t in traces:
        mask = t.tree.ancestor_mask(t.tree.order("hpd"))
        assert t.order_blocks == {b: count_nonzero_blocks(mask, b) for b in BLOCK_SIZES}
        assert t.block_counts["hpd"] == t.order_blocks


def test_placeholder_mask_with_metadata_equals_the_real_mask_when_sdpa_runs():
    """A call the kernel does not take (here: backend torch) rebuilds the mask from the metadata."""
    draft, target = tiny_pair(seed=6)
    PreparedPair.prepare(draft, target, DecodeConfig())  # switches the models to the per-call dispatcher
    prompt = [3, 9, 4, 1, 7]
    tree = tree_from_parents([-1, 0, 0, 1, 1, 2, 4], [7, 11, 12, 13, 14, 15, 16])
    perm = tree.order("dfs")
    outs = []
    for placeholder in (False, True):
        cache = new_cache(target)
        causal_forward(target, cache, prompt[:-1], 0)
        p = len(prompt) - 1
        meta = meta_from_tree(tree, p, perm, 16, 32)
        if placeholder:
            visible = placeholder_mask(tree.size, p + tree.size)
            assert is_placeholder(visible[None, None]) and visible.untyped_storage().nbytes() == 1
        else:
            visible = torch.ones(tree.size, p + tree.size, dtype=torch.bool)
            visible[:, p:] = tree.ancestor_mask(perm)
        outs.append(masked_forward(target, cache, tree.tokens[perm].tolist(),
                                   tree.positions(len(prompt))[perm].tolist(), visible,
                                   attn_kwargs={BACKEND_KWARG: "torch", META_KWARG: meta}))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


@needs_kernel
def test_kernel_tree_forward_gets_metadata_and_no_dense_mask(kernel_calls):
    draft, target = (m.to(DEVICE) for m in tiny_pair(seed=2))
    masks = []

    def spy(module, args, kwargs):
        m = kwargs.get("attention_mask")
        if m is not None and m.shape[2] > 1 and kwargs.get(META_KWARG) is not None:
            masks.append(m)

    hook = target.register_forward_pre_hook(spy, with_kwargs=True)
    try:
        ar = SpeculativeDecoder(draft, target, DecodeConfig(method="autoregressive", attention="torch",
                                                            device=DEVICE.type)).generate_ids([5, 9, 2, 7], 8)
        cfg = DecodeConfig(method="dyspec_greedy", attention="triton", budget=10, depth=3, device=DEVICE.type)
        out = SpeculativeDecoder(draft, target, cfg).generate_ids([5, 9, 2, 7], 8)
    finally:
        hook.remove()
    assert out == ar
    assert masks and all(is_placeholder(m) for m in masks)
    assert kernel_calls


def test_a_triton_request_that_cannot_run_is_refused_up_front(monkeypatch):
    """Before: a pair built on the CPU without the interpreter silently ran SDPA for attention='triton'."""
    from dyntree_core.attention import hf_backend
    from dyntree_core.config import ConfigError

    monkeypatch.setattr(hf_backend, "interpreting", lambda: False)
    draft, target = tiny_pair(seed=2)
    with pytest.raises(ConfigError, match="attention='triton' cannot run here: tensors on cpu"):
        SpeculativeDecoder(draft, target, DecodeConfig(method="chain", attention="triton"))
    SpeculativeDecoder(draft, target, DecodeConfig(method="chain", attention="auto"))  # auto chooses SDPA
