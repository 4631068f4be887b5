#!/usr/bin/env bash
# Device calls for the sm_90 prefill kernel's stage release lag (Sm90PrefillTile.release_lag).
#   a: the paged GPU cell (`python3 -m kubematrix matrix --backend cuda --suite paged`: the lag
#      variants' GPU tests included), then bench_prefill's policy / 3 stages / release 1 / release 2
#   b: the clock trace of the policy's tile and of 3 stages at lag 0, 1, 2 (blocks 16 and 2048)
# Logs in $OUT. Usage on the GPU machine, from the repository root:
#   bash bench/release_session.sh a   (then)   bash bench/release_session.sh b
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/portattn-out}; mkdir -p "$OUT"
start=$SECONDS
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
case "${1:-a}" in
a)
  timeout 230 python3 -m kubematrix matrix --backend cuda --suite paged > "$OUT/paged_cell.log" 2>&1
  echo "cell rc $? at $((SECONDS - start)) s"; tail -6 "$OUT/paged_cell.log"
  timeout 320 python3 bench/bench_prefill.py --schedules \
    --variants "policy,3 stages,release 1,release 2" > "$OUT/prefill_lag.log" 2>&1
  echo "bench rc $? at $((SECONDS - start)) s"; sed -n '/^== summary/,$p' "$OUT/prefill_lag.log"
  ;;
b)
  for tile in 2:0 3:0 3:1 3:2; do
    timeout 130 python3 bench/trace_prefill.py --points "mixed 8x2048 + 56x1 @4k" \
      "prefill 8x4096" --blocks 16 2048 --tile "$tile" > "$OUT/trace_${tile/:/_}.log" 2>&1
    echo "trace tile $tile rc $? at $((SECONDS - start)) s"
    grep -E "^==|graph median|softmax|S = Q|O \+= P|wait|tile period" "$OUT/trace_${tile/:/_}.log"
  done
  ;;
esac
