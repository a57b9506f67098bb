"""Unit tests of the UI's pure builders (tree/mask/chart figures, coloured text, export) on
StepTraces from real tiny-pair runs, plus the session/generation controller."""

from __future__ import annotations

import html
import json
import math
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import torch

from dyntree_core.config import ConfigError, compatible_verifiers
from dyntree_core.trace import StepTrace, TokenProvenance
from dyntree_core.tree import tree_from_parents

from ui.charts import phase_figure, speed_figure, tokens_per_step_figure
from ui.colored_text import build_spans, render_html
from ui.export import ExportError, find_browser, traces_json, write_images, write_json
from ui.mask_figure import mask_figure, mask_matrix, masks_figure
from ui.models import ModelLoadError
from ui.pair_spec import PairSpec
from ui.palette import NODE_COLORS, SOURCE_LABELS, SOURCE_SYMBOLS, TEXT_SHADES
from ui.runner import run_to_end, start_generation
from ui.settings import RunSettings
from ui.text_figure import layout_segments, text_figure
from ui.tiny import TinyModelProvider, TinyTokenizer
from ui.tokens import TokenTexts, group_pieces
from ui.tree_figure import tree_figure, tree_layout


def _settings(**kw) -> RunSettings:
    base = dict(draft="tiny", target="tiny", device="cpu", dtype="float32", prompt="t1 t2 t3", chat=False,
                method="dyspec_greedy", verifier="auto", temperature=0.0, top_p=1.0, budget=24, depth=4, width=3,
                threshold=0.05, max_new_tokens=12, seed=0, precision="float32", draft_precision="float32")
    base.update(kw)
    return RunSettings(**base)


@pytest.fixture(scope="module")
def provider() -> TinyModelProvider:
    return TinyModelProvider()


def _drafting_available() -> bool:
    try:
        from dyntree_core.drafting import make_drafter  # noqa: F401
        from dyntree_core.verify import make_verifier  # noqa: F401
    except ImportError:
        return False
    return True


def _hand_trace() -> StepTrace:
    """A hand-built tree step (used when the drafters are not available)."""
    tree = tree_from_parents([-1, 0, 0, 1, 1, 2, 3], tokens=[5, 6, 7, 8, 9, 10, 11])
    tree.draft_logprob = torch.log(torch.tensor([1.0, 0.5, 0.3, 0.4, 0.2, 0.6, 0.9], dtype=torch.float64))
    committed = [TokenProvenance(6, 0, 1, 1, "accepted", 0.5, 0.7, 1.0),
                 TokenProvenance(8, 0, 2, 3, "accepted", 0.4, 0.5, 1.0),
                 TokenProvenance(12, 0, 3, -1, "bonus", math.nan, 0.6)]
    return StepTrace(step=0, method="dyspec_greedy", verifier="greedy", tree=tree, accepted_nodes=[0, 1, 3],
                     bonus_token=12, committed=committed,
                     node_status=["root", "accepted", "rejected", "accepted", "unverified", "unverified", "rejected"],
                     node_p_target=np.array([math.nan, 0.7, 0.1, 0.5, 0.2, 0.3, 0.1]),
                     node_accept_prob=np.array([math.nan, 1, 0, 1, math.nan, math.nan, 0.0]),
                     block_counts={o: {b: tree.block_count(o, b) for b in (16, 32, 64)} for o in ("bfs", "dfs", "hpd")})


@pytest.fixture(scope="module")
def tree_run(provider):
    """A real tree-method run (or a hand-built step when drafting is unavailable)."""
    if _drafting_available():
        return run_to_end(provider, _settings(temperature=0.8, method="dyspec_greedy", budget=40, depth=5))
    return None


@pytest.fixture(scope="module")
def ar_run(provider):
    return run_to_end(provider, _settings(method="autoregressive"))


def _tree_traces(tree_run) -> list[StepTrace]:
    if tree_run is None:
        return [_hand_trace()]
    return [t for t in tree_run.traces if t.tree is not None]


