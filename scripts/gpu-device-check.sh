#!/usr/bin/env bash
# A copy of shared/gpu/device-check.sh kept in the repository: the device machine gets the working tree, not ../shared.
# Call the device tool with command="bash scripts/gpu-device-check.sh", carry=[".gpu-wheels"] (after ../shared/gpu/prepare.sh;
# add pytest-xdist and execnet to .gpu-wheels and the tests run on 8 workers: 64 s for the list on the H200).
# Runs ON the GPU machine (device tool), in the project root: installs .gpu-wheels, then
#   1. python -m dyntree_core.bench gpu (every section, one process) -> $OUT/gpu/
#   2. pytest on the GPU of every file that uses DEVICE (no interpreter) -> $OUT/pytest.log
# Sized for one 10-minute call on an H200 from the 2026-11-28 timings, the must-shows first (resident 7B 140-174 s,
# decode_step 91-101 s, kernel oracle 30-40 s, greedy identity 56-86 s, attention 40 s, offload ~60 s + set-up, tests
# 64 s; the offload section, last, is cut when the others ran long): the default BENCH_ARGS leave out the 1.5B target
# (host rows only, ~120 s) and inductor's rows (its tree step compiled for more than 165 s, the draft's two programs
# alone too: graph_inductor_draft). The resident kinds answered on 2026-11-28 (graph_no_cudnn, graph_alphas_loop: no
# gain) are out; graph_torch_layers is the A/B of decode/layer_kernels.py. BENCH_S, TEST_S, TEST_TIMEOUT, BENCH_ARGS and
# PYTEST_ARGS change it. Everything lands in $OUT.
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .gpu-wheels/*.whl || exit 3
export PYTHONPATH="$SITE":$PWD
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc
  python3 -c "import torch,triton,transformers;print('torch',torch.__version__,'triton',triton.__version__,'transformers',transformers.__version__)"; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
DEFAULT_BENCH_ARGS="--sections resident decode_step kernel_oracle greedy_identity attention offload --resident-targets 7B --resident-kinds graph graph_every_level graph_torch_layers graph_host_verify host device_side --resident-seconds 170 --offload-seconds 60"
timeout "${BENCH_S:-470}" python3 -m dyntree_core.bench gpu --out "$OUT/gpu" ${BENCH_ARGS-$DEFAULT_BENCH_ARGS} > "$OUT/gpu.log" 2>&1
echo "bench rc=$?" >> "$OUT/gpu.log"; grep "^\[bench gpu" "$OUT/gpu.log" | tail -25
# the files that run on DEVICE first (the graph step's before the rest), then the others naming cuda
files=$( (ls tests/test_graph_step.py; grep -l "from conftest import DEVICE" tests/test_*.py; grep -l "DEVICE\|cuda" tests/test_*.py) \
  | awk '!seen[$0]++' | tr '\n' ' ')
python3 -c "import xdist" 2>/dev/null && XDIST="-n 8" || XDIST=""
timeout "${TEST_S:-100}" python3 -m pytest -v -rfE -p no:cacheprovider --continue-on-collection-errors -m "not realpair and not browser" --timeout "${TEST_TIMEOUT:-60}" ${PYTEST_ARGS-$XDIST} $files > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?" >> "$OUT/pytest.log"; grep -E "FAILED|ERROR|passed|failed" "$OUT/pytest.log" | tail -25
