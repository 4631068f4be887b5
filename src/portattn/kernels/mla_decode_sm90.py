"""MLA decode, Hopper (sm_90) kernel in Gluon: the wide 64-head tile, two warpgroups in seesaw.

Same math, arguments, workspaces and outputs as `portattn.kernels.mla_decode` (whose launcher
picks this kernel where `MlaTiles.sm90_kernel` and `sm90_errors` allow); only the schedule
differs.
The two warpgroups run different code (`gl.warp_specialize`, no producer warps). Tiles go in
pairs (A in buffer 0, B in buffer 1); warpgroup 0 scores A and owns output columns [0, R/2),
warpgroup 1 scores B and owns [R/2, R)::

    WG0: S_A = Q K_A^T -> max m_A (to WG1) -> P_A (to WG1) -> O_L += P_A V_A,L -> (P_B, m_B
         from WG1) -> O_L *= 2^(m_A - m_B) -> O_L += P_B V_B,L
    WG1: S_B = Q K_B^T -> (m_A) m_B = max(m_A, rowmax S_B) -> P_B, m_B (to WG0) -> (P_A)
         O_R += P_A V_A,R -> O_R *= 2^(m_A - m_B) -> O_R += P_B V_B,R

so each score MMA is 64 x 64 (the query is read once per 64 tokens, not once per 32) and one
warpgroup's softmax runs under the other's MMAs. Each tile buffer is loaded in two halves
(latent columns [0, R/2); latent [R/2, R); the rope part with the right half on the TMA path,
with the left on the gather's), each by the warpgroup whose PV frees it, as soon as it does: the
next pair's loads start mid-pair. Those copies find their rows in L2: once a
warpgroup's scores are in, it prefetches its tile of the next pair (``cp.async.bulk.prefetch.L2``,
rows read at the top of the pair), in one program of those reading the split (`_prefetch_tile_l2`;
TMA path only). The query's rope part is the score MMA's register operand, which leaves room
for both tiles' P in shared memory. Hand-offs go through shared memory (P, the running max, the
final row sums) with an mbarrier each; every phase of every barrier is waited before the next is
signalled (module code, comments). Row sums are kept per warpgroup over the tiles it scored and
added once at the end.

The running max is lazy: it moves only when a row's tile max passes it by more than ``LAZY_T``
(P <= 2^8; exact), so the accumulator's factors are almost always exactly 1, and each rescale
(`lazy_rescale`) is one branch a thread around its 128 multiplies, which the warpgroups' serial
chains otherwise pay twice a pair.

Only a tile that reaches past its split's end has its scores masked (one scalar test a tile: a full
tile skips 64 instructions in each warpgroup's chain). In a split's partial last tile the latent
rows past the context are zeroed in shared memory before PV (each warpgroup its own half; their
scores are masked to -inf); an odd tile count ends with a phantom tile (every score masked, buffer
zeroed; TMA boxes copy block 0's rows into it, the gather copies nothing). ptxas hoists every
loop-invariant MMA descriptor out of the loop and spills them (260 B); the buffer indices are
therefore computed from an opaque 0 (``block_size < 0``), which keeps them in the loop (0 spills).

Loads (``GATHER``, `portattn.policy.mla.sm90_gathers`): with a block table of pages of a multiple of
64 tokens each tile half is one or two TMA boxes (an expect-tx barrier, count 1). Otherwise
(``page_indices``, speculative decoding's page size 1, pages of any other size, or heads as N) a
tile's rows are gathered: the issuing warpgroup loads its 64 row indices once, copies each buffer
(a latent half, the rope part) by ``cp.async`` in one op (16-byte pieces, rows past the context
zero-filled; one op per 64-column block got a ``bar.sync`` between blocks) into the same
NVMMA-swizzled buffers, and
each of its 128 threads arrives on the tile barrier once its copies land (``cp.async.mbarrier.arrive
.noinc``; the barriers count 128), so the hand-offs are unchanged. The MMAs read through the async
proxy what cp.async wrote through the generic one: a proxy fence after each tile wait.

Heads as N (``HEADS_N``, `MlaConfig.heads_n`: at most 16 heads of one query token a program):
the 64-row tile would leave 48 of its rows padding, and every MMA would still work on them,
lengthening the chain each tile's buffer waits on before it takes the next tile. Instead each
MMA takes the heads as its N:
``S^T = K Q^T`` (the tile's 64 tokens as M; the query, rope part included, in shared memory)
and ``O^T += V^T P^T`` (the warpgroup's latent columns as M, the tile read transposed), a
quarter of the work (`_warpgroup_heads_n`). The softmax runs down the columns; the hand-offs
and barriers are the same. Its rows always come by the gather: under this schedule the
warpgroups' own copies stream faster than the TMA boxes over long contexts.

Packed rows (``PACKED``, `MlaTiles.packed`): the 64 rows are (query token,
head) pairs of one sequence (`_packed_rows`; 16 heads x 4 tokens fill the tile), the tile's range
comes from its last real row, and each row's scores are masked at its own causal limit (the
running max starts at fp32's lowest finite value, so a row with no column in a tile or split stays
finite, p = 0, while every finite score still sets the max).

Prologue and epilogue. Unpacked, the query's rows are read first (their addresses need no
metadata); both first tiles' rows are read before either copy, and the query goes into shared
memory once the first copies are issued. With one split and ``STORE_SMEM``
(`MlaConfig.store_smem`) each warpgroup writes its output columns through its buffer-0 half,
which no MMA reads any more, then in 16-byte stores, a warp a row. A warpgroup's code does not
see the launch's alignment, so the launcher tells it (``OUT_VEC``, `rows_aligned`); without it,
stores go element by element. Diagnostic: with a ``trace`` buffer the launcher builds a kernel
that stamps each pair's steps (``TRACE``).

Requirements (checked by the launcher, `sm90_errors`): sm_90, fp16/bf16, ``BLOCK_H = BLOCK_N =
64``, ``kv_lora_rank`` in 128 / 256 / 512, rope width a power of two in 16..128, the shared
memory (`sm90_smem_bytes`; 576/512: 230788 B) within the target's, pages laid out one after
another (``stride(0) == block_size * stride(1)``: cache rows are flat slots), 16-byte aligned
rows.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from portattn.kernels._gluon import LAZY_T, clock_stamp, lazy_rescale, row_ptrs, trace_slot
from portattn.kernels._launch import Launch, check_trace_buffer, rows_aligned
from portattn.platform import Target
from portattn.policy import mla as mla_policy
from portattn.policy.common import LaunchOptions
from portattn.policy.mla import MlaConfig

_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
#: The tile this kernel is written for (the policy's wide CUDA tile).
BLOCK_H = 64
BLOCK_N = mla_policy.SM90_BLOCK_N
#: Heads a program of the `HEADS_N` schedule serves (the MMAs' N).
HEADS_N_BLOCK_H = mla_policy.HEADS_N_MAX
#: Warps of the default partition (warpgroup 0); warpgroup 1 is a worker partition of 4 more.
NUM_WARPS = 4
#: Registers per thread each warpgroup asks for (`setmaxnreg`; 8 warps share the 64K file).
WG_REGS = 256
#: Diagnostic trace (``mla_decode(trace=)``): clock64 stamps indexed ``[program, warpgroup,
#: pair, event]`` for the first `TRACE_PAIRS` pairs; the last "pair" holds the epilogue's.
TRACE_EVENTS = gl.constexpr(16)
TRACE_PAIRS = gl.constexpr(256)


@gluon.jit
def _find_seq_sm90(qsl_ptr, stride_qsl, tok, num_seqs):
    """The last sequence ``i < num_seqs`` with ``qsl[i] <= tok`` (binary search)."""
    lo = tok * 0
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if gl.load(qsl_ptr + mid * stride_qsl) <= tok:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@gluon.jit
def _trace_stamp(tr, slot, k: gl.constexpr, TRACE: gl.constexpr, GLOBAL: gl.constexpr = False):
    """Diagnostic (``TRACE``): `clock_stamp` into this warpgroup's trace (slots ``0 ..
    TRACE_PAIRS - 1`` are pairs, slot ``TRACE_PAIRS`` the kernel's own events)."""
    clock_stamp(tr, slot, k, TRACE, TRACE_PAIRS, TRACE_EVENTS, GLOBAL)