# ---------------------------------------------------------------------- layout and tree figure
def test_tree_layout_is_layered_and_centred():
    parents = [-1, 0, 0, 1, 1, 2, 3]
    pos = tree_layout(parents, tree_from_parents(parents).child_rank.tolist())
    depth = [0, 1, 1, 2, 2, 2, 3]
    assert [pos[i][1] for i in range(7)] == [-d for d in depth]
    # leaves in DFS order get increasing x: 6 (under 3), 4, 5
    assert pos[6][0] < pos[4][0] < pos[5][0]
    # a parent sits midway between its first and last child
    assert pos[1][0] == pytest.approx((pos[3][0] + pos[4][0]) / 2)
    assert pos[0][0] == pytest.approx((pos[1][0] + pos[2][0]) / 2)
    assert len({pos[i] for i in range(7)}) == 7


def test_tree_figure_colours_every_node_by_status(tree_run):
    texts = TokenTexts(TinyTokenizer(64))
    for trace in _tree_traces(tree_run)[:4]:
        fig = tree_figure(trace, texts, root_token=3)
        by_name = {tr.name: tr for tr in fig.data if tr.mode and "markers" in tr.mode}
        counted = 0
        for status in ("root", "accepted", "rejected", "unverified"):
            expected = sum(1 for s in trace.node_status if s == status)
            got = [tr for tr in fig.data if tr.marker is not None and tr.marker.color == NODE_COLORS[status]
                   and tr.mode == "markers+text"]
            assert (len(got[0].x) if got else 0) == expected, status
            counted += expected
        assert counted == trace.tree.size
        has_bonus = any(c.kind == "bonus" for c in trace.committed)
        bonus = [tr for tr in by_name.values() if tr.marker.color == NODE_COLORS["bonus"]]
        assert (len(bonus[0].x) if bonus else 0) == int(has_bonus)
        # the thick path has one segment per accepted edge plus the edge to the bonus token
        path = next(tr for tr in fig.data if tr.name == "accepted path")
        segments = sum(1 for v in path.x if v is None)
        assert segments == len(trace.accepted_nodes) - 1 + int(has_bonus)
        # hover shows the per-node probabilities
        hovers = " ".join(h for tr in fig.data if tr.hovertext is not None for h in tr.hovertext)
        assert "p_draft" in hovers and "p_target" in hovers and "accept prob" in hovers and "draw rank" in hovers


def test_tree_figure_shows_which_source_drafted_each_step(provider):
    """A hybrid run: steps drafted from the text draw squares (and say so), model steps circles."""
    from ui.views import status_line

    run = run_to_end(provider, _settings(method="hybrid", prompt="t1 t2 t3 " * 6 + "t1", budget=12, depth=4,
                                         threshold=0.01, max_new_tokens=24))
    sources = [t.draft_source for t in run.traces]
    assert sources[0] == "suffix" and set(sources) <= {"suffix", "model"}
    for i, trace in enumerate(run.traces):
        fig = tree_figure(trace, run.texts, run.root_token(i))
        nodes = [tr for tr in fig.data if tr.mode == "markers+text"]
        marks = (NODE_COLORS["root"], NODE_COLORS["bonus"], NODE_COLORS["cut"])  # (a cut bonus is a diamond too)
        symbols = {sym for tr in nodes if tr.marker.color not in marks for sym in tr.marker.symbol}
        assert symbols == {SOURCE_SYMBOLS[trace.draft_source]}, (i, trace.draft_source)
        assert SOURCE_LABELS[trace.draft_source] in [tr.name for tr in fig.data]
        assert ("drafted from the text" in fig.layout.title.text) == (trace.draft_source == "suffix")
        assert StepTrace.from_dict(json.loads(json.dumps(trace.to_dict()))).draft_source == trace.draft_source
    n_suffix = sources.count("suffix")
    assert f"{n_suffix} of {len(sources)} steps drafted from the text" in status_line(run)


def test_tree_figure_for_autoregressive_step(ar_run):
    fig = tree_figure(ar_run.traces[2], ar_run.texts, ar_run.root_token(2))
    assert "autoregressive" in fig.layout.title.text
    assert ar_run.root_token(2) == ar_run.traces[1].committed[-1].token_id


