"""A decoding step as a few fixed-shape programs over device state, read by the host once.

The tree's envelope is fixed per configuration (``Envelope``: ``n`` candidate slots below the root,
``depth`` levels), so no shape changes between steps; what the dynamic tree decides lives in tensor
contents (which slots are live, their parents, their weights). A tree step (T = 0; at T > 0 the host
verifies the read rows between ``target_tree`` and ``commit``, see ``read``) is

    draft_root               the draft forward of [A, root] (A: the last accepted token the draft has
                             not cached, when there is one) and the root's children
    draft_level x (depth-1)  the draft forward of all n slots, padded (the live ones are the slots
                             at this depth), and the slots' update (DySpec's top-n merge, or a
                             static shape's top-k fill: chain, Sequoia). DySpec stops at the
                             first level with no live slot (``GraphStepper.draft``): the levels
                             after it would add nothing, so its tree is the same
    target_tree              the tree's parents and ancestor mask from the slots, the target forward
                             of root + n slots, argmax and probabilities per node
    verify                   the greedy acceptance walk, the accepted path and the bonus token
    commit                   both caches keep the accepted path (fixed-size gathers), lengths advance
    fetch                    one host read of the tree and the step's numbers (``host.fetch``)

and plain decoding is one ``ar`` program and the same read. Each program is a ``compiled.GraphFn``
(a CUDA graph per bucket on a GPU; eager, the same code, on the CPU); none reads the device, and all
state they carry between steps lives in preallocated buffers updated in place (static addresses for
CUDA graphs): lengths, the root token, the candidate slots, the ancestor tables, the KV buffers.

Positions and cache layout. The target cache holds the committed tokens but the last (the root);
the root is the tree's node 0, forwarded with the tree at slot ``t_len``. The draft cache holds
``d_len`` committed tokens; the root's row sits at slot ``d_len + 1``, A's at ``d_len`` (seen only
when A is live), and draft row ``r`` of the tree at ``d_len + 1 + r`` (row 0 = the root).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from ..config import DecodeConfig
from ..drafting.device import Candidates, ShapeSlots, live_slots, shape_level, shape_start, topn_level, topn_start
from ..sampling import probs_from_logits
from ..tree import TokenTree
from ..verify.device import (DEVICE_VERIFIERS, DRAWN, RESIDUAL, WALK_ROWS, WalkRead, point_mass_walk, sibling_table,
                             token_level_bonus, token_level_walk)
from . import host
from .compiled import CompileEvent, CompileMode, GraphFn
from .dense_forward import DenseForward, dense_reason

_NEG = float("-inf")
_STEP_TAIL = 8  # step_out past the path's depth + 1 slots: len, bonus, p_draft, last, p, u, p_target
MIN_CAPACITY = 512
#: the draft's programs, by ``GraphFn`` name (``CompileMode.graphs(fuse=DRAFT_PROGRAMS)`` fuses their kernels)
DRAFT_PROGRAMS = ("draft_root", "draft_level")
MIN_SPAN = 256


@dataclass(frozen=True)
class Envelope:
    """The fixed shape of a method's greedy trees.

    Attributes:
        method: ``chain``, ``dyspec_greedy``, ``sequoia`` or ``specinfer``.
        n: candidate slots (tree nodes without the root).
        depth: drafted levels below the root.
        parents: a static shape's parent list (root first, breadth-first), None for DySpec.
        scores: a static shape's node values (Sequoia's DP scores), None: path probabilities.
    """

    method: str
    n: int
    depth: int
    parents: Optional[tuple[int, ...]] = None
    scores: Optional[tuple[float, ...]] = None

    @property
    def budget(self) -> int:
        return self.n + 1

    @property
    def draft_rows(self) -> int:
        """Draft rows forwarded per step: the root and ``n`` per level below it."""
        return 1 + (self.depth - 1) * self.n

    @classmethod
    def of(cls, cfg: DecodeConfig) -> Optional["Envelope"]:
        """The envelope of ``cfg``'s greedy trees (None: the method has none here)."""
        if cfg.method == "dyspec_greedy":
            return cls("dyspec_greedy", cfg.budget - 1, cfg.depth)
        if cfg.method == "chain" and cfg.stop_confidence is None:
            return cls("chain", cfg.depth, cfg.depth, tuple(range(-1, cfg.depth)))
        if cfg.method == "specinfer":  # k chains of L below the root, numbered level by level as the host's
            k, depth = cfg.width, cfg.depth
            chains = [1 + (level - 1) * k + i for level in range(1, depth) for i in range(k)]
            return cls("specinfer", k * depth, depth, tuple([-1] + [0] * k + chains))
        if cfg.method == "sequoia":
            from ..drafting.sequoia import SequoiaDrafter

            shape = SequoiaDrafter(cfg).shape
            depth = max(shape.depths())
            if depth < 1:
                return None
            return cls("sequoia", shape.size - 1, depth, tuple(shape.parents), tuple(shape.score))
        return None


