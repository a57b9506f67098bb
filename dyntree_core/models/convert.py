"""GGUF -> safetensors HF directory (float32, dequantized), run once per embedded preset.

``python -m dyntree_core.models.convert FILE.gguf OUT_DIR [--source-sha256 HEX]`` — the fetcher
runs this in a child process so that the dequantization's memory goes back to the OS.

Transformers 5.x loads a GGUF through ``GgufHfQuantizer``; it keeps weights packed when the
``kernels`` package supplies a GGML matmul kernel, so dequantization is requested explicitly with
``GgufConfig(dequantize=True)``. The quantizer marks the model non-serializable, so it is
detached (``hf_quantizer`` / ``config.quantization_config``) before ``save_pretrained``. The marker
file is written last: a directory without it is an unfinished conversion.
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


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def convert_gguf(gguf_path: Path, out_dir: Path, source_sha256: Optional[str] = None) -> dict:
    """Dequantize ``gguf_path`` to a float32 safetensors HF directory ``out_dir`` with tokenizer
    and generation config; returns the record written to the marker file."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    t0 = time.perf_counter()
    gguf_path = Path(gguf_path).resolve()
    print(f"  reading and dequantizing {gguf_path.name} to float32 ...", file=sys.stderr, flush=True)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent),
        gguf_file=gguf_path.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
        attn_implementation="sdpa",
    )
    t_load = time.perf_counter() - t0
    print(f"  dequantized {gguf_path.name} in {t_load:.1f}s (peak RSS {_peak_rss_mib():.0f} MiB)", file=sys.stderr, flush=True)
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)

    # detach the GGUF quantizer: a plain dense float32 model is what we save
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    for attr in ("is_quantized", "quantization_method"):
        if hasattr(model, attr):
            try:
                setattr(model, attr, False if attr == "is_quantized" else None)
            except AttributeError:
                pass
    model.config.dtype = torch.float32
    # keep the tokenizer's special ids consistent in config / generation config
    for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
        tid = getattr(tok, name, None)
        if tid is not None and getattr(model.config, name, None) is None:
            setattr(model.config, name, tid)
    if model.generation_config is not None:
        if model.generation_config.eos_token_id is None and tok.eos_token_id is not None:
            model.generation_config.eos_token_id = tok.eos_token_id
        if model.generation_config.pad_token_id is None and tok.pad_token_id is not None:
            model.generation_config.pad_token_id = tok.pad_token_id
    print(f"  writing safetensors to {out_dir} ...", file=sys.stderr, flush=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tok.save_pretrained(str(out_dir))
    n_params = sum(p.numel() for p in model.parameters())
    rec = {
        "source": gguf_path.name,
        "source_sha256": source_sha256,
        "dtype": "float32",
        "num_parameters": n_params,
        "vocab_size": int(model.get_output_embeddings().weight.shape[0]),
        "tokenizer_len": len(tok),
        "eos_token_id": tok.eos_token_id,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "convert_seconds": time.perf_counter() - t0,
        "dequantize_seconds": t_load,
        "peak_rss_mib": _peak_rss_mib(),
    }
    (out_dir / COMPLETE_MARKER).write_text(json.dumps(rec, indent=1))
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
