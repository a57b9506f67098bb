"""Exact-enumeration proof that the stochastic verifiers are lossless.

For a toy draft/target pair whose next-token distributions depend on the whole path, we
enumerate every drafted tree (all sibling draws with their probabilities, without or with
replacement) and every random outcome of the verifier, by driving the production ``run``
method with a scripted ``Decisions`` that replays each branch. The output (accepted tokens +
bonus token), extended with target samples to ``max depth + 1`` tokens (Lemma A.1 of the
Traversal Verification paper), must equal the target joint to 1e-12. Negative controls pair
the wrong draft update with the sampling scheme and must be visibly off.
"""

from __future__ import annotations

import functools
import itertools
from collections import defaultdict
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Iterator

import numpy as np
import pytest
import torch

from dyntree_core.tree import TokenTree
from dyntree_core.verify import (
    GreedyVerifier,
    PointMassVerifier,
    TokenLevelVerifier,
    TraversalVerifier,
    VerifyResult,
)

ROOT_TOKEN = 0
Seq = tuple[int, ...]


# ---------------------------------------------------------------------- enumerating randomness
class ScriptedDecisions:
    """``Decisions`` that takes the branch indices in ``script`` and branch 0 past its end.

    Zero-probability branches are not offered. ``weight`` is the probability of the branch
    sequence taken; ``bernoulli_probs`` logs every acceptance probability that was tested.
    """

    def __init__(self, script: list[int]):
        self.script = script
        self.choices: list[int] = []
        self.n_options: list[int] = []
        self.weight = 1.0
        self.bernoulli_probs: list[float] = []

    def bernoulli(self, p: float) -> bool:
        self.bernoulli_probs.append(p)
        return self._take([(v, w) for v, w in ((True, p), (False, 1.0 - p)) if w > 0])

    def categorical(self, probs: np.ndarray) -> int:
        total = float(probs.sum())
        return self._take([(int(i), float(probs[i]) / total) for i in np.flatnonzero(probs > 0)])

    def _take(self, options: list[tuple]):
        i = len(self.choices)
        k = self.script[i] if i < len(self.script) else 0
        self.choices.append(k)
        self.n_options.append(len(options))
        self.weight *= options[k][1]
        return options[k][0]


def enumerate_outcomes(run: Callable[[ScriptedDecisions], VerifyResult]) -> list[tuple[VerifyResult, float, ScriptedDecisions]]:
    """Every outcome of ``run`` with its probability (depth-first over the decision tree)."""
    out = []
    script: list[int] = []
    while True:
        d = ScriptedDecisions(script)
        out.append((run(d), d.weight, d))
        j = len(d.choices) - 1
        while j >= 0 and d.choices[j] + 1 >= d.n_options[j]:
            j -= 1
        if j < 0:
            break
        script = d.choices[:j] + [d.choices[j] + 1]
    total = sum(w for _, w, _ in out)
    assert abs(total - 1.0) < 1e-12, f"verifier outcome probabilities sum to {total}"
    return out


# ---------------------------------------------------------------------- toy models and drafting
@dataclass(frozen=True)
class Toy:
    """Path-dependent toy target ``p(path)`` and draft ``q(path)`` over ``vocab`` tokens.

    With ``zeros`` each distribution has a path-dependent set of zero entries (at least two
    tokens keep mass), so supports differ between p and q and between contexts.
    """

    vocab: int
    zeros: bool
    salt: int = 0

    def p(self, path: Seq) -> np.ndarray:
        return _toy_dist(self, 1, path)

    def q(self, path: Seq) -> np.ndarray:
        return _toy_dist(self, 2, path)


@functools.lru_cache(maxsize=None)
def _toy_dist(toy: Toy, which: int, path: Seq) -> np.ndarray:
    rng = np.random.default_rng([toy.salt, toy.vocab, int(toy.zeros), which, len(path), *path])
    w = rng.dirichlet(np.full(toy.vocab, 0.8))
    if toy.zeros:
        n_zero = int(rng.integers(1, toy.vocab - 1))
        w[rng.choice(toy.vocab, size=n_zero, replace=False)] = 0.0
    return w / w.sum()


