"""Host time per call on a machine without a GPU (issue 18): the plan cache's Python, part by part.

`bench_host.py` times the serving-path ops on a GPU. Most of a cached call is Python that runs
the same without one (the key, the lookup, binding the plan's arguments, the op's wrapper and the
Python of Triton's launcher), so this script times those parts on the CPU, at bench_host.py's
shapes, with meta tensors (the ops cache their plans for meta tensors: no contents to read).
Nothing reaches a kernel: `Launch.run` is replaced by one that returns a stand-in compiled kernel
whose launcher is Triton's own `CudaLauncher` (its Python ``__call__``; its descriptor wrapper
where the launch has TMA descriptors) around a C function that takes any arguments and does
nothing. So a "launch" here is everything a cached launch does in Python up to Triton's C
launcher; what the C launcher does (parse the arguments, ``data_ptr()`` and
``cuPointerGetAttribute`` per tensor passed as a tensor, ``cuLaunchKernelEx``) is not in it, and
buffers are allocated on the meta device (cheaper than CUDA's caching allocator; one CPU buffer
is timed at the end, through `torch.empty` and through `_plans.FAST_EMPTY`'s C function). Use
the ratios between two revisions, not the absolute figures, to predict a GPU host's times.

Parts (as bench_host.py's ``--breakdown``): the op's call; the key; key + lookup; key + lookup +
bind (`Plan.bind_launch`: buffers + the argument lists `Plan.run` launches with); the buffers
alone (`Plan._allocate`, the plan looked up once); key + lookup + bind + launch (`Plan.run`);
the probe's part (`PlanCache.guarded`: the op's scalars, its tensors' C guards and alignment,
the lookup), which on a repeated call stands in for key + lookup; probe + bind + launch. Each
is timed with ``timeit`` (GC off), the best of ``--repeats`` loops of ``--calls`` calls.

Usage::

    PYTHONPATH=src python bench/bench_host_cpu.py [--calls 20000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import timeit

import torch
from bench_host import mla_parts, paged_parts, stages

from portattn.kernels import _plans
from portattn.kernels._launch import Launch
from portattn.kernels._plans import PLANS
from portattn.mla_metadata import MlaMetadataBuilder
from portattn.platform import get_target

META = "meta"
_SINK = "".format  # a C function that accepts any arguments and does nothing with them


class _StandIn:
    """A compiled kernel's stand-in: the attributes a cached launch reads, and Triton's
    `CudaLauncher` (Python ``__call__`` and descriptor wrapper as compiled) around `_SINK`."""

    def __init__(self, launch: Launch):
        from triton.backends.nvidia.driver import CudaLauncher, wrap_handle_tensordesc

        signature = {}
        for i, (name, _) in enumerate(launch._params()):
            v = launch.args[name]
            signature[i] = "tensordesc<bf16[16, 64]>" if _plans._is_descriptor(v) else "*bf16"
        run = object.__new__(CudaLauncher)
        run.launch = wrap_handle_tensordesc(_SINK, signature, None)
        run.num_ctas = 1
        run.global_scratch_size = run.profile_scratch_size = 0
        run.global_scratch_align = run.profile_scratch_align = 1
        run.launch_cooperative_grid = run.launch_pdl = False
        self._run = run
        self.function = 0
        self.packed_metadata = (launch.options.num_warps, 1, 0)

    @property
    def run(self):  # a property, as `CompiledKernel.run` is
        return self._run


def _stand_in_run(self: Launch):
    return _StandIn(self)


def _paged(split: bool):
    seqs, hq, hkv, d, bs, ctx = 4, 32, 8, 128, 16, 64
    if split:  # one long sequence: the policy splits it, a reduce launch follows
        seqs, ctx = 1, 8192
    nb = seqs * ctx // bs
    kc = torch.empty(nb, bs, hkv, d, dtype=torch.bfloat16, device=META)
    vc = torch.empty_like(kc)
    q = torch.empty(seqs, hq, d, dtype=torch.bfloat16, device=META)
    table = torch.empty(seqs, nb // seqs, dtype=torch.int32, device=META)
    sl = torch.empty(seqs, dtype=torch.int32, device=META)
    qsl = torch.empty(seqs + 1, dtype=torch.int32, device=META)
    return paged_parts((q, kc, vc, table, sl, qsl), ctx)


def _mla(ctx: int = 256):
    seqs, heads, dk, r, bs = 4, 16, 576, 512, 64
    nb = seqs * ctx // bs
    cache = torch.empty(nb, bs, dk, dtype=torch.bfloat16, device=META)
    q = torch.empty(seqs, heads, dk, dtype=torch.bfloat16, device=META)
    table = torch.empty(seqs, nb // seqs, dtype=torch.int32, device=META)
    sl = torch.empty(seqs, dtype=torch.int32, device=META)
    builder = MlaMetadataBuilder(
        get_target("sm_90"), max_batch=seqs, num_heads=heads, kv_lora_rank=r, head_dim_k=dk,
        dtype=torch.bfloat16, device=META, max_seq_len=ctx,
    )  # fmt: skip
    md = builder.build(sl)
    return mla_parts(q, cache, table, sl, md, r, 1 / math.sqrt(dk))


CASES = {
    "paged_attention": lambda: _paged(False),
    "paged_attention split-KV": lambda: _paged(True),
    "mla_decode": _mla,
    "mla_decode split-KV": lambda: _mla(4096),  # 4 x 4096 tokens: split, a reduce launch follows
}


def best_us(fn, calls: int, repeats: int) -> float:
    gc.collect()
    return min(timeit.repeat(fn, number=calls, repeat=repeats)) / calls * 1e6  # GC off inside


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    Launch.run = _stand_in_run  # nothing reaches a kernel (module docstring)
    _plans._Bound.stream = lambda device: 0
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}; best of "
          f"{args.repeats} x {args.calls} calls, us per call")  # fmt: skip
    for name, make in CASES.items():
        PLANS.clear()
        call, key, inputs, guarded = make()
        call()  # the miss: planned, kept
        call()  # a hit by the key: kept for the probe too
        plan = PLANS._plans.get(key())
        assert PLANS.hits == 1 and plan is not None, f"{name}: not cached"
        assert guarded() is plan, f"{name}: the probe finds another plan"
        n = len(plan._replays)
        print(f"{name} ({n} launch{'es' if n > 1 else ''})")
        for part, fn in stages(call, key, inputs, guarded).items():
            print(f"    {part:34s} {best_us(fn, args.calls, args.repeats):7.2f}", flush=True)
    # the buffers above are meta tensors: a CPU buffer shows what `FAST_EMPTY` saves
    print("one CPU buffer [4, 32, 128] bf16 (`_plans._empty`)")
    for fast in (False, True):
        _plans.FAST_EMPTY = fast
        alloc = _plans._empty((4, 32, 128), torch.bfloat16, torch.device("cpu"))
        label = f"FAST_EMPTY = {fast} ({getattr(alloc.func, '__name__', alloc.func)})"
        print(f"    {label:34s} {best_us(alloc, args.calls, args.repeats):7.2f}", flush=True)
    _plans.FAST_EMPTY = True
    return 0


if __name__ == "__main__":
    sys.exit(main())
