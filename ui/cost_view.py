"""The cost-model panel: why the current run beats plain decoding on this machine or not (its mean
step, model and suffix steps priced separately, against a plain-decoding reference timed inside the run
(its plain probes, ``decode.plain_probes``) or next to it, with its time and the machine's load), and the
same tree priced with what this engine measured on a GPU (the committed H200 results, labelled with their
machine)."""

from __future__ import annotations

import functools
import html
from pathlib import Path
from typing import Optional

from dyntree_core.decode.plain_probes import probe_steps
from dyntree_core.planning.cost_model import StepCost, Verdict, ar_reference, step_cost
from dyntree_core.planning.projection import GpuResults, gpu_rows

from .prediction_view import prediction_html
from .session import RunRecord

STYLE = ("<style>#cost-model table{border-collapse:collapse;font-size:0.85em;margin:4px 0}"
         "#cost-model td,#cost-model th{padding:2px 8px;border-bottom:1px solid #ddd;text-align:right}"
         "#cost-model td:first-child,#cost-model th:first-child{text-align:left}"
         "#cost-model .dt-win{color:#1a7f37;font-weight:bold}#cost-model .dt-lose{color:#b42318;font-weight:bold}"
         "#cost-model details{font-size:0.8em;color:#555}</style>")

#: the H200 results committed in this repository (absent beside an installed package: no GPU rows)
GPU_RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results" / "gpu-h200"

KIND_NAMES = {"model": "model-drafted steps", "suffix": "suffix-tree steps (no draft forward)",
              "repeats": "steps of the text's repeats (no draft forward)", "": "tree steps"}


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


@functools.lru_cache(maxsize=1)
def gpu_results() -> Optional[GpuResults]:
    """The committed GPU measurements (read once)."""
    return GpuResults.load(GPU_RESULTS)


def _step_table(cost: StepCost) -> str:
    kinds, m = cost.kinds, cost.mean
    head = "".join(f"<th>{html.escape(KIND_NAMES.get(k.source, k.source))}</th>" for k in kinds)
    mean_col = len(kinds) > 1
    rows = [
        ("share of steps", [f"{cost.share(k):.0%} ({k.steps})" for k in kinds], f"{m.steps}"),
        ("tree nodes (mean)", [f"{k.tree_size:.1f}" for k in kinds], f"{m.tree_size:.1f}"),
        ("drafting", [_ms(k.draft_s) for k in kinds], _ms(m.draft_s)),
        ("target forward", [_ms(k.target_s) for k in kinds], _ms(m.target_s)),
        ("tree build, mask, verify, KV", [_ms(k.phases_s) for k in kinds], _ms(m.phases_s)),
        ("rest of the step", [_ms(k.rest_s) for k in kinds], _ms(m.rest_s)),
        ("step", [_ms(k.step_s) for k in kinds], _ms(m.step_s)),
        ("tokens per step", [f"{k.tokens_per_step:.2f}" for k in kinds], f"{m.tokens_per_step:.2f}"),
    ]
    return ("<table><tr><th>mean per step</th>" + head + ("<th>all steps, weighted</th>" if mean_col else "") + "</tr>"
            + "".join(f"<tr><td>{name}</td>" + "".join(f"<td>{v}</td>" for v in vals)
                      + (f"<td>{allv}</td>" if mean_col else "") + "</tr>" for name, vals, allv in rows)
            + "</table>")


def _gpu_section(cost: StepCost, target_params: float) -> str:
    gpu = gpu_results()
    if gpu is None:
        return ""
    m = cost.mean
    rows = gpu_rows(gpu, m.tree_size, m.tokens_per_step, target_params)
    if not rows:
        return ""
    return ("<p style='margin-top:8px'><b>The same tree on a GPU</b>, priced with step times this engine "
            f"measured on {html.escape(gpu.machine)} ({html.escape(gpu.date[:10])}; "
            "<code>bench/results/gpu-h200/</code>): measured seconds per step at this run's tree size "
            f"({m.tree_size:.0f} nodes) ÷ this run's {m.tokens_per_step:.2f} tokens/step</p>"
            "<table><tr><th>setting</th><th>plain decoding per token</th><th>tree per token</th><th>speed-up</th></tr>"
            + "".join(f"<tr><td>{html.escape(r.setting)}</td><td>{_ms(r.ar_s_per_token)}</td>"
                      f"<td>{_ms(r.tree_s_per_token)}</td><td>{r.speedup:.2f}×</td></tr>" for r in rows)
            + "</table><details><summary>what was measured</summary>"
            + "".join(f"<p><b>{html.escape(r.setting)}</b>: " + "; ".join(
                f"{html.escape(k)}: {html.escape(v)}" for k, v in r.inputs.items()) + "</p>" for r in rows)
            + "</details>")


