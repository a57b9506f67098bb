"""The verification walkthrough: one step's verifier decisions in the order they were made
(``StepTrace.decisions``), one of them selected, as HTML (pure functions)."""

from __future__ import annotations

import html
import math
from typing import Optional

from dyntree_core.trace import StepTrace
from dyntree_core.verify.base import VerifyDecision

from .fmt import prob
from .tokens import TokenTexts, visible_whitespace

RULES = {
    "token_level": "Token-level rejection sampling: at each node its children are tested in draw order, child x "
                   "accepted with probability min(1, R(x)/D(x)), R the target (residual) distribution at the node, "
                   "D the distribution the child was drawn from. After a rejection R ← norm(max(R − D, 0)) and the "
                   "rejected token leaves D (without replacement). The bonus token is drawn from R where the walk stops.",
    "traversal": "Traversal Verification: the tree is walked leaf-first. Entering child x of u gives it the "
                 "sequence-level probability p = min(1, p_u·Mb(x)/Ms(x)); a node is tested with its p once all its "
                 "children were rejected, and each rejected subtree updates p_u and Mb at its parent. The bonus "
                 "token is drawn from Mb at the accepted node.",
    "point_mass": "Point-mass verification: at each node a token is drawn from the target; the walk moves to the "
                  "child carrying it, or the token becomes the bonus.",
    "greedy": "Greedy verification (T = 0): a child is accepted when its token is the target's argmax at its "
              "parent; the bonus token is the argmax where the walk stops.",
}

KIND_LABELS = {"child": "test", "enter": "enter", "node": "test node", "sample": "sample", "argmax": "argmax",
               "bonus": "bonus"}

STYLE = ("<style>#verify-walkthrough table{border-collapse:collapse;font-size:0.85em;width:100%}"
         "#verify-walkthrough td,#verify-walkthrough th{padding:2px 6px;border-bottom:1px solid #ddd;text-align:right}"
         "#verify-walkthrough td.tok,#verify-walkthrough th.tok{text-align:left;font-family:monospace}"
         "#verify-walkthrough tr.dt-walk-current{background:#fff3c4;font-weight:bold}"
         "#verify-walkthrough .dt-walk-box{max-height:320px;overflow-y:auto}</style>")


def _tok(texts: TokenTexts, token: int) -> str:
    return html.escape(visible_whitespace(texts.piece(token), 16))


def _num(x: float) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else prob(x)


def explain(d: VerifyDecision, texts: TokenTexts) -> str:
    """One sentence for decision ``d``."""
    tok = f"'{_tok(texts, d.token)}'"
    draw = "" if d.u is None else f" Drew u = {d.u:.3f}"
    versus = "" if d.u is None else f"{draw}{' < ' if d.accepted else ' ≥ '}{_num(d.accept_prob)}"
    if d.kind == "child":
        verdict = "accepted" if d.accepted else "rejected"
        ratio = (f"min(1, {_num(d.p_target)} / {_num(d.q)})" if d.q > 0 else "1 (no draft mass)")
        text = f"Node {d.node} {tok}: accept with {ratio} = {_num(d.accept_prob)}.{versus} → <b>{verdict}</b>."
    elif d.kind == "enter":
        text = (f"Enter node {d.node} {tok} with p = min(1, {_num(d.p_target)} / {_num(d.q)}) = {_num(d.accept_prob)}"
                f"{' (p = 0: its whole subtree is rejected)' if d.accept_prob <= 0 else ''}.")
    elif d.kind == "node":
        verdict = "accepted: the walk ends here" if d.accepted else "rejected"
        how = versus if d.drew else " No draw (p = 0)"
        text = f"Test node {d.node} {tok} with its sequence-level p = {_num(d.accept_prob)}.{how} → <b>{verdict}</b>."
    elif d.kind == "sample":
        text = f"Drew {tok} from the target (p = {_num(d.p_target)}):{draw}; node {d.node} carries it → <b>move on</b>."
    elif d.kind == "argmax":
        text = (f"Node {d.node} {tok} {'is' if d.accepted else 'is not'} the target's argmax at its parent"
                f" → <b>{'accepted' if d.accepted else 'rejected'}</b>.")
    else:
        src = "the target's argmax" if d.u is None else f"the target/residual distribution ({draw.strip()})"
        text = f"Bonus token {tok} from {src} after node {d.node}" + (
            f", p = {_num(d.p_target)}." if not math.isnan(d.p_target) else ".")
    if d.residual_top:
        top = ", ".join(f"'{_tok(texts, t)}' {prob(p)}" for t, p in d.residual_top)
        text += f"<br>Residual at the parent afterwards: {top}."
    return text


def walkthrough_html(trace: Optional[StepTrace], texts: Optional[TokenTexts], selected: Optional[int]) -> str:
    """The decisions of ``trace`` as a table, row ``selected`` highlighted and explained."""
    if trace is None or texts is None:
        return STYLE + "<p><i>Run or Step to see how the verifier decided.</i></p>"
    if not trace.decisions:
        return STYLE + f"<p><i>Step {trace.step} ({trace.method}) has no verifier decisions to show.</i></p>"
    ds = trace.decisions
    sel = None if selected is None else max(0, min(len(ds) - 1, selected))
    rule = html.escape(RULES.get(trace.verifier, trace.verifier))
    head = (f"<p style='font-size:0.85em;color:#444'>{rule}</p>"
            f"<p id='walk-current' data-node='{'' if sel is None else ds[sel].node}'>"
            + (f"<b>Decision {sel + 1} of {len(ds)}.</b> {explain(ds[sel], texts)}" if sel is not None else
               f"{len(ds)} decisions in step {trace.step}. Press <b>Next</b> to go through them; the node "
               "is ringed in the tree.") + "</p>")
    cut = set(trace.cut_nodes)
    if cut or trace.bonus_cut:
        why = {"length": "max new tokens was reached", "context": "the model's context is full",
               "eos": "an end-of-sequence token came first"}.get(trace.finish_reason or "", "the run ended")
        head += (f"<p class='dt-walk-cut'><b>Only the first {trace.num_committed} of the tokens this step verified "
                 f"were kept</b>: {why}. Decisions marked 'not kept' are shown as the verifier made them.</p>")
    rows = []
    for i, d in enumerate(ds):
        outcome = "accept" if d.accepted else "reject"
        if d.kind == "enter":
            outcome = "enter" if d.accepted else "skip"
        elif d.kind in ("bonus", "sample"):
            outcome = "drawn"
        if (d.kind == "bonus" and trace.bonus_cut) or (d.accepted and d.node in cut and d.kind not in ("bonus", "enter")):
            outcome += " (not kept)"
        cls = " class='dt-walk-current'" if i == sel else ""
        rows.append(f"<tr{cls}><td>{i + 1}</td><td>{KIND_LABELS[d.kind]}</td><td>{d.node}</td>"
                    f"<td class='tok'>{_tok(texts, d.token)}</td><td>{_num(d.p_target)}</td><td>{_num(d.q)}</td>"
                    f"<td>{_num(d.accept_prob)}</td><td>{'–' if d.u is None else f'{d.u:.3f}'}</td><td>{outcome}</td></tr>")
    table = ("<div class='dt-walk-box'><table><tr><th>#</th><th>what</th><th>node</th><th class='tok'>token</th>"
             "<th>p target / residual</th><th>q draft</th><th>accept prob</th><th>u</th><th>outcome</th></tr>"
             + "".join(rows) + "</table></div>")
    return STYLE + head + table
