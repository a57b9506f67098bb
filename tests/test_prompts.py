"""Packaged prompt sets: counts, disjoint eval/calib slices, non-empty text, clear errors."""

from __future__ import annotations

import json

import pytest

from dyntree_core.prompts import (DATASETS, PromptSetError, load_prompts, prompts_dir, rename, rename_target,
                                  repeat_prompt_text)

EXPECTED_TOTAL = {"wiki": 200, "news": 293, "code": 164}  # news: 300 lines, 7 duplicates dropped


@pytest.mark.parametrize("dataset", DATASETS)
def test_counts_and_disjoint_slices(dataset: str) -> None:
    ev = load_prompts(dataset)
    cal = load_prompts(dataset, split="calib")
    everything = load_prompts(dataset, split="all")
    assert len(everything) == EXPECTED_TOTAL[dataset]
    assert len(ev) + len(cal) == len(everything)
    assert len(cal) == len(everything) // 5  # every 5th record is calibration
    assert {p.id for p in ev}.isdisjoint({p.id for p in cal})
    assert {p.text for p in ev}.isdisjoint({p.text for p in cal})
    assert all(p.split == "eval" for p in ev) and all(p.split == "calib" for p in cal)
    assert len({p.id for p in everything}) == len(everything)


@pytest.mark.parametrize("dataset", DATASETS)
def test_text_and_attribution(dataset: str) -> None:
    for p in load_prompts(dataset, split="all"):
        assert p.text.strip() and len(p.text) >= 50, p.id
        assert p.dataset == dataset and p.id.startswith(dataset + "-")
        assert p.source
    if dataset == "wiki":
        assert all("CC BY-SA" in p.source and p.url and p.url.startswith("https://en.wikipedia.org/wiki/")
                   for p in load_prompts("wiki", split="all"))
    if dataset == "code":
        first = load_prompts("code", split="all")[0]
        assert first.title == "HumanEval/0" and "def has_close_elements" in first.text


def test_n_prefix_and_errors() -> None:
    assert [p.id for p in load_prompts("news", n=3)] == [p.id for p in load_prompts("news")[:3]]
    with pytest.raises(PromptSetError, match="unknown prompt dataset 'poetry'"):
        load_prompts("poetry")
    with pytest.raises(PromptSetError, match="unknown split"):
        load_prompts("wiki", split="train")
    with pytest.raises(PromptSetError, match=r"n must be an integer in \[1, 160\]"):
        load_prompts("wiki", n=10_000)
    with pytest.raises(PromptSetError, match="n must be"):
        load_prompts("code", n=0)


def test_rename_target_and_rename() -> None:
    code = "def add_all(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total\n"
    assert rename_target(code) == ("total", "the_total")  # 3 uses; keywords and 1-2 letter names ignored
    assert rename_target("def f(a):\n    return a\n") is None
    assert rename_target("has_close_elements(1); has_close_elements(2)") == ("has_close_elements", "hasCloseElements")
    assert rename("total_sum = total + subtotal", "total", "t") == "total_sum = t + subtotal"  # whole words only


def test_repeat_set_quotes_each_code_prompt_and_follows_its_splits() -> None:
    code = {p.id: p for p in load_prompts("code", split="all")}
    for split in ("eval", "calib"):
        rep = load_prompts("repeat", split=split)
        assert len(rep) >= 0.9 * len(load_prompts("code", split=split))
        for p in rep:
            src = code[p.id.removeprefix("repeat-")]
            assert p.dataset == "repeat" and p.split == src.split == split
            old, new = rename_target(src.text)
            assert p.text == repeat_prompt_text(src.text, old, new)
            assert src.text.strip("\n") in p.text and p.text.endswith("```\n")
            assert f"`{old}` to `{new}`" in p.text and old != new and old in src.text
    assert load_prompts("repeat", n=2)[1].id == "repeat-code-0001"
    with pytest.raises(PromptSetError, match="repeat"):
        load_prompts("poetry")


def test_files_are_valid_jsonl_and_small() -> None:
    total = 0
    for name in DATASETS:
        path = prompts_dir() / f"{name}.jsonl"
        total += path.stat().st_size
        for line in path.read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)
            assert {"id", "text", "source", "split"} <= rec.keys()
    assert total < 3 * 2**20


def test_env_override_and_malformed_file(tmp_path, monkeypatch) -> None:
    for name in DATASETS:
        (tmp_path / f"{name}.jsonl").write_text(
            json.dumps({"id": f"{name}-0", "text": "hello world " * 10, "source": "test", "split": "eval"}) + "\n"
        )
    (tmp_path / "news.jsonl").write_text('{"id": "news-0", "text": ""}\n')
    monkeypatch.setenv("DYNTREE_PROMPTS_DIR", str(tmp_path))
    assert prompts_dir() == tmp_path
    assert [p.id for p in load_prompts("wiki")] == ["wiki-0"]
    with pytest.raises(PromptSetError, match="malformed prompt record"):
        load_prompts("news")
