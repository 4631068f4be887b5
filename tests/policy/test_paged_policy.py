"""Paged-attention tile policy: exact choices per vendor, the budget, block-size independence."""

from __future__ import annotations

import itertools
import re
from dataclasses import replace

import pytest

from portattn.platform import TARGETS, get_target
from portattn.policy.common import LaunchOptions
from portattn.policy.paged import (
    FP32_BLOCK_M,
    FP32_MAX_WORDS,
    FP32_NUM_WARPS,
    MAX_REGS_4_WARPS_SMEM_MMA,
    MAX_REGS_8_WARPS,
    MAX_WORDS_8_WARPS,
    SHUFFLE_ADDR_WORDS,
    SHUFFLE_WARPS_ELEM_BYTES,
    SMEM_MMA_ARCHS,
    WIDE_MAX_REGS,
    WIDE_TILE_ARCHS,
    PagedConfig,
    PagedProblem,
    PagedTiles,
    PrefillConfig,
    RowTile,
    estimate_registers,
    estimate_shared_mem,
    estimate_words,
    paged_config,
    paged_tiles,
    plan_max_seq_len,
    prefill_config,
    split_count,
)

pytestmark = pytest.mark.policy

BLOCK_SIZES = (1, 16, 80, 544, 2048)
HEAD_DIMS = (64, 80, 128, 256)
GQA = ((8, 8), (10, 2), (32, 4), (8, 1), (128, 1))  # 1:1, 5:1, 8:1, 8:1 MQA, 128:1 MQA
ELEM_BYTES = (2, 4)  # fp16/bf16, fp32
MAX_QUERY_LENS = (1, 6, 512)
DEC_4x4 = RowTile(16, 4, 4)  # decode row tile of GQA 4:1: 4 tokens x 4 heads
SHUFFLED = (False, True)  # KV cache layout NHD / SHUFFLE


def _problem(**kw) -> PagedProblem:
    base = dict(
        num_q_heads=32, num_kv_heads=8, head_dim=128, elem_bytes=2, max_query_len=1, block_size=16
    )
    base.update(kw)
    return PagedProblem(**base)


