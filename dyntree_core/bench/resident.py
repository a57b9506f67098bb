"""``bench gpu``'s resident section: both models in device memory, real Qwen2.5 shapes.

For a 1.5B- and a 7B-shaped target (synthetic weights: random, output head sharpened so greedy
choices are not near-ties; the 0.5B-shaped draft therefore accepts ~nothing and every step
commits ~1 token — the step times are the point) in one process:

- transformers ``generate`` (greedy, SDPA), measured first, before our engine switches the model's
  attention implementation: with its dynamic cache (eager) and with ``cache_implementation="static"``
  (it compiles the forward: the peer to beat; its warm-up reported apart);
- our engine: autoregressive, chain (depth 4) and dyspec_greedy at each budget, each with SDPA
  (``attention="torch"``) and the Triton kernel (``"triton"``): median step time, tokens per step,
  median of every phase that ran, and the step's cost relative to a plain (AR) step of the same
  ``step`` kind. ``step``: ``graph`` = fixed-shape programs (``decode.graph_step``) as captured CUDA
  graphs (captured on the first step: ``compile_s``; DySpec drafts only the levels its tree reaches,
  ``draft_forwards`` per step), ``graph_every_level`` = the same with every draft level of the
  envelope forwarded (what a tree as deep as the envelope pays: the synthetic draft's trees are one
  level deep), ``graph_inductor`` = the same programs compiled
  by inductor with ``mode="reduce-overhead"``, ``graph_inductor_draft`` = a ``graph`` step whose draft programs
  are compiled by inductor first and their fused kernels captured in the step's graphs (the draft level's ~400
  kernels were most of a tree step), ``graph_host_verify`` = a ``graph`` step at T > 0 whose
  token-level verification runs on the host from the read draft and target rows (the A/B of the
  device's verification: the sampled budget-64 rows run both), ``graph_no_cudnn`` = a ``graph`` step whose
  programs were captured with every SDPA backend but cuDNN's (``sdpa_backends``: on the H200 cuDNN's
  attention added two copies and a memset per layer to each forward), plain and at the A/B budget,
  ``graph_alphas_loop`` = a ``graph`` step at T > 0 whose token-level recurrence runs as torch ops, 6 kernels a
  sibling position (``DYNTREE_ALPHAS=loop`` while it is captured), where ``graph`` runs it as one Triton kernel
  (``verify.alpha_kernel``), ``graph_torch_layers`` = a ``graph`` step whose dense layers rotate and write the
  cache and multiply ``silu(gate) * up`` with torch ops (6 kernels; ``DYNTREE_LAYER_KERNELS=torch`` while it is
  captured), where ``graph`` runs ``decode.layer_kernels``' two Triton kernels (plain and at the A/B budget),
  ``host`` = the eager step with host drafting and verification, ``device_side`` = the eager step drafting greedy trees on device tensors through the HF
  forward. On the plan's ``graph_targets`` the SDPA rows run as graphs first, then the A/B of the
  eager kinds (the device-side drafting regression) and inductor's plain step; Triton rows run on the
  host path, last. A row that raises is recorded under ``failed`` and the others still run;
- ``ar_vs_hf_generate`` / ``ar_vs_hf_static``: our best autoregressive ms/token per kind over
  transformers' dynamic / static-cache ``generate``;
- the floor: the target's weight bytes over the measured device-memory bandwidth (a ``clone`` of
  a large buffer: read + write), the time one token must take to stream the weights once;
- ``forward_kernels``: the draft forward's kernels at 1 and 63 rows (a plain step's and a budget-64
  level's), as the CPU's ``LaunchCounter`` models them and as CUDA's profiler counts them (also with cuDNN's
  attention excluded: ``profiled_no_cudnn``).

``--dry-run`` runs the same code at tiny shapes on the CPU (the kernel through Triton's
interpreter): every number is measured, none means anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

#: Qwen2.5 shapes: hidden, layers, heads, kv heads, ffn (vocabulary 151936)
QWEN_SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "0.5B": (896, 24, 14, 2, 4864),
    "1.5B": (1536, 28, 12, 2, 8960),
    "7B": (3584, 28, 28, 4, 18944),
}
QWEN_VOCAB = 151936
#: step kinds that run as fixed-shape programs (``decode.graph_step``)
GRAPH_KINDS = ("graph", "graph_inductor", "graph_inductor_draft", "graph_every_level", "graph_host_verify",
               "graph_no_cudnn", "graph_alphas_loop", "graph_torch_layers")
#: every row's step kind (the module docstring), ``bench gpu --resident-kinds``' choices
STEP_KINDS = (*GRAPH_KINDS, "host", "device_side")
#: the dry run's stand-ins (same roles, tiny)
TINY_SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "0.5B": (64, 2, 4, 2, 128),
    "1.5B": (96, 3, 6, 2, 192),
    "7B": (128, 3, 8, 2, 256),
}
TINY_VOCAB = 512


def synthetic_qwen(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int, seed: int,
                   dev: torch.device, sharpen: float = 30.0):
    """A Qwen2 model of the given shape with random fp32 weights on ``dev``, its output head scaled
    by ``sharpen`` so that next-token distributions are peaked (greedy choices are not near-ties)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(seed)
        with torch.device(dev):
            model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    return model.eval()


