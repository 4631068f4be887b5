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
| `scale_errors`        | scale finite, > 0, fp32-representable  | paged, MLA                    |
|                       | after the kernels' ``* log2(e)``       |                               |
| `overlap_errors`      | written tensors overlap neither an     | every op with a write target  |
|                       | input nor each other, nor themselves   |                               |
| `reach32_errors`      | the dims a kernel offsets in 32 bits   | paged, MLA (shapes, strides)  |
|                       | reach < 2**31 elements                 |                               |
| `positions32_errors`  | seq_lens a kernel counts in 32 bits    | paged seq_lens; MLA int32     |
|                       | are < `POSITIONS32_LIMIT`              | seq_lens                      |

Only USED entries are checked: block-table columns past ``ceil(seq_len / block_size)`` and page
indices past ``indptr[-1]`` may hold anything (-1, garbage), as the kernels never read them.

Where they run (`reads_contents`): always for CPU tensors (free), never for meta tensors, and on
a GPU only when the caller gave no bounds -- then one device-to-host copy (`to_host`) of the
metadata; ``paged_attention`` and ``mla_decode`` (block tables) first ask the device-side form of
the same rules (`portattn.kernels.metadata_summary`) and copy the metadata only when it reports a
broken rule, for these routines' messages. With bounds given on a GPU (``max_query_len`` for
paged_attention, ``metadata`` for mla_decode, ``out`` for gather_kv_cache, ``num_indices`` for
expand_page_indices; always for write_kv_cache's ``slot_mapping``) nothing is read: the caller
vouches for the values, and the call stays free of host syncs (CUDA-graph capturable). An op
about to read on a GPU whose current stream captures a graph raises instead (`capture_errors`),
naming the bound to give.

Every routine returns a list of reasons (empty: valid) in the ops' style, ``"<argument> must
<rule>; got <value>"``, naming only the offending scalars and their indices. `Problems` gathers
one call's reasons, type and value alike, and raises them together.

