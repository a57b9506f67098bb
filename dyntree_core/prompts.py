"""Prompt sets shipped with DynTree (``assets/prompts/*.jsonl``; sources and licenses in
``assets/prompts/README.md``; regenerate with ``scripts/extract_prompts.py``).

Each set has two disjoint slices: ``eval`` (benchmarks, demos) and ``calib`` (every 5th record;
used to estimate the Sequoia acceptance vector and other tuned quantities, so that tuning never
sees the evaluation prompts).

``repeat`` is derived, not shipped: each code prompt becomes an edit request that quotes it ("rename
``x`` to ``y`` in this code … the code with ``x`` renamed:"), so the answer mostly repeats text already
in the prompt, the regime of prompt-lookup and suffix drafting. Its splits follow the code prompts'.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

DATASETS: tuple[str, ...] = ("wiki", "news", "code")
#: sets built from the shipped ones (no file of their own)
DERIVED_DATASETS: tuple[str, ...] = ("repeat",)
ALL_DATASETS: tuple[str, ...] = DATASETS + DERIVED_DATASETS
SPLITS: tuple[str, ...] = ("eval", "calib", "all")

#: environment variable that overrides where the JSONL files are looked up
PROMPTS_DIR_ENV = "DYNTREE_PROMPTS_DIR"


class PromptSetError(ValueError):
    """Unknown dataset / split, bad ``n``, or a missing or malformed prompt file."""


@dataclass(frozen=True)
class Prompt:
    """One prompt: ``id`` is unique within its dataset; ``source`` is the attribution line."""

    id: str
    text: str
    source: str
    dataset: str
    split: str
    title: Optional[str] = None
    url: Optional[str] = None


def _candidate_dirs() -> list[Path]:
    dirs: list[Path] = []
    env = os.environ.get(PROMPTS_DIR_ENV)
    if env:
        dirs.append(Path(env).expanduser())
    here = Path(__file__).resolve().parent
    dirs.append(here.parent / "assets" / "prompts")  # source checkout / editable install
    dirs.append(here / "assets" / "prompts")  # packaged copy, if the build adds one
    return dirs


def prompts_dir() -> Path:
    """The directory holding ``wiki.jsonl``, ``news.jsonl`` and ``code.jsonl``."""
    tried = _candidate_dirs()
    for d in tried:
        if all((d / f"{name}.jsonl").is_file() for name in DATASETS):
            return d
    raise PromptSetError(
        "prompt files not found; looked in: " + ", ".join(str(d) for d in tried)
        + f". Set {PROMPTS_DIR_ENV} or regenerate them with scripts/extract_prompts.py"
    )


@lru_cache(maxsize=None)
def _read(path: Path, dataset: str) -> tuple[Prompt, ...]:
    out: list[Prompt] = []
    seen: set[str] = set()
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                p = Prompt(
                    id=str(rec["id"]), text=str(rec["text"]), source=str(rec["source"]), dataset=dataset,
                    split=str(rec["split"]), title=rec.get("title"), url=rec.get("url"),
                )
            except (ValueError, KeyError, TypeError) as e:
                raise PromptSetError(f"{path}:{lineno}: malformed prompt record ({e})") from None
            if p.split not in ("eval", "calib"):
                raise PromptSetError(f"{path}:{lineno}: split must be 'eval' or 'calib', got {p.split!r}")
            if not p.text.strip():
                raise PromptSetError(f"{path}:{lineno}: empty prompt text (id {p.id})")
            if p.id in seen:
                raise PromptSetError(f"{path}:{lineno}: duplicate id {p.id}")
            seen.add(p.id)
            out.append(p)
    return tuple(out)


def load_prompts(dataset: str, n: Optional[int] = None, split: str = "eval") -> list[Prompt]:
    """The first ``n`` prompts (all when ``None``) of ``dataset``'s ``split`` slice, in file order.

    Args:
        dataset: one of ``ALL_DATASETS`` (wiki, news, code, repeat).
        n: how many; must be in [1, size of the slice].
        split: ``eval``, ``calib`` (disjoint) or ``all``.
    """
    if dataset not in ALL_DATASETS:
        raise PromptSetError(f"unknown prompt dataset {dataset!r}; choose one of: {', '.join(ALL_DATASETS)}")
    if split not in SPLITS:
        raise PromptSetError(f"unknown split {split!r}; choose one of: {', '.join(SPLITS)}")
    if dataset == "repeat":
        prompts = _repeat_prompts(_read(prompts_dir() / "code.jsonl", "code"))
    else:
        prompts = _read(prompts_dir() / f"{dataset}.jsonl", dataset)
    chosen = [p for p in prompts if split == "all" or p.split == split]
    if n is None:
        return chosen
    if isinstance(n, bool) or not isinstance(n, int) or not (1 <= n <= len(chosen)):
        raise PromptSetError(
            f"n must be an integer in [1, {len(chosen)}] for {dataset}/{split} ({len(chosen)} prompts), got {n!r}"
        )
    return chosen[:n]


_KEYWORDS = frozenset("""
False None True and as assert async await break class continue def del elif else except finally for from
global if import in is lambda nonlocal not or pass raise return try while with yield self cls int float str
bool list dict set tuple len range print sum min max abs sorted enumerate zip map filter any all List Dict
Tuple Optional Set Any Union type isinstance object super open round""".split())
_IDENTIFIER = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b")


def rename_target(code: str) -> Optional[tuple[str, str]]:
    """``(old, new)``: the identifier named most often in ``code`` (at least twice, 3+ characters, not a
    keyword or common builtin; first seen wins ties) and its new name (camelCase for snake_case names,
    else ``the_<name>``); ``None`` when no identifier qualifies."""
    counts: dict[str, int] = {}
    for name in _IDENTIFIER.findall(code):
        if len(name) >= 3 and name not in _KEYWORDS:
            counts[name] = counts.get(name, 0) + 1
    best = max(counts.items(), key=lambda kv: kv[1], default=None)  # max keeps the first of equals
    if best is None or best[1] < 2:
        return None
    old = best[0]
    head, *rest = old.strip("_").split("_")
    new = head + "".join(w[:1].upper() + w[1:] for w in rest) if rest and head else f"the_{old}"
    return old, new


def rename(code: str, old: str, new: str) -> str:
    """``code`` with every whole-word ``old`` replaced by ``new``."""
    return re.sub(rf"\b{re.escape(old)}\b", new, code)


def repeat_prompt_text(code: str, old: str, new: str) -> str:
    """The edit request for ``code``; its ideal continuation is ``rename(code, old, new)`` after the
    opening fence."""
    return (f"Rename `{old}` to `{new}` in the code below. Change nothing else.\n\n```\n{code.strip(chr(10))}\n```\n\n"
            f"The same code with `{old}` renamed to `{new}`:\n\n```\n")


@lru_cache(maxsize=None)
def _repeat_prompts(code_prompts: tuple[Prompt, ...]) -> tuple[Prompt, ...]:
    out = []
    for p in code_prompts:
        target = rename_target(p.text)
        if target is None:
            continue
        old, new = target
        out.append(Prompt(id=f"repeat-{p.id}", text=repeat_prompt_text(p.text, old, new),
                          source=f"rename request built from {p.id}: {p.source}", dataset="repeat",
                          split=p.split, title=f"rename {old} -> {new} in {p.title or p.id}", url=p.url))
    return tuple(out)
