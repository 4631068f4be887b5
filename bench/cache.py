"""KV-cache copies: ``portattn.write_kv_cache``, ``gather_kv_cache`` and ``expand_page_indices``.

Rows (8 KV heads x 128, bf16, NHD, block sizes 16 and 2048):

* write: 16384 new tokens into distinct random slots of a 65536-slot cache;
* gather: 64 sequences x 4096 tokens out of a scattered cache, ``out`` preallocated;
* page indices: the flat slots of 64 sequences x 16384 tokens (block 64), ``num_indices``
  given (no host read).

Each result is compared bit for bit with ``portattn.reference`` (the whole cache for writes,
the first three sequences for gathers and indices). Metric: GB/s of the bytes read and written,
beside the read ceiling on the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import portattn
from bench import core, inputs

FAMILY = "cache"
DTYPE = torch.bfloat16
H, D = 8, 128


def _cases(quick: bool) -> list[tuple[str, Callable[..., dict], tuple]]:
    """``(name, row function, its sizes)`` of every row."""
    blocks = (16,) if quick else (16, 2048)
    tokens, slots = (8, 64) if quick else (16384, 65536)
    seqs, context = (3, 40) if quick else (64, 4096)
    cases: list[tuple[str, Callable[..., dict], tuple]] = []
    for bs in blocks:
        cases.append((f"write {tokens} tokens {H}/{D} bs{bs}", _write, (tokens, slots, bs)))
        cases.append((f"gather {seqs}x{context} {H}/{D} bs{bs}", _gather, (seqs, context, bs)))
    idx = (3, 40, 16) if quick else (64, 16384, 64)
    cases.append((f"page indices {idx[0]}x{idx[1]} bs{idx[2]}", _indices, idx))
    return cases


def names(quick: bool) -> list[str]:
    """The rows' names, without running them (``--rows`` is checked against these)."""
    return [name for name, _, _ in _cases(quick)]


def rows(ctx: core.Context):
    for name, fn, sizes in _cases(ctx.quick):
        if ctx.want(name):
            yield fn(ctx, name, *sizes)


def _write(ctx, name, tokens, num_slots, bs) -> dict:
    from portattn import reference

    key, value, kc, vc, slots = inputs.write_case(tokens=tokens, num_slots=num_slots,
                                                  block_size=bs, num_kv_heads=H, head_dim=D,
                                                  dtype=DTYPE, device=ctx.device)  # fmt: skip
    params = dict(tokens=tokens, num_slots=num_slots, block_size=bs, num_kv_heads=H, head_dim=D,
                  dtype="bf16")  # fmt: skip
    want_k, want_v = kc.clone(), vc.clone()
    reference.write_kv_cache(key, value, want_k, want_v, slots)

    def call():
        portattn.write_kv_cache(key, value, kc, vc, slots)

    call()
    check = core.exact_check([(kc, want_k), (vc, want_v)])
    if not check["passed"]:
        return core.row(FAMILY, name, params, check)
    us, how = ctx.time_us(call)
    nbytes = 2 * 2 * key.numel() * DTYPE.itemsize  # K and V, read and written
    return core.row(FAMILY, name, params, check, us, {"GB/s": core.rate(nbytes, us, 1e9)},
                    [ctx.read_ceiling(nbytes)], how)  # fmt: skip


def _gather(ctx, name, seqs, context, bs) -> dict:
    from portattn import reference

    kc, vc, table, cu, out = inputs.gather_case(seqs=seqs, context=context, block_size=bs,
                                                num_kv_heads=H, head_dim=D, dtype=DTYPE,
                                                device=ctx.device)  # fmt: skip
    params = dict(seqs=seqs, context=context, block_size=bs, num_kv_heads=H, head_dim=D,
                  dtype="bf16")  # fmt: skip

    def call():
        return portattn.gather_kv_cache(kc, vc, table, cu, out=out)

    out[0].normal_()
    out[1].normal_()
    call()
    want_k, want_v = reference.gather_kv_cache(kc, vc, table, cu)  # every sequence
    check = core.exact_check([(out[0], want_k), (out[1], want_v)])
    if not check["passed"]:
        return core.row(FAMILY, name, params, check)
    us, how = ctx.time_us(call)
    nbytes = 2 * 2 * out[0].numel() * DTYPE.itemsize
    return core.row(FAMILY, name, params, check, us, {"GB/s": core.rate(nbytes, us, 1e9)},
                    [ctx.read_ceiling(nbytes)], how)  # fmt: skip


def _indices(ctx, name, seqs, context, bs) -> dict:
    from portattn import reference

    b = inputs.mla_batch(batch=seqs, context=context, heads=1, head_dim_k=16, page=bs, q_len=1,
                         dtype=DTYPE, device=ctx.device)  # fmt: skip
    params = dict(seqs=seqs, context=context, block_size=bs)
    total = seqs * context

    def call():
        return portattn.expand_page_indices(b.block_table, b.seq_lens, bs, num_indices=total)

    indptr, indices = call()
    want_ptr, want_idx = reference.expand_page_indices(b.block_table.cpu(), b.seq_lens.cpu(), bs)
    check = core.exact_check([(indptr.long(), want_ptr), (indices.long(), want_idx)])
    if not check["passed"]:
        return core.row(FAMILY, name, params, check)
    us, how = ctx.time_us(call)
    nbytes = indices.numel() * indices.element_size() + b.block_table.numel() * 4
    return core.row(FAMILY, name, params, check, us, {"GB/s": core.rate(nbytes, us, 1e9)},
                    [ctx.read_ceiling(nbytes)], how)  # fmt: skip
