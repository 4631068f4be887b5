"""Diagnostic (issue 19, block 16): how many cycles the sm_90 prefill kernel's K/V copies take a
tile on their own, by how many TMA copies a tile makes, with nothing else running.

The prefill kernel's pure prefill runs 4-5% slower at block 16 than at blocks 544 and 2048,
which run level (bench/RESULTS.md, eighteenth session). Its tile of 128 keys at head_dim 128
takes 24 TMA copies at block 16 (K: 8 page boxes of two 64-column halves; V: 8 page boxes of
one copy each), 16 at block 544 (32-row boxes, K and V two halves each) and 4 at block 2048.
Pages in order measured as random ones, so the count is the suspect. This runs the kernel's
own copies (its descriptors, `_tile_rows`, `_copy_v`, its 3-stage ring of [128, 128] K and V
buffers) in a persistent program a SM: a producer warp issues every tile's copies as the
kernel's does, a consumer warpgroup waits for each tile and releases its stage at once (no
math). Every program reads the same sequence's tiles (one KV head, 4096 tokens: 2 MB, in L2),
each from its own starting tile, as the kernel's programs mostly do.

Printed per block size: cycles a tile an SM (the median program's ``%clock64`` span over its
tiles; the kernel's tile period: ~2800 cycles at blocks 544 and 2048, ~3100 at 16), GB/s over
all programs, and the copies a tile. Correctness first: one program copies every tile once and
its consumer writes each K and V tile out, compared exactly with the cache's rows gathered by
the block table.

Usage (GPU machine, repository root)::

    python3 bench/diag_tma.py [--tiles 2000] [--blocks 16 32 544 2048] [--k-only]
"""

from __future__ import annotations

import argparse
import sys

import torch
from _common import git_commit, save_record
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from portattn.kernels._gluon import clock64
from portattn.kernels._launch import Launch, LaunchOptions
from portattn.kernels.paged_prefill_sm90 import (
    _box_row,
    _copy_k,
    _copy_v,
    _descriptor,
    _pages_layout,
    _rows_per_page,
    _tile_rows,
    _total_rows,
    _v_descriptor,
    box_rows,
    paging,
    v_pages,
)
from portattn.platform import Target, current_target
from portattn.policy.paged import Sm90PrefillTile

TILE = Sm90PrefillTile(block_n=128, stages=3, pingpong=True)  # the policy's head_dim-128 tile
HKV, D, CTX = 8, 128, 4096  # KV heads, head_dim, the sequence's tokens


def copies_a_tile(block_size: int, k_only: bool = False) -> int:
    """TMA copies the kernel's producer issues for one tile (K: two 64-column halves a box; V:
    one a page box where V comes in page boxes, else two)."""
    box = box_rows(block_size, TILE.block_n)
    nb = TILE.block_n // box
    meta = torch.empty(1, block_size, HKV, D, dtype=torch.bfloat16, device="meta")
    nv = v_pages(TILE, box, meta, False)
    return nb * 2 + (0 if k_only else (nb if nv > 1 else nb * 2))


