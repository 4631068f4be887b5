"""Paged-attention timing on one GPU: correctness first, then medians, with a copy ceiling.

Default run: 32 query heads, 8 KV heads, head_dim 128, bf16, random inputs, for
  * decode: batch 64 at contexts 4k and 16k,
  * mixed: one 512-token prefill chunk at 8k context plus 63 decode sequences at 4k,
each with block_size 16 and 2048 (the hybrid-model size; the kernel tile must not follow it).

For each point:
1. correctness on the first 3 sequences against the fp64 oracle under the tolerance rule of
   tests/helpers.py (error <= 2x torch's own low-precision error); a failure stops the run;
2. ``triton.testing.do_bench`` medians (CUDA events, L2 flushed) of the planned launch alone
   (``run_all(plan)``: the kernel) and of ``paged_attention(...)`` (validation + planning, which
   read the metadata on the host, + the kernel);
3. bytes the kernel must move (K and V of every context token once per KV head, query, output)
   as effective bandwidth, next to a device-to-device copy ceiling measured in the same run.

Usage::

    python bench/bench_paged.py                  # the default table
    python bench/bench_paged.py --dtype fp16
    OUT=/tmp/out python bench/bench_paged.py     # also writes $OUT/bench_paged.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess

import torch
from triton.testing import do_bench

from portattn import reference
from portattn.kernels._launch import run_all
from portattn.kernels.paged_attention import paged_attention, plan_paged_attention
from portattn.platform import current_target

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
HQ, HKV, D = 32, 8, 128
# name -> ((seq_len, q_len), ...)
SCENARIOS = {
    "decode 64x4k": ((4096, 1),) * 64,
    "decode 64x16k": ((16384, 1),) * 64,
    "mixed 512@8k + 63x4k": ((8192, 512),) + ((4096, 1),) * 63,
}
BLOCK_SIZES = (16, 2048)


def make_inputs(seqs, block_size, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    nblk = [-(-s // block_size) for s, _ in seqs]
    num_blocks = sum(nblk)
    shape = (num_blocks, block_size, HKV, D)
    k = torch.randn(shape, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(shape, device="cuda", dtype=dtype, generator=g)
    perm = torch.randperm(num_blocks, device="cuda", generator=g).to(torch.int32)
    table = torch.full((len(seqs), max(nblk)), -1, dtype=torch.int32, device="cuda")
    first = 0
    for i, n in enumerate(nblk):
        table[i, :n] = perm[first : first + n]
        first += n
    q_lens = torch.tensor([q for _, q in seqs], dtype=torch.int32)
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    qsl[1:] = q_lens.cumsum(0)
    query = torch.randn(int(qsl[-1]), HQ, D, device="cuda", dtype=dtype, generator=g)
    seq_lens = torch.tensor([s for s, _ in seqs], dtype=torch.int32, device="cuda")
    return query, k, v, table, seq_lens, qsl.cuda()


def check(args, n=3):
    """Tolerance rule on the first ``n`` sequences."""
    q, k, v, table, seq_lens, qsl = args
    end = int(qsl[n])
    sub = (q[:end], k, v, table[:n], seq_lens[:n], qsl[: n + 1])
    out = paged_attention(*sub).double().cpu()
    oracle = reference.paged_attention(*sub)
    lowp = reference.paged_attention(*sub, compute_dtype=q.dtype)
    rel = lambda x: float((x.double() - oracle).norm() / oracle.norm())  # noqa: E731
    e_kernel, e_torch = rel(out), rel(lowp)
    if not (torch.isfinite(out).all() and e_kernel <= 2 * e_torch):
        raise SystemExit(f"correctness: kernel error {e_kernel:.3e} > 2 x torch {e_torch:.3e}")
    return e_kernel, e_torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    opts = ap.parse_args()
    dtype = DTYPES[opts.dtype]
    target = current_target()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    rows = []
    print(f"# {torch.cuda.get_device_name()} ({target.arch}), {opts.dtype}, commit {commit}")
    print(
        f"{'scenario':24} {'bs':>5} {'tiles (M,Q,H,N,stages)':>24} {'kernel us':>10} "
        f"{'call us':>9} {'GB/s':>7} {'copy GB/s':>9} {'err/torch':>10}"
    )
    for name, seqs in SCENARIOS.items():
        for bs in BLOCK_SIZES:
            args = make_inputs(seqs, bs, dtype)
            e_kernel, e_torch = check(args)
            plan = plan_paged_attention(*args)
            a = plan[0].args
            kernel_ms = do_bench(lambda plan=plan: run_all(plan))
            call_ms = do_bench(lambda args=args: paged_attention(*args))
            elem = torch.empty((), dtype=dtype).element_size()
            ctx = sum(s for s, _ in seqs)
            nbytes = 2 * ctx * HKV * D * elem + 2 * args[0].numel() * elem
            src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            copy_ms = do_bench(lambda src=src, dst=dst: dst.copy_(src))
            gbs, copy_gbs = nbytes / kernel_ms / 1e6, nbytes / copy_ms / 1e6
            tiles = (a["BLOCK_M"], a["BLOCK_Q"], a["HEAD_TILE"], a["BLOCK_N"])
            stages = plan[0].options.num_stages
            print(
                f"{name:24} {bs:>5} {str(tiles + (stages,)):>24} {kernel_ms * 1e3:>10.1f} "
                f"{call_ms * 1e3:>9.1f} {gbs:>7.0f} {copy_gbs:>9.0f} {e_kernel / e_torch:>10.2f}"
            )
            rows.append(
                dict(
                    scenario=name,
                    block_size=bs,
                    tiles=tiles,
                    num_stages=stages,
                    kernel_us=kernel_ms * 1e3,
                    call_us=call_ms * 1e3,
                    gbps=gbs,
                    copy_gbps=copy_gbs,
                    err_kernel=e_kernel,
                    err_torch=e_torch,
                )  # fmt: skip
            )
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_paged.json"), "w") as f:
            json.dump(
                dict(
                    device=torch.cuda.get_device_name(),
                    arch=target.arch,
                    dtype=opts.dtype,
                    commit=commit,
                    date=datetime.date.today().isoformat(),
                    rows=rows,
                ),  # fmt: skip
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