Overlap (`overlap_errors`, and `Disjoint` for the plan cache's hits) is decided from shapes,
strides and addresses only, never contents: two tensors are disjoint when their byte ranges do
not meet, or when one period ``P`` (a byte stride of either) splits both into whole periods plus
an inner footprint shorter than ``P`` and the two footprints, taken modulo ``P``, do not meet
(a K and a V cache interleaved page by page in one buffer; ``query`` and ``out`` as two halves
of one row). Anything else sharing bytes counts as overlapping. A write target must also not
overlap itself: its dims, smallest stride first, must each step past everything the smaller
ones span (a stride-0 view fails).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from numbers import Real

import numpy as np
import torch

from portattn.platform import Target

#: Offsets and positions a kernel computes in 32 bits stay below this (`reach32_errors`).
INT32_LIMIT = 2**31
#: seq_lens a kernel counts in 32 bits stay below this: its position arithmetic runs past a
#: sequence's end by up to a query tile, a split's rounding to whole KV tiles and a loop step
#: (at most 2**16 positions), which must stay below 2**31 too.
POSITIONS32_LIMIT = 2**31 - 2**16
#: The largest softmax scale the kernels take: they compute ``scale * log2(e)`` in fp32.
#: The largest int64: offsets, counts and slots live in it.
INT64_MAX = 2**63 - 1
MAX_SCALE = torch.finfo(torch.float32).max / 1.4426950408889634


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


def capture_errors(op: str, device: torch.device, bound: str, reads: str) -> None:
    """Raise when ``device`` is a GPU whose current stream is capturing a CUDA graph: the call
    is about to read ``reads`` to the host, a wait that a capture cannot hold (CUDA would fail
    the sync and invalidate the user's graph). ``bound`` names what the caller gives instead."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise ValueError(
            f"{op}: {bound} must be given while the current stream captures a CUDA graph: "
            f"without it the call reads {reads} to the host (a sync a graph cannot hold); "
            f"with it nothing is read"
        )


def to_host(*tensors: torch.Tensor) -> tuple[np.ndarray, ...]:
    """int64 host arrays of ``tensors`` (same shapes), with one wait for the device: each tensor
    is copied into pinned host memory without a sync (no concatenation kernel, no blocking copy),
    then the stream is synchronized once. The checks below run on numpy, whose operations on
    small arrays cost a fraction of torch's."""
    host = [t.detach().to("cpu", non_blocking=True) for t in tensors]
    for dev in {t.device for t in tensors if t.device.type == "cuda"}:
        torch.cuda.current_stream(dev).synchronize()
    return tuple(h.numpy().astype(np.int64, copy=False) for h in host)


def target_errors(target: object) -> list[str]:
    """An op's ``target``: a `Target` or ``None`` (the tensors' device)."""
    if target is None or isinstance(target, Target):
        return []
    return [
        "target must be a portattn Target or None (e.g. portattn.platform.get_target('sm_90')); "
        f"got {type(target).__name__}"
    ]


def raise_errors(op: str, errors: list[str]) -> None:
    if errors:
        raise ValueError(f"{op}: " + "; ".join(errors))


class Problems:
    """Every problem of one call, raised together (`raise_if_any`): a TypeError when any of
    them is a type problem, else a ValueError, the message listing all of them in the order
    found, ``"<op>: <reason>; <reason>"``."""

    def __init__(self, op: str):
        self.op = op
        self.reasons: list[str] = []
        self.has_type = False

    def __bool__(self) -> bool:
        return bool(self.reasons)

    def type(self, *reasons: str) -> None:
        self.reasons.extend(reasons)
        self.has_type = self.has_type or bool(reasons)

    def value(self, *reasons: str) -> None:
        self.reasons.extend(reasons)

    def run(self, fn: Callable, *args, **kwargs):
        """``fn(*args, **kwargs)``; a TypeError or ValueError it raises (in the ``"<op>: ..."``
        form) becomes one reason, and the result is ``None``."""
        try:
            return fn(*args, **kwargs)
        except TypeError as e:
            self.type(str(e).removeprefix(f"{self.op}: "))
        except ValueError as e:
            self.value(str(e).removeprefix(f"{self.op}: "))
        return None

    def raise_if_any(self) -> None:
        if self.reasons:
            kind = TypeError if self.has_type else ValueError
            raise kind(f"{self.op}: " + "; ".join(self.reasons))


def check_device(p: Problems, device: object) -> None:
    """``device`` (``None``: torch's default) is one torch can parse, of a kind the kernels run
    on (a CUDA/HIP GPU, the CPU under the interpreter, meta for shapes), and one this process can
    reach: a CUDA/HIP index must name a visible device. Reasons go to ``p``, naming ``device``."""
    if device is None:
        return
    try:
        dev = torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, TypeError, ValueError) as exc:
        p.value(f"device must be a torch.device or a device string; got {device!r} ({exc})")
        return
    if dev.type not in ("cuda", "cpu", "meta"):
        p.value(f"device must be a CUDA/HIP GPU, the CPU or meta (the kernels' devices); got {dev}")
    elif dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (dev.index is not None and dev.index >= count):
            p.value(f"device must be one this process sees ({count} CUDA/HIP devices); got {dev}")


def is_real(x: object) -> bool:
    """A real number that is not a bool (``True`` is no scale)."""
    return isinstance(x, Real) and not isinstance(x, bool)


def scale_type_errors(scale, *, optional: bool = False) -> list[str]:
    """``scale`` is a real number (`is_real`); ``None`` too with ``optional``: the type half of
    the scale rule, whose values `scale_errors` checks."""
    if (optional and scale is None) or is_real(scale):
        return []
    none = " or None" if optional else ""
    return [f"scale must be a real number{none}; got {type(scale).__name__}"]


