"""Which packed HIP MLA tile scales best with the verification length, on whatever GPU runs it.

For each HIP policy (``--archs``) and each candidate packed tile (``--tiles``: rows x KV tile,
warps, stages, e.g. ``32x16w8s1``), MLA 576/512 at ``--heads`` heads, ``--batch`` sequences of
``--context`` tokens on 64-token pages is planned with that tile (the split count by the policy's
rule for it) at each ``--q-lens`` length, checked on two sequences against the fp64 oracle, and
timed as the suite times a row (`bench.core.Context.time_us`). q_len 1 always runs the policy's
own (unpacked) tile. Printed: µs per length and each length over q_len 1. The policy's own
packed tile is the candidate ``policy``. A candidate the policy's budgets would refuse still runs
(what it costs is the question); whether it compiles clean for the AMD target is the compile
matrix's answer, not this one's.

Usage (GPU machine, repository root)::

    PYTHONPATH=src python3 -m bench.diag.mla_hip_tiles --archs gfx942,gfx950 \
        --tiles policy,32x16w8s1,32x16w8s2,64x16w8s2

Numbers are diagnostics: the HIP tiles compiled for this GPU, not an AMD GPU's speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys

import torch

from bench import core, inputs, mla
from portattn.compile.__main__ import at_least  # the argparse rule, shared
from portattn.kernels._launch import run_all
from portattn.kernels.mla_decode import plan_mla_decode
from portattn.platform import TARGETS, get_target
from portattn.policy.common import launch_options
from portattn.policy.mla import (
    PROGRAMS_PER_SM,
    MlaProblem,
    mla_decode_tiles,
    mla_hip_packed_lds_bytes,
    mla_num_kv_splits,
)

TILE = re.compile(r"^(\d+)x(\d+)w(\d+)s(\d+)(?:p(\d+))?$")


def parse_tile(text: str) -> tuple[int, int, int, int, int] | None:
    """``"32x16w8s1"`` -> ``(rows, block_n, warps, stages, programs_per_sm)``; a ``pK`` suffix
    sizes the split count for K programs a CU (default the policy's); ``"policy"`` -> None.

    Raises:
        ValueError: any other text (naming the form).
    """
    if text == "policy":
        return None
    m = TILE.match(text)
    if not m:
        raise ValueError(f"--tiles: {text!r} is not ROWSxBLOCK_NwWARPSsSTAGES[pK] (32x16w4s2p4)")
    rows, n, w, s = (int(g) for g in m.groups()[:4])
    return rows, n, w, s, int(m.group(5) or PROGRAMS_PER_SM)


def tiles_for(arch: str, heads: int, q_len: int, batch: int, context: int, tile):
    """The policy's tiles for the problem, or ``tile`` packed in their place (splits by the
    policy's rule for that many programs)."""
    target = get_target(arch)
    problem = MlaProblem(heads, mla.DK, mla.RANK, 2, batch * q_len, context, q_len)
    base = mla_decode_tiles(target, problem)
    if tile is None or q_len == 1:
        return base
    rows, n, w, s, per_sm = tile
    groups = -(-(q_len * heads) // rows)
    return dataclasses.replace(
        base,
        block_h=rows,
        padded_heads=-(-heads // rows) * rows,
        block_n=n,
        options=launch_options(target, w, s),
        smem_bytes=mla_hip_packed_lds_bytes(rows, n, base.block_dv, base.block_dpe, 2),
        num_kv_splits=mla_num_kv_splits(target, batch, groups, context, per_sm),
        packed=True,
        prefetch_rows=False,
        tma=False,
        sm90_kernel=False,
    )


def measure(ctx, arch, heads, q_len, batch, context, tile) -> tuple[float | None, str]:
    b = inputs.mla_batch(batch=batch, context=context, heads=heads, head_dim_k=mla.DK, page=64,
                         q_len=q_len, dtype=mla.DTYPE, device=ctx.device)  # fmt: skip
    tiles = tiles_for(arch, heads, q_len, batch, context, tile)
    out = torch.empty(b.query.shape[0], heads, mla.RANK, dtype=mla.DTYPE, device=ctx.device)
    scale = mla.DK**-0.5
    launches = plan_mla_decode(b.query, b.kv_cache, b.block_table, b.seq_lens,
                               kv_lora_rank=mla.RANK, scale=scale,
                               query_start_loc=b.query_start_loc, out=out,
                               target=get_target(arch), tiles=tiles)  # fmt: skip
    check, us, _ = ctx.checked_time_us(
        lambda: run_all(launches), out, lambda: mla._check(b, out, scale)
    )
    label = f"{tiles.block_h}x{tiles.block_n}w{tiles.options.num_warps}s{tiles.options.num_stages}"
    label += f" splits {tiles.num_kv_splits}"
    if not check["passed"]:
        label += f" WRONG ({check.get('detail', '')})"
    return us, label


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default="gfx942,gfx950")
    ap.add_argument("--tiles", default="policy")
    ap.add_argument("--q-lens", default="1,2,4,8")
    ap.add_argument("--heads", type=at_least(1), default=16)
    ap.add_argument("--batch", type=at_least(1), default=64)
    ap.add_argument("--context", type=at_least(1), default=4096)
    opts = ap.parse_args(argv)
    try:
        tiles = [(t, parse_tile(t)) for t in opts.tiles.split(",")]
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    hip = [a for a, t in TARGETS.items() if t.vendor == "hip"]
    archs = opts.archs.split(",")
    if not set(archs) <= set(hip):
        ap.error(f"--archs must be comma-separated HIP targets of {hip}; got {opts.archs!r}")
    q_texts = opts.q_lens.split(",")
    if not all(q.isascii() and q.isdigit() and int(q) >= 1 for q in q_texts):
        ap.error(f"--q-lens must be comma-separated ints >= 1; got {opts.q_lens!r}")
    q_lens = [int(q) for q in q_texts]
    if all(q == 1 for q in q_lens):  # one token a sequence always takes the policy's tile
        ap.error(
            f"--q-lens must hold a length > 1 (q_len 1 runs no --tiles tile); got {opts.q_lens!r}"
        )
    core.require_gpu("bench.diag.mla_hip_tiles")
    ctx = core.Context(device="cuda")
    for arch in archs:
        base_us, base_label = measure(ctx, arch, opts.heads, 1, opts.batch, opts.context, None)
        print(f"{arch} q1 policy {base_label}: {base_us} µs", flush=True)
        for name, tile in tiles:
            parts = []
            for q in q_lens:
                if q == 1:
                    continue
                us, label = measure(ctx, arch, opts.heads, q, opts.batch, opts.context, tile)
                ratio = "-" if us is None or base_us is None else f"{us / base_us:.2f}x"
                parts.append(f"q{q} {us and round(us, 1)} µs {ratio} [{label}]")
            print(f"{arch} {name}: " + "; ".join(parts), flush=True)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
