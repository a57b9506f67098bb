"""The text's own repeats, drafted after a draft-tree run falls back to plain decoding (``DecodeConfig.fallback``).

A run falls back when its draft model's trees cost more per token than plain steps. The text may still repeat
itself (greedy continuations loop; news and code quote their prompts), and a model-free suffix tree costs only
the target forward of its few nodes. So each step after the fallback builds the best-first suffix tree of at most
``REPEAT_BUDGET`` nodes (``suffix.suffix_tree``) and keeps the prefix of it whose expected tokens per priced second
beat a plain step's (``best_priced_size``, at the run's own profile rows, ``step_price.PricedRows``); where none
does, the step is a plain one. The tree is deterministic, so it is verified greedily (T = 0) or by point mass.

Chosen by replaying the target's greedy 64-token continuations of the 30 eval prompts (10 each of wiki, news and
code) from their 13th token on, priced at the Zen 4 VM's profile rows (``scripts/repeat_replay.py``, docs/PLANNING.md,
"Repeats after a fallback"): 4 nodes, at most as many tokens as the match is long, cost 0.89 / 0.78 / 0.86 x plain
decoding (medians, wiki / news / code; the worst prompt 1.04). Without the match-length cap the worst prompt was
1.11; 8 nodes without it 1.03 / 0.90 / 0.99 (a continuation seen once scores 1.0, so bigger trees are priced
optimistically and pay for it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch

from ..config import DecodeConfig
from ..step_price import PricedRows, StepShape
from ..tree import TokenTree
from .drafter import CountingSource, DraftOrigin
from .suffix import TextIndexedDrafter, suffix_tree

if TYPE_CHECKING:
    from ..trace import StepTrace

#: the largest repeat tree, root included (replayed: 4 beat 8 and 16, see the module docstring)
REPEAT_BUDGET = 4
#: the smallest empirical path probability a repeat node may have (as ``auto``'s suffix trees)
REPEAT_THRESHOLD = 0.2
#: at most ``ceil(REPEAT_SPEC_FACTOR * L)`` repeat tokens after a match of ``L`` tokens (``suffix.size_cap``): a word
#: seen once before scores 1.0 but is weak evidence (replayed: the worst prompt 1.11 -> 1.04 x plain decoding)
REPEAT_SPEC_FACTOR = 1.0


def best_priced_size(value: torch.Tensor, rows: PricedRows) -> int:
    """The size ``k`` of the best-first tree's prefix whose expected tokens per priced second is highest, 1 (a
    plain step) where no prefix beats a plain step.

    Args:
        value: ``[N]`` float64 the tree's node values (empirical path probabilities; node 0, the root, first),
            non-increasing from node 1 on (best-first order), so every prefix is a tree.
        rows: the run's profile rows: a step of ``k`` nodes costs ``rows.step_seconds(StepShape(0, 1.0, k))``.
    """
    best_k, best = 1, 1.0 / rows.step_seconds(StepShape(0, 1.0, 1))
    expected = 1.0  # the bonus token
    for k in range(2, int(value.shape[0]) + 1):
        expected += float(value[k - 1])
        rate = expected / rows.step_seconds(StepShape(0, 1.0, k))
        if rate > best:
            best_k, best = k, rate
    return best_k


def repeat_steps(traces: Sequence["StepTrace"]) -> int:
    """How many of a run's steps (``traces``, in order) verified the text's repeats: the tree steps after the one
    that fell back (the steps after it are plain or repeat steps; 0 for a run that did not fall back)."""
    switch = next((i for i, t in enumerate(traces) if t.fallback), None)
    return 0 if switch is None else sum(t.tree is not None for t in traces[switch + 1:])


class RepeatDrafter(TextIndexedDrafter):
    """Drafts the text's repeats at their price (``candidate``); the engine decodes a plain step where there is none.

    ``reset(committed)`` with the run's text at the fallback, ``extend`` with every token committed after it."""

    name = "suffix"

    def __init__(self, cfg: DecodeConfig, rows: PricedRows, budget: int = REPEAT_BUDGET,
                 spec_factor: Optional[float] = REPEAT_SPEC_FACTOR):
        super().__init__(cfg)
        self.rows = rows
        self.budget = budget
        self.spec_factor = spec_factor

    def last_origin(self) -> DraftOrigin:
        return "suffix"

    def candidate(self, root_token: int) -> Optional[TokenTree]:
        """The priced repeat tree after ``root_token`` (the text's last token), or None when a plain step pays better
        (no repeat, or none whose expected tokens outweigh the bigger forward)."""
        if not self.follows(root_token):
            return None
        tree = suffix_tree(self.index, self.budget, self.budget - 1, REPEAT_THRESHOLD, self.spec_factor)
        if tree.size < 2 or tree.value is None:
            return None
        k = best_priced_size(tree.value, self.rows)
        if k < 2:
            return None
        if k < tree.size:  # the best-first tree of k nodes is the first k nodes of the bigger one
            tree = suffix_tree(self.index, k, self.budget - 1, REPEAT_THRESHOLD, self.spec_factor)
        return tree

    def _draft(self, source: CountingSource, root_token: int, generator: torch.Generator,
               deterministic: bool) -> TokenTree:
        tree = self.candidate(root_token)  # (the engine asked the same a moment before: ~60 us against a ~40 ms step)
        if tree is None:
            raise RuntimeError("no repeat pays here: the engine decodes a plain step (RepeatDrafter.candidate)")
        return tree
