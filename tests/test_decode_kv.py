"""The preallocated decode KV cache: in-place compaction equals the concatenating compaction the
engine used before (``DynamicCache`` + ``torch.cat``) on random trees, the buffers are never
reallocated during a sized run, and greedy decoding through it equals transformers' own cache."""

import random

import pytest
import torch

from dyntree_core import DecodeConfig, SpeculativeDecoder
from dyntree_core.decode import kv
from dyntree_core.decode.kv import KVCache, cache_length, new_cache
from dyntree_core.testing import tiny_config, tiny_pair
from dyntree_core.tree import ORDERS, tree_from_parents


def cat_compact(keys: torch.Tensor, keep: int, extra: list[int]) -> torch.Tensor:
    """The previous engine's compaction of one ``[B, H, L, D]`` tensor (the reference)."""
    idx = torch.tensor(extra, dtype=torch.long)
    return torch.cat([keys[:, :, :keep], keys.index_select(2, idx)], dim=2)


@pytest.mark.parametrize("seed", range(40))
def test_in_place_compaction_equals_concatenation_on_random_trees(seed):
    rng = random.Random(seed)
    layers, heads, dim = 3, 2, 8
    cache = KVCache(tiny_config(layers=layers), capacity=rng.choice([8, 64]))  # small ones grow
    prefix = rng.randrange(1, 20)
    n = rng.randrange(1, 40)
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    ref = []
    for li in range(layers):
        k = torch.randn(1, heads, prefix + n, dim)
        v = torch.randn(1, heads, prefix + n, dim)
        cache.update(k[:, :, :prefix], v[:, :, :prefix], li)
        cache.update(k[:, :, prefix:], v[:, :, prefix:], li)
        ref.append((k, v))
    tree = tree_from_parents(parents)
    perm = tree.order(rng.choice(ORDERS))  # the forward's slot order
    slot = torch.empty(n, dtype=torch.long)
    slot[perm] = torch.arange(n)
    path = tree.path_to(rng.randrange(n))  # the accepted path, root first
    extra = [prefix + int(slot[i]) for i in path]
    cache.compact(prefix, extra)
    assert cache_length(cache) == prefix + len(extra)
    for li, (k, v) in enumerate(ref):
        torch.testing.assert_close(cache.layers[li].keys, cat_compact(k, prefix, extra), rtol=0, atol=0)
        torch.testing.assert_close(cache.layers[li].values, cat_compact(v, prefix, extra), rtol=0, atol=0)


def test_compaction_refuses_unordered_slots():
    cache = KVCache(tiny_config(layers=1), capacity=16)
    cache.update(torch.zeros(1, 2, 6, 4), torch.zeros(1, 2, 6, 4), 0)
    with pytest.raises(ValueError, match="increasing"):
        cache.compact(2, [4, 3])
    with pytest.raises(ValueError, match="increasing"):
        cache.compact(3, [2, 5])


def test_contiguous_path_only_sets_the_length_and_growth_keeps_contents():
    cache = KVCache(tiny_config(layers=1), capacity=4)
    k = torch.arange(2 * 10 * 3, dtype=torch.float32).view(1, 2, 10, 3)
    cache.update(k[:, :, :3], k[:, :, :3], 0)
    cache.update(k[:, :, 3:], k[:, :, 3:], 0)  # past the capacity: grows
    assert cache.reallocations == 1 and cache.capacity >= 10
    torch.testing.assert_close(cache.layers[0].keys, k, rtol=0, atol=0)
    ptr = cache.layers[0].buffers()[0].data_ptr()
    cache.compact(5, [5, 6])
    assert cache_length(cache) == 7 and cache.layers[0].buffers()[0].data_ptr() == ptr
    torch.testing.assert_close(cache.layers[0].keys, k[:, :, :7], rtol=0, atol=0)


@pytest.mark.parametrize("method", ["dyspec_greedy", "chain", "autoregressive"])
def test_a_sized_run_never_reallocates_its_buffers(monkeypatch, method):
    made: list[KVCache] = []
    real = kv.new_cache

    def spy(model, capacity=kv.DEFAULT_CAPACITY):
        c = real(model, capacity)
        made.append(c)
        return c

    monkeypatch.setattr("dyntree_core.decode.engine.new_cache", spy)
    draft, target = tiny_pair(seed=1)
    cfg = DecodeConfig(method=method, budget=24, depth=5)
    traces = list(SpeculativeDecoder(draft, target, cfg).generate([3, 4, 5, 6], 20))
    assert sum(len(t.committed) for t in traces) == 20
    assert made and all(c.reallocations == 0 for c in made)
    assert len(made) == (1 if method == "autoregressive" else 2)


@pytest.mark.parametrize("seed", range(3))
def test_greedy_through_the_cache_equals_transformers_generate(seed):
    draft, target = tiny_pair(seed=seed)
    prompt = [5, 9, 2, 7, 3]
    ref = target.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt):].tolist()
    cache = new_cache(target, capacity=8)  # grows twice on the way
    from dyntree_core.decode.forward import causal_forward

    causal_forward(target, cache, prompt[:-1], 0)
    out, last = [], prompt[-1]
    for pos in range(len(prompt) - 1, len(prompt) - 1 + 20):
        last = int(causal_forward(target, cache, [last], pos)[0].argmax())
        out.append(last)
    assert out == ref and cache.reallocations > 0


def test_assigned_keys_and_values_are_adopted_as_the_cache_contents():
    """Code written for transformers' DynamicLayer (the machine profile's zero prefix) assigns
    ``layer.keys``/``layer.values``; the cache then holds exactly them and grows past them."""
    cache = KVCache(tiny_config(layers=1), capacity=4)
    cache.update(torch.ones(1, 2, 1, 3), torch.ones(1, 2, 1, 3), 0)
    layer = cache.layers[0]
    layer.keys = torch.zeros(1, 2, 9, 3)
    layer.values = torch.zeros(1, 2, 9, 3)
    assert cache_length(cache) == 9
    k, v = cache.update(torch.ones(1, 2, 2, 3), torch.full((1, 2, 2, 3), 2.0), 0)
    assert k.shape[2] == 11 and float(k[:, :, :9].abs().sum()) == 0 and float(v[:, :, 9:].min()) == 2.0
    cache.compact(9, [])
    assert cache_length(cache) == 9
