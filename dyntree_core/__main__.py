"""Command line: ``python -m dyntree_core generate|fetch ...``."""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Optional

from .config import DEFAULT_SPEC_FACTOR, METHODS, PRECISIONS, VERIFIERS, ConfigError, DecodeConfig, parse_spec_factor


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dyntree_core", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    sub.add_parser("fetch", help="fetch and convert the embedded offline model pair (with progress)")
    sub.add_parser("kernels", help="compile this machine's C kernels now (the set-up step; cached), or say why "
                                   "they cannot run here (torch's kernels are used then)")
    sub.add_parser("prepare", help="the app's first load now (the set-up's last step): the embedded pair at the "
                                   "precisions auto's first Run uses, measuring this machine's kernel table and "
                                   "packing the weights once, so that the first Run only reads them")

    g = sub.add_parser("generate", help="generate text with speculative decoding")
    g.add_argument("--prompt", required=True, help="prompt text")
    g.add_argument("--method", default="auto", choices=("auto",) + METHODS,
                   help="'auto' (default): the measured cost model of this machine picks the method, its "
                        "shape and (with --precision auto) each model's precision, and says why")
    g.add_argument("--verifier", default="auto", choices=VERIFIERS)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--draft", default="embedded", help="draft model: 'embedded', a preset, a local dir or a hub id")
    g.add_argument("--target", default="embedded", help="target model: 'embedded', a preset, a local dir or a hub id")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--draft-temperature", type=float, default=None)
    g.add_argument("--budget", type=_budget_arg, default=64,
                   help="tree size incl. root, or 'auto': the shape auto prices for this machine (with --method "
                        "auto, the chosen method's); for a method auto cannot price in closed form (DySpec, "
                        "OPT-Tree, ...) budget/depth (and DySpec's threshold) calibrated by short decodes "
                        "(cached per machine profile, method, precisions and temperature)")
    g.add_argument("--retune", action="store_true", help="re-measure the machine profile and acceptance, re-tune")
    g.add_argument("--depth", type=int, default=4, help="levels below the root (chain length k)")
    g.add_argument("--width", type=int, default=8)
    g.add_argument("--threshold", type=float, default=0.05)
    g.add_argument("--spec-factor", type=_spec_factor_arg, default=DEFAULT_SPEC_FACTOR,
                   help="suffix / hybrid: draft at most ceil(F x match length) tokens ('none' = no cap)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="dtype of dense models / dense parts of quantized ones")
    g.add_argument("--precision", default="auto", choices=("auto",) + PRECISIONS,
                   help="target precision: float32, bfloat16, float16 (CUDA), int8, int4 (weight-only, torch's "
                        "CPU kernels) or auto (measured: the machine profile is cached after the first run)")
    g.add_argument("--draft-precision", default="auto", choices=("auto",) + PRECISIONS)
    g.add_argument("--device", default="cpu")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    g.add_argument("--compare", action="store_true", help="also run the autoregressive baseline and report the speedup")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "fetch":
            from .models import ensure_embedded_pair

            draft_dir, target_dir = ensure_embedded_pair()
            print(f"draft:  {draft_dir}\ntarget: {target_dir}")
            return 0
        if args.command == "kernels":
            return _kernels()
        if args.command == "prepare":
            return _prepare()
        return _generate(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _kernels() -> int:
    """Builds (or finds cached) the GGML C kernels; never fails the set-up: without them torch's run."""
    import time

    from .quant.native import native_kernels, native_unavailable_reason

    t0 = time.perf_counter()
    k = native_kernels()
    if k is None:
        print(f"C kernels not used on this machine: {native_unavailable_reason()} (torch's kernels run instead)")
    else:
        print(f"C kernels ready: {k.path} ({time.perf_counter() - t0:.1f} s); AVX-512 VNNI row kernels: "
              + ("checked bit-identical to the AVX2 ones, the kernel table times them" if k.vnni
                 else f"not used ({k.vnni_reason})"))
    return 0


def _prepare() -> int:
    """``prepare_first_load`` with its progress; never fails the set-up (the first Run loads what is missing)."""
    from .planning.first_load import prepare_first_load

    try:
        done = prepare_first_load(progress=lambda line: print(line.strip(), flush=True))
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        print(f"could not prepare the app's first load ({type(e).__name__}: {e}); its first Run does it instead")
        return 0
    built = f"built: the {' and the '.join(done.loaded)}" if done.loaded else "it was ready"
    print(f"the app's first load is ready: draft {done.draft_precision}, target {done.target_precision} "
          f"({built}; {done.seconds:.1f} s)")
    return 0


def _budget_arg(text: str):
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"budget must be an integer or 'auto', got {text!r}") from None


def _spec_factor_arg(text: str):
    try:
        return parse_spec_factor(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"spec factor must be a number or 'none', got {text!r}") from None


def _generate(args) -> int:
    from .decode.engine import SpeculativeDecoder
    from .models import load_pair

    auto_budget = args.budget == "auto"
    cfg = DecodeConfig(
        method="chain" if args.method == "auto" else args.method,
        verifier=args.verifier,
        temperature=args.temperature,
        top_p=args.top_p,
        draft_temperature=args.draft_temperature,
        budget=64 if auto_budget else args.budget,
        depth=args.depth,
        width=args.width,
        threshold=args.threshold,
        spec_factor=args.spec_factor,
        seed=args.seed,
        dtype=args.dtype,
        device=args.device,
    )
    if "auto" in (args.method, args.precision, args.draft_precision) or auto_budget:
        pair, cfg = auto_config(args, cfg)
    else:
        pair = load_pair(args.draft, args.target, dtype=args.dtype, device=args.device,
                         precision=args.precision, draft_precision=args.draft_precision)
        cfg = _with_precisions(cfg, pair)
    ids = encode_prompt(pair.tokenizer, args.prompt, chat=args.chat)
    summary = run_once(SpeculativeDecoder(pair.draft, pair.target, cfg), ids, args.max_new_tokens)
    print(pair.tokenizer.decode(summary["ids"], skip_special_tokens=True))
    line = (
        f"[{cfg.method}/{cfg.resolved_verifier()}, target {cfg.precision}, draft {cfg.draft_precision}] "
        f"{summary['tokens']} tokens in {summary['seconds']:.2f} s "
        f"= {summary['tokens_per_s']:.2f} tok/s; {summary['steps']} target steps, "
        f"mean tokens per step (accepted + bonus) {summary['mean_accepted']:.2f}"
    )
    if args.compare and cfg.method != "autoregressive":
        ar_cfg = DecodeConfig(method="autoregressive", temperature=cfg.temperature, top_p=cfg.top_p,
                              seed=cfg.seed, dtype=cfg.dtype, device=cfg.device, precision=cfg.precision)
        ar = run_once(SpeculativeDecoder(pair.draft, pair.target, ar_cfg), ids, args.max_new_tokens)
        speedup = summary["tokens_per_s"] / ar["tokens_per_s"] if ar["tokens_per_s"] else float("nan")
        line += f"; autoregressive @ {cfg.precision} {ar['tokens_per_s']:.2f} tok/s; speedup {speedup:.2f}x"
    print(line, file=sys.stderr)
    return 0


def _with_precisions(cfg: DecodeConfig, pair) -> DecodeConfig:
    import dataclasses

    return dataclasses.replace(cfg, precision=pair.target_precision, draft_precision=pair.draft_precision)


def auto_config(args, cfg: DecodeConfig):
    """Resolve every ``auto`` (method, precisions, budget) with the one planner, ``planning.auto``, on
    the one machine profile; prints the reason. ``--budget auto`` takes the shape ``auto`` prices for
    the method; a method it cannot price in closed form is calibrated (``planning.tuning``) on the
    same profile, which the plan measured with the calibration's sizes: the machine is profiled once."""
    import dataclasses

    from .planning.auto import plan_auto, profile_for
    from .planning.pair_cache import PairCache
    from .planning.pricing import AUTO_METHODS
    from .planning.search_space import AUTO, search_space
    from .planning.tuning import CALIBRATION_NS

    def say(msg: str) -> None:
        print("  " + msg, file=sys.stderr)

    device = args.device if args.device != "auto" else "cpu"
    auto_budget = args.budget == "auto"
    calibrate = auto_budget and args.method != AUTO and args.method not in AUTO_METHODS
    cache = PairCache(args.draft, args.target, device=device)
    tps, dps, methods = search_space(args.method, args.precision, args.draft_precision, device)
    calib_ns = CALIBRATION_NS if calibrate else ()
    cfg = dataclasses.replace(cfg, **{k: v for k, v in (("precision", args.precision),
                                                         ("draft_precision", args.draft_precision)) if v != AUTO})
    if AUTO in (args.method, args.precision, args.draft_precision) or (auto_budget and not calibrate):
        from .planning.profiling import run_probe

        plan = plan_auto(cache, args.temperature, target_precisions=tps, draft_precisions=dps, methods=methods,
                         refresh=args.retune, progress=say, target_ns=calib_ns,
                         read_gb_per_s=run_probe() if device == "cpu" else None)  # (the spell's own profile)
        cfg = dataclasses.replace(cfg, **plan.resolve(args.method, args.precision, args.draft_precision))
        best = plan.best_of(cfg.method)
        if auto_budget and args.method != AUTO and best is not None:
            cfg = dataclasses.replace(cfg, **plan.method_fields(best))
        print(plan.reason, file=sys.stderr)
        fallback_draft = plan.fastest_draft_precision
    else:
        fallback_draft = args.draft_precision
    if cfg.method == "autoregressive":
        cfg = dataclasses.replace(cfg, draft_precision=None)
    pair = cache.pair(cfg.precision, cfg.draft_precision or fallback_draft)
    if calibrate:
        profile = profile_for(cache, [cfg.precision], [cfg.draft_precision or fallback_draft], calib_ns,
                              refresh=args.retune and AUTO not in (args.method, args.precision, args.draft_precision),
                              progress=say)
        cfg = tuned_config(pair, cfg, profile, refresh=args.retune)
    return pair, cfg


def tuned_config(pair, cfg: DecodeConfig, profile, refresh: bool = False) -> DecodeConfig:
    """``cfg`` with the budget/depth (and DySpec threshold control) calibrated on this machine's profile."""
    from .planning.acceptance import calibration_prompts
    from .planning.tuning import load_or_tune

    def say(msg: str) -> None:
        print("  " + msg, file=sys.stderr)

    print(f"calibrating {cfg.method} at T={cfg.temperature} on machine profile {profile.key} (cached)",
          file=sys.stderr)
    res = load_or_tune(pair.draft, pair.target, cfg, profile, refresh=refresh, same_calibration=False,
                       prompts=calibration_prompts(pair.tokenizer, max_tokens=128), new_tokens=32,
                       eos_token_id=list(pair.eos_token_ids) or None, progress=say)
    b = res.best
    print(f"tuned: budget {b.budget}, depth {b.depth}, width {b.width} "
          f"(predicted {b.predicted_seconds_per_token * 1e3:.1f} ms/token, {b.tokens_per_step:.2f} tokens/step)",
          file=sys.stderr)
    return res.apply(cfg)


def encode_prompt(tokenizer, text: str, chat: bool = False) -> list[int]:
    if not text or not text.strip():
        raise ConfigError("the prompt is empty")
    if chat:
        msgs = [{"role": "user", "content": text}]
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def run_once(decoder, ids: list[int], max_new_tokens: int) -> dict:
    """Run one generation and summarise it (tokens/s, steps, mean accepted tokens per step)."""
    out: list[int] = []
    per_step: list[int] = []
    last = None
    for trace in decoder.generate(ids, max_new_tokens):
        out.extend(c.token_id for c in trace.committed)
        per_step.append(len(trace.committed))
        last = trace
    return {
        "ids": out,
        "tokens": len(out),
        "seconds": last.elapsed,
        "tokens_per_s": last.tokens_per_s,
        "steps": len(per_step),
        "mean_accepted": statistics.fmean(per_step) if per_step else 0.0,
    }


if __name__ == "__main__":
    sys.exit(main())
