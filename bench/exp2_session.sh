#!/usr/bin/env bash
# One device call (issue 19, from the twelfth session): an A/B of the sm_90 prefill kernel's
# switches, first its softmax switches (`SM90_PREFILL_EXP2_POLY`, `SM90_PREFILL_LAZY_RESCALE`,
# `SM90_PREFILL_TREE_REDUCE`), then the item deal (`SM90_PREFILL_DYNAMIC`): the GPU tests of the
# `_gluon` softmax helpers and of the kernel (its schedule cases run each switch; PYTEST_K: only
# those `pytest -k` selects), then every prefill point under the policy and VARIANTS
# (`bench_prefill.py --schedules` names), rounds in turns. Logs in $OUT.
# Usage on the GPU machine, from the repository root:
#   VARIANTS="policy,tree reduce" ROUNDS=3 bash bench/exp2_session.sh
#   PYTEST_K="dynamic" VARIANTS="policy,dynamic deal" bash bench/exp2_session.sh
# shellcheck source=bench/_session_lib.sh
source "$(dirname "$0")/_session_lib.sh"  # strict mode, $OUT, device.txt, run
run tests 300 python3 -m pytest -q -m gpu tests/kernels/test_gluon_softmax.py \
  tests/kernels/test_paged_prefill_sm90.py ${PYTEST_K:+-k "$PYTEST_K"}
tail -5 "$OUT/tests.log"
run prefill 330 python3 bench/bench_prefill.py --schedules --rounds ${ROUNDS:-3} \
  --variants "${VARIANTS:-policy,exp2 poly 0,exp2 poly 2}"
sed -n '/^== summary/,$p' "$OUT/prefill.log"
