"""The documentation against the tree it documents: the module map in docs/ARCHITECTURE.md names
every module and only modules that exist, the README stays short, and no relative link is dead."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250
MAPPED_PACKAGES = ("dyntree_core", "ui")

_MAP_PATH = re.compile(r"`((?:dyntree_core|ui|scripts)/[\w./-]+\.(?:py|sh)|app\.py)`")
# [text](target) and ![alt](target); the target ends at whitespace or ')' (an optional "title" is ignored)
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def module_map() -> set[str]:
    """Every file path named in backticks in ARCHITECTURE.md's "Module map" section."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("\n## Module map", 1)[1].split("\n## ", 1)[0]
    return set(_MAP_PATH.findall(section))


def package_modules() -> set[str]:
    """Every .py file under the mapped packages, except empty ``__init__.py`` package markers."""
    found = set()
    for pkg in MAPPED_PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            if path.name == "__init__.py" and not path.read_text().strip():
                continue
            found.add(path.relative_to(ROOT).as_posix())
    return found


def relative_links(md: Path) -> list[str]:
    """Link targets in a Markdown file that point into the repository (not URLs or anchors),
    with code spans and fenced blocks left out."""
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    out = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue
        out.append(unquote(target.split("#", 1)[0]))
    return out


def test_the_module_map_names_every_module_and_nothing_else() -> None:
    mapped, modules = module_map(), package_modules()
    assert len(modules) > 50  # the walk found the packages
    missing = sorted(modules - {m for m in mapped if m.split("/", 1)[0] in MAPPED_PACKAGES})
    assert not missing, f"modules missing from docs/ARCHITECTURE.md's module map: {missing}"
    stale = sorted(m for m in mapped if not (ROOT / m).is_file())
    assert not stale, f"docs/ARCHITECTURE.md's module map names files that do not exist: {stale}"


def test_readme_is_at_most_250_lines() -> None:
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move detail to docs/"


def test_every_relative_link_in_the_readme_and_docs_points_to_a_file() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages) >= 5
    dead = []
    for page in pages:
        links = relative_links(page)
        for target in links:
            if not (page.parent / target).exists():
                dead.append(f"{page.relative_to(ROOT)}: {target}")
    assert not dead, f"dead relative links: {dead}"


def test_the_link_check_sees_links_and_skips_urls_anchors_and_code(tmp_path) -> None:
    md = tmp_path / "x.md"
    md.write_text("see [a](docs/A.md#part), ![img](assets/s.png \"t\"), [web](https://x.org), [top](#top),\n"
                  "`[not](a link)` and\n```\n[nor](this)\n```\n")
    assert relative_links(md) == ["docs/A.md", "assets/s.png"]