# Exact choices, CUDA and HIP side by side. Each expected shared_mem_bytes is the budget formula
# 2*stages*block_n*block_d*e + block_m*block_d*e + block_m*block_n*e; 8 warps where the register
# estimate (block_m*block_d + block_m*block_n + block_n*block_d*e/4) / (4*warp_size) exceeds 64.
EXACT = [
    # decode, GQA 4:1, head_dim 128, fp16: 16 rows = 4 heads x 4 tokens
    (
        "sm_90",
        _problem(),
        PagedTiles(16, 4, 4, 64, 128, LaunchOptions(4, 2), 65536 + 4096 + 2048),
    ),
    (
        "gfx942",
        _problem(),  # (64, 2 stages) would need 71680 B > 65536 B -> block_n 32
        PagedTiles(16, 4, 4, 32, 128, LaunchOptions(4, 2, 2), 32768 + 4096 + 1024),
    ),
    # prefill chunk of 512, GQA 4:1, block_size 2048 (the tile does not follow it); the decode
    # sequences of the batch get the 16-row decode tile (4 tokens x 4 heads)
    (
        "sm_100",  # wide 128 x 64: 8-warp registers (16384 + 8192 + 4096) / 256 = 112 <= 112
        _problem(max_query_len=512, block_size=2048),
        PagedTiles(128, 32, 4, 64, 128, LaunchOptions(8, 2), 65536 + 32768 + 16384, DEC_4x4),
    ),
    (
        "sm_90",  # not wide (measured slower on an H100); 64 rows at 4 warps: one warpgroup with
        # shared-memory operands, 4-warp estimate (8192 + 4096 + 4096) / 128 = 128 <= 128
        _problem(max_query_len=512, block_size=2048),
        PagedTiles(64, 16, 4, 64, 128, LaunchOptions(4, 2), 65536 + 16384 + 8192, DEC_4x4),
    ),
    (
        "sm_86",  # wide at 2 stages is 114688 B > 101376 B; 64 rows, 3 stages (122880 B) neither
        _problem(max_query_len=512, block_size=2048),
        PagedTiles(64, 16, 4, 64, 128, LaunchOptions(8, 2), 65536 + 16384 + 8192, DEC_4x4),
    ),
    (
        "gfx942",
        _problem(max_query_len=512, block_size=2048),
        PagedTiles(64, 16, 4, 32, 128, LaunchOptions(4, 2, 2), 32768 + 16384 + 4096, DEC_4x4),
    ),
    # decode with a known 16k context: batch 4 x 8 KV heads = 32 programs < 2 x 132 -> 16 splits
    (
        "sm_90",
        _problem(num_seqs=4, max_seq_len=16384),
        PagedTiles(16, 4, 4, 64, 128, LaunchOptions(4, 2), 65536 + 4096 + 2048, num_splits=16),
    ),
    # head_dim 256 in fp32, GQA 5:1 on the 64 KB LDS part: only 16 x 16, one stage fits
    (
        "gfx942",
        _problem(num_q_heads=40, head_dim=256, elem_bytes=4, max_query_len=64, block_size=544),
        PagedTiles(16, 3, 5, 16, 256, LaunchOptions(4, 1, 2), 32768 + 16384 + 1024),
    ),
    (
        "sm_90",  # fp32 on NVIDIA (FMA dots): 16 rows, 8 warps; block_n 32 is 12800 words > 10240
        # (the 16-bit rule's 64 x 16 x 8 warps spilled 23420 B)
        _problem(num_q_heads=40, head_dim=256, elem_bytes=4, max_query_len=64, block_size=544),
        PagedTiles(16, 3, 5, 16, 256, LaunchOptions(8, 2), 65536 + 16384 + 1024),
    ),
    # fp32 prefill chunk, GQA 5:1, head_dim 128 (the worst former spill: 64 x 64 x 8 warps,
    # 36032 B on sm_90, 37008 B on sm_100): 16 x 32 (6656 words; 16 x 64 is 11264 > 10240)
    (
        "sm_90",
        _problem(num_q_heads=40, head_dim=128, elem_bytes=4, max_query_len=64),
        PagedTiles(16, 3, 5, 32, 128, LaunchOptions(8, 2), 65536 + 8192 + 2048),
    ),
    (
        "sm_100",  # no wide tile either (the 16-bit rule took 128 x 64 for head_dim 64)
        _problem(num_q_heads=40, head_dim=64, elem_bytes=4, max_query_len=64),
        PagedTiles(16, 3, 5, 64, 64, LaunchOptions(8, 2), 65536 + 4096 + 4096),
    ),
    # ... and on SHUFFLE: 16 x 32 is 2048 + 512 + 4096 + 4096 = 10752 words > 10240 -> 16 x 16
    (
        "sm_86",
        _problem(num_q_heads=40, head_dim=128, elem_bytes=4, max_query_len=64, shuffled=True),
        PagedTiles(16, 3, 5, 16, 128, LaunchOptions(8, 2), 32768 + 8192 + 1024),
    ),
    # AMD keeps the 16-bit model for fp32 (MFMA has fp32 instructions; no spills there)
    (
        "gfx950",
        _problem(num_q_heads=40, head_dim=128, elem_bytes=4, max_query_len=64),
        PagedTiles(
            64, 12, 5, 32, 128, LaunchOptions(4, 2, 2), 65536 + 32768 + 8192, RowTile(16, 3, 5)
        ),
    ),
    (
        "gfx942",
        _problem(num_q_heads=40, head_dim=128, elem_bytes=4, max_query_len=64),
        PagedTiles(
            64, 12, 5, 16, 128, LaunchOptions(4, 1, 2), 16384 + 32768 + 4096, RowTile(16, 3, 5)
        ),
    ),
    # MQA with 128 heads: one wide program holds the whole group (K/V read once, not twice)
    (
        "sm_100",
        _problem(num_q_heads=128, num_kv_heads=1, head_dim=64),
        PagedTiles(128, 1, 128, 64, 64, LaunchOptions(8, 2), 32768 + 16384 + 16384),
    ),
    (
        "sm_90",  # 64 heads each, one warpgroup: (4096 + 4096 + 2048) / 128 = 80 <= 128
        _problem(num_q_heads=128, num_kv_heads=1, head_dim=64),
        PagedTiles(64, 1, 64, 64, 64, LaunchOptions(4, 2), 32768 + 8192 + 8192),
    ),
    (
        "gfx950",  # fits the wide tile's memory, but MFMA keeps Q in registers: 64 heads each
        _problem(num_q_heads=128, num_kv_heads=1, head_dim=64),
        PagedTiles(64, 1, 64, 64, 64, LaunchOptions(4, 2, 2), 32768 + 8192 + 8192),
    ),
    (
        "gfx942",  # head_dim 128: the wide tile (114688 B) does not fit 64 KB; 64 heads each
        _problem(num_q_heads=128, num_kv_heads=1, head_dim=128),
        PagedTiles(64, 1, 64, 32, 128, LaunchOptions(4, 2, 2), 32768 + 16384 + 4096),
    ),
    # non-power-of-two head_dim 80 pads to 128
    (
        "sm_120",  # 101376 B: 3 stages (104448 B) do not fit; MHA: decode tile = this tile
        _problem(num_q_heads=8, num_kv_heads=8, head_dim=80, max_query_len=6),
        PagedTiles(16, 16, 1, 64, 128, LaunchOptions(4, 2), 65536 + 4096 + 2048),
    ),
    # SHUFFLE caches: + SHUFFLE_ADDR_WORDS * block_n * block_d words in the per-program words
    # bound (at most MAX_WORDS_8_WARPS, 24576, below block_n 16), in the warp count only in fp32
    # (16-bit caches load 16-byte vectors, which need no per-element words), never the wide tile.
    # MHA decode, head_dim 128: 4 warps like NHD, (2048 + 1024 + 4096) / 128 = 56 (the address
    # words made it 120 -> 8 warps before); on sm_90 the cache-order reads keep the 64-token KV
    # tile under a register cap (`SHUFFLE_REG_CAP`: 142 registers uncapped, 3 programs per SM;
    # 128 capped, 4 like NHD; the 32-token tile kept too few bytes in flight: docs/decisions.md)
    (
        "sm_90",
        _problem(num_q_heads=8, head_dim=128, shuffled=True),
        PagedTiles(16, 16, 1, 64, 128, LaunchOptions(4, 2, maxnreg=128), 65536 + 4096 + 2048),
    ),
    # head_dim 64 keeps NHD's 64-token tile uncapped (80 registers: 6 programs an SM; a cap of
    # 128 made ptxas take 126)
    (
        "sm_90",
        _problem(num_q_heads=8, head_dim=64, shuffled=True),
        PagedTiles(16, 16, 1, 64, 64, LaunchOptions(4, 2), 32768 + 2048 + 2048),
    ),
    (
        "gfx950",  # 64 lanes: 7168 / 256 = 28 <= 64 -> 4 warps (166 VGPRs, no spills)
        _problem(num_q_heads=8, head_dim=128, shuffled=True),
        PagedTiles(16, 16, 1, 64, 128, LaunchOptions(4, 2, 2), 65536 + 4096 + 2048),
    ),
    # GQA 4:1 decode, head_dim 256: block_n 64 is 4096 + 1024 + 8192 + 16384 = 29696 words >
    # 24576 -> block_n 32 (NHD: 64; at 64, 8 warps, ptxas parks 16-28 B at 128 registers on
    # sm_80-sm_100); 4 warps (4096 + 512 + 4096) / 128 = 68 > 64 on sm_90 -> 8 warps, 34 on
    # gfx950 -> 4 warps (153 VGPRs, no spills)
    (
        "sm_90",
        _problem(head_dim=256, shuffled=True),
        PagedTiles(16, 4, 4, 32, 256, LaunchOptions(8, 2), 65536 + 8192 + 1024),
    ),
    (
        "gfx950",  # was 16 x 64 x 4 warps: 174-176 VGPRs spilled (per-element offsets)
        _problem(head_dim=256, shuffled=True),
        PagedTiles(16, 4, 4, 32, 256, LaunchOptions(4, 2, 2), 65536 + 8192 + 1024),
    ),
    # NHD prefill, GQA 4:1, head_dim 256 on sm_90: 128 rows x 32 tokens at 8 warps, 64 rows a
    # warpgroup (the 64-row 8-warp tile split QK^T's N: m64n16 wgmmas); 16 rows of decode stay
    (
        "sm_90",
        _problem(head_dim=256, max_query_len=512),
        PagedTiles(
            128, 32, 4, 32, 256, LaunchOptions(8, 2), 65536 + 65536 + 8192, RowTile(16, 4, 4)
        ),
    ),
    (
        "sm_90",  # 64 rows of work (16 tokens x 4 heads): the 64-row tile at 8 warps
        _problem(head_dim=256, max_query_len=16),
        PagedTiles(
            64, 16, 4, 32, 256, LaunchOptions(8, 2), 65536 + 32768 + 4096, RowTile(16, 4, 4)
        ),
    ),
    # prefill chunk, GQA 5:1, head_dim 256: 64 x 32 is 16384 + 2048 + 4096 + 8192 = 30720 words
    # > 24576 -> 64 x 16 (NHD: 64 x 32, 22528 words)
    (
        "sm_80",  # was 64 x 32 x 8 warps: 32 B spilled
        _problem(num_q_heads=40, head_dim=256, max_query_len=512, shuffled=True),
        PagedTiles(
            64, 12, 5, 16, 256, LaunchOptions(8, 2), 32768 + 32768 + 2048, RowTile(16, 3, 5)
        ),
    ),
    (
        "gfx950",  # was 64 x 32 x 8 warps: 20-27 VGPRs spilled
        _problem(num_q_heads=40, head_dim=256, max_query_len=512, shuffled=True),
        PagedTiles(
            64, 12, 5, 16, 256, LaunchOptions(8, 2, 2), 32768 + 32768 + 2048, RowTile(16, 3, 5)
        ),
    ),
    # GQA 8:1 prefill, head_dim 64: NHD takes the wide tile on sm_100, SHUFFLE 64 rows (the wide
    # SHUFFLE tile spilled 24 B there); 4 warps (4096 + 4096 + 2048 + 4096) / 128 = 112 -> 8
    (
        "sm_100",
        _problem(num_q_heads=64, head_dim=64, max_query_len=512),
        PagedTiles(
            128, 16, 8, 64, 64, LaunchOptions(8, 2), 32768 + 16384 + 16384, RowTile(16, 2, 8)
        ),
    ),
    (
        "sm_100",
        _problem(num_q_heads=64, head_dim=64, max_query_len=512, shuffled=True),
        PagedTiles(64, 8, 8, 64, 64, LaunchOptions(8, 2), 32768 + 8192 + 8192, RowTile(16, 2, 8)),
    ),
]


