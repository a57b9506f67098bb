"""Engine: autoregressive baseline, input validation, EOS, KV-cache reuse."""

import pytest
import torch

from dyntree_core import ConfigError, DecodeConfig, SpeculativeDecoder
from dyntree_core.decode.prepared import VocabMismatchError
from dyntree_core.testing import tiny_pair


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(seed=3)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_autoregressive_greedy_matches_hf_generate(seed):
    draft, target = tiny_pair(seed=seed)
    prompt = [5, 9, 2, 7]
    ours = SpeculativeDecoder(draft, target, DecodeConfig(method="autoregressive")).generate_ids(prompt, 24)
    ref = target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    assert ours == ref


def test_single_token_prompt_and_exact_length(pair):
    draft, target = pair
    dec = SpeculativeDecoder(draft, target, DecodeConfig(method="autoregressive", temperature=0.8, seed=4))
    assert len(dec.generate_ids([3], 17)) == 17


def test_same_seed_same_output_different_seed_differs(pair):
    draft, target = pair
    runs = {}
    for seed in (1, 1, 2):
        dec = SpeculativeDecoder(draft, target, DecodeConfig(method="autoregressive", temperature=1.0, seed=seed))
        runs.setdefault(seed, []).append(dec.generate_ids([3, 4], 30))
    assert runs[1][0] == runs[1][1]
    assert runs[1][0] != runs[2][0]


def test_eos_stops_generation(pair):
    draft, target = pair
    greedy = SpeculativeDecoder(draft, target, DecodeConfig(method="autoregressive")).generate_ids([5, 6], 12)
    eos = greedy[5]
    first = greedy.index(eos)
    dec = SpeculativeDecoder(draft, target, DecodeConfig(method="autoregressive"), eos_token_id=eos)
    traces = list(dec.generate([5, 6], 12))
    out = [c.token_id for t in traces for c in t.committed]
    assert out == greedy[: first + 1]
    assert traces[-1].finished and traces[-1].finish_reason == "eos"


