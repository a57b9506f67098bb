"""Steps as fixed-shape programs (``decode.graph_step``): the dense forward equals transformers', every
program traces whole with ``fullgraph=True`` and never recompiles within a bucket, greedy output is
plain decoding's, and a step launches a fixed number of graphs with one host read — whatever the budget.

On the CPU the programs are traced by dynamo's ``eager`` backend (``CompileMode.check``): what fails there
(a graph break, a host read, a data-dependent shape) fails the same way under inductor on a GPU."""

import re
import sys
from collections import Counter

import pytest
import torch
from conftest import DEVICE
from torch._dynamo.utils import counters

from dyntree_core import DecodeConfig, SpeculativeDecoder
from dyntree_core.decode.compiled import CompileMode
from dyntree_core.decode.dense_forward import DenseForward, dense_reason
from dyntree_core.decode.forward import causal_forward, masked_forward, new_cache
from dyntree_core.decode.graph_step import Envelope, graph_reason
from dyntree_core.decode.op_count import OpCounter, total
from dyntree_core.testing import tiny_pair
from dyntree_core.tree import tree_from_parents

PROMPT = [5, 9, 2, 7, 1]
TREE_METHODS = ("chain", "dyspec_greedy", "sequoia", "specinfer")


@pytest.fixture(scope="module")
def pair():
    draft, target = tiny_pair(seed=3)
    return draft.to(DEVICE), target.to(DEVICE)


#: how the programs run in these tests: eager on the CPU; on a GPU the CUDA default (captured CUDA graphs:
#: no compiler, so every test can afford it); ``test_cuda_graphs_...`` also runs inductor's mode once
TEST_MODE = CompileMode.graphs(DEVICE) if DEVICE.type == "cuda" else None


def graph_decoder(pair, method, mode=TEST_MODE, **kw):
    draft, target = pair
    cfg = DecodeConfig(method=method, attention="torch", trace_block_counts=False, device=DEVICE.type,
                       **({"budget": 16, "depth": 4} | kw))
    dec = SpeculativeDecoder(draft, target, cfg)
    dec.graph_steps = True
    dec.compile_mode = mode
    assert dec.graph_reason() is None
    return dec


def plain_ids(pair, n):
    """Plain decoding's tokens from the eager host step (on CUDA too, where graph steps are the default: the
    reference does not run the programs under test, nor adds a stepper to the pair)."""
    draft, target = pair
    dec = SpeculativeDecoder(draft, target, DecodeConfig(method="autoregressive", attention="torch",
                                                         device=DEVICE.type))
    dec.graph_steps = False
    return dec.generate_ids(PROMPT, n)


def test_the_dense_forward_equals_transformers_for_prefill_steps_and_a_tree(pair):
    _, target = pair
    capacity = 48
    f = DenseForward(target, capacity)
    cache = new_cache(target, capacity)
    n = len(PROMPT)
    ref = causal_forward(target, cache, PROMPT, 0)
    pos = torch.arange(n, device=DEVICE)
    visible = torch.arange(capacity, device=DEVICE)[None, :] <= pos[:, None]
    got = f(torch.tensor(PROMPT, device=DEVICE), pos, pos, visible, pos)
    assert (got - ref).abs().max() < 1e-5
    # a tree of 6 nodes after the prompt: the same ancestor mask through both forwards
    tree = tree_from_parents([-1, 0, 0, 1, 1, 3], tokens=[4, 8, 3, 6, 2, 9])
    anc = tree.ancestor_mask().to(DEVICE)
    depth = tree.depth.to(DEVICE)
    vis_hf = torch.cat([torch.ones(6, n, dtype=torch.bool, device=DEVICE), anc], dim=1)
    ref = masked_forward(target, cache, tree.tokens.to(DEVICE), n + depth, vis_hf)
    slots = n + torch.arange(6, device=DEVICE)
    visible = torch.zeros(6, capacity, dtype=torch.bool, device=DEVICE)
    visible[:, :n] = True
    visible[:, n:n + 6] = anc
    got = f(tree.tokens.to(DEVICE), n + depth, slots, visible, torch.arange(6, device=DEVICE))
    assert (got - ref).abs().max() < 1e-5


