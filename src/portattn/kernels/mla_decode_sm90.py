"""MLA decode, Hopper (sm_90) kernel in Gluon: the wide 64-head tile with an explicit schedule.

Same math, arguments, workspaces and outputs as `portattn.kernels.mla_decode` (whose launcher
picks this kernel, `use_sm90_kernel`); only the schedule differs. Triton's pipeliner issues the
copy of tile i+1 at the END of iteration i and waits for it at the top of the next, so every
tile pays the copy latency on top of its math (bench/NOTES.md, attempt 4). Here, with the same
two latent buffers::

    wait tile i -> issue QK_i (latent + rope, async) -> wait PV_{i-1} (frees tile i-1's buffer)
    -> bulk-copy tile i+1 into it -> wait QK_i -> softmax -> P to shared memory -> issue PV_i

so the copy of tile i+1 runs under QK_i, the softmax and PV_i. Tiles go in pairs and the PV
accumulator is drained once per pair: an accumulator carried through the loop's back edge while
its wgmma is in flight makes ptxas serialize every wgmma of the kernel (its C7514 advisory; the
first version of this kernel had it). Row sums are kept per warpgroup (each holds half of a
tile's columns) and added once at the end. Whole 64-row tiles come from one 64-token page
through tensor descriptors (TMA); in a split's partial last tile the latent rows past the
context are zeroed in shared memory before PV (their scores are masked to -inf); an odd tile
count ends with a phantom tile (no copy, all scores masked).

Requirements (checked by the launcher): sm_90, fp16/bf16, ``BLOCK_H = BLOCK_N = 64``, 8 warps,
``kv_lora_rank`` a power of two <= 512, rope width a power of two >= 16, pages of a multiple of 64
tokens laid out one after another (``stride(0) == block_size * stride(1)``), a block table.
"""

from __future__ import annotations

import dataclasses

import torch
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

from portattn.kernels._launch import Launch
from portattn.platform import Target
from portattn.policy.common import LaunchOptions

_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
#: The tile this kernel is written for (the policy's wide CUDA tile).
BLOCK_H = 64
BLOCK_N = 64
NUM_WARPS = 8


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
def _issue_tile(lat_desc, pe_desc, blk, n, block_size, bar, lat_buf, pe_buf, pred,
                KV_LORA_RANK: gl.constexpr, TILE_BYTES: gl.constexpr):  # fmt: skip
    """Bulk-copy the latent and rope parts of context rows n .. n+BLOCK_N-1 (one page)."""
    row = blk.to(gl.int32) * block_size + n % block_size
    mbarrier.expect(bar, TILE_BYTES, pred=pred)
    tma.async_copy_global_to_shared(lat_desc, [row, 0], bar, lat_buf, pred=pred)
    tma.async_copy_global_to_shared(pe_desc, [row, KV_LORA_RANK], bar, pe_buf, pred=pred)