def test_trace_bookkeeping(pair):
    draft, target = pair
    traces = list(SpeculativeDecoder(draft, target, DecodeConfig(method="autoregressive")).generate([1, 2, 3], 5))
    assert [t.step for t in traces] == list(range(5))
    assert [t.total_new_tokens for t in traces] == [1, 2, 3, 4, 5]
    assert traces[-1].finish_reason == "length" and not traces[0].finished
    assert all(t.tokens_per_s > 0 and t.timings.target_forward > 0 for t in traces)
    assert all(c.kind == "autoregressive" and 0 < c.p_target <= 1 for t in traces for c in t.committed)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(budget=1), "budget"),
        (dict(budget=10**6), "budget"),
        (dict(threshold=1.5), "threshold"),
        (dict(method="beam"), "method"),
        (dict(method="opt_tree", verifier="token_level", temperature=0.7), "point_mass"),
        (dict(verifier="greedy", temperature=0.7), "greedy"),
    ],
)
def test_bad_config_is_refused_clearly(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        DecodeConfig(**kwargs)


def test_bad_prompts_and_lengths_are_refused(pair):
    draft, target = pair
    dec = SpeculativeDecoder(draft, target, DecodeConfig(method="autoregressive"))
    with pytest.raises(ConfigError, match="empty"):
        dec.generate_ids([], 4)
    with pytest.raises(ConfigError, match="context"):
        dec.generate_ids([3] * target.config.max_position_embeddings, 4)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        dec.generate_ids([3], 0)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        dec.generate_ids([3], -2)
    with pytest.raises(ConfigError, match="out of range"):
        dec.generate_ids([10**6], 2)


def test_generation_stops_at_model_context(pair):
    draft, target = pair
    ctx = target.config.max_position_embeddings
    dec = SpeculativeDecoder(draft, target, DecodeConfig(method="autoregressive"))
    traces = list(dec.generate([3] * (ctx - 3), 10))
    assert sum(len(t.committed) for t in traces) == 3
    assert traces[-1].finish_reason == "context"


def test_mismatched_vocab_is_refused_with_both_sizes():
    draft, _ = tiny_pair(vocab=64)
    _, target = tiny_pair(vocab=80)
    with pytest.raises(VocabMismatchError, match="64.*80"):
        SpeculativeDecoder(draft, target, DecodeConfig())


@pytest.mark.parametrize("method", ["autoregressive", "dyspec_greedy"])
def test_chunked_prefill_reports_progress_and_changes_nothing(pair, monkeypatch, method):
    """A prompt prefilled in chunks of 7 gives the same greedy output as one forward, and the
    ``PrefillProgress`` items count every prompt token of each model that is prefilled."""
    import dyntree_core.decode.engine as engine
    from dyntree_core.trace import PrefillProgress

    draft, target = pair
    prompt = [int(x) for x in torch.randint(1, 60, (40,), generator=torch.Generator().manual_seed(3))]
    cfg = DecodeConfig(method=method, budget=12, depth=3)
    whole = SpeculativeDecoder(draft, target, cfg).generate_ids(prompt, 16)
    monkeypatch.setattr(engine, "PREFILL_CHUNK", 7)
    items = list(SpeculativeDecoder(draft, target, cfg).generate(prompt, 16, prefill_progress=True))
    seen = [(p.done, p.total) for p in items if isinstance(p, PrefillProgress)]
    assert all(isinstance(p, PrefillProgress) for p in items[:len(seen)])  # all progress comes first
    chunked = [c.token_id for t in items[len(seen):] for c in t.committed]
    assert chunked == whole
    models = 1 if method == "autoregressive" else 2
    total = 39 * models
    assert seen[0] == (0, total) and len(seen) == 1 + models * 6  # ceil(39 / 7) chunks per model
    assert all(t == total for _, t in seen)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and seen[-1][0] == total


def test_stop_during_the_prefill_ends_it_after_the_current_chunk(pair, monkeypatch):
    """A stop set while the prompt is being prefilled ends the run after that chunk, with no step."""
    import threading

    import dyntree_core.decode.engine as engine
    from dyntree_core.trace import PrefillProgress

    draft, target = pair
    monkeypatch.setattr(engine, "PREFILL_CHUNK", 5)
    stop = threading.Event()
    items = []
    for item in SpeculativeDecoder(draft, target, DecodeConfig(method="dyspec_greedy", budget=8, depth=3)).generate(
            list(range(2, 42)), 16, stop_event=stop, prefill_progress=True):
        items.append(item)
        if item.done >= 10:
            stop.set()
    assert all(isinstance(i, PrefillProgress) for i in items)  # no step
    assert [i.done for i in items] == [0, 5, 10, 10] and items[-1].stopped  # the chunk after the stop never ran
    # without progress items the iterator simply ends
    stop.clear()
    steps = SpeculativeDecoder(draft, target, DecodeConfig(method="chain", depth=2)).generate(
        list(range(2, 42)), 16, stop_event=stop)
    stop.set()
    assert list(steps) == []


def test_prefill_chunks_are_sized_by_the_measured_time(monkeypatch):
    """Stop acts between chunks, so each chunk after the first takes about ``PREFILL_CHUNK_SECONDS`` at
    the rate the previous chunk measured, whatever the machine: a feed of 1 ms per token gets chunks of
    at most 100 tokens at 0.1 s, a feed that slows to 4 ms per token gets at most 25, a fast one is capped
    at ``PREFILL_CHUNK``; every token is fed exactly once, in order."""
    import time

    import dyntree_core.decode.engine as engine

    monkeypatch.setattr(engine, "PREFILL_CHUNK_SECONDS", 0.1)
    monkeypatch.setattr(engine, "PREFILL_FIRST", 16)
    fed: list[tuple[int, int]] = []
    per_token = [0.001]

    def feed(chunk, start):
        fed.append((start, len(chunk)))
        time.sleep(per_token[0] * len(chunk))  # sleeps never undershoot: the sizes below are upper bounds
        if start + len(chunk) >= 300:
            per_token[0] = 0.004

    dec = SpeculativeDecoder.__new__(SpeculativeDecoder)
    items = list(dec._prefill([feed], list(range(1001))))
    assert [s for s, _ in fed] == [sum(n for _, n in fed[:i]) for i in range(len(fed))]
    assert sum(n for _, n in fed) == 1000 and fed[0] == (0, 16)
    slow_from = next(i for i, (s, n) in enumerate(fed) if s + n >= 300) + 1
    assert all(n <= 100 for _, n in fed[1:slow_from + 1]) and all(n <= 25 for _, n in fed[slow_from + 1:])
    assert len(items) == len(fed) + 1 and items[-1].done == items[-1].total == 1000
    sizes = engine.prefill_chunks(10_000)
    assert next(sizes) == 16 and sizes.send((1e-6, 16)) == engine.PREFILL_CHUNK  # fast: capped


def test_a_prefill_of_fixed_cost_forwards_is_not_cut_to_one_token_per_forward(monkeypatch):
    """A streamed target's forward costs about the same for 1 or 512 tokens (2.5 s on the H200 for a
    70B-shaped stack). Sized by rate alone its chunks shrank 32 -> 6 -> 1: a 128-token prompt took ~100
    forwards and the offloaded decode-step bench never reached a step in 215 s. Here a forward costs
    50 ms + 0.1 ms per token against 20 ms chunks: after two measuring chunks the chunks grow (by at most
    ``FIXED_COST_GROWTH`` each) to hundreds of tokens, every token once and in order. A timing spike on a
    fast model (a chunk slower than the one before it, under twice the chunk time) is not taken for a
    fixed cost: the next chunk is sized by rate, not grown."""
    import time

    import dyntree_core.decode.engine as engine

    monkeypatch.setattr(engine, "PREFILL_CHUNK_SECONDS", 0.02)
    monkeypatch.setattr(engine, "PREFILL_FIRST", 16)
    fed: list[tuple[int, int]] = []

    def feed(chunk, start):
        fed.append((start, len(chunk)))
        time.sleep(0.05 + 0.0001 * len(chunk))

    dec = SpeculativeDecoder.__new__(SpeculativeDecoder)
    list(dec._prefill([feed], list(range(1001))))
    assert [s for s, _ in fed] == [sum(n for _, n in fed[:i]) for i in range(len(fed))]
    assert sum(n for _, n in fed) == 1000 and fed[0] == (0, 16)
    assert len(fed) <= 8 and max(n for _, n in fed) >= 256, fed
    sizes = engine.prefill_chunks(10_000)  # no per-token cost measurable: growing by 4x to the largest chunks
    assert next(sizes) == 16 and sizes.send((2.5, 16)) == 1 and sizes.send((2.5, 1)) == 64
    assert sizes.send((2.5, 64)) == 256 and sizes.send((2.5, 256)) == engine.PREFILL_CHUNK
    monkeypatch.setattr(engine, "PREFILL_CHUNK_SECONDS", 0.5)
    sizes = engine.prefill_chunks(10_000)
    assert next(sizes) == 16 and sizes.send((0.6, 16)) == 13
    # a spike: fewer tokens took longer (a line through both has a 2.2-s fixed part and a negative slope);
    # sized by its rate, 0.5 s at 0.9 s / 13 tokens, not PREFILL_CHUNK tokens (~10 s at that rate)
    assert sizes.send((0.9, 13)) == 7
