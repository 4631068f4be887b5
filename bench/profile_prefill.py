"""One paged_attention prefill call for a profiler (Nsight Compute): the sm_90 prefill kernel at
a bench_prefill point, checked against the fp64 oracle on a window first (never timed here).

Usage (bench/NOTES.md, issue 19)::

    ncu --set full -k regex:paged_prefill_sm90 --launch-count 1 -o rep \\
        python3 bench/profile_prefill.py [--point "prefill 8x4096"] [--block-size 2048]
    ncu -i rep.ncu-rep --page details --csv > details.csv
    ncu -i rep.ncu-rep --page source --print-source sass --csv > sass.csv
    python3 bench/ncu_stalls.py sass.csv
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_paged import make_inputs  # noqa: E402
from bench_prefill import POINTS, Oracle  # noqa: E402

from portattn.kernels.paged_attention import paged_attention  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--point", default="prefill 8x4096", choices=sorted(POINTS))
    ap.add_argument("--block-size", type=int, default=2048)
    ap.add_argument("--calls", type=int, default=2, help="calls after the checked one")
    opts = ap.parse_args(argv)
    seqs, _ = POINTS[opts.point]
    args = make_inputs(seqs, opts.block_size, torch.bfloat16)
    kw = dict(max_query_len=max(q for _, q in seqs), max_seq_len=max(s for s, _ in seqs))
    out = paged_attention(*args, **kw)
    ok, err = Oracle(seqs, args, 128).check(out)
    if not ok:
        raise SystemExit(f"profile_prefill: output wrong (error {err:.3e}); nothing profiled")
    for _ in range(opts.calls):
        paged_attention(*args, **kw)
    torch.cuda.synchronize()
    print(f"profile_prefill: {opts.point} block {opts.block_size} checked (error {err:.3e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