@gluon.jit
def _query_halves(q_row, mask, stride_q_dim, HALF: gl.constexpr, LOAD: gl.constexpr):
    """The query's latent halves ([BLOCK_H, HALF] each, in ``LOAD``) from its rows' pointers
    (``q_row``, [BLOCK_H, 1]); rows off ``mask`` read as 0."""
    offs_d = gl.arange(0, HALF, layout=gl.SliceLayout(0, LOAD))
    ql = gl.load(q_row + offs_d[None, :] * stride_q_dim, mask=mask, other=0.0)
    qr = gl.load(q_row + (HALF + offs_d[None, :]) * stride_q_dim, mask=mask, other=0.0)
    return ql, qr


@gluon.jit
def _packed_rows(hg, num_heads, q_start, q_len, BLOCK_H: gl.constexpr, layout: gl.constexpr):
    """A packed tile's rows in ``layout``: row ``r`` is (query token ``r // num_heads``, head
    ``r % num_heads``) of one sequence; returns each row's token (int64), head, query index and
    whether it is real (``q_idx < q_len``)."""
    r = hg * BLOCK_H + gl.arange(0, BLOCK_H, layout=layout)
    q_idx = r // num_heads
    return (q_start + q_idx).to(gl.int64), r % num_heads, q_idx, q_idx < q_len


