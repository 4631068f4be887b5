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

Each layout's sums are checked exactly before it is timed. Reported: µs, the buffer's bytes
over the time (what the MLA rows' ceiling divides), the bytes delivered to the SMs over the
time (``READERS`` times as many), and the read rate as a share of the ceiling's.

Usage (GPU machine, repository root)::

    PYTHONPATH=src python3 -m bench.diag.shared_reads [--mbytes 1208,302] \
        [--layouts 128x1,64x2,132x1] [--reps 30]

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

#: int32 elements a program loads per chunk (64 KB; two chunks in flight a program).
BLOCK = 16384
#: The largest buffer, in MB: the suite ceiling's (`bench.core.Context.read_ceiling`), whose
#: kernel, like this one's chunk offsets, counts int32 elements in 32 bits.
MAX_MBYTES = 4096
LAYOUT = re.compile(r"([1-9][0-9]*)x([1-9][0-9]*)")


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.diag.shared_reads")
    ap.add_argument("--mbytes", default="1208,302")
    ap.add_argument("--layouts", default="ceiling,128x1,64x2,132x1,66x2")
    ap.add_argument("--reps", type=int, default=30)
    opts = ap.parse_args(argv)
    try:
        sizes = flush.parse_list(opts.mbytes, "mbytes")
        if max(sizes) > MAX_MBYTES:
            raise ValueError(f"--mbytes: {max(sizes)} is past {MAX_MBYTES}")
        layouts = parse_layouts(opts.layouts)
    except ValueError as err:
        ap.error(str(err))
    if opts.reps < 1:
        ap.error(f"--reps must be >= 1; got {opts.reps}")
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
        times = ctx.time_together(calls)
        rates = [nbytes / us for (_, nbytes, _), (us, _) in zip(sized, times, strict=True)]
        base = rates[layouts.index(None)] if None in layouts else None
        for (name, nbytes, readers), (us, _) in zip(sized, times, strict=True):
            line = (f"{mb:6d} MB  {name:8} {nbytes / 1e6:7.1f} MB {us:8.1f} µs  "
                    f"{nbytes / us / 1e3:6.0f} GB/s read  {readers * nbytes / us / 1e3:6.0f} "
                    f"GB/s delivered")  # fmt: skip
            if base:
                line += f"  {nbytes / us / base:6.1%} of the ceiling's rate"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
