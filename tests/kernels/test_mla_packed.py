"""MLA verification with packed rows (`MlaTiles.packed`): a program's rows are (query token, head)
pairs of one sequence, each row with its own causal limit. The portable kernel runs packed tiles
under the interpreter (CPU gate, against the fp64 oracle); the sm_90 kernel's packed path runs on
the GPU (``-m gpu``)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from portattn.kernels._launch import run_all
from portattn.kernels.mla_decode import plan_mla_decode
from portattn.kernels.page_indices import expand_page_indices
from portattn.mla_metadata import MlaMetadataBuilder
from portattn.platform import get_target
from portattn.policy.mla import MlaConfig, MlaProblem, mla_decode_tiles, mla_row_groups
from tests.helpers import compile_in_spawned_workers, target_compile
from tests.kernels.test_mla_decode import (
    _poison_unowned_rows,
    check,
    check_out_lse,
    make_inputs,
)

pytestmark = pytest.mark.mla
SM90 = get_target("sm_90")


def _packed_tiles(dk, r, heads, block_h, splits, block_n=16):
    """The policy's fp32 tiles for a small problem, packed with ``block_h`` rows."""
    base = mla_decode_tiles(SM90, MlaProblem(heads, dk, r, 4, 8, 64))
    return dataclasses.replace(
        base,
        packed=True,
        block_h=block_h,
        padded_heads=-(-heads // block_h) * block_h,
        num_kv_splits=splits,
        block_n=block_n,
    )


def _run(q, cache, bt, sl, qsl, r, tiles, page_indices=None):
    launches = plan_mla_decode(
        q, cache, None if page_indices is not None else bt, sl, kv_lora_rank=r, scale=0.05,
        query_start_loc=qsl, return_lse=True, tiles=tiles, page_indices=page_indices,
    )  # fmt: skip
    run_all(launches)
    out, lse = launches[0].outputs
    check(out, lse, q, cache, bt, sl, qsl, r, 0.05, torch.float32)
    return launches


# (dk, r), heads, block_h, splits, q_lens, seq_lens. Awkward on purpose: q_len 2..8 and uneven
# q_len per sequence; a tile spanning tokens (16 rows of 3 heads: 5 tokens and a row of the
# sixth); seq_len == q_len (token 0 sees one position); q_len 0 (an empty sequence); splits
# whose chunks some rows never reach (their partials are empty, lse -inf); heads not dividing
# the tile (padded rows).
PACKED_CASES = [
    ((192, 128), 4, 16, 1, (4, 2), (37, 5)),
    ((192, 128), 3, 16, 3, (8, 1, 5), (40, 8, 5)),
    ((288, 256), 8, 32, 2, (2, 3), (2, 70)),
    ((192, 128), 5, 16, 4, (6, 0, 7), (6, 3, 33)),
    ((256, 256), 2, 16, 2, (3, 8), (19, 8)),
]


@pytest.mark.parametrize(
    ("shape", "heads", "block_h", "splits", "q_lens", "seq_lens"),
    PACKED_CASES,
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v),
)
def test_packed_rows_match_oracle(shape, heads, block_h, splits, q_lens, seq_lens, device):
    dk, r = shape
    q, cache, bt, sl, qsl = make_inputs(dk, r, heads, 16, q_lens, seq_lens, torch.float32, device)
    _poison_unowned_rows(cache, bt, sl)  # any row read past a row's context shows as NaN
    tiles = _packed_tiles(dk, r, heads, block_h, splits)
    launches = _run(q, cache, bt, sl, qsl, r, tiles)
    main = launches[0]
    assert main.args["PACKED"] is True
    groups = -(-max(q_lens) * heads // block_h)
    assert main.args["row_groups"] == groups
    assert main.grid == (len(seq_lens) * groups * splits,)
    assert [x.name for x in launches] == (
        ["mla_decode"] if splits == 1 else ["mla_decode", "mla_decode_reduce"]
    )


def _negative_scores(dk, r, heads, dtype, device):
    """One sequence of 4 query tokens over 20 positions whose every score is negative: each
    cached row is the same positive vector and each query its negation."""
    g = torch.Generator().manual_seed(3)
    row = torch.rand(dk, generator=g) * 0.5 + 0.5
    cache = row.expand(2, 16, dk).to(dtype).contiguous().to(device)
    q = (-row).expand(4, heads, dk).to(dtype).contiguous().to(device)
    bt = torch.tensor([[0, 1]], dtype=torch.int32, device=device)
    sl = torch.tensor([20], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 4], dtype=torch.int32, device=device)
    return q, cache, bt, sl, qsl