def _power_of_two(tokens: int, least: int) -> int:
    """The next power of two >= ``tokens``, at least ``least``."""
    return max(least, 1 << (max(1, int(tokens)) - 1).bit_length())


def span_bucket(tokens: int, capacity: int) -> int:
    """The attention span for ``tokens`` cache slots in use: the next power of two (at least
    ``MIN_SPAN``), at most ``capacity``. A program compiles once per span it meets."""
    return min(capacity, _power_of_two(tokens, MIN_SPAN))


def capacity_bucket(tokens: int) -> int:
    """Committed tokens a stepper is sized for: the next power of two >= ``tokens`` (at least 512),
    so runs of similar lengths share one stepper's buffers and compiled programs."""
    return _power_of_two(tokens, MIN_CAPACITY)


def graph_reason(cfg: DecodeConfig, draft, target, offloaded: bool) -> Optional[str]:
    """Why ``cfg``'s steps cannot run as fixed-shape programs (None: they can)."""
    if offloaded:
        return "the target streams from host memory"
    if cfg.attention == "triton":
        return "attention='triton': the compiled forward attends through SDPA"
    reason = dense_reason(target)
    if reason is not None:
        return f"target: {reason}"
    if cfg.method == "autoregressive":
        return None
    if Envelope.of(cfg) is None:
        return (f"method {cfg.method!r} has no fixed envelope here (chain without stop_confidence, dyspec_greedy, "
                "sequoia, specinfer)")
    reason = dense_reason(draft)
    return None if reason is None else f"draft: {reason}"


@dataclass
class StepRead:
    """What the host reads after a graph step (numpy, slot order: node 0 = root, slot i = node i + 1).

    Attributes:
        tokens, parents, depth, valid, q, value, cid, row: ``[B]`` the padded tree (parents: -1 root).
        sampled: ``topk`` (T = 0) or ``swor`` (T > 0: siblings drawn without replacement, in draw order).
        argmax, p_node, p_argmax: T = 0: ``[B]`` the target's argmax at each node, the target
            probability of each node's token under its parent, of each node's argmax.
        path: verified on the device: accepted nodes (root first); bonus: the token after them;
            p_draft_bonus: the draft's probability of the bonus token at the last accepted node (NaN:
            never forwarded); p_target_bonus: the target's.
        walk: T > 0, verified on the device: the verification's numbers (``verify.device.walk_result``).
        draft_rows, target_probs: T > 0, verified on the host: ``[B, V]`` the draft distribution at each
            node (rows of nodes never forwarded unspecified) and the target's (temperature and top-p applied).
    """

    tokens: np.ndarray
    parents: np.ndarray
    depth: np.ndarray
    valid: np.ndarray
    q: np.ndarray
    value: np.ndarray
    cid: np.ndarray
    row: np.ndarray
    sampled: str = "topk"
    argmax: Optional[np.ndarray] = None
    p_node: Optional[np.ndarray] = None
    p_argmax: Optional[np.ndarray] = None
    path: list[int] = field(default_factory=list)
    bonus: int = -1
    p_draft_bonus: float = math.nan
    p_target_bonus: float = math.nan
    walk: Optional[WalkRead] = None
    draft_rows: Optional[np.ndarray] = None
    target_probs: Optional[np.ndarray] = None

    def token_tree(self) -> tuple[TokenTree, np.ndarray]:
        """The drafted tree (its real nodes in slot order, which is (depth, creation) order) and
        ``node_of_slot`` ``[B]`` (-1: a padding slot)."""
        slots = np.flatnonzero(self.valid)
        node_of = np.full(self.valid.shape[0], -1, dtype=np.int64)
        node_of[slots] = np.arange(slots.shape[0])
        parents = np.where(np.arange(slots.shape[0]) == 0, -1, node_of[self.parents[slots]])
        cid = self.cid[slots]
        rank = np.zeros(slots.shape[0], dtype=np.int64)
        order = np.lexsort((cid, parents))
        for a, b in zip(order[:-1], order[1:]):  # siblings are adjacent in (parent, cid) order
            if parents[a] == parents[b]:
                rank[b] = rank[a] + 1
        q = self.q[slots]
        draft_probs = draft_row = None
        if self.draft_rows is not None:
            has = self.row[slots] >= 0
            draft_row = torch.from_numpy(np.where(has, np.cumsum(has) - 1, -1))
            draft_probs = torch.from_numpy(self.draft_rows[slots[has]].astype(np.float64))
        tree = TokenTree(tokens=torch.from_numpy(self.tokens[slots].copy()), parents=torch.from_numpy(parents),
                         child_rank=torch.from_numpy(rank),
                         draft_logprob=torch.from_numpy(np.log(np.where(q > 0, q, 1.0)) + np.where(q > 0, 0.0, -np.inf)),
                         sampled=self.sampled, value=torch.from_numpy(self.value[slots].copy()),
                         draft_probs=draft_probs, draft_row=draft_row)
        return tree, node_of


