# Sourced by the one-call device session scripts (bench/*_session.sh that say so): strict mode,
# PYTHONPATH, $OUT, the card's name in $OUT/device.txt, and `run NAME SECONDS CMD...`: the
# command's output to $OUT/NAME.log under a time limit, then its exit status and seconds.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/portattn-out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,clocks.sm,memory.total --format=csv,noheader; } 2>&1 | tee "$OUT/device.txt"
run() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  OUT=$OUT timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "### $name: rc=$?, $((SECONDS - t0)) s"
}