def node_paths(shape: list[int], tokens: list[int]) -> list[Seq]:
    """Token path (root token first) of every node."""
    paths: list[Seq] = []
    for i, par in enumerate(shape):
        paths.append((tokens[i],) if par < 0 else paths[par] + (tokens[i],))
    return paths


def sibling_draw_dist(q: np.ndarray, earlier: list[int], mode: str) -> np.ndarray:
    """Distribution of the next sibling given the earlier siblings' tokens.

    swor: q over the tokens not drawn yet, uniform over them once q has no mass left there.
    iid: q itself.
    """
    if mode == "iid":
        return q
    w = q.copy()
    w[earlier] = 0.0
    if w.sum() <= 0:
        w = np.ones_like(q)
        w[earlier] = 0.0
    return w / w.sum()


def drafted_token_lists(shape: list[int], toy: Toy, mode: str) -> Iterator[tuple[list[int], float]]:
    """Every token assignment the drafting process can produce, with its probability.

    Nodes are drawn in index order; siblings in index order are the draw order.
    """
    n = len(shape)
    tokens = [ROOT_TOKEN] + [-1] * (n - 1)

    def rec(i: int, prob: float) -> Iterator[tuple[list[int], float]]:
        if i == n:
            yield list(tokens), prob
            return
        par = shape[i]
        earlier = [tokens[j] for j in range(1, i) if shape[j] == par]
        q = toy.q(node_paths(shape[: par + 1], tokens[: par + 1])[par])
        dist = sibling_draw_dist(q, earlier, mode)
        for x in np.flatnonzero(dist > 0).tolist():
            tokens[i] = x
            yield from rec(i + 1, prob * float(dist[x]))
        tokens[i] = -1

    yield from rec(1, 1.0)


def topk_tokens(shape: list[int], toy: Toy) -> list[int]:
    """The deterministic top-k tree: the k-th child of a node is its k-th most likely draft token."""
    tokens = [ROOT_TOKEN] + [-1] * (len(shape) - 1)
    for i in range(1, len(shape)):
        par = shape[i]
        rank = sum(1 for j in range(1, i) if shape[j] == par)
        q = toy.q(node_paths(shape[: par + 1], tokens[: par + 1])[par])
        tokens[i] = int(np.argsort(-q, kind="stable")[rank])
    return tokens


def build_tree(shape: list[int], tokens: list[int], toy: Toy, sampled: str) -> tuple[TokenTree, torch.Tensor]:
    """TokenTree with draft rows at internal nodes, and its ``[N, V]`` target rows."""
    n = len(shape)
    paths = node_paths(shape, tokens)
    internal = sorted({p for p in shape if p >= 0})
    draft_row = [-1] * n
    for r, u in enumerate(internal):
        draft_row[u] = r
    rank = [sum(1 for j in range(1, i) if shape[j] == shape[i]) for i in range(n)]
    with np.errstate(divide="ignore"):
        logq = [0.0] + [float(np.log(toy.q(paths[shape[i]])[tokens[i]])) for i in range(1, n)]
    tree = TokenTree(
        tokens=torch.tensor(tokens, dtype=torch.long),
        parents=torch.tensor(shape, dtype=torch.long),
        child_rank=torch.tensor(rank, dtype=torch.long),
        draft_logprob=torch.tensor(logq, dtype=torch.float64),
        sampled=sampled,  # type: ignore[arg-type]
        draft_probs=torch.tensor(np.stack([toy.q(paths[u]) for u in internal]) if internal else np.zeros((0, toy.vocab))),
        draft_row=torch.tensor(draft_row, dtype=torch.long),
    )
    target = torch.tensor(np.stack([toy.p(path) for path in paths]))
    return tree, target


