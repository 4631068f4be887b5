"""The copy policy for write/gather/page indices, CUDA and HIP side by side, by exact equality."""

from __future__ import annotations

import pytest

from portattn.platform import TARGETS, get_target
from portattn.policy.cache import (
    CacheCopyProblem,
    CacheCopyTiles,
    PageIndicesTiles,
    gather_kv_cache_tiles,
    page_indices_tiles,
    write_kv_cache_tiles,
)
from portattn.policy.common import LaunchOptions

pytestmark = pytest.mark.policy

SM90, GFX942 = get_target("sm_90"), get_target("gfx942")


@pytest.mark.parametrize(
    "problem, cuda, hip",
    [
        # fp16 heads of 128: 2048 elements/program on CUDA (16 x 4 warps x 32), 4096 on HIP.
        (
            CacheCopyProblem(16384, 8, 128, 2),
            CacheCopyTiles(16, 128, LaunchOptions(4, 1), 0, 8192),
            CacheCopyTiles(32, 128, LaunchOptions(4, 1, waves_per_eu=2), 0, 16384),
        ),
        # MLA-width heads: 256-wide d tiles (576 takes 3 programs), fewer tokens per program.
        (
            CacheCopyProblem(4096, 1, 576, 2),
            CacheCopyTiles(8, 256, LaunchOptions(4, 1), 0, 8192),
            CacheCopyTiles(16, 256, LaunchOptions(4, 1, waves_per_eu=2), 0, 16384),
        ),
        # A single decode token: one token per program, warps cut to what the tile fills.
        (
            CacheCopyProblem(1, 8, 128, 4),
            CacheCopyTiles(1, 128, LaunchOptions(1, 1), 0, 1024),
            CacheCopyTiles(1, 128, LaunchOptions(1, 1, waves_per_eu=2), 0, 1024),
        ),
        # head_dim 80 pads to a 128 tile; 5 tokens -> 8.
        (
            CacheCopyProblem(5, 2, 80, 4),
            CacheCopyTiles(8, 128, LaunchOptions(4, 1), 0, 8192),
            CacheCopyTiles(8, 128, LaunchOptions(4, 1, waves_per_eu=2), 0, 8192),
        ),
    ],
)
def test_copy_tiles_cuda_and_hip(problem, cuda, hip):
    for policy in (write_kv_cache_tiles, gather_kv_cache_tiles):
        assert policy(SM90, problem) == cuda
        assert policy(GFX942, problem) == hip


@pytest.mark.parametrize("arch", sorted(TARGETS))
@pytest.mark.parametrize("head_dim", (1, 64, 80, 128, 256, 576))
def test_copy_tiles_fit_every_target(arch, head_dim):
    target = get_target(arch)
    tiles = write_kv_cache_tiles(target, CacheCopyProblem(100000, 8, head_dim, 2))
    assert tiles.shared_mem_bytes <= target.max_shared_mem
    assert tiles.block_t * tiles.block_d <= 16 * 4 * target.warp_size
    assert tiles.block_d >= min(head_dim, 256)
    assert (tiles.options.waves_per_eu is not None) == target.is_hip
    tiles.options.kwargs(target)  # never hands a backend an option it does not accept


def test_page_indices_tiles():
    assert page_indices_tiles(SM90, 100000) == PageIndicesTiles(
        256, 1024, LaunchOptions(4, 1), 2048
    )
    assert page_indices_tiles(GFX942, 100000) == PageIndicesTiles(
        256, 1024, LaunchOptions(4, 1, waves_per_eu=2), 2048
    )
    assert page_indices_tiles(SM90, 0).block_n == 1
    assert page_indices_tiles(GFX942, 100) == PageIndicesTiles(
        256, 128, LaunchOptions(2, 1, waves_per_eu=2), 2048
    )


def test_policy_errors():
    with pytest.raises(ValueError, match="write_kv_cache_tiles: problem sizes must be ints >= 0"):
        write_kv_cache_tiles(SM90, CacheCopyProblem(-1, 8, 128, 2))
    with pytest.raises(ValueError, match="page_indices_tiles: num_indices must be an int >= 0"):
        page_indices_tiles(SM90, -1)
    # a float count, an element size of 0 or -2 (a negative register estimate), the op's name
    with pytest.raises(ValueError, match="page_indices_tiles: num_indices must be an int >= 0"):
        page_indices_tiles(SM90, float("inf"))
    for size in (0, -2, 3, True):
        with pytest.raises(ValueError, match="gather_kv_cache_tiles: element_size must be 1, 2"):
            gather_kv_cache_tiles(SM90, CacheCopyProblem(8, 8, 128, size))
    with pytest.raises(ValueError, match="write_kv_cache_tiles: problem sizes must be ints"):
        write_kv_cache_tiles(SM90, CacheCopyProblem(8, 8.0, 128, 2))
