"""Offload benchmark: pinned H2D bandwidth, then forwards of a Llama-2-70B-shaped decoder stack
streamed from host memory — our layer streamer vs naive synchronous copies vs accelerate's
``cpu_offload`` — for several query-token counts with a prefix KV cache.

    python -m dyntree_core.bench offload [--layers 80] [--buffers 6] [--tokens 1 16 64 256 768] [--json out.json]
    python -m dyntree_core.bench.offload --device cpu --layers 2 --hidden 256   # functional smoke run

Weights are synthetic: decoder layer ``i`` uses host buffer ``i % K`` (real 70B weights do not
fit in host RAM); every layer execution still copies a full layer. ``seconds`` is the mean of
``--reps`` back-to-back forwards (the prefetch pipeline carries across forwards, as in decoding;
bytes copied inside the timed window = reps x bytes per forward); ``cold_seconds`` is one
forward started from an idle device. ``floor`` = bytes per forward / measured pinned H2D
bandwidth. On ``--device cpu`` every number is a host-memcpy artefact, not a measurement.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..machine import machine_info
from ..offload import OffloadError, accelerate_offload_layers, offload_decoder_layers, sync_offload_layers
from ..offload.backend import Backend, make_backend
from ..offload.pinning import HostBuffer
from ..offload.layout import LayerLayout
from ..offload.synthetic import StackShape, build_meta_model, close_buffers, cycled_host_layers, make_buffers

ENGINES = ("ours", "naive", "accelerate")
CPU_NOTE = ("CPU FUNCTIONAL SMOKE RUN: no GPU, no PCIe; 'bandwidth' is a host memcpy and every "
            "number below is NOT a meaningful offload measurement")


def log(msg: str) -> None:
    print(f"[offload-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------- args
def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m dyntree_core.bench offload", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (functional smoke run only)")
    ap.add_argument("--layers", type=int, default=80, help="decoder layers (Llama-2-70B: 80)")
    ap.add_argument("--hidden", type=int, default=8192, help="hidden size; != 8192 scales the 70B proportions")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--buffers", type=int, default=6, help="K distinct host layer buffers cycled by the layers")
    ap.add_argument("--slots", type=int, nargs="+", default=[2], help="GPU slot counts to measure (ours)")
    ap.add_argument("--resident", nargs="+", default=["0"], help="resident layer counts (ints or 'auto') for ours")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 768], help="query tokens per forward")
    ap.add_argument("--prefix", type=int, default=128, help="tokens already in the KV cache")
    ap.add_argument("--reps", type=int, default=3, help="timed back-to-back forwards per point (ours)")
    ap.add_argument("--baseline-reps", type=int, default=1, help="timed forwards per point (baselines)")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--naive-tokens", type=int, nargs="+", default=None, help="token subset for naive (default all)")
    ap.add_argument("--accelerate-tokens", type=int, nargs="+", default=[1, 64, 768])
    ap.add_argument("--accelerate-layers", type=int, default=16,
                    help="accelerate runs this many layers and its time/bytes are scaled to --layers")
    ap.add_argument("--bw-mib", type=int, default=None, help="bandwidth test buffer (default 1024 MiB; 64 on cpu)")
    ap.add_argument("--time-budget", type=float, default=480.0, help="seconds; later points are skipped past it")
    ap.add_argument("--json", type=Path, default=None, help="write results here (rewritten after every point)")
    a = ap.parse_args(argv)
    for name in ("layers", "hidden", "vocab", "buffers", "prefix", "reps", "baseline_reps", "accelerate_layers"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if any(t < 1 or t > 4096 for t in a.tokens):
        ap.error("--tokens must be in [1, 4096]")
    if any(s < 1 or s > 8 for s in a.slots):
        ap.error("--slots must be in [1, 8]")
    for r in a.resident:
        if r != "auto" and not (r.isdigit() and int(r) <= a.layers):
            ap.error(f"--resident takes integers in [0, layers] or 'auto', got {r!r}")
    return a


# ---------------------------------------------------------------------------------------- helpers
def environment(backend: Backend) -> dict[str, Any]:
    info: dict[str, Any] = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "host": platform.node(), "backend": backend.label,
    }
    try:
        import transformers, accelerate  # noqa: E401

        info["transformers"], info["accelerate"] = transformers.__version__, accelerate.__version__
    except ImportError:
        pass
    try:
        info["host_ram_gb"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError):
        pass
    if backend.overlaps:
        p = torch.cuda.get_device_properties(backend.device)
        info["device_name"] = p.name
        info["device_memory_gb"] = p.total_memory / 1e9
    else:
        info["device_name"] = "cpu (no GPU)"
    info["machine_info"] = machine_info().to_dict()
    return info


def sync(backend: Backend) -> None:
    backend.synchronize()


def measure_bandwidth(backend: Backend, nbytes: int, reps: int = 5) -> dict[str, Any]:
    """Median H2D GB/s from a pinned (and a pageable) host buffer into device memory."""
    out: dict[str, Any] = {"bytes": nbytes}
    src = backend.alloc_host(nbytes)
    try:
        dst = backend.alloc_device(nbytes)
        src.tensor.fill_(1)
        pageable = torch.ones(nbytes, dtype=torch.uint8)

        def timed(s: torch.Tensor, non_blocking: bool) -> float:
            if backend.overlaps:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                dst.copy_(s, non_blocking=non_blocking)
                b.record()
                b.synchronize()
                return a.elapsed_time(b) / 1e3
            t0 = time.perf_counter()
            dst.copy_(s)
            return time.perf_counter() - t0

        for label, s, nb in (("pinned", src.tensor, True), ("pageable", pageable, False)):
            timed(s, nb)  # warm-up
            secs = [timed(s, nb) for _ in range(reps if label == "pinned" else max(2, reps // 2))]
            out[f"{label}_gbps_samples"] = [nbytes / t / 1e9 for t in secs]
            out[f"{label}_gbps"] = nbytes / statistics.median(secs) / 1e9
        out["pinning"] = src.pinning
        backend.synchronize()
    finally:
        src.close()
    return out


def prefix_cache(model, shape: StackShape, prefix: int, dtype: torch.dtype, device: torch.device):
    """A DynamicCache holding ``prefix`` random tokens in every layer."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for i in range(model.config.num_hidden_layers):
        k = torch.randn(1, shape.kv_heads, prefix, shape.head_dim, dtype=dtype, device=device)
        cache.update(k, torch.randn_like(k), i)
    return cache