def scale_errors(scale, *, optional: bool = False) -> list[str]:
    """``scale`` is a real number, finite, > 0 and at most `MAX_SCALE` (the kernels scale fp32
    scores by ``scale * log2(e)``, which must stay finite); ``None`` too with ``optional``."""
    if optional and scale is None:
        return []
    ok = is_real(scale)
    try:  # an int or Fraction past float's range is no finite float either
        ok = ok and math.isfinite(scale) and 0 < scale <= MAX_SCALE
    except OverflowError:
        ok = False
    if ok:
        return []
    none = " or None" if optional else ""
    return [
        f"scale must be a finite float in (0, {MAX_SCALE:.4g}] (the kernels take scale * "
        f"log2(e) in fp32){none}; got {scale!r}"
    ]


# -- overlap --------------------------------------------------------------------------------


def _byte_dims(t: torch.Tensor) -> list[tuple[int, int]]:
    """``(byte stride, size)`` of each dim of ``t`` with more than one element."""
    es = t.element_size()
    return [(st * es, n) for n, st in zip(t.shape, t.stride(), strict=True) if n > 1]


def span(t: torch.Tensor) -> int:
    """Bytes from ``t.data_ptr()`` to the end of its last element (0: empty)."""
    if t.numel() == 0:
        return 0
    return sum(st * (n - 1) for st, n in _byte_dims(t)) + t.element_size()


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share bytes: its dims, smallest stride first, must
    each step past everything the smaller ones span (stride 0 fails; so do a few exotic
    non-overlapping views, which are refused as a write target all the same)."""
    reach = t.element_size()
    for st, n in sorted(_byte_dims(t)):
        if st < reach:
            return True
        reach += st * (n - 1)
    return False


def _footprint(t: torch.Tensor, period: int) -> int | None:
    """The bytes past ``data_ptr() mod period`` that ``t``'s elements cover modulo ``period``,
    when every dim steps by a multiple of ``period`` or stays within one period; else None."""
    inner = t.element_size() + sum(st * (n - 1) for st, n in _byte_dims(t) if st % period)
    return inner if inner <= period else None


def disjoint(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share no byte (module docstring: ranges, then periods)."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0 or a.is_meta:
        return True
    pa, pb = a.data_ptr(), b.data_ptr()
    if pa + span(a) <= pb or pb + span(b) <= pa:
        return True
    # a stride-0 dim repeats its bytes: no period of its own (and no modulus of 0)
    for period in sorted({st for st, _ in _byte_dims(a) + _byte_dims(b) if st}, reverse=True):
        fa, fb = _footprint(a, period), _footprint(b, period)
        if fa is not None and fb is not None:
            delta = (pb - pa) % period
            if delta >= fa and period - delta >= fb:
                return True
    return False


def reach32(t: torch.Tensor, dims: Sequence[int]) -> int:
    """Elements (not bytes) that ``t``'s indices along ``dims`` reach from its first one in
    32-bit terms: the largest absolute offset a kernel computes from those dims' index x stride
    products. A stride of 2**31 or more is passed to the kernel as a 64-bit integer, so its
    products are 64-bit and it adds nothing."""
    return sum(
        (t.shape[d] - 1) * abs(t.stride(d))
        for d in dims
        if t.shape[d] > 0 and abs(t.stride(d)) < INT32_LIMIT
    )


def reach32_errors(named: Sequence[tuple[str, object, Sequence[int]]]) -> list[str]:
    """Each ``(name, tensor, dims)`` (non-tensors skipped): the kernels compute the offsets of
    ``dims`` as 32-bit index x stride products where the stride fits 32 bits (the other dims'
    terms are 64-bit), so their `reach32` must stay below 2**31 elements; past it an offset
    wraps and the kernel reads or writes outside the tensor."""
    errors = []
    for name, t, dims in named:
        if isinstance(t, torch.Tensor) and reach32(t, dims) >= INT32_LIMIT:
            which = "its" if tuple(dims) == tuple(range(t.dim())) else f"dims {list(dims)}"
            errors.append(
                f"{name}'s elements along {which} must lie within 2**31 - 1 elements of the "
                f"first (the kernels offset them in 32 bits); got shape {tuple(t.shape)}, "
                f"strides {tuple(t.stride())}: {reach32(t, dims)} elements"
            )
    return errors


def positions32_errors(name: str, values: np.ndarray) -> list[str]:
    """``values`` (a host copy of seq_lens) must be below `POSITIONS32_LIMIT`: a kernel counts
    positions in 32 bits, and its arithmetic runs a little past each sequence's end."""
    over = values >= POSITIONS32_LIMIT
    if not over.any():
        return []
    i = _first_true_index(over)
    at = ", ".join(map(str, i))
    return [
        f"{name} must be < 2**31 - 2**16 = {POSITIONS32_LIMIT} (the kernel counts positions in "
        f"32 bits, up to 2**16 past a sequence's end); got {name}[{at}]={values[i]}"
    ]


