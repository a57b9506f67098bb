"""Smoke test of the embedded Qwen2.5-Coder pair (fetched beforehand by `python -m dyntree_core fetch`).

Checks the shared vocabulary, the EOS ids, that both models' greedy continuations of simple
prompts are sensible text, and reports the load times. Never fetches: if the pair is not in the
cache the test fails with the command to run.
"""

from __future__ import annotations


import pytest

pytestmark = pytest.mark.realpair

QWEN_VOCAB = 151_936
IM_END, ENDOFTEXT = 151_645, 151_643


@pytest.fixture(scope="module")
def pair(embedded_pair):
    """The session's embedded pair (tests/conftest.py); its load times are in ``load_seconds``."""
    print("\nembedded pair loaded: " + ", ".join(f"{k} {v:.1f}s" for k, v in embedded_pair.load_seconds.items()))
    return embedded_pair


def _greedy(model, tok, prompt: str, n: int) -> str:
    import torch

    ids = tok(prompt, return_tensors="pt").input_ids
    out: list[int] = []
    past = None
    with torch.no_grad():
        x = ids
        for _ in range(n):
            res = model(input_ids=x, past_key_values=past, use_cache=True)
            past = res.past_key_values
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            x = torch.tensor([[nxt]])
    return tok.decode(out)


def test_vocab_and_special_tokens(pair) -> None:
    assert pair.draft_vocab_size == pair.target_vocab_size == QWEN_VOCAB
    from dyntree_core.models import PRESETS

    # the sizes precheck_pair compares before fetching are the loaded models' logit counts
    assert PRESETS[pair.draft_name].vocab_size == PRESETS[pair.target_name].vocab_size == QWEN_VOCAB
    assert pair.tokenizer_size is not None and pair.tokenizer_size <= QWEN_VOCAB
    assert pair.tokenizer.eos_token_id == IM_END
    assert IM_END in pair.eos_token_ids and ENDOFTEXT in pair.eos_token_ids
    assert pair.draft_name == "qwen2.5-coder-0.5b" and pair.target_name == "qwen2.5-coder-1.5b"
    for m in (pair.draft, pair.target):
        # loaded with SDPA; a decoder that ran earlier in the session prepared the pair once, which
        # switches it to the per-call dispatcher (SDPA unless a call names the Triton backend)
        assert not m.training and m.config._attn_implementation in ("sdpa", "dyntree_tree_dispatch")
    assert sum(pair.load_seconds.values()) < 300


@pytest.mark.parametrize("role", ["draft", "target"])
def test_greedy_continuations_are_sensible(pair, role: str) -> None:
    model = getattr(pair, role)
    tok = pair.tokenizer
    code = _greedy(model, tok, "def add(a, b):\n    return a", 3)
    assert code.lstrip().startswith("+ b") or code.lstrip().startswith("+b"), repr(code)
    text = _greedy(model, tok, "The capital of France is", 4)
    assert "Paris" in text, repr(text)


def test_draft_and_target_mostly_agree(pair) -> None:
    """The draft is useful only if it often predicts the target's next token."""
    import torch

    tok = pair.tokenizer
    ids = tok("def fibonacci(n):\n    if n <= 1:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
              return_tensors="pt").input_ids
    with torch.no_grad():
        d = pair.draft(ids).logits[0].argmax(-1)
        t = pair.target(ids).logits[0].argmax(-1)
    agree = float((d == t).float().mean())
    assert agree > 0.5, agree
