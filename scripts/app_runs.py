"""Single runs against Compare columns in one page of ``python app.py`` (the real defaults, Method auto), with
the CPU Chromium and the app used during each single run: Run twice (auto), Compare (plain, chain, auto's
column; no transformers column), then a plain Run. Prints each status line and Compare column.

``--ab N``: instead, after one warm-up Run, N rounds of a default Run (Method auto) and a plain one (Method
autoregressive) in the same page, alternated (auto first in even rounds): each Run's measured ms/token and what its
status line says of its speed over plain decoding (timed inside the run: ``decode.plain_probes``), to hold that
claim against the plain Runs beside it; ``--json OUT`` writes them with the machine's facts.

    .venv/bin/python scripts/app_runs.py [--ab 3 --json OUT]
"""

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "scripts"), str(ROOT)]

from idle_cpu import chromium_pids, cpu_seconds  # noqa: E402
from test_browser import _opened, _status, _wait_compare_done, _wait_status  # noqa: E402
from ui.page_driver import choose, start_app, stop_app  # noqa: E402


def run(page, app_pid: int, label: str) -> dict:
    before = _status(page)
    pids = chromium_pids()
    c0, a0, t0 = cpu_seconds(pids), cpu_seconds([app_pid]), time.monotonic()
    page.click("#run-btn")
    page.wait_for_function("b => document.querySelector('#status [data-testid=markdown]').innerText !== b",
                           arg=before, timeout=120_000)
    _wait_status(page, "finished", 600)
    dt = time.monotonic() - t0
    chromium, app = (cpu_seconds(pids) - c0) / dt, (cpu_seconds([app_pid]) - a0) / dt
    time.sleep(1.5)  # (the check of the prediction is shown on the next refresh)
    status = _status(page)
    print(f"--- {label} ({dt:.1f} s; Chromium {100 * chromium:.0f}% of a core, app {100 * app:.0f}%):\n"
          f"{status[:700]}", flush=True)
    return {"label": label, "seconds": round(dt, 2), "chromium_cores": round(chromium, 3), "app_cores": round(app, 3),
            "status": status}


def _numbers(status: str) -> dict:
    """A finished Run's ms/token (its summary's tokens/s: the prefill and any plain probe included), its check's
    measured ms/token (its steps without the probes), and its check's speed over plain decoding and the plain decoding
    that speed is over, as its status line states them (None where it states none)."""
    tok_s = re.search(r"([\d.]+) tok/s", status)
    checked = re.search(r"measured (\d+) ms/token over", status)
    speed = re.search(r"([\d.]+)x the speed of plain decoding at \S+ timed (inside|beside) it \(([^)]*?)([\d.]+) "
                      r"ms/token\)", status)
    return {"ms_per_token": round(1e3 / float(tok_s.group(1)), 1) if tok_s else None,
            "checked_ms_per_token": int(checked.group(1)) if checked else None,
            "stated_speedup": float(speed.group(1)) if speed else None,
            "stated_plain_ms_per_token": float(speed.group(4)) if speed else None,
            "timed": speed.group(2) if speed else None}


def ab(page, app_pid: int, rounds: int) -> dict:
    """``rounds`` alternated pairs of a default Run and a plain Run (``--ab``)."""
    runs = []
    choose(page, "method", "auto")
    run(page, app_pid, "warm-up (defaults)")
    for r in range(rounds):
        for method in (("auto", "autoregressive") if r % 2 == 0 else ("autoregressive", "auto")):
            choose(page, "method", method)
            time.sleep(1.0)
            runs.append({**run(page, app_pid, f"round {r}: {method}"), "method": method, "round": r})
            runs[-1].update(_numbers(runs[-1]["status"]))
    auto = [x["ms_per_token"] for x in runs if x["method"] == "auto" and x["ms_per_token"]]
    plain = [x["ms_per_token"] for x in runs if x["method"] != "auto" and x["ms_per_token"]]
    stated = [x["stated_speedup"] for x in runs if x["stated_speedup"]]
    out = {"runs": runs, "auto_ms_per_token_median": statistics.median(auto) if auto else None,
           "plain_ms_per_token_median": statistics.median(plain) if plain else None,
           "stated_speedups": stated}
    if auto and plain:
        out["measured_speedup_of_medians"] = round(statistics.median(plain) / statistics.median(auto), 3)
    print(f"auto {auto} ms/token, plain {plain}; stated speed-ups {stated}; "
          f"plain / auto (medians) {out.get('measured_speedup_of_medians')}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ab", type=int, default=0, help="rounds of a default Run and a plain Run, alternated")
    ap.add_argument("--json", help="write the --ab runs here")
    args = ap.parse_args()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False")
    proc, url = start_app([], env, Path("/tmp/dyntree_app_runs.log"), timeout_s=180)
    try:
        with _opened(url, 1400, 1200) as page:
            if args.ab:
                from dyntree_core.bench.result_file import result_header

                out = {**result_header("scripts/app_runs.py --ab"), **ab(page, proc.pid, args.ab)}
                if args.json:
                    Path(args.json).write_text(json.dumps(out, indent=1))
                return
            run(page, proc.pid, "Run 1 (defaults)")
            run(page, proc.pid, "Run 2 (defaults)")
            page.get_by_role("tab", name="Compare").click()
            page.locator("#compare-hf input").uncheck()
            page.click("#compare-btn")
            _wait_compare_done(page, 64, 900)
            for i in range(3):
                print(f"--- Compare column {i}:\n{page.inner_text(f'#compare-stats-{i}')[:700]}", flush=True)
            page.get_by_role("tab", name="Live").click()
            page.click("#model-pair")
            choose(page, "method", "autoregressive")
            run(page, proc.pid, "Run 3 (autoregressive)")
    finally:
        stop_app(proc)


if __name__ == "__main__":
    main()