def refuse_unstrided(op: str, named: Sequence[tuple[str, object]]) -> None:
    """Raise a TypeError naming every tensor of the ``(name, value)`` pairs that is not strided
    (sparse, MKL-DNN): kernels and checks read a tensor's memory through its strides, which such
    a tensor does not have, so it is refused before any other check looks at it."""
    bad = [
        f"{n} must be a strided (dense) tensor; got layout {t.layout}"
        for n, t in named
        if isinstance(t, torch.Tensor) and t.layout != torch.strided
    ]
    if bad:
        raise TypeError(f"{op}: " + "; ".join(bad))


def lazy_bit_errors(named: Sequence[tuple[str, object]]) -> list[str]:
    """The ``(name, tensor)`` pairs (non-tensors skipped) must not carry torch's lazy negation or
    conjugation bit: a kernel reads the memory, which holds the values before the lazy op."""
    lazy = [n for n, t in named if isinstance(t, torch.Tensor) and (t.is_neg() or t.is_conj())]
    if not lazy:
        return []
    return [
        f"{', '.join(lazy)} must not carry torch's lazy negation or conjugation bit (a kernel "
        "reads the memory, which holds the values before the lazy op); pass t.resolve_neg() / "
        "t.resolve_conj()"
    ]


def overlap_errors(
    writes: Sequence[tuple[str, torch.Tensor | None]],
    reads: Sequence[tuple[str, torch.Tensor | None]],
) -> list[str]:
    """The ``(name, tensor)`` pairs an op writes must not overlap themselves, each other, or
    any it reads (``None`` entries are absent arguments). Meta tensors have no memory."""
    written = [(n, t) for n, t in writes if isinstance(t, torch.Tensor) and not t.is_meta]
    read = [(n, t) for n, t in reads if isinstance(t, torch.Tensor) and not t.is_meta]
    errors = []
    for i, (name, w) in enumerate(written):
        if w.numel() and overlaps_itself(w):
            errors.append(
                f"{name} must not overlap itself (it is written); got shape {tuple(w.shape)}, "
                f"strides {w.stride()}"
            )
        for other, t in written[i + 1 :] + read:
            if not disjoint(w, t):
                errors.append(
                    f"{name} must not overlap {other} ({name} is written); got views of the "
                    "same memory"
                )
    return errors


class Disjoint:
    """The plan cache's form of `overlap_errors` for one call description: the writes at
    ``writes`` (indices into the inputs) against every other input, with the spans computed
    once. `check` on a later call of the description is a few pointer comparisons; a pair whose
    byte ranges meet (interleaved caches) is decided by `disjoint`, remembered per address
    difference (the description fixes everything else)."""

    MAX_MEMO = 64

    def __init__(self, writes: Sequence[int], inputs: Sequence[torch.Tensor | None]):
        live = {
            i: span(t)
            for i, t in enumerate(inputs)
            if isinstance(t, torch.Tensor) and t.numel() and not t.is_meta
        }
        self.pairs = [
            (w, o, live[w], live[o])
            for n, w in enumerate(writes)
            if w in live
            for o in live
            if o != w and (o not in writes or writes.index(o) > n)
        ]
        self._memo: dict[tuple[int, int, int], bool] = {}

    def check(self, inputs: Sequence) -> bool:
        """Whether no write of ``inputs`` overlaps another input (``inputs``: a call with the
        description this was built from)."""
        for w, o, sw, so in self.pairs:
            pw, po = inputs[w].data_ptr(), inputs[o].data_ptr()
            if pw + sw <= po or po + so <= pw:
                continue
            key = (w, o, po - pw)
            ok = self._memo.get(key)
            if ok is None:
                ok = disjoint(inputs[w], inputs[o])
                if len(self._memo) >= self.MAX_MEMO:
                    self._memo.clear()
                self._memo[key] = ok
            if not ok:
                return False
        return True


