"""MLA decode's context-split count against its time, on the device's own tiles.

A memory-bound MLA decode of few sequences fills the GPU only by splitting each context: more
splits put more programs on the SMs and add a reduce launch and partial results. For each
``--contexts`` length this plans MLA 576/512 at ``--heads`` heads, ``--batch`` sequences on
``--page``-token pages with the policy's tiles (`mla_decode_tiles`) and each ``--splits`` count
in their place (``policy``: the policy's own count), checks two sequences against the fp64
oracle, then times every checked call together (`report`), beside the read ceiling of its bytes
(and, where it splits, the attention launch alone: the reduce's share is the difference).
With ``--narrow`` the tiles are the narrow 16-row tile's, which the policy keeps on sm_90 only
for a cache the Hopper kernel cannot run (elsewhere it is the policy's own below 64 heads), with
the same split counts. With ``--tiles`` each narrow tile ``BLOCK_N:STAGES:WARPS`` (``policy``:
the policy's narrow one) runs each split count: rows prefetched where the stages reach
`PREFETCH_STAGES`, as the policy's do, at any depth up to `MAX_DIAG_STAGES` (past the target's
own cap, which the policy keeps).

Usage (GPU machine, repository root)::

    PYTHONPATH=src python3 -m bench.diag.mla_splits --heads 16 --contexts 1024,4096 \
        --splits policy,1,2,3,4,6,8
    PYTHONPATH=src python3 -m bench.diag.mla_splits --splits policy,4 --tiles policy,32:3:4

Numbers are diagnostics, not serving figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable

import torch

from bench import core, inputs, mla
from portattn.kernels._launch import run_all
from portattn.kernels.mla_decode import plan_mla_decode
from portattn.platform import Target, current_target
from portattn.policy.common import launch_options
from portattn.policy.mla import (
    BLOCK_N_CANDIDATES,
    MAX_KV_SPLITS,
    PREFETCH_STAGES,
    MlaProblem,
    MlaTiles,
    mla_decode_tiles,
    mla_smem_bytes,
)

#: A narrow tile's ``(block_n, stages, warps)`` (`parse_tiles`).
Shape = tuple[int, int, int]
#: Deepest pipeline a ``--tiles`` shape may ask for: past the target's `max_num_stages` (the
#: policy's cap), so deeper prefetched-row pipelines can be timed before any policy takes them.
MAX_DIAG_STAGES = 8


def parse_splits(text: str) -> list[int | None]:
    """``"policy,1,4"`` -> ``[None, 1, 4]``.

    Raises:
        ValueError: a count that is not ``policy`` or an int in ``[1, MAX_KV_SPLITS]``.
    """
    out: list[int | None] = []
    for part in text.split(","):
        if part == "policy":
            out.append(None)
        elif part.isascii() and part.isdigit() and 1 <= int(part) <= MAX_KV_SPLITS:
            out.append(int(part))
        else:
            raise ValueError(
                f"--splits: {part!r} is neither 'policy' nor an int in [1, {MAX_KV_SPLITS}]"
            )
    return out


def parse_tiles(text: str) -> list[Shape | None]:
    """``"policy,32:3:4"`` -> ``[None, (32, 3, 4)]`` (block_n, stages, warps).

    Raises:
        ValueError: a tile that is not ``policy`` or ``BLOCK_N:STAGES:WARPS`` with BLOCK_N one of
            `BLOCK_N_CANDIDATES`, STAGES in [1, `MAX_DIAG_STAGES`] and WARPS 4 or 8.
    """
    out: list[Shape | None] = []
    for part in text.split(","):
        fields = part.split(":")
        if part == "policy":
            out.append(None)
            continue
        if len(fields) == 3 and all(f.isascii() and f.isdigit() for f in fields):
            n, stages, warps = (int(f) for f in fields)
            if n in BLOCK_N_CANDIDATES and 1 <= stages <= MAX_DIAG_STAGES and warps in (4, 8):
                out.append((n, stages, warps))
                continue
        raise ValueError(
            f"--tiles: {part!r} is neither 'policy' nor BLOCK_N:STAGES:WARPS with BLOCK_N in "
            f"{BLOCK_N_CANDIDATES}, STAGES in [1, {MAX_DIAG_STAGES}] and WARPS 4 or 8"
        )
    return out


def tiles_for(
    target: Target,
    heads: int,
    batch: int,
    context: int,
    splits: int | None,
    narrow: bool = False,
    shape: Shape | None = None,
) -> MlaTiles:
    """The policy's tiles for one decode token a sequence, with ``splits`` context splits (the
    policy's own where ``None``); ``narrow``: the tiles the policy gives a cache the Hopper
    kernel cannot run (the narrow tile below 64 heads); ``shape``: a narrow tile's ``(block_n,
    stages, warps)`` in place of the policy's (16-bit rows prefetched from `PREFETCH_STAGES`
    stages).

    Raises:
        ValueError: ``shape`` on a tile that is not narrow (64 heads or more), or past the
            target's shared memory.
    """
    ready = not narrow and shape is None
    problem = MlaProblem(heads, mla.DK, mla.RANK, 2, batch, context, 1, sm90_ready=ready)
    base = mla_decode_tiles(target, problem)
    if shape is not None:
        if base.block_h != target.mma_min_rows:  # 64 heads or more: the wide tile
            raise ValueError("--tiles: a tile shape replaces the narrow tile only")
        n, stages, warps = shape
        prefetch = stages >= PREFETCH_STAGES
        smem = mla_smem_bytes(base.block_h, n, base.block_dv, base.block_dpe, stages, 2, prefetch)
        if smem > target.max_shared_mem:
            raise ValueError(
                f"--tiles: {n}:{stages}:{warps} needs {smem} B of shared memory, past "
                f"{target.arch}'s {target.max_shared_mem} B"
            )
        base = dataclasses.replace(
            base, block_n=n, smem_bytes=smem, prefetch_rows=prefetch,
            options=dataclasses.replace(launch_options(target, warps, stages), num_stages=stages),
        )  # fmt: skip
    return base if splits is None else dataclasses.replace(base, num_kv_splits=splits)


#: A candidate of `report`: its label, its tiles (``None``: refused) and why it was refused.
Candidate = tuple[str, MlaTiles | None, str]


def report(ctx: core.Context, b: inputs.MlaBatch, out: torch.Tensor, scale: float, nbytes: int,
           ceiling_us: float, cands: list[Candidate]) -> list[str]:  # fmt: skip
    """A line per candidate ``(label, tiles, why refused)``: each planned and checked against the
    oracle alone (a count the kernel refuses, or that answers wrong, is listed with why, not
    fatal), then every checked call, and the attention launch alone of each that splits (the
    reduce's share is the difference), timed together (`core.Context.time_together`: each
    repetition times them all in turn, so a drifting clock moves them alike)."""
    lines: dict[int, str] = {}
    timed: list[tuple[int, Callable[[], object], Callable[[], object] | None]] = []
    for i, (label, tiles, why) in enumerate(cands):
        if tiles is None:
            lines[i] = f"  {label}refused: {why}"
            continue
        try:
            launches = plan_mla_decode(b.query, b.kv_cache, b.block_table, b.seq_lens,
                                       kv_lora_rank=mla.RANK, scale=scale, out=out,
                                       tiles=tiles)  # fmt: skip

            def call(launches=launches):
                return run_all(launches)

            check = ctx.check_once(call, out, lambda: mla._check(b, out, scale))
        except Exception as err:  # noqa: BLE001 - a refused count is a line of the report
            lines[i] = f"  {label:28} failed: {type(err).__name__}: {str(err).splitlines()[0]}"
            continue
        if not check["passed"]:
            lines[i] = f"  {label:28} wrong: {check}"
            continue
        timed.append((i, call, launches[0].run if len(launches) > 1 else None))
    fns = [call for _, call, _ in timed] + [alone for _, _, alone in timed if alone is not None]
    times = iter(us for us, _ in (ctx.time_together(fns) if fns else []))
    whole = {i: next(times) for i, _, _ in timed}
    for i, _, alone in timed:
        us = whole[i]
        extra = "" if alone is None else f"  attention alone {next(times):6.1f} µs"
        lines[i] = (f"  {cands[i][0]:28} {us:8.1f} µs  {nbytes / us / 1e3:7.0f} GB/s  "
                    f"{ceiling_us / us:4.0%} of the ceiling{extra}")  # fmt: skip
    return [lines[i] for i in range(len(cands))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.diag.mla_splits")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--splits", default="policy,1,2,3,4,6,8")
    ap.add_argument("--narrow", action="store_true", help="the narrow 16-row tile's tiles")
    ap.add_argument("--tiles", default="policy", help="narrow tiles BLOCK_N:STAGES:WARPS")
    opts = ap.parse_args(argv)
    try:
        counts = parse_splits(opts.splits)
        shapes = parse_tiles(opts.tiles)
        if opts.narrow and shapes != [None]:
            raise ValueError("--tiles: a tile shape is a narrow tile already (not --narrow)")
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    contexts = [
        int(c) for c in opts.contexts.split(",") if c.isascii() and c.isdigit() and int(c) > 0
    ]
    if not contexts or len(contexts) != len(opts.contexts.split(",")):
        ap.error(f"--contexts must be comma-separated token counts >= 1; got {opts.contexts!r}")
    for name in ("heads", "batch", "page"):
        if getattr(opts, name) < 1:
            ap.error(f"--{name} must be >= 1; got {getattr(opts, name)}")
    core.require_gpu("bench.diag.mla_splits")
    ctx = core.Context(device="cuda")
    target = current_target()
    scale = mla.DK**-0.5
    print(f"device: {torch.cuda.get_device_name()}; {opts.heads} heads, batch {opts.batch}, "
          f"page {opts.page}{', narrow tile' if opts.narrow else ''}")  # fmt: skip
    for context in contexts:
        b = inputs.mla_batch(batch=opts.batch, context=context, heads=opts.heads,
                             head_dim_k=mla.DK, page=opts.page, q_len=1, dtype=mla.DTYPE,
                             device="cuda")  # fmt: skip
        out = torch.empty(opts.batch, opts.heads, mla.RANK, dtype=mla.DTYPE, device="cuda")
        # the bytes a call must move: the latent cache once, the queries and the output
        nbytes = (opts.batch * context * mla.DK + opts.batch * opts.heads * (mla.DK + mla.RANK)) * 2
        ceiling = ctx.read_ceiling(nbytes)
        print(f"context {context}: read ceiling {ceiling['time_us']:.1f} µs", flush=True)
        cands: list[Candidate] = []
        for shape, splits in [(sh, sp) for sh in shapes for sp in counts]:
            tile = "" if shape is None else "tile {}:{}:{} ".format(*shape)
            try:
                tiles = tiles_for(target, opts.heads, opts.batch, context, splits,
                                  opts.narrow, shape)  # fmt: skip
            except ValueError as err:
                cands.append((tile, None, str(err)))
                continue
            policy = "policy " if splits is None else ""
            cands.append((f"{tile}{policy}splits {tiles.num_kv_splits}", tiles, ""))
        for line in report(ctx, b, out, scale, nbytes, ceiling["time_us"], cands):
            print(line, flush=True)
        del b, out
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
