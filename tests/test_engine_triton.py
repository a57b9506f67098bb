"""The engine's tree forward in each node order, through the Triton tree-attention kernel on
``DEVICE`` (CUDA: the compiled kernel; CPU: the Triton interpreter): greedy output equals plain
autoregressive decoding, the kernel really runs with metadata built from the tree, and decoders
sharing one prepared pair never change it."""

import pytest
import torch
from conftest import DEVICE

from dyntree_core import ConfigError, DecodeConfig, SpeculativeDecoder
from dyntree_core.attention import hf_backend
from dyntree_core.attention.mask import build_block_lists, meta_from_mask, meta_from_tree
from dyntree_core.attention import trees
from dyntree_core.attention.triton_kernel import HAS_TRITON
from dyntree_core.decode.prepared import PreparedPair
from dyntree_core.testing import tiny_pair

needs_kernel = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")

PROMPT = [5, 9, 2, 7, 1, 3]
DEV = str(DEVICE)


@needs_kernel
@pytest.mark.parametrize("seed", range(10))
def test_greedy_in_every_node_order_through_the_kernel_equals_autoregressive(seed, kernel_calls):
    draft, target = tiny_pair(seed=seed)
    ar = SpeculativeDecoder(draft, target, DecodeConfig(method="autoregressive", attention="torch", device=DEV)
                            ).generate_ids(PROMPT, 10)
    assert not kernel_calls
    for order in ("dfs", "hpd", "bfs"):
        cfg = DecodeConfig(method="dyspec_greedy", attention="triton", node_order=order, budget=20, depth=4,
                           seed=seed, device=DEV)
        before = len(kernel_calls)
        traces = list(SpeculativeDecoder(draft, target, cfg).generate(PROMPT, 10))
        assert [c.token_id for t in traces for c in t.committed] == ar, order
        tree_metas = [m for m in kernel_calls[before:] if m.dead_rows is None]  # built from the tree
        assert tree_metas, "the kernel never received metadata built from the tree"
        assert all((m.end is not None) == (order != "bfs") for m in tree_metas)  # interval form in pre-orders
        for t in traces:
            assert t.node_order == order and t.kernel_blocks is not None
            assert sorted(t.node_slots) == list(range(t.tree.size))
            assert t.node_slots == t.tree.order(order).tolist()


@needs_kernel
@pytest.mark.parametrize("family", ["dyspec", "uniform", "skewed", "chain", "star"])
@pytest.mark.parametrize("order", ["dfs", "hpd", "bfs"])
def test_metadata_from_the_tree_equals_metadata_from_its_mask(family, order):
    tree = {"dyspec": lambda: trees.dyspec_like_tree(37, seed=3), "uniform": lambda: trees.uniform_random_tree(37, 3),
            "skewed": lambda: trees.skewed(37), "chain": lambda: trees.chain(37), "star": lambda: trees.star(37)}[family]()
    perm = tree.order(order)
    prefix = 11
    full = torch.ones(tree.size, prefix + tree.size, dtype=torch.bool)
    full[:, prefix:] = tree.ancestor_mask(perm)
    for bq, bn in ((16, 16), (32, 16), (8, 32)):
        a = meta_from_tree(tree, prefix, perm, bq, bn)
        b = meta_from_mask(full, bq, bn)
        # the root column is visible to every row, so the mask-derived form counts it as prefix
        assert b.prefix_len == prefix + 1 and a.prefix_len == prefix
        assert not b.dead_rows.any()
        ref = build_block_lists(full[:, prefix:], bq, bn)
        for name in ("full_cnt", "full_idx", "part_cnt", "part_idx"):
            assert torch.equal(getattr(a.blocks, name), getattr(ref, name)), name
        tree_part = full[:, prefix:]
        if a.end is not None:
            cols = torch.arange(tree.size)
            rebuilt = (cols[None, :] <= cols[:, None]) & (cols[:, None] < a.end.long()[None, :])
            assert torch.equal(rebuilt, tree_part)
        else:
            assert torch.equal(a.mask, tree_part)
        assert torch.equal(b.mask, tree_part[:, 1:])