def _first_true_index(mask: np.ndarray) -> tuple[int, ...]:
    """Index of the first True of ``mask`` (row-major)."""
    return tuple(int(i) for i in np.argwhere(mask)[0])


def offsets_errors(
    name: str, offsets: np.ndarray, *, end: int, end_name: str, end_at_most: bool = False
) -> list[str]:
    """``offsets`` ([n + 1], host) starts at 0, never decreases and ends at ``end`` (at most
    ``end`` with ``end_at_most``: rows past it are padding)."""
    errors: list[str] = []
    first, last = int(offsets[0]), int(offsets[-1])
    if first != 0 or (last > end if end_at_most else last != end):
        rule = f"<= {end_name}={end}" if end_at_most else f"{end_name}={end}"
        errors.append(f"{name} must start at 0 and end at {rule}; got first {first}, last {last}")
    down = offsets[1:] < offsets[:-1]  # compared, not subtracted: a difference may wrap
    if bool(down.any()):
        (i,) = _first_true_index(down)
        errors.append(
            f"{name} must be non-decreasing; got a decrease at index {i + 1} "
            f"({int(offsets[i])} -> {int(offsets[i + 1])})"
        )
    return errors


def seq_lens_errors(seq_lens: np.ndarray, q_lens: np.ndarray | None = None) -> list[str]:
    """``seq_lens`` (host) >= each sequence's ``q_lens`` (its last tokens are the queries), or
    >= 0 without queries."""
    floor = np.zeros_like(seq_lens) if q_lens is None else np.maximum(q_lens, 0)
    short = seq_lens < floor
    if not bool(short.any()):
        return []
    (i,) = _first_true_index(short)
    count = f"({int(short.sum())} sequence(s))"
    if q_lens is None:
        return [f"seq_lens must be >= 0; got seq_lens[{i}]={int(seq_lens[i])} {count}"]
    return [
        f"seq_lens must be >= each sequence's q_len; got seq_lens[{i}]={int(seq_lens[i])} < "
        f"q_len {int(floor[i])} {count}"
    ]


def blocks_needed(lens: np.ndarray, block_size: int) -> np.ndarray:
    """``ceil(max(lens, 0) / block_size)`` per entry, without the int64 overflow of
    ``lens + block_size - 1`` (a seq_len near 2**63 needs that many blocks, not a negative
    count)."""
    tokens = np.maximum(lens, 0)
    return tokens // block_size + (tokens % block_size != 0)


def _seq_lens_label(i: int) -> str:
    return f"seq_lens[{i}]"


def capacity_errors(
    lens: np.ndarray,
    block_size: int,
    max_blocks: int,
    label: Callable[[int], str] = _seq_lens_label,
) -> list[str]:
    """Each sequence's ``lens[i]`` tokens (host) fit the ``max_blocks`` columns of its
    block-table row. ``label(i)`` names ``lens[i]`` in the message."""
    if lens.size == 0 or int(lens.max()) <= max_blocks * block_size:
        return []  # the longest fits, so all do (one reduction instead of the per-row sizes)
    n_blocks = blocks_needed(lens, block_size)
    wide = n_blocks > max_blocks
    if not bool(wide.any()):
        return []
    (i,) = _first_true_index(wide)
    return [
        f"block_table must have a column per block of each sequence; got {label(i)}="
        f"{int(lens[i])} needing {int(n_blocks[i])} blocks of {block_size} but "
        f"max_blocks={max_blocks}"
    ]


