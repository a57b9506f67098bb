"""Replaying the suffix method on a known continuation (what ``auto`` prices it with): the replay
is the engine's decode at T = 0 step for step, its accepted length is point-mass verification's in
expectation at T > 0, and ``auto`` prices and configures ``suffix`` from it."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from dyntree_core import DecodeConfig, SpeculativeDecoder
from dyntree_core.planning.acceptance import Acceptance
from dyntree_core.planning.auto import choose
from dyntree_core.planning.candidates import simulate_suffix
from dyntree_core.planning.pricing import price_candidates
from dyntree_core.drafting import PathFunctionSource
from dyntree_core.drafting.suffix import accepted_along, size_cap, suffix_tree
from dyntree_core.drafting.suffix_replay import replay_suffix
from dyntree_core.drafting.suffix_index import SuffixIndex
from dyntree_core.planning.machine_profile import MachineProfile
from dyntree_core.testing import tiny_pair
from dyntree_core.tree import tree_from_parents
from dyntree_core.verify.expected import expected_accepted

NS = [1, 2, 4, 8, 16, 32]


def test_accepted_along_follows_the_longest_matching_path():
    #        0(root) -> 1:a -> 3:c -> 5:e
    #                -> 2:b -> 4:d
    tree = tree_from_parents([-1, 0, 0, 1, 2, 3], tokens=[9, 10, 11, 12, 13, 14])
    assert accepted_along(tree, [10, 12, 14, 7]) == 3
    assert accepted_along(tree, [11, 13]) == 2
    assert accepted_along(tree, [11, 12]) == 1  # 12 hangs under 10, not 11
    assert accepted_along(tree, [7, 10]) == 0
    assert accepted_along(tree, []) == 0


@pytest.mark.parametrize("seed,spec_factor", [(s, f) for s in range(6) for f in (1.0, None)] + [(0, 0.5), (1, 2.0)])
def test_replay_is_the_engines_greedy_decode_step_for_step(seed, spec_factor):
    draft, target = tiny_pair(seed=seed, vocab=32)
    rng = random.Random(seed)
    motif = [rng.randrange(32) for _ in range(rng.randrange(2, 5))]
    prompt = (motif * 4)[: rng.randrange(8, 14)] + [rng.randrange(32) for _ in range(2)]
    cont = SpeculativeDecoder(draft, target, DecodeConfig(method="autoregressive"), eos_token_id=()).generate_ids(prompt, 24)
    cfg = DecodeConfig(method="suffix", budget=8, depth=4, threshold=0.05, spec_factor=spec_factor)
    traces = list(SpeculativeDecoder(draft, target, cfg, eos_token_id=()).generate(prompt, 24))
    engine = [(t.tree_size, t.num_committed) for t in traces]
    assert replay_suffix(prompt, cont, 8, 4, 0.05, spec_factor) == engine


def test_accepted_along_a_target_sample_is_point_mass_acceptance_in_expectation():
    """E over target continuations of the matched length = point-mass's exact expectation."""
    vocab = 3
    index = SuffixIndex(16)
    index.extend([0, 1, 2, 0, 1, 0, 2, 1, 0])
    tree = suffix_tree(index, 6, 3, 0.01)
    assert tree.size > 3
    gen = torch.Generator().manual_seed(3)
    table: dict[tuple[int, ...], torch.Tensor] = {}

    def target(path: tuple[int, ...]) -> torch.Tensor:
        if path not in table:
            table[path] = torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * 2, -1)
        return table[path]

    def node_path(i: int) -> tuple[int, ...]:
        out = []
        while i > 0:
            out.append(int(tree.tokens[i]))
            i = int(tree.parents[i])
        return tuple(reversed(out))

    rows = torch.stack([target(node_path(i)) for i in range(tree.size)])
    depth = int(tree.depth.max())
    mean = 0.0
    for cont in itertools.product(range(vocab), repeat=depth):
        p = math.prod(float(target(cont[:j])[cont[j]]) for j in range(depth))
        mean += p * accepted_along(tree, cont)
    assert mean == pytest.approx(expected_accepted(tree, rows, "point_mass"), abs=1e-12)


def _profile(target_row, other=None) -> MachineProfile:
    return MachineProfile(key="k", machine={"cpu_model": "test cpu", "cpu_class": "avx2"}, prefix_len=32, ns=NS,
                          target={"int8": target_row}, draft={"int8": [0.05] * 6}, other=other or [0.0] * 6)


