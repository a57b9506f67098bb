"""A spell of the memory's bandwidth without a profile of its own is priced from the nearest spell's rows raised
to the time their weights take to read now (``planning.spell_pricing``): on the Zen 4 VM a profile measured at
56.5 GB/s priced the 34.6 GB/s spell's plain decoding 17% under and the draft's one-row levels 33% under."""

from __future__ import annotations

import copy

import pytest

from dyntree_core.planning.machine_profile import MachineProfile
from dyntree_core.planning.prediction import check_prediction, prediction_for
from dyntree_core.planning.pricing import autoregressive_candidate
from dyntree_core.planning.spell_pricing import FORWARD_READ_SHARE, floor_priced, floor_text, weight_floor_s
from dyntree_core.trace import PhaseTimings, StepTrace, TokenProvenance

NS = [1, 2, 4, 8, 16, 32]
#: weight bytes of a one-token forward of the embedded pair's int4 models (``PairCache.forward_bytes``)
BYTES = {("target", "int4"): 979_517_952, ("draft", "int4"): 340_523_008}
#: the Zen 4 VM's two stored profiles of one key (same code, same day), ms: int4 rows measured at 56.5 and 34.59 GB/s
FAST = {"target": [27.1, 26.7, 37.0, 51.8, 97.1, 192.9], "draft": [9.2, 10.6, 15.3, 25.4, 49.5, 88.0]}
SLOW = {"target": [32.5, 34.0, 37.1, 48.6, 93.0, 187.0], "draft": [13.8, 15.1, 13.9, 21.4, 45.2, 80.6]}


def _profile(rows: dict, read: float) -> MachineProfile:
    return MachineProfile(key="k", machine={"cpu_model": "AMD EPYC", "cpu_class": "avx512_bf16"}, prefix_len=128,
                          ns=list(NS), target={"int4": [t / 1e3 for t in rows["target"]]},
                          draft={"int4": [t / 1e3 for t in rows["draft"]]}, other=[0.002] * len(NS),
                          meta={"read_gb_per_s": read})


def _bytes(role: str, prec: str):
    return BYTES.get((role, prec))


def test_the_slower_spell_is_priced_at_its_weight_read_floor():
    fast = _profile(FAST, 56.5)
    before = copy.deepcopy(fast)
    priced = floor_priced(fast, 34.59, _bytes)
    assert fast == before and priced is not fast  # (a copy: the stored profile's rows stand for their spell)
    floor = {role: weight_floor_s(BYTES[(role, "int4")], 34.59) for role in ("target", "draft")}
    for role in ("target", "draft"):
        for n, was, now in zip(NS, getattr(fast, role)["int4"], getattr(priced, role)["int4"]):
            assert now == max(was, floor[role]), (role, n)
    assert priced.meta["floor_priced"] == {"read_gb_per_s": 34.59, "share": FORWARD_READ_SHARE,
                                           "raised": {"target:int4": [1, 2], "draft:int4": [1, 2]}}
    assert priced.read_gb_per_s == 56.5  # (the spell its rows were measured in)
    assert floor_text(priced) == ("forwards priced at no less than reading their weights at 90% of 35 GB/s "
                                  "(target int4 at 1/2 rows, draft int4 at 1/2 rows)")


def test_the_floor_brings_the_fast_spells_rows_near_the_slow_spells_own():
    """Measured data: the 56.5 GB/s profile priced for 34.59 GB/s against the profile measured at 34.59."""
    priced = floor_priced(_profile(FAST, 56.5), 34.59, _bytes)
    slow = _profile(SLOW, 34.59)
    for role, n, raw_off in (("target", 1, 0.83), ("target", 2, 0.79), ("draft", 1, 0.67)):
        i = NS.index(n)
        raw = getattr(_profile(FAST, 56.5), role)["int4"][i] / getattr(slow, role)["int4"][i]
        assert raw == pytest.approx(raw_off, abs=0.01)
        assert 0.78 <= getattr(priced, role)["int4"][i] / getattr(slow, role)["int4"][i] <= 1.0, (role, n)
    for role in ("target", "draft"):  # rows of many tokens are arithmetic: kept (within 20% of the slow spell's)
        for n in (4, 8, 16, 32):
            i = NS.index(n)
            assert getattr(priced, role)["int4"][i] == getattr(_profile(FAST, 56.5), role)["int4"][i]
            assert getattr(priced, role)["int4"][i] / getattr(slow, role)["int4"][i] == pytest.approx(1.0, abs=0.2)


@pytest.mark.parametrize("now", [56.5, 60.0, None])
def test_the_same_or_a_faster_spell_is_priced_as_measured(now):
    fast = _profile(FAST, 56.5)
    assert floor_priced(fast, now, _bytes) is fast
    slow = _profile(SLOW, 34.59)
    assert floor_priced(slow, 56.5, _bytes) is slow  # (what its compute needs is not known from a memory-bound time)
    assert floor_priced(_profile(FAST, None), 34.59, _bytes).meta.get("floor_priced") is None  # (rows not probed)