@dataclass(frozen=True)
class ResidentPlan:
    """What the section runs (``for_run``: the real sizes on CUDA, tiny ones for the dry run)."""

    dry_run: bool
    shapes: dict[str, tuple[int, int, int, int, int]]
    vocab: int
    targets: tuple[str, ...]
    budgets: tuple[int, ...]
    steps: int
    prompt: int
    hf_tokens: int
    bandwidth_bytes: int
    dtype: str
    graph_targets: tuple[str, ...]
    ab_budget: int

    @classmethod
    def for_run(cls, dry_run: bool) -> "ResidentPlan":
        if dry_run:
            return cls(True, TINY_SHAPES, TINY_VOCAB, ("7B", "1.5B"), (4,), 1, 16, 4, 64 << 20, "float32", ("1.5B", "7B"), 4)
        # the 7B shape first: the must-shows' rows before the time budget runs out
        return cls(False, QWEN_SHAPES, QWEN_VOCAB, ("7B", "1.5B"), (16, 64, 256), 12, 128, 64, 4 << 30, "bfloat16",
                   ("7B",), 64)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def memory_bandwidth(dev: torch.device, nbytes: int, reps: int = 5) -> dict[str, Any]:
    """Device-memory bandwidth from ``clone`` of an ``nbytes`` buffer (read + write: 2 x nbytes per copy)."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=dev).fill_(1)
    x.clone()  # warm-up
    samples = []
    for _ in range(reps):
        _sync(dev)
        t0 = time.perf_counter()
        y = x.clone()
        _sync(dev)
        samples.append(2 * nbytes / (time.perf_counter() - t0) / 1e9)
        del y
    del x
    return dict(bytes=nbytes, gbps_samples=samples, gbps=statistics.median(samples))


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def hf_generate_ms(model, ids: torch.Tensor, tokens: int, reps: int = 3, **kwargs) -> tuple[float, float]:
    """ms per new token of transformers' greedy ``generate`` (``kwargs``: e.g.
    ``cache_implementation="static"``) and the seconds of its two warm-up calls (compilation, for a
    static cache). Per token = (``tokens``-token call - 1-token call) / (``tokens`` - 1), each call the fastest
    of ``reps`` (interference only adds time; the medians of a tiny model's calls on a loaded 2-core CI machine
    once gave -0.24 ms): the prompt's prefill is left out."""
    def once(n: int) -> float:
        _sync(ids.device)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **kwargs)
        _sync(ids.device)
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    once(min(8, tokens))
    once(min(8, tokens))
    warmup = time.perf_counter() - t0
    full = min(once(tokens) for _ in range(reps))
    one = min(once(1) for _ in range(reps))
    return (full - one) / (tokens - 1) * 1e3, warmup


def sdpa_backends(step: str):
    """The SDPA backends a row of kind ``step`` may use, as a context: every one but cuDNN's for
    ``graph_no_cudnn`` (in effect while its programs are captured, which fixes the kernels they replay), torch's
    own choice otherwise."""
    if step != "graph_no_cudnn":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


#: the A/B kinds that run a ``graph`` step with torch ops where it has one Triton kernel: the switch set while
#: their programs are captured (which fixes the kernels they replay)
TORCH_OPS_SWITCHES = {"graph_alphas_loop": ("DYNTREE_ALPHAS", "loop"),  # verify.alpha_kernel's recurrence
                      "graph_torch_layers": ("DYNTREE_LAYER_KERNELS", "torch")}  # decode.layer_kernels' two ops


def kernels_as(step: str):
    """A row of kind ``step`` with its ``TORCH_OPS_SWITCHES`` switch set, as a context (no switch: nothing)."""
    if step not in TORCH_OPS_SWITCHES:
        return contextlib.nullcontext()
    from .env import env_var

    return env_var(*TORCH_OPS_SWITCHES[step])


