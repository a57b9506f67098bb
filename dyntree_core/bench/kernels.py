"""``python -m dyntree_core.bench kernels``: every weight-only kernel on every layer shape of the pair, the
kernel table this machine uses, and t(n) of the target per kernel choice (ours and llama.cpp's).

1. Per distinct layer shape of both GGUFs (GGML type, N, K) and M rows (``--rows``, default 1 4 16 64 256),
   milliseconds of one ``[M, K] x [N, K]^T`` product on:

   * ``aten``: torch's kernel on the re-pack the int4 precision used before the table (``Int4Linear`` for
     Q4_K, ``Int8Linear`` for the rest); ``aten_int8``: ``Int8Linear`` for Q4_K shapes too;
   * ``native_rows`` / ``native_dequant_mm``: ``GGMLLinear`` on the file's blocks (``quant.native``);
   * ``dense_bf16_split``: the exact bf16 split of ``quant.linear.enable_dense_rows`` (3 bf16 GEMMs for int4);
   * ``dense_fp32``: one float32 GEMM on the dequantized weight (kept in memory: 4 bytes per weight);
   * ``dense_bf16``: one bf16 GEMM on a kept bf16 copy of the dequantized weight (2 bytes per weight; what
     oneDNN runs on AMX tiles), bf16 activations;
   * ``torch_int8_dynamic``: torch's dynamically quantized int8 linear (per-channel int8 weights; activations
     quantized per tensor, so a row's numbers depend on the other rows of the call: a timing reference for
     what an int8 GEMM with cache blocking reaches on this CPU, not a runtime candidate), on the engine
     ``torch.backends.quantized.engine`` names (``onednn`` uses AMX where the CPU has it);
   * ``torchao_int4``: torchao's CPU int4 weight-only layout (``Int4OpaqueTensor``, group 32), where torchao
     imports (the ``torchao`` extra); its int8-activation x int4-weight path needs torchao's C++ CPU kernels;
   * ``inductor_int8`` (``--inductor``): ``torch.compile(mode="max-autotune")`` with freezing of an int8
     weight-only linear (the pattern inductor's CPU weight-only GEMM templates match), on the shapes named.

   The runtime candidates' timings of this run become this machine's kernel table (``quant.kernel_table``,
   what the models use from then on); each shape's plan is recorded beside the full timings.
2. t(1), t(16), t(64) of the target (128-token prefix, logits of every row; the machine profile's ``ForwardTimer``) at
   int4 for each ``DYNTREE_KERNELS`` policy (``aten``, ``aten`` with the bf16 split from 16 rows, ``native``,
   ``native_mm``, ``native_q8``, ``table``), and llama.cpp's ``Llama.eval`` of the same counts where llama-cpp-python is
   installed (``bench.llamacpp.forward_times``).

The JSON (``--json``, default ``bench/results/kernels_<machine label>.json``) records the machine
(``machine_info()``), torch, the native kernels' digest, torchao's and llama.cpp's status.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from .. import measured
from ..machine import machine_info
from ..quant import kernel_table as kt
from .env import env_var

EXTRA_CANDIDATES = ("aten_int8", "dense_bf16_split", "dense_fp32", "dense_bf16", "torch_int8_dynamic",
                    "torchao_int4")
POLICY_ROWS = (("aten", 0), ("aten", 16), ("native", 0), ("native_mm", 0), ("native_q8", 0), ("native_q8_vnni", 0),
               ("native_x8", 0), ("table", 0))


def torchao_status() -> dict:
    try:
        import torchao  # noqa: F401
    except Exception as e:
        return {"available": False, "error": f"{type(e).__name__}: {e}",
                "install": "pip install 'dyntree[torchao]'"}
    da8w4 = "CPU" in torch._C._dispatch_dump("torchao::da8w4_linear_cpu")
    return {"available": True, "version": torchao.__version__, "da8w4_linear_cpu": da8w4,
            "int4_cpu_kernel": "torch.ops.aten._weight_int4pack_mm_for_cpu (Int4OpaqueTensor)"}


def _torchao_linear(dense: torch.Tensor):
    from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
    from torchao.quantization import quantize_

    lin = torch.nn.Linear(dense.shape[1], dense.shape[0], bias=False, dtype=torch.bfloat16)
    lin.weight.data.copy_(dense)
    quantize_(lin, PrototypeInt4WeightOnlyConfig(group_size=32, set_inductor_config=False))
    return lambda x: lin(x.to(torch.bfloat16)).float()


def extra_candidate(name: str, shape: kt.LayerShape, dense: torch.Tensor) -> Optional[Callable]:
    """A callable ``x [M, K] float32 -> [M, N]`` for one of ``EXTRA_CANDIDATES`` (None where it cannot run)."""
    from ..quant.linear import Int4Linear, Int8Linear, enable_dense_rows, int4_shape_ok

    if name == "aten_int8":
        return Int8Linear.from_dense(dense) if shape.type_name == "Q4_K" else None
    if name == "dense_bf16_split":
        layer = (Int4Linear.from_dense(dense) if shape.type_name == "Q4_K" and int4_shape_ok(shape.n, shape.k)
                 else Int8Linear.from_dense(dense))
        holder = torch.nn.Sequential(layer)
        enable_dense_rows(holder, 1)
        return layer
    if name == "dense_fp32":
        w = dense.clone()
        return lambda x: x @ w.t()
    if name == "dense_bf16":
        wb = dense.to(torch.bfloat16)
        return lambda x: torch.nn.functional.linear(x.to(torch.bfloat16), wb).float()
    if name == "torch_int8_dynamic":
        import warnings

        from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear

        lin = torch.nn.Linear(dense.shape[1], dense.shape[0], bias=False)
        lin.weight.data.copy_(dense)
        lin.qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
        with warnings.catch_warnings():  # torch.ao.quantization's deprecation notices
            warnings.simplefilter("ignore")
            return DynamicInt8Linear.from_float(lin)
    if name == "torchao_int4":
        if shape.type_name != "Q4_K" or not torchao_status()["available"]:
            return None
        return _torchao_linear(dense)
    raise ValueError(name)


def inductor_candidate(dense: torch.Tensor) -> Callable:
    """``torch.compile`` (max-autotune, freezing) of an int8 weight-only linear ``(x @ q^T) * s``."""
    from torch._inductor import config as inductor_config

    from ..quant.linear import Int8Linear

    ref = Int8Linear.from_dense(dense)

    class Woq(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("q", ref.qweight)
            self.register_buffer("s", ref.scales)

        def forward(self, x):
            return (torch.nn.functional.linear(x.to(torch.bfloat16), self.q.to(torch.bfloat16)) * self.s).float()

    inductor_config.freezing = True
    return torch.compile(Woq().eval(), mode="max-autotune", dynamic=False)


def measure_all(shape: kt.LayerShape, rows: list[int], extra: tuple[str, ...], inductor: bool,
                say: Callable[[str], None]) -> dict:
    from ..quant.ggml_linear import GGMLLinear

    out = kt.measure_shape(shape, rows)
    dense = GGMLLinear(shape.type_name, kt.synthetic_blocks(shape), shape.k).dequantized_weight()
    gen = torch.Generator().manual_seed(2)
    compile_s = None
    names = list(extra) + (["inductor_int8"] if inductor else [])
    with torch.inference_mode():
        for name in names:
            out[name] = {}
            try:
                if name == "inductor_int8":
                    fn = inductor_candidate(dense)
                else:
                    fn = extra_candidate(name, shape, dense)
            except Exception as e:  # report what failed; the other candidates still run
                out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                continue

            def at(x, fn=fn, name=name):
                nonlocal compile_s
                if name == "inductor_int8":
                    t1 = time.perf_counter()
                    fn(x)  # compiles for this M (static shapes)
                    compile_s = (compile_s or 0.0) + time.perf_counter() - t1
                return lambda: fn(x)

            try:
                out[name] = kt.time_rows(None if fn is None else at, shape.k, rows, gen)
            except Exception as e:
                out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            if name == "inductor_int8" and compile_s is not None:
                out[name]["compile_seconds"] = compile_s
            say(f"    {shape.label} {name}: " + ", ".join(
                f"M={m} {v:.3f}" for m, v in out[name].items() if isinstance(v, float) and m.isdigit()))
    del dense
    gc.collect()
    return out


def target_forward_times(ns: list[int], say: Callable[[str], None], policies: Optional[list[str]] = None) -> dict:
    """t(n) ms of the embedded target at int4 under each kernel policy (``policies``: labels of ``POLICY_ROWS``,
    None: all; one model loaded at a time)."""
    from ..models.load import load_model, resolve_spec
    from ..planning.forward_timer import ForwardTimer
    from ..quant.linear import enable_dense_rows

    src = resolve_spec("embedded", "target")
    out = {}
    for policy, dense_rows in POLICY_ROWS:
        label = policy + (f"+bf16_split>={dense_rows}" if dense_rows else "")
        if policies is not None and label not in policies:
            continue
        with env_var("DYNTREE_KERNELS", policy):
            model = load_model(src, precision="int4")
            if dense_rows:
                enable_dense_rows(model, dense_rows)
            with torch.inference_mode():
                timer = ForwardTimer(model, 128, max(ns))
                timer.once(1)
                out[label] = {str(n): timer.best(n, 3 if n <= 4 else 2) * 1e3 for n in ns}
        say(f"  target t(n) {label}: " + ", ".join(f"t({n}) {v:.1f} ms" for n, v in out[label].items()))
        del model, timer
        gc.collect()
    return out


NARROW = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 64, "vocab_size": 1024, "pad_token_id": None}


def narrow_twin(kind: str):
    """The embedded target's depth (28 layers, its config otherwise) at width 256 (``NARROW``): a 1-token
    forward costs what the real one costs outside the weight products. ``kind``: ``float32`` (nn.Linear),
    ``aten`` (today's int4: ``Int4Linear`` + an ``Int8Linear`` head, bf16 casts around each), ``native``
    (``GGMLLinear`` on synthetic Q4_K blocks, Q6_K head), ``native_fused`` (``native`` + ``fuse_forward``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..models.load import resolve_spec
    from ..quant.apply import quantize_model, set_submodule
    from ..quant.ggml_linear import GGMLLinear

    cfg = AutoConfig.from_pretrained(resolve_spec("embedded", "target").location, local_files_only=True)
    for k, v in NARROW.items():
        setattr(cfg, k, v)
    cfg.tie_word_embeddings = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    if kind == "aten":
        quantize_model(model, "int4")
    elif kind.startswith("native"):
        head = model.get_output_embeddings()
        for name, mod in list(model.named_modules()):
            if isinstance(mod, torch.nn.Linear):
                t = "Q6_K" if mod is head else "Q4_K"
                shape = kt.LayerShape(t, mod.out_features, mod.in_features)
                set_submodule(model, name, GGMLLinear(t, kt.synthetic_blocks(shape), mod.in_features, mod.bias))
        if kind == "native_fused":
            from ..quant.fused import fuse_forward

            fuse_forward(model)
    return model


def forward_overhead(kinds: tuple[str, ...], say: Callable[[str], None]) -> dict:
    """1-token forward ms (128-token prefix, best of 7) of the narrow twin per ``kind``."""
    from ..planning.forward_timer import ForwardTimer

    out = {}
    for kind in kinds:
        model = narrow_twin(kind)
        with torch.inference_mode():
            timer = ForwardTimer(model, 128, 1)
            timer.once(1)
            out[kind] = timer.best(1, 7) * 1e3
        say(f"  narrow twin ({len(model.model.layers)} layers, width 256) {kind}: {out[kind]:.2f} ms per 1-token forward")
        del model, timer
        gc.collect()
    return out


def profile_target(policy: str, top: int = 15) -> list[dict]:
    """torch.profiler of 1-token int4 forwards of the real target under ``DYNTREE_KERNELS=policy`` (``GGMLLinear``
    models come fused: ``models.gguf_model.fuse_native``): the ops with the most self CPU time (share of the
    profiled total)."""
    from ..models.load import load_model, resolve_spec
    from ..planning.forward_timer import ForwardTimer

    with env_var("DYNTREE_KERNELS", policy):
        model = load_model(resolve_spec("embedded", "target"), precision="int4")
    with torch.inference_mode():
        timer = ForwardTimer(model, 128, 1)
        for _ in range(2):
            timer.once(1)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                timer.once(1)
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: -e.self_cpu_time_total)
    del model, timer
    gc.collect()
    return [{"op": e.key, "self_ms_per_forward": e.self_cpu_time_total / 5e3, "share": e.self_cpu_time_total / total,
             "calls_per_forward": e.count / 5} for e in events[:top]] + [
        {"op": "(total)", "self_ms_per_forward": total / 5e3, "share": 1.0, "calls_per_forward": 0}]


def llamacpp_forward_times(ns: list[int], say: Callable[[str], None]) -> dict:
    from ..models.load import resolve_spec
    from . import llamacpp as lc

    status = lc.llama_cpp_status()
    if not status.available:
        say(status.message)
        return {"status": status.to_dict()}
    llm = lc.open_llama(resolve_spec("embedded", "target").gguf, torch.get_num_threads(), logits_all=True)
    times = lc.forward_times(llm, ns)
    say("  llama.cpp t(n): " + ", ".join(f"t({n}) {v:.1f} ms" for n, v in times.items()))
    del llm
    return {"status": status.to_dict(), "ms": times}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dyntree_core.bench kernels", description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=list(kt.DEFAULT_MS), help="M values")
    p.add_argument("--extra", nargs="*", default=list(EXTRA_CANDIDATES), choices=EXTRA_CANDIDATES)
    p.add_argument("--inductor", nargs="*", default=[], metavar="SHAPE",
                   help="shapes (as 'Q4_K 8960 1536') to also time inductor's compiled int8 weight-only GEMM on")
    p.add_argument("--forward-ns", type=int, nargs="*", default=[1, 16, 64],
                   help="t(n) of the target per kernel policy (none: skip)")
    p.add_argument("--policies", nargs="*", default=None, metavar="POLICY",
                   help="kernel policies of the t(n) rows (labels of POLICY_ROWS, e.g. native_q8 table; default all)")
    p.add_argument("--no-llamacpp", action="store_true")
    p.add_argument("--overhead", nargs="*", default=[], choices=("float32", "aten", "native", "native_fused"),
                   help="1-token forward of a 28-layer, width-256 twin per kind (cost outside the weight products)")
    p.add_argument("--profile", nargs="*", default=[], metavar="POLICY",
                   help="torch.profiler top ops of a 1-token int4 target forward per DYNTREE_KERNELS policy")
    p.add_argument("--no-shapes", action="store_true", help="skip the per-shape kernel timings")
    p.add_argument("--json", type=Path, default=None)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    from ..models.gguf_model import linear_shapes
    from ..models.load import resolve_spec
    from ..quant.gguf_file import read_gguf
    from ..quant.native import native_kernels, native_unavailable_reason

    args = build_parser().parse_args(argv)
    say: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    t_start = time.perf_counter()
    mi = machine_info()
    out_path = args.json or Path("bench/results") / f"kernels_{mi.short_label()}.json"
    nk = native_kernels()
    record: dict = {"bench": "kernels", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:],
                    "machine_info": mi.to_dict(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "native": nk.digest if nk else None, "native_unavailable": native_unavailable_reason(),
                    "vnni": bool(nk and nk.vnni), "vnni_unavailable": nk.vnni_reason if nk else None,
                    "table_identity": kt.table_identity(), "torchao": torchao_status(),
                    "quantized_engine": torch.backends.quantized.engine, "rows": args.rows,
                    "shapes": {}, "plans": {}}

    def save() -> None:
        record["seconds"] = time.perf_counter() - t_start
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(record, indent=1))

    shapes: dict[kt.LayerShape, list[str]] = {}
    for role in ("target", "draft"):
        for s in set(linear_shapes(read_gguf(resolve_spec("embedded", role).gguf)).values()):
            shapes.setdefault(s, []).append(role)
    inductor = {kt.LayerShape(t, int(n), int(k)) for t, n, k in (s.split() for s in args.inductor)}
    table = kt.load_table()
    for s in ([] if args.no_shapes else sorted(shapes, key=lambda s: (s.type_name, s.n, s.k))):
        say(f"  {s.label} ({', '.join(shapes[s])})")
        with measured.watch() as w:
            timings = measure_all(s, args.rows, tuple(args.extra), s in inductor, say)
        verdict = w.verdict()
        record["shapes"][s.label] = {"roles": shapes[s], "ms": timings, "verdict": verdict.to_dict()}
        if not verdict.quiet:
            say(f"    {s.label}: not stored in the runtime table ({verdict.reason})")
        elif [str(m) for m in table.ms] == list(timings["aten"]):  # this run's timings become the runtime table's
            table.timings[s.label] = {c: timings[c] for c in kt.RUNTIME_CANDIDATES}
            kt.save_table(table)
    table = kt.ensure_shapes(shapes, say)
    for s in sorted(shapes, key=lambda s: (s.type_name, s.n, s.k)):
        plan = table.plan_for(s)
        record["plans"][s.label] = {"kind": plan.kind, "mm_min_rows": plan.mm_min_rows, "why": plan.why,
                                    "int8_activations": plan.int8_activations, "vnni_min_rows": plan.vnni_min_rows,
                                    "x8": plan.x8,
                                    "winners": table.winners(s.label),
                                    "runtime_table_ms": table.timings[s.label]}
    save()
    if args.overhead:
        record["narrow_twin_1token_ms"] = forward_overhead(tuple(args.overhead), say)
        save()
    for spec in args.profile:
        record.setdefault("profiles", {})[spec] = profile_target(spec)
        say(f"  profile {spec}: " + "; ".join(f"{r['op']} {r['share']:.0%}" for r in record["profiles"][spec][:6]))
        save()
    if args.forward_ns:
        record["target_forward_ms"] = target_forward_times(args.forward_ns, say, args.policies)
        save()
        if not args.no_llamacpp:
            record["llamacpp_forward_ms"] = llamacpp_forward_times(args.forward_ns, say)
    save()
    print_tables(record, sys.stdout)
    say(f"wrote {out_path}")
    return 0


