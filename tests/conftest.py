"""Suite-wide set-up. Triton's interpreter must be chosen before anything imports Triton
(transformers does on import), so this runs first: on machines without CUDA every Triton
kernel in the suite runs on the CPU through the interpreter."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
