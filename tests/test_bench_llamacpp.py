"""llama.cpp as a peer in the speed bench: without llama-cpp-python the bench says how to get it and runs
the rest; the draft-model adapter keeps the draft's cache in step with the target's tokens."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from dyntree_core.bench import llamacpp as lc


def test_status_without_llama_cpp_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    st = lc.llama_cpp_status()
    assert not st.available and st.version is None
    assert "pip install 'dyntree[llamacpp]'" in st.message and "GGML_NATIVE" in st.message


@pytest.mark.slow
def test_speed_bench_records_why_llama_cpp_rows_are_missing(tmp_path, monkeypatch, capsys, one_torch_thread):
    from dyntree_core.bench.speed import main

    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "speed.json"
    assert main(["--pair", "tiny", "--datasets", "code", "--prompts", "1", "--prompt-tokens", "16", "--new-tokens", "4",
                 "--temperatures", "0", "--precisions", "float32", "--auto-precisions", "float32", "--fixed",
                 "--no-hf", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert not rec["llama_cpp"]["available"] and "dyntree[llamacpp]" in rec["llama_cpp"]["skipped"]
    assert not any(c["row"].startswith("llama.cpp") for c in rec["cells"])
    assert "dyntree[llamacpp]" in capsys.readouterr().err
    assert rec["kernels"].startswith("kt")


class _FakeLlama:
    """What ``DraftLlama`` uses of a ``Llama``: ``input_ids``, ``n_tokens``, ``eval``; logits are a function of
    the last token (next = last + 1, with probability 0.9 unless the last token is a multiple of 5)."""

    def __init__(self, vocab: int = 50):
        self.input_ids = np.zeros(256, dtype=np.intc)
        self.n_tokens = 0
        self.vocab = vocab
        self.fed: list[list[int]] = []

    def eval(self, tokens):
        self.fed.append(list(tokens))
        self.input_ids[self.n_tokens:self.n_tokens + len(tokens)] = tokens
        self.n_tokens += len(tokens)

    def logits(self, _llm):
        last = int(self.input_ids[self.n_tokens - 1])
        out = np.full(self.vocab, -10.0, dtype=np.float32)
        out[(last + 1) % self.vocab] = 10.0 if last % 5 else -9.9  # p < 0.75 after a multiple of 5
        return out


def test_draft_adapter_feeds_only_the_new_tokens_and_stops_on_low_probability():
    fake = _FakeLlama()
    d = lc.DraftLlama(fake, n_max=3, p_min=0.75, logits=fake.logits)
    assert d(np.array([1, 2, 3], dtype=np.intc)).tolist() == [4, 5]  # after 5 the draft is unsure: stop
    assert fake.fed == [[1, 2, 3], [4], [5]]
    # the target accepted 4 and then produced 7: the draft rolls back to the common prefix [1, 2, 3, 4]
    fake.fed.clear()
    assert d(np.array([1, 2, 3, 4, 7], dtype=np.intc)).tolist() == [8, 9, 10]
    assert fake.fed[0] == [7] and fake.n_tokens == 8
    # the same tokens again: the last one is fed again so its logits draft the first token
    fake.fed.clear()
    assert d(np.array(fake.input_ids[:fake.n_tokens].tolist(), dtype=np.intc)).tolist() == []  # 10: unsure
    assert fake.fed == [[10]]
    assert d.calls == 3 and d.drafted == 2 + 3
