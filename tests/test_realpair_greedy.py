"""Greedy (T=0) output of the speculative decoder on the real embedded pair, at the app's precision
(int4 GGUF blocks for both models), is token-identical to plain target greedy decoding.

The pair runs llama.cpp's arithmetic (``DYNTREE_KERNELS=native_q8``: int8 activations, integer block
sums) at every row count: a row's projections are then bit-identical whether the forward holds 1 row
(plain decoding) or a whole tree, so a difference in tokens is the engine's, not a near-tie rounded
differently by another kernel. It is the kernel the measured table picks on every machine measured so far
(AVX2 EPYC, AVX-512/AMX Xeon); the test pins it so that another machine's table cannot make it flaky.
The int4 pair runs these 13 decodes in about 3 minutes on 2 cores (float32: about 10).
"""

import os

import pytest

from dyntree_core import DecodeConfig, SpeculativeDecoder
from dyntree_core.config import METHODS
from dyntree_core.prompts import load_prompts

pytestmark = pytest.mark.realpair

TREE_METHODS = [m for m in METHODS if m not in ("autoregressive", "chain", "suffix")]


def prompt_ids(pair, n_per_dataset=1, tokens=64):
    out = []
    for ds in ("wiki", "code", "news"):
        for p in load_prompts(ds, n_per_dataset, split="eval"):
            out.append(list(pair.tokenizer(p.text, add_special_tokens=False)["input_ids"])[:tokens])
    return out


def greedy(pair, method, prompt, n, **kw):
    cfg = DecodeConfig(method=method, **kw)
    return SpeculativeDecoder(pair.draft, pair.target, cfg, eos_token_id=list(pair.eos_token_ids)).generate_ids(prompt, n)


@pytest.fixture(scope="module")
def int4_pair(embedded_fetched):
    """The embedded pair at int4 (target and draft) on llama.cpp's arithmetic (see the module docstring)."""
    from dyntree_core.models.load import load_pair

    before = os.environ.get("DYNTREE_KERNELS")
    os.environ["DYNTREE_KERNELS"] = "native_q8"  # read when the layers are built
    try:
        return load_pair("embedded", "embedded", dtype="float32", device="cpu", precision="int4")
    finally:
        if before is None:
            os.environ.pop("DYNTREE_KERNELS")
        else:
            os.environ["DYNTREE_KERNELS"] = before


@pytest.fixture(scope="module")
def ar_outputs(int4_pair):
    return [greedy(int4_pair, "autoregressive", p, 64) for p in prompt_ids(int4_pair)]


def test_the_pair_runs_int4_blocks_on_int8_activations(int4_pair):
    from dyntree_core.quant.ggml_linear import GGMLLinear

    layers = [m for model in (int4_pair.draft, int4_pair.target) for m in model.modules() if isinstance(m, GGMLLinear)]
    assert layers and all(m.int8_activations for m in layers)


def test_chain_matches_target_greedy_3_prompts_x_64_tokens(int4_pair, ar_outputs):
    for prompt, ref in zip(prompt_ids(int4_pair), ar_outputs):
        assert len(ref) == 64 or ref[-1] in int4_pair.eos_token_ids
        assert greedy(int4_pair, "chain", prompt, 64, depth=4) == ref


def test_suffix_matches_target_greedy_3_prompts_x_64_tokens(int4_pair, ar_outputs):
    for prompt, ref in zip(prompt_ids(int4_pair), ar_outputs):
        assert greedy(int4_pair, "suffix", prompt, 64, budget=16, depth=8, threshold=0.01) == ref


@pytest.mark.parametrize("method", TREE_METHODS)
def test_tree_method_matches_target_greedy(int4_pair, ar_outputs, method):
    prompt = prompt_ids(int4_pair)[0]
    assert greedy(int4_pair, method, prompt, 32, budget=32, depth=6, width=4) == ar_outputs[0][:32]
