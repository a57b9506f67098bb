"""Exact expected acceptance of every compatible verifier on the same trees.

    python -m dyntree_core.bench exact-acceptance --pair embedded \
        --methods specinfer sequoia dyspec_greedy dyspec_threshold --budgets 16 64 256 \
        --temperatures 0.6 1.0 --datasets wiki news --prompts 20 --new-tokens 64 \
        [--precision int8 --draft-precision int4] [--decode-verifier token_level] [--json out.json]

The decode follows one verifier (``--decode-verifier``, token-level by default); at every step the
step's tree, its draft distributions and the target distributions are handed to
``verify.expected.expected_acceptance`` for every verifier that can verify that tree (token_level,
traversal and point_mass for sampled trees; point_mass for top-k trees; greedy at T=0). Each
verifier is thus scored on *the same* trees with no sampling noise in its own acceptance; the
trees themselves depend on the path the decode took.

Per cell (temperature, method, budget, dataset) the table reports the mean over prompts of each
prompt's mean expected accepted draft tokens per step, with a 95% t-interval over prompts, and the
paired per-step difference traversal − token_level (same interval). Ctrl-C stops early and still
writes what was measured.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from ..config import METHODS, TOPK_METHODS, DecodeConfig, default_threshold
from ..machine import available_memory, machine_info
from ..methods import REGISTRY

SAMPLED_VERIFIERS: tuple[str, ...] = ("token_level", "traversal", "point_mass")
TREE_METHODS = tuple(m for m in METHODS if m != "autoregressive")


def verifiers_for(sampled: str, temperature: float) -> tuple[str, ...]:
    """Verifiers whose exact expectation is reported for a tree of kind ``sampled``."""
    if temperature == 0:
        return ("greedy",)
    return ("point_mass",) if sampled == "topk" else SAMPLED_VERIFIERS


def t_interval(values: list[float]) -> tuple[float, float]:
    """``(mean, half-width of the 95% Student-t interval)``; half-width NaN for fewer than 2 values."""
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, float("nan")
    from scipy.stats import t

    return m, float(t.ppf(0.975, len(values) - 1)) * statistics.stdev(values) / math.sqrt(len(values))


@dataclass
class PromptRecord:
    """Exact expectations of one prompt's decode, per step."""

    dataset: str
    prompt_id: str
    steps: int = 0
    tree_sizes: list[int] = field(default_factory=list)
    realised: list[int] = field(default_factory=list)  # accepted draft tokens the decode's verifier drew
    expected: dict[str, list[float]] = field(default_factory=dict)  # verifier -> per-step expectation
    # per step, index d-1 for depth d: the tree's nodes at that depth, the decode verifier's
    # expected accepted tokens at that depth (sum of P(on path)), and the drafter's own forecast of
    # them (sum of its node values: DySpec's draft path probabilities, Sequoia's DP scores); where a
    # budget's nodes go, which of them pay, and how far the drafter's estimate was from it
    depth_nodes: list[list[int]] = field(default_factory=list)
    depth_accepted: list[list[float]] = field(default_factory=list)
    depth_forecast: list[list[float]] = field(default_factory=list)

    def mean(self, verifier: str) -> float:
        return statistics.fmean(self.expected[verifier])

    def paired(self, a: str, b: str) -> float:
        return statistics.fmean(x - y for x, y in zip(self.expected[a], self.expected[b]))

    def to_dict(self) -> dict:
        return {"dataset": self.dataset, "prompt_id": self.prompt_id, "steps": self.steps,
                "tree_sizes": self.tree_sizes, "realised": self.realised, "expected": self.expected,
                "depth_nodes": self.depth_nodes, "depth_accepted": self.depth_accepted,
                "depth_forecast": self.depth_forecast}

    @classmethod
    def from_dict(cls, d: dict) -> "PromptRecord":
        return cls(d["dataset"], d["prompt_id"], int(d["steps"]), list(d["tree_sizes"]), list(d["realised"]),
                   {k: list(v) for k, v in d["expected"].items()},
                   [list(x) for x in d.get("depth_nodes", ())], [list(x) for x in d.get("depth_accepted", ())],
                   [list(x) for x in d.get("depth_forecast", ())])

    def observe_depths(self, depth: np.ndarray, on_path: np.ndarray, value: Optional[np.ndarray]) -> None:
        """Record one step's depth profile: ``depth`` / ``on_path`` / ``value`` ``[N]`` per node
        (root first); ``value`` None when the drafter records no node values."""
        self.depth_nodes.append(np.bincount(depth)[1:].tolist())
        self.depth_accepted.append(np.bincount(depth, weights=on_path)[1:].tolist())
        if value is not None:
            self.depth_forecast.append(np.bincount(depth, weights=value)[1:].tolist())


