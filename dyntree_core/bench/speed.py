"""``python -m dyntree_core.bench speed``: decode speed by precision and against transformers, in one run.

Rows (each over the same prompts, same new-token count, decode time only: prefill excluded):

* ``autoregressive @ P`` for every precision P in ``--precisions`` (target only);
* ``auto``: the configuration ``dyntree_core.planning.auto`` chooses for this machine at each temperature
  (precision of both models, method, shape), with its predicted ms/token next to the measured one;
* ``hf_generate``: transformers' ``generate`` on the target at the best autoregressive precision;
* ``hf_assisted``: transformers' ``generate(assistant_model=draft)``, same target precision, draft at
  the precision ``auto`` chose (``bench.hf_baselines``; its first draft/verify round is not timed);
* ``hf_prompt_lookup``: transformers' prompt-lookup decoding (``--hf-prompt-lookup K`` candidates
  copied after an n-gram match in the prompt/output; no draft model), same target precision;
* ``fixed: chain k=4`` and any ``--fixed`` configs, at ``auto``'s precisions (a Sequoia tree with the
  acceptance vector ``auto`` measured);
* with ``--llamacpp-bin DIR`` (T=0 only; ``bench.llamacpp_native``; ``make peers`` builds them): llama.cpp's own
  binaries on the same GGUF files, prompts and thread count, no Python in their loop: ``llama.cpp plain``
  (``llama-completion``), ``llama.cpp draft-simple`` and ``llama.cpp ngram-simple`` (``llama-speculative-simple``),
  and ``llama-bench``'s prompt processing / generation of the target (``record["llama_cpp_native"]["forwards"]``);
* without it, ``llama-cpp-python plain`` / ``draft`` / ``ngram`` (T=0 only; ``bench.llamacpp``): llama.cpp's library
  driven from Python (its n-gram and draft loops are Python), when ``llama-cpp-python`` is installed (the
  ``llamacpp`` extra; absent, the bench says how to get it and records why the rows are missing).

``auto`` chooses among ``--auto-precisions`` (default: every precision it prices on the device),
independently of the precisions of the autoregressive rows.

Every cell is the median over prompts of ms/token, with the mean tokens per step. The JSON
(``--json``, default ``bench/results/precision_<machine label>.json``) records the CPU model and flags,
the profile, the acceptance vector, the plan and its reason. At T>0 autoregressive rows are measured
only at the precision auto finds fastest (``--all-ar-temperatures`` for all): an autoregressive step
costs the same at any temperature.
The JSON is rewritten after every cell, so an interrupted run keeps what it measured.

``--interleave``: the rows of a temperature run prompt by prompt (every row on a dataset's first prompt, then on
its second, ...) instead of row by row, so that a machine whose speed drifts over minutes slows every row alike;
the per-prompt ratios (``record["per_prompt_ratios"]``: each row against ``llama.cpp plain`` and against the
fastest llama.cpp row of the same prompt, where those rows ran) then compare like with like.

Before each prompt of each row the bench sums a ``--probe-mib`` buffer (``memory_bandwidth.read_gb_per_s``) and
records the memory read bandwidth it saw (``read_gb_per_s_before``, per prompt): a one-token forward reads every
weight, so plain decoding follows the machine's bandwidth. On a VM whose bandwidth jumps between spells (the
2-core Zen 4 host: ~34 and ~57 GB/s, minutes each) the ratios are also given per spell
(``record["per_prompt_ratios"][...][row]["vs"][reference]["by_spell"]``): prompts where both runs saw the
slower, or both the faster, bandwidth (``spell_split``).

``auto`` plans as the app's Run does: from the profile of the spell the probe before each prompt saw (a spell
without one gets it measured then, as the app measures it in the background), so each of its prompts records the
plan it ran (``plan_per_prompt``), that plan's predicted ms/token, ``measured_over_predicted`` and
``tokens_per_step_over_expected`` (how much of the miss the text's acceptance explains), ``parts_over_priced``
(``planning.prediction.check_prediction``, as the app's status line checks a Run: draft, target forward and the
rest of the step each against its profile price at the run's own sizes, tokens per step), and the probed
bandwidth of the profile that priced it (``profile_read_gb_per_s``); ``--plan-once`` keeps the plan made at the
start for every prompt. A run that falls back (``DecodeConfig.fallback``) still verifies the text's own repeats
(``drafting.repeats``; ``repeat_steps`` per prompt); ``--fallback-ab`` adds the row ``auto, plain steps after its
fallback`` without them. Inside its runs too, a step whose text repeats itself verifies the repeats where they are
priced to beat the run's tree steps; ``--repeats-ab`` adds the row ``auto, no repeats inside its runs``.
``--prompt-aware`` adds the row ``auto, priced for the prompt``: the same, with each prompt priced on the
calibration texts whose prompts' draft/target agreement is nearest its own (``plan_auto``'s ``prompt_ids``; each
prompt records its ``prompt_agreement``); the app's ``auto`` does not do that yet.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from ..planning.auto import AutoPlan, plan_auto, priced_for_spell
from ..planning.pair_cache import PairCache
from ..planning.prediction import check_prediction
from ..planning.search_space import AUTO
from ..memory_bandwidth import read_gb_per_s
from ..planning.profiling import SPELL_GAP
from ..config import DecodeConfig, parse_spec_factor
from ..decode.engine import SpeculativeDecoder
from ..drafting.repeats import repeat_steps
from ..machine import machine_info
from .hf_baselines import hf_assisted_defaults, hf_generate
from .llamacpp_native import NATIVE_ROWS


@dataclass
class Cell:
    row: str
    dataset: str
    temperature: float
    ms_per_token: list[float] = field(default_factory=list)
    tokens_per_step: list[float] = field(default_factory=list)
    tokens: int = 0
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict:
        med = statistics.median(self.ms_per_token) if self.ms_per_token else float("nan")
        return {"row": self.row, "dataset": self.dataset, "temperature": self.temperature,
                "median_ms_per_token": med, "prompts": len(self.ms_per_token),
                "mean_tokens_per_step": statistics.fmean(self.tokens_per_step) if self.tokens_per_step else None,
                "tokens": self.tokens, "per_prompt_ms_per_token": self.ms_per_token, **self.extra}


def _ours(dec: SpeculativeDecoder, ids: list[int], n: int, seed: int,
          per_prompt: Optional[list[dict]] = None, traces: Optional[list] = None) -> tuple[float, float, int]:
    """(ms/token, tokens/step, tokens) of one prompt; ``per_prompt`` gets ``{"fell_back_after_step": the step
    after which the run decoded plainly (DecodeConfig.fallback), or None, "repeat_steps": the steps that verified the
    text's own repeats (drafting.repeats: inside the run and after its fallback)}``; ``traces`` gets the steps."""
    steps = tokens = 0
    seconds = 0.0
    at = None
    ran: list = []
    for tr in dec.generate(ids, n, seed=seed):
        ran.append(tr)
        steps += 1
        tokens += len(tr.committed)
        seconds += tr.step_seconds
        at = tr.step + 1 if tr.fallback else at
    if traces is not None:
        traces.extend(ran)
    if per_prompt is not None:
        per_prompt.append({"fell_back_after_step": at, "repeat_steps": repeat_steps(ran)})
    return seconds * 1e3 / max(tokens, 1), tokens / max(steps, 1), tokens


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dyntree_core.bench speed", description=__doc__.splitlines()[0])
    p.add_argument("--pair", default="embedded", help="'embedded', 'draft,target' specs, or 'tiny' (tests)")
    p.add_argument("--datasets", nargs="+", default=["wiki", "code"])
    p.add_argument("--prompts", type=int, default=10, help="prompts per dataset (eval slice)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.6])
    p.add_argument("--precisions", nargs="+", default=["float32", "bfloat16", "int8", "int4"],
                   help="precisions of the autoregressive rows")
    p.add_argument("--auto-precisions", nargs="+", default=None,
                   help="precisions auto may choose from (default: those it prices on this device, "
                        "whatever --precisions says)")
    p.add_argument("--all-ar-temperatures", action="store_true",
                   help="autoregressive rows at every temperature for every precision (default: at T=0 for "
                        "all, at other temperatures only for the precision auto finds fastest: an "
                        "autoregressive step costs the same at any temperature)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers rows")
    p.add_argument("--hf-rows", nargs="+", default=["generate", "assisted", "prompt_lookup"],
                   choices=("generate", "assisted", "prompt_lookup"), help="which transformers rows to run")
    p.add_argument("--hf-prompt-lookup", type=int, default=10, metavar="K",
                   help="transformers' prompt-lookup decoding row with K candidate tokens (0: no such row)")
    p.add_argument("--fixed", nargs="*", default=["chain:4"],
                   help="fixed tree configs at auto's precisions: method:depth, method:budget:depth or "
                        "method:budget:depth:spec_factor (suffix / hybrid match-length cap; 'none' = no cap)")
    p.add_argument("--llamacpp-rows", nargs="*", default=["plain", "draft", "ngram"],
                   choices=("plain", "draft", "ngram"),
                   help="llama.cpp peer rows at T=0 (none: no llama.cpp rows); need llama-cpp-python")
    p.add_argument("--llamacpp-draft-max", type=int, default=16, help="llama.cpp draft row: most draft tokens")
    p.add_argument("--llamacpp-draft-p-min", type=float, default=0.75,
                   help="llama.cpp draft row: stop drafting below this draft probability")
    p.add_argument("--llamacpp-ngram", type=int, default=10, metavar="K",
                   help="llama.cpp n-gram row: tokens copied after a match (LlamaPromptLookupDecoding)")
    p.add_argument("--llamacpp-bin", type=Path, default=None, metavar="DIR",
                   help="llama.cpp's own binaries (make peers prints DIR): native plain, draft-simple and "
                        "ngram-simple rows and llama-bench's pp/tg instead of llama-cpp-python's rows")
    p.add_argument("--llamacpp-native-rows", nargs="*", default=list(NATIVE_ROWS), choices=NATIVE_ROWS,
                   help="which native llama.cpp rows to run with --llamacpp-bin")
    p.add_argument("--llamacpp-bench-ns", type=int, nargs="*", default=[1, 4, 16, 32, 64],
                   help="llama-bench prompt sizes (pp n: one forward of n rows) with --llamacpp-bin (none: skip)")
    p.add_argument("--interleave", action="store_true",
                   help="run the rows of each temperature prompt by prompt (every row on prompt 1, then on prompt 2, "
                        "...): a drifting machine's spells fall on every row alike")
    p.add_argument("--no-ours", action="store_true",
                   help="skip our rows and transformers' (only llama.cpp's; plans are still made for the prompts)")
    p.add_argument("--probe-mib", type=int, default=512,
                   help="memory read bandwidth probe before each prompt of each row: MiB summed (0: no probe)")
    p.add_argument("--plan-once", action="store_true",
                   help="auto runs the plan made at the start on every prompt (default: planned before each prompt "
                        "from the profile of the spell its probe saw, as the app plans each Run)")
    p.add_argument("--prompt-aware", action="store_true",
                   help="add the row 'auto, priced for the prompt': auto priced on the calibration texts whose "
                        "prompts' draft/target agreement is nearest each prompt's own")
    p.add_argument("--fallback-ab", action="store_true",
                   help="add the row 'auto, plain steps after its fallback': auto without the text's repeats "
                        "drafted after a fallback (drafting.repeats), as it decoded before them")
    p.add_argument("--repeats-ab", action="store_true",
                   help="add the row 'auto, no repeats inside its runs': auto whose tree steps are never replaced by "
                        "the text's repeats before a fallback (SpeculativeDecoder.repeats_in_run)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--seed", type=int, default=0)
    return p


class _CharTokenizer:
    """Characters -> tiny-vocabulary ids (the speed bench's ``--pair tiny`` test mode)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [2 + (ord(c) % 60) for c in text]}


def _parse_fixed(spec: str) -> dict:
    parts = spec.split(":")
    if len(parts) == 2:
        return {"method": parts[0], "depth": int(parts[1]), "budget": max(2, int(parts[1]) + 1)}
    if len(parts) in (3, 4):
        out = {"method": parts[0], "budget": int(parts[1]), "depth": int(parts[2])}
        if len(parts) == 4:  # suffix / hybrid: the match-length cap, or 'none'
            out["spec_factor"] = parse_spec_factor(parts[3])
        return out
    raise SystemExit(f"--fixed takes method:depth, method:budget:depth or method:budget:depth:spec_factor "
                     f"(suffix/hybrid; 'none' = no cap), got {spec!r}")


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    say: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    t_start = time.perf_counter()
    if args.pair == "tiny":
        from ..testing import TinyPairCache

        models = TinyPairCache(_CharTokenizer())
    else:
        d, _, t = args.pair.partition(",")
        models = PairCache(d or "embedded", t or d or "embedded", keep=2)
    mi = machine_info()
    out_path = args.json or Path("bench/results") / f"precision_{mi.short_label()}.json"
    from ..quant.kernel_table import table_identity

    record: dict = {"bench": "speed", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:],
                    "machine_info": mi.to_dict(), "torch": torch.__version__, "pair": args.pair,
                    "kernels": table_identity(), "threads": torch.get_num_threads(),
                    "new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens, "plans": {}, "cells": []}
    cells: list[Cell] = []

    def save() -> None:
        record["cells"] = [c.summary() for c in cells]
        record["seconds"] = time.perf_counter() - t_start
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(record, indent=1))

    probe = torch.ones(args.probe_mib << 18) if args.probe_mib > 0 else None
    probed: list[Optional[float]] = [None]  # the latest probe (``run_one``)

    def probe_now() -> Optional[float]:
        probed[0] = round(read_gb_per_s(samples=3, buffer=probe), 1) if probe is not None else None
        return probed[0]

    plans: dict[float, AutoPlan] = {}
    spell_plans: dict[float, list[AutoPlan]] = {}
    for temp in args.temperatures:
        plans[temp] = plan_auto(models, temp, target_precisions=args.auto_precisions, progress=say,
                                read_gb_per_s=probe_now())
        spell_plans[temp] = [plans[temp]]
        record["plans"][str(temp)] = plans[temp].to_dict()

    def plan_in_spell(temp: float) -> AutoPlan:
        """The plan for the spell of the latest probe: made once per spell (``priced_for_spell``)."""
        if args.plan_once:
            return plans[temp]
        for plan in spell_plans[temp]:
            if priced_for_spell(plan, probed[0]):
                return plan
        say(f"auto at T={temp:g}: the memory reads {probed[0]} GB/s, another spell: planning for it")
        plan = plan_auto(models, temp, target_precisions=args.auto_precisions, progress=say, read_gb_per_s=probed[0])
        if plan.profile is not None and plan.profile.provisional:  # (not stored: the app prices by the nearest)
            plan = plan_auto(models, temp, target_precisions=args.auto_precisions, progress=say, measure=False,
                             read_gb_per_s=probed[0])
        spell_plans[temp].append(plan)
        record.setdefault("plans_by_spell", {}).setdefault(str(temp), []).append(plan.to_dict())
        return plan
    from ..prompts import load_prompts

    base = models.pair(plans[args.temperatures[0]].best.target_precision,
                       plans[args.temperatures[0]].best.draft_precision or args.precisions[0])
    tok = base.tokenizer
    eos = list(getattr(base, "eos_token_ids", ()) or ())
    prompts = {ds: [list(tok(p.text, add_special_tokens=False)["input_ids"])[:args.prompt_tokens]
                    for p in load_prompts(ds, args.prompts)] for ds in args.datasets}

    pending: list[tuple] = []  # (row, temp, runner, extra, per_prompt) until run_pending()

    def run_one(cell: Cell, runner, per_prompt: Optional[list[dict]], i: int, ids: list[int]) -> None:
        if probe is not None:
            cell.extra.setdefault("read_gb_per_s_before", []).append(probe_now())
        ms, tps, ntok = runner(ids, args.seed + i)
        cell.ms_per_token.append(ms)
        cell.tokens_per_step.append(tps)
        cell.tokens += ntok
        for k, v in (per_prompt.pop() if per_prompt else {}).items():
            cell.extra.setdefault(k, []).append(v)

    def done(cell: Cell) -> None:
        say(f"{cell.row:<44} {cell.dataset:<5} T={cell.temperature:<4g} {statistics.median(cell.ms_per_token):8.1f} "
            f"ms/token ({statistics.fmean(cell.tokens_per_step):.2f} tokens/step, "
            f"{time.perf_counter() - t_start:.0f} s)")
        if cell.extra.get("measured_over_predicted"):
            say(f"  {cell.row}: measured / predicted ms/token {prediction_summary(cell.extra)}")
        save()

    def run_rows(row: str, temp: float, runner, extra: Optional[dict] = None,
                 per_prompt: Optional[list[dict]] = None) -> None:
        """One cell per dataset; ``extra``: fields every cell of the row records; ``per_prompt``: the list the
        runner appends one dict to per prompt, each of whose fields the cell records as a per-prompt list.
        It runs now, or with ``--interleave`` at the temperature's ``run_pending`` beside the other rows."""
        pending.append((row, temp, runner, extra, per_prompt))
        if not args.interleave:
            run_pending()

    def run_pending() -> None:
        """Every pending row on a dataset's first prompt, then on its second, ..."""
        for ds, plist in prompts.items():
            here = [(Cell(row, ds, temp, extra=dict(extra or {})), runner, pp)
                    for row, temp, runner, extra, pp in pending]
            cells.extend(c for c, _, _ in here)
            for i, ids in enumerate(plist):
                for cell, runner, pp in here:
                    run_one(cell, runner, pp, i, ids)
            for cell, _, _ in here:
                done(cell)
        pending.clear()

    def ours(pair, cfg: DecodeConfig, per_prompt: Optional[list[dict]] = None):
        if args.interleave:  # a decoder per prompt: the rows' decoders take turns preparing the same models
            return lambda ids, seed: _ours(SpeculativeDecoder(pair.draft, pair.target, cfg, eos_token_id=eos or None),
                                           ids, args.new_tokens, seed, per_prompt)
        dec = SpeculativeDecoder(pair.draft, pair.target, cfg, eos_token_id=eos or None)
        return lambda ids, seed: _ours(dec, ids, args.new_tokens, seed, per_prompt)

    def auto_runner(temp: float, per_prompt: list[dict], for_prompt: bool = False, repeats: bool = True,
                    in_run: bool = True):
        """``auto`` on one prompt: the plan of the spell the prompt's probe saw, its prediction beside the run;
        ``for_prompt``: priced on the calibration texts nearest the prompt (``plan_auto``'s ``prompt_ids``);
        ``repeats``: the text's repeats drafted after a fallback (``SpeculativeDecoder.repeats_after_fallback``);
        ``in_run``: and inside the run (``SpeculativeDecoder.repeats_in_run``)."""
        def run(ids: list[int], seed: int) -> tuple[float, float, int]:
            plan = plan_in_spell(temp)  # (for_prompt too: it measures a new spell's profile, which measure=False reads)
            if for_prompt:
                t0 = time.perf_counter()
                plan = plan_auto(models, temp, target_precisions=args.auto_precisions, measure=False,
                                 read_gb_per_s=probed[0], prompt_ids=ids)
                planned_s = time.perf_counter() - t0
            pair = models.pair(plan.best.target_precision, plan.best.draft_precision or plan.fastest_draft_precision)
            dec = SpeculativeDecoder(pair.draft, pair.target, plan.apply(DecodeConfig(temperature=temp, seed=args.seed)),
                                     eos_token_id=eos or None)
            dec.repeats_after_fallback = repeats
            dec.repeats_in_run = in_run
            traces: list = []
            ms, tps, ntok = _ours(dec, ids, args.new_tokens, seed, per_prompt, traces)
            predicted = plan.best.seconds_per_token * 1e3
            check = check_prediction(plan.prediction(AUTO, plan.best.target_precision, plan.best.draft_precision),
                                     traces)
            per_prompt[-1].update(plan_per_prompt=plan.best.label(), predicted_ms_per_token_per_prompt=round(predicted, 2),
                                  measured_over_predicted=round(ms / predicted, 3),
                                  tokens_per_step_over_expected=round(tps / plan.best.expected_tokens, 3),
                                  parts_over_priced=None if check is None else {
                                      _part_key(part.name): round(part.ratio, 3) for part in check.parts},
                                  profile_read_gb_per_s=plan.profile.read_gb_per_s if plan.profile else None)
            if for_prompt:
                per_prompt[-1].update(prompt_agreement=plan.prompt_agreement, planning_seconds=round(planned_s, 3))
            return ms, tps, ntok
        return run

    for temp in args.temperatures:
        plan = plans[temp]
        dp = plan.best.draft_precision or plan.fastest_draft_precision
        if temp == 0 and args.llamacpp_bin is not None:
            native_llamacpp_rows(args, record, prompts, tok, run_rows, say)
        elif temp == 0 and args.llamacpp_rows:
            llamacpp_rows(args, record, prompts, eos, run_rows, say)
        if args.no_ours:
            continue
        # autoregressive at each precision (target only: the draft is not used)
        for prec in args.precisions:
            if temp != 0 and not args.all_ar_temperatures and prec != plan.best_autoregressive.target_precision:
                continue
            pair = models.pair(prec, dp)
            run_rows(f"autoregressive @ {prec}", temp, ours(pair, DecodeConfig(method="autoregressive",
                                                                                 temperature=temp, seed=args.seed)))
        pair = models.pair(plan.best.target_precision, dp)
        per_prompt: list[dict] = []
        run_rows("auto", temp, auto_runner(temp, per_prompt),
                 extra=dict(plan=plan.best.label(), predicted_ms_per_token=plan.best.seconds_per_token * 1e3,
                            break_even_tokens=plan.break_even_tokens()), per_prompt=per_prompt)
        if args.fallback_ab:
            before: list[dict] = []
            run_rows("auto, plain steps after its fallback", temp, auto_runner(temp, before, repeats=False),
                     per_prompt=before)
        if args.repeats_ab:
            without: list[dict] = []
            run_rows("auto, no repeats inside its runs", temp, auto_runner(temp, without, in_run=False),
                     per_prompt=without)
        if args.prompt_aware:
            aware: list[dict] = []
            run_rows("auto, priced for the prompt", temp, auto_runner(temp, aware, for_prompt=True), per_prompt=aware)
        for spec in args.fixed:
            fx = _parse_fixed(spec)
            if fx["method"] == "sequoia":  # the acceptance vector auto measured, as auto's own Sequoia trees use
                fx["sequoia_acceptance"] = tuple(plan.acceptance)
            cfg = DecodeConfig(temperature=temp, seed=args.seed, **fx)
            run_rows(f"fixed: {spec} @ target {plan.best.target_precision}, draft {dp}", temp, ours(pair, cfg))
        if not args.no_hf:
            hf_pair = models.pair(plan.best_autoregressive.target_precision, dp)
            record.setdefault("hf_assisted_defaults", hf_assisted_defaults(hf_pair.draft))

            def hf(draft, prompt_lookup_tokens=None):
                def run(ids, seed):
                    r = hf_generate(hf_pair.target, ids, args.new_tokens, draft=draft, temperature=temp,
                                    seed=seed, eos_token_id=eos or None, prompt_lookup_tokens=prompt_lookup_tokens)
                    return r.seconds_per_token * 1e3, float("nan"), r.new_tokens
                return run

            tp = plan.best_autoregressive.target_precision
            if "generate" in args.hf_rows:
                run_rows(f"hf_generate @ {tp}", temp, hf(None))
            if "assisted" in args.hf_rows:
                run_rows(f"hf_assisted @ target {tp}, draft {dp}", temp, hf(hf_pair.draft))
            if args.hf_prompt_lookup > 0 and "prompt_lookup" in args.hf_rows:
                k = args.hf_prompt_lookup
                run_rows(f"hf_prompt_lookup k={k} @ {tp}", temp, hf(None, prompt_lookup_tokens=k))
        run_pending()
    record["per_prompt_ratios"] = per_prompt_ratios(record["cells"])
    save()
    print_table(record, sys.stdout)
    print_ratios(record["per_prompt_ratios"], sys.stdout)
    say(f"wrote {out_path}")
    return 0


def _gguf_paths(pair: str) -> tuple[Optional[str], Optional[str], str]:
    """(draft GGUF, target GGUF, why not) for a pair spec; llama.cpp needs GGUF files."""
    from ..models.load import resolve_spec

    if pair == "tiny":
        return None, None, "the tiny test pair has no GGUF"
    d, _, t = pair.partition(",")
    try:
        ds, ts = resolve_spec(d or "embedded", "draft"), resolve_spec(t or d or "embedded", "target")
    except Exception as e:  # an unknown spec was already refused when the pair loaded; be safe
        return None, None, str(e)
    paths = [s.gguf if s.kind == "preset" else (s.location if s.kind == "gguf" else None) for s in (ds, ts)]
    if None in paths:
        return None, None, "llama.cpp needs GGUF files for both models"
    return paths[0], paths[1], ""


def _peer_files(args, rec: dict, available: bool, unavailable: str, name: str,
                say) -> Optional[tuple[str, str, int]]:
    """(draft GGUF, target GGUF, threads) for a llama.cpp peer, recorded in ``rec``; None (the reason recorded
    and said) when the peer is not ``available`` or the pair has no GGUF files."""
    draft_path, target_path, why = _gguf_paths(args.pair)
    if not available or why:
        rec["skipped"] = unavailable if not available else f"{name} rows skipped: {why}"
        say(rec["skipped"])
        return None
    threads = torch.get_num_threads()
    rec.update(threads=threads, target=target_path, draft=draft_path, draft_max=args.llamacpp_draft_max,
               draft_p_min=args.llamacpp_draft_p_min)
    return draft_path, target_path, threads


def native_llamacpp_rows(args, record: dict, prompts: dict, tok, run_rows, say) -> None:
    """llama.cpp's own binaries on the same prompts (T=0): plain, draft-simple, ngram-simple, and llama-bench's
    forwards of the target; or the reason there are none."""
    from . import llamacpp_native as ln

    build = ln.native_build(args.llamacpp_bin)
    record["llama_cpp_native"] = build.to_dict()
    peer = _peer_files(args, record["llama_cpp_native"], build.available, build.message, "native llama.cpp", say)
    if peer is None:
        return
    draft_path, target_path, threads = peer
    texts = {tuple(ids): tok.decode(ids) for plist in prompts.values() for ids in plist}
    labels = {"plain": "llama.cpp plain (llama-completion)",
              "draft-simple": f"llama.cpp draft-simple (n_max {args.llamacpp_draft_max}, p_min "
                              f"{args.llamacpp_draft_p_min}; llama-speculative-simple)",
              "ngram-simple": f"llama.cpp ngram-simple (n_max {args.llamacpp_draft_max}; llama-speculative-simple)"}
    per_prompt: list[dict] = []
    for row in args.llamacpp_native_rows:
        def one(ids, seed, row=row):
            r = ln.decode_prompt(build, row, target_path, texts[tuple(ids)], args.new_tokens, threads,
                                 draft_model=draft_path, draft_max=args.llamacpp_draft_max,
                                 draft_p_min=args.llamacpp_draft_p_min, seed=seed)
            per_prompt.append(dict(llama_prompt_tokens=r.prompt_tokens, drafted=r.drafted, accepted=r.accepted))
            return r.ms_per_token, r.tokens_per_step, r.tokens

        run_rows(labels[row], 0.0, one, extra=dict(implementation="llama.cpp binaries"), per_prompt=per_prompt)
    if args.llamacpp_bench_ns:
        say(f"llama-bench: pp {args.llamacpp_bench_ns}, tg {args.new_tokens} of the target ...")
        record["llama_cpp_native"]["forwards"] = ln.bench_forwards(build, target_path, args.llamacpp_bench_ns,
                                                                   threads, tg=args.new_tokens)


def llamacpp_rows(args, record: dict, prompts: dict, eos: list, run_rows, say) -> None:
    """llama-cpp-python's plain, draft-model and n-gram rows on the same prompts (T=0), or the reason there are
    none: llama.cpp's library with the decode, draft and n-gram loops in Python."""
    from . import llamacpp as lc

    status = lc.llama_cpp_status()
    record["llama_cpp"] = status.to_dict()
    peer = _peer_files(args, record["llama_cpp"], status.available, status.message, "llama.cpp", say)
    if peer is None:
        return
    draft_path, target_path, threads = peer
    record["llama_cpp"]["ngram_tokens"] = args.llamacpp_ngram
    eos_set = set(eos)
    if "plain" in args.llamacpp_rows:
        llm = lc.open_llama(target_path, threads)
        run_rows("llama-cpp-python plain", 0.0, lambda ids, seed: lc.plain_decode(llm, ids, args.new_tokens, eos_set))
        del llm
    if "draft" in args.llamacpp_rows:
        dl = lc.DraftLlama(lc.open_llama(draft_path, threads), args.llamacpp_draft_max, args.llamacpp_draft_p_min)
        llm = lc.open_llama(target_path, threads, draft_model=dl)
        run_rows(f"llama-cpp-python draft (n_max {args.llamacpp_draft_max}, p_min {args.llamacpp_draft_p_min})", 0.0,
                 lambda ids, seed: lc.generate_decode(llm, ids, args.new_tokens, eos_set, draft=dl))
        del llm, dl
    if "ngram" in args.llamacpp_rows:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        llm = lc.open_llama(target_path, threads,
                            draft_model=LlamaPromptLookupDecoding(num_pred_tokens=args.llamacpp_ngram))
        run_rows(f"llama-cpp-python ngram k={args.llamacpp_ngram}", 0.0,
                 lambda ids, seed: lc.generate_decode(llm, ids, args.new_tokens, eos_set))
        del llm


LLAMACPP_PLAIN = "llama.cpp plain (llama-completion)"


def spell_split(cells: list[dict]) -> Optional[float]:
    """The read bandwidth (GB/s) between a run's slower and faster spell: its probes (``read_gb_per_s_before``)
    split in two where the split separates them best (Otsu's threshold: the largest between-group variance; a
    probe taken while the spell changed falls on either side), at the geometric middle of the two probes
    beside the split; None for a run without probes, or whose two groups' medians are less than ``SPELL_GAP``
    apart (one spell)."""
    probes = sorted(g for c in cells for g in c.get("read_gb_per_s_before") or () if g)
    if len(probes) < 2:
        return None
    n, total = len(probes), sum(probes)
    best, at, left = -1.0, 1, 0.0
    for i in range(1, n):
        left += probes[i - 1]
        m0, m1 = left / i, (total - left) / (n - i)
        score = i * (n - i) * (m1 - m0) ** 2
        if score > best:
            best, at = score, i
    if statistics.median(probes[at:]) < SPELL_GAP * statistics.median(probes[:at]):
        return None
    return round((probes[at - 1] * probes[at]) ** 0.5, 1)


def _by_spell(ratios: list[float], probes: list[list[float]], split: float) -> dict:
    """Medians of ``ratios`` over the prompts whose runs (``probes[i]``: every run the ratio compares) all saw
    the slower, or all the faster, bandwidth; prompts whose runs straddle ``split`` are counted apart."""
    sides: dict = {f"slower (< {split:g} GB/s)": [], f"faster (> {split:g} GB/s)": []}
    mixed = 0
    for r, ps in zip(ratios, probes):
        below = {p < split for p in ps}
        if len(below) != 1:
            mixed += 1
            continue
        sides[list(sides)[0 if below.pop() else 1]].append(r)
    out = {k: {"median": statistics.median(v), "prompts": len(v)} for k, v in sides.items() if v}
    out["prompts across spells"] = mixed
    return out


def per_prompt_ratios(cells: list[dict]) -> dict:
    """``{"<dataset> T=<t>": {row: {"vs": {reference: {"median", "min", "max", "ratios"[, "by_spell"]}}}}}``: each
    row's ms/token over ``llama.cpp plain``'s and over the fastest llama.cpp row's on the same prompt, where those
    rows ran there (llama.cpp's own rows: ``--llamacpp-bin``); ``by_spell`` (``_by_spell``) where the run's
    bandwidth probes fall into two spells (``spell_split``)."""
    out: dict = {}
    split = spell_split(cells)
    for ds, t in sorted({(c["dataset"], c["temperature"]) for c in cells}, key=lambda k: (k[1], k[0])):
        here = [c for c in cells if (c["dataset"], c["temperature"]) == (ds, t)]
        peers = [c for c in here if c["row"].startswith("llama.cpp ")]
        plain = next((c for c in here if c["row"] == LLAMACPP_PLAIN), None)
        refs = {}  # name: (per-prompt ms/token, the cells whose runs make it)
        if plain is not None:
            refs[LLAMACPP_PLAIN] = (plain["per_prompt_ms_per_token"], [plain])
        if peers and len({len(c["per_prompt_ms_per_token"]) for c in peers}) == 1:
            refs["llama.cpp's fastest row"] = ([min(v) for v in zip(*(c["per_prompt_ms_per_token"] for c in peers))],
                                               peers)
        rows = {}
        for c in here:
            mine = c["per_prompt_ms_per_token"]
            vs = {}
            for name, (ref, ref_cells) in refs.items():
                if len(ref) != len(mine) or not mine:
                    continue
                r = [a / b for a, b in zip(mine, ref)]
                vs[name] = {"median": statistics.median(r), "min": min(r), "max": max(r), "ratios": r}
                runs = [c, *ref_cells]
                if split is not None and all(len(x.get("read_gb_per_s_before") or ()) == len(mine) for x in runs):
                    probes = [[x["read_gb_per_s_before"][i] for x in runs] for i in range(len(mine))]
                    vs[name]["by_spell"] = _by_spell(r, probes, split)
            if vs:
                rows[c["row"]] = {"vs": vs}
        if rows:
            out[f"{ds} T={t:g}"] = rows
    return out


def _part_key(name: str) -> str:
    """A ``PartCheck`` name without the run's own numbers: "draft (4.2 levels of 1.0)" -> "draft", "target forward
    of the 51 plain steps" -> "target forward of the plain steps"."""
    if name.startswith("target forward of the "):
        return "target forward of the plain steps"
    return name.split(" (")[0]


def prediction_summary(extra: dict) -> str:
    """``auto``'s measured / predicted ms/token over a cell's prompts: the median and range, and per profile that
    priced the prompts (by its probed bandwidth) where more than one did."""
    ratios = extra.get("measured_over_predicted") or []
    if not ratios:
        return ""
    text = f"median {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) over {len(ratios)} prompts"
    tokens = extra.get("tokens_per_step_over_expected") or []
    if tokens:
        text += f" (tokens per step / expected: median {statistics.median(tokens):.2f})"
    parts: dict = {}
    for got in extra.get("parts_over_priced") or ():
        for name, r in (got or {}).items():
            parts.setdefault(name, []).append(r)
    if parts:
        text += "; each part / its price at the run's own sizes (median): " + ", ".join(
            f"{name} {statistics.median(rs):.2f}" for name, rs in parts.items())
    by: dict = {}
    for r, gb in zip(ratios, extra.get("profile_read_gb_per_s") or [None] * len(ratios)):
        by.setdefault(gb, []).append(r)
    if len(by) > 1:
        text += "; " + "; ".join(f"profile at {gb} GB/s: {statistics.median(rs):.2f} on {len(rs)}"
                                 for gb, rs in sorted(by.items(), key=lambda kv: kv[0] or 0))
    return text


def print_ratios(ratios: dict, out=None) -> None:
    out = out or sys.stdout
    for col, rows in ratios.items():
        print(f"\nper-prompt ratios, {col} (median, range):", file=out)
        for row, r in rows.items():
            print(f"  {row}: " + "; ".join(f"/ {ref} {v['median']:.2f} ({v['min']:.2f}-{v['max']:.2f})"
                                           + "".join(f"; {side}: {m['median']:.2f} on {m['prompts']}"
                                                     for side, m in v.get("by_spell", {}).items()
                                                     if isinstance(m, dict))
                                           for ref, v in r["vs"].items()), file=out)


def print_table(record: dict, out=None) -> None:
    out = out or sys.stdout
    cells = record["cells"]
    cols = sorted({(c["dataset"], c["temperature"]) for c in cells}, key=lambda k: (k[1], k[0]))
    rows: list[str] = []
    for c in cells:
        if c["row"] not in rows:
            rows.append(c["row"])
    by = {(c["row"], c["dataset"], c["temperature"]): c for c in cells}
    mi = record.get("machine_info", {})
    print(f"\nms/token (median over prompts; tokens/step) on {mi.get('cpu_model')} [{', '.join(mi.get('cpu_flags', []))}]",
          file=out)
    print("| row | " + " | ".join(f"{d} T={t:g}" for d, t in cols) + " |", file=out)
    print("|---" * (len(cols) + 1) + "|", file=out)
    for r in rows:
        vals = []
        for d, t in cols:
            c = by.get((r, d, t))
            if c is None:
                vals.append("—")
            else:
                tps = c.get("mean_tokens_per_step")
                vals.append(f"{c['median_ms_per_token']:.1f}" + (f" ({tps:.2f})" if tps and tps == tps else ""))
        print(f"| {r} | " + " | ".join(vals) + " |", file=out)
    for t, plan in record.get("plans", {}).items():
        print(f"\nT={t}: {plan['reason']}", file=out)


if __name__ == "__main__":
    sys.exit(main())
