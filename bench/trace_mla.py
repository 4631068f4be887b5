"""Where the sm_90 MLA kernel's time goes: clock stamps at each step of each pair (a diagnostic).

The kernel built with `portattn.kernels.mla_decode_sm90.TRACE_BUFFER` set stamps the SM's clock
(``%clock64``) at 14 points of every pair in each warpgroup, and the global timer at each
program's start and end. This script runs the policy's launch once per point with the trace on
(output checked against the fp64 oracle first), times the traced and the plain launch
(``do_bench_cudagraph`` medians, to show what the stamps cost), and prints:

* per step, the median and mean cycles over every program's steady pairs (all but the first
  two and the last), per warpgroup: what each waits for (tiles, the other warpgroup's hand-offs)
  and how long each MMA takes from issue to its wait's return;
* the pair period, its cycles at the tensor cores' peak (2048 bf16 MAC/clk/SM) and the ratio;
* the kernel's ends: launch spread (global timer), start to the first pair, the first pair, the
  last pair's end to the stores' end, and the clock rate (cycles / ns).

Usage (GPU machine)::

    python3 bench/trace_mla.py 128:4096:64 128:16384:64 128:16384:1 [--resident TOKENS]

A point is ``heads:context:page`` (batch 64, 576/512, bf16); page sizes that are not a multiple
of 64 run the kernel's row gather. Numbers are diagnostics, not serving figures.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys

import numpy as np
import torch
from _common import git_commit, set_switch
from bench_mla import Checker, make_inputs
from triton.testing import do_bench_cudagraph

import portattn.kernels.mla_decode_sm90 as sm90
from portattn.kernels._launch import run_all
from portattn.kernels.mla_decode import plan_mla_decode
from portattn.policy import mla as mla_policy

#: (name, warpgroup, from event, to event); event "+0" is the next pair's event 0.
STEPS = {
    0: [
        ("wait tile A left", 0, 1),
        ("wait tile A right", 1, 2),
        ("S_A (last part) to done", 2, 3),
        ("rowmax, m_A out", 3, 4),
        ("softmax, P_A out", 4, 5),
        ("zero tail, PV_A issue", 5, 7),
        ("wait P_B", 7, 8),
        ("PV_A,L done", 8, 9),
        ("copy A left", 9, 10),
        ("rescale, PV_B issue", 10, 11),
        ("PV_B,L done", 11, 12),
        ("copy B left", 12, 13),
        ("to next pair", 13, "+0"),
    ],
    1: [
        ("wait tile B left", 0, 1),
        ("wait tile B right", 1, 2),
        ("S_B (last part) to done", 2, 3),
        ("wait m_A", 3, 4),
        ("softmax, P_B out", 4, 5),
        ("wait P_A", 5, 6),
        ("rescale, PV_A issue", 6, 7),
        ("PV_A,R done", 7, 9),
        ("copy A right", 9, 10),
        ("rescale, PV_B issue", 10, 11),
        ("PV_B,R done", 11, 12),
        ("copy B right", 12, 13),
        ("to next pair", 13, "+0"),
    ],
}


def pair_macs(heads_tile=64, n=64, dk=576, r=512):
    """MACs of one pair of 64-token tiles in one program (both warpgroups)."""
    return 2 * heads_tile * n * dk + 2 * heads_tile * n * r


def analyse(stamps: np.ndarray, programs: int, pairs: int) -> None:
    ev = stamps[:programs].astype(np.float64)  # [program, wg, slot, event]
    kept = min(pairs, sm90.TRACE_PAIRS.value)
    steady = slice(2, kept - 1) if kept > 4 else slice(0, kept)
    print(f"  programs {programs}, pairs {pairs} (steady: pairs {steady.start}..{steady.stop - 1})")
    for wg, steps in STEPS.items():
        print(f"  warpgroup {wg}: step, median / mean cycles")
        for name, a, b in steps:
            x = ev[:, wg, :kept, a]
            if b == "+0":
                y = np.concatenate([ev[:, wg, 1:kept, 0], np.full((programs, 1), np.nan)], axis=1)
            else:
                y = ev[:, wg, :kept, b]
            d = (y - x)[:, steady]
            d = d[np.isfinite(d)]
            if d.size:
                print(f"    {name:28s} {np.median(d):8.0f} {d.mean():8.0f}")
    period = np.diff(ev[:, 0, :kept, 0], axis=1)[:, steady]
    per = float(np.median(period))
    ideal = pair_macs() / 2048
    print(
        f"  pair period median {per:.0f} cycles (mean {period.mean():.0f}); at the tensor "
        f"peak {ideal:.0f} cycles: {per / ideal:.2f}x"
    )
    # cross-warpgroup: when each hand-off lands against when its waiter starts waiting
    pb_late = ev[:, 1, :kept, 5] - ev[:, 0, :kept, 7]
    ma_late = ev[:, 0, :kept, 4] - ev[:, 1, :kept, 3]
    pa_late = ev[:, 0, :kept, 5] - ev[:, 1, :kept, 5]
    for name, d in (("P_B out after WG0 waits", pb_late), ("m_A out after WG1 waits", ma_late),
                    ("P_A out after WG1 waits", pa_late)):  # fmt: skip
        d = d[:, steady]
        print(f"  {name:28s} median {np.median(d):8.0f}, share > 0: {(d > 0).mean():.2f}")
    # the kernel's ends (slot TRACE_PAIRS): WG0 4 start clock, 5 start ns, 6 prologue issued;
    # both: 0 loop end, 1 row sums exchanged, 2 stores done (clock), 3 end (ns)
    k = ev[:, :, sm90.TRACE_PAIRS.value, :]
    start_ns, end_ns = k[:, 0, 5], np.maximum(k[:, 0, 3], k[:, 1, 3])
    ghz = (np.maximum(k[:, 0, 2], k[:, 1, 2]) - k[:, 0, 4]) / (end_ns - start_ns)
    first = ev[:, :, 0, 0].min(axis=1)
    print(
        f"  span {(end_ns.max() - start_ns.min()) / 1e3:.1f} us (global timer); starts spread "
        f"{(start_ns.max() - start_ns.min()) / 1e3:.2f} us, ends spread "
        f"{(end_ns.max() - end_ns.min()) / 1e3:.2f} us; clock {np.median(ghz):.3f} GHz"
    )
    rows = [
        ("start to prologue issued", k[:, 0, 6] - k[:, 0, 4]),
        ("prologue issued to first pair", first - k[:, 0, 6]),
        ("first pair (WG0)", ev[:, 0, 1, 0] - ev[:, 0, 0, 0]),
        ("first pair: wait tile A left", ev[:, 0, 0, 1] - ev[:, 0, 0, 0]),
        ("last pair (WG0)", k[:, 0, 0] - ev[:, 0, kept - 1, 0] if kept == pairs else None),
        ("loop end to row sums", np.maximum(k[:, 0, 1], k[:, 1, 1]) - k[:, :, 0].max(axis=1)),
        ("row sums to stores done", np.maximum(k[:, 0, 2], k[:, 1, 2]) - k[:, :, 1].max(axis=1)),
    ]
    for name, d in rows:
        if d is not None:
            print(f"  {name:28s} median {np.median(d):8.0f} cycles")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("points", nargs="+", help="heads:context:page")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--resident", type=int, default=0, help="as bench_mla.py --resident")
    ap.add_argument("--set", action="append", default=[], metavar="SWITCH=0|1",
                    help="as bench_mla.py --set")  # fmt: skip
    args = ap.parse_args(argv)
    for item in args.set:
        set_switch(mla_policy, item)
    print(f"switches: {args.set}")
    print(f"device: {torch.cuda.get_device_name()}, commit {git_commit()}")
    dk, r = 576, 512
    scale = 1 / math.sqrt(dk)
    for spec in args.points:
        heads, ctx, page = (int(x) for x in spec.split(":"))
        q, cache, bt, sl = make_inputs(
            args.batch, ctx, heads, dk, page, torch.bfloat16, resident=args.resident
        )
        out = torch.empty(args.batch, heads, r, dtype=torch.bfloat16, device="cuda")
        check = Checker(q, cache, bt, sl, r, scale, torch.bfloat16)
        plain = plan_mla_decode(q, cache, bt, sl, kv_lora_rank=r, scale=scale, out=out)
        programs = plain[0].grid[0]
        n = programs * 2 * (sm90.TRACE_PAIRS.value + 1) * sm90.TRACE_EVENTS.value
        buf = torch.full((n,), -1, dtype=torch.int64, device="cuda")
        sm90.TRACE_BUFFER = buf
        try:
            traced = plan_mla_decode(q, cache, bt, sl, kv_lora_rank=r, scale=scale, out=out)
        finally:
            sm90.TRACE_BUFFER = None
        if plain[0].name != "mla_decode_sm90" or len(plain) != 1:
            print(f"{spec}: not one sm_90 launch ({[x.name for x in plain]}); skipped")
            continue
        out.fill_(float("nan"))
        run_all(traced)
        torch.cuda.synchronize()
        ok, e_k, e_t = check(out)
        print(f"== {spec} (gather {plain[0].args['GATHER']}): check ok={ok} "
              f"err {e_k:.2e} (torch {e_t:.2e})")  # fmt: skip
        if not ok:
            return 1
        buf.fill_(-1)
        run_all(traced)
        torch.cuda.synchronize()
        stamps = buf.view(programs, 2, sm90.TRACE_PAIRS.value + 1, sm90.TRACE_EVENTS.value)
        stamps = stamps.cpu().numpy()
        us_plain = do_bench_cudagraph(functools.partial(run_all, plain), return_mode="median")
        us_plain *= 1e3
        us_traced = do_bench_cudagraph(functools.partial(run_all, traced), return_mode="median")
        us_traced *= 1e3
        print(f"  graph median: plain {us_plain:.1f} us, traced {us_traced:.1f} us")
        pairs = math.ceil(math.ceil(ctx / 64) / 2)
        analyse(stamps, programs, pairs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