def test_the_dense_forward_stays_within_bf16_rounding_of_transformers():
    """The dtype the GPU runs: grouped KV heads (the folded attention), fused norms rounded once, residuals
    in the GEMMs. A bf16 Qwen2 shape's tree logits against transformers' own forward of the same model:
    the difference is bf16 rounding (a few hundredths at logits of size ~10), not a wrong head or slot
    (which moves logits by whole units)."""
    from dyntree_core.bench.resident import synthetic_qwen

    model = synthetic_qwen(64, 3, 4, 2, 128, 256, seed=5, dev=DEVICE).to(torch.bfloat16)
    capacity, n = 64, len(PROMPT)
    cache = new_cache(model, capacity)
    causal_forward(model, cache, PROMPT, 0)
    f = DenseForward(model, capacity)
    pos = torch.arange(n, device=DEVICE)
    f(torch.tensor(PROMPT, device=DEVICE), pos, pos, torch.arange(capacity, device=DEVICE)[None, :] <= pos[:, None],
      pos)
    tree = tree_from_parents([-1, 0, 0, 1, 1, 3], tokens=[4, 8, 3, 6, 2, 9])
    anc = tree.ancestor_mask().to(DEVICE)
    depth = tree.depth.to(DEVICE)
    ref = masked_forward(model, cache, tree.tokens.to(DEVICE), n + depth,
                         torch.cat([torch.ones(6, n, dtype=torch.bool, device=DEVICE), anc], dim=1)).float()
    visible = torch.zeros(6, capacity, dtype=torch.bool, device=DEVICE)
    visible[:, :n] = True
    visible[:, n:n + 6] = anc
    got = f(tree.tokens.to(DEVICE), n + depth, n + torch.arange(6, device=DEVICE), visible,
            torch.arange(6, device=DEVICE)).float()
    scale = ref.abs().max()
    assert scale > 1 and (got - ref).abs().max() < 0.02 * scale, ((got - ref).abs().max(), scale)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_dense_reason_names_what_the_forward_cannot_take(pair):
    import copy

    from dyntree_core.quant.apply import quantize_model

    draft, _ = pair

    q = quantize_model(copy.deepcopy(draft).cpu(), "int8")
    assert "projections" in dense_reason(q) and dense_reason(draft) is None
    cfg = DecodeConfig(method="dyspec_greedy", attention="triton")
    assert "triton" in graph_reason(cfg, draft, draft, offloaded=False)
    assert "stop_confidence" in graph_reason(DecodeConfig(method="chain", stop_confidence=0.3), draft, draft,
                                             offloaded=False)
    assert "streams from host memory" in graph_reason(DecodeConfig(method="chain"), draft, draft, offloaded=True)
    for method in ("autoregressive",) + TREE_METHODS:
        assert graph_reason(DecodeConfig(method=method, temperature=0.5), draft, draft, offloaded=False) is None
    assert Envelope.of(DecodeConfig(method="opt_tree")) is None
    assert Envelope.of(DecodeConfig(method="specinfer", width=2, depth=3)).parents == (-1, 0, 0, 1, 2, 3, 4)
    assert Envelope.of(DecodeConfig(method="chain", depth=5)).parents == (-1, 0, 1, 2, 3, 4)


@pytest.mark.parametrize("method", ("autoregressive",) + TREE_METHODS)
def test_every_program_compiles_whole_and_never_recompiles_within_a_bucket(pair, method):
    """fullgraph=True (a graph break raises), then 30 more steps of the same bucket add no graph."""
    dec = graph_decoder(pair, method, CompileMode.check())
    events = []
    dec.on_compile = events.append
    before = counters["stats"]["unique_graphs"]
    first = [c.token_id for tr in dec.generate(PROMPT, 4) for c in tr.committed]
    compiled = counters["stats"]["unique_graphs"] - before
    programs = {"ar"} if method == "autoregressive" else {"draft_root", "draft_level", "target_tree", "verify", "commit"}
    assert {e.program for e in events} == programs and compiled == len(programs)
    assert first == plain_ids(pair, 4)
    steps = 0
    while steps < 30:  # runs of one bucket reuse the pair's stepper and its programs
        steps += len(list(dec.generate(PROMPT, 40)))
    assert counters["stats"]["unique_graphs"] - before == compiled  # no recompile over >= 30 steps
    assert len(events) == len(programs)  # (a new bucket would have been reported)


@pytest.mark.parametrize("verifier", ("token_level", "point_mass"))
def test_sampled_steps_compile_whole_and_never_recompile_within_a_bucket(pair, verifier):
    """T > 0 with the verification on the device: the same five programs, fullgraph=True, and 30 more steps
    add no graph."""
    dec = graph_decoder(pair, "dyspec_greedy", CompileMode.check(), temperature=0.8, verifier=verifier)
    events = []
    dec.on_compile = events.append
    before = counters["stats"]["unique_graphs"]
    steps = len(list(dec.generate(PROMPT, 4, seed=1)))
    compiled = counters["stats"]["unique_graphs"] - before
    assert {e.program for e in events} == {"draft_root", "draft_level", "target_tree", "verify", "commit"}
    assert compiled == 5
    seed = 2
    while steps < 30:
        steps += len(list(dec.generate(PROMPT, 40, seed=seed)))
        seed += 1
    assert counters["stats"]["unique_graphs"] - before == compiled and len(events) == 5


@pytest.mark.parametrize("method", ("dyspec_greedy", "chain"))
def test_fused_draft_programs_compile_once_inside_the_capture_and_keep_plain_decodings_tokens(method, monkeypatch):
    """``CompileMode.graphs(fuse=DRAFT_PROGRAMS)`` (``bench gpu``'s ``graph_inductor_draft``): the draft's two
    programs go through ``torch.compile(fullgraph=True)`` before their capture (here dynamo's ``eager`` backend:
    the same tracing as inductor's, without its compile time), the others are captured as they are; greedy
    identity, and 30 steps of one bucket compile nothing more."""
    from dyntree_core.decode.graph_step import DRAFT_PROGRAMS

    made = steppers_made(monkeypatch, lambda s: s)
    draft, target = tiny_pair(seed=3)
    pair = draft.to(DEVICE), target.to(DEVICE)
    mode = CompileMode.graphs(DEVICE, fuse=DRAFT_PROGRAMS, fuse_backend="eager")
    dec = graph_decoder(pair, method, mode, budget=8, depth=3)
    events = []
    dec.on_compile = events.append
    before = counters["stats"]["unique_graphs"]
    assert dec.generate_ids(PROMPT, 24) == plain_ids(pair, 24)
    assert counters["stats"]["unique_graphs"] - before == 2  # the two draft programs, nothing else traced
    assert {e.program for e in events} == {*DRAFT_PROGRAMS, "target_tree", "verify", "commit"}
    (stepper,) = made
    assert {p.name for p in stepper.programs if p._run is not p._fn} == set(DRAFT_PROGRAMS)
    steps, seen = 0, len(events)
    while steps < 30:
        traces = list(dec.generate(PROMPT, 24))
        assert [c.token_id for tr in traces for c in tr.committed] == plain_ids(pair, 24)
        steps += len(traces)
    assert counters["stats"]["unique_graphs"] - before == 2 and len(events) == seen
    assert "eager kernels in draft_root, draft_level" in mode.label


