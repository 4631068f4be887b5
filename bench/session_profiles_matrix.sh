#!/usr/bin/env bash
# One device call (issue 18's profiles, then the matrix's first two GPU cells), with the Mamba
# extensions building detached for the next call's hybrid cell. Usage on the GPU machine, from the
# repository root, with the sdists carried in .device/sdists_ms:
#   bash bench/session_profiles_matrix.sh          # then, in the next call of the same machine hold:
#   bash bench/session_profiles_matrix.sh rest     # install the wheels, hybrid + specdec cells
# PROFILES=0 skips the Nsight Compute profiles (the matrix cells only).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/portattn-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
if [[ ${1:-first} == rest ]]; then
  while ! grep -q "^mamba build rc" /tmp/mamba.log 2>/dev/null; do sleep 5; done
  tail -4 /tmp/mamba.log
  python3 -m pip install -q --no-index --no-deps /tmp/wheels/*.whl 2>&1 | tail -2
  python3 -c "import mamba_ssm, causal_conv1d; print('mamba_ssm', mamba_ssm.__version__, 'causal_conv1d', causal_conv1d.__version__)"
  python3 -m kubematrix matrix --backend cuda --suite hybrid --suite specdec \
    --results /tmp/matrix-rest 2>&1 | tee "$OUT/matrix_rest.log" | tail -25
  cp /tmp/matrix-rest/report.md "$OUT/report_rest.md" 2>/dev/null
  exit 0
fi
(setsid nohup bash -c 't0=$SECONDS; MAX_JOBS=12 TORCH_CUDA_ARCH_LIST=9.0 python3 tools/mamba_wheels.py \
  --arch 9.0 --sdists .device/sdists_ms --out /tmp/wheels; echo "mamba build rc $? in $((SECONDS - t0)) s"' \
  > /tmp/mamba.log 2>&1 &)
if [[ ${PROFILES:-1} == 1 ]]; then
m="dram__bytes_read.sum,lts__t_requests_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read.sum"
m="$m,lts__t_sectors_srcunit_tex_op_read_lookup_miss.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum"
m="$m,sm__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__throughput.avg.pct_of_peak_sustained_elapsed"
m="$m,lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed"
m="$m,gpu__time_duration.sum,smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed"
m="$m,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__average_warp_latency_issue_stalled_barrier"
timeout 150 ncu --clock-control none -k regex:_paged_attention_kernel --launch-skip 2 --launch-count 2 \
  --section WarpStateStats --metrics "$m" python3 bench/profile_layouts.py > "$OUT/ncu_layouts.log" 2>&1
echo "### ncu layouts rc=$?"; grep -E "profile_layouts|_paged_attention_kernel|dram__|lts__|l1tex__|sm__|gpu__time|smsp__inst|Stall|stall" "$OUT/ncu_layouts.log" | head -60
timeout 150 ncu --clock-control none -k regex:mla_decode_sm90 --launch-count 2 --section WarpStateStats \
  --metrics "$m" python3 bench/profile_mla.py 128:16384:64 128:16384:1 > "$OUT/ncu_mla.log" 2>&1
echo "### ncu mla rc=$?"; grep -E "^128|mla_decode_sm90|dram__|lts__|l1tex__|sm__|gpu__time|smsp__inst|Stall|stall" "$OUT/ncu_mla.log" | head -60
fi
python3 -m kubematrix matrix --backend cuda --suite paged --suite mla --results /tmp/matrix-first \
  2>&1 | tee "$OUT/matrix_first.log" | tail -25
cp /tmp/matrix-first/report.md "$OUT/report_first.md" 2>/dev/null
tail -3 /tmp/mamba.log