@functools.lru_cache(maxsize=None)
def drafted_trees(shape: tuple[int, ...], toy: Toy, mode: str) -> list[tuple[TokenTree, torch.Tensor, list[int], float]]:
    """(tree, target_probs, tokens, probability) for every drafted tree; ``mode`` may be topk."""
    if mode == "topk":
        tokens = topk_tokens(list(shape), toy)
        return [(*build_tree(list(shape), tokens, toy, "topk"), tokens, 1.0)]
    out = []
    for tokens, prob in drafted_token_lists(list(shape), toy, mode):
        tree, target = build_tree(list(shape), tokens, toy, mode)
        out.append((tree, target, tokens, prob))
    assert abs(sum(t[3] for t in out) - 1.0) < 1e-12
    return out


# ---------------------------------------------------------------------- joints
def output_joint(verifier, shape: tuple[int, ...], toy: Toy, mode: str) -> dict[Seq, float]:
    """P(accepted tokens + bonus token) over drafting and verifier randomness."""
    joint: dict[Seq, float] = defaultdict(float)
    for tree, target, tokens, w_tree in drafted_trees(shape, toy, mode):
        for res, w, _ in enumerate_outcomes(lambda d: verifier.run(tree, target, d)):
            seq = tuple(tokens[v] for v in res.path[1:]) + (res.bonus_token,)
            joint[seq] += w_tree * w
    return joint


def extend_to(joint: dict[Seq, float], toy: Toy, length: int) -> dict[Seq, float]:
    """Extend every output sequence with target samples to ``length`` tokens."""
    out: dict[Seq, float] = defaultdict(float)
    stack = list(joint.items())
    while stack:
        seq, w = stack.pop()
        if len(seq) == length:
            out[seq] += w
            continue
        p = toy.p((ROOT_TOKEN,) + seq)
        stack.extend((seq + (x,), w * float(p[x])) for x in np.flatnonzero(p > 0).tolist())
    return out


def target_joint(toy: Toy, length: int) -> dict[Seq, float]:
    """Target probability of every token sequence of ``length`` after the root."""
    out = {}
    for seq in itertools.product(range(toy.vocab), repeat=length):
        w = 1.0
        for i, x in enumerate(seq):
            w *= float(toy.p((ROOT_TOKEN,) + seq[:i])[x])
            if w == 0.0:
                break
        if w > 0.0:
            out[seq] = w
    return out


def joint_error(verifier, shape: tuple[int, ...], toy: Toy, mode: str) -> float:
    """Max |P_out - P_target| over sequences of ``tree depth + 1`` tokens."""
    depth = max(len(path) for path in node_paths(list(shape), [0] * len(shape))) - 1
    got = extend_to(output_joint(verifier, shape, toy, mode), toy, depth + 1)
    want = target_joint(toy, depth + 1)
    assert abs(sum(got.values()) - 1.0) < 1e-12
    return max(abs(got.get(s, 0.0) - want.get(s, 0.0)) for s in set(got) | set(want))


# ---------------------------------------------------------------------- losslessness
SHAPES = {
    "chain3": ((-1, 0, 1, 2), 4),
    "star3": ((-1, 0, 0, 0), 5),
    "binary2": ((-1, 0, 0, 1, 1, 2, 2), 3),
    "skewed": ((-1, 0, 0, 1, 1, 3), 3),
}
#: with this salt the star3 root's draft support (2 tokens) is smaller than its 3 children
LOSSLESS_SALT = 5
VERIFIERS = {"token_level": TokenLevelVerifier, "traversal": TraversalVerifier, "point_mass": PointMassVerifier}


@pytest.mark.parametrize("zeros", [False, True], ids=["dense", "zeros"])
@pytest.mark.parametrize("mode", ["swor", "iid"])
@pytest.mark.parametrize("shape_name", list(SHAPES))
@pytest.mark.parametrize("verifier_name", list(VERIFIERS))
def test_lossless_on_sampled_trees(verifier_name: str, shape_name: str, mode: str, zeros: bool) -> None:
    shape, vocab = SHAPES[shape_name]
    toy = Toy(vocab=vocab, zeros=zeros, salt=LOSSLESS_SALT)
    assert joint_error(VERIFIERS[verifier_name](), shape, toy, mode) < 1e-12


