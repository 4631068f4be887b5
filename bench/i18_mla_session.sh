#!/usr/bin/env bash
# Issue 18/19 MLA device call: bench_mla's page-size and verification points under each given
# configuration of portattn.policy.mla's boolean switches (an A/B in one machine hold), after the
# sm_90 MLA GPU tests run with the first configuration's switches set.
# Usage on the GPU machine, from the repository root:
#   bash bench/i18_mla_session.sh "SM90_ROWS_AHEAD=1" "SM90_ROWS_AHEAD=0"     (the default)
#   bash bench/i18_mla_session.sh "A=1 B=1" "A=0 B=0" "A=1 B=0"              (several switches)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/portattn-out}; mkdir -p "$OUT"
(( $# )) || set -- "SM90_ROWS_AHEAD=1" "SM90_ROWS_AHEAD=0"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
# the GPU tests with the first configuration's switches
python3 bench/mla_gpu_tests.py "$1" 2>&1 | tail -8 | tee "$OUT/tests_mla.log"
page="--contexts 4096 16384 --heads 16 128 --page 64 1 --page-indices --no-hip"
for i in $(seq 1 $#); do
  cfg=${!i}; sets=(); for item in $cfg; do sets+=(--set "$item"); done
  # shellcheck disable=SC2086  # $page is several words on purpose
  timeout 200 python3 bench/bench_mla.py $page "${sets[@]}" > "$OUT/bench_mla_page_c$i.log" 2>&1
  echo "== page sizes, config $i: $cfg"; sed -n '/^== page ratios/,$p' "$OUT/bench_mla_page_c$i.log"
  grep -E "^ +128 .*policy|^ +128 .*slots" "$OUT/bench_mla_page_c$i.log" | tail -8
done
for i in $(seq 1 $#); do
  cfg=${!i}; sets=(); for item in $cfg; do sets+=(--set "$item"); done
  timeout 150 python3 bench/bench_mla.py --q-len 2 4 8 --contexts 4096 --heads 16 128 "${sets[@]}" \
    > "$OUT/bench_mla_verify_c$i.log" 2>&1
  echo "== verification, config $i: $cfg"; grep -E "policy|goal" "$OUT/bench_mla_verify_c$i.log" | tail -8
done
