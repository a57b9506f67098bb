"""Tree-attention masks and the block metadata the Triton kernel consumes.

Conventions (one sequence, batch 1):

- The key/value sequence is ``[dense part | tree part]``: the first ``P`` columns (the cached
  prefix) are visible to every query row, the remaining ``W`` columns carry a per-element mask.
- For a ``TokenTree`` of ``T`` nodes laid out in a given order, ``W == T`` and query row ``i`` is
  the node in slot ``i``; ``mask[i, P + j]`` is True iff slot ``j`` is an ancestor of (or is)
  slot ``i``.
- In a pre-order (DFS or HPD) the tree part is an *interval mask*: with
  ``subtree_end[k] = k + subtree_size(slot k)``, ``mask[q, k] = (k <= q) & (q < subtree_end[k])``.

Block lists (FlexAttention / FA4 style): for query blocks of ``block_q`` rows and tree key blocks
of ``block_n`` columns, ``BlockLists`` stores, per query block, the compacted indices of the
non-empty key blocks, split into *full* (every in-range element visible: no mask needed) and
*partial* (the kernel evaluates the element mask). Empty blocks are never listed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from dyntree_core.tree import TokenTree, ancestor_matrix, order_of

Order = str  # "bfs" | "dfs" | "hpd" | "gen" (construction order)


def order_permutation(tree: TokenTree, order: str | torch.Tensor) -> torch.Tensor:
    """``[T]`` permutation (slot -> node) for an order name or an explicit permutation.

    ``"gen"`` is the construction order (identity); the others are ``TokenTree.order``.
    """
    if isinstance(order, torch.Tensor):
        return order.to(torch.long)
    if order == "gen":
        return torch.arange(tree.size)
    return tree.order(order)  # type: ignore[arg-type]


def tree_mask(tree: TokenTree, order: str | torch.Tensor = "dfs") -> torch.Tensor:
    """``[T, T]`` bool ancestor-or-self mask with slots in ``order``."""
    return tree.ancestor_mask(order_permutation(tree, order))


def attention_mask_4d(
    tree: TokenTree, prefix_len: int, order: str | torch.Tensor = "dfs", device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``[1, 1, T, P + T]`` bool mask (True = attend): prefix fully visible, ancestors in the tree."""
    t = tree.size
    out = torch.zeros(1, 1, t, prefix_len + t, dtype=torch.bool)
    out[..., :prefix_len] = True
    out[0, 0, :, prefix_len:] = tree_mask(tree, order)
    return out.to(device)


def subtree_end(tree: TokenTree, order: str | torch.Tensor = "dfs") -> torch.Tensor:
    """``[T]`` int32 ``k + subtree_size(slot k)``: the interval form of the mask in a pre-order.

    Raises ``ValueError`` when ``order`` is not a pre-order (every subtree contiguous), because
    the interval form would then be a different mask.
    """
    perm = order_permutation(tree, order)
    end = torch.arange(tree.size) + tree.subtree_size()[perm]
    if not is_preorder(tree, perm):
        raise ValueError("the interval (subtree_end) form needs a pre-order such as dfs or hpd")
    return end.to(torch.int32)


def is_preorder(tree: TokenTree, perm: torch.Tensor) -> bool:
    """True iff every subtree occupies the contiguous slot range ``[slot, slot + size)``.

    Checked by definition: the interval mask built from ``subtree_end`` equals the ancestor mask.
    """
    perm = perm.to(torch.long)
    end = torch.arange(tree.size) + tree.subtree_size()[perm]
    return bool(torch.equal(interval_mask(end), tree.ancestor_mask(perm)))


def interval_mask(end: torch.Tensor) -> torch.Tensor:
    """``[T, T]`` bool ``(k <= q) & (q < end[k])`` for a ``[T]`` ``subtree_end`` vector."""
    t = end.shape[0]
    q = torch.arange(t, device=end.device)[:, None]
    k = torch.arange(t, device=end.device)[None, :]
    return (k <= q) & (q < end.to(torch.long)[None, :])