def run_decoder(draft, target, cfg, prompt: list[int], steps: int, step: str = "host") -> Optional[dict[str, Any]]:
    """Median step of ``steps`` steps after one warm-up step (which compiles a ``graph`` step's
    programs: ``compile_s``); phases that ran, in ms. ``step``: ``graph``, ``host`` or ``device_side``."""
    from .. import SpeculativeDecoder

    from ..decode.compiled import CompileMode

    dec = SpeculativeDecoder(draft, target, cfg)
    dec.graph_steps = step in GRAPH_KINDS
    dec.draft_every_level = step == "graph_every_level"
    dec.device_verify = step != "graph_host_verify"
    dec.device_side = step == "device_side"
    if step == "graph_inductor":
        dec.compile_mode = CompileMode.inductor(dec.device)
    if step == "graph_inductor_draft":
        from ..decode.graph_step import DRAFT_PROGRAMS

        dec.compile_mode = CompileMode.graphs(dec.device, fuse=DRAFT_PROGRAMS)
    if dec.graph_steps and dec.graph_reason() is not None:
        raise RuntimeError(f"a graph step was asked for but cannot run: {dec.graph_reason()}")
    events = []
    dec.on_compile = events.append
    with sdpa_backends(step), kernels_as(step):
        traces = list(dec.generate(prompt, steps + 1))[1:]
    if not traces:
        return None
    phases = {p: statistics.median(getattr(t.timings, p) for t in traces) * 1e3
              for p in ("draft", "tree_build", "mask", "target_forward", "verify", "kv_compaction")
              if any(getattr(t.timings, p) > 0 for t in traces)}
    return dict(step=step, compile_s=sum(e.seconds for e in events),
                steps=len(traces), step_ms=statistics.median(t.step_seconds for t in traces) * 1e3,
                tokens_per_step=sum(len(t.committed) for t in traces) / len(traces),
                tree_size=statistics.median(t.tree_size for t in traces),
                draft_forwards=statistics.median(t.draft_forwards for t in traces), phases_ms=phases)


def resident_configs(plan: ResidentPlan, name: str, dev: torch.device) -> list[tuple[Any, str]]:
    """(config, step kind) of every row for target ``name``, in run order: what the issue's must-shows
    need first (the graph steps, then the A/B of the eager paths), the Triton host rows last."""
    from .. import DecodeConfig

    base = dict(device=str(dev), dtype=plan.dtype, temperature=0.0)

    def ar(attention: str) -> Any:
        return DecodeConfig(method="autoregressive", attention=attention, **base)

    def chain(attention: str) -> Any:
        return DecodeConfig(method="chain", depth=4, attention=attention, **base)

    def tree(attention: str, budget: int, temperature: float = 0.0) -> Any:
        return DecodeConfig(method="dyspec_greedy", budget=budget, depth=8, attention=attention, node_order="dfs",
                            **(base | dict(temperature=temperature)))

    order = sorted(plan.budgets, key=lambda b: (b != plan.ab_budget, -b))  # the A/B budget, then the largest
    out: list[tuple[Any, str]] = []
    if name in plan.graph_targets:
        out += [(ar("torch"), "graph")] + [(tree("torch", b), "graph") for b in order] + [(chain("torch"), "graph")]
        # the same trees with every draft level forwarded: what a tree as deep as the envelope pays (the
        # synthetic pair's trees are one level deep; a real pair's reach depth 7-8 at budget 64)
        out += [(tree("torch", b), "graph_every_level") for b in order]
        # the same graphs captured without cuDNN's attention (its extra copies and memset per layer)
        out += [(ar("torch"), "graph_no_cudnn"), (tree("torch", plan.ab_budget), "graph_no_cudnn")]
        out += [(ar("torch"), "host"), (tree("torch", plan.ab_budget), "host"),
                (tree("torch", plan.ab_budget), "device_side")]
        # T = 1, token level: verified on the device, and on the host from the read rows (2 B V floats)
        out += [(tree("torch", plan.ab_budget, 1.0), "graph"), (tree("torch", plan.ab_budget, 1.0), "graph_host_verify")]
        # and with the token-level recurrence as torch ops (6 kernels a sibling position) instead of one kernel
        out += [(tree("torch", plan.ab_budget, 1.0), "graph_alphas_loop")]
        # and the dense layer's rotation + cache write and silu * mul as torch ops (6 kernels) instead of 2
        out += [(ar("torch"), "graph_torch_layers"), (tree("torch", plan.ab_budget), "graph_torch_layers")]
        if not plan.dry_run:  # inductor's fused kernels (a CUDA compile: the dry run leaves it out)
            out += [(tree("torch", plan.ab_budget), "graph_inductor_draft")]
            out += [(tree("torch", plan.ab_budget), "graph_inductor"), (ar("torch"), "graph_inductor")]
    else:
        out += [(ar("torch"), "host"), (chain("torch"), "host")] + [(tree("torch", b), "host") for b in plan.budgets]
    out += [(ar("triton"), "host"), (chain("triton"), "host")] + [(tree("triton", b), "host") for b in plan.budgets]
    return out


