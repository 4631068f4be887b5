"""MLA decode: interpreter tests on small shapes (CPU gate) and bf16 tests at real shapes (gpu)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from triton.errors import TritonError

from portattn import reference
from portattn.kernels._launch import run_all
from portattn.kernels.mla_decode import mla_decode, plan_mla_decode
from portattn.kernels.page_indices import expand_page_indices
from portattn.platform import get_target, target_for_tensor
from portattn.policy.common import next_pow2
from portattn.policy.mla import MlaConfig, MlaProblem, mla_decode_tiles
from tests.helpers import assert_low_precision_close

pytestmark = pytest.mark.mla

# (head_dim_k, kv_lora_rank): DeepSeek-V3, Mistral-Small-4, 32-wide rope, small, no rope part.
SHAPES = [(576, 512), (320, 256), (288, 256), (192, 128), (256, 256)]
HEADS = [1, 3, 4, 8, 16, 128]
BLOCK_SIZES = [1, 16, 64]
FP32_FLOOR = 1e-6  # fp32: torch's own error is ~1e-7; the kernel's a few ulps more

# Each awkward value appears in at least one case (not the cross product: the interpreter is slow
# with 512-wide tiles). Fields: (dk, r), heads, block_size, q_lens (None = plain decode),
# seq_lens, dtype, index form.
CASES = [
    ((576, 512), 16, 16, None, (1, 37), torch.float32, "block_table"),
    ((320, 256), 3, 1, (3, 1, 6), (9, 4, 30), torch.float16, "page_indices"),
    ((288, 256), 4, 64, (2, 8), (8, 40), torch.float32, "block_table"),
    ((192, 128), 128, 16, (1, 2), (23, 5), torch.float16, "block_table"),
    ((256, 256), 8, 1, (1, 5), (1, 12), torch.float32, "page_indices"),
    ((576, 512), 1, 64, (7, 3), (7, 40), torch.float16, "page_indices"),
    ((320, 256), 16, 64, None, (1, 64, 65), torch.float32, "block_table"),
    ((192, 128), 3, 1, (4, 1, 1, 6), (4, 1, 17, 33), torch.float32, "block_table"),
    # latent and rope parts narrower than a dot's 16 columns: padded tiles, masked columns
    ((16, 8), 4, 16, (2, 1), (9, 30), torch.float32, "block_table"),
    ((8, 8), 3, 1, None, (5, 17), torch.float16, "page_indices"),
    ((10, 3), 2, 16, None, (20, 3), torch.float32, "block_table"),
    # rows of strides no multiple of 16 elements (rope 8): addressed in units of 8 (KV_VEC)
    ((136, 128), 16, 16, None, (5, 40), torch.float16, "block_table"),
    ((136, 128), 4, 3, (2, 1), (9, 30), torch.float16, "page_indices"),
]


def _ids(case) -> str:
    (dk, r), h, bs, ql, sl, dt, form = case
    return f"{dk}-{r}_h{h}_bs{bs}_q{'x'.join(map(str, ql or [1]))}_{str(dt)[6:]}_{form}"


def make_inputs(
    dk, r, heads, block_size, q_lens, seq_lens, dtype, device, *, spare_blocks=2, seed=0
):
    """Random query and cache; blocks shuffled; block-table padding is -1 (never read)."""
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(nblk) + spare_blocks
    cache = torch.randn(num_blocks, block_size, dk, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    bt = torch.full((len(seq_lens), max(nblk) + 1), -1, dtype=torch.int32)
    k = 0
    for i, n in enumerate(nblk):
        bt[i, :n] = perm[k : k + n]
        k += n
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    if q_lens is None:
        qsl, num_tokens = None, len(seq_lens)
    else:
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        num_tokens = int(qsl[-1])
    q = torch.randn(num_tokens, heads, dk, generator=g).to(dtype)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return to(q), to(cache), to(bt), to(sl), to(qsl)


def check(out, lse, q, cache, bt, sl, qsl, r, scale, dtype, lse_rtol=None):
    """The tolerance rule against the fp64 oracle; lse against the oracle's."""
    oracle, lse_ref = reference.mla_decode(
        q, cache, bt, sl, kv_lora_rank=r, scale=scale, query_start_loc=qsl
    )
    lowp, _ = reference.mla_decode(
        q, cache, bt, sl, kv_lora_rank=r, scale=scale, query_start_loc=qsl, compute_dtype=dtype
    )
    floor = FP32_FLOOR if dtype == torch.float32 else 0.0
    assert_low_precision_close(out, oracle, lowp, floor=floor)
    if lse is not None:
        assert lse.dtype == torch.float32 and lse.shape == q.shape[:2]
        torch.testing.assert_close(lse.double().cpu(), lse_ref, rtol=lse_rtol or 1e-4, atol=1e-4)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_matches_oracle(case, device):
    (dk, r), heads, bs, q_lens, seq_lens, dtype, form = case
    q, cache, bt, sl, qsl = make_inputs(dk, r, heads, bs, q_lens, seq_lens, dtype, device)
    scale = 1 / math.sqrt(dk)
    kw = dict(kv_lora_rank=r, scale=scale, query_start_loc=qsl, return_lse=True)
    if form == "page_indices":
        pages = tuple(t.to(device) for t in reference.expand_page_indices(bt.cpu(), sl.cpu(), bs))
        out, lse = mla_decode(q, cache, None, sl, page_indices=pages, **kw)
    else:
        out, lse = mla_decode(q, cache, bt, sl, **kw)
    assert out.shape == (q.shape[0], heads, r) and out.dtype == dtype
    check(out, lse, q, cache, bt, sl, qsl, r, scale, dtype)


@pytest.mark.parametrize("block_size", [1, 16])
def test_page_indices_identical_to_block_table(block_size, device):
    q, cache, bt, sl, qsl = make_inputs(
        320, 256, 4, block_size, (3, 1), (20, 33), torch.float16, device
    )
    kw = dict(kv_lora_rank=256, scale=0.06, query_start_loc=qsl, return_lse=True)
    a, la = mla_decode(q, cache, bt, sl, **kw)
    pages = expand_page_indices(bt, sl, block_size)  # the kernel, not the reference
    ref_pages = reference.expand_page_indices(bt.cpu(), sl.cpu(), block_size)
    assert all(torch.equal(x.cpu().long(), y) for x, y in zip(pages, ref_pages, strict=True))
    b, lb = mla_decode(q, cache, None, sl, page_indices=pages, **kw)
    assert torch.equal(a, b) and torch.equal(la, lb)


