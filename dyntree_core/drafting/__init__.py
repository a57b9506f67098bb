"""Drafters: pure tree-growing algorithms over the ``DraftSource`` protocol (no model inside).

``make_drafter(cfg)`` returns the drafter for ``cfg.method``; ``DRAFTERS`` lists the names
(``config.METHODS`` minus the autoregressive baseline, which drafts nothing). Every drafter has
``draft(source, root_token, generator, deterministic=False) -> TokenTree``, ``sampled_kind``,
``last_stats`` (``DraftStats``: forward calls, requested nodes, nodes, construction seconds
excluding the time inside the source), ``reset()`` (new prompt) and ``observe(tree, accepted)``
(feedback after verification; only DynaTree uses it).
"""

from __future__ import annotations

from ..config import METHODS, ConfigError, DecodeConfig
from ..methods import REGISTRY
from .base import DraftSource, PathFunctionSource
from .chain import ChainDrafter
from .builder import TreeBuilder
from .drafter import Drafter, DraftStats
from .siblings import SiblingSampler, iid_draws, sibling_orders, top_children
from .dynatree import DynaTreeDrafter, DynaTreeParams
from .dyspec_greedy import DySpecGreedyDrafter
from .dyspec_threshold import DySpecThresholdDrafter
from .opt_tree import OptTreeDrafter
from .sequoia import (
    SequoiaDrafter,
    SequoiaShape,
    SequoiaTable,
    default_acceptance_vector,
    estimate_acceptance_vector,
    sequoia_dp,
    sequoia_shape,
    sequoia_tree,
)
from .specinfer import SpecInferDrafter

#: drafter names, in ``config.METHODS`` order (every method of ``methods.REGISTRY`` with a drafter)
DRAFTERS: tuple[str, ...] = tuple(m for m in METHODS if REGISTRY[m].is_tree)
_CLASSES: dict[str, type[Drafter]] = {m: REGISTRY[m].drafter_class() for m in DRAFTERS}


def make_drafter(cfg: DecodeConfig) -> Drafter:
    """The drafter for ``cfg.method`` (raises ``ConfigError`` for the autoregressive baseline)."""
    if cfg.method not in _CLASSES:
        raise ConfigError(f"method {cfg.method!r} has no drafter; drafters: {', '.join(DRAFTERS)}")
    return _CLASSES[cfg.method](cfg)


__all__ = [
    "ChainDrafter",
    "DRAFTERS",
    "DraftSource",
    "DraftStats",
    "Drafter",
    "DynaTreeDrafter",
    "DynaTreeParams",
    "DySpecGreedyDrafter",
    "DySpecThresholdDrafter",
    "OptTreeDrafter",
    "PathFunctionSource",
    "SequoiaDrafter",
    "SequoiaShape",
    "SequoiaTable",
    "SiblingSampler",
    "SpecInferDrafter",
    "TreeBuilder",
    "default_acceptance_vector",
    "estimate_acceptance_vector",
    "iid_draws",
    "make_drafter",
    "sequoia_dp",
    "sequoia_shape",
    "sequoia_tree",
    "sibling_orders",
    "top_children",
]
