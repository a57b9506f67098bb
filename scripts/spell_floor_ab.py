"""A spell of the memory's bandwidth without a profile of its own (``planning.spell_pricing.floor_priced``): in a
slow spell, plain decoding and ``auto``'s plan priced three ways, each run interleaved per prompt with plain decoding
at int4 (the app's default prompt in its chat template, then ``--prompts`` eval prompts of wiki / news / code, 128
prompt tokens, 64 new tokens, T = 0):

* ``own``: this machine's stored profile of the spell the first probe found (``plan_auto(measure=False)``);
* ``raw``: the profile ``PROFILE`` (a faster spell's, e.g. ``machine-<key>@56GBs.json``) as it is;
* ``floor``: ``PROFILE`` floor-priced at the probe taken before each prompt, as the app prices a Run.

A prompt waits (up to 90 s) for a probe under ``--slow`` GB/s; the summary keeps the prompts whose probes before and
after all rows stayed under it. Per plan: measured / predicted ms/token, plain decoding measured / its price.

    .venv/bin/python scripts/spell_floor_ab.py PROFILE [--prompts 5] [--slow 45] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("profile", type=Path, help="another spell's stored profile of this machine and pair")
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--slow", type=float, default=45.0, help="GB/s under which a probe is the slow spell")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from dyntree_core.__main__ import encode_prompt
    from dyntree_core.bench.result_file import write_result
    from dyntree_core.bench.speed import _ours
    from dyntree_core.config import DecodeConfig
    from dyntree_core.decode.engine import SpeculativeDecoder
    from dyntree_core.planning.auto import choose, plan_auto
    from dyntree_core.planning.machine_profile import MachineProfile
    from dyntree_core.planning.pair_cache import PairCache
    from dyntree_core.planning.profiling import run_probe
    from dyntree_core.planning.spell_pricing import floor_priced
    from dyntree_core.prompts import load_prompts
    from ui.layout import AppDefaults

    models = PairCache("embedded", "embedded", keep=2)
    first = run_probe()
    own = plan_auto(models, 0.0, measure=False, read_gb_per_s=first)
    other = MachineProfile.load(args.profile)

    def plan_for(profile: MachineProfile):
        return choose(profile, own.acceptance, 0.0, ["int4"], ["int4"])

    raw = plan_for(other)
    pair = models.pair("int4", "int4")
    tok, eos = pair.tokenizer, list(pair.eos_token_ids or ())
    sets = {"default": [AppDefaults().prompt]}
    sets.update({ds: [p.text for p in load_prompts(ds, args.prompts)] for ds in ("wiki", "news", "code")})
    rows = []
    for ds, texts in sets.items():
        for i, text in enumerate(texts):
            ids = (encode_prompt(tok, text, chat=True) if ds == "default"
                   else list(tok(text, add_special_tokens=False)["input_ids"])[:128])
            now, t0 = run_probe() or first, time.time()
            while now >= args.slow and time.time() - t0 < 90:
                time.sleep(3)
                now = run_probe() or now
            if now >= args.slow:
                print(f"{ds} {i}: skipped (the memory read {now} GB/s for 90 s)", flush=True)
                continue
            plans = {"own": own, "raw": raw, "floor": plan_for(floor_priced(other, now, models.forward_bytes))}
            decs = {"plain": DecodeConfig(method="autoregressive", precision="int4")}
            decs.update({k: p.apply(DecodeConfig(temperature=0.0), p.best) for k, p in plans.items()})
            rec = {"set": ds, "i": i, "probe_before": now,
                   "priced": {k: {"plan": p.best.label(), "predicted_ms": p.best.seconds_per_token * 1e3,
                                  "plain_price_ms": p.best_autoregressive.seconds_per_token * 1e3}
                              for k, p in plans.items()}}
            for k, c in decs.items():
                fell: list = []
                ms, tps, _ = _ours(SpeculativeDecoder(pair.draft, pair.target, c, eos_token_id=eos), ids, 64, i, fell)
                rec[k] = {"ms": ms, "tokens_per_step": tps, "fell_back_after": fell[0]["fell_back_after_step"]}
            rec["probe_after"] = run_probe()
            rows.append(rec)
            print(ds, i, now, rec["probe_after"], {k: round(rec[k]["ms"], 1) for k in decs}, flush=True)
    slow = [r for r in rows if r["probe_after"] and r["probe_after"] < args.slow]
    summary = {"prompts_in_the_slow_spell": len(slow)}
    for k in ("own", "raw", "floor"):
        r = [x[k]["ms"] / x["priced"][k]["predicted_ms"] for x in slow]
        rp = [x["plain"]["ms"] / x["priced"][k]["plain_price_ms"] for x in slow]
        summary[k] = {"plans": sorted({x["priced"][k]["plan"] for x in slow}),
                      "measured_over_predicted_median": statistics.median(r) if r else None,
                      "plain_measured_over_its_price_median": statistics.median(rp) if rp else None,
                      "over_plain_median": statistics.median(x[k]["ms"] / x["plain"]["ms"] for x in slow) if slow else None,
                      "ratios": [round(v, 3) for v in r], "plain_ratios": [round(v, 3) for v in rp]}
        print(k, json.dumps(summary[k]), flush=True)
    if args.json:
        write_result(args.json, "scripts/spell_floor_ab.py", {
            "first_probe": first, "own_profile_gb_per_s": own.profile.read_gb_per_s,
            "other_profile_gb_per_s": other.read_gb_per_s, "summary": summary, "rows": rows})


if __name__ == "__main__":
    main()
