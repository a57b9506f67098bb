"""Exceptions -> one clear message for the page (the app stays usable after any of them)."""

from __future__ import annotations

import logging
import re
import tempfile
from pathlib import Path

from dyntree_core.config import ConfigError
from dyntree_core.decode.prepared import PairClosedError

from .export import ExportError, RunFileError
from .models import ModelLoadError
from .session import GenerationBusy

log = logging.getLogger("dyntree.ui")


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    try:
        import torch

        if isinstance(exc, torch.OutOfMemoryError):
            return True
    except (ImportError, AttributeError):
        pass
    return "out of memory" in str(exc).lower()


def describe_error(exc: BaseException) -> str:
    """A user-facing message (server temp paths reduced to file names); unexpected errors are also
    logged with their traceback."""
    return without_temp_paths(_describe(exc))


def without_temp_paths(message: str) -> str:
    """``message`` with every path under the server's temp directory (uploads, exports) reduced to
    its file name: those paths mean nothing to the user and tell them about the server."""
    root = re.escape(tempfile.gettempdir().rstrip("/"))
    return re.sub(root + r"/[^\s'\"()\[\],;]*", lambda m: Path(m.group(0)).name, message)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, PairClosedError):
        return ("This run's models were released (a Run with other models or precisions loaded its own): "
                "its steps so far are kept; press Run to start again.")
    if isinstance(exc, ConfigError):
        return f"Invalid settings: {exc}"
    if isinstance(exc, ModelLoadError):
        return f"Model loading failed: {exc}"
    if isinstance(exc, RunFileError):
        return f"Cannot open the run: {exc}"
    if isinstance(exc, ExportError):
        return f"Export failed: {exc}"
    if isinstance(exc, GenerationBusy):
        return "Busy: a decoding step of this run is still in progress; try again in a moment."
    if _is_oom(exc):
        return ("Out of memory: lower the tree budget or max new tokens, use bfloat16, "
                "or enable target offload on a GPU. The partial run is kept.")
    log.exception("unexpected error in the UI", exc_info=exc)
    return f"Unexpected error ({type(exc).__name__}): {exc}"


def error_markdown(message: str) -> str:
    return f"⚠️ **{message}**" if message else ""
