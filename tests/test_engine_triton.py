"""The engine with the Triton tree-attention kernel (CPU: Triton interpreter) produces the same
greedy output as with the SDPA reference path."""

import os

import pytest
import torch

from dyntree_core import DecodeConfig, SpeculativeDecoder
from dyntree_core.testing import tiny_pair


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs CUDA or the Triton interpreter (tests/conftest.py sets it on CPU)")
@pytest.mark.parametrize("method", ["dyspec_greedy", "sequoia"])
def test_greedy_with_triton_kernel_equals_reference_path(method):
    outs = {}
    for backend in ("torch", "triton"):
        draft, target = tiny_pair(seed=4)
        cfg = DecodeConfig(method=method, attention=backend, budget=24, depth=4)
        outs[backend] = SpeculativeDecoder(draft, target, cfg).generate_ids([5, 9, 2, 7, 1, 3], 12)
        if backend == "triton":
            assert target.config._attn_implementation == "dyntree_tree_triton"
            assert draft.config._attn_implementation == "dyntree_tree_triton"
    assert outs["triton"] == outs["torch"]
    assert len(outs["torch"]) == 12


def test_attention_switch_is_validated():
    from dyntree_core import ConfigError

    with pytest.raises(ConfigError, match="attention"):
        DecodeConfig(attention="flash")
