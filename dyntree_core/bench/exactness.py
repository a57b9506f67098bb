"""Greedy exactness and speed check on a real pair: every method's T=0 output must be
token-identical to plain target greedy decoding; tokens/s and tokens/step are reported
side by side for each dtype / precision, all in one run. int8/int4 (weight-only kernels) may round
differently for a batched tree forward than for one token, so for them the bench reports how
often and where outputs diverge instead of failing (float32/bfloat16 must be identical), and at each
first divergence how close the target's two candidates were (``at_divergence``: their logits from one
forward of the target over the prompt and the common prefix; a near-tie is a gap of a few hundredths).
``DYNTREE_KERNELS`` (``quant.kernel_table``) picks the int4/int8 CPU kernels; the JSON names it.

    python -m dyntree_core.bench exactness --pair embedded --dtypes float32 bfloat16 \
        --methods chain dyspec_greedy ... --prompts 3 --new-tokens 64 --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from ..config import METHODS, DecodeConfig
from ..machine import machine_info
from ..quant.kernel_table import kernel_policy

TREE_METHODS = tuple(m for m in METHODS if m != "autoregressive")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dyntree_core.bench exactness")
    p.add_argument("--pair", default="embedded")
    p.add_argument("--methods", nargs="+", default=list(TREE_METHODS), choices=TREE_METHODS)
    p.add_argument("--dtypes", nargs="+", default=["float32"],
                   choices=("float32", "bfloat16", "float16", "int8", "int4"),
                   help="precisions (both models); int8/int4 report divergence instead of failing")
    p.add_argument("--datasets", nargs="+", default=["wiki", "code", "news"])
    p.add_argument("--prompts", type=int, default=3, help="prompts in total (cycled over datasets)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--depth", type=int, default=4, help="chain length k / depth cap")
    p.add_argument("--tree-depth", type=int, default=8, help="depth cap of the tree methods")
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", type=Path, default=None)
    return p


def divergence_gap(model, prompt: list[int], reference: list[int], out: list[int], i: int) -> dict:
    """At the first divergence ``i`` (plain decoding chose ``reference[i]``, the method ``out[i]``):
    the target's logits of both tokens and of its top two after ``prompt + reference[:i]``, from
    one forward over that text (its rounding may differ from the step that chose them)."""
    with torch.inference_mode():
        x = torch.tensor([prompt + reference[:i]], device=next(model.parameters()).device)
        logits = model(x).logits[0, -1].float()
    top2 = torch.topk(logits, 2).values
    a, b = reference[i], out[i]
    return {"position": i, "plain_token": a, "method_token": b, "logit_plain": float(logits[a]),
            "logit_method": float(logits[b]), "gap": float(logits[a] - logits[b]),
            "top2_gap": float(top2[0] - top2[1])}


def main(argv: Optional[list[str]] = None) -> int:
    from ..models import load_pair
    from ..decode.engine import SpeculativeDecoder
    from ..prompts import load_prompts

    args = build_parser().parse_args(argv)
    per_ds = -(-args.prompts // len(args.datasets))
    prompts = []
    for ds in args.datasets:
        prompts += [(ds, p) for p in load_prompts(ds, per_ds, split="eval")]
    prompts = prompts[: args.prompts]
    rows = []
    all_identical = True
    for dtype in args.dtypes:
        quant = dtype in ("int8", "int4")
        pair = load_pair(args.pair, args.pair, dtype="float32" if quant else dtype, device=args.device,
                         precision=dtype)
        ids = [(ds, p.id, list(pair.tokenizer(p.text, add_special_tokens=False)["input_ids"])[: args.prompt_tokens]) for ds, p in prompts]
        eos = list(pair.eos_token_ids) if getattr(pair, "eos_token_ids", None) else None
        reference: dict[str, list[int]] = {}
        for method in ("autoregressive", *args.methods):
            depth = args.depth if method in ("chain", "autoregressive") else args.tree_depth
            cfg = DecodeConfig(method=method, budget=args.budget, depth=depth, width=args.width,
                               dtype="float32" if quant else dtype, device=args.device, trace_block_counts=False)
            dec = SpeculativeDecoder(pair.draft, pair.target, cfg, eos_token_id=eos)
            for ds, pid, prompt in ids:
                out: list[int] = []
                t0 = time.perf_counter()
                res = {"steps": 0}
                for tr in dec.generate(prompt, args.new_tokens):
                    out.extend(c.token_id for c in tr.committed)
                    res["steps"] += 1
                seconds = time.perf_counter() - t0
                if method == "autoregressive":
                    reference[pid] = out
                identical = out == reference[pid]
                ref = reference[pid]
                first_div = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b),
                                 None if len(out) == len(ref) else min(len(out), len(ref)))
                if not quant:
                    all_identical &= identical
                gap = (divergence_gap(pair.target, prompt, ref, out, first_div)
                       if first_div is not None and first_div < min(len(out), len(ref)) else None)
                rows.append({
                    "dtype": dtype, "method": method, "dataset": ds, "prompt_id": pid, "new_tokens": len(out),
                    "steps": res["steps"], "tokens_per_step": len(out) / max(1, res["steps"]),
                    "seconds": seconds, "tokens_per_s": len(out) / seconds, "identical_to_ar": identical,
                    "first_divergence": first_div, "at_divergence": gap,
                })
                print(f"{dtype:9} {method:17} {pid:14} tokens={len(out):3d} steps={res['steps']:3d} "
                      f"tok/step={rows[-1]['tokens_per_step']:.2f} tok/s={rows[-1]['tokens_per_s']:.2f} "
                      f"identical={identical}" + (f" gap={gap['gap']:.4f} (top-2 {gap['top2_gap']:.4f})" if gap else ""),
                      file=sys.stderr, flush=True)
        del pair
    summary = []
    for dtype in args.dtypes:
        for method in ("autoregressive", *args.methods):
            rs = [r for r in rows if r["dtype"] == dtype and r["method"] == method]
            summary.append({
                "dtype": dtype, "method": method,
                "identical": all(r["identical_to_ar"] for r in rs),
                "identical_prompts": sum(r["identical_to_ar"] for r in rs), "prompts": len(rs),
                "first_divergences": [r["first_divergence"] for r in rs],
                "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                "mean_tokens_per_step": statistics.fmean(r["tokens_per_step"] for r in rs),
            })
    ar = {s["dtype"]: s["median_tokens_per_s"] for s in summary if s["method"] == "autoregressive"}
    print(f"\n{'dtype':9} {'method':17} {'identical':>9} {'tok/s':>7} {'speedup':>7} {'tok/step':>8}  first divergence")
    for s in summary:
        print(f"{s['dtype']:9} {s['method']:17} {s['identical_prompts']:>4}/{s['prompts']:<4} {s['median_tokens_per_s']:7.2f} "
              f"{s['median_tokens_per_s'] / ar[s['dtype']]:7.2f} {s['mean_tokens_per_step']:8.2f}  {s['first_divergences']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.platform(), "processor": platform.processor(),
            "threads": torch.get_num_threads(), "machine_info": machine_info().to_dict(),
            "kernel_policy": kernel_policy(),
            "args": {k: str(v) for k, v in vars(args).items()},
            "all_identical": all_identical, "summary": summary, "runs": rows}, indent=1))
    return 0 if all_identical else 1


if __name__ == "__main__":
    sys.exit(main())
