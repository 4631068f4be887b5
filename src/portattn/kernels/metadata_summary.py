"""The device-side form of the metadata checks: what an unbounded GPU call reads instead of the
metadata itself.

A call without bounds on a GPU (``paged_attention`` without ``max_query_len``, ``mla_decode``
without ``metadata``, ``gather_kv_cache`` without ``out``) must check the metadata's values and
learn its maxima (or its token count) before it plans. The summary kernel does both on the
device, one program per sequence: each program checks its sequence and folds ``(q_len, seq_len,
broken, its end offset)`` into the call's running maxima with atomics; the program that finishes
last writes the four totals (`Totals`) and zeroes the running maxima for the next call. On a GPU
the totals are pinned host memory, which the kernel writes directly (mapped through unified
addressing): the host waits for the stream once and reads four integers, with no copy queued. Only
when the metadata is broken does the op read the metadata itself and run the host checks of
`_checks`, which name the argument, the rule and the values exactly as before: the summary
decides *whether* a call is valid, `_checks` says *why not*.

The running maxima and the totals are one set per device, stream and thread
(`_buffers`): calls on one stream run their summaries in order, and each thread reads its own
totals after its own wait.

The rules are `_checks`' rules, row by row (a row is broken when any fails):

| rule (`_checks` routine)   | sequence ``i``                                                |
|----------------------------|---------------------------------------------------------------|
| `offsets_errors`           | ``qsl[i] <= qsl[i+1]``; ``qsl[0] == 0``; the last entry equals |
|                            | ``num_tokens`` (at most ``num_tokens`` with ``END_AT_MOST``)  |
| `seq_lens_errors`          | ``seq_lens[i] >= max(q_len_i, 0)`` (``q_len_i`` 1 without qsl)|
| `positions32_errors`       | ``seq_lens[i] <= max_len`` (32-bit kernels: below             |
|                            | ``POSITIONS32_LIMIT``)                                        |
| `capacity_errors`          | ``ceil(seq_lens[i] / block_size) <= max_blocks``              |
| `block_ids_errors`         | used block ids in ``[0, num_blocks)`` (below ``num_blocks``   |
|                            | with ``PADDING_OK``: a negative id is padding)                |

Without ``seq_lens`` (``SEQ_IS_Q``: `gather_kv_cache`, whose ``cu_seq_lens`` are the offsets)
each sequence's length is its q_len.

A property test holds the two forms to the same verdict and the same maxima (and token count)
on any metadata (tests/kernels/test_metadata_summary.py). The summary needs at least one
sequence and a block table; other calls (an empty batch, MLA's ``page_indices``) keep the host
read.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from portattn.kernels._checks import INT64_MAX
from portattn.kernels._launch import Launch
from portattn.kernels._plans import (
    PLANS,
    _current_device,
    _current_stream,
    call_key,
    evict_oldest,
    present,
)
from portattn.platform import Target, override_key, target_for_tensor
from portattn.policy.cache import metadata_summary_tiles

OP = "metadata_summary"
#: The totals' entries (and the running maxima's); the running maxima hold a ticket count after.
Q_LEN, SEQ_LEN, BROKEN, TOKENS, TICKETS = 0, 1, 2, 3, 4


@triton.jit
def _metadata_summary_kernel(
    qsl_ptr,  # [num_seqs + 1] int32/int64 (unused without HAS_QSL)
    seq_lens_ptr,  # [num_seqs] int32/int64 (unused with SEQ_IS_Q)
    block_table_ptr,  # [num_seqs, max_blocks] int32/int64
    running_ptr,  # [5] int64, zero between calls: the totals' four maxima, then tickets
    totals_ptr,  # [4] int64: max q_len, max seq_len, broken, max end offset (`Totals`)
    num_seqs,
    num_tokens,
    block_size,
    num_blocks,
    max_blocks,
    max_len,  # the longest seq_len the op's kernel holds (`positions32_errors`)
    stride_qsl,
    stride_seq_lens,
    stride_bt_seq,
    stride_bt_blk,
    HAS_QSL: tl.constexpr,
    END_AT_MOST: tl.constexpr,
    SEQ_IS_Q: tl.constexpr,  # no seq_lens: each sequence's length is its q_len (needs HAS_QSL)
    PADDING_OK: tl.constexpr,  # a negative block id is padding, not an error
    BLOCK_C: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    # -- query_start_loc: sorted, from 0 to num_tokens --
    if HAS_QSL:
        start = tl.load(qsl_ptr + i * stride_qsl).to(tl.int64)
        end = tl.load(qsl_ptr + (i + 1) * stride_qsl).to(tl.int64)
        q_len = end - start
        broken = end < start  # compared, not subtracted: the difference may wrap
        broken = broken | ((i == 0) & (start != 0))
        last_broken = end > num_tokens if END_AT_MOST else end != num_tokens
        broken = broken | ((i == num_seqs - 1) & last_broken)
    else:
        q_len = tl.full((), 1, tl.int64)
        end = i + 1
        broken = q_len < 0
    seq_len = q_len if SEQ_IS_Q else tl.load(seq_lens_ptr + i * stride_seq_lens).to(tl.int64)
    # -- seq_lens cover the queries, and fit the table's columns (ceil without overflow) --
    broken = broken | (seq_len < tl.maximum(q_len, 0)) | (seq_len > max_len)
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
        bad = (ids >= num_blocks) if PADDING_OK else ((ids < 0) | (ids >= num_blocks))
        bad_ids = bad_ids | (live & bad).to(tl.int32)
    broken = broken | (tl.max(bad_ids, axis=0) != 0)
    # -- fold into the running maxima, entries 0-4 as Q_LEN, SEQ_LEN, BROKEN, TOKENS, TICKETS
    # (acq_rel atomics of one thread: each lands before the ticket) --
    tl.atomic_max(running_ptr + 0, q_len)
    tl.atomic_max(running_ptr + 1, seq_len)
    tl.atomic_max(running_ptr + 2, broken.to(tl.int64))
    tl.atomic_max(running_ptr + 3, end)
    ticket = tl.atomic_add(running_ptr + 4, 1)
    if ticket == num_seqs - 1:
        # the last program: every other one has folded in; hand the totals over, zero the rest
        tl.store(totals_ptr + 0, tl.atomic_xchg(running_ptr + 0, 0))
        tl.store(totals_ptr + 1, tl.atomic_xchg(running_ptr + 1, 0))
        tl.store(totals_ptr + 2, tl.atomic_xchg(running_ptr + 2, 0))
        tl.store(totals_ptr + 3, tl.atomic_xchg(running_ptr + 3, 0))
        tl.atomic_xchg(running_ptr + 4, 0)


def summary_applies(block_table, num_seqs: int) -> bool:
    """Whether a call's metadata is summarized on the device: a block table (not MLA's
    ``page_indices``) on a GPU (CPU tensors are checked on the host for free) and at least one
    sequence."""
    return block_table is not None and not block_table.is_cpu and num_seqs > 0


class Totals(NamedTuple):
    """What the summary of valid metadata found: the longest q_len and seq_len, and the last
    ``query_start_loc`` entry (the token count; the sequence count without one)."""

    max_q_len: int
    max_seq_len: int
    tokens: int


def plan_metadata_summary(
    query_start_loc: torch.Tensor | None,
    seq_lens: torch.Tensor | None,
    block_table: torch.Tensor,
    running: torch.Tensor,
    totals: torch.Tensor,
    *,
    num_tokens: int,
    block_size: int,
    num_blocks: int,
    end_at_most: bool,
    padding_ok: bool = False,
    max_len: int = INT64_MAX,
    target: Target | None = None,
) -> list[Launch]:
    """The summary's launch over metadata the op has already validated in type and shape
    (int32/int64, ``seq_lens [num_seqs]``, ``block_table [num_seqs, max_blocks]``,
    ``query_start_loc [num_seqs + 1]`` or ``None`` for one query a sequence). ``seq_lens``
    ``None``: each sequence's length is its q_len (needs ``query_start_loc``). ``padding_ok``:
    a negative block id is padding. ``max_len``: the longest seq_len the op's kernel holds.
    ``running``: ``[5]`` int64 on the metadata's device, zero
    before the launch and after it; ``totals``: ``[4]`` int64 the launch writes (module
    docstring, `_buffers`)."""
    if seq_lens is None and query_start_loc is None:
        raise ValueError(f"{OP}: seq_lens or query_start_loc must be given")
    num_seqs, max_blocks = block_table.shape
    target = target or target_for_tensor(block_table)
    tiles = metadata_summary_tiles(target, max_blocks)
    has_qsl = query_start_loc is not None
    lens = seq_lens if seq_lens is not None else query_start_loc
    assert lens is not None
    launch = Launch(
        kernel=_metadata_summary_kernel,
        grid=(num_seqs,),
        args=dict(
            qsl_ptr=query_start_loc if has_qsl else lens,
            seq_lens_ptr=lens,
            block_table_ptr=block_table,
            running_ptr=running,
            totals_ptr=totals,
            num_seqs=num_seqs,
            num_tokens=num_tokens,
            block_size=block_size,
            num_blocks=num_blocks,
            max_blocks=max_blocks,
            max_len=max_len,
            stride_qsl=query_start_loc.stride(0) if query_start_loc is not None else 0,
            stride_seq_lens=lens.stride(0),
            stride_bt_seq=block_table.stride(0),
            stride_bt_blk=block_table.stride(1),
            HAS_QSL=has_qsl,
            END_AT_MOST=end_at_most,
            SEQ_IS_Q=seq_lens is None,
            PADDING_OK=padding_ok,
            BLOCK_C=tiles.block_c,
        ),
        options=tiles.options,
        target=target,
        name=OP,
        outputs=(totals,),
        writes=(running, totals),
    )
    return [launch]


class _Buffers(NamedTuple):
    """One device, stream and thread's summary buffers: the running maxima (zero between calls)
    on the device, the totals (pinned host memory on a GPU, which the kernel writes), the host's
    numpy view of them, and on a GPU the stream to wait for."""

    running: torch.Tensor
    totals: torch.Tensor
    host: Any
    stream: Any  # torch.cuda.Stream, or None on the CPU


_BUFFERS: dict[tuple, _Buffers] = {}
#: Buffer sets kept (the oldest dropped first: a thread that still holds its set keeps using it).
MAX_BUFFERS = 256


def _buffers(device: torch.device) -> _Buffers:
    """The summary buffers of the current stream of ``device`` and the calling thread (made on
    first use; the newest `MAX_BUFFERS` sets kept)."""
    raw = _current_stream(device.index) if device.type == "cuda" else None  # the C getter
    key = (device, raw, threading.get_ident())
    bufs = _BUFFERS.get(key)
    if bufs is None:
        stream = None if raw is None else torch.cuda.current_stream(device)
        running = torch.zeros(TICKETS + 1, dtype=torch.int64, device=device)
        totals = torch.zeros(TOKENS + 1, dtype=torch.int64, pin_memory=stream is not None)
        evict_oldest(_BUFFERS, MAX_BUFFERS - 1)
        bufs = _BUFFERS[key] = _Buffers(running, totals, totals.numpy(), stream)
    return bufs


def start_metadata_summary(
    query_start_loc: torch.Tensor | None,
    seq_lens: torch.Tensor | None,
    block_table: torch.Tensor,
    *,
    num_tokens: int,
    block_size: int,
    num_blocks: int,
    end_at_most: bool,
    padding_ok: bool = False,
    max_len: int = INT64_MAX,
) -> _Buffers:
    """Queue the summary kernel (through the plan cache: a repeated description launches
    directly), which writes its totals to the host's buffer; nothing waits. Returns
    the buffers `finish_metadata_summary` reads. Arguments as `plan_metadata_summary`'s."""
    bufs = _buffers(block_table.device)
    inputs = (query_start_loc, seq_lens, block_table, bufs.running, bufs.totals)
    mask, tensors = present(inputs)
    scalars = (OP, _current_device(), override_key(), mask, num_tokens, block_size, num_blocks,
               end_at_most, padding_ok, max_len)  # fmt: skip
    if PLANS.probe(scalars, tensors, inputs) is None:
        key = call_key(OP, *inputs, num_tokens, block_size, num_blocks, end_at_most, padding_ok,
                       max_len)  # fmt: skip
        PLANS.call(
            key,
            inputs,
            lambda: plan_metadata_summary(
                query_start_loc, seq_lens, block_table, bufs.running, bufs.totals,
                num_tokens=num_tokens, block_size=block_size, num_blocks=num_blocks,
                end_at_most=end_at_most, padding_ok=padding_ok, max_len=max_len,
            ),
            (scalars, tensors),
        )  # fmt: skip
    return bufs


def finish_metadata_summary(bufs: _Buffers) -> Totals | None:
    """Wait for the stream a `start_metadata_summary` queued on and read its totals (`Totals`)
    of valid metadata, or ``None`` when some sequence breaks a rule."""
    if bufs.stream is not None:
        bufs.stream.synchronize()
    q_len, seq_len, broken, tokens = bufs.host.tolist()
    return None if broken else Totals(q_len, seq_len, tokens)


def read_metadata_summary(*args: Any, **kwargs: Any) -> Totals | None:
    """`start_metadata_summary` then `finish_metadata_summary` (one wait, no copy), with the
    former's arguments: the `Totals` of valid metadata, or ``None`` when some sequence breaks a
    rule (the caller then reads the metadata and raises `_checks`' errors)."""
    return finish_metadata_summary(start_metadata_summary(*args, **kwargs))
