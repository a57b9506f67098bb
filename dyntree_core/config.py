"""Validated configuration dataclasses. Every out-of-range value raises ``ConfigError`` with a
message that names the field, the value and the allowed range."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from .methods import REGISTRY
from .step_price import FallbackPrice

METHODS: tuple[str, ...] = tuple(REGISTRY)
VERIFIERS: tuple[str, ...] = ("auto", "greedy", "token_level", "traversal", "point_mass")
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
#: per-model precisions (``dyntree_core.quant``); ``auto`` is resolved by ``dyntree_core.planning.auto``
PRECISIONS: tuple[str, ...] = ("float32", "bfloat16", "float16", "int8", "int4")
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "torch", "triton")
#: node orders of the target's tree forward (``TokenTree.order``)
NODE_ORDERS: tuple[str, ...] = ("dfs", "hpd", "bfs")

#: tree methods whose sibling draws are stochastic at T>0 (token-level / traversal apply)
STOCHASTIC_METHODS = frozenset(m.name for m in REGISTRY.values() if m.siblings in ("iid", "swor"))
#: tree methods with deterministic top-k siblings (only point-mass verification is lossless)
TOPK_METHODS = frozenset(m.name for m in REGISTRY.values() if m.siblings == "topk")
MAX_BUDGET = 4096


class ConfigError(ValueError):
    """An invalid configuration value; the message says which and why."""


def default_threshold(budget: int) -> float:
    """The value threshold that makes a threshold-grown tree about ``budget`` nodes (DySpec's
    threshold method, and the threshold controller's starting point): ``min(0.5, 1 / budget)``."""
    return min(0.5, 1.0 / max(2, int(budget)))


#: suffix / hybrid: drafted tokens <= ceil(spec_factor x match length) (SuffixDecoding's default)
DEFAULT_SPEC_FACTOR = 1.0


def parse_spec_factor(text: str) -> Optional[float]:
    """A ``spec_factor`` as typed on a command line: a number, or ``none`` (no cap).
    Raises ValueError on anything else."""
    return None if text.strip().lower() == "none" else float(text)


@dataclass(frozen=True)
class DecodeConfig:
    """Everything that selects and tunes a decoding run.

    Attributes:
        method: one of ``METHODS``.
        verifier: one of ``VERIFIERS``; ``auto`` picks greedy at T=0, ``point_mass`` for top-k
            drafters and ``token_level`` otherwise.
        temperature: target sampling temperature, >= 0 (0 = greedy).
        top_p: nucleus mass in (0, 1], applied to the target only.
        draft_temperature: draft sampling temperature (> 0); None = same as ``temperature``
            (1.0 at T=0, where drafters are deterministic anyway).
        budget: tree size cap, root included (tree methods).
        threshold: method-specific threshold in (0, 1): DySpec-threshold's value cut-off t
            (expand while the estimated value >= t), OPT-Tree's stopping δ, DynaTree's pruning
            and stop confidence τ = ρ_stop (its branching bands τ_h=.9 / τ_l=.4 are fixed).
        depth: maximum number of drafted levels below the root (chain length k, SpecInfer L,
            Sequoia depth cap, depth cap of the dynamic methods).
        width: branching width: SpecInfer's k (number of i.i.d. chains); DynaTree's maximum
            branching (its B = (1, 2, 3) capped by ``width``). OPT-Tree keeps the global top
            ``budget - 1`` per layer (that is what makes it optimal) and ignores ``width``.
        seed: RNG seed for drafting and verification.
        dtype: dtype of dense models (and of the dense parts of quantized ones).
        precision: target precision (``PRECISIONS``); None = as the model was loaded (a dense
            model is cast to ``dtype``). A dense model given with ``int8``/``int4`` is quantized.
        draft_precision: the draft's precision; None = as the draft was loaded.
        device: ``cpu``, ``cuda``, ``cuda:N`` or ``auto``.
        attention: tree-attention backend: ``torch`` (SDPA with a 4D mask), ``triton`` or ``auto``
            (triton on CUDA, torch elsewhere).
        offload_target: stream the target's decoder layers from pinned host memory (CUDA only).
        node_order: the order the tree's nodes take in the target's forward: ``dfs`` (pre-order,
            the kernel's interval form), ``hpd`` (pre-order, heaviest child first) or ``bfs``
            (construction order by depth; the kernel reads block lists). Outputs do not depend
            on it; the attention work does (fewer non-empty mask blocks in a pre-order).
        trace_block_counts: compute mask block counts (BFS/DFS/HPD) for every StepTrace.
        adaptive_threshold: dyspec_threshold only: retune the threshold online so the tree
            size tracks ``budget`` (``drafting.threshold_control.ThresholdController``).
        sequoia_acceptance: measured marginal acceptance vector p_k for the Sequoia DP
            (None = a conservative default; see ``dyntree_core.drafting.sequoia``).
        stop_confidence: chain only: stop drafting after a token whose draft probability is below
            this value (transformers' ``assistant_confidence_threshold`` rule; ``depth`` stays the
            cap). None = always draft ``depth`` tokens. The stop depends on the draft alone, so
            verification stays lossless.
        spec_factor: suffix / hybrid only: draft at most ``ceil(spec_factor * L)`` tokens, ``L`` the
            length of the longest suffix of the text so far that occurred before (SuffixDecoding's
            ``max_spec_factor``: a long match is strong evidence, a one-token match is weak). None =
            no cap (``budget`` nodes whatever the match).
        fallback: a draft-tree method: from the ``FALLBACK_AFTER``-th tree step on, once the run's tree
            steps, each priced at the profile rows at its own shape, cost more per committed token than
            plain decoding (from ``check_from`` on: more than ``early_margin`` x that;
            ``step_price.FallbackPrice.falls_back``), the rest of the run decodes plainly (the tree
            does not pay on this text; ``auto`` sets it from its plan's profile rows,
            ``AutoPlan.fallback_price``), except where the text repeats itself: there a step verifies the
            suffix tree of its repeats priced at the same rows (``drafting.repeats``, no draft model).
            Eager steps only (graph steps keep the tree). None = never. Every step stays exact and the
            switch depends only on steps already decoded: the run stays lossless.
    """

    method: str = "chain"
    verifier: str = "auto"
    temperature: float = 0.0
    top_p: float = 1.0
    draft_temperature: Optional[float] = None
    budget: int = 64
    threshold: float = 0.05
    depth: int = 4
    width: int = 8
    seed: int = 0
    dtype: str = "float32"
    precision: Optional[str] = None
    draft_precision: Optional[str] = None
    device: str = "cpu"
    attention: str = "auto"
    offload_target: bool = False
    node_order: str = "dfs"
    trace_block_counts: bool = True
    adaptive_threshold: bool = False
    sequoia_acceptance: Optional[tuple[float, ...]] = field(default=None)
    stop_confidence: Optional[float] = None
    spec_factor: Optional[float] = DEFAULT_SPEC_FACTOR
    fallback: Optional[FallbackPrice] = None

    def __post_init__(self) -> None:
        _choice("method", self.method, METHODS)
        _choice("verifier", self.verifier, VERIFIERS)
        _choice("dtype", self.dtype, DTYPES)
        for name in ("precision", "draft_precision"):
            value = getattr(self, name)
            if value == "auto":
                raise ConfigError(f"{name}='auto' is resolved before decoding: use dyntree_core.planning.auto.plan_auto "
                                  "(the CLI and the app do this for you)")
            if value is not None:
                _choice(name, value, PRECISIONS)
        _choice("attention", self.attention, ATTENTION_BACKENDS)
        _choice("node_order", self.node_order, NODE_ORDERS)
        if not (isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 10.0):
            raise ConfigError(f"temperature must be in [0, 10] (0 = greedy), got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.draft_temperature is not None and not (0.0 < self.draft_temperature <= 10.0):
            raise ConfigError(f"draft_temperature must be in (0, 10] or None, got {self.draft_temperature!r}")
        if not (isinstance(self.budget, int) and 2 <= self.budget <= MAX_BUDGET):
            raise ConfigError(f"budget (tree size incl. root) must be an integer in [2, {MAX_BUDGET}], got {self.budget!r}")
        if not (0.0 < self.threshold < 1.0):
            raise ConfigError(f"threshold must be in (0, 1), got {self.threshold!r}")
        if not (isinstance(self.depth, int) and 1 <= self.depth <= 256):
            raise ConfigError(f"depth must be an integer in [1, 256], got {self.depth!r}")
        if not (isinstance(self.width, int) and 1 <= self.width <= 256):
            raise ConfigError(f"width must be an integer in [1, 256], got {self.width!r}")
        if not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise ConfigError(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        if not (self.device in ("cpu", "cuda", "auto") or self.device.startswith("cuda:")):
            raise ConfigError(f"device must be cpu, cuda, cuda:N or auto, got {self.device!r}")
        if self.sequoia_acceptance is not None:
            acc = tuple(float(x) for x in self.sequoia_acceptance)
            if not acc or any(not (0.0 <= x <= 1.0) for x in acc):
                raise ConfigError("sequoia_acceptance must be a non-empty sequence of values in [0, 1]")
            object.__setattr__(self, "sequoia_acceptance", acc)
        if self.stop_confidence is not None and not (
                isinstance(self.stop_confidence, (int, float)) and 0.0 < self.stop_confidence < 1.0):
            raise ConfigError(f"stop_confidence must be in (0, 1) or None, got {self.stop_confidence!r}")
        if self.spec_factor is not None and not (
                isinstance(self.spec_factor, (int, float)) and not isinstance(self.spec_factor, bool)
                and 0.0 < self.spec_factor <= 64.0):
            raise ConfigError(f"spec_factor must be in (0, 64] or None (no cap), got {self.spec_factor!r}")
        if self.fallback is not None:
            if not isinstance(self.fallback, FallbackPrice):
                raise ConfigError(f"fallback must be a step_price.FallbackPrice or None, got {self.fallback!r}")
            if self.fallback.problem():
                raise ConfigError(f"fallback: {self.fallback.problem()}")
        self.resolved_verifier()  # raises on incompatible method × verifier

    # ------------------------------------------------------------------ derived values
    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def effective_draft_temperature(self) -> float:
        if self.draft_temperature is not None:
            return float(self.draft_temperature)
        return float(self.temperature) if self.temperature > 0 else 1.0

    def resolved_verifier(self) -> str:
        """The verifier actually used; raises ``ConfigError`` for a lossy combination."""
        v = self.verifier
        if self.method == "autoregressive":
            if v not in ("auto", "greedy") or (v == "greedy" and not self.greedy):
                if v != "auto":
                    raise ConfigError("the autoregressive baseline has no verifier; use verifier='auto'")
            return "none"
        if v == "auto":
            if self.greedy:
                return "greedy"
            return "point_mass" if self.method in TOPK_METHODS else "token_level"
        if v == "greedy":
            if not self.greedy:
                raise ConfigError("the greedy verifier needs temperature 0; at T>0 choose token_level, traversal or point_mass")
            return v
        if self.greedy:
            return "greedy" if v in ("token_level", "traversal", "point_mass") else v
        if self.method in TOPK_METHODS and v != "point_mass":
            raise ConfigError(
                f"method {self.method!r} drafts deterministic top-k siblings; {v!r} is not lossless "
                "for such trees — use verifier='point_mass'"
            )
        return v

    def to_dict(self) -> dict:
        return asdict(self)


def compatible_verifiers(method: str, temperature: float) -> list[str]:
    """Verifiers that are lossless for ``method`` at ``temperature`` (UI choices)."""
    _choice("method", method, METHODS)
    if method == "autoregressive":
        return ["auto"]
    if temperature == 0:
        return ["auto", "greedy"]
    if method in TOPK_METHODS:
        return ["auto", "point_mass"]
    return ["auto", "token_level", "traversal", "point_mass"]


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
