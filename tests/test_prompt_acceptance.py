"""A prompt priced on the calibration texts whose prompts' draft/target agreement is nearest its own
(``Acceptance.nearest``, ``prompt_agreement``, ``plan_auto(prompt_ids=...)``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dyntree_core.planning import acceptance as am
from dyntree_core.planning.acceptance import NEAREST_TEXTS, Acceptance


def _four_texts() -> Acceptance:
    """Two prose-like texts (their prompts agree 0.54 and 0.65) and two code-like (0.79, 0.83), each a run of
    accepts of its own rate."""
    agree = (0.54, 0.65, 0.79, 0.83)
    rows = (40, 48, 48, 46)
    seqs = tuple(tuple((float(i % 5 < round(5 * a)),) for i in range(n)) for a, n in zip((0.6, 0.7, 0.95, 0.93), rows))
    vectors = ((0.6, 0.1), (0.7, 0.1), (0.9, 0.05), (0.92, 0.04))
    texts = tuple(((k,), (k, k)) for k in range(4))
    vector = tuple(sum(n * v[j] for n, v in zip(rows, vectors)) / sum(rows) for j in range(2))
    return Acceptance(vector, seqs, texts, vectors, agree)


def test_a_prompt_is_priced_on_the_texts_whose_prompts_agree_as_much():
    acc = _four_texts()
    prose, code = acc.nearest(0.55), acc.nearest(0.86)
    assert NEAREST_TEXTS == 2
    assert prose.prompt_agreement == (0.54, 0.65) and prose.texts == acc.texts[:2] and prose.sequences == acc.sequences[:2]
    assert code.prompt_agreement == (0.79, 0.83) and code.vectors == acc.vectors[2:]
    assert prose.vector == pytest.approx(((40 * 0.6 + 48 * 0.7) / 88, (40 * 0.1 + 48 * 0.1) / 88))
    assert prose.vector[0] < acc.vector[0] < code.vector[0]
    assert acc.nearest(0.7, k=4) is acc and Acceptance(acc.vector, acc.sequences).nearest(0.5).vector == acc.vector


def test_the_agreement_of_a_model_with_itself_is_one_and_an_empty_prompt_has_none():
    from dyntree_core.testing import tiny_pair

    draft, target = tiny_pair(seed=0)
    assert am.prompt_agreement(SimpleNamespace(draft=target, target=target), list(range(1, 60))) == 1.0
    got = am.prompt_agreement(SimpleNamespace(draft=draft, target=target), list(range(1, 60)))
    assert 0.0 <= got <= 1.0
    with pytest.raises(ValueError):
        am.prompt_agreement(SimpleNamespace(draft=draft, target=target), [])


def _tiny_cache():
    from dyntree_core.testing import TinyPairCache
    from ui.tiny import TinyTokenizer

    return TinyPairCache(TinyTokenizer(64), vocab=64)


def test_the_calibration_keeps_each_texts_vector_and_its_prompts_agreement(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path))
    pair = _tiny_cache().pair("float32", "float32")
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 9, 10, 11, 12], [5, 4, 3, 2, 1, 5, 4, 3]]
    acc = am.load_or_measure_acceptance(pair, "tiny", prompts, 0.0, new_tokens=12)
    n = len(acc.sequences)
    assert n == len(prompts) and len(acc.vectors) == n and len(acc.prompt_agreement) == n
    rows = [len(s) for s in acc.sequences]
    assert acc.vector == pytest.approx([sum(r * v[j] for r, v in zip(rows, acc.vectors)) / sum(rows)
                                        for j in range(len(acc.vector))])
    assert acc.prompt_agreement == tuple(pytest.approx(am.prompt_agreement(pair, p)) for p in prompts)
    again = am.cached_acceptance("tiny", pair.draft_precision, pair.target_precision, 0.0, prompts, new_tokens=12)
    assert again == acc


def test_plan_auto_prices_a_prompt_on_the_calibration_texts_nearest_it(tmp_path, monkeypatch):
    from dyntree_core.planning import auto

    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path))
    cache = _tiny_cache()
    seen = []
    real = auto.choose
    monkeypatch.setattr(auto, "choose", lambda prof, acc, *a, **k: (seen.append(acc), real(prof, acc, *a, **k))[1])
    plain = auto.plan_auto(cache, 0.0, target_precisions=("float32",))
    assert plain.prompt_agreement is None and len(seen[-1].prompt_agreement) == 4  # (2 wiki + 2 code prompts)
    ids = cache.text_tokenizer()("t1 t2 t3 t1 t2 t3 t4 t5", add_special_tokens=False)["input_ids"]
    plan = auto.plan_auto(cache, 0.0, target_precisions=("float32",), measure=False, prompt_ids=ids)
    assert len(seen[-1].prompt_agreement) == NEAREST_TEXTS
    assert plan.prompt_agreement == pytest.approx(am.prompt_agreement(cache.pair("float32", "float32"), ids), abs=1e-3)
    assert "nearest this prompt's" in plan.reason and plan.to_dict()["prompt_agreement"] == plan.prompt_agreement
