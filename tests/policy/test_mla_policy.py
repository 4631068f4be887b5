"""MLA decode tile policy: exact CUDA and HIP tiles side by side, the budget, lessons 1 and 2."""

from __future__ import annotations

import dataclasses
import re

import pytest

from portattn.platform import TARGETS, get_target
from portattn.policy.common import LaunchOptions, next_pow2
from portattn.policy.mla import (
    MAX_KV_SPLITS,
    REG_BUDGET,
    MlaProblem,
    MlaTiles,
    mla_decode_tiles,
    mla_reg_estimate,
    mla_smem_bytes,
)

pytestmark = [pytest.mark.policy, pytest.mark.mla]

# (head_dim_k, kv_lora_rank): DeepSeek-V3, Mistral-Small-4, a 32-wide rope, a small model, no rope.
SHAPES = [(576, 512), (320, 256), (288, 256), (192, 128), (256, 256)]
HEADS = [1, 3, 4, 8, 16, 20, 128]
GPU_ELEM_SIZES = [2]  # fp16 / bf16: what a GPU launch uses


def problem(dk=576, r=512, heads=16, elem=2, tokens=64, context=4096, ready=True) -> MlaProblem:
    return MlaProblem(heads, dk, r, elem, tokens, context, sm90_ready=ready)


# arch, (dk, r) -> (block_n, num_warps, num_stages, smem_bytes, num_kv_splits[, prefetch_rows]) for
# 16 heads, 64 tokens, 4k context (on sm_90 a cache the Hopper kernel cannot run); BLOCK_H 16;
# descriptor (TMA) tiles on sm_90 and later. The longest KV tile within both budgets at the
# fewest warps (576/512 N64 needs 8 warps: 4 would spill; HIP over a 512-wide latent: one wave a
# SIMD), then NVIDIA tiles whose two-buffer estimate fits prefetch block-table rows at 3 stages.
# Splits: the most that fit one wave of resident programs: floor(resident * SMs / 64) with
# resident = max_shared // smem on CUDA (sm_90 N64 w8: 1 -> 2; N64 w4 at 320/256: 2 -> 4), 2 per
# CU on HIP (floor(2 * 304 / 64) = 9 on gfx942).
EXPECTED = {
    ("sm_90", 576, 512): (64, 8, 3, 167936, 2, True),  # measured best on an H100 (decisions.md)
    ("sm_100", 576, 512): (64, 8, 3, 167936, 2, True),
    ("sm_90", 320, 256): (64, 4, 3, 94208, 4, True),
    ("sm_80", 576, 512): (32, 4, 3, 93184, 1, True),  # N64 w8 needs 167936 B > 166912 B
    ("sm_86", 576, 512): (32, 4, 3, 93184, 1, True),  # 99 KB, 72 SMs: one resident program
    ("sm_86", 320, 256): (64, 4, 3, 94208, 1, True),
    ("sm_86", 192, 128): (64, 4, 3, 57344, 1, True),
    ("sm_120", 576, 512): (32, 4, 3, 93184, 2, True),  # 188 SMs
    ("gfx942", 576, 512): (16, 4, 2, 55808, 9),  # 64 KB LDS, 304 CUs
    ("gfx942", 320, 256): (32, 4, 2, 52224, 9),
    ("gfx942", 288, 256): (32, 4, 2, 47104, 9),
    ("gfx942", 256, 256): (32, 4, 2, 41984, 9),
    ("gfx90a", 576, 512): (16, 4, 2, 55808, 3),
    ("gfx950", 576, 512): (32, 4, 2, 93184, 8),
}

# arch -> (block_n, smem_bytes, num_kv_splits) of the wide tile (BLOCK_H 64, 8 warps, 2 stages)
# for 128 heads 576/512, 64 tokens, 4k context; None: the target stays narrow.
EXPECTED_WIDE = {
    "sm_90": (64, 229376, 1),  # the Hopper kernel: one resident per SM, floor(132 / 128)
    "sm_100": None,  # its compile needs 352816 B > 232448 B (compile matrix); narrow N64 w8
    "sm_80": (32, 151552, 1),  # N64 needs 229376 B > 166912 B
    "sm_86": None,  # 99 KB: no 64-head tile fits
    "gfx942": None,  # HIP: narrow (no AMD register calibration)
}