@dataclass
class BlockLists:
    """Per-query-block compacted key-block lists for the tree part of the mask.

    Attributes:
        full_cnt: ``[NQ]`` int32 number of full key blocks of each query block.
        full_idx: ``[NQ, NK]`` int32 their key-block indices (first ``full_cnt[b]`` valid, rest -1).
        part_cnt: ``[NQ]`` int32 number of partial key blocks.
        part_idx: ``[NQ, NK]`` int32 their indices (first ``part_cnt[b]`` valid, rest -1).
        block_q: query rows per query block.
        block_n: key columns per key block.
        n_q: number of query rows the lists were built for.
        width: number of tree key columns ``W``.
    """

    full_cnt: torch.Tensor
    full_idx: torch.Tensor
    part_cnt: torch.Tensor
    part_idx: torch.Tensor
    block_q: int
    block_n: int
    n_q: int
    width: int

    @property
    def num_nonzero(self) -> int:
        """Total number of listed (non-empty) blocks."""
        return int(self.full_cnt.sum().item() + self.part_cnt.sum().item())

    def to(self, device: torch.device | str) -> "BlockLists":
        return BlockLists(
            self.full_cnt.to(device), self.full_idx.to(device), self.part_cnt.to(device),
            self.part_idx.to(device), self.block_q, self.block_n, self.n_q, self.width,
        )


