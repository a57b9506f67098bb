"""Is a run's course fixed by the spell of the memory its plan is priced in? ``auto``'s plan for the app's default
prompt priced at a slow and a fast read bandwidth (given, not probed: ``--spells``), each decoded headless
``--rounds`` times, alternated; each run's steps printed as kind and tokens (``mod``: the draft model's tree, ``rep``:
the text's repeats, ``F``: the fallback), its ms/token and a digest of its tokens.

    .venv/bin/python scripts/spell_course.py [--spells 31 55] [--rounds 2]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spells", type=float, nargs="+", default=[31.0, 55.0])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from dyntree_core.__main__ import encode_prompt
    from dyntree_core.config import DecodeConfig
    from dyntree_core.decode.engine import SpeculativeDecoder
    from dyntree_core.planning.auto import plan_auto
    from dyntree_core.planning.pair_cache import PairCache
    from ui.layout import AppDefaults

    models = PairCache("embedded", "embedded", keep=2)
    pair = models.pair("int4", "int4")
    tok, eos = pair.tokenizer, list(pair.eos_token_ids or ())
    ids = encode_prompt(tok, AppDefaults().prompt, chat=True)
    for rnd in range(args.rounds):
        for gbs in args.spells:
            plan = plan_auto(models, 0.0, measure=False, read_gb_per_s=gbs)
            cfg = plan.apply(DecodeConfig(temperature=0.0), plan.best)
            dec = SpeculativeDecoder(pair.draft, pair.target, cfg, eos_token_id=eos)
            course, toks, secs = [], [], 0.0
            for tr in dec.generate(ids, 64, seed=0):
                course.append(f"{(tr.draft_source or tr.method)[:3]}{len(tr.committed)}" + ("F" if tr.fallback else ""))
                toks.extend(t.token_id for t in tr.committed)
                secs += tr.step_seconds
            fp = plan.fallback_price()
            print(f"round {rnd} priced at {gbs} GB/s: {plan.best.label()} predicted "
                  f"{plan.best.seconds_per_token * 1e3:.1f} ms; fallback tree price "
                  f"{getattr(fp, 'tree_s_per_token', None)}; {len(course)} steps "
                  f"{secs * 1e3 / len(toks):.1f} ms/token; "
                  f"tokens {hashlib.sha256(str(toks).encode()).hexdigest()[:8]}\n   {' '.join(course)}", flush=True)


if __name__ == "__main__":
    main()