@pytest.mark.parametrize(
    "arch,problem,expected", EXACT, ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(EXACT)]
)
def test_exact_choice(arch, problem, expected):
    assert paged_tiles(get_target(arch), problem) == expected


def test_block_size_2048_on_gfx942_fits_lds():
    """Lesson 3: the KV tile is bounded by the budget, never taken from block_size."""
    target = get_target("gfx942")
    for group_heads, elem in itertools.product(((32, 8), (8, 1)), ELEM_BYTES):
        tiles = paged_tiles(
            target,
            _problem(
                num_q_heads=group_heads[0],
                num_kv_heads=group_heads[1],
                elem_bytes=elem,
                max_query_len=2048,
                block_size=2048,
            ),
        )
        assert tiles.block_n <= 128
        assert tiles.shared_mem_bytes <= 65536
    # the naive rule (tile = block_size) asks for far more than the part has
    assert estimate_shared_mem(16, 2048, 128, 2, 2) > 65536


@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_every_choice_fits_the_budget(arch):
    target = TARGETS[arch]
    for bs, d, (hq, hkv), elem, mql, shuf in itertools.product(
        BLOCK_SIZES, HEAD_DIMS, GQA, ELEM_BYTES, MAX_QUERY_LENS, SHUFFLED
    ):
        problem = _problem(
            num_q_heads=hq,
            num_kv_heads=hkv,
            head_dim=d,
            elem_bytes=elem,
            max_query_len=mql,
            block_size=bs,
            shuffled=shuf,
        )
        t = paged_tiles(target, problem)
        assert t.shared_mem_bytes == estimate_shared_mem(
            t.block_m, t.block_n, t.block_d, elem, t.num_stages
        )
        assert t.shared_mem_bytes <= target.max_shared_mem, (problem, t)
        assert 16 <= t.block_n <= 128 and t.block_n & (t.block_n - 1) == 0
        assert t.block_d >= d and t.block_d & (t.block_d - 1) == 0
        assert t.block_m >= max(16, target.mma_min_rows)
        assert 1 <= t.head_tile <= hq // hkv and t.block_q * t.head_tile <= t.block_m
        assert t.block_q >= 1
        assert 1 <= t.num_stages <= target.max_num_stages
        assert (t.waves_per_eu is not None) == target.is_hip
        words = estimate_words(t.block_m, t.block_n, t.block_d, elem, shuf)
        if elem == 4 and not target.is_hip:  # FMA dots: 16 rows, 8 warps, FP32_MAX_WORDS
            assert (t.block_m, t.num_warps, t.decode) == (FP32_BLOCK_M, FP32_NUM_WARPS, None)
            assert t.block_n == 16 or words <= FP32_MAX_WORDS
        else:
            shuf_regs = shuf and elem in SHUFFLE_WARPS_ELEM_BYTES  # (16-bit: words bound only)
            regs4 = estimate_registers(
                t.block_m, t.block_n, t.block_d, elem, 4, target.warp_size, shuf_regs
            )
            smem_mma = arch in SMEM_MMA_ARCHS and t.block_m >= 64
            budget4 = MAX_REGS_4_WARPS_SMEM_MMA if smem_mma else 64
            assert t.num_warps == (4 if regs4 <= budget4 else 8)
            assert t.block_m == 128 or t.block_n == 16 or words <= MAX_WORDS_8_WARPS
        assert (
            t.block_m <= 64
            or (
                t.block_m == 128
                and not shuf
                and arch in WIDE_TILE_ARCHS
                and t.block_n == 64
                and estimate_registers(128, 64, t.block_d, elem, 8, target.warp_size)
                <= WIDE_MAX_REGS
            )
            or (  # sm_90's 8-warp tile: 64 rows a warpgroup
                (t.block_m, t.block_n, t.num_warps) == (128, 32, 8)
                and not shuf
                and arch in SMEM_MMA_ARCHS
                and mql * (hq // hkv) >= 128
            )
        )
        if t.decode is not None:  # a smaller row tile inside the same budget
            dec = t.decode
            assert mql > dec.block_q and dec.block_m < t.block_m
            assert dec.head_tile == min(hq // hkv, dec.block_m)
            assert dec.block_q == dec.block_m // dec.head_tile
        assert t.num_splits == 1  # no max_seq_len given


@pytest.mark.parametrize("arch", ("sm_90", "sm_86", "gfx942", "gfx950"))
def test_tiles_do_not_depend_on_block_size(arch):
    target = get_target(arch)
    for d, elem, mql in itertools.product(HEAD_DIMS, ELEM_BYTES, MAX_QUERY_LENS):
        choices = {
            paged_tiles(
                target, _problem(head_dim=d, elem_bytes=elem, max_query_len=mql, block_size=bs)
            )
            for bs in BLOCK_SIZES
        }
        assert len(choices) == 1


def test_estimate_formula():
    assert (
        estimate_shared_mem(16, 32, 128, 2, 2) == 2 * 2 * 32 * 128 * 2 + 16 * 128 * 2 + 16 * 32 * 2
    )


def test_register_estimate():
    # 64-row prefill tile at head_dim 128, fp16: 128 registers at 4 warps, 64 at 8; sm_90 takes
    # 4 warps (218 registers compiled, no spills: wgmma operands in shared memory), mma.sync
    # parts 8
    assert estimate_registers(64, 64, 128, 2, 4, 32) == 128 == MAX_REGS_4_WARPS_SMEM_MMA
    assert estimate_registers(64, 64, 128, 2, 8, 32) == 64
    # the same tile on a 64-lane wavefront
    assert estimate_registers(64, 32, 128, 2, 4, 64) == (8192 + 2048 + 2048) // 256
    # SHUFFLE caches add SHUFFLE_ADDR_WORDS per gathered K/V element (the warp count counts them
    # in fp32 only: `_num_warps`)
    assert SHUFFLE_ADDR_WORDS == 1 and SHUFFLE_WARPS_ELEM_BYTES == (4,)
    assert estimate_words(64, 64, 128, 2, shuffled=True) == 8192 + 4096 + 4096 + 8192
    assert estimate_registers(64, 64, 128, 2, 4, 32, shuffled=True) == 192
    # the 8-warp bound is NVIDIA's measured 96 registers x 256 threads, per program
    assert MAX_WORDS_8_WARPS == MAX_REGS_8_WARPS * 256 == 24576


def test_fp32_fma_rule_on_nvidia_only():
    """fp32 on NVIDIA: 16 rows x 8 warps and the FMA word budget; HIP fp32 and every 16-bit
    choice keep the MMA model (the constants' compile figures are in policy/paged.py)."""
    assert (FP32_BLOCK_M, FP32_NUM_WARPS, FP32_MAX_WORDS) == (16, 8, 10240)
    # the measured boundary: hd64 SHUFFLE 16 x 64 (clean) is inside, hd128 SHUFFLE 16 x 32
    # (72-112 B spilled on every NVIDIA target) and hd128 NHD 16 x 64 are outside
    assert estimate_words(16, 64, 64, 4, shuffled=True) == 10240 == FP32_MAX_WORDS
    assert estimate_words(16, 32, 128, 4, shuffled=True) == 10752 > FP32_MAX_WORDS
    assert estimate_words(16, 64, 128, 4) == 11264 > FP32_MAX_WORDS
    expected_n = {(64, False): 64, (64, True): 64, (128, False): 32, (128, True): 16}
    expected_n |= {(256, False): 16, (256, True): 16}
    for arch, target in TARGETS.items():
        for (d, shuf), mql in itertools.product(expected_n, (1, 64, 512)):
            kw = dict(num_q_heads=40, head_dim=d, max_query_len=mql, shuffled=shuf)
            fp32 = paged_tiles(target, _problem(elem_bytes=4, **kw))
            if target.is_hip:  # the MMA model: 64-row prefill tiles where the LDS holds them
                wide_lds = d < 256 or arch == "gfx950"
                assert fp32.block_m == (64 if mql > 1 and wide_lds else 16), (arch, d, mql)
                continue
            assert (fp32.block_m, fp32.block_q, fp32.head_tile) == (16, 3, 5), (arch, d, mql)
            assert (fp32.block_n, fp32.num_warps, fp32.num_stages) == (expected_n[d, shuf], 8, 2)
            assert fp32.decode is None


@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_16_bit_shuffle_takes_nhd_tiles_up_to_head_dim_128(arch):
    """Issue 18: SHUFFLE loads are vectors (no per-element offsets), so in 16-bit a SHUFFLE cache
    gets NHD's tiles and warps; the exceptions are head_dim 256 (the per-program words bound
    halves block_n), NHD's wide tile (sm_100), and the cache-order reads' decode row tiles on
    sm_90 (head_dim == BLOCK_D): a 32-token KV tile (`SHUFFLE_NARROW_BLOCK_N`), or at head_dim 128
    NHD's tile under a register cap (`SHUFFLE_REG_CAP`), or at head_dim 64 NHD's tile."""
    from portattn.policy import paged as paged_policy

    target = get_target(arch)
    for hd, (hq, hkv), mql in itertools.product((64, 80, 128), GQA, MAX_QUERY_LENS):
        nhd = paged_tiles(target, _problem(num_q_heads=hq, num_kv_heads=hkv, head_dim=hd,
                                           max_query_len=mql))  # fmt: skip
        if nhd.block_m > 64:  # the wide tile
            continue
        shuffle = paged_tiles(target, _problem(num_q_heads=hq, num_kv_heads=hkv, head_dim=hd,
                                               max_query_len=mql, shuffled=True))  # fmt: skip
        narrow = (
            paged_policy.shuffle_lines(arch)
            and paged_policy.shuffle_lines_tile(nhd.block_d, 32, 8)
            and hd == nhd.block_d
            and nhd.block_m <= paged_policy.SHUFFLE_NARROW_MAX_M
        )
        if narrow and hd == 128 and (nhd.block_n, nhd.num_warps) == (64, 4):
            assert shuffle.block_n == nhd.block_n, (hd, hq, hkv, mql)
            assert shuffle.options == LaunchOptions(4, nhd.options.num_stages, maxnreg=128)
        elif narrow and hd == 64 and nhd.block_n <= 64:
            assert shuffle == nhd, (hd, hq, hkv, mql)
        elif narrow:
            block_n = min(nhd.block_n, paged_policy.SHUFFLE_NARROW_BLOCK_N)
            assert shuffle.block_n == block_n, (hd, hq, hkv, mql)
            assert (shuffle.block_m, shuffle.options) == (nhd.block_m, nhd.options)
        else:
            assert shuffle == nhd, (hd, hq, hkv, mql)


def test_hip_gets_waves_per_eu_and_cuda_does_not():
    problem = _problem()
    hip = paged_tiles(get_target("gfx942"), problem)
    cuda = paged_tiles(get_target("sm_90"), problem)
    assert hip.options.kwargs(get_target("gfx942"))["waves_per_eu"] == 2
    assert "waves_per_eu" not in cuda.options.kwargs(get_target("sm_90"))


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(num_q_heads=6, num_kv_heads=4), r"num_q_heads must be a positive multiple of"),
        (dict(num_kv_heads=0), r"num_kv_heads must be an int >= 1; got 0"),
        (dict(head_dim=288), r"head_dim must be in \[1, 256\]; got 288"),
        (dict(elem_bytes=1), r"elem_bytes must be 2 or 4; got 1"),
        (dict(max_query_len=0), r"max_query_len must be an int >= 1; got 0"),
        (dict(max_seq_len=0), r"max_seq_len must be an int >= 1 or None; got 0"),
        # a float or a bool came back as float tiles, or as 1 (True)
        (dict(num_kv_heads=2.0), r"num_kv_heads must be an int >= 1; got 2.0"),
        (dict(max_seq_len=float("nan")), r"max_seq_len must be an int >= 1 or None; got nan"),
        (dict(num_q_heads=True), r"num_q_heads must be an int >= 1; got True"),
        (dict(block_size=0), r"block_size must be an int >= 1; got 0"),
        # the flags and the remaining sizes: a truthy string read as True, 0 sequences split
        (dict(query_rows_aligned="no"), r"query_rows_aligned must be a bool; got 'no'"),
        (dict(out_rows_aligned=1), r"out_rows_aligned must be a bool; got 1"),
        (dict(shuffled=None), r"shuffled must be a bool; got None"),
        (dict(num_seqs=-1), r"num_seqs must be an int >= 0; got -1"),
        (dict(num_seqs=2.5), r"num_seqs must be an int >= 0; got 2.5"),
        (dict(kv_head_stride=-1), r"kv_head_stride must be an int >= 0 or None; got -1"),
        (dict(kv_head_stride=64.0), r"kv_head_stride must be an int >= 0 or None; got 64.0"),
    ],
)
@pytest.mark.parametrize("policy", ["paged_tiles", "paged_config"])
def test_invalid_problem(kw, match, policy):
    """Both policies refuse what none can plan (paged_config divided by zero on a zero block
    size or KV-head count, and returned a config for a negative block size)."""
    fn = {"paged_tiles": paged_tiles, "paged_config": paged_config}[policy]
    with pytest.raises(ValueError, match=rf"^{policy}: .*" + match):
        fn(get_target("sm_90"), _problem(**kw))


