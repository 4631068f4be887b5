#!/usr/bin/env bash
# One device call (issue 19, from the twelfth session): the sm_90 prefill kernel's softmax
# switches (`SM90_PREFILL_EXP2_POLY`, `SM90_PREFILL_LAZY_RESCALE`, `SM90_PREFILL_TREE_REDUCE`):
# the GPU tests of the `_gluon` softmax helpers and of the kernel (its schedule cases run each
# switch), then every prefill point under the policy and VARIANTS (`bench_prefill.py
# --schedules` names), rounds in turns. Logs in $OUT.
# Usage on the GPU machine, from the repository root:
#   VARIANTS="policy,tree reduce" ROUNDS=3 bash bench/exp2_session.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/portattn-out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,clocks.sm,memory.total --format=csv,noheader; } 2>&1 | tee "$OUT/device.txt"
run() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  OUT=$OUT timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "### $name: rc=$?, $((SECONDS - t0)) s"
}
run tests 200 python3 -m pytest -q -m gpu tests/kernels/test_gluon_softmax.py \
  tests/kernels/test_paged_prefill_sm90.py
tail -5 "$OUT/tests.log"
run prefill 330 python3 bench/bench_prefill.py --schedules --rounds ${ROUNDS:-3} \
  --variants "${VARIANTS:-policy,exp2 poly 0,exp2 poly 2}"
sed -n '/^== summary/,$p' "$OUT/prefill.log"
