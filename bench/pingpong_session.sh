#!/usr/bin/env bash
# One device call: the sm_90 prefill GPU tests (every schedule, the sequential ping-pong
# included), bench_prefill's policy and ping-pong rows at this tree, the policy at an earlier
# tree's src (.ab_old/src: `git archive REV src | tar -x -C .ab_old`, carried), and the clock
# trace of both schedules. Logs in $OUT.
# Usage on the GPU machine, from the repository root:  bash bench/pingpong_session.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/portattn-out}; mkdir -p "$OUT"
start=$SECONDS
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
PYTHONPATH=src timeout 240 python3 -m pytest -q -m gpu tests/kernels/test_paged_prefill_sm90.py \
  > "$OUT/tests.log" 2>&1
echo "tests rc $? at $((SECONDS - start)) s"; tail -6 "$OUT/tests.log"
PYTHONPATH=src timeout 150 python3 bench/bench_prefill.py --schedules --variants "policy,pingpong" \
  > "$OUT/prefill_new.log" 2>&1
echo "new rc $? at $((SECONDS - start)) s"; sed -n '/^== summary/,$p' "$OUT/prefill_new.log"
if [ -d .ab_old/src ]; then
  PYTHONPATH=.ab_old/src timeout 90 python3 bench/bench_prefill.py > "$OUT/prefill_old.log" 2>&1
  echo "old rc $? at $((SECONDS - start)) s"; sed -n '/^== summary/,$p' "$OUT/prefill_old.log" | head -14
fi
for sw in 0 1; do
  PYTHONPATH=src timeout 80 python3 bench/trace_prefill.py --points "prefill 8x4096" \
    "mixed 8x2048 + 56x1 @4k" --blocks 16 --set SM90_PREFILL_PINGPONG=$sw > "$OUT/trace_$sw.log" 2>&1
  echo "trace pingpong=$sw rc $? at $((SECONDS - start)) s"
  grep -E "^==|graph median|softmax|S = Q|O \+= P|tile period|copies issued|ends spread" "$OUT/trace_$sw.log"
done
