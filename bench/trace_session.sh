#!/usr/bin/env bash
# One device call: where the sm_90 MLA kernel's time goes at 128 heads (bench/trace_mla.py's
# clock stamps, DRAM-bound and L2-resident), and bench_mla's 128-head context sweep (the fixed
# cost and the cost per token through the product's bench). Logs in $OUT.
# Usage on the GPU machine, from the repository root:  bash bench/trace_session.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/portattn-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
run() {  # run SECONDS LOG CMD...
  local limit=$1 log=$2; shift 2
  echo "== $*"
  timeout "$limit" "$@" > "$OUT/$log" 2>&1; echo "rc $?"
}
run 150 trace.log python3 bench/trace_mla.py 128:4096:64 128:16384:64 128:16384:1
run 100 trace_resident.log python3 bench/trace_mla.py --resident 4096 128:16384:64 128:16384:1
run 120 sweep.log python3 bench/bench_mla.py --heads 128 --contexts 512 1024 2048 4096 16384 \
  --page 64 --no-hip
grep -E "^ +128 +[0-9]+ +64 +policy" "$OUT/sweep.log"
run 100 resident.log python3 bench/bench_mla.py --heads 128 --contexts 4096 16384 --page 64 1 \
  --resident 4096 --no-hip
grep -E "^ +128 +[0-9]+ +(64|1) +policy" "$OUT/resident.log"
