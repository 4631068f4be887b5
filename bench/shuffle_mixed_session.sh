#!/usr/bin/env bash
# One device call (issues 18/19, eleventh session): SHUFFLE decode tiles with a register cap
# (`--shuffle-variants N,stages,warps,splits[,maxnreg]`), then the mixed 8x2048 batch under the
# sm_90 prefill kernel's schedule switches, 3 rounds in turns. Logs in $OUT.
# Usage on the GPU machine, from the repository root:  bash bench/shuffle_mixed_session.sh
# shellcheck source=bench/_session_lib.sh
source "$(dirname "$0")/_session_lib.sh"  # strict mode, $OUT, device.txt, run
run shuffle 240 python3 bench/bench_paged.py --shuffle --shuffle-variants ${SHUFFLE_VARIANTS:-\
64,2,4,1,128 64,3,4,1,128 32,3,4,1 32,3,4,1,102 64,2,4,1}
grep -v "^$" "$OUT/shuffle.log" | tail -40
run mixed 300 python3 bench/bench_prefill.py --points 8x2048 --schedules --rounds 3 \
  --variants "${MIXED_VARIANTS:-policy,decode launch,v pages off,fused split,late release off}"
sed -n '/^== summary/,$p' "$OUT/mixed.log"
