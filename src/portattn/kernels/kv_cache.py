"""KV-cache write (scatter new tokens into their slots) and gather (a paged cache -> contiguous).

| tensor                | shape                                                  | notes          |
|-----------------------|--------------------------------------------------------|----------------|
| key, value            | [num_tokens, num_kv_heads, head_dim]                   | any strides    |
| slot_mapping          | [num_tokens] int64 (int32 accepted)                    | block*bs + off |
| key_cache (NHD)       | [num_blocks, block_size, num_kv_heads, head_dim]       | any strides    |
| value_cache (NHD)     | [num_blocks, block_size, num_kv_heads, head_dim]       | any strides    |
| key_cache (SHUFFLE)   | [num_blocks, num_kv_heads, head_dim//x, block_size, x] | x = 16 B/elem  |
| value_cache (SHUFFLE) | [num_blocks, num_kv_heads, block_size//x, head_dim, x] | any strides    |
| block_table           | [num_seqs, max_blocks] int32/int64                     | any strides    |
| cu_seq_lens           | [num_seqs + 1] int32/int64                             | cu[0] == 0     |
| gathered k, v         | [total_tokens, num_kv_heads, head_dim]                 | total = cu[-1] |

Both kernels address the cache through `layout.describe_kv_cache` (block and in-block offset
separately, ``TOK_SPLIT``/``DIM_SPLIT`` for SHUFFLE), so a hybrid model's interleaved cache (a
strided view of a shared page buffer, Mamba state between pages) is written and read exactly like
a contiguous one and the state bytes are never touched. Both take the flat-slot shortcut
(``FLAT_SLOTS``: ``offset = slot * stride_tok``) only when `layout.is_block_contiguous` holds for
that cache, through the one helper `_slot_offset`, so the write path and the read path cannot
disagree about where a token lives (docs/design.md lesson 3).

Not supported: dtype conversion (fp8 caches, scales): key/value must have the cache's dtype.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from portattn.blocksize import BlockSizeRule, MultipleOf
from portattn.kernels._checks import (
    INT64_MAX,
    Problems,
    block_ids_errors,
    capacity_errors,
    capture_errors,
    lazy_bit_errors,
    offsets_errors,
    overlap_errors,
    raise_errors,
    reads_contents,
    refuse_unstrided,
    slots_errors,
    target_errors,
    to_host,
)
from portattn.kernels._launch import MAX_GRID_YZ, Launch, in_units
from portattn.kernels._plans import PLANS, CheckMemo, _current_device, call_key
from portattn.kernels.metadata_summary import read_metadata_summary, summary_applies
from portattn.kernels.page_indices import _find_seq, _num_steps
from portattn.layout import (
    CacheAddressing,
    describe_kv_cache,
    is_block_contiguous,
    row_vector_elems,
)
from portattn.platform import Target, override_key, target_for_tensor
from portattn.policy.cache import CacheCopyProblem, gather_kv_cache_tiles, write_kv_cache_tiles

# Any block size for NHD (block and offset are addressed separately); SHUFFLE's V cache splits
# the token axis into block_size // x groups, so there block_size % x == 0 (see ops_registry).
SUPPORTED_BLOCK_SIZES: tuple[BlockSizeRule, ...] = (MultipleOf(1),)
INDEX_DTYPES = (torch.int32, torch.int64)
_INT32_MAX = 2**31 - 1


# -- addressing helpers --------------------------------------------------------------------------


@triton.jit
def _slot_offset(
    slot,  # [BLOCK_T] int64, >= 0
    block_size,
    stride_block,
    stride_tok_hi,
    stride_tok_lo,
    TOK_SPLIT: tl.constexpr,
    FLAT_SLOTS: tl.constexpr,
):
    """Element offset of token ``slot`` (block and in-block token parts), int64 ``[BLOCK_T]``.

    ``FLAT_SLOTS`` is `layout.is_block_contiguous` of this cache, computed on the host.
    """
    if FLAT_SLOTS:
        off = slot * stride_tok_hi
    else:
        blk = slot // block_size
        tok = slot % block_size
        if TOK_SPLIT == 1:
            off = blk * stride_block + tok * stride_tok_hi
        else:
            off = blk * stride_block + (tok // TOK_SPLIT) * stride_tok_hi
            off += (tok % TOK_SPLIT) * stride_tok_lo
    return off


@triton.jit
def _dim_offset(
    d,  # [BLOCK_D] int32 head-dim indices
    stride_dim_hi,
    stride_dim_lo,
    DIM_SPLIT: tl.constexpr,
):
    """Element offset of head-dim index ``d`` inside one (token, head), int64 ``[BLOCK_D]``."""
    d = d.to(tl.int64)
    if DIM_SPLIT == 1:
        off = d * stride_dim_hi
    else:
        off = (d // DIM_SPLIT) * stride_dim_hi + (d % DIM_SPLIT) * stride_dim_lo
    return off


# -- write ---------------------------------------------------------------------------------------


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # NHD [num_blocks, block_size, h, d] | SHUFFLE [num_blocks, h, d//x, bs, x]
    value_cache_ptr,  # NHD [num_blocks, block_size, h, d] | SHUFFLE [num_blocks, h, bs//x, d, x]
    slot_mapping_ptr,  # [num_tokens] int64/int32, negative = skip
    num_tokens,
    head_dim,
    block_size,
    stride_key_tok,
    stride_key_head,
    stride_key_dim,
    stride_value_tok,
    stride_value_head,
    stride_value_dim,
    stride_slot,
    stride_kc_block,
    stride_kc_head,
    stride_kc_tok_hi,
    stride_kc_tok_lo,
    stride_kc_dim_hi,
    stride_kc_dim_lo,
    stride_vc_block,
    stride_vc_head,
    stride_vc_tok_hi,
    stride_vc_tok_lo,
    stride_vc_dim_hi,
    stride_vc_dim_lo,
    K_TOK_SPLIT: tl.constexpr,
    K_DIM_SPLIT: tl.constexpr,
    V_TOK_SPLIT: tl.constexpr,
    V_DIM_SPLIT: tl.constexpr,
    K_FLAT_SLOTS: tl.constexpr,
    V_FLAT_SLOTS: tl.constexpr,
    K_ROW: tl.constexpr,  # NHD K cache: its rows start on multiples of K_ROW (1: no claim)
    V_ROW: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tl.static_assert(BLOCK_T >= 1 and BLOCK_D >= 1)
    # the cache strides as multiples of K_ROW / V_ROW, which the compiler follows: rows as vectors
    stride_kc_block, stride_kc_head, stride_kc_tok_hi = in_units(
        stride_kc_block, stride_kc_head, stride_kc_tok_hi, K_ROW
    )
    stride_vc_block, stride_vc_head, stride_vc_tok_hi = in_units(
        stride_vc_block, stride_vc_head, stride_vc_tok_hi, V_ROW
    )
    pid_t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    tok = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    tok_mask = tok < num_tokens

    # -- slots: negative means padding, skipped --
    slot = tl.load(slot_mapping_ptr + tok * stride_slot, mask=tok_mask, other=-1).to(tl.int64)
    live = slot >= 0
    slot = tl.where(live, slot, 0)
    mask = live[:, None] & (d < head_dim)[None, :]

    # -- key --
    src = tok[:, None] * stride_key_tok + head * stride_key_head
    k = tl.load(key_ptr + src + d.to(tl.int64)[None, :] * stride_key_dim, mask=mask)
    dst = _slot_offset(
        slot,
        block_size,
        stride_kc_block,
        stride_kc_tok_hi,
        stride_kc_tok_lo,
        K_TOK_SPLIT,
        K_FLAT_SLOTS,
    )
    dst = dst[:, None] + head * stride_kc_head
    dst += _dim_offset(d, stride_kc_dim_hi, stride_kc_dim_lo, K_DIM_SPLIT)[None, :]
    tl.store(key_cache_ptr + dst, k, mask=mask)

    # -- value --
    src = tok[:, None] * stride_value_tok + head * stride_value_head
    v = tl.load(value_ptr + src + d.to(tl.int64)[None, :] * stride_value_dim, mask=mask)
    dst = _slot_offset(
        slot,
        block_size,
        stride_vc_block,
        stride_vc_tok_hi,
        stride_vc_tok_lo,
        V_TOK_SPLIT,
        V_FLAT_SLOTS,
    )
    dst = dst[:, None] + head * stride_vc_head
    dst += _dim_offset(d, stride_vc_dim_hi, stride_vc_dim_lo, V_DIM_SPLIT)[None, :]
    tl.store(value_cache_ptr + dst, v, mask=mask)


def _check_grid_heads(p: Problems, ka: CacheAddressing | None) -> None:
    """The cache ops launch one grid row a KV head: at most `MAX_GRID_YZ` of them."""
    if ka is not None and ka.num_kv_heads > MAX_GRID_YZ:
        p.value(
            f"key_cache must have at most {MAX_GRID_YZ} KV heads (one launch grid row a head); "
            f"got {ka.num_kv_heads}"
        )


def _check_index_tensor(p: Problems, name: str, t, dims: int) -> bool:
    """``t`` is an int32/int64 tensor of ``dims`` dims; whether it is one of the right dims."""
    if not isinstance(t, torch.Tensor):
        p.type(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        return False
    if t.dtype not in INDEX_DTYPES:
        p.type(f"{name} dtype must be int32 or int64; got {t.dtype}")
    if t.dim() != dims:
        p.value(f"{name} must be {dims}-D; got shape {tuple(t.shape)}")
        return False
    return True


def _check_row_tensors(
    p: Problems,
    pairs,
    cache: torch.Tensor | None,
    want: tuple[int, int] | None,
    rows: str,
    note: str = "",
) -> dict[str, torch.Tensor]:
    """Each ``(name, t)`` of ``pairs`` is a ``[rows, *want]`` tensor of the cache's dtype on
    its device (``cache``/``want`` ``None``: the caches are invalid, those checks are
    skipped); returns the ones that are tensors, by name."""
    dtype = cache.dtype if cache is not None else None
    device = cache.device if cache is not None else None
    ok = {}
    for name, t in pairs:
        if not isinstance(t, torch.Tensor):
            p.type(f"{name} must be a torch.Tensor; got {type(t).__name__}")
            continue
        ok[name] = t
        if dtype is not None and t.dtype != dtype:
            p.type(f"{name} dtype must match the cache dtype {dtype}; got {t.dtype}")
        if want is not None and (t.dim() != 3 or tuple(t.shape[1:]) != want):
            p.value(
                f"{name} must be [{rows}, {want[0]}, {want[1]}]{note}; got shape {tuple(t.shape)}"
            )
        if device is not None and t.device != device:
            p.value(f"{name} must be on the cache's device {device}; got {t.device}")
    return ok


def _cache_constexprs(
    k: CacheAddressing, v: CacheAddressing, elem_size: int
) -> dict[str, int | bool]:
    """The layout switches of a (K, V) cache pair: splits, the shared contiguity predicate and
    the unit NHD rows start on (`row_vector_elems`: rows of a hybrid model's pages, whose
    strides are multiples of 8 elements but not 16, then copy as 16-byte vectors)."""
    return dict(
        K_TOK_SPLIT=k.tok_split,
        K_DIM_SPLIT=k.dim_split,
        V_TOK_SPLIT=v.tok_split,
        V_DIM_SPLIT=v.dim_split,
        K_FLAT_SLOTS=is_block_contiguous(k),
        V_FLAT_SLOTS=is_block_contiguous(v),
        K_ROW=row_vector_elems(k, elem_size),
        V_ROW=row_vector_elems(v, elem_size),
    )


def plan_write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    layout: str = "NHD",
    target: Target | None = None,
) -> list[Launch]:
    """Validate and plan `write_kv_cache` (one launch); nothing runs."""
    op = "write_kv_cache"
    named = [("key", key), ("value", value), ("key_cache", key_cache),
             ("value_cache", value_cache), ("slot_mapping", slot_mapping)]  # fmt: skip
    refuse_unstrided(op, named)
    p = Problems(op)
    p.type(*target_errors(target))
    kv = p.run(describe_kv_cache, op, key_cache, value_cache, layout)
    ka, va = kv if kv is not None else (None, None)
    _check_grid_heads(p, ka)
    want = (ka.num_kv_heads, ka.head_dim) if ka is not None else None
    note = " (the cache's num_kv_heads, head_dim)"
    pairs = (("key", key), ("value", value))
    ok = _check_row_tensors(p, pairs, key_cache if kv else None, want, "num_tokens", note)
    slots_ok = _check_index_tensor(p, "slot_mapping", slot_mapping, 1)
    if len(ok) == 2 and key.dim() == 3 and value.dim() == 3 and key.shape[0] != value.shape[0]:
        p.value(
            f"key and value must have the same num_tokens; got {key.shape[0]} and {value.shape[0]}"
        )
    if slots_ok and "key" in ok and key.dim() == 3 and slot_mapping.shape[0] > key.shape[0]:
        p.value(
            f"slot_mapping must have at most num_tokens={key.shape[0]} entries; got "
            f"{slot_mapping.shape[0]}"
        )
    sm = slot_mapping if isinstance(slot_mapping, torch.Tensor) else None
    if kv is not None and sm is not None and sm.device != key_cache.device:
        p.value(f"slot_mapping must be on the cache's device {key_cache.device}; got {sm.device}")
    p.value(*lazy_bit_errors(named))
    if not p:
        # the caches are written: neither may overlap itself, the other or an input
        writes = [("key_cache", key_cache), ("value_cache", value_cache)]
        reads = [("key", key), ("value", value), ("slot_mapping", slot_mapping)]
        p.value(*overlap_errors(writes, reads))
    p.raise_if_any()
    assert ka is not None and va is not None
    # Free on CPU; on a GPU this read would sync, so there the caller always vouches (docstring).
    if reads_contents(slot_mapping.device, vouched=True):
        (slots,) = to_host(slot_mapping)
        num_slots = ka.num_blocks * ka.block_size
        raise_errors(op, slots_errors("slot_mapping", slots, num_slots, padding_ok=True))
    num_tokens = slot_mapping.shape[0]
    target = target or target_for_tensor(key_cache)
    tiles = write_kv_cache_tiles(
        target,
        CacheCopyProblem(num_tokens, ka.num_kv_heads, ka.head_dim, key_cache.element_size()),
    )
    grid = (
        triton.cdiv(num_tokens, tiles.block_t),
        ka.num_kv_heads,
        triton.cdiv(ka.head_dim, tiles.block_d),
    )
    args = dict(
        key_ptr=key,
        value_ptr=value,
        key_cache_ptr=key_cache,
        value_cache_ptr=value_cache,
        slot_mapping_ptr=slot_mapping,
        num_tokens=num_tokens,
        head_dim=ka.head_dim,
        block_size=ka.block_size,
        stride_key_tok=key.stride(0),
        stride_key_head=key.stride(1),
        stride_key_dim=key.stride(2),
        stride_value_tok=value.stride(0),
        stride_value_head=value.stride(1),
        stride_value_dim=value.stride(2),
        stride_slot=slot_mapping.stride(0),
        **ka.kernel_args("kc"),
        **va.kernel_args("vc"),
        **_cache_constexprs(ka, va, key_cache.element_size()),
        BLOCK_T=tiles.block_t,
        BLOCK_D=tiles.block_d,
    )
    launch = Launch(_write_kv_cache_kernel, grid, args, tiles.options, target, name=op,
                    writes=(key_cache, value_cache))  # fmt: skip
    return [launch]


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    layout: str = "NHD",
    target: Target | None = None,
) -> None:
    """Write each token's key and value into its cache slot, in place.

    Token ``i`` goes to block ``slot_mapping[i] // block_size``, in-block offset
    ``slot_mapping[i] % block_size``; a negative slot is padding and writes nothing. No other
    cache element is written (in a hybrid cache, the Mamba state between pages is untouched).

    Args:
        key: ``[num_tokens, num_kv_heads, head_dim]``, the cache's dtype, any strides.
        value: ``[num_tokens, num_kv_heads, head_dim]``, the cache's dtype, any strides.
        key_cache: written in place; layout ``layout`` (module table), any strides.
        value_cache: written in place; same dtype, device and geometry as ``key_cache``.
        slot_mapping: ``[n]`` int64 (int32 accepted), ``n <= num_tokens``: only the first ``n``
            tokens are written (rows past ``n`` are CUDA-graph padding and are ignored).
        layout: ``"NHD"`` or ``"SHUFFLE"``.
        target: compile for this target instead of the cache's device.

    Slot bounds: a slot ``>= num_blocks * block_size`` raises ValueError when ``slot_mapping``
    is a CPU tensor (checked for free) and is undefined behaviour on a GPU, as upstream: checking
    there would read the tensor and sync the device. Two tokens with the same slot race: each
    element of the slot ends up holding either token's value (K and V, or two dim chunks, may
    come from different tokens), so a caller must not repeat a slot.
    """
    inputs = (key, value, key_cache, value_cache, slot_mapping)
    cache_key = None
    guard: tuple | None = None
    if isinstance(slot_mapping, torch.Tensor) and not reads_contents(slot_mapping.device, True):
        if target is None:  # the rest of `call_key`'s description (`PlanCache.probe`)
            scalars = ("write_kv_cache", _current_device(), override_key(), type(layout), layout)
            if PLANS.probe(scalars, inputs, inputs) is not None:
                return
            guard = (scalars, inputs)
        cache_key = call_key("write_kv_cache", *inputs, layout, target)
    PLANS.call(
        cache_key,
        inputs,
        lambda: plan_write_kv_cache(
            key, value, key_cache, value_cache, slot_mapping, layout=layout, target=target
        ),
        guard,
    )


# -- gather --------------------------------------------------------------------------------------


@triton.jit
def _gather_kv_cache_kernel(
    key_cache_ptr,  # NHD [num_blocks, block_size, h, d] | SHUFFLE [num_blocks, h, d//x, bs, x]
    value_cache_ptr,  # NHD [num_blocks, block_size, h, d] | SHUFFLE [num_blocks, h, bs//x, d, x]
    block_table_ptr,  # [num_seqs, max_blocks] int32/int64
    cu_seq_lens_ptr,  # [num_seqs + 1] int32/int64
    key_out_ptr,  # [total_tokens, num_kv_heads, head_dim]
    value_out_ptr,  # [total_tokens, num_kv_heads, head_dim]
    total_tokens,
    num_seqs,
    num_steps,
    head_dim,
    block_size,
    stride_bt_seq,
    stride_bt_blk,
    stride_cu,
    stride_ko_tok,
    stride_ko_head,
    stride_ko_dim,
    stride_vo_tok,
    stride_vo_head,
    stride_vo_dim,
    stride_kc_block,
    stride_kc_head,
    stride_kc_tok_hi,
    stride_kc_tok_lo,
    stride_kc_dim_hi,
    stride_kc_dim_lo,
    stride_vc_block,
    stride_vc_head,
    stride_vc_tok_hi,
    stride_vc_tok_lo,
    stride_vc_dim_hi,
    stride_vc_dim_lo,
    K_TOK_SPLIT: tl.constexpr,
    K_DIM_SPLIT: tl.constexpr,
    V_TOK_SPLIT: tl.constexpr,
    V_DIM_SPLIT: tl.constexpr,
    K_FLAT_SLOTS: tl.constexpr,
    V_FLAT_SLOTS: tl.constexpr,
    K_ROW: tl.constexpr,  # NHD K cache: its rows start on multiples of K_ROW (1: no claim)
    V_ROW: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tl.static_assert(BLOCK_T >= 1 and BLOCK_D >= 1)
    # the cache strides as multiples of K_ROW / V_ROW, which the compiler follows: rows as vectors
    stride_kc_block, stride_kc_head, stride_kc_tok_hi = in_units(
        stride_kc_block, stride_kc_head, stride_kc_tok_hi, K_ROW
    )
    stride_vc_block, stride_vc_head, stride_vc_tok_hi = in_units(
        stride_vc_block, stride_vc_head, stride_vc_tok_hi, V_ROW
    )
    pid_t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    tok = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    tok_mask = tok < total_tokens

    # -- packed token -> (sequence, position) -> block id -> slot --
    seq = _find_seq(cu_seq_lens_ptr, stride_cu, tok, tok_mask, num_seqs, num_steps).to(tl.int64)
    pos = tok - tl.load(cu_seq_lens_ptr + seq * stride_cu, mask=tok_mask, other=0).to(tl.int64)
    blk = tl.load(
        block_table_ptr + seq * stride_bt_seq + (pos // block_size) * stride_bt_blk,
        mask=tok_mask,
        other=-1,
    ).to(tl.int64)
    live = blk >= 0  # a negative block id (padding) reads nothing and yields zeros
    slot = tl.where(live, blk * block_size + pos % block_size, 0)
    dmask = (d < head_dim)[None, :]
    load_mask = live[:, None] & dmask
    store_mask = tok_mask[:, None] & dmask

    # -- key --
    src = _slot_offset(
        slot,
        block_size,
        stride_kc_block,
        stride_kc_tok_hi,
        stride_kc_tok_lo,
        K_TOK_SPLIT,
        K_FLAT_SLOTS,
    )
    src = src[:, None] + head * stride_kc_head
    src += _dim_offset(d, stride_kc_dim_hi, stride_kc_dim_lo, K_DIM_SPLIT)[None, :]
    k = tl.load(key_cache_ptr + src, mask=load_mask, other=0.0)
    dst = tok[:, None] * stride_ko_tok + head * stride_ko_head
    tl.store(key_out_ptr + dst + d.to(tl.int64)[None, :] * stride_ko_dim, k, mask=store_mask)

    # -- value --
    src = _slot_offset(
        slot,
        block_size,
        stride_vc_block,
        stride_vc_tok_hi,
        stride_vc_tok_lo,
        V_TOK_SPLIT,
        V_FLAT_SLOTS,
    )
    src = src[:, None] + head * stride_vc_head
    src += _dim_offset(d, stride_vc_dim_hi, stride_vc_dim_lo, V_DIM_SPLIT)[None, :]
    v = tl.load(value_cache_ptr + src, mask=load_mask, other=0.0)
    dst = tok[:, None] * stride_vo_tok + head * stride_vo_head
    tl.store(value_out_ptr + dst + d.to(tl.int64)[None, :] * stride_vo_dim, v, mask=store_mask)


def _check_gather_args(
    key_cache, value_cache, block_table, cu_seq_lens, layout, out, target=None
) -> tuple[CacheAddressing, CacheAddressing]:
    """`gather_kv_cache`'s argument checks (types, shapes, devices, overlap: no index values),
    every problem listed in one error; the caches' addressing."""
    op = "gather_kv_cache"
    outs = out if isinstance(out, (tuple, list)) else ()
    named = [
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("block_table", block_table),
        ("cu_seq_lens", cu_seq_lens),
        *((f"out[{i}]", t) for i, t in enumerate(outs)),
    ]
    refuse_unstrided(op, named)
    p = Problems(op)
    p.type(*target_errors(target))
    kv = p.run(describe_kv_cache, op, key_cache, value_cache, layout)
    ka, va = kv if kv is not None else (None, None)
    _check_grid_heads(p, ka)
    table_ok = _check_index_tensor(p, "block_table", block_table, 2)
    cu_ok = _check_index_tensor(p, "cu_seq_lens", cu_seq_lens, 1)
    nseq = block_table.shape[0] if table_ok else None
    if nseq is not None and cu_ok and cu_seq_lens.shape[0] != nseq + 1:
        p.value(
            f"cu_seq_lens must have num_seqs + 1 = {nseq + 1} entries; got {cu_seq_lens.shape[0]}"
        )
    for name, t in (("block_table", block_table), ("cu_seq_lens", cu_seq_lens)):
        if kv is not None and isinstance(t, torch.Tensor) and t.device != key_cache.device:
            p.value(f"{name} must be on the cache's device {key_cache.device}; got {t.device}")
    want = (ka.num_kv_heads, ka.head_dim) if ka is not None else None
    if out is not None and not (isinstance(out, (tuple, list)) and len(out) == 2):
        p.type(f"out must be a (key_out, value_out) pair; got {type(out).__name__}")
        out = None
    if out is not None:
        pairs = (("out[0]", out[0]), ("out[1]", out[1]))
        ok = _check_row_tensors(p, pairs, key_cache if kv else None, want, "total_tokens")
        rows = {t.shape[0] for t in ok.values() if t.dim() == 3}
        if len(ok) == 2 and len(rows) == 2:
            p.value(
                f"out[0] and out[1] must have the same total_tokens; got {out[0].shape[0]} "
                f"and {out[1].shape[0]}"
            )
    p.value(*lazy_bit_errors(named))
    if not p and out is not None:
        # the outputs are written: neither may overlap itself, the other or an input
        reads = [("key_cache", key_cache), ("value_cache", value_cache),
                 ("block_table", block_table), ("cu_seq_lens", cu_seq_lens)]  # fmt: skip
        p.value(*overlap_errors([("out[0]", out[0]), ("out[1]", out[1])], reads))
    p.raise_if_any()
    assert ka is not None and va is not None
    return ka, va


