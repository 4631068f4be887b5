"""MLA decode and verification: ``portattn.mla_decode`` at 576/512 (DeepSeek-V3), bf16, batch 64.

Rows: 16 and 128 heads at 1k, 4k and 16k tokens with 64-token pages; page size 1 (the gather
path) at 4k and 16k; the 64-token pages addressed by ``page_indices`` (``slots``: the flat slots
`expand_page_indices` gives speculative decoding's page-size-1 kernels) at 128 heads, 4k and 16k;
speculative verification (``q_len`` 2, 4, 8 query tokens a sequence) at 4k; 8 heads (a 64-head
model on 8 ranks) at 4k, q_len 1 and 2 (16 rows, fewer than half the 64-row tile);
and q_len 1, 2, 4, 8 at 16 heads, 4k with a HIP policy forced (gfx942's and gfx950's tiles, passed
to `MlaMetadataBuilder` as its target, compiled for this GPU): how verification scales with q_len
on the AMD tiles (packed rows), not how fast an AMD GPU is; and 16 and 128 heads at 4k over a
520-wide cache (``520/512``: a rope of 8, rows on multiples of 8 elements, not 16; the portable
kernel, which the Hopper kernel's rope widths leave it).
The call is the serving engine's: ``metadata`` from ``MlaMetadataBuilder`` (workspaces
preallocated, no host read, capturable), ``out`` preallocated. Checked on the first two
sequences against the fp64 oracle. Metrics: GB/s of the bytes the call must move (the cache
read once a sequence, query, output) and TFLOP/s (``2 * heads * context * (576 + 512)`` a query
token); the anchor is the read ceiling on the same bytes.
"""

from __future__ import annotations

import inspect
from functools import partial

import torch

import portattn
from bench import core, inputs
from portattn.mla_metadata import MlaMetadataBuilder
from portattn.platform import current_target, get_target

FAMILY = "mla"
DTYPE = torch.bfloat16
DK, RANK = 576, 512
#: The HIP policies whose verification scaling is measured on whatever GPU runs the suite.
HIP_POLICIES = ("gfx942", "gfx950")

# (heads, context, page, q_len, policy, slots, head_dim_k), batch 64; policy None: the device's
# own; slots: the pages addressed by `expand_page_indices`' flat slots, not the block table
FULL = [(h, c, 64, 1, None, False, DK) for h in (16, 128) for c in (1024, 4096, 16384)]
FULL += [(h, c, 1, 1, None, False, DK) for h in (16, 128) for c in (4096, 16384)]
FULL += [(128, c, 64, 1, None, True, DK) for c in (4096, 16384)]
FULL += [(16, 4096, 64, q, None, False, DK) for q in (2, 4, 8)]
FULL += [(128, 4096, 64, 4, None, False, DK)]
FULL += [(8, 4096, 64, q, None, False, DK) for q in (1, 2)]
FULL += [(16, 4096, 64, q, arch, False, DK) for arch in HIP_POLICIES for q in (1, 2, 4, 8)]
FULL += [(h, 4096, 64, 1, None, False, 520) for h in (16, 128)]
QUICK = [(4, 40, 16, 1, None, False, DK), (4, 40, 16, 1, None, True, DK),
         (4, 40, 16, 2, None, False, DK), (4, 40, 16, 4, "gfx942", False, DK),
         (4, 40, 16, 1, None, False, 520)]  # fmt: skip


def _page_size(page: int) -> dict[str, int]:
    """The builder's ``page_size`` argument where it takes one: a src before the sm_90 policy
    stopped sizing tiles from the page size (the old side of ``bench.run --compare``)."""
    params = inspect.signature(MlaMetadataBuilder).parameters
    return {"page_size": page} if "page_size" in params else {}


def _name(batch_n, heads, context, page, q_len, policy, slots, dk) -> str:
    ctx_label = f"{context // 1024}k" if context % 1024 == 0 else str(context)
    name = f"mla {heads}h {batch_n}x{ctx_label} page{page} q{q_len}"
    if slots:
        name += " slots"
    if dk != DK:
        name += f" {dk}/{RANK}"
    return name if policy is None else f"{name} {policy} tiles"


def names(quick: bool) -> list[str]:
    """The rows' names, without running them (``--rows`` is checked against these)."""
    return [_name(2 if quick else 64, *p) for p in (QUICK if quick else FULL)]


