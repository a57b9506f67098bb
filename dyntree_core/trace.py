"""Per-step records the engine yields; the UI and the benchmarks only ever read these."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional

import numpy as np
import torch

from .tree import TokenTree
from .verify.base import VerifyDecision

TokenKind = Literal["accepted", "bonus", "autoregressive", "prompt"]
NodeStatus = Literal["root", "accepted", "rejected", "unverified"]
PHASES: tuple[str, ...] = (
    "draft",
    "tree_build",
    "mask",
    "target_forward",
    "verify",
    "kv_compaction",
    "offload_transfer",
)


@dataclass(frozen=True)
class PrefillProgress:
    """The prompt's prefill so far (``SpeculativeDecoder.generate(prefill_progress=True)`` yields one
    before the first chunk and one after each): ``done`` of ``total`` prompt tokens fed (target and
    draft both count), ``seconds`` since the prefill began, ``stopped`` when a stop ended it early;
    ``compiling``: what the first step is about to compile (graph steps meeting a new size bucket on a
    GPU: minutes), empty otherwise."""

    done: int
    total: int
    seconds: float
    stopped: bool = False
    compiling: str = ""


@dataclass(frozen=True)
class TokenProvenance:
    """Where one committed token came from.

    Attributes:
        token_id: the token.
        step: decoding step that committed it (0-based).
        depth: depth in that step's tree (1 = child of the root); bonus tokens get
            ``len(accepted path)``; autoregressive tokens get 1.
        node: tree node id, -1 for bonus / autoregressive tokens.
        kind: ``accepted`` (a draft token the target accepted), ``bonus`` (sampled from the target
            or its residual after the last accepted node), ``autoregressive`` (baseline).
        p_draft: draft probability of the token at its parent (NaN for bonus / AR).
        p_target: target probability of the token at its parent.
        accept_prob: probability with which the verifier accepted it (NaN for bonus / AR).
    """

    token_id: int
    step: int
    depth: int
    node: int
    kind: TokenKind
    p_draft: float = math.nan
    p_target: float = math.nan
    accept_prob: float = math.nan


@dataclass
class PhaseTimings:
    """Wall-clock seconds of each phase of one step (0 where a phase did not run).
    ``offload_transfer`` is the part of ``target_forward`` spent waiting for the offloaded target's
    weights to arrive, not a phase of its own: ``total`` counts it once, inside the forward."""

    draft: float = 0.0
    tree_build: float = 0.0
    mask: float = 0.0
    target_forward: float = 0.0
    verify: float = 0.0
    kv_compaction: float = 0.0
    offload_transfer: float = 0.0

    @property
    def total(self) -> float:
        return sum(getattr(self, p) for p in PHASES if p != "offload_transfer")

    def as_dict(self) -> dict[str, float]:
        return {p: float(getattr(self, p)) for p in PHASES}


@dataclass
class StepTrace:
    """One decoding step.

    Attributes:
        step: 0-based step index.
        method, verifier: what produced this step.
        tree: the drafted tree (None for the autoregressive baseline).
        accepted_nodes: accepted node ids, root first (``[0]`` when nothing was accepted).
        bonus_token: the target's token after the accepted path.
        committed: the tokens this step appended to the output, with provenance.
        node_status: ``[N]`` status per tree node (empty for AR).
        node_p_target: ``[N]`` float64 target probability of each node's token (NaN root).
        node_accept_prob: ``[N]`` float64 acceptance probability for tested nodes, else NaN.
        block_counts: ``{order: {block_size: non-empty blocks}}`` of the tree mask, orders
            ``bfs``/``dfs``/``hpd``, block sizes 16/32/64 (empty when disabled).
        timings: per-phase seconds.
        node_order: the order the target's tree forward ran in (``dfs``/``hpd``/``bfs``;
            ``DecodeConfig.node_order``); node ids everywhere else stay the tree's own.
        node_slots: ``[N]`` the node at each forward slot (slot -> node permutation; empty for AR).
        order_blocks: ``{block_size: non-empty blocks}`` of the tree mask in the order run (empty
            when block counts are disabled).
        kernel_blocks: non-empty (query block x key block) tiles the Triton kernel visited in the
            tree part, or None when the forward did not run the kernel or block counts are
            disabled (``DecodeConfig.trace_block_counts``).
        decisions: the verifier's decisions in the order made (the verification walkthrough).
        draft_source: what proposed the tree's tokens: ``model`` (the draft model) or ``suffix``
            (the text so far, no draft forward); empty for the autoregressive baseline.
        draft_forwards: the draft model's forwards in this step (a graph step's: its draft levels,
            the root's included); 0 without a draft forward.
        fallback: on the step after which the run decodes plainly (``DecodeConfig.fallback``), why;
            empty otherwise.
        step_seconds: wall-clock seconds of the whole step.
        elapsed: seconds since generation started (prefill included).
        total_new_tokens: tokens generated so far (this step included).
        tokens_per_s: ``total_new_tokens / elapsed``.
        finished: True on the last step; ``finish_reason`` then says why: ``eos`` (an end-of-sequence
            token was committed), ``length`` (``max_new_tokens`` reached), ``context`` (the model's
            context is full) or ``stopped`` (the caller's stop event).
    """

    step: int
    method: str
    verifier: str
    tree: Optional[TokenTree]
    accepted_nodes: list[int]
    bonus_token: int
    committed: list[TokenProvenance]
    node_status: list[NodeStatus] = field(default_factory=list)
    node_p_target: np.ndarray = field(default_factory=lambda: np.zeros(0))
    node_accept_prob: np.ndarray = field(default_factory=lambda: np.zeros(0))
    block_counts: dict[str, dict[int, int]] = field(default_factory=dict)
    timings: PhaseTimings = field(default_factory=PhaseTimings)
    node_order: str = ""
    node_slots: list[int] = field(default_factory=list)
    order_blocks: dict[int, int] = field(default_factory=dict)
    kernel_blocks: Optional[int] = None
    decisions: list[VerifyDecision] = field(default_factory=list)
    draft_source: str = ""
    draft_forwards: int = 0
    fallback: str = ""
    step_seconds: float = 0.0
    elapsed: float = 0.0
    total_new_tokens: int = 0
    tokens_per_s: float = 0.0
    finished: bool = False
    finish_reason: Optional[str] = None

    @property
    def num_committed(self) -> int:
        return len(self.committed)

    @property
    def tree_size(self) -> int:
        return 0 if self.tree is None else self.tree.size

    @property
    def cut_nodes(self) -> list[int]:
        """Accepted-path nodes (root excluded) the verifier accepted but the run did not commit:
        the length limit, the context or an earlier EOS (``finish_reason``) ended the run first."""
        kept = sum(1 for c in self.committed if c.kind == "accepted")
        return [int(v) for v in self.accepted_nodes[1 + kept:]]

    @property
    def bonus_cut(self) -> bool:
        """The verifier drew a bonus token that the run did not commit (see ``cut_nodes``)."""
        return self.tree is not None and not any(c.kind == "bonus" for c in self.committed)

    @classmethod
    def from_dict(cls, d: dict) -> "StepTrace":
        """The trace ``to_dict`` wrote (after a JSON round trip). The tree comes back without the
        draft distributions (``draft_probs``), which the export does not store."""
        tree = None
        if d.get("tree") is not None:
            t = d["tree"]
            n = len(t["tokens"])
            value = t.get("value")
            tree = TokenTree(
                tokens=torch.tensor(t["tokens"], dtype=torch.long),
                parents=torch.tensor(t["parents"], dtype=torch.long),
                child_rank=torch.tensor(t["child_rank"], dtype=torch.long),
                draft_logprob=torch.tensor([_nan(x) for x in t["draft_logprob"]], dtype=torch.float64),
                sampled=t["sampled"],
                draft_row=torch.full((n,), -1, dtype=torch.long),
                value=None if value is None else torch.tensor([_nan(x) for x in value], dtype=torch.float64),
            )
        timings = PhaseTimings(**{p: float(d["timings"].get(p, 0.0)) for p in PHASES})
        return cls(
            step=int(d["step"]), method=d["method"], verifier=d["verifier"], tree=tree,
            accepted_nodes=[int(x) for x in d["accepted_nodes"]], bonus_token=int(d["bonus_token"]),
            committed=[TokenProvenance(int(c["token_id"]), int(c["step"]), int(c["depth"]), int(c["node"]), c["kind"],
                                       _nan(c["p_draft"]), _nan(c["p_target"]), _nan(c["accept_prob"]))
                       for c in d["committed"]],
            node_status=list(d.get("node_status", [])),
            node_p_target=np.array([_nan(x) for x in d.get("node_p_target", [])], dtype=np.float64),
            node_accept_prob=np.array([_nan(x) for x in d.get("node_accept_prob", [])], dtype=np.float64),
            block_counts={o: {int(b): int(n) for b, n in c.items()} for o, c in d.get("block_counts", {}).items()},
            timings=timings,
            node_order=d.get("node_order", ""),
            node_slots=[int(x) for x in d.get("node_slots", [])],
            order_blocks={int(b): int(n) for b, n in d.get("order_blocks", {}).items()},
            kernel_blocks=d.get("kernel_blocks"),
            decisions=[VerifyDecision.from_dict(x) for x in d.get("decisions", [])],
            draft_source=d.get("draft_source", "" if tree is None else "model"),
            draft_forwards=int(d.get("draft_forwards", 0)), fallback=d.get("fallback", ""),
            step_seconds=float(d["step_seconds"]), elapsed=float(d["elapsed"]),
            total_new_tokens=int(d["total_new_tokens"]), tokens_per_s=float(d["tokens_per_s"]),
            finished=bool(d["finished"]), finish_reason=d.get("finish_reason"),
        )

    def to_dict(self) -> dict:
        """JSON-ready view (tree as parent/token lists)."""
        tree = None
        if self.tree is not None:
            t = self.tree
            tree = {
                "tokens": t.tokens.tolist(),
                "parents": t.parents.tolist(),
                "depth": t.depth.tolist(),
                "child_rank": t.child_rank.tolist(),
                "draft_logprob": [_f(x) for x in t.draft_logprob.tolist()],
                "sampled": t.sampled,
                "value": None if t.value is None else [_f(x) for x in t.value.tolist()],
            }
        return {
            "step": self.step,
            "method": self.method,
            "verifier": self.verifier,
            "tree": tree,
            "accepted_nodes": list(self.accepted_nodes),
            "bonus_token": int(self.bonus_token),
            "committed": [
                {
                    "token_id": c.token_id,
                    "step": c.step,
                    "depth": c.depth,
                    "node": c.node,
                    "kind": c.kind,
                    "p_draft": _f(c.p_draft),
                    "p_target": _f(c.p_target),
                    "accept_prob": _f(c.accept_prob),
                }
                for c in self.committed
            ],
            "node_status": list(self.node_status),
            "node_p_target": [_f(x) for x in np.asarray(self.node_p_target).tolist()],
            "node_accept_prob": [_f(x) for x in np.asarray(self.node_accept_prob).tolist()],
            "block_counts": {o: {str(b): n for b, n in d.items()} for o, d in self.block_counts.items()},
            "timings": self.timings.as_dict(),
            "node_order": self.node_order,
            "node_slots": list(self.node_slots),
            "order_blocks": {str(b): n for b, n in self.order_blocks.items()},
            "kernel_blocks": self.kernel_blocks,
            "decisions": [x.to_dict() for x in self.decisions],
            "draft_source": self.draft_source,
            "draft_forwards": self.draft_forwards,
            "fallback": self.fallback,
            "step_seconds": self.step_seconds,
            "elapsed": self.elapsed,
            "total_new_tokens": self.total_new_tokens,
            "tokens_per_s": self.tokens_per_s,
            "finished": self.finished,
            "finish_reason": self.finish_reason,
        }


def _f(x: float) -> Optional[float]:
    x = float(x)
    return None if math.isnan(x) else x


def _nan(x: Optional[float]) -> float:
    """JSON ``null`` (how ``to_dict`` writes NaN) back to NaN."""
    return math.nan if x is None else float(x)
