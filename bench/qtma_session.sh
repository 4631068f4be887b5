#!/usr/bin/env bash
# One device call (issue 19, sixteenth session): the sm_90 prefill kernel's query rows by TMA
# from the producer (`SM90_PREFILL_Q_TMA`), alone and with ping-pong turns at 3 stages. The GPU
# tests that run it (PYTEST_K), clock traces (TRACE_SETS: by default the policy and the switch
# on; item boundaries: bench/trace_prefill.py; TRACE=0 skips them), then every prefill point under
# VARIANTS (`bench_prefill.py --schedules` names), rounds in turns. Logs in $OUT.
# Usage on the GPU machine, from the repository root:
#   ROUNDS=3 bash bench/qtma_session.sh
# shellcheck source=bench/_session_lib.sh
source "$(dirname "$0")/_session_lib.sh"  # strict mode, $OUT, device.txt, run
run tests 300 python3 -m pytest -q -m gpu tests/kernels/test_paged_prefill_sm90.py \
  -k "${PYTEST_K:-tma or query or many_items or pingpong}"
tail -3 "$OUT/tests.log"
if [ "${TRACE:-1}" = 1 ]; then
  # TRACE_SETS: one trace per entry, each a space-separated list of `trace_prefill.py` options
  IFS=';' read -ra sets <<< "${TRACE_SETS:---set SM90_PREFILL_Q_TMA=0;--set SM90_PREFILL_Q_TMA=1}"
  # (the policy's head_dim-128 tile takes the query by TMA with turns; off, the sequential tile)
  i=0
  for opts in "${sets[@]}"; do
    # shellcheck disable=SC2086
    run "trace_$i" 200 python3 bench/trace_prefill.py --points "prefill 8x4096" \
      --blocks ${TRACE_BLOCKS:-2048} $opts
    echo "## trace $i: $opts"
    grep -E "^==|period|item|epilogue|ring\)|S = Q|softmax|P V" "$OUT/trace_$i.log" | head -48
    i=$((i + 1))
  done
fi
run prefill 400 python3 bench/bench_prefill.py --schedules --rounds ${ROUNDS:-3} \
  ${POINTS:+--points "$POINTS"} \
  --variants "${VARIANTS:-policy,sequential,pingpong 3 stages}"
sed -n '/^== summary/,$p' "$OUT/prefill.log"