def rows(ctx: core.Context):
    batch_n = 2 if ctx.quick else 64
    for heads, context, page, q_len, policy, slots, dk in QUICK if ctx.quick else FULL:
        name = _name(batch_n, heads, context, page, q_len, policy, slots, dk)
        if not ctx.want(name):
            continue
        scale = dk**-0.5
        params = dict(batch=batch_n, context=context, heads=heads, head_dim_k=dk,
                      kv_lora_rank=RANK, page=page, q_len=q_len, dtype="bf16")  # fmt: skip
        # a forced policy: its tiles compiled for this device (None: the device's own policy)
        target = get_target(policy) if policy is not None else None
        if policy is not None:
            params["policy"] = policy
        if slots:
            params["page_indices"] = True
        b = inputs.mla_batch(batch=batch_n, context=context, heads=heads, head_dim_k=dk,
                             page=page, q_len=q_len, dtype=DTYPE, device=ctx.device)  # fmt: skip
        pages = portattn.expand_page_indices(b.block_table, b.seq_lens, page) if slots else None
        out = torch.empty(b.query.shape[0], heads, RANK, dtype=DTYPE, device=ctx.device)
        metadata = None
        if ctx.device == "cuda":  # the serving path; the interpreter takes the call without
            builder = MlaMetadataBuilder(
                target or current_target(), max_batch=batch_n, num_heads=heads, kv_lora_rank=RANK,
                head_dim_k=dk, dtype=DTYPE, device=ctx.device, max_query_len=q_len,
                max_seq_len=context, **_page_size(1 if slots else page),
            )  # fmt: skip
            metadata = builder.build(b.seq_lens, b.query_start_loc, max_query_len=q_len)

        # with metadata the launch takes the metadata's target; without (the interpreter) this
        def call(b=b, out=out, metadata=metadata, target=target if metadata is None else None,
                 pages=pages, scale=scale):  # fmt: skip
            table = b.block_table if pages is None else None
            return portattn.mla_decode(b.query, b.kv_cache, table, b.seq_lens,
                                       kv_lora_rank=RANK, scale=scale,
                                       query_start_loc=b.query_start_loc, out=out,
                                       page_indices=pages, metadata=metadata,
                                       target=target)  # fmt: skip

        check, us, how = ctx.checked_time_us(call, out, partial(_check, b, out, scale))
        if us is None:
            yield core.row(FAMILY, name, params, check)
            continue
        elem = DTYPE.itemsize
        tokens = b.query.shape[0]
        nbytes = batch_n * context * dk * elem + tokens * heads * (dk + RANK) * elem
        flops = 2 * tokens * heads * context * (dk + RANK)
        yield core.row(FAMILY, name, params, check, us,
                       {"GB/s": core.rate(nbytes, us, 1e9),
                        "TFLOP/s": core.rate(flops, us, 1e12)},
                       [ctx.read_ceiling(nbytes)], how)  # fmt: skip
        del b, out, metadata, pages
        if ctx.device == "cuda":
            torch.cuda.empty_cache()


def _check(b: inputs.MlaBatch, out: torch.Tensor, scale: float, n: int = 2) -> dict:
    """The first ``n`` sequences' rows against ``reference.mla_decode`` (fp64 and bf16)."""
    from portattn import reference

    rows_n = n * b.q_len
    qsl = None if b.query_start_loc is None else b.query_start_loc[: n + 1]
    # only these sequences' pages, renumbered: the oracle copies its cache to the host
    blocks = b.block_table[:n]
    table = torch.arange(blocks.numel(), dtype=torch.int32, device=blocks.device).view(n, -1)
    sub = (b.query[:rows_n], b.kv_cache[blocks.flatten().long()], table, b.seq_lens[:n])
    oracle, _ = reference.mla_decode(*sub, kv_lora_rank=RANK, scale=scale, query_start_loc=qsl)
    lowp, _ = reference.mla_decode(*sub, kv_lora_rank=RANK, scale=scale, query_start_loc=qsl,
                                   compute_dtype=DTYPE)  # fmt: skip
    result = core.tolerance_check(out[:rows_n], oracle, lowp)
    result["detail"] = f"{rows_n} query rows of {n} sequences"
    return result
