#!/usr/bin/env bash
# One device call (issues 18/19, eleventh session): SHUFFLE decode tiles with a register cap
# (`--shuffle-variants N,stages,warps,splits[,maxnreg]`), then the mixed 8x2048 batch under the
# sm_90 prefill kernel's schedule switches, 3 rounds in turns. Logs in $OUT.
# Usage on the GPU machine, from the repository root:  bash bench/shuffle_mixed_session.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/portattn-out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,clocks.sm,memory.total --format=csv,noheader; } 2>&1 | tee "$OUT/device.txt"
run() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  OUT=$OUT timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "### $name: rc=$?, $((SECONDS - t0)) s"
}
run shuffle 240 python3 bench/bench_paged.py --shuffle --shuffle-variants ${SHUFFLE_VARIANTS:-\
64,2,4,1,128 64,3,4,1,128 32,3,4,1 32,3,4,1,102 64,2,4,1}
grep -v "^$" "$OUT/shuffle.log" | tail -40
run mixed 300 python3 bench/bench_prefill.py --points 8x2048 --schedules --rounds 3 \
  --variants "${MIXED_VARIANTS:-policy,decode launch,v pages off,fused split,late release off}"
sed -n '/^== summary/,$p' "$OUT/mixed.log"
