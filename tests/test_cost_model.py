"""The cost model: step costs from traces, the break-even against AR, projections with their
inputs, logical parameter counts of quantised models, and the app's panel on a tiny run."""

from __future__ import annotations

import copy

import pytest
import torch

from dyntree_core.planning.cost_model import (
    ArReference,
    StepCost,
    Verdict,
    ar_reference,
    logical_params,
    project_hardware,
    step_cost,
)
from dyntree_core.planning.projection import LLAMA2_70B_BF16_BYTES
from dyntree_core.quant.apply import quantize_model
from dyntree_core.testing import tiny_pair
from dyntree_core.trace import PhaseTimings, StepTrace, TokenProvenance
from dyntree_core.tree import TokenTree


def _chain(n: int) -> TokenTree:
    return TokenTree(tokens=torch.arange(n), parents=torch.arange(-1, n - 1), child_rank=torch.zeros(n, dtype=torch.long),
                     draft_logprob=torch.zeros(n, dtype=torch.float64), sampled="swor")


def _trace(step: int, n: int, committed: int, draft: float, target: float, verify: float, elapsed: float,
           total: int) -> StepTrace:
    return StepTrace(step=step, method="chain", verifier="greedy", tree=_chain(n), accepted_nodes=[0], bonus_token=0,
                     committed=[TokenProvenance(0, step, 1, -1, "bonus")] * committed,
                     timings=PhaseTimings(draft=draft, target_forward=target, verify=verify),
                     step_seconds=draft + target + verify, elapsed=elapsed, total_new_tokens=total)


def test_step_cost_takes_medians_and_the_break_even_follows():
    traces = [_trace(0, 5, 2, 0.10, 0.50, 0.01, 1.0, 2), _trace(1, 5, 4, 0.12, 0.40, 0.02, 1.6, 6),
              _trace(2, 5, 3, 0.50, 0.45, 0.03, 2.6, 9)]
    c = step_cost(traces)
    assert (c.steps, c.tree_size, c.depth) == (3, 5, 4)
    assert (c.draft_s, c.target_s, c.overhead_s) == pytest.approx((0.12, 0.45, 0.02))
    assert c.tokens_per_step == pytest.approx(3.0)
    assert c.measured_s_per_token == pytest.approx(2.6 / 9)
    v = Verdict(c, ArReference(0.25, "test"))
    assert v.break_even_tokens_per_step == pytest.approx(0.59 / 0.25)  # 2.36 tokens/step
    assert v.wins and v.predicted_speedup == pytest.approx(0.25 / (0.59 / 3))
    slow = Verdict(c, ArReference(0.15, "test"))
    assert not slow.wins and slow.predicted_speedup < 1


def test_the_ar_reference_prefers_a_measured_baseline():
    base = [_trace(i, 1, 1, 0, 0.2 + 0.01 * i, 0, 0, 0) for i in range(5)]
    for t in base:
        t.tree = None
    ref = ar_reference(base, 0.5)
    assert ref.seconds_per_token == pytest.approx(0.22) and "baseline" in ref.source
    assert ar_reference(None, 0.5).seconds_per_token == 0.5
    assert ar_reference([], None) is None
    assert step_cost(base) is None  # an AR run has no tree step


def test_offload_projection_is_the_bytes_over_bandwidth_floor():
    cost = StepCost(steps=10, tree_size=64, depth=8, draft_s=0.1, target_s=1.0, overhead_s=0.01, tokens_per_step=4.0,
                    measured_s_per_token=0.3)
    rows = project_hardware(cost, 0.5e9, 1.5e9)
    assert [r.hardware for r in rows] == ["H100, both models in HBM (bf16)", "70B target offloaded over PCIe 4.0 x16",
                                          "70B target offloaded over PCIe 5.0 x16"]
    pcie4 = rows[1]
    assert pcie4.ar_s_per_token == pytest.approx(LLAMA2_70B_BF16_BYTES / 25e9)
    assert pcie4.speedup == pytest.approx(4.0, rel=0.01)  # streaming dominates: ~ tokens/step
    assert all(r.inputs for r in rows) and all(r.source == "projection" for r in rows)
    h100 = rows[0]
    assert 0 < h100.ar_s_per_token < 0.05 and h100.speedup > 0


def test_logical_params_count_quantised_layers_as_dense():
    draft, _ = tiny_pair(seed=0)
    dense = sum(p.numel() for p in draft.parameters())
    assert logical_params(draft) == dense
    q = quantize_model(copy.deepcopy(draft), "int4")
    assert logical_params(q) == dense


def test_the_panel_on_a_tiny_run_states_the_break_even():
    from test_ui_figures import _settings
    from ui.controller import Controller
    from ui.cost_view import cost_model_html
    from ui.runner import start_generation
    from ui.tiny import TinyModelProvider

    provider = TinyModelProvider()
    gen = start_generation(provider, _settings(max_new_tokens=8))
    Controller.measure_costs(type("C", (), {"provider": provider, "model_lock": __import__("threading").Lock()})(),
                             gen.record)
    while gen.advance() is not None and not gen.done:
        pass
    rec = gen.record
    assert rec.one_token_forward_s and rec.one_token_forward_s > 0 and all(rec.model_params)
    page = cost_model_html(rec, None)
    assert "tokens/step</b> to beat AR here" in page and "one-token forward" in page
    assert "70B target offloaded over PCIe 4.0" in page and "projections, not measurements" in page
    assert "No autoregressive reference" in cost_model_html(
        type(rec)(**{**rec.__dict__, "one_token_forward_s": None}), None)
