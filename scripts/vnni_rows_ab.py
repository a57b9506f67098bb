"""t(1), t(2), t(4) of the embedded target at int4 with the kernel table's VNNI switch (``vnni_min_rows`` of each
x8 layer) against the VNNI x8 tiles from one row, alternated in one process on one loaded model (6 rounds; the
C decoder layers re-planned at each switch), medians and the median per-round ratio.

    .venv/bin/python scripts/vnni_rows_ab.py
"""
import os
import statistics

import torch

os.environ["DYNTREE_KERNELS"] = "table"
from dyntree_core.models.load import load_model, resolve_spec  # noqa: E402
from dyntree_core.planning.forward_timer import ForwardTimer  # noqa: E402
from dyntree_core.quant.ggml_linear import GGMLLinear  # noqa: E402
from dyntree_core.quant.native_layer import forget_plan  # noqa: E402

model = load_model(resolve_spec("embedded", "target"), precision="int4")
layers = [m for m in model.modules() if isinstance(m, GGMLLinear) and m.x8]
table = [m.vnni_min_rows for m in layers]
print(f"{len(layers)} x8 layers; the table's vnni_min_rows: {({v: table.count(v) for v in set(table)})}")
runs: dict[str, dict[int, list[float]]] = {"table": {}, "vnni_from_1": {}}
with torch.inference_mode():
    timer = ForwardTimer(model, 128, 8)
    timer.once(1)
    for _ in range(6):
        for label, times in runs.items():
            for m, rows in zip(layers, table):
                m.vnni_min_rows = rows if label == "table" else 1
            for mod in model.modules():
                forget_plan(mod)
            timer.once(1)
            for n in (1, 2, 4):
                times.setdefault(n, []).append(timer.best(n, 5) * 1e3)
for n in (1, 2, 4):
    a, b = runs["table"][n], runs["vnni_from_1"][n]
    print(f"t({n}) table {statistics.median(a):.2f} ms, VNNI from 1 row {statistics.median(b):.2f} ms, "
          f"ratio {statistics.median(y / x for x, y in zip(a, b)):.3f}")