def test_rows_without_known_bytes_are_kept_and_nothing_raised_says_nothing():
    fast = _profile(FAST, 56.5)
    priced = floor_priced(fast, 34.59, lambda role, prec: None)
    assert priced.target == fast.target and priced.draft == fast.draft and floor_text(priced) == ""


def test_plain_decodings_price_and_the_checks_line_follow_the_floor():
    fast = _profile(FAST, 56.5)
    priced = floor_priced(fast, 34.59, _bytes)
    plain = autoregressive_candidate(priced, "int4")
    assert plain.seconds_per_token > autoregressive_candidate(fast, "int4").seconds_per_token
    p = prediction_for(plain, plain, priced)
    assert p.floor_gb_per_s == 34.59 and p.read_gb_per_s == 56.5
    assert prediction_for(plain, plain, fast).floor_gb_per_s is None
    # the line every view prints says it (a Compare in this spell differs from a Run in the profile's for this)
    assert p.text().endswith("measured on this machine, priced for the memory's slower spell now (35 GB/s)"), p.text()
    assert "spell" not in prediction_for(plain, plain, fast).text()
    steps = [StepTrace(step=i, method="autoregressive", verifier="none", tree=None, accepted_nodes=[0], bonus_token=0,
                       committed=[TokenProvenance(0, i, 1, -1, "autoregressive")],
                       timings=PhaseTimings(target_forward=0.0325), step_seconds=0.0325) for i in range(10)]
    check = check_prediction(p, steps, read_gb_per_s=(34.0, 35.1))
    assert check.other_spell.endswith("(another spell of this machine's memory bandwidth; its forwards priced at no "
                                      "less than reading their weights at 35 GB/s)")
    assert check.rows_to_remeasure() == ()  # (still another spell's rows: nothing is re-measured)


def test_auto_prices_a_spell_without_a_profile_at_the_floor_and_says_so(tmp_path, monkeypatch):
    """Through ``auto.profile_for`` as the app asks (from the cache only, a probe of another spell): the nearest
    spell's profile comes back floor-priced, and ``auto``'s reason names the floor."""
    import dataclasses

    from dyntree_core.planning.auto import choose, profile_for
    from dyntree_core.planning.machine_profile import pair_name_of, profile_key, profile_path

    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path))
    cache = dataclasses.make_dataclass("Cache", ["draft_spec", "target_spec", "device"])("d", "t", "cpu")
    cache.forward_bytes = _bytes
    cache.timing_model = lambda role, prec: pytest.fail("nothing is measured")
    key = profile_key(pair_name_of("d", "t"), "cpu")
    stored = _profile(FAST, 56.5)
    stored.key = key
    stored.meta["row_gb_per_s"] = {"target:int4": [56.0, 57.0]}
    stored.save(profile_path(key))
    for gb_per_s in (56.0, 60.0):  # its own spell, a faster one: priced as measured
        prof = profile_for(cache, ["int4"], ["int4"], measure=False, read_gb_per_s=gb_per_s)
        assert prof.target == stored.target and "floor_priced" not in prof.meta
    slow = profile_for(cache, ["int4"], ["int4"], measure=False, read_gb_per_s=34.59)
    assert slow.other_spell == 34.59 and slow.target["int4"][0] == weight_floor_s(BYTES[("target", "int4")], 34.59)
    plan = choose(slow, (0.8, 0.6, 0.4), 0.0, ["int4"], ["int4"])
    assert ("56 GB/s when profiled, 35 GB/s now: another spell of this machine's memory bandwidth, not profiled yet; "
            "forwards priced at no less than reading their weights at 90% of 35 GB/s") in plan.reason
    assert plan.prediction("auto", "int4", "int4").floor_gb_per_s == 34.59


def test_a_pairs_weight_bytes_are_read_once_per_role_and_precision(monkeypatch):
    """``floor_priced`` asks for every precision's bytes each time a spell without a profile is planned; reading the
    embedded pair's GGUF headers for them took 0.4-0.8 s, so ``PairCache`` keeps what it read."""
    from dyntree_core.planning.pair_cache import PairCache

    reads = []
    monkeypatch.setattr(PairCache, "_read_forward_bytes", lambda self, role, prec: reads.append((role, prec)) or 7)
    cache = PairCache("d", "t")
    for _ in range(3):
        assert [cache.forward_bytes(r, p) for r in ("target", "draft") for p in ("int4", "int8")] == [7] * 4
    assert reads == [("target", "int4"), ("target", "int8"), ("draft", "int4"), ("draft", "int8")]