@pytest.mark.parametrize("gap", [0, 3])
def test_page_indices_on_pages_with_gaps(gap, device):
    """``page_indices`` are flat slots (``block * block_size + offset``). Into a cache whose pages
    lie one after another the portable kernel reads slot ``s`` at ``s`` rows (FLAT_SLOTS: no
    division by the block size); with ``gap`` rows between pages (a view of a wider buffer) it
    splits the slot into block and offset. Both agree with the block table's result on the same
    cache. (The portable kernel's tiles, ``sm90_ready`` False: on sm_90 16-bit launches would
    take the Hopper kernel's wide tile.)"""
    q, cache, bt, sl, qsl = make_inputs(320, 256, 4, 16, (3, 1), (20, 33), torch.float16, device)
    wide = torch.zeros(cache.shape[0], 16 + gap, 320, dtype=cache.dtype, device=device)
    wide[:, :16] = cache
    cache = wide[:, :16]  # stride(0) = (16 + gap) rows
    problem = MlaProblem(4, 320, 256, 2, q.shape[0], 64, sm90_ready=False)
    tiles = mla_decode_tiles(target_for_tensor(q), problem)
    kw = dict(kv_lora_rank=256, scale=0.06, query_start_loc=qsl, return_lse=True, tiles=tiles)
    pages = expand_page_indices(bt, sl, 16)
    by_table = plan_mla_decode(q, cache, bt, sl, **kw)
    by_slots = plan_mla_decode(q, cache, None, sl, page_indices=pages, **kw)
    assert by_slots[0].name == "mla_decode" and by_slots[0].args["FLAT_SLOTS"] is (gap == 0)
    run_all(by_table)
    run_all(by_slots)
    (a, la), (b, lb) = by_table[0].outputs, by_slots[0].outputs
    assert torch.equal(a, b) and torch.equal(la, lb)
    check(b, lb, q, cache, bt, sl, qsl, 256, 0.06, torch.float16)


def _split_tiles(target, dk, r, heads, splits, block_n=16, elem=4):
    base = mla_decode_tiles(target, MlaProblem(heads, dk, r, elem, 8, 64))
    return dataclasses.replace(base, num_kv_splits=splits, block_n=block_n)


def _run_checked(q, cache, bt, sl, qsl, r, tiles, *, page_indices=None, oracle_cache=None):
    """Plan with injected ``tiles`` (scale 0.05, lse returned; ``page_indices`` instead of the
    block table when given), run, check against the oracle on ``oracle_cache`` (default:
    ``cache``); returns the launches for assertions about the plan."""
    launches = plan_mla_decode(
        q, cache, None if page_indices is not None else bt, sl, kv_lora_rank=r, scale=0.05,
        query_start_loc=qsl, return_lse=True, page_indices=page_indices, tiles=tiles,
    )  # fmt: skip
    run_all(launches)
    out, lse = launches[0].outputs
    oracle_cache = cache if oracle_cache is None else oracle_cache
    check(out, lse, q, oracle_cache, bt, sl, qsl, r, 0.05, torch.float32)
    return launches


def _run_with_poisoned_workspace(launches, heads: int) -> None:
    """Run a split-KV plan whose partial workspaces start as NaN, then assert that the attention
    launch wrote every real head's rows of every token and no padded head's row (the reduce reads
    only real heads: a padded row written is memory traffic for nothing)."""
    part_out, part_lse = launches[0].args["part_out_ptr"], launches[0].args["part_lse_ptr"]
    assert part_out.shape[2] > heads, "the tiles pad no head: nothing to check"
    part_out.fill_(float("nan"))
    part_lse.fill_(float("nan"))
    run_all(launches)
    assert not part_out[:, :, :heads].isnan().any() and not part_lse[:, :, :heads].isnan().any()
    assert part_out[:, :, heads:].isnan().all() and part_lse[:, :, heads:].isnan().all()


@pytest.mark.parametrize(
    ("dk", "r", "heads", "splits", "q_lens", "seq_lens"),
    [
        (576, 512, 3, 3, (1, 1), (40, 17)),  # every split busy / some empty
        (320, 256, 16, 5, (6, 1), (30, 1)),  # verification tokens + seq_len 1 with empty splits
    ],
)
def test_split_kv_reduce(dk, r, heads, splits, q_lens, seq_lens, device):
    q, cache, bt, sl, qsl = make_inputs(dk, r, heads, 16, q_lens, seq_lens, torch.float32, device)
    tiles = _split_tiles(get_target("sm_90"), dk, r, heads, splits)
    launches = _run_checked(q, cache, bt, sl, qsl, r, tiles)
    assert [x.name for x in launches] == ["mla_decode", "mla_decode_reduce"]


def test_prefetched_rows(device):
    # tile i+1's rows are computed during tile i: 40 tokens = 3 tiles of 16, a split boundary,
    # a sequence shorter than one tile; verification tokens
    dk, r, heads = 288, 256, 4
    q, cache, bt, sl, qsl = make_inputs(dk, r, heads, 16, (2, 1), (40, 9), torch.float32, device)
    tiles = dataclasses.replace(_split_tiles(get_target("sm_90"), dk, r, heads, 2),
                                prefetch_rows=True)  # fmt: skip
    launches = _run_checked(q, cache, bt, sl, qsl, r, tiles)
    assert launches[0].args["PREFETCH_ROWS"] is True


def test_split_partials_skip_padded_heads(device):
    """3 heads padded to the 16-row tile, 3 splits (one empty for the short sequence): the
    partials of the real heads only, and the reduced output against the oracle."""
    dk, r, heads = 320, 256, 3
    q, cache, bt, sl, qsl = make_inputs(dk, r, heads, 16, (2, 1), (40, 9), torch.float32, device)
    tiles = _split_tiles(get_target("sm_90"), dk, r, heads, 3)
    assert tiles.padded_heads == 16
    launches = plan_mla_decode(q, cache, bt, sl, kv_lora_rank=r, scale=0.05,
                               query_start_loc=qsl, return_lse=True, tiles=tiles)  # fmt: skip
    _run_with_poisoned_workspace(launches, heads)
    out, lse = launches[0].outputs
    check(out, lse, q, cache, bt, sl, qsl, r, 0.05, torch.float32)