# ---------------------------------------------------------------------- masks
@pytest.mark.parametrize("block", [16, 32, 64])
def test_mask_heatmap_matches_ancestor_mask_and_block_counts(tree_run, block):
    for trace in _tree_traces(tree_run)[:3]:
        for order in ("bfs", "dfs", "hpd"):
            values, perm, blocks = mask_matrix(trace, order, block)
            anc = trace.tree.ancestor_mask(trace.tree.order(order)).numpy()
            assert np.array_equal(values >= 2, anc)
            # non-zero tiles counted from the rendered matrix equal the engine's own count
            n = anc.shape[0]
            nb = -(-n // block)
            tiles = {(q // block, k // block) for q, k in zip(*np.nonzero(values >= 2))}
            assert blocks == len(tiles)
            assert blocks == trace.block_counts[order][block]
            # value 1 marks exactly the masked-out cells of non-zero tiles
            for q, k in zip(*np.nonzero(values == 1)):
                assert (q // block, k // block) in tiles and not anc[q, k]
            fig = mask_figure(trace, order, block)
            assert f"{blocks} of {nb * nb} blocks" in fig.layout.title.text
            assert len(fig.layout.shapes) == 2 * (nb - 1)
        combined = masks_figure(trace, block)
        assert len(combined.data) == 3


def test_accepted_rows_are_highlighted_in_every_order():
    trace = _hand_trace()
    for order in ("bfs", "dfs", "hpd"):
        values, perm, _ = mask_matrix(trace, order, 16)
        slots = {node: j for j, node in enumerate(perm.tolist())}
        for node in trace.accepted_nodes:
            assert (values[slots[node]] == 3).sum() == trace.tree.depth[node].item() + 1
        assert (values == 3).sum() == sum(trace.tree.depth[v].item() + 1 for v in trace.accepted_nodes)


def test_mask_figure_for_autoregressive_step(ar_run):
    assert "autoregressive" in mask_figure(ar_run.traces[0], "dfs", 16).layout.annotations[0].text


# ---------------------------------------------------------------------- charts
def test_speed_and_step_charts_use_trace_values(tree_run, ar_run):
    run = tree_run if tree_run is not None else ar_run
    fig = speed_figure([(run.label, run.traces)], ar_run.traces)
    assert list(fig.data[0].y) == [t.tokens_per_s for t in run.traces]
    assert fig.data[-1].name == "autoregressive baseline"
    per = tokens_per_step_figure([(run.label, run.traces)], ar_run.traces)
    assert list(per.data[0].y) == [t.num_committed for t in run.traces]
    ph = phase_figure(run.traces, 1)
    draft = next(tr for tr in ph.data if tr.name == "draft")
    assert draft.x[0] == pytest.approx(run.traces[1].timings.draft * 1e3)


# ---------------------------------------------------------------------- coloured text
class _MapTokenizer:
    """id -> fixed string, or id -> raw bytes (byte-level pieces) decoded together."""

    def __init__(self, table: dict[int, str | bytes]) -> None:
        self.table = table

    def decode(self, ids, **_):
        raw = b"".join(v if isinstance(v, bytes) else v.encode() for v in (self.table[int(i)] for i in ids))
        return raw.decode("utf-8", errors="replace")


def _trace(step: int, provs: list[TokenProvenance]) -> StepTrace:
    return StepTrace(step=step, method="chain", verifier="greedy", tree=None, accepted_nodes=[0],
                     bonus_token=provs[-1].token_id, committed=provs)


def test_colored_text_escapes_and_preserves_whitespace():
    tok = _MapTokenizer({1: "<script>alert(1)</script>", 2: " a & b", 3: "\n    ", 4: "**md**", 5: '"q"'})
    texts = TokenTexts(tok)
    traces = [
        _trace(0, [TokenProvenance(1, 0, 1, 1, "accepted", 0.5, 0.6, 1.0), TokenProvenance(2, 0, 2, -1, "bonus", math.nan, 0.9)]),
        _trace(1, [TokenProvenance(3, 1, 1, 1, "accepted", 0.25, 0.5, 1.0), TokenProvenance(4, 1, 2, 4, "accepted", 0.1, 0.2, 0.5),
                   TokenProvenance(5, 1, 3, -1, "bonus", math.nan, 0.3)]),
    ]
    out = render_html(build_spans(traces, texts), prompt="<b>prompt</b>")
    assert "<script>" not in out and "&lt;script&gt;alert(1)&lt;/script&gt;" in out
    assert "&lt;b&gt;prompt&lt;/b&gt;" in out
    assert " a &amp; b" in out and "**md**" in out and "&quot;q&quot;" in out
    assert ">\n    </span>" in out  # newline + indentation kept literally
    assert "white-space:pre-wrap" in out
    # provenance: kind classes, alternating shades by step, tooltip with the numbers
    assert out.count("dt-tok dt-accepted dt-s0") == 1 and out.count("dt-tok dt-bonus dt-s0") == 1
    assert out.count("dt-tok dt-accepted dt-s1") == 2 and out.count("dt-tok dt-bonus dt-s1") == 1
    assert TEXT_SHADES["accepted"][0] in out and TEXT_SHADES["accepted"][1] in out
    assert TEXT_SHADES["bonus"][0] in out and TEXT_SHADES["bonus"][1] in out
    assert html.escape("step 1 · accepted draft token · token id 4") in out
    assert "depth 2 · node 4" in out and "p_draft 0.100 · p_target 0.200 · accept prob 0.500" in out


def test_colouring_follows_provenance_not_text():
    """The same text as an accepted and as a bonus token gets each token's own colour."""
    tok = _MapTokenizer({7: "ab", 8: "ab"})
    traces = [_trace(0, [TokenProvenance(7, 0, 1, 1, "accepted", 0.5, 0.5, 1.0), TokenProvenance(8, 0, 2, -1, "bonus")]),
              _trace(1, [TokenProvenance(8, 1, 1, -1, "bonus"), TokenProvenance(7, 1, 1, 2, "accepted", 0.4, 0.4, 1.0)])]
    spans = build_spans(traces, TokenTexts(tok))
    assert [(s.text, s.kind, s.step) for s in spans] == [("ab", "accepted", 0), ("ab", "bonus", 0),
                                                         ("ab", "bonus", 1), ("ab", "accepted", 1)]


def test_split_utf8_character_is_joined_by_ids():
    e_acute = "é".encode()
    tok = _MapTokenizer({10: "x", 11: e_acute[:1], 12: e_acute[1:], 13: "y"})
    groups = group_pieces(TokenTexts(tok), [10, 11, 12, 13])
    assert groups == [(0, 1, "x"), (1, 3, "é"), (3, 4, "y")]


def test_colored_text_of_a_real_run(tree_run, ar_run):
    for run in [r for r in (tree_run, ar_run) if r is not None]:
        spans = build_spans(run.traces, run.texts)
        provs = [c for t in run.traces for c in t.committed]
        assert len(spans) == len(provs) == run.settings.max_new_tokens
        assert [s.kind for s in spans] == [p.kind for p in provs]
        assert "".join(s.text for s in spans) == "".join(f"t{p.token_id} " for p in provs)
        out = render_html(spans)
        assert out.count('class="dt-tok') == len(provs)


def test_text_figure_layout_wraps_and_breaks_lines():
    segs, lines = layout_segments([("abc\nde", None), ("fghij", None)], columns=4)
    assert [(ln, col, t) for ln, col, t, _ in segs] == [(0, 0, "abc"), (1, 0, "de"), (1, 2, "fg"), (2, 0, "hij")]
    assert lines == 3


# ---------------------------------------------------------------------- export
def test_json_export_round_trips(tree_run, ar_run, tmp_path):
    run = tree_run if tree_run is not None else ar_run
    path = write_json(run, tmp_path / "run.json")
    data = json.loads(path.read_text())
    assert data["format"] == "dyntree.run/1"
    assert len(data["steps"]) == len(run.traces)
    assert data["steps"][0] == json.loads(json.dumps(run.traces[0].to_dict()))
    assert data["prompt_ids"] == run.prompt_ids
    ids = [c["token_id"] for s in data["steps"] for c in s["committed"]]
    assert all(data["token_texts"][str(i)] == f"t{i} " for i in ids)
    assert traces_json(run)["summary"]["tokens"] == len(ids)


def test_png_and_svg_export(tree_run, ar_run, tmp_path):
    try:
        find_browser()
    except ExportError as e:
        pytest.skip(str(e))
    run = tree_run if tree_run is not None else ar_run
    trace = _tree_traces(tree_run)[0]
    spans = build_spans(run.traces, run.texts)
    figs = {"tree": tree_figure(trace, run.texts, 3), "masks": masks_figure(trace, 16),
            "text": text_figure(spans, prompt="a <b> & c")}
    files = write_images(figs, tmp_path, ("png", "svg"))
    assert sorted(p.name for p in files) == sorted(f"{n}.{f}" for n in figs for f in ("png", "svg"))
    for p in files:
        data = p.read_bytes()
        if p.suffix == ".png":
            assert data[:8] == b"\x89PNG\r\n\x1a\n"
        else:
            root = ET.fromstring(data)
            assert root.tag.endswith("svg")
    shown = "".join(ET.fromstring((tmp_path / "text.svg").read_bytes()).itertext()).replace("\u00a0", " ")
    assert "t%d " % run.traces[0].committed[0].token_id in shown
    assert "a <b> & c" in shown  # the prompt's markup is shown literally, not interpreted


# ---------------------------------------------------------------------- settings, providers, session
def test_settings_validation():
    with pytest.raises(ConfigError):
        _settings(method="opt_tree", verifier="traversal", temperature=0.7).decode_config()
    with pytest.raises(ConfigError):
        _settings(prompt="   ").decode_config()
    with pytest.raises(ConfigError):
        _settings(max_new_tokens=0).decode_config()
    assert _settings(method="opt_tree", verifier="traversal", temperature=0.7).with_method("chain").verifier == "traversal"
    assert _settings(method="chain", verifier="traversal", temperature=0.7).with_method("opt_tree").verifier == "auto"
    assert compatible_verifiers("opt_tree", 0.7) == ["auto", "point_mass"]


def test_verifier_dropdown_offers_only_compatible_choices():
    from ui.controller import Controller

    _verifier_update = Controller.verifier_update
    upd = _verifier_update("dynatree", 0.9, "traversal")
    assert [c[0] for c in upd.choices] == compatible_verifiers("dynatree", 0.9)
    assert upd.value == "auto"
    assert _verifier_update("chain", 0.9, "traversal").value == "traversal"


def test_tiny_provider_refuses_other_models(provider):
    with pytest.raises(ModelLoadError):
        provider.load(PairSpec("embedded", "tiny"))


def test_generation_step_and_stop_keep_what_was_produced(provider):
    gen = start_generation(provider, _settings(method="chain", max_new_tokens=40))
    assert gen.record.traces == []
    first = gen.next_step()
    assert first is not None and len(gen.record.traces) == 1
    gen.next_step()
    produced = gen.record.token_ids
    gen.stop_now()
    assert gen.done and gen.record.status == "stopped"
    assert gen.next_step() is None
    assert gen.record.token_ids == produced and 2 <= len(produced) < 40


def test_stop_event_ends_a_running_generation(provider):
    gen = start_generation(provider, _settings(method="chain", max_new_tokens=40))
    gen.next_step()
    gen.stop_event.set()
    last = gen.next_step()
    assert last is not None and last.finish_reason == "stopped"
    assert gen.done and gen.record.status == "stopped"


def test_session_state_is_fresh_per_deepcopy():
    import copy

    from ui.session import SessionState

    s = SessionState()
    s.compare = ["x"]
    assert copy.deepcopy(s).compare == []


def test_build_app_loads_no_model():
    from ui import build_app

    class NoLoad:
        default_draft = "d"
        default_target = "t"

        def load(self, spec):  # pragma: no cover - the assertion is that this never runs
            raise AssertionError("a model was loaded while building the app")

        def is_loaded(self, spec):
            return False

        def loaded_description(self):
            return ""

    demo = build_app(NoLoad())
    ids = {getattr(b, "elem_id", None) for b in demo.blocks.values()}
    for needed in ("run-btn", "pause-btn", "step-btn", "stop-btn", "tree-plot", "mask-bfs", "mask-dfs", "mask-hpd",
                   "speed-plot", "colored-text", "step-slider", "compare-btn", "export-png"):
        assert needed in ids
    # the style that dims a run's stale figures names exactly the Live tab's plots (``views.FIGURE_IDS``)
    import gradio as gr

    from ui.views import FIGURE_IDS

    plots = {b.elem_id for b in demo.blocks.values() if isinstance(b, gr.Plot)}
    assert set(FIGURE_IDS) == plots - {"compare-speed", "compare-steps"}


def test_mask_colour_scale_gives_each_value_its_colour():
    from ui.mask_figure import _COLORSCALE, MASK_COLORS

    def colour_at(t: float) -> str:
        # the last band whose start is <= t (plotly's piecewise-constant reading of flat bands)
        return [c for pos, c in _COLORSCALE if pos <= t + 1e-9][-1]

    for value, expected in enumerate(MASK_COLORS):
        t = value / (len(MASK_COLORS) - 1)
        assert colour_at(t) == expected
        assert colour_at(min(1.0, t + 0.1)) == expected or value == len(MASK_COLORS) - 1


def test_encode_prompt_accepts_batch_encoding_from_chat_templates():
    from ui.runner import encode_prompt

    class ChatTok:
        chat_template = "x"

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            assert messages == [{"role": "user", "content": "hi"}] and add_generation_prompt and tokenize
            return {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1]}  # transformers 5 style

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [[9, 9]]}

    assert encode_prompt(ChatTok(), "hi", chat=True) == [5, 6, 7]
    assert encode_prompt(ChatTok(), "hi", chat=False) == [9, 9]
    with pytest.raises(ConfigError):
        encode_prompt(ChatTok(), "  ", chat=True)


def test_auto_is_resolved_by_the_provider_and_explained(tmp_path, monkeypatch):
    """Method and precisions 'auto': the measured cost model picks them, the record says why."""
    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path))
    provider = TinyModelProvider()
    rec = run_to_end(provider, _settings(method="auto", precision="auto", draft_precision="auto", max_new_tokens=6))
    from dyntree_core.planning.pricing import AUTO_METHODS

    # (which one the tiny pair's millisecond forwards make cheapest varies between runs: hybrid included)
    assert rec.status == "finished" and rec.config.method in AUTO_METHODS
    assert rec.settings.precision == "float32" and rec.settings.draft_precision in ("float32", "int8")
    assert rec.note.startswith("auto:") and "ms/token" in rec.note
    from ui.views import status_line

    assert "auto:" in status_line(rec)
    # a given method keeps its method and shape; only the precisions are chosen
    rec2 = run_to_end(provider, _settings(method="dyspec_greedy", precision="auto", draft_precision="auto",
                                          max_new_tokens=6))
    assert rec2.config.method == "dyspec_greedy" and rec2.config.budget == 24 and rec2.settings.precision == "float32"


