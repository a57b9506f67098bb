"""The app's default Run with its page in Chromium against the same Run with no page, alternated run by run: each
forward's wall time by model and row count (a tree step's ~8 rows, a plain step's 1, the draft's one-row level
forwards), each step's phases, each tree step's draft phase split into the draft's forwards and the Python between
them (steps a refresh handler overlapped apart), each run's ms/token and its speed over the
plain steps timed inside it. Where the page costs a tree's wide forward more than a one-row forward, the
ratio page / headless by row count says so.

Headless runs take the app's own path (``ui.runner.start_generation`` with the page's default settings, plain probes
on, ``auto`` planned from the cached measurements); the page's are ``scripts/page_stalls.py``'s served app. A memory
probe before each run names its spell.

    .venv/bin/python scripts/page_vs_headless.py [--rounds 4] [--json OUT]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT), str(ROOT / "scripts")]


def _forwards(log: Path) -> list[tuple[str, int, float]]:
    """(model, rows, seconds) of the forwards in a page_stalls log: ``target`` (the deepest model's) or ``draft``."""
    rows = [line.split() for line in log.read_text().splitlines() if line.startswith("F ")]
    deepest = max((int(f[5]) for f in rows), default=0)
    return [("target" if int(f[5]) == deepest else "draft", int(f[2]), float(f[3])) for f in rows]


CHECK = re.compile(r"measured (\d+) ms/token over (\d+) steps?.*?(\d+\.\d\d)x the speed of plain decoding at \w+ "
                   r"timed inside it \((\d+) plain steps?: ([\d.]+) ms/token\)", re.S)


def _parse(status: str) -> dict:
    """ms/token, steps, speed over the plain steps inside the run and their ms/token, from a run's check line."""
    m = CHECK.search(status)
    if m is None:
        return {"unparsed": status[:300]}
    k = re.search(r"chain \(k<=(\d+)", status)
    return {"ms_per_token": int(m.group(1)), "steps": int(m.group(2)), "speed_over_plain_inside": float(m.group(3)),
            "plain_steps": int(m.group(4)), "plain_ms": float(m.group(5)), "plan": status.split(" · ")[0][:80],
            "chain_k": int(k.group(1)) if k else None}


def _steps(log: Path) -> list[tuple[str, float, int, dict[str, float]]]:
    """(kind, seconds, tokens, phases) of each step in a log of ``page_stalls.logged_forwards``."""
    from dyntree_core.trace import PHASES

    out = []
    for line in log.read_text().splitlines():
        if line.startswith("S "):
            f = line.split()
            out.append((f[1], float(f[2]), int(f[3]), dict(zip(PHASES, map(float, f[4:])))))
    return out


def _draft_split(log: Path) -> list[dict]:
    """Per tree step of a ``page_stalls.logged_forwards`` log of one run, its first step left out (the draft's prefill
    forwards come before it): its draft phase, the draft model's forwards inside it (their count and summed seconds),
    the rest of the phase (the Python between the forwards) and whether a refresh handler (``T`` lines, the page's
    only) ran during the step."""
    from dyntree_core.trace import PHASES

    lines = [line.split() for line in log.read_text().splitlines()]
    deepest = max((int(f[5]) for f in lines if f and f[0] == "F"), default=0)
    ticks = [(float(f[1]), float(f[2])) for f in lines if f and f[0] == "T"]
    out, pending, first = [], [], True
    for f in lines:
        if f and f[0] == "F" and int(f[5]) != deepest:
            pending.append(float(f[3]))
        elif f and f[0] == "S":
            phases = dict(zip(PHASES, map(float, f[4:4 + len(PHASES)])))
            end = float(f[4 + len(PHASES)]) if len(f) > 4 + len(PHASES) else None
            if pending and phases["draft"] > 0 and not first:
                start = None if end is None else end - float(f[2])
                hit = start is not None and any(t < end and t + d > start for t, d in ticks)
                out.append({"kind": f[1], "draft": phases["draft"], "forwards": len(pending),
                            "forward_s": sum(pending), "rest_s": phases["draft"] - sum(pending), "refresh": hit})
            pending, first = [], False
    return out


def _by_rows(forwards: list[tuple[str, int, float]]) -> dict[tuple[str, int], list[float]]:
    out: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
    for model, rows, dt in forwards:
        out[(model, rows)].append(dt)
    return out


def headless_run(provider, settings, log: Path) -> str:
    """One default Run with no page (the app's path), its forwards and steps logged; returns its note and check."""
    from page_stalls import logged_forwards

    from ui.runner import start_generation

    with logged_forwards(log):
        gen = start_generation(provider, settings, plain_probes=True)
        while gen.advance() is not None:
            pass
    rec = gen.record
    check = rec.prediction_check()
    return f"{rec.settings.method} · {rec.note}\n" + (check.text(()) if check is not None else "")


def default_settings():
    from ui.layout import AppDefaults
    from ui.settings import settings_from_form
    from ui_form import form_values

    d = AppDefaults()
    return settings_from_form(*form_values(
        draft="embedded", target="embedded", device=d.device, dtype=d.dtype, prompt=d.prompt, chat=d.chat,
        method=d.method, verifier="auto", temperature=0.0, top_p=1.0, budget=d.budget, depth=d.depth, width=d.width,
        threshold=0.05, max_new_tokens=d.max_new_tokens, seed=0, offload=False, precision=d.precision,
        draft_precision=d.draft_precision))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from page_stalls import run_in_page
    from test_browser import _opened, _ready, _status

    from dyntree_core.bench.result_file import write_result
    from dyntree_core.planning.profiling import run_probe
    from ui.models import HubModelProvider
    from ui.page_driver import start_app, stop_app

    page_log, head_log = Path("/tmp/dyntree_pvh_page.log"), Path("/tmp/dyntree_pvh_headless.log")
    page_log.write_text("")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False")
    proc, url = start_app(["--serve", "--log", str(page_log)], env, page_log.with_suffix(".app.log"),
                          script=ROOT / "scripts" / "page_stalls.py")
    provider, settings = HubModelProvider("embedded", "embedded"), default_settings()
    runs: dict[str, list[dict]] = {"page": [], "headless": []}
    forwards: dict[str, list[tuple[str, int, float]]] = {"page": [], "headless": []}
    step_log: dict[str, list] = {"page": [], "headless": []}
    drafts: dict[str, list[dict]] = {"page": [], "headless": []}
    try:
        with _opened(url, 1400, 1000) as page:
            for i in range(args.rounds + 1):
                for mode in ("page", "headless"):
                    probe = run_probe()
                    if mode == "page":
                        if page.url != url:
                            page.goto(url)
                            _ready(page)
                        page_log.write_text("")
                        run_in_page(page)
                        status = _status(page)
                        got, steps, split = _forwards(page_log), _steps(page_log), _draft_split(page_log)
                        page.goto("about:blank")  # (the headless run has no page refreshing beside it)
                    else:
                        head_log.write_text("")
                        status = headless_run(provider, settings, head_log)
                        got, steps, split = _forwards(head_log), _steps(head_log), _draft_split(head_log)
                    if i == 0:
                        continue  # (the warm-up: loads and plans)
                    runs[mode].append({"probe_gb_per_s": probe, **_parse(status)})
                    forwards[mode].extend(got)
                    step_log[mode].extend(steps)
                    drafts[mode].extend(dict(d, plan=runs[mode][-1].get("chain_k")) for d in split)
                    print(mode, runs[mode][-1], flush=True)
                    time.sleep(2)
    finally:
        stop_app(proc)
    rows = {}
    page_rows, head_rows = _by_rows(forwards["page"]), _by_rows(forwards["headless"])
    for key in sorted(set(page_rows) & set(head_rows)):
        p, h = statistics.median(page_rows[key]), statistics.median(head_rows[key])
        rows[f"{key[0]}:{key[1]}"] = {"page_ms": round(p * 1e3, 2), "headless_ms": round(h * 1e3, 2),
                                      "page_over_headless": round(p / h, 3),
                                      "forwards": [len(page_rows[key]), len(head_rows[key])]}
        print(f"{key[0]:6s} rows {key[1]:2d}: page {p * 1e3:6.1f} ms ({len(page_rows[key])})  headless {h * 1e3:6.1f} ms "
              f"({len(head_rows[key])})  page/headless {p / h:.3f}")
    phases = {}
    kinds = sorted({k for m in step_log.values() for k, *_ in m})
    for kind in kinds:
        for part in ("step", "draft", "tree_build", "mask", "target_forward", "verify", "kv_compaction"):
            med = {}
            for mode, steps in step_log.items():
                xs = [sec if part == "step" else ph[part] for k, sec, _, ph in steps if k == kind]
                med[mode] = statistics.median(xs) if xs else float("nan")
            if med["headless"] > 0:
                phases[f"{kind}:{part}"] = {"page_ms": round(med["page"] * 1e3, 2),
                                            "headless_ms": round(med["headless"] * 1e3, 2),
                                            "page_over_headless": round(med["page"] / med["headless"], 3)}
                print(f"{kind:12s} {part:15s} page {med['page'] * 1e3:7.2f} ms  headless {med['headless'] * 1e3:7.2f} ms"
                      f"  page/headless {med['page'] / med['headless']:.3f}")
    draft_parts = {}
    for mode, xs in drafts.items():
        for group, sel in (("all", xs), ("with a refresh", [d for d in xs if d["refresh"]]),
                           ("without", [d for d in xs if not d["refresh"]])):
            if not sel:
                continue
            per_fwd = [d["forward_s"] / d["forwards"] for d in sel]
            part = {"steps": len(sel), "draft_ms": round(1e3 * statistics.median(d["draft"] for d in sel), 2),
                    "forward_ms_each": round(1e3 * statistics.median(per_fwd), 3),
                    "forwards_per_step": statistics.median(d["forwards"] for d in sel),
                    "rest_ms": round(1e3 * statistics.median(d["rest_s"] for d in sel), 2),
                    "rest_ms_per_forward": round(1e3 * statistics.median(d["rest_s"] / d["forwards"] for d in sel), 3)}
            draft_parts[f"{mode}: {group}"] = part
            print(f"draft {mode:8s} {group:15s} {part}")
    for k in sorted({r.get("chain_k") for m in runs.values() for r in m if r.get("chain_k")}):
        line = []
        for mode in runs:
            ms = [r["ms_per_token"] for r in runs[mode] if r.get("chain_k") == k]
            line.append(f"{mode} {statistics.median(ms) if ms else float('nan')} ms/token ({len(ms)} runs)")
        print(f"plans of chain k<={k}: " + ", ".join(line))
    for mode in runs:
        xs = [r["speed_over_plain_inside"] for r in runs[mode] if "speed_over_plain_inside" in r]
        ms = [r["ms_per_token"] for r in runs[mode] if "ms_per_token" in r]
        if xs:
            print(f"{mode}: speed over plain inside, median {statistics.median(xs):.2f} ({xs}); ms/token median "
                  f"{statistics.median(ms)}")
    if args.json:
        write_result(args.json, "scripts/page_vs_headless.py", {
            "runs": runs, "rows": rows, "phases": phases, "draft_parts": draft_parts, "draft_steps": drafts})


if __name__ == "__main__":
    main()