@gluon.jit
def _tile_cache_rows(bt_row, stride_bt_blk, t, start, num_tiles, block_size, end,
                     BLOCK_N: gl.constexpr, GATHER: gl.constexpr,
                     PAGE_INDICES: gl.constexpr):  # fmt: skip
    """Where tile t's rows lie in the cache, read ahead of `_load_half` (the warpgroups call it
    at the top of a pair, so that the read's latency runs under the pair's MMAs, not between
    them). Without GATHER: the first row of the tile's TMA box (one block-table entry; block 0's
    for a phantom tile). With it: the tile's 64 rows (flat slots from ``page_indices``, or
    ``block_table[pos // bs] * bs + pos % bs``; int32, a cache holds < 2^31 rows) in the gather's
    row layout, 0 past ``end`` and for a phantom tile (``t >= num_tiles``), which read nothing."""
    n = start + t * BLOCK_N
    if GATHER:
        CH: gl.constexpr = 64
        L64: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (CH // 8), CH // 8], [4, 1], [1, 0])
        pos = n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L64))
        ok = (pos < end) & (t < num_tiles)
        if PAGE_INDICES:
            rows = gl.load(bt_row + pos * stride_bt_blk, mask=ok, other=0)
        else:
            blk = gl.load(bt_row + (pos // block_size) * stride_bt_blk, mask=ok, other=0)
            rows = blk * block_size + pos % block_size
        return rows.to(gl.int32)
    else:
        blk = gl.load(bt_row + (n // block_size) * stride_bt_blk, mask=t < num_tiles, other=0)
        return blk.to(gl.int32) * block_size + n % block_size


@gluon.jit
def _prefetch_tile_l2(kv_ptr, stride_kv_row, row, on, BLOCK_N: gl.constexpr):
    """Where ``on``: a TMA-path tile (``BLOCK_N`` cache rows from ``row``, one after another)
    into L2, one bulk prefetch from one thread of the warpgroup, so that its copy a pair later
    finds it there."""
    L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    ELEM: gl.constexpr = kv_ptr.dtype.element_ty.primitive_bitwidth // 8
    i = gl.arange(0, 128, layout=L)
    ptrs = kv_ptr + row.to(gl.int64) * stride_kv_row + i * 0
    on = ((i == 0) & on).to(gl.int32)
    nbytes = gl.full([128], BLOCK_N * ELEM, gl.int32, layout=L) * stride_kv_row
    gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; "
        "mov.b32 $0, 0; }",
        "=r,l,r,r",
        [ptrs, on, nbytes],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _load_half(lat_desc, pe_desc, rows, t, start, num_tiles, steps, bar, lat_buf, pe_buf,
               RIGHT: gl.constexpr, gather, GATHER: gl.constexpr):  # fmt: skip
    """Tile t's left latent half, or (RIGHT) its right latent half, and its rope part (TMA: with
    the right half; gather: with the left) into its buffer, from the rows `_tile_cache_rows`
    read; past ``steps`` nothing. Without GATHER by TMA boxes (64 consecutive rows of one page;
    a phantom tile, ``num_tiles <= t < steps``, copies the rows of block 0 that
    `_tile_cache_rows` gives it, which its masked scores and `_zero_tail` ignore: one expect and
    its boxes, no separate arrival, each op of which costs the warpgroup a ``bar.sync``), else
    by `_gather_half` (``gather``: its runtime values, the cache pointer, its row stride and the
    split's end)."""
    if not GATHER:
        BLOCK_N: gl.constexpr = lat_buf.shape[0]
        HALF: gl.constexpr = lat_buf.shape[1]
        ROPE_DIM: gl.constexpr = pe_buf.shape[1]
        on = t < steps
        if RIGHT:
            mbarrier.expect(bar, BLOCK_N * (HALF + ROPE_DIM) * 2, pred=on)
            tma.async_copy_global_to_shared(lat_desc, [rows, HALF], bar, lat_buf, pred=on)
            tma.async_copy_global_to_shared(pe_desc, [rows, 2 * HALF], bar, pe_buf, pred=on)
        else:
            mbarrier.expect(bar, BLOCK_N * HALF * 2, pred=on)
            tma.async_copy_global_to_shared(lat_desc, [rows, 0], bar, lat_buf, pred=on)
    else:
        _gather_half(rows, t, start, num_tiles, steps, bar, lat_buf, pe_buf, RIGHT, gather)


@gluon.jit
def _gather_part(kv_ptr, stride_row, rows, ok, buf, col0, W: gl.constexpr, LOAD: gl.constexpr):
    """``cp.async`` of columns ``col0 .. col0 + W`` of the gathered ``rows`` (masked by ``ok``:
    those read as zeros) into ``buf`` ([BLOCK_N, W], any NVMMA swizzle), 16-byte pieces."""
    r = gl.convert_layout(rows, gl.SliceLayout(1, LOAD)).to(gl.int64)
    keep = gl.convert_layout(ok, gl.SliceLayout(1, LOAD))
    cols = col0 + gl.arange(0, W, layout=gl.SliceLayout(0, LOAD))
    ptrs = kv_ptr + r[:, None] * stride_row + cols[None, :]
    async_copy.async_copy_global_to_shared(buf, ptrs, mask=keep[:, None])


@gluon.jit
def _gather_half(rows, t, start, num_tiles, steps, bar, lat_buf, pe_buf, RIGHT: gl.constexpr,
                 gather):  # fmt: skip
    """`_load_half` by row gather: each 64-column part of tile t's ``rows`` (`_tile_cache_rows`) by
    ``cp.async`` into the same swizzled buffers the TMA path fills, the rope part with the left
    half, not the right (its score MMA waits for both; the right half's issuer, warpgroup 1,
    issues its copies at the end of its P V, the longer chain). Every thread of the issuing
    warpgroup (128) then arrives on ``bar`` once its copies land (``.noinc``; the barrier counts
    128 in gather mode); a phantom tile copies nothing and arrives at once; past ``steps`` (no
    tile) nothing happens, as on the TMA path."""
    kv_ptr, stride_row, end = gather
    BLOCK_N: gl.constexpr = lat_buf.shape[0]
    HALF: gl.constexpr = lat_buf.shape[1]
    ROPE_DIM: gl.constexpr = pe_buf.shape[1]
    CH: gl.constexpr = 64 if HALF >= 64 else HALF
    L64: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (CH // 8), CH // 8], [4, 1], [1, 0])
    PCH: gl.constexpr = 64 if ROPE_DIM >= 64 else ROPE_DIM
    LPE: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (PCH // 8), PCH // 8], [4, 1], [1, 0])
    if t < steps:
        if t < num_tiles:
            n = start + t * BLOCK_N
            ok = n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L64)) < end
            col0: gl.constexpr = HALF if RIGHT else 0
            # one copy a buffer: one op per 64-column block put a bar.sync between the blocks
            _gather_part(kv_ptr, stride_row, rows, ok, lat_buf, col0, HALF, L64)
            if not RIGHT:  # the rope part with the left half: warpgroup 0 issues it
                _gather_part(kv_ptr, stride_row, rows, ok, pe_buf, 2 * HALF, ROPE_DIM, LPE)
        async_copy.mbarrier_arrive(bar, increment_count=False)


@gluon.jit
def _zero_tail(buf, n, end, LOAD: gl.constexpr):
    """Rows ``n + r >= end`` of a partial or phantom tile's latent half read as 0: their P is 0,
    but stale rows (or never-written shared memory) may hold NaN."""
    BLOCK_N: gl.constexpr = buf.shape[0]
    if n + BLOCK_N > end:
        rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LOAD))
        keep = ((n + rows) < end)[:, None]
        for c in gl.static_range(buf.shape[1] // 64):
            part = buf.slice(c * 64, 64, dim=1)
            x = part.load(LOAD)
            part.store(gl.where(keep, x, gl.zeros_like(x)))
        fence_async_shared()
        gl.thread_barrier()


@gluon.jit
def _opaque_zero(stride_kv_row, block_size, GATHER: gl.constexpr):
    """0, computed from a launch value ptxas cannot see through (module doc): ``block_size`` may
    be 1, which Triton passes as a constant, so the gather takes the row stride."""
    if GATHER:  # noqa: SIM108 (a constexpr branch, not a runtime select)
        opaque = (stride_kv_row < 0).to(gl.int32)
    else:
        opaque = (block_size < 0).to(gl.int32)
    return opaque


@gluon.jit
def _pair_start(WG: gl.constexpr, j, opaque, bt_row, stride_bt_blk, start, num_tiles, block_size,
                end, BLOCK_N: gl.constexpr, GATHER: gl.constexpr, PAGE_INDICES: gl.constexpr,
                TRACE: gl.constexpr, tr):  # fmt: skip
    """Pair ``j``'s phase, its buffers (``b0`` tile A's, written so that ptxas cannot hoist it;
    ``own`` the one of the tile this warpgroup scores), its tiles' first positions, its trace
    slot (pairs past the buffer's are dropped), and the next pair's cache rows, read now so that
    their latency runs under the MMAs."""
    ph = j & 1
    b0 = ph & opaque
    b1 = b0 ^ 1
    own = WG ^ b0
    n_a = start + (2 * j) * BLOCK_N
    n_b = n_a + BLOCK_N
    jt = trace_slot(j, TRACE, TRACE_PAIRS)
    _trace_stamp(tr, jt, 0, TRACE)
    rows_a = _tile_cache_rows(bt_row, stride_bt_blk, 2 * j + 2, start, num_tiles, block_size,
                              end, BLOCK_N, GATHER, PAGE_INDICES)  # fmt: skip
    rows_b = _tile_cache_rows(bt_row, stride_bt_blk, 2 * j + 3, start, num_tiles, block_size,
                              end, BLOCK_N, GATHER, PAGE_INDICES)  # fmt: skip
    return ph, b0, b1, own, n_a, n_b, jt, rows_a, rows_b


@gluon.jit
def _refill(WG: gl.constexpr, acc, rows, t, buf, lat_half, pe_smem, tma_bars, lat_desc, pe_desc,
            start, num_tiles, steps, gather, GATHER: gl.constexpr, TRACE: gl.constexpr, tr, jt,
            K: gl.constexpr):  # fmt: skip
    """Once this warpgroup's P V on buffer ``buf`` has returned (``acc``, returned), its half of
    that buffer takes tile ``t`` (rows ``rows``) with the rope part (TMA: warpgroup 1's half;
    gather: warpgroup 0's), which no score MMA reads any more; trace events ``K``, ``K + 1``."""
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    gl.thread_barrier()
    _trace_stamp(tr, jt, K, TRACE)
    _load_half(lat_desc, pe_desc, rows, t, start, num_tiles, steps, tma_bars.index(2 * buf + WG),
               lat_half.index(buf), pe_smem.index(buf), WG == 1, gather, GATHER)  # fmt: skip
    _trace_stamp(tr, jt, K + 1, TRACE)
    return acc


@gluon.jit
def _sum_rows(WG: gl.constexpr, l_i, l_smem, sync_bars, layout: gl.constexpr):
    """This warpgroup's row sums ``l_i`` plus the other's, exchanged through ``l_smem``."""
    l_smem.index(WG).store(l_i)
    gl.thread_barrier()
    mbarrier.arrive(sync_bars.index(3 + WG), count=1)
    mbarrier.wait(sync_bars.index(4 - WG), 0)
    return l_i + l_smem.index(1 - WG).load(layout)


@gluon.jit
def _row_lse(l_i, m_i):
    """A row's divisor (its sum, 1 where it is 0) and its natural-log LSE (-inf where no
    column counted), from the row sum and the running max in log2 units."""
    has = l_i > 0
    l_safe = gl.where(has, l_i, 1.0)
    lse = gl.where(has, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    return l_safe, lse


@gluon.jit
def _prefetch_next_tile(WG: gl.constexpr, kv_ptr, stride_kv_row, rows_a, rows_b, lead, j,
                        num_tiles, BLOCK_N: gl.constexpr):  # fmt: skip
    """The next pair's tile this warpgroup scores (A for warpgroup 0, B for 1) into L2, a pair
    ahead, where this program is the one that prefetches for the split (``lead``)."""
    if WG == 0:
        _prefetch_tile_l2(kv_ptr, stride_kv_row, rows_a, lead & (2 * j + 2 < num_tiles),
                          BLOCK_N)  # fmt: skip
    else:
        _prefetch_tile_l2(kv_ptr, stride_kv_row, rows_b, lead & (2 * j + 3 < num_tiles),
                          BLOCK_N)  # fmt: skip


@gluon.jit
def _hand_over_p(p_buf, p, bar, TRACE: gl.constexpr, tr, jt):
    """P into its shared buffer (fenced for the async proxy the P V MMAs read through), then
    the hand-off barrier's arrival; trace event 5."""
    p_buf.store(p.to(p_buf.dtype))
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(bar, count=1)
    _trace_stamp(tr, jt, 5, TRACE)


@gluon.jit
def _store_lse(WG: gl.constexpr, lse, lh, tok64, num_heads, valid, split, lse_ptr, stride_lse_tok,
               stride_lse_head, part_lse_ptr, stride_pl_tok, stride_pl_split, stride_pl_head,
               NUM_SPLITS: gl.constexpr, RETURN_LSE: gl.constexpr):  # fmt: skip
    """Warpgroup 0 stores the LSE of the real heads ``lh`` of token ``tok64``: the output's
    (one split, where asked for) or the split's partial."""
    if NUM_SPLITS == 1:
        if RETURN_LSE and WG == 0:
            gl.store(
                lse_ptr + tok64 * stride_lse_tok + lh * stride_lse_head,
                lse,
                mask=(lh < num_heads) & valid,
            )
    elif WG == 0:
        pl = part_lse_ptr + tok64 * stride_pl_tok + split * stride_pl_split
        gl.store(pl + lh * stride_pl_head, lse, mask=(lh < num_heads) & valid)


@gluon.jit
def _warpgroup(WG: gl.constexpr, rt, NUM_SPLITS: gl.constexpr, RETURN_LSE: gl.constexpr,
               GATHER: gl.constexpr, PAGE_INDICES: gl.constexpr, PACKED: gl.constexpr,
               STORE_SMEM: gl.constexpr, OUT_VEC: gl.constexpr, TRACE: gl.constexpr,
               tr):  # fmt: skip
    """Warpgroup WG's whole loop and its half of the epilogue (module doc). ``rt``: the runtime
    values, in the order the kernel packs them. PACKED: rows are (query token, head) pairs of
    one sequence (`_packed_rows`), each masked at its own causal limit.
    STORE_SMEM: a one-split output goes through this warpgroup's buffer-0 half. OUT_VEC: the rows
    it writes are aligned (`rows_aligned`). TRACE, ``tr``: the diagnostic stamps and (trace
    buffer, program id)."""
    (q_ptr, q_row_off, stride_q_head, stride_q_dim, hg, num_heads, lat_desc, pe_desc, bt_row,
     stride_bt_blk, start, end, num_tiles, block_size, qk_scale, ql_smem, qr_smem, qpe_smem,
     latl_smem, latr_smem, pe_smem, p_smem, m_smem, l_smem, tma_bars, sync_bars, out_ptr, lse_ptr,
     part_out_ptr, part_lse_ptr, tok, valid, split, stride_out_tok, stride_out_head,
     stride_out_dim, stride_lse_tok, stride_lse_head, stride_po_tok, stride_po_split,
     stride_po_head, stride_po_dim, stride_pl_tok, stride_pl_split,
     stride_pl_head, kv_ptr, stride_kv_row, stride_q_tok, q_start, q_len,
     seq_len) = rt  # fmt: skip
    gather = (kv_ptr, stride_kv_row, end)
    trace_ptr, pid = tr
    tr = (trace_ptr, (pid * 2 + WG).to(gl.int64) * ((TRACE_PAIRS + 1) * TRACE_EVENTS))
    dtype: gl.constexpr = ql_smem.dtype
    BLOCK_H: gl.constexpr = ql_smem.shape[1]
    HALF: gl.constexpr = ql_smem.shape[2]
    BLOCK_N: gl.constexpr = latl_smem.shape[1]
    ROPE_DIM: gl.constexpr = pe_smem.shape[2]
    QK: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    PV: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16]
    )
    QPE: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=QK, k_width=2)
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    ROW: gl.constexpr = gl.SliceLayout(1, QK)
    PV_ROW: gl.constexpr = gl.SliceLayout(1, PV)
    # the query's rope part: the score MMA's register operand
    qd = 2 * HALF + gl.arange(0, ROPE_DIM, layout=gl.SliceLayout(0, QPE))
    if PACKED:
        tq, hq, _, rq = _packed_rows(hg, num_heads, q_start, q_len, BLOCK_H,
                                     gl.SliceLayout(1, QPE))  # fmt: skip
        q_pe = gl.load(
            q_ptr + tq[:, None] * stride_q_tok + hq[:, None] * stride_q_head
            + qd[None, :] * stride_q_dim,
            mask=rq[:, None],
            other=0.0,
        )  # fmt: skip
    else:
        qh = hg * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, QPE))
        q_pe = gl.load(
            q_ptr + q_row_off + qh[:, None] * stride_q_head + qd[None, :] * stride_q_dim,
            mask=(qh < num_heads)[:, None],
            other=0.0,
        )
    # hand-offs, each completed once per pair: 0 m_A (WG0 -> WG1), 1 P_A (WG0 -> WG1),
    # 2 P_B and m_B (WG1 -> WG0). A barrier's next phase is signalled only after its waiter
    # passed this one (through the chain of the other hand-offs and the tile barriers).
    bar_ma = sync_bars.index(0)
    bar_pa = sync_bars.index(1)
    bar_pb = sync_bars.index(2)
    if PACKED:
        # each row's end in this split (its causal limit); the running max starts finite, so a
        # row without a column in a tile (or the whole split) gets p = 0 and no NaN
        _, _, qi_s, real_s = _packed_rows(hg, num_heads, q_start, q_len, BLOCK_H, ROW)
        row_end = gl.minimum(gl.where(real_s, seq_len - q_len + qi_s + 1, 0), end)
        m_i = gl.full([BLOCK_H], -3.4028234663852886e38, gl.float32, layout=ROW)  # fp32's lowest
    else:
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=ROW)
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=ROW)
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, layout=PV)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, QK))
    steps = gl.cdiv(num_tiles, 2) * 2
    # one program prefetches for all that read this split's rows (its first head group of its
    # first query token): a second program's prefetches of the same rows cost time
    lead = (hg == 0) & (tok == q_start)
    opaque = _opaque_zero(stride_kv_row, block_size, GATHER)
    for j in range(steps // 2):
        ph, b0, b1, own, n_a, n_b, jt, rows_a, rows_b = _pair_start(
            WG, j, opaque, bt_row, stride_bt_blk, start, num_tiles, block_size, end, BLOCK_N,
            GATHER, PAGE_INDICES, TRACE, tr)  # fmt: skip
        # scores of this warpgroup's tile: latent halves as they land, then rope (registers)
        mbarrier.wait(tma_bars.index(2 * own), ph)
        _trace_stamp(tr, jt, 1, TRACE)
        if GATHER:  # cp.async wrote through the generic proxy; the MMAs read through the async
            fence_async_shared()
        qk = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=QK)
        qk = warpgroup_mma(ql_smem.index(b0), latl_smem.index(own).permute((1, 0)), qk,
                           use_acc=False, is_async=True)  # fmt: skip
        mbarrier.wait(tma_bars.index(2 * own + 1), ph)
        _trace_stamp(tr, jt, 2, TRACE)
        if GATHER:
            fence_async_shared()
        qk = warpgroup_mma(qr_smem.index(b0), latr_smem.index(own).permute((1, 0)), qk,
                           is_async=True)  # fmt: skip
        qk = warpgroup_mma(q_pe, pe_smem.index(own).permute((1, 0)), qk, is_async=True)
        qk = warpgroup_mma_wait(num_outstanding=0, deps=[qk])
        _trace_stamp(tr, jt, 3, TRACE)
        if not GATHER:  # the next pair's tile this warpgroup scores into L2, a pair ahead
            _prefetch_next_tile(WG, kv_ptr, stride_kv_row, rows_a, rows_b, lead, j, num_tiles,
                                BLOCK_N)  # fmt: skip
        n_own = n_a + WG * BLOCK_N
        # raw scores, masked; the scale goes inside the exponent (one fma a score): the row
        # max of the raw scores is scaled once a row (qk_scale > 0: the launcher checks it)
        if PACKED:
            s = gl.where((n_own + cols)[None, :] < row_end[:, None], qk, float("-inf"))
        elif n_own + BLOCK_N <= end:  # only a tile that reaches past the split's end is masked
            s = qk
        else:
            s = gl.where(((n_own + cols) < end)[None, :], qk, float("-inf"))
        if WG == 0:
            # m_A first (WG1's softmax waits for it), then P_A
            rm = gl.max(s, 1) * qk_scale
            m_a = gl.where(rm > m_i + LAZY_T, rm, m_i)  # lazy: moves only past LAZY_T
            m_smem.index(0).store(m_a)
            gl.thread_barrier()
            mbarrier.arrive(bar_ma, count=1)
            _trace_stamp(tr, jt, 4, TRACE)
            p = gl.exp2(s * qk_scale - m_a[:, None])
            alpha = gl.exp2(m_i - m_a)
            l_i = l_i * alpha + gl.sum(p, 1)
            acc = lazy_rescale(acc, gl.convert_layout(alpha, PV_ROW), True)
            _hand_over_p(p_smem.index(b0), p, bar_pa, TRACE, tr, jt)
            lat_half = latl_smem  # this warpgroup's output columns: the latent's left half
        else:
            mbarrier.wait(bar_ma, ph)
            _trace_stamp(tr, jt, 4, TRACE)
            m_a = m_smem.index(0).load(ROW)
            rm = gl.max(s, 1) * qk_scale
            m_b = gl.where(rm > m_a + LAZY_T, rm, m_a)
            p = gl.exp2(s * qk_scale - m_b[:, None])
            m_smem.index(1).store(m_b)
            _hand_over_p(p_smem.index(b1), p, bar_pb, TRACE, tr, jt)
            l_b = gl.sum(p, 1)
            mbarrier.wait(bar_pa, ph)
            _trace_stamp(tr, jt, 6, TRACE)
            alpha = gl.exp2(m_i - m_a)
            l_i = l_i * alpha
            acc = lazy_rescale(acc, gl.convert_layout(alpha, PV_ROW), True)
            lat_half = latr_smem
        # PV on A (scaled at m_A), then on B (at m_B); after each, this warpgroup's half of
        # that buffer is free and takes the next pair's tile, with the rope part (TMA: WG1's
        # half; gather: WG0's), which no score MMA reads any more (S_A finished before P_A,
        # S_B before P_B)
        _zero_tail(lat_half.index(b0), n_a, end, LOAD)
        acc = warpgroup_mma(p_smem.index(b0), lat_half.index(b0), acc, is_async=True)
        _trace_stamp(tr, jt, 7, TRACE)
        if WG == 0:
            mbarrier.wait(bar_pb, ph)
            _trace_stamp(tr, jt, 8, TRACE)
            m_b = m_smem.index(1).load(ROW)
        acc = _refill(WG, acc, rows_a, 2 * j + 2, b0, lat_half, pe_smem, tma_bars, lat_desc,
                      pe_desc, start, num_tiles, steps, gather, GATHER, TRACE, tr, jt,
                      9)  # fmt: skip
        beta = gl.exp2(m_a - m_b)
        l_i = l_i * beta
        if WG == 1:
            l_i = l_i + l_b
        acc = lazy_rescale(acc, gl.convert_layout(beta, PV_ROW), True)
        _zero_tail(lat_half.index(b1), n_b, end, LOAD)
        acc = warpgroup_mma(p_smem.index(b1), lat_half.index(b1), acc, is_async=True)
        _trace_stamp(tr, jt, 11, TRACE)
        acc = _refill(WG, acc, rows_b, 2 * j + 3, b1, lat_half, pe_smem, tma_bars, lat_desc,
                      pe_desc, start, num_tiles, steps, gather, GATHER, TRACE, tr, jt,
                      12)  # fmt: skip
        m_i = m_b

    # -- row sums: each warpgroup summed the tiles it scored (both at the final max) --
    last = TRACE_PAIRS + 0 * steps  # the kernel's own slot
    _trace_stamp(tr, last, 0, TRACE)
    l_i = _sum_rows(WG, l_i, l_smem, sync_bars, ROW)
    _trace_stamp(tr, last, 1, TRACE)

    # -- epilogue: this warpgroup's output columns; the lse from warpgroup 0 --
    l_safe, lse = _row_lse(l_i, m_i)
    o = acc / gl.convert_layout(l_safe, PV_ROW)[:, None]
    if NUM_SPLITS == 1 and STORE_SMEM:
        # through shared memory, read back 8 columns a thread: every MMA of both warpgroups
        # has returned (the row sums' exchange follows both loops) and no copy is in flight
        # (nothing is issued past the last tile), so this warpgroup's buffer 0 half is free
        if WG == 0:  # noqa: SIM108 (a constexpr branch)
            obuf = latl_smem.index(0)
        else:
            obuf = latr_smem.index(0)
        fence_async_shared()
        obuf.store(o.to(dtype))
        gl.thread_barrier()
        TPC: gl.constexpr = 32 if HALF >= 256 else HALF // 8
        OUT: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPC, TPC], [4, 1], [1, 0])
        o = obuf.load(OUT)
        O_ROW: gl.constexpr = gl.SliceLayout(1, OUT)
        od = WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, OUT))
    else:  # (a constexpr branch: Gluon needs the annotation in each)
        O_ROW: gl.constexpr = PV_ROW  # type: ignore[no-redef]
        od = WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, PV))
    oh = hg * BLOCK_H + gl.arange(0, BLOCK_H, layout=O_ROW)
    lh = hg * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW)
    tok64 = tok.to(gl.int64)
    if PACKED:  # each real row to its (token, head); padded rows nowhere
        to, ho, _, ro = _packed_rows(hg, num_heads, q_start, q_len, BLOCK_H, O_ROW)
        tl_, hl, _, rl = _packed_rows(hg, num_heads, q_start, q_len, BLOCK_H, ROW)
        mask_o = ro[:, None]  # broadcast along the row (a column term cost the vector stores)
        if NUM_SPLITS == 1:
            base = out_ptr + to[:, None] * stride_out_tok  # [rows, 1]: each row's token
            ptrs = row_ptrs(base, ho * stride_out_head, od, stride_out_dim, OUT_VEC, 8)
            gl.store(ptrs, o.to(dtype), mask=mask_o)
            if RETURN_LSE and WG == 0:
                gl.store(lse_ptr + tl_ * stride_lse_tok + hl * stride_lse_head, lse, mask=rl)
        else:
            po = part_out_ptr + split * stride_po_split
            base = po + to[:, None] * stride_po_tok
            ptrs = row_ptrs(base, ho * stride_po_head, od, stride_po_dim, OUT_VEC, 4)
            gl.store(ptrs, o, mask=mask_o)
            if WG == 0:
                pl = part_lse_ptr + split * stride_pl_split
                gl.store(pl + tl_ * stride_pl_tok + hl * stride_pl_head, lse, mask=rl)
    elif NUM_SPLITS == 1:
        mask_o = ((oh < num_heads) & valid)[:, None]
        ptrs = row_ptrs(out_ptr + tok64 * stride_out_tok, oh * stride_out_head, od,
                        stride_out_dim, OUT_VEC, 8)  # fmt: skip
        gl.store(ptrs, o.to(dtype), mask=mask_o)
        _store_lse(WG, lse, lh, tok64, num_heads, valid, split, lse_ptr, stride_lse_tok,
                   stride_lse_head, part_lse_ptr, stride_pl_tok, stride_pl_split, stride_pl_head,
                   NUM_SPLITS, RETURN_LSE)  # fmt: skip
    else:
        # the real heads' rows only: the reduce reads no padded row
        po = part_out_ptr + tok64 * stride_po_tok + split * stride_po_split
        mask_o = ((oh < num_heads) & valid)[:, None]
        ptrs = row_ptrs(po, oh * stride_po_head, od, stride_po_dim, OUT_VEC, 4)
        gl.store(ptrs, o, mask=mask_o)
        _store_lse(WG, lse, lh, tok64, num_heads, valid, split, lse_ptr, stride_lse_tok,
                   stride_lse_head, part_lse_ptr, stride_pl_tok, stride_pl_split, stride_pl_head,
                   NUM_SPLITS, RETURN_LSE)  # fmt: skip
    _trace_stamp(tr, last, 2, TRACE)
    _trace_stamp(tr, last, 3, TRACE, True)


