"""Prefill throughput of paged_attention (issue 19): checked, then timed, against a roofline.

Points (32 query heads, 8 KV heads, head_dim 128, bf16 or ``--dtype fp16``; inputs from
``bench_paged.make_inputs``: random values, block table a random permutation of the blocks):
  * ``mixed 8x512 + 56x1 @4k``: 64 sequences of 4096 tokens; the first 8 prefill a 512-token
    chunk (their last 512 tokens), the other 56 decode one token (4152 query tokens);
  * ``mixed 8x2048 + 56x1 @4k``: the same with 2048-token chunks;
  * ``prefill 8x4096``: 8 sequences, q_len == seq_len == 4096 (pure causal prefill);
each at block sizes 16, 544 (a hybrid model's block size, not a power of two) and 2048.

For each point and each variant (``VARIANTS``: the live device's policy, plus one per ``--target``):
1. correctness first: the public op ``paged_attention(..., max_query_len=, max_seq_len=)`` (the
   maxima given: no host read, what a serving engine calls) on the whole batch; its output on a
   subset of rows against the fp64 oracle (`portattn.reference.paged_attention`, on the CPU)
   under the tolerance rule of tests/helpers.py (error <= 2x torch's own low-precision error). The
   subset: 128-row windows (``--check-rows``) of the prefill sequences (first and last rows of the
   first one, last rows of the last one) and the first and last decode sequences; a window of rows
   ``a .. a+w`` of a sequence is a sequence of its own with ``q_len w`` and ``seq_len`` cut after
   its last row (the same causal limits), so the oracle costs seconds. A failure stops the run;
2. times: ``do_bench_cudagraph`` median of the call captured in a CUDA graph (the serving case) and
   ``do_bench`` median of the eager call (host planning included: cached plan, no host read);
3. roofline (issue 19): prefill flops / bf16 matmul rate + decode bytes / copy rate, both
   ceilings measured in this run (`_common.matmul_rate`, `_common.copy_ceiling`; with
   ``--rounds N`` the matmul rate also before each round, and each row gets a second ratio at
   the rounds' median rate, ``x_roof_turns``). Prefill flops =
   ``4 * num_q_heads * head_dim * pairs`` over the sequences with ``q_len > 1``, ``pairs`` the
   causal (query, key) pairs ``sum_j (ctx_len + j + 1)``; decode bytes = K + V of every context
   token per KV head + query + output, per decode sequence. Reported: time / roofline and the
   effective TFLOP/s of the prefill part (prefill flops / graph time; goal for pure prefill:
   >= 450), and per scenario and variant the spread max/min of the graph times over the block
   sizes (goal: <= 1.05).

``--target gfx942`` (or ``gfx950``, repeatable) adds that target's policy, forced on this GPU
(``paged_attention(target=get_target(arch))``: the tiles are that target's, `Launch.run` leaves
out the HIP-only launch options): checked and timed like the live policy. Another variant (a
kernel switch, say) is one more entry of the dict `variants` returns: a name and the keyword
arguments it adds to the call.

Usage::

    python bench/bench_prefill.py                         # every point, the live policy
    python bench/bench_prefill.py --points prefill --target gfx942 --target gfx950
    python bench/bench_prefill.py --dtype fp16
    python bench/bench_prefill.py --points part --blocks 16,2048   # other block sizes
    python bench/bench_prefill.py --ordered-pages         # each sequence's pages in order
    OUT=/tmp/out python bench/bench_prefill.py            # also writes $OUT/bench_prefill.json
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import numpy as np
import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    copy_ceiling,
    git_commit,
    matmul_rate,
    save_record,
    switched,
    turn_order,
)
from bench_paged import HKV, HQ, D, make_inputs  # noqa: E402

from portattn import reference  # noqa: E402
from portattn.kernels.paged_attention import paged_attention, plan_paged_attention  # noqa: E402
from portattn.platform import get_target  # noqa: E402
from portattn.policy import paged as paged_policy  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PREFILL_GOAL_TFLOPS = 450.0  # issue 19: pure prefill, effective
SPREAD_GOAL = 1.05  # issue 19: block sizes 16 / 544 / 2048 within 5% of each other
CHECK_ROWS = 128  # rows per checked window of a prefill sequence


def mixed(n_prefill: int, chunk: int, n_decode: int, ctx: int) -> tuple[tuple[int, int], ...]:
    """``n_prefill`` sequences prefilling the last ``chunk`` of ``ctx`` tokens, then ``n_decode``
    decoding one token at ``ctx``: ``((seq_len, q_len), ...)``."""
    return ((ctx, chunk),) * n_prefill + ((ctx, 1),) * n_decode


def prefill(n: int, ctx: int) -> tuple[tuple[int, int], ...]:
    """``n`` pure causal prefills of ``ctx`` tokens (q_len == seq_len)."""
    return ((ctx, ctx),) * n


# name -> ((seq_len, q_len), ...), block sizes
POINTS = {
    "mixed 8x512 + 56x1 @4k": (mixed(8, 512, 56, 4096), (16, 544, 2048)),
    "mixed 8x2048 + 56x1 @4k": (mixed(8, 2048, 56, 4096), (16, 544, 2048)),
    "prefill 8x4096": (prefill(8, 4096), (16, 544, 2048)),
    # the mixed 8x2048 point's two parts alone (where its time goes; not goals of issue 19)
    "part: chunks 8x2048 @4k": (mixed(8, 2048, 0, 4096), (2048,)),
    "part: decodes 56x1 @4k": (mixed(0, 2048, 56, 4096), (2048,)),
}
#: Points run unless --points names them (the parts above)
DEFAULT_POINTS = tuple(n for n in POINTS if not n.startswith("part:"))


def parse_blocks(text: str, prog: str = "bench_prefill") -> tuple[int, ...]:
    """``--blocks``: comma-separated positive block sizes (``""``: none, each point's own);
    anything else stops the script ``prog``, naming the option."""
    parts = text.split(",") if text else []
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        sys.exit(f"{prog}: --blocks must be positive integers; got {text!r}")
    return tuple(int(p) for p in parts)


def metadata(seqs) -> tuple[list[int], list[int], list[int]]:
    """``(q_lens, seq_lens, query_start_loc)`` of ``seqs`` as lists (what make_inputs builds)."""
    q_lens = [q for _, q in seqs]
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    return q_lens, [s for s, _ in seqs], qsl


def causal_pairs(seq_len: int, q_len: int) -> int:
    """(query, key) pairs a sequence attends: query ``j`` sees ``seq_len - q_len + j + 1`` keys."""
    ctx = seq_len - q_len
    return q_len * ctx + q_len * (q_len + 1) // 2


def prefill_flops(seqs, num_q_heads: int = HQ, head_dim: int = D) -> int:
    """QK^T + PV flops (2 each per pair, head and dim) of the sequences with ``q_len > 1``."""
    return sum(4 * num_q_heads * head_dim * causal_pairs(s, q) for s, q in seqs if q > 1)


def decode_bytes(
    seqs, elem: int, num_q_heads: int = HQ, num_kv_heads: int = HKV, head_dim: int = D
) -> int:
    """Bytes the decode sequences (``q_len == 1``) must move: K and V of every context token per
    KV head, read once, plus the query and output rows."""
    kv = sum(2 * s * num_kv_heads * head_dim * elem for s, q in seqs if q == 1)
    n_dec = sum(1 for _, q in seqs if q == 1)
    return kv + n_dec * 2 * num_q_heads * head_dim * elem


def roofline_us(flops: int, nbytes: int, tflops: float, gbps: float) -> float:
    """Issue 19's roofline: flops at the matmul rate plus bytes at the copy rate, in us."""
    return flops / (tflops * 1e12) * 1e6 + nbytes / (gbps * 1e9) * 1e6


def check_windows(seqs, rows: int = CHECK_ROWS) -> list[tuple[int, int, int]]:
    """Checked rows as ``(sequence, first row, width)``: the first and last ``rows`` rows of the
    first prefill sequence, the last ``rows`` of the last one, the first and last decode."""
    pre = [i for i, (_, q) in enumerate(seqs) if q > 1]
    dec = [i for i, (_, q) in enumerate(seqs) if q == 1]
    out: list[tuple[int, int, int]] = []
    if pre:
        first, last = pre[0], pre[-1]
        q0 = seqs[first][1]
        w = min(rows, q0)
        out.append((first, 0, w))
        if q0 > w:
            out.append((first, q0 - w, w))
        if last != first:
            q1 = seqs[last][1]
            out.append((last, q1 - min(rows, q1), min(rows, q1)))
    out += [(i, 0, 1) for i in sorted({*dec[:1], *dec[-1:]})]
    return out


def window_batch(seqs, windows) -> tuple[list[int], list[int], list[int], list[int]]:
    """The checked windows as a batch of their own: ``(query rows of the full batch, sequence of
    each window, seq_lens, query_start_loc)``. Rows ``a .. a+w`` of a sequence ``(S, Q)`` keep
    their causal limits as a sequence ``(S - Q + a + w, w)``."""
    _, _, qsl = metadata(seqs)
    rows, idx, sl, sub_qsl = [], [], [], [0]
    for i, a, w in windows:
        s, q = seqs[i]
        if not (a >= 0 and w >= 1 and a + w <= q):
            raise ValueError(f"window_batch: rows {a}..{a + w} outside sequence {i}'s q_len {q}")
        rows += range(qsl[i] + a, qsl[i] + a + w)
        idx.append(i)
        sl.append(s - q + a + w)
        sub_qsl.append(sub_qsl[-1] + w)
    return rows, idx, sl, sub_qsl


class Oracle:
    """The fp64 oracle and torch's low-precision result on the checked rows of one input set."""

    def __init__(self, seqs, args, rows: int = CHECK_ROWS):
        q, k, v, table, _, _ = args
        dev = q.device
        r, idx, sl, sub_qsl = window_batch(seqs, check_windows(seqs, rows))
        self.rows = torch.tensor(r, device=dev)
        sub = (
            q[self.rows],
            k,
            v,
            table[torch.tensor(idx, device=dev)],
            torch.tensor(sl, dtype=torch.int32, device=dev),
            torch.tensor(sub_qsl, dtype=torch.int32, device=dev),
        )
        self.oracle = reference.paged_attention(*sub)
        self.e_torch = self.rel(reference.paged_attention(*sub, compute_dtype=q.dtype))

    def rel(self, x: torch.Tensor) -> float:
        x = x.double().cpu()
        return float((x - self.oracle).norm() / self.oracle.norm())

    def check(self, out: torch.Tensor) -> tuple[bool, float]:
        """``(passed, kernel error)`` of the full batch's output ``out`` on the checked rows."""
        got = out[self.rows]
        e = self.rel(got)
        return bool(torch.isfinite(got).all()) and e <= 2 * self.e_torch, e


def variants(targets, portable: bool = False, schedules: bool = False) -> dict[str, dict]:
    """Variant name -> keyword arguments added to the `paged_attention` call; upper-case keys
    (not call arguments) set that switch of `portattn.policy.paged` for the variant (plan cache
    emptied around it: the switches are not in a plan's key)."""
    out: dict[str, dict] = {"policy": {}}
    if schedules:  # the sm_90 kernel's schedules and depth (kernels/paged_prefill_sm90.py)
        # the policy's own launch again: a control, its ratio to "policy" is the run's noise
        # between variants in turns (`against_policy`)
        out["policy again"] = {}
        # the tile before the sixteenth session: sequential at 2 stages (late release at 2-4
        # boxes a tile); the variants about that loop's switches run on it
        seq = dict(paged_policy.SM90_PREFILL_TILES)
        seq[128] = paged_policy.Sm90PrefillTile(block_n=128, stages=2)
        three = dict(paged_policy.SM90_PREFILL_TILES)
        three[128] = paged_policy.Sm90PrefillTile(block_n=128, stages=3)
        out["3 stages"] = dict(SM90_PREFILL_TILES=three)
        wide = dict(paged_policy.SM90_PREFILL_TILES)
        wide[128] = paged_policy.Sm90PrefillTile(block_n=64, stages=4, warpgroups=3)
        out["3 warpgroups"] = dict(SM90_PREFILL_TILES=wide)
        out["overlap"] = dict(SM90_PREFILL_OVERLAP=True, SM90_PREFILL_PINGPONG=False,
                              SM90_PREFILL_TILES=seq)  # fmt: skip
        out["overlap+pingpong"] = dict(SM90_PREFILL_OVERLAP=True, SM90_PREFILL_PINGPONG=True,
                                       SM90_PREFILL_TILES=seq)  # fmt: skip
        # turns in the sequential loop (P V of tile t and the scores of t+1 in one turn), at 2
        # stages
        out["pingpong"] = dict(SM90_PREFILL_OVERLAP=False, SM90_PREFILL_PINGPONG=True,
                               SM90_PREFILL_TILES=seq)  # fmt: skip
        # ... with a third stage (the query loaded by the warpgroups), and with the query by TMA
        # (the sixteenth session's policy at head_dim 128, spelled out)
        out["pingpong 3 stages"] = dict(SM90_PREFILL_OVERLAP=False, SM90_PREFILL_PINGPONG=True,
                                        SM90_PREFILL_Q_TMA=False,
                                        SM90_PREFILL_TILES=three)  # fmt: skip
        out["q tma+pingpong 3 stages"] = dict(SM90_PREFILL_Q_TMA=True, SM90_PREFILL_OVERLAP=False,
                                              SM90_PREFILL_PINGPONG=True,
                                              SM90_PREFILL_TILES=three)  # fmt: skip
        out["sequential"] = dict(SM90_PREFILL_TILES=seq)
        # each warpgroup's next item taken before its epilogue (prepared, off)
        out["item ahead"] = dict(SM90_PREFILL_ITEM_AHEAD=True)
        # K buffers freed at the scores, K copied a tile ahead of V (turns only)
        out["k ahead"] = dict(SM90_PREFILL_K_AHEAD=True)
        # the producer's page lookup: a division a box everywhere (`paging` off)
        out["paging off"] = dict(SM90_PREFILL_PAGING=False)
        out["overlap+pingpong 3 stages"] = dict(SM90_PREFILL_OVERLAP=True,
                                                SM90_PREFILL_PINGPONG=True,
                                                SM90_PREFILL_TILES=three)  # fmt: skip
        # the decode sequences of a mixed batch in a launch of their own after the sm_90 kernel
        out["decode launch"] = dict(SM90_PREFILL_FUSE_DECODE=False)
        # ... fused (the default), each split over both warpgroups by keys, not on warpgroup 0
        # (on the sequential tile: the split's merge buffer does not fit beside 3 stages)
        out["fused split"] = dict(SM90_PREFILL_FUSE_DECODE=True, SM90_PREFILL_SPLIT_SHORT=True,
                                  SM90_PREFILL_TILES=seq)  # fmt: skip
        out["fused 3 stages"] = dict(SM90_PREFILL_FUSE_DECODE=True, SM90_PREFILL_TILES=three)
        # V in two copies a page box (the switch off), or in one at every box count (2+ boxes)
        out["v pages off"] = dict(SM90_PREFILL_V_PAGES=False)
        # the policy's two stages wherever the late release would take three
        # (both on the sequential tile, the only one it applies to)
        out["late release off"] = dict(SM90_PREFILL_LATE_RELEASE_BOXES=(), SM90_PREFILL_TILES=seq)
        # ... and at every box count (1 box: block 2048; 8 boxes: block 16)
        out["late release all"] = dict(SM90_PREFILL_LATE_RELEASE_BOXES=(1, 2, 4, 8),
                                       SM90_PREFILL_TILES=seq)  # fmt: skip
        # the softmax's exponentials: that many of every 4 by the polynomial (0: all on the MUFU)
        for k in range(5):
            out[f"exp2 poly {k}"] = dict(SM90_PREFILL_EXP2_POLY=k)
        # the lazy running max, rescales skipped at factor 1 (the switch on), and off
        out["lazy rescale"] = dict(SM90_PREFILL_LAZY_RESCALE=True)
        out["eager rescale"] = dict(SM90_PREFILL_LAZY_RESCALE=False)
        # the row maxima and sums as trees (halves combined first), and as gl.max / gl.sum's chains
        out["tree reduce"] = dict(SM90_PREFILL_TREE_REDUCE=True)
        out["chain reduce"] = dict(SM90_PREFILL_TREE_REDUCE=False)
        # items taken from a counter as programs free up, or dealt when the launch starts
        out["dynamic deal"] = dict(SM90_PREFILL_DYNAMIC=True)
        out["static deal"] = dict(SM90_PREFILL_DYNAMIC=False)
        out["before"] = dict(SM90_PREFILL_V_PAGES=False, SM90_PREFILL_LATE_RELEASE_BOXES=(),
                             SM90_PREFILL_TILES=seq)  # fmt: skip
        out["v pages 2+"] = dict(SM90_PREFILL_V_PAGES=True, SM90_PREFILL_V_PAGES_MIN_BOXES=2)
        out["v pages 4+"] = dict(SM90_PREFILL_V_PAGES=True, SM90_PREFILL_V_PAGES_MIN_BOXES=4)
        # half-width tiles in twice the stages (the same bytes in flight, released and refilled
        # 64 keys at a time; V as one copy a page box at 4 boxes: block 16)
        half = dict(paged_policy.SM90_PREFILL_TILES)
        half[128] = paged_policy.Sm90PrefillTile(block_n=64, stages=6, pingpong=True)
        out["n64 6 stages"] = dict(SM90_PREFILL_TILES=half, SM90_PREFILL_V_PAGES_MIN_BOXES=4)
        # 3 stages, each released later in the next tile (Sm90PrefillTile.release_lag)
        for lag in (1, 2):
            late = dict(paged_policy.SM90_PREFILL_TILES)
            late[128] = paged_policy.Sm90PrefillTile(block_n=128, stages=3, release_lag=lag)
            out[f"release {lag}"] = dict(SM90_PREFILL_TILES=late)
    if portable:
        out["portable"] = dict(SM90_PREFILL=False)
    for arch in targets:
        out[f"{arch} policy"] = dict(target=get_target(arch))
    return out


def describe_plan(args, call_kwargs) -> str:
    """``plan_paged_attention``'s launches for the same call: kernel, grid, main tiles."""
    plan = plan_paged_attention(*args, **call_kwargs)
    parts = []
    for launch in plan:
        a = launch.args
        tiles = "/".join(
            str(a[k]) for k in ("BLOCK_M", "BLOCK_Q", "HEAD_TILE", "BLOCK_N") if k in a
        )
        name = getattr(launch.kernel, "__name__", type(launch.kernel).__name__)
        parts.append(
            f"{name.strip('_')} grid {launch.grid[0]} M/Q/H/N {tiles} "
            f"w{launch.options.num_warps} s{launch.options.num_stages}"
        )
    return "; ".join(parts)


def bench_point(name, seqs, bs, dtype, var, ceilings, check_rows, rounds=1,
                shuffle=True) -> list[dict]:  # fmt: skip
    """Check, then time every variant at one point; returns the rows (stops on a failed check).
    ``rounds`` > 1: the graph timing is repeated that many times over all variants in turn
    (A B C, then rotated: B C A, C A B, ...: `turn_order`), and a row's ``graph_us`` is the
    median of its rounds (``graph_rounds``, in round order):
    clock and power drift during a run then falls on every variant alike. The matmul ceiling is
    measured again before each round (``mm_rounds``, the point's), and each row also gets its
    ratio to the roofline at the median of those (``x_roof_turns``): the run's one ceiling is
    taken at its start, on a card not yet warm from the timings that follow. ``shuffle=False``:
    each sequence's pages in order (a diagnostic: the block table's scatter against its
    absence)."""
    copy_gbs, mm_tflops = ceilings
    args = make_inputs(seqs, bs, dtype, shuffle=shuffle)
    t0 = time.time()
    oracle = Oracle(seqs, args, check_rows)
    oracle_s = time.time() - t0
    mql, msl = max(q for _, q in seqs), max(s for s, _ in seqs)
    elem = torch.finfo(dtype).bits // 8
    flops, nbytes = prefill_flops(seqs), decode_bytes(seqs, elem)
    roof = roofline_us(flops, nbytes, mm_tflops, copy_gbs)
    rows, calls = [], []
    mm_rounds = []
    for rnd in range(rounds):
        if rounds > 1:
            mm_rounds.append(matmul_rate()[0])
        items = list(var.items())
        # round 0 checks and times in the variants' order; later rounds rotate it (`turn_order`)
        for i in turn_order(len(items), rnd) if rnd else range(len(items)):
            vname, extra = items[i]
            switches = {k: v for k, v in extra.items() if k.isupper()}
            extra = {k: v for k, v in extra.items() if not k.isupper()}
            with switched(paged_policy, switches):
                if rnd == 0:
                    row, call = _bench_variant(name, seqs, bs, dtype, args, oracle, oracle_s,
                                               vname, extra, mql, msl, flops, nbytes,
                                               roof)  # fmt: skip
                    row["graph_rounds"] = [row["graph_us"]]
                    rows.append(row)
                    calls.append(call)
                else:  # the same call again (planned anew under the same switches), timed only
                    rows[i]["graph_rounds"].append(
                        do_bench_cudagraph(calls[i], return_mode="median") * 1e3
                    )
    if rounds > 1:
        mm_turns = float(np.median(mm_rounds))
        roof_turns = roofline_us(flops, nbytes, mm_turns, copy_gbs)
        print(f"  matmul ceiling in turns: median {mm_turns:.0f} TFLOP/s of "
              f"{[round(x) for x in mm_rounds]} (the run's: {mm_tflops:.0f})")  # fmt: skip
        for row in rows:
            row["graph_us"] = float(np.median(row["graph_rounds"]))
            row["x_roof"] = row["graph_us"] / roof
            row["prefill_tflops"] = flops / (row["graph_us"] * 1e-6) / 1e12
            row["mm_rounds"] = mm_rounds
            row["roofline_turns_us"] = roof_turns
            row["x_roof_turns"] = row["graph_us"] / roof_turns
            lo = min(row["graph_rounds"])
            spread = max(row["graph_rounds"]) / lo
            print(f"  {row['variant']}: median of {rounds} rounds {row['graph_us']:.1f} us, "
                  f"min {lo:.1f} (rounds max/min {spread:.3f}); x roof {row['x_roof']:.3f}, "
                  f"{row['x_roof_turns']:.3f} at the ceiling in turns")  # fmt: skip
    del args, oracle
    torch.cuda.empty_cache()
    return rows


def _bench_variant(name, seqs, bs, dtype, args, oracle, oracle_s, vname, extra, mql, msl, flops,
                   nbytes, roof) -> tuple[dict, functools.partial]:  # fmt: skip
    """One variant at one point: checked, then timed (graph and eager medians); its row and
    the call (`bench_point`'s later rounds time it again)."""
    out = torch.empty_like(args[0])
    kw = dict(max_query_len=mql, max_seq_len=msl, out=out, **extra)
    call = functools.partial(paged_attention, *args, **kw)
    out.normal_()  # stale values must not pass the check
    call()
    ok, e_kernel = oracle.check(out)
    if not ok:
        raise SystemExit(
            f"correctness: {name} block {bs} {vname}: kernel error {e_kernel:.3e} > 2 x "
            f"torch {str(dtype).removeprefix('torch.')} error {oracle.e_torch:.3e} (or "
            f"non-finite) on {len(oracle.rows)} checked rows; the run stops here"
        )
    graph_us = do_bench_cudagraph(call, return_mode="median") * 1e3
    eager_us = do_bench(call, return_mode="median") * 1e3
    row = dict(
        scenario=name, block_size=bs, variant=vname, graph_us=graph_us, eager_us=eager_us,
        roofline_us=roof, x_roof=graph_us / roof, prefill_flops=flops, decode_bytes=nbytes,
        prefill_tflops=flops / (graph_us * 1e-6) / 1e12, err_kernel=e_kernel,
        err_torch=oracle.e_torch, checked_rows=len(oracle.rows), oracle_s=oracle_s,
        plan=describe_plan(args, {k: v for k, v in kw.items() if k != "out"}),
    )  # fmt: skip
    print(fmt_row(row))
    print(f"  {len(oracle.rows)} rows checked (oracle {oracle_s:.1f} s); plan: {row['plan']}")
    return row, call


HEADER = (
    f"{'scenario':24} {'bs':>5} {'variant':>14} {'graph us':>9} {'eager us':>9} {'roof us':>8} "
    f"{'x roof':>6} {'pf TF/s':>7} {'err/torch':>9}"
)


def fmt_row(r: dict) -> str:
    return (
        f"{r['scenario']:24} {r['block_size']:>5} {r['variant']:>14} {r['graph_us']:9.1f} "
        f"{r['eager_us']:9.1f} {r['roofline_us']:8.1f} {r['x_roof']:6.2f} "
        f"{r['prefill_tflops']:7.0f} {r['err_kernel'] / r['err_torch']:9.2f}"
    )


def spreads(rows) -> list[dict]:
    """Per scenario and variant: max / min of the graph times over the block sizes."""
    out = []
    for key in dict.fromkeys((r["scenario"], r["variant"]) for r in rows):
        pick = [r for r in rows if (r["scenario"], r["variant"]) == key]
        if len(pick) < 2:
            continue
        t = [r["graph_us"] for r in pick]
        out.append(dict(scenario=key[0], variant=key[1], spread=max(t) / min(t),
                        block_sizes=[r["block_size"] for r in pick]))  # fmt: skip
    return out


def against_policy(rows) -> list[dict]:
    """Per scenario and block size: each other variant's graph time over the policy's (< 1:
    faster), in the rows' order; "policy again" (`variants`) is the control."""
    base = {(r["scenario"], r["block_size"]): r["graph_us"] for r in rows
            if r["variant"] == "policy"}  # fmt: skip
    out = []
    for r in rows:
        key = (r["scenario"], r["block_size"])
        if r["variant"] != "policy" and key in base:
            out.append(dict(scenario=key[0], block_size=key[1], variant=r["variant"],
                            ratio=r["graph_us"] / base[key]))  # fmt: skip
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--points", default="", help="comma-separated substrings of point names")
    ap.add_argument("--schedules", action="store_true",
                    help="also the sm_90 kernel's other tiles and schedules")  # fmt: skip
    ap.add_argument("--portable", action="store_true",
                    help="also the portable kernel alone (SM90_PREFILL off) on sm_90")  # fmt: skip
    ap.add_argument("--target", action="append", default=[], choices=["gfx942", "gfx950"],
                    help="also that target's policy, forced on this GPU (repeatable)")  # fmt: skip
    ap.add_argument("--variants", default="",
                    help="comma-separated variant names to keep (default: all)")  # fmt: skip
    ap.add_argument("--check-rows", type=int, default=CHECK_ROWS,
                    help="rows per checked window of a prefill sequence")  # fmt: skip
    ap.add_argument(
        "--blocks",
        default="",
        help="comma-separated block sizes every point runs at (default: its own)",
    )
    ap.add_argument(
        "--ordered-pages",
        action="store_true",
        help="each sequence's pages in order, not a random permutation (diagnostic)",
    )
    ap.add_argument("--rounds", type=int, default=1,
                    help="graph timings a variant, in turns; the median is kept")  # fmt: skip
    opts = ap.parse_args(argv)
    if opts.rounds < 1:
        sys.exit(f"bench_prefill: --rounds must be >= 1; got {opts.rounds}")
    blocks = parse_blocks(opts.blocks)
    if not torch.cuda.is_available():
        sys.exit("bench_prefill: needs a CUDA/HIP device")
    dtype = DTYPES[opts.dtype]
    if opts.points:
        wanted = opts.points.split(",")
        points = {n: p for n, p in POINTS.items() if any(s in n for s in wanted)}
    else:
        points = {n: POINTS[n] for n in DEFAULT_POINTS}
    if not points:
        sys.exit(f"bench_prefill: --points {opts.points!r} matches none of {list(POINTS)}")
    if blocks:
        points = {n: (seqs, blocks) for n, (seqs, _) in points.items()}
    var = variants(opts.target, opts.portable, opts.schedules)
    if opts.variants:
        keep = opts.variants.split(",")
        unknown = sorted(set(keep) - set(var))
        if unknown:
            sys.exit(f"bench_prefill: --variants {unknown} not among {list(var)}")
        var = {k: v for k, v in var.items() if k in keep}
    elem = torch.finfo(dtype).bits // 8
    # the copy as large as the largest decode part (at least 256 MB: pure prefill has none)
    copy_gbs, copy_ms = copy_ceiling(
        max([1 << 28] + [decode_bytes(s, elem) for s, _ in points.values()])
    )
    mm_tflops, mm_ms = matmul_rate()
    device = torch.cuda.get_device_name()
    head = (
        f"device: {device}, {opts.dtype}, {HQ}q/{HKV}kv heads, d{D}, commit {git_commit()}, "
        f"torch {torch.__version__}, triton {triton.__version__}"
    )
    ceil = (
        f"copy ceiling {copy_gbs:.0f} GB/s ({copy_ms:.3f} ms); "
        f"bf16 mm 8192^3 {mm_tflops:.0f} TFLOP/s ({mm_ms:.3f} ms)"
    )
    print(head)
    print(ceil)
    print(f"{'scenario':24} {'tokens':>6} {'prefill GFLOP':>13} {'decode MB':>9} {'roof us':>8}")
    for name, (seqs, _) in points.items():
        f, b = prefill_flops(seqs), decode_bytes(seqs, elem)
        print(f"{name:24} {sum(q for _, q in seqs):>6} {f / 1e9:13.1f} {b / 1e6:9.1f} "
              f"{roofline_us(f, b, mm_tflops, copy_gbs):8.1f}")  # fmt: skip
    print(HEADER)
    rows: list[dict] = []
    t0 = time.time()
    for name, (seqs, block_sizes) in points.items():
        for bs in block_sizes:
            rows += bench_point(name, seqs, bs, dtype, var, (copy_gbs, mm_tflops), opts.check_rows,
                                opts.rounds, not opts.ordered_pages)  # fmt: skip
    spread = spreads(rows)
    print(f"== summary ({time.time() - t0:.0f} s; every row checked against the fp64 oracle first)")
    print(head)
    print(ceil)
    print(HEADER)
    for r in rows:
        print(fmt_row(r))
    for r in rows:
        if "x_roof_turns" in r:
            print(f"{r['scenario']} bs {r['block_size']} {r['variant']}: x roof "
                  f"{r['x_roof']:.3f} at the run's ceiling, {r['x_roof_turns']:.3f} at the "
                  f"ceiling in turns ({r['roofline_turns_us']:.1f} us)")  # fmt: skip
    for a in against_policy(rows):
        print(
            f"{a['scenario']} bs {a['block_size']} {a['variant']}: {a['ratio']:.3f} x policy"
            + (" (control: the policy again)" if a["variant"] == "policy again" else "")
        )
    for s in spread:
        ok = "met" if s["spread"] <= SPREAD_GOAL else "NOT met"
        print(f"block sizes {s['block_sizes']} {s['scenario']:24} {s['variant']:>14}: max/min "
              f"{s['spread']:.3f} (goal <= {SPREAD_GOAL}: {ok})")  # fmt: skip
    for r in rows:
        if r["scenario"].startswith("prefill"):
            ok = "met" if r["prefill_tflops"] >= PREFILL_GOAL_TFLOPS else "NOT met"
            print(f"pure prefill {r['scenario']} bs {r['block_size']} {r['variant']}: "
                  f"{r['prefill_tflops']:.0f} TFLOP/s effective (goal >= "
                  f"{PREFILL_GOAL_TFLOPS:.0f}: {ok})")  # fmt: skip
    if opts.ordered_pages:
        print("(pages in order: --ordered-pages, a diagnostic; the goals take random pages)")
    save_record("bench_prefill", dtype=opts.dtype, copy_gb_per_s=copy_gbs, mm_tflops=mm_tflops,
                pages="ordered" if opts.ordered_pages else "random",
                rows=rows, spreads=spread)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
