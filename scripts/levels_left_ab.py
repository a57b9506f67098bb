"""A run's last steps drafting only the levels it can commit (``SpeculativeDecoder.cap_levels``, ``Drafter.depth``),
on against off, interleaved per prompt (the order alternating) in one process: `auto`'s plan at T = 0, or the method
named with auto's shape (``--method``), 10 eval prompts of wiki / news / code, 128 prompt tokens, 64 new tokens. Per
row: ms/token (the steps' own seconds, as ``bench speed``), the draft forwards and target rows of the run, and whether
the tokens are identical (they must be at T = 0: a tree's shape never changes the greedy text).

    .venv/bin/python scripts/levels_left_ab.py [--method chain] [--depth 12 --no-stop] [--prompts 10] [--json OUT]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="auto", help="auto's choice, or the method auto priced best of that kind")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, help="this depth instead of the plan's")
    ap.add_argument("--no-stop", action="store_true", help="no confidence stop (every step drafts the whole depth)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from dyntree_core.bench.result_file import write_result
    from dyntree_core.config import DecodeConfig
    from dyntree_core.decode.engine import SpeculativeDecoder
    from dyntree_core.planning.auto import plan_auto
    from dyntree_core.planning.pair_cache import PairCache
    from dyntree_core.prompts import load_prompts

    models = PairCache("embedded", "embedded", keep=2)
    plan = plan_auto(models, 0.0)
    cand = plan.best if args.method == "auto" else plan.best_of(args.method)
    pair = models.pair(cand.target_precision, cand.draft_precision)
    tok, eos = pair.tokenizer, list(pair.eos_token_ids or ())
    cfg = plan.apply(DecodeConfig(temperature=0.0), cand)
    if args.depth is not None:
        cfg = dataclasses.replace(cfg, depth=args.depth, budget=max(cfg.budget, args.depth + 1))
    if args.no_stop:
        cfg = dataclasses.replace(cfg, stop_confidence=None)
    ran = f"{cand.label()}" + (f", depth {cfg.depth}" if args.depth is not None else "") + (
        ", no confidence stop" if args.no_stop else "")
    print("running", ran, flush=True)

    def one(ids: list[int], cap: bool, seed: int) -> dict:
        dec = SpeculativeDecoder(pair.draft, pair.target, cfg, eos_token_id=eos)
        dec.cap_levels = cap
        seconds, tokens, forwards, rows = 0.0, [], 0, 0
        for tr in dec.generate(ids, args.new_tokens, seed=seed):
            seconds += tr.step_seconds
            tokens += [c.token_id for c in tr.committed]
            forwards += tr.draft_forwards or 0
            rows += tr.tree_size
        return {"ms_per_token": 1e3 * seconds / max(len(tokens), 1), "draft_forwards": forwards, "target_rows": rows,
                "tokens": tokens}

    out: dict = {}
    for ds in ("wiki", "news", "code"):
        rows = []
        for i, p in enumerate(load_prompts(ds, args.prompts)):
            ids = list(tok(p.text, add_special_tokens=False)["input_ids"])[:128]
            order = (True, False) if i % 2 == 0 else (False, True)
            got = {cap: one(ids, cap, i) for cap in order}
            on, off = got[True], got[False]
            rows.append({"ratio": on["ms_per_token"] / off["ms_per_token"], "identical": on["tokens"] == off["tokens"],
                         **{f"{k}_{name}": r[k] for name, r in (("on", on), ("off", off))
                            for k in ("ms_per_token", "draft_forwards", "target_rows")}})
        ratios = [r["ratio"] for r in rows]
        out[ds] = {"rows": rows, "median_ratio": statistics.median(ratios),
                   "draft_forwards": [sum(r["draft_forwards_on"] for r in rows), sum(r["draft_forwards_off"] for r in rows)],
                   "target_rows": [sum(r["target_rows_on"] for r in rows), sum(r["target_rows_off"] for r in rows)],
                   "identical": sum(r["identical"] for r in rows)}
        print(f"{ds:5} on/off median {out[ds]['median_ratio']:.3f} ({min(ratios):.3f}-{max(ratios):.3f}); draft forwards "
              f"{out[ds]['draft_forwards'][0]} vs {out[ds]['draft_forwards'][1]}, target rows {out[ds]['target_rows'][0]} "
              f"vs {out[ds]['target_rows'][1]}; identical tokens {out[ds]['identical']}/{len(rows)}", flush=True)
    if args.json:
        write_result(args.json, "scripts/levels_left_ab.py", {"ran": ran, "sets": out})


if __name__ == "__main__":
    main()
