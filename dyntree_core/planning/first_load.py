"""The app's first load, done in the set-up (``python -m dyntree_core prepare``, the last step of ``make run`` and
``make test``): the pair at the precisions ``auto``'s first Run decodes at (``provisional_plan``), which measures
this machine's kernel table for its shapes and packs its weights once. The first Run then reads them: on the 2-core
Zen 4 host its first token came 23.6 s after the click with both still to do, of which 16.3 s measuring the
kernels and 6.5 s building the weights (the app log's phases)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

from ..models.load import packed_weights_ready, resolve_spec
from .pair_cache import PairCache
from .provisional import provisional_plan
from .search_space import AUTO, search_space


@dataclass(frozen=True)
class FirstLoad:
    """The precisions ``prepare_first_load`` prepared, how long it took (seconds) and the roles it had to load
    (the others' packed weights were cached)."""

    draft_precision: str
    target_precision: str
    seconds: float
    loaded: tuple[str, ...]


def prepare_first_load(draft: str = "embedded", target: str = "embedded", device: str = "cpu",
                       progress: Optional[Callable[[str], None]] = None) -> FirstLoad:
    """Load ``draft`` and ``target`` once at the precisions of ``auto``'s provisional plan on ``device`` (the app's
    defaults: Method and precisions ``auto``), so that their kernel table and packed weights are cached."""
    target_precisions, draft_precisions, _methods = search_space(AUTO, AUTO, AUTO, device)
    plan = provisional_plan(target_precisions, draft_precisions, "")
    t0 = time.perf_counter()
    cache = PairCache(draft, target, device=device, progress=progress)
    loaded = []
    for role, precision in (("draft", plan.draft_precision), ("target", plan.precision)):
        src = resolve_spec(draft if role == "draft" else target, role)
        if device == "cpu" and packed_weights_ready(src, precision, progress):
            continue  # (its kernel table and packed weights are there: the first Run reads them)
        cache.model(role, precision)
        loaded.append(role)
    return FirstLoad(plan.draft_precision, plan.precision, time.perf_counter() - t0, tuple(loaded))
