"""Bit-exact offloaded forward of the real pair's target (Qwen2.5-Coder-1.5B) on the CPU stand-in."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.realpair


def test_realpair_target_offloaded_bit_exact(embedded_pair):
    from dyntree_core.decode.forward import causal_forward, masked_forward, new_cache
    from dyntree_core.offload import offload_decoder_layers
    from dyntree_core.testing import align_cpu_parameters
    from dyntree_core.tree import ancestor_matrix

    target = embedded_pair.target
    n_layers = len(target.model.layers)

    def script(model) -> list[torch.Tensor]:
        cache = new_cache(model)
        out = [causal_forward(model, cache, [9707, 11, 1879, 0, 358], 0)]
        vis = torch.zeros(4, 9, dtype=torch.bool)
        vis[:, :5] = True
        vis[:, 5:] = ancestor_matrix(torch.tensor([-1, 0, 0, 1]), 3)
        out.append(masked_forward(model, cache, [1207, 279, 264, 1052], [5, 6, 6, 7], vis))
        cache.crop(-4)
        out.append(causal_forward(model, cache, [1207], 5))
        return out

    # the last 4 layers stream; their memory-mapped (misaligned) weights are re-homed first so the
    # reference runs the same CPU kernels as the packed buffers (see testing.align_cpu_parameters)
    resident = n_layers - 4
    assert align_cpu_parameters(target.model.layers[resident:]) > 0
    want = script(target)  # in memory; then the same model is offloaded in place (no second copy)
    h = offload_decoder_layers(target, device="cpu", slots=2, resident_layers=resident)
    try:
        got = script(target)
    finally:
        h.close()  # the session's shared model goes back to plain in-memory layers
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    s = h.stats()
    assert torch.equal(script(target)[0], want[0])  # unwrapped model still computes the same
    assert s.forwards == 3 and s.layers == 3 * (n_layers - resident)
    assert s.bytes == 3 * h.bytes_per_forward
