"""Single runs against Compare columns in one page of ``python app.py`` (the real defaults, Method auto), with
the CPU Chromium and the app used during each single run: Run twice (auto), Compare (plain, chain, auto's
column; no transformers column), then a plain Run. Prints each status line and Compare column.

    .venv/bin/python scripts/app_runs.py
"""

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "scripts"), str(ROOT)]

from idle_cpu import chromium_pids, cpu_seconds  # noqa: E402
from test_browser import _opened, _status, _wait_compare_done, _wait_status  # noqa: E402
from ui.page_driver import choose, start_app, stop_app  # noqa: E402


def run(page, app_pid: int, label: str) -> None:
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
    print(f"--- {label} ({dt:.1f} s; Chromium {100 * chromium:.0f}% of a core, app {100 * app:.0f}%):\n"
          f"{_status(page)[:700]}", flush=True)


def main() -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False")
    proc, url = start_app([], env, Path("/tmp/dyntree_app_runs.log"), timeout_s=180)
    try:
        with _opened(url, 1400, 1200) as page:
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
