"""`auto`'s fallback to plain decoding (``DecodeConfig.fallback``), interleaved per prompt in one process with
plain decoding at the same target precision, so that the machine's drift between rows cancels in the per-prompt
ratios (10 eval prompts of wiki / news / code, 128 prompt tokens, 64 new tokens, T = 0). Rows:

* ``plain``: plain decoding;
* ``auto, priced fallback``: the rule ``auto`` sets (each tree step priced at the profile rows at its own shape);
* ``auto, tokens/step fallback``: the earlier rule, the plan's break-even in tokens per step whatever the
  step's shape (the same ``FallbackPrice`` with a flat target row of that many plain tokens, free drafts);
* ``auto, no fallback``;
* ``auto, priced fallback, plain after it`` (``--rows norepeats``): the priced rule without the text's repeats
  drafted after the fallback (``drafting.repeats``; ``SpeculativeDecoder.repeats_after_fallback``);
* with ``--early FROM MARGIN ...``: ``auto, priced fallback from step FROM at MARGINx``, the priced rule checked
  from tree step FROM on, at MARGIN x the plain price until step ``FALLBACK_AFTER`` (``FallbackPrice.check_from``,
  ``early_margin``); ``--rows`` keeps only the rows named (plain always runs).

``--chat`` runs the prompts as the app does by default: wrapped in the chat template (an instruction and its
answer, not a continuation), the app's default prompt first (set "default"), then the same prompt sets.

    .venv/bin/python scripts/fallback_ab.py [--method chain] [--early 3 1.25] [--rows priced early]
        [--json bench/results/fallback_ab_<machine>.json]
"""
import argparse, dataclasses, statistics
from pathlib import Path

import torch
from dyntree_core.planning.auto import plan_auto
from dyntree_core.planning.pair_cache import PairCache
from dyntree_core.config import DecodeConfig
from dyntree_core.decode.engine import SpeculativeDecoder
from dyntree_core.prompts import load_prompts
from dyntree_core.bench.result_file import write_result
from dyntree_core.bench.speed import _ours
from dyntree_core.machine import machine_info
from dyntree_core.step_price import FallbackPrice, PricedRows

ap = argparse.ArgumentParser()
ap.add_argument("--json", type=Path, default=Path("bench/results") / f"fallback_ab_{machine_info().short_label()}.json")
ap.add_argument("--prompts", type=int, default=10)
ap.add_argument("--method", default="auto", help="auto's choice (default), or the method auto priced best of that "
                "kind (chain, sequoia), with its shape and fallback rule")
ap.add_argument("--early", nargs="+", default=[], metavar="FROM MARGIN",
                help="pairs: an early-checked priced rule from tree step FROM at MARGIN x the plain price")
ap.add_argument("--rows", nargs="+", choices=("priced", "tokens", "none", "early", "norepeats"),
                default=["priced", "tokens", "none", "early"], help="which rows besides plain decoding")
ap.add_argument("--chat", action="store_true", help="the chat template around each prompt, and the app's default "
                "prompt as a set of its own (the app's defaults)")
args = ap.parse_args()
if len(args.early) % 2:
    ap.error("--early takes pairs FROM MARGIN")
models = PairCache("embedded", "embedded", keep=2)
plan = plan_auto(models, 0.0)
cand = plan.best if args.method == "auto" else plan.best_of(args.method)
pair = models.pair(cand.target_precision, cand.draft_precision)
tok, eos = pair.tokenizer, list(pair.eos_token_ids or ())
priced = plan.apply(DecodeConfig(temperature=0.0), cand)
even = plan.break_even_tokens(cand)
flat = None if even is None else FallbackPrice(PricedRows((1, 4096), (even, even), (0.0, 0.0), (0.0, 0.0)), 1.0)
decs = {"plain": DecodeConfig(method="autoregressive", precision=priced.precision)}
if "priced" in args.rows:
    decs["auto, priced fallback"] = priced
if "tokens" in args.rows:
    decs["auto, tokens/step fallback"] = dataclasses.replace(priced, fallback=flat)
if "none" in args.rows:
    decs["auto, no fallback"] = dataclasses.replace(priced, fallback=None)
NO_REPEATS = "auto, priced fallback, plain after it"
if "norepeats" in args.rows:
    decs[NO_REPEATS] = priced
if "early" in args.rows and priced.fallback is not None:
    for first, margin in zip(args.early[::2], args.early[1::2]):
        rule = dataclasses.replace(priced.fallback, check_from=int(first), early_margin=float(margin))
        decs[f"auto, priced fallback from step {first} at {margin}x"] = dataclasses.replace(priced, fallback=rule)
print("auto chose", plan.best.label(), "; running", cand.label(), "break-even", even, "tokens/step; plain", priced.fallback and priced.fallback.plain_s_per_token,
      "s/token", flush=True)
out = {}
from dyntree_core.__main__ import encode_prompt
from ui.layout import AppDefaults

sets = {ds: [p.text for p in load_prompts(ds, args.prompts)] for ds in ("wiki", "news", "code")}
if args.chat:
    sets = {"default": [AppDefaults().prompt], **sets}
for ds, texts in sets.items():
    rows = {k: [] for k in decs}
    for i, text in enumerate(texts):
        ids = (encode_prompt(tok, text, chat=True) if args.chat
               else list(tok(text, add_special_tokens=False)["input_ids"])[:128])
        for k, c in decs.items():
            d = SpeculativeDecoder(pair.draft, pair.target, c, eos_token_id=eos)
            d.repeats_after_fallback = k != NO_REPEATS
            fell = []
            ms, tps, n = _ours(d, ids, 64, i, fell)
            rows[k].append((ms, tps, fell[0]["fell_back_after_step"], fell[0]["repeat_steps"]))
    out[ds] = rows
    pl = [r[0] for r in rows["plain"]]
    for k, r in rows.items():
        ratio = [a[0] / b for a, b in zip(r, pl)]
        print(f"{ds:5} {k:27} median {statistics.median(a[0] for a in r):6.1f} ms/token, "
              f"{statistics.fmean(a[1] for a in r):.2f} tokens/step, /plain median {statistics.median(ratio):.2f} "
              f"({min(ratio):.2f}-{max(ratio):.2f}), fell back on {sum(a[2] is not None for a in r)}/{len(r)}, "
              f"{sum(a[3] for a in r)} repeat steps", flush=True)
write_result(args.json, "scripts/fallback_ab.py", {
    "threads": torch.get_num_threads(), "plan": plan.best.label(), "ran": cand.label(),
    "predicted_ms_per_token": cand.seconds_per_token * 1e3,
    "break_even": even, "fallback": priced.fallback and dataclasses.asdict(priced.fallback),
    "rows": {ds: {k: [{"ms_per_token": a[0], "tokens_per_step": a[1], "fell_back_after": a[2], "repeat_steps": a[3]}
                      for a in r] for k, r in rows.items()} for ds, rows in out.items()}})
