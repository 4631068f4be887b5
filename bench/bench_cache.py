"""KV-cache write and gather timing on one GPU: exactness first, then medians vs a copy ceiling.

Default run (bf16, 8 KV heads, head_dim 128, NHD caches, block sizes 16 and 2048):
  * write_kv_cache: 16384 tokens into random distinct slots of a 65536-slot cache;
    baseline: two ``index_copy_`` (K and V) into the flat ``[slots, heads, d]`` views;
  * gather_kv_cache: 64 sequences x 4096 tokens from a shuffled block table;
    baseline: torch indexing (``cache.view(-1, heads, d)[slots]``, K and V).

For each: the kernel's result must equal the baseline's bit for bit; then ``do_bench`` medians
(CUDA events, L2 flushed) of the planned launch and of the baseline; bytes read + written
(``2 x`` the K+V payload) as GB/s next to a device-to-device copy of the same traffic and of
2 GB (measured in the same run).

Usage::

    python bench/bench_cache.py
    OUT=/tmp/out python bench/bench_cache.py     # also writes $OUT/bench_cache.json
"""

from __future__ import annotations

import argparse
import sys

import torch
from _common import copy_ceiling, git_commit, plan_with_target, save_record
from triton.testing import do_bench

from portattn.kernels._launch import run_all
from portattn.kernels.kv_cache import plan_gather_kv_cache, plan_write_kv_cache
from portattn.platform import current_target

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
H, D = 8, 128
BLOCK_SIZES = (16, 2048)


