"""Model providers: load a (draft, target, tokenizer) pair lazily, on the first Run.

The app never loads a model at import or build time. ``HubModelProvider`` wraps
``dyntree_core.models.load_pair`` (embedded preset, hub id or local dir) and keeps the most
recently used pair in memory; a lock serialises loads so two sessions never load at once.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

from dyntree_core.models.load import ModelLoadError  # the one "this pair cannot be loaded" error
from dyntree_core.process_memory import release_freed_memory

from .pair_spec import PairSpec
from .prompt_check import TextInfo


@dataclass
class LoadedPair:
    draft: Any
    target: Any
    tokenizer: Any
    spec: PairSpec
    description: str = ""
    supports_chat: bool = False
    eos_token_ids: tuple[int, ...] = ()  # ids that end generation (empty: the engine's defaults)
    measured: dict = field(default_factory=dict)  # per-pair measurements the cost model reuses

    def time_one_token_forward(self, config: Any, context_len: int) -> Any:
        """``ForwardTiming`` of the prepared target's one-token forward after ``context_len`` cached
        tokens, timed now (``dyntree_core.planning.forward_timer.time_forward``: one warm-up, then 3
        timed, with the time and the machine's load); never reused, so a value taken while
        the machine was busy does not stand for later runs."""
        from dyntree_core.planning.forward_timer import time_forward

        return time_forward(self.prepared(config).target, context_len, 1, samples=3)

    def params(self) -> tuple[int, int]:
        if "params" not in self.measured:
            from dyntree_core.planning.cost_model import logical_params

            self.measured["params"] = (logical_params(self.draft), logical_params(self.target))
        return self.measured["params"]

    def prepared(self, config: Any) -> Any:
        """The ``dyntree_core.decode.prepared.PreparedPair`` for ``config`` (a ``DecodeConfig``): prepared
        on first use, then borrowed by every Run, Compare column and baseline with those settings."""
        from dyntree_core.decode.prepared import PreparedPair

        return PreparedPair.for_models(self.draft, self.target, config)


class ModelProvider(Protocol):
    """What the app needs from model loading."""

    default_draft: str
    default_target: str
    progress: str  # the latest line of a long load (measuring the kernels, building packed weights), or ""
    #: also told each progress line as it comes (the app log's ``RunClock.phase`` of the Run loading)
    progress_listener: Optional[Callable[[str], None]]

    def load(self, spec: PairSpec) -> LoadedPair: ...

    def is_loaded(self, spec: PairSpec) -> bool: ...

    def loaded_description(self) -> str:
        """The loaded pair's ``LoadedPair.description`` (the page's footer; empty while none is loaded)."""
        ...

    def auto_plan(self, settings: Any, progress: Any = None, planner: Any = None,
                  read_gb_per_s: Optional[float] = None) -> Any:
        """``AutoPlan`` (or ``ProvisionalPlan``) for the settings' pair, temperature and the choices left
        to auto; ``planner``: a ``ui.planner.BackgroundPlanner`` to measure in the background;
        ``read_gb_per_s``: the memory's read bandwidth probed for the Run (its spell's profile prices it)."""
        ...

    def text_info(self, draft: str, target: str) -> Optional["TextInfo"]:
        """The pair's tokenizer and context without loading weights (None when that needs a download)."""
        ...

    def remeasure(self, settings: Any, rows: Any, planner: Any, read_gb_per_s: Optional[float] = None) -> tuple:
        """Start measuring ``rows`` (``ProfileRow``) of the profile ``auto`` priced the form's ``settings``
        with anew on ``planner`` (the stored rows serve until the new ones are written; ``read_gb_per_s``: that
        profile's spell); the rows it started on (none when another measurement is running)."""
        ...


