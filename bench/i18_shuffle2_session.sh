#!/usr/bin/env bash
# Issue 18 device call: SHUFFLE cache-order reads decided by the compiling arch (the forced gfx942
# policy's rows take them too on an NVIDIA GPU). GPU tests, then bench_paged --shuffle.
# Usage on the GPU machine, from the repository root:  bash bench/i18_shuffle2_session.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/portattn-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -m pytest -q -m gpu tests/kernels/test_paged_attention.py tests/compile/test_vector_loads.py \
  tests/kernels/test_plan_cache.py 2>&1 | tail -6 | tee "$OUT/tests_paged.log"
timeout 200 python3 bench/bench_paged.py --shuffle > "$OUT/bench_shuffle.log" 2>&1
cat "$OUT/bench_shuffle.log"