def _poison_unowned_rows(cache, bt, sl):
    """NaN in every cache row no sequence owns (spare blocks, rows past each context's end)."""
    owned = torch.zeros(cache.shape[:2], dtype=torch.bool, device=cache.device)
    bs = cache.shape[1]
    for i, n in enumerate(sl.tolist()):
        pos = torch.arange(n, device=cache.device)
        owned[bt[i, pos // bs].long(), pos % bs] = True
    cache[~owned] = float("nan")


@pytest.mark.parametrize(("splits", "strided"), [(1, False), (2, True)])
def test_bulk_copy_tiles(splits, strided, device):
    """Whole tiles inside one page come from tensor descriptors (TMA on sm_90), the partial last
    tile of each split from the gather; unowned rows are NaN, so any wrong row shows."""
    dk, r, heads = 288, 256, 4
    q, cache0, bt, sl, qsl = make_inputs(
        dk, r, heads, 32, (2, 1, 1), (40, 9, 64), torch.float32, device
    )
    _poison_unowned_rows(cache0, bt, sl)
    if strided:  # padded rows and blocks, 16-byte aligned: still descriptor-legal
        big = torch.full((cache0.shape[0], 40, dk + 32), float("nan"), device=device)
        big[:, :32, 16 : 16 + dk] = cache0
        cache = big[:, :32, 16 : 16 + dk]
    else:
        cache = cache0
    tiles = dataclasses.replace(_split_tiles(get_target("sm_90"), dk, r, heads, splits), tma=True)
    launches = _run_checked(q, cache, bt, sl, qsl, r, tiles, oracle_cache=cache0)
    assert launches[0].args["TMA"] is True


@pytest.mark.parametrize("why", ["page_indices", "tile_across_pages", "padded_columns"])
def test_bulk_copy_falls_back_to_gather(why, device):
    """Where a descriptor cannot load a whole tile, the same tiles gather row by row."""
    dk, r, heads = (320, 256, 4) if why != "padded_columns" else (300, 256, 4)
    bs = 8 if why == "tile_across_pages" else 16
    q, cache, bt, sl, qsl = make_inputs(dk, r, heads, bs, (2, 1), (40, 9), torch.float32, device)
    tiles = dataclasses.replace(_split_tiles(get_target("sm_90"), dk, r, heads, 1), tma=True)
    pages = None
    if why == "page_indices":
        pages = tuple(t.to(device) for t in reference.expand_page_indices(bt.cpu(), sl.cpu(), bs))
    launches = _run_checked(q, cache, bt, sl, qsl, r, tiles, page_indices=pages)
    assert launches[0].args["TMA"] is False


def test_strided_inputs_and_out_in_place(device):
    """Query, cache and out as non-contiguous views (cache rows padded, blocks interleaved)."""
    dk, r, heads = 288, 256, 4
    q0, cache0, bt, sl, qsl = make_inputs(dk, r, heads, 16, (2, 3), (9, 30), torch.float32, device)
    big = torch.full((cache0.shape[0], 2, 16, dk + 32), float("nan"), device=device)
    big[:, 1, :, 16 : 16 + dk] = cache0
    cache = big[:, 1, :, 16 : 16 + dk]  # stride_block 2*16*320, stride_tok 320, offset 16
    qbig = torch.full((q0.shape[0], heads, 2 * dk), float("nan"), device=device)
    qbig[:, :, ::2] = q0
    q = qbig[:, :, ::2]  # stride_dim 2
    outbig = torch.full((q0.shape[0], r, heads), -7.0, device=device)
    out = outbig.transpose(1, 2)
    res = mla_decode(q, cache, bt, sl, kv_lora_rank=r, scale=0.06, query_start_loc=qsl, out=out)
    assert res.data_ptr() == out.data_ptr()
    check(out, None, q0, cache0, bt, sl, qsl, r, 0.06, torch.float32)


@pytest.mark.parametrize("splits", [None, 3])
def test_graph_padding_rows_untouched(splits, device):
    """Rows past query_start_loc[-1] (a CUDA graph's padded batch) are not written, by the
    attention launch nor (split KV, some splits empty) by the reduce."""
    q, cache, bt, sl, qsl = make_inputs(192, 128, 3, 16, (2, 1), (40, 9), torch.float32, device)
    qpad = torch.cat([q, torch.randn(3, 3, 192, device=device)])
    out = torch.full((6, 3, 128), -7.0, device=device)
    kw = dict(kv_lora_rank=128, scale=0.07, query_start_loc=qsl, out=out)
    if splits is None:
        mla_decode(qpad, cache, bt, sl, **kw)
    else:
        tiles = _split_tiles(get_target("sm_90"), 192, 128, 3, splits)
        launches = plan_mla_decode(qpad, cache, bt, sl, tiles=tiles, **kw)
        assert [x.name for x in launches] == ["mla_decode", "mla_decode_reduce"]
        run_all(launches)
    assert (out[3:] == -7.0).all()
    check(out[:3], None, q, cache, bt, sl, qsl, 128, 0.07, torch.float32)


def test_naive_head_dim_tiles_rejected(device):
    """Lesson 1's naive rule (value tile from head_dim_k) cannot run: the kernel refuses it."""
    q, cache, bt, sl, _ = make_inputs(320, 256, 4, 16, None, (5, 20), torch.float32, device)
    good = mla_decode_tiles(get_target("sm_90"), MlaProblem(4, 320, 256, 4, 2, 32))
    naive = dataclasses.replace(good, block_dv=next_pow2(320), block_dpe=0)
    with pytest.raises(TritonError, match="BLOCK_DV must be next_pow2"):
        run_all(plan_mla_decode(q, cache, bt, sl, kv_lora_rank=256, scale=0.1, tiles=naive))


# -- validation: every message ----------------------------------------------------------------


def _valid_args():
    q, cache, bt, sl, qsl = make_inputs(320, 256, 4, 16, (2, 1), (5, 9), torch.float32, "cpu")
    return dict(
        query=q,
        kv_cache=cache,
        block_table=bt,
        seq_lens=sl,
        kv_lora_rank=256,
        scale=0.1,
        query_start_loc=qsl,
    )


def _pages(a):
    return reference.expand_page_indices(a["block_table"], a["seq_lens"], 16)


ERRORS = [
    (
        TypeError,
        "query must be a float16/bfloat16/float32 tensor; got tensor of dtype torch.int32",
        lambda a: a.update(query=a["query"].int()),
    ),
    (
        TypeError,
        "kv_cache must be a tensor of query's dtype torch.float32; got tensor of dtype "
        "torch.float16",
        lambda a: a.update(kv_cache=a["kv_cache"].half()),
    ),
    (
        TypeError,
        "out must be None or a tensor of query's dtype",
        lambda a: a.update(out=torch.empty(3, 4, 256, dtype=torch.float16)),
    ),
    (TypeError, "kv_lora_rank must be an int; got float", lambda a: a.update(kv_lora_rank=256.0)),
    (TypeError, "scale must be a real number; got str", lambda a: a.update(scale="0.1")),
    (TypeError, "return_lse must be a bool; got int", lambda a: a.update(return_lse=1)),
    (
        TypeError,
        "seq_lens must be an int32/int64 tensor; got tensor of dtype torch.float32",
        lambda a: a.update(seq_lens=a["seq_lens"].float()),
    ),
    (
        TypeError,
        "block_table must be an int32/int64 tensor",
        lambda a: a.update(block_table=a["block_table"].float()),
    ),
    (
        TypeError,
        "query_start_loc must be an int32/int64 tensor",
        lambda a: a.update(query_start_loc=[0, 2, 3]),
    ),
    (
        TypeError,
        r"page_indices must be a pair \(indptr, indices\); got tensor",
        lambda a: a.update(block_table=None, page_indices=_pages(a)[1]),
    ),
    (
        TypeError,
        r"page_indices\[1\] \(indices\) must be an int32/int64 tensor",
        lambda a: a.update(block_table=None, page_indices=(_pages(a)[0], _pages(a)[1].float())),
    ),
    (
        TypeError,
        "metadata must be None or an MlaMetadata; got dict",
        lambda a: a.update(metadata={}),
    ),
    (
        ValueError,
        r"query must be 3-D \[num_tokens, num_q_heads, head_dim_k\]; got shape \(3, "
        r"1280\)",
        lambda a: a.update(query=a["query"].reshape(3, -1)),
    ),
    (
        ValueError,
        r"query must have num_q_heads >= 1 and head_dim_k >= 1; got shape \(3, 0, 320\)",
        lambda a: a.update(query=a["query"][:, :0]),
    ),
    (
        ValueError,
        r"kv_cache must be \[num_blocks, block_size, head_dim_k=320\]; got shape "
        r"\(4, 16, 256\)",
        lambda a: a.update(kv_cache=a["kv_cache"][..., :256]),
    ),
    (
        ValueError,
        r"kv_cache must have num_blocks >= 1 and block_size >= 1; got shape "
        r"\(0, 16, 320\)",
        lambda a: a.update(kv_cache=a["kv_cache"][:0]),
    ),
    (
        ValueError,
        "kv_lora_rank must be in 1..head_dim_k=320; got 384",
        lambda a: a.update(kv_lora_rank=384),
    ),
    (
        ValueError,
        r"scale must be a finite float in \(0, 2.359e\+38\] .*; got -0.1",
        lambda a: a.update(scale=-0.1),
    ),
    (
        ValueError,
        r"scale must be a finite float in \(0, .*; got nan",
        lambda a: a.update(scale=math.nan),
    ),
    (
        ValueError,
        r"seq_lens must be 1-D with >= 1 sequence; got shape \(0,\)",
        lambda a: a.update(seq_lens=a["seq_lens"][:0]),
    ),
    (
        ValueError,
        "exactly one of block_table and page_indices must be given; got both",
        lambda a: a.update(page_indices=_pages(a)),
    ),
    (
        ValueError,
        "exactly one of block_table and page_indices must be given; got neither",
        lambda a: a.update(block_table=None),
    ),
    (
        ValueError,
        r"block_table must be \[num_seqs=2, max_blocks_per_seq >= 1\]; got shape "
        r"\(3, 2\)",
        lambda a: a.update(block_table=torch.zeros(3, 2, dtype=torch.int32)),
    ),
    (
        ValueError,
        r"page_indices\[0\] \(indptr\) must have shape \(3,\); got \(2,\)",
        lambda a: a.update(block_table=None, page_indices=(_pages(a)[0][:2], _pages(a)[1])),
    ),
    (
        ValueError,
        r"page_indices\[1\] \(indices\) must be 1-D; got shape \(1, 14\)",
        lambda a: a.update(block_table=None, page_indices=(_pages(a)[0], _pages(a)[1][None])),
    ),
    (
        ValueError,
        r"query_start_loc must have shape \(num_seqs \+ 1,\) = \(3,\); got \(2,\)",
        lambda a: a.update(query_start_loc=a["query_start_loc"][:2]),
    ),
    (
        ValueError,
        "query must have one token per sequence without query_start_loc; got 3 tokens "
        "for 2 sequences",
        lambda a: a.update(query_start_loc=None),
    ),
    (
        ValueError,
        r"out must have shape \(3, 4, 256\); got \(3, 4, 320\)",
        lambda a: a.update(out=torch.empty(3, 4, 320)),
    ),
    (
        ValueError,
        "kv_cache must be on query's device cpu; got meta",
        lambda a: a.update(kv_cache=a["kv_cache"].to("meta")),
    ),
]


@pytest.mark.parametrize(("exc", "match", "mutate"), ERRORS, ids=[e[1][:40] for e in ERRORS])
def test_validation_error(exc, match, mutate):
    a = _valid_args()
    mutate(a)
    with pytest.raises(exc, match=f"^mla_decode: .*{match}"):
        plan_mla_decode(**a)


def test_validation_collects_every_reason():
    a = _valid_args()
    a.update(kv_lora_rank=384, scale=0.0, out=torch.empty(1, 1, 1))
    with pytest.raises(ValueError, match=r"kv_lora_rank must .*; scale must .*; out must"):
        plan_mla_decode(**a)


# -- GPU: bf16 at real shapes ------------------------------------------------------------------


GPU_CASES = [
    # (dk, r), heads, block_size, q_lens, seq_lens
    ((576, 512), 16, 64, None, (1, 4096, 32768, 777)),
    ((576, 512), 128, 64, (1, 3, 6, 2), (32768, 4100, 6, 1000)),
    ((576, 512), 16, 1, (4, 1), (2048, 65)),
    ((320, 256), 16, 64, (1, 6, 3), (32768, 513, 8000)),
    ((320, 256), 128, 16, None, (16384, 1, 300)),
    ((576, 512), 4, 64, (2, 2), (9000, 31)),
    ((576, 512), 128, 1, (1, 2), (5000, 77)),  # page size 1: the sm_90 kernel's gather
    # rows of 520 and 264 elements (ropes of 8, no multiple of 16): the portable kernel's rows in
    # units of 8 elements, so they load as 16-byte vectors
    ((520, 512), 16, 16, None, (3000, 17)),
    ((264, 256), 128, 1, (1, 3), (2000, 45)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"{c[0][0]}-{c[0][1]}_h{c[1]}_bs{c[2]}")
@pytest.mark.parametrize("form", ["block_table", "page_indices", "metadata"])
def test_gpu_bf16_real_shapes(case, form):
    from portattn.mla_metadata import MlaMetadataBuilder
    from portattn.platform import current_target

    (dk, r), heads, bs, q_lens, seq_lens = case
    dtype = torch.bfloat16
    q, cache, bt, sl, qsl = make_inputs(dk, r, heads, bs, q_lens, seq_lens, dtype, "cuda")
    scale = 1 / math.sqrt(dk)
    kw = dict(kv_lora_rank=r, scale=scale, query_start_loc=qsl, return_lse=True)
    if form == "page_indices":
        pages = expand_page_indices(bt, sl, bs)
        out, lse = mla_decode(q, cache, None, sl, page_indices=pages, **kw)
    elif form == "metadata":
        builder = MlaMetadataBuilder(
            current_target(),
            max_batch=8,
            num_heads=heads,
            kv_lora_rank=r,
            head_dim_k=dk,
            dtype=dtype,
            device="cuda",
            max_query_len=8,
            max_seq_len=32768,
        )
        md = builder.build(sl, qsl)
        out, lse = mla_decode(q, cache, bt, sl, metadata=md, **kw)
    else:
        out, lse = mla_decode(q, cache, bt, sl, **kw)
    check_out_lse(out, lse, q, cache, bt, sl, qsl, r, scale)


# head counts the policy pads: below 16 (heads as N), between 16 and 64 (one 64-head block),
# past 64 (blocks of 64, the last partial), past 128 (three and four blocks); one token a
# sequence or a verification step's packed rows; TMA pages and gathered rows
ODD_HEADS = [
    (17, 64, None, (4100, 1, 777)),
    (33, 1, (2, 1, 3), (300, 2049, 64)),
    (7, 16, None, (5000, 65)),
    (65, 64, (1, 3), (129, 4000)),
    (96, 1, None, (2048, 31, 9000)),
    (129, 64, (2, 1), (700, 1500)),
    (160, 1, None, (4097, 100)),
    (200, 128, (1, 2), (300, 8000)),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("heads", "bs", "q_lens", "seq_lens"), ODD_HEADS,
                         ids=[f"h{h}_bs{b}_q{'1' if q is None else max(q)}"
                              for h, b, q, _ in ODD_HEADS])  # fmt: skip
@pytest.mark.parametrize("form", ["block_table", "page_indices"])
def test_gpu_odd_head_counts(heads, bs, q_lens, seq_lens, form):
    """The public op at head counts the Hopper kernel pads, through the policy (on an sm_90
    GPU its kernel), with the unowned cache rows NaN, against the fp64 oracle."""
    r, dk = 512, 576
    q, cache, bt, sl, qsl = make_inputs(dk, r, heads, bs, q_lens, seq_lens, torch.bfloat16, "cuda")
    _poison_unowned_rows(cache, bt, sl)
    scale = 1 / math.sqrt(dk)
    kw = dict(kv_lora_rank=r, scale=scale, query_start_loc=qsl, return_lse=True)
    if form == "page_indices":
        kw["page_indices"], bt_arg = expand_page_indices(bt, sl, bs), None
    else:
        bt_arg = bt
    if torch.cuda.get_device_capability() == (9, 0):
        assert plan_mla_decode(q, cache, bt_arg, sl, **kw)[0].name == "mla_decode_sm90"
    out, lse = mla_decode(q, cache, bt_arg, sl, **kw)
    check_out_lse(out, lse, q, cache, bt, sl, qsl, r, scale)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["gfx90a", "gfx942", "gfx950"])
@pytest.mark.parametrize(("heads", "bs"), [(16, 64), (128, 1)])
def test_gpu_hip_policy_plain_decode(arch, heads, bs):
    """bf16 576/512 decode with ``arch``'s policy forced on this GPU: the narrow tile over the
    512-wide latent (4 warps, one wave a SIMD: `HIP_LATENT_512_NUM_WARPS`,
    `HIP_ONE_WAVE_PER_EU`) against the fp64 oracle, unowned cache rows NaN; 1-token pages by
    page_indices."""
    dk, r = 576, 512
    q, cache, bt, sl, qsl = make_inputs(dk, r, heads, bs, None, (4096, 1, 777, 9000),
                                        torch.bfloat16, "cuda")  # fmt: skip
    _poison_unowned_rows(cache, bt, sl)
    pages = expand_page_indices(bt, sl, bs) if bs == 1 else None
    scale = 1 / math.sqrt(dk)
    launches = plan_mla_decode(
        q, cache, None if pages is not None else bt, sl, kv_lora_rank=r, scale=scale,
        return_lse=True, page_indices=pages, target=get_target(arch),
    )  # fmt: skip
    main = launches[0]
    assert main.name == "mla_decode"
    assert (main.options.num_warps, main.options.waves_per_eu) == (4, 1)
    run_all(launches)
    out, lse = main.outputs
    check_out_lse(out, lse, q, cache, bt, sl, qsl, r, scale)


@pytest.mark.gpu
def test_gpu_hip_policy_fp32_latent_512():
    """fp32 576/512 with gfx950's policy forced on this GPU: 4 warps at one wave a SIMD
    (`HIP_LATENT_512_NUM_WARPS`, `HIP_ONE_WAVE_PER_EU`) against the fp64 oracle, unowned cache
    rows NaN."""
    dk, r = 576, 512
    q, cache, bt, sl, qsl = make_inputs(dk, r, 16, 64, None, (4096, 1, 777), torch.float32,
                                        "cuda")  # fmt: skip
    _poison_unowned_rows(cache, bt, sl)
    scale = 1 / math.sqrt(dk)
    launches = plan_mla_decode(
        q, cache, bt, sl, kv_lora_rank=r, scale=scale, return_lse=True,
        target=get_target("gfx950"),
    )  # fmt: skip
    main = launches[0]
    assert (main.options.num_warps, main.options.waves_per_eu) == (4, 1)
    run_all(launches)
    out, lse = main.outputs
    check(out, lse, q, cache, bt, sl, qsl, r, scale, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dk", "r", "heads", "bs", "q_lens", "seq_lens", "splits"),
    [
        (576, 512, 128, 64, (1, 3, 6, 2), (32768, 4100, 6, 1000), None),  # policy's splits
        (576, 512, 128, 64, (1, 3, 6, 2), (32768, 4100, 6, 1000), 1),
        (576, 512, 64, 128, None, (1, 64, 65, 5000), 7),  # empty splits, one-row sequence
        (320, 256, 100, 64, (2, 1), (127, 9000), 3),  # padded heads (100 -> 128), rope 64
        (160, 128, 128, 64, (1, 2), (700, 1500), None),  # kv_lora_rank 128, rope 32
        (272, 256, 128, 64, None, (300, 2000), 2),  # rope 16
        (384, 256, 64, 64, (3, 1), (129, 4000), None),  # rope 128
    ],
)
def test_gpu_sm90_kernel(dk, r, heads, bs, q_lens, seq_lens, splits):
    """The Hopper kernel against the oracle; unowned cache rows are NaN, so a partial tile whose
    stale rows were not zeroed, or any wrong row, shows."""
    target = _sm90_target()
    q, cache, bt, sl, qsl = make_inputs(dk, r, heads, bs, q_lens, seq_lens, torch.bfloat16, "cuda")
    _poison_unowned_rows(cache, bt, sl)
    _check_sm90(target, q, cache, bt, sl, qsl, r, splits)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dk", "r", "heads", "bs", "form", "q_lens", "seq_lens", "splits"),
    [
        (576, 512, 128, 1, "page_indices", (1, 3, 6, 2), (32768, 4100, 6, 1000), None),
        (576, 512, 128, 1, "block_table", (1, 3, 6, 2), (32768, 4100, 6, 1000), 1),
        (576, 512, 128, 16, "block_table", None, (1, 64, 65, 5000), 7),  # empty splits
        (576, 512, 64, 1, "page_indices", None, (1, 63, 129, 3000), 3),  # partial tiles
        (576, 512, 128, 64, "page_indices", None, (4097, 100), 2),  # TMA pages, slot form
        (320, 256, 100, 1, "block_table", (2, 1), (127, 9000), 3),  # padded heads
        (160, 128, 128, 3, "page_indices", (1, 2), (700, 1500), None),  # rank 128, rope 32
        (272, 256, 128, 1, "block_table", None, (300, 2000), 2),  # rope 16
        (384, 256, 64, 32, "page_indices", (3, 1), (129, 4000), None),  # rope 128
    ],
)
def test_gpu_sm90_gather(dk, r, heads, bs, form, q_lens, seq_lens, splits):
    """The Hopper kernel's row gather (rows not 64 consecutive rows of one page) against the
    oracle; unowned cache rows are NaN, so a row read past the context or a wrong slot shows."""
    target = _sm90_target()
    q, cache, bt, sl, qsl = make_inputs(dk, r, heads, bs, q_lens, seq_lens, torch.bfloat16, "cuda")
    _poison_unowned_rows(cache, bt, sl)
    pages = expand_page_indices(bt, sl, bs) if form == "page_indices" else None
    launch = _check_sm90(target, q, cache, bt, sl, qsl, r, splits, pages=pages)
    assert launch.args["GATHER"] is True


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dk", "r", "heads", "bs", "form", "q_lens", "seq_lens", "splits"),
    [
        (576, 512, 16, 64, "block_table", None, (4100, 1, 777, 64), None),  # policy's splits
        (576, 512, 16, 64, "block_table", None, (4100, 1, 777, 64), 1),  # the bf16 output
        (576, 512, 16, 64, "block_table", None, (1, 64, 65, 5000), 7),  # empty splits
        (576, 512, 8, 1, "page_indices", None, (1, 63, 129, 3000), 3),  # gather, partial tiles
        (576, 512, 16, 1, "block_table", None, (32768, 6), 2),  # gather, long context
        (576, 512, 1, 16, "block_table", None, (300, 2000), None),  # one head
        (576, 512, 13, 128, "page_indices", None, (4097, 100), 2),  # 13 heads, 128-token pages
        (320, 256, 16, 64, "block_table", None, (127, 9000), 3),  # rope 64
        (160, 128, 16, 64, "block_table", None, (700, 1500), None),  # rank 128, rope 32
        (272, 256, 5, 1, "block_table", None, (300, 2000), 2),  # rope 16
        (384, 256, 16, 32, "page_indices", None, (129, 4000), None),  # rope 128
    ],
)
def test_gpu_sm90_heads_as_n(dk, r, heads, bs, form, q_lens, seq_lens, splits):
    """At most 16 heads of one query token, the Hopper kernel with the heads as its MMAs' N
    (`MlaConfig.heads_n`) against the oracle, its rows gathered from block tables of any page
    size (64-token pages included) and from page_indices, one split (the bf16 output) and
    several (partials: the padded heads' never written), every rank and rope width; unowned
    cache rows are NaN."""
    target = _sm90_target()
    q, cache, bt, sl, qsl = make_inputs(dk, r, heads, bs, q_lens, seq_lens, torch.bfloat16, "cuda")
    _poison_unowned_rows(cache, bt, sl)
    pages = expand_page_indices(bt, sl, bs) if form == "page_indices" else None
    launch = _check_sm90(target, q, cache, bt, sl, qsl, r, splits, pages=pages,
                         config=MlaConfig(heads_n=True))  # fmt: skip
    assert launch.args["HEADS_N"] is True and launch.args["GATHER"] is True


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["contiguous", "padded", "dim2", "odd"])
@pytest.mark.parametrize("splits", [1, 2])
def test_gpu_sm90_heads_as_n_query_and_output_forms(form, splits):
    """The heads-as-N schedule with a query and an output of every form `_restride` makes,
    both rows of varying tokens (``query_start_loc``, one token a sequence) and the output
    written by the kernel (one split) or by the reduce (two)."""
    target = _sm90_target()
    q, cache, bt, sl, qsl = make_inputs(576, 512, 16, 64, (1, 1, 1), (4100, 70, 3),
                                        torch.bfloat16, "cuda")  # fmt: skip
    _poison_unowned_rows(cache, bt, sl)
    q = _restride(q, form)
    out = _restride(torch.zeros(q.shape[0], 16, 512, dtype=q.dtype, device="cuda"), form)
    launch = _check_sm90(target, q, cache, bt, sl, qsl, 512, splits, out=out,
                         config=MlaConfig(heads_n=True))  # fmt: skip
    assert launch.args["HEADS_N"] is True


