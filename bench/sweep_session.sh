#!/usr/bin/env bash
# Issue 8, one device call (< ~8 min): MLA tile sweep + roofline, paged attention vs torch SDPA,
# KV-cache write/gather vs copy ceiling. Full logs and JSON go to $OUT (6 files); stdout shows
# only each script's summary block, so the device tool's 12,000-character tail holds all three.
# Usage on the GPU machine, from the repository root:  bash bench/sweep_session.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/portattn-out}; mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git rev-parse --short HEAD 2>/dev/null
} 2>&1 | tee "$OUT/device.txt"
summary() { sed -n '/^== summary/,$p' "$1"; grep -E "^(FAIL|CHECK FAILED|sdpa: no backend|Traceback)" "$1" | head -5; }
run() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "### $name: rc=$rc, $((SECONDS - t0)) s"
  head -3 "$OUT/$name.log"
  summary "$OUT/$name.log"
  [[ $rc -ne 0 ]] && tail -15 "$OUT/$name.log"
}
run bench_mla 330 python3 bench/bench_mla.py --sweep --budget-s 240
run bench_paged 90 python3 bench/bench_paged.py
run bench_cache 60 python3 bench/bench_cache.py
