"""MLA decode timing on one GPU: correctness first, then medians, a copy ceiling and a roofline.

Default run (issue 8's points): batch 64, contexts 1k, 4k and 16k, 16 and 128 heads, 576/512
(DeepSeek-V3), page size 64, bf16, random inputs. Measured once per run: a device-to-device copy
ceiling (bytes read + written / time, buffer as large as the largest KV read) and a bf16 matmul
rate (``torch.mm`` 8192^3). For each point:

1. correctness: the kernel's output for the first sequences against an fp64 oracle, under the
   tolerance rule of tests/helpers.py (error <= 2x torch's own bf16 error); a failed policy check
   stops the run, a failed sweep variant is reported and dropped;
2. ``triton.testing.do_bench`` median (CUDA events, L2 flushed) of ``mla_decode`` with metadata
   from `MlaMetadataBuilder`, and ``do_bench_cudagraph`` median of the same call captured in a
   CUDA graph (no launch overhead);
3. roofline: bytes (latent + rope cache read once, query, output) / copy ceiling and flops
   (``2 * heads * context * (head_dim_k + kv_lora_rank)`` per token) / matmul rate; the larger is
   the roofline time, and ``x roof`` = measured / roofline (1.0 is ideal). The matmul rate is
   also measured again just before each point (and each verification point); the summary ends
   with every policy row's ratio at the run's rate and at its point's (``x_roofline_point``):
   the run's rate is taken on a card not yet warm from the timings that follow;
4. the HIP (gfx942) policy's tiles on this GPU (HIP-only launch options dropped): check + time;
5. ``--sweep``: tile variants, each checked then timed with ``do_bench_cudagraph``. Phase A varies
   the shape (BLOCK_H 16/32/64, BLOCK_N, stages, warps) at a 2-wave split count, phase B the split
   count of the 3 best shapes (1, 4, 8 waves); later contexts of one head count retry only the 6
   best shapes of the first. Shapes that spill on sm_90 (`SPILLS_SM90`, from CPU compiles) are
   not timed there; variants that do not compile (OutOfResources) are skipped; a wall budget
   (``--budget-s``) bounds the whole sweep. Each sweep row records the compiled kernel's
   registers, spills and shared memory.

Page sizes (issue 18): ``--page`` takes several sizes; each gets its own cache (same contents
order, blocks shuffled) and a policy row, and ``--page-indices`` adds, for each size, a row
whose call passes ``page_indices`` from ``expand_page_indices`` instead of the block table (the
speculative-decoding path). The summary ends with each row's time over the first page size's
block-table row at the same point (goal for page 1 against 64: <= 1.15). With ``--rounds R``
every point's inputs stay alive and, once all have run, each policy (and page_indices) row's call
is timed ``R - 1`` more times in turns, the bf16 matmul rate measured before each round; each
row keeps its median (``us_rounds``), and its ratio at the rounds' median rate
(``x_roof_turns``) is printed beside the others (`_page_rounds`).

``--q-len N [N ...]`` (speculative verification, issue 18) replaces the decode points: each
sequence has ``N`` query tokens (varlen ``query_start_loc``, context ``ctx`` including them; token
``j`` sees ``ctx - N + j + 1`` positions). Per point, each checked on the first sequences against
an fp64 causal oracle and timed with ``do_bench_cudagraph``: ``policy`` (the builder's tiles: row
packing where `PACK_QUERY_ROWS` takes it), ``unpacked`` (the same with the switch off) and ``qsep``
(``N`` separate single-token decode calls, token ``j`` of every sequence at its own context length,
in one graph); where the policy packs, also ``decode``: one plain decode step (the last token)
served by the same packed builder, against ``qsep / N``. Roofline: bytes = the cache read once per
sequence + queries + outputs, flops = ``2 * N * heads * ctx * (head_dim_k + kv_lora_rank)`` per
sequence; the goal is ``policy`` within 1.3x of it and never slower than ``qsep``. With
``--rounds R`` each point's calls are timed R times in turns (policy, unpacked, decode, qsep,
then the order rotated each round) and each row keeps the median (``us_rounds``): one slow
timing (the same launch once measured 18% slower than itself in the same run) no longer decides
a verdict.

Usage::

    python bench/bench_mla.py                     # policy + HIP policy + roofline table
    python bench/bench_mla.py --contexts 4096 16384 --heads 16 128 --page 64 1 --page-indices \
        --no-hip                                  # page 1 (both index forms) against page 64
    python bench/bench_mla.py --q-len 2 4 8 --contexts 4096 --heads 16 128   # verification
    python bench/bench_mla.py --heads 128 --contexts 4096 16384 --page 64 1 --no-hip --rounds 5
    python bench/bench_mla.py --sweep             # also the tile sweep (best 3 per point at end)
    OUT=/tmp/out python bench/bench_mla.py        # also writes $OUT/bench_mla.json (+ _sweep.json)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time

import torch
import triton
from _common import (
    at_point_ceiling,
    copy_ceiling,
    git_commit,
    matmul_rate,
    plan_with_target,
    roofline_s,
    save_record,
    set_switch,
    turn_order,
)
from triton.testing import do_bench, do_bench_cudagraph

from portattn.kernels._launch import run_all
from portattn.kernels.mla_decode import mla_decode, plan_mla_decode
from portattn.kernels.page_indices import expand_page_indices
from portattn.mla_metadata import MlaMetadataBuilder
from portattn.platform import current_target
from portattn.policy import mla as mla_policy
from portattn.policy.common import LaunchOptions
from portattn.policy.mla import (
    MIN_TOKENS_PER_SPLIT,
    MlaTiles,
    mla_num_kv_splits,
    mla_programs_per_sm,
    mla_smem_bytes,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: (BLOCK_N, num_stages) tried with BLOCK_H 16 when there are at most 16 heads (all that fit).
SHAPES_SMALL_H = [(32, 1), (32, 2), (32, 3), (64, 1), (64, 2), (64, 3), (128, 1)]
#: (BLOCK_N, num_stages) tried with BLOCK_H 16 for many heads (the first timing's neighbourhood).
SHAPES_H16_MANY = [(32, 2), (32, 3), (64, 2), (128, 1)]
#: (BLOCK_N, num_stages) tried with BLOCK_H >= 32 (register-heavy: short tiles).
SHAPES_BIG_H = [(32, 1), (32, 2), (32, 3), (64, 1), (64, 2)]
WARPS = (4, 8)
#: Shapes (BLOCK_H, BLOCK_N, stages, warps) that spill registers when compiled for sm_90 on a CPU
#: (Triton 3.6, 576/512 bf16; `portattn.compile.worker.compile_launch`): not timed on sm_90.
#: All BLOCK_H 128 shapes spill >= 2800 registers (and 8 warps need 262144 B of shared memory),
#: so BLOCK_H 128 is left out of the sweep. num_stages 4 compiles to the same shared memory as 3.
SPILLS_SM90 = frozenset(
    [(16, 64, 2, 4), (16, 128, 1, 4), (64, 32, 1, 8), (64, 64, 1, 8)]
    + [(bh, bn, st, 4) for bh in (32, 64) for bn, st in SHAPES_BIG_H]
)
MAX_SPLITS = 64
#: Phase 0 (prefetched row offsets), (BLOCK_H, BLOCK_N, stages, warps); key: more than 16 heads.
#: From sm_90 CPU compiles: H16 N32 s3/s4 w4 double-buffers without spills; H64 N64 s2 w8 spills
#: 100 registers with prefetch (left out), H64 N32 s3 w8 double-buffers (184320 B) unspilled.
PREFETCH_SHAPES = {
    False: [(16, 32, 3, 4), (16, 32, 4, 4), (16, 32, 2, 4), (16, 64, 3, 8), (16, 32, 3, 8)],
    True: [(64, 32, 3, 8), (64, 32, 2, 8), (64, 64, 2, 8), (32, 32, 3, 8)],
}


def make_inputs(batch, context, heads, dk, page, dtype, seed=0, resident=0):
    """Random query and cache, the pages of each sequence scattered over the cache. ``resident``
    (a diagnostic, `--resident`): every sequence's pages are taken from the first ``resident``
    tokens' pages only, so the whole read stays in L2; the times then say what the kernel does
    without DRAM, not what a serving call costs."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    per_seq = -(-context // page)
    num_blocks = batch * per_seq
    cache = torch.randn(num_blocks, page, dk, device="cuda", dtype=dtype, generator=g)
    perm = torch.randperm(num_blocks, device="cuda", generator=g).to(torch.int32)
    if resident:
        perm = perm % max(1, resident // page)
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


class Checker:
    """The tolerance rule on the first sequences; the oracles are computed once per point."""

    def __init__(self, query, cache, block_table, seq_lens, r, scale, dtype, num_seqs=2):
        self.n = num_seqs
        self.ref = oracle(query, cache, block_table, seq_lens, r, scale, torch.float64, num_seqs)
        low = oracle(query, cache, block_table, seq_lens, r, scale, dtype, num_seqs)
        self.e_torch = rel_err(low, self.ref)

    def __call__(self, out):
        e_kernel = rel_err(out[: self.n], self.ref)
        ok = bool(torch.isfinite(out).all()) and e_kernel <= 2 * self.e_torch
        return ok, e_kernel, self.e_torch


def variant(
    base: MlaTiles, heads, block_h, block_n, stages, warps, splits, elem, prefetch=False
) -> MlaTiles:
    """``base`` with another head block / KV tile / pipeline / warps / split count / prefetch."""
    return dataclasses.replace(
        base,
        block_h=block_h,
        padded_heads=-(-heads // block_h) * block_h,
        block_n=block_n,
        num_kv_splits=splits,
        options=LaunchOptions(num_warps=warps, num_stages=stages),
        smem_bytes=mla_smem_bytes(
            block_h, block_n, base.block_dv, base.block_dpe, stages, elem, prefetch
        ),
        prefetch_rows=prefetch,
    )


def splits_for_waves(waves, target, batch, head_groups, ctx):
    """Split count giving ``waves`` programs per SM (capped by context and MAX_SPLITS)."""
    want = -(-waves * target.num_sms // max(1, batch * head_groups))
    return max(1, min(want, max(1, ctx // MIN_TOKENS_PER_SPLIT), MAX_SPLITS))


def shape_candidates(heads, base, target, elem):
    """Phase A shapes ``(block_h, block_n, stages, warps)`` within the shared-memory budget."""
    block_hs = [16] if heads <= 16 else [h for h in (16, 32, 64) if h < 2 * heads]
    out = []
    for bh in block_hs:
        shapes = SHAPES_SMALL_H if heads <= 16 else SHAPES_H16_MANY if bh == 16 else SHAPES_BIG_H
        for bn, st in shapes:
            smem = mla_smem_bytes(bh, bn, base.block_dv, base.block_dpe, st, elem)
            if smem > target.max_shared_mem:
                continue
            for w in WARPS:
                if target.arch == "sm_90" and (bh, bn, st, w) in SPILLS_SM90:
                    continue
                out.append((bh, bn, st, w))
    return out


def tiles_desc(t: MlaTiles) -> str:
    return (
        f"H{t.block_h} N{t.block_n} s{t.options.num_stages} w{t.options.num_warps} "
        f"x{t.num_kv_splits}"
        + (" P" if t.prefetch_rows else "")
        + (" V" if t.v_reload else "")
        + (" T" if t.tma else "")
        + (" G" if t.sm90_kernel else "")
    )


def roofline(batch, heads, ctx, dk, r, elem, copy_gbs, mm_tflops):
    nbytes = batch * ctx * dk * elem + batch * heads * (dk + r) * elem
    flops = 2 * batch * heads * ctx * (dk + r)
    t_bytes = nbytes / (copy_gbs * 1e9) * 1e6
    t_flops = flops / (mm_tflops * 1e12) * 1e6
    return dict(bytes=nbytes, flops=flops, us_bytes=t_bytes, us_flops=t_flops,
                us_roof=max(t_bytes, t_flops))  # fmt: skip


class Point:
    """One (heads, context) benchmark point: inputs, checker, roofline, timing helpers."""

    def __init__(self, args, target, dtype, heads, ctx, copy_gbs, mm_tflops, page):
        self.args, self.target, self.dtype, self.heads, self.ctx = args, target, dtype, heads, ctx
        self.page = page
        dk, r = args.head_dim_k, args.kv_lora_rank
        self.scale = 1 / math.sqrt(dk)
        self.q, self.cache, self.bt, self.sl = make_inputs(
            args.batch, ctx, heads, dk, page, dtype, resident=args.resident
        )
        self.out = torch.empty(args.batch, heads, r, dtype=dtype, device="cuda")
        self.kw = dict(kv_lora_rank=r, scale=self.scale, out=self.out)
        self.check = Checker(self.q, self.cache, self.bt, self.sl, r, self.scale, dtype)
        self.roof = roofline(
            args.batch, heads, ctx, dk, r, self.cache.element_size(), copy_gbs, mm_tflops
        )
        self.copy_gbs = copy_gbs

    def plan(self, tiles):
        return plan_mla_decode(self.q, self.cache, self.bt, self.sl, tiles=tiles, **self.kw)

    def run_checked(self, fn):
        """Run once; ``(ok, e_kernel, e_torch)`` or None when the tile does not compile."""
        self.out.fill_(float("nan"))
        try:
            fn()
        except triton.runtime.errors.OutOfResources:
            return None
        torch.cuda.synchronize()
        return self.check(self.out)

    def row(self, kind, t: MlaTiles, errs, us_graph, us_events=None):
        row = dict(
            kind=kind, heads=self.heads, context=self.ctx, batch=self.args.batch,
            head_dim_k=self.args.head_dim_k, kv_lora_rank=self.args.kv_lora_rank,
            page=self.page, dtype=str(self.dtype).removeprefix("torch."),
            block_h=t.block_h, padded_heads=t.padded_heads, block_n=t.block_n,
            num_stages=t.options.num_stages, num_warps=t.options.num_warps,
            num_kv_splits=t.num_kv_splits, smem_estimate=t.smem_bytes,
            prefetch_rows=t.prefetch_rows, v_reload=t.v_reload, tma=t.tma,
            sm90_kernel=t.sm90_kernel,
            rel_err_kernel=errs[1], rel_err_torch=errs[2],
            us_events=us_events, **{f"roof_{k}": v for k, v in self.roof.items()},
        )  # fmt: skip
        set_graph_time(row, us_graph, self.copy_gbs)
        return row


def set_graph_time(row: dict, us_graph: float, copy_gbs: float) -> None:
    """A page row's graph time and the figures that derive from it, taken at the faster of it
    and the row's events time (``gb_per_s``, ``pct_of_copy``, ``x_roofline`` at the run's
    ceilings)."""
    us = us_graph if row["us_events"] is None else min(us_graph, row["us_events"])
    row["us_graph"] = us_graph
    row["gb_per_s"] = row["roof_bytes"] / (us * 1e-6) / 1e9
    row["pct_of_copy"] = 100 * row["gb_per_s"] / copy_gbs
    row["x_roofline"] = us / row["roof_us_roof"]


def fmt_row(row) -> str:
    t = (
        f"H{row['block_h']} N{row['block_n']} s{row['num_stages']} w{row['num_warps']} "
        f"x{row['num_kv_splits']}"
        + (" P" if row.get("prefetch_rows") else "")
        + (" V" if row.get("v_reload") else "")
        + (" T" if row.get("tma") else "")
        + (" G" if row.get("sm90_kernel") else "")
    )
    ev = f"{row['us_events']:9.1f}" if row["us_events"] is not None else f"{'-':>9}"
    return (
        f"{row['heads']:>5} {row['context']:>6} {row['page']:>4} {row['kind']:>7} {t:>20} {ev} "
        f"{row['us_graph']:9.1f} {row['gb_per_s']:6.0f} {row['pct_of_copy']:6.1f} "
        f"{row['x_roofline']:6.2f}"
    )


HEADER = (
    f"{'heads':>5} {'ctx':>6} {'page':>4} {'kind':>7} {'tiles (H,N,stages,warps,splits)':>20} "
    f"{'events us':>9} {'graph us':>9} {'GB/s':>6} {'%copy':>6} {'xroof':>6}"
)


def bench_policy(p: Point, slots: bool = False, timed: list | None = None):
    """The policy's tiles through `MlaMetadataBuilder` (the serving path); None on a failure.
    ``slots``: pass ``page_indices`` (`expand_page_indices` of the block table) instead.
    ``timed``: where (row, call) goes for `_page_rounds`."""
    a = p.args
    builder = MlaMetadataBuilder(
        p.target, max_batch=a.batch, num_heads=p.heads, kv_lora_rank=a.kv_lora_rank,
        head_dim_k=a.head_dim_k, dtype=p.dtype, device="cuda", max_seq_len=p.ctx,
        page_size=1 if slots else p.page,
    )  # fmt: skip
    md = builder.build(p.sl)
    if slots:
        pages = expand_page_indices(p.bt, p.sl, p.page)
        fn = lambda: mla_decode(  # noqa: E731
            p.q, p.cache, None, p.sl, page_indices=pages, metadata=md, **p.kw
        )
    else:
        fn = lambda: mla_decode(p.q, p.cache, p.bt, p.sl, metadata=md, **p.kw)  # noqa: E731
    kind = "slots" if slots else "policy"
    errs = p.run_checked(fn)
    if errs is None or not errs[0]:
        print(f"FAIL {kind} {p.heads=} {p.ctx=} {p.page=} {tiles_desc(builder.tiles)}: {errs}")
        return None, builder.tiles
    ms = do_bench(fn, return_mode="median")
    ms_graph = do_bench_cudagraph(fn, return_mode="median")
    row = p.row(kind, builder.tiles, errs, ms_graph * 1e3, ms * 1e3)
    row["kernel"] = _main_kernel(p, slots)
    if timed is not None:
        timed.append((row, fn))
    return row, builder.tiles


def _main_kernel(p: Point, slots: bool) -> str:
    """The attention launch's name under this GPU's policy, and its load mode (sm_90 kernel)."""
    pages = expand_page_indices(p.bt, p.sl, p.page) if slots else None
    bt = None if slots else p.bt
    (main, *_) = plan_mla_decode(p.q, p.cache, bt, p.sl, page_indices=pages, **p.kw)
    mode = {True: " gather", False: " tma"}.get(main.args.get("GATHER"), "")
    return main.name + mode


def bench_hip(p: Point, arch="gfx942"):
    """The HIP policy's tiles on this GPU (correctness must hold; speed for the record)."""
    launches = plan_with_target(arch, plan_mla_decode, p.q, p.cache, p.bt, p.sl, **p.kw)
    fn = lambda: run_all(launches)  # noqa: E731
    errs = p.run_checked(fn)
    tiles = _tiles_of(launches)
    if errs is None or not errs[0]:
        print(f"FAIL {arch} policy {p.heads=} {p.ctx=} {tiles_desc(tiles)}: {errs}")
        return None
    ms_graph = do_bench_cudagraph(fn, return_mode="median")
    return p.row(arch, tiles, errs, ms_graph * 1e3)


def _tiles_of(launches) -> MlaTiles:
    """The tiles a plan launched with, read back from its constexprs (for the report)."""
    a = launches[0].args
    return MlaTiles(
        block_h=a["BLOCK_H"], padded_heads=a["BLOCK_H"] * a["HEAD_GROUPS"], block_n=a["BLOCK_N"],
        block_dv=a["BLOCK_DV"], block_dpe=a["BLOCK_DPE"], num_kv_splits=a["NUM_SPLITS"],
        options=launches[0].options, reduce_options=launches[-1].options, smem_bytes=0,
    )  # fmt: skip


def time_variant(p: Point, t: MlaTiles, failures: list):
    """Check then graph-time one variant; the row or None (does not compile / fails check)."""
    launches = p.plan(t)
    fn = lambda: run_all(launches)  # noqa: E731
    errs = p.run_checked(fn)
    if errs is None:
        return None
    if not errs[0]:
        failures.append(f"{p.heads} {p.ctx} {tiles_desc(t)}: err {errs[1]:.2e} vs {errs[2]:.2e}")
        return None
    row = p.row("sweep", t, errs, do_bench_cudagraph(fn, return_mode="median") * 1e3)
    row.update(compiled_resources(launches[0]))
    return row


def compiled_resources(launch) -> dict:
    """Registers / spills / shared memory of the compiled main kernel (one extra launch)."""
    try:
        opts = launch.options.backend_kwargs(launch.target, launch.backend())
        ck = launch.kernel[launch.grid](**launch.args, **opts)
        return dict(n_regs=ck.n_regs, n_spills=ck.n_spills, shared=ck.metadata.shared)
    except Exception as e:  # noqa: BLE001 - diagnostics only
        return dict(resources_error=str(e)[:80])


def sweep_point(p: Point, base: MlaTiles, shapes, deadline, failures):
    """Phase A (shapes at 2 waves) then phase B (splits of the 3 best shapes). Rows, sorted."""
    a, elem = p.args, p.cache.element_size()
    rows, seen = [], set()

    def one(bh, bn, st, w, splits, pf=False):
        key = (bh, bn, st, w, splits, pf)
        if key in seen or time.monotonic() > deadline:
            return
        seen.add(key)
        t = variant(base, p.heads, bh, bn, st, w, splits, elem, pf)
        row = time_variant(p, t, failures)
        if row is not None:
            rows.append(row)
            print("  " + fmt_row(row), flush=True)

    def groups(bh):
        return -(-p.heads // bh)

    # Phase 0 (first: the new kernel variant): prefetched row offsets, which let the pipeliner
    # multi-buffer the latent tile (sm_90 compile: N32 s3 93184 B = 2 buffers, s2 = 1), at the
    # policy's split count and at the policy's programs-per-SM rule for each head block.
    for bh, bn, st, w in PREFETCH_SHAPES.get(p.heads > 16, ()):
        if mla_smem_bytes(bh, bn, base.block_dv, base.block_dpe, 1, elem) > p.target.max_shared_mem:
            continue
        smem = mla_smem_bytes(bh, bn, base.block_dv, base.block_dpe, st, elem, True)
        per_sm = mla_programs_per_sm(p.target, bh, smem)
        one(bh, bn, st, w, mla_num_kv_splits(p.target, a.batch, groups(bh), p.ctx, per_sm), True)
    for bh, bn, st, w in shapes:
        one(bh, bn, st, w, splits_for_waves(2, p.target, a.batch, groups(bh), p.ctx))
    best = sorted(rows, key=lambda r: r["us_graph"])[:3]
    for r in best:
        bh = r["block_h"]
        for waves in (1, 4, 8):  # 2 waves: phase A
            s = splits_for_waves(waves, p.target, a.batch, groups(bh), p.ctx)
            one(bh, r["block_n"], r["num_stages"], r["num_warps"], s, r["prefetch_rows"])
    return sorted(rows, key=lambda r: r["us_graph"])


def bench_point(p: Point, args, rows, sweep_rows, failures, first_page: bool,
                timed: list | None = None) -> bool:  # fmt: skip
    """The policy row (and with ``--page-indices`` the page_indices row) of one point, then for
    the first page size the HIP row and the sweep. True on a failed policy check. ``timed``:
    where the policy rows' calls go (`bench_policy`)."""
    target, elem = p.target, p.cache.element_size()
    r = p.roof
    print(
        f"{p.heads:>5} {p.ctx:>6} {r['bytes'] / 1e6:8.1f} {r['flops'] / 1e9:8.1f} "
        f"{r['us_bytes']:8.1f} {r['us_flops']:8.1f}  (page {p.page})"
    )
    print(HEADER)
    for slots in (False, True) if args.page_indices else (False,):
        policy_row, base = bench_policy(p, slots, timed)
        if policy_row is None:
            return True
        rows.append(policy_row)
        print("  " + fmt_row(policy_row), flush=True)
    if not first_page:
        return False
    if not args.no_hip:
        hip_row = bench_hip(p)
        if hip_row is None:
            return True
        rows.append(hip_row)
        print("  " + fmt_row(hip_row), flush=True)
    if args.sweep:
        st = SWEEP_STATE
        top_shapes = st["top"].get(p.heads)
        shapes = top_shapes or shape_candidates(p.heads, base, target, elem)
        left = len(args.heads) * len(args.contexts) - len(st["done"])
        share = max(0.0, st["deadline"] - time.monotonic()) / max(1, left)
        point_rows = sweep_point(
            p, base, shapes, min(st["deadline"], time.monotonic() + share), failures
        )
        st["done"].append((p.heads, p.ctx))
        sweep_rows += point_rows
        if top_shapes is None:
            top: list[tuple[int, int, int, int]] = []
            for x in point_rows:
                s = (x["block_h"], x["block_n"], x["num_stages"], x["num_warps"])
                if s not in top:
                    top.append(s)
            st["top"][p.heads] = top[:6]
    return False


#: The sweep's wall deadline, the points it has done and each head count's best shapes.
SWEEP_STATE: dict = {}


def page_ratios(rows, pages) -> None:
    """Each policy / slots row's time over the first page size's block-table row (same point)."""
    print(f"== page ratios (graph us over page {pages[0]} block table; goal for page 1 <= 1.15)")
    for x in rows:
        if x["kind"] not in ("policy", "slots"):
            continue
        ref = [
            y for y in rows
            if (y["kind"], y["heads"], y["context"], y["page"])
            == ("policy", x["heads"], x["context"], pages[0])
        ]  # fmt: skip
        if ref:
            ratio = x["ratio_to_first_page"] = x["us_graph"] / ref[0]["us_graph"]
            print(
                f"{x['heads']:>5} {x['context']:>6} page {x['page']:>4} {x['kind']:>6} "
                f"{x.get('kernel', ''):>22} {x['us_graph']:9.1f} us  x{ratio:.3f}"
            )


# -- speculative verification (--q-len) ------------------------------------------------------


def verify_oracle(q, cache, bt, ctx, q_len, r, scale, dtype, num_seqs):
    """Causal reference for the first ``num_seqs`` sequences: ``[num_seqs * q_len, heads, r]``."""
    page = cache.shape[1]
    nb = -(-ctx // page)
    outs = []
    for i in range(num_seqs):
        c = cache[bt[i, :nb].long()].reshape(nb * page, -1)[:ctx].to(dtype)
        for j in range(q_len):
            n = ctx - q_len + j + 1
            s = torch.einsum("hd,ld->hl", q[i * q_len + j].to(dtype), c[:n]) * scale
            outs.append(torch.softmax(s, dim=-1) @ c[:n, :r])
    return torch.stack(outs)


def bench_verify(args, target, dtype, heads, ctx, q_len, copy_gbs, mm_tflops) -> list[dict]:
    """The rows of one verification point (module doc); [] after a failed check. With
    ``args.rounds`` > 1 every call is timed again in turns and each row keeps the median."""
    a, dk, r = args, args.head_dim_k, args.kv_lora_rank
    scale = 1 / math.sqrt(dk)
    _, cache, bt, sl = make_inputs(a.batch, ctx, heads, dk, a.page[0], dtype)
    g = torch.Generator(device="cuda").manual_seed(1)
    tokens = a.batch * q_len
    q = torch.randn(tokens, heads, dk, device="cuda", dtype=dtype, generator=g)
    qsl = torch.arange(0, tokens + 1, q_len, dtype=torch.int32, device="cuda")
    out = torch.empty(tokens, heads, r, dtype=dtype, device="cuda")
    elem = cache.element_size()
    nbytes = a.batch * ctx * dk * elem + tokens * heads * (dk + r) * elem
    flops = 2 * a.batch * q_len * heads * ctx * (dk + r)
    us_bytes = nbytes / (copy_gbs * 1e9) * 1e6
    us_flops = flops / (mm_tflops * 1e12) * 1e6
    us_roof = max(us_bytes, us_flops)
    n_check = 2
    ref = verify_oracle(q, cache, bt, ctx, q_len, r, scale, torch.float64, n_check)
    e_torch = rel_err(verify_oracle(q, cache, bt, ctx, q_len, r, scale, dtype, n_check), ref)

    def builder(max_query_len):
        return MlaMetadataBuilder(
            target, max_batch=a.batch, num_heads=heads, kv_lora_rank=r, head_dim_k=dk,
            dtype=dtype, device="cuda", max_query_len=max_query_len, max_seq_len=ctx,
        )  # fmt: skip

    def timed(kind, fn, tiles, last_only=False):
        """Check (every token, or with ``last_only`` the last of each sequence) then time."""
        out.fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        got = out.view(a.batch, q_len, heads, r)
        if last_only:
            e = rel_err(got[:n_check, -1], ref.view(n_check, q_len, heads, r)[:, -1])
            ok = bool(torch.isfinite(got[:, -1]).all()) and e <= 2 * e_torch
        else:
            e = rel_err(out[: n_check * q_len], ref)
            ok = bool(torch.isfinite(out).all()) and e <= 2 * e_torch
        if not ok:
            print(f"FAIL verify {kind} {heads=} {ctx=} {q_len=} {tiles_desc(tiles)}: {e:.2e}")
            return None
        us = do_bench_cudagraph(fn, return_mode="median") * 1e3
        nb, fl = nbytes, flops
        if last_only:  # one token per sequence: the same cache read, 1/q_len of the rest
            nb = a.batch * ctx * dk * elem + a.batch * heads * (dk + r) * elem
            fl = flops // q_len
        roof = max(nb / (copy_gbs * 1e9), fl / (mm_tflops * 1e12)) * 1e6
        gbs = nb / (us * 1e-6) / 1e9
        timings.append((fn, nb))
        return dict(
            kind=kind, q_len=q_len, heads=heads, context=ctx, batch=a.batch, head_dim_k=dk,
            kv_lora_rank=r, page=a.page[0], dtype=str(dtype).removeprefix("torch."),
            tiles=tiles_desc(tiles) + (" Q" if tiles.packed else ""), packed=tiles.packed,
            rel_err_kernel=e, rel_err_torch=e_torch, us_graph=us, gb_per_s=gbs,
            pct_of_copy=100 * gbs / copy_gbs, x_roofline=us / roof, roof_bytes=nb,
            roof_flops=fl, roof_us=roof, verify_roof_us_bytes=us_bytes,
            verify_roof_us_flops=us_flops, verify_roof_us=us_roof,
        )  # fmt: skip

    rows = []
    timings: list = []  # (call, roofline bytes) per row, in row order (`timed`)
    # the policy (packing where PACK_QUERY_ROWS takes it), then the same with the switch off
    saved = mla_policy.PACK_QUERY_ROWS
    for kind, pack in (("policy", saved), ("unpacked", False)):
        if kind == "unpacked" and not saved:
            continue
        mla_policy.PACK_QUERY_ROWS = pack
        try:
            b = builder(q_len)
        finally:
            mla_policy.PACK_QUERY_ROWS = saved
        md = b.build(sl, qsl, max_query_len=q_len)
        kw = dict(kv_lora_rank=r, scale=scale, query_start_loc=qsl, out=out, metadata=md)
        row = timed(kind, lambda kw=kw: mla_decode(q, cache, bt, sl, **kw), b.tiles)
        if row is None:
            return []
        rows.append(row)
        if kind == "policy" and b.tiles.packed:
            # a plain decode step served by the same (packed) builder: the last token of each
            # sequence, one per program's 64 rows (the cost of packed tiles on decode steps)
            md1 = b.build(sl)
            kw1 = dict(kv_lora_rank=r, scale=scale, out=out.view(a.batch, q_len, heads, r)[:, -1])
            qd = q.view(a.batch, q_len, heads, dk)[:, -1]
            dec = lambda qd=qd, md1=md1, kw1=kw1: mla_decode(  # noqa: E731
                qd, cache, bt, sl, metadata=md1, **kw1
            )
            row = timed("decode", dec, b.tiles, last_only=True)
            if row is None:
                return []
            rows.append(row)
    # q_len separate decode calls: token j of every sequence at context ctx - q_len + j + 1
    bd = builder(1)
    q4 = q.view(a.batch, q_len, heads, dk)
    o4 = out.view(a.batch, q_len, heads, r)
    calls = []
    for j in range(q_len):
        sl_j = torch.full_like(sl, ctx - q_len + j + 1)
        md = bd.build(sl_j)
        calls.append((q4[:, j], sl_j, o4[:, j], md))

    def separate():
        for qj, sl_j, oj, md in calls:
            mla_decode(qj, cache, bt, sl_j, kv_lora_rank=r, scale=scale, out=oj, metadata=md)

    row = timed("qsep", separate, bd.tiles)
    if row is None:
        return []
    rows.append(row)
    if getattr(a, "rounds", 1) > 1:
        _verify_rounds(rows, timings, a.rounds, copy_gbs)
    return rows


def _page_rounds(timed, rounds, copy_gbs, mm_run) -> list[float]:
    """``--rounds`` at the page points: each policy row's call (``timed``: (row, call), from
    `bench_policy`) is timed ``rounds - 1`` more times, in turns, with the matmul rate measured
    before each round. Each row keeps the median of its timings (``us_rounds``; the figures that
    derive from the graph time are recomputed from it, ``x_roofline_point`` at the rate measured
    before its point) and its ratio at the rounds' median rate (``mm_turns``, ``x_roof_turns``).
    Returns the rounds' rates."""
    rates = _rounds_in_turns(timed, rounds, lambda: matmul_rate()[0])
    mm = float(statistics.median(rates))
    for row, _ in timed:
        set_graph_time(row, row["us_graph"], copy_gbs)
        at_point_ceiling([row], copy_gbs, mm_run, row["mm_point"])
        row["mm_turns"] = mm
        run, turns = roofline_s(row, copy_gbs, mm_run), roofline_s(row, copy_gbs, mm)
        row["x_roof_turns"] = row["x_roofline"] * run / turns
    return rates


def _rounds_in_turns(calls, rounds, before_round=lambda: None) -> list:
    """Time each (row, call) of ``calls`` ``rounds - 1`` more times, in turns (b a, a b, ...:
    the order rotated each round, `turn_order`);
    each row's ``us_rounds`` then holds its timings (``us_graph`` first) and ``us_graph`` their
    median. ``before_round`` runs before each round; returns its results."""
    for row, _ in calls:
        row["us_rounds"] = [row["us_graph"]]
    seen = []
    for rnd in range(1, rounds):
        seen.append(before_round())
        for i in turn_order(len(calls), rnd):
            row, fn = calls[i]
            row["us_rounds"].append(do_bench_cudagraph(fn, return_mode="median") * 1e3)
    for row, _ in calls:
        row["us_graph"] = float(statistics.median(row["us_rounds"]))
    return seen


def _verify_rounds(rows, timings, rounds, copy_gbs) -> None:
    """Time every row's call ``rounds - 1`` more times, in turns, and keep the median."""
    _rounds_in_turns([(row, fn) for row, (fn, _) in zip(rows, timings, strict=True)], rounds)
    for row, (_, nb) in zip(rows, timings, strict=True):
        us = row["us_graph"]
        row["gb_per_s"] = nb / (us * 1e-6) / 1e9
        row["pct_of_copy"] = 100 * row["gb_per_s"] / copy_gbs
        row["x_roofline"] = us / row["roof_us"]


VERIFY_HEADER = (
    f"{'q':>2} {'heads':>5} {'ctx':>6} {'kind':>8} {'tiles':>24} {'graph us':>9} {'GB/s':>6} "
    f"{'%copy':>6} {'xroof':>6} {'vs qsep':>7}"
)


def fmt_verify(row, sep_us=None) -> str:
    vs = f"{row['us_graph'] / sep_us:7.2f}" if sep_us else f"{'-':>7}"
    return (
        f"{row['q_len']:>2} {row['heads']:>5} {row['context']:>6} {row['kind']:>8} "
        f"{row['tiles']:>24} {row['us_graph']:9.1f} {row['gb_per_s']:6.0f} "
        f"{row['pct_of_copy']:6.1f} {row['x_roofline']:6.2f} {vs}"
    )


def main_verify(args, target, dtype, copy_gbs, mm_tflops) -> int:
    rows: list[dict] = []
    failed = 0
    print(VERIFY_HEADER)
    for heads in args.heads:
        for ctx in args.contexts:
            for q_len in args.q_len:
                mm_here = matmul_rate()[0]  # the card as warm as the point's own timings
                point = bench_verify(args, target, dtype, heads, ctx, q_len, copy_gbs, mm_tflops)
                at_point_ceiling(point, copy_gbs, mm_tflops, mm_here)
                failed += not point
                sep = [x["us_graph"] for x in point if x["kind"] == "qsep"]
                for x in point:
                    # a decode row against one of the q_len separate calls (qsep / q_len)
                    base = (sep[0] / q_len if x["kind"] == "decode" else sep[0]) if sep else None
                    print(fmt_verify(x, base), flush=True)
                    x["vs_qsep"] = x["us_graph"] / base if base else None
                rows += point
                torch.cuda.empty_cache()
    goal = [x for x in rows if x["kind"] == "policy"]
    dec = [x for x in rows if x["kind"] == "decode"]
    if dec:
        print(
            "decode steps on the packed builder: worst vs one separate call "
            f"{max(x['vs_qsep'] or 0 for x in dec):.2f}"
        )
    if goal:
        worst = max(goal, key=lambda x: x["x_roofline"])
        print(
            f"goal (policy <= 1.3x roofline, <= qsep): worst {worst['x_roofline']:.2f}x roofline "
            f"(q{worst['q_len']} h{worst['heads']} {worst['context']}); worst vs qsep "
            f"{max(x['vs_qsep'] or 0 for x in goal):.2f}"
        )
        print_point_ceilings(goal, mm_tflops)
    result = dict(arch=target.arch, copy_gb_per_s=copy_gbs, mm_tflops=mm_tflops)
    save_record("bench_mla_verify", **result, rows=rows)
    return 1 if failed else 0


def print_point_ceilings(rows, mm_run) -> None:
    """Each row's roofline ratio at the run's matmul rate and at its own point's
    (`_common.at_point_ceiling`)."""
    print(f"== x roofline at the run's matmul rate ({mm_run:.0f} TFLOP/s) and at each point's")
    for x in rows:
        label = f"q{x['q_len']} " if "q_len" in x else f"page {x['page']:>2} "
        print(f"  {x['heads']:>4} h {x['context']:>6} {label}{x['kind']:>8}: "
              f"{x['x_roofline']:.3f} / {x['x_roofline_point']:.3f} "
              f"(point: {x['mm_point']:.0f} TFLOP/s)")  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--head-dim-k", type=int, default=576)
    ap.add_argument("--kv-lora-rank", type=int, default=512)
    ap.add_argument(
        "--page", type=int, nargs="+", default=[64], help="page sizes (ratios: to the first)"
    )
    ap.add_argument(
        "--page-indices",
        action="store_true",
        help="also time each page size through page_indices (expand_page_indices)",
    )
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument(
        "--resident", type=int, default=0, metavar="TOKENS",
        help="diagnostic: every sequence reads the same first TOKENS tokens' pages (L2-resident; "
             "x roofline is then not a serving figure)",
    )  # fmt: skip
    ap.add_argument("--sweep", action="store_true", help="also sweep tile variants")
    ap.add_argument("--budget-s", type=float, default=330.0, help="wall budget of the sweep")
    ap.add_argument("--no-hip", action="store_true", help="skip the gfx942-policy rows")
    ap.add_argument(
        "--q-len", type=int, nargs="+", default=None,
        help="verification points with these query tokens per sequence (module doc)",
    )  # fmt: skip
    ap.add_argument(
        "--rounds", type=int, default=1,
        help="time each policy call this many times in turns and keep the median (page "
        "points: the matmul rate measured before each round too)",
    )  # fmt: skip
    ap.add_argument(
        "--set", action="append", default=[], metavar="SWITCH=0|1",
        help="set a boolean switch of portattn.policy.mla for the run (an A/B), e.g. "
             "--set SM90_ROWS_AHEAD=0",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.rounds < 1:
        sys.exit(f"bench_mla: --rounds must be >= 1; got {args.rounds}")
    for item in args.set:
        set_switch(mla_policy, item)
    if not torch.cuda.is_available():
        sys.exit("bench_mla: needs a CUDA/HIP device")

    target = current_target()
    dtype = DTYPES[args.dtype]
    elem = torch.finfo(dtype).bits // 8
    kv_bytes_max = args.batch * max(args.contexts) * args.head_dim_k * elem
    copy_gbs, copy_ms = copy_ceiling(2 * kv_bytes_max)
    mm_tflops, mm_ms = matmul_rate()
    print(
        f"device: {torch.cuda.get_device_name()} ({target.arch}, {target.num_sms} SMs), "
        f"commit {git_commit()}, torch {torch.__version__}, triton {triton.__version__}"
    )
    print(
        f"copy ceiling {copy_gbs:.0f} GB/s ({kv_bytes_max / 1e9:.2f} GB copy, {copy_ms:.3f} ms)"
        f"; bf16 mm 8192^3 {mm_tflops:.0f} TFLOP/s ({mm_ms:.3f} ms)"
    )
    if args.q_len:
        return main_verify(args, target, dtype, copy_gbs, mm_tflops)
    print(f"{'heads':>5} {'ctx':>6} {'MB':>8} {'GFLOP':>8} {'us@copy':>8} {'us@mm':>8}")
    rows: list[dict] = []
    sweep_rows: list[dict] = []
    failures: list[str] = []
    # each sweep point gets an equal share of what is left of the budget
    SWEEP_STATE.update(deadline=time.monotonic() + args.budget_s, done=[], top={})
    timed: list = []  # (policy row, its call) for --rounds: the points' inputs stay alive
    for heads in args.heads:
        for ctx in args.contexts:
            for page in args.page:
                mm_here = matmul_rate()[0]  # the card as warm as the point's own timings
                p = Point(args, target, dtype, heads, ctx, copy_gbs, mm_tflops, page)
                first = len(rows)
                keep = timed if args.rounds > 1 else None
                if bench_point(p, args, rows, sweep_rows, failures, page == args.page[0], keep):
                    return 1
                at_point_ceiling(rows[first:], copy_gbs, mm_tflops, mm_here)
                del p
                torch.cuda.empty_cache()
    if args.rounds > 1:
        rates = _page_rounds(timed, args.rounds, copy_gbs, mm_tflops)
        print(
            f"== {args.rounds} rounds in turns (the policy rows keep their medians); matmul "
            f"rate before each round: {', '.join(f'{r:.0f}' for r in rates)} TFLOP/s"
        )
        for x, _ in timed:
            print(f"  {x['heads']:>4} h {x['context']:>6} page {x['page']:>2} {x['kind']:>6}: "
                  f"{x['us_graph']:.1f} us (of {', '.join(f'{u:.1f}' for u in x['us_rounds'])})"
                  f", x roofline at the rounds' rate {x['x_roof_turns']:.3f}")  # fmt: skip

    print("== summary (policy, gfx942 policy, best 3 sweep variants per point)")
    print(HEADER)
    for heads in args.heads:
        for ctx in args.contexts:
            pick = [x for x in rows if x["heads"] == heads and x["context"] == ctx]
            best = [x for x in sweep_rows if x["heads"] == heads and x["context"] == ctx][:3]
            for x in pick + best:
                print(fmt_row(x))
    if len(args.page) > 1 or args.page_indices:
        page_ratios(rows, args.page)
    print_point_ceilings([x for x in rows if x["kind"] == "policy"], mm_tflops)
    if args.sweep:
        print(
            f"sweep: {len(sweep_rows)} variants timed"
            + (" (budget hit)" if time.monotonic() > SWEEP_STATE["deadline"] else "")
        )
    for f in failures:
        print("CHECK FAILED (sweep variant):", f)
    result = dict(arch=target.arch, copy_gb_per_s=copy_gbs, mm_tflops=mm_tflops)
    save_record("bench_mla", **result, rows=rows)
    if args.sweep:
        save_record("bench_mla_sweep", **result, rows=sweep_rows, failures=failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
