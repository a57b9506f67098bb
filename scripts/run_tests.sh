#!/usr/bin/env bash
# Runs the whole suite. Exit code 5 (no tests collected) is a failure here, never a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
# tests/conftest.py selects the Triton interpreter when there is no CUDA
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1
.venv/bin/python -m pytest -ra --durations=25 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "no tests were collected: failing"; exit 1; fi
exit "$rc"
