"""The page's components: ``build_layout`` places them (inside an open ``gr.Blocks``) and returns
them by name in ``Components``; the controller and the wiring refer to them only by these names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gradio as gr

from dyntree_core.config import DTYPES
from dyntree_core.methods import REGISTRY
from dyntree_core.tree import BLOCK_SIZES

from .mask_figure import MASK_LEGEND
from .memory import memory_line
from .prompt_check import LONG_PROMPT_CHOICES, MAX_PROMPT_TOKENS
from .runner import HF_ASSISTED_LABEL
from .settings import (AUTO, MAX_NEW_TOKENS, METHOD_CHOICES, METHOD_PARAMS, PRECISION_CHOICES, TEMPERATURE_MAX,
                       TREE_METHODS)
from .views import run_view, step_view

#: the mask view's default block: at the app's default budget (32) BFS, DFS and HPD all have 3 of
#: 4 non-empty 16-blocks, while 8-blocks show the reordering (tiny pair, 30 tokens: 118 vs 102/105
#: at T=0). The kernel's own tiles are 16-64 (``BLOCK_SIZES``); 8 is a view of the structure.
VIEW_BLOCK = 8
N_COMPARE = 4  # Compare columns: autoregressive, chain, tree, transformers assisted
METHOD_HINTS: dict[str, str] = {
    AUTO: "auto: this machine's measured cost model picks the method, its shape and each model's precision "
          "(plain decoding when no tree pays for itself here); the status line says why.",
    **{m.name: m.hint for m in REGISTRY.values()},
}


@dataclass(frozen=True)
class AppDefaults:
    """Initial values of the form (the CLI fills these)."""

    device: str = "cpu"
    dtype: str = "float32"
    prompt: str = "Write a Python function that returns the n-th Fibonacci number."
    chat: bool = True
    method: str = AUTO
    precision: str = AUTO
    draft_precision: str = AUTO
    max_new_tokens: int = 64
    budget: int = 32
    depth: int = 6
    width: int = 4
    title: str = "DynTree"


def verifier_choices(method: str, temperature: float) -> list[str]:
    from dyntree_core.config import compatible_verifiers

    return ["auto"] if method == AUTO else compatible_verifiers(method, float(temperature or 0.0))


@dataclass(frozen=True)
class Components:
    """Every component an event reads or writes, by name."""

    draft: Any
    target: Any
    device: Any
    dtype: Any
    precision: Any
    draft_precision: Any
    offload: Any
    prompt: Any
    prompt_info: Any
    long_prompt: Any
    chat: Any
    example: Any
    method: Any
    method_hint: Any
    verifier: Any
    temperature: Any
    top_p: Any
    budget: Any
    depth: Any
    width: Any
    threshold: Any
    max_new: Any
    seed: Any
    with_baseline: Any
    run_btn: Any
    pause_btn: Any
    step_btn: Any
    stop_btn: Any
    status: Any
    error_box: Any
    text_html: Any
    step_slider: Any
    block_size: Any
    tree_plot: Any
    walk_prev: Any
    walk_next: Any
    walkthrough: Any
    mask_bfs: Any
    mask_dfs: Any
    mask_hpd: Any
    cost_model: Any
    speed_plot: Any
    steps_plot: Any
    phase_plot: Any
    png_btn: Any
    svg_btn: Any
    json_btn: Any
    export_files: Any
    open_run: Any
    cmp_method: Any
    cmp_hf: Any
    cmp_btn: Any
    cmp_stop: Any
    cmp_status: Any
    cmp_speed: Any
    cmp_steps: Any
    cmp_texts: tuple[Any, ...]
    cmp_stats: tuple[Any, ...]
    memory: Any

    @property
    def form(self) -> list[Any]:
        """The run settings, in ``settings.settings_from_form``'s argument order."""
        return [self.draft, self.target, self.device, self.dtype, self.prompt, self.chat, self.method, self.verifier,
                self.temperature, self.top_p, self.budget, self.depth, self.width, self.threshold, self.max_new,
                self.seed, self.offload, self.precision, self.draft_precision, self.long_prompt]

    @property
    def masks(self) -> tuple[Any, Any, Any]:
        return (self.mask_bfs, self.mask_dfs, self.mask_hpd)

    @property
    def step_outputs(self) -> list[Any]:
        """What selecting another step redraws."""
        return [self.tree_plot, *self.masks, self.phase_plot, self.walkthrough]

    @property
    def live_outputs(self) -> list[Any]:
        """Everything the Live tab's refresh tick draws (its only writer)."""
        return [*self.step_outputs, self.text_html, self.cost_model, self.speed_plot, self.steps_plot, self.status,
                self.step_slider, self.error_box, self.pause_btn, self.memory]

    @property
    def compare_outputs(self) -> list[Any]:
        return [*self.cmp_texts, *self.cmp_stats, self.cmp_speed, self.cmp_steps, self.cmp_status]