class GraphStepper:
    """The device state and the programs of one decoding run (see the module docstring).

    Args:
        draft, target: dense models (``dense_reason`` None); ``draft`` unused without an envelope.
        envelope: the trees' envelope; None = plain decoding.
        capacity: committed tokens the run may reach (prompt + new tokens).
        temperature, top_p: the target's sampling (T = 0: greedy; T > 0: plain decoding returns the
            distribution, tree steps return the target rows of every node).
        draft_temperature: the draft's (T > 0 tree steps draw siblings without replacement from it).
        mode: how the programs run (``CompileMode.for_device`` by default).
        verifier: T > 0: ``token_level`` and ``point_mass`` verify on the device (``verify.device``);
            another (``traversal``) verifies on the host from the read rows (``read``, ``set_outcome``).
        device_verify: False: every verifier verifies on the host at T > 0 (an A/B switch).

    ``target`` None: **the draft's programs only** (``draft``, ``read_tree``, ``set_outcome``, ``commit``),
    for a target the host forwards and verifies itself (one streamed from host memory: the draft, resident,
    then costs a few graph replays instead of the eager forwards of each level).
    """

    def __init__(self, draft, target, envelope: Optional[Envelope], capacity: int, temperature: float = 0.0,
                 top_p: float = 1.0, mode: Optional[CompileMode] = None, draft_temperature: float = 1.0,
                 verifier: str = "token_level", device_verify: bool = True):
        self.in_use = False
        self.env = envelope
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.draft_temperature = float(draft_temperature)
        self.stochastic = self.temperature > 0.0
        self.verifier = verifier if self.stochastic else "greedy"
        #: the step's verification runs on the device (T = 0 always; T > 0 for ``DEVICE_VERIFIERS``)
        self.device_verifies = not self.stochastic or (device_verify and verifier in DEVICE_VERIFIERS)
        # room past the committed tokens: the tree's rows, and the accepted path's commit
        rows = 1 if envelope is None else max(envelope.budget, envelope.depth + 1)
        if target is None and envelope is None:
            raise ValueError("a draft-only stepper needs an envelope")
        self.tf = None if target is None else DenseForward(target, capacity + rows + 1)
        self.df: Optional[DenseForward] = None
        if envelope is not None:
            self.df = DenseForward(draft, capacity + 2 + envelope.draft_rows)
        dev = self.tf.device if self.tf is not None else self.df.device
        self.device = dev
        self.mode = mode if mode is not None else CompileMode.for_device(dev)
        i64 = dict(dtype=torch.long, device=dev)
        self.t_len = self._static(torch.zeros((), **i64))
        self.root = self._static(torch.zeros(1, **i64))
        self._zero = torch.zeros(1, **i64)
        self.programs: list[GraphFn] = []
        self._pool = torch.cuda.graph_pool_handle() if self.mode.capture == "cuda" else None
        if self.tf is not None:
            self._t_cols = torch.arange(self.tf.capacity, **i64)  # sliced to a span: [:span] is a view
            self._ar = self._program(self._ar_program, "ar")
        if envelope is None:
            return
        env = envelope
        n, d = env.n, env.depth
        vocab = self.df.vocab_size
        self.d_len = self._static(torch.zeros((), **i64))
        self.a_tok = self._static(torch.zeros(1, **i64))
        self.a_valid = self._static(torch.zeros((), dtype=torch.bool, device=dev))
        self._d_cols = torch.arange(self.df.capacity, **i64)
        self._arange_n = torch.arange(n, **i64)
        self._arange_b = torch.arange(n + 1, **i64)
        self._arange_path = torch.arange(d + 1, **i64)
        self._rows_d = torch.arange(env.draft_rows, **i64)
        self._level_rows = 1 + (torch.arange(d, **i64)[:, None] - 1) * n + self._arange_n[None, :]  # [d, n]
        self._levels = [torch.tensor(level, **i64) for level in range(d)]
        self.shape = None if env.parents is None else ShapeSlots.build(env.parents, env.scores, dev)
        self._kmax = 1 if self.shape is None else self.shape.kmax
        self._siblings = n if self.shape is None else self._kmax  # the most children a node can have
        f64 = dict(dtype=torch.float64, device=dev)
        self.c = Candidates(*(self._static(t) for t in (  # (written whole by the root's program)
            torch.zeros(6, n, **i64), torch.full((3, n), _NEG, **f64),
            torch.zeros(n, vocab, dtype=torch.float32, device=dev), torch.zeros((), **i64))))
        self.root_probs = self._static(torch.zeros(1, vocab, dtype=torch.float32, device=dev))
        self.anc_d = self._static(torch.zeros(env.draft_rows, env.draft_rows, dtype=torch.bool, device=dev))
        b = n + 1
        self.tree = self._static(torch.zeros(5, b, **i64))  # tokens, parents (root: 0), depth, valid, row
        self.anc_t = self._static(torch.zeros(b, b, dtype=torch.bool, device=dev))
        self.target_out = self._static(torch.zeros(3, b, dtype=torch.float32, device=dev))  # argmax, p_node, p_argmax
        self.cand_out = self._static(torch.zeros(3, n, dtype=torch.float64, device=dev))  # q, weight, cid
        # T > 0: every node's target distribution (verified on the device, or read for the host's verifier)
        self.target_probs = self._static(torch.zeros(b if self.stochastic and self.tf is not None else 1,
                                                     vocab, dtype=torch.float32, device=dev))
        self.walk_out = self._static(torch.zeros(WALK_ROWS if self.stochastic else 1, b, dtype=torch.float64,
                                                 device=dev))
        # path, len, bonus, p_draft(bonus), last, p(bonus) where drawn, its uniform, p_target(bonus)
        self.step_out = self._static(torch.zeros(d + _STEP_TAIL, dtype=torch.float64, device=dev))
        self._no_draw = torch.full((3,), math.nan, dtype=torch.float64, device=dev)  # T = 0's last three
        # DySpec: grows[l] = after level l some slot is at depth l + 1 (level l + 1 has work)
        self.grows = self._static(torch.zeros(d, dtype=torch.bool, device=dev))
        self.stops_early = self.shape is None  # (a static shape's depth is its shape's)
        self.lookahead = 1 if dev.type == "cuda" else 0
        self._grows_at = [self.grows[level:level + 1] for level in range(d)]
        self._flags = host.Flags(d, dev)
        self._draft_root = self._program(self._draft_root_program, "draft_root")
        self._draft_level = self._program(self._draft_level_program, "draft_level")
        if self.tf is None:
            self._tree = self._program(self._tree_program, "tree")
        else:
            self._target_tree = self._program(self._target_tree_program, "target_tree")
            self._verify = self._program(self._verify_program, "verify")
        self._commit = self._program(self._commit_program, "commit")

    # ------------------------------------------------------------------ set-up
    def begin(self, on_compile: Optional[Callable[[CompileEvent], None]] = None) -> None:
        """A run takes the stepper (``end`` frees it); ``on_compile`` hears of programs compiled during it."""
        if self.in_use:
            raise RuntimeError("this graph stepper is in use by another run")
        self.in_use = True
        for program in self.programs:
            program.on_compile = on_compile

    def to_compile(self) -> list[str]:
        """The programs the next step compiles (a new bucket under a compiling mode), by name."""
        if not self.mode.compiles:
            return []
        return [p.name for p in self.programs if not p.events and (self.env is None) == (p.name == "ar")]

    def end(self) -> None:
        self.in_use = False
        for program in self.programs:
            program.on_compile = None

    def _static(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_cuda:
            torch._dynamo.mark_static_address(t)
        return t

    def close(self) -> None:
        """Frees the programs' captured graphs (a run holding the stepper must have ended)."""
        for program in self.programs:
            program.release()

    @property
    def graphs(self) -> int:
        """CUDA graphs (or their emulation) held by the programs."""
        return sum(p.graphs for p in self.programs)

    def _program(self, fn, name: str) -> GraphFn:
        g = GraphFn(fn, name, self.mode, pool=self._pool, device=self.device)
        self.programs.append(g)
        return g

    def read_tree(self) -> StepRead:
        """Draft-only: the drafted tree, with the draft rows at T > 0 (the host verifier reads them), in one
        read (``set_outcome`` then ``commit`` keep the accepted path in the draft's cache)."""
        self._tree()
        if not self.stochastic:
            tree, c = host.fetch(self.tree, self.cand_out)
            return self._step_read(tree, c)
        tree, c, root, rows = host.fetch(self.tree, self.cand_out, self.root_probs, self.c.rows)
        return self._step_read(tree, c, draft_rows=np.concatenate([root, rows]))

    def draft_prob(self, slot: int, token: int) -> float:
        """Draft-only, after ``read_tree``: the draft's probability of ``token`` at ``slot`` (NaN: the slot was
        never forwarded), one small read (the bonus token's provenance at T = 0, whose tree carries no rows)."""
        rows = self.root_probs[0] if slot == 0 else self.c.rows[slot - 1]
        p, row = host.fetch(rows[token:token + 1], self.tree[4, slot:slot + 1])
        return float(p[0]) if row[0] >= 0 else math.nan

    def prefill(self, role: str, tokens: list[int], start: int) -> None:
        """Feed ``tokens`` at positions ``start...`` to ``role``'s (``target``/``draft``) cache, eagerly
        (prefill chunks vary in length; they are not graph programs)."""
        f = self.tf if role == "target" else self.df
        q = len(tokens)
        dev = self.device
        pos = torch.arange(start, start + q, device=dev)
        cols = torch.arange(span_bucket(start + q, f.capacity), device=dev)
        visible = cols[None, :] <= pos[:, None]
        f(torch.tensor(tokens, dtype=torch.long, device=dev), pos, pos, visible, torch.tensor([q - 1], device=dev))

    def start(self, prompt: list[int]) -> None:
        """The state after the prompt's prefill: every prompt token but the last is cached; the last is the root."""
        self.t_len.fill_(len(prompt) - 1)
        self.root.fill_(prompt[-1])
        if self.env is not None:
            self.d_len.fill_(len(prompt) - 1)
            self.a_valid.fill_(False)

    # ------------------------------------------------------------------ plain decoding
    def ar_forward(self, cached: int):
        """One plain decoding step's program: the root's forward (at T = 0 its argmax becomes the next root).
        ``cached``: the tokens in the target's cache (the host knows it from its reads)."""
        return self._ar(span_bucket(cached + 1, self.tf.capacity))

    def ar_read(self, out) -> tuple[int, float, Optional[np.ndarray]]:
        """The step's one read: ``(token, p_target, None)`` at T = 0; at T > 0 ``(-1, nan, probs)``
        with ``probs`` ``[V]`` float64: the host samples and calls ``set_root``."""
        if self.temperature == 0.0:
            am, p = host.fetch(*out)
            return int(am[0]), float(p[0]), None
        (probs,) = host.fetch(out)
        return -1, float("nan"), probs[0].astype(np.float64)

    def set_root(self, token: int) -> None:
        self.root.fill_(int(token))

    def _ar_program(self, span: int):
        slot = self.t_len.view(1)
        visible = (self._t_cols[:span] <= self.t_len)[None]
        logits = self.tf(self.root, slot, slot, visible, self._zero).float()
        self.t_len.add_(1)
        if self.temperature > 0.0:
            return probs_from_logits(logits, self.temperature, self.top_p)
        am = logits.argmax(-1)
        p = torch.exp(logits.gather(1, am[:, None])[:, 0] - torch.logsumexp(logits, -1))
        self.root.copy_(am)
        return am, p

    # ------------------------------------------------------------------ tree step
    def draft(self, cached: int, generator: Optional[torch.Generator] = None, every_level: bool = False) -> int:
        """Grow the step's tree into the candidate slots; returns the draft forwards it ran (at most
        ``depth``, the root's included). ``cached``: the committed tokens before the root (the host knows it; the
        draft caches at most as many). T > 0: ``generator`` (on the device) draws each level's
        uniforms, one op per level.

        A static shape (chain, Sequoia) forwards every level. DySpec forwards level ``l`` only while
        level ``l - 1 - lookahead`` left a slot at the depth below it (``grows``): a level with no live
        slot adds nothing and neither does any after it, so stopping there gives the same tree.
        ``lookahead`` 1 (CUDA) reads each flag one level late, while the next level runs: the device
        never waits for the host, and at most one level past the tree's depth runs; 0 (CPU, where
        programs run as they are called) reads it at once. ``every_level``: forward every level anyway
        (the same tree; for A/B measurements)."""
        span = span_bucket(cached + 2 + self.env.draft_rows, self.df.capacity)
        vocab = self.df.vocab_size
        noise = (lambda rows: torch.rand(rows, vocab, generator=generator, device=self.device)) if self.stochastic \
            else (lambda rows: None)
        last = self.env.depth - 1
        stops = self.stops_early and not every_level
        self._draft_root(span, noise(1))
        if stops and last > 0:
            self._flags.post(0, self._grows_at[0])
        forwards = 1
        for at, level in enumerate(self._levels[1:], start=1):
            known = at - 1 - self.lookahead
            if stops and known >= 0 and not self._flags.read(known):
                break
            self._draft_level(level, span, noise(self.env.n))
            forwards += 1
            if stops and at < last:
                self._flags.post(at, self._grows_at[at])
        return forwards

    def target_forward(self, cached: int) -> None:
        """The tree's target forward; ``cached``: the tokens in the target's cache."""
        self._target_tree(span_bucket(cached + max(self.env.budget, self.env.depth + 1), self.tf.capacity))

    def verify(self, generator: Optional[torch.Generator] = None) -> None:
        """The step's verification on the device (``device_verifies``); T > 0: ``generator`` (on the
        device) draws its uniforms, one op."""
        if not self.device_verifies:
            raise RuntimeError(f"the {self.verifier} verifier runs on the host: read(), then set_outcome()")
        if self.stochastic:
            self._verify(torch.rand(self.env.budget + 1, dtype=torch.float64, generator=generator, device=self.device))
        else:
            self._verify(None)

    def commit(self) -> None:
        self._commit()

    def read(self) -> StepRead:
        """The step's one host read: the device's verification (``device_verifies``), or at T > 0 the
        draft rows and target rows the host's verifier reads (``set_outcome`` then gives the device its
        decision)."""
        if not self.device_verifies:
            tree, c, root, rows, target = host.fetch(self.tree, self.cand_out, self.root_probs, self.c.rows,
                                                     self.target_probs)
            return self._step_read(tree, c, draft_rows=np.concatenate([root, rows]), target_probs=target)
        tree, c, out, per_node = host.fetch(self.tree, self.cand_out, self.step_out,
                                            self.walk_out if self.stochastic else self.target_out)
        d = self.env.depth
        n_path = int(out[d + 1])
        path, bonus = [int(x) for x in out[:n_path]], int(out[d + 2])
        kw = dict(path=path, bonus=bonus, p_draft_bonus=float(out[d + 3]))
        if self.stochastic:
            walk = WalkRead(self.verifier, per_node, path, bonus, p_bonus=float(out[d + 5]), u_bonus=float(out[d + 6]))
            return self._step_read(tree, c, walk=walk, p_target_bonus=float(out[d + 7]), **kw)
        return self._step_read(tree, c, argmax=per_node[0].astype(np.int64), p_node=per_node[1].astype(np.float64),
                               p_argmax=per_node[2].astype(np.float64),
                               p_target_bonus=float(per_node[2][int(out[d + 4])]), **kw)  # p_argmax at the last node

    def _step_read(self, tree: np.ndarray, c: np.ndarray, **kw) -> StepRead:
        parents = tree[1].copy()
        parents[0] = -1
        q, w, cid = (np.concatenate([[1.0], c[i]]) for i in range(3))
        return StepRead(tokens=tree[0], parents=parents, depth=tree[2], valid=tree[3].astype(bool), q=q,
                        value=np.maximum(w, 0.0), cid=cid.astype(np.int64), row=tree[4],
                        sampled="swor" if self.stochastic else "topk", **kw)

    def set_outcome(self, path: list[int], bonus: int) -> None:
        """T > 0: the host verifier's accepted path (slots, root first) and bonus token, for ``commit``
        (a host -> device copy; no read)."""
        d = self.env.depth
        out = np.zeros(d + _STEP_TAIL)
        out[:len(path)] = path
        out[d + 1], out[d + 2], out[d + 3], out[d + 4] = len(path), bonus, math.nan, path[-1]
        self.step_out.copy_(torch.from_numpy(out), non_blocking=True)

    def _draft_root_program(self, span: int, noise: Optional[torch.Tensor]):
        f = self.df
        base = self.d_len
        keep = base + self.a_valid.long()
        tokens = torch.cat([self.a_tok, self.root])
        slots = torch.stack([base, base + 1])
        positions = torch.stack([base, keep])
        cols = self._d_cols[:span]
        visible = torch.stack([(cols <= base), (cols < keep) | (cols == base + 1)])
        probs = probs_from_logits(f(tokens, positions, slots, visible, self._zero + 1), self.draft_temperature)
        root_row = self._zero
        if self.shape is None:
            c = topn_start(probs, root_row, self.env.n, self.env.depth, noise)
        else:
            c = shape_start(probs, root_row, self.shape, self._kmax, noise)
        _store(self.c, c)
        self.root_probs.copy_(probs)
        self.anc_d[0].copy_(self._rows_d == 0)
        if self.shape is None:
            self.grows.index_copy_(0, self._zero, _grows(c, self._zero + 1))

    def _draft_level_program(self, level: torch.Tensor, span: int, noise: Optional[torch.Tensor]):
        f, c, n = self.df, self.c, self.env.n
        ids = self._level_rows.index_select(0, level.view(1))[0]  # the level's draft rows, 1 + (level - 1) n + i
        live = live_slots(c, level)
        # (a live slot was drawn, so its parent's row prow is set: >= 0)
        anc = self.anc_d.index_select(0, torch.where(live, c.prow, 0)) & live[:, None]
        anc = anc | (self._rows_d[None, :] == ids[:, None])  # each row sees itself (padding rows only that)
        self.anc_d.index_copy_(0, ids, anc)
        base = self.d_len
        keep = base + self.a_valid.long()
        first = base + 1  # the draft cache's slot of row 0
        visible = (self._d_cols[:span] < keep)[None, :].expand(n, -1).clone()
        visible.index_copy_(1, first + self._rows_d, anc)
        logits = f(c.tok, (keep + level).expand(n), first + ids, visible, self._arange_n)
        probs = probs_from_logits(logits, self.draft_temperature)
        if self.shape is None:
            new = topn_level(c, probs, ids, level, noise, live)
            self.grows.index_copy_(0, level.view(1), _grows(new, level + 1))
        else:
            new = shape_level(c, probs, ids, level, self.shape, self._kmax, noise, live)
        _store(self.c, new)

    def _tree_arrays(self) -> tuple[torch.Tensor, ...]:
        """The padded tree from the candidate slots: ``(tokens, parents, depth, valid, row)``, ``[B]`` each
        (slot 0 the root, its own parent here; an empty slot hangs off the root)."""
        c = self.c
        true = torch.ones(1, dtype=torch.bool, device=self.device)
        valid = torch.cat([true, c.w > _NEG])
        tokens = torch.cat([self.root, c.tok])
        depth = torch.cat([self._zero, c.depth])
        all_cid = torch.cat([self._zero, c.cid])
        parent = torch.argmax((c.pcid[:, None] == all_cid[None, :]).to(torch.int8), dim=1)
        parents = torch.cat([self._zero, torch.where(valid[1:], parent, 0)])
        return tokens, parents, depth, valid, torch.cat([self._zero, c.row])

    def _write_tree(self) -> tuple[torch.Tensor, ...]:
        """``_tree_arrays`` written to the read's buffers (the tree, the candidates' numbers); returns them."""
        tokens, parents, depth, valid, row = arrays = self._tree_arrays()
        self.tree.copy_(torch.stack([tokens, parents, depth, valid.long(), row]))
        self.cand_out.copy_(torch.stack([self.c.q, self.c.w, self.c.cid.double()]))
        return arrays

    def _tree_program(self):
        """Draft-only: the tree for the read."""
        self._write_tree()

    def _target_tree_program(self, span: int):
        env = self.env
        b = env.n + 1
        tokens, parents, depth, valid, _ = self._write_tree()
        anc = self._arange_b[:, None] == self._arange_b[None, :]
        for _ in range(env.depth):
            anc = anc | anc.index_select(0, parents)
        t_len = self.t_len
        slots = t_len + self._arange_b
        visible = (self._t_cols[:span] < t_len)[None, :].expand(b, -1).clone()
        visible.index_copy_(1, slots, anc)
        logits = self.tf(tokens, t_len + depth.clamp(max=env.depth), slots, visible, self._arange_b).float()
        self.anc_t.copy_(anc)
        if self.stochastic:
            self.target_probs.copy_(probs_from_logits(logits, self.temperature, self.top_p))
            return
        lse = torch.logsumexp(logits, -1)
        am = logits.argmax(-1)
        p_node = torch.exp(logits[parents, tokens] - lse[parents])
        p_am = torch.exp(logits.gather(1, am[:, None])[:, 0] - lse)
        self.target_out.copy_(torch.stack([am.float(), p_node, p_am]))

    def _verify_program(self, u: Optional[torch.Tensor]):
        """T = 0: the greedy walk; T > 0: ``verify.device``'s walk with ``u`` ``[B + 1]`` uniforms."""
        env = self.env
        b = env.budget
        tokens, parents, depth, valid = self.tree[0], self.tree[1], self.tree[2], self.tree[3].bool()
        is_root = self._arange_b == 0
        if self.stochastic:
            draft = torch.cat([self.root_probs, self.c.rows])  # [B, V] the rows each slot's children came from
            kids = sibling_table(parents, valid, torch.cat([self._zero, self.c.cid]), self._siblings)
            if self.verifier == "token_level":
                walk, tests = token_level_walk(self.target_probs, draft, tokens, parents, kids, u[:b])
            else:
                walk = point_mass_walk(self.target_probs, tokens, parents, kids, u[:b])
            match = valid & (walk.chosen.index_select(0, parents) == self._arange_b)
        else:
            am = self.target_out[0].long()
            match = valid & (tokens == am.index_select(0, parents))
        acc = (self.anc_t <= (match | is_root)[None, :]).all(1)  # [B] every node from the root to the slot matched
        last = torch.argmax(torch.where(acc, depth, -1)).view(1)  # the deepest accepted node (they form a path)
        on_path = self.anc_t.index_select(0, last)[0]  # (a 0-dim index would read the device)
        at = (depth[None, :] == self._arange_path[:, None]) & on_path[None, :]
        path = (at.long() * self._arange_b[None, :]).sum(1)  # [depth + 1] node at each depth (0 past the end)
        if not self.stochastic:
            bonus = am.index_select(0, last)
            drawn = self._no_draw  # (the host has p_target(bonus) from target_out: p_argmax at the last node)
        elif self.verifier == "token_level":
            bonus, p_bonus = token_level_bonus(self.target_probs, draft, tests, kids, last, u[b:])
            drawn = torch.cat([p_bonus, u[b:]])
        else:
            bonus = walk.out[DRAWN].index_select(0, last).long()
            drawn = torch.cat([walk.out[RESIDUAL].index_select(0, last), u.index_select(0, last)])
        if self.stochastic:
            self.walk_out.copy_(walk.out)
            drawn = torch.cat([drawn, self.target_probs.index_select(0, last)[0].index_select(0, bonus).double()])
        row = self.tree[4].index_select(0, last)
        root_p = self.root_probs[0].index_select(0, bonus)
        node_p = self.c.rows.index_select(0, (last - 1).clamp(min=0))[0].index_select(0, bonus)
        p_draft = torch.where(row >= 0, torch.where(last == 0, root_p, node_p).double(), float("nan"))
        self.step_out.copy_(torch.cat([path.double(), on_path.sum().double().view(1), bonus.double(), p_draft,
                                       last.double(), drawn]))

    def _commit_program(self):
        d = self.env.depth
        path = self.step_out[: d + 1].long()
        n_path = self.step_out[d + 1].long()
        bonus = self.step_out[d + 2].long()
        last = self.step_out[d + 4].long()
        if self.tf is not None:
            t_len = self.t_len
            self.tf.kv.keep_path(t_len + path, t_len + self._arange_path)
            self.t_len.add_(n_path)
        row = self.tree[4].index_select(0, path)
        forwarded = (row >= 0) & (self._arange_path < n_path)
        base = self.d_len
        keep = base + self.a_valid.long()
        self.df.kv.keep_path(base + 1 + row.clamp(min=0), keep + self._arange_path)
        self.d_len.copy_(keep + forwarded.sum())
        last = last.view(1)
        self.a_tok.copy_(self.tree[0].index_select(0, last))
        self.a_valid.copy_(self.tree[4].index_select(0, last)[0] < 0)
        self.root.copy_(bonus.view(1))


def _grows(c: Candidates, depth: torch.Tensor) -> torch.Tensor:
    """``[1]`` bool: some real slot of ``c`` is at ``depth`` (the next level has a node to forward)."""
    return live_slots(c, depth).any().view(1)


def _store(dst: Candidates, src: Candidates) -> None:
    for a, b in zip(dst, src):
        a.copy_(b)
