"""Export: figures to PNG/SVG through kaleido (Debian chromium, never a downloaded browser) and
the run's StepTraces to JSON."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Mapping, Sequence

import plotly.graph_objects as go

from .session import RunRecord

FORMATS: tuple[str, ...] = ("png", "svg")
BROWSER_ENV = "DYNTREE_CHROMIUM"


class RunFileError(RuntimeError):
    """An exported run file cannot be opened (unreadable, or not a DynTree run export)."""


class ExportError(RuntimeError):
    """Static export failed; the message says what is missing."""


def find_browser() -> str:
    """Chromium for kaleido: ``$DYNTREE_CHROMIUM``, ``$BROWSER_PATH``, then ``chromium`` on PATH."""
    for cand in (os.environ.get(BROWSER_ENV), os.environ.get("BROWSER_PATH"), shutil.which("chromium"),
                 "/usr/bin/chromium", shutil.which("chromium-browser"), shutil.which("google-chrome")):
        if cand and Path(cand).is_file():
            return cand
    raise ExportError("PNG/SVG export needs Chromium: install it with `apt-get install chromium` "
                      f"(or `make browser`), or point {BROWSER_ENV} at a Chrome/Chromium binary")


def write_images(figures: Mapping[str, go.Figure], out_dir: Path, formats: Sequence[str] = FORMATS,
                 scale: float = 2.0) -> list[Path]:
    """Write every figure in every format with one headless browser; returns the files."""
    for fmt in formats:
        if fmt not in FORMATS:
            raise ExportError(f"unknown image format {fmt!r}; choose from {FORMATS}")
    browser = find_browser()
    import kaleido

    out_dir.mkdir(parents=True, exist_ok=True)
    jobs, paths = [], []
    for name, fig in figures.items():
        for fmt in formats:
            path = out_dir / f"{name}.{fmt}"
            opts = {"format": fmt, "scale": scale if fmt == "png" else 1}
            if fig.layout.width:
                opts["width"] = int(fig.layout.width)
            else:
                opts["width"] = 1100
            if fig.layout.height:
                opts["height"] = int(fig.layout.height)
            jobs.append({"fig": fig, "path": path, "opts": opts})
            paths.append(path)
    try:
        # mathjax=False: no CDN fetch (the machines are offline); the Debian launcher adds
        # --disable-background-networking, kaleido adds --disable-sync/--no-first-run/...
        kaleido.write_fig_from_object_sync(jobs, kopts={"path": browser, "mathjax": False}, cancel_on_error=True)
    except Exception as e:  # noqa: BLE001 - kaleido/choreographer raise many kinds; report them
        raise ExportError(f"figure export failed ({type(e).__name__}: {e})") from e
    missing = [p for p in paths if not p.is_file() or p.stat().st_size == 0]
    if missing:
        raise ExportError(f"figure export produced no file for: {', '.join(p.name for p in missing)}")
    return paths


def traces_json(record: RunRecord) -> dict:
    """The run as JSON: settings, resolved config, prompt ids, token texts and every StepTrace."""
    ids = sorted({c.token_id for t in record.traces for c in t.committed}
                 | {int(x) for t in record.traces if t.tree is not None for x in t.tree.tokens.tolist()}
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
    }


RUN_FORMAT = "dyntree.run/1"


def read_json(path: Path) -> RunRecord:
    """An exported run (``write_json``) as a ``RunRecord`` again: settings, config, prompt ids, token
    texts and every step, so each figure can be drawn without the models."""
    from dataclasses import fields

    from dyntree_core.config import DecodeConfig
    from dyntree_core.trace import StepTrace

    from .settings import RunSettings
    from .tokens import StoredTokenTexts

    try:
        d = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise RunFileError(f"cannot read run file {path}: {e}") from e
    if not isinstance(d, dict) or d.get("format") != RUN_FORMAT:
        raise RunFileError(f"{Path(path).name} is not a DynTree run export (format {RUN_FORMAT!r})")

    def build(cls, values: dict):
        names = {f.name for f in fields(cls) if f.init}
        kw = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items() if k in names}
        return cls(**kw)

    return RunRecord(
        settings=build(RunSettings, d["settings"]),
        config=build(DecodeConfig, d["config"]),
        prompt_ids=[int(i) for i in d["prompt_ids"]],
        texts=StoredTokenTexts({int(k): v for k, v in d["token_texts"].items()}),
        traces=[StepTrace.from_dict(s) for s in d["steps"]],
        status=d.get("status", "finished"),
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