@gluon.jit
def _consumer(k_smem, v_smem, k_bars, v_bars, empty_bars, out_k, out_v, cyc_ptr, tiles,
              CHECK: gl.constexpr, K_ONLY: gl.constexpr, V_PAGES: gl.constexpr):  # fmt: skip
    """Waits for each tile's copies and releases its stage; CHECK: writes the tile out first."""
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEAD_D: gl.constexpr = k_smem.shape[2]
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LOAD))
    c = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, LOAD))
    t0 = clock64()
    for i in range(tiles):
        s = i % STAGES
        ph = (i // STAGES) & 1
        mbarrier.wait(k_bars.index(s), ph)
        if not K_ONLY:
            mbarrier.wait(v_bars.index(s), ph)
        if CHECK:
            offs = i * BLOCK_N * HEAD_D + r[:, None] * HEAD_D + c[None, :]
            gl.store(out_k + offs, k_smem.index(s).load(LOAD))
            if not K_ONLY:
                v_buf = v_smem.index(s)
                if V_PAGES > 1:  # (the page boxes' bytes read through the kernel's layout)
                    VL: gl.constexpr = _pages_layout(BLOCK_N, HEAD_D, V_PAGES)
                    v_buf = v_buf._reinterpret(v_buf.dtype, [BLOCK_N, HEAD_D], VL)
                gl.store(out_v + offs, v_buf.load(LOAD))
            gl.thread_barrier()
        mbarrier.arrive(empty_bars.index(s), count=1)
    gl.store(cyc_ptr + gl.program_id(0), clock64() - t0)


@gluon.jit
def _producer(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, empty_bars, table_ptr, tiles,
              n_tiles, block_size, rows_per_page, total_rows, BOX: gl.constexpr,
              K_ONLY: gl.constexpr, V_PAGES: gl.constexpr, PAGING: gl.constexpr):  # fmt: skip
    """The prefill kernel's copies of each tile (box by box: K, then V), tile ``(first + i) %
    n_tiles`` of the sequence at step ``i``, ``first`` the program's own."""
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEAD_D: gl.constexpr = k_smem.shape[2]
    NB: gl.constexpr = BLOCK_N // BOX
    TILE_BYTES: gl.constexpr = BLOCK_N * HEAD_D * k_smem.dtype.primitive_bitwidth // 8
    boxes = gl.arange(0, NB, layout=gl.BlockedLayout([NB], [32], [gl.num_warps()], [0]))
    first = gl.program_id(0) * 7
    seq_len = n_tiles * BLOCK_N
    for i in range(tiles):
        s = i % STAGES
        rows = _tile_rows(table_ptr, (first + i) % n_tiles, boxes, BOX, BLOCK_N, seq_len,
                          block_size, 1, rows_per_page, total_rows, PAGING)  # fmt: skip
        mbarrier.wait(empty_bars.index(s), ((i // STAGES) & 1) ^ 1, pred=i >= STAGES)
        k_buf = k_smem.index(s)
        v_buf = v_smem.index(s)
        mbarrier.expect(k_bars.index(s), TILE_BYTES)
        if not K_ONLY:
            mbarrier.expect(v_bars.index(s), TILE_BYTES)
        for b in gl.static_range(NB):
            row = _box_row(rows, boxes, b)
            _copy_k(k_desc, k_buf, k_bars.index(s), row, 0, b, BOX)
            if not K_ONLY:
                _copy_v(v_desc, v_buf, v_bars.index(s), row, 0, b, BOX, V_PAGES)


@gluon.jit
def _copies_kernel(k_desc, v_desc, table_ptr, out_k, out_v, cyc_ptr, tiles, n_tiles, block_size,
                   rows_per_page, total_rows, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                   STAGES: gl.constexpr, BOX: gl.constexpr, V_PAGES: gl.constexpr,
                   CHECK: gl.constexpr, K_ONLY: gl.constexpr,
                   PAGING: gl.constexpr):  # fmt: skip
    dtype: gl.constexpr = k_desc.dtype
    KV_LAYOUT: gl.constexpr = k_desc.layout
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], KV_LAYOUT)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], KV_LAYOUT)
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(s), count=1)
        mbarrier.init(v_bars.index(s), count=1)
        mbarrier.init(empty_bars.index(s), count=1)
    fence_async_shared()
    gl.warp_specialize(
        [
            (_consumer, (k_smem, v_smem, k_bars, v_bars, empty_bars, out_k, out_v, cyc_ptr,
                         tiles, CHECK, K_ONLY, V_PAGES)),
            (_producer, (k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, empty_bars, table_ptr,
                         tiles, n_tiles, block_size, rows_per_page, total_rows, BOX, K_ONLY,
                         V_PAGES, PAGING)),
        ],
        [1],
        [64],
    )  # fmt: skip


