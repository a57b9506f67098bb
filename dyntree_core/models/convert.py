"""GGUF -> the metadata part of an HF directory, run once per embedded preset.

``python -m dyntree_core.models.convert FILE.gguf OUT_DIR [--source-sha256 HEX]`` writes
``config.json``, the tokenizer files and ``generation_config.json`` read from the GGUF's header
(seconds, little memory). The weights stay in the GGUF: ``models.gguf_model`` builds the model
from it at the precision asked for (int4/int8 packed once into a cache, float32/bfloat16
dequantized at load), so there is no float32 safetensors copy. The marker file is written last:
a directory without it is an unfinished conversion. The fetcher runs this in a child process.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import Optional

COMPLETE_MARKER = ".dyntree-complete"
#: marker ``format`` of this layout; directories of another format (the float32 safetensors
#: conversions of earlier versions) are converted again
DIR_FORMAT = "gguf-direct-1"


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def convert_gguf(gguf_path: Path, out_dir: Path, source_sha256: Optional[str] = None) -> dict:
    """Write the metadata directory of ``gguf_path`` into ``out_dir``; returns the marker record."""
    import torch
    import transformers

    from .gguf_model import write_metadata_dir

    t0 = time.perf_counter()
    gguf_path = Path(gguf_path).resolve()
    print(f"  reading the config and tokenizer of {gguf_path.name} ...", file=sys.stderr, flush=True)
    info = write_metadata_dir(gguf_path, out_dir)
    rec = {
        "format": DIR_FORMAT,
        "source": gguf_path.name,
        "source_path": str(gguf_path),
        "source_sha256": source_sha256,
        **info,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "convert_seconds": time.perf_counter() - t0,
        "peak_rss_mib": _peak_rss_mib(),
    }
    (Path(out_dir) / COMPLETE_MARKER).write_text(json.dumps(rec, indent=1))
    return rec


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--source-sha256", default=None)
    a = ap.parse_args(argv)
    rec = convert_gguf(a.gguf, a.out_dir, a.source_sha256)
    print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
