"""What a second thread's OpenMP team costs a forward: the real pair's int4 target, one token after 128, timed on
the main thread, on a second thread while the main thread's team lives, and on a second thread after the main
thread released its team (``dyntree_core.openmp_team``); median ms and context switches (waits) per forward.

    .venv/bin/python scripts/openmp_teams.py [--reps 3]
"""

import argparse
import statistics
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dyntree_core.machine import machine_info  # noqa: E402
from dyntree_core.openmp_team import release_thread_team, voluntary_switches  # noqa: E402
from dyntree_core.planning.forward_timer import ForwardTimer  # noqa: E402
from dyntree_core.planning.pair_cache import PairCache  # noqa: E402

FORWARDS = 15


def timed(target, out: list) -> None:
    """Median seconds of ``FORWARDS`` one-token forwards after 128 cached, and waits per forward."""
    with torch.inference_mode():
        timer = ForwardTimer(target, 128, 1)
        timer.once(1)
        s0 = voluntary_switches()
        ms = 1e3 * statistics.median(timer.once(1) for _ in range(FORWARDS))
        out.append((ms, (voluntary_switches() - s0) / FORWARDS))


def on_thread(target, out: list) -> None:
    t = threading.Thread(target=timed, args=(target, out))
    t.start()
    t.join()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    target = PairCache("embedded", "embedded", device="cpu").pair("int4", "int4").target
    rows: dict[str, list] = {"main thread": [], "second thread, main's team alive": [],
                             "second thread, main's team released": []}
    for _ in range(args.reps):
        timed(target, rows["main thread"])  # (the main thread now keeps a team)
        on_thread(target, rows["second thread, main's team alive"])
        release_thread_team()
        on_thread(target, rows["second thread, main's team released"])
    m = machine_info()
    print(f"{m.cpu_model} ({m.cpu_class}, {m.logical_cpus} CPUs), torch {m.torch_threads} threads")
    for name, got in rows.items():
        print(f"{name:38s} {statistics.median(m for m, _ in got):6.1f} ms/forward, "
              f"{statistics.median(s for _, s in got):6.1f} waits/forward   ({', '.join(f'{m:.1f}' for m, _ in got)})")


if __name__ == "__main__":
    main()
