"""Driving the app in a browser (Playwright pages; Playwright itself is imported by the callers):
start the app on a free port, fill a field, pick a dropdown choice. Used by the browser test and
by ``scripts/screenshots.py``."""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import sys
import time
import urllib.request
from pathlib import Path
from typing import Mapping, Sequence

ROOT = Path(__file__).resolve().parents[1]
# a fresh profile comes from Playwright's launch() itself (it refuses --user-data-dir in args)
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run"]


class AppStartError(RuntimeError):
    """The app exited or did not answer in time; the message ends with its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app(args: Sequence[str], env: Mapping[str, str], log: Path, timeout_s: float = 180.0,
              script: Path = ROOT / "app.py") -> tuple[subprocess.Popen, str]:
    """Run ``app.py <args> --port <free port>`` (or another ``script`` that serves the app and takes ``--port``)
    with ``env`` (output to ``log``) and wait until it serves its page; returns the process and the URL. The app
    starts with SIGINT at its default, as from a terminal, so Ctrl-C (``send_signal(SIGINT)``) reaches it: a shell's
    background job runs with SIGINT ignored, a child inherits that, and Python then never raises KeyboardInterrupt
    (a handler here is reset to the default in the child)."""
    port = free_port()
    main = threading.current_thread() is threading.main_thread()  # (only the main thread may set a handler)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler) if main else None
    try:
        with open(log, "w") as fh:
            proc = subprocess.Popen([sys.executable, str(script), *args, "--port", str(port)], cwd=ROOT,
                                    env=dict(env), stdout=fh, stderr=subprocess.STDOUT)
    finally:
        if main:
            signal.signal(signal.SIGINT, inherited)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise AppStartError(f"app exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.terminate()
            raise AppStartError(f"app did not start in {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


def stop_app(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()


def set_field(page, elem: str, value) -> None:
    """Type ``value`` into the text box or number input of component ``#elem`` and leave it."""
    box = page.locator(f"#{elem} textarea, #{elem} input").first
    box.fill(str(value))
    box.press("Tab")


def choose(page, elem: str, value: str) -> None:
    """Pick ``value`` in the dropdown ``#elem``."""
    box = page.locator(f"#{elem} input").first
    box.click()
    box.fill(value)
    page.locator("ul[role=listbox] li", has_text=value).first.click()