def _compact(flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[NQ, NK]`` bool -> (``[NQ]`` int32 counts, ``[NQ, NK]`` int32 indices of True, -1 padded)."""
    nq, nk = flags.shape
    cols = torch.arange(nk, device=flags.device).expand(nq, nk)
    # Sort key: listed blocks first in increasing index order, unlisted after.
    key = torch.where(flags, cols, cols + nk)
    order = torch.sort(key, dim=1).indices
    cnt = flags.sum(dim=1)
    idx = torch.where(torch.arange(nk, device=flags.device)[None, :] < cnt[:, None], order, -1)
    return cnt.to(torch.int32).contiguous(), idx.to(torch.int32).contiguous()


def build_block_lists(mask: torch.Tensor, block_q: int, block_n: int) -> BlockLists:
    """Block lists for a ``[Q, W]`` bool mask of the tree part (rows = queries, cols = tree keys).

    A block is *empty* if no in-range element is True, *full* if every in-range element is True
    (out-of-range padding is ignored: the kernel masks it by bounds), *partial* otherwise.
    Works on any device; nothing is synchronised to the host.
    """
    if mask.dim() != 2:
        raise ValueError(f"mask must be [Q, W], got {tuple(mask.shape)}")
    q, w = mask.shape
    nq, nk = -(-q // block_q), max(1, -(-w // block_n))
    pad_any = torch.zeros(nq * block_q, nk * block_n, dtype=torch.bool, device=mask.device)
    pad_all = torch.ones(nq * block_q, nk * block_n, dtype=torch.bool, device=mask.device)
    pad_any[:q, :w] = mask
    pad_all[:q, :w] = mask
    any_ = pad_any.view(nq, block_q, nk, block_n).any(dim=3).any(dim=1)
    all_ = pad_all.view(nq, block_q, nk, block_n).all(dim=3).all(dim=1)
    if w == 0:
        any_ = torch.zeros_like(any_)
    full = any_ & all_
    part = any_ & ~all_
    fc, fi = _compact(full)
    pc, pi = _compact(part)
    return BlockLists(fc, fi, pc, pi, block_q, block_n, q, w)


def dense_prefix_len(mask: torch.Tensor) -> int:
    """Number of leading key columns visible to every live query row of a ``[Q, KV]`` bool mask.

    Rows with no visible key at all ("dead" padding rows) are ignored: their output is defined
    as zero, as SDPA returns. One host synchronisation.
    """
    live = mask.any(dim=1)
    if not bool(live.any()):
        return 0
    cols_all = mask[live].all(dim=0)
    # Length of the leading run of True.
    not_all = (~cols_all).nonzero()
    return int(not_all[0, 0]) if not_all.numel() else int(mask.shape[1])


@dataclass
class TreeAttnMeta:
    """Everything the kernel needs besides q/k/v for one forward.

    Attributes:
        prefix_len: ``P``, number of dense (unmasked) leading key columns.
        blocks: block lists of the tree part.
        mask: ``[Q, W]`` bool tree-part mask (partial blocks read it) or None in interval mode.
        end: ``[W]`` int32 ``subtree_end`` (interval mode, requires ``Q == W`` rows aligned with
            columns) or None.
        dead_rows: ``[Q]`` bool rows with no visible key (output forced to 0) or None.
    """

    prefix_len: int
    blocks: BlockLists
    mask: Optional[torch.Tensor] = None
    end: Optional[torch.Tensor] = None
    dead_rows: Optional[torch.Tensor] = None


def meta_from_tree(
    tree: TokenTree, prefix_len: int, order: str | torch.Tensor, block_q: int, block_n: int,
    device: torch.device | str = "cpu", interval: Optional[bool] = None, mask: Optional[torch.Tensor] = None,
) -> TreeAttnMeta:
    """Kernel metadata for tree tokens in ``order`` after a ``prefix_len`` prefix.

    ``interval=None`` uses the interval form whenever the order is a pre-order. ``mask``: the
    ``[T, T]`` ancestor mask in that order when the caller has it already (else it is built).
    """
    perm = order_permutation(tree, order)
    m = tree.ancestor_mask(perm) if mask is None else mask
    use_interval = is_preorder(tree, perm) if interval is None else interval
    end = subtree_end(tree, perm).to(device) if use_interval else None
    blocks = build_block_lists(m, block_q, block_n).to(device)
    return TreeAttnMeta(prefix_len, blocks, None if use_interval else m.to(device), end)


@dataclass
class TreeLayout:
    """A tree laid out for the target's forward in one node order (all tensors on the parents' device).

    Attributes:
        perm: ``[N]`` int64 slot -> node.
        slot: ``[N]`` int64 node -> slot.
        depth: ``[N]`` int64 depth of each node (node ids).
        mask: ``[N, N]`` bool ancestor-or-self mask in slot order (what SDPA's mask holds after the prefix).
        end: ``[N]`` int32 ``subtree_end`` in slot order for the pre-orders (dfs, hpd), else None.
        blocks: the kernel's block lists of ``mask`` when tiles were given, else None.
    """

    perm: torch.Tensor
    slot: torch.Tensor
    depth: torch.Tensor
    mask: torch.Tensor
    end: Optional[torch.Tensor]
    blocks: Optional[BlockLists]

    def meta(self, prefix_len: int) -> TreeAttnMeta:
        """The kernel's metadata after a ``prefix_len`` dense prefix (interval form when ``end`` is set)."""
        if self.blocks is None:
            raise ValueError("this layout was built without kernel tiles")
        return TreeAttnMeta(prefix_len, self.blocks, None if self.end is not None else self.mask, self.end)


def layout_from_parents(parents: torch.Tensor, child_rank: torch.Tensor, order: str, levels: int,
                        kernel_tiles: Optional[tuple[int, int]] = None) -> TreeLayout:
    """Order, slot map, mask and (with ``kernel_tiles = (block_q, block_n)``) kernel block lists of a
    tree given by its ``[N]`` parent array, with tensor ops on the parents' device: nothing is read
    back to the host, so a tree drafted on the GPU is laid out there.

    ``levels``: at least the tree's max depth + 1 (``tree.ancestor_matrix``).
    """
    anc = ancestor_matrix(parents, levels)
    perm = order_of(parents, child_rank, order, levels, anc=anc)
    n = parents.shape[0]
    ids = torch.arange(n, device=parents.device)
    slot = torch.empty_like(perm)
    slot[perm] = ids
    mask = anc[perm][:, perm]
    end = (ids + anc.sum(dim=0)[perm]).to(torch.int32) if order in ("dfs", "hpd") else None
    blocks = build_block_lists(mask, *kernel_tiles) if kernel_tiles is not None else None
    return TreeLayout(perm, slot, anc.sum(dim=1) - 1, mask, end, blocks)


def meta_from_mask(mask: torch.Tensor, block_q: int, block_n: int) -> TreeAttnMeta:
    """Kernel metadata derived generically from a ``[Q, KV]`` bool mask (True = attend)."""
    p = dense_prefix_len(mask)
    tree_part = mask[:, p:].contiguous()
    dead = ~mask.any(dim=1)
    blocks = build_block_lists(tree_part, block_q, block_n)
    return TreeAttnMeta(p, blocks, tree_part, None, dead)


def placeholder_mask(q: int, kv: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[q, kv]`` bool all-True view of one element (no ``q x kv`` storage, nothing to transfer):
    the mask argument of a forward whose attention reads ``TreeAttnMeta`` instead. A glue that
    cannot run the kernel for a call must rebuild the real mask from the metadata
    (``is_placeholder``)."""
    return torch.ones((), dtype=torch.bool, device=device).expand(q, kv)


def is_placeholder(mask: torch.Tensor) -> bool:
    """Whether ``mask`` is a ``placeholder_mask`` (possibly with leading unit dims added)."""
    return mask.dtype == torch.bool and mask.numel() > 1 and all(s == 0 for s in mask.stride())
