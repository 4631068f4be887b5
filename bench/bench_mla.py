"""MLA decode timing on one GPU: correctness first, then medians, with a copy ceiling.

Default run (the issue's first timing): batch 64, contexts 4k and 16k, 16 and 128 heads, 576/512
(DeepSeek-V3), page size 64, bf16, random inputs. For each point:

1. correctness: the kernel's output for the first sequences against an fp64 oracle, under the
   tolerance rule of tests/helpers.py (error <= 2x torch's own bf16 error); a failure stops the run;
2. ``triton.testing.do_bench`` median (CUDA events, L2 flushed) of ``mla_decode`` with metadata
   from `MlaMetadataBuilder` (workspaces preallocated), and ``do_bench_cudagraph`` median of the
   same call captured in a CUDA graph (no launch overhead);
3. the bytes the kernel must read (latent cache of every context token, query) and write, as an
   effective bandwidth, next to a device-to-device copy ceiling measured in the same run
   (``dst.copy_(src)`` of a buffer as large as the KV read: bytes read + written / time).

Usage::

    python bench/bench_mla.py                     # the default table
    python bench/bench_mla.py --sweep             # also try other BLOCK_N / stages / splits
    OUT=/tmp/out python bench/bench_mla.py        # also writes $OUT/bench_mla.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import subprocess
import sys

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from portattn.kernels._launch import run_all
from portattn.kernels.mla_decode import mla_decode, plan_mla_decode
from portattn.mla_metadata import MlaMetadataBuilder
from portattn.platform import current_target

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def make_inputs(batch, context, heads, dk, page, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    per_seq = -(-context // page)
    num_blocks = batch * per_seq
    cache = torch.randn(num_blocks, page, dk, device="cuda", dtype=dtype, generator=g)
    perm = torch.randperm(num_blocks, device="cuda", generator=g).to(torch.int32)
    block_table = perm.view(batch, per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, heads, dk, device="cuda", dtype=dtype, generator=g)
    return query, cache, block_table, seq_lens


def oracle(query, cache, block_table, seq_lens, r, scale, dtype, num_seqs):
    """The reference maths for the first ``num_seqs`` sequences (one query token each)."""
    page = cache.shape[1]
    outs = []
    for i in range(num_seqs):
        n = int(seq_lens[i])
        nb = -(-n // page)
        c = cache[block_table[i, :nb].long()].reshape(nb * page, -1)[:n].to(dtype)
        s = torch.einsum("hd,ld->hl", query[i].to(dtype), c) * scale
        outs.append(torch.softmax(s, dim=-1) @ c[:, :r])
    return torch.stack(outs)


def rel_err(x, ref):
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm())


def check(out, query, cache, block_table, seq_lens, r, scale, dtype, num_seqs=2):
    ref = oracle(query, cache, block_table, seq_lens, r, scale, torch.float64, num_seqs)
    low = oracle(query, cache, block_table, seq_lens, r, scale, dtype, num_seqs)
    e_kernel, e_torch = rel_err(out[:num_seqs], ref), rel_err(low, ref)
    ok = bool(torch.isfinite(out).all()) and e_kernel <= 2 * e_torch
    return ok, e_kernel, e_torch


def copy_ceiling(nbytes):
    """Device-to-device copy of ``nbytes``: (bytes read + written) / median time, GB/s."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() * 2 / (ms * 1e-3) / 1e9, ms


def tile_variants(tiles):
    """Alternative tiles for --sweep (same widths and head padding; other BLOCK_N/stages/splits)."""
    seen = {tiles}
    for block_n in (16, 32, 64):
        for stages in (1, 2, 3):
            for splits in sorted({1, tiles.num_kv_splits, 2 * tiles.num_kv_splits, 8}):
                opts = dataclasses.replace(tiles.options, num_stages=stages)
                t = dataclasses.replace(tiles, block_n=block_n, options=opts, num_kv_splits=splits)
                if t not in seen:
                    seen.add(t)
                    yield t


