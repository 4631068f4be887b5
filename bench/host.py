"""Host time per call: what a serving engine pays in Python for each op outside a CUDA graph.

Tiny shapes (the GPU is never the bottleneck): ``paged_attention`` decode (4 sequences x 64
tokens, 32/8 x 128, block 16), ``mla_decode`` (4 x 256 tokens, 16 heads, 576/512, page 64),
``write_kv_cache`` (4 tokens) and ``gather_kv_cache`` (4 x 64 tokens), bf16. Modes:

* ``cached``: the call with its bounds (``max_query_len``/``max_seq_len``, ``metadata``,
  ``out``): a plan-cache hit after the first call;
* ``unbounded``: no bounds, so the op checks the metadata's values on every call (on the device,
  then one copy and one wait; `portattn.kernels.metadata_summary`; `gather_kv_cache` reads them
  on the host);
* ``uncached``: the bounded call with the plan cache off (``PORTATTN_PLAN_CACHE=0``, read at
  import: timed in a child process): validate, plan and launch every call.

Method: ``CALLS`` back-to-back calls timed on the host clock (no sync inside the loop), one
synchronize after; median of ``REPEATS`` such loops; the garbage collector off inside them.
Each op's output is checked first. The anchor is an empty Triton kernel launched through
``JITFunction.run`` in the same process: how fast this host runs Python.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import triton
import triton.language as tl

import portattn
from bench import core, inputs

FAMILY = "host"
DTYPE = torch.bfloat16
CALLS, REPEATS = 300, 7


@triton.jit
def _empty_kernel(a_ptr, b_ptr, n, m, BLOCK: tl.constexpr):
    pass


def _ops(device: str) -> dict:
    """op -> (mode -> call, check): the calls of each mode and the op's correctness check, which
    takes a mode's call (each mode's output is checked: they run different host paths)."""
    from portattn import reference
    from portattn.mla_metadata import MlaMetadataBuilder
    from portattn.platform import current_target

    ops = {}
    b = inputs.paged_batch(((64, 1),) * 4, num_q_heads=32, num_kv_heads=8, head_dim=128,
                           block_size=16, dtype=DTYPE, device=device)  # fmt: skip
    out = torch.empty_like(b.query)

    def paged_check(call):
        out.zero_()
        return core.check_paged(b, call())

    ops["paged_attention"] = ({
        "cached": lambda: portattn.paged_attention(*b.args, out=out, max_query_len=1,
                                                   max_seq_len=64),
        "unbounded": lambda: portattn.paged_attention(*b.args, out=out),
    }, paged_check)  # fmt: skip

    m = inputs.mla_batch(batch=4, context=256, heads=16, head_dim_k=576, page=64, q_len=1,
                         dtype=DTYPE, device=device)  # fmt: skip
    md = MlaMetadataBuilder(current_target(), max_batch=4, num_heads=16, kv_lora_rank=512,
                            head_dim_k=576, dtype=DTYPE, device=device,
                            max_seq_len=256).build(m.seq_lens)  # fmt: skip
    mla_out = torch.empty(4, 16, 512, dtype=DTYPE, device=device)
    mla_args = (m.query, m.kv_cache, m.block_table, m.seq_lens)
    kw = dict(kv_lora_rank=512, scale=576**-0.5, out=mla_out)

    def mla_check(call):
        mla_out.zero_()
        got = call()
        oracle, _ = reference.mla_decode(*mla_args, kv_lora_rank=512, scale=576**-0.5)
        lowp, _ = reference.mla_decode(*mla_args, kv_lora_rank=512, scale=576**-0.5,
                                       compute_dtype=DTYPE)  # fmt: skip
        return core.tolerance_check(got, oracle, lowp)

    ops["mla_decode"] = ({
        "cached": lambda: portattn.mla_decode(*mla_args, metadata=md, **kw),
        "unbounded": lambda: portattn.mla_decode(*mla_args, **kw),
    }, mla_check)  # fmt: skip

    w = inputs.write_case(tokens=4, num_slots=1024, block_size=16, num_kv_heads=8, head_dim=128,
                          dtype=DTYPE, device=device)  # fmt: skip

    def write_check(call):
        want_k, want_v = w[2].clone(), w[3].clone()
        reference.write_kv_cache(*w[:2], want_k, want_v, w[4])
        call()
        return core.exact_check([(w[2], want_k), (w[3], want_v)])

    ops["write_kv_cache"] = ({"cached": lambda: portattn.write_kv_cache(*w)}, write_check)

    kc, vc, table, cu, gout = inputs.gather_case(seqs=4, context=64, block_size=16,
                                                 num_kv_heads=8, head_dim=128, dtype=DTYPE,
                                                 device=device)  # fmt: skip

    def gather_check(call):
        for t in gout:
            t.zero_()
        got = call()
        want = reference.gather_kv_cache(kc, vc, table, cu)
        return core.exact_check(list(zip(got, want, strict=True)))

    ops["gather_kv_cache"] = ({
        "cached": lambda: portattn.gather_kv_cache(kc, vc, table, cu, out=gout),
        "unbounded": lambda: portattn.gather_kv_cache(kc, vc, table, cu),
    }, gather_check)  # fmt: skip
    return ops


def host_us(call, calls: int, repeats: int) -> float:
    """Median over ``repeats`` loops of the host µs per call (module docstring)."""
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    per = []
    gc.collect()
    gc.disable()  # as timeit does: a collection inside one loop is noise, not per-call cost
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                call()
            per.append((time.perf_counter() - t0) / calls * 1e6)
            torch.cuda.synchronize()
    finally:
        gc.enable()
    return statistics.median(per)


def _uncached(quick: bool) -> dict[str, dict] | str:
    """The ``cached`` calls in a child process with ``PORTATTN_PLAN_CACHE=0``: for each op its
    check there (``check``) and host µs (``us``, None when the check failed), or why the child
    failed."""
    import portattn as pkg

    src = os.path.dirname(os.path.dirname(pkg.__file__))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join([src, root, os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PORTATTN_PLAN_CACHE="0", PYTHONPATH=path)
    cmd = [sys.executable, "-m", "bench.host", "--uncached"] + (["--quick"] if quick else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        return f"child failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


#: The ops `_ops` times, and the modes each is timed in.
OPS = ("paged_attention", "mla_decode")
MODES = ("cached", "unbounded", "uncached")


def names(quick: bool) -> list[str]:
    """The rows' names, without running them (``--rows`` is checked against these)."""
    return [f"host {op} {mode}" for op in OPS for mode in MODES]


