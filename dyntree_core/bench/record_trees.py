"""Record real draft trees from the engine for the attention benchmark's ``--trees``.

    python -m dyntree_core.bench record-trees [--pair embedded] [--method dyspec_greedy]
        [--budgets 256 512 1024 2048] [--depth 16] [--prompts 2] [--steps 2] [--temperature 0.6]
        [--dtype bfloat16] [--json bench/results/recorded_trees.json]

Each decoding step's tree (parents in construction order, with its size, depth and how many
nodes the target accepted) is written as ``{"trees": [{"parents": [...], ...}, ...]}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional

from ..config import METHODS, DecodeConfig, default_threshold

DEFAULT_JSON = Path("bench/results/recorded_trees.json")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dyntree_core.bench record-trees")
    p.add_argument("--pair", default="embedded", help="'embedded', 'tiny' or draft_spec,target_spec")
    p.add_argument("--method", default="dyspec_greedy", choices=[m for m in METHODS if m != "autoregressive"])
    p.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--depth", type=int, default=16)
    p.add_argument("--prompts", type=int, default=2, help="prompts per budget (wiki and code, eval split)")
    p.add_argument("--steps", type=int, default=2, help="decoding steps recorded per prompt")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    from tqdm import tqdm

    from ..decode.engine import SpeculativeDecoder
    from ..prompts import load_prompts
    from .decoding import _encode, _load

    args = build_parser().parse_args(argv)
    pair = _load(args.pair, args.dtype, args.device)
    texts = [p for ds in ("wiki", "code") for p in load_prompts(ds, args.prompts, split="eval")][: args.prompts]
    trees = []
    bar = tqdm(total=len(args.budgets) * len(texts) * args.steps, desc="recording", unit="step", file=sys.stderr)
    started = time.time()
    for budget in args.budgets:
        cfg = DecodeConfig(method=args.method, temperature=args.temperature, budget=budget, depth=args.depth,
                           threshold=default_threshold(budget), seed=args.seed, dtype=args.dtype, device=args.device,
                           trace_block_counts=False)
        decoder = SpeculativeDecoder(pair.draft, pair.target, cfg)
        for i, prompt in enumerate(texts):
            ids = _encode(pair.tokenizer, prompt.text, 128)
            for tr in decoder.generate(ids, 10**6, seed=args.seed + i):
                trees.append({
                    "parents": tr.tree.parents.tolist(), "size": tr.tree.size, "depth": int(tr.tree.depth.max()) + 1,
                    "accepted": len(tr.accepted_nodes) - 1, "budget": budget, "method": args.method,
                    "temperature": args.temperature, "prompt": f"{prompt.dataset}/{prompt.id}", "step": tr.step,
                })
                bar.update(1)
                if tr.step + 1 >= args.steps:
                    break
    bar.close()
    out = {"pair": args.pair, "dtype": args.dtype, "device": args.device, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "wall_seconds": time.time() - started, "trees": trees}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out))
    for budget in args.budgets:
        mine = [t for t in trees if t["budget"] == budget]
        if mine:
            print(f"budget {budget}: {len(mine)} trees, sizes {sorted({t['size'] for t in mine})}, "
                  f"depth up to {max(t['depth'] for t in mine)}")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