@pytest.mark.parametrize("kw", [dict(head_dim=96), dict(num_q_heads=4, num_kv_heads=8),
                                dict(block_size=0), dict(block_size=8)])  # fmt: skip
def test_prefill_config_refuses_a_problem_the_sm90_kernel_does_not_take(kw):
    """A KeyError (head_dim 96) or a ZeroDivisionError before."""
    with pytest.raises(ValueError, match=r"^prefill_config: "):
        prefill_config(get_target("sm_90"), _problem(**{"max_query_len": 4096, **kw}))
    with pytest.raises(ValueError, match=r"^prefill_config: sm90_prefill must take the problem"):
        prefill_config(get_target("gfx942"), _problem(max_query_len=4096))


def test_invalid_problem_lists_every_reason():
    with pytest.raises(ValueError, match=r"head_dim must be .*; elem_bytes must be"):
        paged_tiles(get_target("sm_90"), _problem(head_dim=0, elem_bytes=3))


@pytest.mark.parametrize(
    "arch,kw,splits",
    [
        ("sm_90", dict(num_seqs=4, max_seq_len=16384), 16),  # 32 programs -> 16 x 32 >= 264
        ("sm_90", dict(num_seqs=4, max_seq_len=2048), 2),  # capped at 2048 // 1024
        ("sm_90", dict(num_seqs=4, max_seq_len=1000), 1),  # shorter than one split's minimum
        ("sm_90", dict(num_seqs=64, max_seq_len=16384), 1),  # 512 programs fill 132 SMs
        ("sm_90", dict(num_seqs=4), 1),  # max_seq_len unknown: no split (fixed grid)
        ("sm_90", dict(num_seqs=4, max_seq_len=16384, max_query_len=2), 1),  # decode only
        ("sm_86", dict(num_seqs=4, max_seq_len=16384), 8),  # 72 SMs: 32 x 8 >= 144
        ("gfx942", dict(num_seqs=4, max_seq_len=65536), 16),  # 304 CUs: capped at MAX_SPLITS
        ("gfx942", dict(num_seqs=1, num_kv_heads=1, num_q_heads=8, max_seq_len=4096), 4),
    ],
)
def test_split_count(arch, kw, splits):
    """A pure function of (target, batch, heads, max_seq_len); the same through paged_tiles."""
    target = get_target(arch)
    problem = _problem(**kw)
    tiles = paged_tiles(target, problem)
    assert split_count(target, problem, tiles.head_tile) == splits
    assert tiles.num_splits == splits


