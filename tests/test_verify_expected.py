"""Exact expected acceptance (``dyntree_core.verify.expected``) against exact enumeration of the
production verifiers on the lossless-test fixtures, the Traversal paper's worked example, and
Monte Carlo of ``verify`` on larger random trees."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch

from dyntree_core.tree import TokenTree
from dyntree_core.verify import IncompatibleTreeError, make_verifier
from dyntree_core.verify.expected import EXACT_VERIFIERS, expected_acceptance, expected_accepted
from test_verify_exact import (
    LOSSLESS_SALT,
    SHAPES,
    Toy,
    _figure1_tree,
    _p_ini_sum,
    drafted_trees,
    enumerate_outcomes,
)


def enumerated_on_path(verifier, tree: TokenTree, target: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """``([N] P(node on the accepted path), [N] P(node is the last accepted))`` by enumeration."""
    on_path = np.zeros(tree.size)
    final = np.zeros(tree.size)
    for res, w, _ in enumerate_outcomes(lambda d: verifier.run(tree, target, d)):
        on_path[res.path] += w
        final[res.path[-1]] += w
    return on_path, final


@pytest.mark.parametrize("zeros", [False, True], ids=["dense", "zeros"])
@pytest.mark.parametrize("mode", ["swor", "iid"])
@pytest.mark.parametrize("shape_name", list(SHAPES))
@pytest.mark.parametrize("name", ["token_level", "traversal", "point_mass"])
def test_matches_enumeration_on_every_drafted_tree(name: str, shape_name: str, mode: str, zeros: bool) -> None:
    shape, vocab = SHAPES[shape_name]
    toy = Toy(vocab=vocab, zeros=zeros, salt=LOSSLESS_SALT)
    trees = drafted_trees(shape, toy, mode)
    for tree, target, _, _ in trees[:: max(1, len(trees) // 40)]:
        want_on, want_final = enumerated_on_path(make_verifier(name), tree, target)
        got = expected_acceptance(tree, target, name)
        assert np.abs(got.on_path - want_on).max() < 1e-12
        assert np.abs(got.final - want_final).max() < 1e-12
        assert got.accepted == pytest.approx(float(want_on[1:].sum()), abs=1e-12)


@pytest.mark.parametrize("forced", ["swor", "iid"])
def test_forced_draft_update_matches_the_forced_verifier(forced: str) -> None:
    """The negative-control verifiers (mismatched update) have exact expectations too."""
    shape, vocab = SHAPES["binary2"]
    toy = Toy(vocab=vocab, zeros=False, salt=7)
    cls = type(make_verifier("traversal"))
    for tree, target, _, _ in drafted_trees(shape, toy, "iid" if forced == "swor" else "swor")[::25]:
        want_on, _ = enumerated_on_path(cls(draft_update=forced), tree, target)
        got = expected_acceptance(tree, target, "traversal", draft_update=forced)
        assert np.abs(got.on_path - want_on).max() < 1e-12


@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_topk_trees_point_mass_and_greedy(shape_name: str) -> None:
    shape, vocab = SHAPES[shape_name]
    tree, target, _, _ = drafted_trees(shape, Toy(vocab=vocab, zeros=True, salt=3), "topk")[0]
    want_on, _ = enumerated_on_path(make_verifier("point_mass"), tree, target)
    assert np.abs(expected_acceptance(tree, target, "point_mass").on_path - want_on).max() < 1e-12
    greedy = make_verifier("greedy").verify(tree, target, np.random.default_rng(0))
    exp = expected_acceptance(tree, target, "greedy")
    assert exp.accepted == len(greedy.path) - 1
    assert exp.final[greedy.path[-1]] == 1.0 and exp.final.sum() == 1.0
    for name in ("token_level", "traversal"):
        with pytest.raises(IncompatibleTreeError):
            expected_acceptance(tree, target, name)


def test_worked_example_values() -> None:
    """Traversal Fig. 1: E = 64/33 (traversal) vs 7/4 (token-level), and the per-node values."""
    tree, target = _figure1_tree()
    trav = expected_acceptance(tree, target, "traversal")
    assert trav.accepted == pytest.approx(64 / 33, abs=1e-12)
    # nodes: 1=a, 2=c, 3=ab, 4=ac, 5=ca; final: ab 2/3, ac 7/33, ca 2/33, c 2/33
    assert trav.final == pytest.approx([0, 0, 2 / 33, 2 / 3, 7 / 33, 2 / 33], abs=1e-12)
    assert trav.on_path == pytest.approx([1, 2 / 3 + 7 / 33, 4 / 33, 2 / 3, 7 / 33, 2 / 33], abs=1e-12)
    assert expected_accepted(tree, target, "token_level") == pytest.approx(7 / 4, abs=1e-12)


def test_traversal_chain_is_the_block_verification_bound() -> None:
    """Over chains drafted from q, traversal's expectation is E_alpha[sum_l p_ini(alpha_l)] (Thm 3.4;
    per chain it is not), and it is at least token-level's."""
    shape, vocab = SHAPES["chain3"]
    toy = Toy(vocab=vocab, zeros=False, salt=5)
    trav = tl = bound = 0.0
    for tree, target, tokens, w in drafted_trees(shape, toy, "iid"):
        bound += w * _p_ini_sum(tokens, toy)
        trav += w * expected_accepted(tree, target, "traversal")
        tl += w * expected_accepted(tree, target, "token_level")
    assert trav == pytest.approx(bound, abs=1e-12)
    assert trav > tl + 1e-3


