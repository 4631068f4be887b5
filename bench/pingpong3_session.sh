#!/usr/bin/env bash
# One device call (issue 19, sixteenth session): the sm_90 prefill kernel's ping-pong turns with a
# third stage. With two stages a turn issues tile t+1's scores, whose stage is free only once the
# lagging warpgroup's P V of tile t-1 has returned, half a period after the leading warpgroup
# needs it. The GPU tests of the ping-pong schedules (the new "pingpong, 3 stages" case among
# them), a clock trace of the policy and of ping-pong at 3 stages (TRACE=0 skips it), then the
# prefill points under VARIANTS (`bench_prefill.py --schedules` names), rounds in turns. Logs in
# $OUT.
# Usage on the GPU machine, from the repository root:
#   ROUNDS=3 bash bench/pingpong3_session.sh
# shellcheck source=bench/_session_lib.sh
source "$(dirname "$0")/_session_lib.sh"  # strict mode, $OUT, device.txt, run
run tests 300 python3 -m pytest -q -m gpu tests/kernels/test_paged_prefill_sm90.py \
  -k "${PYTEST_K:-pingpong}"
tail -3 "$OUT/tests.log"
if [ "${TRACE:-1}" = 1 ]; then
  run trace 240 python3 bench/trace_prefill.py --points "prefill 8x4096" --blocks 16 2048 \
    --set SM90_PREFILL_PINGPONG=1 --tile 3:0
  grep -E "^==|period|S = Q|softmax|P V|wait" "$OUT/trace.log" | head -60
fi
run prefill 400 python3 bench/bench_prefill.py --schedules --rounds ${ROUNDS:-3} \
  --points ${POINTS:-8x2048,prefill} \
  --variants "${VARIANTS:-policy,pingpong,pingpong 3 stages}"
sed -n '/^== summary/,$p' "$OUT/prefill.log"
