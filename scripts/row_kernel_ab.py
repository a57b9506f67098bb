"""The int8-activation row kernels of one GGML weight shape on AVX2 against AVX-512 VNNI (``vnni_min_rows`` 0 vs 1,
bit-identical outputs), with the weights read from DRAM: each timed pass runs over copies of the weight that
together exceed the caches, and the two paths alternate pass by pass in one process, so that both see the same
spells of a machine whose memory bandwidth drifts. Prints per shape and row count the medians (ms per product
and GB/s of blocks) and the median of the per-round ratios VNNI / AVX2.

    .venv/bin/python scripts/row_kernel_ab.py Q5_0:4864:896 Q5_0:896:896 [--rows 1 2 4] [--rounds 9] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dyntree_core.machine import machine_info  # noqa: E402
from dyntree_core.quant import native  # noqa: E402

CACHE_BYTES = 96e6  # copies of a weight whose sum exceeds this come from DRAM (L3 here: 32 MiB)


def one_pass(nk: native.NativeKernels, spec: tuple[str, int, int], copies: list[torch.Tensor], x: torch.Tensor,
             vnni_rows: int) -> float:
    t, n, k = spec
    times = []
    for w in copies:
        start = time.perf_counter()
        nk.matmul(t, x, w, n, k, None, True, vnni_min_rows=vnni_rows)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shapes", nargs="+", help="TYPE:N:K, e.g. Q5_0:4864:896")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    nk = native.native_kernels()
    if nk is None or not nk.vnni:
        sys.exit(f"needs the VNNI row kernels: {nk.vnni_reason if nk else native.native_unavailable_reason()}")
    results = []
    with torch.inference_mode():
        for spec in args.shapes:
            t, n, k = spec.split(":")
            shape = (t, int(n), int(k))
            first = native.synthetic_blocks(t, int(n), int(k), seed=0)
            copies = [first] + [native.synthetic_blocks(t, int(n), int(k), seed=i)
                                for i in range(1, max(1, int(CACHE_BYTES // first.numel())))]
            for m in args.rows:
                x = torch.randn(m, int(k), generator=torch.Generator().manual_seed(m))
                avx2, vnni = [], []
                for _ in range(args.rounds):
                    avx2.append(one_pass(nk, shape, copies, x, 0))
                    vnni.append(one_pass(nk, shape, copies, x, 1))
                gb = first.numel() / 1e9
                row = {"type": t, "n": int(n), "k": int(k), "rows": m, "copies": len(copies),
                       "avx2_ms": statistics.median(avx2) * 1e3, "vnni_ms": statistics.median(vnni) * 1e3,
                       "avx2_gb_per_s": gb / statistics.median(avx2), "vnni_gb_per_s": gb / statistics.median(vnni),
                       "median_ratio_vnni_over_avx2": statistics.median(b / a for a, b in zip(avx2, vnni))}
                results.append(row)
                print(f"{t} [{n}, {k}] {m} rows: AVX2 {row['avx2_ms']:.3f} ms ({row['avx2_gb_per_s']:.1f} GB/s), "
                      f"VNNI {row['vnni_ms']:.3f} ms ({row['vnni_gb_per_s']:.1f} GB/s), VNNI / AVX2 "
                      f"{row['median_ratio_vnni_over_avx2']:.3f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"script": "scripts/row_kernel_ab.py", "argv": sys.argv[1:],
                                         "machine_info": machine_info().to_dict(), "rounds": args.rounds,
                                         "results": results}, indent=1))


if __name__ == "__main__":
    main()
