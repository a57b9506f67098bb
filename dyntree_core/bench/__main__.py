"""``python -m dyntree_core.bench <subcommand> [args...]``: a table of subcommand -> module.

Each module exposes ``main(argv: list[str] | None) -> int``. With ``pass_name`` True the
subcommand name is kept as the module's first argument (one module serving several modes).
Add a benchmark by adding one row to ``SUBCOMMANDS``.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import NamedTuple, Optional


class Subcommand(NamedTuple):
    module: str
    pass_name: bool
    help: str


SUBCOMMANDS: dict[str, Subcommand] = {
    "attention": Subcommand("dyntree_core.bench.attention", False,
                            "tree-attention block counts (BFS/DFS/HPD) and kernel timings"),
    "offload": Subcommand("dyntree_core.bench.offload", False, "layer-streaming offload bandwidth and forward times"),
    "acceptance": Subcommand("dyntree_core.bench.decoding", True, "accepted tokens per step"),
    "latency": Subcommand("dyntree_core.bench.decoding", True, "seconds per token"),
    "all": Subcommand("dyntree_core.bench.decoding", True, "acceptance + latency + tree-size curve"),
    "record-trees": Subcommand("dyntree_core.bench.record_trees", False,
                               "record real draft trees from the engine (input of attention --trees)"),
    "table": Subcommand("dyntree_core.bench.results_table", False,
                        "Markdown table of committed latency results (bench/results/latency_*.json)"),
    "speed": Subcommand("dyntree_core.bench.speed", False,
                        "ms/token: autoregressive per precision, auto, transformers and llama.cpp peers"),
    "exactness": Subcommand("dyntree_core.bench.exactness", False,
                            "greedy token-identity of every method vs the target, tokens/s per dtype"),
    "profile": Subcommand("dyntree_core.bench.profile", False,
                          "the machine profile (twins), and twin vs real model forward times (--real)"),
    "step-phases": Subcommand("dyntree_core.bench.step_phases", False,
                              "step time by phase and the share outside the two forwards, by budget"),
    "gpu": Subcommand("dyntree_core.bench.gpu", False,
                      "every GPU check and benchmark in one run (<= 20 min on one H100/H200); --dry-run on CPU"),
    "kernels": Subcommand("dyntree_core.bench.kernels", False,
                          "every weight-only kernel per layer shape and M, the kernel table, t(n) per kernel choice"),
    "exact-acceptance": Subcommand("dyntree_core.bench.exact_acceptance", False,
                                   "exact expected accepted tokens of every verifier on the same trees"),
}


def _usage() -> str:
    rows = "\n".join(f"  {name:<12} {sc.help}" for name, sc in SUBCOMMANDS.items())
    return f"usage: python -m dyntree_core.bench <subcommand> [args...]\n\nsubcommands:\n{rows}\n"


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"unknown subcommand {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    # Triton's interpreter must be selected before anything imports Triton (transformers does).
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sc = SUBCOMMANDS[name]
    module = importlib.import_module(sc.module)
    return int(module.main([name, *rest] if sc.pass_name else rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
