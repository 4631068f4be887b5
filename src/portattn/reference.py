"""Readable torch references for every op: the oracles the kernels are tested against.

Loops over sequences and tokens; clear rather than fast; CPU-runnable; never imports a kernel.
Attention references compute in ``compute_dtype`` (float64 for the oracle; the input's low
precision for the "same maths in torch" baseline of the tolerance rule) on the query's device
(a GPU's fp64 runs the large oracles in milliseconds) and return that dtype on the CPU.

Causal rule (design §2): sequence ``i`` has ``q_len_i = qsl[i+1] - qsl[i]`` new tokens, the LAST
``q_len_i`` of its ``seq_lens[i]`` tokens; its query token ``j`` attends to context positions
``< seq_lens[i] - q_len_i + j + 1``.
"""

from __future__ import annotations

import math

import torch

from portattn.layout import to_logical, token_view


def _context(logical: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """Tokens ``0..length-1`` of a sequence whose blocks are ``blocks``: ``[length, ...]``."""
    bs = logical.shape[1]
    n = -(-length // bs)
    return logical[blocks[:n].long()].reshape(n * bs, *logical.shape[2:])[:length]


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping, *, layout="NHD") -> None:
    """In place: token ``i`` goes to slot ``slot_mapping[i]``; negative slots are skipped."""
    bs = to_logical(key_cache[:1], layout, "key").shape[1]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        b, o = divmod(slot, bs)
        kv = token_view(key_cache, layout, "key", b, o)
        kv.copy_(key[i].reshape(kv.shape))
        token_view(value_cache, layout, "value", b, o).copy_(value[i])


def gather_kv_cache(key_cache, value_cache, block_table, cu_seq_lens, *, layout="NHD"):
    """``(k, v)`` each ``[total_tokens, num_kv_heads, head_dim]``, sequences concatenated."""
    lk, lv = to_logical(key_cache, layout, "key"), to_logical(value_cache, layout, "value")
    ks, vs = [], []
    for i in range(block_table.shape[0]):
        n = int(cu_seq_lens[i + 1] - cu_seq_lens[i])
        ks.append(_context(lk, block_table[i], n))
        vs.append(_context(lv, block_table[i], n))
    return torch.cat(ks), torch.cat(vs)


def _attend(q, k, v, prefix_lens, scale, compute_dtype):
    """q ``[n, hq, d]``, k/v ``[L, hkv, d]``; row j sees keys ``< prefix_lens[j]``."""
    q, k, v = (t.to(compute_dtype) for t in (q, k, v))
    n, hq, length, hkv = q.shape[0], q.shape[1], k.shape[0], k.shape[1]
    # query head h reads kv head h // group; grouped, so K/V are never copied per query head
    qg = q.reshape(n, hkv, hq // hkv, q.shape[2])
    scores = torch.einsum("nkgd,lkd->kgnl", qg, k).reshape(hq, n, length) * scale
    pos = torch.arange(length, device=k.device)
    mask = pos[None, :] >= torch.as_tensor(prefix_lens, device=k.device)[:, None]
    scores = scores.masked_fill(mask[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [h, n]
    probs = torch.softmax(scores, dim=-1).reshape(hkv, hq // hkv, n, length)
    out = torch.einsum("kgnl,lkd->nkgd", probs, v).reshape(n, hq, v.shape[2])
    return out, lse.transpose(0, 1)


def paged_attention(
    query,
    key_cache,
    value_cache,
    block_table,
    seq_lens,
    query_start_loc,
    *,
    scale=None,
    layout="NHD",
    compute_dtype=torch.float64,
):
    """Chunked-prefill + decode attention over a paged cache: ``[num_tokens, num_q_heads, d]``."""
    d = query.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    lk, lv = to_logical(key_cache, layout, "key"), to_logical(value_cache, layout, "value")
    out = torch.zeros(query.shape, dtype=compute_dtype, device=query.device)
    qsl = query_start_loc.tolist()
    for i in range(block_table.shape[0]):
        s, e, n = qsl[i], qsl[i + 1], int(seq_lens[i])
        if e == s:
            continue
        k, v = _context(lk, block_table[i], n), _context(lv, block_table[i], n)
        prefix = [n - (e - s) + j + 1 for j in range(e - s)]
        out[s:e] = _attend(query[s:e], k, v, prefix, scale, compute_dtype)[0]
    return out.cpu()


def mla_decode(
    query,
    kv_cache,
    block_table,
    seq_lens,
    *,
    kv_lora_rank,
    scale,
    query_start_loc=None,
    compute_dtype=torch.float64,
):
    """Absorbed-weight MLA: ``(out [num_tokens, num_q_heads, kv_lora_rank], lse [num_tokens, h])``.

    ``kv_cache [num_blocks, block_size, head_dim_k]``: columns ``:kv_lora_rank`` are the latent,
    used as both K (with the rope columns) and V. ``lse`` is the natural-log log-sum-exp of the
    scaled scores. ``query_start_loc=None`` means one query token per sequence.
    """
    num_seqs = block_table.shape[0]
    if query_start_loc is None:
        query_start_loc = torch.arange(num_seqs + 1)
    out = torch.zeros((*query.shape[:2], kv_lora_rank), dtype=compute_dtype, device=query.device)
    lse = torch.full(query.shape[:2], float("-inf"), dtype=compute_dtype, device=query.device)
    qsl = query_start_loc.tolist()
    cache = kv_cache.to(query.device)[:, :, None, :]  # one latent "head"
    for i in range(num_seqs):
        s, e, n = qsl[i], qsl[i + 1], int(seq_lens[i])
        if e == s:
            continue
        c = _context(cache, block_table[i].to(query.device), n)
        prefix = [n - (e - s) + j + 1 for j in range(e - s)]
        o, l_ = _attend(query[s:e], c, c[..., :kv_lora_rank], prefix, scale, compute_dtype)
        out[s:e], lse[s:e] = o, l_
    return out.cpu(), lse.cpu()


def expand_page_indices(block_table, seq_lens, block_size):
    """``(indptr [num_seqs+1], indices [sum(seq_lens)])`` of flat per-token slots (int64)."""
    indptr, idx = [0], []
    for i in range(block_table.shape[0]):
        n = int(seq_lens[i])
        idx += [
            int(block_table[i, t // block_size]) * block_size + t % block_size for t in range(n)
        ]
        indptr.append(len(idx))
    return torch.tensor(indptr, dtype=torch.int64), torch.tensor(idx, dtype=torch.int64)
