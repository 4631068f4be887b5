"""Host steps of an unbounded call: where a ``paged_attention`` / ``mla_decode`` call without
bounds, or a ``gather_kv_cache`` call without ``out``, spends its host time, step by step, on
the host rows' inputs (`bench.host`).

Each step is timed as a host row is (`bench.host.host_us`: ``--calls`` back-to-back calls on
the host clock, median of ``--repeats`` loops, the garbage collector off):

* ``summary``: the device-side metadata check an unbounded call runs (its launch through the
  plan cache, the copy of its totals and one wait, `read_metadata_summary`), alone and right
  after the op's cached call (so the wait includes the kernel the call queued, as in a decode
  loop);
* ``summary queued``: its launch and copy alone, without the wait (`start_metadata_summary`);
* ``a wait, nothing queued``: the stream's wait alone (the summary writes its totals to pinned
  host memory itself, so the wait is all that follows its launch);
* ``summary, cached call, one wait``: the summary queued, the cached call, then the wait and the
  read (`finish_metadata_summary`): what an unbounded call would cost if it could launch its
  kernels before it waits (its kernels then need the summary's verdict on the device);
* ``host read``: the metadata's own device-to-host read (`_checks.to_host`), which an unbounded
  call makes only for broken metadata (to name what is wrong);
* ``sync after a launch``: the cached call then ``torch.cuda.synchronize()`` (the round trip
  without a copy);
* ``argument checks``: the op's type, shape and overlap checks, which an unbounded call runs
  once per description (`CheckMemo`);
* ``checks and maxima``: all an unbounded call does before its cached call;
* ``cached`` and ``unbounded``: the public calls, as in the host rows;
* gather only: ``two new outputs`` (what a call without ``out`` allocates) and ``cached, new
  outputs`` (the call given outputs allocated for it).

Each line also gives the plan cache's misses per call during the step (0: every call replayed a
kept plan).

Usage (GPU machine, repository root)::

    PYTHONPATH=src python3 -m bench.diag.host_steps [--calls 300] [--repeats 7]
"""

from __future__ import annotations

import argparse

import torch

import portattn
from bench import core, inputs
from bench.host import host_us
from portattn.compile.__main__ import at_least  # the argparse rule, shared
from portattn.kernels import mla_decode as mla_mod
from portattn.kernels import paged_attention as paged_mod
from portattn.kernels._checks import INT64_MAX, to_host
from portattn.kernels._plans import PLANS
from portattn.kernels.metadata_summary import (
    finish_metadata_summary,
    read_metadata_summary,
    start_metadata_summary,
)


def paged_steps(device: str) -> dict:
    b = inputs.paged_batch(((64, 1),) * 4, num_q_heads=32, num_kv_heads=8, head_dim=128,
                           block_size=16, dtype=torch.bfloat16, device=device)  # fmt: skip
    q, kc, vc, bt, sl, qsl = b.args

    def cached():
        return portattn.paged_attention(*b.args, max_query_len=1, max_seq_len=64)

    kw = dict(num_tokens=q.shape[0], block_size=16, num_blocks=kc.shape[0], end_at_most=False)

    def summary():
        return read_metadata_summary(qsl, sl, bt, **kw)

    def queued():
        return start_metadata_summary(qsl, sl, bt, **kw)

    return {
        "summary": summary,
        "summary after a launch": lambda: (cached(), summary()),
        "summary queued": queued,
        "a wait, nothing queued": lambda: torch.cuda.current_stream().synchronize(),
        "summary, cached call, one wait": lambda: finish_metadata_summary((queued(), cached())[0]),
        "host read": lambda: to_host(bt, sl, qsl),
        "sync after a launch": lambda: (cached(), torch.cuda.synchronize()),
        "argument checks": lambda: paged_mod._check_call(
            q, kc, vc, bt, sl, qsl, None, None, "NHD", None, None, None, None
        ),
        "checks and maxima": lambda: paged_mod.unbounded_maxima(
            q, kc, vc, bt, sl, qsl, None, None, "NHD", None, None
        ),
        "cached": cached,
        "unbounded": lambda: portattn.paged_attention(*b.args),
    }


def mla_steps(device: str) -> dict:
    from portattn.mla_metadata import MlaMetadataBuilder
    from portattn.platform import current_target

    m = inputs.mla_batch(batch=4, context=256, heads=16, head_dim_k=576, page=64, q_len=1,
                         dtype=torch.bfloat16, device=device)  # fmt: skip
    md = MlaMetadataBuilder(current_target(), max_batch=4, num_heads=16, kv_lora_rank=512,
                            head_dim_k=576, dtype=torch.bfloat16, device=device,
                            max_seq_len=256).build(m.seq_lens)  # fmt: skip
    a = (m.query, m.kv_cache, m.block_table, m.seq_lens)
    scale = 576**-0.5

    def cached():
        return portattn.mla_decode(*a, kv_lora_rank=512, scale=scale, metadata=md)

    kw = dict(num_tokens=4, block_size=64, num_blocks=m.kv_cache.shape[0], end_at_most=True)

    def summary():
        return read_metadata_summary(None, m.seq_lens, m.block_table, **kw)

    def queued():
        return start_metadata_summary(None, m.seq_lens, m.block_table, **kw)

    return {
        "summary": summary,
        "summary after a launch": lambda: (cached(), summary()),
        "summary queued": queued,
        "summary, cached call, one wait": lambda: finish_metadata_summary((queued(), cached())[0]),
        "host read": lambda: to_host(m.block_table, m.seq_lens),
        "checks and maxima": lambda: mla_mod.unbounded_query_len(
            *a, 512, scale, None, None, None, False, None
        ),
        "cached": cached,
        "unbounded": lambda: portattn.mla_decode(*a, kv_lora_rank=512, scale=scale),
    }


def gather_steps(device: str) -> dict:
    kc, vc, table, cu, gout = inputs.gather_case(seqs=4, context=64, block_size=16,
                                                 num_kv_heads=8, head_dim=128,
                                                 dtype=torch.bfloat16, device=device)  # fmt: skip
    kw = dict(num_tokens=INT64_MAX, block_size=16, num_blocks=kc.shape[0], end_at_most=True,
              padding_ok=True)  # fmt: skip

    def fresh():
        return torch.empty_like(gout[0]), torch.empty_like(gout[1])

    return {
        "summary": lambda: read_metadata_summary(cu, None, table, **kw),
        "two new outputs": fresh,
        "cached": lambda: portattn.gather_kv_cache(kc, vc, table, cu, out=gout),
        "cached, new outputs": lambda: portattn.gather_kv_cache(kc, vc, table, cu, out=fresh()),
        "unbounded": lambda: portattn.gather_kv_cache(kc, vc, table, cu),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=at_least(1), default=300)
    ap.add_argument("--repeats", type=at_least(1), default=7)
    opts = ap.parse_args(argv)
    core.require_gpu("bench.diag.host_steps")
    print(f"device: {torch.cuda.get_device_name()}")
    ops = (("paged_attention", paged_steps("cuda")), ("mla_decode", mla_steps("cuda")),
           ("gather_kv_cache", gather_steps("cuda")))  # fmt: skip
    for op, steps in ops:
        for name, fn in steps.items():
            fn()  # a first call plans what the step's calls replay
            misses = PLANS.misses
            us = host_us(fn, opts.calls, opts.repeats)
            per_call = (PLANS.misses - misses) / (20 + opts.calls * opts.repeats)  # 20 warm-ups
            print(f"{op:16s} {name:40s} {us:8.1f} µs/call  {per_call:.2f} plan misses/call")


if __name__ == "__main__":
    main()
