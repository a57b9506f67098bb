"""A Stop during a prefill chunk ends the chunk at the CPU forwards' next layer (``dyntree_core.interrupt``), not
after the whole chunk: the engine runs each chunk inside ``stops_on(stop_event)``; ``lean_forward`` and the C
layer path check before each layer."""

from __future__ import annotations

import threading

import pytest
import torch

from dyntree_core import interrupt
from dyntree_core.decode.kv import new_cache
from dyntree_core.decode.lean_forward import lean_forward


def test_check_raises_only_inside_stops_on_with_its_event_set():
    event = threading.Event()
    interrupt.check()  # outside: nothing
    with interrupt.stops_on(event):
        interrupt.check()  # not set
        event.set()
        with pytest.raises(interrupt.Interrupted):
            interrupt.check()
        with interrupt.stops_on(None):  # a nested block without an event: no stop there
            interrupt.check()
        with pytest.raises(interrupt.Interrupted):
            interrupt.check()
    interrupt.check()  # the block is over: the set event no longer stops anything


def test_the_event_of_another_thread_stops_this_one():
    """The UI sets the event from its thread; the worker's forward sees it at its next check."""
    event, seen = threading.Event(), []

    def worker():
        with interrupt.stops_on(event):
            try:
                while True:
                    interrupt.check()
            except interrupt.Interrupted:
                seen.append(True)

    t = threading.Thread(target=worker)
    t.start()
    event.set()
    t.join(5)
    assert seen == [True] and not t.is_alive()


@pytest.fixture(scope="module")
def ggml_model():
    from dyntree_core.quant.fused import fuse_forward
    from dyntree_core.quant.native import native_kernels, native_unavailable_reason
    from dyntree_core.testing import tiny_ggml_qwen2

    nk = native_kernels()
    if nk is None:
        pytest.skip(f"no native kernels: {native_unavailable_reason()}")
    model = tiny_ggml_qwen2(nk)
    fuse_forward(model)
    return model


@pytest.mark.parametrize("path", ["native", "lean"])
def test_a_cpu_forward_stops_at_the_layer_after_the_event(ggml_model, monkeypatch, path):
    """The event set at layer 0's check: the forward raises at layer 1's (2 checks of 2 layers); unset, it runs
    every layer and returns the logits."""
    from dyntree_core.quant import native_layer

    if path == "lean":
        monkeypatch.setattr(native_layer, "native_plan", lambda model: None)
    elif native_layer.native_plan(ggml_model) is None:
        pytest.skip(f"no C layer plan: {native_layer.native_reason(ggml_model)}")
    event, checks = threading.Event(), []
    real = interrupt.check

    def counting():  # layer 0's check passes, then sets the event
        checks.append(event.is_set())
        real()
        event.set()

    monkeypatch.setattr(interrupt, "check", counting)
    ids = torch.tensor([[1, 5, 9, 200]])
    with interrupt.stops_on(event), pytest.raises(interrupt.Interrupted):
        lean_forward(ggml_model, ids, torch.arange(4)[None], None, new_cache(ggml_model, 16))
    assert checks == [False, True]
    monkeypatch.setattr(interrupt, "check", real)
    event.clear()
    with interrupt.stops_on(event):
        logits = lean_forward(ggml_model, ids, torch.arange(4)[None], None, new_cache(ggml_model, 16))
    assert logits.shape[0] == 4


def test_outside_a_prefill_the_c_layers_run_in_one_call_with_the_same_logits(ggml_model, monkeypatch):
    """A decode step's or a tree's forward (no ``stops_on``) runs every C layer in one call, with no check between
    them; the same forward inside ``stops_on`` calls each layer after a check; the logits are the same, bit for
    bit, and every layer's cache holds the new rows."""
    from dyntree_core.quant import native_layer

    if native_layer.native_plan(ggml_model) is None:
        pytest.skip(f"no C layer plan: {native_layer.native_reason(ggml_model)}")
    checks = []
    real = interrupt.check
    monkeypatch.setattr(interrupt, "check", lambda: checks.append(1) or real())
    ids = torch.tensor([[1, 5, 9, 200]])
    one_cache = new_cache(ggml_model, 16)
    one = lean_forward(ggml_model, ids, torch.arange(4)[None], None, one_cache)
    assert checks == [] and [layer.length for layer in one_cache.layers] == [4] * len(one_cache.layers)
    with interrupt.stops_on(threading.Event()):
        per_layer = lean_forward(ggml_model, ids, torch.arange(4)[None], None, new_cache(ggml_model, 16))
    assert len(checks) == len(ggml_model.model.layers) and torch.equal(one, per_layer)


def test_the_prefill_ends_within_a_chunk_and_counts_only_finished_chunks():
    """``_prefill`` with a feed of 4 layers that checks before each: the stop set in the second chunk's second
    layer ends the prefill there (its last two layers never run) with ``stopped`` progress at the first chunk's
    tokens; the next chunk never starts."""
    from dyntree_core import DecodeConfig, SpeculativeDecoder
    from dyntree_core.testing import tiny_pair

    draft, target = tiny_pair(seed=1)
    dec = SpeculativeDecoder(draft, target, DecodeConfig(method="autoregressive"))
    stop, layers = threading.Event(), []

    def feed(chunk, start):
        for layer in range(4):
            if start > 0 and layer == 1:
                stop.set()
            interrupt.check()
            layers.append((start, layer))

    progress = list(dec._prefill([feed], list(range(2, 80)), stop))
    first = progress[1].done
    assert progress[0].done == 0 and first > 0 and not progress[1].stopped
    assert progress[-1].stopped and progress[-1].done == first and len(progress) == 3
    assert layers == [(0, 0), (0, 1), (0, 2), (0, 3), (first, 0)]