def forward_inputs(n: int, prefix: int, vocab: int, device: torch.device) -> dict[str, torch.Tensor]:
    """``n`` query tokens after ``prefix`` cached ones; 4D bool mask ``[1,1,n,prefix+n]`` (prefix + causal)."""
    g = torch.Generator().manual_seed(n)
    mask = torch.ones(n, prefix + n, dtype=torch.bool)
    mask[:, prefix:] = torch.tril(torch.ones(n, n, dtype=torch.bool))
    return {
        "input_ids": torch.randint(0, vocab, (1, n), generator=g).to(device),
        "position_ids": torch.arange(prefix, prefix + n).unsqueeze(0).to(device),
        "attention_mask": mask[None, None].to(device),
    }


def run_point(model, handle, backend: Backend, shape: StackShape, n: int, prefix: int, reps: int,
              dtype: torch.dtype, bw_gbps: float, scale: float) -> dict[str, Any]:
    """One cold forward, then ``reps`` back-to-back forwards (cache cropped back each time)."""
    dev = backend.device
    cache = prefix_cache(model, shape, prefix, dtype, dev)
    inp = forward_inputs(n, prefix, shape.vocab, dev)

    def fwd() -> None:
        with torch.no_grad():
            model(**inp, past_key_values=cache, use_cache=True)
        cache.crop(-n)

    if hasattr(handle, "drop_prefetch"):
        handle.drop_prefetch()  # the cold forward must copy every streamed layer itself
    sync(backend)
    handle.reset_stats()
    t0 = time.perf_counter()
    fwd()
    sync(backend)
    cold = time.perf_counter() - t0
    cold_bytes = handle.stats().bytes
    handle.reset_stats()
    t0 = time.perf_counter()
    for _ in range(reps):
        fwd()
    sync(backend)
    secs = (time.perf_counter() - t0) / reps
    st = handle.stats()
    if cache.get_seq_length() != prefix:
        raise RuntimeError(f"cache length {cache.get_seq_length()} != prefix {prefix} after crop")
    nbytes = handle.bytes_per_forward * scale
    floor = nbytes / (bw_gbps * 1e9) if bw_gbps > 0 else float("nan")
    row = {
        "tokens": n, "reps": reps, "seconds": secs * scale, "cold_seconds": cold * scale,
        "bytes_per_forward": nbytes, "effective_gbps": nbytes / (secs * scale) / 1e9 if secs > 0 else float("nan"),
        "floor_seconds": floor, "ratio_to_floor": secs * scale / floor if floor > 0 else float("nan"),
        "stats_bytes_per_forward": st.bytes / reps * scale, "cold_stats_bytes": cold_bytes * scale,
        "copy_seconds_per_forward": st.copy_seconds / reps * scale if st.copy_seconds else None,
        "wait_seconds_per_forward": st.wait_seconds / reps * scale if st.copy_seconds else None,
        "copy_gbps": st.gbps if st.copy_seconds else None,
    }
    del cache
    return row