def test_compare_hf_assisted_column_is_transformers_on_the_same_pair(provider, ar_run):
    """The Compare tab's fourth column: transformers' assisted generation on the provider's pair. At
    T=0 it is greedy and lossless, so its tokens are the autoregressive run's; its rounds add up
    to its tokens and plot like steps; a set stop event ends it after the first round."""
    import threading

    from ui.runner import HF_ASSISTED_LABEL, run_hf_assisted
    from ui.session import ExternalRun
    from ui.views import compare_views

    run = run_hf_assisted(provider, _settings(method="autoregressive"))
    assert isinstance(run, ExternalRun) and run.label == HF_ASSISTED_LABEL and run.status == "finished"
    assert run.token_ids == ar_run.token_ids and len(run.token_ids) == 12
    assert sum(r.num_committed for r in run.rounds) == 12 and len(run.rounds) >= 2
    assert all(b.elapsed >= a.elapsed for a, b in zip(run.rounds, run.rounds[1:]))
    s = run.summary()
    assert s["tokens"] == 12 and s["tokens_per_s"] > 0 and s["mean_tokens_per_step"] > 1
    texts, stats, speed, per_step = compare_views([ar_run, run])
    assert "transformers assisted" in stats[1] and "tok/s" in stats[1]
    assert "assisted generation" in texts[1] and len(speed.data) == 2
    stop = threading.Event()
    stop.set()
    stopped = run_hf_assisted(provider, _settings(method="autoregressive"), stop)
    assert stopped.status == "stopped" and 0 < len(stopped.token_ids) < 12