@pytest.mark.parametrize(("arch", "dk", "r"), sorted(EXPECTED))
def test_exact_tiles_cuda_and_hip(arch, dk, r):
    target = get_target(arch)
    block_n, warps, stages, smem, splits, *prefetch = EXPECTED[arch, dk, r]
    rope = dk - r
    want = MlaTiles(
        block_h=16,
        padded_heads=16,
        block_n=block_n,
        block_dv=next_pow2(r),
        block_dpe=next_pow2(rope) if rope else 0,
        num_kv_splits=splits,
        options=LaunchOptions(warps, stages, (1 if r >= 512 else 2) if target.is_hip else None),
        reduce_options=LaunchOptions(4, 1, 2 if target.is_hip else None),
        smem_bytes=smem,
        prefetch_rows=bool(prefetch),
        tma=not target.is_hip and target.capability >= 90,  # sm_90, sm_100, sm_120
    )
    assert mla_decode_tiles(target, problem(dk, r, ready=arch != "sm_90")) == want


@pytest.mark.parametrize("arch", sorted(EXPECTED_WIDE))
def test_exact_wide_tiles_for_many_heads(arch):
    target = get_target(arch)
    t = mla_decode_tiles(target, problem(heads=128))
    if EXPECTED_WIDE[arch] is None:
        assert t.block_h == 16
        return
    block_n, smem, splits = EXPECTED_WIDE[arch]
    assert t == MlaTiles(
        block_h=64,
        padded_heads=128,
        block_n=block_n,
        block_dv=512,
        block_dpe=64,
        num_kv_splits=splits,
        options=LaunchOptions(8, 2, None),
        reduce_options=LaunchOptions(4, 1, None),
        smem_bytes=smem,
        tma=target.capability >= 90,
        sm90_kernel=arch == "sm_90",
    )
    assert mla_reg_estimate(64, block_n, 512, 64, 8, 2) <= REG_BUDGET


def test_register_estimate_matches_sm90_compiles():
    # sm_90 compiles: H16 N64 4 warps spilled, H16 N32 4 warps, H16 N64 8 warps (181
    # registers) and H64 N64 8 warps did not; the budget separates them.
    assert mla_reg_estimate(16, 64, 512, 64, 4, 2) == 208 > REG_BUDGET
    assert mla_reg_estimate(16, 32, 512, 64, 4, 2) == 136 <= REG_BUDGET
    assert mla_reg_estimate(16, 64, 512, 64, 8, 2) == 104 <= REG_BUDGET
    assert mla_reg_estimate(64, 64, 512, 64, 8, 2) == 200 <= REG_BUDGET


@pytest.mark.parametrize("arch", sorted(TARGETS))
@pytest.mark.parametrize(("dk", "r"), SHAPES)
def test_budget_fits_every_target(arch, dk, r):
    target = get_target(arch)
    for heads in (1, 16, 128):
        for elem in GPU_ELEM_SIZES:
            t = mla_decode_tiles(target, problem(dk, r, heads, elem))
            assert t.smem_bytes == mla_smem_bytes(
                t.block_h,
                t.block_n,
                t.block_dv,
                t.block_dpe,
                t.options.num_stages,
                elem,
                t.prefetch_rows,
            )
            assert t.smem_bytes <= target.max_shared_mem
            assert t.options.num_stages <= target.max_num_stages
            assert (t.options.waves_per_eu is not None) == target.is_hip


@pytest.mark.parametrize(("dk", "r"), SHAPES)
def test_lesson1_widths_come_from_rank_not_head_dim(dk, r):
    t = mla_decode_tiles(get_target("sm_86"), problem(dk, r))
    assert t.block_dv == next_pow2(r)
    assert t.block_dpe == (next_pow2(dk - r) if dk > r else 0)
    if next_pow2(dk) != next_pow2(r):  # 576 -> 1024, 320 -> 512: the upstream failure's widths
        assert t.block_dv != next_pow2(dk)