def plan_gather_kv_cache(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    *,
    layout: str = "NHD",
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    target: Target | None = None,
) -> list[Launch]:
    """Validate, allocate and plan `gather_kv_cache` (one launch; outputs in ``.outputs``)."""
    op = "gather_kv_cache"
    ka, va = _check_gather_args(
        key_cache, value_cache, block_table, cu_seq_lens, layout, out, target
    )
    given = tuple(out) if out is not None else ()
    num_seqs = block_table.shape[0]
    if out is None and cu_seq_lens.device.type == "meta":
        raise ValueError(f"{op}: out must be given for meta tensors (total_tokens is unknown)")
    # CPU: always checked (free). GPU: checked when out is not given, with the one device read
    # that total_tokens needs anyway; with out given the caller vouches (no sync).
    if reads_contents(cu_seq_lens.device, vouched=out is not None):
        capture_errors(op, cu_seq_lens.device, "out", "cu_seq_lens and block_table")
        cu, table = to_host(cu_seq_lens, block_table)
        total_tokens = out[0].shape[0] if out is not None else int(cu[-1])
        _check_gather_indices(op, table, cu, ka, total_tokens, out is not None)
    else:
        assert out is not None
        total_tokens = out[0].shape[0]  # no device read
    if out is None:
        out = _new_outputs(key_cache, ka, total_tokens)
    elif total_tokens > _INT32_MAX:
        raise ValueError(f"{op}: total_tokens must be < 2**31; got {total_tokens}")
    k_out, v_out = out
    target = target or target_for_tensor(key_cache)
    tiles = gather_kv_cache_tiles(
        target,
        CacheCopyProblem(total_tokens, ka.num_kv_heads, ka.head_dim, key_cache.element_size()),
    )
    grid = (
        triton.cdiv(total_tokens, tiles.block_t) if num_seqs else 0,
        ka.num_kv_heads,
        triton.cdiv(ka.head_dim, tiles.block_d),
    )
    args = dict(
        key_cache_ptr=key_cache,
        value_cache_ptr=value_cache,
        block_table_ptr=block_table,
        cu_seq_lens_ptr=cu_seq_lens,
        key_out_ptr=k_out,
        value_out_ptr=v_out,
        total_tokens=total_tokens,
        num_seqs=num_seqs,
        num_steps=_num_steps(num_seqs),
        head_dim=ka.head_dim,
        block_size=ka.block_size,
        stride_bt_seq=block_table.stride(0),
        stride_bt_blk=block_table.stride(1),
        stride_cu=cu_seq_lens.stride(0),
        stride_ko_tok=k_out.stride(0),
        stride_ko_head=k_out.stride(1),
        stride_ko_dim=k_out.stride(2),
        stride_vo_tok=v_out.stride(0),
        stride_vo_head=v_out.stride(1),
        stride_vo_dim=v_out.stride(2),
        **ka.kernel_args("kc"),
        **va.kernel_args("vc"),
        **_cache_constexprs(ka, va, key_cache.element_size()),
        BLOCK_T=tiles.block_t,
        BLOCK_D=tiles.block_d,
    )
    return [
        Launch(
            _gather_kv_cache_kernel,
            grid,
            args,
            tiles.options,
            target,
            name=op,
            outputs=(k_out, v_out),
            writes=given,
        )
    ]


