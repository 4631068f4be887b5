"""How fast the sm_90 MLA kernel's two copy engines fill its tiles, with no math behind them.

The Hopper MLA kernel (`portattn.kernels.mla_decode_sm90`) fills 64-row tiles of 576-wide
16-bit cache rows in NVMMA-swizzled shared memory: by TMA boxes where pages hold 64 tokens or a
multiple, by ``cp.async`` (16-byte pieces from all 128 threads of a warpgroup) where rows are
gathered (page size 1, ``page_indices``). This kernel does only that: one program an SM (two
tiles of shared memory, 147 KB), two tiles in flight, each tile's row indices read first (the
block table), the next copy issued into a buffer as soon as its tile has landed. Copies:

* ``cp.async scattered``: the gather, over rows in one random order (page size 1);
* ``cp.async ordered``: the gather, over rows lying in pages of 64;
* ``tma ordered``: one 64-row TMA box a 64-column block, over the same pages;
* ``cp.async sorted``: the gather over the scattered rows, each stream's sorted by address (a
  sequence's keys in any order give the same decode attention), so that its tiles walk the
  cache in one direction;
* with ``--windows W``: ``cp.async scattered/W``, the gather over rows shuffled only within
  windows of ``W`` consecutive rows, the windows in random order (``W = 64``: each tile's rows
  are one page's, in random order; larger windows spread a tile over more memory), which tells
  an effect of the rows' order within a page from one of their spread over the cache.

Each copy runs in the ``STREAMSxREADERS`` layouts of `bench.diag.shared_reads` (``64x2``: two
programs a sequence, as at 128 heads; ``128x1``: the same programs, each reading its own rows).
With ``--lags`` a stream's reader ``r`` starts ``r * lag`` tiles into the stream (and wraps), so
that the readers of a tile copy it ``lag`` steps apart instead of at once.
Every launch's last tiles are read back and checked exactly before it is timed; all are timed
together under the suite's write flush (`bench.core.Context.time_together`). Reported: µs, the
buffer's bytes over the time, the bytes delivered to shared memory over the time.

Usage (GPU machine with sm_90, repository root)::

    PYTHONPATH=src python3 -m bench.diag.gather_copies [--mbytes 1208,302] \\
        [--layouts 128x1,64x2] [--lags 0,2] [--windows 64,1792] [--reps 30]

Numbers are diagnostics, not serving figures.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from bench import core
from bench.diag import flush, shared_reads
from portattn.compile.__main__ import at_least  # the argparse rule, shared

#: A cache row's 16-bit values (`shared_reads`' row: 576) and a tile's rows (64); the kernel
#: spells them out (576 columns in nine 64-column blocks, 64 rows).
WIDTH, ROWS = 2 * shared_reads.ROW_INTS, shared_reads.ROWS
#: The copies, as (name, engine, row order); engine 0 is cp.async, 1 is TMA.
COPIES = (("cp.async scattered", 0, "scattered"), ("cp.async sorted", 0, "sorted"),
          ("cp.async ordered", 0, "ordered"), ("tma ordered", 1, "ordered"))  # fmt: skip
_SWIZZLED = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


@gluon.jit
def _issue(t, b, stream, tiles, desc, kv_ptr, idx_ptr, smem, bars, TMA: gl.constexpr, shift=0):
    """Tile ``t`` of ``stream`` into buffer ``b``: by one TMA box a 64-column block (the tile's
    first row from the index array; its 64 rows lie one after another), or by ``cp.async`` of
    its 64 indexed rows, every thread arriving on the buffer's barrier once its pieces land."""
    bar = bars.index(b)
    idx = idx_ptr + (stream * tiles + (t + shift) % tiles) * 64
    if TMA:
        row = gl.load(idx)
        mbarrier.expect(bar, 64 * 576 * 2)
        for cb in gl.static_range(9):
            tma.async_copy_global_to_shared(desc, [row, cb * 64], bar, smem.index(b * 9 + cb))
    else:
        L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        rows = gl.load(idx + gl.arange(0, 64, layout=gl.SliceLayout(1, L))).to(gl.int64)
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, L))
        for cb in gl.static_range(9):
            ptrs = kv_ptr + rows[:, None] * 576 + (cb * 64 + cols)[None, :]
            async_copy.async_copy_global_to_shared(smem.index(b * 9 + cb), ptrs)
        async_copy.mbarrier_arrive(bar, increment_count=False)


