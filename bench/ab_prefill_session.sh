#!/usr/bin/env bash
# One device call: the sm_90 prefill GPU tests at this tree (TESTS=0 skips them; PYTEST_K
# selects), then bench_prefill.py at this tree, at an earlier tree's src (.ab_old/src:
# `git archive REV src | tar -x -C .ab_old`, carried to the device), and at this tree again
# (RUNS: run names; those starting with "old" run the earlier tree): an A/B of kernel code with
# no switch, in one machine hold. BENCH_ARGS: options for this tree's runs (e.g. `--schedules
# --variants "policy,item ahead" --rounds 3`); OLD_ARGS: for the earlier tree's (default
# BENCH_ARGS); RUN_LIMIT: seconds a run.
# Usage on the GPU machine, from the repository root:  bash bench/ab_prefill_session.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/portattn-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
if [ "${TESTS:-1}" = 1 ]; then
  PYTHONPATH=src timeout 300 python3 -m pytest -q -m gpu tests/kernels/test_paged_prefill_sm90.py \
    ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tail -4 | tee "$OUT/tests.log"
fi
for run in ${RUNS:-new old new2}; do
  src=src args=${BENCH_ARGS:-}
  case $run in  # (runs named old* time the earlier tree: old, old2, ...)
    old*) src=.ab_old/src args=${OLD_ARGS:-${BENCH_ARGS:-}} ;;
  esac
  # shellcheck disable=SC2086
  eval "PYTHONPATH=$src timeout ${RUN_LIMIT:-170} python3 bench/bench_prefill.py $args" \
    > "$OUT/prefill_$run.log" 2>&1
  echo "== $run ($src): rc $?"; sed -n '/^== summary/,$p' "$OUT/prefill_$run.log" | head -40
done
