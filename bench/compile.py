"""Compile time against device time: what a cold Triton cache costs a process, and what the cache
saves, beside the call's own GPU time.

Each case runs in two child processes sharing one new, empty ``TRITON_CACHE_DIR`` (any cache
manager or remote layer of the parent's environment left out): the first compiles (``cold``),
the second loads the kernels from that folder (``warm``). Each child builds the case's inputs,
then times its first call with a synchronize (plan, compile or load, launch: ``first call``);
the cold child then checks the output and times the call (`core.Context.time_us`, in a CUDA
graph: each case makes the bounded call a serving engine makes, MLA with its metadata). A row's time
is the cold first call; the warm one and the device time are its metrics. Cases: the
paged decode, the sm_90-class prefill and the MLA decode of the other families' main rows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import torch

import portattn
from bench import core, inputs
from portattn.mla_metadata import MlaMetadataBuilder
from portattn.platform import current_target

FAMILY = "compile"
DTYPE = torch.bfloat16
CASES = ("paged decode 64x4k 32/8/128 bs16", "prefill 8x4096 32/8/128 bs16",
         "mla 16h 64x4k page64 q1")  # fmt: skip


def _case(name: str, device: str):
    """``(call, check)`` of a case."""
    if name.startswith("paged decode"):
        seqs = ((4096, 1),) * 64
    elif name.startswith("prefill"):
        seqs = ((4096, 4096),) * 8
    else:
        m = inputs.mla_batch(batch=64, context=4096, heads=16, head_dim_k=576, page=64, q_len=1,
                             dtype=DTYPE, device=device)  # fmt: skip
        out = torch.empty(64, 16, 512, dtype=DTYPE, device=device)
        args = (m.query, m.kv_cache, m.block_table, m.seq_lens)
        # the serving call, as the mla family's row: metadata built before the first call (a
        # call without it reads the metadata to the host, which a graph capture refuses)
        metadata = MlaMetadataBuilder(
            current_target(), max_batch=64, num_heads=16, kv_lora_rank=512, head_dim_k=576,
            dtype=DTYPE, device=device, max_seq_len=4096,
        ).build(m.seq_lens)  # fmt: skip

        def mla_call():
            return portattn.mla_decode(*args, kv_lora_rank=512, scale=576**-0.5, out=out,
                                       metadata=metadata)  # fmt: skip

        def mla_check():
            from portattn import reference

            sub = (m.query[:2], m.kv_cache, m.block_table[:2], m.seq_lens[:2])
            oracle, _ = reference.mla_decode(*sub, kv_lora_rank=512, scale=576**-0.5)
            lowp, _ = reference.mla_decode(*sub, kv_lora_rank=512, scale=576**-0.5,
                                           compute_dtype=DTYPE)  # fmt: skip
            return core.tolerance_check(out[:2], oracle, lowp)

        return mla_call, mla_check
    b = inputs.paged_batch(seqs, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                           dtype=DTYPE, device=device)  # fmt: skip
    pout = torch.empty_like(b.query)

    def call():
        return portattn.paged_attention(*b.args, out=pout, max_query_len=b.max_query_len,
                                        max_seq_len=b.max_seq_len)  # fmt: skip

    return call, lambda: core.check_paged(b, pout)


def _child(name: str, measure: bool) -> dict:
    call, check = _case(name, "cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    call()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    result: dict = dict(first_call_s=first_s)
    if measure:
        result["check"] = check()
        if result["check"]["passed"]:
            result["device_us"], result["timing"] = core.Context("cuda").time_us(call)
    return result


def _spawn(name: str, cache_dir: str, measure: bool) -> dict:
    src = os.path.dirname(os.path.dirname(portattn.__file__))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TRITON_CACHE_MANAGER", "TRITON_REMOTE_CACHE", "TRITON_REDIS"))
    }
    env.update(
        TRITON_CACHE_DIR=cache_dir,
        PYTHONPATH=os.pathsep.join([src, root, os.environ.get("PYTHONPATH", "")]),
    )
    cmd = [sys.executable, "-m", "bench.compile", name] + (["--measure"] if measure else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"bench.compile child {name!r} failed ({proc.returncode}): {tail[0]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def names(quick: bool) -> list[str]:
    """The rows' names, without running them (``--rows`` is checked against these)."""
    return [f"compile {case}" for case in CASES]


def rows(ctx: core.Context):
    for case in CASES:
        name = f"compile {case}"
        if not ctx.want(name):
            continue
        with tempfile.TemporaryDirectory(prefix="bench-triton-cache-") as cache_dir:
            cold = _spawn(case, cache_dir, measure=True)
            warm = _spawn(case, cache_dir, measure=False)
        params = dict(case=case)
        if not cold["check"]["passed"]:
            yield core.row(FAMILY, name, params, cold["check"])
            continue
        metrics = {"cold first call ms": cold["first_call_s"] * 1e3,
                   "warm first call ms": warm["first_call_s"] * 1e3,
                   "device µs": cold["device_us"]}  # fmt: skip
        # the row's time is what this family measures: the cold first call (compile included),
        # so --compare's new/old is a compile-cost ratio; the call's own time is a metric
        yield core.row(FAMILY, name, params, cold["check"], cold["first_call_s"] * 1e6, metrics,
                       [], f"first call, cold cache (device time {cold['timing']})")  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in CASES:
        sys.exit(f"bench.compile: run through `python -m bench.run --only compile`; cases "
                 f"{CASES}")  # fmt: skip
    print(json.dumps(_child(sys.argv[1], "--measure" in sys.argv)))
