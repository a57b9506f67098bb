"""Unit tests of the pure verifiers: greedy on hand-built trees, the update rules, result
bookkeeping, the registry and the error messages. Losslessness is in test_verify_exact.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dyntree_core.tree import TokenTree, chain_tree, tree_from_parents
from dyntree_core.verify import (
    VERIFIER_NAMES,
    GreedyVerifier,
    IncompatibleTreeError,
    PointMassVerifier,
    RngDecisions,
    TokenLevelVerifier,
    TraversalVerifier,
    Verifier,
    make_verifier,
)
from dyntree_core.verify.common import SiblingDraft, ratio_accept, residual_update, sample_index

NAN = float("nan")


class ScriptedAnswers:
    """Decisions with fixed Bernoulli answers (in order) and argmax categorical draws."""

    def __init__(self, answers: list[bool]):
        self.answers = list(answers)
        self.asked: list[float] = []

    def bernoulli(self, p: float) -> bool:
        self.asked.append(p)
        return self.answers.pop(0)

    def categorical(self, probs: np.ndarray) -> int:
        return int(np.argmax(probs))


def with_drafts(tree: TokenTree, draft: torch.Tensor) -> TokenTree:
    """``tree`` with draft row i = ``draft[i]`` for every node (``[N, V]``)."""
    tree.draft_probs = draft
    tree.draft_row = torch.arange(tree.size)
    return tree


def one_hot_scores(argmax: list[int], vocab: int) -> torch.Tensor:
    """``[N, V]`` scores (negative, like logits) whose row argmaxes are ``argmax``."""
    scores = -5.0 - torch.rand(len(argmax), vocab, generator=torch.Generator().manual_seed(0))
    scores[torch.arange(len(argmax)), torch.tensor(argmax)] = -1.0
    return scores


def assert_arrays(got: np.ndarray, want: list[float]) -> None:
    np.testing.assert_allclose(got, np.array(want, dtype=np.float64), rtol=0, atol=1e-15)


# ---------------------------------------------------------------------- greedy
def test_greedy_accepts_a_fully_matching_chain() -> None:
    tree = chain_tree([9, 1, 2, 3])
    res = GreedyVerifier().verify(tree, one_hot_scores([1, 2, 3, 4], 6), np.random.default_rng(0))
    assert res.path == [0, 1, 2, 3] and res.bonus_token == 4
    assert res.tested.tolist() == [False, True, True, True]
    assert_arrays(res.accept_prob, [NAN, 1, 1, 1])


def test_greedy_tests_siblings_in_draw_order_up_to_the_match() -> None:
    # root -> 1(5) 2(6) 3(7); 3 -> 4(2) 5(0); argmax: root 7, node 3 -> 0, node 5 -> 3
    tree = tree_from_parents([-1, 0, 0, 0, 3, 3], tokens=[9, 5, 6, 7, 2, 0], sampled="topk")
    res = GreedyVerifier().verify(tree, one_hot_scores([7, 1, 1, 0, 1, 3], 8), np.random.default_rng(0))
    assert res.path == [0, 3, 5] and res.bonus_token == 3
    assert res.tested.tolist() == [False, True, True, True, True, True]
    assert_arrays(res.accept_prob, [NAN, 0, 0, 1, 0, 1])


def test_greedy_follows_child_rank_not_node_index() -> None:
    # nodes 1 and 2 both carry the argmax token 4; node 2 was drawn first (rank 0)
    tree = tree_from_parents([-1, 0, 0, 2], tokens=[9, 4, 4, 1], sampled="iid", child_rank=[0, 1, 0, 0])
    res = GreedyVerifier().verify(tree, one_hot_scores([4, 3, 1, 2], 5), np.random.default_rng(0))
    assert res.path == [0, 2, 3] and res.bonus_token == 2
    assert res.tested.tolist() == [False, False, True, True]


def test_greedy_with_no_match_returns_the_root_argmax() -> None:
    tree = tree_from_parents([-1, 0, 0], tokens=[9, 1, 2])
    scores = one_hot_scores([3, 0, 0], 5)
    res = GreedyVerifier().verify(tree, scores, np.random.default_rng(0))
    assert res.path == [0] and res.bonus_token == 3
    assert_arrays(res.accept_prob, [NAN, 0, 0])
    assert_arrays(res.p_target, [NAN, float(scores[0, 1]), float(scores[0, 2])])


def _naive_greedy(tree: TokenTree, scores: torch.Tensor) -> tuple[list[int], int]:
    argmax = scores.argmax(-1).tolist()
    kids, tokens = tree.children(), tree.tokens.tolist()
    path = [0]
    while True:
        nxt = [c for c in kids[path[-1]] if tokens[c] == argmax[path[-1]]]
        if not nxt:
            return path, argmax[path[-1]]
        path.append(nxt[0])


def test_greedy_matches_a_naive_walk_on_random_trees() -> None:
    gen = np.random.default_rng(5)
    for _ in range(20):
        n, vocab = 300, 40
        parents = [-1] + [int(gen.integers(0, i)) for i in range(1, n)]
        scores = torch.tensor(gen.normal(size=(n, vocab)))
        argmax = scores.argmax(-1).tolist()
        tokens = [0] + [argmax[p] if gen.random() < 0.6 else int(gen.integers(0, vocab)) for p in parents[1:]]
        rank = gen.permutation(n).tolist()  # any distinct ranks give a valid draw order
        tree = tree_from_parents(parents, tokens=tokens, sampled="iid", child_rank=rank)
        res = GreedyVerifier().verify(tree, scores, gen)
        assert (res.path, res.bonus_token) == _naive_greedy(tree, scores)


# ---------------------------------------------------------------------- update rules
MB = np.array([0.3, 0.4, 0.3])
MS = np.array([0.6, 0.3, 0.1])


def test_traversal_parent_update_of_the_worked_example() -> None:
    p_new, mb_new = residual_update(0.5, MB.copy(), MS.copy())
    assert p_new == pytest.approx(1 / 11, abs=1e-15)
    assert_arrays(mb_new, [0, 0, 1])
    p_again, _ = residual_update(p_new, mb_new, np.array([6 / 7, 0, 1 / 7]))
    assert p_again == 0.0


def test_residual_update_keeps_p_one_and_gives_the_token_level_residual() -> None:
    p_new, mb_new = residual_update(1.0, MB.copy(), MS.copy())
    assert p_new == 1.0
    assert_arrays(mb_new, [0, 1 / 3, 2 / 3])


def test_residual_update_with_no_mass_leaves_the_distribution() -> None:
    mb = np.array([0.5, 0.5, 0.0])
    p_new, mb_new = residual_update(1.0, mb, mb.copy())
    assert p_new == 1.0 and mb_new is mb
    assert residual_update(0.4, mb, mb.copy())[0] == 0.0


def test_sibling_draft_without_replacement_and_fallback() -> None:
    draft = SiblingDraft(MS.copy(), "swor")
    draft.after_draw(1)
    assert_arrays(draft.q, [6 / 7, 0, 1 / 7])
    draft = SiblingDraft(np.array([0.5, 0.5, 0.0, 0.0]), "swor")
    draft.after_draw(0)
    assert_arrays(draft.q, [0, 1, 0, 0])
    draft.after_draw(1)
    assert_arrays(draft.q, [0, 0, 0.5, 0.5])  # draft mass exhausted: uniform over undrawn tokens
    draft.after_draw(3)
    assert_arrays(draft.q, [0, 0, 1, 0])


def test_sibling_draft_with_replacement_is_unchanged() -> None:
    draft = SiblingDraft(MS.copy(), "iid")
    draft.after_draw(0)
    assert_arrays(draft.q, MS.tolist())


def test_ratio_accept_limits() -> None:
    assert ratio_accept(0.3, 0.6) == 0.5
    assert ratio_accept(0.4, 0.3) == 1.0
    assert ratio_accept(0.2, 0.0) == 1.0
    assert ratio_accept(0.0, 0.0) == 0.0
    assert ratio_accept(0.0, 0.5) == 0.0


def test_sample_index_never_returns_a_zero_weight_token() -> None:
    w = np.array([0.0, 2.0, 0.0, 1.0, 0.0])
    assert sample_index(w, 0.0) == 1
    assert sample_index(w, 0.66) == 1
    assert sample_index(w, 0.67) == 3
    assert sample_index(w, np.nextafter(1.0, 0.0)) == 3
    with pytest.raises(ValueError, match="no mass"):
        sample_index(np.zeros(3), 0.5)


# ---------------------------------------------------------------------- token-level and point-mass details
def test_token_level_rrsw_example() -> None:
    """RRSw: a rejected (p = 0.5), then b is tested with 4/9 and the bonus comes from the residual."""
    tree = with_drafts(tree_from_parents([-1, 0, 0], tokens=[2, 0, 1]), torch.tensor([MS.tolist()] * 3, dtype=torch.float64))
    target = torch.tensor([MB.tolist()] * 3, dtype=torch.float64)
    answers = ScriptedAnswers([False, False])
    res = TokenLevelVerifier().run(tree, target, answers)
    assert answers.asked == pytest.approx([0.5, 4 / 9])
    assert res.path == [0] and res.bonus_token == 2  # residual after both rejections is [0, 0, 1]
    assert_arrays(res.accept_prob, [NAN, 0.5, 4 / 9])
    assert_arrays(res.p_target, [NAN, 0.3, 0.4])


def test_token_level_bonus_is_from_the_raw_target_when_nothing_was_rejected() -> None:
    tree = with_drafts(chain_tree([0, 1], sampled="swor"), torch.tensor([[0.2, 0.8, 0.0], [0.1, 0.1, 0.8]]))
    target = torch.tensor([[0.1, 0.9, 0.0], [0.1, 0.6, 0.3]])
    res = TokenLevelVerifier().run(tree, target, ScriptedAnswers([True]))
    assert res.path == [0, 1] and res.bonus_token == 1


def test_point_mass_reports_a_priori_match_probabilities() -> None:
    tree = tree_from_parents([-1, 0, 0, 0, 1], tokens=[0, 2, 1, 2, 0], sampled="iid")
    target = torch.tensor([[0.1, 0.3, 0.6], [0.7, 0.2, 0.1], [1 / 3] * 3, [1 / 3] * 3, [0.0, 0.0, 1.0]], dtype=torch.float64)
    res = PointMassVerifier().run(tree, target, ScriptedAnswers([]))
    assert res.path == [0, 1, 4] and res.bonus_token == 2
    assert_arrays(res.accept_prob, [NAN, 0.6, 0.3, 0.0, 0.7])  # node 3 duplicates node 1's token
    assert res.tested.tolist() == [False, True, True, True, True]


def _random_case(n: int, vocab: int, sampled: str, seed: int) -> tuple[TokenTree, torch.Tensor]:
    gen = np.random.default_rng(seed)
    parents = [-1] + [int(gen.integers(0, i)) for i in range(1, n)]
    draft = gen.dirichlet(np.full(vocab, 0.3), size=n)
    tokens = [0] * n
    kids: dict[int, list[int]] = {}
    for i in range(1, n):
        taken = [tokens[c] for c in kids.setdefault(parents[i], [])]
        w = draft[parents[i]].copy()
        if sampled == "swor":
            w[taken] = 0.0
            w = w if w.sum() > 0 else np.where(np.isin(np.arange(vocab), taken), 0.0, 1.0)
        tokens[i] = int(gen.choice(vocab, p=w / w.sum()))
        kids[parents[i]].append(i)
    tree = with_drafts(tree_from_parents(parents, tokens=tokens, sampled=sampled), torch.tensor(draft))
    return tree, torch.tensor(gen.dirichlet(np.full(vocab, 0.3), size=n))


@pytest.mark.parametrize("sampled", ["swor", "iid"])
@pytest.mark.parametrize("name", ["token_level", "traversal", "point_mass"])
def test_result_invariants_on_random_trees(name: str, sampled: str) -> None:
    """On random trees against sparse targets (a third of each row is 0): the path runs from the root
    along parent links through tokens the target can produce, the bonus is one it can produce after
    the path's end, and a path node's test never passed with probability 0."""
    for seed in range(10):
        tree, target = _random_case(40, 12, sampled, seed)
        target = target * (torch.rand(target.shape, generator=torch.Generator().manual_seed(seed)) > 1 / 3)
        target[:, 0] += (target.sum(-1) == 0).to(target.dtype)  # (never an all-zero row)
        target = target / target.sum(-1, keepdim=True)
        res = make_verifier(name).verify(tree, target, np.random.default_rng(seed))
        parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
        assert res.path[0] == 0 and all(parents[b] == a for a, b in zip(res.path, res.path[1:]))
        assert all(target[parents[v], tokens[v]] > 0 for v in res.path[1:])
        assert 0 <= res.bonus_token < 12 and target[res.path[-1], res.bonus_token] > 0
        on_path = [v for v in res.path[1:] if res.tested[v]]
        assert all(res.accept_prob[v] > 0 for v in on_path)
        probs = res.accept_prob[res.tested]
        assert np.all((probs >= 0) & (probs <= 1)) and np.isnan(res.accept_prob[~res.tested]).all()
        if name != "traversal":  # traversal accepts a path's inner nodes through a descendant's test
            assert res.tested[res.path[1:]].all()
        want = target[tree.parents.clamp(min=0), tree.tokens].numpy()
        assert_arrays(res.p_target[1:], want[1:].tolist())
        assert math.isnan(res.p_target[0]) and res.accept_prob.shape == res.tested.shape == (tree.size,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(VERIFIER_NAMES))
def test_low_precision_targets_are_accepted(name: str, dtype: torch.dtype) -> None:
    tree, target = _random_case(20, 8, "swor", 1)
    res = make_verifier(name).verify(tree, target.to(dtype), np.random.default_rng(0))
    assert res.p_target.dtype == np.float64 and res.accept_prob.dtype == np.float64


def test_rng_decisions_use_the_generator() -> None:
    a, b = RngDecisions(np.random.default_rng(3)), RngDecisions(np.random.default_rng(3))
    assert [a.bernoulli(0.5) for _ in range(20)] == [b.bernoulli(0.5) for _ in range(20)]
    assert a.bernoulli(1.0) and not a.bernoulli(0.0)
    assert a.categorical(np.array([0.0, 0.0, 3.0])) == 2


def test_traversal_handles_the_deepest_configurable_chain() -> None:
    """Depth 256 (DecodeConfig's cap) stays within Python's recursion limit."""
    n, vocab = 257, 4
    tree = with_drafts(chain_tree([1] * n, sampled="swor"), torch.full((n, vocab), 1 / vocab, dtype=torch.float64))
    target = torch.zeros(n, vocab, dtype=torch.float64)
    target[:, 1] = 1.0
    res = TraversalVerifier().verify(tree, target, np.random.default_rng(0))
    assert res.path == list(range(n)) and res.bonus_token == 1


# ---------------------------------------------------------------------- registry and errors
def test_registry_builds_every_verifier() -> None:
    assert set(VERIFIER_NAMES) == {"greedy", "token_level", "traversal", "point_mass"}
    for name in VERIFIER_NAMES:
        verifier = make_verifier(name)
        assert isinstance(verifier, Verifier) and verifier.name == name


def test_registry_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match=r"unknown verifier 'rrs'; choose one of \['greedy'"):
        make_verifier("rrs")


@pytest.mark.parametrize("cls", [TokenLevelVerifier, TraversalVerifier])
def test_forced_draft_update_is_validated(cls) -> None:
    with pytest.raises(ValueError, match="draft_update must be None, 'swor' or 'iid', got 'topk'"):
        cls(draft_update="topk")


@pytest.mark.parametrize("name", ["token_level", "traversal"])
def test_ratio_verifiers_refuse_topk_trees(name: str) -> None:
    tree, target = _random_case(6, 5, "swor", 0)
    tree.sampled = "topk"
    with pytest.raises(IncompatibleTreeError, match=rf"verifier '{name}' cannot verify .*'topk'.*\['iid', 'swor'\]"):
        make_verifier(name).verify(tree, target, np.random.default_rng(0))


@pytest.mark.parametrize("name", ["greedy", "point_mass"])
def test_matching_verifiers_accept_topk_trees(name: str) -> None:
    tree, target = _random_case(6, 5, "swor", 0)
    tree.sampled = "topk"
    assert make_verifier(name).verify(tree, target, np.random.default_rng(0)).path[0] == 0


@pytest.mark.parametrize("name", list(VERIFIER_NAMES))
def test_target_shape_is_checked(name: str) -> None:
    tree, target = _random_case(6, 5, "swor", 0)
    with pytest.raises(ValueError, match=r"target_probs must have shape \[6, V\]"):
        make_verifier(name).verify(tree, target[:5], np.random.default_rng(0))


@pytest.mark.parametrize("name", ["token_level", "traversal"])
def test_missing_draft_distribution_is_reported(name: str) -> None:
    tree, target = _random_case(6, 5, "swor", 0)
    tree.draft_row = torch.full((6,), -1)
    with pytest.raises(ValueError, match=rf"'{name}' needs the draft distribution of internal node 0"):
        make_verifier(name).verify(tree, target, np.random.default_rng(0))
    tree.draft_probs = None
    with pytest.raises(ValueError, match="tree has no draft_probs"):
        make_verifier(name).verify(tree, target, np.random.default_rng(0))


@pytest.mark.parametrize("name", ["token_level", "traversal"])
def test_draft_vocab_mismatch_is_reported(name: str) -> None:
    tree, target = _random_case(6, 5, "swor", 0)
    tree.draft_probs = torch.cat([tree.draft_probs, torch.zeros(6, 1, dtype=tree.draft_probs.dtype)], dim=1)
    with pytest.raises(ValueError, match="draft distributions have 6 tokens but target_probs has 5"):
        make_verifier(name).verify(tree, target, np.random.default_rng(0))


@pytest.mark.parametrize("name", ["token_level", "traversal"])
def test_duplicate_siblings_in_a_swor_tree_are_refused(name: str) -> None:
    tree = with_drafts(tree_from_parents([-1, 0, 0], tokens=[0, 1, 1]), torch.tensor([[0.0, 1.0, 0.0]] * 3))
    target = torch.tensor([[0.0, 0.0, 1.0]] * 3)  # both children get rejected
    with pytest.raises(ValueError, match="node 0 has two children with token 1"):
        make_verifier(name).verify(tree, target, np.random.default_rng(0))