@pytest.mark.parametrize("heads", HEADS)
def test_lesson2_heads_padded_to_matrix_rows(heads):
    for arch in ("sm_90", "gfx942"):
        target = get_target(arch)
        t = mla_decode_tiles(target, problem(heads=heads))
        assert t.block_h >= target.mma_min_rows == 16
        assert t.block_h == (64 if arch == "sm_90" else 16)
        assert t.padded_heads == -(-heads // t.block_h) * t.block_h
        assert t.head_groups * t.block_h == t.padded_heads


def test_split_count_is_policy_of_target_batch_heads_context():
    h100 = get_target("sm_90")  # 132 SMs; the narrow 576/512 tile (167936 B): 1 program per SM
    narrow = dict(heads=16, ready=False)
    assert mla_decode_tiles(h100, problem(**narrow, tokens=64, context=4096)).num_kv_splits == 2
    assert mla_decode_tiles(h100, problem(**narrow, tokens=64, context=16384)).num_kv_splits == 2
    assert mla_decode_tiles(h100, problem(**narrow, tokens=32, context=4096)).num_kv_splits == 4
    # two resident programs (320/256, 94208 B): one wave of 264 slots
    assert mla_decode_tiles(h100, problem(320, 256, tokens=64, ready=False)).num_kv_splits == 4
    # the Hopper kernel's wide tile fills one wave of 132: 64 tokens x 2 head groups x 1 split;
    # 16 tokens: 32 programs x 4 splits; sm_80's portable wide tile aims at 2 x 108 programs
    assert mla_decode_tiles(h100, problem(heads=128, tokens=64, context=4096)).num_kv_splits == 1
    assert mla_decode_tiles(h100, problem(heads=128, tokens=16, context=4096)).num_kv_splits == 4
    a100 = get_target("sm_80")
    assert mla_decode_tiles(a100, problem(heads=128, tokens=32, context=4096)).num_kv_splits == 3
    # small batch, long context: capped; short context: never a split under 256 tokens
    assert mla_decode_tiles(h100, problem(tokens=1, context=32768)).num_kv_splits == MAX_KV_SPLITS
    assert mla_decode_tiles(h100, problem(tokens=1, context=1000)).num_kv_splits == 3
    assert mla_decode_tiles(h100, problem(tokens=1, context=40)).num_kv_splits == 1
    # a full GPU without splitting: one
    assert mla_decode_tiles(h100, problem(tokens=2048, context=4096)).num_kv_splits == 1
    # more multiprocessors, more splits (HIP aims at 2 programs per CU)
    mi300 = get_target("gfx942")  # 304 CUs
    assert mla_decode_tiles(mi300, problem(heads=16, tokens=64, context=4096)).num_kv_splits == 9


def test_smem_estimate_counts_prefetch_buffers():
    # prefetched rows: num_stages - 1 latent buffers, the figures sm_90 compiles allocate
    assert mla_smem_bytes(16, 64, 512, 64, 3, 2, prefetch_rows=True) == 167936
    assert mla_smem_bytes(16, 32, 512, 64, 3, 2, prefetch_rows=True) == 93184
    # without prefetch the estimate stays an upper bound of num_stages buffers
    assert mla_smem_bytes(16, 32, 512, 64, 3, 2) == 130048


def test_fp32_latent_512_does_not_fit_64kb():
    with pytest.raises(ValueError, match=r"no tile fits gfx942's 65536 B .* use a 2-byte dtype"):
        mla_decode_tiles(get_target("gfx942"), problem(elem=4))
    # a rank no dtype can serve gets no dtype advice
    with pytest.raises(ValueError, match=r"no tile fits gfx942's .*needs \d+ B\)$"):
        mla_decode_tiles(get_target("gfx942"), problem(dk=2**20, elem=2))
    # fp32 runs exact FMA dots: the narrowest tile at 8 warps, 2 stages, no prefetched rows, no
    # descriptors, never the wide tile (policy.mla.FP32_BLOCK_N: the 16-bit rule's N64 w4 spilled
    # 38 KB and overflowed sm_90's shared memory on an H100)
    # (on gfx950, over the 512-wide latent: 4 warps at one wave a SIMD, as its 16-bit tile)
    for arch, heads in (("sm_90", 16), ("sm_90", 128), ("sm_86", 16), ("gfx950", 16)):
        t = mla_decode_tiles(get_target(arch), problem(elem=4, heads=heads))
        warps, waves = (4, 1) if arch == "gfx950" else (8, None)
        assert (t.block_h, t.block_n, t.options.num_warps) == (16, 16, warps), arch
        assert t.options.waves_per_eu == waves, arch
        assert not (t.prefetch_rows or t.tma or t.sm90_kernel), arch
        assert t.smem_bytes <= get_target(arch).max_shared_mem
    # splits as for every unpacked HIP tile: floor(2 * 256 / 64) = 8
    assert mla_decode_tiles(get_target("gfx950"), problem(elem=4)).num_kv_splits == 8
    # rank 256 in fp32 keeps the fp32 rule (8 warps, two waves a SIMD)
    t = mla_decode_tiles(get_target("gfx950"), problem(dk=320, r=256, elem=4))
    assert (t.options.num_warps, t.options.waves_per_eu) == (8, 2)


def test_invalid_problem_lists_every_reason():
    with pytest.raises(
        ValueError,
        match=r"mla_decode_tiles: num_heads must be an int >= 1; got 0; .*num_tokens must be an "
        r"int >= 0; got -1; kv_lora_rank must be <= head_dim_k; got 600 > 576",
    ):
        mla_decode_tiles(get_target("sm_90"), MlaProblem(0, 576, 600, 2, -1, 10))
    # a float (it came back as float tiles), a bool, an element size of 3 bytes, a flag that is
    # not a bool
    for bad, rule in ((dict(num_heads=1.5), "num_heads must be an int >= 1; got 1.5"),
                      (dict(elem_size=True), "elem_size must be an int >= 1; got True"),
                      (dict(elem_size=3), "elem_size must be 1, 2 or 4 bytes; got 3"),
                      (dict(sm90_ready="no"), "sm90_ready must be a bool; got 'no'")):  # fmt: skip
        with pytest.raises(ValueError, match=r"^mla_decode_tiles: " + re.escape(rule)):
            mla_decode_tiles(get_target("sm_90"), dataclasses.replace(problem(), **bad))


def test_pure_and_frozen():
    target = get_target("sm_90")
    a, b = mla_decode_tiles(target, problem()), mla_decode_tiles(target, problem())
    assert a == b
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.block_n = 16  # type: ignore[misc]


@pytest.mark.parametrize(
    ("arch", "elem", "wide"),
    [("sm_90", 2, True), ("sm_90", 4, False), ("sm_80", 2, False), ("gfx942", 2, False)],
)
@pytest.mark.parametrize("heads", [1, 16, 32, 63])
def test_sm90_16bit_takes_the_wide_tile_below_64_heads(arch, elem, wide, heads):
    """Below 64 heads a 16-bit launch whose cache the sm_90 kernel can run takes its wide tile
    (rows padded to 64; two splits for 64 sequences at 4k), only in 16-bit on sm_90; a cache
    it cannot run (``sm90_ready`` False) keeps the narrow tile, as every other target does."""
    target = get_target(arch)
    got = mla_decode_tiles(target, problem(heads=heads, elem=elem))
    narrow = mla_decode_tiles(target, problem(heads=heads, elem=elem, ready=False))
    if wide:
        assert (got.block_h, got.block_n, got.padded_heads, got.sm90_kernel) == (64, 64, 64, True)
        assert got.num_kv_splits == 2
    else:
        assert got == narrow
    assert narrow.block_h < 64 and not narrow.sm90_kernel


def test_sm90_gathers_rows_of_slots_and_odd_pages():
    from portattn.policy.mla import sm90_gathers

    assert [sm90_gathers(p, False, False) for p in (1, 16, 64, 128, 96)] == [
        True,
        True,
        False,
        False,
        True,
    ]
    assert sm90_gathers(64, True, False)  # page_indices address single slots
    assert sm90_gathers(64, False, True)  # the heads as N gather every page size


@pytest.mark.parametrize(
    ("arch", "dk", "rank", "store_smem"),
    [("sm_90", 576, 512, True), ("sm_90", 320, 256, False), ("sm_80", 576, 512, False)],
)
def test_config_stores_through_shared_memory_at_the_rank_a_gpu_ran(arch, dk, rank, store_smem):
    """`mla_config`: the Hopper kernel's one-split output through shared memory at rank 512
    only (`SM90_STORE_SMEM_RANKS`); other targets never run that kernel."""
    from portattn.policy.mla import MlaConfig, mla_config, mla_config_errors

    target, problem = get_target(arch), MlaProblem(128, dk, rank, 2, 64, 4096)
    config = mla_config(target, problem, mla_decode_tiles(target, problem))
    assert config == MlaConfig(store_smem=store_smem)
    assert mla_config_errors(config, rank, 128) == []
    assert mla_config_errors(MlaConfig(store_smem=True), 256, 128) == [
        "config.store_smem must be False at kv_lora_rank 256 (the shared-memory store is built "
        "for ranks (512,)); got True"
    ]


@pytest.mark.parametrize(
    ("arch", "heads", "q_len", "tiles_q_len", "heads_n"),
    [
        ("sm_90", 16, 1, 1, True),
        ("sm_90", 1, 1, 1, True),
        ("sm_90", 17, 1, 1, False),
        ("sm_90", 16, 2, 2, False),  # verification steps pack their rows
        ("sm_90", 16, 1, 8, False),  # tiles a builder sized for verification pack them too
        ("sm_80", 16, 1, 1, False),
        ("gfx942", 16, 1, 1, False),
    ],
)
def test_config_takes_the_heads_as_n_at_up_to_16_heads_of_one_token(
    arch, heads, q_len, tiles_q_len, heads_n
):
    """`mla_config`: the Hopper kernel's MMAs take the heads as N (`MlaConfig.heads_n`) at up
    to `HEADS_N_MAX` heads of one query token, on tiles that do not pack (token, head) rows;
    a config asking for it past that is refused."""
    from portattn.policy.mla import HEADS_N_MAX, MlaConfig, mla_config, mla_config_errors

    target = get_target(arch)
    problem = MlaProblem(heads, 576, 512, 2, 64, 4096, max_query_len=q_len, sm90_ready=True)
    sized = MlaProblem(heads, 576, 512, 2, 64, 4096, max_query_len=tiles_q_len, sm90_ready=True)
    tiles = mla_decode_tiles(target, sized)
    assert tiles.packed is (arch == "sm_90" and tiles_q_len > 1)
    assert mla_config(target, problem, tiles).heads_n is heads_n
    assert mla_config_errors(MlaConfig(heads_n=True), 512, HEADS_N_MAX) == []
    assert mla_config_errors(MlaConfig(heads_n=True), 512, 17) == [
        "config.heads_n must be False at 17 heads (the heads are the MMAs' N up to 16); got True"
    ]


# -- HIP verification: packed (query token, head) rows -------------------------------------------

HIP_ARCHS = ("gfx90a", "gfx942", "gfx950")


def verify_problem(heads, q_len, dk=576, r=512, batch=64, context=4096, elem=2) -> MlaProblem:
    return MlaProblem(heads, dk, r, elem, batch * q_len, context, q_len)


# (arch, heads, q_len) -> (block_h, num_kv_splits) at 576/512, batch 64, 4k. Every packed HIP
# tile is N32 at 4 warps, 2 stages and one wave a SIMD (`HIP_PACK_*`: the tile that compiles
# without spills on all three targets), 32 rows (16 where there are no more rows than that: one
# head), 36864 B of LDS (one 32 x 576 KV tile, `mla_hip_packed_lds_bytes`). Splits: one wave of
# one program a CU over 64 sequences x row groups (gfx942, 16 heads, q 4: 2 groups,
# floor(304 / 128) = 2; gfx90a's 110 CUs: 1).
EXPECTED_HIP_PACKED = {
    ("gfx90a", 1, 8): (16, 1),
    ("gfx90a", 16, 4): (32, 1),
    ("gfx942", 1, 2): (16, 4),
    ("gfx942", 16, 2): (32, 4),
    ("gfx942", 16, 4): (32, 2),
    ("gfx942", 16, 8): (32, 1),
    ("gfx942", 128, 8): (32, 1),
    ("gfx950", 1, 4): (16, 4),
    ("gfx950", 16, 2): (32, 4),
    ("gfx950", 16, 4): (32, 2),
    ("gfx950", 16, 8): (32, 1),
    ("gfx950", 128, 2): (32, 1),
}


@pytest.mark.parametrize(("arch", "heads", "q_len"), sorted(EXPECTED_HIP_PACKED))
def test_exact_hip_packed_tiles(arch, heads, q_len):
    target = get_target(arch)
    block_h, splits = EXPECTED_HIP_PACKED[arch, heads, q_len]
    assert mla_decode_tiles(target, verify_problem(heads, q_len)) == MlaTiles(
        block_h=block_h,
        padded_heads=-(-heads // block_h) * block_h,
        block_n=32,
        block_dv=512,
        block_dpe=64,
        num_kv_splits=splits,
        options=LaunchOptions(4, 2, 1),
        reduce_options=LaunchOptions(4, 1, 2),
        smem_bytes=36864,
        packed=True,
    )


def test_tile_reads_of_a_sequence():
    from portattn.policy.mla import mla_tile_reads

    assert mla_tile_reads(16, 16, 4, packed=False) == 4  # each token's one head group
    assert mla_tile_reads(64, 16, 4, packed=True) == 1
    assert mla_tile_reads(32, 16, 8, packed=True) == 4
    assert mla_tile_reads(16, 3, 5, packed=True) == 1  # 15 rows
    assert mla_tile_reads(16, 20, 2, packed=False) == 4  # 20 heads: 2 groups a token
    assert mla_tile_reads(16, 20, 2, packed=True) == 3  # 40 rows


@pytest.mark.parametrize("arch", HIP_ARCHS)
@pytest.mark.parametrize(("dk", "r"), SHAPES)
def test_hip_packing_rule_and_budgets(arch, dk, r):
    """Every HIP verification problem (1-128 heads, q_len 2-8): packed exactly where a tile of
    `HIP_PACK_BLOCK_H` rows (no more than the rows there are) fits the LDS and the register
    budget at 64-lane wavefronts (N16, 8 warps, the target's deepest stages that fit) and reads
    fewer KV tiles than the unpacked 16-row tile; the most such rows; else the unpacked tiles
    themselves."""
    from portattn.policy.mla import (
        HIP_ONE_WAVE_PER_EU,
        HIP_PACK_BLOCK_H,
        HIP_PACK_BLOCK_N,
        HIP_PACK_NUM_STAGES,
        HIP_PACK_NUM_WARPS,
        mla_hip_packed_lds_bytes,
        mla_tile_reads,
    )

    target = get_target(arch)
    for heads in HEADS:
        for q_len in (2, 3, 4, 5, 8):
            t = mla_decode_tiles(target, verify_problem(heads, q_len, dk, r))
            unpacked = mla_tile_reads(16, heads, q_len, packed=False)
            rows = heads * q_len
            if not t.packed:
                assert t == mla_decode_tiles(target, problem(dk, r, heads, tokens=64 * q_len))
                continue
            assert t.block_h in HIP_PACK_BLOCK_H and t.block_h <= max(16, next_pow2(rows))
            o = t.options
            assert (t.block_n, o.num_warps, o.num_stages, o.waves_per_eu) == (
                HIP_PACK_BLOCK_N,
                HIP_PACK_NUM_WARPS,
                HIP_PACK_NUM_STAGES,
                HIP_ONE_WAVE_PER_EU,
            )
            assert mla_tile_reads(t.block_h, heads, q_len, packed=True) < unpacked
            regs = mla_reg_estimate(t.block_h, t.block_n, t.block_dv, t.block_dpe, 4, 2, 64)
            assert regs <= REG_BUDGET and t.smem_bytes <= target.max_shared_mem
            assert t.smem_bytes == mla_hip_packed_lds_bytes(
                t.block_h, t.block_n, t.block_dv, t.block_dpe, 2
            )
            assert not (t.tma or t.sm90_kernel or t.prefetch_rows)
            # the splits fill one program a CU: one more would not fit the wave
            groups = -(-rows // t.block_h)
            programs = 64 * groups * t.num_kv_splits
            assert t.num_kv_splits == 1 or programs <= target.num_sms
            # no more rows would have fitted: the next candidate's tile overflows
            bigger = [h for h in HIP_PACK_BLOCK_H if t.block_h < h <= max(16, next_pow2(rows))]
            for h in bigger:
                lds = mla_hip_packed_lds_bytes(h, HIP_PACK_BLOCK_N, t.block_dv, t.block_dpe, 2)
                big_regs = mla_reg_estimate(
                    h, HIP_PACK_BLOCK_N, t.block_dv, t.block_dpe, HIP_PACK_NUM_WARPS, 2, 64
                )
                assert lds > target.max_shared_mem or big_regs > REG_BUDGET, (heads, q_len)


@pytest.mark.parametrize("arch", HIP_ARCHS)
def test_hip_packs_only_16_bit_verification(arch):
    """Plain decode, fp32 and a row count whose 16-row tile reads as much as one token's heads
    (16 heads need 32 rows to gain) keep the unpacked tiles."""
    target = get_target(arch)
    assert not mla_decode_tiles(target, verify_problem(16, 1)).packed
    fp32 = verify_problem(16, 4, 192, 128, elem=4)
    assert not mla_decode_tiles(target, fp32).packed
    assert mla_decode_tiles(target, verify_problem(1, 2)).packed  # 2 rows: 1 tile, not 2


def test_cuda_targets_keep_their_tiles():
    """HIP packing leaves every NVIDIA choice alone: only sm_90 packs, into the Hopper kernel's
    64-row tile; the other CUDA targets' verification tiles are those of the same tokens
    unpacked."""
    for arch, target in TARGETS.items():
        if target.is_hip:
            continue
        for heads in HEADS:
            for q_len in (2, 4, 8):
                t = mla_decode_tiles(target, verify_problem(heads, q_len))
                if arch == "sm_90" and t.packed:
                    assert (t.block_h, t.block_n, t.sm90_kernel) == (64, 64, True)
                    continue
                assert not t.packed
                flat = mla_decode_tiles(target, problem(heads=heads, tokens=64 * q_len))
                assert t == flat, (arch, heads, q_len)


@pytest.mark.parametrize("rank", [576, 1024])
def test_a_latent_wider_than_512_is_refused_by_name(rank):
    """1024-wide value tiles were planned past the budgets' model: 102400 B of shared memory on
    sm_89 (limit 101376) and spills on every vendor, where the op promised a clear refusal."""
    from portattn.platform import get_target
    from portattn.policy.mla import MlaProblem, mla_decode_tiles

    for arch in ("sm_89", "gfx942"):
        with pytest.raises(ValueError, match=f"kv_lora_rank must be <= 512 .*; got {rank}"):
            mla_decode_tiles(get_target(arch), MlaProblem(16, rank + 64, rank, 2, 64, 4096, 1))


@pytest.mark.parametrize(
    ("dk", "rank", "dv", "dpe"),
    [(16, 8, 16, 16), (8, 8, 16, 0), (10, 3, 16, 16), (576, 512, 512, 64)],
)
def test_latent_and_rope_tiles_are_at_least_a_dot_wide(dk, rank, dv, dpe):
    """NVIDIA's tl.dot needs K and N >= 16: narrower parts get 16-column tiles (masked)."""
    from portattn.platform import get_target
    from portattn.policy.mla import MlaProblem, mla_decode_tiles

    t = mla_decode_tiles(get_target("sm_80"), MlaProblem(4, dk, rank, 2, 8, 64, 1))
    assert (t.block_dv, t.block_dpe) == (dv, dpe)


@pytest.mark.parametrize(
    ("dk", "r", "ready"),
    [(448, 384, True), (576, 512, False), (320, 256, False)],
)
def test_sm90_portable_wide_tile_stops_at_32_tokens(dk, r, ready):
    """At 64 heads a launch the Hopper kernel cannot run (a rank it is not built for, or a
    cache it cannot read) runs the portable kernel, whose 64 x 64 wide tile spilled 108-232 B on
    sm_90: it takes 32 tokens; a launch the Hopper kernel runs keeps its 64."""
    sm90 = get_target("sm_90")
    t = mla_decode_tiles(sm90, problem(dk, r, heads=128, ready=ready))
    assert (t.block_h, t.block_n, t.sm90_kernel) == (64, 32, False)
    hopper = mla_decode_tiles(sm90, problem(heads=128))
    assert (hopper.block_h, hopper.block_n, hopper.sm90_kernel) == (64, 64, True)


@pytest.mark.parametrize("dk", [544, 512])
def test_the_register_estimate_counts_a_rope_tile_of_64_over_a_512_latent(dk):
    """A 32-wide rope, or none, let a 16-head, 64-token, 4-warp tile through on sm_80 (its
    estimate 200 / 192), which spilled 228-268 B: the estimate counts a 64-wide rope tile there,
    so the tile takes 8 warps, which compiled without spills."""
    t = mla_decode_tiles(get_target("sm_80"), problem(dk, 512, ready=False))
    assert (t.block_h, t.block_n, t.options.num_warps, t.prefetch_rows) == (16, 64, 8, True)
    # the rank the estimate was fitted at keeps its tile
    t = mla_decode_tiles(get_target("sm_80"), problem(576, 512))
    assert (t.block_n, t.options.num_warps) == (32, 4)