@gluon.jit
def _gather_copies_kernel(desc, kv_ptr, idx_ptr, out_ptr, tiles, lag, READERS: gl.constexpr,
                          TMA: gl.constexpr):  # fmt: skip
    # program p copies stream p // READERS, tile by tile, two in flight; then writes its last
    # two tiles' buffers out (what the check compares)
    pid = gl.program_id(0)
    stream = pid // READERS
    shift = (pid % READERS) * lag
    smem = gl.allocate_shared_memory(gl.bfloat16, [18, 64, 64], _SWIZZLED)
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(bars.index(i), count=1 if TMA else 128)
    _issue(0, 0, stream, tiles, desc, kv_ptr, idx_ptr, smem, bars, TMA, shift)
    _issue(1, 1, stream, tiles, desc, kv_ptr, idx_ptr, smem, bars, TMA, shift)
    for t in range(tiles):
        b = t % 2
        mbarrier.wait(bars.index(b), (t // 2) & 1)
        if t + 2 < tiles:
            gl.thread_barrier()  # every thread has seen the tile before its buffer is refilled
            _issue(t + 2, b, stream, tiles, desc, kv_ptr, idx_ptr, smem, bars, TMA, shift)
    L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, L))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, L))
    for k in gl.static_range(18):  # buffer k // 9 holds tile tiles - 2 + (tiles + k // 9) % 2
        x = smem.index(k).load(L)
        dst = out_ptr + (pid * 2 + k // 9) * (64 * 576) + r[:, None] * 576 + (k % 9) * 64
        gl.store(dst + c[None, :], x)


def scattered_rows(total: int, window: int | None, g: torch.Generator,
                   device: str) -> torch.Tensor:  # fmt: skip
    """A permutation of ``range(total)``: the whole in one random order (``window`` ``None``),
    or shuffled only within windows of ``window`` consecutive rows, the windows in random
    order (the last may be short)."""
    if window is None:
        return torch.randperm(total, device=device, generator=g)
    where = torch.randperm(-(-total // window), device=device, generator=g)
    rank = torch.randperm(total, device=device, generator=g)  # distinct keys within a window
    key = where[torch.arange(total, device=device) // window] * total + rank
    return torch.argsort(key)


def stream_rows(order: str, num_streams: int, tiles: int, g: torch.Generator, device: str,
                window: int | None = None) -> torch.Tensor:  # fmt: skip
    """The int32 row indices of ``num_streams`` streams of ``tiles`` 64-row tiles, stream after
    stream, in ``order`` (`copies`)."""
    pages = num_streams * tiles
    if order in ("scattered", "sorted"):
        rows = scattered_rows(pages * ROWS, window, g, device)
        if order == "sorted":
            rows = rows.view(num_streams, -1).sort(dim=1).values.reshape(-1)
    else:  # pages of 64 rows, in random page order
        first = torch.randperm(pages, device=device, generator=g) * ROWS
        rows = (first[:, None] + torch.arange(ROWS, device=device)).reshape(-1)
    return rows.to(torch.int32)


def copies(nbytes: int, num_streams: int, readers: int, tma_engine: bool, order: str,
           lag: int = 0, device: str = "cuda", seed: int = 0,
           window: int | None = None) -> tuple[Callable[[], None], int]:  # fmt: skip
    """A launch copying ``num_streams`` streams of 64-row tiles (at least two a stream, at most
    ``nbytes`` in all), each by ``readers`` programs, with rows in ``order``
    (`shared_reads.ROW_ORDERS`, or ``sorted``: the scattered rows, each stream's sorted;
    ``scattered`` within windows of ``window`` rows where given: `scattered_rows`), run once and
    checked exactly; and the buffer's bytes.

    Raises:
        ValueError: TMA over scattered rows (a box copies rows that lie one after another).
        RuntimeError: a program's last tiles are not its stream's rows.
    """
    if tma_engine and order != "ordered":
        raise ValueError("gather_copies: a TMA box copies rows that lie one after another")
    if window is not None and (order != "scattered" or window < 2):
        raise ValueError(f"gather_copies: window {window} needs scattered rows and >= 2 rows")
    tiles = max(nbytes // (ROWS * WIDTH * 2 * num_streams), 2)
    pages = num_streams * tiles
    g = torch.Generator(device=device).manual_seed(seed)
    kv = torch.randn(pages * ROWS, WIDTH, device=device, dtype=torch.bfloat16, generator=g)
    rows = stream_rows(order, num_streams, tiles, g, device, window)
    desc = TensorDescriptor.from_tensor(kv, [ROWS, 64], _SWIZZLED)
    out = torch.empty(num_streams * readers * 2, ROWS, WIDTH, device=device, dtype=kv.dtype)

    def launch() -> None:
        _gather_copies_kernel[(num_streams * readers,)](desc, kv, rows, out, tiles, lag,
                                                        READERS=readers, TMA=tma_engine,
                                                        num_warps=4)  # fmt: skip

    launch()
    per_tile = rows.view(num_streams, tiles, ROWS).long()
    # reader r's step t copies tile (t + r * lag) % tiles into buffer t % 2: its last two steps
    want = torch.stack([
        torch.stack([kv[per_tile[:, (t + r * lag) % tiles]]
                     for t in sorted((tiles - 2, tiles - 1), key=lambda t: t % 2)], dim=1)
        for r in range(readers)
    ], dim=1)  # fmt: skip
    if not torch.equal(out.view(num_streams, readers, 2, ROWS, WIDTH), want):
        raise RuntimeError(f"gather_copies: {num_streams}x{readers} {order} tiles are wrong")
    return launch, kv.numel() * 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.diag.gather_copies")
    ap.add_argument("--mbytes", default="1208,302")
    ap.add_argument("--layouts", default="128x1,64x2")
    ap.add_argument("--lags", default="0")
    ap.add_argument("--windows", default="")
    ap.add_argument("--reps", type=at_least(1), default=30)
    opts = ap.parse_args(argv)
    try:
        sizes = shared_reads.parse_mbytes(opts.mbytes)
        layouts = shared_reads.parse_layouts(opts.layouts)
        lags = flush.parse_list(opts.lags, "lags", least=0)
        windows = flush.parse_list(opts.windows, "windows", least=2) if opts.windows else []
        if None in layouts:
            raise ValueError("--layouts: takes STREAMSxREADERS items only (no 'ceiling')")
    except ValueError as err:
        ap.error(str(err))
    core.require_gpu("bench.diag.gather_copies")
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        raise SystemExit("bench.diag.gather_copies: needs an sm_90 GPU (the Hopper MLA kernel's "
                         f"copies); this one is sm_{cap[0]}{cap[1]}")  # fmt: skip
    ctx = core.Context("cuda", reps=opts.reps)
    print(f"device: {torch.cuda.get_device_name()}; suite write flush; {opts.reps} reps")
    for mb in sizes:
        calls, named = [], []
        for layout in layouts:
            assert layout is not None
            runs = [(name, engine, order, None) for name, engine, order in COPIES]
            runs += [(f"cp.async scattered/{w}", 0, "scattered", w) for w in windows]
            for name, engine, order, window in runs:
                for lag in lags if layout[1] > 1 else [0]:
                    fn, nbytes = copies(mb << 20, *layout, bool(engine), order, lag,
                                        window=window)  # fmt: skip
                    calls.append(fn)
                    label = f"{layout[0]}x{layout[1]} {name}" + (f" lag {lag}" if lag else "")
                    named.append((label, nbytes, layout[1]))
        times = ctx.time_together(calls)
        for (name, nbytes, readers), (us, _) in zip(named, times, strict=True):
            print(f"{mb:6d} MB  {name:34} {nbytes / 1e6:7.1f} MB {us:8.1f} µs  "
                  f"{nbytes / us / 1e3:6.0f} GB/s read  {readers * nbytes / us / 1e3:6.0f} GB/s "
                  "delivered", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