def forward_kernels(model, rows: int, span: int, dev: torch.device) -> dict[str, Any]:
    """The kernels of one ``DenseForward`` of ``rows`` rows over a ``span``-slot masked buffer: as
    ``decode.op_count.LaunchCounter`` models them (what the CPU tests hold to budgets) and, on CUDA, as
    torch's profiler sees them (every GPU activity of the call, eager: the count a CUDA graph of it
    replays). The two agreeing is what makes the CPU budgets a GPU property."""
    from ..decode.dense_forward import DenseForward
    from ..decode.op_count import LaunchCounter

    f = DenseForward(model, span)
    idx = torch.arange(rows, device=dev)
    visible = torch.ones(rows, span, dtype=torch.bool, device=dev)
    f(idx, idx, idx, visible, idx)  # warm: cuBLAS handles, allocator
    with LaunchCounter() as launches:
        f(idx, idx, idx, visible, idx)
    out: dict[str, Any] = dict(rows=rows, span=span, modelled=launches.kernels, math_sdpa=launches.math_sdpa)
    if dev.type == "cuda":
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        def profiled() -> int:
            f(idx, idx, idx, visible, idx)  # warm (a backend not used yet)
            _sync(dev)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                f(idx, idx, idx, visible, idx)
                _sync(dev)
            return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)

        out["profiled"] = profiled()
        with sdpa_backends("graph_no_cudnn"):
            out["profiled_no_cudnn"] = profiled()
    return out


def _selected(plan: ResidentPlan, name: str, dev: torch.device, kinds: Optional[list[str]]) -> list[tuple[Any, str]]:
    return [(cfg, step) for cfg, step in resident_configs(plan, name, dev)
            if not kinds or step in kinds or (step == "graph" and cfg.method == "autoregressive")]


