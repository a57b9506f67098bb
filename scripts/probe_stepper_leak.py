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
from contextlib import ExitStack, contextmanager
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]

import torch  # noqa: E402

from dyntree_core import DecodeConfig, SpeculativeDecoder  # noqa: E402
from dyntree_core.decode import graph_step  # noqa: E402
from dyntree_core.decode.compiled import CompileMode  # noqa: E402
from dyntree_core.testing import tiny_pair  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PROMPT = [1, 2, 3, 4, 5]


@contextmanager
def patched(obj, name: str, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextmanager
def variant(name: str):
    with ExitStack() as stack:
        if name == "no-lookahead":
            real = graph_step.GraphStepper.__init__

            def init(self, *a, **k):
                real(self, *a, **k)
                self.lookahead = 0
            stack.enter_context(patched(graph_step.GraphStepper, "__init__", init))
        elif name == "no-static":
            stack.enter_context(patched(torch._dynamo, "mark_static_address", lambda t, guard=False: None))
        elif name == "no-flags":
            class PlainFlags:
                def __init__(self, n, device):
                    self._slots = [None] * n

                def post(self, i, t):
                    self._slots[i] = t.clone()

                def read(self, i):
                    return bool(self._slots[i].reshape(-1)[0])
            stack.enter_context(patched(graph_step.host, "Flags", PlainFlags))
        yield


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
    made: list[tuple[weakref.ref, weakref.ref]] = []
    real = graph_step.GraphStepper.__init__

    def spy(self, *a, **k):
        real(self, *a, **k)
        made.append((weakref.ref(self), weakref.ref(self.tf.kv.kv)))
    mode = CompileMode(capture="emulated") if name == "emulated" else CompileMode.graphs(DEVICE)
    with variant(name), patched(graph_step.GraphStepper, "__init__", spy):
        draft, target = tiny_pair(seed=5)
        cfg = DecodeConfig(method="dyspec_greedy", attention="torch", trace_block_counts=False, device=DEVICE.type,
                           budget=16, depth=4)
        dec = SpeculativeDecoder(draft.to(DEVICE), target.to(DEVICE), cfg)
        dec.graph_steps, dec.compile_mode = True, mode
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
