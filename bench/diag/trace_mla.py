"""Where the sm_90 MLA decode kernel's time goes: the clock stamps of a traced call, summarised.

``portattn.mla_decode(..., trace=buf)`` runs the Hopper kernel (`mla_decode_sm90`) built to stamp
the SM's clock (``%clock64``) at each step of every pair of tiles in both warpgroups, at the
program's start and end of its prologue, and at each warpgroup's end (with the global timer at
the program's start and each warpgroup's end). For each ``--contexts`` length and ``--pages``
page size this plans MLA 576/512 at ``--heads`` heads, ``--batch`` sequences of one query token
(the suite's inputs, `bench.inputs.mla_batch`: pages of 64 tokens load by TMA boxes, page size 1
by the row gather), checks the traced call against the fp64 oracle, times the traced and the
plain call together (what the stamps cost: `core.Context.time_together`), and prints:

* per warpgroup, the median and mean cycles of each step of a pair (a program's first pair left
  out): the waits for its tile's halves, the score MMAs, the hand-offs and softmax, P V on tile
  A and on tile B, each reload's issue, and from the last reload to the next pair; the pair
  period;
* the program's ends: start to the end of the prologue (the query, both first tiles' rows and
  copies), from there to the first pair, the first pair's wait for its tile, the row sums'
  exchange and the epilogue's stores; the part of a program's span its pairs do not explain
  (span minus pairs x period);
* the launch's spread (global timer) and the clock rate.

Usage (GPU machine, repository root)::

    PYTHONPATH=src python3 -m bench.diag.trace_mla --heads 128 --contexts 4096,16384 --pages 64,1

Numbers are diagnostics, not serving figures.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import numpy as np
import torch

from bench import core, inputs, mla
from bench.diag import flush
from bench.diag.trace_prefill import next_step
from portattn.compile.__main__ import at_least  # the argparse rule, shared
from portattn.kernels._launch import run_all
from portattn.kernels.mla_decode import plan_mla_decode

#: a warpgroup's steps of a pair: (name, from event, to event); "+0": its next pair's event 0.
#: Events 6 (P_A received) and 8 (P_B and m_B received) are warpgroup 1's and 0's only.
STEPS = [
    ("rows read, wait left half", 0, 1),
    ("wait right half, rope", 1, 2),
    ("scores (Q K^T)", 2, 3),
    ("max hand-off", 3, 4),
    ("softmax, P out", 4, 5),
    ("P out to P V(A) issued", 5, 7),
    ("  of which wait P_A (WG1)", 5, 6),
    ("P V(A)", 7, 9),
    ("  of which wait P_B (WG0)", 7, 8),
    ("reload A's half issued", 9, 10),
    ("rescale, P V(B) issued", 10, 11),
    ("P V(B)", 11, 12),
    ("reload B's half issued", 12, 13),
    ("to next pair", 13, "+0"),
]
#: the kernel's own slot (the last): warpgroup 0's events 4-6 are the program's start (clock,
#: global timer) and the prologue's end; each warpgroup's 0-3 its loop's end, the row sums
#: exchanged, the epilogue's stores (clock) and its end (global timer)
START, START_NS, PROLOGUE, LOOP_END, SUMS, STORES, END_NS = 4, 5, 6, 0, 1, 2, 3


def _line(out, res: dict, key, label: str, d: np.ndarray) -> None:
    d = d[np.isfinite(d)]
    if d.size:
        out(f"    {label:32s} {np.median(d):8.0f} {d.mean():8.0f}")
        res[key] = float(np.median(d))


def analyse(stamps: np.ndarray, out=print) -> dict:
    """Print the trace's summary; returns the medians it printed (for tests and records).

    ``stamps``: ``[programs, 2, TRACE_PAIRS + 1, TRACE_EVENTS]`` int64, -1 where no stamp was
    written (pairs past a program's work, programs of the buffer the launch did not run)."""
    ev = np.where(stamps < 0, np.nan, stamps.astype(np.float64))
    ev = ev[np.isfinite(ev).any(axis=(1, 2, 3))]
    programs, _, slots, _ = ev.shape
    pairs = slots - 1
    res: dict = {}
    done = np.isfinite(ev[:, :, :pairs, 13])  # the pair's last reload issued: it ran
    per_program = done[:, 0].sum(axis=1)
    out(f"  programs {programs}, pairs per program: median {np.median(per_program):.0f}")
    full = int((per_program >= pairs).sum())
    if full:
        out(f"  {full} programs ran past the trace's {pairs} pairs: their later pairs are not in "
            "the step figures")  # fmt: skip
    res["programs past the buffer"] = full
    steady = done.copy()
    steady[:, :, 0] = False
    periods = {}
    for wg in (0, 1):
        keep = steady[:, wg]
        out(f"  warpgroup {wg}: step, median / mean cycles ({int(keep.sum())} pairs)")
        for name, a, b in STEPS:
            x = ev[:, wg, :pairs, a]
            y = next_step(ev[:, wg, :pairs, 0]) if b == "+0" else ev[:, wg, :pairs, b]
            _line(out, res, (wg, name.strip()), name, (y - x)[keep])
        period = (next_step(ev[:, wg, :pairs, 0]) - ev[:, wg, :pairs, 0])[keep]
        period = period[np.isfinite(period)]
        if period.size:
            periods[wg] = res[(wg, "period")] = float(np.median(period))
            out(f"    pair period median {periods[wg]:.0f} cycles (mean {period.mean():.0f})")
    k = ev[:, :, pairs, :]  # [program, warpgroup, event]
    first_top = ev[:, 0, 0, 0]
    out("  program ends: median / mean cycles")
    for key, label, d in (
        ("prologue", "start to prologue's end", k[:, 0, PROLOGUE] - k[:, 0, START]),
        ("to first pair", "prologue's end to first pair", first_top - k[:, 0, PROLOGUE]),
        ("first tile", "first pair's wait for its tile", ev[:, 0, 0, 2] - first_top),
        ("sums", "loop end to row sums exchanged", k[:, :, SUMS] - k[:, :, LOOP_END]),
        ("stores", "row sums to stores done", k[:, :, STORES] - k[:, :, SUMS]),
    ):
        _line(out, res, key, label, d.ravel())
    if periods:
        span = np.nanmax(k[:, :, STORES], axis=1) - k[:, 0, START]
        rest = span - per_program * max(periods.values())
        _line(out, res, "unexplained", "span minus pairs x period", rest)
    live = np.isfinite(k[:, 0, START_NS])
    start_ns, end_ns = k[live, 0, START_NS], np.nanmax(k[live][:, :, END_NS], axis=1)
    if start_ns.size:
        end_clk = np.nanmax(k[live][:, :, STORES], axis=1)
        ghz = (end_clk - k[live, 0, START]) / (end_ns - start_ns)
        res["span us"] = float((end_ns.max() - start_ns.min()) / 1e3)
        out(f"  span {res['span us']:.1f} us (global timer); starts spread "
            f"{(start_ns.max() - start_ns.min()) / 1e3:.2f} us, ends spread "
            f"{(end_ns.max() - end_ns.min()) / 1e3:.2f} us; clock "
            f"{np.nanmedian(ghz):.3f} GHz")  # fmt: skip
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.diag.trace_mla",
                                 description=__doc__.splitlines()[0])  # fmt: skip
    ap.add_argument("--heads", type=at_least(1), default=128)
    ap.add_argument("--batch", type=at_least(1), default=64)
    ap.add_argument("--contexts", default="4096,16384")
    ap.add_argument("--pages", default="64,1")
    opts = ap.parse_args(argv)
    try:
        contexts = flush.parse_list(opts.contexts, "contexts")
        pages = flush.parse_list(opts.pages, "pages")
    except ValueError as err:
        ap.error(str(err))
    core.require_gpu("bench.diag.trace_mla")
    from portattn.kernels.mla_decode_sm90 import TRACE_EVENTS, TRACE_PAIRS, trace_elements

    ctx = core.Context(device="cuda")
    scale = mla.DK**-0.5
    print(f"device: {torch.cuda.get_device_name()}; {opts.heads} heads, batch {opts.batch}")
    for context in contexts:
        for page in pages:
            b = inputs.mla_batch(batch=opts.batch, context=context, heads=opts.heads,
                                 head_dim_k=mla.DK, page=page, q_len=1, dtype=mla.DTYPE,
                                 device="cuda")  # fmt: skip
            out = torch.empty(opts.batch, opts.heads, mla.RANK, dtype=mla.DTYPE, device="cuda")
            kw = dict(kv_lora_rank=mla.RANK, scale=scale, out=out)
            plain = plan_mla_decode(b.query, b.kv_cache, b.block_table, b.seq_lens, **kw)
            programs = plain[0].grid[0]
            buf = torch.full((trace_elements(programs),), -1, dtype=torch.int64, device="cuda")
            print(f"== context {context}, page {page}: {plain[0].name}, {programs} programs, "
                  f"{len(plain)} launches")  # fmt: skip
            try:
                traced = plan_mla_decode(b.query, b.kv_cache, b.block_table, b.seq_lens,
                                         trace=buf, **kw)  # fmt: skip
            except ValueError as err:  # the portable kernel stamps nothing
                print(f"  not traced: {err}")
                continue
            run_traced = partial(run_all, traced)
            check = ctx.check_once(run_traced, out, partial(mla._check, b, out, scale))
            print(f"  check {check}")
            if not check["passed"]:
                return 1
            buf.fill_(-1)
            run_traced()
            torch.cuda.synchronize()
            shape = (programs, 2, TRACE_PAIRS.value + 1, TRACE_EVENTS.value)
            stamps = buf.view(shape).cpu().numpy()
            (plain_us, _), (traced_us, _) = ctx.time_together([partial(run_all, plain), run_traced])
            print(f"  median: plain {plain_us:.1f} us, traced {traced_us:.1f} us")
            analyse(stamps)
            del b, out, buf
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
