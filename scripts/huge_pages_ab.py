"""t(1) of the embedded target at int4 with its GGMLLinear blocks in 2 MiB pages (as loaded, ``quant/huge_pages.py``)
against the same blocks copied into ordinary 4 KiB pages, alternated in one process on one loaded model (the C
decoder layers re-planned at each switch): medians and the median per-round ratio. ``--small-only``: only the
blocks under 2 MiB move (those ``pack_small_blocks`` packed side by side at load).

    .venv/bin/python scripts/huge_pages_ab.py [--small-only] [--rounds 6] [--json OUT]
"""
import argparse
import os
import statistics

import torch

os.environ["DYNTREE_KERNELS"] = "table"
from dyntree_core.models.load import load_model, resolve_spec  # noqa: E402
from dyntree_core.planning.forward_timer import ForwardTimer  # noqa: E402
from dyntree_core.quant.ggml_linear import GGMLLinear  # noqa: E402
from dyntree_core.quant.huge_pages import HUGE_PAGE  # noqa: E402
from dyntree_core.quant.native_layer import forget_plan  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--small-only", action="store_true")
ap.add_argument("--rounds", type=int, default=6)
ap.add_argument("--json", help="write the rounds, medians and ratio here")
args = ap.parse_args()
model = load_model(resolve_spec("embedded", "target"), precision="int4")
layers = [m for m in model.modules() if isinstance(m, GGMLLinear)
          and not (args.small_only and m.blocks.numel() >= HUGE_PAGE)]
huge = [m.blocks for m in layers]
small = [b.clone() for b in huge]  # torch's allocator: 4 KiB pages
print(f"{sum(b.data_ptr() % HUGE_PAGE == 0 for b in huge)} of {len(layers)} layers' blocks at a 2 MiB page's start "
      f"({sum(b.numel() for b in huge) / 1e6:.1f} MB); "
      + "".join(line.strip() for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages")))
runs: dict[str, list[float]] = {"2 MiB": [], "4 KiB": []}
with torch.inference_mode():
    timer = ForwardTimer(model, 128, 4)
    timer.once(1)
    for r in range(args.rounds):
        for label, bufs in (("2 MiB", huge), ("4 KiB", small)):
            for m, b in zip(layers, bufs):
                m.blocks = b
            for mod in model.modules():
                forget_plan(mod)
            timer.once(1)
            runs[label].append(timer.best(1, 7) * 1e3)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f} ms" for k, v in runs.items()), flush=True)
medians = {k: statistics.median(v) for k, v in runs.items()}
ratio = statistics.median(a / b for a, b in zip(runs["2 MiB"], runs["4 KiB"]))
print("t(1) medians: " + ", ".join(f"{k} {v:.2f} ms" for k, v in medians.items()) + f"; ratio 2 MiB / 4 KiB {ratio:.3f}")
if args.json:
    from dyntree_core.bench.result_file import write_result

    write_result(args.json, "scripts/huge_pages_ab.py", {
        "layers": len(layers), "megabytes": round(sum(b.numel() for b in huge) / 1e6, 1),
        "t1_ms": runs, "median_ms": medians, "median_ratio_2mib_over_4kib": ratio})
