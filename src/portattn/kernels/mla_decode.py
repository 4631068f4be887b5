"""MLA decode with absorbed weights over a paged latent cache, with split-KV and verification.

For each query token ``t`` of sequence ``i`` and query head ``h``::

    s[n]   = scale * (q[t, h, :R] . c[n, :R] + q[t, h, R:] . c[n, R:])     n < causal length
    out    = softmax(s) @ c[:, :R]                                          (latent = value)
    lse    = logsumexp(s)                                                   (natural log)

with ``R = kv_lora_rank`` and ``c`` the sequence's cached rows. Causal rule (docs/design.md §2): the
``q_len_i`` tokens of sequence ``i`` are the last ones of its ``seq_lens[i]``; token ``j`` sees
positions ``< seq_lens[i] - q_len_i + j + 1``.

| tensor          | shape                                     | dtype                  |
|-----------------|-------------------------------------------|------------------------|
| query           | [num_tokens, num_q_heads, head_dim_k]     | fp16 / bf16 / fp32     |
| kv_cache        | [num_blocks, block_size, head_dim_k]      | = query (any strides)  |
| block_table     | [num_seqs, max_blocks_per_seq]            | int32 / int64          |
| page_indices    | ([num_seqs + 1], [total_context_tokens])  | int32 / int64          |
| seq_lens        | [num_seqs]                                | int32 / int64          |
| query_start_loc | [num_seqs + 1]                            | int32 / int64          |
| out             | [num_tokens, num_q_heads, kv_lora_rank]   | = query (any strides)  |
| lse             | [num_tokens, num_q_heads]                 | fp32                   |

The cache is addressed by block and in-block offset separately (`layout.describe_kv_cache`), so any
``block_size >= 1`` works; with ``page_indices`` (from ``expand_page_indices``) each context token's
slot is ``block * block_size + offset``, read at ``slot`` rows where the pages lie one after another
(``FLAT_SLOTS``; split into block and offset otherwise). Tiles (lesson 1): one latent tile
``[BLOCK_N, BLOCK_DV]`` per step feeds both QK (with the rope tile ``[BLOCK_N, BLOCK_DPE]``) and PV;
no tile is sized from ``head_dim_k``. Heads (lesson 2): a program owns ``BLOCK_H`` (>= 16) heads of
one token; padded rows compute on zero queries and are written nowhere. Split-KV:
``NUM_SPLITS > 1`` programs per (token, head group) write normalised partial outputs and their lse;
`_mla_reduce_kernel` merges them.

Packed rows (``MlaTiles.packed``, verification): a program
owns ``BLOCK_H`` rows of ONE sequence, row ``r`` being (query token ``r // num_heads``, head ``r %
num_heads``), so the sequence's ``q_len`` tokens read its cache once per tile, not once per token.
Each row keeps its causal limit (scores past it are -inf; the running max starts finite, so a row
without a column in a tile or split gets ``p = 0``); the tile's range and split chunks come from
its largest limit, and outputs, lse and partials go to each row's (token, head). Grid: sequences x
splits x `portattn.policy.mla.mla_row_groups` (from the longest query).

Bulk copies (``MlaTiles.tma``, sm_90+): a whole tile inside one page (``block_size % BLOCK_N ==
0``, block table, exact latent/rope widths, 16-byte aligned strides) comes through two tensor
descriptors instead of the per-thread gather; a split's partial last tile is still gathered, so
rows past the context are never read. On sm_90 the wide 64-head tile runs the Gluon kernel of
`portattn.kernels.mla_decode_sm90` (``MlaTiles.sm90_kernel``: same arguments, explicit copy/MMA
schedule, `MlaConfig` choices) where its requirements hold (pages of a multiple of 64 tokens by
TMA; other pages and ``page_indices``, e.g. speculative decoding's page size 1, by row gather;
16-bit launches take it below 64 heads too, on 64 padded rows); everything else runs the portable
kernel below.

Not supported: fp8 caches, a separate V cache, negative (padding) entries inside a sequence's
context (rejected where the metadata is checked: `mla_decode`'s Raises). Query rows past
``query_start_loc[-1]`` (CUDA-graph padding) are left unwritten.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable

import numpy as np
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from portattn.blocksize import BlockSizeRule, MultipleOf
from portattn.kernels._checks import (
    INT32_LIMIT,
    INT64_MAX,
    POSITIONS32_LIMIT,
    Problems,
    block_ids_errors,
    capacity_errors,
    capture_errors,
    is_real,
    lazy_bit_errors,
    offsets_errors,
    overlap_errors,
    page_indices_errors,
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
from portattn.kernels._launch import Launch, in_units, rows_aligned, vector_elems
from portattn.kernels._plans import (
    PLANS,
    CheckMemo,
    _current_device,
    call_key,
    exact_id,
    present,
)
from portattn.kernels.metadata_summary import (
    finish_metadata_summary,
    start_metadata_summary,
    summary_applies,
)
from portattn.kernels.mla_decode_sm90 import BLOCK_H as SM90_BLOCK_H
from portattn.kernels.mla_decode_sm90 import BLOCK_N as SM90_BLOCK_N
from portattn.kernels.mla_decode_sm90 import sm90_errors, sm90_launch
from portattn.layout import describe_kv_cache, is_block_contiguous, row_vector_elems
from portattn.mla_metadata import MlaMetadata
from portattn.platform import Target, is_int, override_key, target_for_tensor
from portattn.policy.mla import (
    SM90_KERNEL_ARCHS,
    MlaConfig,
    MlaProblem,
    MlaTiles,
    mla_config,
    mla_config_errors,
    mla_decode_tiles,
    mla_row_groups,
    portable_tiles,
)

# Any block size: the kernel addresses block and in-block offset separately.
SUPPORTED_BLOCK_SIZES: tuple[BlockSizeRule, ...] = (MultipleOf(1),)
# The latent cache is NHD with one KV head ([num_blocks, block_size, head_dim_k]); no SHUFFLE form.
SUPPORTED_LAYOUTS: tuple[str, ...] = ("NHD",)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
_OP = "mla_decode"
# The metadata's value fields (its two workspaces are tensor inputs of the plan cache's key).
_METADATA_VALUES = tuple(
    f.name for f in dataclasses.fields(MlaMetadata) if f.name not in ("partial_out", "partial_lse")
)
_metadata_values = operator.attrgetter(*_METADATA_VALUES)  # one tuple of them, in C
# id(metadata) -> (its values, their `exact_id`, whether the plan reads its workspaces).
_METADATA_MEMO: dict[int, tuple[tuple, int | None, bool]] = {}
_MAX_METADATA_MEMO = 256
_LOG2E = 1.4426950408889634
# `_plans.present`'s mask of a call whose optional tensors are all None (block_table given).
_DECODE: tuple[bool, ...] = (True,) * 4 + (False,) * 6


@triton.jit
def _find_seq(
    qsl_ptr,  # [num_seqs + 1] nondecreasing
    stride_qsl,
    tok,
    num_seqs,
):
    """The last sequence ``i < num_seqs`` with ``qsl[i] <= tok`` (binary search)."""
    lo = tl.zeros((), dtype=tl.int32)
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid * stride_qsl) <= tok:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _kv_row_offsets(
    n,
    end,
    bt_row,  # [max_blocks_per_seq] this sequence's block-table row (not read with PAGE_INDICES)
    page_indices_ptr,  # [total_context_tokens] flat slots (PAGE_INDICES only)
    page_start,
    block_size,
    stride_bt_blk,
    stride_indices,
    stride_kv_block,
    stride_kv_tok_hi,
    stride_kv_tok_lo,
    BLOCK_N: tl.constexpr,
    PAGE_INDICES: tl.constexpr,
    TOK_SPLIT: tl.constexpr,
    FLAT_SLOTS: tl.constexpr,
):
    """Element offsets (int64) of context rows ``n .. n+BLOCK_N-1`` (0 past ``end``).
    FLAT_SLOTS (with PAGE_INDICES): the cache's pages lie one after another
    (`portattn.layout.is_block_contiguous`), so a slot's offset is ``slot * stride_kv_tok_hi``:
    no division by the runtime block size (an int64 division per row a thread: 54 in the sm_90
    build of a 16-head tile, which halved the page_indices path's speed)."""
    offs_n = n + tl.arange(0, BLOCK_N)
    mask_n = offs_n < end
    if PAGE_INDICES:
        slot = tl.load(
            page_indices_ptr + (page_start + offs_n) * stride_indices, mask=mask_n, other=0
        ).to(tl.int64)
        if FLAT_SLOTS:
            return slot * stride_kv_tok_hi
        blk = slot // block_size
        off = slot % block_size
    else:
        blk = tl.load(bt_row + (offs_n // block_size) * stride_bt_blk, mask=mask_n, other=0).to(
            tl.int64
        )
        off = (offs_n % block_size).to(tl.int64)
    return (
        blk * stride_kv_block
        + (off // TOK_SPLIT) * stride_kv_tok_hi
        + (off % TOK_SPLIT) * stride_kv_tok_lo
    )


@triton.jit
def _online_step(
    q_lat,  # [BLOCK_H, BLOCK_DV]
    q_pe,  # [BLOCK_H, BLOCK_DPE] (unused when BLOCK_DPE == 0)
    lat,  # [BLOCK_N, BLOCK_DV] K's latent part
    pe,  # [BLOCK_N, BLOCK_DPE] K's rope part (unused when BLOCK_DPE == 0)
    v,  # [BLOCK_N, BLOCK_DV] V (the latent tile itself)
    mask_s,  # [1 or BLOCK_H, BLOCK_N] scores inside the (row's) causal range
    m_i,
    l_i,
    acc,
    qk_scale,
    BLOCK_DPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP32_DOTS: tl.constexpr,  # dot operands upcast to fp32 (`plan_mla_decode`)
):
    """One tile of the online softmax: scores (latent + rope), running max/sum, PV."""
    if FP32_DOTS:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
        lat = lat.to(tl.float32)
        pe = pe.to(tl.float32)
    qk = tl.dot(q_lat, tl.trans(lat), input_precision=DOT_PRECISION)
    if BLOCK_DPE > 0:
        qk += tl.dot(q_pe, tl.trans(pe), input_precision=DOT_PRECISION)
    qk = tl.where(mask_s, qk * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP32_DOTS:  # P rounded to V's dtype, as on a GPU, then both operands upcast
        pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision=DOT_PRECISION)
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _mla_decode_kernel(
    q_ptr,  # [num_tokens, num_q_heads, head_dim_k]
    kv_ptr,  # [num_blocks, block_size, head_dim_k], any strides
    lat_desc,  # TMA: descriptor of kv_ptr, box [1, BLOCK_N, BLOCK_DV] (else kv_ptr again)
    pe_desc,  # TMA: descriptor of kv_ptr, box [1, BLOCK_N, BLOCK_DPE] (else kv_ptr again)
    block_table_ptr,  # [num_seqs, max_blocks_per_seq] (not read with PAGE_INDICES)
    page_indptr_ptr,  # [num_seqs + 1] (PAGE_INDICES only)
    page_indices_ptr,  # [total_context_tokens] flat slots (PAGE_INDICES only)
    seq_lens_ptr,  # [num_seqs]
    qsl_ptr,  # [num_seqs + 1] (VARLEN only)
    row_groups,  # programs per sequence and split (PACKED only)
    out_ptr,  # [num_tokens, num_q_heads, KV_LORA_RANK] (NUM_SPLITS == 1)
    lse_ptr,  # [num_tokens, num_q_heads] fp32 (NUM_SPLITS == 1 and RETURN_LSE)
    part_out_ptr,  # [max_tokens, NUM_SPLITS, padded_heads, BLOCK_DV] fp32 (NUM_SPLITS > 1)
    part_lse_ptr,  # [max_tokens, NUM_SPLITS, padded_heads] fp32 (NUM_SPLITS > 1)
    scale,
    num_seqs,
    num_heads,
    block_size,
    stride_q_tok,
    stride_q_head,
    stride_q_dim,
    stride_kv_block,
    stride_kv_head,
    stride_kv_tok_hi,
    stride_kv_tok_lo,
    stride_kv_dim_hi,
    stride_kv_dim_lo,
    stride_bt_seq,
    stride_bt_blk,
    stride_indptr,
    stride_indices,
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
    KV_LORA_RANK: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    HEAD_GROUPS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    VARLEN: tl.constexpr,
    PAGE_INDICES: tl.constexpr,
    FLAT_SLOTS: tl.constexpr,  # page_indices into a cache whose pages lie one after another
    KV_VEC: tl.constexpr,  # the cache's rows start on multiples of it (`row_vector_elems`)
    Q_VEC: tl.constexpr,  # the query's rows likewise (`vector_elems`; 1: no claim)
    RETURN_LSE: tl.constexpr,
    TOK_SPLIT: tl.constexpr,
    DIM_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PREFETCH_ROWS: tl.constexpr,
    TMA: tl.constexpr,
    PACKED: tl.constexpr,
    FP32_DOTS: tl.constexpr,  # Triton's interpreter multiplies bf16's raw bits in tl.dot
):
    # Lesson 1: the value tile is the latent tile, sized from kv_lora_rank; the rope tile from the
    # rest. Tiles sized from head_dim_k (next_pow2(320) = 512 for a 256 latent) are refused here.
    tl.static_assert(
        BLOCK_DV >= KV_LORA_RANK and (BLOCK_DV < 2 * KV_LORA_RANK or BLOCK_DV == 16),
        "BLOCK_DV must be next_pow2(kv_lora_rank), at least 16: the value tile comes from the "
        "latent width",
    )
    tl.static_assert(
        BLOCK_DPE >= ROPE_DIM and (ROPE_DIM == 0 or BLOCK_DPE < 2 * ROPE_DIM or BLOCK_DPE == 16),
        "BLOCK_DPE must be next_pow2(head_dim_k - kv_lora_rank), at least 16 (0 without a rope "
        "part)",
    )
    tl.static_assert(BLOCK_H >= 16 and BLOCK_N >= 16, "tl.dot needs BLOCK_H, BLOCK_N >= 16")
    # Strides that are multiples of KV_VEC / Q_VEC, said in a form the compiler follows (it sees
    # only integers divisible by 16): rows that start on such multiples load as vectors.
    stride_kv_block, stride_kv_head, stride_kv_tok_hi = in_units(
        stride_kv_block, stride_kv_head, stride_kv_tok_hi, KV_VEC
    )
    if Q_VEC > 1:
        stride_q_tok = stride_q_tok // Q_VEC * Q_VEC
        stride_q_head = stride_q_head // Q_VEC * Q_VEC

    # -- which (token, split, head group): head groups vary fastest, so the programs reading the
    # same context run side by side and share it through L2 --
    pid = tl.program_id(0)
    if PACKED:
        # (sequence, split, row group): row r of the tile is (query token r // num_heads, head
        # r % num_heads) of this sequence, each row with its own causal limit; the tile's range
        # (and its split chunks) come from the largest limit of its rows
        hg = pid % row_groups
        rest = pid // row_groups
        split = rest % NUM_SPLITS
        seq = rest // NUM_SPLITS
        if VARLEN:
            q_start = tl.load(qsl_ptr + seq * stride_qsl)
            q_len = tl.load(qsl_ptr + (seq + 1) * stride_qsl) - q_start
        else:
            q_start = seq
            q_len = 1
        rows = hg * BLOCK_H + tl.arange(0, BLOCK_H)
        q_rows = rows // num_heads
        offs_h = rows % num_heads  # each row's head
        mask_h = q_rows < q_len  # real rows
        tok_rows = (q_start + q_rows).to(tl.int64)  # each row's query token
        seq_len = tl.load(seq_lens_ptr + seq * stride_seq_lens)
        row_len = tl.where(mask_h, seq_len - q_len + q_rows + 1, 0)  # causal rule, per row
        kv_len = tl.max(row_len, 0)
    else:
        hg = pid % HEAD_GROUPS
        rest = pid // HEAD_GROUPS
        split = rest % NUM_SPLITS
        tok = rest // NUM_SPLITS
        if VARLEN:
            seq = tl.maximum(_find_seq(qsl_ptr, stride_qsl, tok, num_seqs), 0)
            q_start = tl.load(qsl_ptr + seq * stride_qsl)
            q_len = tl.load(qsl_ptr + (seq + 1) * stride_qsl) - q_start
            q_idx = tok - q_start
            valid = (q_idx >= 0) & (q_idx < q_len)  # rows past qsl[-1] are graph padding
        else:
            seq = tok
            q_len = 1
            q_idx = 0
            valid = tok >= 0
        seq_len = tl.load(seq_lens_ptr + seq * stride_seq_lens)
        kv_len = tl.where(valid, seq_len - q_len + q_idx + 1, 0)  # causal rule
        offs_h = hg * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_h = offs_h < num_heads
        tok_rows = tok.to(tl.int64)
    chunk = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, kv_len)
    if PACKED:
        row_end = tl.minimum(row_len, end)  # [BLOCK_H] each row's end inside this split

    # -- query tiles: latent [BLOCK_H, BLOCK_DV] and rope [BLOCK_H, BLOCK_DPE] --
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < KV_LORA_RANK
    if PACKED:
        q_row = q_ptr + tok_rows[:, None] * stride_q_tok + offs_h[:, None] * stride_q_head
    else:
        q_row = q_ptr + tok_rows * stride_q_tok + offs_h[:, None] * stride_q_head
    q_lat = tl.load(
        q_row + offs_dv[None, :] * stride_q_dim, mask=mask_h[:, None] & mask_dv[None, :], other=0.0
    )
    dv_off = (offs_dv // DIM_SPLIT) * stride_kv_dim_hi + (offs_dv % DIM_SPLIT) * stride_kv_dim_lo
    if BLOCK_DPE > 0:
        offs_pe = KV_LORA_RANK + tl.arange(0, BLOCK_DPE)
        mask_pe = offs_pe < KV_LORA_RANK + ROPE_DIM
        q_pe = tl.load(
            q_row + offs_pe[None, :] * stride_q_dim,
            mask=mask_h[:, None] & mask_pe[None, :],
            other=0.0,
        )
        pe_off = (offs_pe // DIM_SPLIT) * stride_kv_dim_hi + (
            offs_pe % DIM_SPLIT
        ) * stride_kv_dim_lo
    else:
        q_pe = q_lat

    qk_scale = scale * 1.4426950408889634  # exp2 domain
    if PACKED:  # fp32's lowest, finite: a row with no column in a tile (or split) gets p = 0,
        # alpha = 1, no NaN; every finite score reaches the max (a -1e30 start hid scores below it)
        m_i = tl.full([BLOCK_H], -3.4028234663852886e38, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt_seq
    if PAGE_INDICES:
        page_start = tl.load(page_indptr_ptr + seq * stride_indptr).to(tl.int64)
    else:
        page_start = tl.zeros((), dtype=tl.int64)

    if TMA:
        tl.static_assert(BLOCK_DPE > 0, "descriptor tiles need a rope part (_tma_ok)")
        # Whole tiles inside one page (block_size % BLOCK_N == 0): one descriptor load per part,
        # which Triton pipelines as asynchronous bulk copies. The last, partial tile (whose rows
        # past `end` must read as zeros) goes through the gather loop below.
        full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
        # the next tile's block id is loaded one step early (off the load -> copy chain)
        blk_next = tl.load(
            bt_row + (start // block_size) * stride_bt_blk, mask=start < full_end, other=0
        )
        for n in range(start, full_end, BLOCK_N):
            blk = blk_next.to(tl.int32)
            blk_next = tl.load(
                bt_row + ((n + BLOCK_N) // block_size) * stride_bt_blk,
                mask=n + BLOCK_N < full_end,
                other=0,
            )
            off = n % block_size
            lat = lat_desc.load([blk, off, 0]).reshape(BLOCK_N, BLOCK_DV)
            pe = pe_desc.load([blk, off, KV_LORA_RANK]).reshape(BLOCK_N, BLOCK_DPE)
            if PACKED:
                mask_s = (n + tl.arange(0, BLOCK_N))[None, :] < row_end[:, None]
            else:
                mask_s = ((n + tl.arange(0, BLOCK_N)) < end)[None, :]
            m_i, l_i, acc = _online_step(
                q_lat,
                q_pe,
                lat,
                pe,
                lat,
                mask_s,
                m_i,
                l_i,
                acc,
                qk_scale,
                BLOCK_DPE,
                DOT_PRECISION,
                FP32_DOTS,
            )
        start = full_end
    if PREFETCH_ROWS:  # software pipelining by hand: tile i+1's block-table entries during tile i
        row_next = _kv_row_offsets(
            start,
            end,
            bt_row,
            page_indices_ptr,
            page_start,
            block_size,
            stride_bt_blk,
            stride_indices,
            stride_kv_block,
            stride_kv_tok_hi,
            stride_kv_tok_lo,
            BLOCK_N,
            PAGE_INDICES,
            TOK_SPLIT,
            FLAT_SLOTS,
        )
    for n in range(start, end, BLOCK_N):  # with TMA: only the partial last tile
        # -- context rows n .. n+BLOCK_N-1: block and in-block offset (int64 offsets) --
        offs_n = n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        if PREFETCH_ROWS:
            row = row_next
            row_next = _kv_row_offsets(
                n + BLOCK_N,
                end,
                bt_row,
                page_indices_ptr,
                page_start,
                block_size,
                stride_bt_blk,
                stride_indices,
                stride_kv_block,
                stride_kv_tok_hi,
                stride_kv_tok_lo,
                BLOCK_N,
                PAGE_INDICES,
                TOK_SPLIT,
                FLAT_SLOTS,
            )
        else:
            row = _kv_row_offsets(
                n,
                end,
                bt_row,
                page_indices_ptr,
                page_start,
                block_size,
                stride_bt_blk,
                stride_indices,
                stride_kv_block,
                stride_kv_tok_hi,
                stride_kv_tok_lo,
                BLOCK_N,
                PAGE_INDICES,
                TOK_SPLIT,
                FLAT_SLOTS,
            )
        lat = tl.load(
            kv_ptr + row[:, None] + dv_off[None, :],
            mask=mask_n[:, None] & mask_dv[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_DV]: K's latent part AND V
        if BLOCK_DPE > 0:
            pe = tl.load(
                kv_ptr + row[:, None] + pe_off[None, :],
                mask=mask_n[:, None] & mask_pe[None, :],
                other=0.0,
            )  # [BLOCK_N, BLOCK_DPE]
        else:
            pe = lat
        if PACKED:  # noqa: SIM108 (a constexpr branch, not a runtime select)
            mask_s = offs_n[None, :] < row_end[:, None]
        else:
            mask_s = mask_n[None, :]
        m_i, l_i, acc = _online_step(
            q_lat,
            q_pe,
            lat,
            pe,
            lat,
            mask_s,
            m_i,
            l_i,
            acc,
            qk_scale,
            BLOCK_DPE,
            DOT_PRECISION,
            FP32_DOTS,
        )

    # -- epilogue: normalised output and natural-log lse (-inf, zeros for an empty range) --
    has = l_i > 0
    l_safe = tl.where(has, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(has, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    if PACKED:  # each real row to its (token, head); padded rows nowhere
        if NUM_SPLITS == 1:
            tl.store(
                out_ptr
                + tok_rows[:, None] * stride_out_tok
                + offs_h[:, None] * stride_out_head
                + offs_dv[None, :] * stride_out_dim,
                o.to(out_ptr.dtype.element_ty),
                mask=mask_h[:, None] & mask_dv[None, :],
            )
            if RETURN_LSE:
                tl.store(
                    lse_ptr + tok_rows * stride_lse_tok + offs_h * stride_lse_head,
                    lse,
                    mask=mask_h,
                )
        else:  # every column (the reduce reads BLOCK_DV of them)
            tl.store(
                part_out_ptr
                + tok_rows[:, None] * stride_po_tok
                + split * stride_po_split
                + offs_h[:, None] * stride_po_head
                + offs_dv[None, :] * stride_po_dim,
                o,
                mask=mask_h[:, None],
            )
            tl.store(
                part_lse_ptr
                + tok_rows * stride_pl_tok
                + split * stride_pl_split
                + offs_h * stride_pl_head,
                lse,
                mask=mask_h,
            )
    else:
        tok64 = tok.to(tl.int64)
        if NUM_SPLITS == 1:
            mask_o = mask_h & valid
            tl.store(
                out_ptr
                + tok64 * stride_out_tok
                + offs_h[:, None] * stride_out_head
                + offs_dv[None, :] * stride_out_dim,
                o.to(out_ptr.dtype.element_ty),
                mask=mask_o[:, None] & mask_dv[None, :],
            )
            if RETURN_LSE:
                tl.store(
                    lse_ptr + tok64 * stride_lse_tok + offs_h * stride_lse_head, lse, mask=mask_o
                )
        else:
            # the real heads' rows, every padded column (the reduce reads BLOCK_DV of them)
            real_h = mask_h & valid
            tl.store(
                part_out_ptr
                + tok64 * stride_po_tok
                + split * stride_po_split
                + offs_h[:, None] * stride_po_head
                + offs_dv[None, :] * stride_po_dim,
                o,
                mask=real_h[:, None],
            )
            tl.store(
                part_lse_ptr
                + tok64 * stride_pl_tok
                + split * stride_pl_split
                + offs_h * stride_pl_head,
                lse,
                mask=real_h,
            )


@triton.jit
def _mla_reduce_kernel(
    part_out_ptr,  # [max_tokens, NUM_SPLITS, padded_heads, BLOCK_DV] fp32
    part_lse_ptr,  # [max_tokens, NUM_SPLITS, padded_heads] fp32
    out_ptr,  # [num_tokens, num_q_heads, KV_LORA_RANK]
    lse_ptr,  # [num_tokens, num_q_heads] fp32 (RETURN_LSE only)
    qsl_ptr,  # [num_seqs + 1] (VARLEN only)
    num_seqs,
    num_heads,
    stride_po_tok,
    stride_po_split,
    stride_po_head,
    stride_po_dim,
    stride_pl_tok,
    stride_pl_split,
    stride_pl_head,
    stride_out_tok,
    stride_out_head,
    stride_out_dim,
    stride_lse_tok,
    stride_lse_head,
    stride_qsl,
    KV_LORA_RANK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    VARLEN: tl.constexpr,
    RETURN_LSE: tl.constexpr,
):
    pid = tl.program_id(0)
    h = pid % num_heads
    tok = (pid // num_heads).to(tl.int64)
    if VARLEN:  # noqa: SIM108 (a constexpr branch, not a runtime select)
        valid = tok < tl.load(qsl_ptr + num_seqs * stride_qsl)
    else:
        valid = tok >= 0
    # -- weights exp(lse_s - max): empty splits (-inf) weigh 0 --
    offs_s = tl.arange(0, BLOCK_S)
    pl = part_lse_ptr + tok * stride_pl_tok + h * stride_pl_head
    lses = tl.load(
        pl + offs_s * stride_pl_split, mask=(offs_s < NUM_SPLITS) & valid, other=float("-inf")
    )
    m = tl.max(lses, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.sum(tl.exp(lses - m), 0)
    offs_d = tl.arange(0, BLOCK_DV)
    po = part_out_ptr + tok * stride_po_tok + h * stride_po_head + offs_d * stride_po_dim
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for s in range(NUM_SPLITS):
        w = tl.exp(tl.load(pl + s * stride_pl_split, mask=valid, other=float("-inf")) - m)
        acc += w * tl.load(po + s * stride_po_split, mask=valid, other=0.0)
    # -- epilogue --
    has = denom > 0
    o = acc / tl.where(has, denom, 1.0)
    tl.store(
        out_ptr + tok * stride_out_tok + h * stride_out_head + offs_d * stride_out_dim,
        o.to(out_ptr.dtype.element_ty),
        mask=(offs_d < KV_LORA_RANK) & valid,
    )
    if RETURN_LSE:
        lse = tl.where(has, m + tl.log(tl.where(has, denom, 1.0)), float("-inf"))
        tl.store(lse_ptr + tok * stride_lse_tok + h * stride_lse_head, lse, mask=valid)


# -- launcher ----------------------------------------------------------------------------------


def _arg_summary(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor of dtype {x.dtype}, shape {tuple(x.shape)}"
    return type(x).__name__ if x is not None else "None"


def _type_errors(
    query,
    kv_cache,
    block_table,
    seq_lens,
    kv_lora_rank,
    scale,
    query_start_loc,
    out,
    page_indices,
    metadata,
    return_lse,
    config,
    trace,
) -> list[str]:
    errors = []
    if not isinstance(query, torch.Tensor) or query.dtype not in FLOAT_DTYPES:
        errors.append(f"query must be a float16/bfloat16/float32 tensor; got {_arg_summary(query)}")
    qdt = query.dtype if isinstance(query, torch.Tensor) else None
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dtype != qdt:
        got = _arg_summary(kv_cache)
        errors.append(f"kv_cache must be a tensor of query's dtype {qdt}; got {got}")
    if out is not None and (not isinstance(out, torch.Tensor) or out.dtype != qdt):
        got = _arg_summary(out)
        errors.append(f"out must be None or a tensor of query's dtype {qdt}; got {got}")
    if isinstance(kv_lora_rank, bool) or not isinstance(kv_lora_rank, int):
        errors.append(f"kv_lora_rank must be an int; got {type(kv_lora_rank).__name__}")
    errors += scale_type_errors(scale)
    if not isinstance(return_lse, bool):
        errors.append(f"return_lse must be a bool; got {type(return_lse).__name__}")
    index_args = [
        ("seq_lens", seq_lens, False),
        ("block_table", block_table, True),
        ("query_start_loc", query_start_loc, True),
    ]
    if page_indices is not None:
        if not isinstance(page_indices, (tuple, list)) or len(page_indices) != 2:
            errors.append(
                f"page_indices must be a pair (indptr, indices); got {_arg_summary(page_indices)}"
            )
        else:
            index_args += [
                ("page_indices[0] (indptr)", page_indices[0], False),
                ("page_indices[1] (indices)", page_indices[1], False),
            ]
    for name, t, optional in index_args:
        if t is None and optional:
            continue
        if not isinstance(t, torch.Tensor) or t.dtype not in INDEX_DTYPES:
            errors.append(f"{name} must be an int32/int64 tensor; got {_arg_summary(t)}")
    if metadata is not None and not isinstance(metadata, MlaMetadata):
        errors.append(f"metadata must be None or an MlaMetadata; got {_arg_summary(metadata)}")
    if config is not None and not isinstance(config, MlaConfig):
        errors.append(f"config must be None or an MlaConfig; got {_arg_summary(config)}")
    if trace is not None and not _is_tensor_of(trace, (torch.int64,)):
        errors.append(f"trace must be None or an int64 tensor; got {_arg_summary(trace)}")
    return errors


def _is_tensor_of(x, dtypes) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype in dtypes


def _value_errors(
    query,
    kv_cache,
    block_table,
    seq_lens,
    kv_lora_rank,
    scale,
    query_start_loc,
    out,
    page_indices,
    metadata,
    config,
    trace,
) -> list[str]:
    """Shape, device and scalar problems; arguments with a type problem (`_type_errors`) are
    skipped, so both lists together name every problem of a call."""
    errors = []
    q3 = _is_tensor_of(query, FLOAT_DTYPES) and query.dim() == 3
    if _is_tensor_of(query, FLOAT_DTYPES) and not q3:
        errors.append(
            f"query must be 3-D [num_tokens, num_q_heads, head_dim_k]; got shape "
            f"{tuple(query.shape)}"
        )
    num_tokens = num_heads = head_dim_k = None
    if q3:
        num_tokens, num_heads, head_dim_k = query.shape
        if num_heads < 1 or head_dim_k < 1:
            errors.append(
                "query must have num_q_heads >= 1 and head_dim_k >= 1; got shape "
                f"{tuple(query.shape)}"
            )
    if isinstance(kv_cache, torch.Tensor) and q3:
        if kv_cache.dim() != 3 or kv_cache.shape[2] != head_dim_k:
            errors.append(
                f"kv_cache must be [num_blocks, block_size, head_dim_k={head_dim_k}]; got "
                f"shape {tuple(kv_cache.shape)}"
            )
        elif kv_cache.shape[0] < 1 or kv_cache.shape[1] < 1:
            errors.append(
                f"kv_cache must have num_blocks >= 1 and block_size >= 1; got shape "
                f"{tuple(kv_cache.shape)}"
            )
    if is_int(kv_lora_rank) and head_dim_k is not None and not 1 <= kv_lora_rank <= head_dim_k:
        errors.append(f"kv_lora_rank must be in 1..head_dim_k={head_dim_k}; got {kv_lora_rank}")
    if is_real(scale):
        errors += scale_errors(scale)
    pair = isinstance(page_indices, (tuple, list)) and len(page_indices) == 2
    indptr, indices = page_indices if pair else (None, None)
    indptr = indptr if _is_tensor_of(indptr, INDEX_DTYPES) else None
    indices = indices if _is_tensor_of(indices, INDEX_DTYPES) else None
    table = block_table if _is_tensor_of(block_table, INDEX_DTYPES) else None
    lens = seq_lens if _is_tensor_of(seq_lens, INDEX_DTYPES) else None
    qsl = query_start_loc if _is_tensor_of(query_start_loc, INDEX_DTYPES) else None
    if (block_table is None) == (page_indices is None):
        errors.append(
            "exactly one of block_table and page_indices must be given; got "
            + ("both" if block_table is not None else "neither")
        )
    # num_seqs: what most of block_table (or indptr), query_start_loc and seq_lens say, ties
    # going to them in that order; each of them that disagrees is the one blamed
    votes = []
    if table is not None and table.dim() == 2:
        votes.append(table.shape[0])
    elif table is None and indptr is not None and indptr.dim() == 1 and indptr.shape[0] >= 1:
        votes.append(indptr.shape[0] - 1)
    if qsl is not None and qsl.dim() == 1 and qsl.shape[0] >= 1:
        votes.append(qsl.shape[0] - 1)
    if lens is not None and lens.dim() == 1:
        votes.append(lens.shape[0])
    num_seqs = max(votes, key=votes.count) if votes else None
    if lens is not None and (lens.dim() != 1 or lens.shape[0] < 1):
        errors.append(f"seq_lens must be 1-D with >= 1 sequence; got shape {tuple(lens.shape)}")
    elif lens is not None and num_seqs is not None and lens.shape[0] != num_seqs:
        errors.append(
            f"seq_lens must have one entry per sequence (num_seqs={num_seqs}); got shape "
            f"{tuple(lens.shape)}"
        )
    # (an empty batch is seq_lens' message alone: a [0, n] table matches it)
    if table is not None and (table.dim() != 2 or table.shape[0] != num_seqs or table.shape[1] < 1):
        want = "num_seqs >= 1" if num_seqs is None else f"num_seqs={num_seqs}"
        errors.append(
            f"block_table must be [{want}, max_blocks_per_seq >= 1]; got shape {tuple(table.shape)}"
        )
    if indptr is not None and num_seqs is not None and tuple(indptr.shape) != (num_seqs + 1,):
        errors.append(
            f"page_indices[0] (indptr) must have shape ({num_seqs + 1},); got {tuple(indptr.shape)}"
        )
    if indices is not None and indices.dim() != 1:
        errors.append(f"page_indices[1] (indices) must be 1-D; got shape {tuple(indices.shape)}")
    decode_md = isinstance(metadata, MlaMetadata) and metadata.decode
    if qsl is not None and num_seqs is not None and tuple(qsl.shape) != (num_seqs + 1,):
        errors.append(
            f"query_start_loc must have shape (num_seqs + 1,) = ({num_seqs + 1},); "
            f"got {tuple(qsl.shape)}"
        )
    elif (
        query_start_loc is None
        and q3
        and num_seqs is not None
        and num_tokens != num_seqs
        and not (isinstance(metadata, MlaMetadata) and not metadata.decode)
    ):
        errors.append(
            f"query must have one token per sequence without query_start_loc; got "
            f"{num_tokens} tokens for {num_seqs} sequences"
        )
    if _is_tensor_of(out, FLOAT_DTYPES) and q3 and is_int(kv_lora_rank):
        want_out = (num_tokens, num_heads, kv_lora_rank)
        if tuple(out.shape) != want_out:
            errors.append(f"out must have shape {want_out}; got {tuple(out.shape)}")
    tensors = [
        ("kv_cache", kv_cache),
        ("seq_lens", seq_lens),
        ("block_table", block_table),
        ("query_start_loc", query_start_loc),
        ("out", out),
        ("page_indices", indptr),
        ("page_indices", indices),
        ("trace", trace),
    ]
    if isinstance(query, torch.Tensor):
        for name, t in tensors:
            if isinstance(t, torch.Tensor) and t.device != query.device:
                errors.append(f"{name} must be on query's device {query.device}; got {t.device}")
    if isinstance(metadata, MlaMetadata) and num_tokens is not None:
        md = metadata
        layer = (num_heads, head_dim_k, kv_lora_rank, query.dtype)
        if (md.num_heads, md.head_dim_k, md.kv_lora_rank, md.dtype) != layer:
            errors.append(
                "metadata must be built for (num_heads, head_dim_k, kv_lora_rank, dtype) = "
                f"{layer}; got {(md.num_heads, md.head_dim_k, md.kv_lora_rank, md.dtype)}"
            )
        if num_seqs is not None and md.num_seqs != num_seqs:
            errors.append(
                f"metadata must be built for this step's {num_seqs} sequences; got {md.num_seqs}"
            )
        if num_tokens > md.max_tokens:
            errors.append(
                f"query must have <= metadata.max_tokens={md.max_tokens} tokens; got {num_tokens}"
            )
        if decode_md and num_seqs is not None and num_tokens != num_seqs:
            errors.append(
                f"query must have one token per sequence with single-token "
                f"(max_query_len == 1) metadata; got {num_tokens} tokens for "
                f"{num_seqs} sequences"
            )
        if not md.decode and query_start_loc is None:
            errors.append(
                f"query_start_loc must be given with metadata of max_query_len="
                f"{md.max_query_len}; got None"
            )
        if md.partial_out.device != query.device and md.tiles.num_kv_splits > 1:
            errors.append(
                f"metadata workspaces must be on query's device {query.device}; got "
                f"{md.partial_out.device}"
            )
    if isinstance(config, MlaConfig) and is_int(kv_lora_rank):
        heads = query.shape[1] if isinstance(query, torch.Tensor) and query.dim() == 3 else 0
        errors += mla_config_errors(config, kv_lora_rank, heads)
    return errors


def _workspace_errors(tiles: MlaTiles, md: MlaMetadata, num_tokens: int) -> list[str]:
    """The workspaces must be exactly what the tiles describe (lesson 2)."""
    if tiles.num_kv_splits == 1:
        return []
    t = tiles
    want_o = (md.max_tokens, t.num_kv_splits, t.padded_heads, t.block_dv)
    want_l = want_o[:3]
    errors = []
    if tuple(md.partial_out.shape) != want_o or md.partial_out.dtype != torch.float32:
        errors.append(
            f"metadata.partial_out must be fp32 {want_o} (from its tiles); got "
            f"{md.partial_out.dtype} {tuple(md.partial_out.shape)}"
        )
    if tuple(md.partial_lse.shape) != want_l or md.partial_lse.dtype != torch.float32:
        errors.append(
            f"metadata.partial_lse must be fp32 {want_l} (from its tiles); got "
            f"{md.partial_lse.dtype} {tuple(md.partial_lse.shape)}"
        )
    return errors


def longest_seq_len(dtype: torch.dtype) -> int:
    """The longest seq_len the kernels count: in 32 bits for int32 seq_lens (they load it in
    its own dtype), else in 64."""
    return POSITIONS32_LIMIT - 1 if dtype == torch.int32 else INT64_MAX


def _check_contents(
    query, kv_cache, block_table, seq_lens, query_start_loc, page_indices, metadata
) -> int:
    """The metadata's values, through `_checks` on one host copy: query_start_loc well formed
    (rows past its end are graph padding), seq_lens >= each q_len, and the used block ids
    (block table) or slots (page indices, which must agree with seq_lens) inside the cache.
    Returns the longest q_len (1 without query_start_loc)."""
    num_tokens = query.shape[0]
    num_blocks, block_size = kv_cache.shape[0], kv_cache.shape[1]
    index = list(page_indices) if page_indices is not None else [block_table]
    qsl_t = [query_start_loc] if query_start_loc is not None else []
    lens, *rest = to_host(seq_lens, *qsl_t, *index)
    qsl = rest.pop(0) if query_start_loc is not None else None
    errors: list[str] = []
    q_lens = np.ones_like(lens)  # one token per sequence (plain decode)
    longest = 1
    if qsl is not None:
        errors += offsets_errors(
            "query_start_loc", qsl, end=num_tokens, end_name="num_tokens", end_at_most=True
        )
        longest = int((qsl[1:] - qsl[:-1]).max())
        if metadata is not None and longest > metadata.max_query_len:
            errors.append(
                f"metadata.max_query_len must be >= the longest q_len {longest}; got "
                f"{metadata.max_query_len}"
            )
        if not (metadata is not None and metadata.decode):
            q_lens = qsl[1:] - qsl[:-1]
        elif (off := qsl != np.arange(qsl.shape[0])).any():  # the kernel reads no offsets
            i = int(np.argmax(off))
            errors.append(
                "query_start_loc must give every sequence one token with single-token metadata "
                f"(metadata.max_query_len 1 runs token i as sequence i); got query_start_loc[{i}]"
                f"={int(qsl[i])}"
            )
    errors += seq_lens_errors(lens, q_lens)
    if seq_lens.dtype == torch.int32:  # the kernels then count positions in 32 bits
        errors += positions32_errors("seq_lens", lens)
    if page_indices is not None:
        indptr, indices = rest
        errors += page_indices_errors(indptr, indices, lens, num_blocks * block_size)
    else:
        (table,) = rest
        errors += capacity_errors(lens, block_size, table.shape[1])
        errors += block_ids_errors(table, lens, block_size, num_blocks)
    raise_errors(_OP, errors)
    return max(1, longest)


def _tma_ok(kv_cache: torch.Tensor, kv_lora_rank: int, tiles: MlaTiles, paged_slots: bool) -> bool:
    """Whether whole tiles can come from tensor descriptors (bulk copies) on this cache.

    Each tile must lie inside one page (``block_size % block_n == 0``; not with flat
    ``page_indices`` slots), the latent and rope tiles must be exactly the cache's columns (no
    padded columns, which a descriptor would fill from the neighbouring part), and the cache must
    meet the copy engine's rules: contiguous last dimension, 16-byte aligned base and strides
    (`rows_aligned`), and every dimension below 2**31: a descriptor's shape and coordinates are
    32-bit (the gather path's block and token terms are 64-bit).
    """
    t = tiles
    rope = kv_cache.shape[2] - kv_lora_rank
    return (
        not paged_slots
        and max(kv_cache.shape) < INT32_LIMIT
        and kv_cache.shape[1] % t.block_n == 0
        and t.block_dv == kv_lora_rank
        and t.block_dpe == rope
        and rope > 0
        and rows_aligned(kv_cache)
    )


def _validate(
    query, kv_cache, block_table, seq_lens, kv_lora_rank, scale, query_start_loc, out,
    page_indices, metadata, return_lse, config, trace, tiles, target=None,
) -> None:  # fmt: skip
    """Every type, value and overlap problem of a call (not the metadata's contents), raised
    together."""
    pages = page_indices if isinstance(page_indices, (tuple, list)) else ()
    named = [
        ("query", query),
        ("kv_cache", kv_cache),
        ("block_table", block_table),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
        ("out", out),
        ("trace", trace),
        *((f"page_indices[{i}]", t) for i, t in enumerate(pages)),
    ]
    refuse_unstrided(_OP, named)
    errors = _type_errors(
        query,
        kv_cache,
        block_table,
        seq_lens,
        kv_lora_rank,
        scale,
        query_start_loc,
        out,
        page_indices,
        metadata,
        return_lse,
        config,
        trace,
    )
    p = Problems(_OP)
    p.type(*errors, *target_errors(target))
    p.value(
        *_value_errors(
            query,
            kv_cache,
            block_table,
            seq_lens,
            kv_lora_rank,
            scale,
            query_start_loc,
            out,
            page_indices,
            metadata,
            config,
            trace,
        )
    )
    if tiles is not None and metadata is not None:
        p.value("tiles must not be given with metadata (the launch uses metadata.tiles)")
    p.value(*lazy_bit_errors(named))
    if not p:
        reads = [("query", query), ("kv_cache", kv_cache), ("block_table", block_table),
                 ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)]  # fmt: skip
        if page_indices is not None:
            reads += [("page_indices[0]", page_indices[0]), ("page_indices[1]", page_indices[1])]
        written = [("out", out), ("trace", trace)]
        if metadata is not None and metadata.tiles.num_kv_splits > 1:
            written += [("metadata.partial_out", metadata.partial_out),
                        ("metadata.partial_lse", metadata.partial_lse)]  # fmt: skip
        p.value(*overlap_errors(written, reads))
        # the kernels' 32-bit offsets: a token's head and dim terms, a cache row's dim term (its
        # block and token terms are 64-bit), a block-table row's columns, the sequences' entries
        indptr = [("page_indices[0]", page_indices[0], (0,))] if page_indices is not None else []
        p.value(*reach32_errors([
            ("query", query, (1, 2)), ("out", out, (1, 2)), ("kv_cache", kv_cache, (2,)),
            ("block_table", block_table, (1,)), ("seq_lens", seq_lens, (0,)),
            ("query_start_loc", query_start_loc, (0,)), *indptr,
        ]))  # fmt: skip
    p.raise_if_any()


#: The unbounded calls' argument checks, by description (`unbounded_query_len`): each kept as
#: ``[True, the longest q_len the description's last call read]``.
_CHECKED = CheckMemo()


@functools.lru_cache(maxsize=256)
def _policy_tiles(target: Target, problem: MlaProblem) -> MlaTiles:
    """`mla_decode_tiles`, remembered: a pure function of two frozen values, asked by every
    plan without metadata (errors are raised afresh each time)."""
    return mla_decode_tiles(target, problem)


#: What a call without metadata reads (`capture_errors`).
_READS = "seq_lens, query_start_loc and the block table or page indices"


def unbounded_query_len(
    query, kv_cache, block_table, seq_lens, kv_lora_rank, scale, query_start_loc, out,
    page_indices, return_lse, config, prepare=None,
) -> tuple[int, Callable[[], tuple] | None]:  # fmt: skip
    """For a call without ``metadata``: the arguments validated, the metadata's values checked
    (on a GPU by the device-side summary, `start_metadata_summary` and
    `finish_metadata_summary`; else, and for page indices, by one host read: `_check_contents`),
    and the longest q_len, which bounds the call to its plan.

    ``prepare(longest)``: called before the wait for the metadata's values (while the device
    checks them), with the longest q_len the description's last call read; it returns the
    call's launches made ready for it (`PlanCache.prepare`) or ``None``. Returns ``(longest,
    ready)``: ``ready`` is what ``prepare`` returned when this call's longest q_len is the same
    (and the metadata valid), else ``None``."""
    indptr, indices = page_indices if page_indices is not None else (None, None)
    inputs = (query, kv_cache, block_table, seq_lens, query_start_loc, out, indptr, indices)
    mask, tensors = present(inputs)
    scalars = (mask, type(kv_lora_rank), kv_lora_rank, type(scale), scale, type(return_lse),
               return_lse, type(page_indices), type(config), config)  # fmt: skip
    entry = _CHECKED.get(scalars, tensors, inputs)
    if entry is None:
        _validate(
            query, kv_cache, block_table, seq_lens, kv_lora_rank, scale, query_start_loc, out,
            page_indices, None, return_lse, config, None, None,
        )  # fmt: skip
        entry = [True, None]
        _CHECKED.keep(scalars, tensors, inputs, (5,), entry)
    capture_errors(_OP, query.device, "metadata", _READS)
    started = None
    if summary_applies(block_table, seq_lens.shape[0]):
        started = start_metadata_summary(
            query_start_loc, seq_lens, block_table, num_tokens=query.shape[0],
            block_size=kv_cache.shape[1], num_blocks=kv_cache.shape[0], end_at_most=True,
            max_len=longest_seq_len(seq_lens.dtype),
        )  # fmt: skip
    ready = prepare(entry[1]) if prepare is not None and entry[1] is not None else None
    got = None if started is None else finish_metadata_summary(started)
    if got is not None:
        longest = max(1, got.max_q_len)
    else:  # broken metadata (or page indices, or no sequence): the host read names what is wrong
        longest = _check_contents(
            query, kv_cache, block_table, seq_lens, query_start_loc, page_indices, None
        )
    if longest != entry[1]:
        entry[1] = longest
        ready = None
    return longest, ready


def plan_mla_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    seq_lens: torch.Tensor,
    *,
    kv_lora_rank: int,
    scale: float,
    query_start_loc: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    page_indices: tuple[torch.Tensor, torch.Tensor] | None = None,
    metadata: MlaMetadata | None = None,
    target: Target | None = None,
    config: MlaConfig | None = None,
    trace: torch.Tensor | None = None,
    tiles: MlaTiles | None = None,
    check_contents: bool | None = None,
    query_len: int | None = None,
) -> list[Launch]:
    """Validate, choose tiles and allocate: the launches of one `mla_decode` call.

    ``query_len``: the longest q_len, already read and checked (`unbounded_query_len`), which
    sizes the plan as a read would; only without ``metadata`` and with ``check_contents`` False.

    ``tiles`` overrides the policy (for the compile matrix and tests; e.g. a naive rule's tiles,
    which the kernel rejects at compile time). Without it the tiles come from ``metadata`` or,
    without metadata, from `mla_decode_tiles`. ``check_contents``: read and validate the
    metadata's values; ``None`` (default): when the tensors are on the CPU, or when no
    ``metadata`` is given; never on meta tensors. The first launch's ``outputs`` are ``(out,)``,
    or ``(out, lse)`` with ``return_lse``. Other arguments as in `mla_decode`.
    """
    _validate(
        query, kv_cache, block_table, seq_lens, kv_lora_rank, scale, query_start_loc, out,
        page_indices, metadata, return_lse, config, trace, tiles, target,
    )  # fmt: skip
    if target is None:
        target = metadata.target if metadata is not None else target_for_tensor(query)
    elif metadata is not None and metadata.target != target:
        raise ValueError(
            f"{_OP}: target must be the metadata's target {metadata.target.arch}; got {target.arch}"
        )
    if check_contents is None:
        check_contents = reads_contents(query.device, vouched=metadata is not None)
    if query_len is not None and (metadata is not None or check_contents):
        raise ValueError(f"{_OP}: query_len is only for a call without metadata or content read")
    longest = query_len  # the longest q_len, when read
    if check_contents and not query.is_meta:
        capture_errors(_OP, query.device, "metadata", _READS)
        longest = _check_contents(
            query, kv_cache, block_table, seq_lens, query_start_loc, page_indices, metadata
        )

    # -- describe the problem --
    num_tokens, num_heads, head_dim_k = query.shape
    block_size = kv_cache.shape[1]
    (kv,) = describe_kv_cache(_OP, kv_cache.unsqueeze(2), kv_cache.unsqueeze(2), "NHD")[:1]
    if page_indices is not None:
        max_context = max(1, page_indices[1].shape[0])
    else:
        assert block_table is not None
        max_context = block_table.shape[1] * block_size
    num_seqs = seq_lens.shape[0]
    varlen = query_start_loc is not None and not (metadata is not None and metadata.decode)
    # The longest query (row packing's grid and policy): the metadata's, the one read, or an
    # upper bound (num_tokens) where nothing was read.
    if not varlen:
        max_query_len = 1
    elif metadata is not None:
        max_query_len = metadata.max_query_len
    else:
        max_query_len = longest if longest is not None else max(1, num_tokens)

    # -- tiles: injected, the metadata's (never recomputed), or the policy's --
    slots = page_indices is not None
    # whether the sm_90 kernel can run this cache (below 64 heads the policy's wide tile then)
    sm90_ready = target.arch in SM90_KERNEL_ARCHS and not sm90_errors(
        kv_cache, kv_lora_rank, SM90_BLOCK_H, SM90_BLOCK_N, target, slots
    )
    problem = MlaProblem(
        num_heads, head_dim_k, kv_lora_rank, query.element_size(), num_tokens, max_context,
        max_query_len, sm90_ready,
    )  # fmt: skip
    if tiles is None and metadata is not None:
        tiles = metadata.tiles
    elif tiles is None:
        try:
            tiles = _policy_tiles(target, problem)
        except ValueError as exc:  # no tile fits the target: the call's widths and dtype ask for it
            raise ValueError(f"{_OP}: {exc}") from None
    if not sm90_ready:  # tiles planned for the Hopper kernel, which cannot read this cache
        tiles = portable_tiles(tiles, query.element_size())
    splits = tiles.num_kv_splits
    row_groups = mla_row_groups(tiles, num_heads, max_query_len)

    # -- allocate --
    dev = query.device
    given_out = out
    if out is None:
        out = torch.empty((num_tokens, num_heads, kv_lora_rank), dtype=query.dtype, device=dev)
    lse = (
        torch.empty((num_tokens, num_heads), dtype=torch.float32, device=dev)
        if return_lse
        else None
    )
    if splits > 1:
        if metadata is not None:
            errors = _workspace_errors(tiles, metadata, num_tokens)
            if errors:
                raise ValueError(f"{_OP}: " + "; ".join(errors))
            part_out, part_lse = metadata.partial_out, metadata.partial_lse
        else:
            part_out = torch.empty(
                (num_tokens, splits, tiles.padded_heads, tiles.block_dv),
                dtype=torch.float32,
                device=dev,
            )
            part_lse = torch.empty(
                (num_tokens, splits, tiles.padded_heads), dtype=torch.float32, device=dev
            )
    else:
        part_out = part_lse = torch.empty((0,), dtype=torch.float32, device=dev)
    lse_arg = lse if lse is not None else torch.empty((0,), dtype=torch.float32, device=dev)

    outputs = (out,) if lse is None else (out, lse)
    # the caller's tensors the launches write: a given out, the metadata's workspaces
    writes: tuple[torch.Tensor, ...] = (given_out,) if given_out is not None else ()
    if splits > 1 and metadata is not None:
        writes += (part_out, part_lse)
    # seq_lens stands in for tensors a launch never reads (a placeholder pointer)
    qsl = query_start_loc if varlen and query_start_loc is not None else seq_lens
    if page_indices is not None:
        indptr, indices = page_indices
        bt = seq_lens
        stride_bt: tuple[int, ...] = (0, 0)
    else:
        assert block_table is not None
        indptr = indices = seq_lens
        bt = block_table
        stride_bt = block_table.stride()
    stride_lse = lse.stride() if lse is not None else (0, 0)
    stride_po = part_out.stride() if splits > 1 else (0, 0, 0, 0)
    stride_pl = part_lse.stride() if splits > 1 else (0, 0, 0)
    kv_args = kv.kernel_args("kv")
    tma = tiles.tma and _tma_ok(kv_cache, kv_lora_rank, tiles, page_indices is not None)
    if tma:
        dims = list(kv_cache.shape)
        lat_desc = TensorDescriptor(
            kv_cache, dims, list(kv_cache.stride()), [1, tiles.block_n, tiles.block_dv]
        )
        pe_desc = TensorDescriptor(
            kv_cache, dims, list(kv_cache.stride()), [1, tiles.block_n, tiles.block_dpe]
        )
    else:
        lat_desc = pe_desc = kv_cache
    # DIM_SPLIT/TOK_SPLIT: 1 for this NHD-like cache (the layout rule's general form is kept).
    # packed: programs per (sequence, split); else per (query token, split)
    programs = num_seqs if tiles.packed else num_tokens
    main = Launch(
        kernel=_mla_decode_kernel,
        grid=(programs * row_groups * splits,),
        args=dict(
            q_ptr=query,
            kv_ptr=kv_cache,
            lat_desc=lat_desc,
            pe_desc=pe_desc,
            block_table_ptr=bt,
            page_indptr_ptr=indptr,
            page_indices_ptr=indices,
            seq_lens_ptr=seq_lens,
            qsl_ptr=qsl,
            row_groups=row_groups,
            out_ptr=out,
            lse_ptr=lse_arg,
            part_out_ptr=part_out,
            part_lse_ptr=part_lse,
            scale=float(scale),
            num_seqs=num_seqs,
            num_heads=num_heads,
            block_size=block_size,
            stride_q_tok=query.stride(0),
            stride_q_head=query.stride(1),
            stride_q_dim=query.stride(2),
            **kv_args,
            stride_bt_seq=stride_bt[0],
            stride_bt_blk=stride_bt[1],
            stride_indptr=indptr.stride(0),
            stride_indices=indices.stride(0),
            stride_seq_lens=seq_lens.stride(0),
            stride_qsl=qsl.stride(0),
            stride_out_tok=out.stride(0),
            stride_out_head=out.stride(1),
            stride_out_dim=out.stride(2),
            stride_lse_tok=stride_lse[0],
            stride_lse_head=stride_lse[1],
            stride_po_tok=stride_po[0],
            stride_po_split=stride_po[1],
            stride_po_head=stride_po[2],
            stride_po_dim=stride_po[3],
            stride_pl_tok=stride_pl[0],
            stride_pl_split=stride_pl[1],
            stride_pl_head=stride_pl[2],
            KV_LORA_RANK=kv_lora_rank,
            ROPE_DIM=head_dim_k - kv_lora_rank,
            BLOCK_H=tiles.block_h,
            BLOCK_N=tiles.block_n,
            BLOCK_DV=tiles.block_dv,
            BLOCK_DPE=tiles.block_dpe,
            HEAD_GROUPS=tiles.head_groups,
            NUM_SPLITS=splits,
            VARLEN=varlen,
            PAGE_INDICES=page_indices is not None,
            FLAT_SLOTS=page_indices is not None and is_block_contiguous(kv),
            # rows of strides no multiple of 16 elements (a 520-wide cache) load as vectors
            KV_VEC=row_vector_elems(kv, kv_cache.element_size()),
            Q_VEC=vector_elems(query.element_size(), query.stride(0), query.stride(1))
            if query.stride(2) == 1
            else 1,
            RETURN_LSE=return_lse,
            TOK_SPLIT=kv.tok_split,
            DIM_SPLIT=kv.dim_split,
            # "ieee" for every dtype: it only matters for fp32 operands (exact fp32 products,
            # like the paged kernel), and gfx90a/gfx950 reject "tf32" even for 16-bit operands
            # (compile matrix: 38 MLA cells failed with it).
            DOT_PRECISION="ieee",
            PREFETCH_ROWS=tiles.prefetch_rows,
            TMA=tma,
            PACKED=tiles.packed,
            # Triton's interpreter multiplies bf16's raw bits in tl.dot: CPU tensors (which
            # only run there) take the dots in fp32 instead
            FP32_DOTS=query.is_cpu and query.dtype == torch.bfloat16,
        ),
        options=tiles.options,
        target=target,
        name="mla_decode",
        outputs=outputs,
        writes=writes,
    )
    # the cache was asked about above; the kernel runs its own tile only (sm90_errors' tile rule)
    sm90_tile = (tiles.block_h, tiles.block_n) == (SM90_BLOCK_H, SM90_BLOCK_N)
    if tiles.sm90_kernel and sm90_tile and sm90_ready:
        if config is None:
            config = mla_config(target, problem, tiles)
        elif config.heads_n and tiles.packed:
            raise ValueError(
                f"{_OP}: config.heads_n must be False where the launch packs (query token, head) "
                "rows (a verification step's tiles, or a metadata builder's sized for one: one "
                "query token a program is its rule); got True"
            )
        main = sm90_launch(main, kv_cache, kv_lora_rank, config, trace)
    elif trace is not None:
        raise ValueError(
            f"{_OP}: trace must be None where the launch runs the portable kernel (only the sm_90 "
            "kernel stamps a trace); got a tensor"
        )
    if splits == 1:
        return [main]
    reduce = Launch(
        kernel=_mla_reduce_kernel,
        grid=(num_tokens * num_heads,),
        args=dict(
            part_out_ptr=part_out,
            part_lse_ptr=part_lse,
            out_ptr=out,
            lse_ptr=lse_arg,
            qsl_ptr=qsl,
            num_seqs=num_seqs,
            num_heads=num_heads,
            stride_po_tok=stride_po[0],
            stride_po_split=stride_po[1],
            stride_po_head=stride_po[2],
            stride_po_dim=stride_po[3],
            stride_pl_tok=stride_pl[0],
            stride_pl_split=stride_pl[1],
            stride_pl_head=stride_pl[2],
            stride_out_tok=out.stride(0),
            stride_out_head=out.stride(1),
            stride_out_dim=out.stride(2),
            stride_lse_tok=stride_lse[0],
            stride_lse_head=stride_lse[1],
            stride_qsl=qsl.stride(0),
            KV_LORA_RANK=kv_lora_rank,
            BLOCK_DV=tiles.block_dv,
            NUM_SPLITS=splits,
            BLOCK_S=triton.next_power_of_2(splits),
            VARLEN=varlen,
            RETURN_LSE=return_lse,
        ),
        options=tiles.reduce_options,
        target=target,
        name="mla_decode_reduce",
        outputs=outputs,
        writes=writes,
    )
    return [main, reduce]


def _metadata_key(
    md: MlaMetadata,
) -> tuple[int | None, torch.Tensor | None, torch.Tensor | None]:
    """The plan cache's view of ``md``: a number for its values (`exact_id`; ``None``:
    unhashable, the call is not cached) and its two workspaces, or ``None`` for them where
    the plan never reads them (one split: the launch uses zero-size placeholders and nothing
    checks the workspaces, so they are not part of the call's description).

    The values are read on every call and compared with those remembered for this object (by
    ``id``; identical fields compare by identity), so a new object whose ``id`` is a collected
    one's, or fields changed behind the frozen dataclass, are numbered afresh; only hashing the
    values (the tiles and target are frozen dataclasses, hashed field by field in Python) is
    spared on a repeated call."""
    values = _metadata_values(md)
    memo = _METADATA_MEMO.get(id(md))
    if memo is None or memo[0] != values:
        tiles = md.tiles
        one_split = type(tiles) is MlaTiles and tiles.num_kv_splits == 1
        memo = (values, exact_id(values), not one_split)
        if len(_METADATA_MEMO) >= _MAX_METADATA_MEMO:
            _METADATA_MEMO.clear()
        _METADATA_MEMO[id(md)] = memo
    if memo[2]:
        return memo[1], md.partial_out, md.partial_lse
    return memo[1], None, None


def _unbounded_call(
    query, kv_cache, block_table, seq_lens, kv_lora_rank, scale, query_start_loc, out,
    return_lse, page_indices, target, config,
) -> tuple:  # fmt: skip
    """A GPU call without metadata: validated, the metadata checked once, then planned by the
    longest q_len it read and cached under it (the plan reads nothing else of the contents); the
    launches are made ready while the device checks, for the longest q_len of the last call."""
    indptr, indices = page_indices if page_indices is not None else (None, None)
    inputs = (query, kv_cache, block_table, seq_lens, query_start_loc, out, indptr, indices)
    mask, tensors = present(inputs)

    def guard(longest: int) -> tuple:
        """The rest of `call_key`'s description below, for `PlanCache.probe` and `prepare`."""
        return (_OP, "unbounded", _current_device(), override_key(), mask, type(kv_lora_rank),
                kv_lora_rank, type(scale), scale, type(return_lse), return_lse, type(target),
                target, type(config), config, longest)  # fmt: skip

    longest, ready = unbounded_query_len(
        query, kv_cache, block_table, seq_lens, kv_lora_rank, scale, query_start_loc, out,
        page_indices, return_lse, config, lambda n: PLANS.prepare(guard(n), tensors, inputs),
    )  # fmt: skip
    if ready is not None:
        return ready()
    scalars = guard(longest)
    outputs = PLANS.probe(scalars, tensors, inputs)
    if outputs is not None:
        return outputs
    key = call_key(
        _OP, *inputs, kv_lora_rank, scale, return_lse, page_indices is None, target, config,
        longest,
    )  # fmt: skip
    plan = functools.partial(
        plan_mla_decode, query, kv_cache, block_table, seq_lens, kv_lora_rank=kv_lora_rank,
        scale=scale, query_start_loc=query_start_loc, out=out, return_lse=return_lse,
        page_indices=page_indices, target=target, config=config, check_contents=False,
        query_len=longest,
    )  # fmt: skip
    return PLANS.call(key, inputs, plan, (scalars, tensors))


def mla_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    seq_lens: torch.Tensor,
    *,
    kv_lora_rank: int,
    scale: float,
    query_start_loc: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    page_indices: tuple[torch.Tensor, torch.Tensor] | None = None,
    metadata: MlaMetadata | None = None,
    target: Target | None = None,
    config: MlaConfig | None = None,
    trace: torch.Tensor | None = None,
):
    """Absorbed-weight MLA decode / speculative verification over a paged latent cache.

    Args:
        query: ``[num_tokens, num_q_heads, head_dim_k]`` (any strides).
        kv_cache: ``[num_blocks, block_size, head_dim_k]`` (any strides): columns
            ``:kv_lora_rank`` are the latent (also V), the rest the rope part.
        block_table: ``[num_seqs, max_blocks_per_seq]`` block ids; None with ``page_indices``.
        seq_lens: ``[num_seqs]`` context lengths including this step's query tokens.
        kv_lora_rank: latent width (= output width), ``<= head_dim_k``.
        scale: softmax scale (> 0).
        query_start_loc: ``[num_seqs + 1]`` offsets of each sequence's query tokens (any
            ``q_len >= 0``, causal rule of docs/design.md §2; query rows from its last entry
            on belong to no sequence and are not written); None: one token per sequence.
        out: optional ``[num_tokens, num_q_heads, kv_lora_rank]`` output, written in place.
        return_lse: also return the natural-log lse, fp32 ``[num_tokens, num_q_heads]``.
        page_indices: ``(indptr, indices)`` from ``expand_page_indices`` instead of
            ``block_table`` (slot ``s`` is block ``s // block_size``, offset
            ``s % block_size``); identical results.
        metadata: from `portattn.mla_metadata.MlaMetadataBuilder.build` (preallocated
            workspaces and the builder's tiles; needed for CUDA-graph capture). Single-token
            metadata (``max_query_len`` 1) runs token ``i`` as sequence ``i``: a given
            ``query_start_loc`` must then give every sequence one token (checked where the
            metadata's values are read).
        target: override the target (default: the tensor's device / the metadata's).
        config: the sm_90 kernel's schedule (`portattn.policy.mla.MlaConfig`; default: the
            policy's, `mla_config`); validated, and part of the plan cache's key.
        trace: an int64 tensor the sm_90 kernel stamps with clock64 per pair and warpgroup
            (`portattn.kernels.mla_decode_sm90.trace_elements` elements); a diagnostic, never
            cached; refused where the launch runs the portable kernel.

    Returns:
        ``out``, or ``(out, lse)`` with ``return_lse``.

    Raises:
        TypeError/ValueError: every invalid argument, before anything runs. The metadata's
        values (``query_start_loc`` from 0, non-decreasing, ``<= num_tokens``; ``seq_lens >=``
        each ``q_len``; the block ids or page-index slots each sequence uses inside the cache,
        page indices agreeing with ``seq_lens``) are read and checked when the tensors are on
        the CPU, or on a GPU when no ``metadata`` is given (one device-to-host read). On a GPU
        with ``metadata`` (the CUDA-graph path) nothing is read: the caller vouches for them.
    """
    if (
        metadata is None
        and trace is None
        and isinstance(query, torch.Tensor)
        and query.is_cuda
        and (config is None or isinstance(config, MlaConfig))
        and (page_indices is None or isinstance(page_indices, tuple) and len(page_indices) == 2)
        and (target is None or isinstance(target, Target))
    ):
        read = _unbounded_call(
            query, kv_cache, block_table, seq_lens, kv_lora_rank, scale, query_start_loc, out,
            return_lse, page_indices, target, config,
        )  # fmt: skip
        return read if return_lse else read[0]

    # Cached (module _plans) only where the plan reads no contents: a GPU call with metadata.
    cacheable = (
        trace is None
        and isinstance(metadata, MlaMetadata)
        and isinstance(query, torch.Tensor)
        and not tensor_reads_contents(query, vouched=True)
        and (page_indices is None or isinstance(page_indices, tuple) and len(page_indices) == 2)
    )
    key = None
    guard: tuple | None = None
    inputs: tuple = ()
    if cacheable:
        assert metadata is not None
        exact, part_out, part_lse = _metadata_key(metadata)
        indptr, indices = page_indices if page_indices is not None else (None, None)
        inputs = (query, kv_cache, block_table, seq_lens, query_start_loc, out, indptr, indices,
                  part_out, part_lse)  # fmt: skip
        if exact is not None:
            if target is None:  # the rest of `call_key`'s description (`PlanCache.probe`)
                if query_start_loc is out is page_indices is part_out is part_lse is None:
                    mask, tensors = _DECODE, inputs[:4]  # a decode step's: no optional tensor
                else:
                    mask, tensors = present(inputs)
                scalars = (_OP, _current_device(), override_key(), exact, mask, type(kv_lora_rank),
                         kv_lora_rank, type(scale), scale, type(return_lse), return_lse,
                         page_indices is None, config)  # fmt: skip
                outs = PLANS.probe(scalars, tensors, inputs)
                if outs is not None:
                    return outs if return_lse else outs[0]
                guard = (scalars, tensors)
            key = call_key(
                _OP, *inputs, kv_lora_rank, scale, return_lse, page_indices is None, target,
                config, exact=exact,
            )  # fmt: skip
            outs = PLANS.hit(key, inputs, guard)
            if outs is not None:
                return outs if return_lse else outs[0]
    # No cached plan: validate and plan (kept for the next call where the key is not None).
    plan = functools.partial(
        plan_mla_decode,
        query,
        kv_cache,
        block_table,
        seq_lens,
        kv_lora_rank=kv_lora_rank,
        scale=scale,
        query_start_loc=query_start_loc,
        out=out,
        return_lse=return_lse,
        page_indices=page_indices,
        metadata=metadata,
        target=target,
        config=config,
        trace=trace,
    )
    outs = PLANS.call(key, inputs, plan, guard)
    return outs if return_lse else outs[0]
