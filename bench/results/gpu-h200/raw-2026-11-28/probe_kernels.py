"""GPU probe: the CUDA kernels of one DenseForward call (0.5B shape, bf16, 1 row over 256 slots) by name,
beside op_count.LaunchCounter's modelled ops, to find what the CPU model misses (320 modelled vs 417 seen)."""
import collections, sys
import dyntree_core  # noqa: F401  (its set-up of transformers first)
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from dyntree_core.bench.resident import QWEN_SHAPES, QWEN_VOCAB, synthetic_qwen
from dyntree_core.decode.dense_forward import DenseForward
from dyntree_core.decode.op_count import LaunchCounter

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
shape = QWEN_SHAPES["0.5B"]
if dev.type == "cpu":
    shape = (64, 2, 4, 2, 128)
m = synthetic_qwen(*shape, QWEN_VOCAB if dev.type == "cuda" else 512, seed=1, dev=dev, sharpen=1.0)
m = m.to(torch.bfloat16 if dev.type == "cuda" else torch.float32)
layers = shape[1]
f = DenseForward(m, 256)
for rows in (1, 63):
    idx = torch.arange(rows, device=dev)
    vis = torch.ones(rows, 256, dtype=torch.bool, device=dev)
    f(idx, idx, idx, vis, idx)
    with LaunchCounter() as lc:
        f(idx, idx, idx, vis, idx)
    print(f"rows {rows}: modelled {lc.kernels} (layers {layers})")
    print("  modelled by op:", dict(lc.by_op.most_common(40)))
    if dev.type == "cuda":
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            f(idx, idx, idx, vis, idx)
            torch.cuda.synchronize()
        names = collections.Counter(e.name for e in prof.events() if e.device_type == DeviceType.CUDA)
        print(f"  profiled {sum(names.values())}:")
        for n, c in names.most_common(60):
            print(f"    {c:5d}  {n[:150]}")
        cpu_ops = collections.Counter(e.name for e in prof.events() if e.device_type == DeviceType.CPU and e.name.startswith("aten::"))
        print("  aten ops:", dict(cpu_ops.most_common(40)))
