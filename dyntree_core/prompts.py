"""Prompt sets shipped with DynTree (``assets/prompts/*.jsonl``; sources and licenses in
``assets/prompts/README.md``; regenerate with ``scripts/extract_prompts.py``).

Each set has two disjoint slices: ``eval`` (benchmarks, demos) and ``calib`` (every 5th record;
used to estimate the Sequoia acceptance vector and other tuned quantities, so that tuning never
sees the evaluation prompts).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

DATASETS: tuple[str, ...] = ("wiki", "news", "code")
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
        dataset: one of ``DATASETS`` (wiki, news, code).
        n: how many; must be in [1, size of the slice].
        split: ``eval``, ``calib`` (disjoint) or ``all``.
    """
    if dataset not in DATASETS:
        raise PromptSetError(f"unknown prompt dataset {dataset!r}; choose one of: {', '.join(DATASETS)}")
    if split not in SPLITS:
        raise PromptSetError(f"unknown split {split!r}; choose one of: {', '.join(SPLITS)}")
    prompts = _read(prompts_dir() / f"{dataset}.jsonl", dataset)
    chosen = [p for p in prompts if split == "all" or p.split == split]
    if n is None:
        return chosen
    if isinstance(n, bool) or not isinstance(n, int) or not (1 <= n <= len(chosen)):
        raise PromptSetError(
            f"n must be an integer in [1, {len(chosen)}] for {dataset}/{split} ({len(chosen)} prompts), got {n!r}"
        )
    return chosen[:n]