def git_commit():
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def bench_point(args, target, dtype, heads, ctx, copy_gbs):
    """Check then time one (heads, context) point; the rows, or None on a failed check."""
    dk, r = args.head_dim_k, args.kv_lora_rank
    scale = 1 / math.sqrt(dk)
    q, cache, bt, sl = make_inputs(args.batch, ctx, heads, dk, args.page, dtype)
    builder = MlaMetadataBuilder(
        target,
        max_batch=args.batch,
        num_heads=heads,
        kv_lora_rank=r,
        head_dim_k=dk,
        dtype=dtype,
        device="cuda",
        max_seq_len=ctx,
    )
    md = builder.build(sl)
    out = torch.empty(args.batch, heads, r, dtype=dtype, device="cuda")
    kw = dict(kv_lora_rank=r, scale=scale, out=out)
    nbytes = (
        args.batch * ctx * dk * cache.element_size()
        + q.numel() * q.element_size()
        + out.numel() * out.element_size()
    )
    candidates = [("policy", None)]
    if args.sweep:
        candidates += [("sweep", t) for t in tile_variants(builder.tiles)]
    rows = []
    for kind, tiles in candidates:
        if tiles is None:
            fn = lambda: mla_decode(q, cache, bt, sl, metadata=md, **kw)  # noqa: E731
            t = builder.tiles
        else:
            launches = plan_mla_decode(q, cache, bt, sl, tiles=tiles, **kw)
            fn = lambda launches=launches: run_all(launches)  # noqa: E731
            t = tiles
        out.fill_(float("nan"))
        try:
            fn()
        except triton.runtime.errors.OutOfResources as e:  # a sweep tile too large
            print(f"{heads:>5} {ctx:>6} skipped {t}: {e}")
            continue
        torch.cuda.synchronize()
        ok, e_k, e_t = check(out, q, cache, bt, sl, r, scale, dtype)
        if not ok:
            print(f"FAIL {heads=} {ctx=} {kind} {t}: kernel {e_k:.3e} vs torch {e_t:.3e}")
            return None
        ms = do_bench(fn, return_mode="median")
        ms_graph = do_bench_cudagraph(fn, return_mode="median")
        gbs = nbytes / (min(ms, ms_graph) * 1e-3) / 1e9
        desc = f"{t.block_n},{t.options.num_stages},{t.num_kv_splits},{t.block_h}"
        print(
            f"{heads:>5} {ctx:>6} {desc:>26} {'ok':>6} {ms * 1e3:>10.1f} "
            f"{ms_graph * 1e3:>9.1f} {gbs:>7.0f} {100 * gbs / copy_gbs:>6.1f}"
            + ("" if kind == "policy" else "  (sweep)")
        )
        rows.append(
            dict(
                kind=kind,
                heads=heads,
                context=ctx,
                batch=args.batch,
                head_dim_k=dk,
                kv_lora_rank=r,
                page=args.page,
                dtype=str(dtype).removeprefix("torch."),
                block_n=t.block_n,
                num_stages=t.options.num_stages,
                num_warps=t.options.num_warps,
                num_kv_splits=t.num_kv_splits,
                block_h=t.block_h,
                padded_heads=t.padded_heads,
                rel_err_kernel=e_k,
                rel_err_torch=e_t,
                median_ms_events=ms,
                median_ms_graph=ms_graph,
                bytes=nbytes,
                gb_per_s=gbs,
                pct_of_copy=100 * gbs / copy_gbs,
            )
        )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--head-dim-k", type=int, default=576)
    ap.add_argument("--kv-lora-rank", type=int, default=512)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--sweep", action="store_true", help="also time alternative tiles")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_mla: needs a CUDA/HIP device")

    target = current_target()
    dtype = DTYPES[args.dtype]
    dk = args.head_dim_k
    rows: list[dict] = []
    max_ctx = max(args.contexts)
    kv_bytes_max = args.batch * max_ctx * dk * torch.finfo(dtype).bits // 8
    copy_gbs, copy_ms = copy_ceiling(kv_bytes_max)
    header = (
        f"{'heads':>5} {'ctx':>6} {'tiles (N,stages,splits,H)':>26} {'check':>6} "
        f"{'events us':>10} {'graph us':>9} {'GB/s':>7} {'% copy':>6}"
    )
    print(f"device: {torch.cuda.get_device_name()} ({target.arch}), commit {git_commit()}")
    print(f"copy ceiling: {copy_gbs:.0f} GB/s ({kv_bytes_max / 1e9:.2f} GB in {copy_ms:.3f} ms)")
    print(header)
    for heads in args.heads:
        for ctx in args.contexts:
            point = bench_point(args, target, dtype, heads, ctx, copy_gbs)
            if point is None:
                return 1
            rows += point
            torch.cuda.empty_cache()
    result = dict(
        device=torch.cuda.get_device_name(),
        arch=target.arch,
        commit=git_commit(),
        date=datetime.date.today().isoformat(),
        torch=torch.__version__,
        triton=triton.__version__,
        command=" ".join(sys.argv),
        copy_gb_per_s=copy_gbs,
        rows=rows,
    )
    out_dir = os.environ.get("OUT")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "bench_mla.json"), "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