@pytest.mark.parametrize("splits", [1, 2])
def test_packed_rows_whose_scores_all_lie_far_below_zero(splits, device):
    """A scale within the documented range can put every score of a row far below -1e30 (here
    about -4e32 in the exp2 domain): the running max starts below any finite score, so the row
    gets its softmax, not zeros and lse -inf."""
    dk, r, heads = 48, 32, 8
    q, cache, bt, sl, qsl = _negative_scores(dk, r, heads, torch.float32, device)
    tiles = _packed_tiles(dk, r, heads, 16, splits)
    launches = plan_mla_decode(
        q, cache, bt, sl, kv_lora_rank=r, scale=1e30, query_start_loc=qsl, return_lse=True,
        tiles=tiles,
    )  # fmt: skip
    assert launches[0].args["PACKED"] is True
    run_all(launches)
    out, lse = launches[0].outputs
    assert torch.isfinite(lse).all() and (lse < -1e31).all()
    check(out, lse, q, cache, bt, sl, qsl, r, 1e30, torch.float32)


def test_packed_bulk_copy_tiles(device):
    """Packed rows with descriptor tiles (whole tiles in a page) and the gathered last tile."""
    dk, r, heads = 288, 256, 4
    q, cache, bt, sl, qsl = make_inputs(
        dk, r, heads, 32, (3, 5, 1), (40, 9, 64), torch.float32, device
    )
    _poison_unowned_rows(cache, bt, sl)
    tiles = dataclasses.replace(_packed_tiles(dk, r, heads, 16, 2), tma=True)
    launches = _run(q, cache, bt, sl, qsl, r, tiles)
    assert launches[0].args["TMA"] is True


def test_packed_page_indices_identical_to_block_table(device):
    from portattn import reference

    dk, r, heads = 192, 128, 3
    q, cache, bt, sl, qsl = make_inputs(dk, r, heads, 16, (4, 2), (20, 33), torch.float32, device)
    tiles = _packed_tiles(dk, r, heads, 16, 2)
    a = _run(q, cache, bt, sl, qsl, r, tiles)[0].outputs
    pages = tuple(t.to(device) for t in reference.expand_page_indices(bt.cpu(), sl.cpu(), 16))
    b = _run(q, cache, bt, sl, qsl, r, tiles, page_indices=pages)[0].outputs
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_packed_single_token_decode(device):
    """Packed tiles on a plain decode step (no query_start_loc): one token per sequence."""
    dk, r, heads = 192, 128, 5
    q, cache, bt, sl, qsl = make_inputs(dk, r, heads, 16, None, (7, 40), torch.float32, device)
    launches = _run(q, cache, bt, sl, qsl, r, _packed_tiles(dk, r, heads, 16, 2))
    assert launches[0].args["VARLEN"] is False and launches[0].args["row_groups"] == 1


def test_packed_graph_padding_rows_untouched(device):
    """Rows past query_start_loc[-1] are not written by packed programs either."""
    dk, r, heads = 192, 128, 3
    q, cache, bt, sl, qsl = make_inputs(dk, r, heads, 16, (2, 3), (5, 9), torch.float32, device)
    qpad = torch.cat([q, torch.randn(2, heads, dk, device=device)])
    out = torch.full((7, heads, r), -7.0, device=device)
    launches = plan_mla_decode(
        qpad, cache, bt, sl, kv_lora_rank=r, scale=0.05, query_start_loc=qsl, out=out,
        tiles=_packed_tiles(dk, r, heads, 16, 1),
    )  # fmt: skip
    run_all(launches)
    assert (out[5:] == -7.0).all()
    check(out[:5], None, q, cache, bt, sl, qsl, r, 0.05, torch.float32)


