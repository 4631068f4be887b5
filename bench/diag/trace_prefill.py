"""Where the sm_90 prefill kernel's time goes: the clock stamps of a traced call, summarised.

``portattn.paged_attention(..., trace=buf)`` (an int64 buffer of
``prod(paged_prefill_sm90.trace_shape(num_sms))`` words) runs the sm_90 prefill kernel built to
stamp the SM's clock (``%clock64``) at each step of every K/V tile in the two consumer
warpgroups and the producer warp, and the global timer at each partition's start and end. This
runs a prefill-family row (`bench.prefill.FULL`) traced (its output checked against the fp64
oracle first), times the traced and the plain call together, repetition by repetition (what
the stamps cost: `core.Context.time_together`), and prints:

* per consumer warpgroup, the median and mean cycles of each step over the tiles it computed
  (its first two tiles of each program left out): the wait for K, the score MMA, the softmax,
  the wait for V, the P V MMA, the release, and from the release to the next tile's start;
* the tile period of each warpgroup and its cycles at the tensor cores' peak;
* the producer: the wait for a free stage, the copies' issue; how far ahead of the consumers'
  K wait its copies are issued; how far apart the two warpgroups release each tile;
* the kernel's ends: the launch's spread (global timer), the start to the first tile, the last
  release to the end (the epilogue), and the clock rate.

The traced launch runs the policy's `PrefillConfig` for the row, or that config with the
changes ``--sm90`` gives (``field=value,...``, as `bench.diag.prefill_tiles` reads them); its
tile and warpgroups shape the summary.

Usage (GPU machine, repository root)::

    PYTHONPATH=src python3 -m bench.diag.trace_prefill --points "prefill 8x4096 32/8/128" \
        --blocks 16 2048 [--sm90 stages=3,v_pages=0]

Numbers are diagnostics, not serving figures.
"""

from __future__ import annotations

import argparse
import math
import sys

import numpy as np
import torch

import portattn
from bench import core, inputs, prefill
from bench.diag import prefill_tiles
from portattn.compile.__main__ import at_least  # the argparse rule, shared
from portattn.platform import current_target
from portattn.policy.paged import PagedConfig

#: consumer steps: (name, from event, to event); "+0" is the warpgroup's next tile's event 0
STEPS = [
    ("wait K", 0, 1),
    ("S = Q K^T", 1, 2),
    ("softmax, P", 2, 3),
    ("wait V, zero tail", 3, 4),
    ("O += P V", 4, 5),
    ("release", 5, 6),
    ("to next tile", 6, "+0"),
]
PRODUCER = [
    ("block-table loads, stage free", 0, 1),  # the loads' issue; their latency shows at the copies
    ("copies issued", 1, 2),
    ("to next", 2, "+0"),
]
#: bf16 MACs per clock per SM at the tensor cores' peak (H100 dense)
PEAK_MACS = 2048


def tile_macs(head_dim: int = 128, block_n: int = 128, warpgroups: int = 2) -> int:
    """MACs of one K/V tile in one program: every warpgroup's 64 rows, scores and P V."""
    return warpgroups * 64 * block_n * head_dim * 2


def next_step(ev: np.ndarray) -> np.ndarray:
    """Each step's (tile's, pair's) next step's event (NaN for the last); the last axis is the
    steps (`trace_mla` too)."""
    pad = np.full(ev.shape[:-1] + (1,), np.nan)
    return np.concatenate([ev[..., 1:], pad], axis=-1)


def _prev(ev: np.ndarray) -> np.ndarray:
    """Each tile's previous tile's event (NaN for the first)."""
    pad = np.full(ev.shape[:-1] + (1,), np.nan)
    return np.concatenate([pad, ev[..., :-1]], axis=-1)