@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_plan_max_seq_len_plans_alike(arch):
    """Every max_seq_len of a band gets the tiles of the band's stand-in (`plan_max_seq_len`),
    which bounds it: the unbounded call's plan is shared across a decode loop's growing context."""
    target = get_target(arch)
    lens = sorted({*range(0, 5000, 97), *(k * 1024 + d for k in range(1, 40) for d in (-1, 0, 1))})
    for num_seqs, (hq, hkv) in itertools.product((1, 3, 64), ((8, 8), (32, 4), (8, 1))):
        for msl in lens:
            stand_in = plan_max_seq_len(msl)
            assert stand_in >= msl and plan_max_seq_len(stand_in) == stand_in
            p = _problem(num_seqs=num_seqs, num_q_heads=hq, num_kv_heads=hkv,
                         max_seq_len=msl or None)  # fmt: skip
            assert paged_tiles(target, p) == paged_tiles(
                target, replace(p, max_seq_len=stand_in or None)
            ), (num_seqs, hq, hkv, msl)
    assert plan_max_seq_len(0) == 0 and plan_max_seq_len(1) == plan_max_seq_len(1023) == 1023
    assert plan_max_seq_len(1024) == 2047


def test_decode_row_tile_only_when_it_differs_and_is_exceeded():
    sm90 = get_target("sm_90")
    # GQA 4:1, q_len up to 4: the decode tile (4 tokens x 4 heads) serves everything
    assert paged_tiles(sm90, _problem(max_query_len=4)).decode is None
    assert paged_tiles(sm90, _problem(max_query_len=5)).decode == DEC_4x4
    # MHA at 6 tokens: the 16-row tile is the decode tile already
    assert paged_tiles(sm90, _problem(num_q_heads=8, max_query_len=6)).decode is None
    # pure decode never has one
    assert paged_tiles(sm90, _problem()).decode is None


