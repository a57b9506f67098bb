"""Where a sampled (T > 0) token-level device verification spends its GPU time, by kernel: the
``verify.device`` walk and bonus of one budget-64 step at Qwen's vocabulary (151,936), on synthetic rows.

    python scripts/probe_verify_kernels.py [--budget 64] [--vocab 151936] [--kids 20]

The tree: a root with ``--kids`` children, the other slots hung under earlier slots at random; each slot's
children drawn without replacement from its draft row (as DySpec draws them). Prints the median time of the
whole walk + bonus (eager, synchronised) and torch's profiler table of its kernels by total device time
(on the CPU: its ops by CPU time; the numbers then say nothing about a GPU).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402

from dyntree_core.verify.device import sibling_table, token_level_bonus, token_level_walk  # noqa: E402


def synthetic_step(b: int, v: int, root_kids: int, dev: torch.device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(b, v, generator=g) * 3, 1)
    draft = torch.softmax(torch.randn(b, v, generator=g) * 3, 1)
    parents = torch.zeros(b, dtype=torch.long)
    for i in range(1 + root_kids, b):
        parents[i] = int(torch.randint(0, i - 1, (1,), generator=g)) if i > 1 else 0
    tokens = torch.zeros(b, dtype=torch.long)
    for p in parents[1:].unique():
        kids = (parents == p).nonzero()[:, 0]
        kids = kids[kids > 0]
        tokens[kids] = torch.multinomial(draft[p], len(kids), replacement=False, generator=g)
    valid = torch.ones(b, dtype=torch.bool)
    kids = sibling_table(parents, valid, torch.arange(b), b)
    u = torch.rand(b + 1, dtype=torch.float64, generator=g)
    return [t.to(dev) for t in (target, draft, tokens, parents, kids, u)]


def verify(target, draft, tokens, parents, kids, u):
    b = tokens.shape[0]
    walk, tests = token_level_walk(target, draft, tokens, parents, kids, u[:b])
    last = torch.zeros(1, dtype=torch.long, device=tokens.device)
    return walk, token_level_bonus(target, draft, tests, kids, last, u[b:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--kids", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    args = synthetic_step(a.budget, a.vocab, a.kids, dev)
    print(f"torch {torch.__version__} on {dev}" + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""))
    print(f"B {a.budget}, V {a.vocab}, root children {a.kids}, most children {int((args[4] < a.budget).sum(1).max())}")
    verify(*args)
    sync()
    times = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        verify(*args)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    print(f"walk + bonus, eager: median {statistics.median(times):.3f} ms (of {a.repeats})")
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        verify(*args)
        sync()
    key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60))


if __name__ == "__main__":
    main()