def test_auto_prices_suffix_from_the_replay_and_configures_it():
    repeat = [5, 6, 7, 8, 9] * 8
    texts = ((tuple(repeat[:20]), tuple(repeat[20:])),)
    acc = Acceptance((0.2,), (), texts)
    prof = _profile([0.1, 0.1, 0.11, 0.12, 0.14, 0.2])  # flat-ish: trees are cheap
    cands = [c for c in price_candidates(prof, acc, ["int8"], ["int8"], methods=("suffix",))]
    assert cands and all(c.method == "suffix" and c.draft_seconds < 0.01 for c in cands)
    best = min(cands, key=lambda c: c.seconds_per_token)
    stats = simulate_suffix(texts, best.budget, best.depth, best.threshold, best.spec_factor)
    assert best.expected_tokens == pytest.approx(stats.suffix_tokens)
    steps = replay_suffix(texts[0][0], texts[0][1], best.budget, best.depth, best.threshold, best.spec_factor)
    assert stats.suffix_tokens == pytest.approx(sum(c for _, c in steps) / len(steps)) and stats.suffix_tokens > 4
    plan = choose(prof, acc, 0.0, ["int8"], ["int8"], methods=("autoregressive", "chain", "sequoia", "suffix"))
    assert plan.method == "suffix" and "no draft model" in plan.reason and "calibration text" in plan.reason
    assert plan.best.seconds_per_token == pytest.approx(best.seconds_per_token, rel=0.05)  # ties: any cheapest
    cfg = plan.apply(DecodeConfig())
    b = plan.best
    assert (cfg.method, cfg.budget, cfg.depth, cfg.threshold, cfg.spec_factor) == (
        "suffix", b.budget, b.depth, b.threshold, b.spec_factor)
    assert {c.spec_factor for c in cands} == {0.5, 1.0, 2.0, None}  # every match-length cap is priced
    assert plan.resolve("suffix", "auto", "auto")["precision"] == "int8"
    # the app: the plan's fields (spec_factor included) reach the run's DecodeConfig
    from dataclasses import replace

    from ui.settings import RunSettings

    form = RunSettings(draft="tiny", target="tiny", device="cpu", dtype="float32", prompt="a", chat=False,
                       method="auto", verifier="auto", temperature=0.0, top_p=1.0, budget=8, depth=4, width=2,
                       threshold=0.1, max_new_tokens=8, seed=0)
    run = replace(form, **plan.resolve("auto", "auto", "auto"))
    assert run.decode_config().spec_factor == b.spec_factor and run.decode_config().method == "suffix"
    assert run.with_method("hybrid").decode_config().spec_factor == 1.0  # a hand-picked method: the default cap


def test_pricing_replays_the_calibration_once_per_process(monkeypatch):
    """A plan replays every suffix and hybrid shape on the calibration texts (0.8 s of a 1.2 s plan on the 2-core
    Zen 4 VM): the same texts are replayed once, so pricing the same request twice costs a quarter and picks the same
    shape; other texts are replayed anew; an acceptance built with lists (unhashable) is priced, every time."""
    from dyntree_core.drafting import suffix_replay

    calls = []
    real = suffix_replay.replay_shapes

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(suffix_replay, "replay_shapes", counted)
    seq = [901, 902, 903, 904, 905, 906] * 7  # (texts no other test prices: the replays are kept per process)
    acc = Acceptance((0.3,), (), ((tuple(seq[:18]), tuple(seq[18:])),))
    prof = _profile([0.1, 0.1, 0.11, 0.12, 0.14, 0.2])
    first = price_candidates(prof, acc, ["int8"], ["int8"], methods=("suffix",))
    again = price_candidates(prof, Acceptance((0.3,), (), ((tuple(seq[:18]), tuple(seq[18:])),)), ["int8"], ["int8"],
                             methods=("suffix",))
    assert len(calls) == 1 and again == first
    other = Acceptance((0.3,), (), ((tuple(seq[:12]), tuple(seq[12:])),))
    price_candidates(prof, other, ["int8"], ["int8"], methods=("suffix",))
    assert len(calls) == 2
    listed = Acceptance((0.3,), (), [(list(seq[:18]), list(seq[18:]))])
    assert price_candidates(prof, listed, ["int8"], ["int8"], methods=("suffix",))
    price_candidates(prof, listed, ["int8"], ["int8"], methods=("suffix",))
    assert len(calls) == 4


