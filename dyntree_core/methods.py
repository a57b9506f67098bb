"""The method registry: one record per decoding method, read by the configuration, the drafters,
the tuner, the benchmarks and the app. Adding a method = one ``MethodSpec`` here + its drafter file.

Pure data (no torch, no model, no import of the rest of the package), so any layer may read it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Literal, Optional

Siblings = Literal["iid", "swor", "topk"]
#: how ``tuning.tune`` searches a method's shape: not at all (the baseline), Sequoia's DP optimizer,
#: the chain length, SpecInfer's width x depth, or budget x depth (the dynamic trees)
Tuning = Literal["none", "sequoia_dp", "chain_length", "width_depth", "budget_depth"]
#: the ``DecodeConfig`` fields a method reads (the app greys out the others)
Param = Literal["budget", "depth", "width", "threshold"]


@dataclass(frozen=True)
class MethodSpec:
    """Everything the package knows about one method.

    Attributes:
        name: the ``DecodeConfig.method`` value.
        drafter: ``"module:Class"`` of its drafter (None for the autoregressive baseline).
        siblings: how its sibling tokens are produced at T > 0: ``iid`` / ``swor`` draws (token-level
            and Traversal verification are lossless) or deterministic ``topk`` (only point-mass is).
        params: the ``DecodeConfig`` fields it uses.
        hint: one line for the app.
        tuning: how the tuner searches its shape.
        threshold_controlled: the tuner runs it with the online threshold controller
            (``adaptive_threshold``) starting from ``config.default_threshold(budget)``.
        uses_draft_model: False for model-free drafters (the engine then never runs the draft).
        pricer: ``"module:function"`` of how ``auto`` prices its shapes in closed form
            (``planning.method_prices``); None: ``auto`` does not (``tuning`` calibrates it by short runs).
    """

    name: str
    drafter: Optional[str]
    siblings: Optional[Siblings]
    params: frozenset[str]
    hint: str
    tuning: Tuning
    threshold_controlled: bool = False
    uses_draft_model: bool = True
    pricer: Optional[str] = None

    @property
    def is_tree(self) -> bool:
        return self.drafter is not None

    def pricer_fn(self):
        """``auto``'s pricer of this method (``price(inputs, target_precision) -> [Candidate]``), or None."""
        if self.pricer is None:
            return None
        module, fn = self.pricer.split(":")
        return getattr(importlib.import_module(module), fn)

    def drafter_class(self) -> type:
        if self.drafter is None:
            raise ValueError(f"method {self.name!r} has no drafter")
        module, _, cls = self.drafter.partition(":")
        return getattr(importlib.import_module(module), cls)


_D = "dyntree_core.drafting."
_P = "dyntree_core.planning.method_prices:price_"
REGISTRY: dict[str, MethodSpec] = {m.name: m for m in (
    MethodSpec("autoregressive", None, None, frozenset(), "Baseline: one target forward per token, no draft.", "none",
               pricer=_P + "autoregressive"),
    MethodSpec("chain", _D + "chain:ChainDrafter", "iid", frozenset({"depth"}),
               "Leviathan chain: one draft sample per level, `depth` levels.", "chain_length", pricer=_P + "chain"),
    MethodSpec("specinfer", _D + "specinfer:SpecInferDrafter", "iid", frozenset({"depth", "width"}),
               "SpecInfer: `width` i.i.d. draft samples per level, `depth` levels.", "width_depth"),
    MethodSpec("sequoia", _D + "sequoia:SequoiaDrafter", "swor", frozenset({"budget", "depth"}),
               "Sequoia: static DP-optimal tree of `budget` nodes (depth-capped), SWOR siblings.", "sequoia_dp",
               pricer=_P + "sequoia"),
    MethodSpec("dyspec_greedy", _D + "dyspec_greedy:DySpecGreedyDrafter", "swor", frozenset({"budget", "depth"}),
               "DySpec greedy heap: expand the most probable node until `budget` nodes.", "budget_depth"),
    MethodSpec("dyspec_threshold", _D + "dyspec_threshold:DySpecThresholdDrafter", "swor",
               frozenset({"budget", "depth", "threshold"}),
               "DySpec threshold: layer by layer, keep nodes whose value exceeds `threshold`.", "budget_depth",
               threshold_controlled=True),
    MethodSpec("opt_tree", _D + "opt_tree:OptTreeDrafter", "topk", frozenset({"budget", "depth", "threshold"}),
               "OPT-Tree: per layer, the global top `budget`-1 nodes by path probability; stop when the gain "
               "< `threshold`.", "budget_depth"),
    MethodSpec("dynatree", _D + "dynatree:DynaTreeDrafter", "topk", frozenset({"budget", "depth", "threshold", "width"}),
               "DynaTree: top-k (`width`) branching where the draft's confidence is below `threshold`.",
               "budget_depth"),
    MethodSpec("suffix", _D + "suffix:SuffixDrafter", "topk", frozenset({"budget", "depth", "threshold"}),
               "Suffix (model-free): continuations already seen in the prompt and output, best-first by their "
               "frequency until `budget` nodes, a path score below `threshold` or ceil(spec_factor x match length) "
               "tokens; no draft model runs.",
               "budget_depth", uses_draft_model=False, pricer=_P + "suffix"),
    MethodSpec("hybrid", _D + "hybrid:HybridDrafter", "topk", frozenset({"budget", "depth", "threshold"}),
               "Hybrid: the suffix tree when the text so far expects >= 2 accepted tokens from it (no draft "
               "forward that step), else OPT-Tree on the draft model.", "budget_depth", pricer=_P + "hybrid"),
)}


def method_spec(name: str) -> MethodSpec:
    """The registry entry of ``name`` (KeyError names the known methods)."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown method {name!r}; methods: {', '.join(REGISTRY)}") from None
