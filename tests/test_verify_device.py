"""The device programs of token-level and point-mass verification (``verify.device``) decide exactly what
the host verifiers decide: on random trees drawn without replacement, fed the same uniforms, the same
path, bonus token, tested nodes, acceptance probabilities and walkthrough decisions (float64 numbers
within 1e-9). Losslessness then carries over from the host verifiers' exact-enumeration tests
(``test_verify_exact``); ``test_graph_step_sampling`` samples the engine's graph steps end to end."""

import math

import numpy as np
import pytest
import torch

from dyntree_core.tree import TokenTree
from dyntree_core.verify import PointMassVerifier, TokenLevelVerifier
from dyntree_core.verify.common import sample_index
from dyntree_core.verify.device import (DRAWN, RESIDUAL, WalkRead, point_mass_walk, sibling_table, token_level_bonus,
                                        token_level_tests, token_level_walk, walk_result)
from dyntree_core.verify.rows import DenseRows

from conftest import DEVICE


class QueuedUniforms:
    """``Decisions`` that take their uniforms from a list, in order (the device's, in the walk's order)."""

    def __init__(self, us):
        self._us = list(us)
        self.last_u = None

    def _next(self) -> float:
        if not self._us:
            raise AssertionError("the host verifier asked for more decisions than the device walk made")
        self.last_u = self._us.pop(0)
        return self.last_u

    def bernoulli(self, p: float) -> bool:
        return self._next() < p

    def categorical(self, probs: np.ndarray) -> int:
        return sample_index(probs, self._next())


def _row(rng, v: int, zeros: float) -> np.ndarray:
    x = rng.dirichlet(np.full(v, 0.6))
    x[rng.random(v) < zeros] = 0.0
    if x.sum() == 0:
        x[rng.integers(v)] = 1.0
    return (x / x.sum()).astype(np.float32)


def random_case(seed: int, v: int = 8, depth: int = 3, pad: int = 3, max_kids: int = 5):
    """A random tree whose siblings are drawn without replacement from their parent's draft row, as slot
    tensors padded by ``pad`` slots (hanging off the root, invalid), with target and draft rows."""
    rng = np.random.default_rng(seed)
    zeros = rng.choice([0.0, 0.3])
    tokens, parents, ranks, depths, logq = [int(rng.integers(v))], [-1], [0], [0], [0.0]
    draft = [_row(rng, v, zeros)]
    queue = [0]
    while queue:
        node = queue.pop(0)
        if depths[node] >= depth:
            continue
        q = draft[node].astype(np.float64).copy()
        for r in range(int(rng.integers(0, max_kids + 1))):
            if q.sum() <= 0:
                break
            x = int(rng.choice(v, p=q / q.sum()))
            tokens.append(x)
            parents.append(node)
            ranks.append(r)
            depths.append(depths[node] + 1)
            logq.append(math.log(float(draft[node][x])))
            draft.append(_row(rng, v, zeros))
            queue.append(len(tokens) - 1)
            q[x] = 0.0
    n = len(tokens)
    b = n + pad
    target = np.stack([_row(rng, v, zeros) for _ in range(b)])
    draft_rows = np.concatenate([np.stack(draft), np.stack([_row(rng, v, 0.0) for _ in range(pad)])])
    tree = TokenTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents), child_rank=torch.tensor(ranks),
                     draft_logprob=torch.tensor(logq, dtype=torch.float64), sampled="swor",
                     draft_probs=torch.from_numpy(np.stack(draft).astype(np.float64)), draft_row=torch.arange(n))
    slots = dict(
        tokens=torch.tensor(tokens + [0] * pad, device=DEVICE),
        parents=torch.tensor([0] + parents[1:] + [0] * pad, device=DEVICE),
        valid=torch.arange(b, device=DEVICE) < n,
        cid=torch.tensor(list(range(n)) + [10 * b] * pad, device=DEVICE),
        depth=torch.tensor(depths + [depth + 1] * pad, device=DEVICE),
    )
    u = torch.from_numpy(rng.random(b + 1)).to(DEVICE)
    return tree, slots, torch.from_numpy(target).to(DEVICE), torch.from_numpy(draft_rows).to(DEVICE), u


def follow(chosen: torch.Tensor) -> list[int]:
    b = chosen.shape[0]
    ch = chosen.cpu().tolist()
    path = [0]
    while ch[path[-1]] < b:
        path.append(ch[path[-1]])
    return path


def device_result(verifier: str, tree, slots, target, draft, u, k: int):
    b = target.shape[0]
    kids = sibling_table(slots["parents"], slots["valid"], slots["cid"], k)
    if verifier == "token_level":
        walk, tests = token_level_walk(target, draft, slots["tokens"], slots["parents"], kids, u[:b])
        path = follow(walk.chosen)
        last = torch.tensor([path[-1]], device=target.device)
        bonus, p_bonus = token_level_bonus(target, draft, tests, kids, last, u[b:])
        read = WalkRead(verifier, walk.out.cpu().numpy(), path, int(bonus), float(p_bonus), float(u[b]))
    else:
        walk = point_mass_walk(target, slots["tokens"], slots["parents"], kids, u[:b])
        path = follow(walk.chosen)
        out = walk.out.cpu().numpy()
        read = WalkRead(verifier, out, path, int(out[DRAWN, path[-1]]), float(out[RESIDUAL, path[-1]]),
                        float(u[path[-1]]))
    node_of = np.where(slots["valid"].cpu().numpy(), np.arange(b), -1)
    return walk_result(read, tree, node_of)


