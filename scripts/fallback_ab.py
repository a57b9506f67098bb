"""`auto` with and without its fallback to plain decoding (``DecodeConfig.fallback_below``) and plain decoding at
auto's target precision, interleaved per prompt in one process (10 eval prompts of wiki / news / code, 128 prompt
tokens, 64 new tokens, T = 0), so that the machine's drift between rows cancels in the per-prompt ratios.

    .venv/bin/python scripts/fallback_ab.py [--json bench/results/fallback_ab_<machine>.json]
"""
import argparse, dataclasses, json, statistics, time
from pathlib import Path

import torch
from dyntree_core.planning.auto import plan_auto
from dyntree_core.planning.pair_cache import PairCache
from dyntree_core.config import DecodeConfig
from dyntree_core.decode.engine import SpeculativeDecoder
from dyntree_core.prompts import load_prompts
from dyntree_core.bench.speed import _ours
from dyntree_core.machine import machine_info

ap = argparse.ArgumentParser()
ap.add_argument("--json", type=Path, default=Path("bench/results") / f"fallback_ab_{machine_info().short_label()}.json")
args = ap.parse_args()
models = PairCache("embedded", "embedded", keep=2)
plan = plan_auto(models, 0.0)
pair = models.pair(plan.best.target_precision, plan.best.draft_precision)
tok, eos = pair.tokenizer, list(pair.eos_token_ids or ())
fb = plan.apply(DecodeConfig(temperature=0.0))
nofb = dataclasses.replace(fb, fallback_below=None)
ar = DecodeConfig(method="autoregressive", precision=fb.precision)
decs = {"plain": ar, "auto+fallback": fb, "auto, no fallback": nofb}
print(plan.best.label(), "break-even", fb.fallback_below, flush=True)
out = {}
for ds in ("wiki", "news", "code"):
    rows = {k: [] for k in decs}
    for i, p in enumerate(load_prompts(ds, 10)):
        ids = list(tok(p.text, add_special_tokens=False)["input_ids"])[:128]
        for k, c in decs.items():
            d = SpeculativeDecoder(pair.draft, pair.target, c, eos_token_id=eos)
            fell = []
            ms, tps, n = _ours(d, ids, 64, i, fell)
            rows[k].append((ms, tps, fell[0]["fell_back_after_step"]))
    out[ds] = rows
    pl = [r[0] for r in rows["plain"]]
    for k, r in rows.items():
        ratio = [a[0] / b for a, b in zip(r, pl)]
        print(f"{ds:5} {k:18} median {statistics.median(a[0] for a in r):6.1f} ms/token, "
              f"{statistics.fmean(a[1] for a in r):.2f} tokens/step, /plain median {statistics.median(ratio):.2f} "
              f"({min(ratio):.2f}-{max(ratio):.2f}), fell back on {sum(a[2] is not None for a in r)}/10", flush=True)
args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine_info": machine_info().to_dict(),
                                 "threads": torch.get_num_threads(), "plan": plan.best.label(),
                                 "break_even": fb.fallback_below,
                                 "rows": {ds: {k: [{"ms_per_token": a[0], "tokens_per_step": a[1], "fell_back_after": a[2]}
                                                   for a in r] for k, r in rows.items()} for ds, rows in out.items()}},
                                indent=1))
