#!/usr/bin/env bash
# Issue 18/19 MLA device call: the MLA GPU tests, then bench_mla's page-size and verification
# points with a boolean switch of portattn.policy.mla on and off (an A/B in one machine hold).
# Usage on the GPU machine, from the repository root:
#   bash bench/i18_mla_session.sh [SWITCH]     # default SWITCH: SM90_ROWS_AHEAD
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/portattn-out}; mkdir -p "$OUT"
sw=${1:-SM90_ROWS_AHEAD}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -m pytest -q -m gpu tests/kernels/test_mla_packed.py tests/kernels/test_mla_decode.py \
  tests/kernels/test_mla_decode_sm90.py 2>&1 | tail -8 | tee "$OUT/tests_mla.log"
page="--contexts 4096 16384 --heads 16 128 --page 64 1 --page-indices --no-hip"
for on in 1 0; do
  # shellcheck disable=SC2086  # $page is several words on purpose
  timeout 200 python3 bench/bench_mla.py $page --set "$sw=$on" > "$OUT/bench_mla_page_$sw$on.log" 2>&1
  echo "== page sizes, $sw=$on"; sed -n '/^== summary/,$p' "$OUT/bench_mla_page_$sw$on.log"
done
for on in 1 0; do
  timeout 150 python3 bench/bench_mla.py --q-len 2 4 8 --contexts 4096 --heads 16 128 \
    --set "$sw=$on" > "$OUT/bench_mla_verify_$sw$on.log" 2>&1
  echo "== verification, $sw=$on"; tail -22 "$OUT/bench_mla_verify_$sw$on.log"
done
