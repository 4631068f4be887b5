#!/usr/bin/env bash
# Issue 18/19, seventh session: the MLA kernel's L2 prefetch of the pair after next
# (portattn.policy.mla.SM90_L2_PREFETCH) in one device call: the product's MLA GPU cell (CELL=1),
# then bench_mla's page-size points (pages 64 and 1, both index forms; 16 and 128 heads; 4k and
# 16k) with the switch on and off in turns (ROUNDS rounds, default 2), then the trace at 128
# heads 16k (TRACE=1).
# Usage on the GPU machine, from the repository root:  bash bench/prefetch_session.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/portattn-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
if [[ ${CELL:-1} == 1 ]]; then
  echo "== python3 -m kubematrix matrix --backend cuda --suite mla"
  timeout 330 python3 -m kubematrix matrix --backend cuda --suite mla > "$OUT/cell_mla.log" 2>&1
  echo "rc $?"; tail -3 "$OUT/cell_mla.log"
fi
page="--contexts 4096 16384 --heads 16 128 --page 64 1 --page-indices --no-hip"
for r in $(seq 1 "${ROUNDS:-2}"); do
  for on in 1 0; do
    # shellcheck disable=SC2086  # $page is several words on purpose
    timeout 150 python3 bench/bench_mla.py $page --set SM90_L2_PREFETCH=$on \
      > "$OUT/page_r${r}_pf$on.log" 2>&1
    echo "== round $r SM90_L2_PREFETCH=$on rc $?"; grep -E "mm 8192" "$OUT/page_r${r}_pf$on.log"
    sed -n '/^== page ratios/,$p' "$OUT/page_r${r}_pf$on.log"
    grep -E "^ +(16|128) +(4096|16384) +(64|1) +(policy|slots)" "$OUT/page_r${r}_pf$on.log" | sort -u
  done
done
if [[ ${TRACE:-1} == 1 ]]; then
  timeout 100 python3 bench/trace_mla.py 128:16384:64 > "$OUT/trace_pf1.log" 2>&1
  echo "== trace 128:16384:64 rc $?"; grep -E "wait tile|pair period|graph median" "$OUT/trace_pf1.log"
fi
