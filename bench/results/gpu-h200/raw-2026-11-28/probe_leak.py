"""GPU probe: what keeps a concurrent run's graph stepper alive after its generator closes."""
import gc, sys, types, weakref
sys.path.insert(0, "tests")
import torch
from conftest import DEVICE
from dyntree_core.decode import graph_step
from dyntree_core.testing import tiny_pair
from test_graph_step import graph_decoder, PROMPT

made = []
real_init = graph_step.GraphStepper.__init__
def spy(self, *a, **k):
    real_init(self, *a, **k)
    made.append((weakref.ref(self), weakref.ref(self.tf.kv.kv)))
graph_step.GraphStepper.__init__ = spy
draft, target = tiny_pair(seed=5)
dec = graph_decoder((draft.to(DEVICE), target.to(DEVICE)), "dyspec_greedy")
dec.generate_ids(PROMPT, 8)
first, second = dec.generate(PROMPT, 8), dec.generate(PROMPT, 8)
next(first), next(second)
second.close(); first.close(); gc.collect()
print("stepper alive:", made[1][0]() is not None, "kv alive:", made[1][1]() is not None)

def describe(o):
    if isinstance(o, dict):
        return f"dict keys={list(o.keys())[:8]}"
    if isinstance(o, (list, tuple)):
        return f"{type(o).__name__} len={len(o)}"
    if isinstance(o, types.FrameType):
        return f"frame {o.f_code.co_filename}:{o.f_lineno} {o.f_code.co_name}"
    if isinstance(o, types.CellType):
        return "cell"
    if isinstance(o, types.FunctionType):
        return f"function {o.__qualname__} {o.__code__.co_filename}"
    return f"{type(o).__module__}.{type(o).__qualname__}"

def chain(obj, depth=0, seen=None, maxdepth=7):
    seen = seen if seen is not None else set()
    if depth > maxdepth:
        return
    for r in gc.get_referrers(obj):
        if id(r) in seen or r is sys._getframe() or isinstance(r, types.FrameType) and r.f_code.co_name == "chain":
            continue
        if r is made or any(r is m for m in made):
            continue
        seen.add(id(r))
        print("  " * depth + describe(r))
        if depth < maxdepth and not isinstance(r, types.ModuleType):
            chain(r, depth + 1, seen, maxdepth)

for label, ref in (("stepper", made[1][0]), ("kv", made[1][1])):
    o = ref()
    if o is not None:
        print("referrers of", label)
        chain(o, maxdepth=5 if label == "stepper" else 3)