def cost_model_html(record: Optional[RunRecord], baseline: Optional[RunRecord]) -> str:
    if record is None or not record.traces:
        return STYLE + "<p><i>After a Run this panel says why the tree beats plain decoding here, or not.</i></p>"
    predicted = prediction_html(record)
    cost = step_cost(record.traces)
    if cost is None:
        return STYLE + predicted + ("<p>This is the autoregressive baseline itself: "
                                    f"{_ms(record.traces[-1].elapsed / max(record.traces[-1].total_new_tokens, 1))} "
                                    "per token (prefill included). Run a tree method to compare against it.</p>")
    ar = ar_reference(baseline.traces if baseline is not None else None, record.ar_timing,
                      record.one_token_forward_s, inside=record.traces)
    if ar is None:
        head = ("<p>No plain-decoding reference: tick <b>Then run the autoregressive baseline</b> to measure it "
                "on this machine.</p>")
    else:
        v = Verdict(cost, ar)
        cls = "dt-win" if v.wins else "dt-lose"
        when = ""
        if ar.inside:
            probes = probe_steps(record.traces)
            where = (["a plain step at steps " + ", ".join(str(t.step + 1) for t in probes)] if probes else []) + (
                ["its plain steps after the fallback"] if ar.inside > len(probes) else [])
            when = (f" Timed inside this run ({'; '.join(where)}), each committing its token, so plain decoding ran "
                    "under the run's own load.")
        elif ar.timing is not None:
            t = ar.timing
            when = (f" Reference timed at <b>{html.escape(t.measured_at)}</b> ({html.escape(t.load_text())}), "
                    f"next to this run, on its mean context ({t.prefix_len} tokens).")
        head = (f"<p>Measured: a mean step of this run costs <b>{_ms(cost.mean.step_s)}</b>; plain decoding at "
                f"{html.escape(record.config.precision or 'the same precision')} costs "
                f"<b>{_ms(ar.seconds_per_token)}</b> per token ({html.escape(ar.source)}).{when} "
                f"So the tree must deliver <b>≥ {v.break_even_tokens_per_step:.2f} tokens/step</b> to beat plain "
                f"decoding here; it delivers <span class='{cls}'>{cost.mean.tokens_per_step:.2f}</span> → "
                f"<span class='{cls}'>{v.speedup:.2f}×</span> its speed on this run's steps "
                f"{'(faster)' if v.wins else '(slower)'}.</p>")
    base_measured = "–"
    if baseline is not None and baseline.traces:
        b = baseline.traces[-1]
        base_measured = _ms(b.elapsed / max(b.total_new_tokens, 1))
    per_token = ("<table><tr><th>ms per token</th><th>step model (mean step ÷ mean tokens/step)</th>"
                 "<th>measured, decoding (wall clock)</th><th>measured, prefill included</th></tr>"
                 f"<tr><td>plain decoding</td><td>{_ms(ar.seconds_per_token) if ar else '–'}</td><td>–</td>"
                 f"<td>{base_measured}</td></tr>"
                 f"<tr><td>{html.escape(record.label)}</td><td>{_ms(cost.step_model_s_per_token)}</td>"
                 f"<td>{_ms(cost.decode_s_per_token)}</td><td>{_ms(cost.with_prefill_s_per_token)}</td></tr></table>")
    return STYLE + predicted + head + per_token + _step_table(cost) + _gpu_section(cost, float(record.model_params[1]))