@pytest.mark.parametrize("method", TREE_METHODS)
@pytest.mark.parametrize("budget,depth", [(16, 4), (7, 6), (40, 3)])
def test_graph_steps_give_plain_decodings_tokens(pair, method, budget, depth):
    dec = graph_decoder(pair, method, budget=budget, depth=depth)
    traces = list(dec.generate(PROMPT, 48))
    assert [c.token_id for tr in traces for c in tr.committed] == plain_ids(pair, 48)
    assert sum(len(tr.accepted_nodes) for tr in traces) > len(traces)  # trees were accepted, not only bonus tokens
    for tr in traces:
        assert tr.tree.size <= Envelope.of(dec.config).budget and tr.node_order == "bfs"
        assert tr.node_status[0] == "root" and all(tr.node_status[i] == "accepted" for i in tr.accepted_nodes[1:])


@pytest.mark.parametrize("method", ("dyspec_greedy", "specinfer"))
def test_graph_steps_keep_the_host_paths_trees_and_provenance(pair, method):
    """The graph step's tree and probabilities are the host drafter's at T = 0 (DySpec greedy; SpecInfer's
    k x L: the root's top k, then each chain's argmax)."""
    draft, target = pair
    knobs = dict(budget=12, depth=3, width=3)
    cfg = DecodeConfig(method=method, attention="torch", trace_block_counts=False, device=DEVICE.type, **knobs)
    host_dec = SpeculativeDecoder(draft, target, cfg)
    host_dec.cap_levels = False  # (the graph steps draft the envelope's depth to the last step)
    host = list(host_dec.generate(PROMPT, 24))
    graph = list(graph_decoder(pair, method, **knobs).generate(PROMPT, 24))
    assert_same_steps(host, graph)


def assert_same_steps(host, graph) -> None:
    """The host drafter's steps and the draft programs' steps: the same trees, tokens and provenance."""
    from test_device_drafting import assert_same_tree

    assert len(host) == len(graph)
    for a, b in zip(host, graph):
        assert_same_tree(a.tree, b.tree, rel=1e-5)
        assert [c.token_id for c in a.committed] == [c.token_id for c in b.committed]
        for x, y in zip(a.committed, b.committed):
            assert y.p_target == pytest.approx(x.p_target, rel=1e-4)
            # the host drafter forwards a node only when its heap pops it; the programs forward every slot
            # above the last level, so they may know a bonus token's draft probability the host does not
            assert x.p_draft != x.p_draft or y.p_draft == pytest.approx(x.p_draft, rel=1e-4)


def test_plain_decoding_at_t_above_0_samples_from_the_same_distribution(pair):
    """At T > 0 the program returns the distribution and the host samples, as the eager path does:
    with the same seed the same tokens (the rows agree to float rounding)."""
    draft, target = pair
    cfg = DecodeConfig(method="autoregressive", temperature=0.8, top_p=0.9, attention="torch", device=DEVICE.type)
    host = SpeculativeDecoder(draft, target, cfg).generate_ids(PROMPT, 32, seed=7)
    dec = SpeculativeDecoder(draft, target, cfg)
    dec.graph_steps = True
    assert dec.graph_reason() is None
    assert dec.generate_ids(PROMPT, 32, seed=7) == host


# ------------------------------------------------------------------ the launch budget
#: per tree step before its read: eager ops (glue outside the programs), graph calls, host reads
STEP_OPS_BUDGET = 0
STEP_READS_BUDGET = 1
DEVICE_PHASES = ("draft", "tree_build", "mask", "target_forward", "verify", "kv_compaction")


def step_counts(dec, n=20):
    out = []
    with OpCounter() as counter:
        for tr in dec.generate(PROMPT, n):
            counts = counter.take_step()
            if tr.step > 0:  # the first step also ends the prefill
                out.append(counts)
    return out


@pytest.mark.parametrize("method", TREE_METHODS)
def test_a_tree_step_launches_its_levels_plus_3_graphs_and_reads_once_at_any_budget(pair, method):
    """Draft: one graph per level forwarded (every level of a static shape; DySpec's levels while its tree
    grows, each posting one flag, the levels but the first each reading one); target forward, verify,
    commit: one each; no other eager op before the step's read, one read — at budget 12 and 48 alike (the
    tree's size lives in the shapes)."""
    for budget in (12, 48):
        dec = graph_decoder(pair, method, budget=budget, depth=4)
        depth = Envelope.of(dec.config).depth
        for counts in step_counts(dec):
            device = total(counts, DEVICE_PHASES)
            draft = counts["draft"]
            levels = draft.graphs
            assert device.ops - draft.ops <= STEP_OPS_BUDGET, counts
            assert device.host_reads == STEP_READS_BUDGET, counts
            assert device.graphs == levels + 3, counts
            if method == "dyspec_greedy":
                assert 1 <= levels <= depth and draft.ops == min(levels, depth - 1), counts
                lookahead = 1 if DEVICE.type == "cuda" else 0  # (GraphStepper.lookahead)
                assert draft.flag_reads == max(0, levels - 1 - lookahead) + (levels < depth), counts
            else:
                assert levels == depth and draft.ops == draft.flag_reads == 0, counts


