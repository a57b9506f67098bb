"""What the page's mere presence costs the default Run, in one app process: the Run clicked in Chromium (``page``),
the same Run started through the app's HTTP API with Chromium on ``about:blank`` (``api``), and started through the
API while the app's page is open and left alone for ``--settle`` seconds first (``api+page``), alternated run by run.
Per run: ms/token over its steps (from ``scripts/page_stalls.py``'s step log) and, for the API runs, the CPU each
other process used while it decoded (Chromium by process type), in cores.

The page's waits poll every 100 ms (Playwright's default polls on every animation frame, reading the status's text,
which is work a user's page does not do).

    .venv/bin/python scripts/page_presence_ab.py [--rounds 5] [--settle 1] [--json OUT]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT), str(ROOT / "scripts")]

MODES = ("page", "api", "api+page")


def processes_cpu() -> dict[str, tuple[str, float]]:
    """pid -> (name, CPU seconds so far) of every process (Chromium's children named by their ``--type``)."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            args = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").split()  # (Chromium rewrites its own)
        except OSError:
            continue
        kind = [a.decode(errors="replace") for a in args if a.startswith(b"--type=")]
        fields = stat.rsplit(")", 1)[1].split()
        out[pid] = (stat[stat.index("(") + 1: stat.rindex(")")] + (f" {kind[0]}" if kind else ""),
                    (int(fields[11]) + int(fields[12])) / tick)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--settle", type=float, default=1.0, help="seconds the page is left alone before an api+page Run")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from gradio_client import Client
    from page_stalls import run_in_page
    from test_browser import _opened, _ready
    from ui_form import form_values

    from dyntree_core.bench.result_file import write_result
    from ui.layout import AppDefaults
    from ui.page_driver import start_app, stop_app

    d = AppDefaults()
    values = form_values(draft="embedded", target="embedded", device=d.device, dtype=d.dtype, prompt=d.prompt,
                         chat=d.chat, method=d.method, verifier="auto", temperature=0.0, top_p=1.0, budget=d.budget,
                         depth=d.depth, width=d.width, threshold=0.05, max_new_tokens=d.max_new_tokens, seed=0,
                         offload=False, precision=d.precision, draft_precision=d.draft_precision)
    log = Path("/tmp/dyntree_presence.log")
    log.write_text("")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False")
    proc, url = start_app(["--serve", "--log", str(log)], env, log.with_suffix(".app.log"),
                          script=ROOT / "scripts" / "page_stalls.py")

    def steps() -> tuple[float, int, int]:
        rows = [line.split() for line in log.read_text().splitlines() if line.startswith("S ")]
        return sum(float(r[2]) for r in rows), sum(int(r[3]) for r in rows), len(rows)

    def decoded(tokens: int, timeout_s: float = 300) -> tuple[float, int, int]:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            got = steps()
            if got[1] >= tokens:
                return got
            time.sleep(0.1)
        raise TimeoutError(f"the API Run did not reach {tokens} tokens in {timeout_s} s")

    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    usage: dict[str, collections.Counter] = {m: collections.Counter() for m in MODES}
    try:
        client = Client(url, verbose=False)
        with _opened(url, 1400, 1000) as page:
            for i in range(args.rounds + 1):
                for mode in MODES:
                    log.write_text("")
                    if mode != "api":
                        page.goto(url)
                        _ready(page)
                        time.sleep(args.settle)
                    c0, t0 = processes_cpu(), time.monotonic()
                    if mode == "page":
                        run_in_page(page)
                        seconds, tokens, n = steps()
                    else:
                        client.predict(False, *values, api_name="/on_run")
                        seconds, tokens, n = decoded(d.max_new_tokens)
                    c1, wall = processes_cpu(), time.monotonic() - t0
                    page.goto("about:blank")
                    time.sleep(2)
                    if i == 0:
                        continue  # (the warm-up: loads and plans)
                    for pid, (name, cpu) in c1.items():
                        if pid in c0 and pid != str(proc.pid):
                            usage[mode][name] += (cpu - c0[pid][1]) / wall / args.rounds
                    runs[mode].append({"ms_per_token": round(1e3 * seconds / tokens, 2), "steps": n,
                                       "wall_s": round(wall, 2)})
                    print(mode, runs[mode][-1], flush=True)
    finally:
        stop_app(proc)
    summary = {m: {"ms_per_token_median": statistics.median(r["ms_per_token"] for r in rs),
                   "other_processes_cores": {k: round(v, 3) for k, v in usage[m].most_common(6)}}
               for m, rs in runs.items()}
    for m, s in summary.items():
        print(f"{m:9s} {s}")
    if args.json:
        write_result(args.json, "scripts/page_presence_ab.py", {"runs": runs, "summary": summary})


if __name__ == "__main__":
    main()
