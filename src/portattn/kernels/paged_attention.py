"""Paged attention: chunked prefill and decode over a paged KV cache, in one launch.

For each sequence ``i`` with ``q_len_i = query_start_loc[i+1] - query_start_loc[i]`` new tokens
(the LAST ``q_len_i`` of its ``seq_lens[i]`` tokens), query token ``j`` attends to the context
positions ``< seq_lens[i] - q_len_i + j + 1`` (causal). Decode (``q_len_i == 1``), chunked prefill
(``1 < q_len_i < seq_lens[i]``) and pure prefill (``q_len_i == seq_lens[i]``) mix in one batch.

| tensor          | shape                                                    | dtype             |
|-----------------|----------------------------------------------------------|-------------------|
| query, out      | [num_tokens, num_q_heads, head_dim]                      | fp16, bf16, fp32  |
| key_cache       | NHD [num_blocks, block_size, num_kv_heads, head_dim]     | = query           |
|                 | SHUFFLE [num_blocks, num_kv_heads, head_dim//x, block_size, x] |             |
| value_cache     | NHD as key_cache;                                        | = query           |
|                 | SHUFFLE [num_blocks, num_kv_heads, block_size//x, head_dim, x] |             |
| block_table     | [num_seqs, max_blocks] (entries past a sequence's blocks ignored) | int32/64 |
| seq_lens        | [num_seqs]                                               | int32/int64       |
| query_start_loc | [num_seqs + 1]: 0, non-decreasing, ..., num_tokens       | int32/int64       |

Every tensor may have any strides (caches: slices of a wider buffer, a hybrid model's interleaved
``[K0][V0][S0][K1]...`` pages); the caches are addressed through `layout.describe_kv_cache`, with
block and in-block offset separately, so any ``block_size >= 1`` works (1, 16, 80, 544, 2048).
GQA/MQA: ``num_q_heads % num_kv_heads == 0``. ``head_dim <= 256`` (padded to a power of two).

Host reads and CUDA graphs: with ``max_query_len`` given (serving engines always know it) the
launcher reads no device tensor's contents -- the grid is sized from ``num_seqs``,
``max_query_len`` and, for split-KV, ``max_seq_len`` -- so a call is capturable in a CUDA graph and
replays with new metadata values of the same shapes. The content checks (``query_start_loc``
starts at 0, ends at ``num_tokens`` and never decreases, ``seq_lens >= q_len``, used block ids in
range, the maxima bound the real values) run when the tensors are on the CPU, or when
``max_query_len`` is not given (one device-to-host read of the metadata). On the GPU with the
maxima given, as in upstream engines, the caller vouches for the metadata.

Work decomposition (policy: `portattn.policy.paged`): a 1-D grid; programs of the main row tile
first, the last (longest, causally) q tile of every sequence first; in a mixed batch, sequences
with ``q_len <= decode.block_q`` are skipped by those and served by decode-sized programs at the
end of the grid. Each program walks its context in two loops: KV tiles entirely below the causal
limit of its first row without masks, then the rest up to the causal limit of its last row. A
decode batch too small to fill the GPU splits each context over ``num_splits`` programs whose
partial results (fp32, with a base-2 log-sum-exp) a second launch combines.

SHUFFLE caches take the same path as NHD: addresses are a token term plus a dim term,
and their x-element runs (16 bytes) are stated aligned (`layout.vector_width`, `tl.multiple_of`)
and constant per block-table entry (`tl.max_constancy`), so K and V load as 16-byte vectors,
pipelined like NHD's. V is read in whole runs; the run holding a sequence's last positions also
holds slots past its end, so the loops stop at the last run boundary and a 16-token tail step,
run first, takes that run with V zeroed past the end (fp32: one masked loop zeroing in place).

Not supported (yet): sliding windows, soft-capping, ALiBi, sinks, fp8 caches.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from portattn.blocksize import BlockSizeRule, MultipleOf
from portattn.kernels._checks import (
    INT32_LIMIT,
    POSITIONS32_LIMIT,
    Problems,
    block_ids_errors,
    capacity_errors,
    capture_errors,
    lazy_bit_errors,
    offsets_errors,
    overlap_errors,
    positions32_errors,
    raise_errors,
    reach32_errors,
    reads_contents,
    refuse_unstrided,
    scale_errors,
    scale_type_errors,
    seq_lens_errors,
    target_errors,
    tensor_reads_contents,
    to_host,
)
from portattn.kernels._launch import MAX_GRID_YZ, Launch, in_units, rows_aligned
from portattn.kernels._plans import PLANS, CheckMemo, _current_device, call_key, present
from portattn.kernels.metadata_summary import (
    finish_metadata_summary,
    start_metadata_summary,
    summary_applies,
)
from portattn.kernels.paged_prefill_sm90 import sm90_prefill_errors, sm90_prefill_launches
from portattn.layout import (
    CacheAddressing,
    describe_kv_cache,
    packed_runs,
    row_vector_elems,
    vector_width,
)
from portattn.platform import Target, compile_arch, is_int, override_key, target_for_tensor
from portattn.policy.common import launch_options
from portattn.policy.paged import (
    MAX_HEAD_DIM,
    PagedConfig,
    PagedProblem,
    PagedTiles,
    PrefillConfig,
    cache_order_reads,
    paged_config,
    paged_tiles,
    plan_max_seq_len,
    prefill_config_errors,
)

OP = "paged_attention"
# Any block size: the context tile is policy, blocks and in-block offsets are addressed separately
# (lesson 3). SHUFFLE V additionally needs block_size % x == 0 (ops_registry applies it).
SUPPORTED_BLOCK_SIZES: tuple[BlockSizeRule, ...] = (MultipleOf(1),)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_LOG2E = 1.4426950408889634


# -- helpers ------------------------------------------------------------------------------------


@triton.jit
def _cache_offsets(
    tok,  # [BLOCK_N, 1] or [1, BLOCK_N]: in-block token offsets
    dim,  # [1, BLOCK_D] or [BLOCK_D, 1]: head-dim indices
    stride_tok_hi,
    stride_tok_lo,
    stride_dim_hi,
    stride_dim_lo,
    TOK_SPLIT: tl.constexpr,
    DIM_SPLIT: tl.constexpr,
):
    """In-block offset of (token, dim) per `layout.CacheAddressing` (caller adds block, head).

    Separable: a token term plus a dim term, each computed on its own vector and broadcast once.
    """
    return _split_offsets(tok, stride_tok_hi, stride_tok_lo, TOK_SPLIT) + _split_offsets(
        dim, stride_dim_hi, stride_dim_lo, DIM_SPLIT
    )


@triton.jit
def _split_offsets(idx, stride_hi, stride_lo, SPLIT: tl.constexpr):
    """Offset of index ``idx`` along one cache axis split ``SPLIT``-wise (`layout.CacheAddressing`):
    ``(idx // SPLIT) * stride_hi + (idx % SPLIT) * stride_lo``; ``idx * stride_hi`` unsplit."""
    if SPLIT == 1:
        return idx * stride_hi
    return (idx // SPLIT) * stride_hi + (idx % SPLIT) * stride_lo


@triton.jit
def _run_major(start, N: tl.constexpr, X: tl.constexpr):
    """``[N * X]`` offsets: element ``i * X + l`` is ``start[i] + l``; each ``start`` a multiple of
    X, so the X elements of a run are contiguous and aligned, as stated to the compiler."""
    rep = tl.reshape(tl.broadcast_to(start[:, None], (N, X)), (N * X,))
    rep = rep + tl.arange(0, N * X) % X
    return tl.max_contiguous(tl.multiple_of(rep, X), X)


@triton.jit
def _kv_step(
    q,  # [BLOCK_M, BLOCK_D] query rows
    m_i,  # [BLOCK_M] running max (base 2)
    l_i,  # [BLOCK_M] running sum
    acc,  # [BLOCK_M, BLOCK_D] fp32 running output
    start,  # first context position of this KV tile
    kv_end,  # positions >= kv_end are not used (TAIL: V of their run is read, then zeroed)
    row_limit,  # [BLOCK_M]: row r sees positions < row_limit[r] (used when MASKED)
    bt_row,  # block_table row of the sequence
    k_base,  # key cache at this KV head
    v_base,  # value cache at this KV head
    offs_n,
    offs_d,
    d_mask,
    scale_log2,
    block_size,
    stride_bt_blk,
    stride_k_block,
    stride_k_tok_hi,
    stride_k_tok_lo,
    stride_k_dim_hi,
    stride_k_dim_lo,
    stride_v_block,
    stride_v_tok_hi,
    stride_v_tok_lo,
    stride_v_dim_hi,
    stride_v_dim_lo,
    MASKED: tl.constexpr,  # False: every position of the tile is < kv_end and < every row_limit
    TAIL: tl.constexpr,  # SHUFFLE V: kv_end may fall inside a run: zero V past it
    EVEN_D: tl.constexpr,  # head_dim == BLOCK_D: no head-dim mask on the gathers
    LINES: tl.constexpr,  # SHUFFLE 16-bit, EVEN_D, aligned runs: K and V read in cache order
    K_TOK_SPLIT: tl.constexpr,
    K_DIM_SPLIT: tl.constexpr,
    V_TOK_SPLIT: tl.constexpr,
    V_DIM_SPLIT: tl.constexpr,
    K_VEC: tl.constexpr,  # SHUFFLE K: its x-element runs start on multiples of K_VEC
    V_VEC: tl.constexpr,  # SHUFFLE V: likewise
    FP32_DOTS: tl.constexpr,  # dot operands upcast to fp32 (`plan_paged_attention`)
):
    """One KV tile: gather K/V through the block table, scores, online-softmax update.

    Addresses are separable: offset(token, dim) = tok_off[token] + dim_off[dim], each half built on
    its own vector and broadcast once, so the compiler sees the runs of contiguous elements (the
    head dim of NHD, the x-element runs of SHUFFLE) and loads them as vectors.
    """
    BLOCK_D: tl.constexpr = offs_d.shape[0]
    BLOCK_N: tl.constexpr = offs_n.shape[0]
    # -- gather: context position -> (physical block, in-block offset) -----------------------
    pos = start + offs_n  # [BLOCK_N]
    if V_TOK_SPLIT > 1:
        # SHUFFLE V keeps runs of V_TOK_SPLIT tokens contiguous. The tile starts on a multiple of
        # BLOCK_N, hence of the run, and block_size is a multiple of the run (ops_registry), so a
        # run never straddles a block: its block and its first in-block offset are constant over
        # the run and only the lane varies -- a form the axis analysis can follow. (Unsigned
        # division: positions and block sizes are >= 0, and it needs no sign fix-ups.)
        run = start + offs_n // V_TOK_SPLIT * V_TOK_SPLIT
        lane = offs_n % V_TOK_SPLIT
        urun = run.to(tl.uint32)
        logical_block = (urun // block_size.to(tl.uint32)).to(tl.int32)
        run_in_block = (urun % block_size.to(tl.uint32)).to(tl.int32)
        in_block = run_in_block + lane
    else:
        logical_block = pos // block_size
        # In-block offsets stay 32-bit (one block spans < 2^31 elements); the block term is 64-bit.
        in_block = pos % block_size
    if MASKED:
        pos_mask = pos < kv_end
        # SHUFFLE V is read in whole runs: those whose first position is < kv_end (still inside
        # the sequence's last block; slots past kv_end are zeroed when TAIL)
        run_mask = run < kv_end if V_TOK_SPLIT > 1 else pos_mask
        phys = tl.load(bt_row + logical_block * stride_bt_blk, mask=run_mask, other=0)
    else:
        phys = tl.load(bt_row + logical_block * stride_bt_blk)
    phys = phys.to(tl.int64)
    if V_TOK_SPLIT > 1:
        phys = tl.max_constancy(phys, V_TOK_SPLIT)  # one block-table entry per run (above)

    if K_DIM_SPLIT > 1:
        # SHUFFLE K: runs of K_DIM_SPLIT dims are contiguous (stride_k_dim_lo 1); each run starts
        # on a multiple of K_VEC elements (`layout.vector_width`, checked on the host), which
        # Triton cannot see itself (it specialises only integer arguments divisible by 16, and
        # the token stride is x): said with tl.multiple_of, the runs load as 16-byte vectors.
        tl.static_assert(K_TOK_SPLIT == 1)
        k_tok = phys * stride_k_block + in_block * stride_k_tok_hi  # [BLOCK_N]
        k_run = (offs_d // K_DIM_SPLIT) * stride_k_dim_hi  # [BLOCK_D]
        if K_VEC > 1:
            k_tok = tl.multiple_of(k_tok, K_VEC)
            k_run = tl.multiple_of(k_run, K_VEC)
        k_off = k_tok[None, :] + (k_run + (offs_d % K_DIM_SPLIT) * stride_k_dim_lo)[:, None]
    else:
        k_off = phys[None, :] * stride_k_block + _cache_offsets(
            in_block[None, :],
            offs_d[:, None],
            stride_k_tok_hi,
            stride_k_tok_lo,
            stride_k_dim_hi,
            stride_k_dim_lo,
            K_TOK_SPLIT,
            K_DIM_SPLIT,
        )
    if LINES:
        # SHUFFLE K read as [runs, tokens * x], the cache's own order: its second axis is
        # contiguous in runs of x (said with max_contiguous: Triton sees no contiguity across the
        # token stride), so the coalescer puts a warp's threads along the tokens of one run, whole
        # 128-byte lines, not across the runs of two tokens; viewed as [BLOCK_D, BLOCK_N] for the
        # dot. (Both [runs, tokens, x] and a [BLOCK_D, BLOCK_N] tile put threads across runs: one
        # 32-byte sector per line.)
        RUNS: tl.constexpr = BLOCK_D // K_DIM_SPLIT
        k_runs = tl.multiple_of(tl.arange(0, RUNS) * stride_k_dim_hi, K_DIM_SPLIT)
        k_toks = _run_major(k_tok, BLOCK_N, K_DIM_SPLIT)
        k_off2 = k_runs[:, None] + k_toks[None, :]
        if MASKED:  # position of each element's token (constant over its run: vector loads)
            keep = start + tl.arange(0, BLOCK_N * K_DIM_SPLIT) // K_DIM_SPLIT < kv_end
            k2 = tl.load(k_base + k_off2, mask=keep[None, :], other=0.0)
        else:
            k2 = tl.load(k_base + k_off2)
        k = tl.reshape(
            tl.permute(tl.reshape(k2, (RUNS, BLOCK_N, K_DIM_SPLIT)), (0, 2, 1)), (BLOCK_D, BLOCK_N)
        )
    elif EVEN_D:
        if MASKED:
            k = tl.load(k_base + k_off, mask=pos_mask[None, :], other=0.0)
        else:
            k = tl.load(k_base + k_off)
    elif MASKED:
        k = tl.load(k_base + k_off, mask=d_mask[:, None] & pos_mask[None, :], other=0.0)
    else:
        k = tl.load(k_base + k_off, mask=d_mask[:, None], other=0.0)

    # -- scores ------------------------------------------------------------------------------
    if FP32_DOTS:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
    s = tl.dot(q, k, input_precision="ieee") * scale_log2  # [BLOCK_M, BLOCK_N]
    if MASKED:
        keep = pos_mask[None, :] & (pos[None, :] < row_limit[:, None])
        s = tl.where(keep, s, float("-inf"))

    # -- online softmax (base 2) --------------------------------------------------------------
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # The tail step runs first: a row may see none of its positions yet (m_new = -inf)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new) if TAIL else m_new
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]

    if V_TOK_SPLIT > 1:
        # SHUFFLE V: runs of V_TOK_SPLIT tokens are contiguous; the run's block and first offset
        # (above) give its start, a multiple of V_VEC elements (as for K), plus the lane.
        tl.static_assert(V_DIM_SPLIT == 1)
        v_run = phys * stride_v_block + (run_in_block // V_TOK_SPLIT) * stride_v_tok_hi
        v_dim = offs_d * stride_v_dim_hi  # [BLOCK_D]
        if V_VEC > 1:
            v_run = tl.multiple_of(v_run, V_VEC)
            v_dim = tl.multiple_of(v_dim, V_VEC)
        v_off = (v_run + lane * stride_v_tok_lo)[:, None] + v_dim[None, :]
    else:
        v_off = phys[:, None] * stride_v_block + _cache_offsets(
            in_block[:, None],
            offs_d[None, :],
            stride_v_tok_hi,
            stride_v_tok_lo,
            stride_v_dim_hi,
            stride_v_dim_lo,
            V_TOK_SPLIT,
            V_DIM_SPLIT,
        )
    if LINES:
        # SHUFFLE V read as [runs, head_dim * x] (each run of x tokens is head_dim * x contiguous
        # elements): a warp's threads along one run's dims, whole lines; viewed as [BLOCK_N,
        # BLOCK_D]. The runs' blocks are read again at run granularity (L1 hits).
        V_RUNS: tl.constexpr = BLOCK_N // V_TOK_SPLIT
        run_pos = start + tl.arange(0, V_RUNS) * V_TOK_SPLIT
        urun_pos = run_pos.to(tl.uint32)
        run_blk = (urun_pos // block_size.to(tl.uint32)).to(tl.int32)
        run_off = (urun_pos % block_size.to(tl.uint32)).to(tl.int32)
        if MASKED:
            run_keep = run_pos < kv_end
            run_phys = tl.load(bt_row + run_blk * stride_bt_blk, mask=run_keep, other=0)
        else:
            run_phys = tl.load(bt_row + run_blk * stride_bt_blk)
        v_runs = run_phys.to(tl.int64) * stride_v_block + (run_off // V_TOK_SPLIT) * stride_v_tok_hi
        v_runs = tl.multiple_of(v_runs, V_TOK_SPLIT)
        v_dims = _run_major(offs_d * stride_v_dim_hi, BLOCK_D, V_TOK_SPLIT)
        v_off2 = v_runs[:, None] + v_dims[None, :]
        if MASKED:
            v2 = tl.load(v_base + v_off2, mask=run_keep[:, None], other=0.0)
        else:
            v2 = tl.load(v_base + v_off2)
        v = tl.reshape(
            tl.permute(tl.reshape(v2, (V_RUNS, BLOCK_D, V_TOK_SPLIT)), (0, 2, 1)),
            (BLOCK_N, BLOCK_D),
        )
    elif EVEN_D:
        if MASKED:
            v = tl.load(v_base + v_off, mask=run_mask[:, None], other=0.0)
        else:
            v = tl.load(v_base + v_off)
    elif MASKED:
        v = tl.load(v_base + v_off, mask=run_mask[:, None] & d_mask[None, :], other=0.0)
    else:
        v = tl.load(v_base + v_off, mask=d_mask[None, :], other=0.0)
    if TAIL:  # the run's slots past the sequence's end may hold anything (NaN): zero them
        v = tl.where(pos_mask[:, None], v, 0.0)
    if FP32_DOTS:  # P rounded to V's dtype, as on a GPU, then both operands upcast
        acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _attend(
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    q_ptr,  # [num_tokens, num_q_heads, head_dim]
    k_ptr,  # key cache, NHD or SHUFFLE, addressed by the stride_k_* arguments
    v_ptr,  # value cache, NHD or SHUFFLE, addressed by the stride_v_* arguments
    block_table_ptr,  # [num_seqs, max_blocks]
    seq_lens_ptr,  # [num_seqs]
    query_start_loc_ptr,  # [num_seqs + 1]
    part_ptr,  # fp32 [NUM_SPLITS, num_tokens, num_q_heads, head_dim] (NUM_SPLITS > 1 only)
    lse_ptr,  # fp32 [NUM_SPLITS, num_tokens, num_q_heads], base-2 log-sum-exp (NUM_SPLITS > 1)
    q_tile,
    head_slot,  # kv_head * ceil(GROUP / HEAD_TILE) + head tile
    seq,
    split,
    q_len_lo,  # this program serves the sequence only if q_len_lo < q_len <= q_len_hi
    q_len_hi,
    scale_log2,
    head_dim,
    block_size,
    num_tokens,
    num_q_heads,
    stride_q_tok,
    stride_q_head,
    stride_q_dim,
    stride_o_tok,
    stride_o_head,
    stride_o_dim,
    stride_bt_seq,
    stride_bt_blk,
    stride_seq_lens,
    stride_qsl,
    stride_k_block,
    stride_k_head,
    stride_k_tok_hi,
    stride_k_tok_lo,
    stride_k_dim_hi,
    stride_k_dim_lo,
    stride_v_block,
    stride_v_head,
    stride_v_tok_hi,
    stride_v_tok_lo,
    stride_v_dim_hi,
    stride_v_dim_lo,
    GROUP: tl.constexpr,
    HEAD_TILE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    K_TOK_SPLIT: tl.constexpr,
    K_DIM_SPLIT: tl.constexpr,
    V_TOK_SPLIT: tl.constexpr,
    V_DIM_SPLIT: tl.constexpr,
    K_VEC: tl.constexpr,
    V_VEC: tl.constexpr,
    K_PACKED: tl.constexpr,
    V_PACKED: tl.constexpr,
    EVEN_D: tl.constexpr,
    LINES: tl.constexpr,
    FP32_DOTS: tl.constexpr,
):
    """One program's work: ``BLOCK_Q`` tokens x ``HEAD_TILE`` heads of one sequence."""
    tl.static_assert(BLOCK_Q * HEAD_TILE <= BLOCK_M)
    tl.static_assert(HEAD_TILE <= GROUP)
    TAIL_N: tl.constexpr = 16  # the tail step's tile (tl.dot's smallest): one SHUFFLE V run
    tl.static_assert(V_TOK_SPLIT <= TAIL_N)
    if K_PACKED:  # SHUFFLE K's token stride is x: a constant (`layout.packed_runs`)
        stride_k_tok_hi = K_DIM_SPLIT
    if V_PACKED:  # SHUFFLE V's dim stride is x
        stride_v_dim_hi = V_TOK_SPLIT
    if K_VEC > 1 and not EVEN_D:  # head_dim is a multiple of K_VEC: the dim mask, run by run
        head_dim = head_dim // K_VEC * K_VEC
    HEAD_TILES_PER_KV: tl.constexpr = (GROUP + HEAD_TILE - 1) // HEAD_TILE
    kv_head = head_slot // HEAD_TILES_PER_KV
    head_tile = head_slot % HEAD_TILES_PER_KV

    q_start = tl.load(query_start_loc_ptr + seq * stride_qsl).to(tl.int64)
    q_len = (tl.load(query_start_loc_ptr + (seq + 1) * stride_qsl) - q_start).to(tl.int32)
    if (q_len > q_len_lo) & (q_len <= q_len_hi) & (q_tile * BLOCK_Q < q_len):
        seq_len = tl.load(seq_lens_ptr + seq * stride_seq_lens).to(tl.int32)
        ctx_len = seq_len - q_len  # tokens before this step's queries

        # -- rows: (query token, query head) pairs of one KV head -------------------------------
        offs_m = tl.arange(0, BLOCK_M)
        tok_in_q = q_tile * BLOCK_Q + offs_m // HEAD_TILE  # [BLOCK_M] token index within the seq
        head_in_group = head_tile * HEAD_TILE + offs_m % HEAD_TILE
        row_mask = (offs_m // HEAD_TILE < BLOCK_Q) & (tok_in_q < q_len) & (head_in_group < GROUP)
        q_head = kv_head * GROUP + head_in_group
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < head_dim

        q_off = (
            (q_start + tok_in_q.to(tl.int64))[:, None] * stride_q_tok
            + q_head.to(tl.int64)[:, None] * stride_q_head
            + offs_d[None, :] * stride_q_dim
        )
        q = tl.load(q_ptr + q_off, mask=row_mask[:, None] & d_mask[None, :], other=0.0)

        # Row r sees positions < row_limit[r]; >= 1 for every row, so no row is ever fully masked
        # (rows past the sequence compute on zeros and are not stored). The loop ends at the
        # causal limit of the tile's LAST row; tiles below the FIRST row's limit need no mask.
        row_limit = ctx_len + tok_in_q + 1
        kv_end = tl.minimum(seq_len, ctx_len + (q_tile + 1) * BLOCK_Q)
        kv_lo = 0
        if NUM_SPLITS > 1:  # this program's share, whole KV tiles, of the sequence's context
            per_split = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
            kv_lo = split * per_split
            kv_end = tl.minimum(kv_end, kv_lo + per_split)
        full_end = tl.minimum((ctx_len + q_tile * BLOCK_Q + 1) // BLOCK_N * BLOCK_N, kv_end)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt_seq
        k_base = k_ptr + kv_head.to(tl.int64) * stride_k_head
        v_base = v_ptr + kv_head.to(tl.int64) * stride_v_head
        offs_n = tl.arange(0, BLOCK_N)

        # SHUFFLE V is loaded in whole runs of V_TOK_SPLIT tokens (`_kv_step`); the run holding
        # the sequence's last positions also holds slots past its end (junk, NaN), which must be
        # zeroed before the P @ V dot. 16-bit: the loops stop at the last run boundary (run_end)
        # and a small tail step, first, takes that run, so that the loops' V tiles stream to
        # shared memory (NHD's pipelined path) instead of passing through registers to be
        # zeroed. fp32 (FMA dots, operands in registers anyway) keeps one masked loop zeroing in
        # place: a tail step and a second loop add to its spills.
        FP32: tl.constexpr = q_ptr.dtype.element_ty == tl.float32
        SHUFFLE_TAIL: tl.constexpr = V_TOK_SPLIT > 1 and not FP32
        IN_PLACE: tl.constexpr = V_TOK_SPLIT > 1 and FP32
        run_end = kv_end
        if SHUFFLE_TAIL:
            run_end = kv_end // V_TOK_SPLIT * V_TOK_SPLIT
            tail = tl.maximum(run_end, kv_lo)  # (an empty split: nothing)
            if tail < kv_end:
                m_i, l_i, acc = _kv_step(
                    q, m_i, l_i, acc, tail, kv_end, row_limit, bt_row, k_base, v_base,
                    tl.arange(0, TAIL_N), offs_d, d_mask, scale_log2, block_size, stride_bt_blk,
                    stride_k_block, stride_k_tok_hi, stride_k_tok_lo, stride_k_dim_hi,
                    stride_k_dim_lo, stride_v_block, stride_v_tok_hi, stride_v_tok_lo,
                    stride_v_dim_hi, stride_v_dim_lo,
                    True, True, EVEN_D, LINES, K_TOK_SPLIT, K_DIM_SPLIT, V_TOK_SPLIT, V_DIM_SPLIT,
                    K_VEC, V_VEC, FP32_DOTS,
                )  # fmt: skip
        if IN_PLACE:
            full_end = kv_lo

        for start in range(kv_lo, full_end, BLOCK_N):
            m_i, l_i, acc = _kv_step(
                q, m_i, l_i, acc, start, kv_end, row_limit, bt_row, k_base, v_base, offs_n,
                offs_d, d_mask, scale_log2, block_size, stride_bt_blk,
                stride_k_block, stride_k_tok_hi, stride_k_tok_lo, stride_k_dim_hi, stride_k_dim_lo,
                stride_v_block, stride_v_tok_hi, stride_v_tok_lo, stride_v_dim_hi, stride_v_dim_lo,
                False, False, EVEN_D, LINES, K_TOK_SPLIT, K_DIM_SPLIT, V_TOK_SPLIT, V_DIM_SPLIT,
                K_VEC, V_VEC, FP32_DOTS,
            )  # fmt: skip
        for start in range(tl.maximum(kv_lo, full_end), run_end, BLOCK_N):
            m_i, l_i, acc = _kv_step(
                q, m_i, l_i, acc, start, run_end, row_limit, bt_row, k_base, v_base, offs_n,
                offs_d, d_mask, scale_log2, block_size, stride_bt_blk,
                stride_k_block, stride_k_tok_hi, stride_k_tok_lo, stride_k_dim_hi, stride_k_dim_lo,
                stride_v_block, stride_v_tok_hi, stride_v_tok_lo, stride_v_dim_hi, stride_v_dim_lo,
                True, IN_PLACE, EVEN_D, LINES, K_TOK_SPLIT, K_DIM_SPLIT, V_TOK_SPLIT, V_DIM_SPLIT,
                K_VEC, V_VEC, FP32_DOTS,
            )  # fmt: skip

        # -- epilogue -------------------------------------------------------------------------
        tok = q_start + tok_in_q.to(tl.int64)
        io_mask = row_mask[:, None] & d_mask[None, :]
        if NUM_SPLITS > 1:
            # Partial result and its log-sum-exp; an empty split (l == 0) stores 0 and -inf.
            l_safe = tl.where(l_i > 0.0, l_i, 1.0)
            row = (split * num_tokens + tok) * num_q_heads + q_head.to(tl.int64)
            tl.store(part_ptr + row[:, None] * head_dim + offs_d[None, :], acc / l_safe[:, None],
                     mask=io_mask)  # fmt: skip
            lse = tl.where(l_i > 0.0, m_i + tl.math.log2(l_safe), float("-inf"))
            tl.store(lse_ptr + row, lse, mask=row_mask)
        else:
            acc = acc / l_i[:, None]
            o_off = (
                tok[:, None] * stride_o_tok
                + q_head.to(tl.int64)[:, None] * stride_o_head
                + offs_d[None, :] * stride_o_dim
            )
            tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    q_ptr,  # [num_tokens, num_q_heads, head_dim]
    k_ptr,  # key cache, NHD or SHUFFLE, addressed by the stride_k_* arguments
    v_ptr,  # value cache, NHD or SHUFFLE, addressed by the stride_v_* arguments
    block_table_ptr,  # [num_seqs, max_blocks]
    seq_lens_ptr,  # [num_seqs]
    query_start_loc_ptr,  # [num_seqs + 1]
    part_ptr,  # fp32 [NUM_SPLITS, num_tokens, num_q_heads, head_dim] (= out_ptr if no split)
    lse_ptr,  # fp32 [NUM_SPLITS, num_tokens, num_q_heads] (= out_ptr if no split)
    scale_log2,  # softmax scale * log2(e)
    head_dim,
    block_size,
    num_tokens,
    num_seqs,
    num_kv_heads,
    num_q_tiles,  # ceil(max_query_len / BLOCK_Q): q tiles per sequence of the main row tile
    stride_q_tok,
    stride_q_head,
    stride_q_dim,
    stride_o_tok,
    stride_o_head,
    stride_o_dim,
    stride_bt_seq,
    stride_bt_blk,
    stride_seq_lens,
    stride_qsl,
    stride_k_block,
    stride_k_head,
    stride_k_tok_hi,
    stride_k_tok_lo,
    stride_k_dim_hi,
    stride_k_dim_lo,
    stride_v_block,
    stride_v_head,
    stride_v_tok_hi,
    stride_v_tok_lo,
    stride_v_dim_hi,
    stride_v_dim_lo,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_TILE: tl.constexpr,  # query heads per program (<= GROUP)
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # rows of the M tile (>= BLOCK_Q * HEAD_TILE)
    BLOCK_N: tl.constexpr,  # context tokens per KV tile (independent of block_size)
    BLOCK_D: tl.constexpr,  # head_dim padded to a power of two
    DECODE_ROLE: tl.constexpr,  # mixed batch: short sequences get the DEC_* row tile
    DEC_HEAD_TILE: tl.constexpr,
    DEC_BLOCK_Q: tl.constexpr,  # sequences with q_len <= DEC_BLOCK_Q take the decode role
    DEC_BLOCK_M: tl.constexpr,
    NUM_SPLITS: tl.constexpr,  # > 1: partial results per KV split for the reduce kernel
    K_TOK_SPLIT: tl.constexpr,
    K_DIM_SPLIT: tl.constexpr,
    V_TOK_SPLIT: tl.constexpr,
    V_DIM_SPLIT: tl.constexpr,
    K_VEC: tl.constexpr,  # elements per aligned contiguous run of the K cache (1: none; SHUFFLE)
    V_VEC: tl.constexpr,  # the same for the V cache
    K_ROW: tl.constexpr,  # NHD K: its rows start on multiples of K_ROW (`row_vector_elems`)
    V_ROW: tl.constexpr,  # the same for the V cache
    K_PACKED: tl.constexpr,  # SHUFFLE K: stride_k_tok_hi == x (`layout.packed_runs`)
    V_PACKED: tl.constexpr,  # SHUFFLE V: stride_v_dim_hi == x
    EVEN_D: tl.constexpr,  # head_dim == BLOCK_D (no head-dim masks on the K/V gathers)
    LINES: tl.constexpr,  # SHUFFLE: K and V read in the cache's order (`_kv_step`)
    FP32_DOTS: tl.constexpr,  # dot operands upcast to fp32 (`plan_paged_attention`)
):
    """1-D grid: main-tile programs first, heaviest q tile first; then the decode-role ones.

    main:   pid -> (q_tile = num_q_tiles - 1 - r // (slots * NUM_SPLITS), head slot, split, seq)
    decode: pid - n_main -> (head slot, seq), q_tile 0, one program per sequence and head tile.
    """
    pid = tl.program_id(0)
    # NHD strides as multiples of K_ROW / V_ROW, which the compiler follows (it sees only
    # integers divisible by 16): rows that start on such multiples load as vectors
    stride_k_block, stride_k_head, stride_k_tok_hi = in_units(
        stride_k_block, stride_k_head, stride_k_tok_hi, K_ROW
    )
    stride_v_block, stride_v_head, stride_v_tok_hi = in_units(
        stride_v_block, stride_v_head, stride_v_tok_hi, V_ROW
    )
    slots = num_kv_heads * ((GROUP + HEAD_TILE - 1) // HEAD_TILE)
    n_main = num_q_tiles * slots * NUM_SPLITS * num_seqs
    if pid < n_main:
        seq = pid % num_seqs
        r = pid // num_seqs
        split = r % NUM_SPLITS
        r = r // NUM_SPLITS
        head_slot = r % slots
        q_tile = num_q_tiles - 1 - r // slots
        q_len_lo = DEC_BLOCK_Q if DECODE_ROLE else 0
        _attend(
            out_ptr, q_ptr, k_ptr, v_ptr, block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
            part_ptr, lse_ptr, q_tile, head_slot, seq, split, q_len_lo, 2147483647,
            scale_log2, head_dim, block_size, num_tokens, num_kv_heads * GROUP,
            stride_q_tok, stride_q_head, stride_q_dim, stride_o_tok, stride_o_head, stride_o_dim,
            stride_bt_seq, stride_bt_blk, stride_seq_lens, stride_qsl,
            stride_k_block, stride_k_head, stride_k_tok_hi, stride_k_tok_lo, stride_k_dim_hi,
            stride_k_dim_lo,
            stride_v_block, stride_v_head, stride_v_tok_hi, stride_v_tok_lo, stride_v_dim_hi,
            stride_v_dim_lo,
            GROUP, HEAD_TILE, BLOCK_Q, BLOCK_M, BLOCK_N, BLOCK_D, NUM_SPLITS,
            K_TOK_SPLIT, K_DIM_SPLIT, V_TOK_SPLIT, V_DIM_SPLIT, K_VEC, V_VEC, K_PACKED, V_PACKED,
            EVEN_D, LINES, FP32_DOTS,
        )  # fmt: skip
    elif DECODE_ROLE:
        d = pid - n_main
        seq = d % num_seqs
        head_slot = d // num_seqs
        _attend(
            out_ptr, q_ptr, k_ptr, v_ptr, block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
            part_ptr, lse_ptr, 0, head_slot, seq, 0, 0, DEC_BLOCK_Q,
            scale_log2, head_dim, block_size, num_tokens, num_kv_heads * GROUP,
            stride_q_tok, stride_q_head, stride_q_dim, stride_o_tok, stride_o_head, stride_o_dim,
            stride_bt_seq, stride_bt_blk, stride_seq_lens, stride_qsl,
            stride_k_block, stride_k_head, stride_k_tok_hi, stride_k_tok_lo, stride_k_dim_hi,
            stride_k_dim_lo,
            stride_v_block, stride_v_head, stride_v_tok_hi, stride_v_tok_lo, stride_v_dim_hi,
            stride_v_dim_lo,
            GROUP, DEC_HEAD_TILE, DEC_BLOCK_Q, DEC_BLOCK_M, BLOCK_N, BLOCK_D, 1,
            K_TOK_SPLIT, K_DIM_SPLIT, V_TOK_SPLIT, V_DIM_SPLIT, K_VEC, V_VEC, K_PACKED, V_PACKED,
            EVEN_D, LINES, FP32_DOTS,
        )  # fmt: skip


@triton.jit
def _paged_attention_reduce_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    part_ptr,  # fp32 [NUM_SPLITS, num_tokens, num_q_heads, head_dim]
    lse_ptr,  # fp32 [NUM_SPLITS, num_tokens, num_q_heads], base 2
    num_tokens,
    num_q_heads,
    head_dim,
    stride_o_tok,
    stride_o_head,
    stride_o_dim,
    NUM_SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Combine the splits of one (token, head): sum_s 2^(lse_s - max) * part_s / sum_s 2^(...)."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    row = (offs_s.to(tl.int64) * num_tokens + tok) * num_q_heads + head  # [NUM_SPLITS]
    lse = tl.load(lse_ptr + row)
    m = tl.max(lse, axis=0)  # finite: split 0 always holds context position 0
    w = tl.math.exp2(lse - m)
    d_mask = offs_d < head_dim
    part = tl.load(part_ptr + row[:, None] * head_dim + offs_d[None, :], mask=d_mask[None, :],
                   other=0.0)  # fmt: skip
    o = tl.sum(part * w[:, None], axis=0) / tl.sum(w, axis=0)
    o_off = tok * stride_o_tok + head * stride_o_head + offs_d * stride_o_dim
    tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=d_mask)


# -- launcher -----------------------------------------------------------------------------------


def _check_call(
    query, key_cache, value_cache, block_table, seq_lens, query_start_loc, out, scale, layout,
    max_query_len, max_seq_len, config=None, trace=None, target=None,
) -> tuple[CacheAddressing, CacheAddressing]:  # fmt: skip
    """Every type, shape, scalar and overlap problem of a call, raised together (`Problems`);
    the caches' addressing when there is none."""
    tensors = [("query", query), ("key_cache", key_cache), ("value_cache", value_cache),
               ("block_table", block_table), ("seq_lens", seq_lens),
               ("query_start_loc", query_start_loc), ("out", out), ("trace", trace)]  # fmt: skip
    refuse_unstrided(OP, tensors)
    p = Problems(OP)
    named = {
        "query": query,
        "block_table": block_table,
        "seq_lens": seq_lens,
        "query_start_loc": query_start_loc,
    }
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            p.type(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if out is not None and not isinstance(out, torch.Tensor):
        p.type(f"out must be a torch.Tensor or None; got {type(out).__name__}")
    if config is not None and not isinstance(config, PagedConfig):
        p.type(f"config must be a PagedConfig or None; got {type(config).__name__}")
    if trace is not None and not isinstance(trace, torch.Tensor):
        p.type(f"trace must be a torch.Tensor or None; got {type(trace).__name__}")
    p.type(*target_errors(target))
    ok = {n: t for n, t in named.items() if isinstance(t, torch.Tensor)}
    q = ok.get("query")
    if q is not None and q.dtype not in _FLOAT_DTYPES:
        p.type(f"query dtype must be one of float16, bfloat16, float32; got {q.dtype}")
    for name in ("block_table", "seq_lens", "query_start_loc"):
        if name in ok and ok[name].dtype not in _INDEX_DTYPES:
            p.type(f"{name} dtype must be int32 or int64; got {ok[name].dtype}")
    if not isinstance(out, torch.Tensor):
        out = None
    if q is not None and out is not None and out.dtype != q.dtype:
        p.type(f"out dtype must equal query dtype {q.dtype}; got {out.dtype}")
    kv = p.run(describe_kv_cache, OP, key_cache, value_cache, layout)
    if kv is not None and q is not None and key_cache.dtype != q.dtype:
        p.type(
            f"key_cache and value_cache dtype must equal query dtype {q.dtype}; got "
            f"{key_cache.dtype}"
        )
    _shape_errors(p, q, kv[0] if kv else None, key_cache if kv else None, ok, out)
    if wrong := scale_type_errors(scale, optional=True):
        p.type(*wrong)
    else:
        p.value(*scale_errors(scale, optional=True))
    p.value(*lazy_bit_errors(tensors))
    for name, v in (("max_query_len", max_query_len), ("max_seq_len", max_seq_len)):
        if v is not None and not is_int(v):
            p.type(f"{name} must be a non-negative int or None; got {type(v).__name__} {v!r}")
        elif v is not None and v < 0:
            p.value(f"{name} must be a non-negative int or None; got {v!r}")
        elif v is not None and v >= POSITIONS32_LIMIT:  # it bounds the seq_lens (32-bit)
            p.value(f"{name} must be < 2**31 - 2**16 = {POSITIONS32_LIMIT}; got {v}")
    if not p and kv is not None:
        reads = [("key_cache", key_cache), ("value_cache", value_cache), *named.items()]
        p.value(*overlap_errors([("out", out), ("trace", trace)], reads))
        # the kernels' 32-bit offsets: a token's head and dim terms, a block's in-block terms,
        # a block-table row's columns, the sequences' metadata entries
        in_block = range(1, key_cache.dim())
        p.value(*reach32_errors([
            ("query", query, (1, 2)), ("out", out, (1, 2)), ("key_cache", key_cache, in_block),
            ("value_cache", value_cache, in_block), ("block_table", block_table, (1,)),
            ("seq_lens", seq_lens, (0,)), ("query_start_loc", query_start_loc, (0,)),
        ]))  # fmt: skip
        if kv[0].block_size >= INT32_LIMIT:
            p.value(
                f"block_size must be < 2**31 (the kernels' positions are 32-bit); got "
                f"{kv[0].block_size}"
            )
    p.raise_if_any()
    assert kv is not None
    return kv


def _shape_errors(
    p: Problems, query, k: CacheAddressing | None, key_cache, ok: dict[str, torch.Tensor], out
) -> None:
    """The shape and device problems of the arguments that are tensors (``ok``; ``k``: the
    caches' addressing, ``None`` when they are invalid)."""
    dev = query.device if query is not None else None
    others = [(n, t) for n, t in ok.items() if n != "query"]
    if key_cache is not None:
        others.insert(0, ("key_cache", key_cache))
    for name, t in others + ([("out", out)] if out is not None else []):
        if dev is not None and t.device != dev:
            p.value(f"{name} must be on query's device {dev}; got {t.device}")
    if query is not None and query.dim() != 3:
        p.value(
            f"query must be 3-D [num_tokens, num_q_heads, head_dim]; got shape {tuple(query.shape)}"
        )
    elif query is not None:
        num_q_heads, head_dim = query.shape[1], query.shape[2]
        if k is not None and head_dim != k.head_dim:
            p.value(f"query head_dim must equal the cache's head_dim {k.head_dim}; got {head_dim}")
        if head_dim > MAX_HEAD_DIM:
            p.value(f"head_dim must be <= {MAX_HEAD_DIM}; got {head_dim}")
        if num_q_heads > MAX_GRID_YZ:  # the split-KV reduce's grid has a row a query head
            p.value(f"num_q_heads must be <= {MAX_GRID_YZ} (a launch grid's limit); got "
                    f"{num_q_heads}")  # fmt: skip
        if k is not None and (num_q_heads < 1 or num_q_heads % k.num_kv_heads):
            p.value(
                f"num_q_heads must be a positive multiple of num_kv_heads {k.num_kv_heads}; "
                f"got {num_q_heads}"
            )
        if out is not None and tuple(out.shape) != tuple(query.shape):
            p.value(
                f"out shape must equal query shape {tuple(query.shape)}; got {tuple(out.shape)}"
            )
    block_table = ok.get("block_table")
    if block_table is not None and block_table.dim() != 2:
        p.value(
            f"block_table must be 2-D [num_seqs, max_blocks]; got shape {tuple(block_table.shape)}"
        )
    if block_table is None or block_table.dim() < 1:
        return  # no num_seqs to hold seq_lens and query_start_loc to
    num_seqs = block_table.shape[0]
    seq_lens, query_start_loc = ok.get("seq_lens"), ok.get("query_start_loc")
    if seq_lens is not None and (seq_lens.dim() != 1 or seq_lens.shape[0] != num_seqs):
        p.value(f"seq_lens must be 1-D [num_seqs={num_seqs}]; got shape {tuple(seq_lens.shape)}")
    if query_start_loc is not None and (
        query_start_loc.dim() != 1 or query_start_loc.shape[0] != num_seqs + 1
    ):
        p.value(
            f"query_start_loc must be 1-D [num_seqs+1={num_seqs + 1}]; got shape "
            f"{tuple(query_start_loc.shape)}"
        )


def _check_contents(
    query, k: CacheAddressing, block_table, seq_lens, query_start_loc, max_query_len, max_seq_len
) -> tuple[int, int]:
    """Validate the metadata's values (`_checks`, one host read); return (max_query_len,
    max_seq_len). Given maxima are checked to bound the real ones (a smaller one would drop work
    silently)."""
    qsl, lens, table = to_host(query_start_loc, seq_lens, block_table)
    errors = offsets_errors("query_start_loc", qsl, end=query.shape[0], end_name="num_tokens")
    q_lens = qsl[1:] - qsl[:-1]
    errors += seq_lens_errors(lens, q_lens)
    errors += positions32_errors("seq_lens", lens)
    errors += capacity_errors(lens, k.block_size, table.shape[1])
    errors += block_ids_errors(table, lens, k.block_size, k.num_blocks)
    real_mql = int(q_lens.max()) if q_lens.size else 0
    real_msl = int(lens.max()) if lens.size else 0
    if max_query_len is not None and max_query_len < real_mql:
        errors.append(f"max_query_len must be >= the longest q_len {real_mql}; got {max_query_len}")
    if max_seq_len is not None and max_seq_len < real_msl:
        errors.append(f"max_seq_len must be >= the longest seq_len {real_msl}; got {max_seq_len}")
    raise_errors(OP, errors)
    return real_mql, real_msl


#: The unbounded calls' argument checks, by description (`unbounded_maxima`): each kept as
#: ``[what the checks returned, the bounds the description's last call read]``.
_CHECKED = CheckMemo()
#: What an unbounded call reads (`capture_errors`).
_READS = "query_start_loc, seq_lens and block_table"


class Unbounded(NamedTuple):
    """What `unbounded_maxima` read: the bounds of the call (``max_query_len``,
    ``max_seq_len``), and ``ready``: the call's launches made ready before the wait
    (``prepare``), or ``None``."""

    max_query_len: int
    max_seq_len: int | None
    ready: Callable[[], tuple] | None


def unbounded_maxima(
    query, key_cache, value_cache, block_table, seq_lens, query_start_loc, out, scale, layout,
    max_seq_len, config, prepare=None,
) -> Unbounded:  # fmt: skip
    """For a call without ``max_query_len``: the arguments checked (types and shapes, then the
    metadata's values: on a GPU by the device-side summary, `start_metadata_summary` and
    `finish_metadata_summary`, else from one host read), and the maxima that bound the call to
    the same plan: the longest q_len, and the caller's ``max_seq_len`` or else
    `plan_max_seq_len` of the longest seq_len (``None`` for an empty batch).

    ``prepare(bounds)``: called before the wait for the metadata's values (while the device
    checks them), with the bounds the description's last call read; it returns the call's
    launches made ready for them (`PlanCache.prepare`) or ``None``. They are handed back as
    ``ready`` only when this call's bounds are the same (and the metadata valid), so the call
    launches right after the wait."""
    inputs = (query, key_cache, value_cache, block_table, seq_lens, query_start_loc, out)
    mask, tensors = present(inputs)
    scalars = (mask, type(scale), scale, type(layout), layout, type(max_seq_len), max_seq_len,
               type(config), config)  # fmt: skip
    entry = _CHECKED.get(scalars, tensors, inputs)
    if entry is None:
        k, _ = _check_call(
            query, key_cache, value_cache, block_table, seq_lens, query_start_loc, out, scale,
            layout, None, max_seq_len, config, None,
        )  # fmt: skip
        entry = [k, None]
        _CHECKED.keep(scalars, tensors, inputs, (6,), entry)
    capture_errors(OP, query.device, "max_query_len", _READS)
    k, last = entry
    started = None
    if summary_applies(block_table, block_table.shape[0]):
        started = start_metadata_summary(
            query_start_loc, seq_lens, block_table, num_tokens=query.shape[0],
            block_size=k.block_size, num_blocks=k.num_blocks, end_at_most=False,
            max_len=POSITIONS32_LIMIT - 1,
        )  # fmt: skip
    ready = prepare(last) if prepare is not None and last is not None else None
    got = None if started is None else finish_metadata_summary(started)
    if got is not None and (max_seq_len is None or max_seq_len >= got.max_seq_len):
        real_mql, real_msl = got.max_q_len, got.max_seq_len
    else:  # broken metadata (or a short max_seq_len): the host read names what is wrong
        real_mql, real_msl = _check_contents(
            query, k, block_table, seq_lens, query_start_loc, None, max_seq_len
        )
    if max_seq_len is None:
        max_seq_len = plan_max_seq_len(real_msl) if real_msl else None
    if (real_mql, max_seq_len) != last:
        entry[1] = (real_mql, max_seq_len)
        ready = None
    return Unbounded(real_mql, max_seq_len, ready)


def _probe_guard(
    inputs, out, scale, layout, max_query_len, max_seq_len, config
) -> tuple[tuple, tuple]:
    """The rest of `call_key`'s description for `PlanCache.probe` and `PlanCache.prepare` (a
    call on the current device without a ``target``), and the tensors its guards check."""
    scalars = (OP, _current_device(), override_key(), out is None, type(scale), scale,
               type(layout), layout, type(max_query_len), max_query_len,
               type(max_seq_len), max_seq_len, type(config), config)  # fmt: skip
    return scalars, (inputs[:6] if out is None else inputs)


def _prefill_config(
    config: PagedConfig | None, target: Target, problem: PagedProblem, splits: int,
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
) -> PrefillConfig | None:  # fmt: skip
    """The sm_90 kernel's configuration for this call, or ``None`` for the portable kernel: the
    policy's (`paged_config`), which gives way to the portable kernel where the tensors do not
    suit it, or the caller's ``config``, refused with every reason it cannot run."""
    chosen = config is None
    cfg = (config if config is not None else paged_config(target, problem)).prefill
    if cfg is None:
        return None
    errors = [] if chosen else prefill_config_errors(target, problem, cfg)
    errors += sm90_prefill_errors(query, key_cache, value_cache)
    if splits > 1:
        errors.append(f"the batch splits each context {splits} ways (split-KV decode)")
    # the kernel reads seq_lens and query_start_loc densely
    for name, t in (("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t.stride(0) != 1:
            errors.append(f"{name} stride {t.stride(0)} is not 1")
    if chosen:
        return None if errors else cfg
    raise_errors(OP, [f"config.prefill cannot run this call: {why}" for why in errors])
    return cfg


def plan_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float | None = None,
    layout: str = "NHD",
    out: torch.Tensor | None = None,
    target: Target | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    config: PagedConfig | None = None,
    trace: torch.Tensor | None = None,
    check_contents: bool | None = None,
    tiles: PagedTiles | None = None,
) -> list[Launch]:
    """Validate, choose tiles and allocate; return the launch(es) `paged_attention` would run.

    Args: as `paged_attention`, plus
        check_contents: read and validate the metadata's values on the host. ``None`` (default):
            when the tensors are on the CPU, or when ``max_query_len`` is not given; never on
            meta tensors. ``False`` with ``max_query_len`` given reads no tensor's contents
            (what a CUDA graph capture needs).
        tiles: use these tiles instead of the policy's (benchmark sweeps, the compile matrix's
            naive rules). Validated only by the kernel's static asserts.
    """
    k, v = _check_call(
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc, out, scale,
        layout, max_query_len, max_seq_len, config, trace, target,
    )  # fmt: skip
    given_out = out

    num_tokens, num_q_heads, head_dim = query.shape
    num_seqs = block_table.shape[0]
    if check_contents is None:
        check_contents = reads_contents(query.device, vouched=max_query_len is not None)
    if query.is_meta:
        check_contents = False
    if check_contents:
        capture_errors(OP, query.device, "max_query_len", _READS)
        real_mql, real_msl = _check_contents(
            query, k, block_table, seq_lens, query_start_loc, max_query_len, max_seq_len
        )
        mql = real_mql if max_query_len is None else max_query_len
        # the plan is the same wherever the tensors live: the read max_seq_len only stands in
        # for a missing one when the caller gave no maxima at all
        msl: int | None = max_seq_len
        if msl is None and max_query_len is None:
            msl = real_msl
    else:
        # No content read: the grid comes from shapes and the caller's maxima only.
        mql = num_tokens if max_query_len is None else max_query_len
        msl = max_seq_len
    mql = min(mql, num_tokens)  # no sequence has more queries than the batch has tokens

    target = target if target is not None else target_for_tensor(query)
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    problem = PagedProblem(
        num_q_heads=num_q_heads,
        num_kv_heads=k.num_kv_heads,
        head_dim=head_dim,
        elem_bytes=query.element_size(),
        max_query_len=max(1, mql),
        block_size=k.block_size,
        num_seqs=num_seqs,
        max_seq_len=msl if msl else None,
        shuffled=layout == "SHUFFLE",
        query_rows_aligned=rows_aligned(query),
        kv_head_stride=value_cache.stride(2) if layout == "NHD" else None,
        out_rows_aligned=rows_aligned(out),
    )
    if tiles is None:
        tiles = paged_tiles(target, problem)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)

    group = num_q_heads // k.num_kv_heads
    splits = tiles.num_splits
    num_q_tiles = -(-mql // tiles.block_q)
    n_main = num_q_tiles * k.num_kv_heads * -(-group // tiles.head_tile) * splits * num_seqs
    dec = tiles.decode
    n_dec = k.num_kv_heads * -(-group // dec.head_tile) * num_seqs if dec is not None else 0
    if splits > 1:
        part = torch.empty((splits, num_tokens, num_q_heads, head_dim), dtype=torch.float32,
                           device=query.device)  # fmt: skip
        lse = torch.empty((splits, num_tokens, num_q_heads), dtype=torch.float32,
                          device=query.device)  # fmt: skip
    else:
        part = lse = out  # never touched (NUM_SPLITS == 1)
    # SHUFFLE only: NHD's code stays as it was (its fp32 spills are held figures)
    even_d = layout == "SHUFFLE" and head_dim == tiles.block_d
    args = dict(
        out_ptr=out,
        q_ptr=query,
        k_ptr=key_cache,
        v_ptr=value_cache,
        block_table_ptr=block_table,
        seq_lens_ptr=seq_lens,
        query_start_loc_ptr=query_start_loc,
        part_ptr=part,
        lse_ptr=lse,
        scale_log2=scale * _LOG2E,
        head_dim=head_dim,
        block_size=k.block_size,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        num_kv_heads=k.num_kv_heads,
        num_q_tiles=num_q_tiles,
        stride_q_tok=query.stride(0),
        stride_q_head=query.stride(1),
        stride_q_dim=query.stride(2),
        stride_o_tok=out.stride(0),
        stride_o_head=out.stride(1),
        stride_o_dim=out.stride(2),
        stride_bt_seq=block_table.stride(0),
        stride_bt_blk=block_table.stride(1),
        stride_seq_lens=seq_lens.stride(0),
        stride_qsl=query_start_loc.stride(0),
        **k.kernel_args("k"),
        **v.kernel_args("v"),
        GROUP=group,
        HEAD_TILE=tiles.head_tile,
        BLOCK_Q=tiles.block_q,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_D=tiles.block_d,
        DECODE_ROLE=dec is not None,
        DEC_HEAD_TILE=dec.head_tile if dec is not None else 1,
        DEC_BLOCK_Q=dec.block_q if dec is not None else 1,
        DEC_BLOCK_M=dec.block_m if dec is not None else 16,
        NUM_SPLITS=splits,
        K_TOK_SPLIT=k.tok_split,
        K_DIM_SPLIT=k.dim_split,
        V_TOK_SPLIT=v.tok_split,
        V_DIM_SPLIT=v.dim_split,
        K_VEC=vector_width(k),
        V_VEC=vector_width(v),
        # NHD rows of strides no multiple of 16 elements (a hybrid model's pages) load as vectors
        K_ROW=row_vector_elems(k, key_cache.element_size()),
        V_ROW=row_vector_elems(v, value_cache.element_size()),
        K_PACKED=packed_runs(k),
        V_PACKED=packed_runs(v),
        EVEN_D=even_d,
        # Triton's interpreter multiplies bf16's raw bits in tl.dot: CPU tensors (which only
        # run there) take the dots in fp32 instead
        FP32_DOTS=query.is_cpu and query.dtype == torch.bfloat16,
        LINES=even_d
        and cache_order_reads(
            compile_arch(query, target),
            head_dim,
            tiles.block_d,
            tiles.block_n,
            query.element_size(),
        )
        and vector_width(k) == k.dim_split
        and vector_width(v) == v.tok_split,
    )
    grid = ((n_main + n_dec) if num_tokens else 0,)
    writes = (given_out,) if given_out is not None else ()  # the caller's tensors written
    launches = [
        Launch(
            kernel=_paged_attention_kernel,
            grid=grid,
            args=args,
            options=tiles.options,
            target=target,
            name=OP,
            outputs=(out,),
            writes=writes,
        )
    ]
    prefill = _prefill_config(
        config, target, problem, splits, query, key_cache, value_cache, seq_lens, query_start_loc
    )
    if prefill is not None and num_tokens and num_seqs:
        # the prefill part on the sm_90 kernel, the decode row tile's sequences (if any) as
        # items of the same persistent launch
        q_len_lo = dec.block_q if dec is not None else 0
        return sm90_prefill_launches(launches[0], key_cache, value_cache, q_len_lo, prefill, trace)
    if trace is not None:
        raise ValueError(
            f"{OP}: trace needs the sm_90 prefill kernel, which stamps it; this call runs the "
            "portable kernel"
        )
    if splits > 1:
        reduce_args = dict(
            out_ptr=out,
            part_ptr=part,
            lse_ptr=lse,
            num_tokens=num_tokens,
            num_q_heads=num_q_heads,
            head_dim=head_dim,
            stride_o_tok=out.stride(0),
            stride_o_head=out.stride(1),
            stride_o_dim=out.stride(2),
            NUM_SPLITS=splits,
            BLOCK_D=tiles.block_d,
        )
        launches.append(
            Launch(
                kernel=_paged_attention_reduce_kernel,
                grid=(num_tokens, num_q_heads),
                args=reduce_args,
                options=launch_options(target, 4, 1),
                target=target,
                name=f"{OP}:reduce",
                outputs=(out,),
                writes=writes,
            )
        )
    return launches


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float | None = None,
    layout: str = "NHD",
    out: torch.Tensor | None = None,
    target: Target | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    config: PagedConfig | None = None,
    trace: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed query tokens over a paged KV cache (prefill + decode mixed).

    Args:
        query: ``[num_tokens, num_q_heads, head_dim]``, fp16/bf16/fp32, any strides.
        key_cache, value_cache: the cache in ``layout`` (module docstring), dtype of ``query``,
            any strides (slices, hybrid interleaved views).
        block_table: ``[num_seqs, max_blocks]`` int32/int64: physical block of each logical
            block; entries past ``ceil(seq_lens[i] / block_size)`` are ignored (e.g. -1).
        seq_lens: ``[num_seqs]``: total tokens of each sequence, this step's included.
        query_start_loc: ``[num_seqs + 1]``: sequence ``i``'s queries are rows
            ``query_start_loc[i] : query_start_loc[i+1]`` of ``query``, its last tokens.
        scale: softmax scale; default ``1 / sqrt(head_dim)``.
        layout: ``"NHD"`` or ``"SHUFFLE"``.
        out: optional ``[num_tokens, num_q_heads, head_dim]`` output of ``query``'s dtype, any
            strides; written in place and returned.
        target: the `Target` whose policy picks the tiles; default: ``query``'s device.
        max_query_len: an upper bound of every ``q_len_i`` (serving engines know it). Given, the
            launcher reads no device tensor's contents: the grid comes from ``num_seqs`` and
            this bound, and the metadata's values (monotonic ``query_start_loc``,
            ``seq_lens >= q_len``, block ids in range) are checked only when the tensors are on
            the CPU -- as upstream engines do, the caller vouches for them on the GPU, and the
            call is capturable in a CUDA graph. Not given, the launcher reads ``query_start_loc``,
            ``seq_lens`` and the used block-table entries once (a device-to-host sync) to
            validate them and size the grid.
        max_seq_len: an upper bound of every ``seq_lens[i]``; with ``max_query_len == 1`` it lets
            the policy split long contexts over several programs (split-KV, a second launch
            combines them) when the batch is too small to fill the GPU. Without it (and with
            ``max_query_len`` given) there is no split.
        config: the kernel choices (`PagedConfig`); ``None``: the policy's
            (`portattn.policy.paged.paged_config`). A given config is checked against the
            target and the call (`prefill_config_errors`) and is part of the plan cache's key.
        trace: diagnostics: an int64 tensor on the query's device of at least
            ``prod(paged_prefill_sm90.trace_shape(num_sms))`` elements that the sm_90 prefill
            kernel fills with clock stamps; such calls are never cached.

    Returns:
        ``out`` (allocated contiguous if not given).

    Raises:
        TypeError / ValueError: naming the argument, the rule and the value; every problem of a
        call is listed.

    Example (one decode sequence of 3 tokens, block_size 2, blocks 5 then 2)::

        block_table = [[5, 2]], seq_lens = [3], query_start_loc = [0, 1]
        -> the query attends to block 5 offsets 0, 1 and block 2 offset 0
    """
    inputs = (query, key_cache, value_cache, block_table, seq_lens, query_start_loc, out)
    if (
        max_query_len is None
        and trace is None
        and isinstance(query, torch.Tensor)
        and query.is_cuda
        and (config is None or isinstance(config, PagedConfig))
        and (target is None or isinstance(target, Target))
    ):
        # Unbounded on a GPU: the metadata is checked on the device once, then the call runs as
        # the call bounded by what was read (the same tiles: `plan_max_seq_len`), through the
        # plan cache; its launches are made ready while the device checks (a probe guard has no
        # target: a call with one builds its key afterwards).

        def prepare(bounds: tuple[int, int | None]) -> Callable[[], tuple] | None:
            scalars, tensors = _probe_guard(
                inputs, out, scale, layout, bounds[0], bounds[1], config
            )
            return PLANS.prepare(scalars, tensors, inputs)

        max_query_len, max_seq_len, ready = unbounded_maxima(
            query, key_cache, value_cache, block_table, seq_lens, query_start_loc, out, scale,
            layout, max_seq_len, config, prepare if target is None else None,
        )  # fmt: skip
        if ready is not None:
            return ready()[0]
    key = None
    guard: tuple | None = None
    if (
        trace is None  # (a traced call is a diagnostic: never cached)
        and (config is None or isinstance(config, PagedConfig))
        and isinstance(query, torch.Tensor)
        and not tensor_reads_contents(query, vouched=max_query_len is not None)
    ):
        if target is None:
            scalars, tensors = _probe_guard(
                inputs, out, scale, layout, max_query_len, max_seq_len, config
            )
            outputs = PLANS.probe(scalars, tensors, inputs)
            if outputs is not None:
                return outputs[0]
            guard = (scalars, tensors)
        key = call_key(OP, *inputs, scale, layout, target, max_query_len, max_seq_len, config)
    outputs = PLANS.call(
        key,
        inputs,
        lambda: plan_paged_attention(
            query,
            key_cache,
            value_cache,
            block_table,
            seq_lens,
            query_start_loc,
            scale=scale,
            layout=layout,
            out=out,
            target=target,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            config=config,
            trace=trace,
        ),
        guard,
    )
    return outputs[0]
