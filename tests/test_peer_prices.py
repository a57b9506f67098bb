"""Peers measured beside our plain decoding in Compare are kept per machine and pair and priced at the profile
(``planning.peer_prices``); ``auto``'s note says where they stand."""

from __future__ import annotations

import pytest

from dyntree_core.planning.machine_profile import MachineProfile
from dyntree_core.planning.peer_prices import (PeerRatio, load_peer_ratios, peer_sentence, price_peers,
                                               record_peer_ratio)
from dyntree_core.planning.pricing import autoregressive_candidate

NS = [1, 2, 4, 8]
LABEL = "transformers assisted @ target int4, draft int4"


def _profile() -> MachineProfile:
    return MachineProfile(key="k", machine={"cpu_model": "test cpu", "cpu_class": "avx2"}, prefix_len=32, ns=list(NS),
                          target={"int4": [0.050] * 4, "int8": [0.080] * 4}, draft={"int4": [0.02] * 4},
                          other=[0.001] * 4, created="2026-11-27 03:00:00")


@pytest.fixture()
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path))
    return tmp_path


def test_a_peer_is_kept_per_pair_as_its_ratio_to_our_plain_decoding(store):
    assert record_peer_ratio("d+t", "cpu", LABEL, "int4", 0.080, 0.050, 64).ratio == pytest.approx(1.6)
    record_peer_ratio("d+t", "cpu", "transformers assisted @ target int8, draft int8", "int8", 0.09, 0.1, 64)
    record_peer_ratio("d+t", "cpu", LABEL, "int4", 0.060, 0.050, 32)  # the latest measurement of a label wins
    got = {r.label: r for r in load_peer_ratios("d+t", "cpu")}
    assert set(got) == {LABEL, "transformers assisted @ target int8, draft int8"}
    assert got[LABEL].ratio == pytest.approx(1.2) and got[LABEL].tokens == 32
    assert load_peer_ratios("other+pair", "cpu") == []
    assert record_peer_ratio("d+t", "cpu", LABEL, "int4", 0.06, 0.05, 0) is None  # nothing generated: not kept


def test_a_peer_is_priced_at_the_profiles_plain_decoding_at_its_precision():
    prof = _profile()
    rows = [PeerRatio(LABEL, "int4", 1.5, 64, "2026-11-27 10:00"), PeerRatio("x @ int8", "int8", 0.5, 64, "2026-11-27"),
            PeerRatio("y @ bfloat16", "bfloat16", 0.1, 64, "2026-11-27")]  # (no bfloat16 row: not priced)
    prices = price_peers(rows, prof)
    assert [p.ratio.label for p in prices] == ["x @ int8", LABEL]  # fastest first
    assert prices[1].s_per_token == pytest.approx(1.5 * autoregressive_candidate(prof, "int4").seconds_per_token)
    assert prices[0].s_per_token == pytest.approx(0.5 * autoregressive_candidate(prof, "int8").seconds_per_token)


def test_the_note_says_when_a_peer_is_priced_faster_than_autos_choice():
    prof = _profile()
    slow = price_peers([PeerRatio(LABEL, "int4", 1.6, 64, "2026-11-27 10:00")], prof)
    plain = autoregressive_candidate(prof, "int4")  # the run's prediction
    note = peer_sentence(slow, plain.seconds_per_token)
    assert note.startswith(f"peers: {LABEL} priced 82 ms/token (1.60x our plain decoding at int4 beside it in "
                           "Compare, 2026-11-27)") and note.endswith("slower than this run (predicted 51 ms/token)")
    fast = price_peers([PeerRatio(LABEL, "int4", 0.8, 64, "2026-11-27 10:00")], prof)
    note = peer_sentence(fast, plain.seconds_per_token)
    assert note.endswith(f"{LABEL} is priced faster than this run (predicted 51 ms/token): run it in the Compare tab")
    assert peer_sentence([], plain.seconds_per_token) == ""
