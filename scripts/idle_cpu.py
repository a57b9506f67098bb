"""CPU the app and one Chromium tab use while nothing happens: ``python app.py`` (the real defaults, no Run)
and its page at 1280x800, measured over 30 s windows after the page settled, then the same browser on
about:blank; CPU seconds from /proc of every Chromium process and of the app.

    .venv/bin/python scripts/idle_cpu.py [--windows 2]
"""

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from test_browser import _opened  # noqa: E402
from ui.page_driver import start_app, stop_app  # noqa: E402

CLK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except OSError:  # (a process that ended)
            pass
    return total / CLK


def chromium_pids() -> list[int]:
    out = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            if "chrom" in Path(f"/proc/{p}/comm").read_text():
                out.append(int(p))
        except OSError:
            pass
    return out


def window(app_pid: int, seconds: float) -> tuple[float, float]:
    pids = chromium_pids()
    c0, a0, t0 = cpu_seconds(pids), cpu_seconds([app_pid]), time.monotonic()
    time.sleep(seconds)
    dt = time.monotonic() - t0
    return (cpu_seconds(pids) - c0) / dt, (cpu_seconds([app_pid]) - a0) / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=2)
    args = ap.parse_args()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False")
    proc, url = start_app([], env, Path("/tmp/dyntree_idle_app.log"), timeout_s=180)
    try:
        with _opened(url, 1280, 800) as page:
            time.sleep(20)
            for _ in range(args.windows):
                chromium, app = window(proc.pid, 30)
                print(f"page idle, 30 s: Chromium {100 * chromium:.1f}% of a core, app {100 * app:.1f}%", flush=True)
            page.goto("about:blank")
            time.sleep(5)
            chromium, app = window(proc.pid, 30)
            print(f"about:blank, 30 s: Chromium {100 * chromium:.1f}% of a core, app {100 * app:.1f}%", flush=True)
    finally:
        stop_app(proc)


if __name__ == "__main__":
    main()