def write_case(bs, tokens, num_slots, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (num_slots // bs, bs, H, D)
    kc = torch.zeros(shape, device="cuda", dtype=dtype)
    vc = torch.zeros_like(kc)
    key = torch.randn(tokens, H, D, device="cuda", dtype=dtype, generator=g)
    value = torch.randn(tokens, H, D, device="cuda", dtype=dtype, generator=g)
    slots = torch.randperm(num_slots, device="cuda", generator=g)[:tokens].contiguous()
    return key, value, kc, vc, slots


def gather_case(bs, seqs, ctx, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    nb = -(-ctx // bs)
    kc = torch.randn(seqs * nb, bs, H, D, device="cuda", dtype=dtype, generator=g)
    vc = torch.randn_like(kc)
    table = torch.randperm(seqs * nb, device="cuda", generator=g).to(torch.int32).view(seqs, nb)
    cu = torch.arange(seqs + 1, device="cuda", dtype=torch.int32) * ctx
    slots = (table.long()[:, :, None] * bs + torch.arange(bs, device="cuda")).view(seqs, -1)
    slots = slots[:, :ctx].reshape(-1)
    out = tuple(torch.empty(seqs * ctx, H, D, device="cuda", dtype=dtype) for _ in range(2))
    return kc, vc, table, cu, slots, out


def row(op, bs, nbytes, kernel_ms, base_ms, copy_same, copy_big, exact, hip_ms, hip_exact):
    gbs = nbytes / (kernel_ms * 1e-3) / 1e9
    return dict(
        op=op, block_size=bs, bytes=nbytes, exact=exact, kernel_us=kernel_ms * 1e3,
        baseline_us=base_ms * 1e3, gb_per_s=gbs, copy_same_gb_per_s=copy_same,
        copy_2gb_gb_per_s=copy_big, pct_copy_same=100 * gbs / copy_same,
        pct_copy_2gb=100 * gbs / copy_big, vs_baseline=kernel_ms / base_ms,
        gfx942_us=hip_ms * 1e3, gfx942_exact=hip_exact,
    )  # fmt: skip


def fmt(r) -> str:
    return (
        f"{r['op']:7} {r['block_size']:>5} {r['bytes'] / 1e6:8.1f} {str(r['exact']):>5} "
        f"{r['kernel_us']:9.1f} {r['baseline_us']:9.1f} {r['vs_baseline']:6.2f} "
        f"{r['gb_per_s']:7.0f} {r['pct_copy_same']:6.1f} {r['pct_copy_2gb']:6.1f} "
        f"{r['gfx942_us']:9.1f} {str(r['gfx942_exact']):>5}"
    )


HEADER = (
    f"{'op':7} {'bs':>5} {'MB moved':>8} {'exact':>5} {'kernel us':>9} {'torch us':>9} "
    f"{'k/torch':>6} {'GB/s':>7} {'%copy=':>6} {'%copy2G':>6} {'gfx942 us':>9} {'exact':>5}"
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--write-tokens", type=int, default=16384)
    ap.add_argument("--write-slots", type=int, default=65536)
    ap.add_argument("--gather-seqs", type=int, default=64)
    ap.add_argument("--gather-context", type=int, default=4096)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_cache: needs a CUDA/HIP device")
    dtype = DTYPES[args.dtype]
    target = current_target()
    big, _ = copy_ceiling(2 * 1024**3)
    print(f"# {torch.cuda.get_device_name()} ({target.arch}), {args.dtype}, commit {git_commit()}")
    print(f"copy ceiling (2 GB moved): {big:.0f} GB/s")
    print(HEADER)
    rows, failed = [], False
    for bs in BLOCK_SIZES:
        # -- write --
        key, value, kc, vc, slots = write_case(bs, args.write_tokens, args.write_slots, dtype)
        ref_k, ref_v = kc.clone(), vc.clone()
        ref_k.view(-1, H, D).index_copy_(0, slots, key)
        ref_v.view(-1, H, D).index_copy_(0, slots, value)
        plan = plan_write_kv_cache(key, value, kc, vc, slots)
        run_all(plan)
        exact = bool(torch.equal(kc, ref_k) and torch.equal(vc, ref_v))
        hplan = plan_with_target("gfx942", plan_write_kv_cache, key, value, kc, vc, slots)
        kc.zero_()
        vc.zero_()
        run_all(hplan)
        hip_exact = bool(torch.equal(kc, ref_k) and torch.equal(vc, ref_v))
        kernel_ms = do_bench(lambda plan=plan: run_all(plan), return_mode="median")
        hip_ms = do_bench(lambda hplan=hplan: run_all(hplan), return_mode="median")

        def base(kc=kc, vc=vc, key=key, value=value, slots=slots):
            kc.view(-1, H, D).index_copy_(0, slots, key)
            vc.view(-1, H, D).index_copy_(0, slots, value)

        base_ms = do_bench(base, return_mode="median")
        nbytes = 2 * 2 * key.numel() * key.element_size()  # K+V read and written
        same, _ = copy_ceiling(nbytes)
        r = row("write", bs, nbytes, kernel_ms, base_ms, same, big, exact, hip_ms, hip_exact)
        print(fmt(r), flush=True)
        rows.append(r)
        del key, value, kc, vc, ref_k, ref_v
        # -- gather --
        kc, vc, table, cu, slots, out = gather_case(
            bs, args.gather_seqs, args.gather_context, dtype
        )
        ref_k, ref_v = kc.view(-1, H, D)[slots], vc.view(-1, H, D)[slots]
        plan = plan_gather_kv_cache(kc, vc, table, cu, out=out)
        run_all(plan)
        exact = bool(torch.equal(out[0], ref_k) and torch.equal(out[1], ref_v))
        hplan = plan_with_target("gfx942", plan_gather_kv_cache, kc, vc, table, cu, out=out)
        out[0].zero_()
        out[1].zero_()
        run_all(hplan)
        hip_exact = bool(torch.equal(out[0], ref_k) and torch.equal(out[1], ref_v))
        kernel_ms = do_bench(lambda plan=plan: run_all(plan), return_mode="median")
        hip_ms = do_bench(lambda hplan=hplan: run_all(hplan), return_mode="median")

        def base_g(kc=kc, vc=vc, slots=slots, out=out):
            torch.index_select(kc.view(-1, H, D), 0, slots, out=out[0])
            torch.index_select(vc.view(-1, H, D), 0, slots, out=out[1])

        base_ms = do_bench(base_g, return_mode="median")
        nbytes = 2 * 2 * ref_k.numel() * ref_k.element_size()
        same, _ = copy_ceiling(nbytes)
        r = row("gather", bs, nbytes, kernel_ms, base_ms, same, big, exact, hip_ms, hip_exact)
        print(fmt(r), flush=True)
        rows.append(r)
        failed |= not (r["exact"] and r["gfx942_exact"]) or not (rows[-2]["exact"])
        del kc, vc, table, cu, slots, out, ref_k, ref_v
        torch.cuda.empty_cache()
    print("== summary (goal: >= 85% of the copy ceiling)")
    for r in rows:
        print(
            f"{r['op']} bs {r['block_size']}: {r['pct_copy_same']:.1f}% of same-size copy, "
            f"{r['pct_copy_2gb']:.1f}% of 2 GB copy, {r['vs_baseline']:.2f}x torch, "
            f"exact {r['exact']}, gfx942 tiles {r['gfx942_us']:.1f} us exact {r['gfx942_exact']}"
        )
    save_record("bench_cache", arch=target.arch, copy_2gb_gb_per_s=big, rows=rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
