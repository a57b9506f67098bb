#!/usr/bin/env bash
# A copy of shared/gpu/device-check.sh kept in the repository: the device machine gets the working tree, not ../shared.
# Call the device tool with command="bash scripts/gpu-device-check.sh", carry=[".gpu-wheels"] (after ../shared/gpu/prepare.sh).
# Runs ON the GPU machine (device tool), in the project root: installs .gpu-wheels, then
#   1. python -m dyntree_core.bench gpu (every section, one process) -> $OUT/gpu/
#   2. pytest on the GPU of every file that uses DEVICE (no interpreter) -> $OUT/pytest.log
# Sized for one 10-minute call on an H100/H200 (BENCH_S, TEST_S, TEST_TIMEOUT to change; PYTEST_ARGS, e.g.
# "-n 8" with pytest-xdist and execnet among the wheels, runs the tests in parallel). Everything lands in $OUT.
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .gpu-wheels/*.whl || exit 3
export PYTHONPATH="$SITE":$PWD
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc
  python3 -c "import torch,triton,transformers;print('torch',torch.__version__,'triton',triton.__version__,'transformers',transformers.__version__)"; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
timeout "${BENCH_S:-420}" python3 -m dyntree_core.bench gpu --out "$OUT/gpu" ${BENCH_ARGS:-} > "$OUT/gpu.log" 2>&1
echo "bench rc=$?" >> "$OUT/gpu.log"; grep "^\[bench gpu" "$OUT/gpu.log" | tail -25
# the files that run on DEVICE first (the graph step's before the rest), then the others naming cuda
files=$( (ls tests/test_graph_step.py; grep -l "from conftest import DEVICE" tests/test_*.py; grep -l "DEVICE\|cuda" tests/test_*.py) \
  | awk '!seen[$0]++' | tr '\n' ' ')
timeout "${TEST_S:-120}" python3 -m pytest -v -rfE -p no:cacheprovider --continue-on-collection-errors -m "not realpair and not browser" --timeout "${TEST_TIMEOUT:-60}" ${PYTEST_ARGS:-} $files > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?" >> "$OUT/pytest.log"; grep -E "FAILED|ERROR|passed|failed" "$OUT/pytest.log" | tail -25
