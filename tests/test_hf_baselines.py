"""bench/hf_baselines.py: transformers' generate / assisted generate as timed baselines, on the tiny pair."""

import json

import pytest

from conftest import torch_threads
from dyntree_core.bench.hf_baselines import HFRun, hf_assisted_defaults, hf_generate
from dyntree_core.config import DecodeConfig
from dyntree_core.decode.engine import SpeculativeDecoder
from dyntree_core.testing import tiny_pair

PROMPTS = ([5, 6, 7, 8, 9], [2, 3], [10, 20, 30, 40, 50, 60, 11, 12], [7])
N = 24


@pytest.fixture(scope="module")
def pair():
    # 64-wide layers gain nothing from threads, and assisted generation's many tiny ops slow down
    # by ~50x with two OpenMP threads on a busy 2-core machine; restored after this module
    with torch_threads(1):
        draft, target = tiny_pair(seed=0)
        # one untimed warm-up of each path, as a benchmark would do
        hf_generate(target, [3, 4], 4)
        hf_generate(target, [3, 4], 4, draft=draft)
        yield draft, target


def _eos(pair):
    return pair[1].generation_config.eos_token_id


def _check_counts(run: HFRun, n: int, eos) -> None:
    """new_tokens / seconds consistent with the timing rule (EOS handled)."""
    assert run.token_ids and run.first_put_tokens >= 1
    hit_eos = eos is not None and eos in run.token_ids
    if hit_eos:
        assert run.token_ids[-1] == eos and run.token_ids.count(eos) == 1 and len(run.token_ids) <= n
    else:
        assert len(run.token_ids) == n
    assert run.new_tokens == len(run.token_ids) - run.first_put_tokens
    assert run.seconds >= 0 and (run.seconds > 0) == (run.new_tokens > 0)
    assert run.seconds_per_token == pytest.approx(run.seconds / max(1, run.new_tokens))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_hf_greedy_matches_our_autoregressive_greedy(pair, prompt):
    draft, target = pair
    ours = SpeculativeDecoder(draft, target, DecodeConfig(method="autoregressive")).generate_ids(prompt, N)
    run = hf_generate(target, prompt, N, eos_token_id=_eos(pair))
    assert run.method == "hf_greedy" and run.assistant_tokens is None
    assert list(run.token_ids) == ours
    _check_counts(run, N, _eos(pair))
    # plain generation streams one token per put: exactly the prefill's token is excluded
    assert run.first_put_tokens == 1 and run.puts == len(run.token_ids)
    if _eos(pair) not in run.token_ids:
        assert run.new_tokens == N - 1 and run.seconds > 0


@pytest.mark.parametrize("prompt", PROMPTS)
def test_hf_assisted_greedy_is_lossless(pair, prompt):
    draft, target = pair
    plain = hf_generate(target, prompt, N, eos_token_id=_eos(pair))
    assisted = hf_generate(target, prompt, N, draft=draft, eos_token_id=_eos(pair))
    assert assisted.method == "hf_assisted"
    assert assisted.token_ids == plain.token_ids
    _check_counts(assisted, N, _eos(pair))
    assert assisted.puts <= len(assisted.token_ids)  # several tokens per put when drafts are accepted
    assert assisted.assistant_tokens == hf_assisted_defaults(draft)["num_assistant_tokens"]  # "constant" schedule


def test_hf_prompt_lookup_greedy_is_lossless_and_copies_repeats(pair):
    draft, target = pair
    prompt = [5, 6, 7, 8, 9] * 6  # repeats, so n-gram lookups find candidates
    plain = hf_generate(target, prompt, N, eos_token_id=_eos(pair))
    lookup = hf_generate(target, prompt, N, prompt_lookup_tokens=4, eos_token_id=_eos(pair))
    assert lookup.method == "hf_prompt_lookup" and lookup.assistant_tokens is None
    assert lookup.token_ids == plain.token_ids
    _check_counts(lookup, N, _eos(pair))
    with pytest.raises(ValueError, match="exclusive"):
        hf_generate(target, prompt, N, draft=draft, prompt_lookup_tokens=4)
    with pytest.raises(ValueError, match="positive"):
        hf_generate(target, prompt, N, prompt_lookup_tokens=0)


