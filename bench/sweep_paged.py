"""Tile sweep for paged_attention: a bounded set of tile variants per serving point, best 3 each.

Points (32 query heads, 8 KV heads, head_dim 128, bf16, inputs from bench_paged.make_inputs):
  * decode 64x4k at block_size 16 and 2048,
  * decode 4x16k at block_size 16 (split-KV: too few programs to fill the GPU without it),
  * mixed: one 512-token prefill chunk at 8k context + 63 decodes at 4k (block_size 16).

For each point the policy's own choice is one variant; the others change one or two knobs of it
(block_n, pipeline stages, warps, the M tile, the decode row tile, the split count), passed to
``plan_paged_attention(..., tiles=...)``. Every variant is checked first: its output on a few
sequences against torch in fp32 (error <= 2x torch's own bf16 error, tests/helpers.py's rule),
then timed as a CUDA graph of its launches (``triton.testing.do_bench_cudagraph``, median).
The policy's full serving call (maxima given, no host reads) is timed the same way, and for the
mixed point torch SDPA doing the same attention (prefill chunk + batched decode on contiguous
K/V) gives the target (issue 8: within 1.2x).

Usage::

    python bench/sweep_paged.py                 # all points, < 3 minutes on an H200
    python bench/sweep_paged.py --points mixed  # a subset (substring match on the point name)
    OUT=/tmp/out python bench/sweep_paged.py    # also writes $OUT/sweep_paged.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import save_record  # noqa: E402
from bench_paged import HKV, HQ, D, make_inputs  # noqa: E402

from portattn.kernels._launch import run_all  # noqa: E402
from portattn.kernels.paged_attention import paged_attention, plan_paged_attention  # noqa: E402
from portattn.platform import Target, current_target  # noqa: E402
from portattn.policy.common import launch_options  # noqa: E402
from portattn.policy.paged import (  # noqa: E402
    PagedTiles,
    RowTile,
    estimate_shared_mem,
)

# name -> ((seq_len, q_len), ...), block_size
POINTS = {
    "decode 64x4k bs16": (((4096, 1),) * 64, 16),
    "decode 64x4k bs2048": (((4096, 1),) * 64, 2048),
    "decode 4x16k bs16 (split-KV)": (((16384, 1),) * 4, 16),
    "mixed 512@8k + 63x4k bs16": (((8192, 512),) + ((4096, 1),) * 63, 16),
    "mixed 512@8k + 63x4k bs2048": (((8192, 512),) + ((4096, 1),) * 63, 2048),
    "prefill 4x2048@8k bs16": (((8192, 2048),) * 4, 16),
}
CHECK_SEQS = 2  # sequences checked per variant (the first ones: the prefill chunk of "mixed")


def variants(base: PagedTiles, target: Target, split_point: bool) -> dict[str, PagedTiles]:
    """The policy's tiles and a bounded set of one/two-knob changes that fit shared memory."""

    def opt(t: PagedTiles, warps: int | None = None, stages: int | None = None) -> PagedTiles:
        o = launch_options(target, warps or t.num_warps, stages or t.num_stages)
        return dataclasses.replace(t, options=o)

    out = {"policy": base}
    for n in (32, 64, 128):
        if n != base.block_n:
            out[f"block_n {n}"] = dataclasses.replace(base, block_n=n)
    for s in (2, 3, 4):
        if s != base.num_stages:
            out[f"stages {s}"] = opt(base, stages=s)
    other = 4 if base.num_warps == 8 else 8
    out[f"warps {other}"] = opt(base, warps=other)
    if base.decode is not None:  # mixed: the one-tile launch of before, and other main tiles
        out["no decode role"] = dataclasses.replace(base, decode=None)
        for m, n, warps, stages in ((64, 64, 4, 2), (64, 64, 8, 2), (64, 32, 8, 2),
                                    (64, 32, 4, 2), (64, 32, 4, 3), (64, 64, 4, 3),
                                    (32, 64, 4, 2), (128, 64, 8, 2)):  # fmt: skip
            if (m, n, warps, stages) != (base.block_m, base.block_n, base.num_warps,
                                         base.num_stages):  # fmt: skip
                rows = RowTile(m, m // base.head_tile, base.head_tile)
                t = dataclasses.replace(base, block_m=m, block_q=rows.block_q, block_n=n)
                out[f"M {m} N {n} x {warps} warps s{stages}"] = opt(t, warps=warps, stages=stages)
        out["M 128, N 128, 2 stages"] = opt(
            dataclasses.replace(base, block_m=128, block_q=128 // base.head_tile, block_n=128),
            warps=8,
            stages=2,
        )
    else:
        out["M 32 (8 tokens)"] = dataclasses.replace(base, block_m=32, block_q=32 // base.head_tile)
    if split_point:
        out[f"splits {base.num_splits}, block_n 32"] = dataclasses.replace(base, block_n=32)
        for s in (1, 4, 8, 16, 32):
            if s != base.num_splits:
                out[f"splits {s}"] = dataclasses.replace(base, num_splits=s)

    fits = {}
    for name, t in out.items():
        smem = estimate_shared_mem(t.block_m, t.block_n, t.block_d, 2, t.num_stages)
        if smem <= target.max_shared_mem:
            fits[name] = dataclasses.replace(t, shared_mem_bytes=smem)
    return fits


def torch_reference(args, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The first ``n`` sequences' outputs by torch on the GPU in ``dtype`` ([tokens, HQ, D])."""
    q, k, v, table, seq_lens, qsl = args
    bs = k.shape[1]
    outs = []
    for i in range(n):
        s, e, length = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
        blocks = table[i, : -(-length // bs)].long()
        kk = k[blocks].reshape(-1, HKV, D)[:length].to(dtype)  # [length, HKV, D]
        vv = v[blocks].reshape(-1, HKV, D)[:length].to(dtype)
        qq = q[s:e].to(dtype)  # [q_len, HQ, D]
        pos = torch.arange(length, device=q.device)
        limit = length - (e - s) + torch.arange(e - s, device=q.device) + 1
        mask = pos[None, :] < limit[:, None]  # [q_len, length]
        o = F.scaled_dot_product_attention(
            qq.transpose(0, 1)[None],
            kk.transpose(0, 1)[None],
            vv.transpose(0, 1)[None],
            attn_mask=mask,
            enable_gqa=True,
        )
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


def sdpa_time_ms(args, seqs) -> float | None:
    """torch SDPA doing the mixed point's work on contiguous K/V: the prefill chunk (explicit
    bottom-right causal mask) + the decodes as one batch. ``None`` if SDPA refuses a shape."""
    q, k, v, table, seq_lens, qsl = args
    (ctx, chunk), dec = seqs[0], seqs[1:]
    dev, dtype = q.device, q.dtype
    g = torch.Generator(device=dev).manual_seed(1)
    qp = torch.randn(1, HQ, chunk, D, device=dev, dtype=dtype, generator=g)
    kp = torch.randn(1, HKV, ctx, D, device=dev, dtype=dtype, generator=g)
    vp = torch.randn_like(kp)
    limit = ctx - chunk + torch.arange(chunk, device=dev) + 1
    mask = torch.arange(ctx, device=dev)[None, :] < limit[:, None]
    qd = torch.randn(len(dec), HQ, 1, D, device=dev, dtype=dtype, generator=g)
    kd = torch.randn(len(dec), HKV, dec[0][0], D, device=dev, dtype=dtype, generator=g)
    vd = torch.randn_like(kd)

    def work():
        F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, enable_gqa=True)
        F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)

    try:
        return do_bench_cudagraph(work)
    except RuntimeError:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default="", help="comma-separated substrings of point names")
    opts = ap.parse_args()
    target = current_target()
    dtype = torch.bfloat16
    t0 = time.time()
    report = []
    print(f"# {torch.cuda.get_device_name()} ({target.arch}), bf16, {HQ}q/{HKV}kv heads, d{D}")
    for name, (seqs, bs) in POINTS.items():
        if not any(part in name for part in opts.points.split(",")):
            continue
        args = make_inputs(seqs, bs, dtype)
        mql, msl = max(q for _, q in seqs), max(s for s, _ in seqs)
        base_plan = plan_paged_attention(*args, max_query_len=mql, max_seq_len=msl)
        base = base_plan[0]
        policy = _tiles_of(base_plan)
        n_rows = int(args[5][CHECK_SEQS])
        ref32 = torch_reference(args, CHECK_SEQS, torch.float32).double()
        lowp = torch_reference(args, CHECK_SEQS, dtype).double()
        e_torch = float((lowp - ref32).norm() / ref32.norm())
        rows = []
        for vname, tiles in variants(policy, target, "split" in name).items():
            plan = plan_paged_attention(*args, max_query_len=mql, max_seq_len=msl, tiles=tiles)
            run_all(plan)
            got = plan[0].outputs[0][:n_rows].double()
            e = float((got - ref32).norm() / ref32.norm())
            if not (torch.isfinite(got).all() and e <= 2 * e_torch):
                print(f"  {name}: {vname}: WRONG (error {e:.3e} > 2 x torch bf16 {e_torch:.3e})")
                rows.append(dict(variant=vname, error=e, us=None))
                continue
            us = do_bench_cudagraph(lambda plan=plan: run_all(plan)) * 1e3
            rows.append(dict(variant=vname, tiles=_describe(tiles), us=us, error=e))
        call = functools.partial(
            paged_attention, *args, max_query_len=mql, max_seq_len=msl, out=base.outputs[0]
        )
        call_us = do_bench_cudagraph(call) * 1e3
        sdpa = sdpa_time_ms(args, seqs) if name.startswith("mixed") else None
        timed = sorted((r for r in rows if r["us"] is not None), key=lambda r: r["us"])
        pol = next((r for r in rows if r["variant"] == "policy"), None)
        print(f"\n{name}: policy {_describe(policy)}")
        print(f"  full call (maxima given, CUDA graph): {call_us:.1f} us")
        if sdpa is not None:
            ratio = (pol["us"] if pol and pol["us"] else float("nan")) / (sdpa * 1e3)
            print(f"  torch SDPA, same work: {sdpa * 1e3:.1f} us; policy / SDPA = {ratio:.2f}")
        for rank, r in enumerate(timed[:3], 1):
            print(f"  #{rank} {r['us']:8.1f} us  {r['variant']:28} {r['tiles']}")
        if pol is not None and pol["us"] is not None and pol not in timed[:3]:
            print(f"  policy #{timed.index(pol) + 1}/{len(timed)}: {pol['us']:.1f} us")
        report.append(dict(point=name, call_us=call_us, sdpa_us=sdpa and sdpa * 1e3, rows=rows))
        torch.cuda.empty_cache()
    print(f"\n# sweep took {time.time() - t0:.0f} s")
    save_record("sweep_paged", points=report)


def _tiles_of(plan) -> PagedTiles:
    """The PagedTiles a plan's main launch carries (its constexprs and options)."""
    a = plan[0].args
    dec = None
    if a["DECODE_ROLE"]:
        dec = RowTile(a["DEC_BLOCK_M"], a["DEC_BLOCK_Q"], a["DEC_HEAD_TILE"])
    return PagedTiles(
        block_m=a["BLOCK_M"],
        block_q=a["BLOCK_Q"],
        head_tile=a["HEAD_TILE"],
        block_n=a["BLOCK_N"],
        block_d=a["BLOCK_D"],
        options=plan[0].options,
        shared_mem_bytes=0,
        decode=dec,
        num_splits=a["NUM_SPLITS"],
    )


def _describe(t: PagedTiles) -> str:
    dec = f" dec {t.decode.block_m}/{t.decode.block_q}x{t.decode.head_tile}" if t.decode else ""
    split = f" splits {t.num_splits}" if t.num_splits > 1 else ""
    return (
        f"M{t.block_m} ({t.block_q}x{t.head_tile}) N{t.block_n} "
        f"w{t.num_warps} s{t.num_stages}{dec}{split}"
    )


if __name__ == "__main__":
    main()