def _run_rows(num_rows: int, g: torch.Generator) -> tuple[list[int], list[int]]:
    """Two sequences' cache rows (page size 1), tile by tile (64 positions each): one run at an
    odd offset, a reversed run, a run with its last row moved, scattered rows, the cache's last
    64 rows, an aligned run, then a partial last tile over a run; and a short sequence: a run,
    then a partial tile. No row is used twice."""
    first = list(range(1000, 1064)) + list(range(2063, 1999, -1))
    first += list(range(3000, 3063)) + [3100]
    first += (4000 + torch.randperm(640, generator=g)[:64]).tolist()
    first += list(range(num_rows - 64, num_rows)) + list(range(64, 128)) + list(range(500, 537))
    second = list(range(700, 764)) + list(range(800, 806))
    return first, second


@pytest.mark.gpu
@pytest.mark.parametrize(("heads", "q_lens"), [(128, None), (16, (4, 2))])
@pytest.mark.parametrize("form", ["page_indices", "block_table"])
@pytest.mark.parametrize("splits", [1, 3])
def test_gpu_sm90_gather_runs(heads, q_lens, form, splits):
    """The Hopper kernel's gather over page-size-1 rows of every shape a tile's rows take: one
    run of consecutive cache rows (at an odd offset, at the cache's end), a reversed run, a run
    with one row moved, scattered rows, partial tiles over runs; one split and three, one query
    token and packed verification rows; unowned rows are NaN."""
    target = _sm90_target()
    g = torch.Generator().manual_seed(3)
    num_rows = 5000
    seqs = _run_rows(num_rows, g)
    cache = torch.randn(num_rows, 1, 576, generator=g).to(torch.bfloat16).cuda()
    bt = torch.full((2, len(seqs[0])), -1, dtype=torch.int32)
    for i, rows in enumerate(seqs):
        bt[i, : len(rows)] = torch.tensor(rows, dtype=torch.int32)
    bt = bt.cuda()
    sl = torch.tensor([len(s) for s in seqs], dtype=torch.int32, device="cuda")
    tokens = 2 if q_lens is None else sum(q_lens)
    qsl = None if q_lens is None else torch.tensor([0, q_lens[0], tokens], dtype=torch.int32)
    q = torch.randn(tokens, heads, 576, generator=g).to(torch.bfloat16).cuda()
    qsl = None if qsl is None else qsl.cuda()
    _poison_unowned_rows(cache, bt, sl)
    pages = expand_page_indices(bt, sl, 1) if form == "page_indices" else None
    launch = _check_sm90(target, q, cache, bt, sl, qsl, 512, splits, pages=pages,
                         max_query_len=1 if q_lens is None else max(q_lens))  # fmt: skip
    assert launch.args["GATHER"] is True
    assert launch.args["PACKED"] is (q_lens is not None)


