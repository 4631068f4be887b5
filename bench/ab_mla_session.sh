#!/usr/bin/env bash
# One device call: the sm_90 MLA GPU tests at this tree, then bench_mla's 128-head page points
# and its verification points at this tree, at an earlier tree's src (.ab_old/src: `git archive
# REV src | tar -x -C .ab_old`, carried to the device) and at this tree again: an A/B of kernel
# code with no switch, in one machine hold (the MLA twin of ab_prefill_session.sh; for an A/B of
# portattn.policy.mla's switches in one tree, see mla_ab_session.sh).
# Usage on the GPU machine, from the repository root:  bash bench/ab_mla_session.sh
# RUNS (default "new old new2") picks the runs; TESTS=0 skips the tests (each run is up to 200 s:
# with the tests, all three may pass a 600 s call: split them over two calls).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/portattn-out}; mkdir -p "$OUT"
[ -d .ab_old/src ] || { echo "ab_mla_session: no .ab_old/src (see the header)"; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
if [ "${TESTS:-1}" = 1 ]; then
  PYTHONPATH=src timeout 170 python3 bench/mla_gpu_tests.py "" 2>&1 | tail -4 | tee "$OUT/tests_mla.log"
fi
for run in ${RUNS:-new old new2}; do
  src=src; [ "$run" = old ] && src=.ab_old/src
  echo "== $run ($src)"
  PYTHONPATH=$src timeout 100 python3 bench/bench_mla.py --heads 128 --contexts 4096 16384 \
    --page 64 1 --no-hip > "$OUT/mla_page_$run.log" 2>&1
  grep -E "copy ceiling" "$OUT/mla_page_$run.log"; sed -n '/^== page ratios/,$p' "$OUT/mla_page_$run.log"
  PYTHONPATH=$src timeout 100 python3 bench/bench_mla.py --q-len 2 4 8 --contexts 4096 \
    --heads 16 128 > "$OUT/mla_verify_$run.log" 2>&1
  grep -E "copy ceiling|policy|goal" "$OUT/mla_verify_$run.log" | tail -8
done