@pytest.mark.parametrize("zeros", [False, True], ids=["dense", "zeros"])
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_point_mass_lossless_on_topk_trees(shape_name: str, zeros: bool) -> None:
    shape, vocab = SHAPES[shape_name]
    assert joint_error(PointMassVerifier(), shape, Toy(vocab=vocab, zeros=zeros, salt=3), "topk") < 1e-12


def test_swor_fallback_is_exercised() -> None:
    """star3/swor/zeros draws children beyond the draft support (the uniform fallback) and
    the target puts mass outside the draft support, so the lossless test covers the fallback."""
    shape, vocab = SHAPES["star3"]
    toy = Toy(vocab=vocab, zeros=True, salt=LOSSLESS_SALT)
    q_root, p_root = toy.q((ROOT_TOKEN,)), toy.p((ROOT_TOKEN,))
    assert p_root[q_root == 0].sum() > 0
    fallback_trees = [t for t in drafted_trees(shape, toy, "swor") if (q_root[t[2][1:]] == 0).any()]
    assert fallback_trees and sum(t[3] for t in fallback_trees) > 0


@pytest.mark.parametrize("shape_name", ["star3", "binary2"])
@pytest.mark.parametrize("tree_mode,forced", [("swor", "iid"), ("iid", "swor")])
@pytest.mark.parametrize("cls", [TokenLevelVerifier, TraversalVerifier], ids=["token_level", "traversal"])
def test_mismatched_draft_update_is_lossy(cls, tree_mode: str, forced: str, shape_name: str) -> None:
    shape, vocab = SHAPES[shape_name]
    toy = Toy(vocab=vocab, zeros=False, salt=7)
    assert joint_error(cls(draft_update=forced), shape, toy, tree_mode) > 1e-6


def test_ratio_test_is_biased_on_topk_trees() -> None:
    """On a deterministic top-k tree the min(1, p/q) test (forced past the compatibility guard
    by relabelling the tree) is biased, while point_mass is exact on the same trees."""
    shape, vocab = SHAPES["star3"]
    toy = Toy(vocab=vocab, zeros=False, salt=3)
    tree, target, tokens, _ = drafted_trees(shape, toy, "topk")[0]
    relabelled = build_tree(list(shape), tokens, toy, "swor")
    joint: dict[Seq, float] = defaultdict(float)
    for res, w, _ in enumerate_outcomes(lambda d: TokenLevelVerifier().run(relabelled[0], relabelled[1], d)):
        joint[tuple(tokens[v] for v in res.path[1:]) + (res.bonus_token,)] += w
    got, want = extend_to(joint, toy, 2), target_joint(toy, 2)
    assert max(abs(got.get(s, 0.0) - want.get(s, 0.0)) for s in set(got) | set(want)) > 1e-6
    assert joint_error(PointMassVerifier(), shape, toy, "topk") < 1e-12


# ---------------------------------------------------------------------- reductions
@pytest.mark.parametrize("mode", ["swor", "iid"])
def test_traversal_equals_token_level_on_depth_one_trees(mode: str) -> None:
    """With only root children, Traversal is RRS(w): same outcome distribution per tree."""
    shape, vocab = SHAPES["star3"]
    toy = Toy(vocab=vocab, zeros=True, salt=11)
    for tree, target, _, _ in drafted_trees(shape, toy, mode):
        dists = []
        for verifier in (TokenLevelVerifier(), TraversalVerifier()):
            d: dict[tuple, float] = defaultdict(float)
            for res, w, _ in enumerate_outcomes(lambda s: verifier.run(tree, target, s)):
                d[(tuple(res.path), res.bonus_token)] += w
            dists.append(d)
        keys = set(dists[0]) | set(dists[1])
        assert max(abs(dists[0].get(k, 0.0) - dists[1].get(k, 0.0)) for k in keys) < 1e-12