@gluon.jit
def _tile_step(i, num_tiles, steps, start, end, block_size, bt_row, stride_bt_blk, blk_next,
               lat_desc, pe_desc, bars, lat_smem, pe_smem, q_smem, qpe_smem, p_smem, m_i, l_i,
               acc, qk_scale, KV_LORA_RANK: gl.constexpr, BLOCK_N: gl.constexpr,
               TILE_BYTES: gl.constexpr, QK: gl.constexpr, PV: gl.constexpr,
               LOAD: gl.constexpr):  # fmt: skip
    """Tile i: scores, bulk copy of tile i+1 once PV_{i-1} freed its buffer, softmax, PV_i
    (returned in flight). Tiles ``num_tiles <= i < steps`` are phantoms: no copy, all masked."""
    dtype: gl.constexpr = q_smem.dtype
    b = i % 2
    n = start + i * BLOCK_N
    lat_b = lat_smem.index(b)
    pe_b = pe_smem.index(b)
    mbarrier.wait(bars.index(b), (i // 2) & 1)
    if n + BLOCK_N > end:  # the partial last tile: stale rows past the context read as 0
        rows_ld = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LOAD))
        keep = ((n + rows_ld) < end)[:, None]
        for c in gl.static_range(KV_LORA_RANK // 64):
            part = lat_b.slice(c * 64, 64, dim=1)
            x = part.load(LOAD)
            part.store(gl.where(keep, x, gl.zeros_like(x)))
        fence_async_shared()
        gl.thread_barrier()
    # scores: latent + rope parts, both asynchronous
    BLOCK_H: gl.constexpr = q_smem.shape[0]
    qk0 = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=QK)
    qk = warpgroup_mma(q_smem, lat_b.permute((1, 0)), qk0, use_acc=False, is_async=True)
    qk = warpgroup_mma(qpe_smem, pe_b.permute((1, 0)), qk, is_async=True)
    # PV_{i-1} (issued before them) done in every warpgroup -> its buffer takes tile i+1
    acc = warpgroup_mma_wait(num_outstanding=2, deps=[acc])
    gl.thread_barrier()
    nb = 1 - b
    _issue_tile(lat_desc, pe_desc, blk_next, n + BLOCK_N, block_size, bars.index(nb),
                lat_smem.index(nb), pe_smem.index(nb), i + 1 < num_tiles, KV_LORA_RANK,
                TILE_BYTES)  # fmt: skip
    mbarrier.arrive(bars.index(nb), count=1, pred=(i + 1 >= num_tiles) & (i + 1 < steps))
    blk_next = gl.load(
        bt_row + ((n + 2 * BLOCK_N) // block_size) * stride_bt_blk,
        mask=i + 2 < num_tiles,
        other=0,
    )
    qk = warpgroup_mma_wait(num_outstanding=0, deps=[qk])
    # online softmax
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, QK))
    s = gl.where(((n + cols) < end)[None, :], qk * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[:, None])
    # row sums per warpgroup (each holds half the columns): no cross-warpgroup reduction here
    ps = gl.sum(gl.reshape(p, [BLOCK_H, 2, BLOCK_N // 2]), 2)
    l_i = l_i * gl.convert_layout(alpha, gl.SliceLayout(1, ps.type.layout))[:, None] + ps
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, PV))[:, None]
    # P through shared memory (both warpgroups' PV_{i-1} finished: barrier above)
    p_smem.store(p.to(dtype))
    fence_async_shared()
    gl.thread_barrier()
    acc = warpgroup_mma(p_smem, lat_b, acc, is_async=True)
    return acc, m_new, l_i, blk_next


@gluon.jit
def _mla_decode_sm90_kernel(
    q_ptr,
    lat_desc,  # [num_blocks * block_size, head_dim_k], box [BLOCK_N, KV_LORA_RANK]
    pe_desc,  # the same rows, box [BLOCK_N, ROPE_DIM]
    block_table_ptr,
    seq_lens_ptr,
    qsl_ptr,
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
    KV_LORA_RANK: gl.constexpr,
    ROPE_DIM: gl.constexpr,
    BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_GROUPS: gl.constexpr,
    NUM_SPLITS: gl.constexpr,
    VARLEN: gl.constexpr,
    RETURN_LSE: gl.constexpr,
    TILE_BYTES: gl.constexpr,
    Q_LAYOUT: gl.constexpr,  # NVMMASharedLayout of [BLOCK_H, KV_LORA_RANK]
    QPE_LAYOUT: gl.constexpr,  # NVMMASharedLayout of [BLOCK_H, ROPE_DIM]
    P_LAYOUT: gl.constexpr,  # NVMMASharedLayout of [BLOCK_H, BLOCK_N]
):
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    # wgmma layouts: one warpgroup per half of the columns (M = 64 heads is one warpgroup's)
    QK: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16]
    )
    PV: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, KV_LORA_RANK // 2, 16]
    )
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    LAT_LAYOUT: gl.constexpr = lat_desc.layout
    PE_LAYOUT: gl.constexpr = pe_desc.layout

    # -- which (token, split, head group), the causal range (as in the portable kernel) --
    pid = gl.program_id(0)
    hg = pid % HEAD_GROUPS
    rest = pid // HEAD_GROUPS
    split = rest % NUM_SPLITS
    tok = rest // NUM_SPLITS
    if VARLEN:
        seq = gl.maximum(_find_seq_sm90(qsl_ptr, stride_qsl, tok, num_seqs), 0)
        q_start = gl.load(qsl_ptr + seq * stride_qsl)
        q_len = gl.load(qsl_ptr + (seq + 1) * stride_qsl) - q_start
        q_idx = tok - q_start
        valid = (q_idx >= 0) & (q_idx < q_len)
    else:
        seq = tok
        q_len = 1
        q_idx = 0
        valid = tok >= 0
    seq_len = gl.load(seq_lens_ptr + seq * stride_seq_lens)
    kv_len = gl.where(valid, seq_len - q_len + q_idx + 1, 0)
    chunk = gl.cdiv(gl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = gl.minimum(start + chunk, kv_len)
    num_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
    bt_row = block_table_ptr + seq.to(gl.int64) * stride_bt_seq

    # -- shared memory: query (latent + rope), two latent/rope tile buffers, their barriers --
    offs_h = hg * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LOAD))
    offs_d = gl.arange(0, KV_LORA_RANK, layout=gl.SliceLayout(0, LOAD))
    offs_pe = KV_LORA_RANK + gl.arange(0, ROPE_DIM, layout=gl.SliceLayout(0, LOAD))
    mask_h = (offs_h < num_heads)[:, None]
    q_row = q_ptr + tok.to(gl.int64) * stride_q_tok + offs_h[:, None] * stride_q_head
    q_lat = gl.load(q_row + offs_d[None, :] * stride_q_dim, mask=mask_h, other=0.0)
    q_pe = gl.load(q_row + offs_pe[None, :] * stride_q_dim, mask=mask_h, other=0.0)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, KV_LORA_RANK], Q_LAYOUT, q_lat)
    qpe_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, ROPE_DIM], QPE_LAYOUT, q_pe)
    lat_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, KV_LORA_RANK], LAT_LAYOUT)
    pe_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, ROPE_DIM], PE_LAYOUT)
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bars.index(0), count=1)
    mbarrier.init(bars.index(1), count=1)
    fence_async_shared()

    # -- prologue: tile 0 in flight; tile 1's block id loaded --
    blk = gl.load(bt_row + (start // block_size) * stride_bt_blk, mask=num_tiles > 0, other=0)
    _issue_tile(lat_desc, pe_desc, blk, start, block_size, bars.index(0), lat_smem.index(0),
                pe_smem.index(0), num_tiles > 0, KV_LORA_RANK, TILE_BYTES)  # fmt: skip
    blk_next = gl.load(
        bt_row + ((start + BLOCK_N) // block_size) * stride_bt_blk, mask=num_tiles > 1, other=0
    )

    qk_scale = scale * 1.4426950408889634  # exp2 domain
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, QK))
    # running row sums per warpgroup half of the columns, [BLOCK_H, 2] (summed at the end)
    zeros = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, QK)
    l_i = gl.sum(gl.reshape(zeros, [BLOCK_H, 2, BLOCK_N // 2]), 2)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], P_LAYOUT)
    acc = gl.zeros([BLOCK_H, KV_LORA_RANK], gl.float32, layout=PV)
    # Tiles go in pairs (buffers 0, 1): PV of the first stays in flight under the second's
    # scores; the accumulator is drained at the end of each pair, because one carried through
    # the loop back edge while in flight makes ptxas serialize every wgmma of the kernel. An odd
    # last tile is paired with a phantom (no copy, every score masked, buffer zeroed).
    steps = gl.cdiv(num_tiles, 2) * 2
    for j in range(steps // 2):
        acc, m_i, l_i, blk_next = _tile_step(
            2 * j, num_tiles, steps, start, end, block_size, bt_row, stride_bt_blk, blk_next,
            lat_desc, pe_desc, bars, lat_smem, pe_smem, q_smem, qpe_smem, p_smem, m_i, l_i,
            acc, qk_scale, KV_LORA_RANK, BLOCK_N, TILE_BYTES, QK, PV, LOAD,
        )  # fmt: skip
        acc, m_i, l_i, blk_next = _tile_step(
            2 * j + 1, num_tiles, steps, start, end, block_size, bt_row, stride_bt_blk,
            blk_next, lat_desc, pe_desc, bars, lat_smem, pe_smem, q_smem, qpe_smem, p_smem,
            m_i, l_i, acc, qk_scale, KV_LORA_RANK, BLOCK_N, TILE_BYTES, QK, PV, LOAD,
        )  # fmt: skip
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    l_i = gl.convert_layout(gl.sum(l_i, 1), gl.SliceLayout(1, QK))
    mbarrier.invalidate(bars.index(0))
    mbarrier.invalidate(bars.index(1))

    # -- epilogue: normalised output and natural-log lse (-inf, zeros for an empty range) --
    has = l_i > 0
    l_safe = gl.where(has, l_i, 1.0)
    lse = gl.where(has, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    o = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, PV))[:, None]
    oh = hg * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, PV))
    od = gl.arange(0, KV_LORA_RANK, layout=gl.SliceLayout(0, PV))
    lh = hg * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, QK))
    tok64 = tok.to(gl.int64)
    if NUM_SPLITS == 1:
        mask_o = ((oh < num_heads) & valid)[:, None] & (od >= 0)[None, :]
        ptrs = out_ptr + tok64 * stride_out_tok + oh[:, None] * stride_out_head
        gl.store(ptrs + od[None, :] * stride_out_dim, o.to(dtype), mask=mask_o)
        if RETURN_LSE:
            gl.store(
                lse_ptr + tok64 * stride_lse_tok + lh * stride_lse_head,
                lse,
                mask=(lh < num_heads) & valid,
            )
    else:
        # every padded head row: the workspace has padded_heads rows
        po = part_out_ptr + tok64 * stride_po_tok + split * stride_po_split
        mask_o = ((oh >= 0) & valid)[:, None] & (od >= 0)[None, :]
        gl.store(po + oh[:, None] * stride_po_head + od[None, :] * stride_po_dim, o, mask=mask_o)
        gl.store(
            part_lse_ptr + tok64 * stride_pl_tok + split * stride_pl_split + lh * stride_pl_head,
            lse,
            mask=(lh >= 0) & valid,
        )


