"""Does the draft/target agreement on a prompt say how much its continuation will accept? For the calibration
prompts ``auto`` measures acceptance on and the eval prompts of wiki, news and code (128 prompt tokens, no chat
template, as ``bench speed``): the target's greedy continuation (64 tokens; 48 for the calibration prompts, as
``acceptance.measure_acceptance``), then both models teacher-forced over prompt + continuation. Per prompt: the
agreement ``auto`` prices with (``acceptance.prompt_agreement``: the last 32 prompt tokens alone), the agreement on
the whole prompt in context, the draft's argmax agreement with the continuation and the tokens per step of a greedy
chain of k <= 12 without a confidence stop replayed on it. Then the correlations over the eval prompts, and how well
the chain's tokens per step of the nearest 1, 2, 3 and all 4 calibration texts (by agreement) predict each prompt's.

    .venv/bin/python scripts/prompt_agreement.py [--prompts 10] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from math import exp, log
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


#: the other windows of prompt tokens whose agreement is measured beside ``AGREEMENT_WINDOW``'s
WINDOWS = (16, 64, 128)


def chain_tokens_per_step(agree: list[float], k: int = 12) -> float:
    """Tokens per step of a greedy chain of at most ``k`` drafts replayed on per-position accepts (0/1)."""
    i = steps = tokens = 0
    while i < len(agree):
        n = 0
        while n < k and i + n < len(agree) and agree[i + n]:
            n += 1
        steps, tokens, i = steps + 1, tokens + n + 1, i + n + 1
    return tokens / steps


def corr(x: list[float], y: list[float]) -> float:
    mx, my = statistics.fmean(x), statistics.fmean(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    return sxy / (sum((a - mx) ** 2 for a in x) * sum((b - my) ** 2 for b in y)) ** 0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from dyntree_core.bench.result_file import result_header
    from dyntree_core.config import DecodeConfig
    from dyntree_core.decode.engine import SpeculativeDecoder
    from dyntree_core.models.load import load_pair
    from dyntree_core.planning.acceptance import calibration_prompts, prompt_agreement
    from dyntree_core.prompts import load_prompts

    pair = load_pair("embedded", "embedded", precision="int4", draft_precision="int4")
    tok = pair.tokenizer
    dec = SpeculativeDecoder(pair.draft, pair.target, DecodeConfig(method="autoregressive", temperature=0.0),
                             eos_token_id=list(pair.eos_token_ids) or None)

    def one(ids: list[int], new: int, dataset: str) -> dict:
        cont: list[int] = []
        for trace in dec.generate(list(ids), new, seed=0):
            cont.extend(c.token_id for c in trace.committed)
        with torch.inference_mode():
            x = torch.tensor([list(ids) + cont])
            ta, da = pair.target(x).logits[0].argmax(-1), pair.draft(x).logits[0].argmax(-1)
        p = len(ids)
        on_cont = (da[p - 1:-1] == torch.tensor(cont)).double()
        row = dict(dataset=dataset, prompt_tokens=p, new_tokens=len(cont),
                   agreement=round(prompt_agreement(pair, ids), 4),
                   **{f"agreement_last_{w}": round(prompt_agreement(pair, ids, w), 4) for w in WINDOWS},
                   agreement_whole_prompt=round(float((ta[:p - 1] == da[:p - 1]).double().mean()), 4),
                   continuation_agreement=round(float(on_cont.mean()), 4),
                   chain12_tokens_per_step=round(chain_tokens_per_step(on_cont.tolist()), 3))
        print(row, flush=True)
        return row

    calib = [one(ids, 48, "calib-" + ("wiki" if i < 2 else "code")) for i, ids in enumerate(calibration_prompts(tok))]
    evals = [one(list(tok(p.text, add_special_tokens=False)["input_ids"])[:128], 64, ds)
             for ds in ("wiki", "news", "code") for p in load_prompts(ds, args.prompts)]
    y = [r["chain12_tokens_per_step"] for r in evals]
    out = {**result_header("scripts/prompt_agreement.py"),
           "calibration": calib, "eval": evals,
           "nearest": {}}
    keys = ("agreement", *(f"agreement_last_{w}" for w in WINDOWS), "agreement_whole_prompt")
    out["correlation_with_chain12"] = {key: round(corr([r[key] for r in evals], y), 3) for key in keys}
    for key in keys:
        for k in (1, 2, 3, 4):
            ratios = []
            for r in evals:
                near = sorted(calib, key=lambda c: abs(c[key] - r[key]))[:k]
                ratios.append(statistics.fmean(c["chain12_tokens_per_step"] for c in near) / r["chain12_tokens_per_step"])
            per_set = {ds: round(statistics.median(q for q, r in zip(ratios, evals) if r["dataset"] == ds), 3)
                       for ds in ("wiki", "news", "code")}
            got = {"median_factor_off": round(exp(statistics.median(abs(log(q)) for q in ratios)), 3),
                   "predicted_over_measured_median": per_set}
            out["nearest"].setdefault(key, {})[str(k)] = got
            print(f"{key}, nearest {k}: predicted within a median factor of {got['median_factor_off']:.2f}; "
                  f"predicted / measured per set {per_set}")
    print("correlation with the chain's tokens per step:", out["correlation_with_chain12"])
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
