"""Paper-style decoding benchmarks: accepted tokens per step and latency per token for every
method × temperature × dataset, the AR baseline in the same run, and the tokens-per-step vs
tree-size curve.

    python -m dyntree_core.bench acceptance|latency|all --pair embedded --methods ... \
        --temperatures 0 0.6 --datasets wiki news code --prompts 20 --prompt-tokens 128 \
        --new-tokens 128 --budget 64 --json out.json

``acceptance`` reports tokens/step only; ``latency`` adds seconds per token (bf16 by default);
``all`` also sweeps budgets for the curve and compares the hardware-tuned configuration
(``dyntree_core.planning.tuning``) of ``--tune-methods`` with fixed budgets ``--tune-fixed-budgets`` on the
same prompts in the same run. Ctrl-C stops early and still writes what was measured.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from ..config import METHODS, DecodeConfig, default_threshold
from ..machine import machine_info

CURVE_BUDGETS = (8, 16, 32, 64, 128, 256, 512, 768)
TREE_METHODS = tuple(m for m in METHODS if m != "autoregressive")


@dataclass
class PromptRun:
    """One generation of one prompt with one configuration."""

    dataset: str
    prompt_id: str
    method: str
    verifier: str
    temperature: float
    budget: int
    depth: int
    label: str
    new_tokens: int
    steps: int
    seconds: float
    tokens_per_step: float
    mean_tree_size: float
    draft_seconds: float
    target_seconds: float
    tree_build_seconds: float

    @property
    def seconds_per_token(self) -> float:
        return self.seconds / max(1, self.new_tokens)


@dataclass(frozen=True)
class PlanItem:
    """One configuration to run on every prompt of ``dataset`` (``section:dataset`` for the curve
    and tuning sections). ``config`` overrides the configuration built from the other fields."""

    dataset: str
    temperature: float
    method: str
    verifier: str
    budget: int
    label: str = ""
    config: Optional[DecodeConfig] = None

    @property
    def prompt_set(self) -> str:
        return self.dataset.rpartition(":")[2]


def run_generation(decoder, prompt_ids: list[int], new_tokens: int, seed: int) -> dict:
    """Decode and summarise; prefill is excluded from the decode seconds."""
    steps = tokens = 0
    tree_sizes: list[int] = []
    draft_s = target_s = build_s = decode_s = 0.0
    for tr in decoder.generate(prompt_ids, new_tokens, seed=seed):
        steps += 1
        tokens += len(tr.committed)
        tree_sizes.append(tr.tree_size)
        draft_s += tr.timings.draft
        build_s += tr.timings.tree_build
        target_s += tr.timings.target_forward
        decode_s += tr.step_seconds
    return {
        "steps": steps,
        "new_tokens": tokens,
        "seconds": decode_s,
        "tokens_per_step": tokens / max(1, steps),
        "mean_tree_size": statistics.fmean(tree_sizes) if tree_sizes else 0.0,
        "draft_seconds": draft_s,
        "target_seconds": target_s,
        "tree_build_seconds": build_s,
    }


def calibrate_sequoia(pair, texts: Sequence[list[int]], temperature: float, width: int = 16,
                      max_positions: int = 256, chunk: int = 64, seed: int = 0) -> tuple[float, ...]:
    """Sequoia's acceptance vector from teacher-forced forwards over calibration texts
    (the offline estimator of notes/sequoia.md §1.5), disjoint from the evaluation prompts.
    Positions are processed in chunks so full-vocabulary float64 rows stay within memory."""
    from ..drafting.sequoia import estimate_acceptance_vector
    from ..sampling import probs_from_logits

    gen = torch.Generator().manual_seed(seed)
    total = None
    count = 0
    for ids in texts:
        ids = ids[:max_positions]
        if len(ids) < 2:
            continue
        tdev = pair.target.get_input_embeddings().weight.device
        ddev = pair.draft.get_input_embeddings().weight.device
        with torch.no_grad():
            tl = pair.target(torch.tensor([ids], device=tdev)).logits[0, :-1]
            dl = pair.draft(torch.tensor([ids], device=ddev)).logits[0, :-1]
        t = temperature if temperature > 0 else 1.0
        for s in range(0, tl.shape[0], chunk):
            tp = probs_from_logits(tl[s:s + chunk], t).cpu()
            dp = probs_from_logits(dl[s:s + chunk], t).cpu()
            acc = estimate_acceptance_vector(dp, tp, width, gen, deterministic=temperature == 0) * tp.shape[0]
            total = acc if total is None else total + acc
            count += tp.shape[0]
    if not count:
        raise ValueError("no calibration text long enough")
    return tuple(float(a) for a in total / count)


def _encode(tokenizer, text: str, n_tokens: int) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])[:n_tokens]


def _summaries(records: list[PromptRun]) -> list[dict]:
    groups: dict[tuple, list[PromptRun]] = {}
    for r in records:
        groups.setdefault((r.dataset, r.temperature, r.method, r.verifier, r.budget, r.depth, r.label), []).append(r)
    rows = []
    ar_latency = {
        (k[0], k[1]): statistics.median(x.seconds_per_token for x in v)
        for k, v in groups.items() if k[2] == "autoregressive"
    }
    for (ds, temp, method, verifier, budget, depth, label), rs in sorted(
            groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2], kv[0][6], kv[0][4], kv[0][5])):
        lat = statistics.median(r.seconds_per_token for r in rs)
        base = ar_latency.get((ds, temp))
        rows.append({
            "dataset": ds, "temperature": temp, "method": method, "verifier": verifier, "budget": budget,
            "depth": depth, "label": label,
            "prompts": len(rs),
            "tokens_per_step": statistics.fmean(r.tokens_per_step for r in rs),
            "mean_tree_size": statistics.fmean(r.mean_tree_size for r in rs),
            "median_seconds_per_token": lat,
            "speedup_vs_ar": (base / lat) if base else None,
            "tree_build_share": sum(r.tree_build_seconds for r in rs) / max(1e-9, sum(r.seconds for r in rs)),
        })
    return rows


def print_table(rows: list[dict], latency: bool, out=None) -> None:
    out = out or sys.stdout
    head = f"{'dataset':8} {'T':>4} {'method':17} {'verifier':12} {'budget':>6} {'depth':>5} {'n':>3} {'tok/step':>8} {'tree':>6}"
    if latency:
        head += f" {'ms/token':>9} {'speedup':>7}"
    print(head, file=out)
    for r in rows:
        method = r["method"] + (f" [{r['label']}]" if r.get("label") else "")
        line = (f"{r['dataset'].rpartition(':')[2]:8} {r['temperature']:4.1f} {method:17} {r['verifier']:12} {r['budget']:6d} "
                f"{r['depth']:5d} {r['prompts']:3d} {r['tokens_per_step']:8.2f} {r['mean_tree_size']:6.1f}")
        if latency:
            sp = r["speedup_vs_ar"]
            line += f" {r['median_seconds_per_token'] * 1e3:9.1f} {'-' if sp is None else f'{sp:7.2f}'}"
        print(line, file=out)


def curve_figure(rows: list[dict], path: Path) -> Optional[Path]:
    """Tokens/step vs tree budget per method (plotly; PNG via kaleido, HTML fallback)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for method in sorted({r["method"] for r in rows}):
        pts = sorted((r["budget"], r["tokens_per_step"]) for r in rows if r["method"] == method)
        fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers", name=method))
    fig.update_layout(title="Tokens per step vs tree budget (T=0)", xaxis_title="tree budget (nodes incl. root)",
                      yaxis_title="mean tokens per step", xaxis_type="log", template="plotly_white")
    fig.write_html(path.with_suffix(".html"))
    try:
        from ..figure_export import write_images

        return write_images({path.name: fig}, path.parent, formats=("png",))[0]
    except Exception as e:  # noqa: BLE001 - a missing browser must not lose the measurements
        print(f"(PNG export unavailable: {e}; wrote {path.with_suffix('.html')})", file=sys.stderr)
        return path.with_suffix(".html")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dyntree_core.bench acceptance|latency|all")
    p.add_argument("mode", choices=("acceptance", "latency", "all"))
    p.add_argument("--pair", default="embedded", help="'embedded', 'tiny' (random test pair) or draft_spec,target_spec")
    p.add_argument("--methods", nargs="*", default=list(TREE_METHODS), choices=TREE_METHODS,
                   help="tree methods of the main table (none: only the AR baseline and the other sections)")
    p.add_argument("--verifiers", nargs="+", default=["auto"], help="verifiers to run at T>0 for each stochastic method")
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 0.6])
    p.add_argument("--datasets", nargs="+", default=["wiki", "news", "code"])
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--curve-budgets", nargs="+", type=int, default=list(CURVE_BUDGETS))
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--threshold", type=float, default=None, help="DySpec/OPT/DynaTree threshold (default 1/budget for DySpec)")
    p.add_argument("--calib-prompts", type=int, default=8)
    p.add_argument("--dtype", default=None, help="default bfloat16 for latency/all, float32 for acceptance")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tune-methods", nargs="*", default=None, choices=TREE_METHODS,
                   help="methods whose hardware-tuned configuration is compared with fixed budgets "
                        "(default: dyspec_greedy in 'all' mode, none otherwise)")
    p.add_argument("--tune-fixed-budgets", nargs="+", type=int, default=[16, 32, 64, 128])
    p.add_argument("--tune-prompts", type=int, default=None, help="evaluation prompts of the tuning comparison (default --prompts)")
    p.add_argument("--tune-calib-prompts", type=int, default=8, help="calibration prompts per tuned point (calib split)")
    p.add_argument("--tune-new-tokens", type=int, default=32, help="tokens decoded per calibration prompt")
    p.add_argument("--retune", action="store_true", help="ignore cached hardware profiles and tunings")
    p.add_argument("--curve-prompts", type=int, default=None, help="prompts per point of the budget curve (default --prompts)")
    p.add_argument("--curve-methods", nargs="*", default=None, choices=TREE_METHODS,
                   help="methods of the budget curve (default --methods)")
    p.add_argument("--json", type=Path, default=None)
    return p


