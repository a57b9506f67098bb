"""``hybrid``: the suffix tree where the text so far supports it, the draft model elsewhere.

Each step first builds the model-free suffix tree (``suffix.suffix_tree``). Its node values are
empirical path probabilities, so their sum is the number of tokens the suffix tree expects to get
accepted if the text keeps repeating as it did; the tree is capped by the match length
(``cfg.spec_factor``, as in ``suffix``). When that sum is at least ``SUFFIX_MIN_EXPECTED`` the
step uses it and runs no draft forward; otherwise the step drafts with OPT-Tree on the draft model
(its deterministic top-k tree, same budget, depth and threshold). Both kinds of tree are
deterministic (``topk``), so the method is verified by point-mass (T > 0) or greedily (T = 0):
every committed token is a target sample whichever source proposed it.

The draft model's KV cache simply falls behind during suffix steps; the next model step feeds the
committed tokens it has not seen (``ModelDraftSource``'s pending tokens).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..config import DecodeConfig
from ..tree import TokenTree
from .drafter import CountingSource, DraftOrigin
from .opt_tree import OptTreeDrafter
from .suffix import TextIndexedDrafter, suffix_tree

#: expected accepted tokens of the suffix tree (sum of its node path probabilities) from which a
#: step uses it instead of the draft model. A suffix step costs only the target forward, but the
#: empirical probabilities of a short match are optimistic (a continuation seen once scores 1.0):
#: with the match-length cap (``spec_factor`` 1) a score of 2 needs a match of at least 2 tokens,
#: and the draft model's chain on the embedded pair already expects ~2 tokens per step at T=0
SUFFIX_MIN_EXPECTED = 2.0


def suffix_tree_is_confident(tree: TokenTree) -> bool:
    """Whether a hybrid step drafts with ``tree`` (a ``suffix_tree``): its node values (empirical
    path probabilities) sum to at least ``SUFFIX_MIN_EXPECTED`` expected accepted tokens."""
    return tree.size >= 2 and tree.value is not None and float(tree.value[1:].sum()) >= SUFFIX_MIN_EXPECTED


class HybridDrafter(TextIndexedDrafter):
    name = "hybrid"

    def __init__(self, cfg: DecodeConfig):
        super().__init__(cfg)
        self.model = OptTreeDrafter(cfg)
        #: which source drafted the last tree
        self.last_source: DraftOrigin = "model"

    def last_origin(self) -> DraftOrigin:
        return self.last_source

    def reset(self, prompt: Sequence[int] = ()) -> None:
        super().reset(prompt)
        self.model.reset(prompt)

    def observe(self, tree: TokenTree, accepted_nodes: int) -> None:
        self.model.observe(tree, accepted_nodes)

    def suffix_candidate(self, root_token: int) -> Optional[TokenTree]:
        """The suffix tree when the index holds the text up to ``root_token`` and the tree expects at
        least ``SUFFIX_MIN_EXPECTED`` accepted tokens, else None."""
        if not self.follows(root_token):
            return None  # the index is not following this text (no reset): the model drafts
        tree = suffix_tree(self.index, self.cfg.budget, self.depth, self.cfg.threshold, self.cfg.spec_factor)
        return tree if suffix_tree_is_confident(tree) else None

    def _draft(self, source: CountingSource, root_token: int, generator: torch.Generator,
               deterministic: bool) -> TokenTree:
        tree = self.suffix_candidate(root_token)
        if tree is not None:
            self.last_source = "suffix"
            return tree
        self.last_source = "model"
        return self.model.draft(source, root_token, generator, deterministic, levels=self._levels_left)
