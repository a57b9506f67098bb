"""Greedy (T=0, fp32) output of the speculative decoder on the real embedded pair is
token-identical to plain target greedy decoding."""

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
def ar_outputs(embedded_pair):
    return [greedy(embedded_pair, "autoregressive", p, 64) for p in prompt_ids(embedded_pair)]


def test_chain_matches_target_greedy_3_prompts_x_64_tokens(embedded_pair, ar_outputs):
    for prompt, ref in zip(prompt_ids(embedded_pair), ar_outputs):
        assert len(ref) == 64 or ref[-1] in embedded_pair.eos_token_ids
        assert greedy(embedded_pair, "chain", prompt, 64, depth=4) == ref


def test_suffix_matches_target_greedy_3_prompts_x_64_tokens(embedded_pair, ar_outputs):
    for prompt, ref in zip(prompt_ids(embedded_pair), ar_outputs):
        assert greedy(embedded_pair, "suffix", prompt, 64, budget=16, depth=8, threshold=0.01) == ref


@pytest.mark.parametrize("method", TREE_METHODS)
def test_tree_method_matches_target_greedy(embedded_pair, ar_outputs, method):
    prompt = prompt_ids(embedded_pair)[0]
    assert greedy(embedded_pair, method, prompt, 32, budget=32, depth=6, width=4) == ar_outputs[0][:32]
