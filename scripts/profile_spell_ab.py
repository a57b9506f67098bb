"""``auto``'s whole measurement from nothing (the machine profile and the pair's acceptance at T = 0, as the app's
background measurement runs it: ``plan_auto`` on the embedded pair, ``auto`` everywhere, a memory probe first), this
tree against another commit's, alternated run by run, each run in its own process and its own empty profile cache
(the fetched models, GGUFs, kernels and packed weights shared). Per run: seconds, the rows measured again for
another spell of the memory's bandwidth, the profile's spell moves, its final spell and the plan.

    .venv/bin/python scripts/profile_spell_ab.py --base REV [--rounds 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from dyntree_core.planning.auto import plan_auto
from dyntree_core.planning.pair_cache import PairCache
from dyntree_core.planning.profiling import run_probe
from dyntree_core.planning.search_space import search_space
tps, dps, methods = search_space("auto", "auto", "auto", "cpu")
lines, t0 = [], time.perf_counter()
say = lambda m: lines.append([round(time.perf_counter() - t0, 2), m.strip()])
probe = run_probe()
plan = plan_auto(PairCache("embedded", "embedded", device="cpu"), 0.0, target_precisions=tps, draft_precisions=dps,
                 methods=methods, progress=say, read_gb_per_s=probe)
prof = plan.profile
print(json.dumps({"seconds": round(time.perf_counter() - t0, 1), "probe_gb_per_s": probe,
                  "profile_gb_per_s": prof.read_gb_per_s, "moved_from": prof.meta.get("spell_moved_from", []),
                  "mixed_spells": prof.meta.get("mixed_spells", []), "plan": plan.best.label(), "lines": lines}))
"""


def run_side(root: Path, shared: Path) -> dict:
    """One measurement from nothing by the source tree at ``root``, in a fresh cache beside ``shared``'s models."""
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp)
        for sub in ("models", "gguf", "kernels", "packed"):
            if (shared / sub).exists():
                (cache / sub).symlink_to(shared / sub)
        env = dict(os.environ, DYNTREE_CACHE=str(cache), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        out = subprocess.run([sys.executable, "-c", CHILD, str(root)], env=env, capture_output=True, text=True,
                             check=True, cwd=root)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    texts = [m for _, m in got["lines"]]
    got["measured_again"] = sum("measured again in" in m for m in texts)
    got["kept_as_measured"] = sum("kept as measured" in m for m in texts)
    got["moves"] = sum("the profile moves to it" in m for m in texts)
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the commit to compare with (a git revision)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from dyntree_core.bench.result_file import write_result
    from dyntree_core.bench.worktree import base_worktree
    from dyntree_core.paths import cache_root

    base_rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout.strip()
    shared = cache_root()
    rounds = []
    with base_worktree(ROOT, base_rev) as wt:
        for r in range(args.rounds):
            pair = {}
            for side, root in (("base", wt), ("this", ROOT)) if r % 2 == 0 else (("this", ROOT), ("base", wt)):
                pair[side] = run_side(root, shared)
                g = pair[side]
                print(f"round {r + 1} {side}: {g['seconds']:.0f} s, probe {g['probe_gb_per_s']} GB/s, profile "
                      f"{g['profile_gb_per_s']} GB/s (moved from {g['moved_from']}), measured again "
                      f"{g['measured_again']}x, kept mixed {g['kept_as_measured']}x; {g['plan']}", flush=True)
            rounds.append(pair)
    med = {side: statistics.median(x[side]["seconds"] for x in rounds) for side in ("base", "this")}
    print(f"median seconds: base {med['base']:.0f}, this {med['this']:.0f}")
    if args.json:
        write_result(args.json, "scripts/profile_spell_ab.py", {"base": base_rev, "rounds": rounds,
                                                                "median_seconds": med})


if __name__ == "__main__":
    main()