def make_launch(block_size: int, tiles: int, programs: int, target: Target, device: str,
                check: bool = False, k_only: bool = False, seed: int = 0) -> Launch:  # fmt: skip
    """The copies kernel at ``block_size``: a cache of one 4096-token sequence's pages (a random
    permutation), 8 KV heads x 128 (head 0 read), bf16; ``device="meta"`` to compile only."""
    n_pages = -(-CTX // block_size)
    shape = (n_pages, block_size, HKV, D)
    if device == "meta":
        k = v = torch.empty(shape, dtype=torch.bfloat16, device="meta")
        table = torch.empty(n_pages, dtype=torch.int32, device="meta")
    else:
        g = torch.Generator(device=device).manual_seed(seed)
        k = torch.randn(shape, dtype=torch.bfloat16, device=device, generator=g)
        v = torch.randn(shape, dtype=torch.bfloat16, device=device, generator=g)
        table = torch.randperm(n_pages, device=device, generator=g).to(torch.int32)
    box = box_rows(block_size, TILE.block_n)
    nv = v_pages(TILE, box, v, False)
    n_tiles = CTX // TILE.block_n
    out_shape = (tiles if check else 1, TILE.block_n, D)
    out_k = torch.empty(out_shape, dtype=torch.bfloat16, device=device)
    out_v = torch.empty(out_shape, dtype=torch.bfloat16, device=device)
    cyc = torch.zeros(programs, dtype=torch.int64, device=device)
    args = dict(
        k_desc=_descriptor(k, TILE, box),
        v_desc=(_v_descriptor if nv > 1 else _descriptor)(v, TILE, box),
        table_ptr=table,
        out_k=out_k,
        out_v=out_v,
        cyc_ptr=cyc,
        tiles=tiles,
        n_tiles=n_tiles,
        block_size=block_size,
        rows_per_page=_rows_per_page(k),
        total_rows=_total_rows(k),
        BLOCK_N=TILE.block_n,
        HEAD_D=D,
        STAGES=TILE.stages,
        BOX=box,
        V_PAGES=nv,
        CHECK=check,
        K_ONLY=k_only,
        PAGING=paging(block_size, box, TILE.block_n),  # the kernel's page lookup, as it runs
    )
    return Launch(kernel=_copies_kernel, grid=(programs,), args=args,
                  options=LaunchOptions(4, 1), target=target, name="diag_tma",
                  outputs=(out_k, out_v, cyc, k, v, table))  # fmt: skip


def expected(k, v, table, block_size: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiles ``0 .. tiles-1`` (program 0's order) of KV head 0: the cache's rows through the
    block table, [tiles, 128, 128] each."""
    n_tiles = CTX // TILE.block_n
    pos = torch.arange(CTX, device=k.device)
    rows = table.long()[pos // block_size] * block_size + pos % block_size
    gather = lambda c: c.reshape(-1, HKV, D)[rows, 0].reshape(n_tiles, TILE.block_n, D)  # noqa: E731
    idx = torch.arange(tiles, device=k.device) % n_tiles
    return gather(k)[idx], gather(v)[idx]


def run_block(block_size: int, tiles: int, k_only: bool) -> dict:
    target = current_target()
    if target.arch != "sm_90":
        sys.exit(f"diag_tma: needs an sm_90 GPU; this one is {target.arch}")
    n_tiles = CTX // TILE.block_n
    chk = make_launch(block_size, n_tiles, 1, target, "cuda", check=True, k_only=k_only)
    chk.run()
    out_k, out_v, _, k, v, table = chk.outputs
    want_k, want_v = expected(k, v, table, block_size, n_tiles)
    ok = torch.equal(out_k, want_k) and (k_only or torch.equal(out_v, want_v))
    if not ok:
        sys.exit(f"diag_tma: block {block_size}: the copied tiles differ from the cache's rows")
    programs = target.num_sms
    timed = make_launch(block_size, tiles, programs, target, "cuda", k_only=k_only)
    timed.run()  # compile, warm
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    timed.run()
    ev[1].record()
    torch.cuda.synchronize()
    ms = ev[0].elapsed_time(ev[1])
    cyc = timed.outputs[2].float()
    per_tile = float(cyc.median()) / tiles
    tile_bytes = TILE.block_n * D * 2 * (1 if k_only else 2)
    return dict(block_size=block_size, copies=copies_a_tile(block_size, k_only), k_only=k_only,
                cycles_a_tile=per_tile, gb_per_s=programs * tiles * tile_bytes / ms / 1e6,
                ms=ms, checked=True)  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", type=int, default=2000, help="tiles a program copies")
    ap.add_argument("--blocks", type=int, nargs="+", default=[16, 32, 544, 2048])
    ap.add_argument("--k-only", action="store_true", help="K's copies only (no V)")
    opts = ap.parse_args(argv)
    if opts.tiles < 1 or min(opts.blocks) < 16 or any(b % 16 for b in opts.blocks):
        sys.exit(f"diag_tma: --tiles must be >= 1 and --blocks multiples of 16; got "
                 f"{opts.tiles}, {opts.blocks}")  # fmt: skip
    if not torch.cuda.is_available():
        sys.exit("diag_tma: needs a CUDA device")
    print(f"device: {torch.cuda.get_device_name()}, commit {git_commit()}, tiles {opts.tiles}")
    print(f"{'block':>6} {'copies':>6} {'cycles/tile':>11} {'GB/s':>8}")
    rows = []
    for bs in opts.blocks:
        r = run_block(bs, opts.tiles, opts.k_only)
        rows.append(r)
        print(f"{bs:>6} {r['copies']:>6} {r['cycles_a_tile']:>11.0f} {r['gb_per_s']:>8.0f}")
    save_record("diag_tma", tiles=opts.tiles, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
