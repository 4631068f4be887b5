"""A draft model's paged attention and a target model's MLA decode in one KV-cache group.

Block-size negotiation finds the size both support (`select_common_block_size`); an MLA path
that wants page size 1 gets flat indices from `expand_page_indices` instead of forcing the group
to size 1; both MLA paths give identical results; negotiation that cannot succeed lists every
participant's constraint (docs/design.md lesson 5).
"""

from __future__ import annotations

import pytest
import torch

from portattn import (
    MultipleOf,
    Participant,
    expand_page_indices,
    participant,
    select_common_block_size,
)
from portattn import reference as ref
from portattn.hybrid import align_block_size
from portattn.kernels.mla_decode import mla_decode
from portattn.kernels.paged_attention import paged_attention
from tests.helpers import assert_low_precision_close
from tests.specdec._batch import make_group

pytestmark = pytest.mark.specdec

# The draft model's paged attention, as a FlashAttention-style backend declares it.
DRAFT = Participant("draft paged_attention", (MultipleOf(16),))
# A target MLA kernel that only addresses page size 1 (FlashInfer-style): it takes flat indices.
PAGE_SIZE_1 = Participant("target MLA (page size 1)", (1,))
RANK, ROPE = 32, 16
# (minimum block size the group needs, e.g. a hybrid model's Mamba page; expected size).
NEGOTIATIONS = ((1, 16), (16, 16), (17, 32), (544, 544), (1000, 1008))


@pytest.mark.parametrize(("min_block_size", "expected"), NEGOTIATIONS)
def test_draft_and_mla_target_negotiate(min_block_size, expected):
    target = participant("mla_decode", "target mla_decode")
    size = select_common_block_size(DRAFT, target, min_block_size=min_block_size)
    assert size == expected
    assert DRAFT.accepts(size) and target.accepts(size)


def test_hybrid_target_page_with_flashmla_style_multiple():
    """A 64-multiple MLA target and a 16-multiple draft over a hybrid model's 544-token pages."""
    target = Participant("target FlashMLA-style", (MultipleOf(64),))
    size = select_common_block_size(DRAFT, target, min_block_size=544)
    assert size == 576 == align_block_size(544, 1, 64)


def test_page_size_1_target_cannot_join_a_16_multiple_group():
    with pytest.raises(
        ValueError,
        match=r"constraints: draft paged_attention: MultipleOf\(16\); "
        r"target MLA \(page size 1\): 1$",
    ):
        select_common_block_size(DRAFT, PAGE_SIZE_1)


def test_exact_block_sizes_that_disagree_list_every_constraint():
    a = Participant("draft FA (exact)", (16,))
    b = Participant("target MLA (exact)", (64,))
    c = Participant("mamba page", (MultipleOf(8),))
    with pytest.raises(
        ValueError,
        match=r"no block size >= 1 .* constraints: draft FA \(exact\): 16; "
        r"target MLA \(exact\): 64; mamba page: MultipleOf\(8\)",
    ):
        select_common_block_size(a, b, c)


@pytest.mark.parametrize("block_size", (16, 32))
def test_both_models_in_one_group(device, block_size):
    """One block table at the negotiated size serves the draft's attention and the target's MLA;
    the target's page-size-1 path (expanded indices) equals its block-table path exactly."""
    seqs = ((block_size * 2 + 5, 1), (block_size + 9, 4), (7, 3))
    group = make_group(seqs, block_size=block_size, hkv=2, d=32, latent_dim=RANK + ROPE,
                       dtype=torch.float16, device=device)  # fmt: skip
    assert select_common_block_size(DRAFT, participant("mla_decode"), preferred=block_size) == (
        block_size
    )
    g = torch.Generator().manual_seed(5)
    n = int(group.query_start_loc[-1])
    q = torch.randn((n, 4, 32), generator=g).to(torch.float16).to(device)
    args = (group.key_cache, group.value_cache, group.block_table, group.seq_lens,
            group.query_start_loc)  # fmt: skip
    out = paged_attention(q, *args)
    assert_low_precision_close(
        out.cpu(), ref.paged_attention(q, *args),
        ref.paged_attention(q, *args, compute_dtype=torch.float16),
    )  # fmt: skip

    qm = torch.randn((n, 4, RANK + ROPE), generator=g).to(torch.float16).to(device)
    kw = dict(kv_lora_rank=RANK, scale=0.125, query_start_loc=group.query_start_loc)
    by_table = mla_decode(qm, group.latent, group.block_table, group.seq_lens, **kw)
    pages = expand_page_indices(group.block_table, group.seq_lens, block_size)
    by_index = mla_decode(qm, group.latent, None, group.seq_lens, page_indices=pages, **kw)
    assert torch.equal(by_table, by_index)
    # ... and the flat indices really are page size 1: the latent seen as [slots, 1, dk].
    flat = group.latent.reshape(-1, 1, RANK + ROPE)
    by_page1 = mla_decode(qm, flat, None, group.seq_lens, page_indices=pages, **kw)
    assert torch.equal(by_table, by_page1)
    oracle, _ = ref.mla_decode(qm, group.latent, group.block_table, group.seq_lens, **kw)
    lowp, _ = ref.mla_decode(qm, group.latent, group.block_table, group.seq_lens,
                             compute_dtype=torch.float16, **kw)  # fmt: skip
    assert_low_precision_close(by_table.cpu(), oracle, lowp)
