"""Host time per call of the serving-path ops (issue 18): what an engine pays in Python per layer.

Each op is called the way a serving engine calls it outside a CUDA graph, at tiny shapes so the
GPU is never the bottleneck:

  * ``paged_attention`` with ``max_query_len`` (and ``max_seq_len``) given: 4 decode sequences,
    32/8 heads x 128, bf16, block 16, 64-token contexts;
  * ``mla_decode`` with ``metadata`` (576/512, 16 heads, page 64, 4 sequences x 256 tokens);
  * ``write_kv_cache``: 4 tokens, 8 heads x 128;
  * ``gather_kv_cache`` with ``out`` given: 4 sequences x 64 tokens.

Method: each op's output is checked first (against ``portattn.reference`` in fp64 / exactly for
the copies). Then, per op and per mode, ``--calls`` (300) back-to-back eager calls are timed on
the host clock (``time.perf_counter`` around the loop, no synchronization inside it; the GPU
work per call is a few microseconds, so the launch queue never fills), then one synchronize;
``--repeats`` (7) such loops, the median per-call time reported; the modes' loops alternate, so
a drift of the host's speed hits both; Python's garbage collector is off inside the loops, as
``timeit`` does. Modes, in the same process:
``cached`` (the plan cache, the default) and ``uncached`` (``PLANS.enabled = False``: validate,
plan and launch through ``JITFunction.run`` on every call, the behaviour before the cache); for
``paged_attention`` and ``mla_decode`` also ``cached`` with the direct launch's switches off
(`_plans.POINTER_INTS`: tensors handed to Triton's C launcher as tensors; `_plans.DIRECT`: every
launch through `CompiledKernel.run`, TMA descriptors encoded on every launch). The GPU
time of one call (``do_bench_cudagraph`` median) is printed next to each op, to show the host
loop is not waiting on the GPU. The goal is judged on ``cached, alone``: the cached call's
loops timed by themselves, 300 calls back to back as issue 18 measured them (in the interleaved
group each cached loop follows other modes' loops). The floor is an empty Triton kernel with 4
arguments launched through ``JITFunction.run``: it shows how fast this host runs Python (it
varied 13-22 us between machines of the same kind), so compare ops with it only within one run.

Usage::

    python bench/bench_host.py [--calls 300] [--repeats 7] [--profile] [--breakdown]
    OUT=/tmp/out python bench/bench_host.py     # also writes $OUT/bench_host.json
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import math
import pstats
import statistics
import sys
import time

import torch
import triton
import triton.language as tl
from _common import git_commit, save_record

from portattn import reference
from portattn.kernels import _plans
from portattn.kernels._plans import PLANS, call_key
from portattn.kernels.kv_cache import gather_kv_cache, write_kv_cache
from portattn.kernels.mla_decode import _metadata_key, mla_decode
from portattn.kernels.paged_attention import paged_attention
from portattn.mla_metadata import MlaMetadataBuilder
from portattn.platform import current_target, override_key

GOAL_US = 25.0


@triton.jit
def _empty_kernel(a_ptr, b_ptr, n, m, BLOCK: tl.constexpr):
    pass


def paged_parts(args, ctx: int):
    """A decode call of `paged_attention` on ``args`` (its six tensors; maxima 1 and ``ctx``) and
    its cache parts as the op builds them: ``(call, key, inputs, guarded)`` (`stages`)."""

    def call():
        return paged_attention(*args, max_query_len=1, max_seq_len=ctx)

    inputs = (*args, None)

    def key():
        return call_key("paged_attention", *inputs, None, "NHD", None, 1, ctx)

    def guarded():  # as paged_attention's probe: its scalars, then its tensors
        scalars = ("paged_attention", _plans._current_device(), override_key(), True,
                   type(None), None, str, "NHD", int, 1, int, ctx)  # fmt: skip
        return PLANS.guarded(scalars, args)

    return call, key, inputs, guarded


def mla_parts(q, cache, table, sl, md, r: int, scale: float):
    """An `mla_decode` call with metadata ``md`` and its cache parts as the op builds them:
    ``(call, key, inputs, guarded)`` (`stages`)."""

    def call():
        return mla_decode(q, cache, table, sl, kv_lora_rank=r, scale=scale, metadata=md)

    _, part_out, part_lse = _metadata_key(md)  # None, None with one split: not read
    inputs = (q, cache, table, sl, None, None, None, None, part_out, part_lse)

    def key():  # as mla_decode's: the metadata's part, then the call's
        exact, po, pl = _metadata_key(md)
        return call_key(
            "mla_decode", q, cache, table, sl, None, None, None, None, po, pl, r, scale, False,
            True, None, exact=exact,
        )  # fmt: skip

    def guarded():  # as mla_decode's probe
        exact = _metadata_key(md)[0]
        mask, tensors = _plans.present(inputs)
        scalars = ("mla_decode", _plans._current_device(), override_key(), exact, mask, int, r,
                   float, scale, bool, False, True)  # fmt: skip
        return PLANS.guarded(scalars, tensors)

    return call, key, inputs, guarded


def _paged():
    g = torch.Generator().manual_seed(0)
    seqs, hq, hkv, d, bs, ctx = 4, 32, 8, 128, 16, 64
    nb = seqs * ctx // bs
    kc = torch.randn(nb, bs, hkv, d, generator=g).bfloat16().cuda()
    vc = torch.randn(nb, bs, hkv, d, generator=g).bfloat16().cuda()
    q = torch.randn(seqs, hq, d, generator=g).bfloat16().cuda()
    table = torch.randperm(nb, generator=g).view(seqs, -1).int().cuda()
    sl = torch.full((seqs,), ctx, dtype=torch.int32, device="cuda")
    qsl = torch.arange(seqs + 1, dtype=torch.int32, device="cuda")
    args = (q, kc, vc, table, sl, qsl)
    call, key, inputs, guarded = paged_parts(args, ctx)

    def check():
        ref = reference.paged_attention(*(t.cpu() for t in args))
        torch.testing.assert_close(call().double().cpu(), ref, rtol=2e-2, atol=2e-2)

    call.stages = stages(call, key, inputs, guarded)
    call.guarded = guarded
    return call, check


def _mla():
    g = torch.Generator().manual_seed(0)
    seqs, heads, dk, r, bs, ctx = 4, 16, 576, 512, 64, 256
    nb = seqs * ctx // bs
    cache = torch.randn(nb, bs, dk, generator=g).bfloat16().cuda()
    q = torch.randn(seqs, heads, dk, generator=g).bfloat16().cuda()
    table = torch.randperm(nb, generator=g).view(seqs, -1).int().cuda()
    sl = torch.full((seqs,), ctx, dtype=torch.int32, device="cuda")
    builder = MlaMetadataBuilder(
        current_target(), max_batch=seqs, num_heads=heads, kv_lora_rank=r, head_dim_k=dk,
        dtype=torch.bfloat16, device="cuda", max_seq_len=ctx,
    )  # fmt: skip
    md = builder.build(sl)
    scale = 1 / math.sqrt(dk)
    call, key, inputs, guarded = mla_parts(q, cache, table, sl, md, r, scale)
    call.stages = stages(call, key, inputs, guarded)
    call.guarded = guarded

    def check():
        ref, _ = reference.mla_decode(
            q.cpu(), cache.cpu(), table.cpu(), sl.cpu(), kv_lora_rank=r, scale=scale
        )
        torch.testing.assert_close(call().double().cpu(), ref, rtol=2e-2, atol=2e-2)

    return call, check


def stages(call, key, inputs, guarded=None):
    """Parts of a cached call, each timed alone (``--breakdown``): the key, the cache lookup,
    `Plan.bind_launch` (buffers and the argument lists `Plan.run` launches with), the buffers
    alone (`Plan._allocate`, the plan looked up once) and the whole replay (bind + launches);
    with ``guarded`` (the op's `PlanCache.guarded` call, as its probe makes it) also the
    probe's part before the replay (the scalars, the tensors' C guards and alignment, the
    lookup), which on a hit stands in for key + lookup. bench_host_cpu.py times the same
    parts."""

    def plan():
        return PLANS._plans[key()]

    found = []

    def kept():  # the plan, looked up once
        if not found:
            found.append(plan())
        return found[0]

    parts = {
        "the op's call": call,
        "key": key,
        "key + lookup": lambda: PLANS._plans.get(key()),
        "bind": lambda: plan().bind_launch(inputs),
        "buffers alone": lambda: kept()._allocate(),
        "key + lookup + bind + launch": lambda: plan().run(inputs),
    }
    if guarded is not None:
        parts["probe: guards + lookup"] = guarded
        parts["probe + bind + launch"] = lambda: guarded().run(inputs)
    return parts


def _switched_off(call, switch: str):
    """``call`` with the plan cache's module switch ``switch`` (``DIRECT``, ``POINTER_INTS``)
    off."""

    def run():
        setattr(_plans, switch, False)
        try:
            return call()
        finally:
            setattr(_plans, switch, True)

    return run


def _write():
    g = torch.Generator().manual_seed(0)
    kc = torch.zeros(64, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    vc = torch.zeros_like(kc)
    k = torch.randn(4, 8, 128, generator=g).bfloat16().cuda()
    v = torch.randn(4, 8, 128, generator=g).bfloat16().cuda()
    slots = torch.randperm(1024, generator=g)[:4].cuda()

    def call():
        return write_kv_cache(k, v, kc, vc, slots)

    def check():
        call()
        rk, rv = kc.cpu().zero_(), vc.cpu().zero_()
        reference.write_kv_cache(k.cpu(), v.cpu(), rk, rv, slots.cpu())
        assert torch.equal(kc.cpu(), rk) and torch.equal(vc.cpu(), rv)

    return call, check


def _gather():
    g = torch.Generator().manual_seed(0)
    seqs, ctx, bs = 4, 64, 16
    nb = seqs * ctx // bs
    kc = torch.randn(nb, bs, 8, 128, generator=g).bfloat16().cuda()
    vc = torch.randn(nb, bs, 8, 128, generator=g).bfloat16().cuda()
    table = torch.randperm(nb, generator=g).view(seqs, -1).int().cuda()
    cu = (torch.arange(seqs + 1, dtype=torch.int32) * ctx).cuda()
    out = tuple(torch.empty(seqs * ctx, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in "kv")

    def call():
        return gather_kv_cache(kc, vc, table, cu, out=out)

    def check():
        k, v = call()
        rk, rv = reference.gather_kv_cache(kc.cpu(), vc.cpu(), table.cpu(), cu.cpu())
        assert torch.equal(k.cpu(), rk) and torch.equal(v.cpu(), rv)

    return call, check


def _floor():
    a = torch.empty(16, device="cuda")

    def call():
        _empty_kernel[(1,)](a, a, 16, 16, BLOCK=16)

    return call, lambda: None


OPS = {
    "paged_attention": _paged,
    "mla_decode": _mla,
    "write_kv_cache": _write,
    "gather_kv_cache": _gather,
    "triton empty kernel (floor)": _floor,
}


def host_us(call, calls: int, repeats: int) -> float:
    """Median over ``repeats`` loops of the host time per call (module docstring)."""
    return host_us_modes({"": call}, calls, repeats)[""]


def host_us_modes(modes: dict, calls: int, repeats: int) -> dict[str, float]:
    """`host_us` for several callables, their loops interleaved (a drift of the host's speed
    during the run hits every mode alike). A mode's name ``uncached`` runs with the plan cache
    off."""
    per: dict[str, list[float]] = {name: [] for name in modes}
    gc.collect()
    gc.disable()  # as timeit does: a collection inside one loop is noise, not per-call cost
    try:
        return _interleaved(modes, calls, repeats, per)
    finally:
        gc.enable()


def _interleaved(modes: dict, calls: int, repeats: int, per: dict) -> dict[str, float]:
    for name, call in modes.items():
        PLANS.enabled = name != "uncached"
        for _ in range(20):
            call()
    torch.cuda.synchronize()
    for _ in range(repeats):
        for name, call in modes.items():
            PLANS.enabled = name != "uncached"
            t0 = time.perf_counter()
            for _ in range(calls):
                call()
            per[name].append((time.perf_counter() - t0) / calls * 1e6)
            torch.cuda.synchronize()
    PLANS.enabled = True
    return {name: statistics.median(v) for name, v in per.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--profile", action="store_true", help="cProfile 300 cached calls per op")
    ap.add_argument("--breakdown", action="store_true", help="time the parts of a cached call")
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, commit {git_commit()}, "
          f"torch {torch.__version__}, triton {triton.__version__}")  # fmt: skip
    rows = []
    for name, make in OPS.items():
        call, check = make()
        PLANS.enabled = True
        check()  # correct first (through the cache: a miss, then hits below)
        check()
        PLANS.enabled = False
        check()
        PLANS.enabled = True
        modes = {"cached": call, "uncached": call}
        if name in ("paged_attention", "mla_decode"):  # the direct launch's shares
            modes["cached, tensors passed as tensors"] = _switched_off(call, "POINTER_INTS")
            modes["cached, through CompiledKernel.run"] = _switched_off(call, "DIRECT")
        times = host_us_modes(modes, args.calls, args.repeats)
        cached, uncached = times["cached"], times["uncached"]
        # the method: back-to-back cached calls with no other mode's loops in between
        # (an uncached loop between two cached ones leaves the next cached loop slower)
        alone = host_us(call, args.calls, args.repeats)
        gpu = triton.testing.do_bench_cudagraph(call, return_mode="median") * 1e3
        row = dict(op=name, cached_us=round(cached, 2), uncached_us=round(uncached, 2))
        row["cached_alone_us"] = round(alone, 2)
        row.update(gpu_us=round(gpu, 2), modes_us={k: round(v, 2) for k, v in times.items()})
        print(f"{name:30s} cached {cached:7.1f} us   uncached {uncached:7.1f} us   "
              f"(GPU time per call in a CUDA graph: {gpu:.1f} us)", flush=True)  # fmt: skip
        print(f"    {'cached, alone':34s} {alone:7.1f} us", flush=True)
        for mode, us in times.items():
            if mode not in ("cached", "uncached"):
                print(f"    {mode:34s} {us:7.1f} us", flush=True)
        if args.breakdown and hasattr(call, "stages"):
            parts = dict(call.stages)
            if call.guarded() is None:  # GUARDS off, or a torch without TensorGuards
                print("    (no guarded plan: the calls build their keys; probe stages left out)")
                parts = {k: v for k, v in parts.items() if not k.startswith("probe")}
            stages = host_us_modes(parts, args.calls, args.repeats)
            row["stages_us"] = {k: round(v, 2) for k, v in stages.items()}
            for stage, us in stages.items():
                print(f"    {stage:34s} {us:7.1f} us", flush=True)
        rows.append(row)
        if args.profile and name in ("paged_attention", "mla_decode"):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(300):
                call()
            prof.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(12)
            print(s.getvalue())
    print(f"== summary (goal: <= {GOAL_US:.0f} us per call, cached calls back to back)")
    for r in rows:
        met = "  met" if r["cached_alone_us"] <= GOAL_US else "  MISSED"
        verdict = "" if "floor" in r["op"] else met
        print(f"{r['op']:30s} {r['cached_alone_us']:7.1f} us alone, {r['cached_us']:.1f} "
              f"interleaved (uncached {r['uncached_us']:.1f}){verdict}")  # fmt: skip
    save_record("bench_host", calls=args.calls, repeats=args.repeats, goal_us=GOAL_US, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
