"""Layer-streaming offload engine on ``DEVICE`` (CUDA when present, else the host stand-in backend):
bit-exact against the in-memory model for prefill, tree and one-token forwards over a DynamicCache,
with transfer accounting. The stream-protocol tests use an adversarial host backend on the CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import DEVICE

from dyntree_core.decode.forward import causal_forward, masked_forward, new_cache
from dyntree_core.offload import (
    LayerLayout,
    OffloadError,
    accelerate_offload_layers,
    offload_decoder_layers,
    sync_offload_layers,
)
from dyntree_core.offload.layout import ALIGN
from dyntree_core.testing import tiny_pair

LAYERS = 4
PREFIX = [3, 17, 5, 42, 8, 11, 29]
#: tree parents (-1 = root); the root is the last accepted token at position len(PREFIX)
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 5]
TREE_TOKENS = [9, 21, 33, 4, 50, 7, 13, 60]


@pytest.fixture(scope="module")
def reference():
    _, target = tiny_pair(vocab=64, seed=3, layers=LAYERS)
    return target


@pytest.fixture(scope="module")
def want(reference):
    """The in-memory model's outputs for ``run_script`` on ``DEVICE``."""
    return run_script(copy.deepcopy(reference).to(DEVICE))


@pytest.fixture(scope="module")
def want_host(reference):
    """The same on the CPU (for the host-backend protocol tests)."""
    return run_script(reference)


def depths(parents: list[int]) -> list[int]:
    d: list[int] = []
    for p in parents:
        d.append(0 if p < 0 else d[p] + 1)
    return d


def tree_mask(cached: int, parents: list[int]) -> torch.Tensor:
    """``[q, cached + q]`` bool: the prefix plus each node's ancestors (itself included)."""
    q = len(parents)
    m = torch.zeros(q, cached + q, dtype=torch.bool)
    m[:, :cached] = True
    for i in range(q):
        j = i
        while j >= 0:
            m[i, cached + j] = True
            j = parents[j]
    return m


def run_script(model) -> list[torch.Tensor]:
    """Prefill, a tree forward, a crop back to the accepted path, then two one-token forwards."""
    cache = new_cache(model)
    out = [causal_forward(model, cache, PREFIX, 0)]
    cached = len(PREFIX)
    pos = [cached + d for d in depths(PARENTS)]  # = prefix_len - 1 + depth with prefix_len = cached + 1
    out.append(masked_forward(model, cache, TREE_TOKENS, pos, tree_mask(cached, PARENTS)))
    cache.crop(-len(TREE_TOKENS))
    out.append(causal_forward(model, cache, [TREE_TOKENS[0]], cached))
    out.append(causal_forward(model, cache, [TREE_TOKENS[1]], cached + 1))
    out.append(torch.cat([cache.layers[i].keys for i in range(LAYERS)]))
    out.append(torch.cat([cache.layers[i].values for i in range(LAYERS)]))
    return out