def _restride(q, form):
    """``q`` copied into a view of another layout over NaN: ``padded`` (8 elements of padding a
    row: still 16-byte aligned), ``dim2`` (head dim stride 2), ``odd`` (one element of padding:
    not aligned)."""
    if form == "contiguous":
        return q
    t, h, d = q.shape
    width = {"padded": d + 8, "dim2": 2 * d, "odd": d + 1}[form]
    base = torch.full((t, h, width), float("nan"), dtype=q.dtype, device=q.device)
    view = base[..., ::2] if form == "dim2" else base[..., :d]
    view.copy_(q)
    return view


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["contiguous", "padded", "dim2", "odd"])
@pytest.mark.parametrize("store_smem", [True, False])
def test_gpu_sm90_query_and_output_forms(form, store_smem):
    """One split (the kernel writes the bf16 output itself) with a query and an output of the
    same form: contiguous, padded rows (still aligned), head dim stride 2, or rows not 16-byte
    aligned (16-byte stores only into aligned rows, ``OUT_VEC``); the output through shared
    memory or straight from the accumulators. Every path against the oracle."""
    target = _sm90_target()
    q, cache, bt, sl, qsl = make_inputs(576, 512, 128, 64, (1, 3, 2), (4100, 70, 3),
                                        torch.bfloat16, "cuda")  # fmt: skip
    _poison_unowned_rows(cache, bt, sl)
    q = _restride(q, form)
    out = _restride(torch.zeros(q.shape[0], 128, 512, dtype=q.dtype, device="cuda"), form)
    config = MlaConfig(store_smem=store_smem)
    launch = _check_sm90(target, q, cache, bt, sl, qsl, 512, 1, out=out, config=config)
    assert launch.args["NUM_SPLITS"] == 1 and launch.outputs[0] is out
    assert launch.args["OUT_VEC"] is (form in ("contiguous", "padded"))
    assert launch.args["STORE_SMEM"] is store_smem
    if form == "padded":  # 16-byte stores into aligned rows wrote nothing past them
        assert torch.isnan(out._base[..., 512:]).all()