@pytest.mark.parametrize("verifier", ("token_level", "point_mass"))
def test_a_sampled_tree_step_verifies_on_the_device_and_reads_bytes_independent_of_the_vocabulary(pair, verifier):
    """T > 0 with a device verifier: the programs of a greedy step, one eager op more (the verification's
    uniforms, as each level draws its own), one read — of the same bytes at vocabularies 64 and 512, where
    the Traversal step (verified on the host) reads the draft and target rows of every slot, 2 B V floats."""
    draft512, target512 = tiny_pair(seed=3, vocab=512)
    big = (draft512.to(DEVICE), target512.to(DEVICE))
    read = {}
    for name, models, verify in (("v64", pair, verifier), ("v512", big, verifier), ("traversal", big, "traversal")):
        dec = graph_decoder(models, "dyspec_greedy", budget=12, depth=4, temperature=0.8, verifier=verify)
        steps = step_counts(dec)
        for counts in steps:
            device = total(counts, DEVICE_PHASES)
            draft = counts["draft"]
            on_device = verify != "traversal"  # (Traversal has no verify program: the host verifies)
            assert device.host_reads == STEP_READS_BUDGET and device.graphs == draft.graphs + 2 + on_device, counts
            if on_device:
                assert device.ops - draft.ops == 1 and counts["verify"].ops == 1, counts
        read[name] = {total(counts, DEVICE_PHASES).read_bytes for counts in steps}
    assert read["v64"] == read["v512"] and len(read["v64"]) == 1, read
    assert min(read["traversal"]) >= 2 * 12 * 512 * 4 > 4 * max(read["v512"]), read


@pytest.mark.parametrize("verifier", ("token_level", "point_mass"))
def test_a_sampled_steps_decisions_lead_to_its_path_and_show_in_the_walkthrough(pair, verifier):
    """The trace a device-verified step leaves (``verify.device.walk_result``) is what the page shows: the
    decisions end with the bonus token, their accepted tests are the accepted path, every rejection carries
    the updated residual's top tokens, and the walkthrough lists one row per decision."""
    from ui.tokens import TokenTexts
    from ui.walkthrough import walkthrough_html

    class Names:
        decode = staticmethod(lambda ids, **kw: "".join(f"<t{i}>" for i in ids))

    texts = TokenTexts(Names())
    dec = graph_decoder(pair, "dyspec_greedy", budget=12, depth=4, temperature=0.8, verifier=verifier)
    kinds = Counter()
    for tr in dec.generate(PROMPT, 24, seed=3):
        ds = tr.decisions
        assert ds[-1].kind == "bonus" and ds[-1].token == tr.bonus_token == tr.committed[-1].token_id
        assert [d.node for d in ds if d.accepted and d.kind != "bonus"] == tr.accepted_nodes[1:]
        assert all(0 <= d.u < 1 and 0 <= d.accept_prob <= 1 and 0 < d.p_target <= 1 + 1e-6 for d in ds
                   if d.kind != "child" or d.accepted), ds
        assert all(d.residual_top for d in ds if d.kind == "child" and not d.accepted)
        assert len(re.findall(r"<tr>", walkthrough_html(tr, texts, None))) == len(ds) + 1
        for sel in range(len(ds)):
            assert f"Decision {sel + 1} of {len(ds)}" in walkthrough_html(tr, texts, sel)
        kinds.update(d.kind if d.accepted else "rejected" for d in ds)
    assert kinds["bonus"] >= 5 and (kinds["rejected"] >= 3 if verifier == "token_level" else kinds["sample"] >= 3), kinds


def test_a_plain_step_is_one_graph_and_one_read(pair):
    for counts in step_counts(graph_decoder(pair, "autoregressive")):
        device = total(counts, DEVICE_PHASES)
        assert (device.ops, device.graphs, device.host_reads) == (0, 1, 1), counts


def test_the_counter_sees_a_host_read_and_ops_added_to_a_phase(pair, monkeypatch):
    """The budget tests fail when a step reads the device or runs ops outside its programs."""
    from dyntree_core.decode import graph_step

    real = graph_step.GraphStepper.verify

    def reads_once_more(self):
        real(self)
        int(self.step_out[0])  # a stray scalar read

    monkeypatch.setattr(graph_step.GraphStepper, "verify", reads_once_more)
    counts = step_counts(graph_decoder(pair, "chain"), 6)[0]
    assert counts["verify"].host_reads == 2 and counts["verify"].ops >= 1
    monkeypatch.setattr(graph_step.GraphStepper, "verify", real)
    real_draft = graph_step.GraphStepper.draft

    def eager_mask(self, cached, generator=None, every_level=False):
        forwards = real_draft(self, cached, generator, every_level)
        (self._d_cols < self.d_len)[None].expand(4, -1).clone()  # mask work moved out of the programs
        return forwards

    monkeypatch.setattr(graph_step.GraphStepper, "draft", eager_mask)
    counts = step_counts(graph_decoder(pair, "chain"), 6)[0]
    assert counts["draft"].ops > STEP_OPS_BUDGET and counts["draft"].host_reads == 0


