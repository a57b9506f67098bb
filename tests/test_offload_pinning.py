"""Pinned host memory has an owner: every registration is released once, by whoever made it.

On the CPU the stand-in backend registers through ``pinning.SIMULATED``, which keeps cudart's
bookkeeping (overlapping ranges refused with 712, unknown pointers with 713) and counts calls, so
these tests prove on the CPU what failed on an H200 (a second offload in one process after the
first left its layer buffers registered)."""

from __future__ import annotations

import gc

import pytest
import torch

from dyntree_core import DecodeConfig, SpeculativeDecoder
from dyntree_core.decode.prepared import PreparedPair
from dyntree_core.offload import CudaCallError, HostBuffer, OffloadError, offload_decoder_layers, pinned_registrations
from dyntree_core.offload.backend import HostBackend
from dyntree_core.offload.layout import HostLayer, LayerLayout, pack_layer
from dyntree_core.offload.pinning import SIMULATED, SimulatedCudart, alloc_pinned, cuda_error_name
from dyntree_core.testing import tiny_pair

PROMPT = [5, 9, 2, 7, 1, 3]


def live() -> int:
    gc.collect()
    return pinned_registrations().live


def test_cuda_codes_are_named_in_the_errors():
    reg = SimulatedCudart()
    t = torch.empty(4096, dtype=torch.uint8)
    a = HostBuffer(t)
    assert a.pin(reg) and a.pinning == "registered" and a.owns_registration
    assert not a.pin(reg)  # already page-locked: nothing registered twice
    with pytest.raises(CudaCallError, match=r"cudaHostRegister failed: cudaErrorHostMemoryAlreadyRegistered \(712\)"):
        HostBuffer(t[1024:]).pin(reg)  # an overlapping range, as a leaked registration would be
    a.close()
    a.close()  # idempotent
    assert a.pinning == "pageable" and reg.calls == {"register": 2, "unregister": 1}
    with pytest.raises(CudaCallError, match=r"cudaErrorHostMemoryNotRegistered \(713\)") as e:
        reg.unregister(t.data_ptr())
    assert e.value.code == 713
    assert cuda_error_name(208) == "cudaErrorAlreadyMapped (208)" and cuda_error_name(999) == "cudaError (999)"


def test_registration_failures_are_raised_not_hidden_by_a_fallback():
    class Exhausted(SimulatedCudart):
        def _register(self, ptr, nbytes):
            return 2

    with pytest.raises(CudaCallError, match=r"cudaErrorMemoryAllocation \(2\)"):
        alloc_pinned(1 << 16, Exhausted())
    with pytest.raises(ValueError, match="pin"):
        HostBuffer(torch.empty(8, dtype=torch.uint8), "registered")  # a registration needs an owner


def test_a_dropped_buffer_releases_its_registration():
    base = live()
    buf = HostBackend().alloc_host(1 << 20)
    assert buf.pinning == "registered" and live() == base + 1
    del buf
    assert live() == base


def _pageable_host_layers(model, n_layers: int, k: int) -> tuple[dict[int, HostLayer], list[HostBuffer]]:
    """Layers ``i`` of ``model`` share pageable buffer ``i % k`` (as the benchmarks' synthetic stacks do)."""
    layout = LayerLayout.of(model.model.layers[0])
    buffers = [HostBuffer(torch.empty(layout.nbytes, dtype=torch.uint8)) for _ in range(k)]
    wrapped = [pack_layer(model.model.layers[j], b) for j, b in enumerate(buffers)]
    return {i: wrapped[i % k] for i in range(n_layers)}, buffers


def test_offload_close_releases_what_the_handle_registered_and_only_that():
    _, target = tiny_pair(seed=1, layers=4)
    base = live()
    before = pinned_registrations()
    host_layers, caller = _pageable_host_layers(target, 4, 2)
    mine = HostBackend().alloc_host(caller[0].nbytes)  # a caller's buffer that is already page-locked
    host_layers[3] = HostLayer.wrap(mine, host_layers[3].layout)
    h = offload_decoder_layers(target, device="cpu", slots=2, resident_layers=0, host_layers=host_layers)
    assert all(b.pinning == "registered" for b in caller)  # pinned in place, once per shared buffer
    assert live() == base + 3
    h.close()
    h.close()
    assert all(b.pinning == "pageable" for b in caller) and mine.pinning == "registered"
    assert live() == base + 1  # the caller's own registration is the caller's to release
    mine.close()
    after = pinned_registrations()
    assert live() == base and after.registered - before.registered == after.unregistered - before.unregistered == 3


