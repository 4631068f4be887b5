"""Tiles for one prefill row: each candidate checked against the fp64 oracle, then all timed as
the bench times a row, in turns (each repetition times every candidate once, so their ratios
hold on a drifting clock), beside the policy's own tiles.

For a row the sm_90 prefill kernel does not serve (fp32, SHUFFLE, ...), this asks
whether the portable kernel's policy leaves speed behind: ``plan_paged_attention(tiles=)``
builds the row's launches with each candidate (``block_m`` x ``block_n`` x warps x stages; the
query heads of one KV head per program, as the policy takes them), and a candidate that fails
to compile or to match the oracle is listed with why.

With ``--sm90 CHANGES`` (repeatable; ``CHANGES``: ``field=value,...`` of `PrefillConfig`, e.g.
``block_n=32,stages=3,turns=1,query_by_tma=1``) it times the sm_90 prefill kernel instead: the
policy's `PrefillConfig` for the row and the policy's with each ``CHANGES``, passed as the call's
``config`` (a config the call cannot run is listed with the rule it breaks).

Usage (GPU machine, repository root)::

    PYTHONPATH=src python3 -m bench.diag.prefill_tiles [--row "prefill 8x4096 32/8/256 bs16"]
    PYTHONPATH=src python3 -m bench.diag.prefill_tiles --sm90 block_n=32,stages=3 --sm90 ...

Numbers are diagnostics, not serving figures.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import re
from typing import Any

import torch

from bench import core, inputs, prefill
from portattn.kernels.paged_attention import plan_paged_attention
from portattn.platform import current_target
from portattn.policy.common import LaunchOptions
from portattn.policy.paged import (
    PagedConfig,
    PagedProblem,
    PrefillConfig,
    paged_config,
    paged_tiles,
)


def row_names(points=prefill.FULL) -> list[str]:
    """The rows ``--row`` may name: the bench's prefill rows."""
    return [f"{p} bs{bs}" for p, (_, _, blocks) in points.items() for bs in blocks]


def _batch(row: str, device: str, points=prefill.FULL):
    """The row's batch (one of ``points``, the bench's prefill rows) and its flops."""
    for point, (seqs, (hq, hkv, d), blocks) in points.items():
        for bs in blocks:
            if f"{point} bs{bs}" == row:
                b = inputs.paged_batch(
                    seqs,
                    num_q_heads=hq,
                    num_kv_heads=hkv,
                    head_dim=d,
                    block_size=bs,
                    dtype=prefill.DTYPE,
                    device=device,
                )
                return b, core.paged_flops(seqs, hq, d)
    raise SystemExit(f"prefill_tiles: --row must be one of {row_names(points)}; got {row!r}")


def mma_shapes(ptx: str) -> str:
    """The warpgroup MMAs of a kernel's PTX by shape (``m64n16k16 x64``): an 8-warp tile of 64
    rows splits each dot's N between its two warpgroups on sm_90, so its shapes show it."""
    shapes = collections.Counter(
        re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)
    )
    return " ".join(f"{k} x{v}" for k, v in sorted(shapes.items())) or "no wgmma"


#: The attention launch of a plan (beside the sm_90 kernel's work list).
MAIN = ("paged_attention", "paged_prefill_sm90")


def parse_changes(text: str) -> dict:
    """``"block_n=32,turns=1"`` -> ``{"block_n": 32, "turns": True}`` (the fields of
    `PrefillConfig`; a bool field takes 0 or 1)."""
    fields = {f.name: f for f in dataclasses.fields(PrefillConfig)}
    out: dict = {}
    if not text.strip(","):  # no change: the policy's tile again, under another label
        raise ValueError(f"--sm90 takes field=int items of {sorted(fields)}; got {text!r}")
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in fields or not (value.lstrip("-").isascii() and value.lstrip("-").isdigit()):
            raise ValueError(f"--sm90 takes field=int items of {sorted(fields)}; got {item!r}")
        if name in out:
            raise ValueError(f"--sm90: {name} is given twice in {text!r}")
        flag = isinstance(fields[name].default, bool)
        if flag and value not in ("0", "1"):
            raise ValueError(f"--sm90: {name} takes 0 or 1; got {value!r}")
        out[name] = bool(int(value)) if flag else int(value)
    return out