def _check_gather_indices(
    op: str, table: np.ndarray, cu: np.ndarray, addr: CacheAddressing, total: int, out: bool
) -> None:
    """`_checks` on host copies: cu_seq_lens well formed, each sequence fits its row, the used
    block ids (negative: padding) inside the cache; unused columns are ignored."""
    end_name = "out's total_tokens" if out else "total_tokens"
    errors = offsets_errors("cu_seq_lens", cu, end=total, end_name=end_name)
    lens = cu[1:] - cu[:-1]
    label = lambda i: f"cu_seq_lens[{i + 1}] - cu_seq_lens[{i}]"  # noqa: E731
    errors += capacity_errors(lens, addr.block_size, table.shape[1], label)
    errors += block_ids_errors(table, lens, addr.block_size, addr.num_blocks, padding_ok=True)
    raise_errors(op, errors)


#: The argument checks an unbounded `gather_kv_cache` passed, by description (`CheckMemo`).
_GATHER_CHECKED = CheckMemo()


def _unbounded(*tensors) -> bool:
    """Whether a call without ``out`` takes `_unbounded_outputs`: every input a tensor on a device
    where the call given ``out`` reads no index (a GPU; on a CPU the planner reads and checks
    them anyway, and meta tensors have no ``total_tokens``: the planner names both)."""
    return all(type(t) is torch.Tensor for t in tensors) and tensors[-1].is_cuda


