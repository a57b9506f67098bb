"""The cost-model panel: why the current run beats autoregressive decoding on this machine or not,
and the same tree priced on other hardware (labelled projections with their inputs)."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Optional

from dyntree_core.planning.cost_model import ar_reference, project_hardware, step_cost, Verdict

from .session import RunRecord

STYLE = ("<style>#cost-model table{border-collapse:collapse;font-size:0.85em;margin:4px 0}"
         "#cost-model td,#cost-model th{padding:2px 8px;border-bottom:1px solid #ddd;text-align:right}"
         "#cost-model td:first-child,#cost-model th:first-child{text-align:left}"
         "#cost-model .dt-win{color:#1a7f37;font-weight:bold}#cost-model .dt-lose{color:#b42318;font-weight:bold}"
         "#cost-model details{font-size:0.8em;color:#555}</style>")

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def _offload_bench() -> Optional[Path]:
    """A committed GPU offload measurement, if any (``bench gpu`` / ``bench offload`` JSON)."""
    found = sorted(RESULTS.glob("offload*cuda*.json")) + sorted(RESULTS.glob("gpu*.json"))
    return found[-1] if found else None


def cost_model_html(record: Optional[RunRecord], baseline: Optional[RunRecord]) -> str:
    if record is None or not record.traces:
        return STYLE + "<p><i>After a Run this panel says why the tree beats autoregressive decoding here, or not.</i></p>"
    cost = step_cost(record.traces)
    if cost is None:
        return STYLE + ("<p>This is the autoregressive baseline itself: "
                        f"{_ms(record.traces[-1].elapsed / max(record.traces[-1].total_new_tokens, 1))} per token "
                        "(prefill included). Run a tree method to compare against it.</p>")
    ar = ar_reference(baseline.traces if baseline is not None else None, record.one_token_forward_s)
    rows = [
        ("draft forwards", cost.draft_s, f"≈ {cost.depth:.0f} forwards (tree depth)"),
        ("target forward", cost.target_s, f"{cost.tree_size:.0f} tokens in one forward"),
        ("everything else", cost.overhead_s, "tree build, mask, verify, KV compaction"),
        ("step", cost.total_s, f"{cost.tokens_per_step:.2f} tokens per step"),
    ]
    table = "<table><tr><th>median per step</th><th>time</th><th></th></tr>" + "".join(
        f"<tr><td>{name}</td><td>{_ms(t)}</td><td>{html.escape(note)}</td></tr>" for name, t, note in rows) + "</table>"
    if ar is None:
        head = ("<p>No autoregressive reference yet: tick <b>Then run the autoregressive baseline</b> to measure it "
                "on this machine.</p>")
        per_token = ""
    else:
        v = Verdict(cost, ar)
        cls = "dt-win" if v.wins else "dt-lose"
        head = (f"<p>On this machine one step of this tree costs <b>{_ms(cost.total_s)}</b>; autoregressive decoding "
                f"costs <b>{_ms(ar.seconds_per_token)}</b> per token ({html.escape(ar.source)}). "
                f"So the tree must deliver <b>≥ {v.break_even_tokens_per_step:.2f} tokens/step</b> to beat AR here; "
                f"it delivers <span class='{cls}'>{cost.tokens_per_step:.2f}</span> → predicted "
                f"<span class='{cls}'>{v.predicted_speedup:.2f}×</span> "
                f"{'faster' if v.wins else '(slower than AR)'}.</p>")
        base_measured = ""
        if baseline is not None and baseline.traces:
            b = baseline.traces[-1]
            base_measured = _ms(b.elapsed / max(b.total_new_tokens, 1))
        per_token = ("<table><tr><th>ms per token</th><th>predicted</th><th>measured (prefill included)</th></tr>"
                     f"<tr><td>autoregressive</td><td>{_ms(ar.seconds_per_token)}</td><td>{base_measured or '–'}</td></tr>"
                     f"<tr><td>{html.escape(record.label)}</td><td>{_ms(cost.predicted_s_per_token)}</td>"
                     f"<td>{_ms(cost.measured_s_per_token)}</td></tr></table>")
    proj = ""
    draft_p, target_p = record.model_params
    if draft_p and target_p:
        rows_p = project_hardware(cost, draft_p, target_p, _offload_bench())
        proj = ("<p style='margin-top:8px'><b>The same tree elsewhere</b> (projections, not measurements: this run's "
                f"tree size {cost.tree_size:.0f}, depth {cost.depth:.0f} and {cost.tokens_per_step:.2f} tokens/step; "
                f"draft {draft_p / 1e9:.2f} B, target {target_p / 1e9:.2f} B parameters)</p>"
                "<table><tr><th>hardware</th><th>AR per token</th><th>tree per token</th><th>speedup</th></tr>"
                + "".join(f"<tr><td>{html.escape(p.hardware)}</td><td>{_ms(p.ar_s_per_token)}</td>"
                          f"<td>{_ms(p.tree_s_per_token)}</td><td>{p.speedup:.2f}×</td></tr>" for p in rows_p)
                + "</table><details><summary>inputs and assumptions</summary>"
                + "".join(f"<p><b>{html.escape(p.hardware)}</b>: " + "; ".join(
                    f"{html.escape(k)}: {html.escape(v)}" for k, v in p.inputs.items()) + "</p>" for p in rows_p)
                + "</details>")
    return STYLE + head + per_token + table + proj
