"""What keeps a concurrent run's graph stepper alive after its generator closes (issue 39's one failing CUDA
test, ``test_the_pair_keeps_its_steppers_between_runs_and_close_frees_them``): on the H200 (torch 2.11) the
stepper and its KV buffer outlived ``close`` + ``gc.collect()`` with no referrer ``gc`` could see; on the CPU
they go. This runs the test's two concurrent runs under each variant below, one at a time, and prints
whether the second run's stepper and KV buffer survive, so one short device call names the part to blame:

    python scripts/probe_stepper_leak.py            # on the GPU machine (~30 s); on the CPU it checks itself

variants: ``as-is``; ``emulated`` (graphs emulated, no CUDA graph captured); ``no-lookahead``
(``GraphStepper.lookahead = 0``); ``no-static`` (no ``torch._dynamo.mark_static_address``); ``no-flags``
(the pinned flag reads replaced by plain reads). A survivor's Python referrers (outside this script) and any
thread whose stack holds it are listed too.
"""

from __future__ import annotations

import gc
import sys
import threading
import types
import weakref
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import DEVICE  # noqa: E402
from test_graph_step import PROMPT, graph_decoder, steppers_made  # noqa: E402

from dyntree_core.decode import graph_step  # noqa: E402
from dyntree_core.decode.compiled import CompileMode  # noqa: E402
from dyntree_core.testing import tiny_pair  # noqa: E402


class PlainFlags:
    """``host.Flags`` without page-locked memory or events: each post keeps a device copy, each read reads it."""

    def __init__(self, n: int, device):
        self._slots = [None] * n

    def post(self, i: int, t: torch.Tensor) -> None:
        self._slots[i] = t.clone()

    def read(self, i: int) -> bool:
        return bool(self._slots[i].reshape(-1)[0])


def apply_variant(mp: pytest.MonkeyPatch, name: str) -> None:
    if name == "no-lookahead":
        real = graph_step.GraphStepper.__init__

        def init(self, *a, **k):
            real(self, *a, **k)
            self.lookahead = 0
        mp.setattr(graph_step.GraphStepper, "__init__", init)
    elif name == "no-static":
        mp.setattr(torch._dynamo, "mark_static_address", lambda t, guard=False: None)
    elif name == "no-flags":
        mp.setattr(graph_step.host, "Flags", PlainFlags)


def referrers(obj, skip: set[int]) -> list[str]:
    out = []
    for r in gc.get_referrers(obj):
        if id(r) in skip or isinstance(r, types.FrameType) and r.f_code.co_filename == __file__:
            continue
        kind = type(r).__qualname__
        if isinstance(r, dict):
            kind += f" keys={list(r)[:6]}"
        out.append(kind)
    for tid, frame in sys._current_frames().items():
        if tid == threading.get_ident():
            continue
        f = frame
        while f is not None:
            if any(v is obj for v in f.f_locals.values()):
                out.append(f"thread {tid} frame {f.f_code.co_name} ({f.f_code.co_filename}:{f.f_lineno})")
            f = f.f_back
    return out


def trial(name: str) -> str:
    mode = CompileMode(capture="emulated") if name == "emulated" else CompileMode.graphs(DEVICE)
    with pytest.MonkeyPatch.context() as mp:
        apply_variant(mp, name)  # (before the spy: it wraps the variant's __init__)
        made = steppers_made(mp, lambda s: (weakref.ref(s), weakref.ref(s.tf.kv.kv)))
        draft, target = tiny_pair(seed=5)
        dec = graph_decoder((draft.to(DEVICE), target.to(DEVICE)), "dyspec_greedy", mode)
        dec.generate_ids(PROMPT, 8)
        first, second = dec.generate(PROMPT, 8), dec.generate(PROMPT, 8)
        next(first), next(second)
        second.close()
        first.close()
        del first, second
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        gc.collect()
    if len(made) < 2:
        return f"{name:13s} only {len(made)} stepper made"
    stepper, kv = made[1][0](), made[1][1]()
    line = f"{name:13s} stepper alive: {stepper is not None}  kv alive: {kv is not None}"
    skip = {id(made), id(sys._getframe().f_locals)}
    if stepper is not None:
        line += "\n    stepper referrers: " + "; ".join(referrers(stepper, skip) or ["none gc sees"])
    if kv is not None:
        line += "\n    kv referrers: " + "; ".join(referrers(kv, skip) or ["none gc sees"])
    del stepper, kv
    dec.pair.close()
    return line


def main() -> int:
    print(f"torch {torch.__version__} on {DEVICE}" + (f" ({torch.cuda.get_device_name()})" if DEVICE.type == "cuda"
                                                     else ""))
    for name in ("as-is", "emulated", "no-lookahead", "no-static", "no-flags"):
        try:
            print(trial(name), flush=True)
        except Exception as e:  # noqa: BLE001 - a variant that cannot run says why; the others still run
            print(f"{name:13s} failed: {type(e).__name__}: {e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
