"""Tile policy for MLA decode (absorbed weights, paged latent cache): (target, problem) -> tiles.

Widths (lesson 1): ``BLOCK_DV = next_pow2(kv_lora_rank)``, ``BLOCK_DPE = next_pow2(head_dim_k -
kv_lora_rank)`` (0 without rope), each at least `MIN_DOT_WIDTH` (the columns past the width are
masked). One latent tile ``[BLOCK_N, BLOCK_DV]`` feeds both QK and PV, so nothing is sized from
``head_dim_k``.

Heads (lesson 2): a program owns ``BLOCK_H >= target.mma_min_rows`` heads of one token (the dot's
M), so 1-8 heads pad to 16 and 20 to 32; ``padded_heads`` is part of the frozen tiles, which
`portattn.mla_metadata.MlaMetadataBuilder` sizes its workspaces from.

Budgets: `mla_smem_bytes` (latent + rope tiles per buffer, the query tiles, P) within the target's
shared memory, and `mla_reg_estimate` (accumulator + one tile, 32-bit registers per thread) at most
`REG_BUDGET`.

Narrow tile (every target): ``BLOCK_H = mma_min_rows``, the longest ``BLOCK_N`` that pipelines
within both budgets at the fewest warps (on HIP over a 512-wide latent, 4 at one wave a SIMD:
`HIP_LATENT_512_NUM_WARPS`, `HIP_ONE_WAVE_PER_EU`). Wide tile (`WIDE_ARCHS`, 64 heads or
more, packed rows, or on sm_90 any 16-bit launch the Hopper kernel can run:
`sm90_kernel_runs`): 64 heads a program, so the latent is read once for 64 heads; below 64
heads it pads rows, and on sm_90 still reads faster than the narrow tile. On sm_90 the wide
16-bit tile runs the Gluon kernel (`portattn.kernels.mla_decode_sm90`), whose schedule choices
are `MlaConfig` (`mla_config`); where that kernel cannot run the launch, the portable kernel's
wide tile is at most `PORTABLE_WIDE_MAX_BLOCK_N` tokens. Over a 512-wide latent the register
estimate counts a rope tile of at least `MIN_MODELLED_ROPE_512`.

Packed rows (verification): rows (query token, head) of one sequence, so its tokens read the
cache once per tile position instead of once per token; programs per sequence and split:
`mla_row_groups`. On sm_90, fewer than 64 heads and ``max_query_len * num_heads >=
PACK_MIN_ROWS`` pack rows into the wide tile. On HIP (gfx90a, gfx942, gfx950; 16-bit,
``max_query_len > 1``) the portable kernel takes the most rows of `HIP_PACK_BLOCK_H` (no more
than ``next_pow2(max_query_len * num_heads)``) whose tile (`HIP_PACK_BLOCK_N`,
`HIP_PACK_NUM_WARPS`, `HIP_PACK_NUM_STAGES`) fits the target's LDS (`mla_hip_packed_lds_bytes`)
and the register budget at 64-lane wavefronts, where that reads fewer KV tiles a sequence than
the unpacked 16-row tile (`mla_tile_reads`); else the narrow tile, unchanged. The packed tile asks
for one wave a SIMD (`HIP_ONE_WAVE_PER_EU`), so it is one program a CU and the split count
fills one such wave.

What was measured where: docs/decisions.md (MLA decode). The HIP tiles are checked by the
compile matrix (no spills, LDS within the target's); their q_len scaling was measured with the
HIP policies forced on an NVIDIA GPU, not on an AMD one.

Split-KV (`mla_num_kv_splits`): the most splits whose programs fit one wave of resident slots,
each split at least `MIN_TOKENS_PER_SPLIT` tokens, at most `MAX_KV_SPLITS`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from portattn.platform import Target, is_int
from portattn.policy.common import LaunchOptions, launch_options, next_pow2

#: KV tile lengths tried, largest first (>= 16: the PV dot's K dimension).
BLOCK_N_CANDIDATES: tuple[int, ...] = (64, 32, 16)
#: Programs per SM the split count aims at on HIP (two hide one program's gather latency).
PROGRAMS_PER_SM = 2
#: Programs per SM of the wide CUDA tile (one resident at 255 registers x 256 threads).
PROGRAMS_PER_SM_WIDE = 2
#: Heads per program of the wide tile.
WIDE_BLOCK_H = 64
#: NVIDIA parts whose shared memory holds the wide tile (sm_100's compile of it does not fit).
WIDE_ARCHS = ("sm_80", "sm_90")
#: Warps of the wide tile (its 64 x 512 fp32 accumulator: 128 registers a thread).
WIDE_NUM_WARPS = 8
#: 32-bit registers per thread the estimate may reach (calibrated on sm_90 compiles).
REG_BUDGET = 200
#: Context tokens a split covers at least, so its partial result is worth the reduce.
MIN_TOKENS_PER_SPLIT = 256
#: Most splits (workspace size, reduce loop length).
MAX_KV_SPLITS = 32
#: Warps of the narrow tile, fewest first.
NUM_WARPS = (4, 8)
#: Warps of a HIP unpacked tile over a 512-wide latent, which asks for one wave a SIMD
#: (`HIP_ONE_WAVE_PER_EU`: at two waves, 256 VGPRs, the 16-bit tile spills on gfx942 and the fp32
#: one on gfx950, Triton 3.6 compile matrix); its split count is sized as for the other HIP tiles.
HIP_LATENT_512_NUM_WARPS = 4
#: fp32 dots are exact (FMA loops with both operands in registers on NVIDIA): the narrowest tile
#: at 8 warps, never the wide tile or prefetched rows (wider ones spill).
FP32_BLOCK_N = 16
FP32_NUM_WARPS = 8
#: Warps of the split-KV reduce kernel.
REDUCE_NUM_WARPS = 4
#: The deepest pipeline asked for (3 stages ran slower on sm_90: more registers, no extra buffer).
MAX_STAGES = 2
#: Pipeline depth of a narrow NVIDIA tile that prefetches its rows: two latent buffers.
PREFETCH_STAGES = 3
#: Capability from which whole tiles inside one page come by TMA (`MlaTiles.tma`).
TMA_MIN_CAPABILITY = 90
#: Where the wide 16-bit tile runs the Hopper kernel (`portattn.kernels.mla_decode_sm90`).
SM90_KERNEL_ARCHS = ("sm_90",)
#: The latent ranks and rope widths the Hopper kernel is built for (its `sm90_errors`).
SM90_KERNEL_RANKS = (128, 256, 512)
SM90_KERNEL_ROPES = (16, 32, 64, 128)
#: The portable kernel's longest KV tile at 64 heads: its 64 x 64 tile over a 512-wide latent
#: spills on sm_90, where only the Hopper kernel holds it (docs/decisions.md).
PORTABLE_WIDE_MAX_BLOCK_N = 32
#: The narrowest rope tile the register estimate counts over a 512-wide latent: a 32-wide rope
#: tile, or none, takes the registers of a 64-wide one (on sm_80 the 16-head, 64-token, 4-warp
#: tile that an estimate from the true width let through spilled).
MIN_MODELLED_ROPE_512 = 64
#: The Hopper kernel's KV tile: pages of a multiple of it are copied by TMA boxes, others gathered.
SM90_BLOCK_N = 64
#: Latent ranks whose one-split output goes out through shared memory (`MlaConfig.store_smem`):
#: the rank a GPU ran it at (its read-back layout depends on the half width).
SM90_STORE_SMEM_RANKS = (512,)
#: Where rows are packed: the Hopper kernel's 64-row tile.
PACK_ARCHS = SM90_KERNEL_ARCHS
#: Packed rows (``max_query_len * num_heads``) from which the 64-row tile is taken: half a tile.
PACK_MIN_ROWS = 32
#: Rows of a packed HIP tile (the portable kernel), most first; budgeted for 64-lane wavefronts.
HIP_PACK_BLOCK_H: tuple[int, ...] = (32, 16)
#: The packed HIP tile's KV tile, warps and stages: the longest KV tile (bytes in flight a
#: program) whose 576/512 tile compiles without VGPR spills on gfx90a, gfx942 and gfx950.
HIP_PACK_BLOCK_N = 32
HIP_PACK_NUM_WARPS = 4
HIP_PACK_NUM_STAGES = 2
#: Waves a SIMD the packed tile and the unpacked one over a 512-wide latent ask for: one, so a
#: wave may hold 512 VGPRs (two cap it at 256, where those tiles spill); the packed tile's 4 waves
#: then make one program a CU.
HIP_ONE_WAVE_PER_EU = 1


def sm90_kernel_runs(target: Target, problem: MlaProblem) -> bool:
    """Whether the Hopper kernel can run ``problem``'s 16-bit launch on ``target``: its
    architecture, a rank and rope width it is built for, and a cache it can read
    (``problem.sm90_ready``)."""
    rope = problem.head_dim_k - problem.kv_lora_rank
    return (
        problem.sm90_ready
        and target.arch in SM90_KERNEL_ARCHS
        and problem.elem_size == 2
        and problem.kv_lora_rank in SM90_KERNEL_RANKS
        and rope in SM90_KERNEL_ROPES
    )


def sm90_gathers(page_size: int, page_indices: bool, heads_n: bool) -> bool:
    """Whether the Hopper kernel gathers a launch's rows (``page_indices``, pages that are not a
    multiple of `SM90_BLOCK_N` tokens, or a heads-as-N launch: `MlaConfig.heads_n`, whose own
    copies stream faster than page boxes over long contexts) rather than copying page boxes:
    the launcher's ``GATHER`` (the tiles do not depend on it: a cache the kernel can run takes
    the wide tile either way)."""
    return heads_n or page_indices or page_size % SM90_BLOCK_N != 0


@dataclass(frozen=True)
class MlaProblem:
    """What the MLA decode policy needs to know: ``num_heads`` query heads, ``head_dim_k``
    (latent + rope) and ``kv_lora_rank`` (latent = value width), ``elem_size`` bytes an element,
    ``num_tokens`` query tokens, bounds on any sequence's context (``max_context``) and query
    tokens (``max_query_len``: packing), and whether the Hopper kernel can run the launch's
    cache (``sm90_ready``: its `sm90_errors` are empty; True where the cache is not known). On
    sm_90 a ready 16-bit launch takes the wide tile at any head count; one that is not keeps the
    narrow tile below 64 heads."""

    num_heads: int
    head_dim_k: int
    kv_lora_rank: int
    elem_size: int
    num_tokens: int
    max_context: int
    max_query_len: int = 1
    sm90_ready: bool = True


@dataclass(frozen=True)
class MlaTiles:
    """Frozen tiles for one MLA decode launch (and the workspaces sized from it).

    Attributes:
        block_h: heads per program (the dot's M); ``padded_heads``: heads rounded up to it.
        block_n: context tokens per KV tile; ``block_dv``, ``block_dpe``: latent and rope widths.
        num_kv_splits: context splits (1: no partial results, no reduce kernel).
        options, reduce_options: launch options of the attention and reduce kernels.
        smem_bytes: `mla_smem_bytes` of these tiles (`mla_hip_packed_lds_bytes` for a packed
            HIP tile), at most the target's limit.
        prefetch_rows: tile i+1's rows are read during tile i, so the latent load depends only
            on loop-carried values and gets ``num_stages - 1`` buffers.
        tma: whole tiles inside one page come by tensor descriptors where the cache allows.
        sm90_kernel: the Hopper kernel runs the tile where its requirements hold.
        packed: a program's rows are (query token, head) pairs of one sequence.
    """

    block_h: int
    padded_heads: int
    block_n: int
    block_dv: int
    block_dpe: int
    num_kv_splits: int
    options: LaunchOptions
    reduce_options: LaunchOptions
    smem_bytes: int
    prefetch_rows: bool = False
    tma: bool = False
    sm90_kernel: bool = False
    packed: bool = False

    @property
    def head_groups(self) -> int:
        """Programs per query token and split along the head axis."""
        return self.padded_heads // self.block_h


def mla_row_groups(tiles: MlaTiles, num_heads: int, max_query_len: int) -> int:
    """Programs per sequence (packed: ``cdiv(max_query_len * num_heads, block_h)``) or per
    query token (``head_groups``) and split, for the launch grid and the split count."""
    if tiles.packed:
        return max(1, -(-max_query_len * num_heads // tiles.block_h))
    return tiles.head_groups


def mla_tile_reads(block_h: int, num_heads: int, q_len: int, packed: bool) -> int:
    """KV tiles one sequence's programs read at each tile position of a split: packed rows
    ``cdiv(q_len * num_heads, block_h)``, else ``q_len * cdiv(num_heads, block_h)`` (every
    token's own head groups). 16 heads x 4 tokens: 4 unpacked at 16 rows, 1 packed at 64."""
    if packed:
        return -(-q_len * num_heads // block_h)
    return q_len * -(-num_heads // block_h)


def mla_smem_bytes(
    block_h: int,
    block_n: int,
    block_dv: int,
    block_dpe: int,
    num_stages: int,
    elem_size: int,
    prefetch_rows: bool = False,
) -> int:
    """Bytes of shared memory: latent + rope tiles per buffer, the query tiles and P. Prefetched
    16-bit rows get ``num_stages - 1`` buffers, everything else ``num_stages``."""
    prefetched = prefetch_rows and elem_size < 4
    buffers = max(1, num_stages - 1) if prefetched else num_stages
    kv = block_n * (block_dv + block_dpe) * elem_size * buffers
    q = block_h * (block_dv + block_dpe) * elem_size
    p = block_h * block_n * elem_size
    return kv + q + p


def mla_hip_packed_lds_bytes(
    block_h: int, block_n: int, block_dv: int, block_dpe: int, elem_size: int
) -> int:
    """LDS of a packed HIP tile at two stages: the larger of the query's latent tile (staged once
    into the dot's layout) and one KV tile (the prefetched one); Triton 3.6 reuses the space,
    so the two do not add (the compile matrix checks the compiled figure)."""
    return max(block_h * block_dv, block_n * (block_dv + block_dpe)) * elem_size


def mla_reg_estimate(
    block_h: int,
    block_n: int,
    block_dv: int,
    block_dpe: int,
    num_warps: int,
    elem_size: int,
    warp_size: int = 32,
) -> int:
    """32-bit registers per thread for the fp32 accumulator and one latent + rope tile."""
    threads = num_warps * warp_size
    acc = block_h * block_dv // threads
    tile = block_n * (block_dv + block_dpe) * elem_size // 4 // threads
    return acc + tile


def mla_num_kv_splits(
    target: Target,
    num_tokens: int,
    head_groups: int,
    max_context: int,
    programs_per_sm: int = PROGRAMS_PER_SM,
) -> int:
    """Context splits for ``num_tokens x head_groups`` programs: the most whose programs fit one
    wave of ``programs_per_sm * num_sms`` slots, at most ``max_context // MIN_TOKENS_PER_SPLIT``
    and `MAX_KV_SPLITS`, at least 1 (sm_90, 64 tokens, 1 group, 2 a SM: 264 // 64 = 4)."""
    base = max(1, num_tokens * head_groups)
    want = programs_per_sm * target.num_sms // base
    by_context = max(1, max_context // MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, by_context, MAX_KV_SPLITS))


def mla_programs_per_sm(
    target: Target, block_h: int, smem_bytes: int, sm90_kernel: bool = False
) -> int:
    """Resident programs per SM the split count aims at: HIP `PROGRAMS_PER_SM`; the Hopper
    kernel 1 (one wave); the wide tile `PROGRAMS_PER_SM_WIDE`; the narrow tile as many as its
    shared memory lets reside."""
    if target.is_hip:
        return PROGRAMS_PER_SM
    if sm90_kernel:
        return 1
    if block_h >= WIDE_BLOCK_H:
        return PROGRAMS_PER_SM_WIDE
    return max(1, target.max_shared_mem // smem_bytes)


def _problem_errors(p: MlaProblem) -> list[str]:
    errors = []
    for name in (
        "num_heads",
        "head_dim_k",
        "kv_lora_rank",
        "elem_size",
        "max_context",
        "max_query_len",
    ):
        v = getattr(p, name)
        if not is_int(v) or v < 1:  # a float gave float tiles
            errors.append(f"{name} must be an int >= 1; got {v!r}")
    if not is_int(p.num_tokens) or p.num_tokens < 0:
        errors.append(f"num_tokens must be an int >= 0; got {p.num_tokens!r}")
    if not isinstance(p.sm90_ready, bool):  # (any string is truthy)
        errors.append(f"sm90_ready must be a bool; got {p.sm90_ready!r}")
    ints = all(isinstance(getattr(p, n), int) for n in ("elem_size", "kv_lora_rank", "head_dim_k"))
    if ints and p.elem_size >= 1 and p.elem_size not in (1, 2, 4):
        errors.append(f"elem_size must be 1, 2 or 4 bytes; got {p.elem_size}")
    if ints and p.kv_lora_rank > p.head_dim_k:
        errors.append(f"kv_lora_rank must be <= head_dim_k; got {p.kv_lora_rank} > {p.head_dim_k}")
    if ints and p.kv_lora_rank > MAX_KV_LORA_RANK:
        errors.append(
            f"kv_lora_rank must be <= {MAX_KV_LORA_RANK} (the widest latent whose tiles the "
            f"budgets model and the compile matrix checks); got {p.kv_lora_rank}"
        )
    return errors


#: The widest latent the tiles are for (DeepSeek's and Kimi's): past it the register model
#: undercounts (1024-wide value tiles spilled on every vendor and overflowed sm_89's shared memory).
MAX_KV_LORA_RANK = 512
#: The narrowest latent or rope tile: NVIDIA's tl.dot needs K and N of at least 16 (a latent or
#: rope part of 1-8 columns failed to compile there; AMD and the interpreter took it).
MIN_DOT_WIDTH = 16


def dot_width(width: int) -> int:
    """The tile of a latent or rope part ``width`` columns wide: ``next_pow2``, at least
    `MIN_DOT_WIDTH`."""
    return max(MIN_DOT_WIDTH, next_pow2(width))


def mla_decode_tiles(target: Target, problem: MlaProblem) -> MlaTiles:
    """The tiles for ``problem`` on ``target``: pure, deterministic, within the smem budget.

    Raises:
        ValueError: an invalid problem, or no tile fits the target's shared memory (e.g. a
            fp32 cache with ``kv_lora_rank`` 512 on a 64 KB part).
    """
    errors = _problem_errors(problem)
    if errors:
        raise ValueError("mla_decode_tiles: " + "; ".join(errors))
    block_dv = dot_width(problem.kv_lora_rank)
    rope = problem.head_dim_k - problem.kv_lora_rank
    block_dpe = dot_width(rope) if rope > 0 else 0
    elem = problem.elem_size
    top = min(MAX_STAGES, target.max_num_stages)

    # the rope width the register estimate counts (`MIN_MODELLED_ROPE_512`)
    reg_dpe = max(block_dpe, MIN_MODELLED_ROPE_512) if block_dv >= 512 else block_dpe

    def fits(
        block_h: int,
        block_n: int,
        stages: int,
        warps: int,
        prefetch: bool = False,
        warp_size: int = 32,
    ) -> int | None:
        """The shared-memory estimate when both budgets hold, else None."""
        regs = mla_reg_estimate(block_h, block_n, block_dv, reg_dpe, warps, elem, warp_size)
        smem = mla_smem_bytes(block_h, block_n, block_dv, block_dpe, stages, elem, prefetch)
        return smem if regs <= REG_BUDGET and smem <= target.max_shared_mem else None

    fp32 = elem >= 4
    hopper = sm90_kernel_runs(target, problem)
    block_ns = (FP32_BLOCK_N,) if fp32 else BLOCK_N_CANDIDATES
    hip_512 = target.is_hip and block_dv >= 512  # `HIP_LATENT_512_NUM_WARPS`
    if hip_512:
        warp_counts: tuple[int, ...] = (HIP_LATENT_512_NUM_WARPS,)
    else:
        warp_counts = (FP32_NUM_WARPS,) if fp32 else NUM_WARPS
    choice = None
    pack = (
        target.arch in PACK_ARCHS
        and elem == 2
        and block_dv <= 512
        and problem.max_query_len > 1
        and problem.num_heads < WIDE_BLOCK_H
        and problem.max_query_len * problem.num_heads >= PACK_MIN_ROWS
    )
    # the Hopper kernel's 64-row tile reads faster than the narrow one below 64 heads too
    wide = problem.num_heads >= WIDE_BLOCK_H or pack or hopper
    if target.arch in WIDE_ARCHS and wide and not fp32:
        for block_n in BLOCK_N_CANDIDATES:
            if not hopper and block_n > PORTABLE_WIDE_MAX_BLOCK_N:
                continue
            smem = fits(WIDE_BLOCK_H, block_n, top, WIDE_NUM_WARPS)
            if smem is not None and block_n >= 32:
                choice = (WIDE_BLOCK_H, block_n, top, WIDE_NUM_WARPS, smem)
                break
    # longest tile that pipelines at the fewest warps; one stage only when nothing else fits
    order = [(n, s) for n in block_ns for s in range(top, 1, -1)]
    order += [(n, 1) for n in block_ns]
    if choice is None and target.is_hip and not fp32 and problem.max_query_len > 1:
        # HIP verification: the most packed rows (`HIP_PACK_BLOCK_H`, no more than the rows
        # there are) whose tile fits the LDS (`mla_hip_packed_lds_bytes`) and the register
        # budget at 64-lane wavefronts, where it reads fewer KV tiles a sequence than one
        # token's heads do (`mla_tile_reads`)
        q_len, heads = problem.max_query_len, problem.num_heads
        unpacked = mla_tile_reads(target.mma_min_rows, heads, q_len, packed=False)
        most = max(target.mma_min_rows, next_pow2(q_len * heads))
        n, w, s = HIP_PACK_BLOCK_N, HIP_PACK_NUM_WARPS, min(top, HIP_PACK_NUM_STAGES)
        for rows in HIP_PACK_BLOCK_H:
            if rows > most or rows < target.mma_min_rows:
                continue
            if mla_tile_reads(rows, heads, q_len, packed=True) >= unpacked:
                break  # fewer rows read no less
            lds = mla_hip_packed_lds_bytes(rows, n, block_dv, block_dpe, elem)
            regs = mla_reg_estimate(rows, n, block_dv, block_dpe, w, elem, target.warp_size)
            if lds <= target.max_shared_mem and regs <= REG_BUDGET:
                choice, pack = (rows, n, s, w, lds), True
                break
    if choice is None:
        pack = False
        block_h = target.mma_min_rows
        # no register budget only when nothing else fits
        choice = next(
            (
                (block_h, n, s, w, smem)
                for n, s in order
                for w in warp_counts
                if (smem := fits(block_h, n, s, w)) is not None
            ),
            None,
        )
        if choice is None:
            for block_n, stages in order:
                smem = mla_smem_bytes(block_h, block_n, block_dv, block_dpe, stages, elem)
                if smem <= target.max_shared_mem:
                    choice = (block_h, block_n, stages, warp_counts[-1], smem)
                    break
    if choice is None:
        smallest = mla_smem_bytes(target.mma_min_rows, 16, block_dv, block_dpe, 1, elem)
        half = mla_smem_bytes(target.mma_min_rows, 16, block_dv, block_dpe, 1, 2)
        hint = "; use a 2-byte dtype" if elem > 2 and half <= target.max_shared_mem else ""
        raise ValueError(
            f"mla_decode_tiles: no tile fits {target.arch}'s {target.max_shared_mem} B of shared "
            f"memory for kv_lora_rank={problem.kv_lora_rank}, head_dim_k={problem.head_dim_k}, "
            f"{problem.elem_size}-byte elements (the smallest needs {smallest} B){hint}"
        )
    block_h, block_n, stages, warps, smem = choice
    # narrow NVIDIA 16-bit tiles prefetch their rows where two latent buffers fit (fp32 spills)
    prefetch = False
    if not target.is_hip and block_h < WIDE_BLOCK_H and stages >= 2 and not fp32:
        deeper = fits(block_h, block_n, PREFETCH_STAGES, warps, prefetch=True)
        if deeper is not None and target.max_num_stages >= PREFETCH_STAGES:
            stages, smem, prefetch = PREFETCH_STAGES, deeper, True
    tma = not target.is_hip and target.capability >= TMA_MIN_CAPABILITY and not fp32
    sm90 = hopper and (block_h, block_n) == (WIDE_BLOCK_H, SM90_BLOCK_N)
    per_sm = 1 if pack and target.is_hip else mla_programs_per_sm(target, block_h, smem, sm90)
    # HIP: launch_options' default (two waves a SIMD) unless the tile asks for one
    waves = HIP_ONE_WAVE_PER_EU if target.is_hip and (pack or hip_512) else None
    padded_heads = -(-problem.num_heads // block_h) * block_h
    if pack:  # programs: sequences x row groups
        rows = problem.max_query_len * problem.num_heads
        seqs = -(-problem.num_tokens // problem.max_query_len)
        splits = mla_num_kv_splits(target, seqs, -(-rows // block_h), problem.max_context, per_sm)
    else:
        splits = mla_num_kv_splits(
            target, problem.num_tokens, padded_heads // block_h, problem.max_context, per_sm
        )
    return MlaTiles(
        block_h=block_h,
        padded_heads=padded_heads,
        block_n=block_n,
        block_dv=block_dv,
        block_dpe=block_dpe,
        num_kv_splits=splits,
        options=launch_options(
            target,
            warps,
            stages,
            waves_per_eu=waves,
        ),
        reduce_options=launch_options(target, REDUCE_NUM_WARPS, 1),
        smem_bytes=smem,
        prefetch_rows=prefetch,
        tma=tma,
        sm90_kernel=sm90,
        packed=pack,
    )


def portable_tiles(tiles: MlaTiles, elem_size: int) -> MlaTiles:
    """The tiles the portable kernel runs in place of ``tiles`` planned for the Hopper kernel
    (``sm90_kernel``) on a cache that kernel cannot read (a metadata builder plans before it
    sees the cache): the wide tile at `PORTABLE_WIDE_MAX_BLOCK_N` tokens, its shared memory
    recounted, the heads and splits (the workspaces) as planned. Other tiles are returned as
    they are."""
    if not tiles.sm90_kernel:
        return tiles
    n = PORTABLE_WIDE_MAX_BLOCK_N
    stages = tiles.options.num_stages
    smem = mla_smem_bytes(tiles.block_h, n, tiles.block_dv, tiles.block_dpe, stages, elem_size)
    return replace(tiles, block_n=n, smem_bytes=smem, sm90_kernel=False)


@dataclass(frozen=True)
class MlaConfig:
    """The Hopper kernel's schedule choices for a launch (`mla_config`; ``mla_decode(config=)``).

    Attributes:
        store_smem: a one-split output of the 64-row schedule goes out through shared memory,
            16-byte stores a warp a row, instead of straight from the MMA accumulators; only at
            `SM90_STORE_SMEM_RANKS` (a `heads_n` launch stores its rows from registers, 16
            bytes a thread, either way).
        heads_n: a launch of one query token a program and at most 16 heads runs its MMAs
            with the heads as N (scores as ``K Q^T``, output as ``V^T P^T``): no MMA works on
            the 64-row tile's padded rows.
    """

    store_smem: bool = False
    heads_n: bool = False

    def __post_init__(self) -> None:
        for name in ("store_smem", "heads_n"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"MlaConfig: {name} must be a bool; got {type(value).__name__}")


#: The most heads `MlaConfig.heads_n` serves: the MMAs' N (one 16-column wgmma tile).
HEADS_N_MAX = 16


def mla_config(target: Target, problem: MlaProblem, tiles: MlaTiles) -> MlaConfig:
    """The policy's `MlaConfig` for ``problem`` on ``target`` with the launch's ``tiles`` (the
    policy's or a metadata builder's: a builder sized for verification packs its rows even in a
    step of one token a sequence, and packed rows keep the 64-row schedule)."""
    sm90 = target.arch in SM90_KERNEL_ARCHS
    return MlaConfig(
        store_smem=sm90 and problem.kv_lora_rank in SM90_STORE_SMEM_RANKS,
        heads_n=sm90
        and problem.num_heads <= HEADS_N_MAX
        and problem.max_query_len == 1
        and not tiles.packed,
    )


def mla_config_errors(config: MlaConfig, kv_lora_rank: int, num_heads: int) -> list[str]:
    """Why ``config`` cannot serve a launch of ``kv_lora_rank`` and ``num_heads`` (empty: it
    can)."""
    errors = []
    if config.store_smem and kv_lora_rank not in SM90_STORE_SMEM_RANKS:
        errors.append(
            f"config.store_smem must be False at kv_lora_rank {kv_lora_rank} (the shared-memory "
            f"store is built for ranks {SM90_STORE_SMEM_RANKS}); got True"
        )
    if config.heads_n and num_heads > HEADS_N_MAX:
        errors.append(
            f"config.heads_n must be False at {num_heads} heads (the heads are the MMAs' N up to "
            f"{HEADS_N_MAX}); got True"
        )
    return errors