# -- HIP policies forced: the portable kernel's packed rows at the policy's own tiles ----------

HIP_ARCHS = ("gfx90a", "gfx942", "gfx950")


def _hip_run(arch, q, cache, bt, sl, qsl, r, dtype, page_indices=None, tiles=None):
    """``mla_decode``'s plan with ``arch``'s policy forced (``target=``; ``tiles``: injected),
    run and checked against the fp64 oracle (output and lse); the main launch."""
    launches = plan_mla_decode(
        q, cache, None if page_indices is not None else bt, sl, kv_lora_rank=r, scale=0.05,
        query_start_loc=qsl, return_lse=True, page_indices=page_indices,
        target=get_target(arch), tiles=tiles,
    )  # fmt: skip
    run_all(launches)
    out, lse = launches[0].outputs
    check(out, lse, q, cache, bt, sl, qsl, r, 0.05, dtype)
    return launches[0]


# arch, (dk, r), heads, block_size, q_lens, seq_lens, form. Awkward on purpose: 3 heads x 5 tokens
# (15 rows: the tile's last row padded), a sequence with seq_len == q_len, 1 head (up to 16 tokens
# a tile), 16 heads x 4 tokens over two 32-row groups (gfx90a), 128 heads (four 64-row groups a
# token pair), 1-token pages by page_indices, an empty sequence (q_len 0), a context long enough
# for split-KV (the reduce runs on packed partials).
HIP_CASES = [
    ("gfx942", (192, 128), 3, 16, (5, 2, 1), (40, 9, 17), "block_table"),
    ("gfx942", (192, 128), 16, 1, (3, 7), (30, 7), "page_indices"),
    ("gfx950", (576, 512), 1, 64, (8, 3), (700, 3), "block_table"),
    ("gfx90a", (576, 512), 16, 1, (4, 2), (40, 5), "page_indices"),
    ("gfx942", (320, 256), 128, 16, (2, 1), (33, 20), "block_table"),
    ("gfx950", (288, 256), 5, 1, (7, 0, 6), (7, 3, 530), "page_indices"),
]


def _hip_ids(v):
    return "x".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _pages(bt, sl, bs, device):
    from portattn import reference

    return tuple(t.to(device) for t in reference.expand_page_indices(bt.cpu(), sl.cpu(), bs))


@pytest.mark.parametrize(
    ("arch", "shape", "heads", "bs", "q_lens", "seq_lens", "form"), HIP_CASES, ids=_hip_ids
)
def test_hip_policy_packed_rows_fp16(arch, shape, heads, bs, q_lens, seq_lens, form, device):
    """fp16 through the HIP policy (``target=``): the tiles it packs, against the fp64 oracle;
    unowned cache rows are NaN, so a row read past its own causal limit shows."""
    dk, r = shape
    q, cache, bt, sl, qsl = make_inputs(dk, r, heads, bs, q_lens, seq_lens, torch.float16, device)
    _poison_unowned_rows(cache, bt, sl)
    pages = _pages(bt, sl, bs, device) if form == "page_indices" else None
    main = _hip_run(arch, q, cache, bt, sl, qsl, r, torch.float16, page_indices=pages)
    max_context = pages[1].shape[0] if pages is not None else bt.shape[1] * bs
    tiles = mla_decode_tiles(
        get_target(arch), MlaProblem(heads, dk, r, 2, q.shape[0], max_context, max(q_lens))
    )
    assert tiles.packed and main.name == "mla_decode" and main.args["PACKED"] is True
    assert (main.args["BLOCK_H"], main.args["NUM_SPLITS"]) == (tiles.block_h, tiles.num_kv_splits)
    assert main.args["row_groups"] == mla_row_groups(tiles, heads, max(q_lens))
    assert main.args["PAGE_INDICES"] is (form == "page_indices")


