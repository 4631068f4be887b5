#!/usr/bin/env bash
# One device call: an A/B of portattn.policy.mla's boolean switches on the sm_90 MLA kernel's
# 128-head points. The sm_90 MLA GPU tests run first with the first configuration's switches;
# then, per configuration, bench_mla's page points (128 heads, 4k/16k, page 64 and 1) and its
# verification points (q_len 2/4/8, 16 and 128 heads, 4k), and the clock trace at 128 heads 4k.
# Usage on the GPU machine, from the repository root:
#   bash bench/mla_ab_session.sh "A=1 B=1" "A=0 B=0" ...
# ROUNDS=R (default 1): the page points' calls timed R times in turns (`bench_mla.py --rounds`);
# TRACE=0 skips the clock traces, VERIFY=0 the verification points, TESTS=0 the GPU tests (for a
# second A/B in the other order within one hold); DIAG=1 runs bench/diag_wgmma.py first.
set -uo pipefail
ROUNDS=${ROUNDS:-1}; TRACE=${TRACE:-1}; DIAG=${DIAG:-0}; VERIFY=${VERIFY:-1}; TESTS=${TESTS:-1}
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/portattn-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
if [ "$DIAG" = 1 ]; then timeout 120 python3 bench/diag_wgmma.py 2>&1 | tee "$OUT/diag_wgmma.log"; fi
if [ "$TESTS" = 1 ]; then
  python3 bench/mla_gpu_tests.py "$1" 2>&1 | tail -4 | tee "$OUT/tests_mla.log"
fi
for i in $(seq 1 $#); do
  cfg=${!i}; sets=(); for item in $cfg; do sets+=(--set "$item"); done
  echo "== config $i: $cfg"
  timeout $((60 + 60 * ROUNDS)) python3 bench/bench_mla.py --heads 128 --contexts 4096 16384 \
    --page 64 1 --no-hip --rounds "$ROUNDS" "${sets[@]}" > "$OUT/page_c$i.log" 2>&1
  grep -E "copy ceiling" "$OUT/page_c$i.log"; sed -n '/^== page ratios/,$p' "$OUT/page_c$i.log"
  grep -E "^ +128 +[0-9]+ +64 +policy" "$OUT/page_c$i.log" | head -2
  if [ "$VERIFY" = 1 ]; then
    timeout 100 python3 bench/bench_mla.py --q-len 2 4 8 --contexts 4096 --heads 16 128 \
      "${sets[@]}" > "$OUT/verify_c$i.log" 2>&1
    grep -E "copy ceiling|policy|goal" "$OUT/verify_c$i.log" | tail -8
  fi
  [ "$TRACE" = 1 ] || continue
  timeout 60 python3 bench/trace_mla.py 128:4096:64 "${sets[@]}" > "$OUT/trace_c$i.log" 2>&1
  grep -E "graph median|pair period|span|start to|first pair|row sums to" "$OUT/trace_c$i.log"
done
