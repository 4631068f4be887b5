"""Tile policy for the KV-cache copy ops: `write_kv_cache`, `gather_kv_cache`, page indices.

A program copies a ``[BLOCK_T tokens, BLOCK_D dims]`` tile of one KV head with plain loads and
stores, so it uses no shared memory (the estimate stays explicit and checked against the target).
Registers bound the tile: ``ELEMS_PER_THREAD`` per thread and tensor. ``block_size`` plays no
part: block and in-block offset are addressed separately (docs/design.md lesson 3).
"""

from __future__ import annotations

from dataclasses import dataclass

from portattn.platform import Target, is_int
from portattn.policy.common import LaunchOptions, launch_options, next_pow2, prev_pow2

ELEMS_PER_THREAD = 16  # per tensor; 2 x 16 B vectors of fp16, 4 x 16 B of fp32
MAX_BLOCK_D = 256  # widest head-dim tile; head_dim 512/576 (MLA latents) use 2-3 programs
NUM_WARPS = 4
MIN_ELEMS_PER_THREAD = 4  # fewer warps when the tile is small, so lanes are not left idle
PAGE_INDICES_BLOCK = 1024  # indices per program of expand_page_indices (int64: 8 KB/program)
PAGE_INDPTR_BLOCK = 256  # sequences per step of the indptr prefix sum (one program)
METADATA_SUMMARY_BLOCK = 512  # block-table columns per step of the metadata summary


@dataclass(frozen=True)
class CacheCopyProblem:
    """One write or gather: tokens copied, heads per token, elements per head, element bytes."""

    num_tokens: int
    num_kv_heads: int
    head_dim: int
    element_size: int


@dataclass(frozen=True)
class CacheCopyTiles:
    """One copy launch: tokens and head-dim elements a program (powers of two), launch options,
    shared memory a program uses (0) and the K and V bytes it holds in registers."""

    block_t: int
    block_d: int
    options: LaunchOptions
    shared_mem_bytes: int
    register_bytes: int


@dataclass(frozen=True)
class PageIndicesTiles:
    """Tiles of `expand_page_indices`: sequences per indptr step, indices per program."""

    block_s: int
    block_n: int
    options: LaunchOptions
    shared_mem_bytes: int


@dataclass(frozen=True)
class MetadataSummaryTiles:
    """Tiles of the metadata summary (`portattn.kernels.metadata_summary`): block-table columns
    a program checks per step (one program per sequence)."""

    block_c: int
    options: LaunchOptions
    shared_mem_bytes: int


def _copy_tiles(target: Target, problem: CacheCopyProblem, name: str) -> CacheCopyTiles:
    p = problem
    sizes = (p.num_tokens, p.num_kv_heads, p.head_dim)
    if not all(is_int(n) and n >= 0 for n in sizes):
        raise ValueError(f"{name}: problem sizes must be ints >= 0; got {problem}")
    if p.element_size not in (1, 2, 4, 8) or isinstance(p.element_size, bool):
        raise ValueError(f"{name}: element_size must be 1, 2, 4 or 8; got {p.element_size!r}")
    budget = ELEMS_PER_THREAD * NUM_WARPS * target.warp_size  # elements per tensor per program
    block_d = min(next_pow2(max(problem.head_dim, 1)), MAX_BLOCK_D)
    block_t = max(1, min(budget // block_d, next_pow2(max(problem.num_tokens, 1))))
    tile = block_t * block_d
    num_warps = min(NUM_WARPS, max(1, prev_pow2(max(1, tile // (target.warp_size * 4)))))
    # No loop to pipeline: one stage.
    options = launch_options(target, num_warps=num_warps, num_stages=1)
    smem = 0  # plain loads/stores, no tl.dot / reduction / convert_layout (see module docstring)
    if smem > target.max_shared_mem:  # pragma: no cover - stated for the next editor
        raise ValueError(f"{name}: {smem} B of shared memory exceeds {target.arch}")
    return CacheCopyTiles(
        block_t=block_t,
        block_d=block_d,
        options=options,
        shared_mem_bytes=smem,
        register_bytes=2 * tile * problem.element_size,
    )


def write_kv_cache_tiles(target: Target, problem: CacheCopyProblem) -> CacheCopyTiles:
    """Tiles for `write_kv_cache`: one slot load per token, then a K and a V tile scattered."""
    return _copy_tiles(target, problem, "write_kv_cache_tiles")


def gather_kv_cache_tiles(target: Target, problem: CacheCopyProblem) -> CacheCopyTiles:
    """Tiles for `gather_kv_cache`: the write's budget (its per-token index work is scalars)."""
    return _copy_tiles(target, problem, "gather_kv_cache_tiles")


def page_indices_tiles(target: Target, num_indices: int) -> PageIndicesTiles:
    """Tiles for `expand_page_indices`: up to ``PAGE_INDICES_BLOCK`` indices a program; the
    indptr prefix sum in one program, ``PAGE_INDPTR_BLOCK`` sequences a step (its scan may stage
    through at most ``block_s * 8`` bytes of shared memory)."""
    if not is_int(num_indices) or num_indices < 0:
        raise ValueError(
            f"page_indices_tiles: num_indices must be an int >= 0; got {num_indices!r}"
        )
    block_n = min(PAGE_INDICES_BLOCK, next_pow2(max(num_indices, 1)))
    num_warps = min(NUM_WARPS, max(1, prev_pow2(max(1, block_n // target.warp_size))))
    smem = PAGE_INDPTR_BLOCK * 8
    if smem > target.max_shared_mem:  # pragma: no cover - every target has >= 64 KB
        raise ValueError(f"page_indices_tiles: {smem} B of shared memory exceeds {target.arch}")
    return PageIndicesTiles(
        block_s=PAGE_INDPTR_BLOCK,
        block_n=block_n,
        options=launch_options(target, num_warps=num_warps, num_stages=1),
        shared_mem_bytes=smem,
    )


def metadata_summary_tiles(target: Target, max_blocks: int) -> MetadataSummaryTiles:
    """Tiles for the metadata summary: up to ``METADATA_SUMMARY_BLOCK`` block-table columns a
    step, a warp per ``4 * warp_size`` of them (its one reduction is over a few registers a lane:
    scratch shared memory at most ``block_c * 4`` bytes)."""
    if not is_int(max_blocks) or max_blocks < 0:
        raise ValueError(
            f"metadata_summary_tiles: max_blocks must be an int >= 0; got {max_blocks!r}"
        )
    block_c = min(METADATA_SUMMARY_BLOCK, next_pow2(max(max_blocks, 1)))
    num_warps = min(NUM_WARPS, max(1, prev_pow2(max(1, block_c // (target.warp_size * 4)))))
    smem = block_c * 4
    if smem > target.max_shared_mem:  # pragma: no cover - every target has >= 64 KB
        raise ValueError(f"metadata_summary_tiles: {smem} B of shared memory exceeds {target.arch}")
    return MetadataSummaryTiles(
        block_c=block_c,
        options=launch_options(target, num_warps=num_warps, num_stages=1),
        shared_mem_bytes=smem,
    )
