"""Every GPU check and benchmark in one command, sized for one 10-minute device call.

    python -m dyntree_core.bench gpu --out DIR            # one H100/H200: ~7 min (see docs/GPU.md)
    python -m dyntree_core.bench gpu --out DIR --dry-run  # CPU: every check, tiny shapes, no CUDA timings

Sections (each recorded as ok / failed / skipped with its seconds; a failure does not stop the run):

1. ``kernel_oracle``: the Triton tree-attention kernel vs the per-node path oracle (no mask
   involved), orders BFS/DFS/HPD, bf16 and fp16, 70B head shapes (64 q / 8 kv heads, d=128) at
   tree sizes 64-1024 (FlashAttention's rule: error <= 2 x the low-precision reference's + 1e-5).
2. ``greedy_identity``: speculative greedy output with the kernel in every node order equals the
   target's plain greedy decoding (SDPA), on a tiny random pair and on real-shape synthetic
   weights (Qwen2.5-0.5B- and 1.5B-shaped, fp32, sharpened output heads).
3. ``attention``: attention time per order vs SDPA and FlexAttention, tree sizes 16-2048, DFS
   also with 64- and 128-wide prefix tiles (``bench.attention.timing_rows``); the timings become
   this GPU's ``attention="auto"`` table (``attention.auto_table``, saved in the profile cache).
4. ``offload``: the 70B-shaped layer-streamed forward vs bytes / measured bandwidth, vs
   ``accelerate``'s CPU offload and a naive per-layer copy (``bench.offload``).
5. ``decode_step``: full decode steps of dyspec_greedy with a real-shape synthetic 0.5B-class draft
   and an offloaded 70B-shaped target at budgets 64-768, median phase breakdown per budget.
6. ``resident``: both models in device memory, 1.5B- and 7B-shaped targets: transformers
   ``generate`` vs our AR / chain / dyspec_greedy (budgets 16, 64, 256) with SDPA and the kernel,
   phase medians, ``ar_vs_hf_generate``, the weight-streaming floor (``bench.resident``).

Sections run one after another in this process; each releases what it acquired, and the JSON
records per section the pinned host registrations made / released / left and the device memory
before and after (a section that leaks a registration is marked failed). Writes ``DIR/gpu.json``
(with the machine and device named) and ``DIR/gpu.md``. Imports only torch, triton, transformers
and accelerate (no gradio or plotly).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..machine import machine_info
from .resident import STEP_KINDS, resident

SECTIONS: tuple[str, ...] = ("kernel_oracle", "greedy_identity", "attention", "offload", "decode_step", "resident")
PHASES: tuple[str, ...] = ("draft", "tree_build", "mask", "target_forward", "offload_transfer", "verify", "kv_compaction")


@dataclass(frozen=True)
class Plan:
    """Sizes of every section: the real ones (CUDA) or the dry-run's tiny ones (CPU)."""

    dry_run: bool
    oracle_sizes: tuple[int, ...]
    oracle_prefixes: tuple[int, ...]
    oracle_heads: tuple[int, int, int]  # q heads, kv heads, head dim
    identity_seeds: int
    identity_tokens: int
    attention_sizes: tuple[int, ...]
    attention_prefixes: tuple[int, ...]
    attention_heads: tuple[int, int, int]
    decode_budgets: tuple[int, ...]
    decode_steps: int

    @classmethod
    def for_run(cls, dry_run: bool) -> "Plan":
        if dry_run:
            return cls(True, (24,), (0, 17), (4, 2, 32), 1, 6, (24,), (8,), (4, 2, 32), (8,), 2)
        return cls(False, (64, 256, 1024), (128, 1024), (64, 8, 128), 3, 32,
                   (16, 64, 256, 512, 1024, 2048), (128, 1024), (64, 8, 128), (64, 256, 768), 3)