class HubModelProvider:
    """Loads pairs through ``dyntree_core.planning.pair_cache.PairCache`` (one cache per draft/target/device: the
    models of the last two precisions stay loaded, so auto's profiling, its choice and the run
    share them), or ``load_pair`` for an offloaded target."""

    def __init__(self, default_draft: str = "embedded", default_target: str = "embedded") -> None:
        self.default_draft = default_draft
        self.default_target = default_target
        self._lock = threading.Lock()
        self._pair: Optional[LoadedPair] = None
        self._cache: Any = None
        self._cache_key: Optional[tuple] = None
        self.progress: str = ""  # the latest progress line of a long load / profile (status line)
        self.progress_listener: Optional[Callable[[str], None]] = None
        self._text_info: dict[tuple[str, str], Optional[TextInfo]] = {}

    def text_info(self, draft: str, target: str) -> Optional[TextInfo]:
        """The target's tokenizer and context (the loaded pair's, else read from local files once)."""
        key = (draft.strip(), target.strip())
        pair = self._pair
        if pair is not None and (pair.spec.draft, pair.spec.target) == key:
            context = int(getattr(pair.target.config, "max_position_embeddings", 0) or 1 << 30)
            return TextInfo(pair.tokenizer, context, pair.supports_chat)
        if key not in self._text_info:
            from dyntree_core.models.load import local_text_info

            found = local_text_info(key[1], "target")
            self._text_info[key] = None if found is None else TextInfo(
                found[0], found[1], bool(getattr(found[0], "chat_template", None)))
        return self._text_info[key]

    def is_loaded(self, spec: PairSpec) -> bool:
        pair = self._pair
        return pair is not None and pair.spec == spec

    def loaded_description(self) -> str:
        pair = self._pair
        return pair.description if pair is not None else ""

    def _say(self, line: str) -> None:
        self.progress = line.strip()
        listener = self.progress_listener
        if listener is not None:
            listener(line)

    def _pair_cache(self, draft: str, target: str, device: str):
        from dyntree_core.planning.pair_cache import PairCache
        from dyntree_core.models import precheck_pair

        key = (draft, target, device)
        if self._cache_key != key:
            precheck_pair(draft, target)  # a bad name or mismatched vocabularies keep the loaded pair
            self._release()
            self._cache, self._cache_key = PairCache(draft, target, device=device, progress=self._say), key
        return self._cache

    def _plan_request(self, settings: Any) -> tuple:
        """``(draft, target, device, temperature, plan_auto keywords, the planner's key)`` of a request."""
        from dyntree_core.planning.search_space import search_space

        device = "cpu" if settings.offload else settings.device
        draft, target = settings.draft.strip(), settings.target.strip()
        tps, dps, methods = search_space(settings.method, settings.precision, settings.draft_precision, device)
        temperature = float(settings.temperature)
        kw = dict(target_precisions=tps, draft_precisions=dps, methods=methods)
        return draft, target, device, temperature, kw, (draft, target, device, temperature, tps, dps, methods)

    def auto_plan(self, settings: Any, progress: Any = None, planner: Any = None,
                  read_gb_per_s: Optional[float] = None) -> Any:
        """Resolve ``auto`` (method and/or precisions) with the measured cost model: from the caches,
        or with a ``ui.planner.BackgroundPlanner`` the provisional plan while it measures."""
        from dyntree_core.planning.auto import plan_auto
        from dyntree_core.planning.pair_cache import PairCache
        from dyntree_core.planning.profiling import run_probe

        from .planner import plan_auto_for_app

        def say(msg: str) -> None:
            self._say(msg)
            if progress is not None:
                progress(msg)

        draft, target, device, temperature, kw, key = self._plan_request(settings)

        def measure(turn, note):
            now = read_gb_per_s
            if now is not None:  # probed again in an idle turn: the Run's probe may have shared the memory with a step
                with turn():
                    now = run_probe()
            # the background measurement loads its own models: the run's cache stays this thread's
            return plan_auto(PairCache(draft, target, device=device), temperature, turn=turn, progress=note,
                             read_gb_per_s=now, **kw)

        with self._lock:
            try:
                cache = self._pair_cache(draft, target, device)
                return plan_auto_for_app(
                    planner, key, kw["target_precisions"], kw["draft_precisions"],
                    cached=lambda: plan_auto(cache, temperature, measure=False, read_gb_per_s=read_gb_per_s, **kw),
                    measure=measure,
                    foreground=lambda: plan_auto(cache, temperature, progress=say, read_gb_per_s=read_gb_per_s, **kw),
                    read_gb_per_s=read_gb_per_s)
            except (OSError, ValueError, KeyError) as e:
                raise ModelLoadError(f"could not plan 'auto' for draft {settings.draft!r} / target "
                                     f"{settings.target!r}: {e}") from e

    def remeasure(self, settings: Any, rows: Any, planner: Any, read_gb_per_s: Optional[float] = None) -> tuple:
        from dyntree_core.planning.auto import plan_auto
        from dyntree_core.planning.pair_cache import PairCache

        if planner is None or not rows:
            return ()
        draft, target, device, temperature, kw, key = self._plan_request(settings)
        started = planner.start(key + ("remeasure",), lambda turn, note: plan_auto(
            PairCache(draft, target, device=device), temperature, turn=turn, progress=note, remeasure=tuple(rows),
            read_gb_per_s=read_gb_per_s, **kw), plans_for=key)
        return tuple(rows) if started else ()

    def load(self, spec: PairSpec) -> LoadedPair:
        if not spec.draft.strip() or not spec.target.strip():
            raise ModelLoadError("give both a draft and a target model ('embedded', a preset, a local dir or a hub id)")
        if "auto" in (spec.precision, spec.draft_precision):
            raise ModelLoadError("resolve precision 'auto' first (auto_plan)")
        with self._lock:
            if self._pair is not None and self._pair.spec == spec:
                return self._pair
            self.progress = ""
            if self._pair is not None and self._pair.spec.offload:  # its pinned memory goes before another load
                self._release()
            try:
                if spec.offload:  # an offloaded target is streamed from host memory: load it on the CPU
                    from dyntree_core.models import load_pair, precheck_pair  # lazy: nothing is loaded at import

                    precheck_pair(spec.draft, spec.target)
                    self._release()
                    pair = load_pair(spec.draft.strip(), spec.target.strip(), dtype=spec.dtype, device="cpu",
                                     precision=spec.precision, draft_precision=spec.draft_precision,
                                     progress=self._say)
                else:
                    cache = self._pair_cache(spec.draft.strip(), spec.target.strip(), spec.device)
                    pair = cache.pair(spec.precision, spec.draft_precision)
            except (OSError, ValueError, KeyError) as e:
                raise ModelLoadError(f"could not load draft {spec.draft!r} / target {spec.target!r}: {e}") from e
            tok = pair.tokenizer
            self._pair = LoadedPair(
                draft=pair.draft,
                target=pair.target,
                tokenizer=tok,
                spec=spec,
                description=str(getattr(pair, "description", "") or f"{spec.draft} → {spec.target}"),
                supports_chat=bool(getattr(tok, "chat_template", None)),
                eos_token_ids=tuple(int(i) for i in getattr(pair, "eos_token_ids", ()) or ()),
            )
            return self._pair

    def _release(self) -> None:
        """Drop the loaded pair and its cache, closing what preparing its models acquired first (an
        offloaded target's pinned host memory must be unregistered before another pair pins its own)."""
        if self._pair is None and self._cache is None:
            return
        if self._pair is not None:
            from dyntree_core.decode.prepared import PreparedPair

            PreparedPair.close_attached(self._pair.draft, self._pair.target)
        self._pair = None
        self._cache, self._cache_key = None, None
        release_freed_memory()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:  # pragma: no cover - torch is a hard dependency
            pass
