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
from dyntree_core.auto import Acceptance, choose, price_candidates, simulate_suffix
from dyntree_core.drafting.suffix import accepted_along, replay_suffix, size_cap, suffix_tree
from dyntree_core.drafting.suffix_index import SuffixIndex
from dyntree_core.machine_profile import MachineProfile
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


def _profile(target_row, verify=None) -> MachineProfile:
    return MachineProfile(key="k", machine={"cpu_model": "test cpu", "cpu_class": "avx2"}, prefix_len=32, ns=NS,
                          target={"int8": target_row}, draft={"int8": [0.05] * 6}, verify=verify or [0.0] * 6)


def test_auto_prices_suffix_from_the_replay_and_configures_it():
    repeat = [5, 6, 7, 8, 9] * 8
    texts = ((tuple(repeat[:20]), tuple(repeat[20:])),)
    acc = Acceptance((0.2,), (), texts)
    prof = _profile([0.1, 0.1, 0.11, 0.12, 0.14, 0.2])  # flat-ish: trees are cheap
    cands = [c for c in price_candidates(prof, acc, ["int8"], ["int8"], methods=("suffix",))]
    assert cands and all(c.method == "suffix" and c.draft_seconds < 0.01 for c in cands)
    best = min(cands, key=lambda c: c.seconds_per_token)
    stats = simulate_suffix(texts, best.budget, best.depth, best.threshold, best.spec_factor)
    assert best.expected_tokens == pytest.approx(stats.tokens)
    steps = replay_suffix(texts[0][0], texts[0][1], best.budget, best.depth, best.threshold, best.spec_factor)
    assert stats.tokens == pytest.approx(sum(c for _, c in steps) / len(steps)) and stats.tokens > 4
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