@needs_kernel
def test_torch_decoder_after_a_triton_decoder_runs_sdpa(kernel_calls):
    draft, target = tiny_pair(seed=4)
    impl = target.config._attn_implementation
    tri = SpeculativeDecoder(draft, target, DecodeConfig(method="sequoia", attention="triton", budget=16, depth=3,
                                                         device=DEV))
    out_tri = tri.generate_ids(PROMPT, 6)
    assert kernel_calls
    impl_after = target.config._attn_implementation
    n = len(kernel_calls)
    torch_dec = SpeculativeDecoder(draft, target, DecodeConfig(method="sequoia", attention="torch", budget=16, depth=3,
                                                               device=DEV))
    assert torch_dec.pair is tri.pair  # one preparation, borrowed twice
    assert torch_dec.generate_ids(PROMPT, 6) == out_tri
    assert len(kernel_calls) == n, "a torch-attention decoder ran the Triton kernel"
    assert target.config._attn_implementation == impl_after  # decoders do not switch it
    assert impl_after == hf_backend.DISPATCH_IMPL and impl != impl_after
    tri.pair.restore_attention()
    assert target.config._attn_implementation == impl


def test_decoders_borrow_one_preparation_and_refuse_a_stale_one():
    draft, target = tiny_pair(seed=1)
    cfg = DecodeConfig(method="chain", depth=3, device=DEV)
    a = SpeculativeDecoder(draft, target, cfg)
    b = SpeculativeDecoder(draft, target, DecodeConfig(method="dyspec_greedy", budget=8, device=DEV))
    assert a.pair is b.pair
    params = {k: v.data_ptr() for k, v in target.named_parameters()}
    out = a.generate_ids(PROMPT, 5)
    assert {k: v.data_ptr() for k, v in target.named_parameters()} == params  # decoding moved nothing
    c = SpeculativeDecoder(draft, target, DecodeConfig(method="chain", depth=3, dtype="bfloat16", device=DEV))
    assert c.pair is not a.pair and a.pair.stale and next(target.parameters()).dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="prepared again"):
        a.generate_ids(PROMPT, 5)
    with pytest.raises(ConfigError, match="dtype"):
        SpeculativeDecoder.on_pair(c.pair, cfg)
    pair = PreparedPair.for_models(draft, target, cfg)
    assert pair is not c.pair and c.pair.stale
    assert SpeculativeDecoder.on_pair(pair, cfg).generate_ids(PROMPT, 5) == out


def test_node_order_is_validated():
    with pytest.raises(ConfigError, match="node_order"):
        DecodeConfig(node_order="random")
    with pytest.raises(ConfigError, match="attention"):
        DecodeConfig(attention="flash")


def test_two_offloaded_decoders_share_one_prepared_pair():
    """Two offload-configured decoders borrow one preparation (the second does not wrap the target
    again, which raises) and decode like the plain target; on the CPU through the layer streamer's
    host stand-in, which only a caller that asks for it gets."""
    draft, target = tiny_pair(seed=2)
    plain = SpeculativeDecoder(*tiny_pair(seed=2), DecodeConfig(method="autoregressive", device=DEV)
                               ).generate_ids(PROMPT, 8)
    cfg = DecodeConfig(method="chain", depth=3, offload_target=True, device=DEV)
    if DEVICE.type == "cpu":
        with pytest.raises(ConfigError, match="CUDA"):
            PreparedPair.prepare(draft, target, cfg)
    pair = PreparedPair.prepare(draft, target, cfg, allow_cpu_offload=DEVICE.type == "cpu")
    assert pair.offload is not None
    first = SpeculativeDecoder(draft, target, cfg)
    second = SpeculativeDecoder(draft, target, DecodeConfig(method="dyspec_greedy", budget=12, offload_target=True,
                                                           device=DEV))
    assert first.pair is pair and second.pair is pair
    assert first.generate_ids(PROMPT, 8) == plain
    assert second.generate_ids(PROMPT, 8) == plain
    with pytest.raises(ConfigError, match="offload_target=True"):
        SpeculativeDecoder(draft, target, DecodeConfig(method="chain", device=DEV))
    pair.close()