@pytest.mark.parametrize(
    ("arch", "dtype_bytes", "head_dim", "shuffled", "narrow"),
    [
        ("sm_90", 2, 32, True, True),
        ("sm_90", 2, 64, True, False),  # head_dim 64: NHD's tile, uncapped
        ("sm_90", 2, 128, False, False),  # NHD keeps its tile
        ("sm_90", 2, 80, True, False),  # head_dim < BLOCK_D: no cache-order reads
        ("sm_90", 4, 128, True, False),  # fp32
        ("sm_86", 2, 128, True, False),  # no cache-order reads on sm_86
        ("gfx942", 2, 128, True, False),
    ],
)
def test_shuffle_lines_narrow_caps_block_n_where_the_reads_apply(
    arch, dtype_bytes, head_dim, shuffled, narrow
):
    """`SHUFFLE_NARROW_BLOCK_N` caps block_n at 32 for SHUFFLE decode problems that take the
    cache-order reads (against NHD's 64), rows and warps as NHD's; row tiles above 16 (here 64
    tokens of prefill) and the other problems keep a 64-token tile."""
    for max_query_len in (1, 64):
        p = PagedProblem(32, 8, head_dim, dtype_bytes, max_query_len=max_query_len,
                         max_seq_len=16384, num_seqs=64, shuffled=shuffled)  # fmt: skip
        target = get_target(arch)
        got = paged_tiles(target, p)
        nhd = paged_tiles(target, replace(p, shuffled=False))
        assert got.options.maxnreg is None
        if narrow and max_query_len == 1:
            assert nhd.block_n == 64 and got.block_n == 32
            assert (got.block_m, got.num_warps) == (nhd.block_m, nhd.num_warps)
        elif dtype_bytes == 2:
            assert got.block_n == nhd.block_n, max_query_len