def test_a_flag_is_one_op_to_post_and_a_read_counted_apart_from_the_steps_read():
    """``host.Flags``: a post is one dispatched copy, a read none; the counter sees a flag read, not a host read
    (the step's one ``fetch`` stays its one host read)."""
    from dyntree_core.decode.host import Flags

    flags = Flags(3, DEVICE)
    yes, no = torch.tensor([True], device=DEVICE), torch.tensor([False], device=DEVICE)
    with OpCounter() as counter:
        flags.post(1, yes)
        flags.post(2, no)
        got = flags.read(1), flags.read(2)
        c = counter.take_step()["other"]
    assert got == (True, False)
    assert (c.ops, c.flag_reads, c.host_reads) == (2, 2, 0), c


def steppers_made(monkeypatch, record) -> list:
    """``record(stepper)`` of every ``GraphStepper`` made from now on, in order (the test's ``monkeypatch``
    undoes the spy)."""
    from dyntree_core.decode import graph_step

    made = []
    real_init = graph_step.GraphStepper.__init__

    def spy(self, *a, **k):
        real_init(self, *a, **k)
        made.append(record(self))

    monkeypatch.setattr(graph_step.GraphStepper, "__init__", spy)
    return made


def holders(obj, depth: int = 4) -> str:
    """What ``gc`` sees holding ``obj`` (a failed release's message): chains of referrers up to ``depth`` levels
    (each by type; a dict by its keys, a frame by its function), this test's own frames and lists left out."""
    import gc
    import types

    def name(r) -> str:
        if isinstance(r, types.FrameType):
            return f"frame {r.f_code.co_name} ({r.f_code.co_filename}:{r.f_lineno})"
        return type(r).__qualname__ + (f" keys={list(r)[:8]}" if isinstance(r, dict) else "")

    caller = sys._getframe().f_back

    def mine(r) -> bool:
        return r is caller or isinstance(r, types.FrameType) and r.f_code in (holders.__code__, up.__code__)

    def up(o, level: int, seen: set) -> list[str]:
        refs = [r for r in gc.get_referrers(o) if id(r) not in seen and not mine(r) and not isinstance(r, list)]
        if level == depth or not refs or isinstance(o, (types.ModuleType, types.FrameType)):
            return [name(o)]
        seen, here = seen | {id(o)}, name(o)  # (the comprehension sees ``here``, not ``o``: no cell holds ``o``)
        return [f"{here} <- {chain}" for r in refs[:3] for chain in up(r, level + 1, seen)]

    chains = up(obj, 0, set())
    if chains == [name(obj)]:
        return f"{name(obj)} held by nothing gc sees (refcount {sys.getrefcount(obj)})"
    return "held: " + " | ".join(chains[:12])


def test_the_pair_keeps_its_steppers_between_runs_and_close_frees_them(monkeypatch):
    """A run borrows the pair's stepper (its KV buffers and compiled programs); the next run of the same
    bucket reuses it, a concurrent one gets its own, and ``PreparedPair.close`` releases them."""
    import gc
    import weakref

    made = steppers_made(monkeypatch, lambda s: (weakref.ref(s.tf.kv.kv), weakref.ref(s.df.kv.kv)))
    draft, target = tiny_pair(seed=5)
    dec = graph_decoder((draft.to(DEVICE), target.to(DEVICE)), "dyspec_greedy")
    assert len(dec.generate_ids(PROMPT, 8)) == 8 and len(dec.generate_ids(PROMPT, 8)) == 8
    assert len(made) == 1  # reused
    first, second = dec.generate(PROMPT, 8), dec.generate(PROMPT, 8)
    next(first), next(second)  # two runs at once
    assert len(made) == 2
    second.close()
    first.close()
    gc.collect()
    assert made[1][0]() is None, holders(made[1][0]())  # the concurrent run's own stepper went with it
    assert made[0][0]() is not None  # the pair's is kept for the next run
    dec.pair.close()
    gc.collect()
    assert all(r() is None for refs in made for r in refs)


def test_a_concurrent_runs_own_stepper_frees_its_graphs_when_the_run_ends(monkeypatch):
    """The pair keeps one stepper per configuration; a run that finds it in use makes its own, which
    ``PreparedPair.give_back`` releases when that run ends (its captured graphs and their pool: on a GPU
    nothing else frees them while anything still references the stepper); the kept one keeps its graphs."""
    made = steppers_made(monkeypatch, lambda s: s)
    draft, target = tiny_pair(seed=5)
    dec = graph_decoder((draft.to(DEVICE), target.to(DEVICE)), "dyspec_greedy", CompileMode.graphs(DEVICE))
    first, second = dec.generate(PROMPT, 8), dec.generate(PROMPT, 8)
    next(first), next(second)
    list(second)
    assert len(made) == 2 and made[1].graphs == 0 and not made[1].in_use
    list(first)
    assert made[0].graphs > 0 and not made[0].in_use  # kept for the next run
    dec.pair.close()
    assert made[0].graphs == 0