def assert_same(dev, host):
    assert dev.path == host.path and dev.bonus_token == host.bonus_token
    np.testing.assert_array_equal(dev.tested, host.tested)
    np.testing.assert_allclose(dev.accept_prob, host.accept_prob, rtol=1e-9, atol=1e-12, equal_nan=True)
    np.testing.assert_allclose(dev.p_target, host.p_target, rtol=1e-9, atol=1e-12, equal_nan=True)
    assert len(dev.decisions) == len(host.decisions)
    for d, h in zip(dev.decisions, host.decisions):
        assert (d.kind, d.node, d.token, d.accepted, d.u, d.drew) == (h.kind, h.node, h.token, h.accepted, h.u, h.drew)
        np.testing.assert_allclose([d.p_target, d.q, d.accept_prob], [h.p_target, h.q, h.accept_prob], rtol=1e-9,
                                   atol=1e-12, equal_nan=True)
        assert [t for t, _ in d.residual_top] == [t for t, _ in h.residual_top]
        np.testing.assert_allclose([p for _, p in d.residual_top], [p for _, p in h.residual_top], rtol=1e-9)


@pytest.mark.parametrize("verifier", ["token_level", "point_mass"])
def test_the_device_walk_decides_what_the_host_verifier_decides(verifier):
    host = TokenLevelVerifier() if verifier == "token_level" else PointMassVerifier()
    rejections = 0
    for seed in range(200):
        tree, slots, target, draft, u = random_case(seed)
        dev = device_result(verifier, tree, slots, target, draft, u, k=6)
        ref = host.run(tree, DenseRows(target[:tree.size].double()), QueuedUniforms([d.u for d in dev.decisions]))
        assert_same(dev, ref)
        rejections += sum(1 for d in dev.decisions if d.kind == "child" and not d.accepted)
    if verifier == "token_level":
        assert rejections > 200  # the residual updates were exercised, chains of several included


def test_a_long_rejection_chain_matches_the_host():
    """Every child rejected (uniforms near 1) at nodes with up to 7 children over 8 tokens: the closed form's
    residual after each of many rejections, and the bonus drawn from the last one."""
    host = TokenLevelVerifier()
    for seed in range(40):
        tree, slots, target, draft, u = random_case(1000 + seed, depth=2, max_kids=7)
        u = 1.0 - 1e-9 * torch.rand(u.shape, dtype=torch.float64, device=u.device) if seed % 2 else u
        dev = device_result("token_level", tree, slots, target, draft, u, k=8)
        ref = host.run(tree, DenseRows(target[:tree.size].double()), QueuedUniforms([d.u for d in dev.decisions]))
        assert_same(dev, ref)


def test_the_sibling_table_lists_children_in_draw_order_and_skips_padding():
    parents = torch.tensor([0, 0, 0, 1, 0, 1, 0])
    valid = torch.tensor([True, True, True, True, True, True, False])
    cid = torch.tensor([0, 5, 2, 9, 7, 8, 1])
    kids = sibling_table(parents, valid, cid, 3)
    assert kids.tolist() == [[2, 1, 4], [5, 3, 7], [7, 7, 7], [7, 7, 7], [7, 7, 7], [7, 7, 7], [7, 7, 7]]


def test_a_rejection_of_probability_0_leaves_the_residual_as_the_host_leaves_it():
    """Where the target row equals the draft row a child is always accepted; a rejection there (reachable only
    by rounding) leaves the host's residual unchanged, and the device's tests of the next sibling match it."""

    class RejectFirst:
        """Rejects the first test whatever its probability; then draws with uniform 0.5."""
        calls, last_u = 0, 0.5

        def bernoulli(self, p):
            self.calls += 1
            return self.calls > 1 and 0.5 < p

        def categorical(self, probs):
            return sample_index(probs, 0.5)

    p = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.25] * 4, [0.25] * 4], dtype=torch.float32, device=DEVICE)
    tree = TokenTree(tokens=torch.tensor([3, 0, 1]), parents=torch.tensor([-1, 0, 0]), child_rank=torch.tensor([0, 0, 1]),
                     draft_logprob=torch.log(torch.tensor([1.0, 0.4, 0.3], dtype=torch.float64)), sampled="swor",
                     draft_probs=p[:1].double().cpu(), draft_row=torch.tensor([0, -1, -1]))
    host = TokenLevelVerifier().run(tree, DenseRows(p.double().cpu()), RejectFirst())
    second = [d for d in host.decisions if d.kind == "child"][1]
    tests = token_level_tests(p, p, torch.tensor([[0, 1], [0, 0], [0, 0]], device=DEVICE))
    assert tests.accept[0, 0] == 1.0
    got = [float(tests.residual[0, 1]), float(tests.draft[0, 1]), float(tests.accept[0, 1])]
    np.testing.assert_allclose(got, [second.p_target, second.q, second.accept_prob], rtol=1e-9)


def test_sample_rows_never_draws_a_token_of_zero_weight():
    """Inverse-CDF draws at the edges: a uniform of 0 takes the first positive token (leading zeros skipped), a
    uniform at the top (``u * total`` rounded up to the total: the ``searchsorted`` index past the row) takes
    the last positive one, not the trailing zeros; each draw's probability is its weight over the row's total."""
    from dyntree_core.verify.device import sample_rows

    rows = torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.0, 0.0],
                         [0.0, 0.25, 0.0, 0.5, 0.0, 0.0],
                         [0.1, 0.2, 0.3, 0.0, 0.0, 0.0],
                         [0.1, 0.2, 0.3, 0.0, 0.0, 0.0]], dtype=torch.float64, device=DEVICE)
    u = torch.tensor([0.0, 1.0, 0.5, 1.0], dtype=torch.float64, device=DEVICE)
    tok, prob = sample_rows(rows, u)
    assert tok.tolist() == [1, 3, 2, 2]
    assert torch.allclose(prob.cpu(), torch.tensor([1 / 3, 2 / 3, 0.5, 0.5], dtype=torch.float64))
