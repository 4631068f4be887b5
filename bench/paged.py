"""Paged decode: ``portattn.paged_attention`` with one query token a sequence, NHD and SHUFFLE.

Rows: batch 64 at 1k, 4k and 16k tokens, GQA 32/8 x 128 and 64/4 x 64, bf16, block sizes 16
and 2048 (a hybrid model's size: the kernel's tile must not follow it), both layouts on the same
cache values. The call is the serving engine's: ``max_query_len=1, max_seq_len=`` given (no host
read, capturable), ``out`` preallocated. Memory-bound: the metric is GB/s of the bytes the call
must move (K and V once per KV head, query, output), beside the read ceiling on the same bytes
and vLLM's Triton kernel where vLLM imports.
"""

from __future__ import annotations

from functools import partial

import torch

import portattn
from bench import core, inputs

FAMILY = "paged"
DTYPE = torch.bfloat16

# (batch, context, (q heads, kv heads, head_dim), layout, block size)
FULL = [
    (64, 4096, (32, 8, 128), "NHD", 16),
    (64, 4096, (32, 8, 128), "SHUFFLE", 16),
    (64, 4096, (32, 8, 128), "NHD", 2048),
    (64, 16384, (32, 8, 128), "NHD", 16),
    (64, 16384, (32, 8, 128), "SHUFFLE", 16),
    (64, 1024, (32, 8, 128), "NHD", 2048),
    (64, 1024, (32, 8, 128), "SHUFFLE", 2048),
    (64, 1024, (64, 4, 64), "NHD", 16),
    (64, 1024, (64, 4, 64), "SHUFFLE", 16),
    (64, 4096, (64, 4, 64), "NHD", 16),
    (64, 4096, (64, 4, 64), "SHUFFLE", 16),
    (64, 16384, (64, 4, 64), "NHD", 16),
    (64, 16384, (64, 4, 64), "SHUFFLE", 16),
]
QUICK = [
    (3, 40, (4, 2, 64), "NHD", 16),
    (3, 40, (4, 2, 64), "SHUFFLE", 16),
]


def _ctx_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _name(batch_n, context, hq, hkv, d, layout, bs) -> str:
    return f"decode {batch_n}x{_ctx_label(context)} {hq}/{hkv}/{d} {layout} bs{bs}"


def names(quick: bool) -> list[str]:
    """The rows' names, without running them (``--rows`` is checked against these)."""
    return [_name(n, c, *h, lay, bs) for n, c, h, lay, bs in (QUICK if quick else FULL)]


def rows(ctx: core.Context):
    vllm_fn, vllm_why = core.vllm_unified_attention()
    for batch_n, context, (hq, hkv, d), layout, bs in QUICK if ctx.quick else FULL:
        name = _name(batch_n, context, hq, hkv, d, layout, bs)
        if not ctx.want(name):
            continue
        seqs = ((context, 1),) * batch_n
        params = dict(batch=batch_n, context=context, num_q_heads=hq, num_kv_heads=hkv,
                      head_dim=d, layout=layout, block_size=bs, dtype="bf16")  # fmt: skip
        b = inputs.paged_batch(seqs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                               block_size=bs, dtype=DTYPE, device=ctx.device,
                               layout=layout)  # fmt: skip
        out = torch.empty_like(b.query)

        def call(b=b, out=out):
            return portattn.paged_attention(*b.args, layout=b.layout, out=out,
                                            max_query_len=1, max_seq_len=b.max_seq_len)  # fmt: skip

        check, us, how = ctx.checked_time_us(call, out, partial(core.check_paged, b, out))
        if us is None:
            yield core.row(FAMILY, name, params, check)
            continue
        nbytes = core.paged_bytes(seqs, hq, hkv, d, DTYPE.itemsize)
        anchors = [ctx.read_ceiling(nbytes)]
        if layout == "NHD" and vllm_fn is not None:  # else the document says why not
            v = core.vllm_anchor(vllm_fn, vllm_why, ctx, b, out, d**-0.5)
            v["metrics"] = {"GB/s": core.rate(nbytes, v["time_us"], 1e9)}
            anchors.append(v)
        yield core.row(FAMILY, name, params, check, us, {"GB/s": core.rate(nbytes, us, 1e9)},
                       anchors, how)  # fmt: skip
        del b, out
        if ctx.device == "cuda":
            torch.cuda.empty_cache()
