"""One registry entry per method (``dyntree_core.methods``), and every consumer reads it: the
configuration, the drafters, the verifier matrix, the tuner and the app."""

from __future__ import annotations

from typing import get_args

import pytest

from dyntree_core.config import METHODS, STOCHASTIC_METHODS, TOPK_METHODS, DecodeConfig, compatible_verifiers
from dyntree_core.drafting import DRAFTERS, make_drafter
from dyntree_core.methods import REGISTRY, Tuning, method_spec


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_registry_entry_reaches_config_drafting_verifiers_tuning_and_ui(name):
    from ui.layout import METHOD_HINTS
    from ui.settings import METHOD_CHOICES, METHOD_PARAMS

    spec = REGISTRY[name]
    assert name in METHODS and name in METHOD_CHOICES
    assert METHOD_PARAMS[name] == spec.params and METHOD_HINTS[name] == spec.hint
    assert spec.params <= {"budget", "depth", "width", "threshold"}
    assert spec.tuning in get_args(Tuning)  # tuning.tune dispatches on each kind and refuses others
    if not spec.is_tree:
        assert name not in DRAFTERS and spec.tuning == "none"
        assert compatible_verifiers(name, 0.7) == ["auto"]
        return
    drafter = make_drafter(DecodeConfig(method=name))
    assert type(drafter) is spec.drafter_class() and drafter.name == name
    assert drafter.sampled_kind(False) == spec.siblings and drafter.sampled_kind(True) == "topk"
    lossless = set(compatible_verifiers(name, 0.7))
    if spec.siblings == "topk":
        assert name in TOPK_METHODS and lossless == {"auto", "point_mass"}
    else:
        assert name in STOCHASTIC_METHODS and {"token_level", "traversal", "point_mass"} <= lossless
    assert compatible_verifiers(name, 0.0) == ["auto", "greedy"]


def test_config_lists_exactly_the_registry():
    assert METHODS == tuple(REGISTRY)
    assert set(DRAFTERS) == {m for m, s in REGISTRY.items() if s.is_tree}
    assert STOCHASTIC_METHODS | TOPK_METHODS == set(DRAFTERS)


def test_unknown_method_names_the_known_ones():
    with pytest.raises(KeyError, match="dyspec_greedy"):
        method_spec("nope")


def test_every_drafter_derives_from_the_one_abstract_drafter():
    from dyntree_core.drafting import Drafter

    assert all(issubclass(REGISTRY[m].drafter_class(), Drafter) for m in DRAFTERS)

    class Incomplete(Drafter):
        name = "chain"

    with pytest.raises(TypeError, match="_draft"):
        Incomplete(DecodeConfig())


def test_auto_prices_exactly_the_methods_whose_spec_names_a_pricer():
    """A method's pricer lives in its registry entry: ``auto``'s methods are those entries, and each
    pricer prices its own method only."""
    from dyntree_core.methods import REGISTRY
    from dyntree_core.planning.acceptance import Acceptance
    from dyntree_core.planning.machine_profile import MachineProfile
    from dyntree_core.planning.pricing import PricingInputs
    from dyntree_core.planning.pricing import AUTO_METHODS, price_candidates

    priced = [name for name, spec in REGISTRY.items() if spec.pricer is not None]
    assert list(AUTO_METHODS) == priced == ["autoregressive", "chain", "sequoia", "suffix", "hybrid"]
    ns = (1, 2, 4, 8, 16, 32)
    prof = MachineProfile(key="k", machine={"cpu_model": "x", "cpu_class": "avx2"}, prefix_len=32, ns=ns,
                          target={"int4": [0.04 + 0.002 * n for n in ns]}, draft={"int4": [0.01] * len(ns)},
                          other=[0.001] * len(ns))
    acc = Acceptance((0.8, 0.6, 0.4), (), (((1, 2, 3, 1, 2, 3, 1, 2), (3, 1, 2, 3, 1, 2)),))
    inputs = PricingInputs.build(prof, acc, ["int4"], AUTO_METHODS, (1, 2, 4), (4, 8, 16), (2, 3))
    for name in priced:
        cands = REGISTRY[name].pricer_fn()(inputs, "int4")
        assert cands and {c.method for c in cands} == {name}, name
    assert {c.method for c in price_candidates(prof, acc, ["int4"], ["int4"])} == set(priced)
    with pytest.raises(ValueError, match="cannot price 'dyspec_greedy'"):
        price_candidates(prof, acc, ["int4"], ["int4"], methods=("dyspec_greedy",))


def test_pricing_ends_at_a_stopped_loads_next_method(monkeypatch):
    """A Run's Stop during ``auto``'s plan (0.25-1.2 s of pricing on a 2-core CPU) ends it before the next method
    is priced; outside a load's scope the same call prices every method."""
    import threading

    from dyntree_core.interrupt import LoadStopped, stops_loads_on
    from dyntree_core.planning import method_prices
    from dyntree_core.planning.acceptance import Acceptance
    from dyntree_core.planning.machine_profile import MachineProfile
    from dyntree_core.planning.pricing import price_candidates

    assert REGISTRY["chain"].pricer == "dyntree_core.planning.method_prices:price_chain"
    ns = (1, 2, 4, 8, 16, 32)
    prof = MachineProfile(key="k", machine={"cpu_model": "x", "cpu_class": "avx2"}, prefix_len=32, ns=ns,
                          target={"int4": [0.04 + 0.002 * n for n in ns]}, draft={"int4": [0.01] * len(ns)},
                          other=[0.001] * len(ns))
    acc = Acceptance((0.8, 0.6, 0.4), (), (((1, 2, 3, 1, 2, 3, 1, 2), (3, 1, 2, 3, 1, 2)),))
    stop, priced = threading.Event(), []
    real = method_prices.price_chain

    def chain_then_stop(inputs, tp):
        priced.append(tp)
        stop.set()
        return real(inputs, tp)

    monkeypatch.setattr(method_prices, "price_chain", chain_then_stop)
    methods = ("chain", "sequoia", "suffix")
    with stops_loads_on(stop), pytest.raises(LoadStopped):
        price_candidates(prof, acc, ["int4"], ["int4"], methods=methods)
    assert priced == ["int4"]
    assert {c.method for c in price_candidates(prof, acc, ["int4"], ["int4"], methods=methods)} == set(methods)
