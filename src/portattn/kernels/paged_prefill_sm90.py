"""Paged attention, Hopper (sm_90) prefill kernel in Gluon: TMA page boxes, a producer warp, two
or three consumer warpgroups on wgmma.

Same math, arguments and output as `portattn.kernels.paged_attention`, whose launcher picks this
kernel for the prefill part of a batch (`portattn.policy.paged.paged_config`); the decode
sequences of a mixed batch are items of the same launch. Every launch-time choice comes from a
`PrefillConfig`; this module only maps it to the kernel's constexprs.

Work. A program's ``64 x WGS`` rows are ``BLOCK_Q`` query tokens x ``HEAD_TILE`` query heads of
one KV head (as the portable kernel packs GQA groups); warpgroup ``w`` owns rows
``[64 w, 64 w + 64)``.
A first, small launch (`_work_list_kernel`, one program per sequence) writes the list of
(sequence, q tile) entries of the prefill sequences, heaviest q tile first within a sequence,
and a second list of the decode sequences. The grid is persistent (one program per SM): each
program's producer claims the next item of one launch-wide order (`item_order`: the decode items
spread evenly among the prefill items) from a counter (`_claim_item`) and hands it, with what its
metadata says, to its warpgroups through a ring in shared memory (`_receive_item`: no global
reads at an item's start), so the programs end together and
a few programs stream a decode item's cache while the rest run prefill tiles. No host read of
the metadata: the launch is CUDA-graph safe. A warpgroup whose rows are all padding (a decode
item's later warpgroups) skips the math and only releases each tile.

Schedule (`gl.warp_specialize`): the producer walks the same items and K/V tiles as the consumers
and, for each tile, waits until every warpgroup released the stage, then loads K and V (``SPLIT``:
waits for the stage's K buffer and loads K, then does the same for V) by TMA, one box per ``BOX``
rows of one cache page (its page found without a division a box where ``PAGING`` allows,
`_tile_rows`; a box past the sequence reads a row past the tensor: zeros). Each consumer warpgroup:
S = Q K^T (wgmma, operands in shared memory), masks on the tiles past its first row's causal limit,
base-2 online softmax in registers, O += P V with P in registers, then releases the stage
(``SPLIT``: its K buffer once its scores have returned, apart, so that the next K tile loads under P
V). ``PINGPONG``: the warpgroups with real rows take turns issuing their MMAs, round robin (one's
softmax under the others' MMAs): a turn issues P V of tile t and the scores of tile t+1; items whose
second warpgroup has no real rows take no turns. Otherwise a warpgroup scores, softmaxes and
accumulates one tile at a time; ``LATE_RELEASE`` releases each V buffer just before the next tile's
P V. ``V_PAGES``: V tiles arrive a page box a copy through a 3-D view of the cache and P V reads
them through one shared layout of the boxes (`_pages_layout`). ``Q_TMA``: the producer loads each
item's query rows by TMA into a warpgroup's buffer once the warpgroup freed it (`_load_query`,
`_query_freed`); otherwise each warpgroup reads its rows (16 bytes a thread where ``Q_VEC``: a
partition cannot see the launch's alignment, `rows_aligned`). ``O_TMA``: a warpgroup whose rows are
all real tokens writes them by one TMA copy (`_store_out`) through its query buffer, freeing the
buffer once TMA has read it. Others store element by element (`_store_rows`, 4 bytes a thread where
``O_VEC``).

The rows of a sequence's last page past ``seq_len`` may hold anything (NaN): their scores are
masked, and before P V each warpgroup zeroes them in the V tile.

Requirements (`sm90_prefill_errors`, beside the config's `prefill_config_errors`): the cache
rows addressable as one 2-D tensor of rows ``page * (stride(0) // stride(1)) + slot``
(``stride(3) == 1``, the page stride a multiple of the token stride, a token's KV heads within
its token stride, 16-byte aligned strides and base): contiguous, sliced and hybrid-interleaved
NHD caches, not HND-stored ones.

Tracing (a launch's ``trace`` buffer): clock stamps per K/V tile for the first `TRACE_TILES`
tiles of each program in each partition (`trace_shape`); compiled out otherwise.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
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
from portattn.policy.common import LaunchOptions
from portattn.policy.paged import (
    SM90_PREFILL_RING_EXTRA,
    SM90_PREFILL_RING_WORDS,
    SM90_PREFILL_TILES,
    PrefillConfig,
)

_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
#: Head dims this kernel is written for (each with its tile in `SM90_PREFILL_TILES`).
HEAD_DIMS = tuple(sorted(SM90_PREFILL_TILES))
#: Warps of the default partition (consumer warpgroup 0); the other consumer warpgroups
#: (`PrefillConfig.warpgroups`) and the producer are worker partitions of 4 and 1 warps.
NUM_WARPS = 4
PRODUCER_WARPS = gl.constexpr(1)
#: The trace's stamps a tile, tiles a program and partitions (consumer warpgroups 0-2; the producer
#: at 3). Consumer events: 0 tile start, 1 K landed, 2 scores done, 3 P ready, 4 V landed (tail
#: zeroed), 5 P V done, 6 stage released, 7 item start (its first tile), 8 the epilogue's stores
#: issued and 9 the next item in hand (its last tile); a warpgroup passing tiles on stamps 0, 1, 4,
#: 6 and 9. Producer: 0 tile start, 1 stage (SPLIT: K buffer) free, 2 copies issued. The slot past
#: the tiles holds each partition's start and end (clock, global timer ns).
TRACE_EVENTS = gl.constexpr(10)
TRACE_TILES = gl.constexpr(2048)
TRACE_PARTS = gl.constexpr(4)


@gluon.jit
def _stamp(tr, slot, k: gl.constexpr, TRACE: gl.constexpr, GLOBAL: gl.constexpr = False):
    """Diagnostic (``TRACE``): `clock_stamp` into this partition's trace."""
    clock_stamp(tr, slot, k, TRACE, TRACE_TILES, TRACE_EVENTS, GLOBAL)


@gluon.jit
def _trace_part(trace_ptr, PART: gl.constexpr):
    """This program's partition ``PART``'s trace: (buffer, first element)."""
    pid = gl.program_id(0).to(gl.int64)
    return trace_ptr, (pid * TRACE_PARTS + PART) * ((TRACE_TILES + 1) * TRACE_EVENTS)


@dataclasses.dataclass(frozen=True)
class WorkListLayout:
    """Where `_work_list_kernel` writes in its int32 buffer of ``size`` words: the two lists'
    entry counts at 0 and 1, the prefill list from 2, the decode list from ``b_off``, and the
    item counter at ``counter`` (`_claim_item`). The launcher sizes the buffer from it and passes
    ``b_off`` and ``counter`` to both kernels."""

    b_off: int
    counter: int
    size: int


def work_list_layout(num_seqs: int, num_q_tiles: int) -> WorkListLayout:
    """The work list's layout for ``num_seqs`` sequences of at most ``num_q_tiles`` q tiles
    each (each list has room for every entry)."""
    entries = num_seqs * num_q_tiles
    return WorkListLayout(b_off=2 + entries, counter=2 + 2 * entries, size=3 + 2 * entries)


