"""Ctrl-C in the app with work under way: ``make run``'s app on the real pair, the default Run clicked in Chromium,
then SIGINT (what Ctrl-C sends) ``--after`` seconds later, while it decodes or while ``auto``'s background
measurement runs (on a machine not measured yet it starts once the first Run has finished). Prints the exit status
(-6: the process aborted, "terminate called without an active exception"), the seconds from the signal to Gradio's
"closing server", to the app's "stopping" and "stopped" lines and to the exit, and the status line at the signal.

    .venv/bin/python scripts/ctrl_c_exit.py [--after 6 12] [--rounds 1] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

MARKS = {"closing": "Keyboard interruption", "stopping": "DynTree: stopping", "stopped": "DynTree: stopped"}


def one(after_s: float, log: Path) -> dict:
    from test_browser import _opened, _ready

    from ui.page_driver import start_app

    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False",
               PYTHONUNBUFFERED="1")
    proc, url = start_app([], env, log)  # (SIGINT at its default in the app, as from a terminal)
    seen: dict[str, float] = {}
    with _opened(url, 1280, 800) as page:
        _ready(page)
        page.click("#run-btn")
        time.sleep(after_s)
        status = page.inner_text("#status").splitlines()[0]
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        while proc.poll() is None and time.monotonic() - t0 < 120:
            text = log.read_text(errors="replace")
            for key, mark in MARKS.items():
                if mark in text and key not in seen:
                    seen[key] = round(time.monotonic() - t0, 2)
            time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
        exit_s = round(time.monotonic() - t0, 2)
    text = log.read_text(errors="replace")
    return {"after_s": after_s, "returncode": proc.wait(), "exit_s": exit_s, "seen_s": seen,
            "terminate_called": "terminate called" in text, "status_at_signal": status,
            "measurement_running": "auto's background measurement: [" in text}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--after", type=float, nargs="+", default=[6.0, 12.0], help="seconds after the click")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from dyntree_core.bench.result_file import write_result

    rows = []
    for _ in range(args.rounds):
        for after in args.after:
            row = one(after, Path("/tmp/dyntree_ctrl_c.log"))
            print(json.dumps(row))
            rows.append(row)
    if args.json:
        write_result(args.json, "scripts/ctrl_c_exit.py", {"runs": rows})


if __name__ == "__main__":
    main()
