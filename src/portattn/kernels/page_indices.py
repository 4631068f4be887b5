"""Page-index expansion: a paged block table as flat per-token slot indices (page size 1).

Some kernels (FlashInfer-style, or an MLA kernel that only supports page size 1) address a KV
cache token by token. `expand_page_indices` turns ``block_table`` + ``seq_lens`` into the CSR pair
those kernels take, so a KV-cache group keeps whatever block size the other participants need
(docs/design.md lesson 5):

| tensor        | shape                     | dtype        | meaning                              |
|---------------|---------------------------|--------------|--------------------------------------|
| block_table   | [num_seqs, max_blocks]    | int32/int64  | block ids of each sequence           |
| seq_lens      | [num_seqs]                | int32/int64  | tokens of each sequence              |
| indptr (out)  | [num_seqs + 1]            | int64        | ``indices[indptr[i]:indptr[i+1]]``   |
| indices (out) | [sum(seq_lens)]           | int64        | ``block*block_size + offset``        |

Also here: `_find_seq`, the binary search from a packed token to its sequence, shared with the
gather kernel. Not supported: block tables whose entries for tokens below ``seq_lens`` are
missing (negative entries there come out as ``-1``, the padding convention).
"""

from __future__ import annotations

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
    num_indices_errors,
    raise_errors,
    reads_contents,
    refuse_unstrided,
    seq_lens_errors,
    target_errors,
    to_host,
    tokens_total,
    tokens_total_errors,
)
from portattn.kernels._launch import Launch, run_all
from portattn.platform import Target, is_int, target_for_tensor
from portattn.policy.cache import page_indices_tiles

# Any block size: the kernel divides by a runtime block_size.
SUPPORTED_BLOCK_SIZES: tuple[BlockSizeRule, ...] = (MultipleOf(1),)
INDEX_DTYPES = (torch.int32, torch.int64)


#: The most indices one call returns: the int64 ``indices`` tensor's bytes (8 a slot) must be
#: < 2**63, as any tensor's.
MAX_INDICES = 2**60
INDICES_RULE = "8 bytes each in the int64 indices tensor, whose bytes must be < 2**63"


@triton.jit
def _find_seq(
    cu_ptr,  # [num_seqs + 1] nondecreasing, cu[0] == 0
    stride_cu,
    tok,  # [BLOCK] packed token indices
    mask,  # [BLOCK] which lanes are live
    num_seqs,
    num_steps,  # ceil(log2(num_seqs)) + 1
):
    """Per lane, the sequence ``i`` with ``cu[i] <= tok < cu[i+1]`` (the last such ``i`` when
    sequences are empty), by binary search; ``num_steps`` is computed on the host."""
    lo = tl.zeros_like(tok)
    hi = lo + num_seqs
    for _ in range(num_steps):
        mid = (lo + hi) // 2
        start = tl.load(cu_ptr + mid.to(tl.int64) * stride_cu, mask=mask, other=0)
        go_right = start <= tok
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    return lo


@triton.jit
def _page_indptr_kernel(
    seq_lens_ptr,  # [num_seqs] int32/int64
    indptr_ptr,  # [num_seqs + 1] int64
    num_seqs,
    stride_seq_lens,
    BLOCK_S: tl.constexpr,
):
    # -- one program: prefix sum in chunks of BLOCK_S, carrying the running total --
    tl.store(indptr_ptr, tl.zeros((), dtype=tl.int64))
    carry = tl.zeros((), dtype=tl.int64)
    for start in range(0, num_seqs, BLOCK_S):
        s = start + tl.arange(0, BLOCK_S)
        mask = s < num_seqs
        n = tl.load(seq_lens_ptr + s.to(tl.int64) * stride_seq_lens, mask=mask, other=0)
        n = n.to(tl.int64)
        tl.store(indptr_ptr + 1 + s, tl.cumsum(n, axis=0) + carry, mask=mask)
        carry += tl.sum(n, axis=0)


