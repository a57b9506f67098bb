"""``PairCache``: the draft and target models of one pair, loaded once per (role, precision) and
handed out as pairs at any precision pair, at most ``keep`` models in memory (least recently used go
first). ``auto`` loads everything it measures through one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from ..process_memory import release_freed_memory
from .machine_profile import NotMeasuredYet


@dataclass
class PairCache:
    """Loads models per (role, precision) once; hands out pairs at a precision pair.

    Holding every precision of both models would need ~15 GB for the embedded pair, so at most
    ``keep`` models stay loaded (least recently used go first)."""

    draft_spec: str
    target_spec: str
    device: str = "cpu"
    keep: int = 2
    progress: Optional[Callable[[str], None]] = None  # a line for each long part of a load (``load_model``)
    _models: dict = field(default_factory=dict)
    _base: object = None
    _forward_bytes: dict = field(default_factory=dict)  # (role, precision) -> ``forward_bytes``, read once

    def model(self, role: str, precision: str):
        key = (role, precision)
        if key in self._models:
            m = self._models.pop(key)
            self._models[key] = m
            return m
        from ..models.load import load_model, resolve_spec

        src = resolve_spec(self.draft_spec if role == "draft" else self.target_spec, role)
        if len(self._models) >= self.keep:
            while len(self._models) >= self.keep:
                self._models.pop(next(iter(self._models)))
            release_freed_memory()  # (before the next model's bytes arrive)
        m = load_model(src, "float32", self.device, precision, self.progress)
        self._models[key] = m
        return m

    def text_tokenizer(self):
        """The pair's tokenizer without loading weights (the loaded pair's, else the target's files
        on this machine); ``NotMeasuredYet`` where that would need a download."""
        if self._base is not None:
            return self._base.tokenizer
        from ..models.load import local_text_info

        found = local_text_info(self.target_spec, "target")
        if found is None:
            raise NotMeasuredYet(f"the tokenizer of {self.target_spec!r} is not on this machine yet")
        return found[0]

    def timing_model(self, role: str, precision: str):
        """A model that costs what ``model(role, precision)`` costs per forward: its zero-weight shape
        twin where one can be built (a GGUF preset on the CPU: seconds instead of a full load), else
        the model itself. Twins are not kept."""
        from ..models.load import load_shape_twin, resolve_spec

        src = resolve_spec(self.draft_spec if role == "draft" else self.target_spec, role)
        twin = load_shape_twin(src, self.device, precision)
        return twin if twin is not None else self.model(role, precision)

    def forward_bytes(self, role: str, precision: str) -> Optional[int]:
        """Weight bytes a one-token forward of ``model(role, precision)`` reads, known without loading it (a GGUF
        preset on the CPU: ``gguf_model.gguf_forward_bytes``, read once per (role, precision): 0.4-0.8 s for the
        embedded pair's eight); None where it is not."""
        key = (role, precision)
        if key not in self._forward_bytes:
            self._forward_bytes[key] = self._read_forward_bytes(role, precision)
        return self._forward_bytes[key]

    def _read_forward_bytes(self, role: str, precision: str) -> Optional[int]:
        from ..models.load import resolve_spec

        src = resolve_spec(self.draft_spec if role == "draft" else self.target_spec, role)
        if not (src.kind == "preset" and src.gguf) or self.device != "cpu":
            return None
        from ..models.gguf_model import gguf_forward_bytes

        return gguf_forward_bytes(src.gguf, precision, head=src.head)

    def pair(self, target_precision: str, draft_precision: str):
        """A ``ModelPair`` at those precisions (tokenizer and checks from ``load_pair``'s first call)."""
        import dataclasses

        from ..models.load import load_pair

        if self._base is None:
            pair = load_pair(self.draft_spec, self.target_spec, device=self.device,
                             precision=target_precision, draft_precision=draft_precision, progress=self.progress)
            # the template of later pairs keeps the tokenizer and checks, not these weights: holding
            # them would keep the first precisions in memory beside the ``keep`` models
            self._base = dataclasses.replace(pair, draft=None, target=None)
            self._models[("draft", draft_precision)] = pair.draft
            self._models[("target", target_precision)] = pair.target
            while len(self._models) > max(self.keep, 2):
                self._models.pop(next(iter(self._models)))
            return pair
        t = self.model("target", target_precision)
        d = self.model("draft", draft_precision)
        return dataclasses.replace(self._base, draft=d, target=t, draft_precision=draft_precision,
                                   target_precision=target_precision)
