"""Paged-attention timing on one GPU: correctness first, then medians, with a copy ceiling.

Default run: 32 query heads, 8 KV heads, head_dim 128, bf16, random inputs, for
  * decode: batch 64 at contexts 1k, 4k and 16k,
  * mixed: one 512-token prefill chunk at 8k context plus 63 decode sequences at 4k,
each with block_size 16 and 2048 (the hybrid-model size; the kernel tile must not follow it).

For each point:
1. correctness on the first 3 sequences against the fp64 oracle under the tolerance rule of
   tests/helpers.py (error <= 2x torch's own low-precision error); a failure stops the run;
2. ``triton.testing.do_bench`` medians (CUDA events, L2 flushed) of the planned launch alone
   (``run_all(plan)``: the kernel) and of ``paged_attention(...)`` (validation + planning, which
   read the metadata on the host, + the kernel);
3. bytes the kernel must move (K and V of every context token once per KV head, query, output)
   as effective bandwidth, next to a device-to-device copy ceiling measured in the same run.

Baselines, same shapes, same inputs (the contiguous K/V are gathered from the paged cache, so the
outputs are compared too):
4. torch SDPA: decode with contiguous K/V ``[batch, kv_heads, context, d]``, ``enable_gqa=True``,
   cuDNN backend (falls back to flash, then efficient, and says which ran); mixed: the prefill
   chunk with the flash backend and a lower-right causal mask (``causal_lower_right(512, 8192)``:
   query j sees the first 8192 - 512 + j + 1 positions) plus the 63 decode sequences with flash,
   as two SDPA calls timed together in one function (the sum);
5. the HIP (gfx942) policy's tiles on this GPU (HIP-only launch options dropped): check + time.

``--shuffle`` (issue 18) times instead the SHUFFLE layout next to NHD at the decode points: the
same cache contents converted with `layout.from_logical`, each checked against the oracle first,
under this GPU's policy and under the gfx942 policy forced, with the SHUFFLE / NHD kernel-time
ratio per point (goal: <= 1.1 everywhere); ``--rounds R`` times every launch of a point R times
in turns and keeps the medians. A few minutes on an H100; writes
``$OUT/bench_paged_shuffle.json``.

Usage::

    python bench/bench_paged.py                  # the default table
    python bench/bench_paged.py --dtype fp16
    python bench/bench_paged.py --shuffle        # SHUFFLE vs NHD at the decode points
    OUT=/tmp/out python bench/bench_paged.py     # also writes $OUT/bench_paged.json
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from _common import git_commit, plan_with_target, save_record, set_switch, turn_order
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from triton.testing import do_bench

from portattn import reference
from portattn.kernels._launch import run_all
from portattn.kernels.paged_attention import paged_attention, plan_paged_attention
from portattn.layout import from_logical
from portattn.platform import current_target
from portattn.policy import paged as paged_policy

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
HQ, HKV, D = 32, 8, 128
# name -> ((seq_len, q_len), ...)
SCENARIOS = {
    "decode 64x1k": ((1024, 1),) * 64,
    "decode 64x4k": ((4096, 1),) * 64,
    "decode 64x16k": ((16384, 1),) * 64,
    "mixed 512@8k + 63x4k": ((8192, 512),) + ((4096, 1),) * 63,
}
BLOCK_SIZES = (16, 2048)


def set_heads(spec: str) -> None:
    """``--heads HQ:HKV``: the query and KV head counts every point of this run uses."""
    global HQ, HKV
    try:
        hq, hkv = (int(x) for x in spec.split(":"))
        if hq < 1 or hkv < 1 or hq % hkv:
            raise ValueError(spec)
    except ValueError:
        raise SystemExit(
            f"--heads: want HQ:HKV, positive, HQ a multiple of HKV; got {spec!r}"
        ) from None
    HQ, HKV = hq, hkv


def make_inputs(seqs, block_size, dtype, seed=0, device="cuda", shuffle=True):
    """Random ``(query, key_cache, value_cache, block_table, seq_lens, query_start_loc)`` for
    ``seqs`` (``(seq_len, q_len)`` each) in NHD caches of ``block_size``, blocks a random
    permutation (``shuffle=False``: in order, each sequence's pages one contiguous run);
    ``device="cpu"`` for CPU tests (the kernels under ``TRITON_INTERPRET=1``)."""
    g = torch.Generator(device=device).manual_seed(seed)
    nblk = [-(-s // block_size) for s, _ in seqs]
    num_blocks = sum(nblk)
    shape = (num_blocks, block_size, HKV, D)
    k = torch.randn(shape, device=device, dtype=dtype, generator=g)
    v = torch.randn(shape, device=device, dtype=dtype, generator=g)
    # (drawn either way: the query after it comes from the same generator state)
    perm = torch.randperm(num_blocks, device=device, generator=g).to(torch.int32)
    if not shuffle:
        perm = torch.arange(num_blocks, device=device, dtype=torch.int32)
    table = torch.full((len(seqs), max(nblk)), -1, dtype=torch.int32, device=device)
    first = 0
    for i, n in enumerate(nblk):
        table[i, :n] = perm[first : first + n]
        first += n
    q_lens = torch.tensor([q for _, q in seqs], dtype=torch.int32)
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    qsl[1:] = q_lens.cumsum(0)
    query = torch.randn(int(qsl[-1]), HQ, D, device=device, dtype=dtype, generator=g)
    seq_lens = torch.tensor([s for s, _ in seqs], dtype=torch.int32, device=device)
    return query, k, v, table, seq_lens, qsl.to(device)


def check(args, n=3):
    """Tolerance rule on the first ``n`` sequences."""
    q, k, v, table, seq_lens, qsl = args
    end = int(qsl[n])
    sub = (q[:end], k, v, table[:n], seq_lens[:n], qsl[: n + 1])
    out = paged_attention(*sub).double().cpu()
    oracle = reference.paged_attention(*sub)
    lowp = reference.paged_attention(*sub, compute_dtype=q.dtype)
    rel = lambda x: float((x.double() - oracle).norm() / oracle.norm())  # noqa: E731
    e_kernel, e_torch = rel(out), rel(lowp)
    if not (torch.isfinite(out).all() and e_kernel <= 2 * e_torch):
        raise SystemExit(f"correctness: kernel error {e_kernel:.3e} > 2 x torch {e_torch:.3e}")
    return e_kernel, e_torch


def contiguous_kv(cache, table, seq_lens, i0, i1):
    """Sequences ``i0 .. i1-1`` (equal lengths) as contiguous ``[n, kv_heads, ctx, d]``."""
    n = int(seq_lens[i0])
    bs = cache.shape[1]
    nb = -(-n // bs)
    x = cache[table[i0:i1, :nb].long()]  # [seqs, nb, bs, kv_heads, d]
    return x.reshape(i1 - i0, nb * bs, HKV, D)[:, :n].transpose(1, 2).contiguous()


def sdpa_run(backends, q, k, v, mask=None):
    """Run SDPA with the first backend of ``backends`` that accepts the shapes.

    Returns ``(backend name, output, fn)``; ``fn`` re-enters the same backend on every call.
    """
    errors = []
    group = q.shape[1] // k.shape[1]
    # GQA first; then K/V heads expanded (a backend that refuses enable_gqa with this mask)
    for expand in (False, True):
        ke, ve = (x.repeat_interleave(group, dim=1) for x in (k, v)) if expand else (k, v)
        for b in backends:

            def fn(b=b, ke=ke, ve=ve):
                with sdpa_kernel(b):
                    return F.scaled_dot_product_attention(
                        q, ke, ve, attn_mask=mask, enable_gqa=True
                    )

            try:
                out = fn()
                if out.is_cuda:
                    torch.cuda.synchronize()
                return b.name + (" (kv expanded)" if expand else ""), out, fn
            except RuntimeError as e:
                errors.append(f"{b.name}: {str(e).splitlines()[0][:80]}")
    print("sdpa: no backend ran: " + "; ".join(errors))
    return None


def sdpa_baseline(name, seqs, args, kernel_out):
    """Torch SDPA on the same work; ``(us, backends, rel diff vs the kernel)``."""
    q, k, v, table, seq_lens, qsl = args
    first_backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                      SDPBackend.EFFICIENT_ATTENTION]  # fmt: skip
    if seqs[0][1] == 1:  # decode: one call over the batch
        kc, vc = (contiguous_kv(c, table, seq_lens, 0, len(seqs)) for c in (k, v))
        qd = q.view(len(seqs), HQ, 1, D)
        got = sdpa_run(first_backends, qd, kc, vc)
        if got is None:
            return None
        used, out, fn = got
        outs = [out.reshape(len(seqs), HQ, D)]
        fns = [fn]
        names = [used]
    else:  # mixed: the prefill chunk (lower-right causal) + the decode sequences, two calls
        flash = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
        s0, q0 = seqs[0]
        kp, vp = (contiguous_kv(c, table, seq_lens, 0, 1) for c in (k, v))
        qp = q[:q0].transpose(0, 1).unsqueeze(0)  # [1, HQ, q0, D]
        got_p = sdpa_run(flash, qp, kp, vp, causal_lower_right(q0, s0))
        kd, vd = (contiguous_kv(c, table, seq_lens, 1, len(seqs)) for c in (k, v))
        qd = q[q0:].view(len(seqs) - 1, HQ, 1, D)
        got_d = sdpa_run(flash, qd, kd, vd)
        if got_p is None or got_d is None:
            return None
        (used_p, out_p, fn_p), (used_d, out_d, fn_d) = got_p, got_d
        outs = [out_p[0].transpose(0, 1), out_d.reshape(len(seqs) - 1, HQ, D)]
        fns = [fn_p, fn_d]
        names = [f"prefill {used_p}", f"decode {used_d}"]
    ref = torch.cat(outs).double()
    diff = float((kernel_out.double() - ref).norm() / ref.norm())
    if not ref.is_cuda:  # a CPU self-check of the baseline's maths: no timing
        return float("nan"), " + ".join(names), diff
    ms = do_bench(lambda: [f() for f in fns])
    return ms * 1e3, " + ".join(names), diff


def check_plan(plan_fn, args, n=3, layout="NHD"):
    """Tolerance rule on the first ``n`` sequences for launches from ``plan_fn(*sub)``."""
    q, k, v, table, seq_lens, qsl = args
    end = int(qsl[n])
    sub = (q[:end], k, v, table[:n], seq_lens[:n], qsl[: n + 1])
    launches = plan_fn(*sub, layout=layout)
    run_all(launches)
    out = launches[0].outputs[0].double().cpu()
    oracle = reference.paged_attention(*sub, layout=layout)
    lowp = reference.paged_attention(*sub, compute_dtype=q.dtype, layout=layout)
    rel = lambda x: float((x.double() - oracle).norm() / oracle.norm())  # noqa: E731
    e_kernel, e_torch = rel(out), rel(lowp)
    ok = bool(torch.isfinite(out).all()) and e_kernel <= 2 * e_torch
    return ok, e_kernel, e_torch


def hip_plan(*args, **kwargs):
    return plan_with_target("gfx942", plan_paged_attention, *args, **kwargs)


def to_shuffle(args):
    """``args`` (NHD caches) with the same cache contents in the SHUFFLE layout."""
    q, k, v, table, seq_lens, qsl = args
    ks = from_logical(k, "SHUFFLE", "key")
    vs = from_logical(v, "SHUFFLE", "value")
    return q, ks, vs, table, seq_lens, qsl


def _tiles(plan):
    a, o = plan[0].args, plan[0].options
    return (a["BLOCK_M"], a["BLOCK_N"], o.num_warps, o.num_stages, a["NUM_SPLITS"])


def shuffle_variant_plans(args, spec: str):
    """``plan_paged_attention`` of ``args`` (a SHUFFLE cache) at this GPU's policy tiles with
    ``spec`` = ``N,stages,warps,splits[,maxnreg]`` in place of theirs (``--shuffle-variants``;
    ``maxnreg``: a CUDA register cap, `LaunchOptions.maxnreg`)."""
    import dataclasses

    from sweep_paged import _tiles_of

    from portattn.platform import current_target
    from portattn.policy.common import launch_options

    try:
        fields = [int(x) for x in spec.split(",")]
        if len(fields) not in (4, 5):
            raise ValueError(spec)
    except ValueError:
        raise SystemExit(
            f"--shuffle-variants: want N,stages,warps,splits[,maxnreg]; got {spec!r}"
        ) from None
    n, stages, warps, splits = fields[:4]
    maxnreg = fields[4] if len(fields) == 5 else None
    base = _tiles_of(plan_paged_attention(*args, layout="SHUFFLE"))
    tiles = dataclasses.replace(
        base, block_n=n, num_splits=splits,
        options=launch_options(current_target(), warps, stages, maxnreg),
    )  # fmt: skip

    def plan_fn(*a, **kw):
        return plan_paged_attention(*a, tiles=tiles, **kw)

    return plan_fn


def _timed_in_turns(plans: dict, rounds: int) -> dict[str, list[float]]:
    """``do_bench`` µs of each plan, ``rounds`` times in turns (A B C, B C A, C A B, ...: the
    order rotated each round, `turn_order`): a drift of the clock, a one-off slow timing or a
    place in the round falls on every plan alike and shows in its list."""
    times: dict[str, list[float]] = {k: [] for k in plans}
    keys = list(plans)
    for rnd in range(rounds):
        for i in turn_order(len(keys), rnd):
            plan = plans[keys[i]]
            times[keys[i]].append(do_bench(lambda plan=plan: run_all(plan)) * 1e3)
    return times


def shuffle_main(dtype, arch, variants=(), rounds: int = 1) -> None:
    """SHUFFLE vs NHD at the decode points (``--shuffle``; module docstring); ``variants``
    (``N,stages,warps,splits[,maxnreg]``) add SHUFFLE rows at other tiles of this GPU's policy,
    each against the policy's NHD time. Every launch is checked first; then, per point, all of
    them are timed ``rounds`` times in turns and each keeps its median (``--rounds``)."""
    import statistics

    policies = {arch: plan_paged_attention, "gfx942": hip_plan}
    print(
        f"{'scenario':16} {'bs':>5} {'policy':>7} {'tiles NHD (M,N,w,s,splits)':>27} "
        f"{'tiles SHUFFLE':>19} {'NHD us':>8} {'SHUF us':>8} {'ratio':>6} {'err/torch':>10}"
    )
    rows, variant_rows = [], []
    for name, seqs in SCENARIOS.items():
        if seqs[0][1] != 1:
            continue  # decode points only
        for bs in BLOCK_SIZES:
            nhd = make_inputs(seqs, bs, dtype)
            shuf = to_shuffle(nhd)
            plans, errs = {}, {}
            for pname, plan_fn in policies.items():
                for layout, args in (("NHD", nhd), ("SHUFFLE", shuf)):
                    ok, e_k, e_t = check_plan(plan_fn, args, layout=layout)
                    if not ok:
                        raise SystemExit(f"correctness: {name} bs {bs} {pname} {layout}: kernel "
                                         f"error {e_k:.3e} > 2 x torch {e_t:.3e}")  # fmt: skip
                    plans[(pname, layout)] = plan_fn(*args, layout=layout)
                    errs[(pname, layout)] = e_k / e_t
            for spec in variants:
                plan_v = shuffle_variant_plans(shuf, spec)
                ok, e_k, e_t = check_plan(plan_v, shuf, layout="SHUFFLE")
                if not ok:
                    raise SystemExit(f"correctness: {name} bs {bs} SHUFFLE variant {spec}: "
                                     f"error {e_k:.3e} > 2 x torch {e_t:.3e}")  # fmt: skip
                plans[("variant", spec)] = plan_v(*shuf, layout="SHUFFLE")
                errs[("variant", spec)] = e_k / e_t
            times = _timed_in_turns(plans, rounds)
            us = {k: statistics.median(v) for k, v in times.items()}
            spread = " ".join(f"{t:.1f}" for t in times[(arch, "SHUFFLE")]) if rounds > 1 else ""
            for pname in policies:
                res = {
                    layout: dict(us=us[(pname, layout)], rounds=times[(pname, layout)],
                                 tiles=_tiles(plans[(pname, layout)]),
                                 err=errs[(pname, layout)])
                    for layout in ("NHD", "SHUFFLE")
                }  # fmt: skip
                ratio = res["SHUFFLE"]["us"] / res["NHD"]["us"]
                flag = "" if ratio <= 1.1 else "  > 1.1"
                print(
                    f"{name:16} {bs:>5} {pname:>7} {str(res['NHD']['tiles']):>27} "
                    f"{str(res['SHUFFLE']['tiles']):>19} {res['NHD']['us']:>8.1f} "
                    f"{res['SHUFFLE']['us']:>8.1f} {ratio:>6.2f} "
                    f"{max(r['err'] for r in res.values()):>10.2f}{flag}"
                    + (f"   rounds {spread}" if pname == arch and spread else "")
                )
                rows.append(dict(scenario=name, block_size=bs, policy=pname, ratio=ratio,
                                 nhd=res["NHD"], shuffle=res["SHUFFLE"]))  # fmt: skip
            nhd_us = us[(arch, "NHD")]
            for spec in variants:
                key = ("variant", spec)
                laps = " ".join(f"{t:.1f}" for t in times[key]) if rounds > 1 else ""
                print(f"{name:16} {bs:>5} {'variant':>7} {spec:>27} {str(_tiles(plans[key])):>19} "
                      f"{'':>8} {us[key]:>8.1f} {us[key] / nhd_us:>6.2f} "
                      f"{errs[key]:>10.2f}" + (f"   rounds {laps}" if laps else ""))  # fmt: skip
                variant_rows.append(dict(scenario=name, block_size=bs, variant=spec, us=us[key],
                                         rounds=times[key], ratio=us[key] / nhd_us,
                                         tiles=_tiles(plans[key])))  # fmt: skip
            del nhd, shuf, plans
            torch.cuda.empty_cache()
    worst = max(rows, key=lambda r: r["ratio"])
    print(f"== worst SHUFFLE / NHD: {worst['ratio']:.2f} ({worst['scenario']}, bs "
          f"{worst['block_size']}, {worst['policy']} policy); goal <= 1.1: "
          f"{'met' if worst['ratio'] <= 1.1 else 'NOT met'}")  # fmt: skip
    dtype_name = str(dtype).removeprefix("torch.")
    save_record("bench_paged_shuffle", arch=arch, dtype=dtype_name, rows=rows,
                variants=variant_rows, rounds=rounds, heads=[HQ, HKV])  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--no-sdpa", action="store_true", help="skip the torch SDPA baselines")
    ap.add_argument("--no-hip", action="store_true", help="skip the gfx942-policy rows")
    ap.add_argument("--shuffle", action="store_true",
                    help="only SHUFFLE vs NHD at the decode points (issue 18)")  # fmt: skip
    ap.add_argument("--shuffle-variants", nargs="*", default=[],
                    metavar="N,STAGES,WARPS,SPLITS[,MAXNREG]",
                    help="with --shuffle: SHUFFLE rows at these tiles too (this GPU's policy "
                         "otherwise)")  # fmt: skip
    ap.add_argument("--heads", default=f"{HQ}:{HKV}", metavar="HQ:HKV",
                    help="query and KV heads (head_dim 128; default %(default)s)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=1,
                    help="with --shuffle: every launch of a point timed this many times in "
                         "turns; the median is kept")  # fmt: skip
    ap.add_argument("--set", action="append", default=[], metavar="SWITCH=0|1",
                    help="set a boolean switch of portattn.policy.paged for the run (an A/B), "
                         "e.g. --set SHUFFLE_LINES=0")  # fmt: skip
    opts = ap.parse_args()
    if opts.rounds < 1:
        raise SystemExit(f"bench_paged: --rounds must be >= 1; got {opts.rounds}")
    set_heads(opts.heads)
    for item in opts.set:
        set_switch(paged_policy, item)
    dtype = DTYPES[opts.dtype]
    target = current_target()
    commit = git_commit()
    if opts.shuffle:
        print(f"# {torch.cuda.get_device_name()} ({target.arch}), {opts.dtype}, commit {commit}, "
              f"SHUFFLE vs NHD, {HQ}/{HKV} heads x {D}")  # fmt: skip
        shuffle_main(dtype, target.arch, opts.shuffle_variants, opts.rounds)
        return
    rows, sdpa_rows, summary = [], [], []
    print(f"# {torch.cuda.get_device_name()} ({target.arch}), {opts.dtype}, commit {commit}, "
          f"torch {torch.__version__}, {HQ}/{HKV} heads x {D}")  # fmt: skip
    print(
        f"{'scenario':24} {'bs':>5} {'tiles (M,Q,H,N,stages)':>24} {'kernel us':>10} "
        f"{'call us':>9} {'GB/s':>7} {'copy GB/s':>9} {'err/torch':>10}"
    )
    for name, seqs in SCENARIOS.items():
        for bs in BLOCK_SIZES:
            args = make_inputs(seqs, bs, dtype)
            e_kernel, e_torch = check(args)
            plan = plan_paged_attention(*args)
            a = plan[0].args
            kernel_ms = do_bench(lambda plan=plan: run_all(plan))
            call_ms = do_bench(lambda args=args: paged_attention(*args))
            elem = torch.empty((), dtype=dtype).element_size()
            ctx = sum(s for s, _ in seqs)
            nbytes = 2 * ctx * HKV * D * elem + 2 * args[0].numel() * elem
            src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            copy_ms = do_bench(lambda src=src, dst=dst: dst.copy_(src))
            gbs, copy_gbs = nbytes / kernel_ms / 1e6, nbytes / copy_ms / 1e6
            tiles = (a["BLOCK_M"], a["BLOCK_Q"], a["HEAD_TILE"], a["BLOCK_N"])
            stages = plan[0].options.num_stages
            print(
                f"{name:24} {bs:>5} {str(tiles + (stages,)):>24} {kernel_ms * 1e3:>10.1f} "
                f"{call_ms * 1e3:>9.1f} {gbs:>7.0f} {copy_gbs:>9.0f} {e_kernel / e_torch:>10.2f}"
            )
            row = dict(
                scenario=name, block_size=bs, tiles=tiles, num_stages=stages,
                kernel_us=kernel_ms * 1e3, call_us=call_ms * 1e3, gbps=gbs, copy_gbps=copy_gbs,
                err_kernel=e_kernel, err_torch=e_torch,
            )  # fmt: skip
            if not opts.no_hip:
                ok, he_k, he_t = check_plan(hip_plan, args)
                hplan = hip_plan(*args)
                ha = hplan[0].args
                htiles = (ha["BLOCK_M"], ha["BLOCK_Q"], ha["HEAD_TILE"], ha["BLOCK_N"])
                hip_ms = do_bench(lambda hplan=hplan: run_all(hplan)) if ok else float("nan")
                hstages = hplan[0].options.num_stages
                print(
                    f"{'  gfx942 policy':24} {bs:>5} {str(htiles + (hstages,)):>24} "
                    f"{hip_ms * 1e3:>10.1f} {'':>9} {nbytes / hip_ms / 1e6:>7.0f} {'':>9} "
                    f"{he_k / he_t:>10.2f}" + ("" if ok else "  CHECK FAILED")
                )
                row.update(hip_ok=ok, hip_tiles=htiles, hip_stages=hstages, hip_us=hip_ms * 1e3,
                           hip_err_kernel=he_k, hip_err_torch=he_t)  # fmt: skip
            if bs == BLOCK_SIZES[0] and not opts.no_sdpa:
                run_all(plan)
                kernel_out = plan[0].outputs[0]
                got = sdpa_baseline(name, seqs, args, kernel_out)
                sdpa_us, backend, diff = got if got else (float("nan"), "none ran", float("nan"))
                print(
                    f"{'  torch SDPA':24} {'-':>5} {'(contiguous K/V)':>24} {sdpa_us:>10.1f} "
                    f"{'':>9} {nbytes / sdpa_us / 1e3:>7.0f}   {backend}; kernel vs sdpa "
                    f"rel diff {diff:.1e}"
                )
                sdpa_rows.append(dict(scenario=name, sdpa_us=sdpa_us, backend=backend,
                                      rel_diff_vs_kernel=diff))  # fmt: skip
            rows.append(row)
            del args
            torch.cuda.empty_cache()
    print("== summary: kernel / SDPA time (< 1 is faster), % of copy ceiling")
    for r in rows:
        base = next((s for s in sdpa_rows if s["scenario"] == r["scenario"]), None)
        ratio = r["kernel_us"] / base["sdpa_us"] if base else float("nan")
        hip = f"gfx942 {r['hip_us']:.1f} us" if "hip_us" in r else ""
        line = (
            f"{r['scenario']:24} bs {r['block_size']:>5}: kernel {r['kernel_us']:8.1f} us "
            f"({100 * r['gbps'] / r['copy_gbps']:5.1f}% copy), SDPA "
            f"{base['sdpa_us'] if base else float('nan'):8.1f} us, ratio {ratio:5.2f}; {hip}"
        )
        print(line)
        summary.append(line)
    save_record("bench_paged", arch=target.arch, dtype=opts.dtype, rows=rows, sdpa=sdpa_rows)


if __name__ == "__main__":
    main()