def depth_profile(prompts: list[PromptRecord], with_forecast: bool = True) -> Optional[dict]:
    """Nodes, expected accepted tokens and the drafter's forecast per step at each depth, averaged
    per prompt and then over prompts (as ``expected_accepted`` is, so over all prompts the accepted
    column sums to its mean). Runs recorded before profiles (or forecasts) existed may be pooled
    with newer ones: the profile then covers the prompts that have the most of it, and says how
    many (``prompts``). None when no prompt has one. ``with_forecast`` False leaves the forecast
    out (i.i.d. siblings: summing the path probabilities of repeated draws forecasts nothing)."""
    profiled = [p for p in prompts if p.steps and len(p.depth_nodes) == p.steps]
    forecast = [p for p in profiled if len(p.depth_forecast) == p.steps] if with_forecast else []
    use = forecast or profiled
    if not use:
        return None
    top = max(len(r) for p in use for r in p.depth_nodes)

    def mean(rows: list[list[float]]) -> list[float]:
        return [statistics.fmean(r[d] if d < len(r) else 0.0 for r in rows) for d in range(top)]

    out = {"prompts": len(use), "nodes": mean([mean(p.depth_nodes) for p in use]),
           "accepted": mean([mean(p.depth_accepted) for p in use])}
    if forecast:
        out["forecast"] = mean([mean(p.depth_forecast) for p in use])
    return out


@dataclass
class Cell:
    temperature: float
    method: str
    budget: int
    dataset: str
    decode_verifier: str
    prompts: list[PromptRecord] = field(default_factory=list)

    def key(self) -> tuple:
        return (self.temperature, self.method, self.budget, self.dataset, self.decode_verifier)

    def records(self) -> list[dict]:
        """Per-prompt records (what ``--merge`` pools across runs)."""
        return [{"temperature": self.temperature, "method": self.method, "budget": self.budget,
                 "decode_verifier": self.decode_verifier, **p.to_dict()} for p in self.prompts if p.steps]

    def summary(self) -> dict:
        done = [p for p in self.prompts if p.steps]
        names = [v for v in ("greedy",) + SAMPLED_VERIFIERS if any(v in p.expected for p in done)]
        out: dict = {"temperature": self.temperature, "method": self.method, "budget": self.budget,
                     "dataset": self.dataset, "decode_verifier": self.decode_verifier, "prompts": len(done),
                     "steps": sum(p.steps for p in done),
                     "mean_tree_size": statistics.fmean(s for p in done for s in p.tree_sizes) if done else float("nan"),
                     "realised_accepted": statistics.fmean(statistics.fmean(p.realised) for p in done) if done else float("nan"),
                     "expected_accepted": {}}
        for v in names:
            m, h = t_interval([p.mean(v) for p in done])
            out["expected_accepted"][v] = {"mean": m, "ci95": h}
        method = REGISTRY.get(self.method)
        profile = depth_profile(done, with_forecast=method is None or method.siblings != "iid")
        if profile:
            out["depth_profile"] = profile
        if {"traversal", "token_level"} <= set(names):
            m, h = t_interval([p.paired("traversal", "token_level") for p in done])
            base = out["expected_accepted"]["token_level"]["mean"]
            out["traversal_minus_token_level"] = {"mean": m, "ci95": h, "relative": m / base if base else float("nan"),
                                                  "ci95_relative": h / base if base else float("nan")}
        return out