#: page-wide rules: the inline error line in red; disabled inputs visibly disabled
PAGE_STYLE = ("<style>#error-box .prose, #error-box .prose *{color:#b42318 !important}"
              "input:disabled, textarea:disabled{opacity:0.45;cursor:not-allowed}"
              "#colored-text .dt-text{max-height:420px;overflow-y:auto}</style>")


def build_layout(default_draft: str, default_target: str, defaults: AppDefaults, cuda: bool,
                 examples: list[tuple[str, str]]) -> Components:
    """Place the controls (left) and the Live / Compare tabs (right); call inside ``gr.Blocks``."""
    with gr.Row(equal_height=False):
        # ---------------------------------------------------------------- controls
        with gr.Column(scale=1, min_width=330, elem_id="controls"):
            with gr.Accordion("Model pair", open=False, elem_id="model-pair"):
                draft = gr.Textbox(default_draft, label="Draft model",
                                   info="'embedded', a preset, a local dir or a hub id", elem_id="draft-model")
                target = gr.Textbox(default_target, label="Target model", elem_id="target-model")
                with gr.Row():
                    device = gr.Dropdown(["cpu", "cuda"] if cuda else ["cpu"], value=defaults.device,
                                         label="Device", elem_id="device")
                    dtype = gr.Dropdown(list(DTYPES), value=defaults.dtype, label="dtype", elem_id="dtype",
                                        info="of float weights and of the activations between layers; "
                                             "int8/int4 layers keep their low-bit weights")
                with gr.Row():
                    precision = gr.Dropdown(list(PRECISION_CHOICES), value=defaults.precision,
                                            label="Target precision", elem_id="precision",
                                            info="auto: measured on this machine (first Run profiles it, then cached)")
                    draft_precision = gr.Dropdown(list(PRECISION_CHOICES), value=defaults.draft_precision,
                                                  label="Draft precision", elem_id="draft-precision")
                offload = gr.Checkbox(False, label="Offload the target's layers to host memory (CUDA)",
                                      visible=cuda, elem_id="offload")
            prompt = gr.Textbox(defaults.prompt, lines=3, max_lines=12, label="Prompt", elem_id="prompt")
            prompt_info = gr.Markdown("", elem_id="prompt-info")
            with gr.Row():
                chat = gr.Checkbox(defaults.chat, label="Chat template", elem_id="chat",
                                   info="wrap the prompt when the tokenizer has one")
                example = gr.Dropdown([label for label, _ in examples], value=None, label="Example prompt",
                                      visible=bool(examples), elem_id="example-prompt")
            method = gr.Dropdown(list(METHOD_CHOICES), value=defaults.method, label="Method", elem_id="method")
            method_hint = gr.Markdown(METHOD_HINTS.get(defaults.method, ""), elem_id="method-hint")
            with gr.Row(elem_id="run-controls"):
                run_btn = gr.Button("Run", variant="primary", elem_id="run-btn", min_width=60)
                pause_btn = gr.Button("Pause", elem_id="pause-btn", min_width=60)
                step_btn = gr.Button("Step", elem_id="step-btn", min_width=60)
                stop_btn = gr.Button("Stop", variant="stop", elem_id="stop-btn", min_width=60)
            error_box = gr.Markdown("", elem_id="error-box")
            with gr.Accordion("Decoding settings", open=True, elem_id="decoding-settings"):
                verifier = gr.Dropdown(verifier_choices(defaults.method, 0.0), value="auto",
                                       label="Verifier (lossless choices only)", elem_id="verifier")
                # no minimum/maximum on these numbers: Gradio would answer an out-of-range value with a
                # bare "Error" (and a traceback in the log); a slider also clamps a typed value into its
                # range on blur, so -1 ran as 0. RunSettings/DecodeConfig name the field and its range inline.
                with gr.Row():
                    temperature = gr.Number(0.0, label=f"Temperature (0-{TEMPERATURE_MAX:g}, 0 = greedy)", step=0.05,
                                            elem_id="temperature")
                    top_p = gr.Number(1.0, label="Top-p (over 0, up to 1)", step=0.05, elem_id="top-p")
                used = METHOD_PARAMS.get(defaults.method, frozenset())
                with gr.Row():
                    budget = gr.Number(defaults.budget, label="Budget (nodes incl. root, 2-4096)", precision=0,
                                       interactive="budget" in used, elem_id="budget")
                    depth = gr.Number(defaults.depth, label="Depth (1-256)", precision=0,
                                      interactive="depth" in used, elem_id="depth")
                with gr.Row():
                    width = gr.Number(defaults.width, label="Width (1-256)", precision=0,
                                      interactive="width" in used, elem_id="width")
                    threshold = gr.Number(0.05, label="Threshold (0-1)", step=0.01,
                                          interactive="threshold" in used, elem_id="threshold")
                with gr.Row():
                    max_new = gr.Number(defaults.max_new_tokens, label=f"Max new tokens (1-{MAX_NEW_TOKENS})",
                                        precision=0, elem_id="max-new-tokens")
                    seed = gr.Number(0, label="Seed (0 or more)", precision=0, elem_id="seed")
                long_prompt = gr.Radio(list(LONG_PROMPT_CHOICES), value="refuse", elem_id="long-prompt",
                                       label=f"Long prompt (over {MAX_PROMPT_TOKENS:,} tokens or the context)")
                with_baseline = gr.Checkbox(False, label="Then run the autoregressive baseline (same prompt, seed, "
                                            "length)", elem_id="with-baseline")
            gr.HTML(PAGE_STYLE, elem_id="page-style", padding=False)

        # ---------------------------------------------------------------- panels
        with gr.Column(scale=3, min_width=600):
            with gr.Tabs():
                with gr.Tab("Live", id="live", elem_id="live-tab"):
                    # the run's status line heads the panels it describes, at their width: auto's
                    # explanation in it (several hundred characters) fits a 1280x800 screen there; in
                    # the 330 px controls column it began at 654 px and ran under the fold
                    status = gr.Markdown("Idle. Press Run, or Step through one step at a time.", elem_id="status")
                    text_html = gr.HTML(run_view(None, None).text_html, elem_id="colored-text")
                    with gr.Accordion("Why is it faster or slower than plain decoding here? (cost model)", open=True,
                                      elem_id="cost-model-box"):
                        cost_model = gr.HTML(run_view(None, None).cost, elem_id="cost-model")
                    with gr.Row():
                        step_slider = gr.Slider(0, 1, value=0, step=1, label="Step (drag to revisit an earlier step)",
                                                interactive=False, elem_id="step-slider", scale=4)
                        block_size = gr.Radio([VIEW_BLOCK, *BLOCK_SIZES], value=VIEW_BLOCK,
                                              label="Mask block size (kernel tiles: 16-64)",
                                              elem_id="block-size", scale=1)
                    empty = step_view(None, None, VIEW_BLOCK)
                    tree_plot = gr.Plot(empty.tree, label="Draft tree", elem_id="tree-plot")
                    with gr.Accordion("How the verifier decided (walkthrough)", open=True, elem_id="walkthrough-box"):
                        with gr.Row():
                            walk_prev = gr.Button("◀ Previous decision", elem_id="walk-prev", size="sm")
                            walk_next = gr.Button("Next decision ▶", elem_id="walk-next", size="sm")
                        walkthrough = gr.HTML(empty.walkthrough, elem_id="verify-walkthrough")
                    gr.Markdown(f"**Tree attention mask** of the selected step in three node orders. {MASK_LEGEND}",
                                elem_id="mask-caption")
                    with gr.Row():
                        mask_bfs = gr.Plot(empty.masks[0], label="Mask, BFS (original) order", elem_id="mask-bfs")
                        mask_dfs = gr.Plot(empty.masks[1], label="Mask, DFS order", elem_id="mask-dfs")
                        mask_hpd = gr.Plot(empty.masks[2], label="Mask, HPD order", elem_id="mask-hpd")
                    with gr.Row():
                        speed_plot = gr.Plot(run_view(None, None).speed, label="Tokens/s", elem_id="speed-plot")
                        steps_plot = gr.Plot(run_view(None, None).per_step, label="Tokens per step",
                                             elem_id="tokens-per-step-plot")
                    phase_plot = gr.Plot(empty.phases, label="Phase timings", elem_id="phase-plot")
                    with gr.Accordion("Export", open=False, elem_id="export"):
                        gr.Markdown("Tree and masks of the selected step, the coloured text and the tokens/s "
                                    "chart as images (headless Chromium via kaleido), or the run's StepTraces as JSON.")
                        with gr.Row():
                            png_btn = gr.Button("PNG", elem_id="export-png")
                            svg_btn = gr.Button("SVG", elem_id="export-svg")
                            json_btn = gr.Button("JSON (StepTraces)", elem_id="export-json")
                        export_files = gr.File(label="Exported files", file_count="multiple", interactive=False,
                                               elem_id="export-files")
                        open_run = gr.File(label="Open an exported run (JSON): replays its steps, no models needed",
                                           file_types=[".json"], file_count="single", elem_id="open-run")
                with gr.Tab("Compare", id="compare", elem_id="compare-tab"):
                    gr.Markdown("Autoregressive vs chain vs a tree method (default: what `auto` chooses for this "
                                "machine, with its prediction) on the **same** prompt, seed, "
                                "sampling settings and token budget, run one after the other; optionally "
                                "transformers' own assisted generation (`generate(assistant_model=draft)`) "
                                "on the same models as a fourth column.")
                    with gr.Row():
                        cmp_method = gr.Dropdown([AUTO, *TREE_METHODS], value=AUTO, label="Tree method",
                                                 elem_id="compare-method")
                        cmp_hf = gr.Checkbox(value=True, label="+ transformers assisted", elem_id="compare-hf")
                        cmp_btn = gr.Button("Compare", variant="primary", elem_id="compare-btn")
                        cmp_stop = gr.Button("Stop", variant="stop", elem_id="compare-stop")
                    cmp_status = gr.Markdown("", elem_id="compare-status")
                    with gr.Row():
                        cmp_texts, cmp_stats = [], []
                        for i, name in enumerate(("autoregressive", "chain", "tree", HF_ASSISTED_LABEL)):
                            with gr.Column(min_width=240):
                                cmp_stats.append(gr.Markdown(f"**{name}**", elem_id=f"compare-stats-{i}"))
                                cmp_texts.append(gr.HTML("", elem_id=f"compare-text-{i}"))
                    with gr.Row():
                        cmp_speed = gr.Plot(label="Tokens/s", elem_id="compare-speed")
                        cmp_steps = gr.Plot(label="Tokens per step", elem_id="compare-steps")
    memory = gr.Markdown(memory_line(), elem_id="memory-footer")

    return Components(
        draft=draft,
        target=target,
        device=device,
        dtype=dtype,
        precision=precision,
        draft_precision=draft_precision,
        offload=offload,
        prompt=prompt,
        prompt_info=prompt_info,
        long_prompt=long_prompt,
        chat=chat,
        example=example,
        method=method,
        method_hint=method_hint,
        verifier=verifier,
        temperature=temperature,
        top_p=top_p,
        budget=budget,
        depth=depth,
        width=width,
        threshold=threshold,
        max_new=max_new,
        seed=seed,
        with_baseline=with_baseline,
        run_btn=run_btn,
        pause_btn=pause_btn,
        step_btn=step_btn,
        stop_btn=stop_btn,
        status=status,
        error_box=error_box,
        text_html=text_html,
        step_slider=step_slider,
        block_size=block_size,
        tree_plot=tree_plot,
        walk_prev=walk_prev,
        walk_next=walk_next,
        walkthrough=walkthrough,
        mask_bfs=mask_bfs,
        mask_dfs=mask_dfs,
        mask_hpd=mask_hpd,
        cost_model=cost_model,
        speed_plot=speed_plot,
        steps_plot=steps_plot,
        phase_plot=phase_plot,
        png_btn=png_btn,
        svg_btn=svg_btn,
        json_btn=json_btn,
        export_files=export_files,
        open_run=open_run,
        cmp_method=cmp_method,
        cmp_hf=cmp_hf,
        cmp_btn=cmp_btn,
        cmp_stop=cmp_stop,
        cmp_status=cmp_status,
        cmp_speed=cmp_speed,
        cmp_steps=cmp_steps,
        cmp_texts=tuple(cmp_texts),
        cmp_stats=tuple(cmp_stats),
        memory=memory,
    )
