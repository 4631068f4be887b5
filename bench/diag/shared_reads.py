"""How fast the card streams bytes that several programs each read, as MLA's wide tile reads them.

At 128 heads the sm_90 MLA kernel runs two programs a sequence (64 heads each) that walk the
same cache rows in step: memory sends each byte once, L2 delivers it twice. This times streams
over one int32 buffer of ``--mbytes`` (each layout reading every byte of it), under the suite's
write flush, all layouts' repetitions interleaved (`bench.core.Context.time_together`):

* ``STREAMSxREADERS``: ``STREAMS`` contiguous streams, each read whole, chunk by chunk (the next
  chunk's load issued before the last one is summed), by ``READERS`` programs launched side by
  side (program ``p`` reads stream ``p // READERS``): ``64x2`` is the 128-head MLA pattern,
  ``128x1`` the same program count reading each byte once;
* ``ceiling``: the suite's read ceiling (`bench.core.read_stream`, many short programs).

With ``--rows ordered,scattered`` each ``STREAMSxREADERS`` layout is also read as MLA's cache
is: rows of `ROW_BYTES` (576 bf16 values), `ROWS` a chunk, each chunk's row indices read first
(the block table); ``ordered``: a stream's rows lie one after another (pages of 64 tokens and
more), ``scattered``: the whole buffer's rows in one random order, dealt out to the streams
(page size 1). The same kernel reads both, so they differ only in where the rows lie.

Each layout's sums are checked exactly before it is timed. Reported: µs, the buffer's bytes
over the time (what the MLA rows' ceiling divides), the bytes delivered to the SMs over the
time (``READERS`` times as many), and the read rate as a share of the ceiling's.

Usage (GPU machine, repository root)::

    PYTHONPATH=src python3 -m bench.diag.shared_reads [--mbytes 1208,302] \
        [--layouts 128x1,64x2,132x1] [--rows ordered,scattered] [--reps 30]

Numbers are diagnostics, not serving figures.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from bench import core
from bench.diag import flush
from portattn.compile.__main__ import at_least  # the argparse rule, shared

#: int32 elements a program loads per chunk (64 KB; two chunks in flight a program).
BLOCK = 16384
#: The largest buffer, in MB: the suite ceiling's (`bench.core.Context.read_ceiling`), whose
#: kernel, like this one's chunk offsets, counts int32 elements in 32 bits.
MAX_MBYTES = 4096
LAYOUT = re.compile(r"([1-9][0-9]*)x([1-9][0-9]*)")
#: A cache row (MLA's 576 bf16 values) as int32: a 256-wide part and a 32-wide tail.
ROW_INTS, ROW_HEAD = 288, 256
ROW_BYTES = 4 * ROW_INTS
#: Rows a chunk (the sm_90 MLA kernel's tile).
ROWS = 64
#: Row orders ``--rows`` takes.
ROW_ORDERS = ("ordered", "scattered")


@triton.jit
def _streams_kernel(x_ptr, out_ptr, chunks, READERS: tl.constexpr, BLOCK: tl.constexpr):
    # program p sums stream p // READERS (chunks * BLOCK int32, contiguous), the next chunk's
    # load issued before the current one is added: two chunks in flight
    stream = tl.program_id(0) // READERS
    base = x_ptr + stream.to(tl.int64) * chunks * BLOCK
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    nxt = tl.load(base + offs, cache_modifier=".cg")
    for c in range(1, chunks):
        cur = nxt
        nxt = tl.load(base + c * BLOCK + offs, cache_modifier=".cg")
        acc += cur
    acc += nxt
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


@triton.jit
def _rows_kernel(x_ptr, rows_ptr, out_ptr, chunks, READERS: tl.constexpr, ROWS: tl.constexpr,
                 HEAD: tl.constexpr, TAIL: tl.constexpr):  # fmt: skip
    # program p sums stream p // READERS: ``chunks * ROWS`` rows of HEAD + TAIL int32 each,
    # whose indices it reads chunk by chunk; the next chunk's loads issued before the current
    # one is added (two chunks in flight)
    stream = tl.program_id(0) // READERS
    idx = rows_ptr + stream.to(tl.int64) * chunks * ROWS
    r = tl.arange(0, ROWS)
    c = tl.arange(0, HEAD)
    t = HEAD + tl.arange(0, TAIL)
    acc = tl.zeros([ROWS, HEAD], dtype=tl.int32)
    acc_t = tl.zeros([ROWS, TAIL], dtype=tl.int32)
    row = x_ptr + tl.load(idx + r).to(tl.int64)[:, None] * (HEAD + TAIL)
    nxt = tl.load(row + c[None, :], cache_modifier=".cg")
    nxt_t = tl.load(row + t[None, :], cache_modifier=".cg")
    for k in range(1, chunks):
        cur, cur_t = nxt, nxt_t
        row = x_ptr + tl.load(idx + k * ROWS + r).to(tl.int64)[:, None] * (HEAD + TAIL)
        nxt = tl.load(row + c[None, :], cache_modifier=".cg")
        nxt_t = tl.load(row + t[None, :], cache_modifier=".cg")
        acc += cur
        acc_t += cur_t
    acc += nxt
    acc_t += nxt_t
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.sum(acc, 1), 0) + tl.sum(tl.sum(acc_t, 1), 0))


def parse_mbytes(text: str) -> list[int]:
    """``--mbytes``: `flush.parse_list`'s rule, each at most `MAX_MBYTES`.

    Raises:
        ValueError: naming the rule broken.
    """
    sizes = flush.parse_list(text, "mbytes")
    if max(sizes) > MAX_MBYTES:
        raise ValueError(f"--mbytes: {max(sizes)} is past {MAX_MBYTES}")
    return sizes


def parse_layouts(text: str) -> list[tuple[int, int] | None]:
    """``"ceiling,128x1,64x2"`` -> ``[None, (128, 1), (64, 2)]`` (``None``: the suite's ceiling).

    Raises:
        ValueError: an item that is neither ``ceiling`` nor ``STREAMSxREADERS`` (ints >= 1),
            or a repeated item.
    """
    out: list[tuple[int, int] | None] = []
    for part in text.split(","):
        m = LAYOUT.fullmatch(part)
        if part == "ceiling":
            out.append(None)
        elif m and part.isascii():
            out.append((int(m[1]), int(m[2])))
        else:
            raise ValueError(f"--layouts: {part!r} is neither 'ceiling' nor STREAMSxREADERS")
    if len(set(out)) != len(out):
        raise ValueError(f"--layouts: {text!r} repeats an item")
    return out


def streams(nbytes: int, num_streams: int, readers: int, device: str) -> tuple[
        Callable[[], None], int]:  # fmt: skip
    """A launch of ``num_streams x readers`` programs over a fresh int32 buffer of at most
    ``nbytes`` (each stream a whole number of `BLOCK` chunks, at least one), run once and checked
    exactly; and the buffer's bytes.

    Raises:
        RuntimeError: a program's sum is not its stream's.
    """
    chunks = max(nbytes // (4 * BLOCK * num_streams), 1)
    x = torch.randint(-8, 8, (num_streams, chunks * BLOCK), dtype=torch.int32, device=device)
    out = torch.empty(num_streams * readers, dtype=torch.int32, device=device)

    def launch() -> None:
        _streams_kernel[(out.numel(),)](x, out, chunks, READERS=readers, BLOCK=BLOCK, num_warps=8)

    launch()
    want = x.sum(dim=1, dtype=torch.int32).repeat_interleave(readers)
    if not torch.equal(out, want):
        raise RuntimeError(f"shared_reads: {num_streams}x{readers}'s sums are wrong")
    return launch, x.numel() * 4


def row_streams(nbytes: int, num_streams: int, readers: int, order: str, device: str,
                seed: int = 0) -> tuple[Callable[[], None], int]:  # fmt: skip
    """As `streams`, read as cache rows (`_rows_kernel`) in ``order`` (`ROW_ORDERS`): a launch
    over a fresh buffer of at most ``nbytes`` (each stream a whole number of `ROWS`-row chunks,
    at least one), run once and checked exactly; and the buffer's bytes.

    Raises:
        RuntimeError: a program's sum is not its stream's.
    """
    chunks = max(nbytes // (ROW_BYTES * ROWS * num_streams), 1)
    total = num_streams * chunks * ROWS
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randint(-8, 8, (total, ROW_INTS), dtype=torch.int32, device=device, generator=g)
    if order == "scattered":
        rows = torch.randperm(total, device=device, generator=g).to(torch.int32)
    else:
        rows = torch.arange(total, dtype=torch.int32, device=device)
    out = torch.empty(num_streams * readers, dtype=torch.int32, device=device)

    def launch() -> None:
        _rows_kernel[(out.numel(),)](x, rows, out, chunks, READERS=readers, ROWS=ROWS,
                                     HEAD=ROW_HEAD, TAIL=ROW_INTS - ROW_HEAD,
                                     num_warps=8)  # fmt: skip

    launch()
    want = x[rows.long()].view(num_streams, -1).sum(dim=1, dtype=torch.int32)
    if not torch.equal(out, want.repeat_interleave(readers)):
        raise RuntimeError(f"shared_reads: {num_streams}x{readers} {order} rows' sums are wrong")
    return launch, x.numel() * 4


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.diag.shared_reads")
    ap.add_argument("--mbytes", default="1208,302")
    ap.add_argument("--layouts", default="ceiling,128x1,64x2,132x1,66x2")
    ap.add_argument("--rows", default="")
    ap.add_argument("--reps", type=at_least(1), default=30)
    opts = ap.parse_args(argv)
    try:
        sizes = parse_mbytes(opts.mbytes)
        layouts = parse_layouts(opts.layouts)
        orders = flush.parse_list(opts.rows, "rows", ROW_ORDERS) if opts.rows else []
    except ValueError as err:
        ap.error(str(err))
    core.require_gpu("bench.diag.shared_reads")
    ctx = core.Context("cuda", reps=opts.reps)
    print(f"device: {torch.cuda.get_device_name()}; suite write flush; {opts.reps} reps")
    for mb in sizes:
        calls, sized = [], []
        for layout in layouts:
            if layout is None:
                calls.append(core.read_stream(mb << 20, "cuda"))
                sized.append(("ceiling", mb << 20, 1))
            else:
                fn, nbytes = streams(mb << 20, *layout, "cuda")
                calls.append(fn)
                sized.append((f"{layout[0]}x{layout[1]}", nbytes, layout[1]))
                for order in orders:
                    fn, nbytes = row_streams(mb << 20, *layout, order, "cuda")
                    calls.append(fn)
                    sized.append((f"{layout[0]}x{layout[1]} {order}", nbytes, layout[1]))
        times = ctx.time_together(calls)
        rates = [nbytes / us for (_, nbytes, _), (us, _) in zip(sized, times, strict=True)]
        names = [name for name, _, _ in sized]
        base = rates[names.index("ceiling")] if "ceiling" in names else None
        for (name, nbytes, readers), (us, _) in zip(sized, times, strict=True):
            line = (f"{mb:6d} MB  {name:18} {nbytes / 1e6:7.1f} MB {us:8.1f} µs  "
                    f"{nbytes / us / 1e3:6.0f} GB/s read  {readers * nbytes / us / 1e3:6.0f} "
                    f"GB/s delivered")  # fmt: skip
            if base:
                line += f"  {nbytes / us / base:6.1%} of the ceiling's rate"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
