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
  # kernels, MLA metadata, hybrid and specdec suites; the CI layer (tests/ci) needs no GPU
  python3 -m pytest -m gpu -n 4 -q -p no:cacheprovider --junitxml="$OUT/gpu-junit.xml" \
    tests/kernels tests/test_mla_metadata.py tests/hybrid tests/specdec > "$OUT/gpu-tests.log" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu-tests.log" | tail -25
fi
if [[ $what == bench || $what == all ]]; then
  python3 bench/compile_vs_device.py --cpu-json bench/compile_vs_device_cpu.json 2>&1 | tail -14 | tee "$OUT/compile_vs_device.log"
  python3 bench/bench_mla.py > "$OUT/bench_mla.log" 2>&1; sed -n '/^== summary/,$p' "$OUT/bench_mla.log"
  python3 bench/bench_paged.py > "$OUT/bench_paged.log" 2>&1; sed -n '/^== summary/,$p' "$OUT/bench_paged.log"
  python3 bench/bench_cache.py > "$OUT/bench_cache.log" 2>&1; sed -n '/^== summary/,$p' "$OUT/bench_cache.log"
  # the mixed batch against torch SDPA doing the same work as one batch (CUDA graphs)
  python3 bench/sweep_paged.py --points mixed > "$OUT/sweep_paged.log" 2>&1
  grep -E "^mixed|full call|torch SDPA|#1|policy" "$OUT/sweep_paged.log"
fi
