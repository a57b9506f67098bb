"""Size buckets for graph-captured forwards: the padding gives the unpadded eager forward's logits
(to float32 rounding, same argmax) and KV; on the CPU capture is off and says why, once."""

import logging

import pytest
import torch

from dyntree_core import DecodeConfig, SpeculativeDecoder
from dyntree_core.decode import graphs
from dyntree_core.decode.forward import causal_forward, masked_forward, new_cache
from dyntree_core.decode.graphs import PaddedForward, bucket, capture_support, pad_tree
from dyntree_core.testing import tiny_pair
from dyntree_core.tree import tree_from_parents


def test_buckets_are_powers_of_two_up_to_1024():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 63, 64, 65, 1000, 1024)] == [1, 2, 4, 4, 8, 64, 64, 128, 1024, 1024]
    assert bucket(1500) == 1500
    with pytest.raises(ValueError):
        bucket(0)


def test_capture_is_off_on_cpu_and_the_reason_is_logged_once(caplog, monkeypatch):
    monkeypatch.setattr(graphs, "_reported", set())
    support = capture_support(torch.device("cpu"))
    assert not support.enabled and "CUDA" in support.reason
    draft, target = tiny_pair(seed=1)
    with caplog.at_level(logging.WARNING, logger="dyntree_core.decode.graphs"):
        for _ in range(3):
            dec = SpeculativeDecoder(draft, target, DecodeConfig(method="chain", depth=2))
            dec.generate_ids([3, 4], 3)
    assert not dec.capture.enabled
    assert [r.getMessage() for r in caplog.records].count(support.reason) == 1


@pytest.mark.parametrize("seed", range(6))
def test_padded_tree_forward_equals_the_unpadded_forward(seed):
    gen = torch.Generator().manual_seed(seed)
    _, target = tiny_pair(seed=seed)
    n = int(torch.randint(1, 20, (1,), generator=gen))
    parents = [-1] + [int(torch.randint(i, (1,), generator=gen)) for i in range(1, n)]
    tree = tree_from_parents(parents, torch.randint(0, 64, (n,), generator=gen).tolist())
    prompt = torch.randint(2, 64, (6,), generator=gen).tolist()
    perm = tree.order("dfs")
    outs, caches = [], []
    for padded in (False, True):
        cache = new_cache(target)
        causal_forward(target, cache, prompt[:-1], 0)
        p = len(prompt) - 1
        visible = torch.ones(n, p + n, dtype=torch.bool)
        visible[:, p:] = tree.ancestor_mask(perm)
        tok, pos = tree.tokens[perm], tree.positions(len(prompt))[perm]
        if padded:
            pt = pad_tree(tok, pos, visible, p)
            assert pt.tokens.shape[0] == bucket(n) and pt.visible.shape == (bucket(n), p + bucket(n))
            outs.append(PaddedForward()(target, cache, tok, pos, visible))
        else:
            outs.append(masked_forward(target, cache, tok, pos, visible))
        caches.append(cache)
    # equal up to float32 rounding (the linear layers' matmuls run on other row counts)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)
    assert torch.equal(outs[1].argmax(-1), outs[0].argmax(-1))
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert a.keys.shape == b.keys.shape
        torch.testing.assert_close(b.keys, a.keys, rtol=1e-4, atol=1e-5)
