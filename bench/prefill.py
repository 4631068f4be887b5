"""Pure prefill and mixed batches: ``portattn.paged_attention`` with long query chunks.

Rows (32/8 heads, bf16, random pages; head_dim 128 at block sizes 16 and 2048, head_dim 64 and
256 at block 16):

* ``prefill 8x4096``: 8 causal prefills, ``q_len == seq_len == 4096`` (head_dim 64, 128, 256);
* ``prefill 2x16384``: 2 causal prefills of 16384 tokens;
* ``mixed 8x2048+56x1@4k``: 64 sequences of 4096 tokens, the first 8 prefilling their last 2048
  tokens, the other 56 decoding one.

The call is the serving engine's (``max_query_len``, ``max_seq_len``, ``out`` given). Checked on
128-row windows of the prefill sequences and on the first and last decode (`core.check_paged`).
Metric: TFLOP/s of the causal (query, key) pairs (4 flops a pair, head and dim). Anchors: torch
SDPA with the cuDNN and the flash backend forced, on the same problem as dense tensors (K/V
gathered contiguous; a chunk's queries see the keys before them: lower-right causal), their
output compared with the row's before they are timed, and timed together with the row (each
repetition times the row and every anchor in turn, `core.Context.time_together`, so a drifting
clock moves them alike). A mixed row has one more anchor, its
compute floor: cuDNN on the prefill part alone plus portattn on the decode part alone, timed
together (each chunk's attention as cuDNN's two fast shapes of the same flops: its queries over
the keys before the chunk, dense, and over the chunk's own keys, causal; a lower-right causal
bias is no cuDNN fast path). The floor's parts are timed, not checked: their outputs are
partial attentions, not the row's.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

import portattn
from bench import core, inputs

FAMILY = "prefill"
DTYPE = torch.bfloat16


def _mixed(n_prefill: int, chunk: int, n_decode: int, ctx: int):
    return ((ctx, chunk),) * n_prefill + ((ctx, 1),) * n_decode


# "<point> <q heads>/<kv heads>/<head_dim>" -> (seqs, (q heads, kv heads, head_dim), block sizes);
# a row is "<key> bs<block size>"
def _points(*entries) -> dict:
    return {
        f"{point} {h[0]}/{h[1]}/{h[2]}": (seqs, h, blocks) for point, seqs, h, blocks in entries
    }


FULL = _points(
    ("prefill 8x4096", ((4096, 4096),) * 8, (32, 8, 128), (16, 2048)),
    ("prefill 2x16384", ((16384, 16384),) * 2, (32, 8, 128), (16, 2048)),
    ("prefill 8x4096", ((4096, 4096),) * 8, (32, 8, 64), (16,)),
    ("prefill 8x4096", ((4096, 4096),) * 8, (32, 8, 256), (16,)),
    ("mixed 8x2048+56x1@4k", _mixed(8, 2048, 56, 4096), (32, 8, 128), (16, 2048)),
)
QUICK = _points(
    ("prefill 2x48", ((48, 48),) * 2, (4, 2, 64), (16,)),
    ("mixed 2x16+3x1@48", _mixed(2, 16, 3, 48), (4, 2, 64), (16,)),
)


def _dense_kv(cache: torch.Tensor, table: torch.Tensor, i: int, n: int) -> torch.Tensor:
    """Sequence ``i``'s first ``n`` tokens of an NHD cache as ``[1, kv_heads, n, d]``."""
    bs = cache.shape[1]
    blocks = table[i, : -(-n // bs)].long()
    return cache[blocks].flatten(0, 1)[:n].transpose(0, 1).unsqueeze(0)


def sdpa_anchor(backend_name: str, b: inputs.PagedBatch, out_ref: torch.Tensor, flops: int,
                ctx: core.Context) -> core.Pending | dict:  # fmt: skip
    """Torch SDPA with ``backend_name`` (``CUDNN_ATTENTION``, ``FLASH_ATTENTION``) forced, one
    call a group of equal sequences (the prefills, the decodes), K/V heads expanded where the
    backend refuses GQA: its call, checked against the row's output and ready to time beside
    it, or an anchor saying why it did not run."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    name = f"SDPA {backend_name.removesuffix('_ATTENTION').lower()}"
    if ctx.device != "cuda":
        return core.anchor(name, None, note="needs a CUDA device")
    backend = getattr(SDPBackend, backend_name)
    qsl = b.query_start_loc.tolist()
    groups: dict[tuple[int, int], list[int]] = {}
    for i, sq in enumerate(b.seqs):
        groups.setdefault(sq, []).append(i)
    calls, rows_of = [], []
    for (s, q), idx in groups.items():
        qd = torch.stack([b.query[qsl[i] : qsl[i] + q] for i in idx]).transpose(1, 2)
        kd = torch.cat([_dense_kv(b.key_cache, b.block_table, i, s) for i in idx])
        vd = torch.cat([_dense_kv(b.value_cache, b.block_table, i, s) for i in idx])
        if q == s:
            mask, causal = None, True
        elif q == 1:
            mask, causal = None, False
        else:
            mask, causal = causal_lower_right(q, s), False
        calls.append((qd.contiguous(), kd.contiguous(), vd.contiguous(), mask, causal))
        rows_of.append([r for i in idx for r in range(qsl[i], qsl[i] + q)])
    group = b.query.shape[1] // b.key_cache.shape[2]

    def run(expand: bool):
        outs = []
        with sdpa_kernel(backend):
            for qd, kd, vd, mask, causal in calls:
                if expand:
                    kd, vd = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
                outs.append(F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask,
                                                           is_causal=causal,
                                                           enable_gqa=not expand))  # fmt: skip
        return outs

    errors = []
    for expand in (False, True):
        try:
            outs = run(expand)
        except RuntimeError as err:
            errors.append(str(err).splitlines()[0][:100])
            continue
        got = torch.empty_like(out_ref)
        for o, r in zip(outs, rows_of, strict=True):
            got[torch.tensor(r, device=got.device)] = o.transpose(1, 2).flatten(0, 1)
        diff = core.rel_err(got, out_ref)
        if not diff < 2e-2:
            return core.anchor(name, None, note=f"output differs from the row's by {diff:.2e}")
        notes = ["K/V heads expanded (no GQA in this backend)"] if expand else []
        if any(c[3] is not None for c in calls):
            notes.append("chunks lower-right causal (a CausalBias: torch may route it elsewhere)")
        return core.Pending(name, lambda expand=expand: run(expand),
                            lambda us: {"TFLOP/s": core.rate(flops, us, 1e12)},
                            "; ".join(notes))  # fmt: skip
    return core.anchor(name, None, note="backend refused: " + " | ".join(errors))


def floor_anchor(b: inputs.PagedBatch, ctx: core.Context) -> core.Pending | dict:
    """A mixed batch's compute floor (module docstring): cuDNN on its prefill part plus portattn
    on its decode part, each alone, as one call to time beside the row (or an anchor saying why
    it did not run)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    name = "compute floor (cuDNN prefill part + decode part alone)"
    if ctx.device != "cuda":
        return core.anchor(name, None, note="needs a CUDA device")
    qsl = b.query_start_loc.tolist()
    chunks = [i for i, (_, q) in enumerate(b.seqs) if q > 1]
    decodes = [sq for sq in b.seqs if sq[1] == 1]
    s, q = b.seqs[chunks[0]]
    if any(b.seqs[i] != (s, q) for i in chunks):
        return core.anchor(name, None, note="needs chunks of one shape")
    qd = torch.stack([b.query[qsl[i] : qsl[i] + q] for i in chunks]).transpose(1, 2).contiguous()
    kv = [torch.cat([_dense_kv(c, b.block_table, i, s) for i in chunks])
          for c in (b.key_cache, b.value_cache)]  # fmt: skip
    past = [t[:, :, : s - q].contiguous() for t in kv]
    own = [t[:, :, s - q :].contiguous() for t in kv]
    hq, hkv, d = b.query.shape[1], b.key_cache.shape[2], b.query.shape[2]
    dec = inputs.paged_batch(decodes, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                             block_size=b.key_cache.shape[1], dtype=b.query.dtype,
                             device=str(b.query.device), seed=1)  # fmt: skip
    dec_out = torch.empty_like(dec.query)

    def run(p, o, gqa: bool):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            if s > q:
                F.scaled_dot_product_attention(qd, *p, enable_gqa=gqa)
            F.scaled_dot_product_attention(qd, *o, is_causal=True, enable_gqa=gqa)
        portattn.paged_attention(*dec.args, out=dec_out, max_query_len=1,
                                 max_seq_len=dec.max_seq_len)  # fmt: skip

    errors = []
    for expand in (False, True):
        p, o = past, own
        if expand:  # the backend's GQA refused: K/V heads repeated before the timing
            p, o = ([t.repeat_interleave(hq // hkv, 1) for t in x] for x in (past, own))
        try:
            run(p, o, not expand)
        except RuntimeError as err:
            errors.append(str(err).splitlines()[0][:100])
            continue
        note = "K/V heads expanded (no GQA in this backend); " if expand else ""
        return core.Pending(name, lambda p=p, o=o, gqa=not expand: run(p, o, gqa), lambda us: {},
                            note + "the parts timed, not checked")  # fmt: skip
    return core.anchor(name, None, note="cuDNN refused: " + " | ".join(errors))


def names(quick: bool) -> list[str]:
    """The rows' names, without running them (``--rows`` is checked against these)."""
    return [f"{p} bs{bs}" for p, (_, _, blocks) in (QUICK if quick else FULL).items()
            for bs in blocks]  # fmt: skip


def rows(ctx: core.Context):
    points = QUICK if ctx.quick else FULL
    for point, (seqs, (hq, hkv, d), blocks) in points.items():
        for bs in blocks:
            name = f"{point} bs{bs}"
            if not ctx.want(name):
                continue
            params = dict(seqs=[list(s) for s in dict.fromkeys(seqs)], num_seqs=len(seqs),
                          num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                          dtype="bf16")  # fmt: skip
            b = inputs.paged_batch(seqs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                   block_size=bs, dtype=DTYPE, device=ctx.device)  # fmt: skip
            out = torch.empty_like(b.query)

            def call(b=b, out=out):
                return portattn.paged_attention(*b.args, out=out, max_query_len=b.max_query_len,
                                                max_seq_len=b.max_seq_len)  # fmt: skip

            check = ctx.check_once(call, out, partial(core.check_paged, b, out))
            if not check["passed"]:
                yield core.row(FAMILY, name, params, check)
                continue
            flops = core.paged_flops(seqs, hq, d)
            anchors = [sdpa_anchor(bk, b, out, flops, ctx)
                       for bk in ("CUDNN_ATTENTION", "FLASH_ATTENTION")]  # fmt: skip
            if any(q == 1 for _, q in seqs) and any(q > 1 for _, q in seqs):
                anchors.append(floor_anchor(b, ctx))
            # the row and its anchors' calls timed together, repetition by repetition
            pending = [a for a in anchors if isinstance(a, core.Pending)]
            (us, how), *timed = ctx.time_together([call] + [a.fn for a in pending])
            times = iter(timed)  # (in the anchors' order)
            anchors = [a.anchor(*next(times)) if isinstance(a, core.Pending) else a
                       for a in anchors]  # fmt: skip
            yield core.row(FAMILY, name, params, check, us,
                           {"TFLOP/s": core.rate(flops, us, 1e12)}, anchors, how)  # fmt: skip
            del b, out
            if ctx.device == "cuda":
                torch.cuda.empty_cache()
