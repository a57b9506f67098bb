"""Drafting on the device (T = 0): the same trees and tokens as the host drafters, and a step that
reads the device once. The device path runs here on CPU tensors (``SpeculativeDecoder.device_side``);
what would synchronise a CUDA device is counted by recording stubs."""

import math
import random
from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import DEVICE

from dyntree_core import DecodeConfig, SpeculativeDecoder
from dyntree_core.decode import host
from dyntree_core.decode.timer import StepTimer
from dyntree_core.drafting import DySpecGreedyDrafter, PathFunctionSource
from dyntree_core.drafting.device import chain_greedy, topn_greedy
from dyntree_core.testing import tiny_pair


def canonical(tree) -> dict[tuple, tuple]:
    """A tree as {token path: (draw rank, q, value)}: independent of the node numbering."""
    toks, par = tree.tokens.tolist(), tree.parents.tolist()
    rank, logq = tree.child_rank.tolist(), tree.draft_logprob.tolist()
    value = tree.value.tolist() if tree.value is not None else [math.nan] * tree.size
    return {canonical_node(tree, i): (rank[i], math.exp(logq[i]), value[i]) for i in range(tree.size)}


def canonical_node(tree, i) -> tuple:
    toks, par = tree.tokens.tolist(), tree.parents.tolist()
    out = []
    while i >= 0:
        out.append(toks[i])
        i = par[i]
    return tuple(reversed(out))


def assert_same_tree(a, b, rel: float) -> None:
    """Same nodes (token paths) and draw ranks; probabilities equal to ``rel``."""
    ca, cb = canonical(a), canonical(b)
    assert sorted(ca) == sorted(cb)
    for path, (rank, q, v) in ca.items():
        assert cb[path][0] == rank
        assert cb[path][1] == pytest.approx(q, rel=rel) and cb[path][2] == pytest.approx(v, rel=rel)


class ToyLevelSource:
    """A ``LevelSource`` over a path function (the device drafters' counterpart of
    ``PathFunctionSource``; reads its rows' tokens on the host, which only a toy may do)."""

    def __init__(self, fn, vocab):
        self.fn, self.vocab_size = fn, vocab
        self.rows: list[tuple[int, int]] = []  # (parent row, token)

    def reserve(self, rows):
        self.rows = []

    def expand(self, tokens, parent_rows, live, depth):
        out, ids = [], []
        for tok, par in zip(tokens.tolist(), parent_rows.tolist()):
            self.rows.append((par, tok))
            ids.append(len(self.rows) - 1)
            path, r = [], len(self.rows) - 1
            while r >= 0:
                path.append(self.rows[r][1])
                r = self.rows[r][0]
            out.append(torch.as_tensor(self.fn(tuple(reversed(path))), dtype=torch.float32))
        return torch.stack(out), torch.tensor(ids)


def random_path_fn(vocab: int, seed: int, zeros: bool):
    def fn(path):
        g = torch.Generator().manual_seed(hash((seed,) + path) % (2**31))
        logits = torch.randn(vocab, generator=g, dtype=torch.float64) * 3
        if zeros:
            logits[torch.rand(vocab, generator=g) < 0.6] = -math.inf  # sparse rows: fewer draws than the budget
        return torch.softmax(logits, 0).float()

    return fn


@pytest.mark.parametrize("seed", range(30))
def test_topn_greedy_equals_the_host_dyspec_greedy_on_random_sources(seed):
    rng = random.Random(seed)
    vocab, budget, depth = rng.choice([5, 12, 40]), rng.choice([2, 5, 16, 33]), rng.choice([1, 2, 4, 6])
    fn = random_path_fn(vocab, seed, zeros=seed % 3 == 0)
    cfg = DecodeConfig(method="dyspec_greedy", budget=budget, depth=depth)
    host_tree = DySpecGreedyDrafter(cfg).draft(PathFunctionSource(fn, vocab), 3, torch.Generator(), deterministic=True)
    dev = topn_greedy(ToyLevelSource(fn, vocab), 3, budget, depth, torch.device("cpu"))
    k = int(dev.valid.sum())
    assert k == host_tree.size
    from dyntree_core.tree import TokenTree

    got = TokenTree(tokens=dev.tokens[:k], parents=dev.parents[:k], child_rank=dev.child_rank[:k],
                    draft_logprob=torch.tensor([0.0] + [math.log(x) for x in dev.q[1:k].tolist()], dtype=torch.float64),
                    sampled="topk", value=dev.value[:k])
    assert_same_tree(got, host_tree, rel=0)  # the same rows: bit-identical probabilities
    assert dev.valid[:k].all() and not dev.valid[k:].any() and (dev.parents[1:] < torch.arange(1, dev.size)).all()


def test_chain_greedy_is_the_draft_argmax_chain():
    fn = random_path_fn(17, 5, zeros=False)
    t = chain_greedy(ToyLevelSource(fn, 17), 4, 6, torch.device("cpu"))
    path = [4]
    for _ in range(6):
        path.append(int(torch.argmax(fn(tuple(path)))))
    assert t.tokens.tolist() == path and t.parents.tolist() == list(range(-1, 6))


