"""What the page costs a run's forwards: default Runs in Chromium on the real pair, with every target forward and
every refresh handler of the app logged, then each forward's excess over the median of its row count, for the
forwards that overlapped a refresh and for the others.

The app runs in its own process as ``make run`` starts it (``app.main``), with wrappers installed first (no
product code changes): around the engine's ``masked_forward`` and ``causal_forward`` (rows, wall time, the process's voluntary context
switches: a two-thread forward waiting at its barriers for a core the page took switches tens of times instead of
2-4) and around ``Controller.on_tick`` (when each refresh ran). How the first refresh's blank figures were found to
stall a forward 180-200 ms (docs/USAGE.md, "The previous figures dimmed").

    .venv/bin/python scripts/page_stalls.py [--runs 6] [--json OUT]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

#: how often the scripts' waits read the page's status (Playwright's default polls on every animation frame: the
#: status's text read 60 times a second is renderer work a user's page does not do, beside the run being measured)
POLL_MS = 100
STATUS = "document.querySelector('#status [data-testid=markdown]')"


def run_in_page(page) -> None:
    """Click the page's Run and wait until its status has changed and says "finished" (polling every ``POLL_MS``)."""
    from test_browser import _status

    before = _status(page)
    page.click("#run-btn")
    page.wait_for_function(f"b => {STATUS}.innerText !== b", arg=before, timeout=600_000, polling=POLL_MS)
    page.wait_for_function(f"w => {{ const e = {STATUS}; return e && e.innerText.includes(w); }}", arg="finished",
                           timeout=600_000, polling=POLL_MS)


@contextlib.contextmanager
def logged_forwards(log: Path):
    """Every forward of the engine (a tree step's ``masked_forward``, a plain step's ``causal_forward``, the draft
    source's level forwards) appended to
    ``log`` as ``F start rows seconds switches layers``, and every decoding step of the app's runs as ``S kind
    step_seconds tokens``, its phases' seconds (``trace.PHASES`` order) and the clock at its end, while the block runs."""
    from dyntree_core.decode import draft_source, engine
    from dyntree_core.openmp_team import voluntary_switches
    from dyntree_core.trace import PHASES, StepTrace
    from ui.session import Generation

    out = open(log, "a", buffering=1)

    def logged(real):
        def forward(model, cache, tokens, *args, **kwargs):
            s0, t0 = voluntary_switches(), time.perf_counter()
            logits = real(model, cache, tokens, *args, **kwargs)
            dt = time.perf_counter() - t0
            layers = getattr(getattr(model, "config", None), "num_hidden_layers", 0)
            out.write(f"F {t0:.4f} {len(tokens)} {dt:.5f} {voluntary_switches() - s0} {layers}\n")
            return logits
        return forward

    real_advance = Generation.advance

    def advance(self):
        item = real_advance(self)
        if isinstance(item, StepTrace):
            kind = (item.draft_source or item.method).replace(" ", "_")
            phases = " ".join(f"{getattr(item.timings, p):.5f}" for p in PHASES)
            out.write(f"S {kind} {item.step_seconds:.5f} {len(item.committed)} {phases} {time.perf_counter():.4f}\n")
        return item

    reals = engine.masked_forward, engine.causal_forward, draft_source.masked_forward
    engine.masked_forward, engine.causal_forward, draft_source.masked_forward = (logged(r) for r in reals)
    Generation.advance = advance
    try:
        yield out
    finally:
        engine.masked_forward, engine.causal_forward, draft_source.masked_forward = reals
        Generation.advance = real_advance
        out.close()


def serve(port: int, log: Path) -> int:
    """Run the app with the forward and refresh loggers installed."""
    from ui.controller import Controller

    real_tick = Controller.on_tick

    with logged_forwards(log) as out:
        def tick(self, state, block):
            t0 = time.perf_counter()
            try:
                return real_tick(self, state, block)
            finally:
                out.write(f"T {t0:.4f} {time.perf_counter() - t0:.5f}\n")

        Controller.on_tick = tick
        import app

        return app.main(["--port", str(port)])


def analyze(log: Path) -> dict:
    """Each forward of the deepest model (the target) against the median of its row count."""
    forwards, ticks = [], []
    for line in log.read_text().splitlines():
        f = line.split()
        if f and f[0] == "F":
            forwards.append((float(f[1]), int(f[2]), float(f[3]), int(f[4]), int(f[5])))
        elif f and f[0] == "T":
            ticks.append(float(f[1]))
    target = max((f[4] for f in forwards), default=0)
    forwards = [f for f in forwards if f[4] == target]
    by_rows = collections.defaultdict(list)
    for _, rows, dt, _, _ in forwards:
        by_rows[rows].append(dt)
    median = {rows: statistics.median(v) for rows, v in by_rows.items()}
    groups: dict[str, list[tuple[float, int]]] = {"overlapping a refresh": [], "the others": []}
    for t0, rows, dt, switches, _ in forwards:
        hit = any(t0 - 0.05 <= t <= t0 + dt for t in ticks)
        groups["overlapping a refresh" if hit else "the others"].append((dt - median[rows], switches))
    summary = {}
    for name, xs in groups.items():
        if xs:
            summary[name] = {"forwards": len(xs), "excess_ms_mean": round(1e3 * statistics.fmean(x for x, _ in xs), 1),
                             "excess_ms_median": round(1e3 * statistics.median(x for x, _ in xs), 1),
                             "excess_ms_total": round(1e3 * sum(x for x, _ in xs), 1),
                             "switches_median": statistics.median(s for _, s in xs)}
    return {"target_forwards": len(forwards), "refreshes": len(ticks), **summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=6, help="default Runs after a warm-up one")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--log", type=Path, default=Path("/tmp/dyntree_page_stalls.log"))
    args = ap.parse_args()
    if args.serve:
        sys.exit(serve(args.port, args.log))

    from test_browser import _opened, _status
    from dyntree_core.bench.result_file import write_result
    from ui.page_driver import start_app, stop_app

    args.log.write_text("")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False")
    proc, url = start_app(["--serve", "--log", str(args.log)], env, args.log.with_suffix(".app.log"),
                          script=Path(__file__))
    try:
        statuses = []
        with _opened(url, 1400, 1000) as page:
            for i in range(args.runs + 1):
                run_in_page(page)
                if i == 0:
                    time.sleep(3)
                    args.log.write_text("")  # (the warm-up Run loads and plans: not counted)
                    continue
                statuses.append(_status(page).split("\n")[0])
                print(statuses[-1][:160], flush=True)
                time.sleep(3)
    finally:
        stop_app(proc)
    result = analyze(args.log)
    print(json.dumps(result, indent=1))
    if args.json:
        write_result(args.json, "scripts/page_stalls.py", {"runs": args.runs, "statuses": statuses, **result})


if __name__ == "__main__":
    main()
