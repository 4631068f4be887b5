#!/usr/bin/env bash
# One device call: the sm_90 prefill GPU tests at this tree, then bench_prefill.py at this tree,
# at an earlier tree's src (.ab_old/src: `git archive REV src | tar -x -C .ab_old`, carried to
# the device), and at this tree again: an A/B of kernel code with no switch, in one machine hold.
# Usage on the GPU machine, from the repository root:  bash bench/ab_prefill_session.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/portattn-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
PYTHONPATH=src timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_paged_prefill_sm90.py \
  2>&1 | tail -4 | tee "$OUT/tests.log"
for run in new old new2; do
  src=src; [ "$run" = old ] && src=.ab_old/src
  PYTHONPATH=$src timeout 170 python3 bench/bench_prefill.py > "$OUT/prefill_$run.log" 2>&1
  echo "== $run ($src): rc $?"; sed -n '/^== summary/,$p' "$OUT/prefill_$run.log" | head -30
done