class Budget:
    def __init__(self, seconds: float):
        self.t0, self.seconds = time.perf_counter(), seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.t0)


def is_oom(e: BaseException) -> bool:
    msg = str(e).lower()
    return isinstance(e, (torch.OutOfMemoryError, OffloadError, MemoryError)) or "out of memory" in msg \
        or "can't allocate memory" in msg


def clean(x: Any) -> Any:
    """JSON-safe copy: NaN/inf -> None (strict JSON has no NaN)."""
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return None
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    return x


def free_memory(backend: Backend) -> None:
    gc.collect()
    if backend.overlaps:
        torch.cuda.synchronize(backend.device)
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------- runs
def run_engine(name: str, label: dict[str, Any], make: Callable[[], tuple[Any, Any]], tokens: list[int],
               reps: int, args, backend: Backend, shape: StackShape, dtype: torch.dtype, bw: float,
               scale: float, budget: Budget, results: dict, save: Callable[[], None]) -> None:
    """Wrap a fresh model with ``make``, measure every token count, record rows (errors included)."""
    rows: list[dict[str, Any]] = results["runs"]
    base = {"engine": name, **label}
    if budget.left() < 10:
        rows.append({**base, "skipped": "time budget exhausted before start"})
        log(f"{name} {label}: skipped (time budget)")
        save()
        return
    model = handle = None
    try:
        t0 = time.perf_counter()
        model, handle = make()
        log(f"{name} {label}: wrapped in {time.perf_counter() - t0:.1f} s "
            f"({getattr(handle, 'summary', lambda: {})() or handle.kind})")
        est = 0.0
        for n in tokens:
            r = reps
            if est and budget.left() < est * (r + 1) + 5:
                r = int(max(0, budget.left() - 5) // est) - 1
                if r < 1:
                    rows.append({**base, "tokens": n, "skipped": "time budget"})
                    log(f"{name} n={n}: skipped (time budget, {budget.left():.0f} s left)")
                    save()
                    continue
            try:
                row = run_point(model, handle, backend, shape, n, args.prefix, r, dtype, bw, scale)
            except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                if not is_oom(e):
                    raise
                rows.append({**base, "tokens": n, "error": f"{type(e).__name__}: {e}"})
                log(f"{name} n={n}: OUT OF MEMORY: {e}")
                free_memory(backend)
                save()
                continue
            est = max(row["cold_seconds"], row["seconds"]) / scale
            rows.append({**base, **row})
            log(f"{name} {label} n={n}: {row['seconds']:.3f} s/fwd (cold {row['cold_seconds']:.3f}), "
                f"{row['effective_gbps']:.1f} GB/s effective, {row['ratio_to_floor']:.2f}x floor")
            save()
    except Exception as e:  # noqa: BLE001
        if not is_oom(e):
            raise
        rows.append({**base, "error": f"{type(e).__name__}: {e}"})
        log(f"{name} {label}: FAILED (memory): {e}")
        save()
    finally:
        if handle is not None:
            handle.close()
        del model, handle
        free_memory(backend)


def print_table(results: dict) -> None:
    env = results["environment"]
    print()
    print(f"device: {env.get('device_name')} | torch {env['torch']} | {env['date_utc']} | backend: {env['backend']}")
    if results.get("note"):
        print(f"NOTE: {results['note']}")
    bw = results["bandwidth"]
    print(f"pinned H2D {bw['pinned_gbps']:.2f} GB/s ({bw['pinning']}), pageable {bw['pageable_gbps']:.2f} GB/s; "
          f"layer {results['layer_bytes'] / 1e6:.1f} MB x {results['shape']['layers']} layers")
    hdr = f"{'engine':<11}{'slots':>6}{'res':>5}{'n':>6}{'s/fwd':>9}{'cold s':>9}{'GB/s':>8}{'floor s':>9}{'x floor':>9}{'wait s':>9}{'copy GB/s':>10}"
    print(hdr)
    print("-" * len(hdr))
    for r in results["runs"]:
        head = f"{r['engine']:<11}{str(r.get('slots', '-')):>6}{str(r.get('resident', '-')):>5}{str(r.get('tokens', '-')):>6}"
        if "seconds" not in r:
            print(head + "  " + (r.get("error") or r.get("skipped", "")))
            continue
        w = r["wait_seconds_per_forward"]
        c = r["copy_gbps"]
        print(head + f"{r['seconds']:>9.3f}{r['cold_seconds']:>9.3f}{r['effective_gbps']:>8.1f}{r['floor_seconds']:>9.3f}"
              f"{r['ratio_to_floor']:>9.2f}{(f'{w:.3f}' if w is not None else '-'):>9}{(f'{c:.1f}' if c is not None else '-'):>10}")
    for note in results.get("notes", []):
        print(f"* {note}")


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    try:
        backend = make_backend(args.device)
    except OffloadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    dev = backend.device
    shape = StackShape(layers=args.layers) if args.hidden == 8192 else StackShape.scaled(args.layers, args.hidden, args.vocab)
    shape = StackShape(**{**shape.as_dict(), "vocab": args.vocab})
    budget = Budget(args.time_budget)
    results: dict[str, Any] = {"environment": environment(backend), "shape": shape.as_dict(), "args": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "runs": [], "notes": []}
    if not backend.overlaps:
        results["note"] = CPU_NOTE
        log(CPU_NOTE)
    log(f"device {results['environment']['device_name']}, torch {torch.__version__}, shape {shape}")

    def save() -> None:
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            tmp = args.json.with_suffix(args.json.suffix + ".tmp")
            tmp.write_text(json.dumps(clean(results), indent=1, default=str, allow_nan=False))
            tmp.replace(args.json)

    bw_bytes = (args.bw_mib or (1024 if backend.overlaps else 64)) << 20
    try:
        results["bandwidth"] = measure_bandwidth(backend, bw_bytes)
    except Exception as e:  # noqa: BLE001
        if not is_oom(e):
            raise
        print(f"error: bandwidth test ran out of memory: {e}", file=sys.stderr)
        return 3
    bw = results["bandwidth"]["pinned_gbps"]
    log(f"pinned H2D {bw:.2f} GB/s, pageable {results['bandwidth']['pageable_gbps']:.2f} GB/s")
    save()

    base = build_meta_model(StackShape(**{**shape.as_dict(), "layers": 1}), dtype, dev)
    layout = LayerLayout.of(base.model.layers[0])
    results["layer_bytes"] = layout.nbytes
    results["layer_params"] = shape.layer_params
    k = min(args.buffers, args.layers)
    results["notes"].append(f"synthetic weights: {args.layers} layers cycle through K={k} host buffers of "
                            f"{layout.nbytes / 1e9:.3f} GB; every layer execution copies a full layer")
    pinned: list[HostBuffer] = []
    pageable: list[HostBuffer] = []
    try:
        if "ours" in args.engines:
            pinned = make_buffers(layout, k, backend.alloc_host, dev, log)
        if {"naive", "accelerate"} & set(args.engines):
            src = pinned or make_buffers(layout, k, lambda nb: HostBuffer(torch.empty(nb, dtype=torch.uint8), "pageable"), dev, log)
            pageable = [HostBuffer(torch.empty(b.nbytes, dtype=torch.uint8).copy_(b.tensor), "pageable")
                        for b in src] if pinned else src
    except Exception as e:  # noqa: BLE001
        close_buffers(pinned)
        if not is_oom(e):
            raise
        print(f"error: could not allocate the host layer buffers ({k} x {layout.nbytes / 1e9:.2f} GB): {e}; "
              "lower --buffers", file=sys.stderr)
        return 3
    try:
        save()

        def meta(layers: int):
            return build_meta_model(StackShape(**{**shape.as_dict(), "layers": layers}), dtype, dev, share_from=base)

        def ours_job(slots: int, res: str) -> Callable[[], None]:
            def make():
                m = meta(shape.layers)
                h = offload_decoder_layers(m, device=dev, slots=slots, resident_layers="auto" if res == "auto" else int(res),
                                           host_layers=cycled_host_layers(layout, shape.layers, pinned))
                return m, h

            def job() -> None:
                run_engine("ours", {"slots": slots, "resident": res, "layers_run": shape.layers}, make, args.tokens,
                           args.reps, args, backend, shape, dtype, bw, 1.0, budget, results, save)
                done = [r for r in results["runs"] if r.get("engine") == "ours" and r.get("slots") == slots
                        and r.get("resident") == res and "stats_bytes_per_forward" in r]
                if res == "auto" and done:
                    results["notes"].append(f"ours slots={slots} resident='auto' streamed "
                                            f"{done[-1]['stats_bytes_per_forward'] / layout.nbytes:.0f} of {shape.layers} layers")

            return job

        def naive_job() -> None:
            def make():
                m = meta(shape.layers)
                return m, sync_offload_layers(m, device=dev, host_layers=cycled_host_layers(layout, shape.layers, pageable))

            results["notes"].append("naive = per-parameter blocking .to(device) from pageable host memory before each "
                                    "layer, device copy dropped after it (no prefetch, no overlap)")
            run_engine("naive", {"slots": "-", "resident": 0, "layers_run": shape.layers}, make,
                       args.naive_tokens or args.tokens, args.baseline_reps, args, backend, shape, dtype, bw, 1.0,
                       budget, results, save)

        def accelerate_job() -> None:
            al = min(args.accelerate_layers, shape.layers)
            scale = shape.layers / al

            def make():
                m = meta(al)
                return m, accelerate_offload_layers(m, device=dev, host_layers=cycled_host_layers(layout, al, pageable))

            results["notes"].append(f"accelerate = accelerate.cpu_offload on each decoder layer (pageable CPU state dict), "
                                    f"run with {al} layers and seconds/bytes scaled x{scale:.2f} to {shape.layers} layers; "
                                    f"tokens {args.accelerate_tokens} only")
            run_engine("accelerate", {"slots": "-", "resident": 0, "layers_run": al}, make, args.accelerate_tokens,
                       args.baseline_reps, args, backend, shape, dtype, bw, scale, budget, results, save)

        # order: the first configuration of ours, then the baselines, then the other configurations of ours
        # (so a tight time budget still yields the comparison)
        ours = [ours_job(sl, res) for res in args.resident for sl in args.slots] if "ours" in args.engines else []
        jobs = ours[:1] + ([naive_job] if "naive" in args.engines else []) + \
            ([accelerate_job] if "accelerate" in args.engines else []) + ours[1:]
        for job in jobs:
            job()
    finally:  # the pinned layer buffers are ours: release them before anything else runs
        results["host_buffers_released_bytes"] = close_buffers(pinned)
    results["wall_seconds"] = time.perf_counter() - budget.t0
    save()
    print_table(results)
    if args.json is not None:
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
