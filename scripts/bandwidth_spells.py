"""Whether plain decoding follows the machine's memory bandwidth: in one process, round after round, the embedded
target's one-token forward (int4, after 128 cached tokens; median of 20 before and of 20 after the probes), the
memory read bandwidth on one and on two threads (``memory_bandwidth.read_gb_per_s``), and llama.cpp's
``llama-bench`` generation on the same GGUF (its own process, 32 tokens, 2 repetitions), so that every row of a
round sees the same spell of a VM whose bandwidth jumps.

    .venv/bin/python scripts/bandwidth_spells.py --llamacpp-bin DIR [--seconds 240] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dyntree_core.bench.result_file import write_result  # noqa: E402
from dyntree_core.models.load import resolve_spec  # noqa: E402
from dyntree_core.planning.forward_timer import ForwardTimer  # noqa: E402
from dyntree_core.planning.pair_cache import PairCache  # noqa: E402
from dyntree_core.memory_bandwidth import read_gb_per_s  # noqa: E402

def llama_bench_ms(binary: Path, gguf: Path, threads: int) -> float:
    out = subprocess.run([str(binary), "-m", str(gguf), "-p", "0", "-n", "32", "-r", "2", "-t", str(threads),
                          "-o", "json"], capture_output=True, text=True, check=True).stdout
    return 1e3 / json.loads(out)[0]["avg_ts"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llamacpp-bin", type=Path, required=True)
    ap.add_argument("--seconds", type=float, default=240.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    threads = torch.get_num_threads()
    gguf = Path(resolve_spec("embedded", "target").gguf)  # the file our target is read from
    target = PairCache("embedded", "embedded", device="cpu").pair("int4", "int4").target
    probe = torch.ones(1 << 27)  # 512 MiB
    rounds = []
    t0 = time.time()
    with torch.inference_mode():
        timer = ForwardTimer(target, 128, 1)
        timer.once(1)
        while time.time() - t0 < args.seconds:
            before = 1e3 * statistics.median(timer.once(1) for _ in range(20))
            torch.set_num_threads(1)
            one = read_gb_per_s(samples=3, buffer=probe)
            torch.set_num_threads(threads)
            both = read_gb_per_s(samples=3, buffer=probe)
            llama = llama_bench_ms(args.llamacpp_bin / "llama-bench", gguf, threads)
            after = 1e3 * statistics.median(timer.once(1) for _ in range(20))
            rounds.append(dict(at_s=round(time.time() - t0, 1), ours_t1_ms_before=round(before, 2),
                               read_gb_per_s_1_thread=round(one, 1), read_gb_per_s=round(both, 1),
                               llama_bench_tg_ms=round(llama, 2), ours_t1_ms_after=round(after, 2)))
            r = rounds[-1]
            print(f"{r['at_s']:6.1f} s  ours t(1) {before:5.1f} / {after:5.1f} ms   read {one:5.1f} GB/s (1 thread) "
                  f"{both:5.1f} ({threads})   llama-bench tg {llama:5.1f} ms", flush=True)
    if args.json:
        write_result(args.json, "scripts/bandwidth_spells.py", {"threads": threads, "rounds": rounds})


if __name__ == "__main__":
    main()
