"""What Chromium spends drawing the page while the default Run decodes, and what that costs the run: default Runs in
Chromium on the real pair, each with Chromium's own counters read before the click and after the run finished (the
DevTools protocol's ``Performance.getMetrics``: script, layout, style and task seconds of the page's main thread) and
the run's ms/token (``page_stalls.run_in_page``: its waits poll every 100 ms, not on every animation frame);
variants leave some Live outputs out of the refreshes while the run goes on (they are drawn once it finished),
alternated Run by Run in one app and one page.

The app runs as ``scripts/page_stalls.py`` serves it (forwards and refreshes logged), with ``Controller.live`` wrapped
to skip the outputs a file names (re-read at every refresh; no product code changes).

    .venv/bin/python scripts/page_render_cost.py [--rounds 4] [--variants none cost_model text_html,cost_model ...]
                                                 [--drop-figures] [--json OUT]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT), str(ROOT / "scripts")]

#: Chromium's counters read per Run (seconds, except the counts)
METRICS = ("TaskDuration", "ScriptDuration", "LayoutDuration", "RecalcStyleDuration", "LayoutCount", "RecalcStyleCount")


#: a variant's short name for the Live tab's figures
FIGURES = {"figures": "tree_plot,mask_bfs,mask_dfs,mask_hpd,phase_plot,walkthrough,speed_plot,steps_plot"}


def serve(port: int, log: Path, skip_file: Path, drop_figures: bool = False) -> int:
    """``page_stalls.serve`` with the Live outputs ``skip_file`` names left out of a running session's refreshes;
    ``drop_figures``: the eight figures are not outputs of the refresh at all (never drawn: what a refresh costs
    the page when it does not carry them)."""
    import gradio as gr

    import page_stalls
    from ui.controller import Controller

    real_live = Controller.live

    def live(self, state, block):
        out = real_live(self, state, block)
        try:
            names = [n for n in skip_file.read_text().split(",") if n.strip() and n.strip() != "none"]
        except OSError:
            names = []
        if state.running:
            for name in (x.strip() for n in names for x in FIGURES.get(n.strip(), n).split(",")):
                comp = getattr(self.c, name)
                if comp in out:
                    out[comp] = gr.skip()
            if names:
                state.rendered_version = -1  # (the skipped outputs are drawn at the first refresh after the run)
        return out

    Controller.live = live
    if drop_figures:
        from ui.layout import Components

        names = FIGURES["figures"].split(",")
        outputs = Components.live_outputs.fget
        Components.live_outputs = property(
            lambda self: [x for x in outputs(self) if all(x is not getattr(self, n) for n in names)])
        kept = Controller.live

        def without_figures(self, state, block):
            out = kept(self, state, block)
            for n in names:
                out.pop(getattr(self.c, n), None)
            return out

        Controller.live = without_figures
    return page_stalls.serve(port, log)


def _metrics(cdp) -> dict[str, float]:
    got = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
    return {k: got.get(k, 0.0) for k in METRICS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--variants", nargs="+", default=["none", "cost_model,text_html,step_slider", "figures"],
                    help="comma lists of Live outputs (``ui.layout`` names; figures: all eight figures) or none")
    ap.add_argument("--drop-figures", action="store_true",
                    help="serve the app with the eight figures removed from the refresh's outputs (never drawn)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--log", type=Path, default=Path("/tmp/dyntree_render_cost.log"))
    ap.add_argument("--skip-file", type=Path, default=Path("/tmp/dyntree_render_cost.skip"))
    args = ap.parse_args()
    if args.serve:
        sys.exit(serve(args.port, args.log, args.skip_file, args.drop_figures))

    from page_stalls import run_in_page
    from page_vs_headless import _parse
    from test_browser import _opened, _status

    from dyntree_core.bench.result_file import write_result
    from ui.page_driver import start_app, stop_app

    args.log.write_text("")
    args.skip_file.write_text("none")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False")
    proc, url = start_app(["--serve", "--log", str(args.log), "--skip-file", str(args.skip_file),
                           *(["--drop-figures"] if args.drop_figures else [])], env,
                          args.log.with_suffix(".app.log"), script=Path(__file__))
    runs: dict[str, list[dict]] = {v: [] for v in args.variants}
    try:
        with _opened(url, 1400, 1000) as page:
            cdp = page.context.new_cdp_session(page)
            cdp.send("Performance.enable")
            for i in range(args.rounds + 1):
                for variant in args.variants:
                    args.skip_file.write_text(variant)
                    args.log.write_text("")
                    m0, t0 = _metrics(cdp), time.monotonic()
                    run_in_page(page)
                    m1, wall = _metrics(cdp), time.monotonic() - t0
                    refreshes = sum(1 for line in args.log.read_text().splitlines() if line.startswith("T "))
                    time.sleep(3)  # (the finished run's figures are drawn before the next click)
                    if i == 0:
                        continue  # (the warm-up round: loads and plans)
                    row = {**_parse(_status(page)), "wall_s": round(wall, 2), "refreshes": refreshes,
                           **{k: round(m1[k] - m0[k], 3) for k in METRICS}}
                    runs[variant].append(row)
                    print(variant, row, flush=True)
    finally:
        stop_app(proc)
    summary = {}
    for variant, rows in runs.items():
        ok = [r for r in rows if "ms_per_token" in r]
        summary[variant] = {k: round(statistics.median(r[k] for r in ok), 3)
                            for k in ("ms_per_token", "speed_over_plain_inside", *METRICS) if ok}
        print(f"{variant:40s} {summary[variant]}")
    if args.json:
        write_result(args.json, "scripts/page_render_cost.py", {"runs": runs, "summary": summary})


if __name__ == "__main__":
    main()