def test_a_step_cut_by_max_new_tokens_is_marked_in_tree_walkthrough_and_text(provider):
    """The verifier may accept more than the run has room for: the tree marks the tokens that were
    not kept, the walkthrough says so, and the text holds exactly max new tokens."""
    from ui.walkthrough import walkthrough_html

    found = 0
    for max_new in range(3, 14):
        rec = run_to_end(provider, _settings(method="dyspec_greedy", budget=24, depth=5, max_new_tokens=max_new))
        last = rec.traces[-1]
        assert len(rec.token_ids) == max_new and last.finish_reason == "length"
        verified = len(last.accepted_nodes) - 1 + 1  # accepted draft tokens + the bonus
        dropped = len(last.cut_nodes) + int(last.bonus_cut)
        assert last.num_committed + dropped == verified  # every verified token is kept or marked
        if not dropped:
            continue
        found += 1
        title = tree_figure(last, rec.texts, rec.root_token(len(rec.traces) - 1)).layout.title.text
        assert f"{last.num_committed} kept (max new tokens reached)" in title, title
        page = walkthrough_html(last, rec.texts, None)
        assert f"Only the first {last.num_committed} of the tokens this step verified were kept" in page
        assert "(not kept)" in page
    assert found, "no run ended with a cut step: the test proves nothing"


