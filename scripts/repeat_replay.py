"""How much the text's own repeats save after a fallback (``drafting.repeats``), replayed without timing anything:
the target's greedy continuation of each eval prompt (wiki, news, code; 128 prompt tokens, no chat template, as
``bench speed``), then from token ``--from`` on (a fallback comes after 3-8 tree steps) each step either verifies a
repeat tree of the text so far or is plain, priced as the engine prices it: at the rows of the fallback rule
``auto`` sets on this machine (``AutoPlan.fallback_price``: its profile's target forward and the rest of the step).
A tree's accepted length is what greedy verification accepts on the known continuation (``suffix.accepted_along``).
``--temperature T`` samples the continuations at T instead (``--samples`` per prompt): the length ``accepted_along``
finds on a target sample is distributed as point-mass verification's accepted length, so the replay prices T > 0.

Rules replayed, each as cost over plain decoding's for the same tokens (per prompt; medians, means and the worst
prompt per set):
* ``priced, budget B, cap F``: ``RepeatDrafter``'s rule (the best-priced prefix of a best-first suffix tree of at
  most B nodes, at most ceil(F x match length) tokens; B = ``REPEAT_BUDGET``, F = ``REPEAT_SPEC_FACTOR`` is what
  the engine runs), and other B and F;
* ``confident, budget B``: the hybrid method's rule instead of the price (``hybrid.suffix_tree_is_confident``: a
  tree that expects >= 2 tokens, whatever it costs).

    .venv/bin/python scripts/repeat_replay.py [--prompts 10] [--from 12] [--temperature 0 --samples 1] [--json OUT]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--from", dest="start", type=int, default=12, help="the first continuation token replayed")
    ap.add_argument("--temperature", type=float, default=0.0, help="the continuations' temperature (0: greedy)")
    ap.add_argument("--samples", type=int, default=1, help="continuations per prompt (seeded; T > 0)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from dyntree_core.config import DecodeConfig
    from dyntree_core.decode.engine import SpeculativeDecoder
    from dyntree_core.drafting.hybrid import suffix_tree_is_confident
    from dyntree_core.drafting.repeats import REPEAT_BUDGET, REPEAT_SPEC_FACTOR, REPEAT_THRESHOLD, RepeatDrafter
    from dyntree_core.drafting.suffix import accepted_along, suffix_tree
    from dyntree_core.machine import machine_info
    from dyntree_core.planning.auto import plan_auto
    from dyntree_core.planning.pair_cache import PairCache
    from dyntree_core.prompts import load_prompts
    from dyntree_core.step_price import StepShape

    models = PairCache("embedded", "embedded", keep=2)
    plan = plan_auto(models, 0.0)
    rule = plan.fallback_price()
    if rule is None:
        ap.error(f"auto chose {plan.best.label()}: no fallback rule to replay")
    rows = rule.rows
    price = lambda n: rows.step_seconds(StepShape(0, 1.0, n))  # noqa: E731

    pair = models.pair(plan.best.target_precision, plan.best.draft_precision or plan.fastest_draft_precision)
    tok = pair.tokenizer
    dec = SpeculativeDecoder(pair.draft, pair.target, DecodeConfig(method="autoregressive", temperature=args.temperature),
                             eos_token_id=list(pair.eos_token_ids) or None)
    texts = []
    for ds in ("wiki", "news", "code"):
        for i, p in enumerate(load_prompts(ds, args.prompts)):
            ids = list(tok(p.text, add_special_tokens=False)["input_ids"])[:128]
            for k in range(args.samples if args.temperature > 0 else 1):
                cont = [c.token_id for tr in dec.generate(ids, 64, seed=100 * i + k) for c in tr.committed]
                texts.append((ds, ids, cont))
            print(f"{ds}: {len(cont)} tokens", flush=True)

    def replay(ids, cont, pick, budget: int, cap) -> tuple[float, int]:
        """Cost over plain decoding's from token ``args.start`` on, and the steps that verified a tree."""
        drafter = RepeatDrafter(DecodeConfig(method="chain"), rows, budget, cap)
        drafter.reset(ids + cont[:args.start])
        i, cost, trees = args.start, 0.0, 0
        while i < len(cont):
            tree = pick(drafter)
            accepted = 0 if tree is None else min(accepted_along(tree, cont[i:]), len(cont) - i - 1)
            cost += price(1 if tree is None else tree.size)
            trees += tree is not None
            drafter.extend(cont[i:i + accepted + 1])
            i += accepted + 1
        return cost / (price(1) * max(1, len(cont) - args.start)), trees

    def priced(d):
        return d.candidate(d.index.tokens[-1])

    def confident(d):
        tree = suffix_tree(d.index, d.budget, d.budget - 1, REPEAT_THRESHOLD, d.spec_factor)
        return tree if suffix_tree_is_confident(tree) else None

    rules = {f"priced, budget {b}, cap {f}": (priced, b, f)
             for b, f in ((REPEAT_BUDGET, REPEAT_SPEC_FACTOR), (REPEAT_BUDGET, None), (REPEAT_BUDGET, 0.5),
                          (REPEAT_BUDGET, 2.0), (8, REPEAT_SPEC_FACTOR), (8, None), (16, None))}
    rules[f"confident, budget {REPEAT_BUDGET}"] = (confident, REPEAT_BUDGET, None)
    out: dict = {}
    for name, (pick, budget, cap) in rules.items():
        out[name] = {}
        for ds in ("wiki", "news", "code"):
            got = [replay(ids, cont, pick, budget, cap) for d, ids, cont in texts if d == ds]
            ratios = [round(r, 3) for r, _ in got]
            out[name][ds] = dict(median=statistics.median(ratios), mean=round(statistics.fmean(ratios), 3),
                                 worst=max(ratios), ratios=ratios, tree_steps=sum(n for _, n in got))
        print(f"{name:28} " + "  ".join(f"{ds} {v['median']:.3f} (mean {v['mean']:.3f}, worst {v['worst']:.2f})"
                                         for ds, v in out[name].items()), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv[1:], "machine_info": machine_info().to_dict(),
                                         "plan": plan.best.label(), "rows": dataclasses.asdict(rows),
                                         "from_token": args.start,
                                         "temperature": args.temperature, "samples": args.samples, "rules": out}, indent=1))


if __name__ == "__main__":
    main()