@pytest.mark.parametrize(
    "block_d,block_n,lines",
    [(32, 16, True), (32, 32, True), (32, 64, False), (64, 64, True), (128, 64, True),
     (128, 128, False), (256, 32, True), (256, 64, False), (16, 32, False), (64, 128, False)],
)  # fmt: skip
def test_shuffle_lines_tile_keeps_to_the_shapes_checked_on_a_gpu(block_d, block_n, lines):
    """Four runs (head_dim 32, x 8) at 64 tokens came out wrong from Triton 3.6's sm_90 build
    (`SHUFFLE_LINES_MAX_N`); the cache-order reads keep to the shapes a GPU ran right
    (head_dim 64/128 up to 64 tokens, 32/256 up to 32), the rest take the earlier reads."""
    from portattn.policy.paged import shuffle_lines_tile

    assert shuffle_lines_tile(block_d, block_n, 8) is lines


def test_shuffle_reg_cap_keeps_nhd_tile_at_head_dim_128():
    """`SHUFFLE_REG_CAP`: sm_90 SHUFFLE decode at head_dim 128 (cache-order reads) keeps NHD's
    64-token, 4-warp tile with ``maxnreg`` = the cap. Prefill row tiles, NHD, fp32, HIP and
    other CUDA archs never get a cap."""
    from portattn.policy.paged import SHUFFLE_REG_CAP

    sm90 = get_target("sm_90")
    for hq, hkv in ((8, 8), (32, 8), (64, 8)):
        p = PagedProblem(hq, hkv, 128, 2, 1, max_seq_len=16384, num_seqs=64, shuffled=True)
        nhd = paged_tiles(sm90, replace(p, shuffled=False))
        got = paged_tiles(sm90, p)
        assert got.block_n == nhd.block_n == 64
        assert got.options == replace(nhd.options, maxnreg=SHUFFLE_REG_CAP)
    prefill = PagedProblem(32, 8, 128, 2, max_query_len=64, shuffled=True)
    assert paged_tiles(sm90, prefill).options.maxnreg is None
    for arch, elem in (("sm_90", 4), ("sm_86", 2), ("sm_100", 2), ("gfx942", 2)):
        p = PagedProblem(32, 8, 128, elem, 1, max_seq_len=16384, num_seqs=64, shuffled=True)
        assert paged_tiles(get_target(arch), p).options.maxnreg is None, arch


