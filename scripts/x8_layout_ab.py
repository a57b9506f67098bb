"""The x8 layout of this tree against another commit's, alternated in one process: the other commit's kernels
(built from a temporary ``git worktree`` into the kernel cache) loaded beside this tree's, each multiplying the
same GGUF rows repacked into its own layout. Two measurements, both medians of the rounds with the per-round
ratios this / base:

- ``products``: x8 products of the target's shapes with their weights streamed from DRAM (several copies
  cycled so nothing stays in the L3), at the row counts asked;
- ``forward``: t(n) of the embedded target at int4 (the kernel table's choices), one loaded model whose x8 layers
  switch between the two kernels and layouts (the C decoder layers re-planned at each switch; blocks under 2
  MiB packed side by side in 2 MiB pages on both sides, as at load).

    .venv/bin/python scripts/x8_layout_ab.py --base HEAD~1 [--rounds 6] [--ns 1 4 16 32] [--tiles vnni|avx2]
        [--json OUT]

``--tiles avx2``: the AVX2 tiles (products without the VNNI kernels, the forward under ``DYNTREE_KERNELS=native_x8``),
a proxy on an AVX-512 CPU for an AVX2-only one.

Only for commits whose kernels keep this tree's C interface (the layout may differ).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DYNTREE_KERNELS", "table")

from dyntree_core.quant import native  # noqa: E402
from dyntree_core.bench.worktree import base_worktree  # noqa: E402

BASE_KERNELS = """
import json
from dyntree_core.quant import native
k = native.native_kernels()
print(json.dumps({"path": str(k.path), "digest": k.digest, "x8": native.X8}))
"""
#: the target's x8 shapes (N, K) per type, and how many copies cycle so the weights come from DRAM (L3: 32 MiB)
SHAPES = (("Q4_K", 8960, 1536, 12), ("Q4_K", 1536, 1536, 40), ("Q6_K", 1536, 8960, 12))


@contextlib.contextmanager
def layout(x8: dict) -> None:
    """``native.X8`` (the bytes per group and block that shapes and checks read) set to ``x8`` for the block."""
    saved = dict(native.X8)
    native.X8.update({k: tuple(v) for k, v in x8.items()})
    try:
        yield
    finally:
        native.X8.update(saved)


def base_kernels(rev: str) -> tuple[native.NativeKernels, dict]:
    with base_worktree(ROOT, rev) as wt:
        out = subprocess.run([sys.executable, "-c", BASE_KERNELS], cwd=wt, capture_output=True, text=True,
                             check=True, env={**os.environ, "PYTHONPATH": str(wt)}).stdout
    got = json.loads(out.strip().splitlines()[-1])
    x8 = {k: tuple(v) for k, v in got["x8"].items()}
    with layout(x8):
        return native._load(Path(got["path"]), got["digest"]), x8


def time_products(sides: dict, rows: list[int], rounds: int, vnni_min_rows: int = 1) -> dict:
    results: dict = {}
    for type_name, n, k, copies in SHAPES:
        ggml = [native.synthetic_blocks(type_name, n, k, seed=s) for s in range(copies)]
        packed = {}
        for label, (nk, x8) in sides.items():
            with layout(x8):
                packed[label] = [nk.repack_x8(type_name, g, n, k) for g in ggml]  # (2 MiB pages where one fills)
        for m in rows:
            x = torch.randn(m, k)
            got: dict[str, list[float]] = {label: [] for label in sides}
            for r in range(rounds):
                for label in ("base", "this") if r % 2 == 0 else ("this", "base"):
                    nk, x8 = sides[label]
                    with layout(x8):
                        times = []
                        for _pass in range(3):
                            for blocks in packed[label]:
                                t0 = time.perf_counter()
                                nk.matmul(type_name, x, blocks, n, k, int8_activations=True, vnni_min_rows=vnni_min_rows,
                                          x8=True)
                                times.append(time.perf_counter() - t0)
                        got[label].append(statistics.median(times) * 1e3)
            key = f"{type_name} [{n},{k}] rows {m}"
            results[key] = {"ms": got, "median_ms": {s: statistics.median(v) for s, v in got.items()},
                            "median_ratio_this_over_base": statistics.median(
                                a / b for a, b in zip(got["this"], got["base"]))}
            print(f"{key}: " + "  ".join(f"{s} {v:.3f} ms" for s, v in results[key]["median_ms"].items())
                  + f"  ratio {results[key]['median_ratio_this_over_base']:.3f}", flush=True)
    return results


def time_forward(sides: dict, ns: list[int], rounds: int) -> dict:
    from dyntree_core.models.load import load_model, resolve_spec
    from dyntree_core.planning.forward_timer import ForwardTimer
    from dyntree_core.quant.ggml_linear import GGMLLinear
    from dyntree_core.quant.huge_pages import HUGE_PAGE, packed_in_huge_pages
    from dyntree_core.quant.native_layer import forget_plan

    model = load_model(resolve_spec("embedded", "target"), precision="int4")
    layers = [m for m in model.modules() if isinstance(m, GGMLLinear)]
    blocks = {"this": [m.blocks for m in layers]}
    base_nk, base_x8 = sides["base"]
    rebuilt = []
    for m in layers:
        if not (m.x8 and base_x8[m.type_name] != native.X8[m.type_name]):
            rebuilt.append(m.blocks)
            continue
        rows = m.ggml_blocks()
        with layout(base_x8):
            rebuilt.append(base_nk.repack_x8(m.type_name, rows, m.out_features, m.in_features))
    small = [i for i, (m, b) in enumerate(zip(layers, rebuilt))
             if b.data_ptr() != m.blocks.data_ptr() and b.numel() < HUGE_PAGE]
    for i, b in zip(small, packed_in_huge_pages([rebuilt[i] for i in small])):
        rebuilt[i] = b
    blocks["base"] = rebuilt
    moved = sum(b.data_ptr() != m.blocks.data_ptr() for m, b in zip(layers, rebuilt))
    nbytes = {s: sum({b.data_ptr(): b.numel() for b in bs}.values()) for s, bs in blocks.items()}
    print(f"{moved} of {len(layers)} layers in another layout on the base side; the layers' blocks: "
          + ", ".join(f"{s} {v / 1e6:.1f} MB" for s, v in nbytes.items()), flush=True)
    got: dict[str, dict[str, list[float]]] = {s: {str(n): [] for n in ns} for s in sides}
    with torch.inference_mode():
        timer = ForwardTimer(model, 128, max(ns))
        for r in range(rounds):
            for label in ("base", "this") if r % 2 == 0 else ("this", "base"):  # ABBA: neither side always first
                nk, x8 = sides[label]
                with layout(x8):
                    for m, b in zip(layers, blocks[label]):
                        m.blocks, m.kernels = b, nk
                    for mod in model.modules():
                        forget_plan(mod)
                    timer.once(1)
                    for n in ns:
                        got[label][str(n)].append(timer.best(n, 5 if n <= 8 else 3) * 1e3)
            print(f"round {r + 1}: " + "  ".join(f"t({n}) {got['base'][str(n)][-1]:.1f} -> {got['this'][str(n)][-1]:.1f}"
                                                 for n in ns), flush=True)
    ratios = {str(n): statistics.median(a / b for a, b in zip(got["this"][str(n)], got["base"][str(n)])) for n in ns}
    medians = {s: {k: statistics.median(v) for k, v in t.items()} for s, t in got.items()}
    print("forward medians: " + "  ".join(f"t({n}) {medians['base'][str(n)]:.1f} -> {medians['this'][str(n)]:.1f}"
                                          f" ({ratios[str(n)]:.3f})" for n in ns))
    return {"layers_in_another_layout": moved, "block_megabytes": {k: round(v / 1e6, 1) for k, v in nbytes.items()}, "ms": got, "median_ms": medians, "median_ratio_this_over_base": ratios}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the commit whose kernels and layout to compare against")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 4, 16, 32], help="rows of the forward")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16], help="rows of the products")
    ap.add_argument("--skip", choices=("products", "forward"), help="leave one measurement out")
    ap.add_argument("--tiles", choices=("vnni", "avx2"), default="vnni", help="which x8 tiles run")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.tiles == "avx2":
        os.environ["DYNTREE_KERNELS"] = "native_x8"
    rev = subprocess.run(["git", "rev-parse", args.base], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    this_nk = native.native_kernels()
    base_nk, base_x8 = base_kernels(rev)
    sides = {"base": (base_nk, base_x8), "this": (this_nk, dict(native.X8))}
    print(f"base {rev[:10]}: x8 bytes {base_x8}; this tree: {dict(native.X8)}", flush=True)
    out: dict = {"base": rev, "x8_bytes": {"base": base_x8, "this": dict(native.X8)}, "rounds": args.rounds,
                 "tiles": args.tiles, "kernels_policy": os.environ["DYNTREE_KERNELS"]}
    if args.skip != "products":
        out["products"] = time_products(sides, args.rows, args.rounds, int(args.tiles == "vnni"))
    if args.skip != "forward":
        out["forward"] = time_forward(sides, args.ns, args.rounds)
    if args.json:
        from dyntree_core.bench.result_file import write_result

        write_result(args.json, "scripts/x8_layout_ab.py", out)


if __name__ == "__main__":
    main()
