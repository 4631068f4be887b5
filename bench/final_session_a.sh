#!/usr/bin/env bash
# Device call A of a session's close: the product's GPU cells for the kernels this session
# changed (paged, mla), then the MLA startup A/B against an earlier tree's src (.ab_old/src,
# carried): bench_mla's 128-head page points and the 16-head q8 verification point, new / old /
# new, and the clock trace of the new tree. Logs in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/portattn-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
results=/tmp/portattn-matrix
PYTHONPATH=src timeout 330 python3 -m kubematrix matrix --backend cuda --suite paged --suite mla \
  --results "$results" > "$OUT/matrix_a.log" 2>&1
echo "matrix rc $?"; tail -12 "$OUT/matrix_a.log"
cp "$results/report.md" "$OUT/report_a.md" 2>/dev/null
for run in new old new2; do
  src=src; [ "$run" = old ] && src=.ab_old/src
  PYTHONPATH=$src timeout 80 python3 bench/bench_mla.py --heads 128 --contexts 4096 16384 \
    --page 64 1 --no-hip > "$OUT/page_$run.log" 2>&1
  PYTHONPATH=$src timeout 60 python3 bench/bench_mla.py --q-len 8 --contexts 4096 --heads 16 \
    > "$OUT/verify_$run.log" 2>&1
  echo "== $run ($src)"; grep -E "^ +128 +[0-9]+ +(64|1) +policy" "$OUT/page_$run.log" | head -4
  grep -E "copy ceiling" "$OUT/page_$run.log"; grep -E "policy" "$OUT/verify_$run.log" | tail -1
done
PYTHONPATH=src timeout 60 python3 bench/trace_mla.py 128:4096:64 > "$OUT/trace.log" 2>&1
grep -E "graph median|pair period|span|start to|first pair|row sums to" "$OUT/trace.log"