@triton.jit
def _page_indices_kernel(
    block_table_ptr,  # [num_seqs, max_blocks] int32/int64
    indptr_ptr,  # [num_seqs + 1] int64
    indices_ptr,  # [num_indices] int64
    num_indices,
    num_seqs,
    num_steps,
    block_size,
    stride_bt_seq,
    stride_bt_blk,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    tok = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = tok < num_indices
    # -- which sequence, which position inside it --
    seq = _find_seq(indptr_ptr, 1, tok, mask, num_seqs, num_steps)
    pos = tok - tl.load(indptr_ptr + seq, mask=mask, other=0)
    # -- block id from the table, then the flat slot --
    blk = tl.load(
        block_table_ptr + seq * stride_bt_seq + (pos // block_size) * stride_bt_blk,
        mask=mask,
        other=-1,
    ).to(tl.int64)
    slot = tl.where(blk >= 0, blk * block_size + pos % block_size, -1)
    tl.store(indices_ptr + tok, slot, mask=mask)


def _num_steps(num_seqs: int) -> int:
    """Binary-search iterations that narrow ``[0, num_seqs)`` to one sequence."""
    return max(1, (num_seqs - 1).bit_length()) + 1


def plan_expand_page_indices(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    *,
    num_indices: int | None = None,
    target: Target | None = None,
) -> list[Launch]:
    """Validate, allocate ``indptr``/``indices`` and plan the two launches (see
    `expand_page_indices`). The outputs are ``launches[-1].outputs``."""
    op = "expand_page_indices"
    named = [("block_table", block_table), ("seq_lens", seq_lens)]
    refuse_unstrided(op, named)
    p = Problems(op)
    p.type(*target_errors(target))
    ok = {}
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens)):
        if not isinstance(t, torch.Tensor):
            p.type(f"{name} must be a torch.Tensor; got {type(t).__name__}")
            continue
        ok[name] = t
        if t.dtype not in INDEX_DTYPES:
            p.type(f"{name} dtype must be int32 or int64; got {t.dtype}")
    if not is_int(block_size):
        p.type(f"block_size must be an int in [1, 2**63 - 1]; got {block_size!r}")
    elif not 1 <= block_size <= INT64_MAX:
        p.value(f"block_size must be an int in [1, 2**63 - 1]; got {block_size!r}")
    table, lens = ok.get("block_table"), ok.get("seq_lens")
    if table is not None and table.dim() != 2:
        p.value(f"block_table must be 2-D [num_seqs, max_blocks]; got {tuple(table.shape)}")
    if lens is not None and lens.dim() != 1:
        p.value(f"seq_lens must be 1-D [num_seqs]; got {tuple(lens.shape)}")
    elif (
        lens is not None
        and table is not None
        and table.dim() == 2
        and lens.shape[0] != table.shape[0]
    ):
        p.value(
            f"seq_lens must have one entry per block_table row ({table.shape[0]}); got "
            f"{lens.shape[0]}"
        )
    if lens is not None and table is not None and table.device != lens.device:
        p.value(
            f"block_table and seq_lens must be on one device; got {table.device} and {lens.device}"
        )
    p.value(*lazy_bit_errors(named))
    if num_indices is not None and not is_int(num_indices):
        p.type(f"num_indices must be an int or None; got {type(num_indices).__name__}")
    elif num_indices is not None and not 0 <= num_indices < MAX_INDICES:
        p.value(f"num_indices must be in [0, 2**60) ({INDICES_RULE}); got {num_indices!r}")
    if num_indices is None and lens is not None and lens.is_meta:
        p.value("num_indices must be given for meta tensors (sum(seq_lens) is unknown)")
    p.raise_if_any()
    num_seqs = seq_lens.shape[0]
    # CPU: always checked (free). GPU: checked when num_indices is not given, with the one device
    # read that sum(seq_lens) needs anyway; with num_indices given the caller vouches (no sync).
    if reads_contents(seq_lens.device, vouched=num_indices is not None):
        capture_errors(op, seq_lens.device, "num_indices", "seq_lens and block_table")
        host_lens, host_table = to_host(seq_lens, block_table)
        errors = seq_lens_errors(host_lens)
        errors += capacity_errors(host_lens, block_size, block_table.shape[1])
        # a slot is block * block_size + offset, in int64: each used block's last slot,
        # (block + 1) * block_size - 1, must fit, so block < 2**63 // block_size
        limit = (INT64_MAX + 1) // block_size
        bound = f"2**63 // block_size = {limit} (slots block * block_size + offset are int64)"
        errors += block_ids_errors(
            host_table, host_lens, block_size, limit, padding_ok=True, limit=bound
        )
        if num_indices is not None:
            errors += num_indices_errors(num_indices, host_lens)
        else:
            errors += tokens_total_errors(host_lens)
            total = tokens_total(host_lens)
            if MAX_INDICES <= total <= INT64_MAX:  # past int64: tokens_total_errors says so
                errors.append(f"sum(seq_lens) must be < 2**60 ({INDICES_RULE}); got {total}")
        raise_errors(op, errors)
        if num_indices is None:
            num_indices = tokens_total(host_lens)
    assert num_indices is not None
    target = target or target_for_tensor(block_table)
    tiles = page_indices_tiles(target, num_indices)
    device = block_table.device
    indptr = torch.empty(num_seqs + 1, dtype=torch.int64, device=device)
    indices = torch.empty(num_indices, dtype=torch.int64, device=device)
    indptr_launch = Launch(
        kernel=_page_indptr_kernel,
        grid=(1,),
        args=dict(
            seq_lens_ptr=seq_lens,
            indptr_ptr=indptr,
            num_seqs=num_seqs,
            stride_seq_lens=seq_lens.stride(0),
            BLOCK_S=tiles.block_s,
        ),
        options=tiles.options,
        target=target,
        name="expand_page_indices.indptr",
        outputs=(indptr,),
    )
    indices_launch = Launch(
        kernel=_page_indices_kernel,
        grid=(triton.cdiv(num_indices, tiles.block_n) if num_seqs else 0,),
        args=dict(
            block_table_ptr=block_table,
            indptr_ptr=indptr,
            indices_ptr=indices,
            num_indices=num_indices,
            num_seqs=num_seqs,
            num_steps=_num_steps(num_seqs),
            block_size=block_size,
            stride_bt_seq=block_table.stride(0),
            stride_bt_blk=block_table.stride(1),
            BLOCK_N=tiles.block_n,
        ),
        options=tiles.options,
        target=target,
        name="expand_page_indices.indices",
        outputs=(indptr, indices),
    )
    return [indptr_launch, indices_launch]