def _random_tree(rng: np.random.Generator, n: int, vocab: int, sampled: str, peak: float) -> tuple[TokenTree, torch.Tensor]:
    """A random tree of ``n`` nodes whose siblings are drawn from per-node random draft rows."""
    parents = [-1]
    for i in range(1, n):
        parents.append(int(rng.integers(0, i)))
    kids: dict[int, list[int]] = defaultdict(list)
    for i in range(1, n):
        kids[parents[i]].append(i)
    internal = sorted(kids)
    q = rng.dirichlet(np.full(vocab, peak), size=len(internal))
    p = rng.dirichlet(np.full(vocab, peak), size=n)
    tokens = [0] * n
    rank = [0] * n
    for r, u in enumerate(internal):
        w = q[r].copy()
        for k, c in enumerate(kids[u]):
            tokens[c] = int(rng.choice(vocab, p=w / w.sum()))
            rank[c] = k
            if sampled == "swor":
                w[tokens[c]] = 0.0
    draft_row = [-1] * n
    for r, u in enumerate(internal):
        draft_row[u] = r
    tree = TokenTree(
        tokens=torch.tensor(tokens), parents=torch.tensor(parents), child_rank=torch.tensor(rank),
        draft_logprob=torch.zeros(n, dtype=torch.float64), sampled=sampled,  # type: ignore[arg-type]
        draft_probs=torch.tensor(q), draft_row=torch.tensor(draft_row),
    )
    return tree, torch.tensor(p)


#: verifier runs per random tree in the Monte Carlo check (sized in its docstring)
MC_RUNS = 2310


@pytest.mark.parametrize("sampled", ["swor", "iid"])
@pytest.mark.parametrize("name", ["token_level", "traversal", "point_mass"])
def test_matches_monte_carlo_of_verify_on_random_trees(name: str, sampled: str) -> None:
    """On 16-node random trees (V = 12, max 4 siblings) the verifier's mean accepted length over
    MC_RUNS runs lies within 4.5 standard errors of the exact expectation, and each node's
    on-path frequency within 4.5 standard errors of its probability (+ 1e-3).

    False alarm: 17 checks per tree, 3 trees, each two-sided at 4.5 exact standard errors
    (6.8e-6): <= 3.5e-4 per parameter set. Power: the bug it must catch is a verifier whose
    sibling draft update does not match how the tree was drawn (swor verified as iid). On this
    test's swor trees that moves a node's on-path probability by up to 0.047 (token_level) and
    0.094 (traversal); the fewest runs at which the most-moved node fails with probability >= 0.99
    is 2,310 (token_level; traversal needs 500), so MC_RUNS = 2,310 (was 3,000). point_mass has no
    draft update; sampling below a matched node from the parent's row moves a node by up to 0.046
    on its swor trees (100 runs catch it). On the iid trees these bugs move no node by more than
    0.006, below what an affordable run count resolves; there the test catches a node off by
    >= 0.072 with power 0.99 (at on-path probability 0.5, the worst case), and
    ``test_matches_enumeration_on_every_drafted_tree`` checks every verifier exactly. The trees
    come from their own generator, so they do not depend on the run count."""
    tree_rng = np.random.default_rng([17, len(name), len(sampled)])
    rng = np.random.default_rng([18, len(name), len(sampled)])
    verifier = make_verifier(name)
    for _ in range(3):
        while True:
            tree, target = _random_tree(tree_rng, 16, 12, sampled, peak=0.3)
            if max(len(k) for k in tree.children()) <= 4:
                break
        exp = expected_acceptance(tree, target, name)
        runs = MC_RUNS
        lengths = np.empty(runs)
        hits = np.zeros(tree.size)
        for i in range(runs):
            path = verifier.verify(tree, target, rng).path
            lengths[i] = len(path) - 1
            hits[path] += 1
        # the exact standard error: the nodes on the path are the last accepted node w and its
        # ancestors, so E[L^2] = sum_w P(w on path) (2 depth(w) - 1) (a tree that rarely accepts
        # anything gives a sample standard deviation of 0, and the sample's error no 4.5 sigma bound)
        depth = tree.depth.numpy()[1:]
        var = float((exp.on_path[1:] * (2 * depth - 1)).sum()) - exp.accepted ** 2
        se = np.sqrt(max(var, 0.0) / runs)
        assert abs(lengths.mean() - exp.accepted) < 4.5 * se + 1e-9
        freq = hits / runs
        node_se = np.sqrt(np.clip(exp.on_path * (1 - exp.on_path), 0.0, None) / runs)
        assert (np.abs(freq - exp.on_path) <= 4.5 * node_se + 1e-3).all()


def test_unknown_verifier_is_a_clear_error() -> None:
    tree, target = _figure1_tree()
    with pytest.raises(ValueError, match="choose one of"):
        expected_acceptance(tree, target, "block")
    assert set(EXACT_VERIFIERS) == {"greedy", "token_level", "traversal", "point_mass"}