def _sm90_target():
    from portattn.platform import current_target

    target = current_target()
    if target.arch != "sm_90":
        pytest.skip(f"the sm_90 kernel needs an sm_90 device; this is {target.arch}")
    return target


def check_out_lse(out, lse, q, cache, bt, sl, qsl, r, scale):
    """``out`` against the fp64 oracle under the low-precision rule, ``lse`` to 1e-3."""
    kw = dict(kv_lora_rank=r, scale=scale, query_start_loc=qsl)
    oracle, lse_ref = reference.mla_decode(q, cache, bt, sl, **kw)
    lowp, _ = reference.mla_decode(q, cache, bt, sl, **kw, compute_dtype=q.dtype)
    assert_low_precision_close(out.cpu(), oracle, lowp)
    torch.testing.assert_close(lse.double().cpu(), lse_ref, rtol=1e-3, atol=1e-3)


def _check_sm90(target, q, cache, bt, sl, qsl, r, splits, pages=None, out=None, config=None,
                max_query_len=1):  # fmt: skip
    """Run the sm_90 kernel (the policy's tiles for ``max_query_len``, ``splits`` when given;
    ``pages``: page_indices instead of ``bt``; ``out``: the output tensor to write; ``config``:
    its schedule) and check it against the fp64 oracle, output and lse, and where its tiles pad
    heads of a split launch, that it wrote no padded head's partials. The main launch."""
    heads, dk = q.shape[1:]
    scale = 1 / math.sqrt(dk)
    max_len = int(sl.max())
    problem = MlaProblem(heads, dk, r, 2, q.shape[0], max_len, max_query_len)
    base = mla_decode_tiles(target, problem)
    tiles = dataclasses.replace(base, sm90_kernel=True)
    if splits is not None:
        tiles = dataclasses.replace(tiles, num_kv_splits=splits)
    launches = plan_mla_decode(
        q, cache, None if pages is not None else bt, sl, kv_lora_rank=r, scale=scale,
        query_start_loc=qsl, return_lse=True, tiles=tiles, page_indices=pages, out=out,
        config=config,
    )  # fmt: skip
    assert launches[0].name == "mla_decode_sm90"
    if launches[0].args["NUM_SPLITS"] > 1 and tiles.padded_heads > heads:
        _run_with_poisoned_workspace(launches, heads)
    else:
        run_all(launches)
    out, lse = launches[0].outputs
    check_out_lse(out, lse, q, cache, bt, sl, qsl, r, scale)
    return launches[0]