def test_a_run_that_compiles_says_so_before_its_first_step(pair):
    """Under a compiling mode the first run of a bucket yields a progress item naming the programs it is
    about to compile (the app shows it while the step runs); the next run of the bucket compiles nothing."""
    from dyntree_core.trace import PrefillProgress, StepTrace

    dec = graph_decoder(pair, "chain", CompileMode.check(), depth=3)
    items = list(dec.generate(PROMPT, 4, prefill_progress=True))
    notes = [i.compiling for i in items if isinstance(i, PrefillProgress) and i.compiling]
    assert len(notes) == 1 and all(p in notes[0] for p in ("draft_root", "draft_level", "target_tree", "commit"))
    first_step = next(k for k, i in enumerate(items) if isinstance(i, StepTrace))
    assert items.index(next(i for i in items if isinstance(i, PrefillProgress) and i.compiling)) < first_step
    again = list(dec.generate(PROMPT, 4, prefill_progress=True))
    assert not any(isinstance(i, PrefillProgress) and i.compiling for i in again)
    assert not any(isinstance(i, PrefillProgress) and i.compiling
                   for i in graph_decoder(pair, "chain", CompileMode(), depth=3).generate(PROMPT, 4, prefill_progress=True))


@pytest.mark.parametrize("method", ("autoregressive",) + TREE_METHODS)
def test_captured_programs_replay_with_each_calls_arguments_and_close_frees_the_graphs(method):
    """The graph-capture bookkeeping (``CompileMode.graphs``: a CUDA graph per shape on a GPU, its eager
    emulation on the CPU): the first call of a shape runs and captures, later calls copy their tensor
    arguments into the graph's own inputs and replay. The draft levels pass a different level tensor to
    one captured program each call, so a replay that kept the captured arguments would grow every level
    as level 1 and lose greedy identity. A second run captures nothing; closing the pair frees them."""
    from test_device_drafting import assert_same_tree

    draft, target = tiny_pair(seed=3)
    dec = graph_decoder((draft.to(DEVICE), target.to(DEVICE)), method, CompileMode.graphs(DEVICE),
                        budget=8, depth=4)
    events = []
    dec.on_compile = events.append
    eager = list(graph_decoder((draft, target), method, CompileMode(), budget=8, depth=4).generate(PROMPT, 24))
    replayed = list(dec.generate(PROMPT, 24))
    assert [c.token_id for t in replayed for c in t.committed] == plain_ids((draft, target), 24)
    assert len(replayed) == len(eager)
    for a, b in zip(eager, replayed):  # the same trees as eager calls (identity alone holds for any tree)
        if a.tree is not None:
            assert_same_tree(a.tree, b.tree, rel=1e-5)
    captured = len(events)
    assert captured >= (1 if method == "autoregressive" else 5)
    assert dec.generate_ids(PROMPT, 24) == plain_ids((draft, target), 24)
    assert len(events) == captured
    steppers = list(dec.pair._steppers.values())
    assert steppers and sum(s.graphs for s in steppers) == captured
    dec.pair.close()
    assert sum(s.graphs for s in steppers) == 0


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("method,mode", (("autoregressive", "graphs"), ("dyspec_greedy", "graphs"),
                                         ("sequoia", "graphs"), ("autoregressive", "inductor")))
def test_cuda_graphs_give_plain_decodings_tokens_and_replay_without_recompiling(method, mode):
    """The CUDA modes (the default: captured CUDA graphs; ``inductor``: reduce-overhead): state buffers at
    static addresses, updated in place by the replays; greedy identity, and a second run compiles nothing."""
    mode = CompileMode.graphs(DEVICE) if mode == "graphs" else CompileMode.inductor(DEVICE)
    draft, target = tiny_pair(seed=3)  # a pair of its own: the module's may hold this bucket's stepper already
    pair = draft.to(DEVICE), target.to(DEVICE)
    dec = graph_decoder(pair, method, mode, budget=8, depth=3)
    events = []
    dec.on_compile = events.append
    assert dec.generate_ids(PROMPT, 24) == plain_ids(pair, 24)
    compiled = len(events)
    assert compiled >= 1 and dec.generate_ids(PROMPT, 24) == plain_ids(pair, 24)
    assert len(events) == compiled


def _dense_forward_kernels(layers: int):
    """The CUDA kernels of one dense forward of 4 rows over a masked span (``op_count.LaunchCounter``),
    bf16 Qwen2 shape with grouped KV heads (4 query heads, 2 KV heads)."""
    from dyntree_core.bench.resident import synthetic_qwen
    from dyntree_core.decode.op_count import LaunchCounter

    model = synthetic_qwen(64, layers, 4, 2, 128, 512, seed=1, dev=torch.device("cpu")).to(torch.bfloat16)
    f = DenseForward(model, 256)
    rows, visible = torch.arange(4), torch.ones(4, 256, dtype=torch.bool)
    with LaunchCounter() as launches:
        f(rows, rows, rows, visible, rows)
    return launches