def block_ids_errors(
    block_table: np.ndarray,
    lens: np.ndarray,
    block_size: int,
    num_blocks: int,
    *,
    padding_ok: bool = False,
    limit: str | None = None,
) -> list[str]:
    """The USED entries of ``block_table`` (host; the first ``ceil(lens[i] / block_size)`` of
    row ``i``) are block ids ``< num_blocks``, and ``>= 0`` unless ``padding_ok`` (a negative
    entry is padding the kernel skips). Other columns may hold anything. ``limit`` names the
    bound in the message (default ``num_blocks=<num_blocks>``)."""
    limit = f"num_blocks={num_blocks}" if limit is None else limit
    if block_table.size == 0:
        return []
    lo, hi = int(block_table.min()), int(block_table.max())
    if (padding_ok or lo >= 0) and hi < num_blocks:
        return []  # every entry is in range, used or not: no per-entry mask needed
    n_blocks = blocks_needed(lens, block_size)
    used = np.arange(block_table.shape[1])[None, :] < n_blocks[:, None]
    bad = used & (block_table >= num_blocks)
    if not padding_ok:
        bad |= used & (block_table < 0)
    if not bool(bad.any()):
        return []
    r, c = _first_true_index(bad)
    where = f"block_table[{r}, {c}]={int(block_table[r, c])} ({int(bad.sum())} entries)"
    entries = block_table[used]
    if padding_ok:
        return [
            f"block_table entries of used blocks must be < {limit} (negative: "
            f"padding); got max {int(entries.max())}, first at {where}"
        ]
    return [
        f"block_table entries of used blocks must be in [0, {limit}); got range "
        f"[{int(entries.min())}, {int(entries.max())}], first at {where}"
    ]


def slots_errors(
    name: str, slots: np.ndarray, num_slots: int, *, padding_ok: bool = False
) -> list[str]:
    """Flat slots (host, ``block * block_size + offset``) address the cache: ``< num_slots``,
    and ``>= 0`` unless ``padding_ok`` (a negative slot is skipped)."""
    if slots.size == 0:
        return []
    bad = (slots >= num_slots) if padding_ok else ((slots < 0) | (slots >= num_slots))
    if not bool(bad.any()):
        return []
    (i,) = _first_true_index(bad)
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
    indptr: np.ndarray, indices: np.ndarray, seq_lens: np.ndarray, num_slots: int
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
        (i,) = _first_true_index(off)
        errors.append(
            f"{iname} must give each sequence seq_lens[i] slots; got indptr[{i + 1}] - "
            f"indptr[{i}] = {int(counts[i])} but seq_lens[{i}]={int(seq_lens[i])} "
            f"({int(off.sum())} sequence(s))"
        )
    if not errors:
        errors += slots_errors("page_indices[1]", indices[: int(indptr[-1])], num_slots)
    return errors


def tokens_total(seq_lens: np.ndarray) -> int:
    """``sum(max(seq_lens, 0))`` (host) as an exact int: numpy's int64 sum would wrap."""
    lens = np.maximum(seq_lens, 0)
    if lens.size == 0 or int(lens.max()) <= INT64_MAX // lens.size:
        return int(lens.sum())
    return sum(map(int, lens.tolist()))


def tokens_total_errors(seq_lens: np.ndarray) -> list[str]:
    """``sum(seq_lens)`` (host) fits the int64 offsets and counts of the expanded indices."""
    total = tokens_total(seq_lens)
    if total > INT64_MAX:
        return [f"sum(seq_lens) must be <= 2**63 - 1 (int64 offsets); got {total}"]
    return []


def num_indices_errors(num_indices: int, seq_lens: np.ndarray) -> list[str]:
    """``num_indices`` (the caller's count of output slots) equals ``sum(seq_lens)`` (host)."""
    total = tokens_total(seq_lens)
    if num_indices != total:
        return [f"num_indices must equal sum(seq_lens)={total}; got {num_indices}"]
    return []