def _spare_block_zero(cache, bt):
    """The same blocks one id up, behind a new block 0 of NaN that no sequence owns."""
    nan = torch.full_like(cache[:1], float("nan"))
    return torch.cat([nan, cache]), torch.where(bt >= 0, bt + 1, bt)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("bs", "seq_lens", "splits"),
    [
        (64, (4100, 1000, 6), 1),  # 65, 16 and 1 tiles: rows 0-63 of block 0
        (128, (4100, 8256), 3),  # 22, 22, 21 and 43 x 3 tiles: rows 64-127 of block 0
    ],
)
def test_gpu_sm90_phantom_tile_reads_a_spare_block(bs, seq_lens, splits):
    """An odd tile count ends with a phantom tile, whose TMA boxes copy block 0's rows at the
    tile's offset in its page: here block 0 is a spare block of NaN, so a phantom whose scores
    were not masked or whose latent rows were not zeroed shows."""
    target = _sm90_target()
    q, cache, bt, sl, qsl = make_inputs(576, 512, 128, bs, None, seq_lens, torch.bfloat16, "cuda")
    cache, bt = _spare_block_zero(cache, bt)
    _poison_unowned_rows(cache, bt, sl)
    _check_sm90(target, q, cache, bt, sl, qsl, 512, splits)


