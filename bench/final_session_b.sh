#!/usr/bin/env bash
# Device call B of a session's close: the product's other GPU cells (specdec, hybrid; the
# Mamba extensions are not built in this call, so their tests skip), then every issue-18/19 goal
# bench once (bench/goals_session.sh). Logs in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/portattn-out}; mkdir -p "$OUT"
results=/tmp/portattn-matrix
PYTHONPATH=src timeout 300 python3 -m kubematrix matrix --backend cuda --suite specdec \
  --suite hybrid --results "$results" > "$OUT/matrix_b.log" 2>&1
echo "matrix rc $?"; tail -10 "$OUT/matrix_b.log"
cp "$results/report.md" "$OUT/report_b.md" 2>/dev/null
bash bench/goals_session.sh
