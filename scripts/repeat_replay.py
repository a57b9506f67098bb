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

``--in-run`` replays the repeats inside ``auto``'s chain run instead (T = 0, from the first continuation token; the
plan must be a chain): each step is a chain step as the engine's (the draft's teacher-forced argmax and confidence on
the continuation: levels while the argmax is the continuation's token and its confidence reaches the plan's stop, one
more for a wrong token it was confident of; priced at the rows at that shape) or a repeat tree, whose committed tokens
the draft catches up on in its next chain step's first forward (priced: that forward's extra rows). Rules: the chain
alone, the hybrid rule, and the price rule against the chain's priced rate at budgets 4 / 8 / 12, edges 1.0 to 2.0
(``RepeatDrafter.in_run``: ``REPEAT_IN_RUN_BUDGET``, ``REPEAT_EDGE``), a minimum match length (``min_match``), and
against the run's own chain steps so far (priced, with a prior of some tokens at the plan's rate) instead.

    .venv/bin/python scripts/repeat_replay.py [--prompts 10] [--from 12] [--temperature 0 --samples 1] [--in-run]
        [--json OUT]
"""

from __future__ import annotations

import argparse
import dataclasses
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
    ap.add_argument("--in-run", action="store_true", help="replay the repeats inside auto's chain run instead")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from dyntree_core.bench.result_file import write_result
    from dyntree_core.config import DecodeConfig
    from dyntree_core.decode.engine import SpeculativeDecoder
    from dyntree_core.drafting.hybrid import suffix_tree_is_confident
    from dyntree_core.drafting.repeats import REPEAT_BUDGET, REPEAT_SPEC_FACTOR, REPEAT_THRESHOLD, RepeatDrafter
    from dyntree_core.drafting.suffix import accepted_along, suffix_tree
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

    if args.in_run:
        out = in_run(plan, rows, pair, texts, RepeatDrafter, suffix_tree_is_confident, accepted_along)
        if args.json:
            write_result(args.json, "scripts/repeat_replay.py", {"plan": plan.best.label(),
                                                                 "rows": dataclasses.asdict(rows), "rules": out})
        return

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
        write_result(args.json, "scripts/repeat_replay.py", {
            "plan": plan.best.label(), "rows": dataclasses.asdict(rows), "from_token": args.start,
            "temperature": args.temperature, "samples": args.samples, "rules": out})


def in_run(plan, rows, pair, texts, RepeatDrafter, suffix_tree_is_confident, accepted_along) -> dict:
    """``--in-run``: the repeats inside ``auto``'s chain run, rule by rule (cost over plain decoding per prompt)."""
    import torch

    from dyntree_core.config import DecodeConfig
    from dyntree_core.drafting.repeats import REPEAT_EDGE, REPEAT_IN_RUN_BUDGET, REPEAT_SPEC_FACTOR, REPEAT_THRESHOLD
    from dyntree_core.drafting.suffix import suffix_tree
    from dyntree_core.step_price import StepShape

    b = plan.best
    if b.method != "chain":
        raise SystemExit(f"auto chose {b.label()}: --in-run replays a chain run")
    depth, stop = b.depth, b.stop_confidence or 0.0
    plain = rows.step_seconds(StepShape(0, 1.0, 1))
    draft_rows = lambda n: rows.time(rows.draft, n) if rows.draft else 0.0  # noqa: E731
    teacher = []
    for _, ids, cont in texts:  # the draft's argmax and confidence at each continuation token, on the true text
        with torch.inference_mode():
            probs = torch.softmax(pair.draft(torch.tensor([ids + cont])).logits[0].float(), -1)
        conf, top = probs.max(-1)
        teacher.append((top[len(ids) - 1:-1].tolist(), conf[len(ids) - 1:-1].tolist()))

    def replay(ids, cont, top, conf, rule, budget, edge, min_match=1, prior=None) -> tuple[float, int]:
        drafter = RepeatDrafter(DecodeConfig(method="chain"), rows, budget, bar_s_per_token=b.seconds_per_token / edge,
                                min_match=min_match)
        drafter.reset(ids)
        i, cost, repeats, pending = 0, 0.0, 0, 0
        chain_s, chain_tokens = 0.0, 0
        while i < len(cont):
            tree = None
            if prior is not None and chain_tokens + prior > 0:  # the bar: this run's chain steps so far, priced, with
                # ``prior`` tokens at the plan's rate
                drafter.bar_s_per_token = (chain_s + prior * b.seconds_per_token) / (chain_tokens + prior) / edge
            if rule == "priced":
                tree = drafter.candidate(drafter.index.tokens[-1])
            elif rule == "confident":
                t = suffix_tree(drafter.index, budget, budget - 1, REPEAT_THRESHOLD, REPEAT_SPEC_FACTOR)
                tree = t if suffix_tree_is_confident(t) else None
            if tree is not None:
                accepted = min(accepted_along(tree, cont[i:]), len(cont) - i - 1)
                cost += rows.step_seconds(StepShape(0, 1.0, tree.size))
                repeats += 1
                pending += accepted + 1
            else:
                k = 0
                while k < depth and i + k < len(cont) - 1 and top[i + k] == cont[i + k] and conf[i + k] >= stop:
                    k += 1
                wrong = k < depth and i + k < len(cont) and conf[i + k] >= stop and top[i + k] != cont[i + k]
                levels = k + int(wrong)
                accepted = k
                step_s = rows.step_seconds(StepShape(levels, 1.0, levels + 1)) if levels else plain
                cost += step_s
                chain_s, chain_tokens = chain_s + step_s, chain_tokens + accepted + 1
                if levels and pending:  # the draft's first forward catches up on the repeat steps' tokens
                    cost += draft_rows(1 + pending) - draft_rows(1)
                pending = 0 if levels else pending + accepted + 1
            drafter.extend(cont[i:i + accepted + 1])
            i += accepted + 1
        return cost / (plain * len(cont)), repeats

    rules = {"the chain alone": ("chain", REPEAT_IN_RUN_BUDGET, 1.0, 1, None),
             "hybrid's rule, budget 8": ("confident", 8, 1.0, 1, None)}
    for budget in (4, 8, 12):
        for edge in (1.0, 1.2, 1.5, 2.0):
            for m in (1, 2, 3, 4, 6):
                if m > 1 and (budget, edge) != (REPEAT_IN_RUN_BUDGET, REPEAT_EDGE):
                    continue
                shipped = " (shipped)" if (budget, edge, m) == (REPEAT_IN_RUN_BUDGET, REPEAT_EDGE, 1) else ""
                rules[f"priced, budget {budget}, edge {edge}, match >= {m}{shipped}"] = ("priced", budget, edge, m, None)
    for prior in (0, 4, 8, 16):
        for edge in (1.0, 1.2):
            rules[f"priced, budget 8, edge {edge}, the run's chain rate (prior {prior})"] = ("priced", 8, edge, 1, prior)
    out: dict = {}
    for name, (rule, budget, edge, m, prior) in rules.items():
        out[name] = {}
        for ds in ("wiki", "news", "code"):
            got = [replay(ids, cont, top, conf, rule, budget, edge, m, prior)
                   for (d, ids, cont), (top, conf) in zip(texts, teacher) if d == ds]
            ratios = [round(r, 3) for r, _ in got]
            out[name][ds] = dict(median=statistics.median(ratios), mean=round(statistics.fmean(ratios), 3),
                                 worst=max(ratios), ratios=ratios, repeat_steps=sum(n for _, n in got))
        print(f"{name:58} " + "  ".join(f"{ds} {v['median']:.3f} (mean {v['mean']:.3f}, worst {v['worst']:.2f}, "
                                         f"{v['repeat_steps']} repeats)" for ds, v in out[name].items()), flush=True)
    return out


if __name__ == "__main__":
    main()