def sm90_errors(
    kv_cache: torch.Tensor, kv_lora_rank: int, block_h: int, block_n: int, target: Target,
    paged_slots: bool,
) -> list[str]:  # fmt: skip
    """Why this kernel cannot run a launch (empty: it can); module doc, Requirements."""
    rope = kv_cache.shape[2] - kv_lora_rank
    elem = kv_cache.element_size()
    rules = [
        (target.arch == "sm_90", f"target {target.arch} is not sm_90"),
        (kv_cache.dtype in _GL_DTYPES, f"dtype {kv_cache.dtype} is not fp16/bf16"),
        ((block_h, block_n) == (BLOCK_H, BLOCK_N), f"tile H{block_h} N{block_n} is not H64 N64"),
        (not paged_slots, "page_indices (flat slots) instead of a block table"),
        (kv_lora_rank in (64, 128, 256, 512), f"kv_lora_rank {kv_lora_rank} not in 64..512 pow2"),
        (rope in (16, 32, 64, 128), f"rope width {rope} not in 16..128 pow2"),
        (kv_cache.shape[1] % BLOCK_N == 0, f"block_size {kv_cache.shape[1]} % {BLOCK_N} != 0"),
        (
            kv_cache.stride(2) == 1
            and kv_cache.stride(0) == kv_cache.shape[1] * kv_cache.stride(1),
            f"cache strides {tuple(kv_cache.stride())} are not pages one after another",
        ),
        ((kv_cache.stride(1) * elem) % 16 == 0, "row stride not 16-byte aligned"),
        (kv_cache.data_ptr() % 16 == 0, "cache base not 16-byte aligned"),
        (kv_cache.device.type in ("cuda", "meta"), "not a CUDA (or meta) tensor"),
    ]
    return [why for ok, why in rules if not ok]