def test_eos_stops_both_paths_like_our_engine(pair):
    """With a frequent token as EOS, every path stops right after it, as our engine does."""
    draft, target = pair
    prompt, n = [5, 6, 7, 8, 9], 40
    full = hf_generate(target, prompt, n, eos_token_id=_eos(pair)).token_ids
    eos = full[len(full) // 2]  # a token the target does produce
    ours = SpeculativeDecoder(draft, target, DecodeConfig(method="autoregressive"), eos_token_id=eos).generate_ids(prompt, n)
    for run in (hf_generate(target, prompt, n, eos_token_id=eos), hf_generate(target, prompt, n, draft=draft, eos_token_id=eos)):
        assert list(run.token_ids) == ours and run.token_ids[-1] == eos and len(run.token_ids) < n
        _check_counts(run, n, eos)


def test_assisted_call_leaves_generation_configs_unchanged(pair):
    draft, target = pair
    before = (draft.generation_config.to_dict(), target.generation_config.to_dict())
    hf_generate(target, [5, 6, 7], N, draft=draft, eos_token_id=_eos(pair))
    hf_generate(target, [5, 6, 7], N, draft=draft, temperature=0.7, eos_token_id=_eos(pair))
    assert (draft.generation_config.to_dict(), target.generation_config.to_dict()) == before


def test_heuristic_schedule_is_reported_and_restored(pair):
    """Under the "heuristic" schedule transformers writes num_assistant_tokens back into the
    draft's config; hf_generate reports it and then restores the config."""
    draft, target = pair
    old = draft.generation_config
    draft.generation_config = old.__class__.from_dict(old.to_dict())
    try:
        draft.generation_config.num_assistant_tokens_schedule = "heuristic"
        draft.generation_config.num_assistant_tokens = 5
        before = draft.generation_config.to_dict()
        runs = [hf_generate(target, [5, 6, 7], N, draft=draft, eos_token_id=_eos(pair)) for _ in range(2)]
        assert draft.generation_config.to_dict() == before
        assert runs[0].assistant_tokens is not None and runs[0].assistant_tokens >= 1
        assert runs[0].assistant_tokens == runs[1].assistant_tokens  # independent runs: same start, same end
        assert runs[0].token_ids == runs[1].token_ids == hf_generate(target, [5, 6, 7], N, eos_token_id=_eos(pair)).token_ids
    finally:
        draft.generation_config = old


def test_assisted_defaults_are_transformers_defaults(pair):
    d = hf_assisted_defaults(pair[0])
    assert d["num_assistant_tokens"] == 20
    assert d["num_assistant_tokens_schedule"] == "constant"
    assert d["assistant_confidence_threshold"] == pytest.approx(0.4)
    json.dumps(d)


@pytest.mark.parametrize("assisted", [False, True])
def test_sampling_runs_and_is_reproducible(pair, assisted):
    draft, target = pair
    kw = dict(draft=draft if assisted else None, temperature=0.8, top_p=0.95, eos_token_id=_eos(pair))
    a = hf_generate(target, [5, 6, 7, 8], N, seed=11, **kw)
    b = hf_generate(target, [5, 6, 7, 8], N, seed=11, **kw)
    c = hf_generate(target, [5, 6, 7, 8], N, seed=12, **kw)
    assert a.method == ("hf_assisted" if assisted else "hf_greedy")
    assert a.token_ids == b.token_ids
    assert c.token_ids != a.token_ids  # 24 tokens from a 64-token vocabulary: a collision is negligible
    greedy = hf_generate(target, [5, 6, 7, 8], N, eos_token_id=_eos(pair))
    assert a.token_ids != greedy.token_ids
    _check_counts(a, N, _eos(pair))


def test_input_validation(pair):
    target = pair[1]
    with pytest.raises(ValueError):
        hf_generate(target, [], 4)
    with pytest.raises(ValueError):
        hf_generate(target, [3], 0)
    with pytest.raises(ValueError):
        hf_generate(target, [3], 4, temperature=-1.0)
    with pytest.raises(ValueError):
        hf_generate(target, [3], 4, temperature=0.5, top_p=0.0)