def test_the_transformers_column_shows_the_prompt_and_colours_each_round():
    from ui.session import ExternalRun, RoundPoint
    from ui.views import external_text_html

    tok = TinyTokenizer(64)
    run = ExternalRun(label="transformers assisted", text="", token_ids=[5, 6, 7, 8, 9],
                      rounds=[RoundPoint(0, 3, 0.1, 3), RoundPoint(1, 2, 0.2, 5)], status="finished",
                      prompt="t1 t2 ", texts=TokenTexts(tok))
    kinds = [(p.step, p.kind) for p in run.provenance()]
    assert kinds == [(0, "accepted"), (0, "accepted"), (0, "bonus"), (1, "accepted"), (1, "bonus")]
    page = external_text_html(run)
    assert 'class="dt-prompt"' in page and "t1 t2" in page
    assert page.count("dt-tok dt-accepted") == 3 and page.count("dt-tok dt-bonus") == 2


def test_the_baseline_line_spans_the_runs_own_steps(tree_run, ar_run):
    fig = tokens_per_step_figure([("tree", tree_run.traces)], ar_run.traces)
    line = next(t for t in fig.data if t.name == "autoregressive (1 / step)")
    assert list(line.x) == [tree_run.traces[0].step, tree_run.traces[-1].step]
    assert len(ar_run.traces) > len(tree_run.traces)  # the baseline has more steps: they must not stretch the axis