@gluon.jit
def _warpgroup_heads_n(WG: gl.constexpr, rt, NUM_SPLITS: gl.constexpr, RETURN_LSE: gl.constexpr,
                       PAGE_INDICES: gl.constexpr, OUT_VEC: gl.constexpr, TRACE: gl.constexpr,
                       tr):  # fmt: skip
    """`_warpgroup` with the heads as the MMAs' N (``HEADS_N``: at most 16 heads, one query token
    a program): the scores are computed transposed, ``S^T = K Q^T`` (a tile's 64 tokens as M),
    and the output as ``O^T += V^T P^T`` (this warpgroup's latent columns as M), so no MMA
    works on padded head rows. The softmax runs down the columns; each warpgroup keeps its row
    sums as a ``[BLOCK_N, BLOCK_H]`` partial summed once at the end. Its rows always come by the
    gather (`sm90_gathers`). Same hand-offs, barriers and outputs as `_warpgroup`."""
    (q_ptr, q_row_off, stride_q_head, stride_q_dim, hg, num_heads, lat_desc, pe_desc, bt_row,
     stride_bt_blk, start, end, num_tiles, block_size, qk_scale, ql_smem, qr_smem, qpe_smem,
     latl_smem, latr_smem, pe_smem, p_smem, m_smem, l_smem, tma_bars, sync_bars, out_ptr, lse_ptr,
     part_out_ptr, part_lse_ptr, tok, valid, split, stride_out_tok, stride_out_head,
     stride_out_dim, stride_lse_tok, stride_lse_head, stride_po_tok, stride_po_split,
     stride_po_head, stride_po_dim, stride_pl_tok, stride_pl_split,
     stride_pl_head, kv_ptr, stride_kv_row, stride_q_tok, q_start, q_len,
     seq_len) = rt  # fmt: skip
    gather = (kv_ptr, stride_kv_row, end)
    trace_ptr, pid = tr
    tr = (trace_ptr, (pid * 2 + WG).to(gl.int64) * ((TRACE_PAIRS + 1) * TRACE_EVENTS))
    dtype: gl.constexpr = ql_smem.dtype
    BLOCK_H: gl.constexpr = ql_smem.shape[1]
    HALF: gl.constexpr = ql_smem.shape[2]
    BLOCK_N: gl.constexpr = latl_smem.shape[1]
    ST: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 16]
    )
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    COL: gl.constexpr = gl.SliceLayout(0, ST)
    bar_ma = sync_bars.index(0)
    bar_pa = sync_bars.index(1)
    bar_pb = sync_bars.index(2)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=COL)
    l_part = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=ST)
    acc = gl.zeros([HALF, BLOCK_H], gl.float32, layout=ST)
    toks = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ST))
    steps = gl.cdiv(num_tiles, 2) * 2
    opaque = _opaque_zero(stride_kv_row, block_size, True)
    for j in range(steps // 2):
        ph, b0, b1, own, n_a, n_b, jt, rows_a, rows_b = _pair_start(
            WG, j, opaque, bt_row, stride_bt_blk, start, num_tiles, block_size, end, BLOCK_N,
            True, PAGE_INDICES, TRACE, tr)  # fmt: skip
        mbarrier.wait(tma_bars.index(2 * own), ph)
        _trace_stamp(tr, jt, 1, TRACE)
        fence_async_shared()  # cp.async wrote through the generic proxy, the MMAs read the async
        st = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=ST)
        st = warpgroup_mma(latl_smem.index(own), ql_smem.index(b0).permute((1, 0)), st,
                           use_acc=False, is_async=True)  # fmt: skip
        mbarrier.wait(tma_bars.index(2 * own + 1), ph)
        _trace_stamp(tr, jt, 2, TRACE)
        fence_async_shared()
        st = warpgroup_mma(latr_smem.index(own), qr_smem.index(b0).permute((1, 0)), st,
                           is_async=True)  # fmt: skip
        st = warpgroup_mma(pe_smem.index(own), qpe_smem.index(b0).permute((1, 0)), st,
                           is_async=True)  # fmt: skip
        st = warpgroup_mma_wait(num_outstanding=0, deps=[st])
        _trace_stamp(tr, jt, 3, TRACE)
        n_own = n_a + WG * BLOCK_N
        if n_own + BLOCK_N <= end:  # only a tile that reaches past the split's end is masked
            s = st
        else:
            s = gl.where(((n_own + toks) < end)[:, None], st, float("-inf"))
        if WG == 0:
            cm = gl.max(s, 0) * qk_scale
            m_a = gl.where(cm > m_i + LAZY_T, cm, m_i)
            m_smem.index(0).store(m_a)
            gl.thread_barrier()
            mbarrier.arrive(bar_ma, count=1)
            _trace_stamp(tr, jt, 4, TRACE)
            p = gl.exp2(s * qk_scale - m_a[None, :])
            alpha = gl.exp2(m_i - m_a)
            l_part = l_part * alpha[None, :] + p
            acc = acc * alpha[None, :]
            _hand_over_p(p_smem.index(b0), p, bar_pa, TRACE, tr, jt)
            lat_half = latl_smem
        else:
            mbarrier.wait(bar_ma, ph)
            _trace_stamp(tr, jt, 4, TRACE)
            m_a = m_smem.index(0).load(COL)
            cm = gl.max(s, 0) * qk_scale
            m_b = gl.where(cm > m_a + LAZY_T, cm, m_a)
            p = gl.exp2(s * qk_scale - m_b[None, :])
            m_smem.index(1).store(m_b)
            _hand_over_p(p_smem.index(b1), p, bar_pb, TRACE, tr, jt)
            mbarrier.wait(bar_pa, ph)
            _trace_stamp(tr, jt, 6, TRACE)
            alpha = gl.exp2(m_i - m_a)
            l_part = l_part * alpha[None, :]
            acc = acc * alpha[None, :]
            lat_half = latr_smem
        _zero_tail(lat_half.index(b0), n_a, end, LOAD)
        acc = warpgroup_mma(lat_half.index(b0).permute((1, 0)), p_smem.index(b0), acc,
                            is_async=True)  # fmt: skip
        _trace_stamp(tr, jt, 7, TRACE)
        if WG == 0:
            mbarrier.wait(bar_pb, ph)
            _trace_stamp(tr, jt, 8, TRACE)
            m_b = m_smem.index(1).load(COL)
        acc = _refill(WG, acc, rows_a, 2 * j + 2, b0, lat_half, pe_smem, tma_bars, lat_desc,
                      pe_desc, start, num_tiles, steps, gather, True, TRACE, tr, jt,
                      9)  # fmt: skip
        beta = gl.exp2(m_a - m_b)
        l_part = l_part * beta[None, :]
        if WG == 1:
            l_part = l_part + p
        acc = acc * beta[None, :]
        _zero_tail(lat_half.index(b1), n_b, end, LOAD)
        acc = warpgroup_mma(lat_half.index(b1).permute((1, 0)), p_smem.index(b1), acc,
                            is_async=True)  # fmt: skip
        _trace_stamp(tr, jt, 11, TRACE)
        acc = _refill(WG, acc, rows_b, 2 * j + 3, b1, lat_half, pe_smem, tma_bars, lat_desc,
                      pe_desc, start, num_tiles, steps, gather, True, TRACE, tr, jt,
                      12)  # fmt: skip
        m_i = m_b

    # -- row sums: each warpgroup's partial summed down its tokens, then exchanged --
    last = TRACE_PAIRS + 0 * steps
    _trace_stamp(tr, last, 0, TRACE)
    l_i = gl.sum(l_part, 0)
    l_i = _sum_rows(WG, l_i, l_smem, sync_bars, COL)
    _trace_stamp(tr, last, 1, TRACE)

    # -- epilogue: O^T transposed into rows of heads, stored 16 bytes a thread --
    l_safe, lse = _row_lse(l_i, m_i)
    o = gl.permute(acc / l_safe[None, :], [1, 0])
    lh = hg * BLOCK_H + gl.arange(0, BLOCK_H, layout=COL)
    tok64 = tok.to(gl.int64)
    if NUM_SPLITS == 1:
        OUT: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        ob = gl.convert_layout(o.to(dtype), OUT)
        oh = hg * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, OUT))
        od = WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, OUT))
        ptrs = row_ptrs(out_ptr + tok64 * stride_out_tok, oh * stride_out_head, od,
                        stride_out_dim, OUT_VEC, 8)  # fmt: skip
        gl.store(ptrs, ob, mask=((oh < num_heads) & valid)[:, None])
        _store_lse(WG, lse, lh, tok64, num_heads, valid, split, lse_ptr, stride_lse_tok,
                   stride_lse_head, part_lse_ptr, stride_pl_tok, stride_pl_split, stride_pl_head,
                   NUM_SPLITS, RETURN_LSE)  # fmt: skip
    else:
        OUTF: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])
        of = gl.convert_layout(o, OUTF)
        oh = hg * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, OUTF))
        od = WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, OUTF))
        po = part_out_ptr + tok64 * stride_po_tok + split * stride_po_split
        ptrs = row_ptrs(po, oh * stride_po_head, od, stride_po_dim, OUT_VEC, 4)
        gl.store(ptrs, of, mask=((oh < num_heads) & valid)[:, None])
        _store_lse(WG, lse, lh, tok64, num_heads, valid, split, lse_ptr, stride_lse_tok,
                   stride_lse_head, part_lse_ptr, stride_pl_tok, stride_pl_split, stride_pl_head,
                   NUM_SPLITS, RETURN_LSE)  # fmt: skip
    _trace_stamp(tr, last, 2, TRACE)
    _trace_stamp(tr, last, 3, TRACE, True)


