#!/usr/bin/env bash
# Runs the browser end-to-end test N times in a row (default 20) while the rest of the suite runs
# beside it in a loop, as on a loaded CI machine; prints one line per run and a summary, and exits
# non-zero if any run failed. A flaky test is a broken test: this is how to show it is not.
# Each run gets a fresh DynTree cache holding only the fetched models (as a clean CI machine after
# `make models`): the app's first auto Run measures this machine while the test drives the page.
#   scripts/browser_loop.sh [N]
set -uo pipefail
cd "$(dirname "$0")/.."
runs="${1:-20}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
log_dir="$(mktemp -d -t dyntree-browser-loop-XXXX)"

# the rest of the suite, over and over, until the loop ends: in its own process group, so that one
# signal ends the loop and the pytest it is running (and the app that one may have started)
setsid bash -c 'while true; do
    .venv/bin/python -m pytest -q -p no:cacheprovider -m "not realpair and not browser" -x >>"$1" 2>&1 || true
  done' _ "$log_dir/beside.log" &
beside=$!
trap 'kill -- -"$beside" 2>/dev/null' EXIT
trap 'exit 130' INT TERM

src_cache="${DYNTREE_CACHE:-$HOME/.cache/dyntree}"
passed=0
for i in $(seq 1 "$runs"); do
  start=$(date +%s)
  fresh="$log_dir/cache$i"; mkdir -p "$fresh"
  for d in gguf models; do [ -e "$src_cache/$d" ] && ln -s "$src_cache/$d" "$fresh/$d"; done
  if DYNTREE_CACHE="$fresh" .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_browser.py -k end_to_end \
      >"$log_dir/run$i.log" 2>&1; then
    passed=$((passed + 1)); verdict=passed
  else
    verdict="FAILED (log: $log_dir/run$i.log)"
  fi
  echo "run $i/$runs: $verdict in $(( $(date +%s) - start )) s; load $(cut -d' ' -f1 /proc/loadavg)"
done
echo "test_app_end_to_end: $passed of $runs passed with the rest of the suite running beside it"
[ "$passed" -eq "$runs" ]