def _log(msg: str) -> None:
    print(f"[bench gpu {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# ------------------------------------------------------------------------------ 1. kernel oracle
def kernel_oracle(plan: Plan, dev: torch.device) -> dict[str, Any]:
    from ..attention import attention_mask_4d, default_block_q, meta_from_tree, path_oracle, sdpa_reference
    from ..attention.trees import dyspec_like_tree, skewed, uniform_random_tree
    from ..attention.triton_kernel import triton_tree_attention

    hq, hkv, d = plan.oracle_heads
    rows, failures = [], 0
    for size in plan.oracle_sizes:
        trees = {"dyspec": dyspec_like_tree(size, seed=size), "uniform": uniform_random_tree(size, seed=size),
                 "skewed": skewed(size)}
        for fam, tree in trees.items():
            for prefix in plan.oracle_prefixes:
                for dtype in (torch.bfloat16, torch.float16):
                    gen = torch.Generator().manual_seed(size + prefix)
                    q = torch.randn(hq, size, d, generator=gen).to(dev, dtype)
                    k = torch.randn(hkv, prefix + size, d, generator=gen).to(dev, dtype)
                    v = torch.randn(hkv, prefix + size, d, generator=gen).to(dev, dtype)
                    for order in ("bfs", "dfs", "hpd"):
                        meta = meta_from_tree(tree, prefix, order, default_block_q(hq // hkv, 64), 32, device=dev)
                        out = torch.full_like(q, float("nan"))
                        triton_tree_attention(q, k, v, meta, out=out)
                        oracle = path_oracle(q, k, v, tree, prefix, order)
                        low = sdpa_reference(q, k, v, attention_mask_4d(tree, prefix, order, device=dev)[0, 0],
                                             dtype=None).float()
                        err = float((out.float() - oracle).abs().max()) if not out.isnan().any() else math.inf
                        ref_err = float((low - oracle).abs().max())
                        ok = err <= 2 * ref_err + 1e-5
                        failures += not ok
                        rows.append(dict(family=fam, size=size, prefix=prefix, dtype=str(dtype).split(".")[-1],
                                         order=order, interval=meta.end is not None, max_err=err,
                                         reference_err=ref_err, ok=ok))
    return dict(ok=failures == 0, checks=len(rows), failures=failures, heads=dict(q=hq, kv=hkv, head_dim=d), rows=rows)


# ------------------------------------------------------------------------------ 2. greedy identity
def _identity_case(name: str, make: Callable[[], tuple[Any, Any]], dev: torch.device, tokens: int, budget: int,
                   seed: int) -> list[dict[str, Any]]:
    from .. import DecodeConfig, SpeculativeDecoder

    draft, target = make()
    vocab = int(target.config.vocab_size)
    prompt = torch.randint(0, vocab, (24,), generator=torch.Generator().manual_seed(seed)).tolist()
    ar = SpeculativeDecoder(draft, target, DecodeConfig(method="autoregressive", attention="torch", device=str(dev))
                            ).generate_ids(prompt, tokens)
    rows = []
    for order in ("dfs", "hpd", "bfs"):
        cfg = DecodeConfig(method="dyspec_greedy", attention="triton", node_order=order, budget=budget, depth=6,
                           device=str(dev), seed=seed)
        t0 = time.perf_counter()
        traces = list(SpeculativeDecoder(draft, target, cfg).generate(prompt, tokens))
        out = [c.token_id for t in traces for c in t.committed]
        first_diff = next((i for i, (a, b) in enumerate(zip(out, ar)) if a != b), None)
        rows.append(dict(case=name, seed=seed, order=order, tokens=len(out), identical=out == ar,
                         first_difference=first_diff, steps=len(traces),
                         kernel_ran=all(t.kernel_blocks is not None for t in traces),
                         seconds=time.perf_counter() - t0))
    return rows


def greedy_identity(plan: Plan, dev: torch.device) -> dict[str, Any]:
    from ..testing import tiny_pair
    from .resident import QWEN_SHAPES, QWEN_VOCAB, TINY_SHAPES, TINY_VOCAB, synthetic_qwen

    rows: list[dict[str, Any]] = []
    for seed in range(plan.identity_seeds):
        def tiny(seed=seed):
            d, t = tiny_pair(seed=seed)
            return d.to(dev), t.to(dev)

        rows += _identity_case("tiny", tiny, dev, plan.identity_tokens, 20, seed)
    if plan.dry_run:  # same code, shapes scaled down (real shapes through the interpreter take hours)
        shapes = dict(draft=TINY_SHAPES["0.5B"], target=TINY_SHAPES["1.5B"], vocab=TINY_VOCAB)
    else:  # Qwen2.5-0.5B and -1.5B
        shapes = dict(draft=QWEN_SHAPES["0.5B"], target=QWEN_SHAPES["1.5B"], vocab=QWEN_VOCAB)

    def real_shape():
        v = shapes["vocab"]
        return (synthetic_qwen(*shapes["draft"], v, seed=1, dev=dev),
                synthetic_qwen(*shapes["target"], v, seed=2, dev=dev))

    rows += _identity_case("real-shape synthetic" + (" (scaled down)" if plan.dry_run else ""), real_shape, dev,
                           plan.identity_tokens, 64 if not plan.dry_run else 16, 0)
    return dict(ok=all(r["identical"] and r["kernel_ran"] for r in rows), shapes=shapes, rows=rows)


# ------------------------------------------------------------------------------ 3. attention timings
def attention_timings(plan: Plan, dev: torch.device) -> dict[str, Any]:
    from ..attention.auto_table import AutoTable
    from ..measured import watch
    from .attention import timing_rows, write_auto_table

    hq, hkv, d = plan.attention_heads
    args = argparse.Namespace(family="dyspec", dtype="bfloat16" if not plan.dry_run else "float32", block_m=128,
                              warmup=3 if not plan.dry_run else 0, iters=20 if not plan.dry_run else 1)
    with watch() as w:
        rows = timing_rows(args, dev, list(plan.attention_sizes), list(plan.attention_prefixes), hq=hq, hkv=hkv, d=d,
                           use_flex=not plan.dry_run, prefix_blocks=() if plan.dry_run else (64, 128))
    for r in rows:
        r["dfs_vs_bfs"] = r["kernel_bfs_ms"] / r["kernel_dfs_ms"]
        r["tiles_bfs_vs_dfs"] = r["kernel_bfs_tiles"] / max(1, r["kernel_dfs_tiles"])
    # the dry run's interpreter timings describe nothing worth storing: its table stays in the JSON
    table = AutoTable.from_timing_rows(dev, rows, machine_info().to_dict()).to_dict() if plan.dry_run \
        else write_auto_table(dev, rows, w.verdict())
    errs = [v for r in rows for k, v in r.items() if k.endswith("_maxerr_vs_sdpa")]
    return dict(ok=max(errs) < 0.05, timings_meaningful=not plan.dry_run, rows=rows, auto_table=table)


# ------------------------------------------------------------------------------ 4. offload forward
def offload_forward(plan: Plan, dev: torch.device, out_dir: Path, seconds: float) -> dict[str, Any]:
    from . import offload as offload_bench

    path = out_dir / "offload.json"
    if plan.dry_run:
        argv = ["--device", "cpu", "--layers", "3", "--hidden", "128", "--vocab", "512", "--tokens", "1", "8",
                "--buffers", "2", "--bw-mib", "4", "--accelerate-layers", "2", "--accelerate-tokens", "1",
                "--dtype", "float32"]
    else:
        argv = ["--device", str(dev), "--layers", "80", "--tokens", "1", "64", "256", "768", "--slots", "2", "3",
                "--resident", "0", "auto", "--naive-tokens", "1", "64"]
    argv += ["--json", str(path), "--time-budget", str(int(seconds))]
    rc = offload_bench.main(argv)
    res = json.loads(path.read_text())
    runs = [r for r in res["runs"] if "seconds" in r]
    return dict(ok=rc == 0 and bool(runs), exit_code=rc, json=path.name, bandwidth=res.get("bandwidth"),
                layer_bytes=res.get("layer_bytes"), runs=res["runs"], notes=res.get("notes", []),
                timings_meaningful=not plan.dry_run)


# ------------------------------------------------------------------------------ 5. decode step
def decode_step(plan: Plan, dev: torch.device) -> dict[str, Any]:
    from .. import DecodeConfig, SpeculativeDecoder
    from ..offload.backend import make_backend
    from ..offload.layout import LayerLayout
    from ..offload.synthetic import StackShape, build_meta_model, close_buffers, cycled_host_layers, make_buffers
    from ..decode.prepared import PreparedPair
    from .resident import QWEN_SHAPES, TINY_SHAPES, synthetic_qwen

    dtype_name = "float32" if plan.dry_run else "bfloat16"
    dtype = getattr(torch, dtype_name)
    vocab = 512 if plan.dry_run else 32000
    shape = StackShape.scaled(4, 128, vocab) if plan.dry_run else StackShape(layers=80, vocab=vocab)
    backend = make_backend(str(dev))
    target = build_meta_model(shape, dtype, dev)
    layout = LayerLayout.of(build_meta_model(StackShape(**{**shape.as_dict(), "layers": 1}), dtype, dev,
                                             share_from=target).model.layers[0])
    buffers = make_buffers(layout, min(6, shape.layers), backend.alloc_host, dev, _log)
    pair = None
    rows = []
    try:
        dshape = (TINY_SHAPES if plan.dry_run else QWEN_SHAPES)["0.5B"]
        draft = synthetic_qwen(*dshape, vocab, seed=3, dev=torch.device("cpu"), sharpen=1.0)
        base = DecodeConfig(method="dyspec_greedy", budget=plan.decode_budgets[0], depth=8, device=str(dev),
                            dtype=dtype_name, offload_target=True, attention="auto" if not plan.dry_run else "triton")
        pair = PreparedPair.prepare(draft, target, base, allow_cpu_offload=plan.dry_run,
                                    offload_options=dict(host_layers=cycled_host_layers(layout, shape.layers, buffers),
                                                         slots=2, resident_layers=0))
        prompt = torch.randint(0, vocab, (128,), generator=torch.Generator().manual_seed(0)).tolist()
        # every budget with the draft on its programs, then the first with the eager drafter: the A/B
        for budget, programs in [(b, True) for b in plan.decode_budgets] + [(plan.decode_budgets[0], False)]:
            cfg = DecodeConfig(**{**base.__dict__, "budget": budget})
            dec = SpeculativeDecoder.on_pair(pair, cfg)
            dec.graph_steps = programs  # (the CUDA default; the dry run asks for it on the CPU)
            drafting = "programs" if dec.draft_graph_reason() is None else "eager"
            traces = list(dec.generate(prompt, plan.decode_steps + 1))[1:]  # the first step is a warm-up
            if not traces:
                continue
            med = {p: statistics.median(getattr(t.timings, p) for t in traces) for p in PHASES}
            step = statistics.median(t.step_seconds for t in traces)
            outside = step - med["draft"] - med["target_forward"]
            rows.append(dict(budget=budget, drafting=drafting, draft_reason=dec.draft_graph_reason(),
                             tree_size=statistics.median(t.tree_size for t in traces),
                             steps=len(traces), step_seconds=step, **{f"{p}_seconds": v for p, v in med.items()},
                             step_vs_target_forward=step / med["target_forward"] if med["target_forward"] > 0 else math.nan,
                             draft_forwards=statistics.median(t.draft_forwards for t in traces),
                             outside_forwards_share=outside / step if step > 0 else math.nan,
                             kernel_blocks=traces[-1].kernel_blocks, order_blocks=traces[-1].order_blocks))
            _log(f"decode step budget {budget} ({drafting} draft): {step:.3f} s (target {med['target_forward']:.3f}, "
                 f"draft {med['draft']:.3f}, outside {outside:.3f})")
    finally:  # the offload's registrations, then the layer buffers' (ours: the pair only borrowed them)
        if pair is not None:
            pair.close()
        close_buffers(buffers)
    return dict(ok=len(rows) == len(plan.decode_budgets) + 1, dtype=dtype_name, target_shape=shape.as_dict(),
                draft_shape=dict(zip(("hidden", "layers", "heads", "kv_heads", "ffn"), dshape), vocab=vocab),
                layer_bytes=layout.nbytes, rows=rows, timings_meaningful=not plan.dry_run,
                note="random weights accept ~nothing: every step commits ~1 token; the timings are the point")


# ------------------------------------------------------------------------------ driver
def _resources(dev: torch.device) -> dict[str, int]:
    """What the process holds between sections: host registrations (``offload.pinned_registrations``,
    real or simulated) and, on CUDA, allocated / reserved device bytes. Collects garbage first, so
    only what something still references is counted."""
    from ..offload import pinned_registrations

    gc.collect()
    _sync(dev)
    out = {f"pinned_{k}": v for k, v in pinned_registrations().to_dict().items()}
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        out["cuda_allocated_bytes"] = int(torch.cuda.memory_allocated(dev))
        out["cuda_reserved_bytes"] = int(torch.cuda.memory_reserved(dev))
    return out


def _released(before: dict[str, int], after: dict[str, int]) -> dict[str, Any]:
    """One section's accounting: what it registered and released, and what it left behind."""
    out: dict[str, Any] = dict(
        before=before, after=after,
        registrations_made=after["pinned_registered"] - before["pinned_registered"],
        registrations_released=after["pinned_unregistered"] - before["pinned_unregistered"],
        pinned_bytes_made=after["pinned_registered_bytes"] - before["pinned_registered_bytes"],
        pinned_bytes_released=after["pinned_unregistered_bytes"] - before["pinned_unregistered_bytes"],
        leaked_registrations=after["pinned_live"] - before["pinned_live"],
        leaked_pinned_bytes=after["pinned_live_bytes"] - before["pinned_live_bytes"],
    )
    if "cuda_allocated_bytes" in after:
        out["cuda_allocated_delta_bytes"] = after["cuda_allocated_bytes"] - before["cuda_allocated_bytes"]
    return out


def _environment(dev: torch.device, dry_run: bool) -> dict[str, Any]:
    info: dict[str, Any] = dict(
        date_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        dry_run=dry_run, torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version(),
        host=platform.node(), device=str(dev),
        device_name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (no GPU: dry run)",
        machine_info=machine_info().to_dict(),
    )
    for mod in ("triton", "transformers", "accelerate"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            info[mod] = None
    return info


def _markdown(res: dict[str, Any]) -> str:
    env = res["environment"]
    lines = [f"# bench gpu — {env['device_name']}{' (DRY RUN: timings meaningless)' if env['dry_run'] else ''}",
             "", f"{env['date_utc']}, torch {env['torch']}, triton {env['triton']}, transformers {env['transformers']}",
             "", "| section | status | seconds | pinned registrations made / released | summary |",
             "|---|---|---|---|---|"]
    for name in SECTIONS:
        s = res["sections"].get(name, {})
        r = s.get("resources")
        pinned = f"{r['registrations_made']} / {r['registrations_released']}" if r else "-"
        lines.append(f"| {name} | {s.get('status', '-')} | {s.get('seconds', 0):.1f} | {pinned} | {s.get('summary', '')} |")
    dec = res["sections"].get("decode_step", {}).get("result", {})
    if dec.get("rows"):
        lines += ["", "## Decode step (median seconds per phase)", "",
                  "| budget | draft on | nodes | step | x target fwd | draft | target fwd | offload wait | verify | outside share |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in dec["rows"]:
            lines.append(f"| {r['budget']} | {r.get('drafting', '-')} | {r['tree_size']:.0f} | {r['step_seconds']:.3f} | "
                         f"{r.get('step_vs_target_forward', math.nan):.3f} | {r['draft_seconds']:.3f} | "
                         f"{r['target_forward_seconds']:.3f} | {r['offload_transfer_seconds']:.3f} | "
                         f"{r['verify_seconds']:.4f} | {100 * r['outside_forwards_share']:.1f}% |")
    lines += _resident_markdown(res["sections"].get("resident", {}).get("result", {}))
    att = res["sections"].get("attention", {}).get("result", {})
    if att.get("rows"):
        lines += ["", "## Attention (ms): kernel per order vs SDPA / FlexAttention; auto = the table's choice", "",
                  "| nodes | prefix | bfs | dfs | hpd | dfs p64 | dfs p128 | sdpa | flex | tiles bfs/dfs | dfs vs bfs | auto dfs/bfs |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        choice = {(c["size"], c["prefix"]): c["choice"] for c in att.get("auto_table", {}).get("cells", [])}
        for r in att["rows"]:
            f = lambda k: f"{r[k]:.3f}" if isinstance(r.get(k), float) else "-"  # noqa: E731
            ch = choice.get((r["size"], r["prefix"]), {})
            lines.append(f"| {r['size']} | {r['prefix']} | {f('kernel_bfs_ms')} | {f('kernel_dfs_ms')} | "
                         f"{f('kernel_hpd_ms')} | {f('kernel_dfs_prefix64_ms')} | {f('kernel_dfs_prefix128_ms')} | "
                         f"{f('sdpa_ms')} | {f('flex_ms')} | {r.get('kernel_bfs_tiles')}/{r.get('kernel_dfs_tiles')} | "
                         f"{r['dfs_vs_bfs']:.2f} | {ch.get('dfs', '-')}/{ch.get('bfs', '-')} |")
    return "\n".join(lines) + "\n"


def _resident_markdown(r: dict[str, Any]) -> list[str]:
    if not r.get("targets"):
        return []
    lines = ["", "## Resident (both models in device memory; median ms)", ""]
    kernels = r.get("forward_kernels", {}).get("0.5B")
    if kernels:
        lines += ["Kernels per draft forward (modelled on the CPU by `LaunchCounter` / profiled on the device): "
                  + ", ".join(f"{k['rows']} rows {k['modelled']} / {k.get('profiled', '-')}" for k in kernels), ""]
    for t in r["targets"]:
        lines += [f"**{t['name']}-shaped target**: transformers generate {t['hf_generate_ms_per_token']:.2f} ms/token, "
                  f"static cache {t['hf_static_ms_per_token']:.2f} (warm-up {t['hf_static_warmup_s']:.1f} s), "
                  f"floor {t['floor_ms_per_token']:.2f} ms/token ({t['weight_bytes'] / 1e9:.3g} GB at "
                  f"{r['bandwidth']['gbps']:.3g} GB/s); ours per token (ar_vs_hf_generate, ar_vs_hf_static, ar_vs_floor): "
                  + ", ".join(f"{a} {t['ar_ms_per_token'][a]:.2f} ms = {v:.2f}x, {t['ar_vs_hf_static'][a]:.2f}x, "
                              f"{t['ar_vs_floor'][a]:.2f}x" for a, v in t["ar_vs_hf_generate"].items()), "",
                  "| method | budget | T | attention | step | ms/step | x AR step | tokens/step | compile s | draft forwards "
                  "| draft | tree build | mask | target fwd | verify | kv |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for x in t["rows"]:
            ph = x["phases_ms"]
            cell = lambda k: f"{ph[k]:.2f}" if k in ph else "-"  # noqa: E731
            lines.append(f"| {x['method']} | {x.get('budget', '-')} | {x.get('temperature', 0):g} | {x['attention']} | "
                         f"{x['step']} | {x['step_ms']:.2f} | "
                         f"{x.get('step_vs_ar_step', math.nan):.2f} | {x['tokens_per_step']:.2f} | {x['compile_s']:.1f} | "
                         f"{x.get('draft_forwards', '-')} | {cell('draft')} | {cell('tree_build')} | {cell('mask')} | {cell('target_forward')} | "
                         f"{cell('verify')} | {cell('kv_compaction')} |")
        lines.append("")
    return lines


def _summary(name: str, r: dict[str, Any]) -> str:
    if name == "kernel_oracle":
        return f"{r['checks'] - r['failures']}/{r['checks']} oracle checks pass"
    if name == "greedy_identity":
        good = sum(x["identical"] and x["kernel_ran"] for x in r["rows"])
        return f"{good}/{len(r['rows'])} runs token-identical to greedy AR with the kernel"
    if name == "attention":
        if not r["rows"]:
            return "no timing rows"
        big = max(r["rows"], key=lambda x: (x["size"], -x["prefix"]))
        return (f"{len(r['rows'])} timing rows; DFS vs BFS {big['dfs_vs_bfs']:.2f}x at {big['size']} nodes / "
                f"{big['prefix']} prefix (tiles {big['tiles_bfs_vs_dfs']:.2f}x)"
                + ("" if r["timings_meaningful"] else " (interpreter: times meaningless)"))
    if name == "offload":
        return f"{sum('seconds' in x for x in r['runs'])} forward points, exit {r['exit_code']}"
    if name == "decode_step":
        return ", ".join(f"b{x['budget']} ({x.get('drafting', '?')} draft): {x['step_seconds']:.2f} s "
                         f"= {x.get('step_vs_target_forward', math.nan):.2f}x target fwd" for x in r["rows"])
    if name == "resident":
        return "; ".join(f"{t['name']}: AR {min(t['ar_ms_per_token'].values()):.1f} ms/token vs transformers "
                         f"{t['hf_generate_ms_per_token']:.1f} ({t['ar_vs_hf_generate_best']:.2f}x), static "
                         f"{t['hf_static_ms_per_token']:.1f} ({t['ar_vs_hf_static_best']:.2f}x), floor "
                         f"{t['floor_ms_per_token']:.2f}" for t in r["targets"] if t["ar_ms_per_token"]) \
            + (f"; {len(r['skipped'])} rows skipped" if r["skipped"] else "") \
            + (f"; {len(r['failed'])} rows FAILED" if r.get("failed") else "")
    return ""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dyntree_core.bench gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="directory for gpu.json, gpu.md and offload.json")
    p.add_argument("--dry-run", action="store_true", help="CPU: run every check on tiny shapes (no CUDA timings)")
    p.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS,
                   help="sections to run, in this order (default: all, in the order above)")
    p.add_argument("--offload-seconds", type=float, default=100.0, help="time budget of the offload section")
    p.add_argument("--resident-seconds", type=float, default=140.0,
                   help="time budget of the resident section (later rows are listed as skipped)")
    p.add_argument("--resident-targets", nargs="+", choices=("1.5B", "7B"), help="only these targets")
    p.add_argument("--resident-kinds", nargs="+", choices=STEP_KINDS,
                   help="only these step kinds (plain decoding's graph row always runs: the reference)")
    p.add_argument("--skip-hf", action="store_true", help="leave transformers' generate rows out")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    cuda = torch.cuda.is_available()
    if not args.dry_run and not cuda:
        print("bench gpu needs CUDA; on a machine without a GPU run it with --dry-run", file=sys.stderr)
        return 2
    dev = torch.device("cpu") if args.dry_run else torch.device("cuda")
    plan = Plan.for_run(args.dry_run)
    args.out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = dict(environment=_environment(dev, args.dry_run), plan=plan.__dict__, sections={})
    jobs: dict[str, Callable[[], dict[str, Any]]] = {
        "kernel_oracle": lambda: kernel_oracle(plan, dev),
        "greedy_identity": lambda: greedy_identity(plan, dev),
        "attention": lambda: attention_timings(plan, dev),
        "offload": lambda: offload_forward(plan, dev, args.out, args.offload_seconds if not args.dry_run else 60),
        "decode_step": lambda: decode_step(plan, dev),
        "resident": lambda: resident(dev, args.resident_seconds, args.dry_run, _log, partial("resident"),
                                     args.resident_targets, args.resident_kinds, args.skip_hf),
    }

    def partial(name: str) -> Callable[[dict[str, Any]], None]:
        """What a long section has measured so far, saved as it goes (a killed run keeps its rows)."""
        def save(r: dict[str, Any]) -> None:
            res["sections"][name] = dict(status="running", summary="unfinished: the rows measured so far", result=r)
            (args.out / "gpu.json").write_text(json.dumps(res, indent=1, default=str))
        return save

    t_all = time.perf_counter()
    for name in SECTIONS:
        if name not in args.sections:
            res["sections"][name] = dict(status="skipped", seconds=0.0, summary="not selected")
    for name in dict.fromkeys(args.sections):  # in the order asked for
        _log(f"{name} ...")
        before = _resources(dev)
        t0 = time.perf_counter()
        try:
            r = jobs[name]()
            sec = dict(status="ok" if r.get("ok") else "failed", seconds=time.perf_counter() - t0,
                       summary=_summary(name, r), result=r)
        except Exception as e:  # noqa: BLE001 - recorded; the other sections still run
            sec = dict(status="failed", seconds=time.perf_counter() - t0,
                       summary=f"{type(e).__name__}: {e}"[:200], traceback=traceback.format_exc())
        sec["resources"] = _released(before, _resources(dev))
        if sec["resources"]["leaked_registrations"]:  # the next section would inherit them: a bug here
            sec["status"] = "failed"
            sec["summary"] += f"; leaked {sec['resources']['leaked_registrations']} pinned host registrations"
        res["sections"][name] = sec
        _log(f"{name}: {sec['status']} ({sec['seconds']:.1f} s) {sec['summary']} | pinned: "
             f"{sec['resources']['registrations_made']} made, {sec['resources']['registrations_released']} released")
        (args.out / "gpu.json").write_text(json.dumps(res, indent=1, default=str))
    res["total_seconds"] = time.perf_counter() - t_all
    (args.out / "gpu.json").write_text(json.dumps(res, indent=1, default=str))
    md = _markdown(res)
    (args.out / "gpu.md").write_text(md)
    print(md)
    return 0 if all(s["status"] in ("ok", "skipped") for s in res["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