def _p_ini_sum(tokens: list[int], toy: Toy) -> float:
    """sum_l p_ini(alpha_l) for a chain: p_0 = 1, p_l = min(p_{l-1} * p/q, 1)."""
    total, p_prev = 0.0, 1.0
    for i in range(1, len(tokens)):
        ctx = tuple(tokens[:i])
        p_prev = min(p_prev * toy.p(ctx)[tokens[i]] / toy.q(ctx)[tokens[i]], 1.0)
        total += p_prev
    return total


def test_traversal_chain_expected_length_is_the_block_verification_bound() -> None:
    """Chain: E[accepted] = E_{alpha ~ q}[sum_l p_ini(alpha_l)] (Thm 3.4), and >= token-level."""
    shape, vocab = SHAPES["chain3"]
    toy = Toy(vocab=vocab, zeros=False, salt=5)
    expected = {"traversal": 0.0, "token_level": 0.0}
    bound = 0.0
    for tree, target, tokens, w_tree in drafted_trees(shape, toy, "iid"):
        bound += w_tree * _p_ini_sum(tokens, toy)
        for name, verifier in (("traversal", TraversalVerifier()), ("token_level", TokenLevelVerifier())):
            for res, w, _ in enumerate_outcomes(lambda d: verifier.run(tree, target, d)):
                expected[name] += w_tree * w * (len(res.path) - 1)
    assert abs(expected["traversal"] - bound) < 1e-12
    assert expected["traversal"] > expected["token_level"] + 1e-3


@pytest.mark.parametrize("cls", [TokenLevelVerifier, TraversalVerifier, PointMassVerifier])
def test_one_hot_target_reduces_to_greedy(cls) -> None:
    """With one-hot targets every stochastic verifier is deterministic and agrees with greedy."""
    shape, vocab = SHAPES["binary2"]
    toy = Toy(vocab=vocab, zeros=False, salt=2)
    gen = np.random.default_rng(0)
    for tree, _, _, _ in drafted_trees(shape, toy, "swor")[::17]:
        target = torch.zeros(tree.size, vocab, dtype=torch.float64)
        target[torch.arange(tree.size), torch.as_tensor(gen.integers(0, vocab, tree.size))] = 1.0
        greedy = GreedyVerifier().verify(tree, target, gen)
        outcomes = enumerate_outcomes(lambda d: cls().run(tree, target, d))
        assert len(outcomes) == 1
        res = outcomes[0][0]
        assert (res.path, res.bonus_token) == (greedy.path, greedy.bonus_token)


# ---------------------------------------------------------------------- the paper's worked example
A, B, C = 0, 1, 2
MB = [0.3, 0.4, 0.3]
MS = [0.6, 0.3, 0.1]


def _figure1_tree(sampled: str = "swor") -> tuple[TokenTree, torch.Tensor]:
    """Traversal Verification Fig. 1: root -> X1=a {X3=b, X4=c}, X2=c {X5=a}; same Mb/Ms everywhere."""
    parents = [-1, 0, 0, 1, 1, 2]
    tree = TokenTree(
        tokens=torch.tensor([A, A, C, B, C, A]),
        parents=torch.tensor(parents),
        child_rank=torch.tensor([0, 0, 1, 0, 1, 0]),
        draft_logprob=torch.zeros(6, dtype=torch.float64),
        sampled=sampled,  # type: ignore[arg-type]
        draft_probs=torch.tensor([MS] * 3, dtype=torch.float64),
        draft_row=torch.tensor([0, 1, 2, -1, -1, -1]),
    )
    return tree, torch.tensor([MB] * 6, dtype=torch.float64)


