"""MLA decode: time explicit tile variants at chosen points (a focused sweep, one device call).

Each variant is ``H,N,stages,warps,splits[,P][,V][,T]`` (BLOCK_H, BLOCK_N, num_stages, num_warps,
num_kv_splits, ``P`` = prefetched block-table rows, ``V`` = latent reloaded for PV, ``T`` = whole
tiles through tensor descriptors, else every tile gathered; ``G`` = the sm_90 Gluon kernel where
its requirements hold); ``policy``
means the policy's own tiles. Every variant is checked against the fp64 oracle (tolerance rule
of tests/helpers.py) before it is timed with ``do_bench_cudagraph`` (median); its compiled
registers / spills / shared memory are recorded. Points, inputs, roofline and checks: `bench_mla`.

Usage::

    python bench/sweep_mla.py --point 16:4096 --variants policy 16,32,3,4,8,P 16,32,3,4,16,P
    OUT=/tmp/out python bench/sweep_mla.py ...   # also writes $OUT/sweep_mla.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch
import triton
from _common import copy_ceiling, git_commit, matmul_rate, save_record
from bench_mla import DTYPES, HEADER, Point, bench_policy, fmt_row, time_variant, variant

from portattn.platform import current_target


def parse_variant(spec: str):
    """``H,N,stages,warps,splits`` then optional flags ``P`` (prefetch), ``V`` (V reload), ``T``
    (tensor descriptors)."""
    parts = spec.split(",")
    flags = {x.upper() for x in parts[5:]}
    if len(parts) < 5 or not flags <= {"P", "V", "T", "G"}:
        raise SystemExit(
            f"sweep_mla: variant must be H,N,stages,warps,splits[,P][,V][,T][,G]; got {spec}"
        )
    return (*(int(x) for x in parts[:5]), "P" in flags, "V" in flags, "T" in flags, "G" in flags)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--point", action="append", required=True, help="HEADS:CONTEXT (repeatable)")
    ap.add_argument("--variants", nargs="+", required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--head-dim-k", type=int, default=576)
    ap.add_argument("--kv-lora-rank", type=int, default=512)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.set_defaults(resident=0)  # bench_mla's Point reads it (its diagnostic --resident)
    args = ap.parse_args(argv)
    target = current_target()
    dtype = DTYPES[args.dtype]
    elem = torch.finfo(dtype).bits // 8
    points = [tuple(int(x) for x in p.split(":")) for p in args.point]
    copy_gbs, _ = copy_ceiling(2 * args.batch * max(c for _, c in points) * args.head_dim_k * elem)
    mm_tflops, _ = matmul_rate()
    print(
        f"device: {torch.cuda.get_device_name()} ({target.arch}), commit {git_commit()}, "
        f"triton {triton.__version__}; copy {copy_gbs:.0f} GB/s, bf16 mm {mm_tflops:.0f} TFLOP/s"
    )
    deadline = time.monotonic() + args.budget_s
    rows, failures = [], []
    for heads, ctx in points:
        p = Point(args, target, dtype, heads, ctx, copy_gbs, mm_tflops, args.page)
        print(HEADER)
        base = None
        for spec in args.variants:
            if time.monotonic() > deadline:
                print("budget hit")
                break
            if spec == "policy":
                row, base = bench_policy(p)
            else:
                if base is None:
                    _, base = bench_policy(p)
                bh, bn, st, w, sp, pf, vr, tma, g = parse_variant(spec)
                if bh < 2 * heads or bh == 16 or g:  # G: the sm_90 kernel pads to 64 rows
                    t = dataclasses.replace(
                        variant(base, heads, bh, bn, st, w, sp, elem, pf),
                        v_reload=vr,
                        tma=tma,
                        sm90_kernel=g,
                    )
                    row = time_variant(p, t, failures)
                else:
                    row = None
            if row is not None:
                rows.append(row)
                res = {k: row[k] for k in ("n_regs", "n_spills", "shared") if k in row}
                print("  " + fmt_row(row), res, flush=True)
            elif spec != "policy":
                print(f"  {heads} {ctx} {spec}: did not compile / skipped", flush=True)
        del p
        torch.cuda.empty_cache()
    for f in failures:
        print("CHECK FAILED (sweep variant):", f)
    save_record(
        "sweep_mla", copy_gb_per_s=copy_gbs, mm_tflops=mm_tflops, rows=rows, failures=failures
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