def expand_page_indices(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    *,
    num_indices: int | None = None,
    target: Target | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat per-token slot indices of each sequence of a paged KV cache (page size 1).

    Token ``t`` of sequence ``i`` lives at ``block_table[i, t // block_size] * block_size +
    t % block_size``; sequence ``i``'s tokens are ``indices[indptr[i]:indptr[i+1]]``. Example::

        block_table = [[5, 2], [7, 0]], seq_lens = [3, 1], block_size = 2
        indptr  = [0, 3, 4]
        indices = [10, 11, 4, 14]      # 5*2+0, 5*2+1, 2*2+0 | 7*2+0

    Args:
        block_table: ``[num_seqs, max_blocks]`` int32/int64, any strides.
        seq_lens: ``[num_seqs]`` int32/int64, any stride.
        block_size: tokens per KV-cache block (any int >= 1: 16, 544, 2048 ...).
        num_indices: ``sum(seq_lens)`` if the caller knows it; otherwise it is read from the
            device (one sync; pass it when capturing CUDA graphs).
        target: compile for this target instead of the tensor's device.

    Returns:
        ``(indptr [num_seqs + 1] int64, indices [sum(seq_lens)] int64)``, contiguous, new.

    Block-table entries that a sequence's tokens need must be valid; a negative entry there
    yields ``-1`` (padding) for its tokens. ``seq_lens`` (``>= 0``, ``<= max_blocks *
    block_size``) and ``num_indices == sum(seq_lens)`` are checked for CPU tensors, and on a GPU
    when ``num_indices`` is not given; with it given on a GPU the caller vouches for them (a
    violation is undefined behaviour).
    """
    launches = plan_expand_page_indices(
        block_table, seq_lens, block_size, num_indices=num_indices, target=target
    )
    run_all(launches)
    indptr, indices = launches[-1].outputs
    return indptr, indices