@gluon.jit
def _mla_decode_sm90_kernel(
    q_ptr,
    lat_desc,  # [num_blocks * block_size, head_dim_k], box [BLOCK_N, KV_LORA_RANK // 2]
    pe_desc,  # the same rows, box [BLOCK_N, ROPE_DIM]
    block_table_ptr,
    seq_lens_ptr,
    qsl_ptr,
    row_groups,
    out_ptr,
    lse_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale,
    num_seqs,
    num_heads,
    block_size,
    stride_q_tok,
    stride_q_head,
    stride_q_dim,
    stride_bt_seq,
    stride_bt_blk,
    stride_seq_lens,
    stride_qsl,
    stride_out_tok,
    stride_out_head,
    stride_out_dim,
    stride_lse_tok,
    stride_lse_head,
    stride_po_tok,
    stride_po_split,
    stride_po_head,
    stride_po_dim,
    stride_pl_tok,
    stride_pl_split,
    stride_pl_head,
    kv_ptr,  # the cache (GATHER only)
    stride_kv_row,  # its row stride, ``kv_cache.stride(1)`` (GATHER only)
    page_indptr_ptr,  # [num_seqs + 1] (PAGE_INDICES only)
    page_indices_ptr,  # [total_context_tokens] flat slots (PAGE_INDICES only)
    stride_indptr,
    stride_indices,
    KV_LORA_RANK: gl.constexpr,
    ROPE_DIM: gl.constexpr,
    BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_GROUPS: gl.constexpr,
    NUM_SPLITS: gl.constexpr,
    VARLEN: gl.constexpr,
    RETURN_LSE: gl.constexpr,
    Q_LAYOUT: gl.constexpr,  # NVMMASharedLayout of [BLOCK_H, KV_LORA_RANK // 2]
    P_LAYOUT: gl.constexpr,  # NVMMASharedLayout of P's tile ([BLOCK_N, BLOCK_H] with HEADS_N)
    QPE_LAYOUT: gl.constexpr,  # NVMMASharedLayout of [BLOCK_H, ROPE_DIM] (HEADS_N only)
    HEADS_N: gl.constexpr,  # the heads as the MMAs' N (`_warpgroup_heads_n`)
    WG_REGS: gl.constexpr,
    GATHER: gl.constexpr,  # rows by cp.async gather (`_gather_half`), not TMA boxes
    PAGE_INDICES: gl.constexpr,  # rows from page_indices' flat slots (GATHER only)
    PACKED: gl.constexpr,
    trace_ptr,  # int64 clock stamps (TRACE only)
    TRACE: gl.constexpr,
    STORE_SMEM: gl.constexpr,  # the output through shared memory (`MlaConfig.store_smem`)
    OUT_VEC: gl.constexpr,  # the rows it writes (output or partials) are aligned (`rows_aligned`)
):
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    HALF: gl.constexpr = KV_LORA_RANK // 2
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    LAT_LAYOUT: gl.constexpr = lat_desc.layout
    PE_LAYOUT: gl.constexpr = pe_desc.layout
    VEC: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])

    # -- which (token, split, head group), the causal range (as in the portable kernel) --
    pid = gl.program_id(0)
    tr0 = (trace_ptr, pid.to(gl.int64) * (2 * (TRACE_PAIRS + 1) * TRACE_EVENTS))
    _trace_stamp(tr0, TRACE_PAIRS + 0 * pid, 4, TRACE)
    _trace_stamp(tr0, TRACE_PAIRS + 0 * pid, 5, TRACE, True)
    if PACKED:
        # (sequence, split, row group) (`_packed_rows`); the tile's range comes from its last
        # real row, whose causal limit is the largest
        hg = pid % row_groups
        rest = pid // row_groups
        split = rest % NUM_SPLITS
        seq = rest // NUM_SPLITS
        if VARLEN:
            q_start = gl.load(qsl_ptr + seq * stride_qsl)
            q_len = gl.load(qsl_ptr + (seq + 1) * stride_qsl) - q_start
        else:
            q_start = seq
            q_len = seq * 0 + 1
        seq_len = gl.load(seq_lens_ptr + seq * stride_seq_lens)
        last = gl.minimum((hg + 1) * BLOCK_H, q_len * num_heads) - 1
        kv_len = gl.where(last >= hg * BLOCK_H, seq_len - q_len + last // num_heads + 1, 0)
        tok = q_start  # the non-packed epilogue's; unused
        valid = q_len > 0
    else:
        hg = pid % HEAD_GROUPS
        rest = pid // HEAD_GROUPS
        split = rest % NUM_SPLITS
        tok = rest // NUM_SPLITS
        # the query's rows need no metadata: read first, so that their latency runs under the
        # metadata reads and the first tiles' issue (stored once those are issued)
        q_row_off = tok.to(gl.int64) * stride_q_tok
        offs_h = hg * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LOAD))
        q_row = q_ptr + q_row_off + offs_h[:, None] * stride_q_head
        ql, qr = _query_halves(q_row, (offs_h < num_heads)[:, None], stride_q_dim, HALF, LOAD)
        if VARLEN:
            seq = gl.maximum(_find_seq_sm90(qsl_ptr, stride_qsl, tok, num_seqs), 0)
            q_start = gl.load(qsl_ptr + seq * stride_qsl)
            q_len = gl.load(qsl_ptr + (seq + 1) * stride_qsl) - q_start
            q_idx = tok - q_start
            valid = (q_idx >= 0) & (q_idx < q_len)
        else:
            seq = tok
            q_start = tok
            q_len = tok * 0 + 1
            q_idx = 0
            valid = tok >= 0
        seq_len = gl.load(seq_lens_ptr + seq * stride_seq_lens)
        kv_len = gl.where(valid, seq_len - q_len + q_idx + 1, 0)
    chunk = gl.cdiv(gl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = gl.minimum(start + chunk, kv_len)
    num_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
    steps = gl.cdiv(num_tiles, 2) * 2
    bt_row = block_table_ptr + seq.to(gl.int64) * stride_bt_seq
    if PAGE_INDICES:  # the gather reads this sequence's flat slots where it reads block ids
        page_start = gl.load(page_indptr_ptr + seq * stride_indptr).to(gl.int64)
        bt_row = page_indices_ptr + page_start * stride_indices
        stride_bt_blk = stride_indices

    # -- shared memory: the query's latent halves ([1, ...]: indexed with the opaque 0), two
    # tile buffers (latent halves, rope part), both tiles' P, the running max and row sums
    # handed between the warpgroups, the barriers --
    if PACKED:  # the rows come from the sequence's query tokens
        q_row_off = tok.to(gl.int64) * stride_q_tok
        tq, hq, _, rq = _packed_rows(hg, num_heads, q_start, q_len, BLOCK_H,
                                     gl.SliceLayout(1, LOAD))  # fmt: skip
        q_row = q_ptr + tq[:, None] * stride_q_tok + hq[:, None] * stride_q_head
        ql, qr = _query_halves(q_row, rq[:, None], stride_q_dim, HALF, LOAD)
    ql_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_H, HALF], Q_LAYOUT)
    qr_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_H, HALF], Q_LAYOUT)
    latl_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HALF], LAT_LAYOUT)
    latr_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HALF], LAT_LAYOUT)
    pe_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, ROPE_DIM], PE_LAYOUT)
    if HEADS_N:  # P^T is the output MMA's B operand; the query's rope part is in shared memory
        p_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_H], P_LAYOUT)
        qpe_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_H, ROPE_DIM], QPE_LAYOUT)
        offs_pe = 2 * HALF + gl.arange(0, ROPE_DIM, layout=gl.SliceLayout(0, LOAD))
        qpe = gl.load(q_row + offs_pe[None, :] * stride_q_dim, mask=(offs_h < num_heads)[:, None],
                      other=0.0)  # fmt: skip
    else:
        p_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_H, BLOCK_N], P_LAYOUT)
        qpe_smem = pe_smem  # (unused)
    m_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], VEC)
    l_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], VEC)
    # tile barriers: buffer b's left half (2b), its right half (2b + 1); the rope part with the
    # right half (TMA) or the left (gather)
    tma_bars = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    # hand-offs (see _warpgroup), then 3 / 4: warpgroup 0 / 1's row sums written
    sync_bars = gl.allocate_shared_memory(gl.int64, [5, 1], mbarrier.MBarrierLayout())
    # TMA: one arrival (the expect) plus the bytes; gather: each of the issuing warpgroup's
    # 128 threads once its cp.async copies land
    for k in gl.static_range(4):
        mbarrier.init(tma_bars.index(k), count=128 if GATHER else 1)
    for k in gl.static_range(5):
        mbarrier.init(sync_bars.index(k), count=1)
    fence_async_shared()
    # -- prologue: tiles 0 and 1 in flight (both tiles' rows read first: one wait, not two) --
    rows_01 = (
        _tile_cache_rows(bt_row, stride_bt_blk, 0, start, num_tiles, block_size, end, BLOCK_N,
                         GATHER, PAGE_INDICES),
        _tile_cache_rows(bt_row, stride_bt_blk, 1, start, num_tiles, block_size, end, BLOCK_N,
                         GATHER, PAGE_INDICES),
    )  # fmt: skip
    for t in gl.static_range(2):
        rows = rows_01[t]
        _load_half(lat_desc, pe_desc, rows, t, start, num_tiles, steps, tma_bars.index(2 * t),
                   latl_smem.index(t), pe_smem.index(t), False, (kv_ptr, stride_kv_row, end),
                   GATHER)  # fmt: skip
        _load_half(lat_desc, pe_desc, rows, t, start, num_tiles, steps, tma_bars.index(2 * t + 1),
                   latr_smem.index(t), pe_smem.index(t), True, (kv_ptr, stride_kv_row, end),
                   GATHER)  # fmt: skip
    ql_smem.index(0).store(ql)
    qr_smem.index(0).store(qr)
    if HEADS_N:
        qpe_smem.index(0).store(qpe)
    fence_async_shared()  # the score MMAs read the query through the async proxy
    _trace_stamp(tr0, TRACE_PAIRS + 0 * pid, 6, TRACE)
    qk_scale = scale * 1.4426950408889634  # exp2 domain
    # runtime values for both warpgroups (the constexprs go in the call tuples themselves: a
    # tuple assigned to a name turns them into tensors)
    rt = (q_ptr, q_row_off, stride_q_head, stride_q_dim, hg, num_heads, lat_desc, pe_desc, bt_row,
          stride_bt_blk, start, end, num_tiles, block_size, qk_scale, ql_smem, qr_smem, qpe_smem,
          latl_smem, latr_smem, pe_smem, p_smem, m_smem, l_smem, tma_bars, sync_bars, out_ptr,
          lse_ptr, part_out_ptr, part_lse_ptr, tok, valid, split, stride_out_tok, stride_out_head,
          stride_out_dim, stride_lse_tok, stride_lse_head, stride_po_tok, stride_po_split,
          stride_po_head, stride_po_dim, stride_pl_tok, stride_pl_split,
          stride_pl_head, kv_ptr, stride_kv_row, stride_q_tok, q_start, q_len,
          seq_len)  # fmt: skip
    # fmt: off
    if HEADS_N:
        gl.static_assert(GATHER, "heads as N load their rows by the gather (sm90_gathers)")
        gl.warp_specialize(
            [
                (_warpgroup_heads_n, (0, rt, NUM_SPLITS, RETURN_LSE, PAGE_INDICES, OUT_VEC,
                                      TRACE, (trace_ptr, pid))),
                (_warpgroup_heads_n, (1, rt, NUM_SPLITS, RETURN_LSE, PAGE_INDICES, OUT_VEC,
                                      TRACE, (trace_ptr, pid))),
            ],
            [4],
            [WG_REGS],
        )
    else:
        gl.warp_specialize(
            [
                (_warpgroup, (0, rt, NUM_SPLITS, RETURN_LSE, GATHER, PAGE_INDICES, PACKED,
                              STORE_SMEM, OUT_VEC, TRACE, (trace_ptr, pid))),
                (_warpgroup, (1, rt, NUM_SPLITS, RETURN_LSE, GATHER, PAGE_INDICES, PACKED,
                              STORE_SMEM, OUT_VEC, TRACE, (trace_ptr, pid))),
            ],
            [4],
            [WG_REGS],
        )
    # fmt: on


