"""Prefill time of the embedded pair's target (int4, plain decoding) with time-sized chunks
(``engine.PREFILL_CHUNK_SECONDS``) against fixed 512-token chunks, alternated in one process.

    .venv/bin/python scripts/prefill_chunks_ab.py [--tokens 1024] [--reps 2]
"""

import argparse
import time

import torch

import dyntree_core.decode.engine as engine
from dyntree_core import DecodeConfig, SpeculativeDecoder
from ui.models import HubModelProvider
from ui.pair_spec import PairSpec


def prefill_seconds(pair, prompt: list[int]) -> tuple[float, list[int]]:
    """Seconds to the end of the prefill (one new token) and the chunk sizes it used."""
    cfg = DecodeConfig(method="autoregressive", precision="int4", draft_precision="int4")
    sizes, last = [], 0
    t0 = time.perf_counter()
    for item in SpeculativeDecoder(pair.draft, pair.target, cfg).generate(prompt, 1, prefill_progress=True):
        if hasattr(item, "done"):
            sizes.append(item.done - last)
            last = item.done
    return time.perf_counter() - t0, sizes[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(2)
    pair = HubModelProvider().load(PairSpec("embedded", "embedded", precision="int4", draft_precision="int4"))
    gen = torch.Generator().manual_seed(0)
    prompt = [int(x) for x in torch.randint(100, 20000, (args.tokens + 1,), generator=gen)]
    timed = (engine.PREFILL_FIRST, engine.PREFILL_CHUNK_SECONDS)
    for _ in range(args.reps):
        for label, (first, seconds) in (("fixed 512-token chunks", (512, 1e9)), ("time-sized chunks", timed)):
            engine.PREFILL_FIRST, engine.PREFILL_CHUNK_SECONDS = first, seconds
            t, sizes = prefill_seconds(pair, prompt)
            print(f"{label}: {t:.1f} s for {args.tokens} prompt tokens, {len(sizes)} chunks, first {sizes[:6]}",
                  flush=True)


if __name__ == "__main__":
    main()
