"""How the L2 flush before each timed repetition shapes a row's time.

The suite flushes L2 by writing a 256 MB buffer (`bench.core.Context.time_us`, as
`triton.testing.do_bench` does). A write leaves the cache full of dirty lines, which the timed
kernel's first reads must evict, writing them back to memory; a read of 256 MB leaves it full
of clean lines. This times, under each ``--flush`` mode, the read-ceiling kernel
(`bench.core`'s streaming read) at ``--mbytes`` sizes, and MLA 576/512 decode (the policy's
tiles) at ``--heads`` x ``--contexts`` (batch 64, page 64), each the median of ``--reps``
repetitions (graph replay between two events, as the suite times a row):

* ``write``: the suite's flush (256 MB of zeros);
* ``read``: a streaming read of 256 MB (`bench.core.read_stream`);
* ``none``: nothing between repetitions (L2 warm from the last one).

Where the time is linear in the bytes, ``fit`` gives each mode's fixed part and its rate: what a
short row pays once, whatever it reads.

Usage (GPU machine, repository root)::

    PYTHONPATH=src python3 -m bench.diag.flush [--mbytes 75,302,1208] [--heads 16,128] \
        [--contexts 1024,4096,16384] [--flush write,read,none] [--reps 50]

Numbers are diagnostics, not serving figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import torch

from bench import core, inputs, mla
from portattn.kernels._launch import run_all
from portattn.kernels.mla_decode import plan_mla_decode
from portattn.platform import current_target
from portattn.policy.mla import MlaProblem, mla_decode_tiles

MODES = ("write", "read", "none")


def parse_list(text: str, name: str, allowed: tuple[str, ...] | None = None,
               least: int = 1) -> list:  # fmt: skip
    """``"a,b"`` -> the items: ints >= ``least``, or (``allowed``) names among them.

    Raises:
        ValueError: naming ``--name`` and the item that is neither, or a repeated item.
    """
    out: list = []
    for part in text.split(","):
        if allowed is not None and part in allowed:
            out.append(part)
        elif allowed is None and part.isascii() and part.isdigit() and int(part) >= least:
            out.append(int(part))
        else:
            want = f"one of {list(allowed)}" if allowed else f"an int >= {least}"
            raise ValueError(f"--{name}: {part!r} is not {want}")
    if len(set(out)) != len(out):  # the fit needs distinct sizes; a repeat times nothing new
        raise ValueError(f"--{name}: {text!r} repeats an item")
    return out


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares line through ``(x, y)`` points: ``(intercept, slope)``.

    Raises:
        ValueError: fewer than two distinct ``x``.
    """
    xs = [x for x, _ in points]
    if len(set(xs)) < 2:
        raise ValueError(f"fit needs two distinct x; got {xs}")
    mx, my = statistics.fmean(xs), statistics.fmean(y for _, y in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


class Flusher:
    """What each mode does before a repetition: ``write`` zeroes a 256 MB buffer (the suite's
    flush), ``read`` streams another 256 MB through the read ceiling's kernel."""

    def __init__(self) -> None:
        self.buf = torch.zeros(core.FLUSH_BYTES, dtype=torch.int8, device="cuda")
        self.read = core.read_stream(core.FLUSH_BYTES, "cuda")

    def __call__(self, mode: str) -> None:
        if mode == "write":
            self.buf.zero_()
        elif mode == "read":
            self.read()


def time_us(fn: Callable[[], object], flush: Flusher, mode: str, reps: int) -> float:
    """Median µs of ``fn`` replayed from a CUDA graph between two events, ``flush(mode)`` before
    each repetition."""
    fn()
    torch.cuda.synchronize()
    graph = core.capture(fn)
    graph.replay()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]  # fmt: skip
    for start, end in events:
        flush(mode)
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in events)


def _mla(heads: int, context: int) -> tuple[Callable[[], object], int]:
    """MLA decode, batch 64, page 64, the policy's tiles, checked once against the fp64 oracle;
    and the bytes it must move."""
    batch, page = 64, 64
    b = inputs.mla_batch(batch=batch, context=context, heads=heads, head_dim_k=mla.DK, page=page,
                         q_len=1, dtype=mla.DTYPE, device="cuda")  # fmt: skip
    out = torch.empty(batch, heads, mla.RANK, dtype=mla.DTYPE, device="cuda")
    problem = MlaProblem(heads, mla.DK, mla.RANK, 2, batch, context, 1)
    launches = plan_mla_decode(b.query, b.kv_cache, b.block_table, b.seq_lens,
                               kv_lora_rank=mla.RANK, scale=mla.DK**-0.5, out=out,
                               tiles=mla_decode_tiles(current_target(), problem))  # fmt: skip
    run_all(launches)
    check = mla._check(b, out, mla.DK**-0.5)
    if not check["passed"]:
        raise RuntimeError(f"flush: MLA {heads} heads at {context} is wrong: {check}")
    nbytes = (batch * context * mla.DK + batch * heads * (mla.DK + mla.RANK)) * 2
    return (lambda: run_all(launches)), nbytes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.diag.flush")
    ap.add_argument("--mbytes", default="75,302,1208")
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--flush", default=",".join(MODES))
    ap.add_argument("--reps", type=int, default=50)
    opts = ap.parse_args(argv)
    try:
        sizes = parse_list(opts.mbytes, "mbytes")
        heads = parse_list(opts.heads, "heads")
        contexts = parse_list(opts.contexts, "contexts")
        modes = parse_list(opts.flush, "flush", MODES)
    except ValueError as err:
        ap.error(str(err))
    if opts.reps < 1:
        ap.error(f"--reps must be >= 1; got {opts.reps}")
    core.require_gpu("bench.diag.flush")
    flush = Flusher()
    print(f"device: {torch.cuda.get_device_name()}; flush modes {modes}; {opts.reps} reps")
    rows: list[tuple[str, list[tuple[int, Callable[[], object]]]]] = []
    rows.append(("read ceiling", [(mb << 20, core.read_stream(mb << 20, "cuda")) for mb in sizes]))
    for h in heads:
        rows.append((f"mla {h}h 64x page64", [(nb, fn) for fn, nb in
                                               (_mla(h, c) for c in contexts)]))  # fmt: skip
    for name, cases in rows:
        for mode in modes:
            points = [(nbytes, time_us(fn, flush, mode, opts.reps)) for nbytes, fn in cases]
            cells = "  ".join(f"{nb / 1e6:6.0f} MB {us:8.1f} µs" for nb, us in points)
            line = f"{name:22} flush {mode:5}  {cells}"
            if len(points) > 1:
                fixed, per_byte = fit([(float(nb), us) for nb, us in points])
                line += f"  | fixed {fixed:6.1f} µs, {1e-3 / per_byte:6.0f} GB/s past it"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
