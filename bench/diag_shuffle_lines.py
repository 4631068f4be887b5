"""Diagnose the SHUFFLE cache-order reads (`LINES`) on a GPU: which head dims and KV tile widths
read correctly. Each (head_dim, block_n, state bytes, LINES on/off) runs the same two batches as
tests/kernels/test_paged_attention.py::test_shuffle_full_tiles (a mixed batch on the policy's
prefill tile with block_n forced, then a decode batch split over 2 KV ranges) and prints the
kernel's error over torch's low-precision error against the fp64 oracle (> 2: wrong). The reads
are forced on every shape, the ones `policy.paged.shuffle_lines_tile` keeps off included.

Usage on the GPU machine, from the repository root:  python3 bench/diag_shuffle_lines.py
"""

from __future__ import annotations

import dataclasses
import itertools
import sys

import torch

sys.path.insert(0, ".")
from tests.kernels.test_paged_attention import make_batch  # noqa: E402

from portattn import reference  # noqa: E402
from portattn.kernels._launch import run_all  # noqa: E402
from portattn.kernels.paged_attention import plan_paged_attention  # noqa: E402
from portattn.platform import get_target  # noqa: E402
from portattn.policy import paged as paged_policy  # noqa: E402
from portattn.policy.paged import PagedProblem, paged_tiles  # noqa: E402


def err_ratio(b, out) -> float:
    oracle = reference.paged_attention(*b.args(), layout=b.layout)
    lowp = reference.paged_attention(*b.args(), compute_dtype=b.query.dtype, layout=b.layout)
    o = out.cpu().double()
    if not torch.isfinite(o).all():
        return float("inf")
    e = float((o - oracle).norm() / oracle.norm())
    t = float((lowp.double() - oracle).norm() / oracle.norm())
    return e / t


def main() -> None:
    dtype = torch.float16
    print(f"# {torch.cuda.get_device_name()}; error / torch's (> 2 wrong)")
    print(f"{'hd':>4} {'bn':>4} {'state':>5} {'lines':>5} {'bs':>4} {'mixed':>8} {'decode':>8}")
    for hd, bn, state, lines, bs in itertools.product(
        (32, 64, 128), (16, 32, 64), (48, 0), (True, False), (16,)
    ):
        if state == 0 and hd != 32:
            continue
        paged_policy.SHUFFLE_LINES = lines
        # every shape the reads may take, the ones `shuffle_lines_tile` keeps off too (the point
        # is what Triton builds, e.g. after an upgrade)
        paged_policy.shuffle_lines_tile = lambda block_d, block_n, x: True
        problem = PagedProblem(4, 2, hd, 2, max_query_len=20, shuffled=True)
        tiles = dataclasses.replace(paged_tiles(get_target("sm_90"), problem), block_n=bn)
        split = dataclasses.replace(tiles, num_splits=2, decode=None)
        mixed = ((200, 1), (150, 20), (2 * bn, 1), (bn + 9, 3))
        decode = ((200, 1), (3 * bn + 1, 1), (2 * bn, 1))
        res = []
        for seqs, t in ((mixed, tiles), (decode, split)):
            b = make_batch(seqs, block_size=bs, heads=(4, 2), head_dim=hd, dtype=dtype,
                           kind="contiguous", layout="SHUFFLE", device="cuda",
                           state_bytes=state)  # fmt: skip
            launches = plan_paged_attention(*b.args(), layout="SHUFFLE", tiles=t)
            got = launches[0].args["LINES"]
            run_all(launches)
            torch.cuda.synchronize()
            res.append(f"{err_ratio(b, launches[0].outputs[0]):8.2f}{'' if got == lines else '!'}")
        print(f"{hd:>4} {bn:>4} {state:>5} {int(lines):>5} {bs:>4} {res[0]} {res[1]}", flush=True)


if __name__ == "__main__":
    main()
