"""Clock probe: the SM clock and board power while a prefill row runs, to split a time gap
between block sizes into extra cycles and a lower clock (a card at its power limit runs more work
a tile at a lower clock: the same cycles, more microseconds).

For each prefill-family point (`bench.prefill.FULL`) and block size, the public op's call is
checked against the fp64 oracle (`bench.core.check_paged`), captured in a CUDA graph and
replayed for ``--seconds`` while a thread reads the SM clock and power through NVML every 20 ms,
in ``--rounds`` rounds whose order rotates. Per row: µs a call, the median MHz and W, and cycles a
call; per point: each block size over the largest in time, cycles and clock.

Usage (GPU machine, repository root)::

    PYTHONPATH=src python3 -m bench.diag.clock [--points "prefill 8x4096 32/8/128"] \
        [--blocks 16,2048] [--seconds 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import ctypes
import math
import statistics
import sys
import threading
import time

import torch

import portattn
from bench import core, inputs, prefill
from portattn.compile.__main__ import at_least  # the argparse rule, shared


def nvml_reader(index: int = 0):
    """A function returning the card's ``(SM MHz, W)`` now, through the driver's NVML library
    (ctypes: no Python package needed). Raises OSError where NVML is missing, RuntimeError on an
    NVML error (its code named)."""
    lib = ctypes.CDLL("libnvidia-ml.so.1")

    def ok(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"nvml_reader: {what} returned NVML error {rc}")

    ok(lib.nvmlInit_v2(), "nvmlInit_v2")
    handle = ctypes.c_void_p()
    ok(lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)), "GetHandleByIndex")
    mhz, mw = ctypes.c_uint(), ctypes.c_uint()

    def read() -> tuple[float, float]:
        ok(lib.nvmlDeviceGetClockInfo(handle, 1, ctypes.byref(mhz)), "GetClockInfo(SM)")
        ok(lib.nvmlDeviceGetPowerUsage(handle, ctypes.byref(mw)), "GetPowerUsage")
        return float(mhz.value), mw.value / 1000.0

    return read


def sample_while(read, work, ms: float = 20.0, trim: int = 2) -> list:
    """Run ``work()`` while a thread calls ``read()`` every ``ms`` ms; the samples, less ``trim``
    at each end (the thread's start and stop fall outside the work). A failed read is raised
    again: no run reports a clock it did not read."""
    got: list = []
    errors: list = []
    stop = threading.Event()

    def loop():
        try:
            while not stop.is_set():
                got.append(read())
                time.sleep(ms / 1e3)
        except Exception as err:  # noqa: BLE001 (raised again below)
            errors.append(err)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        work()
    finally:
        stop.set()
        thread.join()
    if errors:
        raise RuntimeError(f"sample_while: read failed: {errors[0]}") from errors[0]
    return got[trim : len(got) - trim]


def summarize(rows: list[dict]) -> list[dict]:
    """Per point, each block size's row over the largest block size's: ratios of time, cycles
    (µs x MHz) and clock, from the rows' medians over rounds. ``rows``: ``point``,
    ``block_size``, ``us``, ``mhz`` (lists, one per round)."""
    out = []
    for point in dict.fromkeys(r["point"] for r in rows):
        mine = {r["block_size"]: r for r in rows if r["point"] == point}
        top = max(mine)
        b_us, b_mhz = statistics.median(mine[top]["us"]), statistics.median(mine[top]["mhz"])
        for bs, r in sorted(mine.items()):
            if bs == top:
                continue
            us, mhz = statistics.median(r["us"]), statistics.median(r["mhz"])
            out.append(dict(point=point, block_size=bs, against=top, time=us / b_us,
                            cycles=(us * mhz) / (b_us * b_mhz), clock=mhz / b_mhz))  # fmt: skip
    return out


def _replay(graph, seconds: float, read) -> tuple[float, float, float]:
    """(µs a replay, median SM MHz, median W) over about ``seconds`` of back-to-back replays."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    graph.replay()
    ev[1].record()
    torch.cuda.synchronize()
    n = max(8, int(seconds * 1e3 / max(ev[0].elapsed_time(ev[1]), 1e-3)))

    def work():
        ev[0].record()
        for _ in range(n):
            graph.replay()
        ev[1].record()
        torch.cuda.synchronize()

    samples = sample_while(read, work)
    if not samples:
        raise SystemExit(f"clock: no clock sample in {seconds} s of replays; raise --seconds")
    mhz = statistics.median(s[0] for s in samples)
    watts = statistics.median(s[1] for s in samples)
    return ev[0].elapsed_time(ev[1]) * 1e3 / n, mhz, watts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.diag.clock",
                                 description=__doc__.splitlines()[0])  # fmt: skip
    ap.add_argument("--points", default="prefill 8x4096 32/8/128", help=f"of {list(prefill.FULL)}")
    ap.add_argument("--blocks", default="16,2048")
    ap.add_argument("--seconds", type=float, default=3.0, help="replays a row a round")
    ap.add_argument("--rounds", type=at_least(1), default=3)
    opts = ap.parse_args(argv)
    names = [p.strip() for p in opts.points.split(",")]
    if any(n not in prefill.FULL for n in names):
        ap.error(f"--points must name points of {list(prefill.FULL)}; got {names}")
    try:
        blocks = [int(b) for b in opts.blocks.split(",")]
    except ValueError:
        ap.error(f"--blocks must be comma-separated integers; got {opts.blocks!r}")
    # nan passes a comparison and inf replays forever: a finite count of seconds only
    if not (math.isfinite(opts.seconds) and opts.seconds > 0):
        ap.error(f"--seconds must be a finite number > 0; got {opts.seconds}")
    if min(blocks) < 1:
        ap.error(f"--blocks must be block sizes >= 1; got {opts.blocks!r}")
    core.require_gpu("bench.diag.clock")
    read = nvml_reader(torch.cuda.current_device())
    rows, keep = [], []
    for name in names:
        seqs, (hq, hkv, d), _ = prefill.FULL[name]
        for bs in blocks:
            b = inputs.paged_batch(seqs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                   block_size=bs, dtype=prefill.DTYPE, device="cuda")  # fmt: skip
            out = torch.empty_like(b.query)

            def call(b=b, out=out):
                portattn.paged_attention(*b.args, out=out, max_query_len=b.max_query_len,
                                         max_seq_len=b.max_seq_len)  # fmt: skip

            out.normal_()
            call()
            check = core.check_paged(b, out)
            if not check["passed"]:
                sys.exit(f"clock: {name} block {bs}: check failed {check}")
            graph = core.capture(call)
            keep.append((graph, b, out))  # the inputs live as long as the graph
            rows.append(dict(point=name, block_size=bs, us=[], mhz=[], watts=[]))
    for rnd in range(opts.rounds):
        for i in [(j + rnd) % len(rows) for j in range(len(rows))]:
            us, mhz, watts = _replay(keep[i][0], opts.seconds, read)
            for key, value in (("us", us), ("mhz", mhz), ("watts", watts)):
                rows[i][key].append(value)
    print(f"{torch.cuda.get_device_name()}: {opts.seconds} s a row, {opts.rounds} rounds")
    print(f"{'point':24} {'block':>5} {'us a call':>10} {'MHz':>6} {'W':>6} {'Mcycles':>8}")
    for r in rows:
        us, mhz, w = (statistics.median(r[k]) for k in ("us", "mhz", "watts"))
        print(f"{r['point']:24} {r['block_size']:>5} {us:>10.1f} {mhz:>6.0f} {w:>6.0f} "
              f"{us * mhz / 1e6:>8.3f}")  # fmt: skip
    for s in summarize(rows):
        print(f"{s['point']}: block {s['block_size']} over {s['against']}: time {s['time']:.3f}, "
              f"cycles {s['cycles']:.3f}, clock {s['clock']:.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
