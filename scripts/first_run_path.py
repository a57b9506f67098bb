"""What the app's first default Run does before its first step, timed part by part in one fresh process, as the app
does it: the prompt line's tokenizer (``HubModelProvider.text_info``, on page load), the memory probe, ``auto``'s plan
(``auto_plan`` with a background planner, from the cached measurements), the pair's load; then ``--replans`` times
the plan again after each of N touches of a stored profile (what a Run pays after a background measurement stored
one). Run it in a worktree of another commit to compare (its own ``ui`` and ``dyntree_core`` are imported).

    .venv/bin/python scripts/first_run_path.py [--replans 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT), str(ROOT / "scripts")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replans", type=int, default=0, help="plans after a stored profile changed, once the pair is loaded")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from page_vs_headless import default_settings

    from dyntree_core.paths import cache_root
    from dyntree_core.planning.profiling import run_probe
    from ui.model_lock import ModelLock
    from ui.models import HubModelProvider
    from ui.planner import BackgroundPlanner

    provider, settings, planner = HubModelProvider("embedded", "embedded"), default_settings(), BackgroundPlanner(ModelLock())
    t0 = time.perf_counter()
    provider.text_info("embedded", "embedded")
    t1 = time.perf_counter()
    probe = run_probe()
    t2 = time.perf_counter()
    plan = provider.auto_plan(settings, planner=planner, read_gb_per_s=probe)
    t3 = time.perf_counter()
    run = replace(settings, **plan.resolve(settings.method, settings.precision, settings.draft_precision))
    provider.load(run.pair_spec())
    t4 = time.perf_counter()
    best = getattr(plan, "best", None)  # (None: the provisional plan of a machine not measured yet)
    out = {"root": str(ROOT), "probe_gb_per_s": probe, "plan": best.method if best else "provisional (plain)",
           "budget": best.budget if best else None,
           "text_info_s": round(t1 - t0, 3), "probe_s": round(t2 - t1, 3), "plan_s": round(t3 - t2, 3),
           "load_s": round(t4 - t3, 3), "plan_and_load_s": round(t4 - t2, 3)}
    profiles = sorted((cache_root() / "profiles").glob("machine-*.json"))
    if args.replans and profiles:
        times = []
        for _ in range(args.replans):
            os.utime(profiles[0])  # (a stored measurement changed: the app prices the request again)
            s = time.perf_counter()
            provider.auto_plan(settings, planner=planner, read_gb_per_s=probe)
            times.append(round(time.perf_counter() - s, 3))
        out.update(replan_s=times, replan_median_s=statistics.median(times))
    print(json.dumps(out))
    planner.close()  # (a measurement it started must not be inside torch as the interpreter exits: an abort)


if __name__ == "__main__":
    main()
