"""The real CUDA path (pinned buffers, copy stream, events). Skipped without a GPU (CI has none)."""

from __future__ import annotations

import copy

import pytest
import torch

from dyntree_core.decode.forward import causal_forward, masked_forward, new_cache
from dyntree_core.offload import offload_decoder_layers, sync_offload_layers
from dyntree_core.testing import tiny_pair
from dyntree_core.tree import ancestor_matrix

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

LAYERS = 6


def script(model) -> list[torch.Tensor]:
    cache = new_cache(model)
    out = [causal_forward(model, cache, [3, 17, 5, 42, 8], 0)]
    vis = torch.zeros(5, 10, dtype=torch.bool)
    vis[:, :5] = True
    vis[:, 5:] = ancestor_matrix(torch.tensor([-1, 0, 0, 1, 2]), 3)
    out.append(masked_forward(model, cache, [9, 21, 33, 4, 50], [5, 6, 6, 7, 7], vis))
    cache.crop(-5)
    out.append(causal_forward(model, cache, [9], 5))
    return [t.float().cpu() for t in out]


@pytest.fixture(scope="module")
def reference():
    _, target = tiny_pair(vocab=64, seed=5, layers=LAYERS, hidden=256)
    return target


@pytest.mark.parametrize("slots", [2, 3])
@pytest.mark.parametrize("resident", [0, 2])
def test_cuda_streamed_equals_resident(reference, slots, resident):
    want = script(copy.deepcopy(reference).to("cuda"))
    model = copy.deepcopy(reference)
    h = offload_decoder_layers(model, device="cuda", slots=slots, resident_layers=resident)
    assert h.host_pinning in ("registered", "pinned_alloc")
    for i in h.streamed:
        assert all(p.device.type == "cpu" and p.is_pinned() for p in model.model.layers[i].parameters())
    got = script(model)
    for a, b in zip(want, got):
        assert torch.equal(a, b), (a - b).abs().max()
    s = h.stats()
    assert s.forwards == 3 and s.layers == 3 * (LAYERS - resident)
    assert s.bytes == 3 * h.bytes_per_forward
    assert s.copy_seconds > 0 and 0 <= s.wait_seconds
    h.close()
    for i in h.streamed:  # the packed buffers were unregistered: ordinary pageable CPU memory now
        for p in model.model.layers[i].parameters():
            assert p.device.type == "cpu" and not p.is_pinned()
    for a, b in zip(want, script(model.to("cuda"))):  # and the model still computes the same
        assert torch.equal(a, b)


def test_cuda_auto_resident_and_sync_baseline(reference):
    want = script(copy.deepcopy(reference).to("cuda"))
    model = copy.deepcopy(reference)
    h = offload_decoder_layers(model, device="cuda", resident_layers="auto")
    assert h.resident == list(range(LAYERS)) and not h.streamed  # a tiny model fits entirely
    for a, b in zip(want, script(model)):
        assert torch.equal(a, b)
    model = copy.deepcopy(reference)
    b = sync_offload_layers(model, device="cuda")
    for x, y in zip(want, script(model)):
        assert torch.equal(x, y)
    assert b.stats().bytes == 3 * b.bytes_per_forward


def test_cuda_double_buffering_overlaps_copy_and_compute():
    """fp32, hidden 1024, 4096 tokens: per layer the GEMMs take about as long as the 36 MB copy, so
    overlapping (slots=2) must beat the no-overlap schedule (slots=1) clearly."""
    _, target = tiny_pair(vocab=64, seed=1, layers=8, hidden=1024)
    ids = torch.randint(0, 64, (1, 4096), device="cuda")
    walls = {}
    for slots in (1, 2):
        model = copy.deepcopy(target)
        h = offload_decoder_layers(model, device="cuda", slots=slots, resident_layers=0)
        with torch.no_grad():
            model(input_ids=ids)  # warm-up
            torch.cuda.synchronize()
            h.reset_stats()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(5):
                model(input_ids=ids)
            b.record()
            b.synchronize()
        s = h.stats()
        walls[slots] = a.elapsed_time(b) / 1e3
        print(f"slots={slots}: {walls[slots] / 5 * 1e3:.2f} ms/forward, {s}, copy {s.gbps:.1f} GB/s")
        assert s.forwards == 5 and s.bytes == 5 * h.bytes_per_forward
        assert s.gbps > 5.0  # pinned DMA, not a pageable crawl
        assert s.wait_seconds <= s.copy_seconds * 1.05 + 1e-3
        h.close()
    assert walls[2] < 0.9 * walls[1], walls
