"""``bench kernels``' extra candidates compute the layer's product (to their precision's rounding): a timing of
a candidate that computes something else would compare nothing."""

from __future__ import annotations

import pytest
import torch

from dyntree_core.bench.kernels import EXTRA_CANDIDATES, extra_candidate
from dyntree_core.quant import kernel_table as kt
from dyntree_core.quant.ggml_linear import GGMLLinear
from dyntree_core.quant.native import native_kernels

#: relative error (max |d| / max |reference|) each may have: weight and activation rounding of its precision
TOLERANCE = {"aten_int8": 0.03, "dense_bf16_split": 0.02, "dense_fp32": 1e-5, "dense_bf16": 0.02,
             "torch_int8_dynamic": 0.06, "torchao_int4": 0.02}


@pytest.mark.parametrize("name", EXTRA_CANDIDATES)
def test_each_extra_candidate_computes_the_layers_product(name):
    if native_kernels() is None:
        pytest.skip("the synthetic weight is dequantized by the native kernels")
    shape = kt.LayerShape("Q4_K", 64, 512)
    dense = GGMLLinear("Q4_K", kt.synthetic_blocks(shape), shape.k).dequantized_weight()
    fn = extra_candidate(name, shape, dense)
    if fn is None:
        pytest.skip(f"{name} does not run here")
    x = torch.randn(5, shape.k, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got = fn(x).float()
    ref = x @ dense.t()
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= TOLERANCE[name] * ref.abs().max().item()


def test_a_bench_switch_holds_for_its_block_and_is_restored(monkeypatch):
    """``bench.env.env_var``: set inside, the old value back after (also after an error), unset if it was."""
    import os

    from dyntree_core.bench.env import env_var

    monkeypatch.delenv("DYNTREE_KERNELS", raising=False)
    with env_var("DYNTREE_KERNELS", "aten"):
        assert os.environ["DYNTREE_KERNELS"] == "aten"
    assert "DYNTREE_KERNELS" not in os.environ
    monkeypatch.setenv("DYNTREE_KERNELS", "native")
    with pytest.raises(RuntimeError), env_var("DYNTREE_KERNELS", "aten"):
        raise RuntimeError("a row failed")
    assert os.environ["DYNTREE_KERNELS"] == "native"
