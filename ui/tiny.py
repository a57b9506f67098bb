"""TEST-ONLY model provider: ``dyntree_core.testing.tiny_pair`` with a trivial tokenizer.

Used by ``python app.py --tiny`` (or ``DYNTREE_TINY=1``), the browser test and the screenshot
script, so the whole UI can be exercised in seconds without the real model pair. Token ``i``
reads as ``"t{i} "``; it is not a language model and its text is not meant to be meaningful.
"""

from __future__ import annotations

import re
import threading
import zlib
from typing import Callable, Optional, Sequence

from .models import LoadedPair, ModelLoadError
from .pair_spec import PairSpec
from .prompt_check import TextInfo

TINY_NAME = "tiny"
_TOKEN_RE = re.compile(r"t(\d+)")


class TinyTokenizer:
    """Token ``i`` <-> text ``"t{i} "``; other words map to a stable id (crc32 mod vocab)."""

    chat_template = None

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": self.encode(text)}

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for word in text.split():
            m = _TOKEN_RE.fullmatch(word)
            if m and int(m.group(1)) < self.vocab:
                ids.append(int(m.group(1)))
            else:
                ids.append(2 + zlib.crc32(word.encode()) % (self.vocab - 2))  # skip bos/eos ids
        return ids

    def decode(self, ids: Sequence[int], **_: object) -> str:
        return "".join(f"t{int(i)} " for i in ids)


class TinyModelProvider:
    """Serves the tiny random pair under the model name ``tiny`` (anything else is refused)."""

    default_draft = TINY_NAME
    default_target = TINY_NAME

    def __init__(self, vocab: int = 64, seed: int = 0, max_positions: int = 16384) -> None:
        self.vocab = vocab
        self.seed = seed
        self.max_positions = max_positions  # long enough for the long-prompt tests
        self._lock = threading.Lock()
        self._pair: Optional[LoadedPair] = None
        self.progress = ""  # (the tiny pair loads at once: nothing to report)
        self.progress_listener: Optional[Callable[[str], None]] = None

    def is_loaded(self, spec: PairSpec) -> bool:
        pair = self._pair
        return pair is not None and pair.spec == spec

    def loaded_description(self) -> str:
        pair = self._pair
        return pair.description if pair is not None else ""

    def auto_plan(self, settings, progress=None, planner=None, read_gb_per_s=None):
        """``auto`` on the tiny pair: the same measured cost model (profile + acceptance, cached
        under ``$DYNTREE_CACHE``), only float32 (and int8 for the draft) to keep it quick."""
        from dyntree_core.planning.auto import plan_auto

        from .planner import plan_auto_for_app

        temperature, tps, dps, methods = self._request(settings)
        kw = dict(target_precisions=tps, draft_precisions=dps, methods=methods, read_gb_per_s=read_gb_per_s)
        return plan_auto_for_app(
            planner, (temperature, tps, dps, methods), tps, dps,
            cached=lambda: plan_auto(self._cache(), temperature, measure=False, **kw),
            measure=lambda turn, note: plan_auto(self._cache(), temperature, turn=turn, progress=note, **kw),
            foreground=lambda: plan_auto(self._cache(), temperature, progress=progress, **kw),
            read_gb_per_s=read_gb_per_s)

    def remeasure(self, settings, rows, planner, read_gb_per_s=None) -> tuple:
        """As ``HubModelProvider.remeasure``, on the tiny pair's profile."""
        from dyntree_core.planning.auto import plan_auto

        if planner is None or not rows:
            return ()
        temperature, tps, dps, methods = self._request(settings)
        started = planner.start((temperature, tps, dps, methods, "remeasure"), lambda turn, note: plan_auto(
            self._cache(), temperature, target_precisions=tps, draft_precisions=dps, methods=methods, turn=turn,
            progress=note, remeasure=tuple(rows), read_gb_per_s=read_gb_per_s), plans_for=(temperature, tps, dps, methods))
        return tuple(rows) if started else ()

    @staticmethod
    def _request(settings) -> tuple:
        """``(temperature, target precisions, draft precisions, methods)`` auto prices on the tiny pair."""
        from dyntree_core.planning.search_space import search_space

        _, _, methods = search_space(settings.method, settings.precision, settings.draft_precision, "cpu")
        tps = ("float32",) if settings.precision == "auto" else (settings.precision,)
        dps = ("float32", "int8") if settings.draft_precision == "auto" else (settings.draft_precision,)
        return float(settings.temperature), tps, dps, methods

    def _cache(self):
        from dyntree_core.testing import TinyPairCache

        return TinyPairCache(TinyTokenizer(self.vocab), vocab=self.vocab, seed=self.seed, max_positions=self.max_positions)

    def text_info(self, draft: str, target: str) -> Optional[TextInfo]:
        if draft != TINY_NAME or target != TINY_NAME:
            return None
        return TextInfo(TinyTokenizer(self.vocab), self.max_positions, supports_chat=False)

    def load(self, spec: PairSpec) -> LoadedPair:
        if spec.draft != TINY_NAME or spec.target != TINY_NAME:
            raise ModelLoadError(
                f"this app was started with --tiny and serves only the test pair 'tiny'; "
                f"got draft {spec.draft!r}, target {spec.target!r}"
            )
        with self._lock:
            if self._pair is None or self._pair.spec != spec:
                pair = self._cache().pair(
                    _concrete(spec.precision), _concrete(spec.draft_precision))
                self._pair = LoadedPair(pair.draft, pair.target, pair.tokenizer, spec,
                                        description=f"tiny random Llama pair (test only; {pair.description})")
            return self._pair


def _concrete(precision: str) -> str:
    return "float32" if precision in ("auto", "", None) else precision
