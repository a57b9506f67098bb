#!/usr/bin/env bash
# Runs the whole suite on two pytest-xdist workers (the CI machine has 2 cores); the real-pair
# tests share one worker and one loaded model pair (xdist group "realpair").
# Exit code 5 (no tests collected) is a failure here, never a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
# tests/conftest.py selects the Triton interpreter when there is no CUDA
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1
workers="${DYNTREE_TEST_WORKERS:-2}"
.venv/bin/python -m pytest -ra --durations=30 -n "$workers" --dist loadgroup -p no:cacheprovider "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "no tests were collected: failing"; exit 1; fi
exit "$rc"
