"""The machine profile as ``auto`` measures it, and (``--real``) how well the zero-weight shape twins
it is timed on stand for the real models.

    python -m dyntree_core.bench profile [--pair embedded] [--precisions int8 int4 float32 bfloat16]
        [--real] [--json bench/results/profile_<cpu>.json]

Prints the wall time of the twin profile (what a first ``auto`` run pays) and, with ``--real``,
t(n) of the twin beside t(n) of the real model for every role, precision and size, with their ratio.
Nothing is written to the profile cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from ..planning.pair_cache import PairCache
from ..planning.search_space import default_precisions


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dyntree_core.bench profile")
    p.add_argument("--pair", default="embedded", help="'embedded' or draft_spec,target_spec")
    p.add_argument("--precisions", nargs="+", default=None, help="default: those auto prices on this device")
    p.add_argument("--device", default="cpu")
    p.add_argument("--real", action="store_true", help="also profile the real models and compare")
    p.add_argument("--json", type=Path, default=None)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    from ..machine import machine_info
    from ..planning.profiling import measure_profile

    args = build_parser().parse_args(argv)
    d, _, t = args.pair.partition(",")
    cache = PairCache(d or "embedded", t or d or "embedded", device=args.device)
    precs = list(args.precisions or default_precisions(args.device))
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    twin = measure_profile(cache.timing_model, precs, "twin", progress=say)
    twin_s = time.perf_counter() - t0
    record: dict = {"bench": "profile", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "machine_info": machine_info().to_dict(), "pair": args.pair, "precisions": precs,
                    "twin": asdict(twin), "twin_seconds": twin_s}
    print(f"\ntwin profile: {twin_s:.1f} s for {len(precs)} precisions x 2 models")
    if args.real:
        t0 = time.perf_counter()
        real = measure_profile(cache.model, precs, "real", progress=say)
        record["real_seconds"] = time.perf_counter() - t0
        record["real"] = asdict(real)
        ratios = []
        print(f"real profile: {record['real_seconds']:.1f} s\n")
        print("| model | precision | n | twin ms | real ms | twin/real |")
        print("|---|---|---|---|---|---|")
        for role in ("target", "draft"):
            for prec in precs:
                for n, a, b in zip(twin.ns, getattr(twin, role).get(prec, []), getattr(real, role).get(prec, [])):
                    if a is None or b is None:
                        continue
                    ratios.append(a / b)
                    print(f"| {role} | {prec} | {n} | {a * 1e3:.1f} | {b * 1e3:.1f} | {a / b:.2f} |")
        if ratios:
            record["twin_over_real"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
            print(f"\ntwin/real: median {statistics.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