def _item_starts(ev, wg: int, tiles: int, computed: np.ndarray, res: dict, out) -> None:
    """Warpgroup ``wg``'s item boundaries (the first tile of each item it computed, after its
    previous tile): from the previous tile's release to the item start (event 7: the epilogue,
    the next step's hand-over and the item's metadata reads; then each of the three, from the
    previous tile's events 8 and 9), from there to the first tile's start (the query rows'
    load), and their sum over the launch against its cycles (the warpgroup's first to last
    stamp, median over programs)."""
    first = np.isfinite(ev[:, wg, :tiles, 7]) & computed
    rel = _prev(ev[:, wg, :tiles, 6])
    ends = (ev[:, wg, :tiles, 7] - rel)[first]
    loads = (ev[:, wg, :tiles, 0] - ev[:, wg, :tiles, 7])[first]
    ends, loads = ends[np.isfinite(ends)], loads[np.isfinite(loads)]
    if not ends.size or not loads.size:
        return
    both = np.where(first, ev[:, wg, :tiles, 0] - rel, 0.0)
    per_prog = np.nansum(both, axis=1)
    span = np.nanmax(ev[:, wg, :tiles, 6], axis=1) - np.nanmin(ev[:, wg, :tiles, 0], axis=1)
    share = float(np.nanmedian(per_prog / span))
    out(f"    item end to start (epilogue, metadata) {np.median(ends):6.0f} {ends.mean():8.0f}")
    out(f"    item start to first tile (query)       {np.median(loads):6.0f} {loads.mean():8.0f}")
    out(f"    item boundaries: {first.sum(axis=1).mean():.1f} items a program, "
        f"{share:.1%} of the warpgroup's span")  # fmt: skip
    res[(wg, "item end to start")] = float(np.median(ends))
    res[(wg, "item start to first tile")] = float(np.median(loads))
    res[(wg, "item share")] = share
    # the end-to-start gap in three, from the previous tile's events 8 (the epilogue's stores
    # issued) and 9 (the next step in hand)
    epi, step = _prev(ev[:, wg, :tiles, 8]), _prev(ev[:, wg, :tiles, 9])
    for label, x in (
        ("release to stores issued (epilogue)", epi - rel),
        ("stores to next step (ring)", step - epi),
        ("next step to item start (metadata)", ev[:, wg, :tiles, 7] - step),
    ):
        x = x[first]
        x = x[np.isfinite(x)]
        if x.size:
            out(f"      {label:38} {np.median(x):6.0f} {x.mean():8.0f}")
            res[(wg, label)] = float(np.median(x))


