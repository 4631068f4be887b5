#!/usr/bin/env bash
# One device call: every issue-18/19 goal's benchmark once, at one tree on one GPU (the "rows for
# each goal from one run" the issues ask for): host time, SHUFFLE vs NHD, MLA page sizes and
# verification, prefill / mixed batches. Logs in $OUT; the JSON records in $OUT/records.tgz.
# Usage on the GPU machine, from the repository root:  bash bench/goals_session.sh
# MLA_ROUNDS=R (default 1): the MLA page points timed R times in turns (`bench_mla.py --rounds`).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/portattn-out}; mkdir -p "$OUT"
rec=/tmp/portattn-records; rm -rf "$rec"; mkdir -p "$rec"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
run() {  # run SECONDS LOG CMD...: the command's output to $OUT/LOG, its summary to stdout
  local limit=$1 log=$2; shift 2
  echo "== $*"
  OUT=$rec timeout "$limit" "$@" > "$OUT/$log" 2>&1; echo "rc $?"
}
# limits total 580 s at MLA_ROUNDS=1 (+40 s a round), under the device tool's 600 s a call (the
# whole run took 80-195 s on H100s; 180 s with MLA_ROUNDS=3)
run 60 host.log python3 bench/bench_host.py; tail -7 "$OUT/host.log"
run 110 shuffle.log python3 bench/bench_paged.py --shuffle; tail -14 "$OUT/shuffle.log"
MLA_ROUNDS=${MLA_ROUNDS:-1}
run $((80 + 40 * MLA_ROUNDS)) mla_page.log python3 bench/bench_mla.py --contexts 4096 16384 \
  --heads 16 128 --page 64 1 --page-indices --no-hip --rounds "$MLA_ROUNDS"
# (the page ratios' summary ends with each policy row's ratio at its point's matmul rate)
sed -n '/^== page ratios/,$p' "$OUT/mla_page.log"; sed -n '/rounds in turns/,/^== summary/p' "$OUT/mla_page.log"; grep -E "^ +128 +(4096|16384) +64 +policy" "$OUT/mla_page.log"
run 120 mla_verify.log python3 bench/bench_mla.py --q-len 2 4 8 --contexts 4096 --heads 16 128 \
  --rounds 3
grep -E "policy|goal" "$OUT/mla_verify.log" | tail -8
sed -n '/^== x roofline at the run/,$p' "$OUT/mla_verify.log"
# PREFILL_ARGS: e.g. '--rounds 3 --target gfx942'; PREFILL_VARIANTS: `--schedules` names beside
# the policy's, comma-separated (spaces kept: one argument), e.g. 'policy,v pages off'
# shellcheck disable=SC2086
run 180 prefill.log python3 bench/bench_prefill.py ${PREFILL_ARGS:-} \
  ${PREFILL_VARIANTS:+--schedules --variants "$PREFILL_VARIANTS"}
sed -n '/^== summary/,$p' "$OUT/prefill.log"
tar czf "$OUT/records.tgz" -C "$rec" .
