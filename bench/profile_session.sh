#!/usr/bin/env bash
# One device call: the issue-8 benchmarks at the policies (MLA at 1k/4k/16k), an Nsight Compute
# profile of the MLA kernels, and a focused MLA variant sweep. Logs/JSON in $OUT; stdout keeps
# only summaries. Usage on the GPU machine, from the repository root:
#   bash bench/profile_session.sh [bench] [ncu] [sass] [sweep]   (default: bench ncu sweep)
# `sass`: per-instruction stall samples of the 128-head sm_90 kernel, summarised by
# bench/ncu_stalls.py (bench/NOTES.md, attempt 6).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/portattn-out}; mkdir -p "$OUT"
what=${*:-bench ncu sweep}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.sm --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git rev-parse --short HEAD 2>/dev/null; date -u +%FT%TZ
} 2>&1 | tee "$OUT/device.txt"
run() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "### $name: rc=$rc, $((SECONDS - t0)) s"
  sed -n '/^== summary/,$p' "$OUT/$name.log"
  grep -E "^(FAIL|CHECK FAILED|sdpa: no backend|Traceback|correctness)" "$OUT/$name.log" | head -5
  [[ $rc -ne 0 ]] && tail -8 "$OUT/$name.log"
}
if [[ $what == *bench* ]]; then
  run bench_mla 150 python3 bench/bench_mla.py --contexts 1024 4096 16384
  run bench_paged 150 python3 bench/bench_paged.py
  run bench_cache 60 python3 bench/bench_cache.py
fi
if [[ $what == *ncu* ]] && command -v ncu >/dev/null; then
  t0=$SECONDS
  timeout 150 ncu --clock-control none -k regex:_mla_decode \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
    python3 bench/profile_mla.py 16:4096 128:16384 > "$OUT/ncu_mla.log" 2>&1
  echo "### ncu: rc=$?, $((SECONDS - t0)) s"
  grep -E "_mla_decode|Duration|DRAM Throughput|Memory Throughput|L2 Hit|L1/TEX Hit|Compute \(SM\) Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Warp Cycles Per Issued|Issue Slots Busy|Executed Ipc A|Mem Busy|Max Bandwidth|Block Limit (Reg|Shared)" "$OUT/ncu_mla.log" | head -60
  grep -E -o "(stalled|spends) [^.]*\." "$OUT/ncu_mla.log" | head -6
fi
if [[ $what == *sass* ]] && command -v ncu >/dev/null; then
  t0=$SECONDS
  timeout 200 ncu --clock-control none -k regex:sm90 --launch-count 1 --set full \
    --import-source no -f -o "$OUT/sm90" python3 bench/profile_mla.py 128:16384 \
    > "$OUT/ncu_sass.log" 2>&1
  ncu -i "$OUT/sm90.ncu-rep" --page source --print-source sass --csv > "$OUT/sm90_sass.csv"
  echo "### sass: rc=$?, $((SECONDS - t0)) s"
  python3 bench/ncu_stalls.py "$OUT/sm90_sass.csv" --min-share 1
fi
if [[ $what == *sweep* ]]; then
  run sweep_mla_16 200 python3 bench/sweep_mla.py --budget-s 170 --point 16:4096 --point 16:16384 \
    --variants policy 16,32,3,4,8,P 16,32,3,4,4,P 16,32,3,4,32,P 16,16,4,4,16,P 16,16,6,4,16,P \
    16,32,4,4,16,P 16,64,3,8,8,P 16,32,3,8,16,P
  grep -E "^ +16 " "$OUT/sweep_mla_16.log" | cut -c1-150
  run sweep_mla_128 170 python3 bench/sweep_mla.py --budget-s 140 --point 128:16384 \
    --variants policy 64,32,3,8,2,P 64,32,4,8,2,P 64,16,4,8,2,P 64,16,6,8,2,P 64,32,3,8,4,P \
    64,64,3,8,2,P 64,32,2,8,2
  grep -E "^ +128 " "$OUT/sweep_mla_128.log" | cut -c1-150
fi
