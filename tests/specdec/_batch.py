"""Speculative-decoding batches: a draft model's K/V cache and a target model's MLA latent cache
sharing one KV-cache group (one block size, one block table), with verification query lengths."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Group:
    block_size: int
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32, shared by both models
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    key_cache: torch.Tensor  # draft: [num_blocks, block_size, hkv, d]
    value_cache: torch.Tensor
    latent: torch.Tensor  # target: [num_blocks, block_size, rank + rope]

    @property
    def q_lens(self) -> list[int]:
        return (self.query_start_loc[1:] - self.query_start_loc[:-1]).tolist()


def make_group(seqs, *, block_size, hkv, d, latent_dim, dtype, device, seed=0) -> Group:
    """``seqs``: ``(seq_len, q_len)`` per sequence; blocks are a random permutation."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n, _ in seqs]
    num_blocks = sum(per_seq) + 2
    order = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.full((len(seqs), max(per_seq)), -1, dtype=torch.int32)
    i = 0
    for s, n in enumerate(per_seq):
        table[s, :n] = torch.tensor(order[i : i + n])
        i += n
    rnd = lambda *shape: torch.randn(shape, generator=g).to(dtype).to(device)  # noqa: E731
    qsl = torch.tensor([0, *torch.tensor([q for _, q in seqs]).cumsum(0).tolist()])
    return Group(
        block_size=block_size,
        block_table=table.to(device),
        seq_lens=torch.tensor([n for n, _ in seqs], dtype=torch.int32, device=device),
        query_start_loc=qsl.to(torch.int32).to(device),
        key_cache=rnd(num_blocks, block_size, hkv, d),
        value_cache=rnd(num_blocks, block_size, hkv, d),
        latent=rnd(num_blocks, block_size, latent_dim),
    )


def per_position(group: Group, one_row):
    """Stack ``one_row(seq, pos, prefix_len)`` over every query position of every sequence.

    Each position's reference is computed as a single-token decode over its OWN causal prefix
    (``seq_len - q_len + j + 1`` tokens), independently of the other positions.
    """
    rows = []
    for s, (n, q) in enumerate(zip(group.seq_lens.tolist(), group.q_lens, strict=True)):
        for j in range(q):
            rows.append(one_row(s, j, n - q + j + 1))
    return torch.cat(rows)
