#!/usr/bin/env bash
# One device call (issue 8, round 2): MLA split counts for the prefetched narrow tile at 1k/4k/16k,
# wide-tile variants at 128 heads, and the paged mixed/prefill tile sweep. Logs/JSON in $OUT.
# Usage on the GPU machine, from the repository root:  bash bench/explore_session.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/portattn-out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader; git rev-parse --short HEAD; } 2>&1
run() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "### $name: rc=$?, $((SECONDS - t0)) s"
}
run sweep_mla_16 220 python3 bench/sweep_mla.py --budget-s 200 \
  --point 16:1024 --point 16:4096 --point 16:16384 --variants policy \
  16,32,3,4,2,P 16,32,3,4,3,P 16,32,3,4,4,P 16,32,3,4,5,P 16,32,3,4,6,P 16,64,3,8,4,P 16,64,3,8,2,P
grep -E "^ +16 |CHECK" "$OUT/sweep_mla_16.log" | cut -c1-112
run sweep_mla_128 150 python3 bench/sweep_mla.py --budget-s 130 --point 128:16384 --variants \
  policy 64,64,2,8,1 64,64,2,8,3 64,64,1,8,2 64,64,2,8,2,V 64,32,3,8,2,P,V
grep -E "^ +128 |CHECK" "$OUT/sweep_mla_128.log" | cut -c1-112
run sweep_paged 240 python3 bench/sweep_paged.py --points mixed,prefill
sed -n '/^mixed\|^prefill\|^  /p' "$OUT/sweep_paged.log" | grep -v "^  decode" | head -40
python3 - "$OUT/sweep_paged.log" <<'PY'
import json, os, sys
d = json.load(open(os.path.join(os.environ.get("OUT", "/tmp/portattn-out"), "sweep_paged.json")))
for p in d["points"]:
    print(p["point"], "sdpa", p["sdpa_us"])
    for r in sorted((r for r in p["rows"] if r["us"]), key=lambda r: r["us"]):
        print(f"   {r['us']:8.1f}  {r['variant']:30} {r['tiles']}")
PY
