#!/usr/bin/env bash
# One device call (issue 19, fifteenth session): the sm_90 MLA kernel's GPU tests (every
# `test_mla_decode.py` test of the sm_90 kernel, the schedule switches' included), then an A/B of
# `portattn.policy.mla` switch configurations at the 128-head page points, timed in turns
# (`bench/ab_mla.py`), then optionally the clock trace of each configuration (TRACE=1).
# Usage on the GPU machine, from the repository root:
#   CONFIGS=$'\nSM90_MASK_LAST_ONLY=1\nSM90_REFILL_LATE=1' ROUNDS=5 bash bench/mla_turns_session.sh
# CONFIGS: one configuration a line (an empty line: the policy as it stands); TESTS=0 skips the
# tests; PAGES (default "64 1"), CONTEXTS (default "4096 16384").
# shellcheck source=bench/_session_lib.sh
source "$(dirname "$0")/_session_lib.sh"  # strict mode, $OUT, device.txt, run
if [ "${TESTS:-1}" = 1 ]; then
  run tests 420 python3 -m pytest -q -m gpu tests/kernels/test_mla_decode.py -k sm90
  tail -3 "$OUT/tests.log"
fi
args=()
while IFS= read -r cfg; do args+=(--config "$cfg"); done <<< "${CONFIGS:-}"
run ab 400 python3 bench/ab_mla.py "${args[@]}" --rounds "${ROUNDS:-5}" \
  --page ${PAGES:-64 1} --contexts ${CONTEXTS:-4096 16384}
grep -E "^device|^==|^  " "$OUT/ab.log"
if [ "${TRACE:-0}" = 1 ]; then
  while IFS= read -r cfg; do
    sets=(); for item in $cfg; do sets+=(--set "$item"); done
    echo "== trace [$cfg]"
    OUT=$OUT timeout 60 python3 bench/trace_mla.py 128:4096:64 "${sets[@]}" 2>&1 \
      | grep -E "graph median|pair period|span|first pair"
  done <<< "${CONFIGS:-}"
fi
