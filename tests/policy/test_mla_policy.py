"""MLA decode tile policy: exact CUDA and HIP tiles side by side, the budget, lessons 1 and 2."""

from __future__ import annotations

import dataclasses

import pytest

from portattn.platform import TARGETS, get_target
from portattn.policy.common import LaunchOptions, next_pow2
from portattn.policy.mla import (
    MAX_KV_SPLITS,
    MlaProblem,
    MlaTiles,
    mla_decode_tiles,
    mla_num_kv_splits,
    mla_smem_bytes,
)

pytestmark = [pytest.mark.policy, pytest.mark.mla]

# (head_dim_k, kv_lora_rank): DeepSeek-V3, Mistral-Small-4, a 32-wide rope, a small model, no rope.
SHAPES = [(576, 512), (320, 256), (288, 256), (192, 128), (256, 256)]
HEADS = [1, 3, 4, 8, 16, 20, 128]
GPU_ELEM_SIZES = [2]  # fp16 / bf16: what a GPU launch uses


def problem(dk=576, r=512, heads=16, elem=2, tokens=64, context=4096) -> MlaProblem:
    return MlaProblem(heads, dk, r, elem, tokens, context)


# arch, (dk, r) -> (block_n, num_stages, smem_bytes); BLOCK_H 16, 4 warps everywhere.
EXPECTED = {
    ("sm_90", 576, 512): (64, 2, 167936),
    ("sm_90", 320, 256): (64, 3, 135168),
    ("sm_80", 576, 512): (32, 3, 130048),  # 64 x 2 stages = 167936 B > sm_80's 166912 B
    ("sm_86", 576, 512): (32, 2, 93184),  # 99 KB: the large latent gets fewer stages (lesson 1)
    ("sm_86", 320, 256): (64, 2, 94208),
    ("sm_86", 192, 128): (64, 3, 81920),
    ("sm_120", 576, 512): (32, 2, 93184),
    ("gfx942", 576, 512): (16, 2, 55808),  # 64 KB LDS
    ("gfx942", 320, 256): (32, 2, 52224),
    ("gfx942", 288, 256): (32, 2, 47104),
    ("gfx942", 256, 256): (32, 2, 41984),
    ("gfx90a", 576, 512): (16, 2, 55808),
    ("gfx950", 576, 512): (32, 2, 93184),
}


@pytest.mark.parametrize(("arch", "dk", "r"), sorted(EXPECTED))
def test_exact_tiles_cuda_and_hip(arch, dk, r):
    target = get_target(arch)
    block_n, stages, smem = EXPECTED[arch, dk, r]
    rope = dk - r
    want = MlaTiles(
        block_h=16,
        padded_heads=16,
        block_n=block_n,
        block_dv=next_pow2(r),
        block_dpe=next_pow2(rope) if rope else 0,
        num_kv_splits=mla_num_kv_splits(target, 64, 1, 4096),
        options=LaunchOptions(4, stages, 2 if target.is_hip else None),
        reduce_options=LaunchOptions(4, 1, 2 if target.is_hip else None),
        smem_bytes=smem,
    )
    assert mla_decode_tiles(target, problem(dk, r)) == want


@pytest.mark.parametrize("arch", sorted(TARGETS))
@pytest.mark.parametrize(("dk", "r"), SHAPES)
def test_budget_fits_every_target(arch, dk, r):
    target = get_target(arch)
    for heads in (1, 16, 128):
        for elem in GPU_ELEM_SIZES:
            t = mla_decode_tiles(target, problem(dk, r, heads, elem))
            assert t.smem_bytes == mla_smem_bytes(
                t.block_h, t.block_n, t.block_dv, t.block_dpe, t.options.num_stages, elem
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
        assert t.block_h == target.mma_min_rows == 16
        assert t.padded_heads == -(-heads // 16) * 16
        assert t.head_groups * t.block_h == t.padded_heads


def test_split_count_is_policy_of_target_batch_heads_context():
    h100 = get_target("sm_90")  # 132 SMs: aims at 264 programs
    assert mla_decode_tiles(h100, problem(heads=16, tokens=64, context=4096)).num_kv_splits == 5
    assert mla_decode_tiles(h100, problem(heads=16, tokens=64, context=16384)).num_kv_splits == 5
    assert mla_decode_tiles(h100, problem(heads=128, tokens=64, context=4096)).num_kv_splits == 1
    # small batch, long context: capped; short context: never a split under 256 tokens
    assert mla_decode_tiles(h100, problem(tokens=1, context=32768)).num_kv_splits == MAX_KV_SPLITS
    assert mla_decode_tiles(h100, problem(tokens=1, context=1000)).num_kv_splits == 3
    assert mla_decode_tiles(h100, problem(tokens=1, context=40)).num_kv_splits == 1
    # more multiprocessors, more splits
    mi300 = get_target("gfx942")  # 304 CUs
    assert mla_decode_tiles(mi300, problem(heads=16, tokens=64, context=4096)).num_kv_splits == 10


def test_fp32_latent_512_does_not_fit_64kb():
    with pytest.raises(ValueError, match=r"no tile fits gfx942's 65536 B .* use a 2-byte dtype"):
        mla_decode_tiles(get_target("gfx942"), problem(elem=4))
    # the interpreter's default target (sm_90) takes fp32
    assert mla_decode_tiles(get_target("sm_90"), problem(elem=4)).block_n == 32


def test_invalid_problem_lists_every_reason():
    with pytest.raises(
        ValueError,
        match=r"mla_decode_tiles: num_heads must be >= 1; got 0; .*num_tokens must be >= 0; "
        r"got -1; kv_lora_rank must be <= head_dim_k; got 600 > 576",
    ):
        mla_decode_tiles(get_target("sm_90"), MlaProblem(0, 576, 600, 2, -1, 10))


def test_pure_and_frozen():
    target = get_target("sm_90")
    a, b = mla_decode_tiles(target, problem()), mla_decode_tiles(target, problem())
    assert a == b
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.block_n = 16  # type: ignore[misc]
