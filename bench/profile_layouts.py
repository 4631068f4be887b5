"""One NHD and one SHUFFLE paged decode launch on the same cache contents, for a profiler
(Nsight Compute): bench_paged's decode point (bf16, 32/8 heads x 128, batch 64), each layout's
output checked against the fp64 oracle on its first sequences first (never timed here).

Usage (bench/NOTES.md, issue 18, SHUFFLE)::

    ncu --clock-control none -k regex:_paged_attention_kernel --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        --metrics dram__bytes_read.sum,lts__t_requests_srcunit_tex_op_read.sum \\
        python3 bench/profile_layouts.py [--context 16384] [--block-size 16]

The first launch of each layout is the checked one (``--launch-skip 2`` leaves both out); the
profiled pair is NHD, then SHUFFLE.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_paged import check_plan, make_inputs, to_shuffle  # noqa: E402

from portattn.kernels._launch import run_all  # noqa: E402
from portattn.kernels.paged_attention import plan_paged_attention  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--batch", type=int, default=64)
    opts = ap.parse_args(argv)
    nhd = make_inputs(((opts.context, 1),) * opts.batch, opts.block_size, torch.bfloat16)
    shuffle = to_shuffle(nhd)
    plans = []
    for args, layout in ((nhd, "NHD"), (shuffle, "SHUFFLE")):
        ok, err, err_torch = check_plan(plan_paged_attention, args, layout=layout)
        if not ok:
            raise SystemExit(f"profile_layouts: {layout} output wrong (error {err:.3e}, torch's "
                             f"{err_torch:.3e}); nothing profiled")  # fmt: skip
        print(f"profile_layouts: {layout} checked (error {err:.3e}, torch's {err_torch:.3e})")
        plans.append(plan_paged_attention(*args, layout=layout))
    for launches in plans:  # the profiled pair: NHD, then SHUFFLE
        run_all(launches)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
