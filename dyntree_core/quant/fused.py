"""Fewer, larger ops around the weight products of a model on ``GGMLLinear`` layers.

``fuse_forward(model)``, in place:

* every ``*RMSNorm`` module (HF: cast, pow, mean, add, rsqrt, mul, cast, mul) runs ``torch.nn.functional.rms_norm``
  (one op; on the CPU it gave bit-identical float32 outputs on the target's width);
* every gated MLP whose ``gate_proj`` and ``up_proj`` are ``GGMLLinear`` of one type and input width, without
  bias, runs them as one ``GGMLLinear`` of both weights' rows (one kernel call over ``2 * intermediate`` rows;
  each output is computed exactly as before, rows do not interact), then ``act(gate) * up``.

The casts and the bias add around each quantized linear are already gone on ``GGMLLinear`` (float32 in and out,
bias in the kernel). The model is then marked for ``decode.lean_forward`` where its architecture allows
(the engine's forwards skip transformers' per-layer code). Returns what was fused.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from .gate_up import FusedGateUp
from .ggml_linear import GGMLLinear


def _rms_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    x = hidden_states if hidden_states.dtype == torch.float32 else hidden_states.float()
    y = F.rms_norm(x, (x.shape[-1],), self.weight if self.weight.dtype == torch.float32 else None,
                   self.variance_epsilon)
    if self.weight.dtype != torch.float32:
        return self.weight * y.to(hidden_states.dtype)
    return y.to(hidden_states.dtype)


#: what decides how a ``GGMLLinear`` runs, named alike on the layer and on the kernel table's ``LayerPlan``
KERNEL_SETTINGS = ("int8_activations", "x8", "mm_min_rows", "vnni_min_rows")


def run_alike(a, b) -> bool:
    """Whether two ``GGMLLinear`` layers (or their ``LayerPlan``s) run on the same kernels: one layer of both rows
    then computes each output as they did."""
    return all(getattr(a, f) == getattr(b, f) for f in KERNEL_SETTINGS)


def _fusable_mlp(mod: nn.Module) -> bool:
    g, u = getattr(mod, "gate_proj", None), getattr(mod, "up_proj", None)
    return (isinstance(g, GGMLLinear) and isinstance(u, GGMLLinear) and g.type_name == u.type_name
            and g.in_features == u.in_features and g.bias is None and u.bias is None and run_alike(g, u)
            and hasattr(mod, "down_proj") and hasattr(mod, "act_fn"))


def fuse_forward(model: nn.Module) -> dict[str, int]:
    """Fuse in place (see the module docstring); ``{"rms_norm": n, "gate_up": n, "lean_forward": 0 or 1}``."""
    from .apply import set_submodule

    done = {"rms_norm": 0, "gate_up": 0}
    for name, mod in list(model.named_modules()):
        if type(mod).__name__.endswith("RMSNorm") and hasattr(mod, "variance_epsilon") and hasattr(mod, "weight"):
            mod.forward = types.MethodType(_rms_forward, mod)
            done["rms_norm"] += 1
        elif _fusable_mlp(mod):
            set_submodule(model, name, FusedGateUp.from_mlp(mod))
            done["gate_up"] += 1
        elif isinstance(mod, FusedGateUp):  # (joined at load: ``gguf_model``'s packed cache)
            done["gate_up"] += 1
    from .lean_mark import enable_lean

    done["lean_forward"] = int(enable_lean(model))
    model._dyntree_fused = done
    return done