def test_a_dense_forward_layer_launches_at_most_10_cuda_kernels():
    """The measured GPU tree step is launch-bound in the draft (H200: 2.5 ms per 24-layer 0.5B-shaped forward
    inside a CUDA graph, ~6 us a kernel, docs/GPU_RESULTS.md): each layer's kernels are what a draft level costs.
    One q/k/v and one gate/up matmul (``fuse_projections``); q, k and v rotated and the keys and values written
    to the cache by one op (``layer_kernels.rope_write``; the values by the identity); ``silu(gate) * up`` one op
    (``layer_kernels.silu_mul``); the norms as ``F.rms_norm`` (one fused CUDA kernel each); attention over the
    masked span with the query heads folded per KV head (``fold_gqa``: CUDA's fused SDPA kernels take no mask
    with ``enable_gqa``) and the residual sums inside the o and down GEMMs (``add_linear``): 10 per layer,
    none on SDPA's math path. The rotary tables (one gather, one join with the values' identity), the mask and
    the final norm: 8 per forward. Before: 42 per layer and 24 per forward (the norms as transformers' modules,
    masked ``enable_gqa``, separate residual adds and cache writes, tables computed per forward), then 14 (the
    rotation as cat, mul, addcmul and the write apart; silu and mul apart). Each mutation fails here: one norm
    back to ``layer.input_layernorm(h)`` (+7 on bf16), the fold back to ``enable_gqa`` with the mask (+12,
    CUDA's math path), a residual added apart (+1), ``silu_op`` off (+1), the rotation and write as torch ops
    (+3)."""
    one, two = _dense_forward_kernels(1), _dense_forward_kernels(2)
    assert two.math_sdpa == 0, dict(two.by_op)
    per_layer = two.kernels - one.kernels
    assert per_layer <= 10, dict(two.by_op - one.by_op)
    assert one.kernels - per_layer <= 8, dict(one.by_op)
    assert (two.by_op - one.by_op)["rms_norm"] == 2 and (two.by_op - one.by_op)["sdpa"] == 1