def print_tables(record: dict, out=None) -> None:
    out = out or sys.stdout
    mi = record.get("machine_info", {})
    print(f"\nms per product on {mi.get('cpu_model')} [{', '.join(mi.get('cpu_flags', []))}], "
          f"{record.get('threads')} threads, torch {record.get('torch')}", file=out)
    rows = [str(m) for m in record["rows"]]
    for label, entry in record["shapes"].items():
        plan = record["plans"][label]
        print(f"\n{label} ({', '.join(entry['roles'])}): runs {plan['kind']}" + (" (x8 tiles)" if plan.get("x8") else "")
              + (f", dequant+GEMM from {plan['mm_min_rows']} rows" if plan["mm_min_rows"] else "")
              + (f", AVX-512 VNNI from {plan['vnni_min_rows']} rows" if plan.get("vnni_min_rows") else ""), file=out)
        print("| kernel | " + " | ".join(f"M={m}" for m in rows) + " |", file=out)
        print("|---" * (len(rows) + 1) + "|", file=out)
        for cand, ms in entry["ms"].items():
            if "error" in ms:
                print(f"| {cand} | error: {ms['error'][:80]} |", file=out)
                continue
            vals = [f"{ms[m]:.3f}" if isinstance(ms.get(m), float) else "—" for m in rows]
            print(f"| {cand} | " + " | ".join(vals) + " |", file=out)
    for kind, ms in record.get("narrow_twin_1token_ms", {}).items():
        print(f"narrow twin (28 layers, width 256), 1-token forward, {kind}: {ms:.2f} ms", file=out)
    for spec, rows in record.get("profiles", {}).items():
        print(f"\nprofile of a 1-token int4 target forward, {spec}:", file=out)
        for r in rows:
            print(f"  {r['op']:<45} {r['self_ms_per_forward']:8.2f} ms {r['share']:6.1%}  x{r['calls_per_forward']:.0f}",
                  file=out)
    fwd = record.get("target_forward_ms")
    if fwd:
        ns = list(next(iter(fwd.values())))
        print("\ntarget forward ms (int4, 128-token prefix, logits of every row)", file=out)
        print("| kernels | " + " | ".join(f"t({n})" for n in ns) + " |", file=out)
        print("|---" * (len(ns) + 1) + "|", file=out)
        for label, t in fwd.items():
            print(f"| ours: {label} | " + " | ".join(f"{t[n]:.1f}" for n in ns) + " |", file=out)
        lc = record.get("llamacpp_forward_ms", {})
        if "ms" in lc:
            print("| llama.cpp Llama.eval | " + " | ".join(f"{lc['ms'].get(n, float('nan')):.1f}" for n in ns) + " |",
                  file=out)


if __name__ == "__main__":
    sys.exit(main())