# fp32 through 16-bit tiles is an interpreter check (on a GPU these tiles overflow fp32's budgets)
@pytest.mark.cpu
@pytest.mark.parametrize(
    ("arch", "shape", "heads", "bs", "q_lens", "seq_lens", "form"),
    [
        ("gfx950", (576, 512), 16, 64, (4, 8), (100, 8), "block_table"),  # 64 rows, 2 groups
        ("gfx942", (288, 256), 5, 1, (7, 6), (7, 600), "page_indices"),  # 35 rows, 2 splits
        ("gfx90a", (192, 128), 128, 16, (2, 1), (21, 600), "block_table"),  # 4 groups, splits
    ],
    ids=_hip_ids,
)
def test_hip_packed_tiles_fp32(arch, shape, heads, bs, q_lens, seq_lens, form, device):
    """The HIP policy's 16-bit packed tiles (fp32 is never packed) run in fp32, so the packed
    rows' masking, offsets and split merge are checked at fp32's tolerance."""
    dk, r = shape
    q, cache, bt, sl, qsl = make_inputs(dk, r, heads, bs, q_lens, seq_lens, torch.float32, device)
    _poison_unowned_rows(cache, bt, sl)
    pages = _pages(bt, sl, bs, device) if form == "page_indices" else None
    max_context = pages[1].shape[0] if pages is not None else bt.shape[1] * bs
    tiles = mla_decode_tiles(
        get_target(arch), MlaProblem(heads, dk, r, 2, q.shape[0], max_context, max(q_lens))
    )
    assert tiles.packed and tiles.block_h > 16
    main = _hip_run(arch, q, cache, bt, sl, qsl, r, torch.float32, page_indices=pages, tiles=tiles)
    assert main.args["PACKED"] is True


def test_hip_packed_page_indices_identical_to_block_table(device):
    """1-token pages: the same packed tiles by block table and by page_indices give bit-equal
    results."""
    dk, r, heads = 192, 128, 16
    q, cache, bt, sl, qsl = make_inputs(dk, r, heads, 1, (4, 3), (20, 33), torch.float16, device)
    pages = _pages(bt, sl, 1, device)
    tiles = mla_decode_tiles(
        get_target("gfx942"), MlaProblem(heads, dk, r, 2, q.shape[0], pages[1].shape[0], 4)
    )
    a = _hip_run("gfx942", q, cache, bt, sl, qsl, r, torch.float16, tiles=tiles).outputs
    b = _hip_run("gfx942", q, cache, bt, sl, qsl, r, torch.float16, page_indices=pages,
                 tiles=tiles).outputs  # fmt: skip
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("arch", HIP_ARCHS)
def test_hip_metadata_route(arch, device):
    """The serving route with a HIP target: `MlaMetadataBuilder` picks the packed tiles for its
    max_query_len and sizes the workspaces from them; a shorter step uses the same tiles with
    fewer row groups."""
    dk, r, heads = 192, 128, 16
    seq_lens = (300, 40, 4)
    b = MlaMetadataBuilder(
        get_target(arch), max_batch=3, num_heads=heads, kv_lora_rank=r, head_dim_k=dk,
        dtype=torch.float16, device=device, max_query_len=4, max_seq_len=320,
    )  # fmt: skip
    assert b.tiles.packed
    for q_lens in ((4, 3, 4), (2, 1, 2)):
        q, cache, bt, sl, qsl = make_inputs(dk, r, heads, 16, q_lens, seq_lens, torch.float16,
                                            device)  # fmt: skip
        md = b.build(sl, qsl, max_query_len=max(q_lens))
        launches = plan_mla_decode(
            q, cache, bt, sl, kv_lora_rank=r, scale=0.05, query_start_loc=qsl, return_lse=True,
            metadata=md,
        )  # fmt: skip
        main = launches[0]
        assert main.name == "mla_decode" and main.args["PACKED"] is True
        assert main.args["row_groups"] == mla_row_groups(b.tiles, heads, max(q_lens))
        run_all(launches)
        out, lse = main.outputs
        check(out, lse, q, cache, bt, sl, qsl, r, 0.05, torch.float16)