def sm90_smem_bytes(kv_lora_rank: int, rope: int, elem: int = 2) -> int:
    """Shared memory this kernel allocates, an upper bound: the query's latent part, two tiles,
    two P tiles, the max / row-sum vectors, 9 barriers and 1 KB for Triton's alignment
    (576/512 bf16: 231496 B; Triton allocates 230788)."""
    query = BLOCK_H * kv_lora_rank * elem
    tiles = 2 * BLOCK_N * (kv_lora_rank + rope) * elem
    p = 2 * BLOCK_H * BLOCK_N * elem
    return query + tiles + p + 2 * 2 * BLOCK_H * 4 + 9 * 8 + 1024


def sm90_errors(
    kv_cache: torch.Tensor, kv_lora_rank: int, block_h: int, block_n: int, target: Target,
    paged_slots: bool,
) -> list[str]:  # fmt: skip
    """Why this kernel cannot run a launch (empty: it can); module doc, Requirements. Pages of
    a multiple of 64 tokens in a block table load by TMA; other pages and ``page_indices`` by
    row gather."""
    rope = kv_cache.shape[2] - kv_lora_rank
    elem = kv_cache.element_size()
    smem = sm90_smem_bytes(kv_lora_rank, rope, elem)
    # messages are formatted only for the rules that fail (the planner asks on every call)
    rules: list[tuple[bool, Callable[[], str]]] = [
        (target.arch == "sm_90", lambda: f"target {target.arch} is not sm_90"),
        (kv_cache.dtype in _GL_DTYPES, lambda: f"dtype {kv_cache.dtype} is not fp16/bf16"),
        (
            (block_h, block_n) == (BLOCK_H, BLOCK_N),
            lambda: f"tile H{block_h} N{block_n} is not H64 N64",
        ),
        (
            kv_lora_rank in mla_policy.SM90_KERNEL_RANKS,
            lambda: f"kv_lora_rank {kv_lora_rank} not in 128/256/512",
        ),
        (
            rope in mla_policy.SM90_KERNEL_ROPES,
            lambda: f"rope width {rope} not in 16..128 pow2",
        ),
        (
            smem <= target.max_shared_mem,
            lambda: f"shared memory {smem} B > the target's {target.max_shared_mem}",
        ),
        (
            kv_cache.stride(2) == 1
            and kv_cache.stride(0) == kv_cache.shape[1] * kv_cache.stride(1),
            lambda: f"cache strides {tuple(kv_cache.stride())} are not pages one after another",
        ),
        (
            kv_cache.shape[0] * kv_cache.shape[1] < 2**31,
            lambda: (
                f"{kv_cache.shape[0]} x {kv_cache.shape[1]} cache rows >= 2^31 (32-bit row indices)"
            ),
        ),
        ((kv_cache.stride(1) * elem) % 16 == 0, lambda: "row stride not 16-byte aligned"),
        (kv_cache.data_ptr() % 16 == 0, lambda: "cache base not 16-byte aligned"),
        (kv_cache.device.type in ("cuda", "meta"), lambda: "not a CUDA (or meta) tensor"),
    ]
    return [why() for ok, why in rules if not ok]


