"""Tile policy for the KV-cache copy ops: `write_kv_cache`, `gather_kv_cache`, page indices.

These kernels move bytes; they do no arithmetic that needs shared memory. A program copies a
``[BLOCK_T tokens, BLOCK_D dims]`` tile of one KV head with plain pointer loads and stores: no
``tl.dot``, no reduction, no layout conversion, so Triton allocates no shared memory / LDS for
them (checked by compiling for sm_90 and gfx942: ``metadata.shared == 0``). The estimate is
still explicit (`CacheCopyTiles.shared_mem_bytes`) and checked against the target's limit, so a
later change that stages tiles through shared memory has to state its cost here.

What does bound the tile is registers: each thread holds its share of the K tile and the V tile
in flight. The policy gives every thread ``ELEMS_PER_THREAD = 16`` elements per tensor (32 B of
fp16, two 16-byte vectors), so a program copies ``16 * num_warps * warp_size`` elements per
tensor: 2048 on CUDA (4 warps x 32 lanes), 4096 on HIP (4 wavefronts x 64 lanes). ``BLOCK_D``
covers the head (next power of two, at most 256; wider heads take several programs), and
``BLOCK_T`` takes the rest of the budget. None of this depends on ``block_size``: the kernels
address block and in-block offset separately (docs/design.md lesson 3), so a 2048-token block gets
the same tile as a 16-token one.
"""

from __future__ import annotations

from dataclasses import dataclass

from portattn.platform import Target
from portattn.policy.common import LaunchOptions, launch_options, next_pow2, prev_pow2

ELEMS_PER_THREAD = 16  # per tensor; 2 x 16 B vectors of fp16, 4 x 16 B of fp32
MAX_BLOCK_D = 256  # widest head-dim tile; head_dim 512/576 (MLA latents) use 2-3 programs
NUM_WARPS = 4
MIN_ELEMS_PER_THREAD = 4  # fewer warps when the tile is small, so lanes are not left idle
PAGE_INDICES_BLOCK = 1024  # indices per program of expand_page_indices (int64: 8 KB/program)
PAGE_INDPTR_BLOCK = 256  # sequences per step of the indptr prefix sum (one program)


@dataclass(frozen=True)
class CacheCopyProblem:
    """What the copy policy needs to know about one write or gather.

    Attributes:
        num_tokens: tokens copied (``slot_mapping`` length, or ``total_tokens`` of a gather).
        num_kv_heads: heads per token.
        head_dim: elements per head.
        element_size: bytes per cache element (2 for fp16/bf16, 4 for fp32).
    """

    num_tokens: int
    num_kv_heads: int
    head_dim: int
    element_size: int


@dataclass(frozen=True)
class CacheCopyTiles:
    """Tiles and launch options of one copy kernel launch.

    Attributes:
        block_t: tokens per program (power of two).
        block_d: head-dim elements per program (power of two, masked to ``head_dim``).
        options: `LaunchOptions` for the target's backend.
        shared_mem_bytes: shared memory / LDS one program uses (0: registers only, see module).
        register_bytes: bytes of K and V tile one program holds in registers.
    """

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


def _copy_tiles(target: Target, problem: CacheCopyProblem) -> CacheCopyTiles:
    if min(problem.num_tokens, problem.num_kv_heads, problem.head_dim) < 0:
        raise ValueError(f"cache policy: problem sizes must be >= 0; got {problem}")
    budget = ELEMS_PER_THREAD * NUM_WARPS * target.warp_size  # elements per tensor per program
    block_d = min(next_pow2(max(problem.head_dim, 1)), MAX_BLOCK_D)
    block_t = max(1, min(budget // block_d, next_pow2(max(problem.num_tokens, 1))))
    tile = block_t * block_d
    num_warps = min(NUM_WARPS, max(1, prev_pow2(max(1, tile // (target.warp_size * 4)))))
    # No loop to pipeline: one stage.
    options = launch_options(target, num_warps=num_warps, num_stages=1)
    smem = 0  # plain loads/stores, no tl.dot / reduction / convert_layout (see module docstring)
    if smem > target.max_shared_mem:  # pragma: no cover - stated for the next editor
        raise ValueError(f"cache policy: {smem} B of shared memory exceeds {target.arch}")
    return CacheCopyTiles(
        block_t=block_t,
        block_d=block_d,
        options=options,
        shared_mem_bytes=smem,
        register_bytes=2 * tile * problem.element_size,
    )


def write_kv_cache_tiles(target: Target, problem: CacheCopyProblem) -> CacheCopyTiles:
    """Tiles for `write_kv_cache`: one slot load per token, then a K and a V tile scattered."""
    return _copy_tiles(target, problem)


def gather_kv_cache_tiles(target: Target, problem: CacheCopyProblem) -> CacheCopyTiles:
    """Tiles for `gather_kv_cache`: a binary search and a block-table load per token, then K
    and V tiles gathered. Same budget as the write: the per-token index work is a few scalars."""
    return _copy_tiles(target, problem)


def page_indices_tiles(target: Target, num_indices: int) -> PageIndicesTiles:
    """Tiles for `expand_page_indices`.

    ``block_n = 1024`` int64 indices per program is 8 KB in registers: 8 per thread on CUDA
    (4 warps x 32), 4 on HIP (4 x 64); smaller outputs take the next power of two. The indptr
    prefix sum runs in one program over ``block_s = 256`` sequences per step (``tl.cumsum`` is a
    warp-level scan; Triton may stage it through a few hundred bytes of shared memory, bounded
    by ``block_s * 8`` bytes).
    """
    if num_indices < 0:
        raise ValueError(f"page_indices_tiles: num_indices must be >= 0; got {num_indices}")
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
