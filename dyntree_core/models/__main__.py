"""``python -m dyntree_core.models fetch [--preset NAME ...]`` — fetch and convert embedded models.

Without ``--preset`` it fetches the default pair (draft + target) and prints their directories;
``list`` prints the presets and whether each is ready in the cache.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Optional

from .fetch import FetchError, cache_root, converted, ensure_embedded, ensure_embedded_pair
from .presets import ALIASES, PRESETS, resolve_preset


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dyntree_core.models", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="download, verify and convert embedded models (default: the pair)")
    f.add_argument("--preset", action="append", default=None,
                   help=f"preset to fetch (repeatable): {', '.join([*PRESETS, *ALIASES])}")
    sub.add_parser("list", help="list the embedded presets and their cache state")
    a = ap.parse_args(argv)
    if a.cmd == "list":
        root = cache_root()
        for p in PRESETS.values():
            ready = converted(root / "models" / p.name, p.sha256)
            print(f"{p.name:22s} {'ready' if ready else 'not fetched':12s} {p.description}  [{', '.join(p.requirements[:1])}...]")
        return 0
    t0 = time.perf_counter()
    try:
        if a.preset:
            for name in a.preset:
                print(f"{resolve_preset(name).name}: {ensure_embedded(name)}")
        else:
            d, t = ensure_embedded_pair()
            print(f"draft:  {d}\ntarget: {t}")
    except (FetchError, KeyError) as e:
        print(f"error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 1
    print(f"embedded models ready in {cache_root()} ({time.perf_counter() - t0:.1f}s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