def test_auto_does_not_choose_suffix_on_text_that_never_repeats():
    rng = random.Random(0)
    seq = rng.sample(range(1000), 80)
    acc = Acceptance((0.2,), (), ((tuple(seq[:40]), tuple(seq[40:])),))
    prof = _profile([0.1 * n for n in NS])  # steep: every extra token costs
    plan = choose(prof, acc, 0.0, ["int8"], ["int8"], methods=("autoregressive", "suffix"))
    assert plan.method == "autoregressive"
    suffix = [c for c in price_candidates(prof, acc, ["int8"], ["int8"], methods=("suffix",))]
    assert all(c.expected_tokens == pytest.approx(1.0) for c in suffix)


def test_the_match_length_cap_sizes_the_tree_by_the_evidence():
    """SuffixDecoding's adaptive size: at most ceil(spec_factor x match length) drafted tokens."""
    assert [size_cap(m, 16, 1.0) for m in (0, 1, 2, 5, 15, 16)] == [1, 2, 3, 6, 16, 16]
    assert [size_cap(m, 16, 0.5) for m in (1, 2, 3)] == [2, 2, 3]
    assert size_cap(1, 16, None) == 16 and size_cap(3, 4, 2.0) == 4
    weak = SuffixIndex(16)
    weak.extend([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 9])  # only "9" matches: one token of evidence
    assert weak.continuations(weak.tokens).match_len == 1
    assert suffix_tree(weak, 16, 8, 0.01, None).size == 9  # 10 11 12 9 10 ... to the depth cap
    assert suffix_tree(weak, 16, 8, 0.01, 1.0).size == 2  # one token drafted
    assert suffix_tree(weak, 16, 8, 0.01, 3.0).size == 4
    strong = SuffixIndex(16)
    strong.extend(list(range(20, 32)) * 2 + [20, 21, 22, 23])  # a 4+-token match: 16 tokens of evidence
    assert strong.continuations(strong.tokens).match_len == 16
    assert suffix_tree(strong, 12, 12, 0.01, 1.0).size == 12


def _reference_replay(prompt, cont, budget, depth, threshold, spec_factor):
    """The suffix method's replay written out plainly: one index per shape, rebuilt step by step."""
    index = SuffixIndex(16)
    index.extend(list(prompt))
    steps, pos = [], 0
    while pos < len(cont):  # (a step drafts at most the levels it can commit, as the engine's: ``Drafter.depth``)
        tree = suffix_tree(index, budget, max(1, min(depth, len(cont) - pos - 1)), threshold, spec_factor)
        commit = min(accepted_along(tree, cont[pos:]) + 1, len(cont) - pos)
        steps.append((tree.size, commit))
        index.extend(list(cont[pos:pos + commit]))
        pos += commit
    return steps


def _repetitive_text(seed: int, n: int = 90, vocab: int = 12) -> list[int]:
    rng = random.Random(seed)
    motifs = [[rng.randrange(vocab) for _ in range(rng.randrange(2, 7))] for _ in range(3)]
    out: list[int] = []
    while len(out) < n:
        out += rng.choice(motifs) if rng.random() < 0.7 else [rng.randrange(vocab)]
    return out[:n]


@pytest.mark.parametrize("seed", range(4))
def test_lockstep_replay_of_many_shapes_equals_each_shape_replayed_alone(seed):
    from dyntree_core.drafting.suffix_replay import SuffixShape, replay_shapes

    text = _repetitive_text(seed)
    prompt, cont = text[:30], text[30:]
    shapes = [SuffixShape(n, d, q, f) for n in (2, 4, 8, 16) for d in (1, 3, 8) for q in (0.05, 0.3)
              for f in (0.5, 1.0, None)]
    replays = replay_shapes(prompt, cont, shapes)
    sizes = set()
    for s in shapes:
        got = [(st.size, st.committed) for st in replays[s].steps]
        assert got == _reference_replay(prompt, cont, s.budget, s.depth, s.threshold, s.spec_factor), s
        assert all(st.from_suffix for st in replays[s].steps) and replays[s].build_seconds > 0
        assert sum(c for _, c in got) == len(cont)
        sizes |= {n for n, _ in got}
    assert len(sizes) > 3  # the shapes really differ on this text