def pooled_cells(records: list[dict]) -> list[Cell]:
    """Cells rebuilt from per-prompt records (duplicates of one prompt in one cell kept once), plus
    one cell per (T, method, budget, decode verifier) pooling its datasets (``wiki+news``)."""
    by_key: dict[tuple, Cell] = {}
    seen: set[tuple] = set()
    for r in records:
        rec = PromptRecord.from_dict(r)
        key = (float(r["temperature"]), r["method"], int(r["budget"]), rec.dataset, r["decode_verifier"])
        if key + (rec.prompt_id,) in seen:
            continue
        seen.add(key + (rec.prompt_id,))
        by_key.setdefault(key, Cell(*key)).prompts.append(rec)
    cells = sorted(by_key.values(), key=lambda c: c.key())
    groups: dict[tuple, list[Cell]] = {}
    for c in cells:
        groups.setdefault((c.temperature, c.method, c.budget, c.decode_verifier), []).append(c)
    for (t, m, b, v), cs in groups.items():
        if len(cs) > 1:
            cells.append(Cell(t, m, b, "+".join(c.dataset for c in cs), v, [p for c in cs for p in c.prompts]))
    return cells


def _paired(a: Cell, b: Cell) -> Optional[dict]:
    """``a − b`` over their common prompts (each under its decode's verifier), mean ± 95% t-interval."""
    mine = {(p.dataset, p.prompt_id): p for p in a.prompts if p.steps}
    theirs = {(p.dataset, p.prompt_id): p for p in b.prompts if p.steps}
    common = sorted(set(mine) & set(theirs))
    if not common:
        return None
    m, h = t_interval([mine[k].mean(a.decode_verifier) - theirs[k].mean(b.decode_verifier) for k in common])
    return {"temperature": a.temperature, "dataset": a.dataset, "a_verifier": a.decode_verifier,
            "b_verifier": b.decode_verifier, "prompts": len(common), "mean": m, "ci95": h}


def method_differences(cells: list[Cell]) -> list[dict]:
    """Paired by prompt: for every two methods measured at the same temperature, budget and
    dataset, the mean over their common prompts of the difference of their expected accepted
    tokens per step, each under the verifier its decode followed, with a 95% t-interval. The two
    decodes took different paths from the same prompt, so the pairing removes the prompt's own
    difficulty, not the path's."""
    groups: dict[tuple, list[Cell]] = {}
    for c in cells:
        groups.setdefault((c.temperature, c.budget, c.dataset), []).append(c)
    out = []
    for (_, budget, _), cs in groups.items():
        for i, a in enumerate(cs):
            for b in cs[i + 1:]:
                d = _paired(a, b)
                if d:
                    out.append(dict(d, budget=budget, a=a.method, b=b.method))
    return out


def budget_gains(cells: list[Cell]) -> list[dict]:
    """Paired by prompt, per method, temperature and dataset: what each budget adds over the next
    smaller one measured (``larger − smaller``), as ``method_differences`` pairs methods."""
    groups: dict[tuple, list[Cell]] = {}
    for c in cells:
        groups.setdefault((c.temperature, c.method, c.dataset, c.decode_verifier), []).append(c)
    out = []
    for (_, method, _, _), cs in groups.items():
        cs = sorted(cs, key=lambda c: c.budget)
        for small, large in zip(cs, cs[1:]):
            d = _paired(large, small)
            if d:
                out.append(dict(d, method=method, budget=large.budget, from_budget=small.budget))
    return out


CELL_FIELDS = ("temperature", "method", "budget", "dataset", "decode_verifier")


def prompt_range(argv: Optional[list]) -> Optional[dict]:
    """The prompt slice a run was asked for: its datasets, ``--prompt-start`` and ``--prompts``, as this parser
    reads its recorded argv (defaults where it left them out; flags this version does not know are ignored).
    None for a run that recorded no argv."""
    if argv is None:
        return None
    ns, _ = build_parser().parse_known_args([str(a) for a in argv])
    return {"datasets": list(ns.datasets), "prompt_start": ns.prompt_start, "prompts": ns.prompts}


def measured_prompts(records: list[dict]) -> list[dict]:
    """Which prompts a run holds in each cell (in its order): with the merged file's records,
    enough to rebuild that run's own table."""
    cells: dict[tuple, list[str]] = {}
    for r in records:
        cells.setdefault(tuple(r[k] for k in CELL_FIELDS), []).append(r["prompt_id"])
    return [dict(zip(CELL_FIELDS, key), prompt_ids=ids) for key, ids in cells.items()]


