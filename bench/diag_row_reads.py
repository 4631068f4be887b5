"""Diagnostic (issue 18, MLA page 1): how fast this GPU reads an MLA cache's rows in the orders
the MLA benchmark's caches are read, with no attention maths in the way.

Each program of a small Triton kernel reads 64 rows of ``[rows, 576]`` bf16 (1152 bytes a row)
through an index array and writes one fp32 sum (checked against torch first). Orders, for the
caches of ``bench_mla.py``'s 128-head points (64 sequences x context tokens):

- ``sequential``: rows in memory order (the copy-like ceiling of a read-only stream);
- ``pages 64``: 64-row pages in a random order (each program one page: the TMA path's reads);
- ``rows 1``: single rows in a random order (page size 1: the gather path's reads).

The rate is the cache's bytes / median time (``do_bench``); with ``--readers 2`` two adjacent
programs read each row group, as the two 64-head groups of a 128-head MLA call do (loads
``.cg``, through L2 only, as the gather's ``cp.async.cg``). If ``rows 1`` reads much slower than
``pages 64`` here, the page-1 gather's gap to page 64 is the memory system's, not the kernel's.

Usage (GPU machine, repository root)::

    python3 bench/diag_row_reads.py                      # contexts 4096 16384
    OUT=/tmp/out python3 bench/diag_row_reads.py --contexts 16384
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from _common import save_record
from triton.testing import do_bench

ROW = 576  # MLA head_dim_k: 512 latent + 64 rope
ROWS = 64  # rows a program reads (one page of 64 / 64 gathered rows)
CHUNK = 64  # columns a load


@triton.jit
def _row_sums(cache, idx, out, stride_row, ROWS: tl.constexpr, D: tl.constexpr,
              CHUNK: tl.constexpr, READERS: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    group = pid // READERS  # READERS adjacent programs read the same rows (MLA's head groups)
    r = tl.load(idx + group * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, CHUNK)
    acc = tl.zeros([ROWS, CHUNK], dtype=tl.float32)
    for c in tl.range(0, D, CHUNK):
        ptrs = cache + r[:, None] * stride_row + (c + cols)[None, :]
        acc += tl.load(ptrs, cache_modifier=".cg").to(tl.float32)  # L2 only, as cp.async.cg
    tl.store(out + pid, tl.sum(acc))


def orders(num_rows: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The row index arrays (int32, ``num_rows``, on ``gen``'s device) of each order."""
    dev = gen.device
    seq = torch.arange(num_rows, device=dev, dtype=torch.int32)
    pages = torch.randperm(num_rows // ROWS, device=dev, generator=gen).to(torch.int32)
    paged = (pages[:, None] * ROWS + torch.arange(ROWS, device=dev, dtype=torch.int32)).flatten()
    rows = torch.randperm(num_rows, device=dev, generator=gen).to(torch.int32)
    return {"sequential": seq, "pages 64": paged, "rows 1": rows}


def run(context: int, batch: int, num_warps: int, readers: int,
        gen: torch.Generator) -> list[dict]:  # fmt: skip
    num_rows = batch * context
    cache = torch.randn(num_rows, ROW, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = torch.empty(num_rows // ROWS * readers, device="cuda", dtype=torch.float32)
    grid = (num_rows // ROWS * readers,)
    nbytes = num_rows * ROW * cache.element_size()
    rows = []
    for name, idx in orders(num_rows, gen).items():

        def call(idx=idx):
            _row_sums[grid](cache, idx, out, cache.stride(0), ROWS, ROW, CHUNK, readers,
                            num_warps=num_warps)  # fmt: skip

        call()
        ref = cache[idx.long()].float().view(-1, ROWS * ROW).sum(1).repeat_interleave(readers)
        ok = torch.allclose(out, ref, rtol=1e-3, atol=1e-2)
        ms = do_bench(call, warmup=25, rep=200, return_mode="median")
        rows.append(dict(context=context, order=name, readers=readers, ok=bool(ok), us=ms * 1e3,
                         gbs=nbytes / ms / 1e6, gb=nbytes / 1e9))  # fmt: skip
        r = rows[-1]
        print(
            f"  ctx {context:6d} {name:10s} x{readers} check ok={ok}  {r['us']:9.1f} us  "
            f"{r['gbs']:7.0f} GB/s of the cache ({readers * r['gbs']:7.0f} GB/s to the SMs)"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--readers", type=int, nargs="+", default=[1],
                    help="programs reading each row group (2: as the MLA kernel's two head "
                    "groups at 128 heads)")  # fmt: skip
    args = ap.parse_args()
    if args.batch < 1 or any(c < ROWS or c % ROWS for c in args.contexts):
        ap.error(f"--batch must be >= 1 and each --contexts a positive multiple of {ROWS}")
    if any(n < 1 for n in args.readers):
        ap.error("--readers must be >= 1")
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}; rows of {ROW} bf16, {ROWS} a program, "
          f"{args.warps} warps")  # fmt: skip
    rows = []
    for ctx in args.contexts:
        for n in args.readers:
            rows += run(ctx, args.batch, args.warps, n, gen)
    if not all(r["ok"] for r in rows):
        raise SystemExit("a check failed: the rates above are not valid")
    save_record("diag_row_reads", rows=rows)


if __name__ == "__main__":
    main()