def analyse(
    stamps: np.ndarray, head_dim: int = 128, block_n: int = 128, warpgroups: int = 2, out=print
) -> dict:
    """Print the trace's summary; returns the medians it printed (for tests and records).

    ``stamps``: ``[programs, TRACE_PARTS, TRACE_TILES + 1, TRACE_EVENTS]`` int64, -1 where no
    stamp was written (a partition that does not exist, tiles past a program's work);
    ``warpgroups``: the launch's consumer warpgroups (partitions ``0 .. warpgroups - 1``).
    """
    ev = np.where(stamps < 0, np.nan, stamps.astype(np.float64))
    ev = ev[np.isfinite(ev).any(axis=(1, 2, 3))]  # the buffer's programs the launch did not run
    programs, parts, slots, _ = ev.shape
    tiles = slots - 1
    prod = parts - 1
    res: dict = {}
    computed = np.isfinite(ev[:, :, :tiles, 2])  # a score MMA stamped: the warpgroup computed it
    steady = np.zeros_like(computed)
    steady[:, :, 2:] = True
    per_program = np.isfinite(ev[:, prod, :tiles, 0]).sum(axis=1)
    out(f"  programs {programs}, tiles per program: median {np.median(per_program):.0f}")
    full = int((per_program >= tiles).sum())
    if full:  # tiles past the buffer were not stamped: the ends below start at the last kept
        out(f"  {full} programs ran past the trace's {tiles} tiles: their later tiles are not in "
            "the step figures, and their last release to end is inflated")  # fmt: skip
    res["programs past the buffer"] = full
    for wg in range(warpgroups):
        keep = (computed & steady)[:, wg]
        out(f"  warpgroup {wg}: step, median / mean cycles ({int(keep.sum())} tiles; "
            f"{int((np.isfinite(ev[:, wg, :tiles, 0]) & ~computed[:, wg]).sum())} "
            "passed on)")  # fmt: skip
        for name, a, b in STEPS:
            x = ev[:, wg, :tiles, a]
            y = next_step(ev[:, wg, :tiles, 0]) if b == "+0" else ev[:, wg, :tiles, b]
            d = (y - x)[keep]
            d = d[np.isfinite(d)]
            if d.size:
                out(f"    {name:28s} {np.median(d):8.0f} {d.mean():8.0f}")
                res[(wg, name)] = float(np.median(d))
        _item_starts(ev, wg, tiles, computed[:, wg], res, out)
        period = (next_step(ev[:, wg, :tiles, 0]) - ev[:, wg, :tiles, 0])[keep]
        period = period[np.isfinite(period)]
        if period.size:
            ideal = tile_macs(head_dim, block_n, warpgroups) / PEAK_MACS
            per = float(np.median(period))
            res[(wg, "period")] = per
            out(f"    tile period median {per:.0f} cycles (mean {period.mean():.0f}); at the "
                f"tensor peak {ideal:.0f}: {per / ideal:.2f}x")  # fmt: skip
    out("  producer: step, median / mean cycles")
    for name, a, b in PRODUCER:
        x = ev[:, prod, :tiles, a]
        y = next_step(ev[:, prod, :tiles, 0]) if b == "+0" else ev[:, prod, :tiles, b]
        d = (y - x)[:, 2:]
        d = d[np.isfinite(d)]
        if d.size:
            out(f"    {name:28s} {np.median(d):8.0f} {d.mean():8.0f}")
            res[("producer", name)] = float(np.median(d))
    ahead = (ev[:, 0, :tiles, 0] - ev[:, prod, :tiles, 2])[:, 2:]
    skew = np.abs(ev[:, 0, :tiles, 6] - ev[:, 1, :tiles, 6])[:, 2:]
    for name, d in (("copies issued before WG0 waits", ahead), ("release skew WG0/WG1", skew)):
        d = d[np.isfinite(d)]
        if d.size:
            out(f"  {name:30s} median {np.median(d):8.0f} cycles, share > 0: "
                f"{(d > 0).mean():.2f}")  # fmt: skip
            res[name] = float(np.median(d))
    k = ev[:, :, tiles, :]  # [program, part, event]: 0/2 clock start/end, 1/3 ns start/end
    live = [p for p in range(parts) if np.isfinite(k[:, p, 1]).any()]
    start_ns = np.nanmin(k[:, live, 1], axis=1)
    end_ns = np.nanmax(k[:, live, 3], axis=1)
    start_clk = np.nanmin(k[:, live, 0], axis=1)
    end_clk = np.nanmax(k[:, live, 2], axis=1)
    ghz = (end_clk - start_clk) / (end_ns - start_ns)
    out(f"  span {(np.nanmax(end_ns) - np.nanmin(start_ns)) / 1e3:.1f} us (global timer); starts "
        f"spread {(np.nanmax(start_ns) - np.nanmin(start_ns)) / 1e3:.2f} us, ends spread "
        f"{(np.nanmax(end_ns) - np.nanmin(end_ns)) / 1e3:.2f} us; clock "
        f"{np.nanmedian(ghz):.3f} GHz")  # fmt: skip
    first = np.nanmin(ev[:, 0, :tiles, 0], axis=1) - k[:, 0, 0]
    last_release = np.nanmax(ev[:, :warpgroups, :tiles, 6], axis=(1, 2))
    tail = np.nanmax(k[:, :warpgroups, 2], axis=1) - last_release
    for name, d in (("start to first tile (WG0)", first), ("last release to end", tail)):
        d = d[np.isfinite(d)]
        if d.size:
            out(f"  {name:30s} median {np.median(d):8.0f} cycles")
            res[name] = float(np.median(d))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.diag.trace_prefill",
                                 description=__doc__.splitlines()[0])  # fmt: skip
    ap.add_argument(
        "--points", nargs="+", default=["prefill 8x4096 32/8/128"], choices=sorted(prefill.FULL)
    )
    ap.add_argument("--blocks", type=at_least(1), nargs="+", default=[16])
    ap.add_argument("--sm90", default="", metavar="CHANGES",
                    help="field=value,... of PrefillConfig: the traced launch runs the "
                         "policy's config with these changes")  # fmt: skip
    args = ap.parse_args(argv)
    try:
        changes = prefill_tiles.parse_changes(args.sm90) if args.sm90 else {}
    except ValueError as err:
        ap.error(str(err))
    core.require_gpu("bench.diag.trace_prefill")
    from portattn.kernels.paged_prefill_sm90 import trace_shape

    ctx = core.Context("cuda")
    shape = trace_shape(torch.cuda.get_device_properties(0).multi_processor_count)
    buf = torch.full((math.prod(shape),), -1, dtype=torch.int64, device="cuda")
    print(f"device: {torch.cuda.get_device_name()}")
    for name in args.points:
        seqs, (hq, hkv, d), _ = prefill.FULL[name]
        for bs in args.blocks:
            b = inputs.paged_batch(seqs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                   block_size=bs, dtype=prefill.DTYPE, device="cuda")  # fmt: skip
            out = torch.empty_like(b.query)
            problem = prefill_tiles.problem_of(b)
            cfg = prefill_tiles.changed_config(current_target(), problem, changes)
            kw = dict(out=out, max_query_len=b.max_query_len, max_seq_len=b.max_seq_len,
                      config=PagedConfig(prefill=cfg))  # fmt: skip

            def plain(b=b, kw=kw):
                portattn.paged_attention(*b.args, **kw)

            def traced(b=b, kw=kw):
                portattn.paged_attention(*b.args, trace=buf, **kw)

            out.normal_()  # stale values must not pass the check
            traced()
            check = core.check_paged(b, out)
            print(f"== {name} block {bs}, {cfg}: check {check}")
            if not check["passed"]:
                return 1
            buf.fill_(-1)
            traced()
            torch.cuda.synchronize()
            stamps = buf.view(shape).cpu().numpy()
            (plain_us, _), (traced_us, _) = ctx.time_together([plain, traced])
            print(f"  median: plain {plain_us:.1f} us, traced {traced_us:.1f} us")
            analyse(stamps, head_dim=d, block_n=cfg.block_n, warpgroups=cfg.warpgroups)
            del b, out
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