def sm90_gathers(kv_cache: torch.Tensor, paged_slots: bool, heads_n: bool) -> bool:
    """Whether the kernel loads rows by gather rather than by TMA boxes
    (`portattn.policy.mla.sm90_gathers` of the cache's page size and the launch's schedule)."""
    return mla_policy.sm90_gathers(kv_cache.shape[1], paged_slots, heads_n)


def trace_elements(programs: int) -> int:
    """Elements a trace buffer of a launch of ``programs`` needs (`TRACE_PAIRS` + 1 slots of
    `TRACE_EVENTS` stamps per program and warpgroup)."""
    return programs * 2 * (TRACE_PAIRS.value + 1) * TRACE_EVENTS.value


@functools.cache
def _shared_layouts(
    dtype: torch.dtype, half: int, rope: int, heads_n: bool
) -> tuple[gl.NVMMASharedLayout, ...]:
    """The shared-memory layouts of a launch's latent half, rope, query half, P and query rope
    tiles (frozen values, built once per dtype and widths: each costs microseconds of host time
    a call); ``heads_n``: the `HEADS_N` tiles (`_warpgroup_heads_n`)."""
    gl_dtype = _GL_DTYPES[dtype]
    bh = HEADS_N_BLOCK_H if heads_n else BLOCK_H
    p = [BLOCK_N, bh] if heads_n else [bh, BLOCK_N]
    return tuple(
        gl.NVMMASharedLayout.get_default_for(block, gl_dtype)
        for block in ([BLOCK_N, half], [BLOCK_N, rope], [bh, half], p, [bh, rope])
    )


