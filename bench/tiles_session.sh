#!/usr/bin/env bash
# Issue 18/19, seventh session: the MLA kernel's 32-row tiles in four buffers
# (portattn.policy.mla.SM90_FOUR_BUFFERS) against 64-row tiles in two, in one device call:
# bench_mla's page-size points and verification points with the switch on and off in turns
# (ROUNDS rounds, default 2; every row checked against the fp64 oracle first), then the trace at
# 128 heads 16k with it on (TRACE=1).
# Usage on the GPU machine, from the repository root:  bash bench/tiles_session.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/portattn-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
# smoke first (a buffer-phase bug hangs: short limit; the script stops on a failure)
timeout 60 python3 bench/bench_mla.py --contexts 1024 --heads 128 --page 64 1 --page-indices \
  --no-hip --set SM90_FOUR_BUFFERS=1 > "$OUT/smoke.log" 2>&1
rc=$?; echo "== smoke rc $rc"; sed -n '/^== page ratios/,$p' "$OUT/smoke.log" | head -6
(( rc == 0 )) || { tail -20 "$OUT/smoke.log"; exit 1; }
page="--contexts 4096 16384 --heads 16 128 --page 64 1 --page-indices --no-hip"
for r in $(seq 1 "${ROUNDS:-2}"); do
  for on in 1 0; do
    # shellcheck disable=SC2086  # $page is several words on purpose
    timeout 150 python3 bench/bench_mla.py $page --set SM90_FOUR_BUFFERS=$on \
      > "$OUT/page_r${r}_fb$on.log" 2>&1
    echo "== page sizes, round $r, SM90_FOUR_BUFFERS=$on: rc $?"; grep -E "mm 8192" "$OUT/page_r${r}_fb$on.log"
    sed -n '/^== page ratios/,$p' "$OUT/page_r${r}_fb$on.log" | grep -E "^ +128|correct|Error"
  done
done
for on in 1 0; do
  timeout 120 python3 bench/bench_mla.py --q-len 2 4 8 --contexts 4096 --heads 16 128 \
    --set SM90_FOUR_BUFFERS=$on > "$OUT/verify_fb$on.log" 2>&1
  echo "== verification, SM90_FOUR_BUFFERS=$on: rc $?"; grep -E "policy|goal" "$OUT/verify_fb$on.log" | tail -7
done
if [[ ${TRACE:-1} == 1 ]]; then
  timeout 100 python3 bench/trace_mla.py 128:16384:64 --set SM90_FOUR_BUFFERS=1 > "$OUT/trace_fb1.log" 2>&1
  echo "== trace 128:16384:64 four buffers rc $?"; grep -E "wait tile|pair period|graph median" "$OUT/trace_fb1.log"
fi
