"""Where the first Run's load goes on a fresh machine: the embedded pair loaded at int4 in a new cache (the fetched
GGUFs and the compiled kernels linked in, as after ``make run``'s set-up; no kernel table, no packed weights), each
progress line of ``load_pair`` printed with the seconds since the start and since the line before (the kernel
table's shapes, the packed build of each model). With ``--prepared``, the set-up's ``python -m dyntree_core
prepare`` runs first in that cache (untimed), as ``make run`` does: what the first Run's load is left with.

    .venv/bin/python scripts/first_load.py [--keep DIR] [--prepared]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", type=Path, help="build the fresh cache here and keep it (default: a temporary one)")
    ap.add_argument("--prepared", action="store_true", help="run the set-up's prepare step in the cache first")
    args = ap.parse_args()
    from dyntree_core.paths import cache_root

    home = cache_root()
    with tempfile.TemporaryDirectory() as tmp:
        cache = args.keep or Path(tmp)
        cache.mkdir(parents=True, exist_ok=True)
        for sub in ("gguf", "models"):
            if not (cache / sub).exists():
                (cache / sub).symlink_to(home / sub)
        (cache / "kernels").mkdir(exist_ok=True)
        for so in (home / "kernels").glob("ggml_kernels-*.so"):  # the compiled kernels, not the table
            if not (cache / "kernels" / so.name).exists():
                os.link(so, cache / "kernels" / so.name)
        os.environ["DYNTREE_CACHE"] = str(cache)
        if args.prepared:
            from dyntree_core.planning.first_load import prepare_first_load

            done = prepare_first_load()
            print(f"prepared (untimed): draft {done.draft_precision}, target {done.target_precision}, "
                  f"{done.seconds:.1f} s", flush=True)
        t0 = last = time.perf_counter()

        def say(line: str) -> None:
            nonlocal last
            now = time.perf_counter()
            print(f"{now - t0:6.1f} s (+{now - last:5.1f})  {line.strip()}", flush=True)
            last = now

        from dyntree_core.machine import machine_info
        from dyntree_core.models.load import load_pair
        from dyntree_core.quant.native import native_kernels

        info = machine_info()
        say(f"{info.cpu_model} ({info.cpu_class}), {os.cpu_count()} CPUs")
        native_kernels()
        say("native kernels loaded")
        pair = load_pair("embedded", "embedded", precision="int4", draft_precision="int4", progress=say)
        say("pair loaded: " + ", ".join(f"{k} {v:.1f} s" for k, v in pair.load_seconds.items()))


if __name__ == "__main__":
    main()
