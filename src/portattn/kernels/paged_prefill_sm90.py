"""Paged attention, Hopper (sm_90) prefill kernel in Gluon: TMA page boxes, a producer warp, two
(or three) consumer warpgroups on wgmma (issue 19).

Same math, arguments and output as `portattn.kernels.paged_attention` (whose launcher picks this
kernel for the prefill part of a batch, `portattn.policy.paged.sm90_prefill`); the decode part of
a mixed batch stays on the portable kernel (its decode row tile), in a launch of its own, or,
with ``SM90_PREFILL_FUSE_DECODE``, runs in this kernel too (below).

Work. A program's 128 rows (192 with `Sm90PrefillTile.warpgroups` 3) are ``BLOCK_Q`` query
tokens x ``HEAD_TILE`` query heads of one KV head (as the portable kernel packs GQA groups);
warpgroup ``w`` owns rows ``[64 w, 64 w + 64)``. The
grid is persistent (one program per multiprocessor): a first, small launch (`_work_list_kernel`,
one program per sequence) writes the list of (sequence, q tile) entries of the prefill sequences
(``q_len > q_len_lo``), heaviest q tile first within each sequence, and their count (item ``i``
of the list: entry ``i // SLOTS``, head slot ``i % SLOTS``). So the launch needs no host read of
the metadata (CUDA graphs). ``DYNAMIC`` (`SM90_PREFILL_DYNAMIC`, on): the launch's items form one
order (`program_items` of a single program) and each program's producer takes the next one from a
counter (an atomic increment, the counter zeroed by the work-list launch) once it has issued
its previous item's copies (up to ``STAGES`` tiles before its warpgroups are free), handing it to
the consumer warpgroups through a ring in shared memory (`_grab`, `_take`); so the programs end
within about an item of each other, whatever their items cost. Off, the lists are dealt when
the launch starts: item ``i`` to program ``i % num_programs`` (below). With the decode
sequences fused, they form a second list, dealt round-robin too but from the last program (the
programs left with one prefill item more are the last to get one decode item more), and each
program spreads its decode items evenly among its prefill items from a phase of its own
(`program_items`): at any moment a few programs stream a decode item's cache (memory-bound)
while the rest run prefill tiles (compute-bound), where a decode launch after the prefill would
leave the tensor cores idle (the dynamic deal spreads them so over the launch's one order). A
warpgroup whose rows are all padding (a decode item's second warpgroup) skips the math and only
releases each tile (with ``Q_TMA``, also its query buffer, which the producer fills anyway).

Schedule (`gl.warp_specialize`): a one-warp producer walks the same items and KV tiles as the
consumers and, for each tile, waits until both warpgroups released its stage, then loads K and
V by TMA, one box per ``BOX`` rows of one cache page (the block table read per box, its page
found without a division a box where the page size allows, `paging`; a box past the sequence's
last page is given a row past the tensor, which TMA fills with zeros), each into
its own barrier so the score MMA starts as soon as K lands. Each consumer warpgroup: S = Q K^T
(wgmma, both operands in shared memory), masks on the tiles that reach past the causal limit of
its first row, base-2 online softmax in registers, then O += P V with P as the register operand
(wgmma RS), and releases the stage. Two schedule switches (`portattn.policy.paged`):

* ``SM90_PREFILL_OVERLAP``: tile t's scores are issued together with tile t-1's P V, and tile t's
  softmax runs while the latter is in flight (the accumulator is rescaled once it lands);
* ``SM90_PREFILL_PINGPONG`` (or the tile's own `Sm90PrefillTile.pingpong`, `takes_turns`): the
  two warpgroups take turns issuing their MMAs (an mbarrier each; warpgroup 0 first), so one's
  softmax runs under the other's MMAs instead of both warpgroups, which wait on the same K tile,
  scoring at once and then both leaving the tensor cores idle. Overlapped, a turn issues tile t's
  scores with tile t-1's P V; sequential, it issues tile t's P V with tile t+1's scores (the item's
  first scores and its last P V take turns of their own). An item whose second warpgroup has no
  real rows (a decode item, a short last q tile) takes no turns: warpgroup 0 runs it alone while
  warpgroup 1 passes its tiles on (with ``SM90_PREFILL_SPLIT_SHORT``, both run it by halves of
  the keys, without turns).

Both off, a warpgroup scores, softmaxes and accumulates one tile at a time (head_dim 64's tile;
on an H100 neither the overlapped schedules, nor 3 stages, nor 192-row tiles measured faster
than it, bench/RESULTS.md 2026-11-25, at whole-tile boxes; 3 stages with a late release did, at
2-4 boxes a tile: below). Head_dim 128's tile takes turns at 3 stages with the query by TMA
(sixteenth session, H200: at 2 stages the turns starved, since a turn issues the scores of a
tile whose stage the other warpgroup frees only half a tile period before, and measured
slower); where the query cannot come by TMA (GQA whose group does not divide 64, unaligned
rows, ``SM90_PREFILL_Q_TMA`` off) the launch runs the sequential 2-stage tile instead
(`query_tile`, `paged_policy.SM90_PREFILL_NO_TMA_TILES`).

Pages shorter than the tile (bench/RESULTS.md, sixth session; the launch picks both,
`launch_tile` and `v_pages`):

* V pages (``V_PAGES``, where a tile has `SM90_PREFILL_V_PAGES_MIN_BOXES` boxes: 16-row boxes):
  a [box, 128] box is two TMA copies under the 128-byte swizzle. The value cache's 3-D view
  ``[column groups of 64, rows, 64]`` copies both halves of a box at once, laid down as the box's
  own [box, 128] NVMMA tile (`_v_page`). P V reads the whole tile through one shared layout of
  its boxes (`_pages_layout`): one MMA, one commit group (an MMA a box made every k-step a group
  of its own behind its own fence). K keeps two copies a box (the score MMA reads the tile's
  rows at one stride). At 16-token pages a tile's copies fall from 32 to 24. In the sequential
  loop, with or without ping-pong turns (not the overlapped loop).
* Late release (``RELEASE_LAG``, where a tile has 2 or 4 boxes: `SM90_PREFILL_LATE_RELEASE_BOXES`):
  3 stages, each released just before the next tile's P V instead of after its own.

Query rows are read 16 bytes a thread and output rows written 4 bytes a thread where the launcher
found them aligned (``Q_VEC`` / ``O_VEC``, `rows_aligned`: a warpgroup's code does not see the
launch's alignment); otherwise both go element by element. With ``Q_TMA`` (`SM90_PREFILL_Q_TMA`,
where `q_tma` allows it) the producer loads them instead: after the copies of an item's tile
``STAGES - 1`` (or its last; in an item of at least ``STAGES`` tiles that tile's stage was the
previous item's last, released after its last scores, so the copy does not wait; a shorter
item's may wait for them), one TMA copy a warpgroup (the 4-D view of `_q_descriptor`), each into the
warpgroup's query buffer once the warpgroup has freed it (its previous item's last score MMA
returned: a "free" and a "full" barrier a warpgroup, `_load_query`, `_query_freed`). The
warpgroup then starts an item with its query already in shared memory, not with a global read
behind the item's metadata.

The rows of the sequence's last page past ``seq_len`` are real memory that may hold anything
(NaN): their scores are masked, and before P V each warpgroup zeroes them in the V tile (both
write the same zeros; the other warpgroup reads either its own zeros or these).

Requirements (`sm90_prefill_errors`): sm_90, fp16/bf16, NHD, ``head_dim`` in `HEAD_DIMS`,
``block_size`` a multiple of 16 (TMA boxes of 16..128 rows), the cache rows addressable as one
2-D tensor of rows ``page * (stride(0) // stride(1)) + slot`` (``stride(3) == 1``, the page stride
a multiple of the token stride, a token's KV heads within its token stride, 16-byte aligned
strides and base: contiguous, sliced and hybrid-interleaved NHD caches; not HND-stored ones), and
shared memory within the target's. Anything else runs on the portable kernel.
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

from portattn.kernels._gluon import (
    EXP2_PACK,
    LAZY_T,
    clock_stamp,
    exp2_split,
    lazy_rescale,
    row_max,
    row_ptrs,
    row_sum,
    trace_slot,
)
from portattn.kernels._launch import Launch, check_trace_buffer, rows_aligned
from portattn.platform import Target
from portattn.policy import paged as paged_policy
from portattn.policy.common import LaunchOptions
from portattn.policy.paged import SM90_PREFILL_TILES, Sm90PrefillTile

_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
#: Head dims this kernel is written for (each with its tile in `SM90_PREFILL_TILES`).
HEAD_DIMS = tuple(sorted(SM90_PREFILL_TILES))
#: Warps of the default partition (consumer warpgroup 0); warpgroup 1 and the producer are
#: worker partitions of 4 and 1 warps.
NUM_WARPS = 4
PRODUCER_WARPS = 1
#: Registers per thread asked for (`setmaxnreg`): the worker consumer warpgroups and the
#: producer warp, by the number of consumer warpgroups (Triton gives the default partition
#: what is left of the register file).
REGS = {2: (216, 64), 3: (152, 56)}
#: More for the producer with K_AHEAD (two tiles' box rows held), by whether V comes as page
#: boxes (`V_PAGES` > 1: block 16, where the consumers need their share). ptxas, sm_90, the mixed
#: batch at 64 + 8 / 64 + 16: blocks 16: 0 / 8 B spilled (a consumer); 32, 64, 544: 16 B (the
#: producer) / 0; 128, 256, 2048: 0 / 0 (eighteenth session).
K_AHEAD_REGS = {True: 8, False: 16}
#: Smallest TMA box (rows of one page): pages must be a multiple of it.
MIN_BOX = 16
#: Diagnostic trace (`TRACE`, bench/trace_prefill.py): clock stamps per K/V tile (the
#: program's tile counter: the same tile in every partition) for the first ``TRACE_TILES`` tiles
#: of each program, in four partitions (consumer warpgroups 0..2, the producer at 3).
TRACE_EVENTS = gl.constexpr(10)
TRACE_TILES = gl.constexpr(2048)
TRACE_PARTS = gl.constexpr(4)
#: When set (an int64 CUDA tensor of at least ``programs * TRACE_PARTS * (TRACE_TILES + 1) *
#: TRACE_EVENTS`` elements), `sm90_prefill_launches` builds traced launches, stamping
#: ``[program, partition, tile, event]`` (the last "tile" holds each partition's start and end).
#: Consumer events: 0 tile start, 1 K landed, 2 scores done, 3 P ready, 4 V landed (tail
#: zeroed), 5 P V done, 6 stage released, 7 (an item's first tile) item start, before its query
#: is read; on an item's last tile, 8 the epilogue's stores issued and 9 the next step in hand
#: (`_take`; with AHEAD, taken before the epilogue). A warpgroup passing an item's tiles on
#: stamps 0, 1, 4, 6 and 9. Producer: 0 tile start
#: (before its block-table loads are issued), 1 stage free, 2 copies issued. Kernel slot,
#: every partition: 0 start (clock), 1 start (global timer, ns), 2 end (clock), 3 end (ns).
#: The sequential schedule only (OVERLAP and SPLIT off: the launcher refuses the rest).
#: Diagnostic only; the library never sets it. It is read at planning and is not part of the
#: op's plan-cache key: set it only around `plan_paged_attention` (as bench/trace_prefill.py
#: does).
TRACE_BUFFER = None


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
    entry counts at 0 and 1, the main list from 2, the second list from ``b_off``, and the
    dynamic deal's counter at ``counter`` (`_grab`). The one place these offsets come from: the
    launcher sizes the buffer and passes ``b_off`` and ``counter`` to both kernels."""

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
    b_off,  # where the second list starts (`WorkListLayout`)
    counter,  # where the dynamic deal's counter is (`WorkListLayout`)
    num_seqs,
    q_len_lo,  # sequences with q_len > q_len_lo: the main list
    q_len_min,  # sequences with q_len_min < q_len <= q_len_lo: the second list (fused decodes)
    num_q_tiles,
    BLOCK_Q: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """One program per sequence: its entries (``seq * num_q_tiles + q_tile``), heaviest q tile
    first, after those of the sequences before it in the same list (their count summed here,
    ``BLOCK_S`` at a time). The main list starts at ``work[2]``, the second at ``work[b_off]``;
    the last program writes their entry counts to ``work[0]`` and ``work[1]``, and zeroes the
    dynamic deal's counter ``work[counter]`` (`DYNAMIC`). Sequences with
    ``q_len <= q_len_min`` are in neither (the decode launch serves them; ``q_len_min ==
    q_len_lo`` leaves the second list empty)."""
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
        second = m & (q_len > q_len_min) & (q_len <= q_len_lo)
        base_b += tl.sum(tl.where(second, tiles, 0), axis=0)
    q_len = tl.load(qsl_ptr + seq + 1) - tl.load(qsl_ptr + seq)
    in_a = q_len > q_len_lo
    # at most num_q_tiles per sequence (max_query_len's): a caller whose q_len exceeds the
    # maximum it gave loses that work, as with the portable kernel, and the list its bounds
    n = tl.where(q_len > q_len_min, tl.minimum(tl.cdiv(q_len, BLOCK_Q), num_q_tiles), 0)
    start = tl.where(in_a, 2 + base_a, b_off + base_b)
    for t0 in range(0, n, BLOCK_S):
        t = t0 + tl.arange(0, BLOCK_S)
        entry = seq * num_q_tiles + (n - 1 - t)
        tl.store(work_ptr + start + t, entry.to(tl.int32), mask=t < n)
    if seq == num_seqs - 1:
        tl.store(work_ptr, (base_a + tl.where(in_a, n, 0)).to(tl.int32))
        tl.store(work_ptr + 1, (base_b + tl.where(in_a, 0, n)).to(tl.int32))
        tl.store(work_ptr + counter, 0)