@triton.jit
def _work_list_kernel(
    qsl_ptr,  # [num_seqs + 1]
    work_ptr,  # int32 [`WorkListLayout.size`]: counts, the two lists, the counter
    b_off,  # where the decode list starts (`WorkListLayout`)
    counter,  # where the item counter is (`WorkListLayout`)
    num_seqs,
    q_len_lo,  # sequences with q_len > q_len_lo: the prefill list; the others: the decode list
    num_q_tiles,
    BLOCK_Q: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """One program per sequence: its entries (``seq * num_q_tiles + q_tile``), heaviest q tile
    first, after those of the sequences before it in the same list (their count summed here,
    ``BLOCK_S`` at a time). The prefill list starts at ``work[2]``, the decode list at
    ``work[b_off]``; the last program writes their entry counts to ``work[0]`` and ``work[1]``
    and zeroes the item counter ``work[counter]``. Sequences with ``q_len == 0`` are in
    neither."""
    seq = tl.program_id(0)
    base_a = 0
    base_b = 0
    for s0 in range(0, seq, BLOCK_S):
        idx = s0 + tl.arange(0, BLOCK_S)
        m = idx < seq
        lo = tl.load(qsl_ptr + idx, mask=m, other=0)
        hi = tl.load(qsl_ptr + idx + 1, mask=m, other=0)
        q_len = hi - lo
        tiles = tl.minimum(tl.cdiv(q_len, BLOCK_Q), num_q_tiles)
        base_a += tl.sum(tl.where(m & (q_len > q_len_lo), tiles, 0), axis=0)
        second = m & (q_len > 0) & (q_len <= q_len_lo)
        base_b += tl.sum(tl.where(second, tiles, 0), axis=0)
    q_len = tl.load(qsl_ptr + seq + 1) - tl.load(qsl_ptr + seq)
    in_a = q_len > q_len_lo
    # at most num_q_tiles per sequence (max_query_len's): a caller whose q_len exceeds the
    # maximum it gave loses that work, as with the portable kernel, and the list its bounds
    n = tl.where(q_len > 0, tl.minimum(tl.cdiv(q_len, BLOCK_Q), num_q_tiles), 0)
    start = tl.where(in_a, 2 + base_a, b_off + base_b)
    for t0 in range(0, n, BLOCK_S):
        t = t0 + tl.arange(0, BLOCK_S)
        entry = seq * num_q_tiles + (n - 1 - t)
        tl.store(work_ptr + start + t, entry.to(tl.int32), mask=t < n)
    if seq == num_seqs - 1:
        tl.store(work_ptr, (base_a + tl.where(in_a, n, 0)).to(tl.int32))
        tl.store(work_ptr + 1, (base_b + tl.where(in_a, 0, n)).to(tl.int32))
        tl.store(work_ptr + counter, 0)


def item_order(n_a: int, n_b: int) -> list[tuple[bool, int]]:
    """The launch's items in the order the programs claim them (`_item_counts` and `_item_at`
    compute the same on the device): ``(False, j)`` item ``j`` of the prefill list, ``(True, j)``
    of the decode list, the decode items spread evenly among the prefill items so that at any
    moment only some programs run a (memory-bound) decode item."""
    n = n_a + n_b
    items = []
    for step in range(n):
        k = step * n_b // n
        second = (step + 1) * n_b // n > k
        items.append((second, k if second else step - k))
    return items


@gluon.jit
def _item_counts(work_ptr, SLOTS: gl.constexpr):
    """The launch's decode items and all its items (`item_order`): each list entry is ``SLOTS``
    items (KV heads x head tiles)."""
    n_a = gl.load(work_ptr) * SLOTS
    n_b = gl.load(work_ptr + 1) * SLOTS
    n_a = gl.maximum(n_a, 0)
    n_b = gl.maximum(n_b, 0)
    return n_b, n_a + n_b


@gluon.jit
def _item_at(lists, step, SLOTS: gl.constexpr):
    """Item ``step`` of the launch's order (`item_order`; ``n_b``, ``n`` from `_item_counts`,
    the decode list at ``work[b_off]``): its sequence, head slot, q tile, query start and
    length, and sequence length."""
    work_ptr, n_b, n, b_off, num_q_tiles, qsl_ptr, seq_lens_ptr = lists
    # the launch's steps x decode items can pass 2^31
    k = ((step.to(gl.int64) * n_b) // n).to(gl.int32)
    second = ((step.to(gl.int64) + 1) * n_b) // n > k
    j = gl.where(second, k, step - k)
    e = gl.load(work_ptr + gl.where(second, b_off, 2) + j // SLOTS)
    slot = j % SLOTS
    seq = e // num_q_tiles
    q_tile = e % num_q_tiles
    q_start = gl.load(qsl_ptr + seq)
    q_len = gl.load(qsl_ptr + seq + 1) - q_start
    seq_len = gl.load(seq_lens_ptr + seq)
    return seq, slot, q_tile, q_start, q_len, seq_len


@gluon.jit
def _item_span(q_tile, q_len, seq_len, BLOCK_Q: gl.constexpr, BLOCK_N: gl.constexpr):
    """An item's context length before its queries, the end of its KV range, where its masked
    tiles start, and its tiles."""
    ctx_len = seq_len - q_len
    kv_end = gl.minimum(seq_len, ctx_len + (q_tile + 1) * BLOCK_Q)
    full_end = (ctx_len + q_tile * BLOCK_Q + 1) // BLOCK_N * BLOCK_N
    # at least one tile: a sequence with seq_len < q_len (outside the op's contract; unchecked in
    # a CUDA graph) would give none, and items without tiles would let the producer run more than
    # the ring ahead of the warpgroups (`ITEM_RING_EXTRA`); its rows come out NaN
    n_tiles = gl.maximum(gl.cdiv(kv_end, BLOCK_N), 1)
    return ctx_len, kv_end, full_end, n_tiles


#: Ring slots past the stages (`_claim_item`): the producer writes item s's slot after the waits
#: for the stage (SPLIT: its K and V buffers) of item s-1's last tile, which every warpgroup
#: releases only once all its warps have read item s-1-STAGES (`_receive_item`'s barrier; every
#: item has a tile, `_item_at`).
ITEM_RING_EXTRA = gl.constexpr(SM90_PREFILL_RING_EXTRA)


#: Words of a ring slot (`_claim_item`): the step, then the item's head slot, q tile, query start
#: and length, and sequence length (the rest unused).
RING_WORDS = gl.constexpr(SM90_PREFILL_RING_WORDS)


@gluon.jit
def _claim_item(ctr_ptr, lists, ring, ring_bars, step, SLOTS: gl.constexpr):
    """The producer's next item: the launch's next unclaimed step (one atomic increment) and,
    below the launch's ``n`` steps, its `_item_at`; both handed to the consumer warpgroups
    through slot ``step % R`` of ``ring`` (`_receive_item`), so that they start the item
    without global reads. A step past the last tells them to stop."""
    R: gl.constexpr = ring.shape[0]
    n = lists[2]
    g = gl.atomic_add(ctr_ptr, 1)
    seq = g * 0
    slot = seq
    q_tile = seq
    q_start = seq
    q_len = seq
    seq_len = seq
    if g < n:
        seq, slot, q_tile, q_start, q_len, seq_len = _item_at(lists, g, SLOTS)
    L: gl.constexpr = gl.BlockedLayout([RING_WORDS], [32], [gl.num_warps()], [0])
    i = gl.arange(0, RING_WORDS, layout=L)
    words = gl.where(i == 0, g, 0) + gl.where(i == 1, slot, 0) + gl.where(i == 2, q_tile, 0)
    words += gl.where(i == 3, q_start, 0) + gl.where(i == 4, q_len, 0)
    words += gl.where(i == 5, seq_len, 0)
    ring.index(step % R).store(words)
    gl.thread_barrier()  # every lane's store before the arrival (as before a stage release)
    mbarrier.arrive(ring_bars.index(step % R), count=1)
    return g, seq, slot, q_tile, q_start, q_len, seq_len


@gluon.jit
def _ring_word(words, i, k: gl.constexpr):
    """Word ``k`` of a ring slot read by `_receive_item` (every word in each thread)."""
    return gl.sum(gl.where(i == k, words, 0), axis=0)


@gluon.jit
def _receive_item(ring, ring_bars, step):
    """A consumer warpgroup's ``step``-th item, as the producer's `_claim_item` put it in slot
    ``step % R``: the step, head slot, q tile, query start and length, and sequence length."""
    R: gl.constexpr = ring.shape[0]
    mbarrier.wait(ring_bars.index(step % R), (step // R) & 1)
    L: gl.constexpr = gl.BlockedLayout([RING_WORDS], [32], [gl.num_warps()], [0])
    i = gl.arange(0, RING_WORDS, layout=L)
    words = ring.index(step % R).load(L)
    # every warp has read the slot before any of them releases a stage (a release is one
    # thread's arrival; the path that passes tiles on has no barrier before it)
    gl.thread_barrier()
    return (
        _ring_word(words, i, 0),
        _ring_word(words, i, 1),
        _ring_word(words, i, 2),
        _ring_word(words, i, 3),
        _ring_word(words, i, 4),
        _ring_word(words, i, 5),
    )


@gluon.jit
def _producer(rt, SLOTS: gl.constexpr, HEAD_TILES: gl.constexpr, BLOCK_Q: gl.constexpr,
              STAGES: gl.constexpr, BOX: gl.constexpr, V_PAGES: gl.constexpr,
              GROUP: gl.constexpr, HEAD_TILE: gl.constexpr, Q_TMA: gl.constexpr,
              PAGING: gl.constexpr, TRACE: gl.constexpr, SPLIT: gl.constexpr):  # fmt: skip
    """The load warp: every item's K and V tiles by TMA boxes of ``BOX`` rows of one page, once
    every warpgroup released the stage (box by box: K, V, K, V, ...); SPLIT: a tile's K boxes
    once they released the stage's K buffer, then its V boxes once they released its V buffer. K:
    a 2-D box of [BOX, HEAD_D] (one copy a 64-column group under the 128-byte swizzle). V: see
    `_copy_v`. Q_TMA: after the copies of an item's tile ``STAGES - 1`` (or its last), each
    warpgroup's query rows (`_load_query`)."""
    (work_ptr, b_off, num_q_tiles, qsl_ptr, seq_lens_ptr, block_table_ptr, stride_bt_seq,
     stride_bt_blk, block_size, rows_per_page, total_rows, stride_kcol, stride_vcol, k_desc, v_desc,
     k_smem, v_smem, k_bars, v_bars, k_free, v_free, ctr_ptr, ring, ring_bars, q_desc, q_smem,
     q_full, q_free, trace_ptr) = rt  # fmt: skip
    tr = _trace_part(trace_ptr, TRACE_PARTS - 1)
    _stamp(tr, TRACE_TILES + 0 * b_off, 0, TRACE)
    _stamp(tr, TRACE_TILES + 0 * b_off, 1, TRACE, True)
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEAD_D: gl.constexpr = k_smem.shape[2]
    NB: gl.constexpr = BLOCK_N // BOX
    TILE_BYTES: gl.constexpr = BLOCK_N * HEAD_D * k_smem.dtype.primitive_bitwidth // 8
    # every box's row in each thread's registers: picking box b's below is a register move (one
    # box per lane made each pick a three-step shuffle reduction)
    boxes = gl.arange(0, NB, layout=gl.BlockedLayout([NB], [32], [gl.num_warps()], [0]))
    n_b, n = _item_counts(work_ptr, SLOTS)
    lists = (work_ptr, n_b, n, b_off, num_q_tiles, qsl_ptr, seq_lens_ptr)
    it = 0
    nq = 0  # items whose query rows were loaded (Q_TMA)
    step = 0
    cur, seq, slot, q_tile, q_start, q_len, seq_len = _claim_item(
        ctr_ptr, lists, ring, ring_bars, step, SLOTS
    )
    while cur < n:
        n_tiles = _item_span(q_tile, q_len, seq_len, BLOCK_Q, BLOCK_N)[3]
        kv_head = slot // HEAD_TILES
        bt_row = block_table_ptr + seq.to(gl.int64) * stride_bt_seq
        kcol = kv_head * stride_kcol
        vcol = kv_head * stride_vcol
        for t in range(n_tiles):
            s = it % STAGES
            jt = trace_slot(it, TRACE, TRACE_TILES)
            _stamp(tr, jt, 0, TRACE)
            # the tile's block-table reads (one per box, for K and V) before the wait for its
            # stage: their latency runs under the wait instead of after it
            rows = _tile_rows(bt_row, t, boxes, BOX, BLOCK_N, seq_len, block_size,
                              stride_bt_blk, rows_per_page, total_rows, PAGING)  # fmt: skip
            # the stage's previous tile (SPLIT: its K buffer, later its V buffer) released by
            # every warpgroup (none before the first use)
            free_ph = ((it // STAGES) & 1) ^ 1
            mbarrier.wait(k_free.index(s), free_ph, pred=it >= STAGES)
            _stamp(tr, jt, 1, TRACE)
            k_buf = k_smem.index(s)
            v_buf = v_smem.index(s)
            mbarrier.expect(k_bars.index(s), TILE_BYTES)
            if not SPLIT:
                mbarrier.expect(v_bars.index(s), TILE_BYTES)
            for b in gl.static_range(NB):  # K boxes (without SPLIT each with its V box)
                row = _box_row(rows, boxes, b)
                _copy_k(k_desc, k_buf, k_bars.index(s), row, kcol, b, BOX)
                if not SPLIT:
                    _copy_v(v_desc, v_buf, v_bars.index(s), row, vcol, b, BOX, V_PAGES)
            if SPLIT:  # then the V boxes, once the V buffer is free
                mbarrier.wait(v_free.index(s), free_ph, pred=it >= STAGES)
                mbarrier.expect(v_bars.index(s), TILE_BYTES)
                for b in gl.static_range(NB):
                    row = _box_row(rows, boxes, b)
                    _copy_v(v_desc, v_buf, v_bars.index(s), row, vcol, b, BOX, V_PAGES)
            nq = _query_step(q_desc, q_smem, q_full, q_free, nq, t, n_tiles, q_start, q_tile,
                             kv_head, slot, STAGES - 1, BLOCK_Q, GROUP, HEAD_TILES, HEAD_TILE,
                             Q_TMA)  # fmt: skip
            _stamp(tr, jt, 2, TRACE)
            it += 1
        step += 1
        cur, seq, slot, q_tile, q_start, q_len, seq_len = _claim_item(
            ctr_ptr, lists, ring, ring_bars, step, SLOTS
        )
    _stamp(tr, TRACE_TILES + 0 * b_off, 2, TRACE)
    _stamp(tr, TRACE_TILES + 0 * b_off, 3, TRACE, True)


@gluon.jit
def _query_step(q_desc, q_smem, q_full, q_free, nq, t, n_tiles, q_start, q_tile, kv_head, slot,
                Q_AT: gl.constexpr, BLOCK_Q: gl.constexpr, GROUP: gl.constexpr,
                HEAD_TILES: gl.constexpr, HEAD_TILE: gl.constexpr,
                Q_TMA: gl.constexpr):  # fmt: skip
    """Q_TMA: the producer's copy of an item's query rows (`_load_query`) after the copies of its
    tile ``Q_AT`` (or its last); returns the items whose query was loaded. ``Q_AT``, ``STAGES - 1``,
    is the first tile whose stage the previous item releases once the warpgroups may have freed
    their query buffers (that item's last tile's stage, its V buffer freed after the last P V).
    Waiting at the item's first tile held the copies back to within a tile of the warpgroups at
    every item boundary."""
    if Q_TMA:  # noqa: SIM102 (a constexpr branch around a runtime one)
        if t == gl.minimum(Q_AT, n_tiles - 1):
            _load_query(q_desc, q_smem, q_full, q_free, nq, q_start + q_tile * BLOCK_Q,
                        kv_head * GROUP + (slot % HEAD_TILES) * HEAD_TILE)  # fmt: skip
            nq += 1
    return nq


@gluon.jit
def _tile_rows(bt_row, t, boxes, BOX: gl.constexpr, BLOCK_N: gl.constexpr, seq_len, block_size,
               stride_bt_blk, rows_per_page, total_rows, PAGING: gl.constexpr):  # fmt: skip
    """The cache row of each box of an item's tile ``t`` (one block-table read a box; a box
    past the sequence gets ``total_rows``, a row past the tensor, which TMA fills with zeros).
    Each box's page and its row in it by ``PAGING`` (`PrefillConfig.paging`): 1, a box a page
    (block ``t x boxes + b``, row 0); 2, pages of a tile or more (the tile's first page by one
    division, then at most one page edge inside the tile); 0, a division a box."""
    pos = t * BLOCK_N + boxes * BOX
    real = pos < seq_len
    if PAGING == 1:
        page = t * (BLOCK_N // BOX) + boxes
        off = 0
    elif PAGING == 2:
        first = t * BLOCK_N
        p0 = first // block_size
        r = first - p0 * block_size + boxes * BOX
        edge = r >= block_size
        page = p0 + edge.to(gl.int32)
        off = gl.where(edge, r - block_size, r)
    else:
        page = pos // block_size
        off = pos % block_size
    blk = gl.load(bt_row + page * stride_bt_blk, mask=real, other=0)
    return gl.where(real, blk.to(gl.int32) * rows_per_page + off, total_rows)


@gluon.jit
def _box_row(rows, boxes, b: gl.constexpr):
    """Box ``b``'s cache row out of a tile's `_tile_rows` (every box's row is in each thread's
    registers: a register move)."""
    return gl.sum(gl.where(boxes == b, rows, 0), axis=0)


@gluon.jit
def _copy_k(k_desc, k_buf, bar, row, kcol, b: gl.constexpr, BOX: gl.constexpr):
    """Box ``b`` of a K tile (``BOX`` rows from cache row ``row``, KV head columns from
    ``kcol``) into ``k_buf`` on barrier ``bar``: a 2-D box, one copy a 64-column group."""
    tma.async_copy_global_to_shared(k_desc, [row, kcol], bar, k_buf.slice(b * BOX, BOX))


@gluon.jit
def _copy_v(v_desc, v_buf, bar, row, vcol, b: gl.constexpr, BOX: gl.constexpr,
            V_PAGES: gl.constexpr):  # fmt: skip
    """Box ``b`` of a V tile (``BOX`` rows from cache row ``row``, KV head columns from
    ``vcol``) into ``v_buf`` on barrier ``bar``. V_PAGES (> 1): one copy, through the 3-D view
    ``[column groups, rows, 64]`` of ``v_desc``, into the box's own [BOX, HEAD_D] tile
    (`_v_page`); else a 2-D box like K's."""
    HEAD_D: gl.constexpr = v_buf.shape[1]
    if V_PAGES > 1:
        L3: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                rank=3)  # fmt: skip
        page = _v_page(v_buf, b, V_PAGES)._reinterpret(v_buf.dtype, [HEAD_D // 64, BOX, 64], L3)
        tma.async_copy_global_to_shared(v_desc, [vcol // 64, row, 0], bar, page)
    else:
        tma.async_copy_global_to_shared(v_desc, [row, vcol], bar, v_buf.slice(b * BOX, BOX))


@gluon.jit
def _rows_box(buf, box: gl.constexpr):
    """A warpgroup's rows buffer ([64, HEAD_D], NVMMA: its query buffer, or its share of a K
    tile) as the Q_TMA / O_TMA box ``[column groups of 64, tokens, heads, 64]``
    (`_q_descriptor`): the same bytes, row ``token x HEAD_TILE + head`` (`_warpgroup_rows`),
    column halves major."""
    L4: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
    return buf._reinterpret(buf.dtype, box, L4)


@gluon.jit
def _load_query(q_desc, q_smem, q_full, q_free, nq, tok0, head0):
    """Q_TMA, the producer: the ``nq``-th item's query rows, one copy a consumer warpgroup, each
    once the warpgroup has freed its buffer (its last score MMA of the item before returned,
    `_query_freed`). Rows past the tensor's tokens arrive as zeros; rows past the sequence hold
    the next one's tokens (or, for a warpgroup with no real rows, anything): their outputs are
    not written. (A head tile never passes its group: `query_by_tma_fits` needs ``HEAD_TILE``
    to divide 64, and it is then the whole group.)"""
    BOX: gl.constexpr = q_desc.block_shape
    TOK: gl.constexpr = BOX[1]
    WGS: gl.constexpr = q_smem.shape[0]
    for w in gl.static_range(WGS):
        mbarrier.wait(q_free.index(w), (nq & 1) ^ 1, pred=nq > 0)
        mbarrier.expect(q_full.index(w), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [0, tok0 + w * TOK, head0, 0], q_full.index(w),
                                        _rows_box(q_smem.index(w), BOX))  # fmt: skip


@gluon.jit
def _release(bars, s):
    """This warpgroup frees buffer ``s`` (one arrival on its barrier in ``bars``), after the
    warpgroup's barrier: every warp's MMAs reading it have returned."""
    gl.thread_barrier()
    mbarrier.arrive(bars.index(s), count=1)


@gluon.jit
def _query_freed(q_free, WG: gl.constexpr, Q_TMA: gl.constexpr):
    """Q_TMA, a consumer warpgroup: its query buffer is free for the next item (every warp's
    score MMAs of this item have returned, `_release`)."""
    if Q_TMA:
        _release(q_free, WG)


@gluon.jit
def _store_rows(output, WG: gl.constexpr, o, item, GROUP: gl.constexpr, HEAD_TILE: gl.constexpr,
                BLOCK_Q: gl.constexpr, O_VEC: gl.constexpr):  # fmt: skip
    """Warpgroup WG's output rows ``o`` (in the P V layout) that are real (`_warpgroup_rows`),
    element by element (4 bytes a thread where O_VEC); ``output`` is (pointer, token, head and
    dim strides), ``item`` (q tile, head tile, KV head, query start, query length)."""
    out_ptr, stride_o_tok, stride_o_head, stride_o_dim = output
    q_tile, head_tile, kv_head, q_start, q_len = item
    PV: gl.constexpr = o.type.layout
    HEAD_D: gl.constexpr = o.shape[1]
    tok, head, real = _warpgroup_rows(WG, q_tile, head_tile, kv_head, q_start, q_len, GROUP,
                                      HEAD_TILE, BLOCK_Q, gl.SliceLayout(1, PV))  # fmt: skip
    do = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, PV))
    o_rows = tok * stride_o_tok + head * stride_o_head
    gl.store(row_ptrs(out_ptr, o_rows, do, stride_o_dim, O_VEC, 8), o, mask=real[:, None])


@gluon.jit
def _store_out(o_desc, buf, WG: gl.constexpr, o, tok0, head0):
    """O_TMA, a consumer warpgroup: its 64 output rows ``o`` (tokens from ``tok0``, heads from
    ``head0``, as `_load_query` reads them) through the rows buffer ``buf`` (its query buffer)
    to the output by one TMA copy (`_q_descriptor` on the output); returns once TMA has read the
    buffer, so that it may be overwritten."""
    BOX: gl.constexpr = o_desc.block_shape
    TOK: gl.constexpr = BOX[1]
    buf.store(o)
    fence_async_shared()
    gl.thread_barrier()  # every warp's rows in the buffer before the copy
    tma.async_copy_shared_to_global(o_desc, [0, tok0 + WG * TOK, head0, 0],
                                    _rows_box(buf, BOX))  # fmt: skip
    tma.store_wait(0)
    gl.thread_barrier()  # the copy has read the buffer before any warp writes it again


@gluon.jit
def _warpgroup_rows(WG: gl.constexpr, q_tile, head_tile, kv_head, q_start, q_len,
                    GROUP: gl.constexpr, HEAD_TILE: gl.constexpr, BLOCK_Q: gl.constexpr,
                    layout: gl.constexpr):  # fmt: skip
    """Warpgroup WG's 64 rows in ``layout``: row ``r`` is query token ``r // HEAD_TILE`` of the
    q tile and head ``r % HEAD_TILE`` of the head tile; returns each row's token (int64, in the
    batch), query head and whether it is real (a token of the sequence, a head of the group)."""
    r = WG * 64 + gl.arange(0, 64, layout=layout)
    tok = q_tile * BLOCK_Q + r // HEAD_TILE
    hig = head_tile * HEAD_TILE + r % HEAD_TILE
    real = (r // HEAD_TILE < BLOCK_Q) & (tok < q_len) & (hig < GROUP)
    return (q_start + tok).to(gl.int64), kv_head * GROUP + hig, real


@gluon.jit
def _store_query(q_buf, WG: gl.constexpr, query, item, GROUP: gl.constexpr,
                 HEAD_TILE: gl.constexpr, BLOCK_Q: gl.constexpr, Q_VEC: gl.constexpr,
                 LOAD: gl.constexpr):  # fmt: skip
    """Warpgroup WG's query rows (`_warpgroup_rows`; rows that are not real read as 0) from
    global memory into its buffer ``q_buf``, for the score MMA (16 bytes a thread where Q_VEC);
    ``query`` is (pointer, token, head and dim strides), ``item`` (q tile, head tile, KV head,
    query start, query length)."""
    q_ptr, stride_q_tok, stride_q_head, stride_q_dim = query
    q_tile, head_tile, kv_head, q_start, q_len = item
    HEAD_D: gl.constexpr = q_buf.shape[1]
    tok, head, real = _warpgroup_rows(WG, q_tile, head_tile, kv_head, q_start, q_len, GROUP,
                                      HEAD_TILE, BLOCK_Q, gl.SliceLayout(1, LOAD))  # fmt: skip
    dq = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, LOAD))
    q_rows = tok * stride_q_tok + head * stride_q_head
    q_ptrs = row_ptrs(q_ptr, q_rows, dq, stride_q_dim, Q_VEC, 8)
    q_buf.store(gl.load(q_ptrs, mask=real[:, None], other=0.0))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _scores(qk, start, full_end, limit, cols):
    """The raw scores of the tile at ``start``; past ``full_end`` each row's limit (its causal
    limit clamped to the item's ``kv_end``: one compare an element) masks them to -inf."""
    sc = qk
    if start + cols.shape[0] > full_end:
        pos = start + cols
        keep = pos[None, :] < limit[:, None]
        sc = gl.where(keep, sc, float("-inf"))
    return sc


@gluon.jit
def _first_scores(q_buf, k_smem, k_bars, k_free, it, turn_bars, WG: gl.constexpr, tk, turns, nxt,
                  QK: gl.constexpr, SPLIT: gl.constexpr):  # fmt: skip
    """An item's first tile's scores (K tile ``it``), in a turn of their own (SPLIT: then its K
    buffer released); returns them and the turns taken."""
    STAGES: gl.constexpr = k_smem.shape[0]
    ROWS: gl.constexpr = q_buf.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    s = it % STAGES
    mbarrier.wait(k_bars.index(s), (it // STAGES) & 1)
    tk = _turn_wait(turn_bars, WG, tk, turns)
    qk = warpgroup_mma(q_buf, k_smem.index(s).permute((1, 0)),
                       gl.zeros([ROWS, BLOCK_N], gl.float32, layout=QK),
                       use_acc=False, is_async=True)  # fmt: skip
    _turn_pass(turn_bars, nxt, turns)
    qk = warpgroup_mma_wait(num_outstanding=0, deps=[qk])
    if SPLIT:
        _release(k_free, s)
    return qk, tk


@gluon.jit
def _quad_sums(x):
    """``x`` ([rows, BLOCK_N], the score MMA's layout) summed to 4 columns, one a lane of each
    row's quad: halvings of columns ``c`` and ``c + n/2`` down to 8, then the adjacent pair. In
    that layout a thread holds column bit 0 and every bit from 8 up, so each step is one add a
    pair in registers, with no shuffle."""
    ROWS: gl.constexpr = x.shape[0]
    y = x
    for _ in gl.static_range(gl.constexpr(_halvings(x.shape[1]))):
        y = gl.sum(gl.reshape(y, [ROWS, 2, y.shape[1] // 2]), axis=1)
    return gl.sum(gl.reshape(y, [ROWS, y.shape[1] // 2, 2]), axis=2)


@gluon.constexpr_function
def _halvings(n):
    """Halvings `_quad_sums` takes of ``n`` columns: down to the 8 of a row's quad."""
    return max(0, int(n).bit_length() - 4)


@gluon.jit
def _softmax(sc, m_i, l_i, acc, scale_log2, dtype: gl.constexpr, PA: gl.constexpr,
             QUAD_SUMS: gl.constexpr, LAZY_MAX: gl.constexpr):  # fmt: skip
    """One tile's online-softmax step on its masked raw scores ``sc``: the new row maxima
    (scaled, base 2; LAZY_MAX: a row's moves only where its tile's passes it by more than
    ``LAZY_T``, so ``P <= 2^LAZY_T`` and a thread whose factors are all 1 skips the rescale,
    `lazy_rescale`), ``P = 2^(sc scale_log2 - m)``, the new row sums, the accumulator rescaled
    to the new maxima, and P as the P V MMA's register operand. QUAD_SUMS: the row sums ``l_i``
    are kept as a partial sum a lane of the row's quad (`_quad_sums`), and the shuffles that
    finish them run once, in the epilogue. The scale goes inside the exponent, one FFMA an
    element: the maximum is taken of the raw scores and scaled once a row (``scale_log2 > 0``:
    the launcher checks the scale)."""
    rm = gl.max(sc, 1) * scale_log2
    m_new = gl.where(rm > m_i + LAZY_T, rm, m_i) if LAZY_MAX else gl.maximum(m_i, rm)
    p = gl.exp2(sc * scale_log2 - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    if QUAD_SUMS:
        quad_alpha = gl.convert_layout(alpha, gl.SliceLayout(1, l_i.type.layout))
        l_i = l_i * quad_alpha[:, None] + _quad_sums(p)
    else:
        l_i = l_i * alpha + gl.sum(p, 1)
    acc = lazy_rescale(acc, gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), LAZY_MAX)
    return m_new, l_i, acc, gl.convert_layout(p.to(dtype), PA)


@gluon.jit
def _zero_tail(v_buf, start, seq_len, LOAD: gl.constexpr, NB: gl.constexpr = 1):
    """Rows of the V tile at ``start`` past the sequence (its last page's tail: any values,
    NaN included) set to 0 before P V (their P is 0, but 0 x NaN is NaN); NB > 1: the tile is
    held as NB page boxes (V_PAGES, `_v_page`), zeroed box by box."""
    BLOCK_N: gl.constexpr = v_buf.shape[0]
    BOX: gl.constexpr = BLOCK_N // NB
    if start + BLOCK_N > seq_len:
        for b in gl.static_range(NB):
            part = v_buf if NB == 1 else _v_page(v_buf, b, NB)
            vr = start + b * BOX + gl.arange(0, BOX, layout=gl.SliceLayout(1, LOAD))
            x = part.load(LOAD)
            part.store(gl.where((vr < seq_len)[:, None], x, gl.zeros_like(x)))
        fence_async_shared()
        gl.thread_barrier()


@gluon.jit
def _v_page(v_buf, b, NB: gl.constexpr):
    """V_PAGES: page box ``b`` of a stage's V tile ([BLOCK_N, HEAD_D], NVMMA) as its own
    [BLOCK_N // NB, HEAD_D] NVMMA tile (the same bytes: the box's rows, column halves major)."""
    BLOCK_N: gl.constexpr = v_buf.shape[0]
    HEAD_D: gl.constexpr = v_buf.shape[1]
    # (a buffer's layout has the rank of its tiles: a leading dimension indexes them)
    L2: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    return v_buf._reinterpret(v_buf.dtype, [NB, BLOCK_N // NB, HEAD_D], L2).index(b)


@gluon.constexpr_function
def _pages_layout(block_n, head_d, nb):
    """V_PAGES: a stage's V tile ([block_n, head_d], 16-bit) as its page boxes lay it down
    (`_v_page`: box after box, each box its 64-column groups one after another under the
    128-byte swizzle), as one shared layout. The P V MMA reads the whole tile through it: every
    16-row k-step lies in one box, and Triton derives each step's descriptor (the column groups
    ``box x 128`` bytes apart) from the layout."""
    box = block_n // nb
    whole = box * nb == block_n and box >= 16 and head_d % 64 == 0
    if not whole or any(n < 1 or n & (n - 1) for n in (nb, box, head_d // 64)):
        raise ValueError(
            f"_pages_layout: the boxes, a box's rows (at least a k-step's 16) and the 64-column "
            f"groups must each be a whole power of two; got block_n {block_n}, head_d "
            f"{head_d}, nb {nb}"
        )
    bases = [[0, 1 << i] for i in range(6)]  # a row's 64 columns
    bases += [[1 << i, 8 << i] for i in range(3)]  # rows 0-7: the swizzle's XOR on 16-byte pieces
    bases += [[8 << i, 0] for i in range((box // 8).bit_length() - 1)]  # the box's row groups
    bases += [[0, 64 << i] for i in range((head_d // 64).bit_length() - 1)]  # column groups
    bases += [[box << i, 0] for i in range(nb.bit_length() - 1)]  # the boxes
    return gl.SharedLinearLayout(offset_bases=bases, alignment=1024)


@gluon.jit
def _pv_pages(p_op, v_buf, acc, NB: gl.constexpr):
    """V_PAGES: O += P V over a V tile held as NB page boxes, one async MMA (one fence and one
    commit group: an MMA a box made each of its 8 k-steps a group of its own at block 16)."""
    BLOCK_N: gl.constexpr = v_buf.shape[0]
    HEAD_D: gl.constexpr = v_buf.shape[1]
    VL: gl.constexpr = _pages_layout(BLOCK_N, HEAD_D, NB)
    return warpgroup_mma(p_op, v_buf._reinterpret(v_buf.dtype, [BLOCK_N, HEAD_D], VL), acc,
                         is_async=True)  # fmt: skip


@gluon.jit
def _release_prev(v_free, it, t, STAGES: gl.constexpr):
    """LATE_RELEASE: this warpgroup releases the V buffer (the stage, without SPLIT) of its tile
    before tile ``t`` of the item (global tile count ``it``; nothing when ``t == 0``), once every
    warp's P V of that tile has returned (`_release`)."""
    if t > 0:
        _release(v_free, (it - 1) % STAGES)


@gluon.jit
def _turn_wait(turn_bars, WG: gl.constexpr, tk, on):
    """Where ``on`` (the item takes turns): wait for this warpgroup's turn to issue MMAs;
    returns the turns taken."""
    mbarrier.wait(turn_bars.index(WG), tk & 1, pred=on)
    tk += on.to(gl.int32)
    return tk


@gluon.jit
def _turn_pass(turn_bars, nxt, on):
    """Where ``on``: MMAs issued; warpgroup ``nxt``'s turn."""
    mbarrier.arrive(turn_bars.index(nxt), count=1, pred=on)


@gluon.jit
def _has_rows(W: gl.constexpr, q_tile, head_tile, q_len, GROUP: gl.constexpr,
              HEAD_TILE: gl.constexpr, BLOCK_Q: gl.constexpr):  # fmt: skip
    """Whether warpgroup W has real rows in the item: its first row is a token of the sequence
    and a head of the group (`_warpgroup_rows`; the real rows are a prefix of the item's)."""
    r0: gl.constexpr = W * 64
    real = (r0 // HEAD_TILE < BLOCK_Q) & (q_tile * BLOCK_Q + r0 // HEAD_TILE < q_len)
    return real & (head_tile * HEAD_TILE + r0 % HEAD_TILE < GROUP)


@gluon.jit
def _consumer(WG: gl.constexpr, rt, SLOTS: gl.constexpr, HEAD_TILES: gl.constexpr,
              GROUP: gl.constexpr, HEAD_TILE: gl.constexpr, BLOCK_Q: gl.constexpr,
              STAGES: gl.constexpr, PINGPONG: gl.constexpr, Q_VEC: gl.constexpr,
              O_VEC: gl.constexpr, LATE_RELEASE: gl.constexpr, V_PAGES: gl.constexpr,
              Q_TMA: gl.constexpr, O_TMA: gl.constexpr, TRACE: gl.constexpr,
              QUAD_SUMS: gl.constexpr, LAZY_MAX: gl.constexpr, SPLIT: gl.constexpr):  # fmt: skip
    """Warpgroup WG: rows ``[64 WG, 64 WG + 64)`` of every item of the launch. PINGPONG: the
    warpgroups with real rows issue their MMAs in turns, round robin (module doc).
    A tile's stage is released once its P V returns (``v_free``; without SPLIT ``k_free`` is the
    same barrier); SPLIT: its K buffer apart, once its scores return (``k_free``).
    LATE_RELEASE (the sequential loop): tile t's V buffer is released just before tile t+1's
    P V, an item's last tile's at the item's end.
    V_PAGES (> 1): V tiles arrive as that many page boxes of one copy each (`_v_page`), and P V
    reads them through one layout (`_pv_pages`). Q_VEC / O_VEC: the query's / output's rows are
    aligned (`rows_aligned`): read 16 bytes a thread, written 4; else element by element. Q_TMA:
    the producer loads the query rows (`_load_query`); the warpgroup waits for them at the
    item's start and frees its buffer once the item's last score MMA has returned
    (`_query_freed`)."""
    (work_ptr, b_off, num_q_tiles, qsl_ptr, seq_lens_ptr, q_ptr, out_ptr, stride_q_tok,
     stride_q_head, stride_q_dim, stride_o_tok, stride_o_head, stride_o_dim, scale_log2, k_smem,
     v_smem, k_bars, v_bars, k_free, v_free, q_smem, turn_bars, ring, ring_bars, q_full, q_free,
     o_desc, trace_ptr) = rt  # fmt: skip
    # (the sequential loop frees no query buffer)
    gl.static_assert(not Q_TMA or PINGPONG, "Q_TMA: only with ping-pong turns")
    tr = _trace_part(trace_ptr, WG)
    _stamp(tr, TRACE_TILES + 0 * b_off, 0, TRACE)
    _stamp(tr, TRACE_TILES + 0 * b_off, 1, TRACE, True)
    dtype: gl.constexpr = k_smem.dtype
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEAD_D: gl.constexpr = k_smem.shape[2]
    ROWS: gl.constexpr = 64
    QK: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    PV: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_D, 16]
    )
    PA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=PV, k_width=2)
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HEAD_D // 8), HEAD_D // 8], [4, 1],
                                          [1, 0])  # fmt: skip
    ROW: gl.constexpr = gl.SliceLayout(1, QK)
    COL: gl.constexpr = gl.SliceLayout(0, QK)
    PV_ROW: gl.constexpr = gl.SliceLayout(1, PV)
    q_buf = q_smem.index(WG)
    WGS: gl.constexpr = q_smem.shape[0]
    n_b, n = _item_counts(work_ptr, SLOTS)
    it = 0
    tk = 0  # turns taken (PINGPONG)
    nq = 0  # items whose query rows the producer loaded (Q_TMA)
    step = 0
    cur, slot, q_tile, q_start, q_len, seq_len = _receive_item(ring, ring_bars, step)
    while cur < n:
        ctx_len, kv_end, full_end, n_tiles = _item_span(q_tile, q_len, seq_len, BLOCK_Q, BLOCK_N)
        kv_head = slot // HEAD_TILES
        head_tile = slot % HEAD_TILES
        # a warpgroup none of whose rows is real (a decode item's later warpgroups, or a short
        # last q tile) only passes the item's tiles on: waits for each, releases it (in order,
        # so its release lands in the stage's current phase), and takes no ping-pong turns
        if WG == 0:
            idle = False
        else:
            idle = ~_has_rows(WG, q_tile, head_tile, q_len, GROUP, HEAD_TILE, BLOCK_Q)
        # PINGPONG: an item takes turns only where warpgroup 1 has real rows (every warpgroup
        # computes the same: a prefix of the rows is real); else warpgroup 0 runs it alone.
        # The turn passes to the next warpgroup with real rows, from the last back to 0
        turns = _has_rows(1, q_tile, head_tile, q_len, GROUP, HEAD_TILE, BLOCK_Q)
        # (from warpgroup 0 the turn goes to 1 whenever there are turns)
        if WG == 0 or WG + 1 == WGS:
            nxt = (WG + 1) % WGS
        else:
            has_next = _has_rows(WG + 1, q_tile, head_tile, q_len, GROUP, HEAD_TILE, BLOCK_Q)
            nxt = has_next.to(gl.int32) * (WG + 1)
        if idle:
            if Q_TMA:  # (the producer loads every warpgroup's rows: pass the buffer on)
                mbarrier.wait(q_full.index(WG), nq & 1)
            _query_freed(q_free, WG, Q_TMA)
            for _t in range(n_tiles):
                s = it % STAGES
                ph = (it // STAGES) & 1
                jt = trace_slot(it, TRACE, TRACE_TILES)
                _stamp(tr, jt, 0, TRACE)
                mbarrier.wait(k_bars.index(s), ph)
                if SPLIT:
                    mbarrier.arrive(k_free.index(s), count=1)
                _stamp(tr, jt, 1, TRACE)
                mbarrier.wait(v_bars.index(s), ph)
                _stamp(tr, jt, 4, TRACE)
                mbarrier.arrive(v_free.index(s), count=1)
                _stamp(tr, jt, 6, TRACE)
                it += 1
        else:
            _stamp(tr, trace_slot(it, TRACE, TRACE_TILES), 7, TRACE)
            # -- this warpgroup's query rows into shared memory (the score MMA's A operand) --
            if Q_TMA:
                mbarrier.wait(q_full.index(WG), nq & 1)
            else:
                _store_query(q_buf, WG, (q_ptr, stride_q_tok, stride_q_head, stride_q_dim),
                             (q_tile, head_tile, kv_head, q_start, q_len), GROUP, HEAD_TILE,
                             BLOCK_Q, Q_VEC, LOAD)  # fmt: skip
            # each row sees the positions < its limit (>= 1: no row is ever fully masked),
            # clamped to kv_end (a real row's limit is at most kv_end: the same keys)
            rs = WG * ROWS + gl.arange(0, ROWS, layout=ROW)
            limit = gl.minimum(ctx_len + q_tile * BLOCK_Q + rs // HEAD_TILE + 1, kv_end)
            cols = gl.arange(0, BLOCK_N, layout=COL)
            m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=ROW)
            if QUAD_SUMS:  # each row's sum as its quad's 4 partial sums (`_quad_sums`)
                l_i = _quad_sums(gl.zeros([ROWS, BLOCK_N], gl.float32, layout=QK))
            else:
                l_i = gl.zeros([ROWS], gl.float32, layout=ROW)
            acc = gl.zeros([ROWS, HEAD_D], gl.float32, layout=PV)
            if PINGPONG:
                # one turn issues P V of tile t and the scores of tile t+1 (the item's first
                # scores, and the last tile's P V, take a turn of their own), then passes, so
                # that the other warpgroups' MMAs run under this one's softmax. Both are waited
                # after the pass (P V first: issued first). Trace steps: 1 = 0 (K is waited
                # before the turn), 2 the softmax's start, 5 the turn, the issues and the P V
                # wait, 6 the scores' wait and the releases
                qk, tk = _first_scores(q_buf, k_smem, k_bars, k_free, it, turn_bars, WG, tk,
                                       turns, nxt, QK, SPLIT)  # fmt: skip
                for t in range(n_tiles - 1):
                    s = it % STAGES
                    jt = trace_slot(it, TRACE, TRACE_TILES)
                    _stamp(tr, jt, 0, TRACE)
                    _stamp(tr, jt, 1, TRACE)
                    _stamp(tr, jt, 2, TRACE)
                    sc = _scores(qk, t * BLOCK_N, full_end, limit, cols)
                    m_i, l_i, acc, p_op = _softmax(sc, m_i, l_i, acc, scale_log2, dtype, PA,
                                                   QUAD_SUMS, LAZY_MAX)  # fmt: skip
                    _stamp(tr, jt, 3, TRACE)
                    # tile t is not the item's last: it ends before kv_end <= seq_len, its V
                    # rows are all real
                    mbarrier.wait(v_bars.index(s), (it // STAGES) & 1)
                    s2 = (it + 1) % STAGES
                    mbarrier.wait(k_bars.index(s2), ((it + 1) // STAGES) & 1)
                    _stamp(tr, jt, 4, TRACE)
                    tk = _turn_wait(turn_bars, WG, tk, turns)
                    if V_PAGES > 1:
                        acc = _pv_pages(p_op, v_smem.index(s), acc, V_PAGES)
                    else:
                        acc = warpgroup_mma(p_op, v_smem.index(s), acc, is_async=True)
                    qk = warpgroup_mma(q_buf, k_smem.index(s2).permute((1, 0)),
                                       gl.zeros([ROWS, BLOCK_N], gl.float32, layout=QK),
                                       use_acc=False, is_async=True)  # fmt: skip
                    _turn_pass(turn_bars, nxt, turns)
                    acc, p_op = warpgroup_mma_wait(num_outstanding=1, deps=[acc, p_op])
                    _stamp(tr, jt, 5, TRACE)
                    if SPLIT:
                        qk = warpgroup_mma_wait(num_outstanding=0, deps=[qk])
                        # one barrier for both: tile t's V buffer and tile t+1's K buffer
                        gl.thread_barrier()
                        mbarrier.arrive(v_free.index(s), count=1)
                        mbarrier.arrive(k_free.index(s2), count=1)
                    else:
                        _release(v_free, s)
                        qk = warpgroup_mma_wait(num_outstanding=0, deps=[qk])
                    _stamp(tr, jt, 6, TRACE)
                    it += 1
                # the item's last scores have returned (O_TMA: the query buffer holds the
                # output, freed after the epilogue)
                if not O_TMA:
                    _query_freed(q_free, WG, Q_TMA)
                # the last tile: its softmax, then its P V in a turn of its own
                s = it % STAGES
                start = (n_tiles - 1) * BLOCK_N
                jt = trace_slot(it, TRACE, TRACE_TILES)
                _stamp(tr, jt, 0, TRACE)
                _stamp(tr, jt, 1, TRACE)
                _stamp(tr, jt, 2, TRACE)
                sc = _scores(qk, start, full_end, limit, cols)
                m_i, l_i, acc, p_op = _softmax(sc, m_i, l_i, acc, scale_log2, dtype, PA,
                                               QUAD_SUMS, LAZY_MAX)  # fmt: skip
                _stamp(tr, jt, 3, TRACE)
                v_buf = v_smem.index(s)
                mbarrier.wait(v_bars.index(s), (it // STAGES) & 1)
                _zero_tail(v_buf, start, seq_len, LOAD, V_PAGES)
                _stamp(tr, jt, 4, TRACE)
                tk = _turn_wait(turn_bars, WG, tk, turns)
                if V_PAGES > 1:
                    acc = _pv_pages(p_op, v_buf, acc, V_PAGES)
                else:
                    acc = warpgroup_mma(p_op, v_buf, acc, is_async=True)
                _turn_pass(turn_bars, nxt, turns)
                acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=[acc, p_op])
                _stamp(tr, jt, 5, TRACE)
                _release(v_free, s)
                _stamp(tr, jt, 6, TRACE)
                it += 1
            else:
                for t in range(n_tiles):
                    s = it % STAGES
                    ph = (it // STAGES) & 1
                    start = t * BLOCK_N
                    jt = trace_slot(it, TRACE, TRACE_TILES)
                    _stamp(tr, jt, 0, TRACE)
                    mbarrier.wait(k_bars.index(s), ph)
                    _stamp(tr, jt, 1, TRACE)
                    qk = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=QK)
                    qk = warpgroup_mma(q_buf, k_smem.index(s).permute((1, 0)), qk, use_acc=False,
                                       is_async=True)  # fmt: skip
                    qk = warpgroup_mma_wait(num_outstanding=0, deps=[qk])
                    if SPLIT:
                        _release(k_free, s)
                    _stamp(tr, jt, 2, TRACE)
                    sc = _scores(qk, start, full_end, limit, cols)
                    m_i, l_i, acc, p_op = _softmax(sc, m_i, l_i, acc, scale_log2, dtype, PA,
                                                   QUAD_SUMS, LAZY_MAX)  # fmt: skip
                    _stamp(tr, jt, 3, TRACE)
                    v_buf = v_smem.index(s)
                    mbarrier.wait(v_bars.index(s), ph)
                    _zero_tail(v_buf, start, seq_len, LOAD, V_PAGES)
                    if LATE_RELEASE:
                        _release_prev(v_free, it, t, STAGES)
                    _stamp(tr, jt, 4, TRACE)
                    if V_PAGES > 1:
                        acc = _pv_pages(p_op, v_buf, acc, V_PAGES)
                    else:
                        acc = warpgroup_mma(p_op, v_buf, acc, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
                    _stamp(tr, jt, 5, TRACE)
                    if not LATE_RELEASE:
                        _release(v_free, s)
                    _stamp(tr, jt, 6, TRACE)
                    it += 1
                if LATE_RELEASE:  # the item's last tile
                    _release_prev(v_free, it, n_tiles, STAGES)
            # -- epilogue: this warpgroup's rows to the output. O_TMA: where its 64 rows are all
            # real tokens (every head of the tile is, `out_by_tma_fits`), one TMA copy of whole
            # lines through its query buffer; rows past the sequence are the next one's, so a
            # partial warpgroup's go by `_store_rows` --
            l_row = gl.sum(l_i, 1) if QUAD_SUMS else l_i
            o = (acc * gl.convert_layout(1.0 / l_row, PV_ROW)[:, None]).to(dtype)
            item = (q_tile, head_tile, kv_head, q_start, q_len)
            output = (out_ptr, stride_o_tok, stride_o_head, stride_o_dim)
            if O_TMA:
                if q_tile * BLOCK_Q + (WG * ROWS + ROWS - 1) // HEAD_TILE < q_len:
                    _store_out(o_desc, q_buf, WG, o, q_start + q_tile * BLOCK_Q,
                               kv_head * GROUP + head_tile * HEAD_TILE)  # fmt: skip
                else:
                    _store_rows(output, WG, o, item, GROUP, HEAD_TILE, BLOCK_Q, O_VEC)
                # (the query buffer held the output until TMA read it)
                _query_freed(q_free, WG, Q_TMA)
            else:
                _store_rows(output, WG, o, item, GROUP, HEAD_TILE, BLOCK_Q, O_VEC)
            _stamp(tr, trace_slot(it - 1, TRACE, TRACE_TILES), 8, TRACE)
        nq += 1
        step += 1
        cur, slot, q_tile, q_start, q_len, seq_len = _receive_item(ring, ring_bars, step)
        _stamp(tr, trace_slot(it - 1, TRACE, TRACE_TILES), 9, TRACE)
    _stamp(tr, TRACE_TILES + 0 * b_off, 2, TRACE)
    _stamp(tr, TRACE_TILES + 0 * b_off, 3, TRACE, True)


@gluon.jit
def _paged_prefill_sm90_kernel(
    out_ptr,
    q_ptr,
    k_desc,  # 2-D view of the key cache's rows: [total_rows, cols], box [BOX, HEAD_D]
    v_desc,
    q_desc,  # Q_TMA: the query as [column groups, tokens, heads, 64] (`_q_descriptor`); else k_desc
    o_desc,  # O_TMA: the output as q_desc views the query; else k_desc
    work_ptr,  # `_work_list_kernel`'s lists
    b_off,  # where the decode list starts (`WorkListLayout`)
    counter,  # where the item counter is (`WorkListLayout`)
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2,
    block_size,
    rows_per_page,  # the page stride in cache rows (``stride(0) // stride(1)``)
    total_rows,  # rows of the 2-D views (a row coordinate past them reads zeros)
    stride_kcol,  # the KV-head stride in elements (column of head h: h * stride)
    stride_vcol,
    num_q_tiles,
    stride_q_tok,
    stride_q_head,
    stride_q_dim,
    stride_o_tok,
    stride_o_head,
    stride_o_dim,
    stride_bt_seq,
    stride_bt_blk,
    GROUP: gl.constexpr,
    HEAD_TILE: gl.constexpr,
    BLOCK_Q: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_D: gl.constexpr,
    SLOTS: gl.constexpr,  # KV heads x head tiles per KV head
    STAGES: gl.constexpr,
    BOX: gl.constexpr,
    Q_LAYOUT: gl.constexpr,  # NVMMASharedLayout of [64, HEAD_D]
    PINGPONG: gl.constexpr,  # the warpgroups take turns (`PrefillConfig.turns`)
    WGS: gl.constexpr,  # consumer warpgroups (`PrefillConfig.warpgroups`)
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
    LATE_RELEASE: gl.constexpr,  # a stage released before the next P V (`_release_prev`)
    V_PAGES: gl.constexpr,  # > 1: V tiles as that many one-copy page boxes (`_copy_v`)
    Q_VEC: gl.constexpr,  # the query's rows aligned (`rows_aligned`)
    O_VEC: gl.constexpr,  # the output's rows aligned
    Q_TMA: gl.constexpr,  # the producer loads the query rows (`_load_query`)
    O_TMA: gl.constexpr,  # whole warpgroups' rows go by TMA through the query buffer
    # (`_store_out`); else element by element
    PAGING: gl.constexpr,  # how a tile's boxes find their pages (`_tile_rows`)
    QUAD_SUMS: gl.constexpr,  # row sums as quad partials (`PrefillConfig.quad_sums`)
    LAZY_MAX: gl.constexpr,  # the running max moves only past LAZY_T (`PrefillConfig.lazy_max`)
    SPLIT: gl.constexpr,  # K and V buffers freed apart (`PrefillConfig.split_release`)
    trace_ptr,  # int64 clock stamps (TRACE only)
    TRACE: gl.constexpr,
):
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    KV_LAYOUT: gl.constexpr = k_desc.layout
    HEAD_TILES: gl.constexpr = (GROUP + HEAD_TILE - 1) // HEAD_TILE
    q_smem = gl.allocate_shared_memory(dtype, [WGS, 64, HEAD_D], Q_LAYOUT)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], KV_LAYOUT)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], KV_LAYOUT)
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # each stage freed by every warpgroup; SPLIT: its K and V buffers apart (K at its scores'
    # return), else one barrier for both
    k_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    if SPLIT:
        v_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    else:
        v_free = k_free
    turn_bars = gl.allocate_shared_memory(gl.int64, [WGS, 1], mbarrier.MBarrierLayout())
    ROW1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    # the producer's ring of item steps for the consumers (`_claim_item`, `_receive_item`)
    RING: gl.constexpr = STAGES + ITEM_RING_EXTRA
    ring = gl.allocate_shared_memory(gl.int32, [RING, RING_WORDS], ROW1)
    ring_bars = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    for r in gl.static_range(RING):
        mbarrier.init(ring_bars.index(r), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(s), count=1)
        mbarrier.init(v_bars.index(s), count=1)
        mbarrier.init(k_free.index(s), count=WGS)  # an arrival per warpgroup
        if SPLIT:
            mbarrier.init(v_free.index(s), count=WGS)
    for w in gl.static_range(WGS):
        mbarrier.init(turn_bars.index(w), count=1)
    # Q_TMA: each warpgroup's query buffer loaded (the producer's copy) and freed (the warpgroup)
    q_full = gl.allocate_shared_memory(gl.int64, [WGS, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [WGS, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(WGS):
        mbarrier.init(q_full.index(w), count=1)
        mbarrier.init(q_free.index(w), count=1)
    mbarrier.arrive(turn_bars.index(0), count=1, pred=PINGPONG)  # warpgroup 0 goes first
    fence_async_shared()
    prod = (work_ptr, b_off, num_q_tiles, query_start_loc_ptr, seq_lens_ptr, block_table_ptr,
            stride_bt_seq, stride_bt_blk, block_size, rows_per_page, total_rows, stride_kcol,
            stride_vcol, k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, k_free, v_free,
            work_ptr + counter, ring, ring_bars, q_desc, q_smem, q_full, q_free,
            trace_ptr)  # fmt: skip
    cons = (work_ptr, b_off, num_q_tiles, query_start_loc_ptr, seq_lens_ptr, q_ptr, out_ptr,
            stride_q_tok, stride_q_head, stride_q_dim, stride_o_tok, stride_o_head, stride_o_dim,
            scale_log2, k_smem, v_smem, k_bars, v_bars, k_free, v_free, q_smem, turn_bars, ring,
            ring_bars, q_full, q_free, o_desc, trace_ptr)  # fmt: skip
    if WGS == 3:
        gl.warp_specialize(
            [
                (_consumer, (0, cons, SLOTS, HEAD_TILES, GROUP, HEAD_TILE, BLOCK_Q, STAGES,
                             PINGPONG, Q_VEC, O_VEC, LATE_RELEASE, V_PAGES, Q_TMA, O_TMA, TRACE,
                             QUAD_SUMS, LAZY_MAX, SPLIT)),
                (_consumer, (1, cons, SLOTS, HEAD_TILES, GROUP, HEAD_TILE, BLOCK_Q, STAGES,
                             PINGPONG, Q_VEC, O_VEC, LATE_RELEASE, V_PAGES, Q_TMA, O_TMA, TRACE,
                             QUAD_SUMS, LAZY_MAX, SPLIT)),
                (_consumer, (2, cons, SLOTS, HEAD_TILES, GROUP, HEAD_TILE, BLOCK_Q, STAGES,
                             PINGPONG, Q_VEC, O_VEC, LATE_RELEASE, V_PAGES, Q_TMA, O_TMA, TRACE,
                             QUAD_SUMS, LAZY_MAX, SPLIT)),
                (_producer, (prod, SLOTS, HEAD_TILES, BLOCK_Q, STAGES, BOX, V_PAGES, GROUP,
                             HEAD_TILE, Q_TMA, PAGING, TRACE, SPLIT)),
            ],
            [4, 4, PRODUCER_WARPS],
            [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip
    else:
        gl.warp_specialize(
            [
                (_consumer, (0, cons, SLOTS, HEAD_TILES, GROUP, HEAD_TILE, BLOCK_Q, STAGES,
                             PINGPONG, Q_VEC, O_VEC, LATE_RELEASE, V_PAGES, Q_TMA, O_TMA, TRACE,
                             QUAD_SUMS, LAZY_MAX, SPLIT)),
                (_consumer, (1, cons, SLOTS, HEAD_TILES, GROUP, HEAD_TILE, BLOCK_Q, STAGES,
                             PINGPONG, Q_VEC, O_VEC, LATE_RELEASE, V_PAGES, Q_TMA, O_TMA, TRACE,
                             QUAD_SUMS, LAZY_MAX, SPLIT)),
                (_producer, (prod, SLOTS, HEAD_TILES, BLOCK_Q, STAGES, BOX, V_PAGES, GROUP,
                             HEAD_TILE, Q_TMA, PAGING, TRACE, SPLIT)),
            ],
            [4, PRODUCER_WARPS],
            [CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip


# -- host side ----------------------------------------------------------------------------------


def _rows_per_page(cache: torch.Tensor) -> int:
    return cache.stride(0) // cache.stride(1) if cache.stride(1) else 0


def sm90_prefill_errors(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
) -> list[str]:
    """Why this kernel cannot read these tensors (empty: it can); module doc, Requirements.
    What the config decides is `prefill_config_errors`'."""
    elem = query.element_size()
    rules = [
        (query.device.type in ("cuda", "meta"), "not a CUDA (or meta) tensor"),
        (
            key_cache.stride() == value_cache.stride(),
            f"key_cache strides {tuple(key_cache.stride())} differ from value_cache's "
            f"{tuple(value_cache.stride())} (one row map serves both)",
        ),
    ]
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        rules += [
            (c.stride(3) == 1, f"{name} head_dim stride {c.stride(3)} is not 1"),
            (
                (c.shape[2] - 1) * c.stride(2) + c.shape[3] <= c.stride(1),
                f"{name}'s KV heads of a token do not lie within its token stride {c.stride(1)} "
                f"(head stride {c.stride(2)}: e.g. an HND cache)",
            ),
            (
                c.stride(1) > 0 and c.stride(0) % c.stride(1) == 0,
                f"{name} page stride {c.stride(0)} is not a multiple of its token stride "
                f"{c.stride(1)}",
            ),
            (
                (c.stride(1) * elem) % 16 == 0 and (c.stride(0) * elem) % 16 == 0,
                f"{name} strides {tuple(c.stride())} are not 16-byte aligned",
            ),
            (c.data_ptr() % 16 == 0, f"{name} base is not 16-byte aligned"),
            (
                _total_rows(c) < 2**31,
                f"{name} spans {_total_rows(c)} rows, past TMA's 32-bit coordinates",
            ),
        ]
    return [why for ok, why in rules if not ok]


def _total_rows(cache: torch.Tensor) -> int:
    return (cache.shape[0] - 1) * _rows_per_page(cache) + cache.shape[1] if cache.shape[0] else 0


def _descriptor(cache: torch.Tensor, cfg: PrefillConfig) -> TensorDescriptor:
    """The cache's rows as one 2-D tensor: row ``page * rows_per_page + slot``, columns from
    the first KV head's first element (head ``h`` at ``h * stride(2)``); boxes ``[box, d]``."""
    d = cache.shape[3]
    cols = (cache.shape[2] - 1) * cache.stride(2) + d
    layout = gl.NVMMASharedLayout.get_default_for([cfg.block_n, d], _GL_DTYPES[cache.dtype])
    return TensorDescriptor(
        cache, [_total_rows(cache), cols], [cache.stride(1), 1], [cfg.box, d], layout
    )


def _v_descriptor(cache: torch.Tensor, cfg: PrefillConfig) -> TensorDescriptor:
    """V pages: the value cache's rows as ``[column groups of 64, rows, 64]`` (strides 64, the
    token stride, 1: the outer dimension's stride is the smaller one, which TMA allows), box
    ``[head_dim // 64, box, 64]``: one copy lays a page box down as its own [box, head_dim]
    NVMMA tile (column halves major)."""
    d = cache.shape[3]
    cols = (cache.shape[2] - 1) * cache.stride(2) + d
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
    return TensorDescriptor(
        cache, [cols // 64, _total_rows(cache), 64], [64, cache.stride(1), 1],
        [d // 64, cfg.box, 64], layout,
    )  # fmt: skip


def _q_descriptor(q: torch.Tensor, head_tile: int) -> TensorDescriptor:
    """Q_TMA (the query) and O_TMA (the output): ``[tokens, heads, head_dim]`` as ``[column
    groups of 64, tokens, heads, 64]`` (strides 64, the token and head strides, 1), box
    ``[head_dim // 64, 64 // head_tile, head_tile, 64]``: one copy moves a warpgroup's 64 rows
    (``token x head_tile + head``) to or from its [64, head_dim] NVMMA tile, column halves major
    (as `_v_descriptor` does for V pages)."""
    d = q.shape[2]
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
    return TensorDescriptor(
        q, [d // 64, q.shape[0], q.shape[1], 64], [64, q.stride(0), q.stride(1), 1],
        [d // 64, 64 // head_tile, head_tile, 64], layout,
    )  # fmt: skip


def trace_shape(programs: int) -> tuple[int, int, int, int]:
    """The stamps a trace buffer holds for a launch of ``programs``, as ``[program, partition,
    tile, event]`` (the buffer needs their product of int64 words)."""
    return programs, TRACE_PARTS.value, TRACE_TILES.value + 1, TRACE_EVENTS.value


def sm90_prefill_launches(
    main: Launch,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    q_len_lo: int,
    cfg: PrefillConfig,
    trace: torch.Tensor | None = None,
) -> list[Launch]:
    """The portable kernel's launch ``main`` by this kernel, as ``cfg`` says: the work-list
    launch, then the kernel's (same outputs). Sequences with ``q_len > q_len_lo`` are prefill
    items, the others decode items spread among them (`item_order`). ``trace``: an int64
    buffer of `trace_shape` stamps (`check_trace_buffer`), the launch built to fill it."""
    a = main.args
    head_dim = key_cache.shape[3]
    group = a["GROUP"]
    q = a["q_ptr"]
    rows = 64 * cfg.warpgroups
    head_tile = min(group, rows)
    block_q = rows // head_tile
    slots = a["num_kv_heads"] * -(-group // head_tile)
    num_seqs = a["num_seqs"]
    num_q_tiles = max(1, -(-a["num_q_tiles"] * a["BLOCK_Q"] // block_q))
    device = q.device
    layout = work_list_layout(num_seqs, num_q_tiles)
    work = torch.empty(layout.size, dtype=torch.int32, device=device)
    work_launch = Launch(
        kernel=_work_list_kernel,
        grid=(num_seqs,),
        args=dict(
            qsl_ptr=a["query_start_loc_ptr"],
            work_ptr=work,
            b_off=layout.b_off,
            counter=layout.counter,
            num_seqs=num_seqs,
            q_len_lo=q_len_lo,
            num_q_tiles=num_q_tiles,
            BLOCK_Q=block_q,
            BLOCK_S=128,
        ),
        options=LaunchOptions(4, 1),
        target=main.target,
        name="paged_attention:work_list",
        outputs=main.outputs,  # (the op's outputs: the plan cache returns the first launch's)
    )
    dtype = _GL_DTYPES[key_cache.dtype]
    programs = main.target.num_sms
    if trace is not None:
        need = math.prod(trace_shape(programs))
        dims = "programs x partitions x (tiles + 1) x events"
        check_trace_buffer(trace, need, device, dims, "paged_attention")
    k_desc = _descriptor(key_cache, cfg)
    args = dict(
        out_ptr=a["out_ptr"],
        q_ptr=q,
        k_desc=k_desc,
        v_desc=(_v_descriptor if cfg.v_pages else _descriptor)(value_cache, cfg),
        q_desc=_q_descriptor(q, head_tile) if cfg.query_by_tma else k_desc,  # (off: never read)
        o_desc=_q_descriptor(a["out_ptr"], head_tile) if cfg.out_by_tma else k_desc,
        work_ptr=work,
        b_off=layout.b_off,
        counter=layout.counter,
        block_table_ptr=a["block_table_ptr"],
        seq_lens_ptr=a["seq_lens_ptr"],
        query_start_loc_ptr=a["query_start_loc_ptr"],
        scale_log2=a["scale_log2"],
        block_size=key_cache.shape[1],
        rows_per_page=_rows_per_page(key_cache),
        total_rows=_total_rows(key_cache),
        stride_kcol=key_cache.stride(2),
        stride_vcol=value_cache.stride(2),
        num_q_tiles=num_q_tiles,
        stride_q_tok=a["stride_q_tok"],
        stride_q_head=a["stride_q_head"],
        stride_q_dim=a["stride_q_dim"],
        stride_o_tok=a["stride_o_tok"],
        stride_o_head=a["stride_o_head"],
        stride_o_dim=a["stride_o_dim"],
        stride_bt_seq=a["stride_bt_seq"],
        stride_bt_blk=a["stride_bt_blk"],
        GROUP=group,
        HEAD_TILE=head_tile,
        BLOCK_Q=block_q,
        BLOCK_N=cfg.block_n,
        HEAD_D=head_dim,
        SLOTS=slots,
        STAGES=cfg.stages,
        BOX=cfg.box,
        Q_LAYOUT=gl.NVMMASharedLayout.get_default_for([64, head_dim], dtype),
        PINGPONG=cfg.turns,
        WGS=cfg.warpgroups,
        CONSUMER_REGS=cfg.consumer_regs,
        PRODUCER_REGS=cfg.producer_regs,
        LATE_RELEASE=cfg.late_release,
        V_PAGES=cfg.boxes if cfg.v_pages else 1,
        Q_VEC=rows_aligned(q),
        O_VEC=rows_aligned(a["out_ptr"]),
        Q_TMA=cfg.query_by_tma,
        O_TMA=cfg.out_by_tma,
        PAGING=cfg.paging,
        QUAD_SUMS=cfg.quad_sums,
        LAZY_MAX=cfg.lazy_max,
        SPLIT=cfg.split_release,
        # a placeholder pointer when off (never read)
        trace_ptr=trace if trace is not None else a["seq_lens_ptr"],
        TRACE=trace is not None,
    )
    kernel = Launch(
        kernel=_paged_prefill_sm90_kernel,
        grid=(programs,),
        args=args,
        options=LaunchOptions(NUM_WARPS, 1),
        target=main.target,
        name="paged_prefill_sm90",
        outputs=main.outputs,
        writes=main.writes,
    )
    return [work_launch, kernel]
