"""README screenshots and example exported figures, reproducibly.

Starts ``app.py`` (tiny test pair by default, or a real pair), drives it with Playwright on
Debian's Chromium, runs one generation, and saves a screenshot of each panel to
``assets/screenshots/``; then runs the same settings in-process and writes the exported figures
(PNG + SVG via kaleido) and the StepTraces JSON to ``assets/examples/``.

    .venv/bin/python scripts/screenshots.py                      # tiny test pair (seconds)
    .venv/bin/python scripts/screenshots.py --pair embedded      # the real Qwen pair (make models first)
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from ui.page_driver import CHROMIUM_FLAGS, AppStartError, choose, set_field, start_app, stop_app  # noqa: E402
PANELS = {
    "colored_text": "#colored-text",
    "draft_tree": "#tree-plot",
    "mask_bfs": "#mask-bfs",
    "mask_dfs": "#mask-dfs",
    "mask_hpd": "#mask-hpd",
    "tokens_per_s": "#speed-plot",
    "tokens_per_step": "#tokens-per-step-plot",
    "phase_timings": "#phase-plot",
    "cost_model": "#cost-model-box",
    "verify_walkthrough": "#walkthrough-box",
    "controls": "#controls",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", default="tiny", help="'tiny' (test pair) or a model for both roles, e.g. 'embedded'")
    p.add_argument("--draft", default=None, help="draft model (default: --pair)")
    p.add_argument("--target", default=None, help="target model (default: --pair)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--method", default="dyspec_greedy")
    p.add_argument("--prompt", default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--budget", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--precision", default=None, help="target and draft precision (default: the app's, auto)")
    p.add_argument("--step", type=int, default=2, help="step shown in the tree/mask shots and example exports")
    p.add_argument("--shots", type=Path, default=ROOT / "assets" / "screenshots")
    p.add_argument("--examples", type=Path, default=ROOT / "assets" / "examples")
    p.add_argument("--no-examples", action="store_true", help="screenshots only")
    p.add_argument("--examples-only", action="store_true", help="exported example figures only (no browser)")
    p.add_argument("--load-timeout", type=float, default=1800, help="seconds to wait for model loading + the run")
    return p.parse_args(argv)


def wait_for_run(page, method: str, timeout_s: float) -> None:
    """Until the status line says a run of ``method`` (any, if empty) finished or stopped (the
    previous run's status says so too, hence the method), then a refresh or two more."""
    page.wait_for_function(
        "m => { const s = document.querySelector('#status').innerText; "
        "return /finished|stopped/.test(s) && s.includes(m); }", arg=method, timeout=timeout_s * 1000)
    time.sleep(2)


def take_screenshots(args, url: str) -> list[Path]:
    from playwright.sync_api import sync_playwright

    chromium = os.environ.get("DYNTREE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    args.shots.mkdir(parents=True, exist_ok=True)
    out: list[Path] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800}, device_scale_factor=1)
            page.goto(url, timeout=120_000)
            page.wait_for_selector("#run-btn", timeout=120_000)
            # what a new user sees: Run with the app's defaults on a 1280x800 screen
            page.click("#run-btn")
            wait_for_run(page, "", args.load_timeout)
            first = args.shots / "first_screen.png"
            page.screenshot(path=str(first))
            out.append(first)
            page.set_viewport_size({"width": 1600, "height": 1200})
            choose(page, "method", args.method)
            if args.precision:
                page.click("#model-pair")
                choose(page, "precision", args.precision)
                choose(page, "draft-precision", args.precision)
            if args.prompt:
                set_field(page, "prompt", args.prompt)
            if args.max_new_tokens:
                set_field(page, "max-new-tokens", args.max_new_tokens)
            budget = args.budget or (48 if args.pair == "tiny" else None)
            if budget:
                set_field(page, "budget", budget)
            if args.temperature:
                box = page.locator("#temperature input[type=number]").first
                box.fill(str(args.temperature))
                box.press("Tab")
            page.click("#run-btn")
            wait_for_run(page, args.method, args.load_timeout)
            box = page.locator("#step-slider input[type=number]").first
            box.fill(str(args.step))
            box.press("Tab")
            page.wait_for_function(
                "s => (document.querySelector('#tree-plot .gtitle') || {}).textContent?.startsWith(`step ${s} `)",
                arg=args.step, timeout=60_000)
            for k in range(1, 4):  # walk through the first decisions of the verification
                page.click("#walk-next")
                page.wait_for_function(
                    "k => /Decision (\\d+) of (\\d+)/.test((document.querySelector('#walk-current') || {}).innerText"
                    " || '')", arg=k, timeout=60_000)
                time.sleep(1.5)
            time.sleep(1.5)
            full = args.shots / "app_live.png"
            page.screenshot(path=str(full), full_page=True)
            out.append(full)
            for name, sel in PANELS.items():
                path = args.shots / f"{name}.png"
                page.locator(sel).first.screenshot(path=str(path))
                out.append(path)
            page.get_by_role("tab", name="Compare").click()
            page.click("#compare-btn")
            page.wait_for_function(
                "() => /done|stopped/.test(document.querySelector('#compare-status').innerText)",
                timeout=args.load_timeout * 1000)
            time.sleep(2)
            path = args.shots / "compare.png"
            page.screenshot(path=str(path), full_page=True)
            out.append(path)
        finally:
            browser.close()
    return out


def export_examples(args) -> list[Path]:
    """The same run in-process, exported the way the app's Export buttons do it."""
    from ui.export import write_images, write_json
    from ui.models import HubModelProvider
    from ui.runner import run_to_end
    from ui.settings import RunSettings
    from ui.tiny import TinyModelProvider
    from ui.views import export_figures

    tiny = args.pair == "tiny"
    provider = TinyModelProvider() if tiny else HubModelProvider(args.draft or args.pair, args.target or args.pair)
    settings = RunSettings(
        draft=provider.default_draft, target=provider.default_target, device=args.device,
        dtype="float32", prompt=args.prompt or ("t1 t2 t3 t4 t5" if tiny else
                                                 "Write a Python function that returns the n-th Fibonacci number."),
        chat=not tiny, method=args.method, verifier="auto", temperature=args.temperature, top_p=1.0,
        budget=args.budget or 48, depth=6, width=4, threshold=0.05,
        max_new_tokens=args.max_new_tokens or (24 if tiny else 64), seed=0)
    record = run_to_end(provider, settings)
    args.examples.mkdir(parents=True, exist_ok=True)
    step = min(args.step, len(record.traces) - 1)
    files = write_images(export_figures(record, step, 16), args.examples, ("png", "svg"))
    files.append(write_json(record, args.examples / "steptraces.json"))
    return files


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.examples_only:
        for p in export_examples(args):
            print(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p)
        return 0
    app_args = ["--device", args.device] + (["--tiny"] if args.pair == "tiny" else
                                                ["--draft", args.draft or args.pair, "--target", args.target or args.pair])
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False")
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"dyntree-screenshots-{os.getpid()}.log"
    try:
        proc, url = start_app(app_args, env, log)
    except AppStartError as e:
        raise SystemExit(str(e)) from None
    try:
        for p in take_screenshots(args, url):
            print(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p)
    finally:
        stop_app(proc)
    if not args.no_examples:
        for p in export_examples(args):
            print(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
