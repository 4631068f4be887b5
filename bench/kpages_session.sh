#!/usr/bin/env bash
# Issue 19, seventh session: the prefill kernel's K tiles in one copy a page box
# (portattn.policy.paged.SM90_PREFILL_K_PAGES), in one device call: the product's paged GPU cell
# (CELL=1), then bench_prefill's points with the policy (K pages on) against "k pages off", in
# turns (ROUNDS rounds, default 9; every row checked against the fp64 oracle first).
# Usage on the GPU machine, from the repository root:  bash bench/kpages_session.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/portattn-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
timeout 200 python3 bench/bench_prefill.py --schedules --variants "policy,k pages off" \
  --rounds "${ROUNDS:-9}" > "$OUT/kpages.log" 2>&1
echo "== bench_prefill policy vs k pages off: rc $?"
grep -E "median of|matmul ceiling in turns" "$OUT/kpages.log"; sed -n '/^== summary/,$p' "$OUT/kpages.log" | head -24
if [[ ${CELL:-1} == 1 ]]; then
  echo "== python3 -m kubematrix matrix --backend cuda --suite paged"
  timeout 330 python3 -m kubematrix matrix --backend cuda --suite paged > "$OUT/cell_paged.log" 2>&1
  echo "rc $?"; grep -E "cuda-sm_90|matrix:" "$OUT/cell_paged.log" | tail -3
fi