def test_an_offloaded_steps_phases_count_the_weight_wait_once():
    """The offloaded target's wait for its weights is part of its forward: the phase bars and the
    step total count it once."""
    from dyntree_core.trace import PhaseTimings

    trace = _hand_trace()
    trace.timings = PhaseTimings(draft=0.010, target_forward=0.100, offload_transfer=0.060, verify=0.005)
    trace.step_seconds = 0.120
    assert trace.timings.total == pytest.approx(0.115)
    fig = phase_figure([trace])
    bars = {b.name: b.x[0] for b in fig.data}
    assert bars["target"] == pytest.approx(40.0) and sum(bars.values()) == pytest.approx(120.0)


def test_a_blank_figure_is_built_once_per_note():
    """The blank figures (before the first run, for missing data) are built once per note and shared (Gradio only
    reads them)."""
    from ui.tree_figure import empty_figure

    first = empty_figure("tokens/s")
    assert empty_figure("tokens/s") is first and empty_figure("tokens/s", height=300) is not first
    assert first.layout.annotations[0].text == "tokens/s"


def test_every_live_figure_is_valid_plotly_and_keeps_its_json(provider, tree_run, ar_run):
    """The panels' figures are built as dicts and wrapped without validation (``ui.plotly_spec``): each must come out
    of plotly's validating constructor unchanged, so a misspelt property, a magic underscore or a value plotly would
    rewrite (an empty list it would drop) fails here. Steps of a tree run (with a walkthrough ring), a text-drafted run, plain decoding, the charts
    with a baseline, the comparison and the blank figures."""
    import plotly.graph_objects as go

    from ui.views import compare_views, run_view, step_view

    suffix = run_to_end(provider, _settings(method="hybrid", budget=13, depth=6, max_new_tokens=16))
    figures = []
    for rec in [r for r in (tree_run, suffix, ar_run) if r is not None]:
        for step in (0, len(rec.traces) // 2, len(rec.traces) - 1):
            for block, decision in ((4, None), (4, 0), (64, None)):  # (64: one block, no grid lines)
                view = step_view(rec, step, block, decision)
                figures += [view.tree, *view.masks, view.phases]
        view = run_view(rec, ar_run, True)
        figures += [view.speed, view.per_step]
    runs = [r for r in (tree_run, suffix, ar_run) if r is not None]
    figures += list(compare_views(runs)[2:]) + list(compare_views(runs[:1])[2:]) + list(compare_views([])[2:])
    empty = step_view(None, None, 16)
    figures += [empty.tree, *empty.masks, empty.phases, phase_figure([])]
    for fig in figures:
        built = json.loads(fig.to_json())
        assert json.loads(go.Figure(fig.to_plotly_json()).to_json()) == built
        assert built["data"] or built["layout"].get("annotations") or "phase timings" in built["layout"]["title"]["text"]
