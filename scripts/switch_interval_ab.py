"""What Python work beside a decoding thread costs it, at several interpreter switch intervals
(``ui.switch_interval``): the app's default prompt (chat template), 64 tokens at T = 0, decoded by auto's plan and
by plain decoding at its target precision, in a worker thread that takes a lock per step as the app's worker does,
while another thread runs pure Python for BUSY seconds of every PERIOD. Rows, interleaved per repeat: the decode
alone, beside the busy thread at each interval, and beside a busy *process* (the same work without the shared
interpreter lock: what the CPUs alone cost). Prints the medians; ``--json`` writes them with the machine's facts.

    .venv/bin/python scripts/switch_interval_ab.py [--intervals 0.005 0.0005] [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def busy(seconds: float) -> None:
    """Run pure Python for ``seconds`` of this thread's CPU time."""
    end = time.thread_time() + seconds
    x = 0
    while time.thread_time() < end:
        for i in range(2000):
            x += i * i


def busy_loop(stop, seconds: float, period: float) -> None:
    while not stop.is_set():
        t0 = time.monotonic()
        busy(seconds)
        stop.wait(max(0.0, period - (time.monotonic() - t0)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--intervals", type=float, nargs="+", default=[0.005, 0.0005])
    ap.add_argument("--busy", type=float, default=0.1, help="seconds of Python per period")
    ap.add_argument("--period", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from dyntree_core.__main__ import encode_prompt
    from dyntree_core.bench.result_file import write_result
    from dyntree_core.config import DecodeConfig
    from dyntree_core.decode.engine import SpeculativeDecoder
    from dyntree_core.openmp_team import release_thread_team
    from dyntree_core.planning.auto import plan_auto
    from dyntree_core.planning.pair_cache import PairCache
    from ui.layout import AppDefaults

    models = PairCache("embedded", "embedded", keep=2)
    plan = plan_auto(models, 0.0)
    cand = plan.best
    pair = models.pair(cand.target_precision, cand.draft_precision)
    eos = list(pair.eos_token_ids or ())
    configs = {"plain": DecodeConfig(method="autoregressive", precision=cand.target_precision),
               "auto": plan.apply(DecodeConfig(temperature=0.0))}
    ids = encode_prompt(pair.tokenizer, AppDefaults().prompt, chat=True)
    lock = threading.Lock()

    def decode(cfg, out: list) -> None:
        steps = SpeculativeDecoder(pair.draft, pair.target, cfg, eos_token_id=eos).generate(ids, 64)
        t0 = time.perf_counter()
        while True:
            with lock:
                if next(steps, None) is None:
                    break
            release_thread_team()
        out.append(time.perf_counter() - t0)

    def one(cfg, beside: str, interval: float) -> float:
        out: list = []
        worker = threading.Thread(target=decode, args=(cfg, out))
        stop = mp.Event() if beside == "process" else threading.Event()
        other = (mp.Process(target=busy_loop, args=(stop, args.busy, args.period)) if beside == "process"
                 else threading.Thread(target=busy_loop, args=(stop, args.busy, args.period)) if beside == "thread"
                 else None)
        before = sys.getswitchinterval()
        sys.setswitchinterval(interval)
        try:
            worker.start()
            if other is not None:
                other.start()
            worker.join()
        finally:
            stop.set()
            if other is not None:
                other.join()
            sys.setswitchinterval(before)
        return out[0]

    rows = [("alone", 0.005), *(("thread", i) for i in args.intervals), ("process", 0.005)]
    seconds: dict[str, list[float]] = {}
    for rep in range(args.repeats):
        for label, cfg in configs.items():
            for beside, interval in rows:
                key = f"{label}, {beside}" + (f", switch interval {interval * 1e3:g} ms" if beside == "thread" else "")
                seconds.setdefault(key, []).append(one(cfg, beside, interval))
                print(rep, key, round(seconds[key][-1], 3), flush=True)
    medians = {k: round(statistics.median(v), 3) for k, v in seconds.items()}
    for k, v in medians.items():
        print(f"{k:55} median {v:.3f} s")
    if args.json:
        write_result(args.json, "scripts/switch_interval_ab.py", {
            "plan": cand.label(), "busy_s": args.busy,
            "period_s": args.period, "new_tokens": 64, "seconds": seconds, "medians": medians})


if __name__ == "__main__":
    main()
