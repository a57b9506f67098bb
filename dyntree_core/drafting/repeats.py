"""The text's own repeats, drafted inside a draft-tree run and after it falls back to plain decoding
(``DecodeConfig.fallback``).

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

**Inside the run**, before any fallback (``FallbackPrice.tree_s_per_token``: the plan's price per token of the run's
own tree steps), a step whose text repeats itself verifies the best-first repeat tree of at most
``REPEAT_IN_RUN_BUDGET`` nodes instead of drafting, where its expected tokens per priced second beat the tree steps'
priced rate by ``REPEAT_EDGE`` (and a plain step's). It costs no draft forward; the draft model's cache catches up on
the committed tokens in its next forward. Replayed on the same continuations with ``auto``'s chain (k <= 12, stop
below q = 0.6), from the first continuation token, the draft's catch-up priced (``scripts/repeat_replay.py
--in-run``): cost over plain decoding, median (mean) for wiki / news / code, the chain alone 0.83 (0.78) / 0.83 (0.83)
/ 0.56 (0.57); with the repeats at 8 nodes and an edge of 1.2 0.82 (0.71) / 0.78 (0.76) / 0.56 (0.56); 4 nodes 0.81
(0.72) / 0.79 (0.77) / 0.56 (0.57); an edge of 1.0 0.84 (0.72) / 0.79 (0.76) / 0.57 (0.57).
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
#: the largest repeat tree inside a draft-model run (it stands in for a tree step, whose chains run to 12 tokens)
REPEAT_IN_RUN_BUDGET = 8
#: inside a run, a repeat tree's expected tokens per priced second must beat the tree steps' priced rate by this
#: factor (their rate is an average over the text; a repeat tree's is its own step's)
REPEAT_EDGE = 1.2
#: the smallest empirical path probability a repeat node may have (as ``auto``'s suffix trees)
REPEAT_THRESHOLD = 0.2
#: at most ``ceil(REPEAT_SPEC_FACTOR * L)`` repeat tokens after a match of ``L`` tokens (``suffix.size_cap``): a word
#: seen once before scores 1.0 but is weak evidence (replayed: the worst prompt 1.11 -> 1.04 x plain decoding)
REPEAT_SPEC_FACTOR = 1.0


def best_priced_size(value: torch.Tensor, rows: PricedRows, bar_s_per_token: Optional[float] = None) -> int:
    """The size ``k`` of the best-first tree's prefix whose expected tokens per priced second is highest, 1 (no repeat
    step) where no prefix beats a plain step, nor costs under ``bar_s_per_token`` per expected token.

    Args:
        value: ``[N]`` float64 the tree's node values (empirical path probabilities; node 0, the root, first),
            non-increasing from node 1 on (best-first order), so every prefix is a tree.
        rows: the run's profile rows: a step of ``k`` nodes costs ``rows.step_seconds(StepShape(0, 1.0, k))``.
        bar_s_per_token: the price per token a repeat step must beat besides a plain step's (inside a run: its tree
            steps' priced rate over ``REPEAT_EDGE``); None: a plain step's only.
    """
    best_k, best = 1, 1.0 / rows.step_seconds(StepShape(0, 1.0, 1))
    if bar_s_per_token is not None:
        best = max(best, 1.0 / bar_s_per_token)
    expected = 1.0  # the bonus token
    for k in range(2, int(value.shape[0]) + 1):
        expected += float(value[k - 1])
        rate = expected / rows.step_seconds(StepShape(0, 1.0, k))
        if rate > best:
            best_k, best = k, rate
    return best_k


def repeat_steps(traces: Sequence["StepTrace"]) -> int:
    """How many of a run's steps verified the text's repeats (``RepeatDrafter``'s, inside the run or after its
    fallback)."""
    return sum(t.draft_source == "repeats" for t in traces)


class RepeatDrafter(TextIndexedDrafter):
    """Drafts the text's repeats at their price (``candidate``); the engine decodes the run's own step (a tree
    inside the run, a plain one after its fallback) where there is none.

    ``reset(text)`` with the run's text so far; ``follow(committed)`` brings it up to every committed token.
    ``bar_s_per_token``: inside a run, the price per token a repeat tree must beat (``best_priced_size``);
    ``min_match``: no repeat before this many of the text's last tokens occurred before (replayed inside a run: 2 is
    the same as 1, a 2-node tree after a 1-token match never pays there; 3 and more cost more).
    """

    name = "suffix"

    def __init__(self, cfg: DecodeConfig, rows: PricedRows, budget: int = REPEAT_BUDGET,
                 spec_factor: Optional[float] = REPEAT_SPEC_FACTOR, bar_s_per_token: Optional[float] = None,
                 min_match: int = 1):
        super().__init__(cfg)
        self.rows = rows
        self.budget = budget
        self.spec_factor = spec_factor
        self.bar_s_per_token = bar_s_per_token
        self.min_match = min_match

    @classmethod
    def in_run(cls, cfg: DecodeConfig, rows: PricedRows, tree_s_per_token: float) -> "RepeatDrafter":
        """The drafter of the repeats inside a draft-model run whose tree steps were priced at ``tree_s_per_token``."""
        return cls(cfg, rows, REPEAT_IN_RUN_BUDGET, bar_s_per_token=tree_s_per_token / REPEAT_EDGE)

    def follow(self, committed: Sequence[int]) -> None:
        """Index the tokens of ``committed`` (the run's whole text) not indexed yet."""
        seen = len(self.index.tokens)
        if len(committed) > seen:
            self.extend(committed[seen:])

    def match_length(self) -> int:
        """How many of the text's last tokens occurred before, followed by a token (``SuffixIndex``)."""
        history = self.index.tokens
        return self.index.continuations(history[-self.index.max_len:]).match_len

    def last_origin(self) -> DraftOrigin:
        return "repeats"

    def candidate(self, root_token: int) -> Optional[TokenTree]:
        """The priced repeat tree after ``root_token`` (the text's last token), or None when a plain step pays better
        (no repeat, or none whose expected tokens outweigh the bigger forward)."""
        if not self.follows(root_token):
            return None
        if self.min_match > 1 and self.match_length() < self.min_match:
            return None
        tree = suffix_tree(self.index, self.budget, self.budget - 1, REPEAT_THRESHOLD, self.spec_factor)
        if tree.size < 2 or tree.value is None:
            return None
        k = best_priced_size(tree.value, self.rows, self.bar_s_per_token)
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