def _dense_rows_of(d: dict):
    """record -> the --dense-rows threshold it was computed with: a run's own setting, or for an
    earlier merge its per-cell record (``dense_rows_by_cell``)."""
    if "dense_rows_by_cell" in d:
        by_cell = {(float(c["temperature"]), c["method"], int(c["budget"])): int(c["dense_rows"])
                   for c in d["dense_rows_by_cell"]}
        return lambda r: by_cell.get((float(r["temperature"]), r["method"], int(r["budget"])), 0)
    rows = int((d.get("dense_rows") or {}).get("min_rows", 0))
    return lambda r: rows


def provenance(name: str, d: dict) -> dict:
    """What ``--merge`` keeps of one input besides its per-prompt records, so the merged file can
    stand in for it: everything the run recorded except the tables derived from those records
    (its ``cells``, ``method_differences``, ``budget_gains``: ``measured`` names its prompts per
    cell, from which the merged records rebuild them). An earlier merge keeps its own inputs'."""
    if "merged_from" in d:
        return {"file": name, "merge": d.get("merge"), "precision": d.get("precision"),
                "draft_precision": d.get("draft_precision"), "merged_from": d["merged_from"]}
    return {"file": name, "date": d.get("date"), "argv": d.get("argv"), "machine_info": d.get("machine_info"),
            "pair": d.get("pair"), "precision": d.get("precision"), "draft_precision": d.get("draft_precision"),
            "new_tokens": d.get("new_tokens"), "prompt_tokens": d.get("prompt_tokens"),
            "prompt_range": prompt_range(d.get("argv")), "dense_rows": d.get("dense_rows"),
            "seconds": d.get("seconds"), "sequoia_calibration": d.get("sequoia_calibration"),
            "sequoia_acceptance": d.get("sequoia_acceptance"), "measured": measured_prompts(d["prompt_records"])}