@pytest.mark.parametrize("method", ["dyspec_greedy", "chain"])
@pytest.mark.parametrize("order", ["dfs", "bfs"])
def test_device_drafting_gives_the_host_paths_trees_and_tokens(method, order):
    for seed in range(6):
        draft, target = tiny_pair(seed=seed)
        cfg = DecodeConfig(method=method, budget=16, depth=4, seed=seed, node_order=order)
        prompt = [seed % 60 + 2, 7, 11]
        ref = list(SpeculativeDecoder(draft, target, cfg).generate(prompt, 20))
        dec = SpeculativeDecoder(draft, target, cfg)
        dec.device_side = True
        got = list(dec.generate(prompt, 20))
        assert len(got) == len(ref)
        for a, b in zip(ref, got):
            # the draft's rows come from differently batched forwards: equal to float32 rounding
            assert_same_tree(a.tree, b.tree, rel=1e-5)
            assert [canonical_node(a.tree, i) for i in a.accepted_nodes] == [canonical_node(b.tree, i) for i in b.accepted_nodes]
            for x, y in zip(a.committed, b.committed):
                assert (x.token_id, x.kind, x.depth) == (y.token_id, y.kind, y.depth)
                for f in ("p_draft", "p_target", "accept_prob"):
                    u, v = getattr(x, f), getattr(y, f)
                    assert (math.isnan(u) and math.isnan(v)) or u == pytest.approx(v, rel=1e-5), f
            assert sorted(b.node_slots) == list(range(b.tree.size))
            assert b.node_slots == b.tree.order(order).tolist()


# ------------------------------------------------------------------ host synchronisations per step
#: aten ops that make a CUDA host wait (a scalar read, or an output size known only on the device)
SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "repeat_interleave",
            "_assert_async", "equal", "is_nonzero")


class SyncRecorder(TorchDispatchMode):
    """Records aten ops that would synchronise a CUDA device, and boolean-mask indexing."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.on = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on:
            name = func.__name__.split(".")[0]
            if name in SYNC_OPS:
                self.ops.append(name)
            if name in ("index", "index_put", "index_put_") and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or [])):
                self.ops.append(name + "[bool]")
        return func(*args, **(kwargs or {}))


DEVICE_PHASES = ("draft", "mask", "target_forward", "verify")


@pytest.mark.parametrize("method", ["dyspec_greedy", "chain", "autoregressive"])
def test_a_greedy_step_reads_the_device_at_most_twice(monkeypatch, method):
    """Counts, per step: ``host.fetch`` calls (each one batched read = one sync), and outside them
    any Tensor -> Python read (``item/tolist/cpu/numpy``, ``bool/int/float``) and any syncing aten
    op during the device phases. The host verifier then works on fetched numpy data."""
    recorder = SyncRecorder()
    reads: list[str] = []
    fetches: list[int] = []
    real_fetch = host.fetch
    state = {"in_fetch": False}

    def fetch(*tensors):
        fetches.append(len(tensors))
        state["in_fetch"] = True
        recorder.on = False
        try:
            return real_fetch(*tensors)
        finally:
            state["in_fetch"] = False
            state["phase_on"] = False  # after the read the verify phase works on host data

    monkeypatch.setattr(host, "fetch", fetch)
    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        real = getattr(torch.Tensor, name)

        def spy(self, *a, _real=real, _name=name, **k):
            if state.get("phase_on") and not state["in_fetch"]:
                reads.append(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)
    real_phase = StepTimer.phase

    @contextmanager
    def phase(self, name):
        device_phase = name in DEVICE_PHASES
        with real_phase(self, name):
            state["phase_on"] = device_phase
            recorder.on = device_phase
            try:
                yield
            finally:
                state["phase_on"] = False
                recorder.on = False

    monkeypatch.setattr(StepTimer, "phase", phase)
    waits: list[int] = []
    real_sync = SpeculativeDecoder._sync
    monkeypatch.setattr(SpeculativeDecoder, "_sync", lambda self: waits.append(1) or real_sync(self))
    draft, target = tiny_pair(seed=2)
    cfg = DecodeConfig(method=method, budget=12, depth=3, trace_block_counts=False)
    dec = SpeculativeDecoder(draft, target, cfg)
    dec.device_side = True
    per_step = []
    with recorder:
        for trace in dec.generate([5, 9, 2, 7], 12):
            per_step.append((len(fetches) + len(waits), list(reads), list(recorder.ops)))
            fetches.clear(), reads.clear(), recorder.ops.clear(), waits.clear()
    assert len(per_step) >= 3
    for syncs, host_reads, sync_ops in per_step[1:]:  # the first step also ends the prefill's wait
        assert 1 <= syncs <= 2, per_step  # one fetch + the loop's end-of-step wait
        assert not host_reads and not sync_ops, (host_reads, sync_ops)


def test_device_drafting_through_the_kernel_equals_autoregressive(kernel_calls):
    """The padded device tree through the Triton kernel (CPU: the interpreter): greedy identity."""
    import os

    from dyntree_core.attention.triton_kernel import HAS_TRITON

    if not HAS_TRITON or (not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"):
        pytest.skip("needs Triton with CUDA or the Triton interpreter (tests/conftest.py sets it on CPU)")
    draft, target = (m.to(DEVICE) for m in tiny_pair(seed=3))
    prompt = [5, 9, 2, 7, 1]
    ar = SpeculativeDecoder(draft, target, DecodeConfig(method="autoregressive", attention="torch", device=DEVICE.type)
                            ).generate_ids(prompt, 8)
    dec = SpeculativeDecoder(draft, target, DecodeConfig(method="dyspec_greedy", attention="triton", budget=10, depth=3,
                                                         device=DEVICE.type))
    dec.device_side = True
    assert dec.generate_ids(prompt, 8) == ar
    assert kernel_calls
