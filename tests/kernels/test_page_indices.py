"""expand_page_indices against the reference: awkward block sizes, strides, empty sequences."""

from __future__ import annotations

import pytest
import torch

from portattn import reference
from portattn.kernels.page_indices import expand_page_indices
from portattn.policy.cache import PAGE_INDPTR_BLOCK

pytestmark = [pytest.mark.paged, pytest.mark.specdec]

BLOCK_SIZES = (1, 16, 80, 544, 2048)
INDEX_DTYPES = (torch.int32, torch.int64)


def _case(block_size, dtype, device, seed=0):
    """Partial last block, empty sequence, one token, exactly full rows; strided table."""
    max_blocks = 3
    lens = [block_size + block_size // 2 + 1, 0, 1, max_blocks * block_size, block_size]
    g = torch.Generator().manual_seed(seed)
    wide = torch.randint(0, 50, (max_blocks + 2, len(lens)), generator=g)
    table = wide.to(dtype).t()[:, 1 : max_blocks + 1].to(device)  # transposed, column-sliced
    seq_lens = torch.tensor(lens, dtype=dtype).to(device)[::1]
    return table, seq_lens


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_matches_reference(block_size, dtype, device):
    table, seq_lens = _case(block_size, dtype, device)
    indptr, indices = expand_page_indices(table, seq_lens, block_size)
    r_indptr, r_indices = reference.expand_page_indices(table.cpu(), seq_lens.cpu(), block_size)
    assert indptr.dtype == indices.dtype == torch.int64
    assert torch.equal(indptr.cpu(), r_indptr) and torch.equal(indices.cpu(), r_indices)


def test_docstring_example(device):
    table = torch.tensor([[5, 2], [7, 0]], device=device)
    indptr, indices = expand_page_indices(table, torch.tensor([3, 1], device=device), 2)
    assert indptr.tolist() == [0, 3, 4]
    assert indices.tolist() == [10, 11, 4, 14]


def test_many_sequences_carry_across_prefix_sum_chunks(device):
    """More sequences than one indptr step (the scan carries its running total)."""
    n = 2 * PAGE_INDPTR_BLOCK + 7
    g = torch.Generator().manual_seed(3)
    seq_lens = torch.randint(0, 9, (n,), generator=g)
    table = torch.randint(0, 100, (n, 3), generator=g, dtype=torch.int32)
    seq_lens_s = torch.stack([seq_lens, seq_lens]).t()[:, 1]  # stride 2
    indptr, indices = expand_page_indices(table.to(device), seq_lens_s.to(device), 3)
    r_indptr, r_indices = reference.expand_page_indices(table, seq_lens, 3)
    assert torch.equal(indptr.cpu(), r_indptr) and torch.equal(indices.cpu(), r_indices)


def test_given_num_indices_and_empty_batches(device):
    table = torch.tensor([[4, 1]], device=device)
    indptr, indices = expand_page_indices(table, torch.tensor([5], device=device), 4, num_indices=5)
    assert indices.tolist() == [16, 17, 18, 19, 4]
    indptr, indices = expand_page_indices(table, torch.tensor([0], device=device), 4)
    assert indptr.tolist() == [0, 0] and indices.numel() == 0
    empty = torch.empty((0, 2), dtype=torch.int64, device=device)
    indptr, indices = expand_page_indices(
        empty, torch.empty(0, dtype=torch.int64, device=device), 4
    )
    assert indptr.tolist() == [0] and indices.numel() == 0


def test_negative_block_entries_are_padding(device):
    table = torch.tensor([[3, -1]], device=device)
    _, indices = expand_page_indices(table, torch.tensor([4], device=device), 2)
    assert indices.tolist() == [6, 7, -1, -1]


OP = "expand_page_indices"
_T = torch.tensor([[0, 1], [2, 3]])
_L = torch.tensor([3, 4])
ERRORS = [
    (dict(block_table=[[0]]), TypeError, f"{OP}: block_table must be a torch.Tensor; got list"),
    (dict(seq_lens=_L.float()), TypeError, f"{OP}: seq_lens dtype must be int32 or int64; got "),
    (
        dict(block_size=0),
        ValueError,
        rf"{OP}: block_size must be an int in \[1, 2\*\*63 - 1\]; got 0",
    ),
    (dict(block_size=True), TypeError, "block_size must be an int in .*; got True"),
    (dict(block_size=2.0), TypeError, "block_size must be an int in .*; got 2.0"),
    (dict(num_indices="4"), TypeError, "num_indices must be an int or None; got str"),
    # past int64: numpy's checks and the kernel's argument cannot hold it
    (dict(block_size=2**63), ValueError, f"block_size must be an int in .*; got {2**63}"),
    (dict(block_table=_T[0]), ValueError, r"block_table must be 2-D \[num_seqs, max_blocks\]"),
    (dict(seq_lens=_L[None]), ValueError, r"seq_lens must be 1-D \[num_seqs\]; got \(1, 2\)"),
    (dict(seq_lens=_L[:1]), ValueError, r"seq_lens must have one entry per block_table row \(2\)"),
    (dict(seq_lens=_L.to("meta")), ValueError, "block_table and seq_lens must be on one device"),
    (dict(num_indices=-1), ValueError, r"num_indices must be in \[0, 2\*\*60\) \(8 bytes each"),
    # the int64 indices tensor of 2**60 slots has 2**63 bytes: torch cannot size it
    (
        dict(block_table=_T.to("meta"), seq_lens=_L.to("meta"), num_indices=2**60),
        ValueError,
        f"num_indices must be in .*; got {2**60}",
    ),
    (
        dict(seq_lens=torch.tensor([2**60, 0]), block_size=2**60),
        ValueError,
        rf"sum\(seq_lens\) must be < 2\*\*60 \(8 bytes each .*; got {2**60}",
    ),
    # past int64 torch cannot allocate the output (meta: no content check to catch it)
    (dict(num_indices=2**63), ValueError, f"num_indices must be in .*; got {2**63}"),
    (
        dict(block_table=_T.to("meta"), seq_lens=_L.to("meta"), num_indices=2**70),
        ValueError,
        f"num_indices must be in .*; got {2**70}",
    ),
    (dict(seq_lens=torch.tensor([3, -1])), ValueError, f"{OP}: seq_lens must be >= 0"),
    (
        dict(seq_lens=torch.tensor([3, 9])),
        ValueError,
        r"block_table must have a column per block of each sequence; got seq_lens\[1\]=9",
    ),
]


@pytest.mark.parametrize("over, exc, msg", ERRORS)
def test_validation(over, exc, msg):
    args = dict(block_table=_T, seq_lens=_L, block_size=4)
    args.update(over)
    block_table, seq_lens, block_size = (
        args.pop("block_table"),
        args.pop("seq_lens"),
        args.pop("block_size"),
    )
    with pytest.raises(exc, match=msg):
        expand_page_indices(block_table, seq_lens, block_size, **args)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", (16, 2048))
def test_gpu_matches_reference(block_size):
    g = torch.Generator().manual_seed(0)
    num_seqs, max_blocks = 64, 8
    seq_lens = torch.randint(0, max_blocks * block_size + 1, (num_seqs,), generator=g)
    table = torch.randint(0, 4096, (num_seqs, max_blocks), generator=g, dtype=torch.int32)
    indptr, indices = expand_page_indices(table.cuda(), seq_lens.cuda(), block_size)
    r_indptr, r_indices = reference.expand_page_indices(table, seq_lens, block_size)
    assert torch.equal(indptr.cpu(), r_indptr) and torch.equal(indices.cpu(), r_indices)
