"""Paged-attention tile policy: exact choices per vendor, the budget, block-size independence."""

from __future__ import annotations

import itertools

import pytest

from portattn.platform import TARGETS, get_target
from portattn.policy.common import LaunchOptions
from portattn.policy.paged import (
    PagedProblem,
    PagedTiles,
    estimate_registers,
    estimate_shared_mem,
    paged_tiles,
)

pytestmark = pytest.mark.policy

BLOCK_SIZES = (1, 16, 80, 544, 2048)
HEAD_DIMS = (64, 80, 128, 256)
GQA = ((8, 8), (10, 2), (32, 4), (8, 1), (128, 1))  # 1:1, 5:1, 8:1, 8:1 MQA, 128:1 MQA
ELEM_BYTES = (2, 4)  # fp16/bf16, fp32
MAX_QUERY_LENS = (1, 6, 512)


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
        PagedTiles(16, 4, 4, 64, 128, LaunchOptions(4, 3), 98304 + 4096 + 2048),
    ),
    (
        "gfx942",
        _problem(),  # (64, 2 stages) would need 71680 B > 65536 B -> block_n 32
        PagedTiles(16, 4, 4, 32, 128, LaunchOptions(4, 2, 2), 32768 + 4096 + 1024),
    ),
    # prefill chunk of 512, GQA 4:1, block_size 2048 (the tile does not follow it)
    (
        "sm_90",
        _problem(max_query_len=512, block_size=2048),
        PagedTiles(64, 16, 4, 64, 128, LaunchOptions(8, 3), 98304 + 16384 + 8192),
    ),
    (
        "sm_86",  # 101376 B: 3 stages (122880 B) do not fit, 2 do
        _problem(max_query_len=512, block_size=2048),
        PagedTiles(64, 16, 4, 64, 128, LaunchOptions(8, 2), 65536 + 16384 + 8192),
    ),
    (
        "gfx942",
        _problem(max_query_len=512, block_size=2048),
        PagedTiles(64, 16, 4, 32, 128, LaunchOptions(4, 2, 2), 32768 + 16384 + 4096),
    ),
    # head_dim 256 in fp32, GQA 5:1 on the 64 KB LDS part: only 16 x 16, one stage fits
    (
        "gfx942",
        _problem(num_q_heads=40, head_dim=256, elem_bytes=4, max_query_len=64, block_size=544),
        PagedTiles(16, 3, 5, 16, 256, LaunchOptions(4, 1, 2), 32768 + 16384 + 1024),
    ),
    (
        "sm_90",
        _problem(num_q_heads=40, head_dim=256, elem_bytes=4, max_query_len=64, block_size=544),
        PagedTiles(64, 12, 5, 32, 256, LaunchOptions(8, 2), 131072 + 65536 + 8192),
    ),
    # MQA with 128 heads: the group is split over programs, 64 heads each
    (
        "sm_90",
        _problem(num_q_heads=128, num_kv_heads=1, head_dim=64),
        PagedTiles(64, 1, 64, 64, 64, LaunchOptions(8, 3), 49152 + 8192 + 8192),
    ),
    (
        "gfx950",
        _problem(num_q_heads=128, num_kv_heads=1, head_dim=64),
        PagedTiles(64, 1, 64, 64, 64, LaunchOptions(4, 2, 2), 32768 + 8192 + 8192),
    ),
    # non-power-of-two head_dim 80 pads to 128
    (
        "sm_120",  # 101376 B: 3 stages (104448 B) do not fit
        _problem(num_q_heads=8, num_kv_heads=8, head_dim=80, max_query_len=6),
        PagedTiles(16, 16, 1, 64, 128, LaunchOptions(4, 2), 65536 + 4096 + 2048),
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
    for bs, d, (hq, hkv), elem, mql in itertools.product(
        BLOCK_SIZES, HEAD_DIMS, GQA, ELEM_BYTES, MAX_QUERY_LENS
    ):
        problem = _problem(
            num_q_heads=hq,
            num_kv_heads=hkv,
            head_dim=d,
            elem_bytes=elem,
            max_query_len=mql,
            block_size=bs,
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
        regs4 = estimate_registers(t.block_m, t.block_n, t.block_d, elem, 4, target.warp_size)
        assert t.num_warps == (4 if regs4 <= 64 else 8)


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
    # sm_90 prefill tile at head_dim 128, fp16: 128 registers at 4 warps (spills), 64 at 8
    assert estimate_registers(64, 64, 128, 2, 4, 32) == 128
    assert estimate_registers(64, 64, 128, 2, 8, 32) == 64
    # the same tile on a 64-lane wavefront
    assert estimate_registers(64, 32, 128, 2, 4, 64) == (8192 + 2048 + 2048) // 256


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
        (dict(num_kv_heads=0), r"num_q_heads must be a positive multiple of"),
        (dict(head_dim=288), r"head_dim must be in \[1, 256\]; got 288"),
        (dict(elem_bytes=1), r"elem_bytes must be 2 or 4; got 1"),
        (dict(max_query_len=0), r"max_query_len must be >= 1; got 0"),
    ],
)
def test_invalid_problem(kw, match):
    with pytest.raises(ValueError, match=r"^paged_tiles: .*" + match):
        paged_tiles(get_target("sm_90"), _problem(**kw))


def test_invalid_problem_lists_every_reason():
    with pytest.raises(ValueError, match=r"head_dim must be .*; elem_bytes must be"):
        paged_tiles(get_target("sm_90"), _problem(head_dim=0, elem_bytes=3))
