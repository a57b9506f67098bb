"""DynTree app: ``python app.py`` serves the UI on http://127.0.0.1:7860.

Flags: ``--draft/--target`` (default: the embedded Qwen2.5-Coder pair fetched by ``make run``),
``--device cpu|cuda``, ``--port``, ``--host`` (default 127.0.0.1), ``--share`` (off by default),
``--tiny`` (TEST ONLY: a tiny random model pair with a trivial tokenizer; same as DYNTREE_TINY=1).
Models load lazily on the first Run, never at import.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="DynTree: see tree-based speculative decoding in the browser")
    p.add_argument("--draft", default="embedded", help="draft model: 'embedded', a preset, a local dir or a hub id")
    p.add_argument("--target", default="embedded", help="target model: 'embedded', a preset, a local dir or a hub id")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="default dtype in the form (float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: localhost only)")
    p.add_argument("--share", action="store_true", help="create a public Gradio share link (off by default)")
    p.add_argument("--tiny", action="store_true", default=os.environ.get("DYNTREE_TINY") == "1",
                   help="TEST ONLY: serve a tiny random model pair (also DYNTREE_TINY=1)")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from dyntree_core.decode.prepared import resolve_device
    from dyntree_core.config import ConfigError

    try:
        resolve_device(args.device)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from ui import AppDefaults, HubModelProvider, build_app
    from ui.app import serve
    from ui.app_log import configure as log_to_stderr
    from ui.page_script import launch_app_kwargs
    from ui.switch_interval import favour_decoding

    favour_decoding()
    log_to_stderr()  # each Run's load phases and first step, timed from its click

    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.tiny:
        import torch

        from ui.tiny import TinyModelProvider

        torch.set_num_threads(1)  # the tiny pair needs no more; leave a core to the browser under test

        provider = TinyModelProvider()
        # the real app's defaults (Method and precisions auto, its budget/depth/width) with a prompt the
        # tiny tokenizer reads and fewer tokens
        defaults = AppDefaults(device=args.device, dtype="float32", prompt="t1 t2 t3 t4 t5", chat=False,
                               max_new_tokens=24, title="DynTree (tiny test pair)")
    else:
        provider = HubModelProvider(args.draft, args.target)
        defaults = AppDefaults(device=args.device, dtype=dtype)
    demo = build_app(provider, defaults)
    # (until Ctrl-C; then no thread may be left inside torch as the interpreter exits)
    serve(demo, server_name=args.host, server_port=args.port, share=args.share,
          css_paths=[HERE / "assets" / "ui.css"], footer_links=["gradio", "settings"], app_kwargs=launch_app_kwargs())
    return 0


if __name__ == "__main__":
    sys.exit(main())
