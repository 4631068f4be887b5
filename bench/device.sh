#!/usr/bin/env bash
# The one script a GPU machine runs, from the repository root; what it writes to $OUT comes back.
#
#   bench/device.sh matrix paged                 # GPU matrix cells through the product's command,
#   bench/device.sh matrix mla,hybrid,specdec    #   one invocation per call (10 minutes a call)
#   bench/device.sh bench [bench.run args...]    # the suite: python -m bench.run, then RESULTS.md
#   bench/device.sh bench --compare .bench-old   #   ... against another checkout's src/ as well
#
# Triton's compile cache: TRITON_CACHE_DIR is $BENCH_TRITON_CACHE (default .triton-cache/ in the
# repository root, git-ignored: the device keeps ignored folders between the calls of one machine
# hold, and `carry` can bring it to the next hold). Compiles go through kubematrix's layered
# cache manager, as CI's cells do (src/kubematrix/compile_cache.py; no Redis here: the local
# layer only), whose counters give the hits: $OUT/cache.txt. The matrix's local runner reports
# each cell's hit rate in its own summary too.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/portattn-out}
mkdir -p "$OUT"
export TRITON_CACHE_DIR=${BENCH_TRITON_CACHE:-$PWD/.triton-cache}
mkdir -p "$TRITON_CACHE_DIR"
stats=$(mktemp -d /tmp/bench-cache-stats.XXXXXX)

cache_report() {  # $1: before|after
  local files kb
  files=$(find "$TRITON_CACHE_DIR" -type f | wc -l)
  kb=$(du -sk "$TRITON_CACHE_DIR" | cut -f1)
  echo "triton cache $1: $TRITON_CACHE_DIR, $files files, $((kb / 1024)) MB" | tee -a "$OUT/cache.txt"
}

what=${1:-}
shift || true
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/cache.txt"
cache_report before
case $what in
  matrix)
    [[ $# -eq 1 ]] || { echo "usage: bench/device.sh matrix SUITE[,SUITE...]" >&2; exit 2; }
    suites=()
    IFS=, read -ra names <<< "$1"
    for s in "${names[@]}"; do suites+=(--suite "$s"); done
    results=/tmp/portattn-matrix-$$
    # the local runner gives every cell the layered cache and its own counters
    timeout 585 python3 -m kubematrix matrix --backend cuda "${suites[@]}" --results "$results" \
      2>&1 | tee "$OUT/matrix.log"
    rc=${PIPESTATUS[0]}
    cp "$results/report.md" "$results/results.json" "$results/junit.xml" "$OUT/" 2>/dev/null
    tar czf "$OUT/matrix-cells.tgz" -C "$results" . 2>/dev/null
    ;;
  bench)
    export TRITON_CACHE_MANAGER=kubematrix.compile_cache:LayeredCacheManager
    export KUBEMATRIX_CACHE_STATS=$stats
    rm -f "$OUT/bench.json" "$OUT/RESULTS.md"  # a reused $OUT: never render an earlier run's
    timeout 585 python3 -m bench.run --out "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"
    rc=${PIPESTATUS[0]}
    if [[ -s $OUT/bench.json ]]; then
      python3 -m bench.results "$OUT/bench.json" --out "$OUT/RESULTS.md"
    fi
    python3 -c "import sys; from kubematrix.cachestats import read_stats; s = read_stats(sys.argv[1]); \
print('triton cache lookups (this run):', s.to_dict() if s else 'none recorded', \
'hit rate', None if s is None or s.hit_rate is None else round(s.hit_rate, 3))" "$stats" \
      | tee -a "$OUT/cache.txt"
    ;;
  *)
    echo "usage: bench/device.sh matrix SUITE[,SUITE...] | bench [python -m bench.run args]" >&2
    exit 2
    ;;
esac
cache_report after
rm -rf "$stats"
exit "$rc"
