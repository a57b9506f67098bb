"""Print the committed latency benchmarks (``bench/results/latency_*.json``) as one Markdown
table: rows are methods, one column per dataset and temperature, each cell
``tokens/step · ms/token``.

    python -m dyntree_core.bench table [bench/results/latency_wiki_cpu_bf16.json ...]

Where several files hold the same (dataset, temperature, method), the row with the most prompts
is kept (the later file on a tie), so a run that completes a row of an interrupted one replaces
it. Rows with fewer prompts than the others of their column are marked with the count.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..config import METHODS
from ..prompts import DATASETS


def load_rows(paths: list[Path]) -> dict[tuple[str, float, str], dict]:
    rows: dict[tuple[str, float, str], dict] = {}
    for path in paths:
        data = json.loads(path.read_text())
        for s in data["summary"]:
            key = (s["dataset"], float(s["temperature"]), s["method"])
            if key not in rows or s["prompts"] >= rows[key]["prompts"]:
                rows[key] = dict(s, source=path.name)
    return rows


def markdown(rows: dict[tuple[str, float, str], dict]) -> str:
    columns = sorted({(d, t) for d, t, _ in rows},
                     key=lambda c: (DATASETS.index(c[0]) if c[0] in DATASETS else len(DATASETS), c[0], c[1]))
    methods = sorted({m for _, _, m in rows}, key=lambda m: METHODS.index(m) if m in METHODS else len(METHODS))
    head = "| method | " + " | ".join(f"{d} T={t:g}" for d, t in columns) + " |"
    sep = "|---|" + "---|" * len(columns)
    lines = [head, sep]
    full = {c: max((r["prompts"] for (d, t, _), r in rows.items() if (d, t) == c), default=0) for c in columns}
    for m in methods:
        cells = []
        for c in columns:
            r = rows.get((c[0], c[1], m))
            if r is None:
                cells.append("—")
                continue
            short = f" ({r['prompts']}/{full[c]} prompts)" if r["prompts"] < full[c] else ""
            cells.append(f"{r['tokens_per_step']:.2f} · {r['median_seconds_per_token'] * 1e3:.0f}{short}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
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
