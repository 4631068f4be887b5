"""Content checks of the index metadata, shared by every op (one rule, one message, one place).

The ops check types and shapes themselves; the routines here check VALUES -- what a kernel trusts
when it turns an index into an address -- on host copies of the metadata:

| routine               | rule                                   | used by                       |
|-----------------------|----------------------------------------|-------------------------------|
| `offsets_errors`      | starts at 0, non-decreasing, ends at   | query_start_loc (paged, MLA), |
|                       | the row count                          | cu_seq_lens, page indptr      |
| `seq_lens_errors`     | seq_lens >= q_len (>= 0 without)       | paged, MLA, page indices      |
| `capacity_errors`     | a block-table column per block         | paged, MLA, gather, page ind. |
| `block_ids_errors`    | used block ids in [0, num_blocks)      | paged, MLA, gather (-1 ok)    |
| `slots_errors`        | flat slots < num_blocks * block_size   | write (-1 ok), MLA indices    |
| `page_indices_errors` | indptr gives each sequence seq_lens[i] | MLA with page_indices         |
| `num_indices_errors`  | num_indices == sum(seq_lens)           | expand_page_indices           |

Only USED entries are checked: block-table columns past ``ceil(seq_len / block_size)`` and page
indices past ``indptr[-1]`` may hold anything (-1, garbage), as the kernels never read them.

Where they run (`reads_contents`): always for CPU tensors (free), never for meta tensors, and on
a GPU only when the caller gave no bounds -- then one device-to-host copy (`to_host`) of the
metadata. With bounds given on a GPU (``max_query_len`` for paged_attention, ``metadata`` for
mla_decode, ``out`` for gather_kv_cache, ``num_indices`` for expand_page_indices; always for
write_kv_cache's ``slot_mapping``) nothing is read: the caller vouches for the values, and the
call stays free of host syncs (CUDA-graph capturable).

Every routine returns a list of reasons (empty: valid) in the ops' style, ``"<argument> must
<rule>; got <value>"``, naming only the offending scalars and their indices.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def reads_contents(device: torch.device, vouched: bool) -> bool:
    """Whether an op reads and checks its metadata's values: CPU always, GPU when the caller
    gave no bounds (``vouched`` False), meta tensors never (they have no values)."""
    if device.type == "meta":
        return False
    return device.type == "cpu" or not vouched


def tensor_reads_contents(t: torch.Tensor, vouched: bool) -> bool:
    """`reads_contents` of ``t``'s device, from the tensor's own flags (no device object: the
    ops' hit path, docs/design.md "Host path")."""
    if t.is_meta:
        return False
    return t.is_cpu or not vouched


def to_host(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """int64 CPU copies of ``tensors`` (same shapes), with one device-to-host transfer."""
    if all(t.device.type == "cpu" for t in tensors):
        return tuple(t.detach().to(torch.int64) for t in tensors)
    flat = torch.cat([t.detach().reshape(-1).to(torch.int64) for t in tensors]).cpu()
    out, at = [], 0
    for t in tensors:
        out.append(flat[at : at + t.numel()].reshape(t.shape))
        at += t.numel()
    return tuple(out)


def raise_errors(op: str, errors: list[str]) -> None:
    if errors:
        raise ValueError(f"{op}: " + "; ".join(errors))


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    """Index of the first True of ``mask`` (row-major)."""
    return tuple(int(i) for i in torch.nonzero(mask)[0])


def offsets_errors(
    name: str, offsets: torch.Tensor, *, end: int, end_name: str, end_at_most: bool = False
) -> list[str]:
    """``offsets`` ([n + 1], host) starts at 0, never decreases and ends at ``end`` (at most
    ``end`` with ``end_at_most``: rows past it are padding)."""
    errors: list[str] = []
    first, last = int(offsets[0]), int(offsets[-1])
    if first != 0 or (last > end if end_at_most else last != end):
        rule = f"<= {end_name}={end}" if end_at_most else f"{end_name}={end}"
        errors.append(f"{name} must start at 0 and end at {rule}; got first {first}, last {last}")
    steps = offsets[1:] - offsets[:-1]
    if bool((steps < 0).any()):
        (i,) = _first(steps < 0)
        errors.append(
            f"{name} must be non-decreasing; got a decrease at index {i + 1} "
            f"({int(offsets[i])} -> {int(offsets[i + 1])})"
        )
    return errors


def seq_lens_errors(seq_lens: torch.Tensor, q_lens: torch.Tensor | None = None) -> list[str]:
    """``seq_lens`` (host) >= each sequence's ``q_lens`` (its last tokens are the queries), or
    >= 0 without queries."""
    floor = torch.zeros_like(seq_lens) if q_lens is None else q_lens.clamp_min(0)
    short = seq_lens < floor
    if not bool(short.any()):
        return []
    (i,) = _first(short)
    count = f"({int(short.sum())} sequence(s))"
    if q_lens is None:
        return [f"seq_lens must be >= 0; got seq_lens[{i}]={int(seq_lens[i])} {count}"]
    return [
        f"seq_lens must be >= each sequence's q_len; got seq_lens[{i}]={int(seq_lens[i])} < "
        f"q_len {int(floor[i])} {count}"
    ]


def _seq_lens_label(i: int) -> str:
    return f"seq_lens[{i}]"


def capacity_errors(
    lens: torch.Tensor,
    block_size: int,
    max_blocks: int,
    label: Callable[[int], str] = _seq_lens_label,
) -> list[str]:
    """Each sequence's ``lens[i]`` tokens (host) fit the ``max_blocks`` columns of its
    block-table row. ``label(i)`` names ``lens[i]`` in the message."""
    n_blocks = (lens.clamp_min(0) + block_size - 1) // block_size
    wide = n_blocks > max_blocks
    if not bool(wide.any()):
        return []
    (i,) = _first(wide)
    return [
        f"block_table must have a column per block of each sequence; got {label(i)}="
        f"{int(lens[i])} needing {int(n_blocks[i])} blocks of {block_size} but "
        f"max_blocks={max_blocks}"
    ]


def block_ids_errors(
    block_table: torch.Tensor,
    lens: torch.Tensor,
    block_size: int,
    num_blocks: int,
    *,
    padding_ok: bool = False,
) -> list[str]:
    """The USED entries of ``block_table`` (host; the first ``ceil(lens[i] / block_size)`` of
    row ``i``) are block ids ``< num_blocks``, and ``>= 0`` unless ``padding_ok`` (a negative
    entry is padding the kernel skips). Other columns may hold anything."""
    if block_table.numel() == 0:
        return []
    n_blocks = (lens.clamp_min(0) + block_size - 1) // block_size
    used = torch.arange(block_table.shape[1])[None, :] < n_blocks[:, None]
    bad = used & (block_table >= num_blocks)
    if not padding_ok:
        bad |= used & (block_table < 0)
    if not bool(bad.any()):
        return []
    r, c = _first(bad)
    where = f"block_table[{r}, {c}]={int(block_table[r, c])} ({int(bad.sum())} entries)"
    entries = block_table[used]
    if padding_ok:
        return [
            f"block_table entries of used blocks must be < num_blocks={num_blocks} (negative: "
            f"padding); got max {int(entries.max())}, first at {where}"
        ]
    return [
        f"block_table entries of used blocks must be in [0, num_blocks={num_blocks}); got range "
        f"[{int(entries.min())}, {int(entries.max())}], first at {where}"
    ]


def slots_errors(
    name: str, slots: torch.Tensor, num_slots: int, *, padding_ok: bool = False
) -> list[str]:
    """Flat slots (host, ``block * block_size + offset``) address the cache: ``< num_slots``,
    and ``>= 0`` unless ``padding_ok`` (a negative slot is skipped)."""
    if slots.numel() == 0:
        return []
    bad = (slots >= num_slots) if padding_ok else ((slots < 0) | (slots >= num_slots))
    if not bool(bad.any()):
        return []
    (i,) = _first(bad)
    where = f"first at {name}[{i}]={int(slots[i])} ({int(bad.sum())} entries)"
    if padding_ok:
        return [
            f"{name} must be < num_blocks * block_size = {num_slots} (or negative to skip); "
            f"got max {int(slots.max())}, {where}"
        ]
    return [
        f"{name} must be in [0, num_blocks * block_size = {num_slots}); got range "
        f"[{int(slots.min())}, {int(slots.max())}], {where}"
    ]


def page_indices_errors(
    indptr: torch.Tensor, indices: torch.Tensor, seq_lens: torch.Tensor, num_slots: int
) -> list[str]:
    """``(indptr, indices)`` (host) give sequence ``i`` exactly ``seq_lens[i]`` slots,
    ``indices[indptr[i]:indptr[i+1]]``, each in the cache; entries past ``indptr[-1]`` are not
    read."""
    iname = "page_indices[0] (indptr)"
    errors = offsets_errors(
        iname, indptr, end=indices.shape[0], end_name="len(indices)", end_at_most=True
    )
    counts = indptr[1:] - indptr[:-1]
    off = counts != seq_lens
    if bool(off.any()):
        (i,) = _first(off)
        errors.append(
            f"{iname} must give each sequence seq_lens[i] slots; got indptr[{i + 1}] - "
            f"indptr[{i}] = {int(counts[i])} but seq_lens[{i}]={int(seq_lens[i])} "
            f"({int(off.sum())} sequence(s))"
        )
    if not errors:
        errors += slots_errors("page_indices[1]", indices[: int(indptr[-1])], num_slots)
    return errors


def num_indices_errors(num_indices: int, seq_lens: torch.Tensor) -> list[str]:
    """``num_indices`` (the caller's count of output slots) equals ``sum(seq_lens)`` (host)."""
    total = int(seq_lens.clamp_min(0).sum())
    if num_indices != total:
        return [f"num_indices must equal sum(seq_lens)={total}; got {num_indices}"]
    return []
