#!/usr/bin/env bash
# Issue 19, seventh session: the MLA kernel's head-group pairs (2-CTA clusters, TMA multicast;
# portattn.policy.mla.SM90_PAIRS) in one device call: a short checked bench first (a pairing bug
# shows as a hang: short limit), the product's MLA GPU cell, then 128 heads at page 64 with the
# switch on and off, in turns (ROUNDS rounds, default 2).
# Usage on the GPU machine, from the repository root:  bash bench/pairs_session.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/portattn-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
echo "== smoke: bench_mla 128 heads 1k page 64 (checked first)"
timeout 120 python3 bench/bench_mla.py --contexts 1024 --heads 128 --page 64 --no-hip \
  > "$OUT/smoke.log" 2>&1; echo "rc $?"; grep -E "policy|Error|error|mismatch" "$OUT/smoke.log" | head
if [[ ${CELL:-1} == 1 ]]; then
  echo "== python3 -m kubematrix matrix --backend cuda --suite mla"
  timeout 330 python3 -m kubematrix matrix --backend cuda --suite mla > "$OUT/cell_mla.log" 2>&1
  echo "rc $?"; tail -4 "$OUT/cell_mla.log"
fi
for r in $(seq 1 "${ROUNDS:-2}"); do
  for on in 1 0; do
    timeout 100 python3 bench/bench_mla.py --contexts 4096 16384 --heads 128 --page 64 --no-hip \
      --set SM90_PAIRS=$on > "$OUT/ab_r${r}_pairs$on.log" 2>&1
    echo "== round $r SM90_PAIRS=$on rc $?"
    grep -E "^ +128 +(4096|16384) +64 +policy|mm |copy " "$OUT/ab_r${r}_pairs$on.log"
  done
done
