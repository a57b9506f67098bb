"""Target rows formed on demand from logits (``LogitRows``) answer exactly what the dense
probability matrix answers, and the engine forms only the rows its verifier visits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dyntree_core import DecodeConfig, SpeculativeDecoder
from dyntree_core.sampling import probs_from_logits
from dyntree_core.testing import tiny_pair
from dyntree_core.verify import DenseRows, LogitRows, make_verifier
from test_verify_expected import _random_tree


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (0.6, 1.0), (1.0, 0.9)])
def test_logit_rows_equal_the_dense_matrix(temperature: float, top_p: float) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 50, generator=gen) * 3
    dense_probs = probs_from_logits(logits, temperature, top_p) if temperature > 0 else torch.softmax(logits, -1)
    lazy, dense = LogitRows(logits, temperature, top_p), DenseRows(dense_probs)
    assert lazy.shape == dense.shape == (9, 50)
    for r in (0, 4, 8):
        np.testing.assert_array_equal(lazy.row(r), dense.row(r))
    par, tok = torch.tensor([0, 0, 3, 8]), torch.tensor([1, 7, 2, 49])
    np.testing.assert_allclose(lazy.token_probs(par, tok), dense.token_probs(par, tok), rtol=1e-5, atol=1e-9)
    np.testing.assert_array_equal(lazy.argmax(), logits.argmax(-1).numpy())
    assert lazy.rows_formed == 3


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (0.7, 1.0), (1.0, 0.8)])
def test_rows_of_a_permuted_forward_map_back_to_node_ids(temperature: float, top_p: float) -> None:
    """The engine's forward runs the tree in another node order: row ``slot[i]`` holds node i."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(11, 30, generator=gen) * 3  # node order
    perm = torch.randperm(11, generator=gen)  # slot -> node
    slot = torch.empty_like(perm)
    slot[perm] = torch.arange(11)
    mapped, plain = LogitRows(logits[perm], temperature, top_p, row_of_node=slot), LogitRows(logits, temperature, top_p)
    for r in range(11):
        np.testing.assert_array_equal(mapped.row(r), plain.row(r))
    par, tok = torch.tensor([0, 2, 2, 10, 5]), torch.tensor([3, 0, 29, 7, 7])
    np.testing.assert_allclose(mapped.token_probs(par, tok), plain.token_probs(par, tok), rtol=1e-6)
    np.testing.assert_array_equal(mapped.argmax(), plain.argmax())
    with pytest.raises(ValueError, match="row_of_node"):
        LogitRows(logits, temperature, top_p, row_of_node=slot[:5])


@pytest.mark.parametrize("name", ["token_level", "traversal", "point_mass"])
def test_verifiers_decide_the_same_on_lazy_and_dense_rows(name: str) -> None:
    rng = np.random.default_rng(3)
    for trial in range(20):
        tree, _ = _random_tree(rng, 24, 40, "swor", peak=0.3)
        logits = torch.tensor(rng.normal(size=(tree.size, 40)) * 2, dtype=torch.float32)
        a = make_verifier(name).verify(tree, LogitRows(logits, 0.8), np.random.default_rng(trial))
        b = make_verifier(name).verify(tree, probs_from_logits(logits, 0.8), np.random.default_rng(trial))
        assert (a.path, a.bonus_token) == (b.path, b.bonus_token)
        np.testing.assert_allclose(a.p_target, b.p_target, rtol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_forms_only_the_rows_its_verifier_visits(temperature: float) -> None:
    draft, target = tiny_pair(vocab=64, seed=1)
    seen: list[tuple[int, int, int]] = []

    def observe(tree, rows, result) -> None:
        seen.append((tree.size, rows.rows_formed, int(result.tested.sum())))

    cfg = DecodeConfig(method="dyspec_greedy", temperature=temperature, budget=32, depth=4, seed=0)
    dec = SpeculativeDecoder(draft, target, cfg, on_verify=observe)
    dec.generate_ids([3, 5, 7], 24)
    assert seen
    if temperature == 0:
        assert all(formed == 0 for _, formed, _ in seen)  # argmax and token probabilities only
    else:
        # token-level reads the row of every node whose children it tests, and of the last node
        assert all(formed <= tested + 1 for _, formed, tested in seen)
        assert sum(f for _, f, _ in seen) < sum(n for n, _, _ in seen) / 2
