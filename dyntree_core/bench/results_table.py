"""Print the committed latency benchmarks (``bench/results/latency_*.json``) as one Markdown
table: rows are methods, one column per dataset and temperature, each cell
``tokens/step · ms/token``.

    python -m dyntree_core.bench table [bench/results/latency_wiki_cpu_bf16.json ...]

Where several files hold the same (dataset, temperature, method), the row with the most prompts
is kept (the later file on a tie), so a run that completes a row of an interrupted one replaces
it. Rows with fewer prompts than the others of their column are marked with the count.

A column's plain-decoding row comes from the run that supplies most of that column's other rows.
A cell measured in another run (another day, maybe another machine) is compared with *that*
run's own plain decoding: it carries its speedup over it and a footnote naming the run and its CPU,
so no cell is silently divided by a baseline it was not measured beside.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..config import METHODS
from ..prompts import DATASETS

AR = "autoregressive"

Key = tuple[str, float, str]  # (dataset, temperature, method)


def load_rows(paths: list[Path]) -> dict[Key, dict]:
    """The row kept for each (dataset, temperature, method); each carries ``source`` (its file's
    name), ``cpu`` (the CPU that file records, or None) and ``own_ar_ms`` (plain decoding's median
    ms/token in the same file and column, or None)."""
    runs: list[tuple[str, dict[Key, dict], str | None]] = []
    for path in paths:
        data = json.loads(path.read_text())
        info = data.get("machine_info") or {}
        cpu = " ".join(x for x in (info.get("cpu_model"), f"({info['cpu_class']})" if info.get("cpu_class") else None) if x)
        runs.append((path.name, {(s["dataset"], float(s["temperature"]), s["method"]): s for s in data["summary"]},
                     cpu or None))
    rows: dict[Key, dict] = {}
    for name, summary, cpu in runs:
        for key, s in summary.items():
            if key[2] == AR:
                continue
            if key not in rows or s["prompts"] >= rows[key]["prompts"]:
                ar = summary.get((key[0], key[1], AR))
                rows[key] = dict(s, source=name, cpu=cpu,
                                 own_ar_ms=ar["median_seconds_per_token"] * 1e3 if ar else None)
    ar_rank: dict[Key, tuple] = {}  # (rows the run supplies to the column, its AR prompts, file order)
    for i, (name, summary, cpu) in enumerate(runs):
        for key, s in summary.items():
            if key[2] != AR:
                continue
            supplied = sum(1 for k, r in rows.items() if k[:2] == key[:2] and k[2] != AR and r["source"] == name)
            rank = (supplied, s["prompts"], i)
            if key not in ar_rank or rank >= ar_rank[key]:
                ar_rank[key] = rank
                rows[key] = dict(s, source=name, cpu=cpu, own_ar_ms=s["median_seconds_per_token"] * 1e3)
    return rows


def markdown(rows: dict[Key, dict]) -> str:
    columns = sorted({(d, t) for d, t, _ in rows},
                     key=lambda c: (DATASETS.index(c[0]) if c[0] in DATASETS else len(DATASETS), c[0], c[1]))
    methods = sorted({m for _, _, m in rows}, key=lambda m: METHODS.index(m) if m in METHODS else len(METHODS))
    head = "| method | " + " | ".join(f"{d} T={t:g}" for d, t in columns) + " |"
    sep = "|---|" + "---|" * len(columns)
    lines = [head, sep]
    full = {c: max((r["prompts"] for (d, t, _), r in rows.items() if (d, t) == c), default=0) for c in columns}
    notes: dict[str, int] = {}  # source file -> footnote number
    for m in methods:
        cells = []
        for c in columns:
            r = rows.get((c[0], c[1], m))
            if r is None:
                cells.append("—")
                continue
            short = f" ({r['prompts']}/{full[c]} prompts)" if r["prompts"] < full[c] else ""
            cell = f"{r['tokens_per_step']:.2f} · {r['median_seconds_per_token'] * 1e3:.0f}{short}"
            ar = rows.get((c[0], c[1], AR))
            if m != AR and ar is not None and r["source"] != ar["source"]:
                n = notes.setdefault(r["source"], len(notes) + 1)
                own = (f"{r['own_ar_ms'] / (r['median_seconds_per_token'] * 1e3):.2f}x its own AR"
                       if r["own_ar_ms"] else "no AR in its run")
                cell += f" ({own}) [{n}]"
            cells.append(cell)
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    if notes:
        lines.append("")
        for source, n in notes.items():
            from_source = {k: r for k, r in rows.items() if r["source"] == source}
            cpu = next((r["cpu"] for r in from_source.values() if r["cpu"]), None)
            own_ar = {k[:2]: r["own_ar_ms"] for k, r in from_source.items() if r["own_ar_ms"]}
            own = [f"{d} T={t:g} {own_ar[(d, t)]:.0f}" for d, t in columns if (d, t) in own_ar]
            lines.append(f"[{n}] measured in a separate run, `{source}`" + (f" on {cpu}" if cpu else "")
                         + (f"; its own plain decoding, ms/token: {', '.join(own)}" if own else "") + ".")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dyntree_core.bench table", description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="*", type=Path)
    args = p.parse_args(argv)
    paths = args.paths or sorted(Path("bench/results").glob("latency_*.json"))
    if not paths:
        print("no bench/results/latency_*.json: run `python -m dyntree_core.bench latency ... --json ...` first",
              file=sys.stderr)
        return 1
    print(markdown(load_rows(paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