def resident(dev: torch.device, seconds: float, dry_run: bool, log=print,
             save: Optional[Callable[[dict[str, Any]], None]] = None, target_names: Optional[list[str]] = None,
             kinds: Optional[list[str]] = None, skip_hf: bool = False) -> dict[str, Any]:
    """The section (see the module docstring). Rows past ``seconds`` are listed under ``skipped``;
    ``save`` gets what is measured so far after each row (a run killed by its time limit keeps it).
    ``target_names`` / ``kinds``: only these targets / step kinds (plain decoding's ``graph`` row is always
    kept: the other rows' reference); ``skip_hf``: transformers' rows left out (their ratios NaN)."""
    from ..decode.prepared import PreparedPair

    plan = ResidentPlan.for_run(dry_run)
    if target_names:
        plan = dataclasses.replace(plan, targets=tuple(t for t in plan.targets if t in target_names))
    t_start = time.perf_counter()
    dtype = getattr(torch, plan.dtype)
    targets: list[dict[str, Any]] = []
    skipped: list[str] = []
    failed: list[dict[str, str]] = []
    bandwidth = memory_bandwidth(dev, plan.bandwidth_bytes)
    log(f"resident: device-memory bandwidth {bandwidth['gbps']:.1f} GB/s (clone, read + write)")
    draft = synthetic_qwen(*plan.shapes["0.5B"], plan.vocab, seed=1, dev=dev, sharpen=1.0).to(dtype)
    kernels: dict[str, Any] = {}
    try:
        kernels["0.5B"] = [forward_kernels(draft, r, 256, dev) for r in (1, 63)]
        log("resident: kernels per draft forward (modelled / profiled): "
            + ", ".join(f"{k['rows']} rows {k['modelled']} / {k.get('profiled', '-')}" for k in kernels["0.5B"]))
    except Exception as e:  # noqa: BLE001 - recorded; the section's rows still run
        failed.append(dict(row="forward kernels", error=f"{type(e).__name__}: {e}",
                           traceback=traceback.format_exc(limit=12)))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, plan.vocab, (plan.prompt,), generator=gen).tolist()
    for name in plan.targets:
        target = synthetic_qwen(*plan.shapes[name], plan.vocab, seed=2, dev=dev, sharpen=30.0).to(dtype)
        try:
            nbytes = weight_bytes(target)
            ids = torch.tensor([prompt], device=dev)
            if skip_hf:
                hf = hf_static = hf_static_warmup = math.nan
            else:
                hf, _ = hf_generate_ms(target, ids, plan.hf_tokens)
                hf_static, hf_static_warmup = hf_generate_ms(target, ids, plan.hf_tokens,
                                                             cache_implementation="static")
            log(f"resident {name}: transformers generate {hf:.2f} ms/token, static cache {hf_static:.2f} "
                f"(warm-up {hf_static_warmup:.1f} s)")
            rows = []
            for cfg, step in _selected(plan, name, dev, kinds):
                label = f"{name} {cfg.method}" + (f" b{cfg.budget}" if cfg.method == "dyspec_greedy" else "") \
                    + f" {cfg.attention} {step}"
                if time.perf_counter() - t_start > seconds:
                    skipped.append(f"{label}: time budget ({seconds:.0f} s) spent")
                    continue
                try:
                    r = run_decoder(draft, target, cfg, prompt, plan.steps, step)
                except Exception as e:  # noqa: BLE001 - recorded; the other rows still run
                    failed.append(dict(row=label, error=f"{type(e).__name__}: {e}",
                                       traceback=traceback.format_exc(limit=12)))
                    log(f"resident {label}: FAILED {type(e).__name__}: {e}")
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                    continue
                if r is None:
                    skipped.append(f"{label}: no step decoded")
                    continue
                knobs = dict(budget=cfg.budget) if cfg.method == "dyspec_greedy" else {}
                if cfg.method != "autoregressive":
                    knobs["depth"] = cfg.depth
                if cfg.temperature > 0:
                    knobs["temperature"] = cfg.temperature
                rows.append(dict(method=cfg.method, **knobs, attention=cfg.attention, **r))
                if save is not None:
                    save(dict(partial=True, bandwidth=bandwidth, targets=targets, skipped=skipped, failed=failed,
                              current=dict(name=name, hf_generate_ms_per_token=hf, hf_static_ms_per_token=hf_static,
                                           hf_static_warmup_s=hf_static_warmup, weight_bytes=nbytes, rows=rows)))
                log(f"resident {label}: {r['step_ms']:.2f} ms/step, {r['tokens_per_step']:.2f} tokens/step, "
                    f"{r['draft_forwards']:g} draft forwards/step"
                    + (f" (compiled in {r['compile_s']:.1f} s)" if r["compile_s"] else ""))
            ar_rows = {(r["attention"], r["step"]): r for r in rows if r["method"] == "autoregressive"}
            for r in rows:
                ar_row = (ar_rows.get((r["attention"], r["step"]))
                          or ar_rows.get((r["attention"], "graph" if r["step"] in GRAPH_KINDS else "host")))
                if ar_row is not None:
                    r["step_vs_ar_step"] = r["step_ms"] / ar_row["step_ms"]
            ar = {f"{a} {k}": r["step_ms"] / r["tokens_per_step"] for (a, k), r in ar_rows.items()}
            ratio = {a: ms / hf for a, ms in ar.items()}
            ratio_static = {a: ms / hf_static for a, ms in ar.items()}
            floor = nbytes / (bandwidth["gbps"] * 1e9) * 1e3
            targets.append(dict(
                name=name, shape=dict(zip(("hidden", "layers", "heads", "kv_heads", "ffn"), plan.shapes[name])),
                weight_bytes=nbytes, floor_ms_per_token=floor,
                hf_generate_ms_per_token=hf, hf_static_ms_per_token=hf_static, hf_static_warmup_s=hf_static_warmup,
                ar_ms_per_token=ar, ar_vs_hf_generate=ratio, ar_vs_hf_static=ratio_static,
                ar_vs_floor={a: ms / floor for a, ms in ar.items()},
                ar_vs_hf_generate_best=min(ratio.values()) if ratio else math.nan,
                ar_vs_hf_static_best=min(ratio_static.values()) if ratio_static else math.nan, rows=rows))
        finally:
            PreparedPair.close_attached(draft, target)
            del target
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    want = sum(len(_selected(plan, name, dev, kinds)) for name in plan.targets)
    return dict(ok=sum(len(t["rows"]) for t in targets) == want and not failed, failed=failed, dtype=plan.dtype, vocab=plan.vocab,
                prompt_tokens=plan.prompt, steps=plan.steps, budgets=list(plan.budgets),
                draft_shape=dict(zip(("hidden", "layers", "heads", "kv_heads", "ffn"), plan.shapes["0.5B"])),
                bandwidth=bandwidth, targets=targets, skipped=skipped, timings_meaningful=not dry_run,
                forward_kernels=kernels,
                note="random weights: ~1 token per step; step times and their split are the point")