def rows(ctx: core.Context):
    calls, repeats = (30, 3) if ctx.quick else (CALLS, REPEATS)
    a = torch.empty(16, device=ctx.device)
    floor_us = host_us(lambda: _empty_kernel[(1,)](a, a, 16, 16, BLOCK=16), calls, repeats)
    floor = core.anchor("Triton empty kernel launch", floor_us, note="JITFunction.run, 4 args")
    uncached = _uncached(ctx.quick)
    for op, (modes, check_fn) in _ops(ctx.device).items():
        for mode in MODES:
            name = f"host {op} {mode}"
            if not ctx.want(name) or (mode != "uncached" and mode not in modes):
                continue
            params = dict(op=op, mode=mode, calls=calls, repeats=repeats)
            if mode == "uncached":  # checked and timed in the child, with the plan cache off
                if isinstance(uncached, str):
                    check = core.not_checked(f"the child failed: {uncached}")
                    yield core.row(FAMILY, name, params, check, None, {}, [],
                                   f"not timed: {uncached}")  # fmt: skip
                    continue
                check, us = uncached[op]["check"], uncached[op]["us"]
            else:
                check = check_fn(modes[mode])
                us = host_us(modes[mode], calls, repeats) if check["passed"] else None
            if not check["passed"]:
                yield core.row(FAMILY, name, params, check)
                continue
            yield core.row(FAMILY, name, params, check, us, {"host µs/call": us}, [floor],
                           "host clock, back-to-back eager calls")  # fmt: skip


def _child(quick: bool) -> None:
    """``--uncached``: print the bounded calls' host µs as one JSON line (run by `_uncached`)."""
    calls, repeats = (30, 3) if quick else (CALLS, REPEATS)
    found = {}
    for op, (modes, check_fn) in _ops("cuda").items():
        check = check_fn(modes["cached"])
        us = host_us(modes["cached"], calls, repeats) if check["passed"] else None
        found[op] = dict(check=check, us=us)
    print(json.dumps(found))


if __name__ == "__main__":
    if "--uncached" in sys.argv:
        _child("--quick" in sys.argv)
    else:
        sys.exit("bench.host: run through `python -m bench.run --only host`")