def expected_layer_bytes(layer) -> int:
    return sum(-(-p.numel() * p.element_size() // ALIGN) * ALIGN for p in layer.parameters())


@pytest.mark.parametrize("slots", [2, 3])
@pytest.mark.parametrize("resident", [0, 1])
def test_streamed_forwards_bit_exact_and_counted(reference, want, slots, resident):
    model = copy.deepcopy(reference)
    per_layer = [expected_layer_bytes(layer) for layer in model.model.layers]
    h = offload_decoder_layers(model, device=DEVICE, slots=slots, resident_layers=resident)
    assert h.resident == list(range(resident)) and h.streamed == list(range(resident, LAYERS))
    assert h.bytes_per_forward == sum(per_layer[resident:])
    got = run_script(model)
    assert len(got) == len(want)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    s = h.stats()
    assert s.forwards == 4
    assert s.layers == 4 * (LAYERS - resident)
    assert s.bytes == 4 * sum(per_layer[resident:])
    assert s.copy_seconds > 0
    if DEVICE.type == "cpu":  # synchronous host copies: the compute waited for every one of them
        assert s.wait_seconds == pytest.approx(s.copy_seconds)
    h.reset_stats()
    assert h.stats().bytes == 0 and h.stats().forwards == 0
    # between forwards the streamed parameters are views of the one packed host buffer per layer
    for i in h.streamed:
        ptrs = {p.untyped_storage().data_ptr() for p in model.model.layers[i].parameters()}
        assert len(ptrs) == 1
    assert {k: v for k, v in model.state_dict().items()}.keys() == reference.state_dict().keys()
    for k, v in reference.state_dict().items():
        assert torch.equal(v, model.state_dict()[k].to(v.device)), k  # the non-layer parts sit on DEVICE


def test_slots_one_and_close_restores(reference, want):
    model = copy.deepcopy(reference)
    h = offload_decoder_layers(model, device=DEVICE, slots=1, resident_layers=0)
    for a, b in zip(want, run_script(model)):
        assert torch.equal(a, b)
    with pytest.raises(OffloadError, match="already offloaded"):
        offload_decoder_layers(model, device=DEVICE)
    h.close()
    model.to(DEVICE)  # close leaves the streamed layers' weights intact on the host (the rest is on DEVICE)
    for a, b in zip(want, run_script(model)):
        assert torch.equal(a, b)
    assert h.stats().forwards == 4  # no hooks after close


def test_abort_mid_forward_resyncs(reference, want):
    model = copy.deepcopy(reference)
    h = offload_decoder_layers(model, device=DEVICE, slots=2, resident_layers=0)
    boom = {"armed": True}

    def raise_once(module, args):
        if boom["armed"]:
            boom["armed"] = False
            raise RuntimeError("injected")

    hook = model.model.layers[2].register_forward_pre_hook(raise_once)
    with pytest.raises(RuntimeError, match="injected"):
        causal_forward(model, new_cache(model), PREFIX, 0)
    hook.remove()
    for i in h.streamed:  # nothing left pointing into a slot
        assert all(p.data_ptr() == q.data_ptr() for p, q in zip(model.model.layers[i].parameters(), h._host[i].views))
    for a, b in zip(want, run_script(model)):
        assert torch.equal(a, b)


def test_inference_only(reference):
    model = copy.deepcopy(reference)
    offload_decoder_layers(model, device=DEVICE, slots=2, resident_layers=0)
    model.model.embed_tokens.weight.requires_grad_(True)
    with pytest.raises(OffloadError, match="inference-only"):
        model(input_ids=torch.tensor([[1, 2, 3]], device=DEVICE))


def test_bad_arguments(reference):
    model = copy.deepcopy(reference)
    with pytest.raises(OffloadError, match="slots"):
        offload_decoder_layers(model, device=DEVICE, slots=0)
    before = {k: (v.device, v.data_ptr()) for k, v in model.state_dict().items()}
    for bad in (LAYERS + 1, -1, "all", 1.5):
        with pytest.raises(OffloadError, match="resident_layers"):
            offload_decoder_layers(model, device=DEVICE, resident_layers=bad)
    assert {k: (v.device, v.data_ptr()) for k, v in model.state_dict().items()} == before  # nothing moved or packed
    assert getattr(model, "_dyntree_offload", None) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_without_cuda_raises_clearly(reference):
    model = copy.deepcopy(reference)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(OffloadError, match="CUDA is not available"):
        offload_decoder_layers(model, device="cuda")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert getattr(model, "_dyntree_offload", None) is None


@pytest.mark.parametrize("wrap", [sync_offload_layers, accelerate_offload_layers])
def test_baselines_bit_exact(reference, want, wrap):
    model = copy.deepcopy(reference)
    h = wrap(model, device=DEVICE)
    for a, b in zip(want, run_script(model)):
        assert torch.equal(a, b)
    s = h.stats()
    assert s.forwards == 4
    assert s.bytes == 4 * sum(sum(p.nbytes for p in reference.model.layers[i].parameters()) for i in range(LAYERS))
    h.close()


def test_layout_views_roundtrip():
    _, target = tiny_pair(vocab=32, seed=1, layers=1)
    layer = target.model.layers[0]
    lay = LayerLayout.of(layer)
    assert all(s.offset % ALIGN == 0 for s in lay.params)
    buf = torch.zeros(lay.nbytes, dtype=torch.uint8)
    for v, p in zip(lay.views(buf), layer.parameters()):
        v.copy_(p.detach())
    for v, p in zip(lay.views(buf), layer.parameters()):
        assert torch.equal(v, p.detach())
    with pytest.raises(ValueError):
        lay.views(torch.zeros(lay.nbytes - 1, dtype=torch.uint8))


class LazyCopyBackend:
    """Host stand-in whose copies run only when someone waits for them (an adversarial "GPU"):
    a layer that used its slot without waiting on the copy's event would compute with stale
    weights (another layer's) and break bit-exactness."""

    def __new__(cls):
        from dyntree_core.offload.backend import HostBackend, HostEvent

        class _Lazy(HostBackend):
            label = "lazy-copy test backend"

            def __init__(self) -> None:
                super().__init__()
                self.queue: list = []
                self.max_queued = 0
                self.copies = 0
                # protocol check: a slot may be overwritten only after the copy stream waited on a
                # compute-stream event recorded after the slot's previous use began
                self.tick = 0
                self.copy_fence = -1
                self.last_copy_ptr = None
                self.done_ptr: dict = {}
                self.use_start: dict = {}

            def copy_stream(self):
                return "copy"

            def copy(self, dst, src, stream):
                assert stream == "copy"
                ptr = dst.data_ptr()
                if ptr in self.use_start:
                    assert self.copy_fence > self.use_start[ptr], "slot overwritten before compute released it"
                self.last_copy_ptr = ptr
                self.queue.append((dst, src))
                self.copies += 1
                self.max_queued = max(self.max_queued, sum(isinstance(q, tuple) for q in self.queue))

            def record(self, event, stream):
                self.tick += 1
                event.tick = self.tick
                if stream == "copy":
                    event.t = None
                    self.done_ptr[id(event)] = self.last_copy_ptr
                    self.queue.append(event)
                else:
                    HostBackend.record(self, event, stream)

            def _flush(self, until=None):
                while self.queue:
                    q = self.queue.pop(0)
                    if isinstance(q, HostEvent):
                        HostBackend.record(self, q, None)
                        if q is until:
                            return
                    else:
                        q[0].copy_(q[1])

            def wait(self, stream, event):
                if event is None:
                    return
                if stream == "copy":
                    self.copy_fence = max(self.copy_fence, event.tick)
                    return
                self.tick += 1
                self.use_start[self.done_ptr[id(event)]] = self.tick
                if event.t is None:
                    self._flush(event)

            def elapsed(self, start, end):
                if end.t is None:
                    self._flush(end)
                return HostBackend.elapsed(self, start, end)

            def synchronize(self):
                self._flush()

        return _Lazy()


@pytest.mark.parametrize("slots", [2, 3])
def test_handshake_with_deferred_copies(reference, want_host, slots, monkeypatch):
    import dyntree_core.offload.model as om

    backend = LazyCopyBackend()
    monkeypatch.setattr(om, "make_backend", lambda device, register_host=True: backend)
    model = copy.deepcopy(reference)
    h = offload_decoder_layers(model, device="cpu", slots=slots, resident_layers=0)
    for a, b in zip(want_host, run_script(model)):
        assert torch.equal(a, b)
    assert backend.max_queued == slots  # copies for the next slots-1 layers were in flight (prefetch)
    assert h.stats().bytes == 4 * h.bytes_per_forward


def test_drop_prefetch_recopies(reference, monkeypatch):
    import dyntree_core.offload.model as om

    backend = LazyCopyBackend()
    monkeypatch.setattr(om, "make_backend", lambda device, register_host=True: backend)
    model = copy.deepcopy(reference)
    offload_decoder_layers(model, device="cpu", slots=3, resident_layers=1)  # 3 streamed layers
    streamed, ahead = LAYERS - 1, 3 - 1

    def copies_in_forward() -> int:
        before = backend.copies
        causal_forward(model, new_cache(model), PREFIX, 0)
        return backend.copies - before

    assert copies_in_forward() == streamed + ahead  # the last layer prefetches the next forward's first two
    assert copies_in_forward() == streamed  # steady state: two were already in flight
    model._dyntree_offload.drop_prefetch()
    assert copies_in_forward() == streamed + ahead  # cold again: everything re-copied


def test_align_cpu_parameters_rehomes_misaligned_storage():
    from torch import nn

    from dyntree_core.testing import CPU_PARAM_ALIGN, align_cpu_parameters

    lin = nn.Linear(8, 4)
    raw = torch.zeros(4 * 8 + 1)
    lin.weight.data = raw[1:].view(4, 8)  # 4 bytes past an aligned start, like a mapped file
    lin.weight.data.copy_(torch.arange(32.0).view(4, 8))
    assert lin.weight.data_ptr() % CPU_PARAM_ALIGN
    assert align_cpu_parameters(lin) == 1
    assert lin.weight.data_ptr() % CPU_PARAM_ALIGN == 0
    assert torch.equal(lin.weight, torch.arange(32.0).view(4, 8))
    assert align_cpu_parameters(lin) == 0
