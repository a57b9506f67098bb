"""Export: the run's StepTraces to JSON and back; figures to PNG/SVG (``dyntree_core.figure_export``,
re-exported here)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from dyntree_core.figure_export import BROWSER_ENV, FORMATS, ExportError, find_browser, write_images

from .session import RunRecord

__all__ = ["BROWSER_ENV", "FORMATS", "ExportError", "RunFileError", "find_browser", "read_json", "traces_json",
           "write_images", "write_json"]


class RunFileError(RuntimeError):
    """An exported run file cannot be opened (unreadable, or not a DynTree run export)."""


def traces_json(record: RunRecord) -> dict:
    """The run as JSON: settings, resolved config, prompt ids, token texts and every StepTrace."""
    ids = sorted({c.token_id for t in record.traces for c in t.committed}
                 | {int(x) for t in record.traces if t.tree is not None for x in t.tree.tokens.tolist()}
                 | {d.token for t in record.traces for d in t.decisions}
                 | {tok for t in record.traces for d in t.decisions for tok, _ in d.residual_top}
                 | set(record.prompt_ids[-1:]))  # the first step's root
    return {
        "format": RUN_FORMAT,
        "settings": record.settings.to_dict(),
        "config": record.config.to_dict(),
        "status": record.status,
        "prompt_ids": list(record.prompt_ids),
        "token_texts": {str(i): record.texts.piece(i) for i in ids},
        "summary": {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in record.summary().items()},
        "steps": [t.to_dict() for t in record.traces],
        "costs": {"prefill_seconds": record.prefill_seconds, "one_token_forward_s": record.one_token_forward_s,
                  "ar_timing": None if record.ar_timing is None else asdict(record.ar_timing),
                  "model_params": list(record.model_params), "wait_seconds": record.wait_seconds},
    }


RUN_FORMAT = "dyntree.run/1"


def read_json(path: Path) -> RunRecord:
    """An exported run (``write_json``) as a ``RunRecord`` again: settings, config, prompt ids, token
    texts and every step, so each figure can be drawn without the models. Anything else raises
    ``RunFileError`` naming the file (not its path) and what is wrong."""
    name = Path(path).name  # (never the server's path: it is a temporary upload location)
    try:
        d = json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise RunFileError(f"{name} is not a text file: open a run exported with 'JSON (StepTraces)'") from None
    except ValueError as e:
        raise RunFileError(f"{name} is not valid JSON ({e}): open a run exported with 'JSON (StepTraces)'") from None
    except OSError as e:
        raise RunFileError(f"{name} could not be read ({e.strerror or type(e).__name__})") from None
    if not isinstance(d, dict) or d.get("format") != RUN_FORMAT:
        raise RunFileError(f"{name} is not a DynTree run export (no \"format\": {RUN_FORMAT!r}): open a file "
                           "saved with 'JSON (StepTraces)'")
    try:
        return _record_from(d)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        what = f"missing field {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
        raise RunFileError(f"{name} is a DynTree run export but it is damaged or from an incompatible "
                           f"version ({what})") from None


def _record_from(d: dict) -> RunRecord:
    from dataclasses import MISSING, fields

    from dyntree_core.config import DecodeConfig
    from dyntree_core.planning.forward_timer import ForwardTiming
    from dyntree_core.step_price import FallbackPrice
    from dyntree_core.trace import StepTrace

    from .settings import RunSettings
    from .tokens import StoredTokenTexts

    def build(cls, values: dict):
        if not isinstance(values, dict):
            raise TypeError(f"{cls.__name__} must be an object, got {type(values).__name__}")
        names = {f.name for f in fields(cls) if f.init}
        missing = [f.name for f in fields(cls) if f.init and f.default is MISSING
                   and f.default_factory is MISSING and f.name not in values]
        if missing:
            raise KeyError(f"{cls.__name__}.{missing[0]}")
        kw = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items() if k in names}
        if isinstance(kw.get("fallback"), dict):  # RunSettings / DecodeConfig: the one nested field
            kw["fallback"] = FallbackPrice.from_dict(kw["fallback"])
        return cls(**kw)

    costs = d.get("costs") or {}
    return RunRecord(
        settings=build(RunSettings, d["settings"]),
        config=build(DecodeConfig, d["config"]),
        prompt_ids=[int(i) for i in d["prompt_ids"]],
        texts=StoredTokenTexts({int(k): v for k, v in d["token_texts"].items()}),
        traces=[StepTrace.from_dict(s) for s in d["steps"]],
        status=d.get("status", "finished"),
        prefill_seconds=costs.get("prefill_seconds"),
        one_token_forward_s=costs.get("one_token_forward_s"),
        ar_timing=build(ForwardTiming, costs["ar_timing"]) if costs.get("ar_timing") else None,
        wait_seconds=float(costs.get("wait_seconds") or 0.0),
        model_params=tuple(int(x) for x in costs.get("model_params", (0, 0))),  # type: ignore[arg-type]
    )


def write_json(record: RunRecord, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(traces_json(record), fh, ensure_ascii=False, indent=1, allow_nan=False, default=_json_default)
    return path


def _json_default(obj):
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
