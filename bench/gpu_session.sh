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
    tests/kernels tests/test_mla_metadata.py tests/hybrid tests/specdec 2>&1 | tail -40 | tee "$OUT/gpu-tests.log"
fi
if [[ $what == bench || $what == all ]]; then
  [[ -f bench/compile_vs_device.py ]] && python3 bench/compile_vs_device.py 2>&1 | tail -30 | tee "$OUT/compile_vs_device.log"
  python3 bench/bench_mla.py 2>&1 | tail -30 | tee "$OUT/bench_mla.log"
  python3 bench/bench_paged.py 2>&1 | tail -30 | tee "$OUT/bench_paged.log"
fi