def test_fused_projections_keep_the_models_numbers_and_share_its_storage():
    """Fusing changes no value: the model's own forward gives the same logits, its q/k/v and gate/up
    parameters are views of the fused tensors (no second copy), a second fuse reuses them, and a dtype
    change (new parameters) is fused anew. (A model of its own: the module's pair may be prepared, hence
    fused already, and holds its steppers' CUDA graphs on a GPU, which cannot be deep-copied.)"""
    from dyntree_core.decode.dense_forward import fuse_projections

    model = tiny_pair(seed=3)[1].to(DEVICE)
    ids = torch.tensor([PROMPT], device=DEVICE)
    before = model(ids).logits
    layer = model.model.layers[0]
    qkv, gate_up = fuse_projections(layer)
    assert torch.equal(model(ids).logits, before)
    attn = layer.self_attn
    ptr = qkv.weight.untyped_storage().data_ptr()
    assert all(p.weight.untyped_storage().data_ptr() == ptr for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert layer.mlp.up_proj.weight.untyped_storage().data_ptr() == gate_up.weight.untyped_storage().data_ptr()
    assert fuse_projections(layer)[0] is qkv
    model.to(torch.float64)
    again, _ = fuse_projections(layer)
    assert again is not qkv and again.weight.dtype == torch.float64


# ------------------------------------------------------------------ DySpec stops where its tree stops
def _levels_and_steps(dec, n, stops_early: bool, lookahead: int, monkeypatch):
    """``(draft graphs per step, traces)`` with the decoder's ``draft_every_level`` and the stepper's
    lookahead set; each step's ``draft_forwards`` is its count of draft graphs."""
    from dyntree_core.decode import graph_step

    real = graph_step.GraphStepper.draft

    def draft(self, cached, generator=None, every_level=False):
        self.lookahead = lookahead
        return real(self, cached, generator, every_level)

    monkeypatch.setattr(graph_step.GraphStepper, "draft", draft)
    dec.draft_every_level = not stops_early
    levels, traces = [], []
    with OpCounter() as counter:
        for tr in dec.generate(PROMPT, n):
            levels.append(counter.take_step()["draft"].graphs)
            assert tr.draft_forwards == levels[-1]
            traces.append(tr)
    monkeypatch.setattr(graph_step.GraphStepper, "draft", real)
    return levels, traces


@pytest.mark.parametrize("lookahead", [0, 1])
@pytest.mark.parametrize("budget,depth", [(16, 4), (12, 8), (48, 6)])
def test_dyspec_drafts_only_the_levels_its_tree_reaches_and_grows_the_same_tree(pair, budget, depth, lookahead,
                                                                                 monkeypatch):
    """A level with no live slot adds nothing, so the graph step stops there: the draft forwards
    ``min(tree depth + 1 + lookahead, depth)`` levels (the root's included) where it forwarded ``depth``,
    and the trees and tokens are those of every level forwarded."""
    from test_device_drafting import assert_same_tree

    every, full = _levels_and_steps(graph_decoder(pair, "dyspec_greedy", budget=budget, depth=depth), 40, False, 0,
                                    monkeypatch)
    levels, early = _levels_and_steps(graph_decoder(pair, "dyspec_greedy", budget=budget, depth=depth), 40, True,
                                      lookahead, monkeypatch)
    assert all(n == depth for n in every[1:])
    assert len(early) == len(full)
    for a, b, n in zip(full, early, levels):
        assert_same_tree(a.tree, b.tree, rel=0)
        assert [c.token_id for c in a.committed] == [c.token_id for c in b.committed]
        assert n == min(int(b.tree.depth.max()) + 1 + lookahead, depth), (n, b.tree.depth.tolist())
    if depth == 8:  # (the tiny pair's trees reach depths 4 and 6; at budget 12 they stop short of 8)
        assert sum(levels) < sum(every), levels


def test_a_flat_drafts_tree_costs_two_draft_levels_at_depth_8(monkeypatch):
    """The GPU bench's synthetic pair (a flat draft: every tree is the root and its children): 2 draft
    graphs per step at budget 64, depth 8 (3 with the CUDA lookahead) where 8 ran before."""
    from dyntree_core.bench.resident import synthetic_qwen

    draft = synthetic_qwen(64, 8, 4, 2, 128, 256, seed=1, dev=DEVICE, sharpen=1.0)
    target = synthetic_qwen(64, 4, 4, 2, 128, 256, seed=2, dev=DEVICE, sharpen=30.0)
    dec = graph_decoder((draft, target), "dyspec_greedy", budget=64, depth=8)
    for lookahead in (0, 1):
        levels, traces = _levels_and_steps(dec, 6, True, lookahead, monkeypatch)
        assert all(int(tr.tree.depth.max()) == 1 for tr in traces)
        assert levels[1:] == [2 + lookahead] * (len(levels) - 1), levels


#: CUDA kernels a draft level's program runs beyond its draft forward (``op_count.LaunchCounter``): the
#: level's visibility rows, its draws and the merge into the candidate set (DySpec), or the shape's draws
#: (chain, Sequoia); the same at every budget (the tree's size lives in the shapes)
LEVEL_KERNELS = {"dyspec_greedy": 69.75, "chain": 57.75, "sequoia": 57.75, "specinfer": 57.75}


@pytest.mark.skipif(DEVICE.type == "cuda", reason="a CUDA replay runs no Python: the kernels are counted on the CPU")
@pytest.mark.parametrize("method", TREE_METHODS)
def test_a_draft_level_launches_its_forward_and_at_most_a_fixed_number_of_kernels(pair, method):
    """Per draft graph (the root's program included), the kernels beyond one draft forward: 69.75 (DySpec)
    and 57.75 (chain, Sequoia) on this pair at budgets 12 and 48 alike (96.5 / 68.5 before the candidate
    set was packed into four tensors and the level's row ids, live slots and softmax trimmed); one more
    kernel per level fails (tried: a ``clone`` of the level's probabilities). On a 24-layer draft the
    forward is ~345 kernels (14 per layer): the level's own work is ~17% of a DySpec level."""
    from dyntree_core.decode.op_count import LaunchCounter

    draft, _ = pair
    f = DenseForward(draft, 64)
    rows = torch.arange(4)
    with LaunchCounter() as launches:
        f(rows, rows, rows, torch.ones(4, 64, dtype=torch.bool), rows)
    forward = launches.kernels
    for budget in (12, 48):
        for counts in step_counts(graph_decoder(pair, method, budget=budget, depth=4)):
            draft_phase = counts["draft"]
            per_level = draft_phase.graph_kernels / draft_phase.graphs - forward
            assert 0 < per_level <= LEVEL_KERNELS[method], (method, budget, per_level, forward)


#: CUDA kernels of the greedy ``verify`` program on this pair (``op_count.LaunchCounter``), whatever the budget and
#: the depth: the accepted path is read from the target tree's ancestor matrix (3 kernels), where a walk down the
#: levels took 3 kernels a level
GREEDY_VERIFY_KERNELS = 36


@pytest.mark.skipif(DEVICE.type == "cuda", reason="a CUDA replay runs no Python: the kernels are counted on the CPU")
def test_a_greedy_verify_launches_a_fixed_number_of_kernels_at_any_depth(pair):
    """The same count at depths 4 and 8, budgets 12 and 48; the walk down the levels back in place fails it (tried:
    ``acc = acc | (match & acc.index_select(0, parents))`` per level: 45 kernels at depth 4)."""
    for depth in (4, 8):
        for budget in (12, 48):
            counts = step_counts(graph_decoder(pair, "dyspec_greedy", budget=budget, depth=depth), n=6)
            kernels = {c["verify"].graph_kernels for c in counts}
            assert kernels == {GREEDY_VERIFY_KERNELS}, (depth, budget, kernels)


#: CUDA kernels of the T > 0 ``verify`` program on this pair at depth 4 (``op_count.LaunchCounter``), whatever
#: the budget: the token-level recurrence over each slot's sibling positions is one op
#: (``verify.alpha_kernel.token_level_alphas``), where it was 6 kernels a position (DySpec's nodes may have
#: ``budget - 1`` children: 240 kernels at budget 12, 456 at 48; ~550 at budget 64 on the H200's pair); the
#: prefix sums it searches are summed in float64 from the float32 rows and kept apart (161 when they were
#: converted first, stacked and joined with a zero column)
VERIFY_KERNELS = {"token_level": 155, "point_mass": 100}


@pytest.mark.skipif(DEVICE.type == "cuda", reason="a CUDA replay runs no Python: the kernels are counted on the CPU")
@pytest.mark.parametrize("verifier", ("token_level", "point_mass"))
def test_a_sampled_verify_launches_a_fixed_number_of_kernels_at_any_budget(pair, verifier):
    """Token level: 155 at budgets 12 and 48 alike; point mass: 100. The recurrence written back as torch ops
    (``alpha_kernel.alphas_loop`` called in ``token_level_tests``) fails it."""
    for budget in (12, 48):
        counts = step_counts(graph_decoder(pair, "dyspec_greedy", budget=budget, depth=4, temperature=0.8,
                                           verifier=verifier), n=8)
        kernels = {c["verify"].graph_kernels for c in counts}
        assert kernels == {VERIFY_KERNELS[verifier]}, (budget, kernels)