def sm90_launch(main: Launch, kv_cache: torch.Tensor, kv_lora_rank: int) -> Launch:
    """The portable kernel's launch ``main``, run by this kernel (same arguments and outputs)."""
    a = main.args
    dtype = _GL_DTYPES[kv_cache.dtype]
    rope = kv_cache.shape[2] - kv_lora_rank
    rows = kv_cache.shape[0] * kv_cache.shape[1]
    shape, strides = [rows, kv_cache.shape[2]], [kv_cache.stride(1), 1]
    lat_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, kv_lora_rank], dtype)
    pe_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, rope], dtype)
    args = {
        name: a[name]
        for name in _mla_decode_sm90_kernel.arg_names
        if name in a and name not in ("BLOCK_H", "BLOCK_N")
    }
    args.update(
        lat_desc=TensorDescriptor(kv_cache, shape, strides, [BLOCK_N, kv_lora_rank], lat_layout),
        pe_desc=TensorDescriptor(kv_cache, shape, strides, [BLOCK_N, rope], pe_layout),
        BLOCK_H=BLOCK_H,
        BLOCK_N=BLOCK_N,
        TILE_BYTES=BLOCK_N * kv_cache.shape[2] * kv_cache.element_size(),
        Q_LAYOUT=gl.NVMMASharedLayout.get_default_for([BLOCK_H, kv_lora_rank], dtype),
        QPE_LAYOUT=gl.NVMMASharedLayout.get_default_for([BLOCK_H, rope], dtype),
        P_LAYOUT=gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype),
    )
    options = LaunchOptions(NUM_WARPS, main.options.num_stages)
    return dataclasses.replace(
        main, kernel=_mla_decode_sm90_kernel, args=args, options=options, name="mla_decode_sm90"
    )