@pytest.mark.parametrize("arch", ["gfx90a", "gfx942", "gfx950"])
@pytest.mark.parametrize(
    ("hq", "hkv", "d"), [(32, 8, 128), (64, 4, 64), (16, 1, 128), (64, 8, 128)]
)
@pytest.mark.parametrize("q_len", [2, 4, 8])
def test_hip_verification_tokens_share_each_kv_tile(arch, hq, hkv, d, q_len):
    """A verification step on the HIP tiles: a program's rows are query tokens x heads of one
    KV head, so a sequence's q_len tokens read each KV tile ceil(q_len / block_q) times, at most
    once per 64 rows of (token, head) pairs, never once per token."""
    group = hq // hkv
    tiles = paged_tiles(get_target(arch), PagedProblem(hq, hkv, d, 2, q_len, 16, 64, 4096))
    reads = -(-q_len // tiles.block_q) * -(-group // tiles.head_tile)
    assert tiles.head_tile == min(group, tiles.block_m)
    assert reads == -(-(q_len * group) // 64) or reads == 1
    assert reads < q_len


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: PagedConfig(prefill=5), "prefill must be a PrefillConfig or None; got 5"),
        (lambda: PagedConfig(prefill={}), "PagedConfig: prefill must be a PrefillConfig or None"),
        (lambda: PrefillConfig(block_n="64"), "PrefillConfig: block_n must be an int; got '64'"),
        (lambda: PrefillConfig(stages=2.0, box=True),
         "PrefillConfig: stages must be an int; got 2.0; box must be an int; got True"),
        (lambda: PrefillConfig(turns=1), "PrefillConfig: turns must be a bool; got 1"),
        (lambda: PrefillConfig(consumer_regs=None), "consumer_regs must be an int; got None"),
    ],
)  # fmt: skip
def test_a_config_of_the_wrong_types_is_refused_when_built(make, message):
    """Values are judged against a call (`prefill_config_errors`); types cannot wait for one: a
    string block_n or an int as prefill failed inside the launcher."""
    with pytest.raises(TypeError, match=re.escape(message)):
        make()
