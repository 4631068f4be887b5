#!/usr/bin/env bash
# One device call (issue 19, thirteenth session): where the sm_90 prefill kernel's block-16
# penalty goes, by Nsight Compute. The same point (default "prefill 8x4096") is profiled at each
# block size in BLOCKS (default "16 2048"), output checked against the fp64 oracle first
# (bench/profile_prefill.py); `--set full`, one launch each. Kept in $OUT: the report, its details
# and raw pages as CSV, and bench/ncu_stalls.py's summary of the SASS stall samples.
# Usage on the GPU machine, from the repository root:
#   [POINT="prefill 8x4096"] [BLOCKS="16 2048"] bash bench/ncu_prefill_session.sh
# shellcheck source=bench/_session_lib.sh
source "$(dirname "$0")/_session_lib.sh"  # strict mode, $OUT, device.txt, run
command -v ncu >/dev/null || { echo "ncu_prefill_session: no ncu on this machine"; exit 2; }
POINT=${POINT:-prefill 8x4096}
for bs in ${BLOCKS:-16 2048}; do
  run "ncu_bs$bs" 240 ncu --set full -k regex:paged_prefill_sm90 --launch-count 1 \
    --import-source no -f -o "$OUT/prefill_bs$bs" \
    python3 bench/profile_prefill.py --point "$POINT" --block-size "$bs" --calls 0
  grep -E "profile_prefill|ERR|rror" "$OUT/ncu_bs$bs.log" | head -5
  ncu -i "$OUT/prefill_bs$bs.ncu-rep" --page details --csv > "$OUT/details_bs$bs.csv"
  ncu -i "$OUT/prefill_bs$bs.ncu-rep" --page raw --csv > "$OUT/raw_bs$bs.csv"
  ncu -i "$OUT/prefill_bs$bs.ncu-rep" --page source --print-source sass --csv \
    > "$OUT/sass_bs$bs.csv"
  echo "== block $bs"
  grep -E '"(Duration|Compute \(SM\) Throughput|Memory Throughput|L1/TEX Cache Throughput|L2 Cache Throughput|DRAM Throughput|Issue Slots Busy|Warp Cycles Per Issued Instruction|Eligible Warps Per Scheduler|Executed Ipc Active|Shared Memory Configuration Size)"' \
    "$OUT/details_bs$bs.csv" | awk -F'","' '{print "  " $(NF-2) " = " $NF " " $(NF-1)}' | sed 's/"$//'
  python3 bench/ncu_stalls.py "$OUT/sass_bs$bs.csv" --min-share 1.5 | tee "$OUT/stalls_bs$bs.txt"
done
