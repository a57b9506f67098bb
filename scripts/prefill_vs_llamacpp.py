"""Our engine's prefill of a 512-token prompt (embedded pair, plain int4, time-sized chunks, as the app runs it)
against llama.cpp's prompt processing of the same GGUF (``llama-bench`` pp64 / pp512), one process.

    .venv/bin/python scripts/prefill_vs_llamacpp.py --llamacpp-bin DIR   (DIR: what ``make peers`` printed)
"""

import argparse
import statistics

import torch

from dyntree_core.bench import llamacpp_native as ln
from dyntree_core.bench.speed import _gguf_paths
from dyntree_core.config import DecodeConfig
from dyntree_core.decode.engine import SpeculativeDecoder
from dyntree_core.planning.pair_cache import PairCache
from dyntree_core.prompts import load_prompts
from dyntree_core.trace import PrefillProgress


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llamacpp-bin", required=True)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    pair = PairCache("embedded", "embedded", keep=1).pair("int4", "int4")
    text = " ".join(p.text for p in load_prompts("wiki", 10))
    ids = pair.tokenizer(text, add_special_tokens=False)["input_ids"][:args.tokens + 1]
    dec = SpeculativeDecoder(pair.draft, pair.target, DecodeConfig(method="autoregressive"), eos_token_id=())
    ours = []
    for _ in range(args.reps):
        last = None
        for ev in dec.generate(ids, 1, prefill_progress=True):
            last = ev if isinstance(ev, PrefillProgress) else last
        ours.append(last.seconds / last.done * 1e3)
    ms = statistics.median(ours)
    print(f"ours: {ms:.2f} ms per prompt token over {args.tokens} ({1e3 / ms:.1f} tokens/s; {[round(x, 2) for x in ours]})")
    _, target, _ = _gguf_paths("embedded")
    forwards = ln.bench_forwards(ln.native_build(args.llamacpp_bin), target, [64, args.tokens],
                                 torch.get_num_threads(), tg=16, repetitions=args.reps)
    for n, t in forwards["pp"].items():
        print(f"llama-bench pp{n}: {t / n:.2f} ms per token ({n / t * 1e3:.1f} tokens/s); ours / it = {ms / (t / n):.2f}")


if __name__ == "__main__":
    main()
