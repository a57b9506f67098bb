"""The ``Drafter`` base class (overhead accounting, ``reset``/``observe`` hooks) and the
``CountingSource`` it wraps around a ``DraftSource``."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal, Optional, Sequence

import torch

from ..config import DecodeConfig
from ..tree import SampledKind, TokenTree
from .base import DraftSource

#: what proposed a tree's tokens: the draft model, the text so far (suffix index, no forward), or the text's own
#: repeats drafted inside a draft-model run, where they are priced to pay (``drafting.repeats``, no forward)
DraftOrigin = Literal["model", "suffix", "repeats"]


def capped_depth(depth: int, levels: Optional[int]) -> int:
    """``depth`` levels, at most ``levels`` (the levels a step can still commit; None: no cap), at least 1."""
    return depth if levels is None else max(1, min(depth, levels))


class CountingSource:
    """Wraps a ``DraftSource``: counts calls and requested nodes and times ``next_probs``."""

    def __init__(self, source: DraftSource):
        self.source = source
        self.vocab_size = int(source.vocab_size)
        self.calls = 0
        self.requested = 0
        self.seconds = 0.0

    @property
    def forward_calls(self) -> int:
        return self.calls

    def next_probs(self, tokens: Sequence[int], parents: Sequence[int], nodes: Sequence[int]) -> torch.Tensor:
        """``[len(nodes), V]`` rows from the wrapped source (shape-checked)."""
        t0 = time.perf_counter()
        out = self.source.next_probs(tokens, parents, nodes)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self.requested += len(nodes)
        if out.dim() != 2 or out.shape[0] != len(nodes):
            raise ValueError(f"DraftSource returned shape {tuple(out.shape)} for {len(nodes)} nodes")
        return out


@dataclass
class DraftStats:
    """Overhead accounting of the last ``draft`` call.

    Attributes:
        forward_calls: ``next_probs`` calls (= batched draft forwards).
        requested_nodes: nodes whose distribution was requested, summed over calls.
        nodes: size of the returned tree (root included).
        construction_seconds: wall time of ``draft`` minus the time spent inside the source.
        source_seconds: time spent inside ``source.next_probs``.
        source: what proposed the tree's tokens: ``model`` (the draft model) or ``suffix`` (the
            text so far, no draft forward).
    """

    forward_calls: int
    requested_nodes: int
    nodes: int
    construction_seconds: float
    source_seconds: float
    source: DraftOrigin = "model"


class Drafter(ABC):
    """Grows one draft tree per decoding step: the one interface every drafter implements.

    Subclasses set ``name`` (their ``methods.REGISTRY`` entry, which also says how they draw
    siblings) and implement ``_draft(source, root_token, generator, deterministic)``. The engine
    calls ``reset()`` at the start of each prompt, ``draft(...)`` once per step and
    ``observe(tree, accepted)`` after verification; ``last_stats`` holds the last step's overhead.
    ``deterministic=True`` (target temperature 0): siblings are the highest-probability tokens in
    order (SWOR becomes top-k) and the tree is marked ``sampled="topk"``.
    """

    name: str = "base"

    def __init__(self, cfg: DecodeConfig):
        self.cfg = cfg
        self.last_stats: Optional[DraftStats] = None
        self._levels_left: Optional[int] = None  # the current ``draft`` call's ``levels`` (None: no cap)

    @property
    def depth(self) -> int:
        """Levels below the root worth drafting this step: ``cfg.depth``, at most the ``levels`` the engine passed to
        ``draft`` (the tokens its run has left less the bonus token), at least 1. Drafters that grow level by level
        read this instead of ``cfg.depth``; Sequoia's precomputed shape keeps its depth."""
        return capped_depth(self.cfg.depth, self._levels_left)

    def last_origin(self) -> DraftOrigin:
        """What proposed the tree the last ``_draft`` returned (``model`` unless overridden)."""
        return "model"

    @property
    def stochastic_kind(self) -> SampledKind:
        """How this method draws siblings at T > 0 (its ``methods.REGISTRY`` entry)."""
        from ..methods import REGISTRY

        return REGISTRY[self.name].siblings  # type: ignore[return-value]

    def sampled_kind(self, deterministic: bool) -> SampledKind:
        """``topk`` when deterministic, else the drafter's stochastic kind."""
        return "topk" if deterministic else self.stochastic_kind

    def reset(self, prompt: Sequence[int] = ()) -> None:
        """Forget per-generation state (called at the start of every prompt, with its token ids)."""

    def extend(self, tokens: Sequence[int]) -> None:
        """The tokens a step committed (after ``observe``): drafters that draft from the text so far
        index them, the others ignore them."""

    def observe(self, tree: TokenTree, accepted_nodes: int) -> None:
        """Feedback after verification: ``accepted_nodes`` draft tokens of ``tree`` were accepted
        (root and bonus token excluded). Stateless drafters ignore it."""

    def draft(
        self,
        source: DraftSource,
        root_token: int,
        generator: torch.Generator,
        deterministic: bool = False,
        levels: Optional[int] = None,
    ) -> TokenTree:
        """Grow one draft tree rooted at ``root_token``; records ``last_stats``. ``levels``: at most this many
        levels can be committed this step (a run with k tokens left commits at most k - 1 drafted tokens and the
        bonus): ``depth`` is capped by it, so a run's last steps draft no level it cannot use."""
        t0 = time.perf_counter()
        counted = CountingSource(source)
        self._levels_left = None if levels is None else int(levels)
        try:
            tree = self._draft(counted, int(root_token), generator, bool(deterministic))
        finally:
            self._levels_left = None
        total = time.perf_counter() - t0
        self.last_stats = DraftStats(
            forward_calls=counted.calls,
            requested_nodes=counted.requested,
            nodes=tree.size,
            construction_seconds=max(0.0, total - counted.seconds),
            source_seconds=counted.seconds,
            source=self.last_origin(),
        )
        return tree

    @abstractmethod
    def _draft(
        self, source: CountingSource, root_token: int, generator: torch.Generator, deterministic: bool
    ) -> TokenTree:
        """Grow the tree (``source`` counts and times the draft forwards)."""
