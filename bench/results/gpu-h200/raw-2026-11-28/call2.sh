#!/usr/bin/env bash
# second device call of 2026-11-28: the decode_step section after the prefill fix (stacks dumped on timeout),
# the CUDA test files that failed in call 1, the stepper-release probe, the dense forward's kernels by name
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .gpu-wheels/*.whl || exit 3
export PYTHONPATH="$SITE":$PWD
t0=$(date +%s)
timeout -s ABRT ${DS_S:-150} python3 -X faulthandler -m dyntree_core.bench gpu --sections decode_step --out "$OUT/ds" > "$OUT/ds.log" 2>&1
echo "decode_step rc=$? $(( $(date +%s) - t0 )) s" >> "$OUT/ds.log"; grep "^\[bench gpu\|rc=" "$OUT/ds.log" | tail -12
timeout ${T_S:-75} python3 -m pytest -q -rfE -n 6 -p no:cacheprovider --timeout 60 tests/test_graph_step.py tests/test_graph_draft_offload.py tests/test_engine_triton.py > "$OUT/pytest2.log" 2>&1
echo "pytest rc=$? $(( $(date +%s) - t0 )) s" >> "$OUT/pytest2.log"; tail -8 "$OUT/pytest2.log"
timeout 40 python3 probe_tmp/probe_leak.py > "$OUT/leak.log" 2>&1; head -c 3000 "$OUT/leak.log"
timeout 40 python3 probe_tmp/probe_kernels.py > "$OUT/kernels.log" 2>&1; grep -E "rows|profiled" "$OUT/kernels.log"
echo "total $(( $(date +%s) - t0 )) s"
