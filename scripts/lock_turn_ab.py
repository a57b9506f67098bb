"""The default Run headless three ways, alternated: steps advanced directly, each step in a turn on the app's
``ModelLock`` (whose release stops the OpenMP team), and in a turn with the app's 0.5 ms switch interval
(``ui.switch_interval``). Per run: the steps' ms/token, the wall ms/token (prefill included) and the step count. Where
the page's Runs decode slower than headless ones, this says whether the app's turns or its switch interval do it.

    .venv/bin/python scripts/lock_turn_ab.py [--rounds 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT), str(ROOT / "scripts")]

MODES = ("direct", "turn", "turn+switch")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from page_vs_headless import default_settings

    from dyntree_core.bench.result_file import write_result
    from ui.model_lock import ModelLock
    from ui.models import HubModelProvider
    from ui.runner import start_generation
    from ui.switch_interval import DECODE_SWITCH_INTERVAL_S

    provider, settings, lock = HubModelProvider("embedded", "embedded"), default_settings(), ModelLock()
    default_interval = sys.getswitchinterval()

    def run(mode: str) -> dict:
        sys.setswitchinterval(DECODE_SWITCH_INTERVAL_S if mode == "turn+switch" else default_interval)
        gen = start_generation(provider, settings, plain_probes=True)
        t0 = time.perf_counter()
        while True:
            if mode == "direct":
                item = gen.advance()
            else:
                with lock.turn("lock_turn_ab"):
                    item = gen.advance()
            if item is None:
                break
        wall = time.perf_counter() - t0
        traces = gen.record.traces
        tokens = sum(t.num_committed for t in traces)
        return {"step_ms_per_token": round(1e3 * sum(t.step_seconds for t in traces) / tokens, 2),
                "wall_ms_per_token": round(1e3 * wall / tokens, 2), "steps": len(traces)}

    run("direct")  # (the warm-up: loads and plans)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            runs[mode].append(run(mode))
            print(mode, runs[mode][-1], flush=True)
    sys.setswitchinterval(default_interval)
    summary = {m: {k: statistics.median(r[k] for r in rs) for k in ("step_ms_per_token", "wall_ms_per_token")}
               for m, rs in runs.items()}
    for m, s in summary.items():
        print(f"{m:12s} {s}")
    if args.json:
        write_result(args.json, "scripts/lock_turn_ab.py", {"runs": runs, "summary": summary})


if __name__ == "__main__":
    main()
