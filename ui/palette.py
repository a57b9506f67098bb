"""Colours shared by the tree, the masks, the colored text and the exports."""

from __future__ import annotations

NODE_COLORS: dict[str, str] = {
    "root": "#6b6b6b",
    "accepted": "#2ca02c",
    "rejected": "#d62728",
    "unverified": "#c7c7c7",
    "bonus": "#8c4fd0",
    "cut": "#b8e0b0",
}
NODE_LABELS: dict[str, str] = {
    "root": "root (last committed token)",
    "accepted": "accepted draft token",
    "rejected": "rejected by the verifier",
    "unverified": "never verified",
    "bonus": "bonus token (from the target)",
    "cut": "accepted, but past the run's end (not kept)",
}
#: draft-tree node shape and outline by what proposed the tokens (``StepTrace.draft_source``)
SOURCE_SYMBOLS: dict[str, str] = {"model": "circle", "suffix": "square", "repeats": "square"}
SOURCE_EDGE: dict[str, str] = {"model": "#333333", "suffix": "#0f8b8d", "repeats": "#0f8b8d"}
SOURCE_LABELS: dict[str, str] = {
    "model": "drafted by the draft model",
    "suffix": "drafted from the text so far (suffix tree)",
    "repeats": "the text's own repeats, priced to pay here (suffix tree, no draft forward)",
}
#: text background per token kind, two shades alternating by step parity
TEXT_SHADES: dict[str, tuple[str, str]] = {
    "accepted": ("#c9efc9", "#9fdc9f"),
    "bonus": ("#e6d5f7", "#ccb0ef"),
    "autoregressive": ("#e8e8e8", "#d2d2d2"),
}
TEXT_KIND_LABELS: dict[str, str] = {
    "accepted": "accepted draft token",
    "bonus": "bonus token (target)",
    "autoregressive": "autoregressive token",
}
PROMPT_COLOR = "#777777"
METHOD_COLORS: tuple[str, ...] = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2")
BASELINE_COLOR = "#555555"
PHASE_COLORS: dict[str, str] = {
    "draft": "#1f77b4",
    "tree_build": "#aec7e8",
    "mask": "#ffbb78",
    "target_forward": "#d62728",
    "verify": "#2ca02c",
    "kv_compaction": "#9467bd",
    "offload_transfer": "#8c564b",
}
PHASE_LABELS: dict[str, str] = {
    "draft": "draft",
    "tree_build": "tree build",
    "mask": "mask",
    "target_forward": "target",
    "verify": "verify",
    "kv_compaction": "kv",
    "offload_transfer": "waiting for offloaded weights (in the forward)",
}


def text_shade(kind: str, step: int) -> str:
    shades = TEXT_SHADES.get(kind, TEXT_SHADES["autoregressive"])
    return shades[step % 2]