def _load(pair_spec: str, dtype: str, device: str):
    if pair_spec == "tiny":
        from types import SimpleNamespace

        from ..testing import tiny_pair

        draft, target = tiny_pair(seed=0)

        class _Tok:
            def __call__(self, text, add_special_tokens=False):
                return {"input_ids": [2 + (ord(c) % 60) for c in text]}

        return SimpleNamespace(draft=draft, target=target, tokenizer=_Tok(), name="tiny")
    from ..models import load_pair

    d, _, t = pair_spec.partition(",")
    return load_pair(d or "embedded", t or d or "embedded", dtype=dtype, device=device)


def main(argv: Optional[list[str]] = None) -> int:
    from tqdm import tqdm

    from ..decode.engine import SpeculativeDecoder
    from ..prompts import load_prompts

    args = build_parser().parse_args(argv)
    dtype = args.dtype or ("float32" if args.mode == "acceptance" else "bfloat16")
    pair = _load(args.pair, dtype, args.device)
    torch.manual_seed(args.seed)
    tune_methods = args.tune_methods if args.tune_methods is not None else (["dyspec_greedy"] if args.mode == "all" else [])
    if tune_methods and args.mode == "acceptance":
        print("--tune-methods compares latency: use the latency or all mode", file=sys.stderr)
        return 2

    prompts = {ds: [(p.id, _encode(pair.tokenizer, p.text, args.prompt_tokens)) for p in load_prompts(ds, args.prompts, split="eval")]
               for ds in args.datasets}
    calib_texts = [_encode(pair.tokenizer, p.text, 256) for ds in args.datasets for p in load_prompts(ds, args.calib_prompts, split="calib")]
    section_prompts = {"curve": args.curve_prompts or args.prompts, "tune": args.tune_prompts or args.prompts}

    def prompts_of(item: PlanItem) -> list[tuple[str, list[int]]]:
        section = item.dataset.partition(":")[0] if ":" in item.dataset else None
        ps = prompts[item.prompt_set]
        return ps[: section_prompts[section]] if section else ps

    plan: list[PlanItem] = []
    for ds in args.datasets:
        for temp in args.temperatures:
            if args.mode != "acceptance":  # AR makes 1 token per step by definition; only its latency is news
                plan.append(PlanItem(ds, temp, "autoregressive", "auto", 1))
            for m in args.methods:
                for v in (["auto"] if temp == 0 else args.verifiers):
                    plan.append(PlanItem(ds, temp, m, v, args.budget))
    if args.mode == "all":
        for m in (args.methods if args.curve_methods is None else args.curve_methods):
            for b in args.curve_budgets:
                plan.append(PlanItem("curve:" + args.datasets[0], 0.0, m, "auto", b))

    sequoia_acc: dict[float, tuple[float, ...]] = {}

    def sequoia_vector(temp: float) -> tuple[float, ...]:
        if temp not in sequoia_acc:
            sequoia_acc[temp] = calibrate_sequoia(pair, calib_texts, temp)
        return sequoia_acc[temp]

    def make_cfg(item: PlanItem) -> DecodeConfig:
        if item.config is not None:
            return item.config
        return DecodeConfig(
            method=item.method, verifier=item.verifier, temperature=item.temperature, budget=max(2, item.budget),
            depth=args.depth, width=args.width, threshold=args.threshold or default_threshold(item.budget),
            seed=args.seed, dtype=dtype, device=args.device,
            sequoia_acceptance=sequoia_vector(item.temperature) if item.method == "sequoia" else None,
            trace_block_counts=False,
        )

    tunings: list[dict] = []
    started = time.time()
    partial = False
    records: list[PromptRun] = []
    try:
        if tune_methods:
            plan += _tuning_plan(args, pair, dtype, tune_methods, make_cfg, tunings)
        total = sum(len(prompts_of(item)) for item in plan)
        bar = tqdm(total=total, desc="bench", unit="run", file=sys.stderr)
        try:
            for item in plan:
                if item.method == "sequoia" and item.temperature not in sequoia_acc and item.config is None:
                    bar.set_postfix_str(f"calibrating Sequoia acceptance at T={item.temperature}")
                try:
                    cfg = make_cfg(item)
                except ValueError as e:
                    print(f"skipping {item.method}/{item.verifier} at T={item.temperature}: {e}", file=sys.stderr)
                    bar.update(len(prompts_of(item)))
                    continue
                decoder = SpeculativeDecoder(pair.draft, pair.target, cfg)
                verifier = cfg.resolved_verifier() if item.method != "autoregressive" else "none"
                for i, (pid, ids) in enumerate(prompts_of(item)):
                    bar.set_postfix_str(f"{item.dataset} T={item.temperature} {item.method}/{item.verifier} "
                                        f"b={cfg.budget} d={cfg.depth} {item.label}")
                    res = run_generation(decoder, ids, args.new_tokens, seed=args.seed + i)
                    records.append(PromptRun(item.dataset, pid, item.method, verifier, item.temperature,
                                             cfg.budget if item.method != "autoregressive" else 1,
                                             cfg.depth if item.method != "autoregressive" else 0, item.label, **res))
                    bar.update(1)
        finally:
            bar.close()
    except KeyboardInterrupt:
        partial = True
        print("\ninterrupted: keeping the partial results", file=sys.stderr)

    def section(r: PromptRun) -> str:
        return r.dataset.partition(":")[0] if ":" in r.dataset else "main"

    main_rows = _summaries([r for r in records if section(r) == "main"])
    curve_rows = _summaries([r for r in records if section(r) == "curve"])
    tune_rows = _summaries([r for r in records if section(r) == "tune"])
    print_table(main_rows, latency=args.mode != "acceptance")
    if args.mode == "all":
        print("\ntokens/step vs budget (T=0, " + args.datasets[0] + ")")
        print_table(curve_rows, latency=True)
    if tune_rows:
        print(f"\nhardware-tuned vs fixed budgets ({args.datasets[0]}, same prompts, same run)")
        print_table(tune_rows, latency=True)
        for t in tunings:
            verdict = _tuned_verdict(tune_rows, t["method"], t["temperature"])
            t["verdict"] = verdict
            print(f"  {t['method']} T={t['temperature']}: {verdict['text']}")
    result = {
        "mode": args.mode, "partial": partial, "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "dtype": dtype, "machine": {"platform": platform.platform(), "processor": platform.processor(),
                                    "threads": torch.get_num_threads(), "torch": torch.__version__,
                                    "device": args.device,
                                    "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
        "machine_info": machine_info().to_dict(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "wall_seconds": time.time() - started,
        "sequoia_acceptance": {str(k): v for k, v in sequoia_acc.items()},
        "summary": main_rows, "curve": curve_rows if args.mode == "all" else [],
        "tuning": tunings, "tuned_vs_fixed": tune_rows,
        "runs": [asdict(r) | {"seconds_per_token": r.seconds_per_token} for r in records],
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)
        if args.mode == "all" and curve_rows:
            curve_figure(curve_rows, args.json.with_name(args.json.stem + "_curve"))
    return 130 if partial else 0


def _tuning_plan(args, pair, dtype: str, methods: Sequence[str], make_cfg, tunings: list[dict]) -> list[PlanItem]:
    """Profile this machine, tune each method at each temperature on the calibration split, and
    plan the comparison: AR, every fixed budget, the tuned configuration (same prompts)."""
    import dataclasses

    from ..planning.profiling import load_or_measure_profile
    from ..planning.tuning import CALIBRATION_NS, load_or_tune
    from ..prompts import load_prompts

    ds = args.datasets[0]
    d, _, t = args.pair.partition(",")
    name = f"{d or 'embedded'},{t or d or 'embedded'}"
    print(f"the machine profile of {name} at {dtype} (measured once per machine, then cached)", file=sys.stderr)
    profile = load_or_measure_profile(lambda role, _p: pair.draft if role == "draft" else pair.target, name,
                                      args.device, [dtype], refresh=args.retune, target_ns=CALIBRATION_NS,
                                      progress=lambda m: print("  " + m, file=sys.stderr))
    calib = [_encode(pair.tokenizer, p.text, args.prompt_tokens)
             for p in load_prompts(ds, args.tune_calib_prompts, split="calib")]
    plan: list[PlanItem] = []
    for temp in args.temperatures:
        plan.append(PlanItem("tune:" + ds, temp, "autoregressive", "auto", 1))
        for m in methods:
            base = make_cfg(PlanItem(ds, temp, m, "auto", args.budget))
            print(f"tuning {m} at T={temp} ({len(calib)} calibration prompts x {args.tune_new_tokens} tokens)",
                  file=sys.stderr)
            res = load_or_tune(pair.draft, pair.target, base, profile, refresh=args.retune, prompts=calib,
                               new_tokens=args.tune_new_tokens, eos_token_id=list(getattr(pair, "eos_token_ids", ())) or None,
                               progress=lambda msg: print("  " + msg, file=sys.stderr))
            best = res.best
            print(f"  -> budget {best.budget}, depth {best.depth}, width {best.width}: predicted "
                  f"{best.predicted_seconds_per_token * 1e3:.1f} ms/token ({len(res.points)} points, {res.seconds:.0f} s)",
                  file=sys.stderr)
            if "argmin_budget" in res.meta and (res.meta["argmin_budget"], res.meta["argmin_depth"]) != (best.budget, best.depth):
                print(f"     (the calibration argmin, budget {res.meta['argmin_budget']} depth {res.meta['argmin_depth']}: "
                      f"{res.meta['argmin_predicted_seconds_per_token'] * 1e3:.1f} ms/token, is within one paired "
                      f"standard error ({res.meta['paired_standard_error'] * 1e3:.1f} ms): the smaller / shallower tree is kept)",
                      file=sys.stderr)
            tunings.append({"method": m, "temperature": temp, "profile": dataclasses.asdict(profile),
                            "result": json.loads(res.to_json())})
            for b in args.tune_fixed_budgets:
                plan.append(PlanItem("tune:" + ds, temp, m, "auto", b, "fixed",
                                     make_cfg(PlanItem(ds, temp, m, "auto", b))))
            plan.append(PlanItem("tune:" + ds, temp, m, "auto", best.budget, "tuned", res.apply(base)))
    return plan


def _tuned_verdict(rows: list[dict], method: str, temperature: float) -> dict:
    """Does the tuned row beat every fixed-budget row of the same method and temperature?"""
    mine = [r for r in rows if r["method"] == method and r["temperature"] == temperature]
    tuned = [r for r in mine if r["label"] == "tuned"]
    fixed = [r for r in mine if r["label"] == "fixed"]
    if not tuned or not fixed:
        return {"beats_all_fixed": None, "text": "incomplete (interrupted?)"}
    t = tuned[0]["median_seconds_per_token"]
    best_fixed = min(fixed, key=lambda r: r["median_seconds_per_token"])
    beats = all(t < r["median_seconds_per_token"] for r in fixed)
    return {
        "beats_all_fixed": beats,
        "tuned_ms_per_token": t * 1e3,
        "best_fixed_budget": best_fixed["budget"],
        "best_fixed_ms_per_token": best_fixed["median_seconds_per_token"] * 1e3,
        "text": (f"tuned {t * 1e3:.1f} ms/token vs best fixed budget {best_fixed['budget']} "
                 f"{best_fixed['median_seconds_per_token'] * 1e3:.1f} ms/token: "
                 + ("beats every fixed budget" if beats else "does NOT beat every fixed budget")),
    }


if __name__ == "__main__":
    sys.exit(main())