def merge(paths: list[Path], out: Optional[Path], on_conflict: str = "refuse",
          command: Optional[str] = None) -> int:
    """Pool the per-prompt records of several runs (e.g. disjoint ``--prompt-start`` slices run in
    different sessions, or an earlier merge and new slices) and print / write the combined table.

    The merged file records the merge (``merge``: its command, date and conflict policy) and, per
    input, its provenance (``provenance``) and the records it holds that were not pooled
    (``set_aside``), so it can replace its inputs: it also carries their common Sequoia
    acceptance vector and calibration, i.e. it can be ``--sequoia-acceptance-from`` for a further
    slice. Two different records of one prompt in one cell are refused, or with ``on_conflict``
    ``"first"`` the first input's (in the order given) is pooled and the other set aside: the same
    prompt decoded on two machines whose kernels round differently is the same distribution but
    another sample."""
    records, runs = [], []
    vectors: dict[str, tuple[str, list[float]]] = {}  # T -> (first file recording it, its Sequoia vector)
    calibration: Optional[tuple[str, dict]] = None  # (first file recording one, the Sequoia calibration)
    sources: dict[tuple, tuple[str, dict]] = {}  # (cell, prompt) -> (first file recording it, the record)
    kernels: dict[tuple, dict[int, str]] = {}  # cell -> {--dense-rows threshold: first file using it}
    for path in paths:
        d = json.loads(path.read_text())
        if "prompt_records" not in d:
            print(f"{path} has no per-prompt records (written before --merge existed)", file=sys.stderr)
            return 2
        dense_rows = _dense_rows_of(d)
        set_aside = []
        for r in d["prompt_records"]:
            cell_prompt = (float(r["temperature"]), r["method"], int(r["budget"]), r["dataset"],
                           r["decode_verifier"], r["prompt_id"])
            if cell_prompt in sources and sources[cell_prompt][1] != r:
                if on_conflict != "first":
                    print(f"refusing to pool two different records of prompt {r['prompt_id']} in the cell "
                          f"T={r['temperature']} {r['method']} budget {r['budget']} ({sources[cell_prompt][0]} vs "
                          f"{path.name}): keep one of the files, or --on-conflict first pools the first's",
                          file=sys.stderr)
                    return 2
                set_aside.append(dict({k: r[k] for k in CELL_FIELDS}, prompt_id=r["prompt_id"],
                                      pooled_from=sources[cell_prompt][0]))
                continue
            sources.setdefault(cell_prompt, (path.name, r))
            kernels.setdefault(cell_prompt[:5], {}).setdefault(dense_rows(r), path.name)
        records += d["prompt_records"]
        runs.append(dict(provenance(path.name, d), set_aside=set_aside))
        for t, v in (d.get("sequoia_acceptance") or {}).items():
            first = vectors.setdefault(t, (path.name, v))
            if len(first[1]) != len(v) or any(abs(a - b) > 1e-9 for a, b in zip(first[1], v)):
                print(f"refusing to pool Sequoia trees grown from different acceptance vectors at T={t} "
                      f"({first[0]} vs {path.name}); rerun with --sequoia-acceptance-from", file=sys.stderr)
                return 2
        if d.get("sequoia_calibration"):
            calibration = calibration or (path.name, d["sequoia_calibration"])
            if calibration[1] != d["sequoia_calibration"]:
                print(f"refusing to pool runs whose Sequoia calibrations differ ({calibration[0]} vs {path.name})",
                      file=sys.stderr)
                return 2
    precisions = {(r["precision"], r.get("draft_precision")) for r in runs}
    if len(precisions) > 1:
        print(f"refusing to pool runs at different precisions: {sorted(precisions)}", file=sys.stderr)
        return 2
    for (t, m, b, ds, _), used in kernels.items():
        if len(used) > 1:
            print(f"refusing to pool prompts of one cell (T={t} {m} budget {b} {ds}) computed with different "
                  f"--dense-rows thresholds {sorted(used)} ({', '.join(used.values())})", file=sys.stderr)
            return 2
    cells = pooled_cells(records)
    record = {"bench": "exact-acceptance",
              "merge": {"command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "on_conflict": on_conflict},
              "merged_from": runs, "precision": runs[0]["precision"] if runs else None,
              "draft_precision": runs[0]["draft_precision"] if runs else None,
              "sequoia_calibration": calibration[1] if calibration else None,
              "sequoia_acceptance": {t: v for t, (_, v) in sorted(vectors.items())},
              "cells": [c.summary() for c in cells], "method_differences": method_differences(cells),
              "budget_gains": budget_gains(cells),
              "dense_rows_by_cell": [{"temperature": t, "method": m, "budget": b, "dense_rows": rows}
                                     for t, m, b, rows in sorted({(t, m, b, next(iter(used)))
                                                                  for (t, m, b, _, _), used in kernels.items()})],
              "prompt_records": records}
    print_table(record, sys.stdout)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1))
        print(f"wrote {out}")
    return 0


