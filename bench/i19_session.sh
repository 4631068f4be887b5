#!/usr/bin/env bash
# Issue 19 device call: the sm_90 prefill GPU tests, then bench_prefill's fused-decode variants.
# Usage on the GPU machine, from the repository root:  bash bench/i19_session.sh [variants]
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/portattn-out}; mkdir -p "$OUT"
variants=${1:-policy,decode launch,fused split}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -m pytest -q -m gpu tests/kernels/test_paged_prefill_sm90.py 2>&1 | tail -25 | tee "$OUT/tests.log"
python3 bench/bench_prefill.py --schedules --variants "$variants" > "$OUT/bench_prefill.log" 2>&1
sed -n '/^== summary/,$p' "$OUT/bench_prefill.log"
