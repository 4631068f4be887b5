#!/usr/bin/env bash
# One device call: GPU tests, then benchmarks. Logs and JSON go to $OUT (the device tool's folder).
# Usage on the GPU machine, from the repository root:  bash bench/gpu_session.sh [tests|bench|all]
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/portattn-out}; mkdir -p "$OUT"
what=${1:-all}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/device.txt"
if [[ $what == tests || $what == all ]]; then
  # The product's own command: every GPU cell of the matrix this machine can run (the same pytest
  # arguments a Buildkite step or a Kubernetes Job runs), then its summary. $OUT takes a few
  # files only: the report, results.json and the merged JUnit; the per-cell logs go in one tarball.
  results=/tmp/portattn-matrix
  python3 -m kubematrix matrix --backend cuda --results "$results" 2>&1 | tee "$OUT/matrix.log"
  cp "$results/report.md" "$results/results.json" "$results/junit.xml" "$OUT/" 2>/dev/null
  tar czf "$OUT/matrix-cells.tgz" -C "$results" . 2>/dev/null
fi
if [[ $what == bench || $what == all ]]; then
  python3 bench/compile_vs_device.py --cpu-json bench/compile_vs_device_cpu.json 2>&1 | tail -14 | tee "$OUT/compile_vs_device.log"
  python3 bench/bench_mla.py > "$OUT/bench_mla.log" 2>&1; sed -n '/^== summary/,$p' "$OUT/bench_mla.log"
  python3 bench/bench_paged.py > "$OUT/bench_paged.log" 2>&1; sed -n '/^== summary/,$p' "$OUT/bench_paged.log"
  python3 bench/bench_cache.py > "$OUT/bench_cache.log" 2>&1; sed -n '/^== summary/,$p' "$OUT/bench_cache.log"
  python3 bench/bench_prefill.py > "$OUT/bench_prefill.log" 2>&1; sed -n '/^== summary/,$p' "$OUT/bench_prefill.log"
  # the mixed batch against torch SDPA doing the same work as one batch (CUDA graphs)
  python3 bench/sweep_paged.py --points mixed > "$OUT/sweep_paged.log" 2>&1
  grep -E "^mixed|full call|torch SDPA|#1|policy" "$OUT/sweep_paged.log"
fi