def _unbounded_outputs(
    key_cache, value_cache, block_table, cu_seq_lens, layout
) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs of a call without ``out`` (``cu_seq_lens[-1]`` rows), once its checks pass:
    the arguments' once per description (`CheckMemo`), the indices each call on the device
    (`start_metadata_summary`: ``cu_seq_lens`` as the offsets and the lengths, negative block ids
    as padding), which also gives the token count; where it finds a broken rule (or there is no
    sequence), one host read of ``cu_seq_lens`` and ``block_table`` and `_check_gather_indices`,
    as the planner runs them, name it."""
    op = "gather_kv_cache"
    inputs = (key_cache, value_cache, block_table, cu_seq_lens)
    scalars = (type(layout), layout)
    ka = _GATHER_CHECKED.get(scalars, inputs, inputs)
    if ka is None:
        ka, _ = _check_gather_args(key_cache, value_cache, block_table, cu_seq_lens, layout, None)
        _GATHER_CHECKED.keep(scalars, inputs, inputs, (), ka)
    capture_errors(op, cu_seq_lens.device, "out", "cu_seq_lens and block_table")
    got = None
    if summary_applies(block_table, block_table.shape[0]):
        got = read_metadata_summary(
            cu_seq_lens, None, block_table, num_tokens=INT64_MAX, block_size=ka.block_size,
            num_blocks=ka.num_blocks, end_at_most=True, padding_ok=True,
        )  # fmt: skip
    if got is not None:
        total = got.tokens
    else:
        cu, table = to_host(cu_seq_lens, block_table)
        total = int(cu[-1])
        _check_gather_indices(op, table, cu, ka, total, False)
    return _new_outputs(key_cache, ka, total)


def _new_outputs(key_cache, ka: CacheAddressing, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs of a call without ``out``: ``total`` rows each (below 2**31)."""
    if total > _INT32_MAX:
        raise ValueError(f"gather_kv_cache: total_tokens must be < 2**31; got {total}")
    shape = (total, ka.num_kv_heads, ka.head_dim)
    return (
        torch.empty(shape, dtype=key_cache.dtype, device=key_cache.device),
        torch.empty(shape, dtype=key_cache.dtype, device=key_cache.device),
    )