def test_spare_block_zero_keeps_every_row():
    """The helper above: block 0 is NaN and owned by no sequence; every sequence reads the rows
    it read before."""
    q, cache, bt, sl, qsl = make_inputs(16, 8, 1, 4, None, (9, 3), torch.float32, "cpu")
    cache2, bt2 = _spare_block_zero(cache, bt)
    assert torch.isnan(cache2[0]).all() and 0 not in bt2.tolist()
    for i, n in enumerate(sl.tolist()):
        pos = torch.arange(n)
        assert torch.equal(
            cache2[bt2[i, pos // 4].long(), pos % 4], cache[bt[i, pos // 4].long(), pos % 4]
        )


@pytest.mark.gpu
@pytest.mark.parametrize("ramp", ["climb", "fall", "jumps"])
@pytest.mark.parametrize("splits", [None, 2])
def test_gpu_sm90_running_max_moves(ramp, splits):
    """The sm_90 kernel's running-max rescale against the oracle, with scores that climb along
    the context (the max moves on different tiles for different heads, and for the two rows one
    thread holds), that fall (the first tile's max stays), and that jump twice (every row
    rescales on the same tile). Random scores move the max almost only on the first tiles."""
    target = _sm90_target()
    dk, r, heads, bs, dtype = 576, 512, 128, 64, torch.bfloat16
    seq_lens = (3000, 64 * 37 + 5, 700)
    q, cache, bt, sl, qsl = make_inputs(dk, r, heads, bs, None, seq_lens, dtype, "cuda")
    for i, n in enumerate(seq_lens):
        pos = torch.arange(n, device="cuda")
        frac = pos.float() / n
        factor = {
            "climb": 1 + 3 * frac,
            "fall": 4 - 3 * frac,
            "jumps": 1 + 3 * (frac >= 1 / 3).float() + 6 * (frac >= 2 / 3).float(),
        }[ramp]
        rows = (bt[i, pos // bs].long(), pos % bs)
        cache[rows] = (cache[rows].float() * factor[:, None]).to(dtype)
    q = (q.float() * torch.linspace(0.25, 2.0, heads, device="cuda")[None, :, None]).to(dtype)
    _poison_unowned_rows(cache, bt, sl)
    _check_sm90(target, q, cache, bt, sl, qsl, r, splits)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dk", "r", "heads", "bs", "q_lens", "seq_lens", "splits"),
    [
        (576, 512, 128, 64, (1, 3, 6, 2), (32768, 4100, 6, 1000), None),
        (576, 512, 128, 64, None, (4100, 6, 1000, 8192), None),  # partial last tiles, odd counts
        (576, 512, 64, 128, None, (1, 64, 65, 5000), 7),  # empty splits, one-row sequence
        (576, 512, 128, 1, None, (3001, 130), 2),  # page size 1: the rows gathered
        (320, 256, 100, 64, (2, 1), (127, 9000), 3),  # padded heads
    ],
)
def test_gpu_sm90_masks_past_the_context(dk, r, heads, bs, q_lens, seq_lens, splits):
    """The sm_90 kernel against the fp64 oracle with NaN in every row no sequence owns: full
    tiles go unmasked, so a tile past the context's end must still be masked."""
    target = _sm90_target()
    q, cache, bt, sl, qsl = make_inputs(dk, r, heads, bs, q_lens, seq_lens, torch.bfloat16, "cuda")
    _poison_unowned_rows(cache, bt, sl)
    _check_sm90(target, q, cache, bt, sl, qsl, r, splits)
