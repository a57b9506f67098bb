"""The run's prediction and its check as the page shows them: the same two lines in the status line,
the cost panel and every Compare column (``dyntree_core.planning.prediction``), and the cost panel's
part-by-part table."""

from __future__ import annotations

import html
from typing import Optional

from .session import RunRecord


def prediction_lines(record: RunRecord) -> list[str]:
    """``[prediction, check]`` of a run ``auto`` priced (the check once a step ran); [] otherwise."""
    p = record.prediction
    if p is None:
        return []
    check = record.prediction_check()
    so_far = record.status in ("running", "paused")
    return [p.text()] + ([check.text(record.remeasuring, so_far=so_far)] if check is not None else [])


def check_table(record: RunRecord) -> str:
    """HTML: each part of the step, predicted and measured, and the profile row that priced it ('' when
    the run has no prediction or no step yet)."""
    check = record.prediction_check()
    if check is None:
        return ""

    def val(name: str, v: float) -> str:
        return f"{v:.2f}" if name == "tokens per step" else f"{v * 1e3:.1f} ms"

    rows = "".join(
        f"<tr><td>{html.escape(c.name)}</td><td>{val(c.name, c.predicted)}</td><td>{val(c.name, c.measured)}</td>"
        f"<td class='{'dt-lose' if c.off else ''}'>{c.ratio:.2f}×</td>"
        f"<td>{html.escape(c.row.text() if c.row else 'the acceptance measured on the calibration text')}</td></tr>"
        for c in check.parts)
    p = check.prediction
    total = (f"<tr><td><b>per token</b></td><td>{p.s_per_token * 1e3:.1f} ms</td>"
             f"<td>{check.measured_s_per_token * 1e3:.1f} ms</td>"
             f"<td class='{'dt-lose' if check.off else 'dt-win'}'>{check.ratio:.2f}×</td><td></td></tr>")
    k, r = check.fell_back_after, check.repeat_steps
    tree = check.steps - check.plain_steps - r
    repeats = f"its {r} steps of the text's repeats" if r else ""
    if k is not None:
        over = f"its {tree} tree steps, then the plain steps after its fallback" + (f" and {repeats}" if r else "")
    elif r:
        over = f"its {tree} tree steps, and {repeats}"
    else:
        over = f"{check.steps} steps"
    return ("<table><tr><th>per step</th><th>priced by auto (at the run's sizes where the profile has them)</th><th>measured (mean of "
            f"{over})</th><th>measured ÷ predicted</th><th>priced from</th></tr>"
            + rows + total + "</table>")


def prediction_html(record: Optional[RunRecord]) -> str:
    """The cost panel's first paragraph: the two lines and the table."""
    if record is None or record.prediction is None:
        return ""
    lines = prediction_lines(record)
    return ("<p><b>auto's prediction for this run</b>: " + html.escape(lines[0])
            + ("<br><b>this run</b>: " + html.escape(lines[1]) if len(lines) > 1 else "") + "</p>"
            + check_table(record))