def gather_kv_cache(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    *,
    layout: str = "NHD",
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    target: Target | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy each sequence's cached tokens out of a paged cache, sequences concatenated.

    Sequence ``i`` has ``cu_seq_lens[i+1] - cu_seq_lens[i]`` tokens; its token ``t`` is read from
    block ``block_table[i, t // block_size]``, offset ``t % block_size``, and written to row
    ``cu_seq_lens[i] + t`` of the outputs.

    Args:
        key_cache, value_cache: layout ``layout`` (module table), any strides; read only.
        block_table: ``[num_seqs, max_blocks]`` int32/int64, any strides. A negative entry that
            a sequence's tokens need is padding: those rows come out as zeros.
        cu_seq_lens: ``[num_seqs + 1]`` int32/int64, ``cu[0] == 0``, nondecreasing.
        layout: ``"NHD"`` or ``"SHUFFLE"``.
        out: optional ``(key_out, value_out)``, each ``[total_tokens, num_kv_heads, head_dim]``
            in the cache's dtype, any strides; written in place and returned.
        target: compile for this target instead of the cache's device.

    Returns:
        ``(k, v)``, each ``[total_tokens, num_kv_heads, head_dim]``: new contiguous tensors, or
        ``out``. ``total_tokens`` is ``out[0].shape[0]`` if ``out`` is given, else
        ``cu_seq_lens[-1]``, read once with the index checks (a device sync; pass ``out`` to
        avoid it).

    Index checks (``cu_seq_lens`` well formed, sequences fit their rows, the block ids each
    sequence uses ``< num_blocks``; other columns are ignored) run for CPU tensors, and on a GPU
    when ``out`` is not given (on the device, `portattn.kernels.metadata_summary`, with the one
    read that ``total_tokens`` needs). With ``out`` given on a GPU the caller vouches for them: a
    violation is undefined behaviour.
    """
    if (
        out is None
        and (target is None or isinstance(target, Target))
        and _unbounded(key_cache, value_cache, block_table, cu_seq_lens)
    ):
        # checked here, then the call runs as the call given these outputs (the plan cache)
        out = _unbounded_outputs(key_cache, value_cache, block_table, cu_seq_lens, layout)
    inputs: tuple = (key_cache, value_cache, block_table, cu_seq_lens)
    cache_key = None
    guard: tuple | None = None
    given = isinstance(out, (tuple, list)) and len(out) == 2
    if given and isinstance(cu_seq_lens, torch.Tensor):
        assert out is not None
        inputs += tuple(out)
        if not reads_contents(cu_seq_lens.device, vouched=True):
            if target is None:  # the rest of `call_key`'s description (`PlanCache.probe`)
                scalars = ("gather_kv_cache", _current_device(), override_key(),
                           isinstance(out, tuple), type(layout), layout)  # fmt: skip
                outputs = PLANS.probe(scalars, inputs, inputs)
                if outputs is not None:
                    return outputs[0], outputs[1]
                guard = (scalars, inputs)
            cache_key = call_key("gather_kv_cache", *inputs, isinstance(out, tuple), layout, target)
    k, v = PLANS.call(
        cache_key,
        inputs,
        lambda: plan_gather_kv_cache(
            key_cache, value_cache, block_table, cu_seq_lens, layout=layout, out=out, target=target
        ),
        guard,
    )
    return k, v
