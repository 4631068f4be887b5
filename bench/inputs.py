"""The one input maker of the suite: random paged batches, MLA caches and KV-cache copy cases.

Every family draws its tensors here, from one seeded generator per case, so that two checkouts
timed by ``python -m bench.run --compare`` see the same bytes. Values are random normals (never
zeros: a kernel that skips work on zeros would look fast); each sequence's pages are a random
permutation of the cache's blocks (the scattered pages a serving engine's allocator leaves).
Only portattn's public layout helpers are used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from portattn.layout import from_logical


@dataclass(frozen=True)
class PagedBatch:
    """The six positional arguments of ``portattn.paged_attention`` plus the batch's shape."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    seqs: tuple[tuple[int, int], ...]  # (seq_len, q_len) of each sequence
    layout: str

    @property
    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.query, self.key_cache, self.value_cache, self.block_table, self.seq_lens,
                self.query_start_loc)  # fmt: skip

    @property
    def max_query_len(self) -> int:
        return max(q for _, q in self.seqs)

    @property
    def max_seq_len(self) -> int:
        return max(s for s, _ in self.seqs)


@dataclass(frozen=True)
class MlaBatch:
    """``mla_decode``'s inputs: query, latent cache, block table, seq_lens, query_start_loc."""

    query: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor | None  # None: one query token per sequence
    q_len: int


def _gen(device: str, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _scattered_table(num_seqs: int, blocks_per_seq: list[int], g, device) -> torch.Tensor:
    """``[num_seqs, max(blocks)]`` int32: a random permutation of all blocks dealt in order,
    unused entries -1."""
    total = sum(blocks_per_seq)
    perm = torch.randperm(total, device=device, generator=g).to(torch.int32)
    table = torch.full((num_seqs, max(blocks_per_seq)), -1, dtype=torch.int32, device=device)
    first = 0
    for i, n in enumerate(blocks_per_seq):
        table[i, :n] = perm[first : first + n]
        first += n
    return table


def paged_batch(seqs, *, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                dtype: torch.dtype, device: str, layout: str = "NHD",
                seed: int = 0) -> PagedBatch:  # fmt: skip
    """A paged batch of ``seqs`` (``(seq_len, q_len)`` each; a sequence's queries are its last
    ``q_len`` tokens). The cache is drawn in NHD and converted with ``layout.from_logical``, so
    NHD and SHUFFLE batches of one seed hold the same values."""
    g = _gen(device, seed)
    nblk = [-(-s // block_size) for s, _ in seqs]
    shape = (sum(nblk), block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, device=device, dtype=dtype, generator=g)
    v = torch.randn(shape, device=device, dtype=dtype, generator=g)
    table = _scattered_table(len(seqs), nblk, g, device)
    qsl = [0]
    for _, q in seqs:
        qsl.append(qsl[-1] + q)
    query = torch.randn(qsl[-1], num_q_heads, head_dim, device=device, dtype=dtype, generator=g)
    if layout != "NHD":
        k, v = from_logical(k, layout, "key"), from_logical(v, layout, "value")
    return PagedBatch(
        query, k, v, table,
        torch.tensor([s for s, _ in seqs], dtype=torch.int32, device=device),
        torch.tensor(qsl, dtype=torch.int32, device=device),
        tuple(seqs), layout,
    )  # fmt: skip


def mla_batch(*, batch: int, context: int, heads: int, head_dim_k: int, page: int, q_len: int,
              dtype: torch.dtype, device: str, seed: int = 0) -> MlaBatch:  # fmt: skip
    """``batch`` sequences of ``context`` tokens (this step's ``q_len`` included) in a latent
    cache of ``page``-token pages, scattered."""
    g = _gen(device, seed)
    per_seq = -(-context // page)
    cache = torch.randn(batch * per_seq, page, head_dim_k, device=device, dtype=dtype, generator=g)
    table = _scattered_table(batch, [per_seq] * batch, g, device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = torch.randn(batch * q_len, heads, head_dim_k, device=device, dtype=dtype, generator=g)
    qsl = None
    if q_len > 1:
        qsl = torch.arange(batch + 1, dtype=torch.int32, device=device) * q_len
    return MlaBatch(query, cache, table, seq_lens, qsl, q_len)


def write_case(*, tokens: int, num_slots: int, block_size: int, num_kv_heads: int,
               head_dim: int, dtype: torch.dtype, device: str, seed: int = 0):  # fmt: skip
    """``write_kv_cache``'s inputs: ``tokens`` new K/V rows to distinct random slots of a zeroed
    NHD cache of ``num_slots`` slots. Returns ``(key, value, key_cache, value_cache, slots)``."""
    g = _gen(device, seed)
    kc = torch.zeros(num_slots // block_size, block_size, num_kv_heads, head_dim, device=device,
                     dtype=dtype)  # fmt: skip
    vc = torch.zeros_like(kc)
    key = torch.randn(tokens, num_kv_heads, head_dim, device=device, dtype=dtype, generator=g)
    value = torch.randn(tokens, num_kv_heads, head_dim, device=device, dtype=dtype, generator=g)
    slots = torch.randperm(num_slots, device=device, generator=g)[:tokens].contiguous()
    return key, value, kc, vc, slots


def gather_case(*, seqs: int, context: int, block_size: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype, device: str, seed: int = 0):  # fmt: skip
    """``gather_kv_cache``'s inputs for ``seqs`` sequences of ``context`` tokens and its
    preallocated outputs: ``(key_cache, value_cache, block_table, cu_seq_lens, out)``."""
    g = _gen(device, seed)
    nb = -(-context // block_size)
    shape = (seqs * nb, block_size, num_kv_heads, head_dim)
    kc = torch.randn(shape, device=device, dtype=dtype, generator=g)
    vc = torch.randn(shape, device=device, dtype=dtype, generator=g)
    table = _scattered_table(seqs, [nb] * seqs, g, device)
    cu = torch.arange(seqs + 1, device=device, dtype=torch.int32) * context
    out = tuple(torch.empty(seqs * context, num_kv_heads, head_dim, device=device, dtype=dtype)
                for _ in range(2))  # fmt: skip
    return kc, vc, table, cu, out