# -- policy and metadata: where packing is taken, and the one place sizes come from ----------


def _problem(heads, q_len, batch=64, context=4096, elem=2):
    return MlaProblem(heads, 576, 512, elem, batch * q_len, context, q_len)


@pytest.mark.parametrize("q_len", [2, 3, 4, 8])
def test_policy_packs_16_heads_into_the_sm90_tile(q_len):
    t = mla_decode_tiles(SM90, _problem(16, q_len))
    assert t.packed and t.sm90_kernel and (t.block_h, t.block_n) == (64, 64)
    groups = mla_row_groups(t, 16, q_len)
    assert groups == -(-q_len * 16 // 64)
    # one wave of the Hopper kernel (1 program per SM): 64 sequences x groups x splits <= 132
    assert 64 * groups * t.num_kv_splits <= SM90.num_sms
    assert t.num_kv_splits == max(1, min(SM90.num_sms // (64 * groups), 4096 // 256))


@pytest.mark.parametrize(
    ("arch", "heads", "q_len", "elem", "why"),
    [
        ("sm_90", 128, 4, 2, "a token already fills the tile"),
        ("sm_90", 64, 2, 2, "a token already fills the tile"),
        ("sm_90", 16, 1, 2, "plain decode"),
        ("sm_90", 8, 3, 2, "24 rows < PACK_MIN_ROWS"),
        ("sm_90", 16, 4, 4, "fp32"),
        ("sm_80", 16, 4, 2, "not a PACK_ARCHS target"),
        ("gfx942", 16, 1, 2, "plain decode"),
        ("gfx950", 16, 4, 4, "fp32"),
    ],
)
def test_policy_does_not_pack(arch, heads, q_len, elem, why):
    t = mla_decode_tiles(get_target(arch), _problem(heads, q_len, elem=elem))
    assert not t.packed, why
    unpacked = mla_decode_tiles(get_target(arch), _problem(heads, 1, batch=64 * q_len, elem=elem))
    assert t == unpacked  # exactly the tiles of the same tokens without packing


def test_metadata_workspaces_and_grid_from_the_packed_tiles():
    """Builder: one policy call with max_query_len; workspaces from those tiles (padded_heads of
    the 64-row tile); the grid from the step's max_query_len through mla_row_groups."""
    b = MlaMetadataBuilder(
        SM90, max_batch=64, num_heads=16, kv_lora_rank=512, head_dim_k=576,
        dtype=torch.bfloat16, device="meta", max_query_len=4, max_seq_len=4096,
    )  # fmt: skip
    t = b.tiles
    assert t == mla_decode_tiles(SM90, _problem(16, 4))
    assert t.packed and t.num_kv_splits == 2
    assert b._partial_out.shape == (256, 2, 64, 512)
    sl = torch.full((64,), 4096, dtype=torch.int32, device="meta")
    for step_q in (4, 2):
        qsl = torch.arange(0, 64 * step_q + 1, step_q, dtype=torch.int32, device="meta")
        md = b.build(sl, qsl, max_query_len=step_q)
        q = torch.empty(64 * step_q, 16, 576, dtype=torch.bfloat16, device="meta")
        cache = torch.empty(64 * 64 + 1, 64, 576, dtype=torch.bfloat16, device="meta")
        bt = torch.empty(64, 64, dtype=torch.int32, device="meta")
        main, _ = plan_mla_decode(
            q, cache, bt, sl, kv_lora_rank=512, scale=0.1, query_start_loc=qsl, metadata=md,
            target=SM90,
        )  # fmt: skip
        assert main.name == "mla_decode_sm90" and main.args["PACKED"] is True
        groups = mla_row_groups(t, 16, step_q)
        assert main.args["row_groups"] == groups and main.grid == (64 * groups * 2,)


def test_plan_without_metadata_reads_the_longest_query(device):
    """Without metadata the policy gets the longest q_len read from query_start_loc (bf16 on
    sm_90: packed), and the grid covers every sequence's rows."""
    dk, r, heads = 576, 512, 16
    q, cache, bt, sl, qsl = make_inputs(
        dk, r, heads, 64, (3, 1), (70, 5), torch.bfloat16, device, spare_blocks=0
    )
    launches = plan_mla_decode(
        q, cache, bt, sl, kv_lora_rank=r, scale=0.05, query_start_loc=qsl, target=SM90
    )
    main = launches[0]
    assert main.args["PACKED"] is True and main.args["row_groups"] == 1  # 3 x 16 rows <= 64
    assert main.grid[0] == 2 * main.args["NUM_SPLITS"]


# -- GPU: the sm_90 kernel's packed path ---------------------------------------------------


def _sm90_target():
    from portattn.platform import current_target

    target = current_target()
    if target.arch != "sm_90":
        pytest.skip(f"the sm_90 kernel needs an sm_90 device; this is {target.arch}")
    return target


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dk", "r", "heads", "q_lens", "seq_lens", "splits"),
    [
        (576, 512, 16, (4, 4, 4), (4096, 300, 4), None),  # 64 rows, seq_len == q_len
        (576, 512, 16, (2, 8, 5, 1), (4100, 1000, 70, 6), None),  # uneven: 1..2 row groups
        (576, 512, 16, (8, 3), (9000, 130), 7),  # empty splits for some rows
        (576, 512, 16, (6, 2, 7), (65, 2, 3000), 2),  # a tile spanning tokens, phantom tiles
        (576, 512, 12, (5, 3), (2000, 129), 3),  # 12 heads: rows cross tokens mid-tile
        (320, 256, 8, (8, 4), (5000, 64), None),  # rope 64
        (160, 128, 32, (2, 2), (700, 1500), 2),  # kv_lora_rank 128, rope 32
    ],
)
def test_gpu_sm90_packed(dk, r, heads, q_lens, seq_lens, splits):
    """The Hopper kernel's packed rows against the fp64 oracle (output and lse); unowned cache
    rows are NaN, so a row reading past its own causal limit shows."""
    target = _sm90_target()
    q, cache, bt, sl, qsl = make_inputs(dk, r, heads, 64, q_lens, seq_lens, torch.bfloat16, "cuda")
    _poison_unowned_rows(cache, bt, sl)
    max_q = max(q_lens)
    base = mla_decode_tiles(target, MlaProblem(heads, dk, r, 2, q.shape[0], max(seq_lens), max_q))
    tiles = dataclasses.replace(base, packed=True, sm90_kernel=True, block_h=64, block_n=64,
                                padded_heads=-(-heads // 64) * 64)  # fmt: skip
    if splits is not None:
        tiles = dataclasses.replace(tiles, num_kv_splits=splits)
    scale = 1 / math.sqrt(dk)
    launches = plan_mla_decode(
        q, cache, bt, sl, kv_lora_rank=r, scale=scale, query_start_loc=qsl, return_lse=True,
        tiles=tiles,
    )  # fmt: skip
    assert launches[0].name == "mla_decode_sm90" and launches[0].args["PACKED"] is True
    run_all(launches)
    out, lse = launches[0].outputs
    check_out_lse(out, lse, q, cache, bt, sl, qsl, r, scale)


@pytest.mark.gpu
@pytest.mark.parametrize("store_smem", [True, False])
def test_gpu_sm90_packed_one_split(store_smem):
    """Packed rows with one split: the kernel writes each real row's bf16 output to its (token,
    head) itself, through shared memory or from the accumulators."""
    target = _sm90_target()
    dk, r, heads, q_lens, seq_lens = 576, 512, 16, (8, 3, 6), (5000, 130, 6)
    q, cache, bt, sl, qsl = make_inputs(dk, r, heads, 64, q_lens, seq_lens, torch.bfloat16, "cuda")
    _poison_unowned_rows(cache, bt, sl)
    base = mla_decode_tiles(target, MlaProblem(heads, dk, r, 2, q.shape[0], max(seq_lens), 8))
    tiles = dataclasses.replace(base, packed=True, sm90_kernel=True, block_h=64, block_n=64,
                                padded_heads=64, num_kv_splits=1)  # fmt: skip
    scale = 1 / math.sqrt(dk)
    launches = plan_mla_decode(
        q, cache, bt, sl, kv_lora_rank=r, scale=scale, query_start_loc=qsl, return_lse=True,
        tiles=tiles, config=MlaConfig(store_smem=store_smem),
    )  # fmt: skip
    main = launches[0]
    assert main.name == "mla_decode_sm90" and main.args["PACKED"] is True
    assert (main.args["NUM_SPLITS"], main.args["STORE_SMEM"], main.args["OUT_VEC"]) == (
        1, store_smem, True,
    )  # fmt: skip
    run_all(launches)
    out, lse = main.outputs
    check_out_lse(out, lse, q, cache, bt, sl, qsl, r, scale)


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [2, 4, 8])
def test_gpu_policy_packed_with_metadata(q_len):
    """The policy's route (metadata, CUDA-graph path) at 16 heads: packed, sm_90 kernel."""
    target = _sm90_target()
    dk, r, heads = 576, 512, 16
    seq_lens = tuple(4096 - 37 * i for i in range(8))
    q, cache, bt, sl, qsl = make_inputs(
        dk, r, heads, 64, (q_len,) * 8, seq_lens, torch.bfloat16, "cuda"
    )
    b = MlaMetadataBuilder(
        target, max_batch=8, num_heads=heads, kv_lora_rank=r, head_dim_k=dk,
        dtype=torch.bfloat16, device="cuda", max_query_len=8, max_seq_len=4096,
    )  # fmt: skip
    assert b.tiles.packed
    md = b.build(sl, qsl, max_query_len=q_len)
    scale = 1 / math.sqrt(dk)
    launches = plan_mla_decode(
        q, cache, bt, sl, kv_lora_rank=r, scale=scale, query_start_loc=qsl, return_lse=True,
        metadata=md,
    )  # fmt: skip
    assert launches[0].name == "mla_decode_sm90"
    run_all(launches)
    out, lse = launches[0].outputs
    check_out_lse(out, lse, q, cache, bt, sl, qsl, r, scale)


@target_compile
def test_packed_sm90_kernel_compiles_within_its_estimate_without_spills():
    """The compile matrix's packed case (16 heads, q_len 4, 64-token pages) takes the Hopper
    kernel with PACKED rows; its sm_90 compile stays within `sm90_smem_bytes` with no spills."""
    from portattn.compile import default_cases
    from portattn.kernels.mla_decode_sm90 import sm90_smem_bytes

    case = {c.id: c for c in default_cases()}["mla_decode/576/512 h16 q4 page64"]
    (main, _) = case.plan(SM90)
    assert main.name == "mla_decode_sm90" and main.args["PACKED"] is True
    (cell,) = compile_in_spawned_workers([case], ["sm_90"])  # spawned workers: no interpreter
    (r,) = [launch for launch in cell.launches if launch.name == "mla_decode_sm90"]
    assert r.ok, r.error
    assert r.shared <= sm90_smem_bytes(512, 64) <= SM90.max_shared_mem
    assert r.spills == 0


# a GPU runs these tiles on the Hopper kernel (test_gpu_policy_packed_with_metadata)
@pytest.mark.cpu
@pytest.mark.parametrize("q_lens", [(2, 2, 1), (4, 3, 4)])
def test_policy_route_real_shape_fp16(q_lens):
    """The policy's packed sm_90 tiles (H64 N64, bulk copies) through `MlaMetadataBuilder` at
    DeepSeek's 576/512, 16 heads, 64-token pages, fp16. Off the GPU the Hopper kernel is refused
    (`sm90_errors`: not a CUDA tensor), so the portable kernel runs the same packed tiles."""
    device = "cpu"
    dk, r, heads = 576, 512, 16
    seq_lens = (150, 64, 4)
    q, cache, bt, sl, qsl = make_inputs(dk, r, heads, 64, q_lens, seq_lens, torch.float16, device)
    _poison_unowned_rows(cache, bt, sl)
    b = MlaMetadataBuilder(
        SM90, max_batch=3, num_heads=heads, kv_lora_rank=r, head_dim_k=dk, dtype=torch.float16,
        device=device, max_query_len=4, max_seq_len=256,
    )  # fmt: skip
    assert b.tiles.packed and (b.tiles.block_h, b.tiles.block_n) == (64, 64)
    md = b.build(sl, qsl, max_query_len=max(q_lens))
    launches = plan_mla_decode(
        q, cache, bt, sl, kv_lora_rank=r, scale=0.05, query_start_loc=qsl, return_lse=True,
        metadata=md,
    )  # fmt: skip
    assert launches[0].name == "mla_decode" and launches[0].args["TMA"] is True
    run_all(launches)
    out, lse = launches[0].outputs
    check(out, lse, q, cache, bt, sl, qsl, r, 0.05, torch.float16)


# -- GPU: each HIP policy forced on the NVIDIA device (the portable kernel's packed rows) -------

HIP_GPU_CASES = [
    # (dk, r), heads, block_size, form, q_lens, seq_lens
    ((576, 512), 16, 64, "block_table", (4, 4, 2, 8), (4096, 300, 4, 9000)),
    ((576, 512), 16, 1, "page_indices", (2, 8, 5, 1), (4100, 1000, 70, 6)),
    ((576, 512), 128, 64, "block_table", (2, 3), (5000, 129)),
    ((576, 512), 1, 1, "page_indices", (8, 3), (3000, 3)),
    ((320, 256), 12, 16, "block_table", (5, 3), (2000, 129)),  # rows cross tokens mid-tile
]


@pytest.mark.gpu
@pytest.mark.parametrize("arch", HIP_ARCHS)
@pytest.mark.parametrize(
    "case", HIP_GPU_CASES, ids=lambda c: f"{c[0][0]}-{c[0][1]}_h{c[1]}_bs{c[2]}_{c[3]}"
)
def test_gpu_hip_policy_packed(arch, case):
    """bf16 at real shapes with ``arch``'s policy forced through `MlaMetadataBuilder` (the
    serving route): the HIP packed tiles compile for this GPU and match the fp64 oracle; unowned
    cache rows are NaN."""
    (dk, r), heads, bs, form, q_lens, seq_lens = case
    q, cache, bt, sl, qsl = make_inputs(dk, r, heads, bs, q_lens, seq_lens, torch.bfloat16, "cuda")
    _poison_unowned_rows(cache, bt, sl)
    pages = expand_page_indices(bt, sl, bs) if form == "page_indices" else None
    b = MlaMetadataBuilder(
        get_target(arch), max_batch=len(seq_lens), num_heads=heads, kv_lora_rank=r,
        head_dim_k=dk, dtype=torch.bfloat16, device="cuda", max_query_len=8,
        max_seq_len=max(seq_lens),
    )  # fmt: skip
    assert b.tiles.packed and not b.tiles.sm90_kernel
    md = b.build(sl, qsl, max_query_len=max(q_lens))
    scale = 1 / math.sqrt(dk)
    launches = plan_mla_decode(
        q, cache, None if pages is not None else bt, sl, kv_lora_rank=r, scale=scale,
        query_start_loc=qsl, return_lse=True, page_indices=pages, metadata=md,
    )  # fmt: skip
    assert launches[0].name == "mla_decode" and launches[0].args["PACKED"] is True
    run_all(launches)
    out, lse = launches[0].outputs
    check_out_lse(out, lse, q, cache, bt, sl, qsl, r, scale)
