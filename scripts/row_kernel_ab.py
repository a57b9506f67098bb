"""Two int8-activation kernels of one GGML weight shape, with the weights read from DRAM: each timed pass runs over
copies of the weight that together exceed the caches, and the two alternate pass by pass in one process, so that
both see the same spells of a machine whose memory bandwidth drifts. ``--pair vnni`` (default): the row kernels on
AVX2 against AVX-512 VNNI (``vnni_min_rows`` 0 vs 1, bit-identical outputs); ``--pair x8``: the row kernels against
the x8 tiles (the rows repacked 8 at a time), both on VNNI where the CPU has it. Prints per shape and row count the
medians (ms per product and GB/s of blocks) and the median of the per-round ratios second / first.

    .venv/bin/python scripts/row_kernel_ab.py Q5_0:4864:896 Q5_0:896:896 [--pair vnni|x8] [--rows 1 2 4]
        [--rounds 9] [--json OUT]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dyntree_core.bench.result_file import write_result  # noqa: E402
from dyntree_core.quant import native  # noqa: E402

CACHE_BYTES = 96e6  # copies of a weight whose sum exceeds this come from DRAM (L3 here: 32 MiB)


def one_pass(nk: native.NativeKernels, spec: tuple[str, int, int], copies: list[torch.Tensor], x: torch.Tensor,
             vnni_rows: int, x8: bool) -> float:
    t, n, k = spec
    times = []
    for w in copies:
        start = time.perf_counter()
        nk.matmul(t, x, w, n, k, None, True, vnni_min_rows=vnni_rows, x8=x8)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shapes", nargs="+", help="TYPE:N:K, e.g. Q5_0:4864:896")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--pair", choices=("vnni", "x8"), default="vnni")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    nk = native.native_kernels()
    if nk is None or (args.pair == "vnni" and not nk.vnni):
        sys.exit(f"needs the VNNI row kernels: {nk.vnni_reason if nk else native.native_unavailable_reason()}")
    names = ("AVX2", "VNNI") if args.pair == "vnni" else ("rows", "x8")
    # (vnni_min_rows, x8) of the first and the second kernel
    sides = ((0, False), (1, False)) if args.pair == "vnni" else ((int(nk.vnni), False), (int(nk.vnni), True))
    results = []
    with torch.inference_mode():
        for spec in args.shapes:
            t, n, k = spec.split(":")
            shape = (t, int(n), int(k))
            first = native.synthetic_blocks(t, int(n), int(k), seed=0)
            copies = [first] + [native.synthetic_blocks(t, int(n), int(k), seed=i)
                                for i in range(1, max(1, int(CACHE_BYTES // first.numel())))]
            packed = [nk.repack_x8(t, w, int(n), int(k)) for w in copies] if args.pair == "x8" else copies
            for m in args.rows:
                x = torch.randn(m, int(k), generator=torch.Generator().manual_seed(m))
                times: tuple[list[float], list[float]] = ([], [])
                for _ in range(args.rounds):
                    for (vnni_rows, x8), ts in zip(sides, times):
                        ts.append(one_pass(nk, shape, packed if x8 else copies, x, vnni_rows, x8))
                gb = first.numel() / 1e9
                row = {"type": t, "n": int(n), "k": int(k), "rows": m, "copies": len(copies)}
                for name, ts in zip(names, times):
                    row[f"{name.lower()}_ms"] = statistics.median(ts) * 1e3
                    row[f"{name.lower()}_gb_per_s"] = gb / statistics.median(ts)
                ratio = f"median_ratio_{names[1].lower()}_over_{names[0].lower()}"
                row[ratio] = statistics.median(b / a for a, b in zip(*times))
                results.append(row)
                print(f"{t} [{n}, {k}] {m} rows: " + ", ".join(
                    f"{name} {row[f'{name.lower()}_ms']:.3f} ms ({row[f'{name.lower()}_gb_per_s']:.1f} GB/s)"
                    for name in names) + f", {names[1]} / {names[0]} {row[ratio]:.3f}", flush=True)
    if args.json:
        write_result(args.json, "scripts/row_kernel_ab.py", {"rounds": args.rounds, "pair": args.pair,
                                                             "results": results})


if __name__ == "__main__":
    main()