def sm90_launch(
    main: Launch,
    kv_cache: torch.Tensor,
    kv_lora_rank: int,
    config: MlaConfig,
    trace: torch.Tensor | None = None,
) -> Launch:
    """The portable kernel's launch ``main``, run by this kernel (same arguments and outputs),
    with ``config``'s schedule; ``trace``: an int64 buffer the launch stamps (`trace_elements`).

    Raises:
        ValueError: ``trace`` is not an int64 tensor on the cache's device of that size.
    """
    a = main.args
    rope = kv_cache.shape[2] - kv_lora_rank
    half = kv_lora_rank // 2
    rows = kv_cache.shape[0] * kv_cache.shape[1]
    shape, strides = [rows, kv_cache.shape[2]], [kv_cache.stride(1), 1]
    # the heads as the MMAs' N (the planner refused it for packed rows and more heads)
    heads_n = config.heads_n
    lat_layout, pe_layout, q_layout, p_layout, qpe_layout = _shared_layouts(
        kv_cache.dtype, half, rope, heads_n
    )
    args = {
        name: a[name]
        for name in _mla_decode_sm90_kernel.arg_names
        if name in a and name not in ("BLOCK_H", "BLOCK_N")
    }
    args.update(
        kv_ptr=kv_cache,
        stride_kv_row=kv_cache.stride(1),
        GATHER=sm90_gathers(kv_cache, bool(a["PAGE_INDICES"]), heads_n),
        lat_desc=TensorDescriptor(kv_cache, shape, strides, [BLOCK_N, half], lat_layout),
        pe_desc=TensorDescriptor(kv_cache, shape, strides, [BLOCK_N, rope], pe_layout),
        BLOCK_H=HEADS_N_BLOCK_H if heads_n else BLOCK_H,
        BLOCK_N=BLOCK_N,
        Q_LAYOUT=q_layout,
        P_LAYOUT=p_layout,
        QPE_LAYOUT=qpe_layout,
        HEADS_N=heads_n,
        WG_REGS=WG_REGS,
        OUT_VEC=rows_aligned(a["out_ptr"] if a["NUM_SPLITS"] == 1 else a["part_out_ptr"]),
        STORE_SMEM=config.store_smem,
        # a placeholder pointer without a trace (never read)
        trace_ptr=trace if trace is not None else a["seq_lens_ptr"],
        TRACE=trace is not None,
    )
    if trace is not None:
        need = trace_elements(main.grid[0])
        layout = "programs x 2 x (TRACE_PAIRS + 1) x TRACE_EVENTS"
        check_trace_buffer(trace, need, kv_cache.device, layout, "mla_decode")
    options = LaunchOptions(NUM_WARPS, main.options.num_stages)
    return dataclasses.replace(
        main, kernel=_mla_decode_sm90_kernel, args=args, options=options, name="mla_decode_sm90"
    )
