"""Hybrid-model page buffers for tests: attention K/V (or an MLA latent) and Mamba state per page.

`hybrid_kv` builds ``layout.make_hybrid_cache``'s pages ``[K_b][V_b][state_b]``. With
``kernel_block=kb`` each page of ``block_size`` tokens is split into ``k = block_size // kb``
kernel blocks, interleaved per kernel block as a serving engine does when its kernel wants smaller
blocks than the hybrid page (vLLM's kernel-block split): page ``b`` is ``[K_b0][V_b0] ...
[K_b(k-1)][V_b(k-1)]`` followed by the Mamba state padded to whole kernel-block pairs, so the
kernel sees one regular strided cache of kernel blocks and the block table skips the state slots.
`to_kernel_table` / `to_kernel_slots` translate page-level block tables and slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from portattn.layout import make_hybrid_cache


@dataclass
class HybridKV:
    buffer: torch.Tensor
    key_cache: torch.Tensor  # what the kernels get (kernel blocks when split)
    value_cache: torch.Tensor
    state: torch.Tensor  # [num_pages, state_bytes] uint8 view
    block_size: int  # page (logical block) size in tokens
    kernel_block: int  # tokens per kernel block (== block_size when not split)
    slots_per_page: int  # kernel blocks a page spans, state slots included

    @property
    def per_page(self) -> int:
        return self.block_size // self.kernel_block

    def to_kernel_table(self, table: torch.Tensor) -> torch.Tensor:
        """Page-level ``[num_seqs, max_pages]`` -> kernel-block ``[num_seqs, max_pages * k]``."""
        j = torch.arange(self.per_page, device=table.device)
        kt = table.long()[:, :, None] * self.slots_per_page + j
        return kt.reshape(table.shape[0], -1).to(table.dtype)

    def attention_blocks(self, num_pages: int) -> torch.Tensor:
        """The kernel blocks that hold attention tokens (not Mamba state) of every page."""
        return self.to_kernel_table(torch.arange(num_pages)[None, :]).flatten()

    def to_kernel_slots(self, slots: torch.Tensor) -> torch.Tensor:
        page, off = slots // self.block_size, slots % self.block_size
        kb = page * self.slots_per_page + off // self.kernel_block
        return torch.where(slots < 0, slots, kb * self.kernel_block + off % self.kernel_block)


def hybrid_kv(
    num_pages, block_size, num_kv_heads, head_dim, *, state_bytes, dtype, device,
    layout="NHD", kernel_block=None,
) -> HybridKV:  # fmt: skip
    if kernel_block is None or kernel_block == block_size:
        hc = make_hybrid_cache(
            num_pages, block_size, num_kv_heads, head_dim, mamba_state_bytes=state_bytes,
            layout=layout, dtype=dtype, device=device,
        )  # fmt: skip
        return HybridKV(hc.buffer, hc.key_cache, hc.value_cache, hc.mamba_state, block_size,
                        block_size, 1)  # fmt: skip
    k = block_size // kernel_block
    esize = torch.empty((), dtype=dtype).element_size()
    pair_bytes = 2 * kernel_block * num_kv_heads * head_dim * esize
    s = -(-state_bytes // pair_bytes)
    hc = make_hybrid_cache(
        num_pages * (k + s), kernel_block, num_kv_heads, head_dim, mamba_state_bytes=0,
        layout=layout, dtype=dtype, device=device,
    )  # fmt: skip
    state = hc.buffer.view(torch.uint8).as_strided(
        (num_pages, state_bytes), ((k + s) * pair_bytes, 1), k * pair_bytes
    )
    return HybridKV(hc.buffer, hc.key_cache, hc.value_cache, state, block_size, kernel_block, k + s)


@dataclass
class HybridLatent:
    """An MLA latent cache ``[num_kernel_blocks, kernel_block, head_dim_k]`` with Mamba state."""

    buffer: torch.Tensor
    kv_cache: torch.Tensor
    state: torch.Tensor
    block_size: int
    kernel_block: int
    slots_per_page: int

    to_kernel_table = HybridKV.to_kernel_table
    attention_blocks = HybridKV.attention_blocks
    per_page = HybridKV.per_page


def hybrid_latent(
    num_pages, block_size, head_dim_k, *, state_bytes, dtype, device, kernel_block=None
) -> HybridLatent:
    esize = torch.empty((), dtype=dtype).element_size()
    if kernel_block is None or kernel_block == block_size:  # [latent_b][state_b], unpadded
        page = block_size * head_dim_k + -(-state_bytes // esize)
        buffer = torch.empty(num_pages * page, dtype=dtype, device=device)
        cache = buffer.as_strided((num_pages, block_size, head_dim_k), (page, head_dim_k, 1))
        state = buffer.view(torch.uint8).as_strided(
            (num_pages, state_bytes), (page * esize, 1), block_size * head_dim_k * esize
        )
        return HybridLatent(buffer, cache, state, block_size, block_size, 1)
    kb = kernel_block
    k = block_size // kb
    slot_elems = kb * head_dim_k
    s = -(-state_bytes // (slot_elems * esize))  # state padded to whole kernel-block slots
    page = (k + s) * slot_elems
    buffer = torch.empty(num_pages * page, dtype=dtype, device=device)
    cache = buffer.as_strided((num_pages * (k + s), kb, head_dim_k), (slot_elems, head_dim_k, 1))
    state = buffer.view(torch.uint8).as_strided(
        (num_pages, state_bytes), (page * esize, 1), k * slot_elems * esize
    )
    return HybridLatent(buffer, cache, state, block_size, kb, k + s)