def _accepted_dist(verifier) -> tuple[dict[Seq, float], list[tuple[VerifyResult, float, ScriptedDecisions]]]:
    """P(accepted draft tokens) on the Fig. 1 tree, and the raw enumerated outcomes."""
    tree, target = _figure1_tree()
    tokens = tree.tokens.tolist()
    outcomes = enumerate_outcomes(lambda d: verifier.run(tree, target, d))
    accepted: dict[Seq, float] = defaultdict(float)
    for res, w, _ in outcomes:
        accepted[tuple(tokens[v] for v in res.path[1:])] += w
    return accepted, outcomes


def _assert_dist(got: dict[Seq, float], want: dict[Seq, Fraction]) -> None:
    assert set(got) == set(want), (sorted(got), sorted(want))
    for k, v in want.items():
        assert abs(got[k] - float(v)) < 1e-12, (k, got[k], v)


def test_worked_example_traversal_output_distribution() -> None:
    accepted, outcomes = _accepted_dist(TraversalVerifier())
    _assert_dist(accepted, {(A, B): Fraction(2, 3), (A, C): Fraction(7, 33), (C, A): Fraction(2, 33), (C,): Fraction(2, 33)})
    assert abs(sum(w * len(s) for s, w in accepted.items()) - 64 / 33) < 1e-12
    bonus_after_c: dict[int, float] = defaultdict(float)
    for res, w, _ in outcomes:
        if res.path == [0, 2]:
            bonus_after_c[res.bonus_token] += w
    assert set(bonus_after_c) == {B, C}
    assert abs(bonus_after_c[B] - 2 / 99) < 1e-12 and abs(bonus_after_c[C] - 4 / 99) < 1e-12


def test_worked_example_traversal_acceptance_probabilities() -> None:
    """Post-order tests: X1X3 w.p. 2/3, then X1X4 w.p. 7/11 (X1's p' = 1/11 after X3's
    rejection, checked in the unit tests), then X1 has p = 0 and is dropped without a draw,
    then X2X5 w.p. 1/2, then X2 w.p. 1."""
    _, outcomes = _accepted_dist(TraversalVerifier())
    sequence = [2 / 3, 7 / 11, 1 / 2, 1.0]
    seen = set()
    for res, _, d in outcomes:
        probs = d.bernoulli_probs
        assert probs == pytest.approx(sequence[: len(probs)], abs=1e-15)
        seen.add(len(probs))
        if len(probs) >= 2:
            assert res.accept_prob[3] == pytest.approx(2 / 3) and res.accept_prob[4] == pytest.approx(7 / 11)
        if len(probs) >= 3:
            assert res.tested[1] and res.accept_prob[1] == 0.0
    assert seen == {1, 2, 3, 4}


def test_worked_example_token_level_gives_seven_quarters() -> None:
    accepted, _ = _accepted_dist(TokenLevelVerifier())
    _assert_dist(accepted, {(A, B): Fraction(1, 2), (C, A): Fraction(1, 4), (C,): Fraction(1, 4)})
    assert abs(sum(w * len(s) for s, w in accepted.items()) - 7 / 4) < 1e-12


def test_rng_driven_verify_matches_the_enumerated_distribution() -> None:
    """``verify`` (numpy Generator) samples the distribution that ``run`` enumerates: over 4,000
    runs every accepted path's frequency is within 0.03 of its probability. False alarm 6e-5, power
    0.99 against a shift of 0.047 or more in any path's probability (the 2/3 one at worst). n is
    kept: the tolerance is absolute, so the false-alarm rate falls only as n grows and 4,000 is the
    fewest runs that keep today's."""
    tree, target = _figure1_tree()
    rng = np.random.default_rng(1234)
    counts: dict[Seq, int] = defaultdict(int)
    n = 4000
    tokens = tree.tokens.tolist()
    for _ in range(n):
        res = TraversalVerifier().verify(tree, target, rng)
        counts[tuple(tokens[v] for v in res.path[1:])] += 1
    exact = {(A, B): 2 / 3, (A, C): 7 / 33, (C, A): 2 / 33, (C,): 2 / 33}
    assert set(counts) == set(exact)
    assert max(abs(counts[k] / n - v) for k, v in exact.items()) < 0.03
