#!/usr/bin/env bash
# Issue 18 device call: the SHUFFLE cache-order reads (SHUFFLE_LINES). GPU tests of the paged
# suite's SHUFFLE and vector-load cases, then bench_paged --shuffle with the switch on and off.
# Usage on the GPU machine, from the repository root:  bash bench/i18_shuffle_session.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/portattn-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -m pytest -q -m gpu tests/kernels/test_paged_attention.py tests/compile/test_vector_loads.py \
  tests/kernels/test_plan_cache.py 2>&1 | tail -6 | tee "$OUT/tests_paged.log"
for lines in 1 0; do
  timeout 200 python3 bench/bench_paged.py --shuffle --set SHUFFLE_LINES=$lines \
    > "$OUT/bench_shuffle_lines$lines.log" 2>&1
  echo "== SHUFFLE_LINES=$lines"; cat "$OUT/bench_shuffle_lines$lines.log"
done
