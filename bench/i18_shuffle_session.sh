#!/usr/bin/env bash
# Issue 18 device call: the SHUFFLE cache-order reads (SHUFFLE_LINES). GPU tests of the paged
# suite's SHUFFLE and vector-load cases, then bench_paged --shuffle; with "ab", once with the
# switch on and once off (an A/B in one machine hold); with "narrow", once as shipped and once
# without SHUFFLE_LINES_NARROW (the 32-token decode tiles where the cache-order reads apply).
# Usage on the GPU machine, from the repository root:  bash bench/i18_shuffle_session.sh [ab|narrow]
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/portattn-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -m pytest -q -m gpu tests/kernels/test_paged_attention.py tests/compile/test_vector_loads.py \
  tests/kernels/test_plan_cache.py 2>&1 | tail -6 | tee "$OUT/tests_paged.log"
runs=("")
[[ ${1:-} == ab ]] && runs=("--set SHUFFLE_LINES=1" "--set SHUFFLE_LINES=0")
[[ ${1:-} == narrow ]] && runs=("" "--set SHUFFLE_LINES_NARROW=0")
for i in "${!runs[@]}"; do
  # shellcheck disable=SC2086  # the switch is two words on purpose
  timeout 200 python3 bench/bench_paged.py --shuffle ${runs[$i]} > "$OUT/bench_shuffle$i.log" 2>&1
  echo "== bench_paged.py --shuffle ${runs[$i]}"; cat "$OUT/bench_shuffle$i.log"
done
