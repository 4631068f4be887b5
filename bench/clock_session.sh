#!/usr/bin/env bash
# One device call (issue 19, prepared in the nineteenth session): is block 16's extra time extra
# cycles or a lower clock? `bench/diag_clock.py` (the SM clock and power through NVML during each
# block size's graph replays, rounds in turns), then the traced launches at blocks 16 and 2048
# (each prints its tile period in cycles and its clock). Logs in $OUT. About 3 minutes.
# Usage on the GPU machine, from the repository root:  bash bench/clock_session.sh
# shellcheck source=bench/_session_lib.sh
source "$(dirname "$0")/_session_lib.sh"  # strict mode, $OUT, device.txt, run
run clock 300 python3 bench/diag_clock.py --points "prefill 8x4096,mixed 8x2048 + 56x1 @4k" \
  --blocks 16,544,2048 --rounds "${ROUNDS:-3}"
sed -n '/^point/,$p' "$OUT/clock.log"
run trace 200 python3 bench/trace_prefill.py --points "prefill 8x4096" --blocks 16 2048
grep -E "^==|period|clock" "$OUT/trace.log" | head -24
