"""The device-side form of the metadata checks: what an unbounded GPU call reads instead of the
metadata itself.

A call without bounds on a GPU (``paged_attention`` without ``max_query_len``, ``mla_decode``
without ``metadata``) must check the metadata's values and learn its maxima before it plans. The
summary kernel does both on the device, one program per sequence, and writes one int64 row per
sequence: ``(q_len, seq_len, broken)``. The host then reads that one tensor (one copy, one wait)
and reduces it with one numpy call. Only when some row is broken does the op read the metadata
itself and run the host checks of `_checks`, which name the argument, the rule and the values
exactly as before: the summary decides *whether* a call is valid, `_checks` says *why not*.

The rules are `_checks`' rules, row by row (a row is broken when any fails):

| rule (`_checks` routine)   | sequence ``i``                                                |
|----------------------------|---------------------------------------------------------------|
| `offsets_errors`           | ``qsl[i] <= qsl[i+1]``; ``qsl[0] == 0``; the last entry equals |
|                            | ``num_tokens`` (at most ``num_tokens`` with ``END_AT_MOST``)  |
| `seq_lens_errors`          | ``seq_lens[i] >= max(q_len_i, 0)`` (``q_len_i`` 1 without qsl)|
| `capacity_errors`          | ``ceil(seq_lens[i] / block_size) <= max_blocks``              |
| `block_ids_errors`         | used block ids in ``[0, num_blocks)``                         |

A property test holds the two forms to the same verdict and the same maxima on any metadata
(tests/kernels/test_metadata_summary.py). The summary needs at least one sequence and a block
table; other calls (an empty batch, MLA's ``page_indices``) keep the host read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from portattn.kernels._launch import Launch
from portattn.kernels._plans import PLANS, call_key
from portattn.platform import Target, target_for_tensor
from portattn.policy.cache import metadata_summary_tiles

OP = "metadata_summary"
#: Columns of a summary row.
Q_LEN, SEQ_LEN, BROKEN = 0, 1, 2


@triton.jit
def _metadata_summary_kernel(
    qsl_ptr,  # [num_seqs + 1] int32/int64 (unused without HAS_QSL)
    seq_lens_ptr,  # [num_seqs] int32/int64
    block_table_ptr,  # [num_seqs, max_blocks] int32/int64
    summary_ptr,  # [num_seqs, 3] int64: q_len, seq_len, broken
    num_seqs,
    num_tokens,
    block_size,
    num_blocks,
    max_blocks,
    stride_qsl,
    stride_seq_lens,
    stride_bt_seq,
    stride_bt_blk,
    HAS_QSL: tl.constexpr,
    END_AT_MOST: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + i * stride_seq_lens).to(tl.int64)
    # -- query_start_loc: sorted, from 0 to num_tokens --
    if HAS_QSL:
        start = tl.load(qsl_ptr + i * stride_qsl).to(tl.int64)
        end = tl.load(qsl_ptr + (i + 1) * stride_qsl).to(tl.int64)
        q_len = end - start
        broken = q_len < 0
        broken = broken | ((i == 0) & (start != 0))
        last_broken = end > num_tokens if END_AT_MOST else end != num_tokens
        broken = broken | ((i == num_seqs - 1) & last_broken)
    else:
        q_len = tl.full((), 1, tl.int64)
        broken = q_len < 0
    # -- seq_lens cover the queries, and fit the table's columns (ceil without overflow) --
    broken = broken | (seq_len < tl.maximum(q_len, 0))
    tokens = tl.maximum(seq_len, 0)
    used = tokens // block_size + (tokens % block_size != 0).to(tl.int64)
    broken = broken | (used > max_blocks)
    used = tl.minimum(used, max_blocks)
    # -- the used block ids address the cache --
    row = block_table_ptr + i * stride_bt_seq
    bad_ids = tl.zeros((BLOCK_C,), dtype=tl.int32)
    for c in range(0, used, BLOCK_C):
        cols = c + tl.arange(0, BLOCK_C)
        live = cols < used
        ids = tl.load(row + cols.to(tl.int64) * stride_bt_blk, mask=live, other=0).to(tl.int64)
        bad_ids = bad_ids | (live & ((ids < 0) | (ids >= num_blocks))).to(tl.int32)
    broken = broken | (tl.max(bad_ids, axis=0) != 0)
    out = summary_ptr + i * 3
    tl.store(out + 0, q_len)
    tl.store(out + 1, seq_len)
    tl.store(out + 2, broken.to(tl.int64))


def summary_applies(block_table, num_seqs: int) -> bool:
    """Whether a call's metadata is summarized on the device: a block table (not MLA's
    ``page_indices``) on a GPU (CPU tensors are checked on the host for free) and at least one
    sequence."""
    return block_table is not None and not block_table.is_cpu and num_seqs > 0


def plan_metadata_summary(
    query_start_loc: torch.Tensor | None,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    num_tokens: int,
    block_size: int,
    num_blocks: int,
    end_at_most: bool,
    target: Target | None = None,
) -> list[Launch]:
    """The summary's launch over metadata the op has already validated in type and shape
    (int32/int64, ``seq_lens [num_seqs]``, ``block_table [num_seqs, max_blocks]``,
    ``query_start_loc [num_seqs + 1]`` or ``None`` for one query a sequence); its output is
    ``[num_seqs, 3]`` int64 (module docstring)."""
    num_seqs, max_blocks = block_table.shape
    target = target or target_for_tensor(seq_lens)
    tiles = metadata_summary_tiles(target, max_blocks)
    summary = torch.empty((num_seqs, 3), dtype=torch.int64, device=seq_lens.device)
    has_qsl = query_start_loc is not None
    launch = Launch(
        kernel=_metadata_summary_kernel,
        grid=(num_seqs,),
        args=dict(
            qsl_ptr=query_start_loc if has_qsl else seq_lens,
            seq_lens_ptr=seq_lens,
            block_table_ptr=block_table,
            summary_ptr=summary,
            num_seqs=num_seqs,
            num_tokens=num_tokens,
            block_size=block_size,
            num_blocks=num_blocks,
            max_blocks=max_blocks,
            stride_qsl=query_start_loc.stride(0) if query_start_loc is not None else 0,
            stride_seq_lens=seq_lens.stride(0),
            stride_bt_seq=block_table.stride(0),
            stride_bt_blk=block_table.stride(1),
            HAS_QSL=has_qsl,
            END_AT_MOST=end_at_most,
            BLOCK_C=tiles.block_c,
        ),
        options=tiles.options,
        target=target,
        name=OP,
        outputs=(summary,),
    )
    return [launch]


def read_metadata_summary(
    query_start_loc: torch.Tensor | None,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    num_tokens: int,
    block_size: int,
    num_blocks: int,
    end_at_most: bool,
) -> tuple[int, int] | None:
    """``(longest q_len, longest seq_len)`` of valid metadata, from the summary kernel and one
    read of its output (through the plan cache: a repeated description launches directly);
    ``None`` when some sequence breaks a rule (the caller then reads the metadata and raises
    `_checks`' errors). Arguments as `plan_metadata_summary`'s."""
    inputs = (query_start_loc, seq_lens, block_table)
    scalars = (num_tokens, block_size, num_blocks, end_at_most)
    key = call_key(OP, *inputs, *scalars)
    (summary,) = PLANS.call(
        key,
        inputs,
        lambda: plan_metadata_summary(
            query_start_loc,
            seq_lens,
            block_table,
            num_tokens=num_tokens,
            block_size=block_size,
            num_blocks=num_blocks,
            end_at_most=end_at_most,
        ),  # fmt: skip
    )
    host = summary.to("cpu", non_blocking=True)
    if summary.is_cuda:
        torch.cuda.current_stream(summary.device).synchronize()
    top = host.numpy().max(axis=0)
    if top[BROKEN]:
        return None
    return int(top[Q_LEN]), int(top[SEQ_LEN])
