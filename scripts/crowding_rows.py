"""What another process on the CPUs costs each forward size: the target's int4 forward of n tokens (128-token
prefix) timed quiet and beside a busy loop that takes ``--duty`` of one core (10 ms periods), alternated in
``--rounds`` blocks, with a memory-read probe per block. The browser of the app's page took 0.25-0.28 of a core
beside its runs on the 2-core VM (``measured.crowding``): does that cost a tree's wide forward more than plain
decoding's one-token forward?

    .venv/bin/python scripts/crowding_rows.py [--duty 0.26] [--rounds 6] [--json OUT]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
SIZES = (1, 4, 8, 16, 32)


def _busy(duty: float, stop) -> None:
    period = 0.01
    while not stop.is_set():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < duty * period:
            pass
        time.sleep(period * (1 - duty))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duty", type=float, default=0.26)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import torch

    from dyntree_core.bench.result_file import write_result
    from dyntree_core.planning.forward_timer import ForwardTimer
    from dyntree_core.planning.pair_cache import PairCache
    from dyntree_core.planning.profiling import run_probe

    model = PairCache("embedded", "embedded").model("target", "int4")
    timer = ForwardTimer(model, 128, max(SIZES))
    for n in SIZES:
        timer.once(n)
    times: dict[str, dict[int, list[float]]] = {m: {n: [] for n in SIZES} for m in ("quiet", "busy")}
    probes: dict[str, list] = {"quiet": [], "busy": []}
    for _ in range(args.rounds):
        for mode in ("quiet", "busy"):
            stop = mp.Event()
            proc = None
            if mode == "busy":
                proc = mp.Process(target=_busy, args=(args.duty, stop))
                proc.start()
                time.sleep(0.2)
            probes[mode].append(run_probe())
            for n in SIZES:
                times[mode][n].append(statistics.median(timer.once(n) for _ in range(7)))
            if proc is not None:
                stop.set()
                proc.join()
    rows = {}
    for n in SIZES:
        q, b = statistics.median(times["quiet"][n]), statistics.median(times["busy"][n])
        rows[n] = {"quiet_ms": round(q * 1e3, 2), "busy_ms": round(b * 1e3, 2), "ratio": round(b / q, 3)}
        print(f"n={n:2d}  quiet {q * 1e3:7.1f} ms  busy {b * 1e3:7.1f} ms  busy/quiet {b / q:.3f}")
    med_probe = {m: statistics.median([p for p in v if p] or [float("nan")]) for m, v in probes.items()}
    print(f"memory read (median probe, GB/s): {med_probe}; torch threads {torch.get_num_threads()}")
    if args.json:
        write_result(args.json, "scripts/crowding_rows.py", {
            "duty": args.duty, "rounds": args.rounds,
            "torch_threads": torch.get_num_threads(), "probe_gb_per_s": med_probe, "probes": probes,
            "rows": rows, "times_s": times})


if __name__ == "__main__":
    main()