@pytest.mark.parametrize("seed", range(3))
def test_hybrid_replay_takes_the_suffix_tree_exactly_where_the_hybrid_drafter_does(seed):
    from dyntree_core.drafting import make_drafter
    from dyntree_core.drafting.suffix_replay import SuffixShape, replay_shapes

    text = _repetitive_text(seed + 10)
    prompt, cont = text[:25], text[25:]
    shape = SuffixShape(8, 4, 0.05, 1.0, hybrid=True)
    rep = replay_shapes(prompt, cont, [shape], {shape: 2})[shape]
    drafter = make_drafter(DecodeConfig(method="hybrid", budget=8, depth=4, threshold=0.05, spec_factor=1.0))
    model = PathFunctionSource(lambda path: torch.full((12,), 1 / 12), 12)  # (a model step's tree is not compared)
    pos = 0
    kinds = set()
    for st in rep.steps:
        drafter.reset(prompt + cont[:pos])
        tree = drafter.draft(model, (prompt + cont[:pos])[-1], torch.Generator(), True, levels=len(cont) - pos - 1)
        assert (drafter.last_source == "suffix") == st.from_suffix
        if st.from_suffix:
            assert tree.size == st.size and st.committed == min(accepted_along(tree, cont[pos:]) + 1, len(cont) - pos)
        else:
            assert (st.size, st.committed) == (8, min(2, len(cont) - pos))  # the caller's model-step estimate
        kinds.add(st.from_suffix)
        pos += st.committed
    assert pos == len(cont) and kinds == {True, False}


def test_auto_prices_hybrid_and_takes_it_where_text_repeats_in_parts_and_the_draft_is_cheap():
    from dyntree_core.planning.candidates import HYBRID_BUDGETS, HYBRID_DEPTHS, sequoia_shapes, simulate_suffix_shapes
    from dyntree_core.drafting.suffix_replay import SuffixShape

    rng = random.Random(1)
    block = [rng.randrange(100, 1000) for _ in range(12)]
    fresh = lambda: [rng.randrange(1000, 5000) for _ in range(12)]  # noqa: E731
    text = block + fresh() + block + fresh() + block + fresh() + block + fresh()
    texts = ((tuple(text[:24]), tuple(text[24:])),)
    vector = (0.8, 0.1, 0.05, 0.02)
    acc = Acceptance(vector, (), texts)
    prof = _profile([0.1, 0.1, 0.11, 0.12, 0.14, 0.2])  # trees are cheap, the draft costs 0.05 a forward
    prof = MachineProfile(key="k", machine=prof.machine, prefix_len=32, ns=NS, target=prof.target,
                          draft={"int8": [0.002] * 6}, other=[0.0] * 6)
    hybrid = [c for c in price_candidates(prof, acc, ["int8"], ["int8"], methods=("hybrid",))]
    assert {c.method for c in hybrid} == {"hybrid"}
    assert {(c.budget, c.depth) for c in hybrid} == {(n, d) for n in HYBRID_BUDGETS for d in HYBRID_DEPTHS}
    assert all(0.0 < c.model_share < 1.0 for c in hybrid)  # repeats: suffix steps; fresh text: model steps
    trees = sequoia_shapes(vector, HYBRID_BUDGETS, HYBRID_DEPTHS)
    for c in hybrid:
        size, g, levels = trees[(c.budget, c.depth)]
        assert c.draft_seconds >= c.model_share * 0.002 * len(levels)
        sh = SuffixShape(c.budget, c.depth, c.threshold, c.spec_factor, hybrid=True)
        stats = simulate_suffix_shapes(texts, [sh], {sh: max(1, round(g))})[sh]
        assert c.expected_tokens == pytest.approx(stats.suffix_tokens + stats.model_share * g)
        assert c.model_share == pytest.approx(stats.model_share)
    plan = choose(prof, acc, 0.0, ["int8"], ["int8"])
    assert plan.method == "hybrid", plan.reason
    assert "draft model on" in plan.reason and "suffix steps replayed" in plan.reason
    b = plan.best
    cfg = plan.apply(DecodeConfig())
    assert (cfg.method, cfg.budget, cfg.depth, cfg.threshold, cfg.spec_factor, cfg.draft_precision) == (
        "hybrid", b.budget, b.depth, b.threshold, b.spec_factor, "int8")
    best_suffix = min((c for c in plan.top if c.method == "suffix"), key=lambda c: c.seconds_per_token, default=None)
    assert best_suffix is None or best_suffix.seconds_per_token > b.seconds_per_token
    # text that never repeats: every hybrid step is a model step, priced as Sequoia's tree
    seq = random.Random(0).sample(range(1000), 80)
    plain = Acceptance(vector, (), ((tuple(seq[:40]), tuple(seq[40:])),))
    for c in price_candidates(prof, plain, ["int8"], ["int8"], methods=("hybrid",)):
        assert c.model_share == 1.0 and c.expected_tokens == pytest.approx(trees[(c.budget, c.depth)][1])
