"""t(n) of the embedded target (or ``--role draft``: its draft) at int4 (the kernel table's choices) from this tree and from another commit,
alternated one process at a time, so that both sides see the same spells of a machine whose speed drifts; or, with
``--kernels``, this tree under each ``DYNTREE_KERNELS`` policy named (e.g. ``native_q8 native_x8 table``: the AVX2
row kernels, the AVX2 x8 tiles and the table's choice on one machine), ratios against the first.

    .venv/bin/python scripts/forward_ab.py --base HEAD~1 [--role target|draft] [--rounds 3] [--ns 1 4 8 16 32 64]
        [--json OUT]
    .venv/bin/python scripts/forward_ab.py --kernels native_q8 native_x8 table [--rounds 3] [--json OUT]

Each side runs in its own process from its own source tree (the base from a temporary ``git worktree``), so
each loads its own kernels (built or cached under their digest) and its own kernel table. Prints t(n) per round
and the per-round ratios this / base with their medians; ``--json`` writes all of it with the machine's facts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, os, sys, torch
os.environ.setdefault("DYNTREE_KERNELS", "table")
from dyntree_core.models.load import load_model, resolve_spec
from dyntree_core.planning.forward_timer import ForwardTimer
role, ns = sys.argv[1], [int(a) for a in sys.argv[2:]]
model = load_model(resolve_spec("embedded", role), precision="int4")
with torch.inference_mode():
    timer = ForwardTimer(model, 128, max(ns))
    timer.once(1)
    print(json.dumps({str(n): timer.best(n, 5 if n <= 8 else 3) * 1e3 for n in ns}))
"""


def run_side(tree: Path, role: str, ns: list[int], policy: str = "table") -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree), "DYNTREE_KERNELS": policy}
    out = subprocess.run([sys.executable, "-c", CHILD, role, *map(str, ns)], cwd=tree, env=env, capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    side = ap.add_mutually_exclusive_group(required=True)
    side.add_argument("--base", help="the commit to compare against")
    side.add_argument("--kernels", nargs="+", help="DYNTREE_KERNELS policies to compare on this tree")
    ap.add_argument("--role", choices=("target", "draft"), default="target", help="which model of the pair")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from dyntree_core.bench.result_file import write_result
    from dyntree_core.bench.worktree import base_worktree

    if args.kernels:
        compare_policies(args)
        return

    base_rev = subprocess.run(["git", "rev-parse", args.base], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    head_rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout.strip())
    rounds = []
    with base_worktree(ROOT, base_rev) as wt:
        for r in range(args.rounds):
            base = run_side(wt, args.role, args.ns)
            this = run_side(ROOT, args.role, args.ns)
            rounds.append({"base": base, "this": this})
            print(f"round {r + 1}: " + "  ".join(f"t({n}) {base[str(n)]:.1f} -> {this[str(n)]:.1f}"
                                                 for n in args.ns), flush=True)
    ratios = {str(n): statistics.median(x["this"][str(n)] / x["base"][str(n)] for x in rounds) for n in args.ns}
    medians = {side: {str(n): statistics.median(x[side][str(n)] for x in rounds) for n in args.ns}
               for side in ("base", "this")}
    print("median ratio this / base: " + "  ".join(f"t({n}) {v:.2f}" for n, v in ratios.items()))
    for side in ("base", "this"):
        m = medians[side]
        print(f"{side} medians: " + "  ".join(f"t({n}) {v:.1f}" for n, v in m.items())
              + (f"  t({max(args.ns)})/t(1) {m[str(max(args.ns))] / m['1']:.1f}" if "1" in m else ""))
    if args.json:
        write_result(args.json, "scripts/forward_ab.py", {
            "base": base_rev, "this": head_rev, "this_uncommitted_changes": dirty, "rounds": rounds,
            "median_ms": medians, "median_ratio_this_over_base": ratios}, default=str)


def compare_policies(args: argparse.Namespace) -> None:
    """Each round runs every policy in turn (one process each); medians per policy and of the per-round ratios
    against the first policy."""
    from dyntree_core.bench.result_file import write_result

    rounds = []
    for r in range(args.rounds):
        got = {policy: run_side(ROOT, args.role, args.ns, policy) for policy in args.kernels}
        rounds.append(got)
        print(f"round {r + 1}: " + " | ".join(f"{p}: " + " ".join(f"t({n}) {t[str(n)]:.1f}" for n in args.ns)
                                                for p, t in got.items()), flush=True)
    first = args.kernels[0]
    medians = {p: {str(n): statistics.median(x[p][str(n)] for x in rounds) for n in args.ns} for p in args.kernels}
    ratios = {p: {str(n): statistics.median(x[p][str(n)] / x[first][str(n)] for x in rounds) for n in args.ns}
              for p in args.kernels[1:]}
    for p, m in medians.items():
        print(f"{p} medians: " + "  ".join(f"t({n}) {v:.1f}" for n, v in m.items())
              + (f"  t({max(args.ns)})/t(1) {m[str(max(args.ns))] / m['1']:.1f}" if "1" in m else ""))
    for p, q in ratios.items():
        print(f"median ratio {p} / {first}: " + "  ".join(f"t({n}) {v:.2f}" for n, v in q.items()))
    if args.json:
        write_result(args.json, "scripts/forward_ab.py", {
            "rounds": rounds, "median_ms": medians, f"median_ratio_over_{first}": ratios}, default=str)


if __name__ == "__main__":
    main()