def program_items(pid: int, nprog: int, n_a: int, n_b: int) -> list[tuple[bool, int]]:
    """Program ``pid``'s items in its order (`_share` and `_item` compute the same on the
    device): ``(False, j)`` item ``j`` of the main list, ``(True, j)`` of the second.

    Each list is dealt round-robin, the main list from program 0 (program ``pid`` takes items
    ``pid, pid + nprog, ...``), the second from the last program (``rp = nprog - 1 - pid``
    takes ``rp, rp + nprog, ...``), so the programs left with one main-list item more than the
    others are the last to get one decode item more (dealt from program 0 as well, both
    extras landed on the same programs, whose end the whole launch waited for). A program
    spreads its second-list items evenly among its main-list ones, from a phase of its own
    (`phase`), so at any step only some programs run a (memory-bound) decode item while the
    others run (compute-bound) prefill items."""
    rp = nprog - 1 - pid
    mine_a = max(0, -(-(n_a - pid) // nprog))
    mine_b = max(0, -(-(n_b - rp) // nprog))
    n = mine_a + mine_b
    off = phase(pid, n)
    items = []
    for step in range(n):
        k = (step * mine_b + off) // n
        second = ((step + 1) * mine_b + off) // n > k
        items.append((second, rp + k * nprog if second else pid + (step - k) * nprog))
    return items


def phase(pid: int, n: int) -> int:
    """Program ``pid``'s phase in its ``n`` steps: the fraction ``pid x 0.618`` mod 1 (10 bits)
    of them, spread evenly over the programs whatever their count and ``n`` (the golden-ratio
    sequence); `_share` computes the same."""
    return (pid * 633) % 1024 * n // 1024


@gluon.jit
def _programs(DYNAMIC: gl.constexpr):
    """``(pid, nprog)`` of the deal: this program's, or with DYNAMIC the whole launch as one
    program (its steps taken by whichever program is free: `_grab`)."""
    if DYNAMIC:
        return 0, 1
    else:
        return gl.program_id(0), gl.num_programs(0)


@gluon.jit
def _share(work_ptr, SLOTS: gl.constexpr, DYNAMIC: gl.constexpr):
    """This program's share of the two lists (`program_items`): its second-list items, its
    steps and its phase (DYNAMIC: the launch's, as one program's)."""
    pid, nprog = _programs(DYNAMIC)
    n_a = gl.load(work_ptr) * SLOTS  # work[0], work[1] count (sequence, q tile) entries
    n_b = gl.load(work_ptr + 1) * SLOTS
    mine_a = gl.maximum(n_a - pid + nprog - 1, 0) // nprog
    mine_b = gl.maximum(n_b - (nprog - 1 - pid) + nprog - 1, 0) // nprog  # dealt from the last
    n = mine_a + mine_b
    return mine_b, n, (pid * 633) % 1024 * n // 1024  # `phase`


@gluon.jit
def _item(lists, step, SLOTS: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_N: gl.constexpr,
          DYNAMIC: gl.constexpr, GUARD: gl.constexpr = False):  # fmt: skip
    """This program's item at ``step`` (`program_items`; ``mine_b``, ``n``, ``off`` from
    `_share`, the second list at ``work[b_off]``; DYNAMIC: the launch's step ``step``): its
    sequence, head slot, q tile, query start and length, context length before the queries, the
    end of its KV range, where its masked tiles start, and its tiles. GUARD: ``step`` may be past
    the last (`_next_item`): the list is then not read (sequence 0's values, unused)."""
    work_ptr, mine_b, n, off, b_off, num_q_tiles, qsl_ptr, seq_lens_ptr = lists
    pid, nprog = _programs(DYNAMIC)
    if GUARD:
        real_step = step < n
        n = gl.maximum(n, 1)  # (no items: no division by zero either)
    if DYNAMIC:  # the launch's steps x second-list items can pass 2^31
        k = ((step.to(gl.int64) * mine_b + off) // n).to(gl.int32)
        second = ((step.to(gl.int64) + 1) * mine_b + off) // n > k
    else:
        k = (step * mine_b + off) // n
        second = ((step + 1) * mine_b + off) // n > k
    j = gl.where(second, nprog - 1 - pid + k * nprog, pid + (step - k) * nprog)
    if GUARD:
        e = gl.load(work_ptr + gl.where(second, b_off, 2) + j // SLOTS, mask=real_step, other=0)
    else:
        e = gl.load(work_ptr + gl.where(second, b_off, 2) + j // SLOTS)
    slot = j % SLOTS
    seq = e // num_q_tiles
    q_tile = e % num_q_tiles
    q_start = gl.load(qsl_ptr + seq)
    q_len = gl.load(qsl_ptr + seq + 1) - q_start
    seq_len = gl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len
    kv_end = gl.minimum(seq_len, ctx_len + (q_tile + 1) * BLOCK_Q)
    full_end = (ctx_len + q_tile * BLOCK_Q + 1) // BLOCK_N * BLOCK_N
    # at least one tile: a sequence with seq_len < q_len (outside the op's contract; unchecked in
    # a CUDA graph) would give none, and items without tiles would let the producer run more than
    # the dynamic deal's ring ahead of the warpgroups (`ITEM_RING_EXTRA`); its rows come out NaN
    n_tiles = gl.maximum(gl.cdiv(kv_end, BLOCK_N), 1)
    return seq, slot, q_tile, q_start, q_len, seq_len, ctx_len, kv_end, full_end, n_tiles


#: Slots of the dynamic deal's ring (`_grab`): the producer is at most ``STAGES + 1`` items ahead of
#: the slowest consumer's read. It writes item s's slot after the wait for the stage of item s-1's
#: last tile, which every consumer warpgroup releases only once all its warps have read item
#: s-1-STAGES (`_take`'s barrier; every item has a tile, `_item`).
ITEM_RING_EXTRA = gl.constexpr(2)


@gluon.jit
def _grab(ctr_ptr, ring, ring_bars, step, DYNAMIC: gl.constexpr):
    """The producer's next step: ``step`` itself, or with DYNAMIC the launch's next free step (one
    atomic increment), handed to the consumer warpgroups through slot ``step % R`` of ``ring``
    (their `_take`); a step past the last tells them to stop."""
    if DYNAMIC:
        R: gl.constexpr = ring.shape[0]
        g = gl.atomic_add(ctr_ptr, 1)
        L: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        ring.index(step % R).store(gl.full([1], g, gl.int32, layout=L))
        gl.thread_barrier()  # every lane's store before the arrival (as before a stage release)
        mbarrier.arrive(ring_bars.index(step % R), count=1)
        return g
    else:
        return step


@gluon.jit
def _next_item(ring, ring_bars, step, lists, SLOTS: gl.constexpr, BLOCK_Q: gl.constexpr,
               BLOCK_N: gl.constexpr, DYNAMIC: gl.constexpr):  # fmt: skip
    """AHEAD, a consumer warpgroup: its next step (`_take`) and that item's values (`_item`,
    guarded: the step may be past the last), taken before this item's epilogue, so that the
    metadata reads are in flight under the output's stores instead of after them."""
    cur = _take(ring, ring_bars, step, DYNAMIC)
    return cur, _item(lists, cur, SLOTS, BLOCK_Q, BLOCK_N, DYNAMIC, True)


@gluon.jit
def _take(ring, ring_bars, step, DYNAMIC: gl.constexpr):
    """A consumer warpgroup's next step: ``step``, or with DYNAMIC what the producer's `_grab`
    put in slot ``step % R``."""
    if DYNAMIC:
        R: gl.constexpr = ring.shape[0]
        mbarrier.wait(ring_bars.index(step % R), (step // R) & 1)
        L: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        v = ring.index(step % R).load(L)
        # every warp has read the slot before any of them releases a stage (a release is one
        # thread's arrival; the path that passes tiles on has no barrier before it)
        gl.thread_barrier()
        return gl.max(v, axis=0)
    else:
        return step


@gluon.jit
def _producer(rt, SLOTS: gl.constexpr, HEAD_TILES: gl.constexpr, BLOCK_Q: gl.constexpr,
              STAGES: gl.constexpr, BOX: gl.constexpr, V_PAGES: gl.constexpr,
              DYNAMIC: gl.constexpr, GROUP: gl.constexpr, HEAD_TILE: gl.constexpr,
              NUM_WG: gl.constexpr, Q_TMA: gl.constexpr, K_AHEAD: gl.constexpr,
              PAGING: gl.constexpr, TRACE: gl.constexpr):  # fmt: skip
    """The load warp: every item's K and V tiles by TMA boxes of ``BOX`` rows of one page. K: a
    2-D box of [BOX, HEAD_D] (one copy a 64-column group under the 128-byte swizzle). V: see
    `_copy_v`. The copies go box by box (K, V, K, V, ...) once the stage is released. K_AHEAD:
    a stage's K buffer has a barrier of its own (``kfree_bars``), released when the tile's scores
    have returned (`_consumer`, turns), and K runs a tile ahead of V within an item: on the
    release of stage ``s`` the producer issues V of tile t, then K of tile t+1 (whose K buffer
    the scores of tile t-2 freed at the same time). Q_TMA: after the copies of an item's tile
    ``STAGES - 1`` (or its last), each consumer warpgroup's query rows (`_load_query`)."""
    (work_ptr, b_off, num_q_tiles, qsl_ptr, seq_lens_ptr, block_table_ptr, stride_bt_seq,
     stride_bt_blk, block_size, rows_per_page, total_rows, stride_kcol, stride_vcol, k_desc, v_desc,
     k_smem, v_smem, k_bars, v_bars, empty_bars, kfree_bars, ctr_ptr, ring, ring_bars, q_desc,
     q_smem, q_full, q_free, trace_ptr) = rt  # fmt: skip
    tr = _trace_part(trace_ptr, TRACE_PARTS - 1)
    _stamp(tr, TRACE_TILES + 0 * b_off, 0, TRACE)
    _stamp(tr, TRACE_TILES + 0 * b_off, 1, TRACE, True)
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEAD_D: gl.constexpr = k_smem.shape[2]
    NB: gl.constexpr = BLOCK_N // BOX
    TILE_BYTES: gl.constexpr = BLOCK_N * HEAD_D * k_smem.dtype.primitive_bitwidth // 8
    # every box's row in each thread's registers: picking box b's below is a register move (one
    # box per lane made each pick a three-step shuffle reduction, 8 boxes ~1200 cycles a tile)
    boxes = gl.arange(0, NB, layout=gl.BlockedLayout([NB], [32], [gl.num_warps()], [0]))
    mine_b, n, off = _share(work_ptr, SLOTS, DYNAMIC)
    lists = (work_ptr, mine_b, n, off, b_off, num_q_tiles, qsl_ptr, seq_lens_ptr)
    it = 0
    nq = 0  # items whose query rows were loaded (Q_TMA)
    step = 0
    cur = _grab(ctr_ptr, ring, ring_bars, step, DYNAMIC)
    while cur < n:
        seq, slot, q_tile, q_start, _, seq_len, _, _, _, n_tiles = _item(
            lists, cur, SLOTS, BLOCK_Q, BLOCK_N, DYNAMIC
        )
        kv_head = slot // HEAD_TILES
        bt_row = block_table_ptr + seq.to(gl.int64) * stride_bt_seq
        kcol = kv_head * stride_kcol
        vcol = kv_head * stride_vcol
        if K_AHEAD:  # the item's first K tile: alone, as its K buffer frees
            rows = _tile_rows(bt_row, 0, boxes, BOX, BLOCK_N, seq_len, block_size, stride_bt_blk,
                              rows_per_page, total_rows, PAGING)  # fmt: skip
            _copy_k_tile(k_desc, k_smem, k_bars, kfree_bars, rows, boxes, kcol, it, NB, BOX,
                         TILE_BYTES)  # fmt: skip
        for t in range(n_tiles):
            s = it % STAGES
            jt = trace_slot(it, TRACE, TRACE_TILES)
            _stamp(tr, jt, 0, TRACE)
            # the tile's block-table reads (one per box, for K and V) before the wait for its
            # stage: their latency runs under the wait instead of after it (a decode item, whose
            # math is short, waited for both in turn on every tile). K_AHEAD: the next tile's
            # (this tile's, for V, were read a tile ago)
            if K_AHEAD:
                rows_v = rows
                rows = _tile_rows(bt_row, t + 1, boxes, BOX, BLOCK_N, seq_len, block_size,
                                  stride_bt_blk, rows_per_page, total_rows, PAGING)  # fmt: skip
            else:
                rows = _tile_rows(bt_row, t, boxes, BOX, BLOCK_N, seq_len, block_size,
                                  stride_bt_blk, rows_per_page, total_rows, PAGING)  # fmt: skip
            # the stage's previous tile released by both warpgroups (none before the first use)
            mbarrier.wait(empty_bars.index(s), ((it // STAGES) & 1) ^ 1, pred=it >= STAGES)
            _stamp(tr, jt, 1, TRACE)
            v_buf = v_smem.index(s)
            if K_AHEAD:
                mbarrier.expect(v_bars.index(s), TILE_BYTES)
                for b in gl.static_range(NB):
                    _copy_v(v_desc, v_buf, v_bars.index(s), _box_row(rows_v, boxes, b), vcol, b,
                            BOX, V_PAGES)  # fmt: skip
                # the query before K of tile t+1: at t = 2 that K waits for the buffer this
                # item's first scores free, which need the query (after it, a deadlock)
                nq = _query_step(q_desc, q_smem, q_full, q_free, nq, t, n_tiles, q_start, q_tile,
                                 kv_head, slot, STAGES, BLOCK_Q, GROUP, HEAD_TILES, HEAD_TILE,
                                 NUM_WG, Q_TMA)  # fmt: skip
                if t + 1 < n_tiles:
                    _copy_k_tile(k_desc, k_smem, k_bars, kfree_bars, rows, boxes, kcol, it + 1,
                                 NB, BOX, TILE_BYTES)  # fmt: skip
            else:
                k_buf = k_smem.index(s)
                mbarrier.expect(k_bars.index(s), TILE_BYTES)
                mbarrier.expect(v_bars.index(s), TILE_BYTES)
                for b in gl.static_range(NB):
                    row = _box_row(rows, boxes, b)
                    _copy_k(k_desc, k_buf, k_bars.index(s), row, kcol, b, BOX)
                    _copy_v(v_desc, v_buf, v_bars.index(s), row, vcol, b, BOX, V_PAGES)
                nq = _query_step(q_desc, q_smem, q_full, q_free, nq, t, n_tiles, q_start, q_tile,
                                 kv_head, slot, STAGES, BLOCK_Q, GROUP, HEAD_TILES, HEAD_TILE,
                                 NUM_WG, Q_TMA)  # fmt: skip
            _stamp(tr, jt, 2, TRACE)
            it += 1
        step += 1
        cur = _grab(ctr_ptr, ring, ring_bars, step, DYNAMIC)
    _stamp(tr, TRACE_TILES + 0 * b_off, 2, TRACE)
    _stamp(tr, TRACE_TILES + 0 * b_off, 3, TRACE, True)


@gluon.jit
def _query_step(q_desc, q_smem, q_full, q_free, nq, t, n_tiles, q_start, q_tile, kv_head, slot,
                STAGES: gl.constexpr, BLOCK_Q: gl.constexpr, GROUP: gl.constexpr,
                HEAD_TILES: gl.constexpr, HEAD_TILE: gl.constexpr, NUM_WG: gl.constexpr,
                Q_TMA: gl.constexpr):  # fmt: skip
    """Q_TMA: the producer's copy of an item's query rows (`_load_query`) at its tile ``t``
    once that is ``STAGES - 1`` (or the item's last); returns the items whose query was loaded.
    In an item of at least STAGES tiles that tile's stage was the previous item's last, so its
    warpgroups' last scores have returned and the wait for their buffers is over (a shorter item
    may wait here); waiting at the item's first tile held the copies back to within a tile of
    the warpgroups at every item boundary."""
    if Q_TMA:  # noqa: SIM102 (a constexpr branch around a runtime one)
        if t == gl.minimum(STAGES - 1, n_tiles - 1):
            _load_query(q_desc, q_smem, q_full, q_free, nq, q_start + q_tile * BLOCK_Q,
                        kv_head * GROUP + (slot % HEAD_TILES) * HEAD_TILE, NUM_WG)  # fmt: skip
            nq += 1
    return nq


@gluon.jit
def _tile_rows(bt_row, t, boxes, BOX: gl.constexpr, BLOCK_N: gl.constexpr, seq_len, block_size,
               stride_bt_blk, rows_per_page, total_rows, PAGING: gl.constexpr):  # fmt: skip
    """The cache row of each box of an item's tile ``t`` (one block-table read a box; a box
    past the sequence gets ``total_rows``, a row past the tensor, which TMA fills with zeros).
    Each box's page and its row in it by `paging`'s case: 1, a box a page (block ``t x boxes +
    b``, row 0); 2, pages of a tile or more (the tile's first page by one division, then at most
    one page edge inside the tile); 0, a division a box."""
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
def _copy_k_tile(k_desc, k_smem, k_bars, kfree_bars, rows, boxes, kcol, it,
                 NB: gl.constexpr, BOX: gl.constexpr, TILE_BYTES: gl.constexpr):  # fmt: skip
    """K_AHEAD: global tile ``it``'s K boxes (cache rows ``rows``) into its stage once both
    warpgroups have freed that stage's K buffer (none before the first use)."""
    STAGES: gl.constexpr = k_smem.shape[0]
    s = it % STAGES
    mbarrier.wait(kfree_bars.index(s), ((it // STAGES) & 1) ^ 1, pred=it >= STAGES)
    k_buf = k_smem.index(s)
    mbarrier.expect(k_bars.index(s), TILE_BYTES)
    for b in gl.static_range(NB):
        _copy_k(k_desc, k_buf, k_bars.index(s), _box_row(rows, boxes, b), kcol, b, BOX)


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
def _query_box(q_smem, w: gl.constexpr, box: gl.constexpr):
    """Warpgroup ``w``'s query buffer ([64, HEAD_D], NVMMA) as the Q_TMA box ``[column groups of
    64, tokens, heads, 64]`` (`_q_descriptor`): the same bytes, row ``token x HEAD_TILE + head``
    (`_rows`), column halves major."""
    L4: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
    return q_smem.index(w)._reinterpret(q_smem.dtype, box, L4)


@gluon.jit
def _load_query(q_desc, q_smem, q_full, q_free, nq, tok0, head0, NUM_WG: gl.constexpr):
    """Q_TMA, the producer: the ``nq``-th item's query rows, one copy a consumer warpgroup, each
    once the warpgroup has freed its buffer (its last score MMA of the item before returned,
    `_query_freed`). Rows past the tensor's tokens arrive as zeros; rows past the sequence hold
    the next one's tokens (or, for a warpgroup with no real rows, anything): their outputs are
    not written. (A head tile never passes its group: `q_tma` needs ``HEAD_TILE`` to divide 64
    and it is the whole group.)"""
    BOX: gl.constexpr = q_desc.block_shape
    TOK: gl.constexpr = BOX[1]
    for w in gl.static_range(NUM_WG):
        mbarrier.wait(q_free.index(w), (nq & 1) ^ 1, pred=nq > 0)
        mbarrier.expect(q_full.index(w), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [0, tok0 + w * TOK, head0, 0], q_full.index(w),
                                        _query_box(q_smem, w, BOX))  # fmt: skip


@gluon.jit
def _query_freed(q_free, WG: gl.constexpr, Q_TMA: gl.constexpr):
    """Q_TMA, a consumer warpgroup: its query buffer is free for the next item (every warp's
    score MMAs of this item have returned: the barrier first)."""
    if Q_TMA:
        gl.thread_barrier()
        mbarrier.arrive(q_free.index(WG), count=1)


@gluon.jit
def _rows(WG: gl.constexpr, q_tile, head_tile, kv_head, q_start, q_len, GROUP: gl.constexpr,
          HEAD_TILE: gl.constexpr, BLOCK_Q: gl.constexpr, layout: gl.constexpr):  # fmt: skip
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
    """Warpgroup WG's query rows (`_rows`; rows that are not real read as 0) from global memory
    into its buffer ``q_buf``, for the score MMA (16 bytes a thread where Q_VEC); ``query`` is
    (pointer, token, head and dim strides), ``item`` (q tile, head tile, KV head, query start,
    query length)."""
    q_ptr, stride_q_tok, stride_q_head, stride_q_dim = query
    q_tile, head_tile, kv_head, q_start, q_len = item
    HEAD_D: gl.constexpr = q_buf.shape[1]
    tok, head, real = _rows(WG, q_tile, head_tile, kv_head, q_start, q_len, GROUP, HEAD_TILE,
                            BLOCK_Q, gl.SliceLayout(1, LOAD))  # fmt: skip
    dq = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, LOAD))
    q_rows = tok * stride_q_tok + head * stride_q_head
    q_ptrs = row_ptrs(q_ptr, q_rows, dq, stride_q_dim, Q_VEC, 8)
    q_buf.store(gl.load(q_ptrs, mask=real[:, None], other=0.0))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _scores(qk, start, full_end, kv_end, limit, cols):
    """The raw scores of the tile at ``start``; past ``full_end`` each row's causal limit and
    ``kv_end`` mask them to -inf."""
    sc = qk
    if start + cols.shape[0] > full_end:
        pos = start + cols
        keep = (pos < kv_end)[None, :] & (pos[None, :] < limit[:, None])
        sc = gl.where(keep, sc, float("-inf"))
    return sc


@gluon.jit
def _probs(sc, m_i, scale_log2, POLY: gl.constexpr = 0, LAZY: gl.constexpr = False,
           TREE: gl.constexpr = False):  # fmt: skip
    """The new row maxima (scaled, base 2) and ``P = 2^(sc scale_log2 - m)`` of raw scores
    ``sc``. The scale goes inside the exponent, one FFMA an element: the maximum is taken of the
    raw scores and scaled once a row (``scale_log2 > 0``: the launcher checks the scale), where
    scaling the scores first cost an FMUL an element before the maximum could start. ``POLY``:
    that many of every 4 exponentials by a polynomial on the FMA pipe (`exp2_split`; a masked
    score then gives ``2^-126`` where the MUFU gives 0: nothing, beside a row's sum >= 1). LAZY:
    the row's reference max moves only when the tile's passes it by more than `LAZY_T` (P <=
    2^8; from -inf, the first tile's max), so it mostly stays, and with it the rescale factors
    at exactly 1 (`_softmax`). TREE: the row maxima by a tree (`row_max`)."""
    rm = row_max(sc, TREE) * scale_log2
    if LAZY:  # noqa: SIM108 (a constexpr branch)
        m_new = gl.where(rm > m_i + LAZY_T, rm, m_i)
    else:
        m_new = gl.maximum(m_i, rm)
    p = exp2_split(sc * scale_log2 - m_new[:, None], POLY)
    return m_new, p


@gluon.jit
def _first_scores(q_buf, k_smem, k_bars, it, turn_bars, WG: gl.constexpr, tk,
                  PINGPONG: gl.constexpr, turns, QK: gl.constexpr):  # fmt: skip
    """An item's first tile's scores (K tile ``it``), in a turn of their own under PINGPONG
    (both loops that take turns start so); returns them and the turns taken."""
    STAGES: gl.constexpr = k_smem.shape[0]
    ROWS: gl.constexpr = q_buf.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    s = it % STAGES
    mbarrier.wait(k_bars.index(s), (it // STAGES) & 1)
    tk = _turn_wait(turn_bars, WG, tk, PINGPONG, turns)
    qk = warpgroup_mma(q_buf, k_smem.index(s).permute((1, 0)),
                       gl.zeros([ROWS, BLOCK_N], gl.float32, layout=QK),
                       use_acc=False, is_async=True)  # fmt: skip
    _turn_pass(turn_bars, WG, PINGPONG, turns)
    return warpgroup_mma_wait(num_outstanding=0, deps=[qk]), tk


@gluon.jit
def _softmax(sc, m_i, l_i, acc, scale_log2, dtype: gl.constexpr, PA: gl.constexpr,
             POLY: gl.constexpr = 0,
             LAZY: gl.constexpr = False, TREE: gl.constexpr = False):  # fmt: skip
    """One tile's online-softmax step on its masked raw scores ``sc``: the new row maxima and
    sums, the accumulator rescaled to the new maxima, and P as the P V MMA's register operand
    (POLY: `_probs`). LAZY: the
    lazy max (`_probs`), and a thread whose factors are exactly 1 skips its 64 multiplies
    (`lazy_rescale`). TREE: the row maxima and sums by trees (`row_max`, `row_sum`)."""
    m_new, p = _probs(sc, m_i, scale_log2, POLY, LAZY, TREE)
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + row_sum(p, TREE)
    acc = lazy_rescale(acc, gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), LAZY)
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
def _release_prev(empty_bars, it, t, STAGES: gl.constexpr):
    """RELEASE_LAG: this warpgroup releases the stage of its tile before tile ``t`` of the
    item (global tile count ``it``; nothing when ``t == 0``). The warpgroup's barrier first: every
    warp's P V of that tile has returned."""
    if t > 0:
        gl.thread_barrier()
        mbarrier.arrive(empty_bars.index((it - 1) % STAGES), count=1)


@gluon.jit
def _turn_wait(turn_bars, WG: gl.constexpr, tk, PINGPONG: gl.constexpr, on):
    """PINGPONG and ``on`` (the item takes turns): wait for this warpgroup's turn to issue MMAs;
    returns the turns taken."""
    if PINGPONG:
        mbarrier.wait(turn_bars.index(WG), tk & 1, pred=on)
        tk += on.to(gl.int32)
    return tk


@gluon.jit
def _turn_pass(turn_bars, WG: gl.constexpr, PINGPONG: gl.constexpr, on):
    """PINGPONG and ``on``: MMAs issued; the other warpgroup's turn."""
    if PINGPONG:
        mbarrier.arrive(turn_bars.index(1 - WG), count=1, pred=on)


@gluon.jit
def _half_keys(WG: gl.constexpr, q_buf, k_smem, v_smem, k_bars, v_bars, empty_bars, it, n_tiles,
               scale_log2, full_end, kv_end, seq_len, limit, STAGES: gl.constexpr):  # fmt: skip
    """A short item (its real rows all in the first 64) on both warpgroups: warpgroup WG scores
    rows ``[0, 64)`` against keys ``[WG H, WG H + H)`` of every tile (``H = BLOCK_N / 2``) and
    accumulates their P V, releasing each tile as the full path does. Returns its row maxima
    (from -1e30: a row may see no key in this half), row sums, accumulator and ``it``."""
    dtype: gl.constexpr = k_smem.dtype
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEAD_D: gl.constexpr = k_smem.shape[2]
    HALF: gl.constexpr = BLOCK_N // 2
    QK: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16]
    )
    PV: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_D, 16]
    )
    PA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=PV, k_width=2)
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HEAD_D // 8), HEAD_D // 8], [4, 1],
                                          [1, 0])  # fmt: skip
    cols = gl.arange(0, HALF, layout=gl.SliceLayout(0, QK))
    m_i = gl.full([64], -1.0e30, gl.float32, layout=gl.SliceLayout(1, QK))
    l_i = gl.zeros([64], gl.float32, layout=gl.SliceLayout(1, QK))
    acc = gl.zeros([64, HEAD_D], gl.float32, layout=PV)
    for t in range(n_tiles):
        s = it % STAGES
        ph = (it // STAGES) & 1
        start = t * BLOCK_N + WG * HALF
        mbarrier.wait(k_bars.index(s), ph)
        k_half = k_smem.index(s).slice(WG * HALF, HALF)
        qk = gl.zeros([64, HALF], gl.float32, layout=QK)
        qk = warpgroup_mma(q_buf, k_half.permute((1, 0)), qk, use_acc=False, is_async=True)
        qk = warpgroup_mma_wait(num_outstanding=0, deps=[qk])
        sc = _scores(qk, start, full_end, kv_end, limit, cols)
        m_i, l_i, acc, p_op = _softmax(sc, m_i, l_i, acc, scale_log2, dtype, PA)
        v_half = v_smem.index(s).slice(WG * HALF, HALF)
        mbarrier.wait(v_bars.index(s), ph)
        _zero_tail(v_half, start, seq_len, LOAD)
        acc = warpgroup_mma(p_op, v_half, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        gl.thread_barrier()
        mbarrier.arrive(empty_bars.index(s), count=1)
        it += 1
    return m_i, l_i, acc, it


@gluon.jit
def _merge(WG: gl.constexpr, nm, m_h, l_h, acc_h, merge_acc, merge_m, merge_l, merge_bars, item,
           outs, GROUP: gl.constexpr, HEAD_TILE: gl.constexpr, BLOCK_Q: gl.constexpr,
           SPLIT: gl.constexpr):  # fmt: skip
    """A short item's end (`_half_keys` on both warpgroups): warpgroup 1 hands its row maxima,
    sums and accumulator over in shared memory (once warpgroup 0 has read the previous ones);
    warpgroup 0 combines them with its own and writes the rows. Nothing without SPLIT (the
    buffers are then placeholders)."""
    if SPLIT:
        q_tile, head_tile, kv_head, q_start, q_len = item
        out_ptr, stride_o_tok, stride_o_head, stride_o_dim = outs
        PV: gl.constexpr = acc_h.type.layout
        PV_ROW: gl.constexpr = gl.SliceLayout(1, PV)
        HEAD_D: gl.constexpr = acc_h.shape[1]
        ML: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        if WG == 1:
            mbarrier.wait(merge_bars.index(1), (nm & 1) ^ 1, pred=nm > 0)
            merge_acc.store(acc_h)
            merge_m.store(gl.convert_layout(m_h, ML))
            merge_l.store(gl.convert_layout(l_h, ML))
            gl.thread_barrier()
            mbarrier.arrive(merge_bars.index(0), count=1)
        else:
            mbarrier.wait(merge_bars.index(0), nm & 1)
            acc_o = merge_acc.load(PV)
            m_o = gl.convert_layout(merge_m.load(ML), m_h.type.layout)
            l_o = gl.convert_layout(merge_l.load(ML), m_h.type.layout)
            gl.thread_barrier()
            mbarrier.arrive(merge_bars.index(1), count=1)
            m_new = gl.maximum(m_h, m_o)
            a_h = gl.exp2(m_h - m_new)
            a_o = gl.exp2(m_o - m_new)
            l_new = l_h * a_h + l_o * a_o
            acc = acc_h * gl.convert_layout(a_h, PV_ROW)[:, None]
            acc = acc + acc_o * gl.convert_layout(a_o, PV_ROW)[:, None]
            o = acc / gl.convert_layout(l_new, PV_ROW)[:, None]
            tok_o, head_o, real_o = _rows(0, q_tile, head_tile, kv_head, q_start, q_len, GROUP,
                                          HEAD_TILE, BLOCK_Q, PV_ROW)  # fmt: skip
            do = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, PV))
            o_rows = tok_o * stride_o_tok + head_o * stride_o_head
            dtype: gl.constexpr = out_ptr.dtype.element_ty
            gl.store(out_ptr + o_rows[:, None] + do[None, :] * stride_o_dim, o.to(dtype),
                     mask=real_o[:, None])  # fmt: skip


@gluon.jit
def _consumer(WG: gl.constexpr, rt, SLOTS: gl.constexpr, HEAD_TILES: gl.constexpr,
              GROUP: gl.constexpr, HEAD_TILE: gl.constexpr, BLOCK_Q: gl.constexpr,
              STAGES: gl.constexpr, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr,
              SPLIT: gl.constexpr, Q_VEC: gl.constexpr, O_VEC: gl.constexpr,
              RELEASE_LAG: gl.constexpr, V_PAGES: gl.constexpr, POLY: gl.constexpr,
              LAZY: gl.constexpr, TREE: gl.constexpr, DYNAMIC: gl.constexpr,
              Q_TMA: gl.constexpr, AHEAD: gl.constexpr, K_AHEAD: gl.constexpr,
              TRACE: gl.constexpr):  # fmt: skip
    """Warpgroup WG: rows ``[64 WG, 64 WG + 64)`` of every item of this program. OVERLAP: the
    scores of tile t are issued with P V of tile t-1 and tile t's softmax runs under the latter;
    PINGPONG: the two warpgroups issue their MMAs in turns (module doc). RELEASE_LAG (the
    sequential loop only, `Sm90PrefillTile.release_lag`): tile t's stage is released after tile
    t+1's scores (1) or just before its P V (2), not after tile t's P V (0); an item's last tile
    at the item's end. V_PAGES (> 1; the sequential loop, with or without turns): V tiles
    arrive as that many page boxes of one copy each (`_v_page`), and P V reads them through one
    layout (`_pv_pages`). Q_VEC / O_VEC: the
    query's / output's rows are aligned (`rows_aligned`): the query is read 16 bytes a thread,
    the output written 4; else element by element. Q_TMA: the producer loads the query rows
    (`_load_query`); the warpgroup waits for them at the item's start and frees its buffer once
    the item's last score MMA has returned (`_query_freed`). AHEAD: the next item's step and
    values are taken before this item's epilogue (`_next_item`). K_AHEAD (turns only): a tile's
    K buffer is freed on ``kfree_bars`` as soon as its scores have returned, its V buffer on
    ``empty_bars`` after its P V (`_producer`); a warpgroup that passes tiles on frees both."""
    (work_ptr, b_off, num_q_tiles, qsl_ptr, seq_lens_ptr, q_ptr, out_ptr, stride_q_tok,
     stride_q_head, stride_q_dim, stride_o_tok, stride_o_head, stride_o_dim, scale_log2, k_smem,
     v_smem, k_bars, v_bars, empty_bars, kfree_bars, q_smem, turn_bars, merge_acc, merge_m,
     merge_l, merge_bars, ring, ring_bars, q_full, q_free, trace_ptr) = rt  # fmt: skip
    gl.static_assert(not (Q_TMA and SPLIT), "Q_TMA: the split short items store their own query")
    # (the launcher takes Q_TMA only with turns, `q_tma`: the sequential loop frees no buffer)
    gl.static_assert(not Q_TMA or PINGPONG, "Q_TMA: only with ping-pong turns")
    gl.static_assert(not K_AHEAD or (PINGPONG and not OVERLAP and not SPLIT),
                     "K_AHEAD: only the turns' loop frees K buffers early")  # fmt: skip
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
    mine_b, n, off = _share(work_ptr, SLOTS, DYNAMIC)
    lists = (work_ptr, mine_b, n, off, b_off, num_q_tiles, qsl_ptr, seq_lens_ptr)
    it = 0
    tk = 0  # turns taken (PINGPONG)
    nm = 0  # short items merged (SPLIT)
    nq = 0  # items whose query rows the producer loaded (Q_TMA)
    step = 0
    cur = _take(ring, ring_bars, step, DYNAMIC)
    if AHEAD:
        nxt = _item(lists, cur, SLOTS, BLOCK_Q, BLOCK_N, DYNAMIC, True)
    while cur < n:
        if AHEAD:
            seq, slot, q_tile, q_start, q_len, seq_len, ctx_len, kv_end, full_end, n_tiles = nxt
        else:
            seq, slot, q_tile, q_start, q_len, seq_len, ctx_len, kv_end, full_end, n_tiles = _item(
                lists, cur, SLOTS, BLOCK_Q, BLOCK_N, DYNAMIC
            )
        kv_head = slot // HEAD_TILES
        head_tile = slot % HEAD_TILES
        # a warpgroup none of whose rows is real (a decode item's second warpgroup, or a short
        # last q tile) only passes the item's tiles on: waits for each, releases it (in order,
        # so its release lands in the stage's current phase), and takes no ping-pong turns.
        # SPLIT: an item whose real rows all lie in the first 64 (a decode item, a short last q
        # tile) runs on both warpgroups instead, each on half of every tile's keys (`_half_keys`),
        # warpgroup 1 handing its row maxima, sums and accumulator to warpgroup 0 through shared
        # memory at the end (one merge buffer: warpgroup 1 waits until 0 has read the last one)
        if SPLIT:
            short = (ROWS // HEAD_TILE >= BLOCK_Q) | (q_tile * BLOCK_Q + ROWS // HEAD_TILE >= q_len)
            short = short | (head_tile * HEAD_TILE + ROWS % HEAD_TILE >= GROUP)
        else:
            short = False
        if WG == 0:
            idle = False
        else:
            r0: gl.constexpr = WG * ROWS
            idle = (r0 // HEAD_TILE >= BLOCK_Q) | (q_tile * BLOCK_Q + r0 // HEAD_TILE >= q_len)
            idle = idle | (head_tile * HEAD_TILE + r0 % HEAD_TILE >= GROUP)
        # PINGPONG: an item takes turns only where warpgroup 1 has real rows (both warpgroups
        # compute the same: a prefix of the rows is real); else (a decode item, a short last q
        # tile) warpgroup 0 runs it alone while 1 passes its tiles on, or with SPLIT both run it
        # by halves of the keys (`_half_keys`), neither taking turns
        turns = (q_tile * BLOCK_Q + ROWS // HEAD_TILE < q_len) & (ROWS // HEAD_TILE < BLOCK_Q)
        turns = turns & (head_tile * HEAD_TILE + ROWS % HEAD_TILE < GROUP)
        if SPLIT and short:  # (SPLIT first: no dead branch reaches the compiler)
            _store_query(q_buf, 0, (q_ptr, stride_q_tok, stride_q_head, stride_q_dim),
                         (q_tile, head_tile, kv_head, q_start, q_len), GROUP, HEAD_TILE,
                         BLOCK_Q, Q_VEC, LOAD)  # fmt: skip
            QK_H: gl.constexpr = gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N // 2, 16]
            )
            rs_h = gl.arange(0, ROWS, layout=gl.SliceLayout(1, QK_H))
            limit_h = ctx_len + q_tile * BLOCK_Q + rs_h // HEAD_TILE + 1
            m_h, l_h, acc_h, it = _half_keys(WG, q_buf, k_smem, v_smem, k_bars, v_bars,
                                             empty_bars, it, n_tiles, scale_log2, full_end,
                                             kv_end, seq_len, limit_h, STAGES)  # fmt: skip
            outs = (out_ptr, stride_o_tok, stride_o_head, stride_o_dim)
            item = (q_tile, head_tile, kv_head, q_start, q_len)
            if AHEAD:
                cur_n, nxt = _next_item(ring, ring_bars, step + 1, lists, SLOTS, BLOCK_Q, BLOCK_N,
                                        DYNAMIC)  # fmt: skip
            _merge(WG, nm, m_h, l_h, acc_h, merge_acc, merge_m, merge_l, merge_bars, item, outs,
                   GROUP, HEAD_TILE, BLOCK_Q, SPLIT)  # fmt: skip
            nm += 1
        elif idle:
            if Q_TMA:  # (the producer loads every warpgroup's rows: pass the buffer on)
                mbarrier.wait(q_full.index(WG), nq & 1)
                _query_freed(q_free, WG, Q_TMA)
            for _t in range(n_tiles):
                s = it % STAGES
                ph = (it // STAGES) & 1
                jt = trace_slot(it, TRACE, TRACE_TILES)
                _stamp(tr, jt, 0, TRACE)
                mbarrier.wait(k_bars.index(s), ph)
                _stamp(tr, jt, 1, TRACE)
                mbarrier.wait(v_bars.index(s), ph)
                _stamp(tr, jt, 4, TRACE)
                mbarrier.arrive(empty_bars.index(s), count=1)
                if K_AHEAD:
                    mbarrier.arrive(kfree_bars.index(s), count=1)
                _stamp(tr, jt, 6, TRACE)
                it += 1
            if AHEAD:
                cur_n, nxt = _next_item(ring, ring_bars, step + 1, lists, SLOTS, BLOCK_Q, BLOCK_N,
                                        DYNAMIC)  # fmt: skip
        else:
            _stamp(tr, trace_slot(it, TRACE, TRACE_TILES), 7, TRACE)
            # -- this warpgroup's query rows into shared memory (the score MMA's A operand) --
            if Q_TMA:
                mbarrier.wait(q_full.index(WG), nq & 1)
            else:
                _store_query(q_buf, WG, (q_ptr, stride_q_tok, stride_q_head, stride_q_dim),
                             (q_tile, head_tile, kv_head, q_start, q_len), GROUP, HEAD_TILE,
                             BLOCK_Q, Q_VEC, LOAD)  # fmt: skip
            # each row sees the positions < its limit (>= 1: no row is ever fully masked)
            rs = WG * ROWS + gl.arange(0, ROWS, layout=ROW)
            limit = ctx_len + q_tile * BLOCK_Q + rs // HEAD_TILE + 1
            cols = gl.arange(0, BLOCK_N, layout=COL)
            m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=ROW)
            l_i = gl.zeros([ROWS], gl.float32, layout=ROW)
            acc = gl.zeros([ROWS, HEAD_D], gl.float32, layout=PV)
            if OVERLAP:
                # tile 0: its scores alone
                qk, tk = _first_scores(q_buf, k_smem, k_bars, it, turn_bars, WG, tk, PINGPONG,
                                       turns, QK)  # fmt: skip
                sc = _scores(qk, 0, full_end, kv_end, limit, cols)
                m_i, p = _probs(sc, m_i, scale_log2, POLY, LAZY, TREE)  # from -inf: the tile's
                l_i = row_sum(p, TREE)
                p_op = gl.convert_layout(p.to(dtype), PA)
                for t in range(1, n_tiles):
                    sp = it % STAGES  # tile t-1's stage
                    php = (it // STAGES) & 1
                    it += 1
                    s = it % STAGES
                    mbarrier.wait(k_bars.index(s), (it // STAGES) & 1)
                    # (tile t-1 ends before kv_end <= seq_len: its V rows are all real)
                    mbarrier.wait(v_bars.index(sp), php)
                    tk = _turn_wait(turn_bars, WG, tk, PINGPONG, turns)
                    qk = warpgroup_mma(q_buf, k_smem.index(s).permute((1, 0)),
                                       gl.zeros([ROWS, BLOCK_N], gl.float32, layout=QK),
                                       use_acc=False, is_async=True)  # fmt: skip
                    acc = warpgroup_mma(p_op, v_smem.index(sp), acc, is_async=True)
                    _turn_pass(turn_bars, WG, PINGPONG, turns)
                    qk = warpgroup_mma_wait(num_outstanding=1, deps=[qk])
                    sc = _scores(qk, t * BLOCK_N, full_end, kv_end, limit, cols)
                    m_new, p = _probs(sc, m_i, scale_log2, POLY, LAZY, TREE)
                    alpha = gl.exp2(m_i - m_new)
                    l_i = l_i * alpha + row_sum(p, TREE)
                    m_i = m_new
                    acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=[acc, p_op])
                    gl.thread_barrier()
                    mbarrier.arrive(empty_bars.index(sp), count=1)
                    acc = lazy_rescale(acc, gl.convert_layout(alpha, PV_ROW), LAZY)
                    p_op = gl.convert_layout(p.to(dtype), PA)
                _query_freed(q_free, WG, Q_TMA)  # (the item's last scores have returned)
                # the last tile's P V
                s = it % STAGES
                v_buf = v_smem.index(s)
                mbarrier.wait(v_bars.index(s), (it // STAGES) & 1)
                _zero_tail(v_buf, (n_tiles - 1) * BLOCK_N, seq_len, LOAD)
                tk = _turn_wait(turn_bars, WG, tk, PINGPONG, turns)
                acc = warpgroup_mma(p_op, v_buf, acc, is_async=True)
                _turn_pass(turn_bars, WG, PINGPONG, turns)
                acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=[acc, p_op])
                gl.thread_barrier()
                mbarrier.arrive(empty_bars.index(s), count=1)
                it += 1
            elif PINGPONG:
                # turns in the sequential loop: one turn issues P V of tile t and the scores of
                # tile t+1 (the item's first scores, and the last tile's P V, take a turn of
                # their own), then passes, so that the other warpgroup's MMAs run under this
                # one's softmax. Both are waited after the pass (P V first: issued first).
                # Trace steps: 1 = 0 (K is waited before the turn), 2 the softmax's start, 5
                # the turn, the issues and the P V wait, 6 the release and the scores' wait
                qk, tk = _first_scores(q_buf, k_smem, k_bars, it, turn_bars, WG, tk, PINGPONG,
                                       turns, QK)  # fmt: skip
                if K_AHEAD:  # the first tile's K buffer (its scores have returned)
                    gl.thread_barrier()
                    mbarrier.arrive(kfree_bars.index(it % STAGES), count=1)
                for t in range(n_tiles - 1):
                    s = it % STAGES
                    jt = trace_slot(it, TRACE, TRACE_TILES)
                    _stamp(tr, jt, 0, TRACE)
                    _stamp(tr, jt, 1, TRACE)
                    _stamp(tr, jt, 2, TRACE)
                    sc = _scores(qk, t * BLOCK_N, full_end, kv_end, limit, cols)
                    m_i, l_i, acc, p_op = _softmax(sc, m_i, l_i, acc, scale_log2, dtype, PA,
                                                   POLY, LAZY, TREE)  # fmt: skip
                    _stamp(tr, jt, 3, TRACE)
                    # tile t is not the item's last: it ends before kv_end <= seq_len, its V
                    # rows are all real
                    mbarrier.wait(v_bars.index(s), (it // STAGES) & 1)
                    s2 = (it + 1) % STAGES
                    mbarrier.wait(k_bars.index(s2), ((it + 1) // STAGES) & 1)
                    _stamp(tr, jt, 4, TRACE)
                    tk = _turn_wait(turn_bars, WG, tk, PINGPONG, turns)
                    if V_PAGES > 1:
                        acc = _pv_pages(p_op, v_smem.index(s), acc, V_PAGES)
                    else:
                        acc = warpgroup_mma(p_op, v_smem.index(s), acc, is_async=True)
                    qk = warpgroup_mma(q_buf, k_smem.index(s2).permute((1, 0)),
                                       gl.zeros([ROWS, BLOCK_N], gl.float32, layout=QK),
                                       use_acc=False, is_async=True)  # fmt: skip
                    _turn_pass(turn_bars, WG, PINGPONG, turns)
                    acc, p_op = warpgroup_mma_wait(num_outstanding=1, deps=[acc, p_op])
                    _stamp(tr, jt, 5, TRACE)
                    gl.thread_barrier()
                    mbarrier.arrive(empty_bars.index(s), count=1)
                    qk = warpgroup_mma_wait(num_outstanding=0, deps=[qk])
                    if K_AHEAD:  # tile t+1's K buffer (its scores have returned; its stage
                        # from s, live here, not s2: holding s2 through the MMAs spilled 12 B)
                        gl.thread_barrier()
                        mbarrier.arrive(kfree_bars.index((s + 1) % STAGES), count=1)
                    _stamp(tr, jt, 6, TRACE)
                    it += 1
                _query_freed(q_free, WG, Q_TMA)  # (the item's last scores have returned)
                # the last tile: its softmax, then its P V in a turn of its own
                s = it % STAGES
                start = (n_tiles - 1) * BLOCK_N
                jt = trace_slot(it, TRACE, TRACE_TILES)
                _stamp(tr, jt, 0, TRACE)
                _stamp(tr, jt, 1, TRACE)
                _stamp(tr, jt, 2, TRACE)
                sc = _scores(qk, start, full_end, kv_end, limit, cols)
                m_i, l_i, acc, p_op = _softmax(sc, m_i, l_i, acc, scale_log2, dtype, PA,
                                               POLY, LAZY, TREE)  # fmt: skip
                _stamp(tr, jt, 3, TRACE)
                v_buf = v_smem.index(s)
                mbarrier.wait(v_bars.index(s), (it // STAGES) & 1)
                _zero_tail(v_buf, start, seq_len, LOAD, V_PAGES)
                _stamp(tr, jt, 4, TRACE)
                tk = _turn_wait(turn_bars, WG, tk, PINGPONG, turns)
                if V_PAGES > 1:
                    acc = _pv_pages(p_op, v_buf, acc, V_PAGES)
                else:
                    acc = warpgroup_mma(p_op, v_buf, acc, is_async=True)
                _turn_pass(turn_bars, WG, PINGPONG, turns)
                acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=[acc, p_op])
                _stamp(tr, jt, 5, TRACE)
                gl.thread_barrier()
                mbarrier.arrive(empty_bars.index(s), count=1)
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
                    if RELEASE_LAG == 1:  # the previous tile's stage (its P V has returned)
                        _release_prev(empty_bars, it, t, STAGES)
                    _stamp(tr, jt, 2, TRACE)
                    sc = _scores(qk, start, full_end, kv_end, limit, cols)
                    m_i, l_i, acc, p_op = _softmax(sc, m_i, l_i, acc, scale_log2, dtype, PA,
                                                   POLY, LAZY, TREE)  # fmt: skip
                    _stamp(tr, jt, 3, TRACE)
                    v_buf = v_smem.index(s)
                    mbarrier.wait(v_bars.index(s), ph)
                    _zero_tail(v_buf, start, seq_len, LOAD, V_PAGES)
                    if RELEASE_LAG == 2:
                        _release_prev(empty_bars, it, t, STAGES)
                    _stamp(tr, jt, 4, TRACE)
                    if V_PAGES > 1:
                        acc = _pv_pages(p_op, v_buf, acc, V_PAGES)
                    else:
                        acc = warpgroup_mma(p_op, v_buf, acc, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
                    _stamp(tr, jt, 5, TRACE)
                    if RELEASE_LAG == 0:
                        gl.thread_barrier()
                        mbarrier.arrive(empty_bars.index(s), count=1)
                    _stamp(tr, jt, 6, TRACE)
                    it += 1
                if RELEASE_LAG != 0:  # the item's last tile
                    _release_prev(empty_bars, it, n_tiles, STAGES)
            if AHEAD:
                cur_n, nxt = _next_item(ring, ring_bars, step + 1, lists, SLOTS, BLOCK_Q, BLOCK_N,
                                        DYNAMIC)  # fmt: skip
            # -- epilogue: this warpgroup's rows to the output (4-byte stores into aligned rows;
            # through the query buffer for 16-byte ones, ptxas spilled 12 B) --
            o = acc / gl.convert_layout(l_i, PV_ROW)[:, None]
            tok_o, head_o, real_o = _rows(WG, q_tile, head_tile, kv_head, q_start, q_len, GROUP,
                                          HEAD_TILE, BLOCK_Q, PV_ROW)  # fmt: skip
            do = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, PV))
            o_rows = tok_o * stride_o_tok + head_o * stride_o_head
            o_ptrs = row_ptrs(out_ptr, o_rows, do, stride_o_dim, O_VEC, 8)
            gl.store(o_ptrs, o.to(dtype), mask=real_o[:, None])
            _stamp(tr, trace_slot(it - 1, TRACE, TRACE_TILES), 8, TRACE)
        nq += 1
        step += 1
        if AHEAD:  # noqa: SIM108 (a constexpr branch: the other side is never compiled)
            cur = cur_n
        else:
            cur = _take(ring, ring_bars, step, DYNAMIC)
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
    work_ptr,  # `_work_list_kernel`'s lists
    b_off,  # where the second list starts (`WorkListLayout`)
    counter,  # where the dynamic deal's counter is (`WorkListLayout`)
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
    OVERLAP: gl.constexpr,
    PINGPONG: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
    PRODUCER_WARPS_: gl.constexpr,
    NUM_WG: gl.constexpr,  # consumer warpgroups (64 rows each)
    SPLIT: gl.constexpr,  # short items on both warpgroups, half the keys each (two, sequential)
    RELEASE_LAG: gl.constexpr,  # when a stage is released (`Sm90PrefillTile.release_lag`)
    V_PAGES: gl.constexpr,  # > 1: V tiles as that many one-copy page boxes (`v_pages`)
    EXP2_POLY: gl.constexpr,  # exponentials of every 4 by the polynomial (`exp2_split`)
    LAZY: gl.constexpr,  # lazy running max, rescales skipped at factor 1 (`lazy_rescale`)
    TREE: gl.constexpr,  # row maxima and sums by trees (`_softmax`)
    Q_VEC: gl.constexpr,  # the query's rows aligned (`rows_aligned`)
    O_VEC: gl.constexpr,  # the output's rows aligned
    DYNAMIC: gl.constexpr,  # items taken from a counter as programs free up (`_grab`), not dealt
    Q_TMA: gl.constexpr,  # the producer loads the query rows (`_load_query`)
    AHEAD: gl.constexpr,  # a warpgroup's next item taken before its epilogue (`_next_item`)
    K_AHEAD: gl.constexpr,  # K buffers freed at the scores, K a tile ahead of V (`_producer`)
    PAGING: gl.constexpr,  # how a tile's boxes find their pages (`paging`, `_tile_rows`)
    trace_ptr,  # int64 clock stamps (TRACE only; `TRACE_BUFFER`)
    TRACE: gl.constexpr,
):
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    KV_LAYOUT: gl.constexpr = k_desc.layout
    HEAD_TILES: gl.constexpr = (GROUP + HEAD_TILE - 1) // HEAD_TILE
    q_smem = gl.allocate_shared_memory(dtype, [NUM_WG, 64, HEAD_D], Q_LAYOUT)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], KV_LAYOUT)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], KV_LAYOUT)
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    if K_AHEAD:
        kfree_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    else:
        kfree_bars = empty_bars  # (never waited or arrived on)
    turn_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    # SPLIT: warpgroup 1's accumulator, row maxima and sums for warpgroup 0 (`_consumer`)
    MR: gl.constexpr = 64 if SPLIT else 2
    MD: gl.constexpr = HEAD_D if SPLIT else 2
    PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    merge_acc = gl.allocate_shared_memory(gl.float32, [MR, MD], PLAIN)
    ROW1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    merge_m = gl.allocate_shared_memory(gl.float32, [MR], ROW1)
    merge_l = gl.allocate_shared_memory(gl.float32, [MR], ROW1)
    merge_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    # DYNAMIC: the producer's ring of item steps for the consumers (`_grab`, `_take`)
    RING: gl.constexpr = STAGES + ITEM_RING_EXTRA if DYNAMIC else 1
    ring = gl.allocate_shared_memory(gl.int32, [RING, 1], ROW1)  # (one slot's layout)
    ring_bars = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    for r in gl.static_range(RING):
        mbarrier.init(ring_bars.index(r), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(s), count=1)
        mbarrier.init(v_bars.index(s), count=1)
        mbarrier.init(empty_bars.index(s), count=NUM_WG)  # one arrival per consumer warpgroup
        if K_AHEAD:
            mbarrier.init(kfree_bars.index(s), count=NUM_WG)
    for w in gl.static_range(2):
        mbarrier.init(turn_bars.index(w), count=1)
        mbarrier.init(merge_bars.index(w), count=1)
    # Q_TMA: each warpgroup's query buffer loaded (the producer's copy) and freed (the warpgroup)
    q_full = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(NUM_WG):
        mbarrier.init(q_full.index(w), count=1)
        mbarrier.init(q_free.index(w), count=1)
    mbarrier.arrive(turn_bars.index(0), count=1, pred=PINGPONG)  # warpgroup 0 goes first
    fence_async_shared()
    prod = (work_ptr, b_off, num_q_tiles, query_start_loc_ptr, seq_lens_ptr, block_table_ptr,
            stride_bt_seq, stride_bt_blk, block_size, rows_per_page, total_rows, stride_kcol,
            stride_vcol, k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, empty_bars, kfree_bars,
            work_ptr + counter, ring, ring_bars, q_desc, q_smem, q_full, q_free,
            trace_ptr)  # fmt: skip
    cons = (work_ptr, b_off, num_q_tiles, query_start_loc_ptr, seq_lens_ptr, q_ptr, out_ptr,
            stride_q_tok, stride_q_head, stride_q_dim, stride_o_tok, stride_o_head, stride_o_dim,
            scale_log2, k_smem, v_smem, k_bars, v_bars, empty_bars, kfree_bars, q_smem, turn_bars,
            merge_acc, merge_m, merge_l, merge_bars, ring, ring_bars, q_full, q_free,
            trace_ptr)  # fmt: skip
    if NUM_WG == 2:
        gl.warp_specialize(
            [
                (_consumer, (0, cons, SLOTS, HEAD_TILES, GROUP, HEAD_TILE, BLOCK_Q, STAGES,
                             OVERLAP, PINGPONG, SPLIT, Q_VEC, O_VEC, RELEASE_LAG,
                             V_PAGES, EXP2_POLY, LAZY, TREE, DYNAMIC, Q_TMA, AHEAD, K_AHEAD,
                             TRACE)),
                (_consumer, (1, cons, SLOTS, HEAD_TILES, GROUP, HEAD_TILE, BLOCK_Q, STAGES,
                             OVERLAP, PINGPONG, SPLIT, Q_VEC, O_VEC, RELEASE_LAG,
                             V_PAGES, EXP2_POLY, LAZY, TREE, DYNAMIC, Q_TMA, AHEAD, K_AHEAD,
                             TRACE)),
                (_producer, (prod, SLOTS, HEAD_TILES, BLOCK_Q, STAGES, BOX, V_PAGES, DYNAMIC,
                             GROUP, HEAD_TILE, NUM_WG, Q_TMA, K_AHEAD, PAGING, TRACE)),
            ],
            [4, PRODUCER_WARPS_],
            [CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip
    else:
        gl.static_assert(NUM_WG == 3)
        gl.warp_specialize(
            [
                (_consumer, (0, cons, SLOTS, HEAD_TILES, GROUP, HEAD_TILE, BLOCK_Q, STAGES,
                             OVERLAP, False, False, Q_VEC, O_VEC, RELEASE_LAG,
                             V_PAGES, EXP2_POLY, LAZY, TREE, DYNAMIC, Q_TMA, AHEAD, K_AHEAD,
                             TRACE)),
                (_consumer, (1, cons, SLOTS, HEAD_TILES, GROUP, HEAD_TILE, BLOCK_Q, STAGES,
                             OVERLAP, False, False, Q_VEC, O_VEC, RELEASE_LAG,
                             V_PAGES, EXP2_POLY, LAZY, TREE, DYNAMIC, Q_TMA, AHEAD, K_AHEAD,
                             TRACE)),
                (_consumer, (2, cons, SLOTS, HEAD_TILES, GROUP, HEAD_TILE, BLOCK_Q, STAGES,
                             OVERLAP, False, False, Q_VEC, O_VEC, RELEASE_LAG,
                             V_PAGES, EXP2_POLY, LAZY, TREE, DYNAMIC, Q_TMA, AHEAD, K_AHEAD,
                             TRACE)),
                (_producer, (prod, SLOTS, HEAD_TILES, BLOCK_Q, STAGES, BOX, V_PAGES, DYNAMIC,
                             GROUP, HEAD_TILE, NUM_WG, Q_TMA, K_AHEAD, PAGING, TRACE)),
            ],
            [4, 4, PRODUCER_WARPS_],
            [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip


# -- host side ----------------------------------------------------------------------------------


def k_ahead(tile: paged_policy.Sm90PrefillTile, split: bool) -> bool:
    """Whether the launch frees K buffers at the scores and copies K a tile ahead of V
    (`SM90_PREFILL_K_AHEAD`): only where the tile takes turns, without OVERLAP or the short
    items' split (`_consumer`)."""
    return (
        bool(paged_policy.SM90_PREFILL_K_AHEAD)
        and takes_turns(tile)
        and not paged_policy.SM90_PREFILL_OVERLAP
        and not split
    )


def box_rows(block_size: int, block_n: int) -> int:
    """Rows per TMA box: the largest power of two dividing ``block_size``, at most ``block_n``
    (a box never crosses a page)."""
    return min(block_n, block_size & -block_size)


def paging(block_size: int, box: int, block_n: int) -> int:
    """How the producer finds a tile's boxes' pages (`_tile_rows`): 1 where a box is a whole
    page, 2 where a page holds a tile or more, else 0 (a division a box); 0 with
    `SM90_PREFILL_PAGING` off. ``box`` is `box_rows`'s: it divides both the page and the tile, so
    no box crosses a page and, in case 2, a tile holds at most one page edge."""
    if not paged_policy.SM90_PREFILL_PAGING:
        return 0
    if box == block_size:
        return 1
    return 2 if block_size >= block_n else 0


def smem_bytes(tile: Sm90PrefillTile, head_dim: int, elem: int = 2, split: bool = False) -> int:
    """Shared memory this kernel allocates, an upper bound: Q (64 rows a warpgroup), ``stages``
    K and V tiles, the merge buffer of short items on two warpgroups (``split``: 64 rows of fp32
    accumulator, maxima and sums), the barriers (Q_TMA's two a warpgroup among them), the dynamic
    deal's ring (`_grab`: a word and a barrier a slot) and 1 KB for Triton's alignment."""
    q = 64 * tile.warpgroups * head_dim * elem
    kv = 2 * tile.stages * tile.block_n * head_dim * elem
    merge = 64 * (head_dim + 2) * 4 if split else 2 * 2 * 4 + 2 * 2 * 4
    ring = (tile.stages + ITEM_RING_EXTRA.value) * (4 + 8)
    bars = 3 * tile.stages + 4 + 2 * tile.warpgroups
    return q + kv + merge + bars * 8 + ring + 1024


def split_short(tile: Sm90PrefillTile, head_dim: int, elem: int, target: Target) -> bool:
    """Whether a short item (real rows all in the first 64) runs on both warpgroups, half of
    each tile's keys apiece (`SM90_PREFILL_SPLIT_SHORT`): two warpgroups, the sequential
    schedule, and the merge buffer within the target's shared memory."""
    return (
        paged_policy.SM90_PREFILL_SPLIT_SHORT
        and tile.warpgroups == 2
        and not paged_policy.SM90_PREFILL_OVERLAP
        and smem_bytes(tile, head_dim, elem, split=True) <= target.max_shared_mem
    )


def _rows_per_page(cache: torch.Tensor) -> int:
    return cache.stride(0) // cache.stride(1) if cache.stride(1) else 0


def sm90_prefill_errors(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, layout: str,
    target: Target,
) -> list[str]:  # fmt: skip
    """Why this kernel cannot serve a launch (empty: it can); module doc, Requirements."""
    head_dim = query.shape[-1]
    tile = paged_policy.SM90_PREFILL_TILES.get(head_dim)
    rules = [
        (target.arch == "sm_90", f"target {target.arch} is not sm_90"),
        (query.dtype in _GL_DTYPES, f"dtype {query.dtype} is not fp16/bf16"),
        (layout == "NHD", f"layout {layout} is not NHD"),
        (tile is not None, f"head_dim {head_dim} not in {HEAD_DIMS}"),
        (query.device.type in ("cuda", "meta"), "not a CUDA (or meta) tensor"),
    ]
    # the policy's tile and the one a launch may take instead (`query_tile`): both must run
    fallback = paged_policy.SM90_PREFILL_NO_TMA_TILES.get(head_dim)
    for which, t in (("tile", tile), ("fallback tile", fallback)):
        if t is None or (which != "tile" and t == tile):
            continue
        smem = smem_bytes(t, head_dim, query.element_size())
        rules.append(
            (
                smem <= target.max_shared_mem,
                f"{which} shared memory {smem} B > {target.max_shared_mem}",
            )
        )
        lag = t.release_lag
        schedule = _turns_or_overlap(t)
        rules += [
            (lag in (0, 1, 2), f"{which} release_lag {lag} not in (0, 1, 2)"),
            (
                lag == 0 or t.stages >= 3,
                f"{which} release_lag {lag} needs stages >= 3, got {t.stages} (the producer "
                "would wait for the stage of the tile the consumers need next)",
            ),
            (
                lag == 0 or not schedule,
                f"{which} release_lag {lag} is for the sequential schedule without turns "
                "(SM90_PREFILL_OVERLAP, SM90_PREFILL_PINGPONG or the tile's pingpong is on)",
            ),
        ]
    elem = query.element_size()
    rules.append(
        (
            key_cache.stride() == value_cache.stride(),
            f"key_cache strides {tuple(key_cache.stride())} differ from value_cache's "
            f"{tuple(value_cache.stride())} (one row map serves both)",
        )
    )
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        bs = c.shape[1]
        rules += [
            (bs % MIN_BOX == 0, f"{name} block_size {bs} is not a multiple of {MIN_BOX}"),
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


def _descriptor(cache: torch.Tensor, tile: Sm90PrefillTile, box: int) -> TensorDescriptor:
    """The cache's rows as one 2-D tensor: row ``page * rows_per_page + slot``, columns from
    the first KV head's first element (head ``h`` at ``h * stride(2)``); boxes ``[box, d]``."""
    d = cache.shape[3]
    cols = (cache.shape[2] - 1) * cache.stride(2) + d
    layout = gl.NVMMASharedLayout.get_default_for([tile.block_n, d], _GL_DTYPES[cache.dtype])
    return TensorDescriptor(
        cache, [_total_rows(cache), cols], [cache.stride(1), 1], [box, d], layout
    )


def query_tile(tile: Sm90PrefillTile, head_dim: int, query_by_tma: bool) -> Sm90PrefillTile:
    """The launch's tile before its page boxes are known: the policy's ``tile``, or where that
    takes turns of its own (`Sm90PrefillTile.pingpong`) but the query cannot come by TMA
    (``query_by_tma``: `q_tma`, and no split short items), `paged_policy.SM90_PREFILL_NO_TMA_TILES`'
    (the turns measured faster only with it; without it they spilled at GQA 5:1). The caller
    derives the launch's rows and q tiles from the tile this returns."""
    if tile.pingpong and tile.warpgroups == 2 and not query_by_tma:
        return paged_policy.SM90_PREFILL_NO_TMA_TILES.get(
            head_dim, dataclasses.replace(tile, pingpong=False)
        )
    return tile


def launch_tile(tile: Sm90PrefillTile, box: int, head_dim: int, elem: int,
                target: Target) -> Sm90PrefillTile:  # fmt: skip
    """The tile (`query_tile`'s) for a launch whose pages are ``box``-row boxes: where a tile has a
    count of boxes in `paged_policy.SM90_PREFILL_LATE_RELEASE_BOXES`, a two-stage tile of the
    sequential schedule runs 3 stages with release lag 2 (`Sm90PrefillTile.release_lag`) if they
    fit the target's shared memory and the short items' split (`split_short`, whose merge buffer
    would no longer fit) is not on; any other tile is the policy's."""
    late = dataclasses.replace(tile, stages=3, release_lag=2)
    take = (
        tile.block_n // box in paged_policy.SM90_PREFILL_LATE_RELEASE_BOXES
        and (tile.stages, tile.release_lag) == (2, 0)
        and not _turns_or_overlap(tile)
        and not split_short(tile, head_dim, elem, target)
        and smem_bytes(late, head_dim, elem) <= target.max_shared_mem
    )
    return late if take else tile


def takes_turns(tile: Sm90PrefillTile) -> bool:
    """Whether the launch's two warpgroups take ping-pong turns (``PINGPONG``): the tile's own
    `Sm90PrefillTile.pingpong` or `paged_policy.SM90_PREFILL_PINGPONG`, two warpgroups only."""
    return (tile.pingpong or paged_policy.SM90_PREFILL_PINGPONG) and tile.warpgroups == 2


def _turns_or_overlap(tile: Sm90PrefillTile) -> bool:
    """Whether the launch runs the overlapped loop or takes ping-pong turns: the loops that
    release each stage after its own P V (no late release)."""
    return paged_policy.SM90_PREFILL_OVERLAP or takes_turns(tile)


def v_pages(tile: Sm90PrefillTile, box: int, value_cache: torch.Tensor, split: bool) -> int:
    """How many one-copy page boxes a V tile arrives in (`paged_policy.SM90_PREFILL_V_PAGES`; 1:
    the tile's 2-D boxes, two copies each at head_dim 128): pages shorter than the tile,
    head_dim a power-of-two multiple of 64 above 64, KV heads a multiple of 64 columns apart,
    and the sequential loop, with or without ping-pong turns (the overlapped loop and the short
    items' split read V as one tile)."""
    d = value_cache.shape[3]
    ok = (
        paged_policy.SM90_PREFILL_V_PAGES
        and tile.block_n // box >= max(2, paged_policy.SM90_PREFILL_V_PAGES_MIN_BOXES)
        and d > 64
        and d % 64 == 0
        and (d // 64) & (d // 64 - 1) == 0  # `_pages_layout`: powers of two
        and value_cache.stride(2) % 64 == 0
        and tile.block_n // box in (2, 4, 8)  # (boxes of 16 rows at least)
        and not paged_policy.SM90_PREFILL_OVERLAP
        and not split
    )
    return tile.block_n // box if ok else 1


def _v_descriptor(cache: torch.Tensor, tile: Sm90PrefillTile, box: int) -> TensorDescriptor:
    """V_PAGES: the value cache's rows as ``[column groups of 64, rows, 64]`` (strides 64, the
    token stride, 1: the outer dimension's stride is the smaller one, which TMA allows; H100
    checked, bench/probe_v3d.py), box ``[head_dim // 64, box, 64]``: one copy lays a page box
    down as its own [box, head_dim] NVMMA tile (column halves major)."""
    d = cache.shape[3]
    cols = (cache.shape[2] - 1) * cache.stride(2) + d
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
    return TensorDescriptor(
        cache, [cols // 64, _total_rows(cache), 64], [64, cache.stride(1), 1],
        [d // 64, box, 64], layout,
    )  # fmt: skip


def q_tma(q: torch.Tensor, head_dim: int, head_tile: int) -> bool:
    """Whether the producer may load the query rows (`paged_policy.SM90_PREFILL_Q_TMA`): rows
    that TMA can address (`rows_aligned`), ``head_dim`` in whole 64-column groups (the 128-byte
    swizzle's), a warpgroup's 64 rows whole tokens of the head tile. The launch does so where it
    takes ping-pong turns (where it measured faster) and splits no short items (they store
    their query themselves)."""
    return (
        paged_policy.SM90_PREFILL_Q_TMA
        and rows_aligned(q)
        and head_dim % 64 == 0
        and head_tile <= 64
        and 64 % head_tile == 0
    )


def _q_descriptor(q: torch.Tensor, head_tile: int) -> TensorDescriptor:
    """Q_TMA: the query ``[tokens, heads, head_dim]`` as ``[column groups of 64, tokens, heads,
    64]`` (strides 64, the token and head strides, 1), box ``[head_dim // 64, 64 // head_tile,
    head_tile, 64]``: one copy lays a warpgroup's 64 rows (``token x head_tile + head``) down as
    its [64, head_dim] NVMMA tile, column halves major (as `_v_descriptor` does for V pages)."""
    d = q.shape[2]
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
    return TensorDescriptor(
        q, [d // 64, q.shape[0], q.shape[1], 64], [64, q.stride(0), q.stride(1), 1],
        [d // 64, 64 // head_tile, head_tile, 64], layout,
    )  # fmt: skip


def trace_shape(programs: int) -> tuple[int, int, int, int]:
    """The stamps `TRACE_BUFFER` holds for a launch of ``programs``, as ``[program, partition,
    tile, event]`` (the buffer needs their product of int64 words)."""
    return programs, TRACE_PARTS.value, TRACE_TILES.value + 1, TRACE_EVENTS.value


def _check_trace(buf: torch.Tensor, programs: int, args: dict, device: torch.device) -> None:
    """`TRACE_BUFFER` fits the launch, and the launch runs the schedule the trace stamps."""
    need = math.prod(trace_shape(programs))
    check_trace_buffer(
        buf, need, device, "programs x TRACE_PARTS x (TRACE_TILES + 1) x TRACE_EVENTS"
    )
    if args["OVERLAP"] or args["SPLIT"]:
        raise ValueError(
            "TRACE_BUFFER: the trace stamps the sequential schedule only; set "
            "SM90_PREFILL_OVERLAP and SM90_PREFILL_SPLIT_SHORT off (got OVERLAP="
            f"{args['OVERLAP']}, SPLIT={args['SPLIT']})"
        )


def sm90_prefill_launches(
    main: Launch,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    q_len_lo: int,
    fuse_decode: bool = False,
) -> list[Launch]:
    """The portable kernel's launch ``main``'s prefill part (sequences with ``q_len >
    q_len_lo``) by this kernel: the work-list launch, then the kernel's (same outputs).
    ``fuse_decode``: the other sequences (``0 < q_len <= q_len_lo``) too, their items spread
    among the prefill items (`program_items`); the caller then launches no decode part."""
    a = main.args
    head_dim = key_cache.shape[3]
    elem = key_cache.element_size()
    group = a["GROUP"]
    q = a["q_ptr"]
    tile = paged_policy.SM90_PREFILL_TILES[head_dim]
    by_tma = q_tma(q, head_dim, min(group, 64 * tile.warpgroups))
    by_tma = by_tma and not split_short(tile, head_dim, elem, main.target)
    tile = query_tile(tile, head_dim, by_tma)
    block_m = 64 * tile.warpgroups
    head_tile = min(group, block_m)
    block_q = block_m // head_tile
    slots = a["num_kv_heads"] * -(-group // head_tile)
    num_seqs = a["num_seqs"]
    num_q_tiles = max(1, -(-a["num_q_tiles"] * a["BLOCK_Q"] // block_q))
    device = main.args["q_ptr"].device
    layout = work_list_layout(num_seqs, num_q_tiles)
    work = torch.empty(layout.size, dtype=torch.int32, device=device)
    box = min(
        box_rows(key_cache.shape[1], tile.block_n), box_rows(value_cache.shape[1], tile.block_n)
    )
    tile = launch_tile(tile, box, head_dim, elem, main.target)
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
            q_len_min=0 if fuse_decode else q_len_lo,
            num_q_tiles=num_q_tiles,
            BLOCK_Q=block_q,
            BLOCK_S=128,
        ),
        options=LaunchOptions(4, 1),
        target=main.target,
        name="paged_attention:work_list",
        outputs=main.outputs,  # (the op's outputs: the plan cache returns the first launch's)
    )
    poly = paged_policy.SM90_PREFILL_EXP2_POLY
    if type(poly) is not int or not 0 <= poly <= EXP2_PACK:
        raise ValueError(
            f"portattn.policy.paged.SM90_PREFILL_EXP2_POLY {poly!r} is not an int in [0, "
            f"{EXP2_PACK}] (exponentials of every {EXP2_PACK} by the polynomial)"
        )
    dtype = _GL_DTYPES[key_cache.dtype]
    split = split_short(tile, head_dim, elem, main.target)
    nv = v_pages(tile, box, value_cache, split)
    use_q_tma = q_tma(q, head_dim, head_tile) and takes_turns(tile) and not split
    ka = k_ahead(tile, split)
    k_desc = _descriptor(key_cache, tile, box)
    args = dict(
        out_ptr=a["out_ptr"],
        q_ptr=a["q_ptr"],
        k_desc=k_desc,
        v_desc=(_v_descriptor if nv > 1 else _descriptor)(value_cache, tile, box),
        q_desc=_q_descriptor(q, head_tile) if use_q_tma else k_desc,  # (off: never read)
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
        BLOCK_N=tile.block_n,
        HEAD_D=head_dim,
        SLOTS=slots,
        STAGES=tile.stages,
        BOX=box,
        Q_LAYOUT=gl.NVMMASharedLayout.get_default_for([64, head_dim], dtype),
        OVERLAP=paged_policy.SM90_PREFILL_OVERLAP,
        PINGPONG=takes_turns(tile),
        CONSUMER_REGS=REGS[tile.warpgroups][0],
        PRODUCER_REGS=REGS[tile.warpgroups][1] + (K_AHEAD_REGS[nv > 1] if ka else 0),
        PRODUCER_WARPS_=PRODUCER_WARPS,
        NUM_WG=tile.warpgroups,
        SPLIT=split,
        RELEASE_LAG=tile.release_lag,
        V_PAGES=nv,
        EXP2_POLY=poly,
        LAZY=bool(paged_policy.SM90_PREFILL_LAZY_RESCALE),
        TREE=bool(paged_policy.SM90_PREFILL_TREE_REDUCE),
        Q_VEC=rows_aligned(a["q_ptr"]),
        O_VEC=rows_aligned(a["out_ptr"]),
        DYNAMIC=bool(paged_policy.SM90_PREFILL_DYNAMIC),
        Q_TMA=use_q_tma,
        AHEAD=bool(paged_policy.SM90_PREFILL_ITEM_AHEAD),
        K_AHEAD=ka,
        PAGING=paging(key_cache.shape[1], box, tile.block_n),
        # a placeholder pointer when off (never read)
        trace_ptr=TRACE_BUFFER if TRACE_BUFFER is not None else a["seq_lens_ptr"],
        TRACE=TRACE_BUFFER is not None,
    )
    if TRACE_BUFFER is not None:
        _check_trace(TRACE_BUFFER, main.target.num_sms, args, key_cache.device)
    kernel = Launch(
        kernel=_paged_prefill_sm90_kernel,
        grid=(main.target.num_sms,),
        args=args,
        options=LaunchOptions(NUM_WARPS, 1),
        target=main.target,
        name="paged_prefill_sm90",
        outputs=main.outputs,
        writes=main.writes,
    )
    return [work_launch, kernel]
