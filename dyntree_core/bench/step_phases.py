"""Where a decoding step's time goes outside the two models' forwards, by tree budget.

    python -m dyntree_core.bench step-phases [--pair embedded] [--method dyspec_greedy]
        [--budgets 64 256 768] [--depth 8] [--temperatures 0 0.6] [--steps 3] [--prompts 2]
        [--precision int4] [--draft-precision int4] [--device-side | --graph-steps] [--count-ops]
        [--json out.json]

For each budget and temperature, ``--steps`` steps after a 128-token prompt of each of ``--prompts``
wiki/code prompts; per phase (draft forwards, tree build, mask, target forward, verify, KV compaction)
the mean and the median seconds per step, and the time spent outside the two forwards (tree build,
order and mask, verification including forming the target distributions, KV compaction, trace):
its mean share of the step and its median per step. ``--device-side`` runs greedy dyspec_greedy /
chain steps on device tensors through the HF forward (``SpeculativeDecoder.device_side``);
``--graph-steps`` runs steps as fixed-shape programs (``decode.graph_step``; the default on CUDA).

``--count-ops`` adds, per phase, the median per step of the torch ops dispatched eagerly, the
compiled-graph calls and the device -> host reads (``decode.op_count``), counted in separate runs of
the same steps (the counter slows the step down): what a step launches, measured on any device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Optional

from ..config import METHODS, DecodeConfig, default_threshold

PHASES = ("draft", "tree_build", "mask", "target_forward", "verify", "kv_compaction")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dyntree_core.bench step-phases")
    p.add_argument("--pair", default="embedded", help="'embedded', 'tiny' or draft_spec,target_spec")
    p.add_argument("--method", default="dyspec_greedy", choices=[m for m in METHODS if m != "autoregressive"])
    p.add_argument("--budgets", nargs="+", type=int, default=[64, 256, 768])
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 0.6])
    p.add_argument("--steps", type=int, default=3, help="steps per prompt")
    p.add_argument("--prompts", type=int, default=2, help="prompts (alternately wiki and code, eval split)")
    p.add_argument("--node-orders", nargs="+", default=["dfs"], choices=["dfs", "hpd", "bfs"],
                   help="node orders of the target's tree forward (DecodeConfig.node_order)")
    p.add_argument("--precision", default="int4")
    p.add_argument("--draft-precision", default=None)
    p.add_argument("--device", default="cpu")
    side = p.add_mutually_exclusive_group()
    side.add_argument("--device-side", action="store_true",
                      help="draft greedy dyspec_greedy/chain steps on device tensors through the HF forward")
    side.add_argument("--graph-steps", action="store_true",
                      help="steps as fixed-shape programs (decode.graph_step; the default on CUDA)")
    p.add_argument("--count-ops", action="store_true",
                   help="also count ops, graph calls and host reads per phase (decode.op_count)")
    p.add_argument("--json", type=Path, default=None)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    from ..decode.engine import SpeculativeDecoder
    from ..machine import machine_info
    from ..prompts import load_prompts
    from .decoding import _encode
    from .exact_acceptance import _load

    args = build_parser().parse_args(argv)
    pair = _load(args)
    texts = [p for pair_ in zip(load_prompts("wiki", args.prompts), load_prompts("code", args.prompts)) for p in pair_]
    texts = texts[: args.prompts]
    rows = []
    for temp, budget, order in ((t, b, o) for t in args.temperatures for b in args.budgets for o in args.node_orders):
        cfg = DecodeConfig(method=args.method, temperature=temp, budget=budget, depth=args.depth,
                           threshold=default_threshold(budget), device=args.device, trace_block_counts=False,
                           node_order=order)
        dec = SpeculativeDecoder(pair.draft, pair.target, cfg)
        dec.device_side = bool(args.device_side)
        dec.graph_steps = bool(args.graph_steps) or (dec.graph_steps and not args.device_side)
        prompts = [_encode(pair.tokenizer, prompt.text, 128) for prompt in texts]
        sums = {p: [] for p in PHASES}
        step_s: list[float] = []
        sizes: list[int] = []
        for i, ids in enumerate(prompts):
            for tr in dec.generate(ids, 10**6, seed=i):
                for p in PHASES:
                    sums[p].append(getattr(tr.timings, p))
                step_s.append(tr.step_seconds)
                sizes.append(tr.tree_size)
                if tr.step + 1 >= args.steps:
                    break
        step = statistics.fmean(step_s)
        phases = {p: statistics.fmean(v) for p, v in sums.items()}
        outside = step - phases["draft"] - phases["target_forward"]
        outside_each = [s - d - t for s, d, t in zip(step_s, sums["draft"], sums["target_forward"])]
        row = {"temperature": temp, "budget": budget, "node_order": order, "mean_tree_size": statistics.fmean(sizes), "steps": len(step_s),
               "step_seconds": step, "phases": phases, "outside_forwards_seconds": outside,
               "outside_share": outside / step, "step_seconds_median": statistics.median(step_s),
               "phases_median": {p: statistics.median(v) for p, v in sums.items()},
               "outside_forwards_seconds_median": statistics.median(outside_each)}
        row["graph_reason"] = dec.graph_reason()
        if args.count_ops:
            row["ops"], row["draft_graphs_and_depth"] = count_ops(dec, prompts, args.steps)
        rows.append(row)
        print(f"T={temp:<4g} budget {budget:4d} {order} (tree {row['mean_tree_size']:6.1f}): step {step:7.3f} s, "
              + ", ".join(f"{p} {v:.3f}" for p, v in phases.items())
              + f"; outside the forwards {outside:.3f} s = {100 * outside / step:.1f}%"
              + f"; medians: step {row['step_seconds_median']:.4f} s, outside {row['outside_forwards_seconds_median']:.4f} s",
              flush=True)
        if args.count_ops:
            levels = [g for g, _ in row["draft_graphs_and_depth"]]
            if any(levels):
                print(f"  draft graphs per step: {dict(sorted(Counter(levels).items()))} (tree depth per step: "
                      f"{dict(sorted(Counter(d for _, d in row['draft_graphs_and_depth']).items()))})", flush=True)
            print("  per step (median): " + "; ".join(
                f"{p} {c['ops']:g} ops {c['graphs']:g} graphs {c['host_reads']:g} reads"
                + (f" ({_bytes(c['read_bytes'])})" if c.get("read_bytes") else "")
                + (f" {c['flag_reads']:g} flag reads" if c.get("flag_reads") else "")
                + (f" ({c['graph_kernels']:g} CUDA kernels inside the graphs)" if c.get("graph_kernels") else "")
                for p, c in row["ops"].items()) + f"  [graph steps: {row['graph_reason'] or 'on'}]", flush=True)
    record = {"bench": "step-phases", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": argv or sys.argv[1:],
              "machine_info": machine_info().to_dict(), "pair": args.pair, "method": args.method,
              "precision": args.precision, "draft_precision": args.draft_precision or args.precision,
              "device_side": bool(args.device_side), "graph_steps": bool(args.graph_steps), "rows": rows}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1))
        print(f"wrote {args.json}")
    return 0


def count_ops(dec, prompts: list[list[int]], steps: int) -> tuple[dict[str, dict[str, float]], list[tuple[int, int]]]:
    """Per phase, the median over steps (the first step of each prompt left out: it also ends the
    prefill) of ops, graph calls, host reads, ops on host data, flag reads and the kernels inside the graphs
    (``decode.op_count.PhaseOps``);
    and per step (the same steps) the draft's graph calls and the tree's depth."""
    from ..decode.op_count import OpCounter, PhaseOps

    per_step: list[dict[str, PhaseOps]] = []
    trees = []
    with OpCounter() as counter:
        for i, ids in enumerate(prompts):
            for tr in dec.generate(ids, 10**6, seed=i):
                counts = counter.take_step()
                if tr.step > 0:
                    per_step.append(counts)
                    trees.append(tr.tree)
                if tr.step + 1 >= max(steps, 2):
                    break
    # (the trees' depths are read after counting: torch ops here would count as the next step's)
    levels = [(counts.get("draft", PhaseOps()).graphs, int(tree.depth.max()) if tree is not None else 0)
              for counts, tree in zip(per_step, trees)]
    phases = sorted({p for counts in per_step for p in counts}, key=lambda p: (p not in PHASES, PHASES.index(p)
                                                                                if p in PHASES else 0, p))
    out: dict[str, dict[str, float]] = {}
    for p in phases:
        got = [counts.get(p, PhaseOps()) for counts in per_step]
        out[p] = {f: statistics.median(getattr(c, f) for c in got) for f in ("ops", "graphs", "host_reads", "host_ops",
                                                                            "flag_reads", "graph_kernels",
                                                                            "read_bytes")}
    return out, levels


def _bytes(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB" if n >= 1e3 else f"{n:g} B"


if __name__ == "__main__":
    sys.exit(main())
