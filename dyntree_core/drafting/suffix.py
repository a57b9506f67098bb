"""``suffix``: a model-free drafter that proposes continuations already seen in the prompt and the
output so far (SuffixDecoding's idea; prompt-lookup decoding is its chain form).

The tree grows best-first: a candidate child's score is the product of empirical continuation
probabilities along its path (``SuffixIndex`` counts, longest-suffix match at every node), and the
highest-scoring candidate is added next until ``budget`` nodes, ``depth`` levels, or no candidate
scores at least ``threshold``. The tree is also sized by the evidence (SuffixDecoding's adaptive
speculation length): with ``spec_factor`` = α and ``L`` the length of the longest suffix of the text
that occurred before, at most ``ceil(α·L)`` tokens are drafted, so a one-token match (a common word
seen once before) drafts one token, not a full tree. Without a match the tree is the root alone (the
step is a plain target step). No draft model forward runs at all.

The tree is deterministic given the text, so it is verified by point-mass (T > 0) or greedily
(T = 0): every committed token is then a target sample, whatever the index proposed.
"""

from __future__ import annotations

import heapq
import math
from typing import Optional, Sequence

import torch

from ..config import DecodeConfig
from ..tree import TokenTree
from .drafter import CountingSource, DraftOrigin, Drafter
from .suffix_index import SuffixIndex

#: longest context suffix the index matches
MAX_MATCH = 16


class TextIndexedDrafter(Drafter):
    """A drafter that indexes the prompt and every committed token (``SuffixIndex``)."""

    def __init__(self, cfg: DecodeConfig):
        super().__init__(cfg)
        self.index = SuffixIndex(MAX_MATCH)

    def reset(self, prompt: Sequence[int] = ()) -> None:
        self.index = SuffixIndex(MAX_MATCH)
        self.index.extend(prompt)

    def extend(self, tokens: Sequence[int]) -> None:
        self.index.extend(tokens)

    def follows(self, root_token: int) -> bool:
        """Whether the indexed text ends with ``root_token`` (the engine kept it up to date)."""
        history = self.index.tokens
        return bool(history) and history[-1] == root_token


class SuffixDrafter(TextIndexedDrafter):
    name = "suffix"

    def last_origin(self) -> DraftOrigin:
        return "suffix"

    def _draft(self, source: CountingSource, root_token: int, generator: torch.Generator,
               deterministic: bool) -> TokenTree:
        if not self.follows(root_token):
            raise RuntimeError("the suffix drafter's history must end with the root token "
                               "(the engine calls reset(prompt) and extend(committed tokens))")
        return suffix_tree(self.index, self.cfg.budget, self.depth, self.cfg.threshold, self.cfg.spec_factor)


def size_cap(match_len: int, budget: int, spec_factor: Optional[float]) -> int:
    """Tree size (root included) allowed after a ``match_len``-token match: ``budget``, or fewer when
    ``spec_factor`` caps the drafted tokens at ``ceil(spec_factor * match_len)``."""
    if spec_factor is None:
        return budget
    return min(budget, 1 + math.ceil(spec_factor * match_len - 1e-9))


def suffix_tree(index: SuffixIndex, budget: int, depth: int, threshold: float,
                spec_factor: Optional[float] = None) -> TokenTree:
    """The best-first continuation tree of ``index``'s sequence (its last token is the root), of at
    most ``size_cap(match length, budget, spec_factor)`` nodes."""
    history = index.tokens
    window = history[-index.max_len:]  # all of the history a lookup can match
    root = index.continuations(window)
    budget = size_cap(root.match_len, budget, spec_factor)
    tokens, parents, logq, value, depths = [history[-1]], [-1], [0.0], [1.0], [0]
    paths: list[tuple[int, ...]] = [()]
    heap: list[tuple[float, int, int, int]] = []  # (-score, push order, parent, token)
    order = 0

    def push_children(node: int) -> None:
        nonlocal order
        if depths[node] >= depth:
            return
        found = root if node == 0 else index.continuations(window + list(paths[node]))
        for tok, p in found.ranked():
            score = value[node] * p
            if score < threshold:
                break  # ranked by probability: later siblings score lower still
            heapq.heappush(heap, (-score, order, node, tok))
            order += 1

    push_children(0)
    while heap and len(tokens) < budget:
        neg, _, parent, tok = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(tok)
        parents.append(parent)
        value.append(-neg)
        logq.append(math.log(-neg / value[parent]))
        depths.append(depths[parent] + 1)
        paths.append(paths[parent] + (tok,))
        push_children(node)
    # siblings are added in probability order: their rank is their order of addition
    kept_rank: dict[int, int] = {}
    child_rank = [0]
    for i in range(1, len(tokens)):
        child_rank.append(kept_rank.get(parents[i], 0))
        kept_rank[parents[i]] = child_rank[-1] + 1
    n = len(tokens)
    return TokenTree(
        tokens=torch.tensor(tokens, dtype=torch.long),
        parents=torch.tensor(parents, dtype=torch.long),
        child_rank=torch.tensor(child_rank, dtype=torch.long),
        draft_logprob=torch.tensor(logq, dtype=torch.float64),
        sampled="topk",
        draft_row=torch.full((n,), -1, dtype=torch.long),
        value=torch.tensor(value, dtype=torch.float64),
    )


def accepted_along(tree: TokenTree, continuation: Sequence[int]) -> int:
    """How many draft tokens of a deterministic ``tree`` a verifier accepts when the target's
    tokens are ``continuation``: the longest root path spelling its prefix. At T = 0 this is what
    greedy verification accepts; at T > 0, with ``continuation`` a target sample, it is distributed
    as point-mass verification's accepted length (node v is accepted with the probability that the
    target samples v's path)."""
    children: dict[tuple[int, int], int] = {}
    for i in range(1, tree.size):
        children[(int(tree.parents[i]), int(tree.tokens[i]))] = i
    node, accepted = 0, 0
    for tok in continuation:
        nxt = children.get((node, int(tok)))
        if nxt is None:
            break
        node, accepted = nxt, accepted + 1
    return accepted
