"""Diagnostic (issue 19, block 16): the SM clock and board power while the prefill kernel runs at
each block size, to split block 16's extra time into extra cycles and a lower clock.

Block 16 runs pure prefill 4-5% slower than block 2048 on the H200 (bench/RESULTS.md, eighteenth
and nineteenth sessions), and the copies' count, the pages' scatter and V's layout are ruled out
(bench/NOTES.md). Under Nsight Compute's locked clock (thirteenth session) the kernel at block 16
executed 15% more instructions than at 2048. If the card is at its power limit, more work a tile
can mean a lower clock: the same cycles, more microseconds. This measures both: for each point
and block size, the public op's call captured in a CUDA graph is replayed for ``--seconds``
while a thread reads the SM clock and power through NVML every 20 ms (`_common.ClockSampler`),
in ``--rounds`` rounds whose order rotates (`_common.turn_order`). Per row: µs a call (CUDA
events over the replays), the median clock and power, and cycles a call (µs x MHz). Per point:
block 16 over 2048 in time, in cycles and in clock.

Correctness first: each point's output checked against the fp64 oracle on the rows
`bench_prefill.Oracle` picks (a failure stops the run).

Usage (GPU machine, repository root)::

    python3 bench/diag_clock.py [--points "prefill 8x4096"] [--blocks 16,2048] [--seconds 3]
                                [--rounds 3]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ClockSampler, git_commit, nvml_reader, save_record, turn_order  # noqa: E402
from bench_paged import make_inputs  # noqa: E402
from bench_prefill import CHECK_ROWS, POINTS, Oracle, parse_blocks  # noqa: E402

from portattn.kernels.paged_attention import paged_attention  # noqa: E402


def summarize(rows: list[dict]) -> list[dict]:
    """Per point, the largest block size's row against each other block size's: ratios of time
    (µs a call), cycles (µs x MHz) and clock (MHz), each from the rows' medians over rounds.
    ``rows``: ``point``, ``block_size``, ``us``, ``mhz`` (lists, one per round)."""
    out = []
    for point in dict.fromkeys(r["point"] for r in rows):
        mine = {r["block_size"]: r for r in rows if r["point"] == point}
        top = max(mine)
        b_us, b_mhz = float(np.median(mine[top]["us"])), float(np.median(mine[top]["mhz"]))
        for bs, r in sorted(mine.items()):
            if bs == top:
                continue
            us, mhz = float(np.median(r["us"])), float(np.median(r["mhz"]))
            out.append(dict(point=point, block_size=bs, against=top, time=us / b_us,
                            cycles=(us * mhz) / (b_us * b_mhz), clock=mhz / b_mhz))  # fmt: skip
    return out


def _graph(call) -> torch.cuda.CUDAGraph:
    """``call`` captured in a CUDA graph (warmed on a side stream first, as torch asks)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    torch.cuda.synchronize()
    return graph


def _replay(graph: torch.cuda.CUDAGraph, seconds: float, read) -> tuple[float, float, float]:
    """(µs a replay, median SM MHz, median W) over about ``seconds`` of back-to-back replays."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    graph.replay()
    ev[1].record()
    torch.cuda.synchronize()
    n = max(8, int(seconds * 1e3 / max(ev[0].elapsed_time(ev[1]), 1e-3)))
    with ClockSampler(read) as sampler:
        ev[0].record()
        for _ in range(n):
            graph.replay()
        ev[1].record()
        torch.cuda.synchronize()
    if not sampler.samples:
        raise SystemExit(f"diag_clock: no clock sample in {seconds} s of replays; raise --seconds")
    mhz, watts = np.median(np.array(sampler.samples), axis=0)
    return ev[0].elapsed_time(ev[1]) * 1e3 / n, float(mhz), float(watts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default="prefill 8x4096",
                    help="comma-separated names of bench_prefill's points")  # fmt: skip
    ap.add_argument("--blocks", default="16,2048")
    ap.add_argument("--seconds", type=float, default=3.0, help="replays a row a round")
    ap.add_argument("--rounds", type=int, default=3)
    opts = ap.parse_args(argv)
    names = [p.strip() for p in opts.points.split(",")]
    unknown = [n for n in names if n not in POINTS]
    if unknown:
        raise SystemExit(f"diag_clock: --points {unknown} not among {list(POINTS)}")
    if opts.seconds <= 0 or opts.rounds < 1:
        raise SystemExit(f"diag_clock: --seconds must be > 0 and --rounds >= 1; got "
                         f"{opts.seconds}, {opts.rounds}")  # fmt: skip
    blocks = parse_blocks(opts.blocks, "diag_clock")
    if not blocks:
        raise SystemExit("diag_clock: --blocks names no block size")
    if not torch.cuda.is_available():
        raise SystemExit("diag_clock: needs a CUDA device")
    read = nvml_reader(torch.cuda.current_device())
    print(f"device: {torch.cuda.get_device_name()}, commit {git_commit()}, {opts.seconds} s a "
          f"row, {opts.rounds} rounds in turns")  # fmt: skip
    rows, graphs = [], []
    for name in names:
        seqs = POINTS[name][0]
        mql, msl = max(q for _, q in seqs), max(s for s, _ in seqs)
        for bs in blocks:
            args = make_inputs(seqs, bs, torch.bfloat16)
            out = torch.empty_like(args[0])
            call = functools.partial(paged_attention, *args, max_query_len=mql,
                                     max_seq_len=msl, out=out)  # fmt: skip
            out.normal_()  # stale values must not pass
            call()
            oracle = Oracle(seqs, args, CHECK_ROWS)
            ok, err = oracle.check(out)
            if not ok:
                raise SystemExit(f"diag_clock: {name} block {bs}: error {err:.3e} > 2 x torch's "
                                 f"{oracle.e_torch:.3e}; the run stops here")  # fmt: skip
            graphs.append((_graph(call), args, out))  # (the inputs live as long as the graph)
            rows.append(dict(point=name, block_size=bs, us=[], mhz=[], watts=[], checked=True))
    for rnd in range(opts.rounds):
        for i in turn_order(len(rows), rnd):
            us, mhz, watts = _replay(graphs[i][0], opts.seconds, read)
            for key, value in (("us", us), ("mhz", mhz), ("watts", watts)):
                rows[i][key].append(value)
    print(f"{'point':24} {'block':>5} {'us a call':>10} {'MHz':>6} {'W':>6} {'Mcycles':>8}")
    for r in rows:
        us, mhz, w = (float(np.median(r[k])) for k in ("us", "mhz", "watts"))
        print(f"{r['point']:24} {r['block_size']:>5} {us:>10.1f} {mhz:>6.0f} {w:>6.0f} "
              f"{us * mhz / 1e6:>8.3f}")  # fmt: skip
    ratios = summarize(rows)
    for s in ratios:
        print(f"{s['point']}: block {s['block_size']} over {s['against']}: time {s['time']:.3f}, "
              f"cycles {s['cycles']:.3f}, clock {s['clock']:.3f}")  # fmt: skip
    save_record("diag_clock", rows=rows, ratios=ratios, seconds=opts.seconds, rounds=opts.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