def reused_sequoia_acceptance(path: Path, calibration: dict) -> dict[float, tuple[float, ...]]:
    """The Sequoia acceptance vectors (per temperature) recorded by an earlier run, provided it
    calibrated on the same pair, precisions and calibration prompts as ``calibration`` describes.
    Raises ValueError with the reason otherwise."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read Sequoia acceptance from {path}: {e}") from e
    if not d.get("sequoia_acceptance"):
        raise ValueError(f"{path} records no Sequoia acceptance vector (its run had no sequoia cell, or predates them)")
    theirs = d.get("sequoia_calibration") or {}
    differ = sorted(k for k in calibration if theirs.get(k) != calibration[k])
    if differ:
        raise ValueError(f"{path} calibrated Sequoia differently ({', '.join(f'{k}: {theirs.get(k)!r} vs {calibration[k]!r}' for k in differ)})")
    return {float(t): tuple(float(a) for a in v) for t, v in d["sequoia_acceptance"].items()}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dyntree_core.bench exact-acceptance")
    p.add_argument("--pair", default="embedded", help="'embedded', 'tiny' (random test pair) or draft_spec,target_spec")
    p.add_argument("--methods", nargs="+", default=["specinfer", "sequoia", "dyspec_greedy", "dyspec_threshold"],
                   choices=TREE_METHODS)
    p.add_argument("--budgets", nargs="+", type=int, default=[64])
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--width", type=int, default=8, help="SpecInfer's k (its depth is budget // k)")
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.6, 1.0])
    p.add_argument("--datasets", nargs="+", default=["wiki", "news"])
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--prompt-start", type=int, default=0,
                   help="skip this many eval prompts per dataset (disjoint slices for runs pooled with --merge)")
    p.add_argument("--merge", type=Path, nargs="+", default=None,
                   help="pool the per-prompt records of these JSON files (no decoding) and print the table")
    p.add_argument("--on-conflict", choices=("refuse", "first"), default="refuse",
                   help="with --merge, two different records of one prompt in one cell: refuse, or pool the "
                        "first file's (in the order given) and record the other as set aside")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--decode-verifier", default="token_level", choices=SAMPLED_VERIFIERS,
                   help="the verifier the decode itself follows (top-k methods always use point_mass)")
    p.add_argument("--precision", default="float32", help="target precision (float32 bfloat16 int8 int4)")
    p.add_argument("--draft-precision", default=None, help="draft precision (default: the target's)")
    p.add_argument("--calib-prompts", type=int, default=4, help="calibration prompts per dataset for Sequoia's acceptance vector")
    p.add_argument("--sequoia-acceptance-from", type=Path, default=None,
                   help="reuse the Sequoia acceptance vectors recorded in this earlier run's JSON (same pair, "
                        "precisions and calibration prompts) instead of calibrating again; slices of one sweep "
                        "then grow the very same Sequoia trees")
    p.add_argument("--dense-rows", default="0",
                   help="from this many rows on, int8/int4 layers multiply on the dense bf16 GEMM by an exact "
                        "bf16 split of their weight (same numbers up to the order of float32 sums; ~3-6x faster "
                        "at 256 rows with AMX); 'auto' measures the crossover here, 0 keeps the kernels")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    return p


def apply_dense_rows(pair, setting: str) -> dict:
    """``--dense-rows``: turn the dense split on for both models; returns what to record in the JSON.
    Raises ``ValueError`` for a bad setting or when the parts would not fit in the available memory."""
    from ..quant.linear import dense_rows_bytes, enable_dense_rows, measure_dense_rows

    info: dict = {"setting": setting}
    if setting == "auto":
        rows, info["measured"] = measure_dense_rows(pair.target)
    else:
        try:
            rows = int(setting)
        except ValueError:
            raise ValueError(f"--dense-rows takes a row count >= 0 or 'auto', got {setting!r}") from None
        if rows < 0:
            raise ValueError(f"--dense-rows takes a row count >= 0 or 'auto', got {setting!r}")
    info["min_rows"] = rows
    if rows <= 0:
        enable_dense_rows(pair.target, 0)
        enable_dense_rows(pair.draft, 0)
    else:
        need = dense_rows_bytes(pair.target) + dense_rows_bytes(pair.draft)
        avail = available_memory()
        if avail is not None and need > 0.8 * avail:
            raise ValueError(f"--dense-rows needs up to {need / 2**30:.1f} GiB for the bf16 weight splits and "
                             f"{avail / 2**30:.1f} GiB is available; use --dense-rows 0")
        info["bytes"] = enable_dense_rows(pair.target, rows) + enable_dense_rows(pair.draft, rows)
    return info


def _load(args):
    if args.pair == "tiny":
        from .decoding import _load as load_tiny

        return load_tiny("tiny", "float32", args.device)
    from ..models import load_pair

    d, _, t = args.pair.partition(",")
    return load_pair(d or "embedded", t or d or "embedded", dtype="float32", device=args.device,
                     precision=args.precision, draft_precision=args.draft_precision)


def main(argv: Optional[list[str]] = None) -> int:
    from tqdm import tqdm

    from ..decode.engine import SpeculativeDecoder
    from ..prompts import load_prompts
    from ..verify.expected import expected_acceptance
    from .decoding import _encode, calibrate_sequoia

    args = build_parser().parse_args(argv)
    if args.merge:
        given = sys.argv[1:] if argv is None else argv
        return merge(args.merge, args.json, args.on_conflict,
                     "python -m dyntree_core.bench exact-acceptance " + shlex.join(str(a) for a in given))
    if args.prompt_start < 0:
        print("--prompt-start must be >= 0", file=sys.stderr)
        return 2
    started = time.time()
    pair = _load(args)
    try:
        dense_rows = apply_dense_rows(pair, args.dense_rows)
    except ValueError as e:
        print(str(e), file=sys.stderr)
        return 2
    eos = list(getattr(pair, "eos_token_ids", ()) or ()) or None
    prompts = {ds: [(p.id, _encode(pair.tokenizer, p.text, args.prompt_tokens))
                    for p in load_prompts(ds, args.prompt_start + args.prompts)[args.prompt_start:]]
               for ds in args.datasets}
    calib = [_encode(pair.tokenizer, p.text, 256) for ds in args.datasets
             for p in load_prompts(ds, args.calib_prompts, split="calib")]
    calibration = {"pair": args.pair, "precision": args.precision,
                   "draft_precision": args.draft_precision or args.precision,
                   "datasets": list(args.datasets), "calib_prompts": args.calib_prompts}
    sequoia_acc: dict[float, tuple[float, ...]] = {}
    if args.sequoia_acceptance_from:
        try:
            sequoia_acc = reused_sequoia_acceptance(args.sequoia_acceptance_from, calibration)
        except ValueError as e:
            print(str(e), file=sys.stderr)
            return 2
    cells: list[Cell] = []
    record = {"bench": "exact-acceptance", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:] if argv is None else argv,
              "machine_info": machine_info().to_dict(), "pair": args.pair, "precision": args.precision,
              "draft_precision": args.draft_precision or args.precision, "new_tokens": args.new_tokens,
              "prompt_tokens": args.prompt_tokens, "dense_rows": dense_rows, "cells": []}

    def save() -> None:
        record["prompt_records"] = [r for c in cells for r in c.records()]
        pooled = pooled_cells(record["prompt_records"])
        record["cells"] = [c.summary() for c in pooled]
        record["method_differences"] = method_differences(pooled)
        record["budget_gains"] = budget_gains(pooled)
        record["seconds"] = time.time() - started
        record["sequoia_calibration"] = calibration
        record["sequoia_acceptance"] = {str(t): list(v) for t, v in sorted(sequoia_acc.items())}
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(record, indent=1))

    plan = [(t, m, b, ds) for t in args.temperatures for m in args.methods for b in args.budgets for ds in args.datasets]
    bar = tqdm(total=len(plan) * args.prompts, desc="exact acceptance", unit="prompt", file=sys.stderr)
    try:
        for temp, method, budget, ds in plan:
            if method == "sequoia" and temp not in sequoia_acc:
                bar.set_postfix_str(f"calibrating Sequoia at T={temp}")
                sequoia_acc[temp] = calibrate_sequoia(pair, calib, temp)
                bar.set_postfix_str("")
            verifier = "point_mass" if method in TOPK_METHODS and temp > 0 else ("auto" if temp == 0 else args.decode_verifier)
            cfg = DecodeConfig(method=method, verifier=verifier, temperature=temp, budget=budget,
                               depth=max(1, budget // args.width) if method == "specinfer" else args.depth,
                               width=args.width, threshold=default_threshold(budget), seed=args.seed,
                               device=args.device, trace_block_counts=False,
                               sequoia_acceptance=sequoia_acc.get(temp) if method == "sequoia" else None)
            cell = Cell(temp, method, budget, ds, cfg.resolved_verifier())
            cells.append(cell)
            current: list[PromptRecord] = []

            def observe(tree, target_probs, result) -> None:
                rec = current[-1]
                rec.steps += 1
                rec.tree_sizes.append(tree.size)
                rec.realised.append(len(result.path) - 1)
                for v in verifiers_for(tree.sampled, temp):
                    exp = expected_acceptance(tree, target_probs, v)
                    rec.expected.setdefault(v, []).append(exp.accepted)
                    if v == cell.decode_verifier:
                        rec.observe_depths(tree.depth.cpu().numpy(), exp.on_path,
                                           None if tree.value is None else tree.value.cpu().numpy())

            decoder = SpeculativeDecoder(pair.draft, pair.target, cfg, eos_token_id=eos, on_verify=observe)
            for i, (pid, ids) in enumerate(prompts[ds]):
                current.append(PromptRecord(ds, pid))
                cell.prompts.append(current[-1])
                for _ in decoder.generate(ids, args.new_tokens, seed=args.seed + args.prompt_start + i):
                    pass
                bar.update(1)
                save()
            save()
    except KeyboardInterrupt:
        print("\ninterrupted: writing what was measured", file=sys.stderr)
    bar.close()
    save()
    print_table(record, sys.stdout)
    if args.json:
        print(f"wrote {args.json}")
    return 0


def print_table(record: dict, out=None) -> None:
    out = out or sys.stdout
    names = ("greedy",) + SAMPLED_VERIFIERS
    print("\nexpected accepted draft tokens per step (mean over prompts ± 95% CI); decode followed the "
          "verifier named in 'decode'", file=out)
    print("| T | method | budget | dataset | prompts | steps | tree | decode | " + " | ".join(names)
          + " | traversal − token_level |", file=out)
    print("|---" * (9 + len(names)) + "|", file=out)
    for c in record["cells"]:
        vals = []
        for v in names:
            e = c["expected_accepted"].get(v)
            vals.append("—" if e is None else f"{e['mean']:.3f} ± {e['ci95']:.3f}")
        d = c.get("traversal_minus_token_level")
        diff = "—" if d is None else f"{d['mean']:+.4f} ± {d['ci95']:.4f} ({100 * d['relative']:+.2f}% ± {100 * d['ci95_relative']:.2f}%)"
        print(f"| {c['temperature']:g} | {c['method']} | {c['budget']} | {c['dataset']} | {c['prompts']} | {c['steps']} "
              f"| {c['mean_tree_size']:.1f} | {c['decode_verifier']} | " + " | ".join(vals) + f" | {diff} |", file=out)
    if record.get("method_differences"):
        print("\nmethod a − method b, paired by prompt (expected accepted tokens per step, each under its decode's"
              " verifier; mean ± 95% CI over common prompts)", file=out)
        print("| T | budget | dataset | a | b | prompts | a − b |", file=out)
        print("|---" * 7 + "|", file=out)
        for d in record["method_differences"]:
            print(f"| {d['temperature']:g} | {d['budget']} | {d['dataset']} | {d['a']} | {d['b']} | {d['prompts']} "
                  f"| {d['mean']:+.3f} ± {d['ci95']:.3f} |", file=out)
    if record.get("budget_gains"):
        print("\nwhat a larger budget adds, paired by prompt (expected accepted tokens per step; mean ± 95% CI)",
              file=out)
        print("| T | method | dataset | budgets | prompts | gain |", file=out)
        print("|---" * 6 + "|", file=out)
        for d in record["budget_gains"]:
            print(f"| {d['temperature']:g} | {d['method']} | {d['dataset']} | {d['from_budget']} -> {d['budget']} "
                  f"| {d['prompts']} | {d['mean']:+.3f} ± {d['ci95']:.3f} |", file=out)
    profiled = [c for c in record["cells"] if c.get("depth_profile")]
    if profiled:
        top = max(len(c["depth_profile"]["nodes"]) for c in profiled)
        print("\nwhere the nodes go, per step at each depth: mean nodes / expected accepted tokens (decode's verifier)"
              " / the drafter's own forecast of them (sum of its node values)", file=out)
        print("| T | method | budget | dataset | prompts | " + " | ".join(f"d{d}" for d in range(1, top + 1)) + " |",
              file=out)
        print("|---" * (5 + top) + "|", file=out)
        for c in profiled:
            prof = c["depth_profile"]
            forecast = prof.get("forecast") or [None] * len(prof["nodes"])
            cols = [f"{n:.1f} / {a:.2f}" + ("" if f is None else f" / {f:.2f}")
                    for n, a, f in zip(prof["nodes"], prof["accepted"], forecast)]
            cols += ["—"] * (top - len(cols))
            print(f"| {c['temperature']:g} | {c['method']} | {c['budget']} | {c['dataset']} | {prof['prompts']} | "
                  + " | ".join(cols) + " |", file=out)


if __name__ == "__main__":
    sys.exit(main())
