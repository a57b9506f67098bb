"""Stop clicked while the first Run loads its models: ``make run``'s app on the real pair, the default Run clicked in
Chromium, Stop ``--after`` seconds later (the models still loading), then the page watched until the app is idle.
Prints per round the status line when Stop was clicked, the seconds from Stop to the status's end state, that state,
and the tokens the page shows (a load that went on ran the whole Run after the Stop).

    .venv/bin/python scripts/stop_during_load.py [--after 1.5] [--rounds 1] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

#: the status's words once nothing runs any more
ENDED = ("Stopped while loading", "stopped", "finished")


def one(after_s: float, log: Path) -> dict:
    from test_browser import _opened, _ready, _status, _tokens

    from ui.page_driver import start_app

    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False",
               PYTHONUNBUFFERED="1")
    proc, url = start_app([], env, log, script=ROOT / "app.py")
    try:
        with _opened(url, 1280, 800) as page:
            _ready(page)
            page.click("#run-btn")
            time.sleep(after_s)
            at_stop = _status(page).splitlines()[0]
            page.click("#stop-btn")
            t0 = time.monotonic()
            while time.monotonic() - t0 < 300:
                status = _status(page)
                first = status.splitlines()[0] if status else ""
                if any(w in first for w in ENDED) and "stopping" not in status:
                    break
                time.sleep(0.05)
            idle_s = round(time.monotonic() - t0, 2)
            return {"after_s": after_s, "status_at_stop": at_stop, "stop_to_idle_s": idle_s, "status_then": first,
                    "tokens_shown": _tokens(page)}
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--after", type=float, default=1.5, help="seconds after the Run click")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = []
    for r in range(args.rounds):
        row = one(args.after, Path(f"/tmp/stop_during_load_{os.getpid()}_{r}.log"))
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        from dyntree_core.bench.result_file import write_result

        write_result(args.json, "scripts/stop_during_load.py", {"rounds": rows})


if __name__ == "__main__":
    main()
