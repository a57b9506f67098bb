"""Figures to PNG/SVG through kaleido with the system Chromium (never a downloaded browser): used by
the app's export buttons and by the benchmarks (which must not import the app)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

if TYPE_CHECKING:
    import plotly.graph_objects as go

FORMATS: tuple[str, ...] = ("png", "svg")
BROWSER_ENV = "DYNTREE_CHROMIUM"


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


def write_images(figures: Mapping[str, "go.Figure"], out_dir: Path, formats: Sequence[str] = FORMATS,
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
