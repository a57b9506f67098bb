"""A target streamed from host memory with the draft on its fixed-shape programs (``SpeculativeDecoder
.draft_graph_reason``: a ``GraphStepper`` without a target). The offloaded step's target forward is seconds
long; its draft, forwarded eagerly level by level through transformers, added ~20% to it on the H200
(decode_step b64: 0.62 s of draft over a 2.45 s target forward). Here the draft is a few graph replays, one
read of the tree, and one commit program. On the CPU the layer streamer runs with the host as its device
(``allow_cpu_offload``): every property but the time is checked; on a GPU the same tests run with page-locked
layers and captured CUDA graphs (the χ² test stays on the CPU: it borrows ``test_sampling_e2e``'s pair)."""

import pytest
from conftest import DEVICE

from dyntree_core import DecodeConfig, SpeculativeDecoder
from dyntree_core.decode.graph_step import Envelope
from dyntree_core.decode.op_count import OpCounter
from dyntree_core.decode.prepared import PreparedPair
from dyntree_core.testing import tiny_pair

from stat_utils import ALPHA, chi_square_pvalue, sample_first_two, samples_for
from test_graph_step import assert_same_steps
from test_sampling_e2e import PROMPT as FLAT_PROMPT, exact, pair  # noqa: F401  (the flat pair and its exact joints)

PROMPT = [5, 9, 2, 7, 1]
METHODS = ("chain", "dyspec_greedy", "sequoia", "specinfer")


def offloaded(method, models=None, **kw):
    """A decoder on an offloaded stand-in pair, graph steps asked for (the CUDA default)."""
    draft, target = models if models is not None else tiny_pair(seed=3, layers=3)
    cfg = DecodeConfig(method=method, offload_target=True, attention="torch", trace_block_counts=False,
                       device=DEVICE.type, **({"budget": 12, "depth": 4, "width": 3} | kw))
    pair = PreparedPair.prepare(draft, target, cfg, allow_cpu_offload=DEVICE.type == "cpu")
    dec = SpeculativeDecoder.on_pair(pair, cfg)
    dec.graph_steps = True
    return dec, pair


@pytest.mark.parametrize("method", METHODS)
def test_the_draft_programs_give_the_host_drafters_trees_and_plain_decodings_tokens(method):
    plain = SpeculativeDecoder(*(m.to(DEVICE) for m in tiny_pair(seed=3, layers=3)),
                               DecodeConfig(method="autoregressive", device=DEVICE.type)).generate_ids(PROMPT, 30)
    dec, pair = offloaded(method)
    try:
        assert "streams from host memory" in dec.graph_reason() and dec.draft_graph_reason() is None
        graph = list(dec.generate(PROMPT, 30))
        host_dec = SpeculativeDecoder.on_pair(pair, dec.config)
        host_dec.graph_steps = False  # (the CUDA default is on)
        host_dec.cap_levels = False  # (the draft programs forward the envelope's depth to the last step)
        assert host_dec.draft_graph_reason() is not None  # the host drafter
        host = list(host_dec.generate(PROMPT, 30))
    finally:
        pair.close()
    assert [c.token_id for t in graph for c in t.committed] == plain
    assert sum(len(t.accepted_nodes) for t in graph) > len(graph)  # trees were accepted
    assert_same_steps(host, graph)
    assert all(b.draft_forwards <= Envelope.of(dec.config).depth for b in graph)


@pytest.mark.parametrize("method", ("dyspec_greedy", "sequoia"))
def test_the_draft_phase_is_its_graphs_and_one_read(method):
    """Per step, the draft phase launches one graph per level forwarded and the tree's program, reads the
    device once (the tree), and runs no eager op but DySpec's flag copies; the draft's commit is one graph."""
    dec, pair = offloaded(method)
    try:
        with OpCounter() as counter:
            for tr in dec.generate(PROMPT, 20):
                counts = counter.take_step()
                if tr.step == 0:
                    continue
                draft = counts["draft"]
                assert draft.graphs == tr.draft_forwards + 1 and draft.host_reads == 1, counts
                # (the read is the step's first: what follows it runs on host data, counted apart; DySpec posts a
                # flag per level but the last, and on CUDA reads each one level late: GraphStepper.lookahead)
                posts = min(tr.draft_forwards, dec.config.depth - 1) if method == "dyspec_greedy" else 0
                assert draft.ops == posts, counts
                assert counts["kv_compaction"].graphs == 1, counts
    finally:
        pair.close()


@pytest.mark.slow
@pytest.mark.skipif(DEVICE.type == "cuda", reason="runs on the CPU either way: CI covers it, the device's minutes go to CUDA")
def test_sampled_steps_with_the_draft_programs_sample_the_target(pair, exact):  # noqa: F811
    """T = 1, DySpec drawn without replacement on the device, token level on the host from the read draft rows:
    1,355 samples, power >= 0.99 against w2 >= 0.04 at false-alarm rate ALPHA (``test_sampling_e2e``'s flat
    pair, its target streamed)."""
    draft, target = pair
    cfg = DecodeConfig(method="dyspec_greedy", verifier="token_level", temperature=1.0, budget=6, depth=2,
                       offload_target=True, attention="torch", trace_block_counts=False, device="cpu")
    prepared = PreparedPair.prepare(draft, target, cfg, allow_cpu_offload=True)

    def make():
        dec = SpeculativeDecoder.on_pair(prepared, cfg, eos_token_id=())
        dec.graph_steps = True
        assert dec.draft_graph_reason() is None
        return dec

    try:
        counts = sample_first_two(make, FLAT_PROMPT, samples_for(exact(1.0)), seed0=700)
    finally:
        prepared.close()
    assert chi_square_pvalue(counts, exact(1.0)) > ALPHA