def report(ctx: core.Context, b, flops: int, cands: list[tuple[str, dict, Any]]) -> list[str]:
    """A line per candidate: each planned and checked against the oracle alone (a call the
    compiler or the launch refuses, or that answers wrong, is listed with why, not fatal), then
    every checked one timed together (`core.Context.time_together`: each repetition times them
    all in turn, so a drifting clock moves them alike and their ratios hold)."""
    lines: dict[str, str] = {}
    timed: list[tuple[str, Any, Any]] = []  # (label, call, the attention launch's kernel)
    for label, kw, _ in cands:
        out = torch.empty_like(b.query)
        try:
            launches = plan_paged_attention(*b.args, out=out, max_query_len=b.max_query_len,
                                            max_seq_len=b.max_seq_len, **kw)  # fmt: skip

            def call(launches=launches):
                return [launch.run() for launch in launches]

            check = ctx.check_once(call, out, lambda out=out: core.check_paged(b, out))
            # compiled by now: the attention launch's registers, spills and MMAs
            (kernel,) = [k for x, k in zip(launches, call(), strict=True) if x.name in MAIN]
        except Exception as err:  # noqa: BLE001 - a refused candidate is a line of the report
            why = f"{type(err).__name__}: {str(err).splitlines()[0]}"
            lines[label] = f"{label:24} failed: {why}"
            if ctx.meaningful:
                torch.cuda.synchronize()
            continue
        if not check["passed"]:
            lines[label] = f"{label:24} wrong: {check}"
            continue
        timed.append((label, call, kernel))
    times = ctx.time_together([call for _, call, _ in timed]) if timed else []
    for (label, _, kernel), (us, _how) in zip(timed, times, strict=True):
        asm = getattr(kernel, "asm", {}) or {}
        lines[label] = (
            f"{label:24} {us:10.1f} µs  {core.rate(flops, us, 1e12):6.1f} TFLOP/s  "
            f"regs {getattr(kernel, 'n_regs', None)} spills {getattr(kernel, 'n_spills', None)}  "
            f"{mma_shapes(asm.get('ptx', ''))}"
        )
    return [lines[label] for label, _, _ in cands]


def changed_config(target, problem: PagedProblem, change: dict) -> PrefillConfig:
    """The policy's sm_90 `PrefillConfig` for ``problem`` with ``change`` (`parse_changes`'s);
    a row the sm_90 kernel does not serve ends the run."""
    cfg = paged_config(target, problem).prefill
    if cfg is None:
        raise SystemExit("the sm_90 prefill kernel does not serve this row")
    return dataclasses.replace(cfg, **change)


def candidates(target, problem: PagedProblem, changes: list[dict]) -> list[tuple[str, dict, Any]]:
    """(label, the call's keyword arguments, the tiles or config) of each candidate, the
    policy's first: with ``changes`` the sm_90 kernel's `PrefillConfig` and each change of it,
    else the portable kernel (``config=PagedConfig()``: the sm_90 kernel may serve the row)
    at the policy's tiles and a grid of others."""
    if changes:
        out = []
        for i, change in enumerate([{}, *changes]):
            label = "policy" if i == 0 else ",".join(f"{k}={int(v)}" for k, v in change.items())
            config = PagedConfig(prefill=changed_config(target, problem, change))
            out.append((label, dict(config=config), config.prefill))
        return out
    policy = paged_tiles(target, problem)
    grid = itertools.product((64, 128), (32, 64), (4, 8), (2, 3))
    cands = [policy] + [
        dataclasses.replace(
            policy,
            block_m=m,
            block_q=m // policy.head_tile,
            block_n=n,
            options=LaunchOptions(w, s),
            decode=None,
        )  # fmt: skip
        for m, n, w, s in grid
    ]
    labels = [
        ("policy " if i == 0 else "")
        + f"m{t.block_m} n{t.block_n} w{t.options.num_warps} s{t.options.num_stages}"
        for i, t in enumerate(cands)
    ]
    return [
        (label, dict(tiles=t, config=PagedConfig()), t)
        for label, t in zip(labels, cands, strict=True)
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.diag.prefill_tiles")
    ap.add_argument("--row", default="prefill 8x4096 32/8/256 bs16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sm90", action="append", default=[], metavar="CHANGES")
    opts = ap.parse_args(argv)
    if opts.reps < 1:
        ap.error(f"--reps must be >= 1; got {opts.reps}")
    try:
        changes = [parse_changes(c) for c in opts.sm90]
    except ValueError as err:
        ap.error(str(err))
    if opts.row not in row_names():
        ap.error(f"--row must be one of {row_names()}; got {opts.row!r}")
    core.require_gpu("bench.diag.prefill_tiles")
    ctx = core.Context("cuda", reps=opts.reps)
    b, flops = _batch(opts.row, "cuda")
    cands = candidates(current_target(), problem_of(b), changes)
    print(f"device: {torch.cuda.get_device_name()}; row {opts.row}; policy {cands[0][2]}; "
          f"{opts.reps} repetitions, the candidates in turn", flush=True)  # fmt: skip
    for line in report(ctx, b, flops, cands):
        print(line)
    return 0


def problem_of(b) -> PagedProblem:
    """The policy's view of a bench batch (`bench.inputs.PagedBatch`)."""
    hq, hkv, d = b.query.shape[1], b.key_cache.shape[2], b.query.shape[2]
    return PagedProblem(hq, hkv, d, b.query.element_size(), b.max_query_len,
                        b.key_cache.shape[1], len(b.seqs), b.max_seq_len)  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
