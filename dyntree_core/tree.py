"""Token trees: flat node tensors, node orders, ancestor masks and mask block counts.

Node 0 is the root: the last committed token (the pending bonus token of the previous step).
Every other node has a parent with a smaller index (construction order is a valid topological
order). Depth counts edges from the root (root depth 0); "tree depth" in the papers' sense is
``max(depth) + 1`` levels including the root.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, Optional, Sequence

import torch

SampledKind = Literal["swor", "iid", "topk"]
Order = Literal["bfs", "dfs", "hpd"]
SAMPLED_KINDS: tuple[str, ...] = ("swor", "iid", "topk")
ORDERS: tuple[str, ...] = ("bfs", "dfs", "hpd")
#: mask block sizes the traces and the app count non-empty blocks at
BLOCK_SIZES: tuple[int, ...] = (16, 32, 64)


@dataclass
class TokenTree:
    """A draft token tree in construction order (node 0 = root).

    Attributes:
        tokens: ``[N]`` int64 token ids.
        parents: ``[N]`` int64 parent index, ``-1`` for the root; ``parents[i] < i``.
        child_rank: ``[N]`` int64 order in which siblings were drawn (0 = first draw).
        draft_logprob: ``[N]`` float64 log q(token | parent path) under the parent's full draft
            distribution (0 for the root). For ``swor`` trees this is the *unconditioned* draft
            probability, not the residual one.
        sampled: how siblings were produced: ``swor`` (without replacement), ``iid`` (with
            replacement, duplicates possible) or ``topk`` (deterministic, not sampled).
        draft_probs: optional ``[M, V]`` float draft next-token distributions (after the draft
            temperature) for the nodes that have them; ``draft_row[i]`` indexes it or is -1.
            Stochastic verifiers need a row for every internal node.
        draft_row: ``[N]`` int64 row of ``draft_probs`` for each node, -1 when absent.
        value: optional ``[N]`` float64 drafter's estimated acceptance value of each node.
        source_index: optional ``[N]`` int64 index each node had in the tree the drafter handed to
            its ``DraftSource`` (identity when None); lets the engine reuse the draft model's KV
            of accepted nodes when a drafter prunes or renumbers its working tree.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    child_rank: torch.Tensor
    draft_logprob: torch.Tensor
    sampled: SampledKind
    draft_probs: Optional[torch.Tensor] = None
    draft_row: Optional[torch.Tensor] = None
    value: Optional[torch.Tensor] = None
    source_index: Optional[torch.Tensor] = None
    depth: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        if self.sampled not in SAMPLED_KINDS:
            raise ValueError(f"sampled must be one of {SAMPLED_KINDS}, got {self.sampled!r}")
        n = self.tokens.shape[0]
        if n < 1:
            raise ValueError("a token tree has at least the root node")
        for name in ("parents", "child_rank", "draft_logprob"):
            if getattr(self, name).shape != (n,):
                raise ValueError(f"{name} must have shape [{n}], got {tuple(getattr(self, name).shape)}")
        par = self.parents.tolist()
        if par[0] != -1:
            raise ValueError("node 0 must be the root (parent -1)")
        depth = [0] * n
        for i in range(1, n):
            p = par[i]
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}; parents must precede their children")
            depth[i] = depth[p] + 1
        self.depth = torch.tensor(depth, dtype=torch.long)
        if self.draft_row is None:
            self.draft_row = torch.full((n,), -1, dtype=torch.long)

    # ------------------------------------------------------------------ basic structure
    @property
    def size(self) -> int:
        """Number of nodes including the root."""
        return int(self.tokens.shape[0])

    @property
    def num_levels(self) -> int:
        """Depth in the papers' sense: number of levels including the root."""
        return int(self.depth.max().item()) + 1

    def children(self) -> list[list[int]]:
        """Children of each node, in draw order (child_rank)."""
        kids: list[list[int]] = [[] for _ in range(self.size)]
        par = self.parents.tolist()
        for i in range(1, self.size):
            kids[par[i]].append(i)
        rank = self.child_rank.tolist()
        for k in kids:
            k.sort(key=lambda c: rank[c])
        return kids

    def path_to(self, node: int) -> list[int]:
        """Node ids from the root to ``node`` inclusive."""
        par = self.parents.tolist()
        path = [node]
        while par[path[-1]] >= 0:
            path.append(par[path[-1]])
        return path[::-1]

    def subtree_size(self) -> torch.Tensor:
        """``[N]`` int64 number of nodes in each node's subtree (itself included)."""
        return ancestor_matrix(self.parents, self.num_levels).sum(dim=0)

    def draft_dist(self, node: int) -> torch.Tensor:
        """``[V]`` draft distribution at ``node`` (for drawing its children)."""
        if self.draft_probs is None or int(self.draft_row[node]) < 0:
            raise KeyError(f"node {node} has no recorded draft distribution")
        return self.draft_probs[int(self.draft_row[node])]

    def positions(self, prefix_len: int) -> torch.Tensor:
        """``[N]`` position ids: ``prefix_len - 1 + depth`` (root sits at the last prefix slot).

        ``prefix_len`` counts committed tokens including the root.
        """
        return self.depth + (prefix_len - 1)

    # ------------------------------------------------------------------ orders
    def order(self, kind: Order) -> torch.Tensor:
        """``[N]`` permutation: ``order[j]`` is the node placed at slot ``j``.

        bfs: construction order sorted by depth (stable); dfs: pre-order, children in draw
        order; hpd: pre-order visiting the heaviest (largest subtree) child first (ties in draw
        order). Computed by ``order_of`` (tensor ops, any device).
        """
        return order_of(self.parents, self.child_rank, kind, self.num_levels)

    def permuted(self, order: torch.Tensor) -> "TokenTree":
        """The same tree with nodes renumbered so that new node j = old node ``order[j]``.

        ``order[0]`` must be the root and every parent must precede its children in ``order``.
        """
        n = self.size
        inv = torch.empty(n, dtype=torch.long)
        inv[order] = torch.arange(n)
        par = self.parents[order]
        new_par = torch.where(par >= 0, inv[par.clamp(min=0)], par)
        return replace(
            self,
            tokens=self.tokens[order],
            parents=new_par,
            child_rank=self.child_rank[order],
            draft_logprob=self.draft_logprob[order],
            draft_row=self.draft_row[order],
            value=None if self.value is None else self.value[order],
            source_index=self.source_ids()[order],
        )

    def source_ids(self) -> torch.Tensor:
        """``[N]`` index of each node in the drafter's ``DraftSource`` tree."""
        if self.source_index is None:
            return torch.arange(self.size)
        return self.source_index

    # ------------------------------------------------------------------ masks
    def ancestor_mask(self, order: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[N, N]`` bool: ``mask[q, k]`` is True iff slot k's node is an ancestor of (or is) slot q's.

        Slots follow ``order`` (construction order when None).
        """
        anc = ancestor_matrix(self.parents, self.num_levels)
        if order is not None:
            anc = anc[order][:, order]
        return anc

    def block_count(self, order: Order | torch.Tensor, block_size: int) -> int:
        """Number of non-empty ``block_size``² blocks of the tree part of the attention mask."""
        perm = self.order(order) if isinstance(order, str) else order
        return count_nonzero_blocks(self.ancestor_mask(perm), block_size)


# ---------------------------------------------------------------------- tensor layout (any device)
# Node orders and ancestor masks from the parent array with a fixed number of vectorised steps
# (no per-node Python loop, nothing read back to the host), so a tree drafted on the GPU is laid
# out there. ``levels`` bounds the number of nodes on any root path (max depth + 1); a larger
# value is harmless.


def ancestor_matrix(parents: torch.Tensor, levels: int) -> torch.Tensor:
    """``[N, N]`` bool ``anc[i, j]``: node j is an ancestor of (or is) node i.

    Args:
        parents: ``[N]`` int64 parent ids (-1 for the root, or for padding nodes that are their
            own roots), on any device.
        levels: at least the number of nodes on the longest root path (max depth + 1).
    """
    n = parents.shape[0]
    dev = parents.device
    anc = torch.zeros(n, n + 1, dtype=torch.bool, device=dev)  # column n absorbs finished walks
    rows = torch.arange(n, device=dev)
    cur = rows.clone()
    for _ in range(int(levels)):
        live = cur >= 0
        anc[rows, torch.where(live, cur, n)] = True
        cur = torch.where(live, parents[cur.clamp(min=0)], -1)
    return anc[:, :n]


def order_of(parents: torch.Tensor, child_rank: torch.Tensor, kind: str, levels: int,
             anc: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[N]`` slot -> node permutation of ``kind`` (``bfs``/``dfs``/``hpd``, see ``TokenTree.order``).

    A pre-order slot is ``Σ (1 + size of the earlier siblings)`` over the node's non-root
    ancestors-or-self, "earlier" meaning lower draw rank (dfs) or larger subtree, then lower rank
    (hpd); ties fall back to the node id, as a stable sort would.

    Args:
        parents, child_rank: ``[N]`` int64 (any device).
        levels: see ``ancestor_matrix``; anc: its result when the caller has it.
    """
    if kind not in ORDERS:
        raise ValueError(f"unknown order {kind!r}; choose one of {ORDERS}")
    if anc is None:
        anc = ancestor_matrix(parents, levels)
    depth = anc.sum(dim=1) - 1
    if kind == "bfs":
        return torch.sort(depth, stable=True).indices
    n = parents.shape[0]
    size = anc.sum(dim=0)
    ids = torch.arange(n, device=parents.device)
    rank = child_rank.to(parents.device)
    # earlier[v, s]: s is a sibling of v visited before it
    sib = (parents[:, None] == parents[None, :]) & (ids[:, None] != ids[None, :]) & (parents[:, None] >= 0)
    first = (rank[None, :] < rank[:, None]) | ((rank[None, :] == rank[:, None]) & (ids[None, :] < ids[:, None]))
    if kind == "hpd":
        first = (size[None, :] > size[:, None]) | ((size[None, :] == size[:, None]) & first)
    offset = ((sib & first).long() * size[None, :]).sum(dim=1)
    step = torch.where(parents >= 0, 1 + offset, torch.zeros_like(offset))
    pos = (anc.long() * step[None, :]).sum(dim=1)
    perm = torch.empty_like(pos)
    perm[pos] = ids
    return perm


def count_nonzero_blocks(mask: torch.Tensor, block_size: int) -> int:
    """Number of ``block_size``×``block_size`` tiles of a ``[Q, K]`` bool mask with any True."""
    q, k = mask.shape
    if q <= block_size and k <= block_size:  # (one tile)
        return int(bool(mask.any()))
    nq, nk = -(-q // block_size), -(-k // block_size)
    padded = torch.zeros(nq * block_size, nk * block_size, dtype=torch.bool)
    padded[:q, :k] = mask
    tiles = padded.view(nq, block_size, nk, block_size).any(dim=3).any(dim=1)
    return int(tiles.sum().item())


def tree_from_parents(
    parents: Sequence[int],
    tokens: Optional[Sequence[int]] = None,
    sampled: SampledKind = "swor",
    child_rank: Optional[Sequence[int]] = None,
) -> TokenTree:
    """Build a bare tree from a parent list (tests, synthetic benchmark trees).

    Child ranks default to the order in which siblings appear in ``parents``.
    """
    n = len(parents)
    if tokens is None:
        tokens = list(range(n))
    if child_rank is None:
        seen: dict[int, int] = {}
        child_rank = []
        for p in parents:
            child_rank.append(seen.get(p, 0))
            seen[p] = seen.get(p, 0) + 1
    return TokenTree(
        tokens=torch.tensor(list(tokens), dtype=torch.long),
        parents=torch.tensor(list(parents), dtype=torch.long),
        child_rank=torch.tensor(list(child_rank), dtype=torch.long),
        draft_logprob=torch.zeros(n, dtype=torch.float64),
        sampled=sampled,
    )


def chain_tree(tokens: Sequence[int], sampled: SampledKind = "iid") -> TokenTree:
    """A chain root -> t1 -> t2 ... (``tokens[0]`` is the root)."""
    return tree_from_parents(list(range(-1, len(tokens) - 1)), tokens, sampled=sampled)
