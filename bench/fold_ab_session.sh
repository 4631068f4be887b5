#!/usr/bin/env bash
# One device call: an A/B of both sm_90 softmax-scale folds (prefill f29a17c, MLA d946832) against
# an earlier tree's src (.ab_old/src: `git archive 035207e src | tar -x -C .ab_old`, carried), then
# the product's paged and mla cells at this tree in the time left. Each bench checks its output
# against the fp64 oracle before timing. Logs in $OUT.
# Usage on the GPU machine, from the repository root:  bash bench/fold_ab_session.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/portattn-out}; mkdir -p "$OUT"
[ -d .ab_old/src ] || { echo "fold_ab_session: no .ab_old/src (see the header)"; exit 2; }
start=$SECONDS; budget=${BUDGET:-580}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
for run in new old; do
  src=src; [ "$run" = old ] && src=.ab_old/src
  echo "== prefill $run ($src)"
  PYTHONPATH=$src timeout 120 python3 bench/bench_prefill.py > "$OUT/prefill_$run.log" 2>&1
  echo "rc $? at $((SECONDS - start)) s"; sed -n '/^== summary/,$p' "$OUT/prefill_$run.log" | head -24
done
for run in new old; do
  src=src; [ "$run" = old ] && src=.ab_old/src
  echo "== mla $run ($src)"
  PYTHONPATH=$src timeout 90 python3 bench/bench_mla.py --heads 128 --contexts 4096 16384 \
    --page 64 1 --no-hip > "$OUT/mla_page_$run.log" 2>&1
  echo "rc $? at $((SECONDS - start)) s"
  grep -E "copy ceiling|roofline" "$OUT/mla_page_$run.log" | head -3
  grep -E "^ +128 +[0-9]+ +(64|1) +policy" "$OUT/mla_page_$run.log"
  sed -n '/^== page ratios/,$p' "$OUT/mla_page_$run.log"
  PYTHONPATH=$src timeout 80 python3 bench/bench_mla.py --q-len 2 8 --contexts 4096 \
    --heads 16 128 > "$OUT/mla_verify_$run.log" 2>&1
  echo "rc $? at $((SECONDS - start)) s"; grep -E "policy|goal" "$OUT/mla_verify_$run.log" | tail -6
done
left=$((budget - (SECONDS - start)))
echo "== matrix paged+mla, $left s left"
if [ "$left" -gt 60 ]; then
  PYTHONPATH=src timeout "$left" python3 -m kubematrix matrix --backend cuda --suite paged \
    --suite mla --results /tmp/portattn-matrix > "$OUT/matrix.log" 2>&1
  echo "matrix rc $? at $((SECONDS - start)) s"; tail -12 "$OUT/matrix.log"
  cp /tmp/portattn-matrix/report.md "$OUT/report.md" 2>/dev/null
fi
