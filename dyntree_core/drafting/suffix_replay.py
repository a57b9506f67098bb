"""Replaying the ``suffix`` and ``hybrid`` methods on a known continuation, many shapes at once.

What ``auto`` prices the model-free drafters with. A replay is the engine's decode at T = 0 step
for step (``tests/test_suffix_replay.py``): at each step the index holds the prompt and the
tokens committed so far, the tree is ``suffix_tree`` of it, and the step commits the draft
tokens the continuation spells along the tree plus the target's next one. At T > 0, with the
continuation a target sample, the accepted length is point-mass verification's in expectation.

Every shape replays the same text, and the index after ``pos`` committed tokens is the same
whatever shape got there, so all shapes advance in lockstep over one index: a step of any shape
starting at ``pos`` reads the index as it stands at ``pos``, and shapes that would build the same
tree there (same size allowed by the match-length cap, depth and threshold) share it. Each shape
is charged what its own drafter would spend: indexing the prompt and the continuation, plus the
measured build time of every tree it uses.

A ``hybrid`` shape uses the suffix tree only where ``suffix_tree_is_confident`` (the drafter's own
rule); elsewhere its step is a draft-model step (OPT-Tree of ``budget`` nodes), which a replay
cannot run: it is recorded as a model step that commits ``model_commit`` tokens (the caller's
estimate, e.g. the positional model's expected tokens rounded) so the replay can go on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

from .drafter import capped_depth
from .hybrid import suffix_tree_is_confident
from .suffix import MAX_MATCH, accepted_along, size_cap, suffix_tree
from .suffix_index import SuffixIndex


@dataclass(frozen=True)
class SuffixShape:
    """A ``suffix`` (or, with ``hybrid``, a ``hybrid``) configuration as ``DecodeConfig`` sets it."""

    budget: int
    depth: int
    threshold: float
    spec_factor: Optional[float] = None
    hybrid: bool = False


@dataclass(frozen=True)
class ReplayStep:
    """One replayed step: the tree's size (a model step: the shape's budget), the tokens it
    committed, and whether the suffix index drafted it (else the draft model did)."""

    size: int
    committed: int
    from_suffix: bool = True


@dataclass(frozen=True)
class ShapeReplay:
    """A shape's steps on one text and the seconds its suffix side spent (index updates and tree
    builds; a hybrid's draft-model forwards are not included)."""

    steps: tuple[ReplayStep, ...]
    build_seconds: float


def replay_shapes(prompt: Sequence[int], continuation: Sequence[int], shapes: Sequence[SuffixShape],
                  model_commit: Optional[Mapping[SuffixShape, int]] = None,
                  clock: Callable[[], float] = time.perf_counter) -> dict[SuffixShape, ShapeReplay]:
    """Each shape's steps on ``continuation`` of ``prompt`` (non-empty), replayed in lockstep over
    one ``SuffixIndex``. ``model_commit[shape]`` (default 1) is what a hybrid shape's draft-model
    step commits; the last step of every shape is cut at the end of ``continuation``."""
    if not prompt:
        raise ValueError("the replay needs a non-empty prompt (its last token is the first root)")
    cont = [int(t) for t in continuation]
    model_commit = model_commit or {}
    index = SuffixIndex(MAX_MATCH)
    t0 = clock()
    index.extend([int(t) for t in prompt])
    index_seconds = clock() - t0
    next_pos = {s: 0 for s in shapes}
    steps: dict[SuffixShape, list[ReplayStep]] = {s: [] for s in shapes}
    tree_seconds = {s: 0.0 for s in shapes}
    for pos in range(len(cont)):
        due = [s for s in shapes if next_pos[s] == pos]
        if due:
            match_len = index.continuations(index.tokens[-index.max_len:]).match_len
            built: dict[tuple, tuple] = {}  # (size allowed, depth, threshold) -> (tree, seconds, accepted)
            left = len(cont) - pos  # (the engine's steps draft at most the levels they can commit: ``Drafter.depth``)
            for s in due:
                key = (size_cap(match_len, s.budget, s.spec_factor), capped_depth(s.depth, left - 1), s.threshold)
                if key not in built:
                    t0 = clock()
                    tree = suffix_tree(index, key[0], key[1], s.threshold)
                    built[key] = (tree, clock() - t0, accepted_along(tree, cont[pos:]))
                tree, seconds, accepted = built[key]
                tree_seconds[s] += seconds
                if s.hybrid and not suffix_tree_is_confident(tree):
                    step = ReplayStep(s.budget, min(max(1, model_commit.get(s, 1)), len(cont) - pos), False)
                else:
                    step = ReplayStep(tree.size, min(accepted + 1, len(cont) - pos))
                steps[s].append(step)
                next_pos[s] = pos + step.committed
        t0 = clock()
        index.extend([cont[pos]])
        index_seconds += clock() - t0
    return {s: ShapeReplay(tuple(steps[s]), index_seconds + tree_seconds[s]) for s in shapes}


def replay_suffix(prompt: Sequence[int], continuation: Sequence[int], budget: int, depth: int,
                  threshold: float, spec_factor: Optional[float] = None) -> list[tuple[int, int]]:
    """The ``suffix`` method's steps on a known continuation of ``prompt``: ``[(tree size,
    committed tokens)]`` per step (``replay_shapes`` of that one shape)."""
    shape = SuffixShape(budget, depth, threshold, spec_factor)
    return [(st.size, st.committed) for st in replay_shapes(prompt, continuation, [shape])[shape].steps]