def test_failed_offload_releases_the_registrations_it_made(monkeypatch):
    import dyntree_core.offload.model as om

    class Boom(RuntimeError):
        pass

    def no_slots(*a, **k):
        raise Boom("device out of memory (injected)")

    _, target = tiny_pair(seed=2, layers=3)
    base = live()
    monkeypatch.setattr(om, "LayerStreamer", no_slots)
    with pytest.raises(Boom):
        offload_decoder_layers(target, device="cpu", resident_layers=0)
    assert live() == base


def test_offloaded_pair_loaded_and_closed_ten_times_leaves_nothing_registered():
    """Load, decode, close an offloaded stand-in pair 10 times in one process (what the app does on
    every change of model, dtype or precision): no registration survives a close, and every load
    registers the same amount (no growth)."""
    cfg = DecodeConfig(method="dyspec_greedy", budget=8, depth=3, offload_target=True)
    base = live()
    start = pinned_registrations()
    per_load = []
    outputs = []
    for i in range(10):
        draft, target = tiny_pair(seed=3, layers=3)
        pair = PreparedPair.prepare(draft, target, cfg, allow_cpu_offload=True)
        during = pinned_registrations()
        per_load.append((during.live - base, during.live_bytes))
        outputs.append(SpeculativeDecoder.on_pair(pair, cfg).generate_ids(PROMPT, 5))
        held = list(pair.offload._owned)  # held here, so only close() (not a finalizer) can release them
        assert PreparedPair.close_attached(draft, target) == 1
        assert held and all(b.pinning == "pageable" and not b.owns_registration for b in held)
        assert pair.closed and pair.offload.closed and live() == base, f"load {i} left registrations"
        with pytest.raises(Exception, match="closed"):
            SpeculativeDecoder.on_pair(pair, cfg)
    end = pinned_registrations()
    assert per_load[0][0] == 3 and len(set(per_load)) == 1  # 3 streamed layers, same bytes every time
    assert end.registered - start.registered == end.unregistered - start.unregistered == 30
    assert all(o == outputs[0] for o in outputs)


def test_a_closed_pair_can_be_prepared_again():
    draft, target = tiny_pair(seed=4, layers=2)
    cfg = DecodeConfig(method="chain", depth=3, offload_target=True)
    plain = SpeculativeDecoder(*tiny_pair(seed=4, layers=2), DecodeConfig(method="autoregressive")).generate_ids(PROMPT, 6)
    base = live()
    first = PreparedPair.prepare(draft, target, cfg, allow_cpu_offload=True)
    first.close()
    first.close()
    second = PreparedPair.prepare(draft, target, cfg, allow_cpu_offload=True)
    assert SpeculativeDecoder.on_pair(second, cfg).generate_ids(PROMPT, 6) == plain
    second.close()
    assert live() == base
    assert SIMULATED.calls["register"] >= SIMULATED.calls["unregister"] > 0


def test_unregister_refusal_is_raised_after_releasing_the_rest(monkeypatch):
    import dyntree_core.offload.model as om

    class Refuses(SimulatedCudart):
        label = "refusing test runtime"

        def _unregister(self, ptr):
            super()._unregister(ptr)
            return 1

    _, target = tiny_pair(seed=5, layers=3)
    backend = HostBackend(Refuses())
    monkeypatch.setattr(om, "make_backend", lambda device, register_host=True: backend)
    h = offload_decoder_layers(target, device="cpu", resident_layers=0)
    with pytest.raises(OffloadError, match=r"cudaHostUnregister failed: cudaErrorInvalidValue \(1\)"):
        h.close()
    assert backend.registrar.calls["unregister"] == 3  # every buffer was tried
    assert h.closed
