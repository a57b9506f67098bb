"""The header every result JSON of a bench script or an A/B script starts with: what wrote it, when (UTC), with which
arguments, on which machine (``machine.machine_info``: a result from one kind of machine says nothing about another)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from ..machine import machine_info


def result_header(what: str, argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """``{"what", "date", "argv", "machine_info"}``; ``argv`` defaults to this process's arguments."""
    return {"what": what, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "argv": list(sys.argv[1:] if argv is None else argv), "machine_info": machine_info().to_dict()}


def write_result(path: Path | str, what: str, body: Mapping[str, Any], **dump: Any) -> dict[str, Any]:
    """Write ``result_header(what)`` followed by ``body`` to ``path`` as indented JSON (``dump``: more
    ``json.dumps`` keywords, e.g. ``default=str``); returns what was written."""
    out = {**result_header(what), **body}
    Path(path).write_text(json.dumps(out, indent=1, **dump))
    return out
