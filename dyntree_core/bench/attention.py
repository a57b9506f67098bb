"""Tree-attention benchmark: mask block counts per node order, and (GPU) kernel timings.

    python -m dyntree_core.bench attention [--device auto|cuda|cpu] [--json out.json]
        [--trees recorded.json] [--sizes 256 512 1024 2048] [--prefixes 0 128 1024]
        [--seeds 10] [--block-sizes 16 32 64 128] [--block-m 128] [--no-flex] [--interp-timing]
        [--heads 64 8 128] [--prefix-blocks 64 128] [--auto-table auto|yes|no]

Block counts (any device): non-empty ``B x B`` tiles of the tree part of the mask, for BFS,
DFS, HPD and the construction ("gen") order, averaged over ``--seeds`` synthetic trees per size
(``dyntree_core.attention.trees``: ``dyspec`` = DySpec-shaped greedy trees, ``uniform`` = random
recursive trees), plus the whole ``[T, P + T]`` mask at each prefix length for block 32 (the
setting of DySpec's Fig. 9). DySpec's Table 5 numbers (block 32, "random tree structure") are
printed alongside. ``--trees`` adds recorded trees: a JSON list whose items are parent lists or
objects with a ``"parents"`` list (optionally under a top-level ``"trees"`` key).

Kernel timings (CUDA only): Llama-2-70B head shape (64 q heads, 8 kv heads, d=128, bf16 by
default), per tree size and prefix length: the Triton kernel in each order (block_n 32,
``--block-m`` 128 packed rows = 16 query tokens x 8 heads; DFS also through the mask path),
torch SDPA with the bool mask, FlexAttention (compiled, BLOCK_SIZE 128) and manual attention
(matmul + masked softmax); median of CUDA-event timings (launch overhead included); DFS also
with wider prefix-loop tiles (``--prefix-blocks``). The kernel's output is checked against SDPA in
every configuration. The timings are also written as the device's ``attention="auto"`` table
(``attention.auto_table``: per size and prefix, the kernel path of the node order vs SDPA). On CPU
only the block-count table is produced; ``--auto-table yes`` measures the CPU's table through
the Triton interpreter (it says SDPA everywhere), ``--interp-timing`` adds tiny-shape
interpreter timings, which say nothing about GPU speed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from dyntree_core.attention.trees import TREE_FAMILIES, make_tree
from dyntree_core.machine import machine_info
from dyntree_core.measured import Verdict, summarize, watch
from dyntree_core.tree import TokenTree, count_nonzero_blocks, tree_from_parents

ORDERS: tuple[str, ...] = ("gen", "bfs", "dfs", "hpd")
# DySpec appendix C, Table 5: block count at block size 32, Llama-2-70B shape, random trees.
DYSPEC_TABLE5: dict[int, dict[str, float]] = {
    256: {"original": 36, "reordered": 22.5},
    512: {"original": 135.5, "reordered": 52.8},
    1024: {"original": 490.2, "reordered": 119.3},
    2048: {"original": 1654.5, "reordered": 278.7},
}
DEFAULT_RESULT = Path("bench/results/attention_blocks_cpu.json")


def _perm(tree: TokenTree, order: str) -> torch.Tensor:
    return torch.arange(tree.size) if order == "gen" else tree.order(order)  # type: ignore[arg-type]


def block_count_rows(trees: dict[str, list[TokenTree]], block_sizes: list[int], prefixes: list[int]) -> list[dict]:
    """Mean non-empty block counts per (family, size, order, block size) and per prefix (B=32)."""
    rows: list[dict] = []
    for (family, size), group in _group_by_size(trees).items():
        acc: dict[tuple, list[int]] = {}
        for tree in group:
            anc = tree.ancestor_mask()
            for order in ORDERS:
                p = _perm(tree, order)
                m = anc[p][:, p]
                for b in block_sizes:
                    acc.setdefault(("tree", order, b, 0), []).append(count_nonzero_blocks(m, b))
                for pre in prefixes:
                    if pre == 0:
                        continue
                    full = torch.cat([torch.ones(tree.size, pre, dtype=torch.bool), m], dim=1)
                    acc.setdefault(("full", order, 32, pre), []).append(count_nonzero_blocks(full, 32))
        for (scope, order, b, pre), vals in sorted(acc.items()):
            nb = -(-size // b)
            rows.append(dict(family=family, size=size, scope=scope, order=order, block=b, prefix=pre,
                             mean_blocks=statistics.fmean(vals), n_trees=len(vals),
                             lower_triangle=nb * (nb + 1) // 2, total_tiles=nb * nb))
    return rows


def _group_by_size(trees: dict[str, list[TokenTree]]) -> dict[tuple[str, int], list[TokenTree]]:
    out: dict[tuple[str, int], list[TokenTree]] = {}
    for family, group in trees.items():
        for t in group:
            out.setdefault((family, t.size), []).append(t)
    return dict(sorted(out.items()))


def load_recorded_trees(path: Path) -> list[TokenTree]:
    """Trees from a JSON list of parent lists / ``{"parents": [...]}`` objects."""
    data = json.loads(path.read_text())
    if isinstance(data, dict):
        data = data.get("trees", [])
    trees = []
    for item in data:
        parents = item["parents"] if isinstance(item, dict) else item
        trees.append(tree_from_parents([int(p) for p in parents]))
    if not trees:
        raise ValueError(f"{path}: no trees found")
    return trees


def print_block_table(rows: list[dict], out=None) -> None:
    """Tree-part counts at block 32 next to DySpec's Table 5, then other block sizes and prefixes."""
    out = sys.stdout if out is None else out  # resolved per call: pytest swaps sys.stdout between tests
    def get(family, size, order, b, scope="tree", pre=0):
        for r in rows:
            if (r["family"], r["size"], r["order"], r["block"], r["scope"], r["prefix"]) == (family, size, order, b, scope, pre):
                return r["mean_blocks"]
        return None

    families = sorted({r["family"] for r in rows})
    sizes = sorted({r["size"] for r in rows})
    print("\nNon-empty 32x32 blocks of the tree mask (mean over trees); DySpec Table 5 alongside", file=out)
    print("gen = construction order, BFS/DFS/HPD = TokenTree.order; tri = full lower triangle;"
          " DySpec orig/DFS = their 'Reorder False/True' columns", file=out)
    hdr = f"{'family':<9}{'T':>6}{'gen':>9}{'BFS':>9}{'DFS':>9}{'HPD':>9}{'BFS/DFS':>9}{'tri':>7}  {'DySpec orig':>11}{'DySpec DFS':>11}"
    print(hdr, file=out)
    for fam in families:
        for t in sizes:
            vals = [get(fam, t, o, 32) for o in ORDERS]
            if vals[1] is None:
                continue
            ds = DYSPEC_TABLE5.get(t, {})
            nb = -(-t // 32)
            print(f"{fam:<9}{t:>6}" + "".join(f"{v:>9.1f}" for v in vals) + f"{vals[1] / max(vals[2], 1e-9):>9.2f}"
                  + f"{nb * (nb + 1) // 2:>7}  {ds.get('original', float('nan')):>11}{ds.get('reordered', float('nan')):>11}", file=out)
    blocks = sorted({r["block"] for r in rows if r["scope"] == "tree"})
    print("\nOther block sizes (BFS -> DFS -> HPD):", file=out)
    for fam in families:
        for t in sizes:
            cells = []
            for b in blocks:
                v = [get(fam, t, o, b) for o in ("bfs", "dfs", "hpd")]
                if v[0] is not None:
                    cells.append(f"B={b}: {v[0]:.1f}/{v[1]:.1f}/{v[2]:.1f}")
            if cells:
                print(f"  {fam:<8} T={t:<5} " + "  ".join(cells), file=out)
    prefixes = sorted({r["prefix"] for r in rows if r["scope"] == "full"})
    if prefixes:
        print("\nWhole [T, P+T] mask at B=32 (BFS -> DFS), prefix blocks included:", file=out)
        for fam in families:
            for t in sizes:
                cells = [f"P={p}: {get(fam, t, 'bfs', 32, 'full', p):.1f}/{get(fam, t, 'dfs', 32, 'full', p):.1f}"
                         for p in prefixes if get(fam, t, "bfs", 32, "full", p) is not None]
                if cells:
                    print(f"  {fam:<8} T={t:<5} " + "  ".join(cells), file=out)


# ---------------------------------------------------------------------------------------- timing
def _time_ms(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn``: CUDA events on GPU, wall clock otherwise (``measured.summarize``: the
    spread goes to the quiet check of an enclosing ``measured.watch``)."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return summarize([t / 1e3 for t in times]).median_ms


def _manual(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    g = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(g, dim=1)
    vv = v.repeat_interleave(g, dim=1)
    s = torch.matmul(q, kk.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s.float(), dim=-1).to(q.dtype), vv)


def timing_rows(
    args: argparse.Namespace, dev: torch.device, sizes: list[int], prefixes: list[int],
    hq: int = 64, hkv: int = 8, d: int = 128, use_flex: bool = True, prefix_blocks: tuple[int, ...] = (),
) -> list[dict]:
    """Kernel (per order) vs SDPA / FlexAttention / manual attention; Llama-2-70B heads by default.

    ``prefix_blocks``: also time DFS with these widths of the dense prefix loop's tile
    (``kernel_dfs_prefix<N>_ms``). On CUDA these are the benchmark numbers; on CPU (Triton
    interpreter) the kernel's times say only that the interpreter is slow.
    """
    import torch.nn.functional as F

    from dyntree_core.attention.mask import meta_from_tree
    from dyntree_core.attention.triton_kernel import default_block_q, triton_tree_attention

    dtype = getattr(torch, args.dtype)
    scale = d ** -0.5
    flex = None
    if use_flex:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            flex = torch.compile(flex_attention, dynamic=False)
            for knob in ("recompile_limit", "cache_size_limit"):  # one compile per (T, P) shape
                if hasattr(torch._dynamo.config, knob):
                    setattr(torch._dynamo.config, knob, max(64, getattr(torch._dynamo.config, knob)))
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            print(f"FlexAttention unavailable: {e}", file=sys.stderr)
    rows: list[dict] = []
    block_q = default_block_q(hq // hkv, args.block_m)
    for size in sizes:
        tree = make_tree(args.family, size, 0)
        for pre in prefixes:
            gen = torch.Generator(device=dev).manual_seed(size + pre)
            q = torch.randn(1, hq, size, d, device=dev, dtype=dtype, generator=gen)
            k = torch.randn(1, hkv, pre + size, d, device=dev, dtype=dtype, generator=gen)
            v = torch.randn(1, hkv, pre + size, d, device=dev, dtype=dtype, generator=gen)
            row: dict[str, Any] = dict(family=args.family, size=size, prefix=pre, dtype=args.dtype,
                                       heads=hq, kv_heads=hkv, head_dim=d, block_n=32, block_q=block_q)
            anc = tree.ancestor_mask()
            for order in ("bfs", "dfs", "hpd"):
                p = _perm(tree, order)
                meta = meta_from_tree(tree, pre, p, block_q, 32, device=dev)
                mask = torch.cat([torch.ones(size, pre, dtype=torch.bool), anc[p][:, p]], dim=1).to(dev)
                out = triton_tree_attention(q[0], k[0], v[0], meta, sm_scale=scale)
                ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], scale=scale, enable_gqa=True)[0]
                row[f"kernel_{order}_ms"] = _time_ms(lambda: triton_tree_attention(q[0], k[0], v[0], meta, sm_scale=scale),
                                                     dev, args.warmup, args.iters)
                row[f"kernel_{order}_tiles"] = meta.blocks.num_nonzero
                row[f"kernel_{order}_maxerr_vs_sdpa"] = (out.float() - ref.float()).abs().max().item()
                row[f"kernel_{order}_interval"] = meta.end is not None
                if order == "dfs":
                    dfs_mask = mask
                    # Same DFS tree through the mask-tensor path, isolating the interval form's effect.
                    meta_m = meta_from_tree(tree, pre, p, block_q, 32, device=dev, interval=False)
                    row["kernel_dfs_maskpath_ms"] = _time_ms(
                        lambda: triton_tree_attention(q[0], k[0], v[0], meta_m, sm_scale=scale), dev, args.warmup, args.iters)
                    for pb in prefix_blocks:
                        got = triton_tree_attention(q[0], k[0], v[0], meta, sm_scale=scale, prefix_block_n=pb)
                        row[f"kernel_dfs_prefix{pb}_maxerr_vs_sdpa"] = (got.float() - ref.float()).abs().max().item()
                        row[f"kernel_dfs_prefix{pb}_ms"] = _time_ms(
                            lambda pb=pb: triton_tree_attention(q[0], k[0], v[0], meta, sm_scale=scale, prefix_block_n=pb),
                            dev, args.warmup, args.iters)
            m4 = dfs_mask[None, None]
            row["sdpa_ms"] = _time_ms(
                lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=m4, scale=scale, enable_gqa=True),
                dev, args.warmup, args.iters)
            try:
                row["manual_ms"] = _time_ms(lambda: _manual(q, k, v, m4, scale), dev, args.warmup, args.iters)
            except torch.OutOfMemoryError:
                row["manual_ms"] = None
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            if flex is not None:
                try:
                    tree_dev = dfs_mask[:, pre:].contiguous()

                    def mask_mod(b, h, qi, kv, _t=tree_dev, _p=pre, _n=size):
                        # mask_mod also sees padded (out-of-range) indices: clamp before indexing.
                        return (kv < _p) | _t[qi.clamp(0, _n - 1), (kv - _p).clamp(0, _n - 1)]

                    bm = create_block_mask(mask_mod, 1, 1, size, pre + size, device=dev, BLOCK_SIZE=128)
                    row["flex_ms"] = _time_ms(lambda: flex(q, k, v, block_mask=bm, scale=scale, enable_gqa=True),
                                              dev, args.warmup, args.iters)
                except Exception as e:  # noqa: BLE001 - one failed baseline must not kill the run
                    row["flex_ms"] = None
                    row["flex_error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            print(_fmt_timing(row), flush=True)
    return rows


def _fmt_timing(r: dict) -> str:
    def ms(key):
        v = r.get(key)
        return f"{v:8.3f}" if isinstance(v, float) else f"{'-':>8}"

    return (f"T={r['size']:<5} P={r['prefix']:<5} kernel bfs/dfs/hpd {ms('kernel_bfs_ms')}{ms('kernel_dfs_ms')}{ms('kernel_hpd_ms')} ms"
            f" (tiles {r.get('kernel_bfs_tiles')}/{r.get('kernel_dfs_tiles')}/{r.get('kernel_hpd_tiles')})"
            f" | sdpa {ms('sdpa_ms')} flex {ms('flex_ms')} manual {ms('manual_ms')}"
            f" | max err {max(r.get('kernel_bfs_maxerr_vs_sdpa', 0), r.get('kernel_dfs_maxerr_vs_sdpa', 0)):.2e}")


def write_auto_table(dev: torch.device, rows: list[dict], verdict: Optional[Verdict] = None) -> dict:
    """Store the kernel-vs-SDPA table ``attention="auto"`` reads for ``dev`` and print its choices; with a busy
    ``verdict`` (of the ``measured.watch`` the rows were timed in) it is printed but not stored."""
    import triton

    from dyntree_core.attention.auto_table import AutoTable, save_table

    machine = dict(machine_info().to_dict(), triton=triton.__version__,
                   device_name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu")
    table = AutoTable.from_timing_rows(dev, rows, machine)
    path = save_table(table, verdict)
    print(f"\nattention='auto' table for {table.device_key} "
          f"({path if path is not None else 'not stored: ' + verdict.reason}):")
    for c in table.cells:
        print(f"  T={c.size:<5} P={c.prefix:<5} kernel dfs {c.kernel_ms.get('dfs', float('nan')):8.3f} "
              f"bfs {c.kernel_ms.get('bfs', float('nan')):8.3f} sdpa {c.sdpa_ms:8.3f} ms -> "
              f"pre-order {c.choice(True)}, other {c.choice(False)}")
    return dict(table.to_dict(), path=None if path is None else str(path),
                verdict=(verdict or Verdict(True)).to_dict())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dyntree_core.bench attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--json", type=Path, default=None, help=f"output JSON (default on CPU: {DEFAULT_RESULT})")
    p.add_argument("--trees", type=Path, default=None, help="JSON of recorded trees (parent lists)")
    p.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--prefixes", type=int, nargs="+", default=[0, 128, 1024])
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--seeds", type=int, default=10, help="synthetic trees per size and family")
    p.add_argument("--families", nargs="+", default=list(TREE_FAMILIES), choices=TREE_FAMILIES)
    p.add_argument("--family", default="dyspec", choices=TREE_FAMILIES, help="tree family for GPU timings")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--block-m", type=int, default=128, help="kernel rows per program (query tokens x GQA group)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compile is slow)")
    p.add_argument("--interp-timing", action="store_true", help="CPU: add tiny Triton-interpreter timings")
    p.add_argument("--heads", type=int, nargs=3, default=[64, 8, 128], metavar=("Q", "KV", "D"),
                   help="head shape of the GPU timings and of the auto table (default: Llama-2-70B)")
    p.add_argument("--prefix-blocks", type=int, nargs="*", default=[64, 128],
                   help="GPU: also time DFS with these prefix-loop tile widths")
    p.add_argument("--auto-table", choices=("auto", "yes", "no"), default="auto",
                   help="write the measured kernel-vs-SDPA table attention='auto' reads for this device "
                        "(auto: on CUDA; yes on CPU measures it through the Triton interpreter at --table-sizes)")
    p.add_argument("--table-sizes", type=int, nargs="+", default=[16, 64],
                   help="CPU table: tree sizes (the interpreter is slow)")
    p.add_argument("--table-prefixes", type=int, nargs="+", default=[0, 64], help="CPU table: prefixes")
    return p


def _env(device: str) -> dict:
    info: dict[str, Any] = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=device, torch=torch.__version__, python=platform.python_version(), host=platform.node(),
        cpu=platform.processor() or platform.machine(), argv=sys.argv[1:],
    )
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device == "cuda":
        info["device_name"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    else:
        info["device_name"] = "cpu"
    info["machine_info"] = machine_info().to_dict()
    return info


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda requested but CUDA is not available", file=sys.stderr)
        return 2
    if any(s < 1 for s in args.sizes) or any(p < 0 for p in args.prefixes) or args.seeds < 1:
        print("sizes and seeds must be >= 1, prefixes >= 0", file=sys.stderr)
        return 2
    trees: dict[str, list[TokenTree]] = {
        fam: [make_tree(fam, s, seed) for s in args.sizes for seed in range(args.seeds)] for fam in args.families
    }
    if args.trees is not None:
        trees["recorded"] = load_recorded_trees(args.trees)
    t0 = time.perf_counter()
    rows = block_count_rows(trees, args.block_sizes, args.prefixes)
    print_block_table(rows)
    print(f"\n(block counts computed in {time.perf_counter() - t0:.1f} s)")
    result: dict[str, Any] = dict(
        env=_env(device),
        generator=dict(dyspec="dyspec_like_tree(size, seed): greedy max-heap expansion by value(parent)*q_parent[rank], "
                              "q ~ sorted Dirichlet(0.1) over 32 tokens (DySpec Alg. 1 shape)",
                       uniform="uniform_random_tree(size, seed): parent of node i uniform over 0..i-1",
                       seeds=args.seeds),
        dyspec_table5_block32=DYSPEC_TABLE5,
        block_counts=rows,
    )
    hq, hkv, d = args.heads
    if device == "cuda":
        print(f"\nTimings on {torch.cuda.get_device_name(0)} ({args.dtype}, {hq} q / {hkv} kv heads, d={d}, median ms):")
        with watch() as w:
            result["gpu_timings"] = timing_rows(args, torch.device("cuda"), args.sizes, args.prefixes, hq=hq, hkv=hkv,
                                                d=d, use_flex=not args.no_flex, prefix_blocks=tuple(args.prefix_blocks))
        if args.auto_table != "no":
            result["auto_table"] = write_auto_table(torch.device("cuda"), result["gpu_timings"], w.verdict())
    elif args.auto_table == "yes":
        from dyntree_core.attention.triton_kernel import interpreting

        if not interpreting():
            print("--auto-table on the CPU needs the Triton interpreter (TRITON_INTERPRET=1 before start)",
                  file=sys.stderr)
            return 2
        print("\n[auto table on the CPU: the kernel through the Triton interpreter vs SDPA, 4 q / 2 kv heads, d=32]")
        args.warmup, args.iters = 1, 3
        with watch() as w:
            rows_cpu = timing_rows(args, torch.device("cpu"), args.table_sizes, args.table_prefixes, hq=4, hkv=2,
                                   d=32, use_flex=False)
        result["cpu_table_timings"] = rows_cpu
        result["auto_table"] = write_auto_table(torch.device("cpu"), rows_cpu, w.verdict())
    if args.interp_timing and device == "cpu":
        from dyntree_core.attention.triton_kernel import interpreting

        if interpreting():
            print("\n[Triton CPU interpreter, tiny shape (4 q / 2 kv heads, d=64): NOT meaningful as performance]")
            args.warmup, args.iters = 0, 1
            result["interpreter_timings_not_meaningful"] = timing_rows(
                args, torch.device("cpu"), [64], [0, 32], hq=4, hkv=2, d=64, use_flex=False)
    path = args.json or (DEFAULT_RESULT if device == "cpu" and args.auto_table != "yes" else None)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
