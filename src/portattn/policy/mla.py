"""Tile policy for MLA decode (absorbed weights, paged latent cache): (target, problem) -> tiles.

Widths (lesson 1): the value tile comes from ``kv_lora_rank`` (``BLOCK_DV = next_pow2(rank)``), the
rope tile from ``head_dim_k - kv_lora_rank`` (``BLOCK_DPE = next_pow2(rope)``, 0 when there is no
rope part). The kernel loads one latent tile ``[BLOCK_N, BLOCK_DV]`` per step and uses it for both
QK and PV, so nothing is ever sized from ``head_dim_k`` (``next_pow2(576) = 1024`` and
``next_pow2(320) = 512`` are the widths that broke upstream).

Heads (lesson 2): one program owns ``BLOCK_H = target.mma_min_rows`` heads of one query token (the
``tl.dot`` M dimension needs >= 16 rows), so 1, 3, 4 or 8 heads are padded to 16 and 20 heads to
32. ``padded_heads`` is part of the frozen tiles, and the split-KV workspaces are sized from it by
`portattn.mla_metadata.MlaMetadataBuilder`, which holds the very object the launch consumes.

Shared memory (explicit budget, `mla_smem_bytes`)::

    (BLOCK_N * BLOCK_DV + BLOCK_N * BLOCK_DPE) * elem * buffers       latent + rope tiles
  + BLOCK_H * (BLOCK_DV + BLOCK_DPE) * elem                            query tiles (dot operands)
  + BLOCK_H * BLOCK_N * elem                                           P (the PV dot's A operand)

``buffers`` is ``num_stages - 1`` for tiles that prefetch block-table rows (the latent load then
depends only on loop-carried values, and Triton 3.6 multi-buffers it: sm_90 compiles of H16 N32 s3
and H16 N64 s3 allocate exactly 93184 and 167936 B), else ``num_stages`` (an upper bound: Triton
3.6 gives a gathered latent tile whose address depends on a load of the same iteration one buffer).

Registers (`mla_reg_estimate`, 32-bit registers per thread): the fp32 accumulator
``BLOCK_H * BLOCK_DV / threads`` plus the latent + rope tile ``BLOCK_N * (BLOCK_DV + BLOCK_DPE) *
elem / 4 / threads``, at most `REG_BUDGET`. Calibrated on sm_90 compiles (bench/NOTES.md, attempt
1): H16 N64 4 warps = 64 + 144 = 208 spills ~200 registers; H16 N32 4 warps = 136 compiles to 225
registers without spills; H16 N64 8 warps = 104 compiles to 181; H64 N64 8 warps = 200 compiles to
255 without spills.

Tiles, narrow (every target, and every head count without the wide tile): ``BLOCK_H =
mma_min_rows``; the longest ``BLOCK_N`` within both budgets at >= 2 stages, at the fewest warps
(4, else 8) whose register estimate fits. Worked numbers for 576/512 bf16: N64 needs 8 warps
(4 would spill); its 2-stage estimate 167936 B fits sm_90/sm_100 (232448 B) but not sm_80
(166912 B), which, like the 99 KB parts, takes N32 x 4 warps (93184 B); 64 KB AMD parts get
N16 x 2 = 55808 B. Measured on an H100 (bench/RESULTS.md, 2026-11-22, 16 heads, batch 64, each
at its best split count): N64 w8 38.8 / 115.0 / 419.3 us at 1k / 4k / 16k against N32 w4
41.8 / 117.3 / 420.4 us.

Tiles, wide (CUDA, ``num_heads >= WIDE_BLOCK_H``): ``BLOCK_H 64``, 8 warps, BLOCK_N 64 (else 32)
at 2 stages. One program reads the latent once for 64 heads instead of 16 (4x fewer bytes) and
its dots have M = 64 (the warpgroup MMA shape). Sweep: 128 heads, 4k: H64 N64 s2 w8 x2 357.5 us
against 858.9 us for H16; 16k: 1322 us against 3405 us. sm_90: N64 = 229376 B of 232448
B; sm_80: N32 = 151552 B; the 99 KB parts do not fit it and stay narrow. HIP stays narrow (the
register calibration is NVIDIA's; no AMD measurement yet).

Packed rows (verification, `PACK_QUERY_ROWS`): on sm_90, 16-bit caches with fewer than 64 heads
and ``max_query_len * num_heads >= PACK_MIN_ROWS`` take the wide tile with rows (query token,
head) of one sequence, so a sequence's query tokens read its cache once per tile; programs per
sequence and split: `mla_row_groups`. Unmeasured (bench/NOTES.md, issue 18).

Split-KV: with few (token, head-group) programs the GPU idles, so the context is split into
``num_kv_splits`` chunks whose partial results a reduce kernel merges. `mla_num_kv_splits` takes
the most splits whose programs fit ONE wave of resident slots (``programs_per_sm * num_sms``),
never gives a split fewer than ``MIN_TOKENS_PER_SPLIT`` context tokens, and is capped at
``MAX_KV_SPLITS``. Resident programs per SM: on CUDA the narrow tile's shared-memory estimate
decides (``max_shared_mem // smem``: 1 for N64 w8, 2 for N32 w4 on sm_90), the wide tile uses
`PROGRAMS_PER_SM_WIDE` (2) and HIP `PROGRAMS_PER_SM` (2, unmeasured). Every extra split costs a
partial output (``padded_heads x BLOCK_DV`` fp32 written and read back), so once each program
double-buffers its gather (prefetched rows) one full wave beats several. Measured on an H100
(132 SMs, 16 heads, 64 tokens, 4k): N32 w4 x4 (256 programs in 264 slots) 117.3 us against x3
139.1, x5 169.0, x8 128.6, x16 145.1; N64 w8 x2 (128 in 132) 115.0 us against x4 125.4. (Before
the rows were prefetched, an H200 sweep favoured ~8 programs per SM: x16 136.5 us > x9 143.9.)
"""

from __future__ import annotations

from dataclasses import dataclass

from portattn.platform import Target
from portattn.policy.common import LaunchOptions, launch_options, next_pow2

#: KV tile lengths tried, largest first (>= 16: the PV dot's K dimension).
BLOCK_N_CANDIDATES: tuple[int, ...] = (64, 32, 16)
#: Programs per multiprocessor the split count aims at on HIP (unmeasured there: two hide one
#: program's gather latency).
PROGRAMS_PER_SM = 2
#: Wide CUDA tile (H64 w8, 255 registers x 256 threads = one resident per SM): 2 waves (measured).
PROGRAMS_PER_SM_WIDE = 2
#: Heads per program of the wide tile (CUDA, num_heads >= this).
WIDE_BLOCK_H = 64
#: Where the 64-head tile is taken: the NVIDIA parts whose compile matrix cells fit it. sm_100's
#: compile of the same tile uses 352816 B of shared memory (its MMA path stages operands
#: differently from the estimate), over the 232448 B limit; 99 KB parts cannot hold it; HIP has no
#: register calibration yet.
WIDE_ARCHS = ("sm_80", "sm_90")
#: Warps of the wide tile (its 64 x 512 fp32 accumulator is 128 registers/thread at 8 warps).
WIDE_NUM_WARPS = 8
#: Per-thread 32-bit register estimate allowed (`mla_reg_estimate`; calibrated on sm_90).
REG_BUDGET = 200
#: A split covers at least this many context tokens, so its partial result is worth the reduce.
MIN_TOKENS_PER_SPLIT = 256
#: Upper bound on splits (workspace size, reduce-kernel loop length).
MAX_KV_SPLITS = 32
#: Warps per program of the narrow tile, fewest first: 4 unless the register estimate needs 8
#: (BLOCK_H 16 x BLOCK_DV 512 fp32 accumulator = 64 registers/thread at 4 warps, 32 at 8).
NUM_WARPS = (4, 8)
#: 4-byte (fp32) elements: the kernel's dots run in exact fp32 (``input_precision="ieee"``), which
#: no tensor core does, so each dot holds both operands in registers (FMA dots) and the register
#: model above (16-bit MMA operands read from shared memory) does not hold. Compiled with Triton
#: 3.6 on a CPU (compile matrix, 2026-11-24), H16 at 2 stages: sm_90 576/512 N32 w4 spills 1188 B,
#: N16 w8 uses 90 registers; 320/256 N32 w4 spills 9928 B (N64 w4, the 16-bit rule's choice,
#: 38176 B), N16 w8 64 registers; gfx942 320/256 N32 w8 spills 99 VGPRs, N16 w8 214 VGPRs and no
#: spill. So fp32 takes the narrowest KV tile at 8 warps, never the wide tile, and never the
#: prefetched rows (below).
FP32_BLOCK_N = 16
FP32_NUM_WARPS = 8
#: Warps of the split-KV reduce kernel.
REDUCE_NUM_WARPS = 4
#: The deepest pipeline the policy asks for (a target may cap it lower): 3 stages measured slower
#: than 2 on sm_90 (more registers, no extra shared memory: the gather is not multi-buffered).
MAX_STAGES = 2
#: Pipeline depth of the narrow NVIDIA tile when it prefetches block-table rows (see below):
#: two latent buffers.
PREFETCH_STAGES = 3
#: CUDA targets from this capability have the bulk-copy engine (TMA): whole tiles inside one page
#: come through tensor descriptors (`MlaTiles.tma`). Measured on an H100 (bench/RESULTS.md,
#: 2026-11-22): 128 heads 16k 1312.7 -> 1101.1 us, 4k 359.4 -> 300.5 us; 16 heads 16k
#: 429.2 -> 414.1 us, 4k 116.9 -> 115.1 us.
TMA_MIN_CAPABILITY = 90
#: Where the wide tile runs the Hopper kernel (`portattn.kernels.mla_decode_sm90`). Measured on an
#: H100 (bench/RESULTS.md, 2026-11-22), 128 heads, batch 64, against the portable kernel with
#: descriptor tiles at its best split: 16k 1101.1 -> 749.9 us, 4k 296.7 -> 209.2 us, 1k 101.1 ->
#: 63.7 us (one split: 128 programs, one wave; two splits: 765.2 / 218.1 / 82.4 us). Its seesaw
#: schedule (332b8e9): 549.6 / 145.0 / 55.6 us, one split still best (x2: 599.3 / 182.4 / 82.3).
SM90_KERNEL_ARCHS = ("sm_90",)
#: The sm_90 kernel's KV tile: pages of a multiple of it are copied by TMA boxes, others gathered.
SM90_BLOCK_N = 64


def sm90_gathers(page_size: int, page_indices: bool) -> bool:
    """Whether the sm_90 kernel gathers a launch's rows (``page_indices``, whose slots are single
    rows, or pages that are not a multiple of `SM90_BLOCK_N` tokens) rather than copying page
    boxes: the one rule its launcher, the planner (`MlaProblem.gathers`) and
    `MlaMetadataBuilder` (``page_size``) use."""
    return page_indices or page_size % SM90_BLOCK_N != 0


#: The latent ranks it is taken at: those a GPU ran it at (its read-back layout depends on the
#: half width); the others write straight from the accumulators.
SM90_STORE_SMEM_RANKS = (512,)
#: Where packing runs: the Hopper kernel's 64-row tile (the portable kernel runs packed tiles too,
#: e.g. where `sm90_errors` refuses a cache, but has no measurement of its own).
PACK_ARCHS = SM90_KERNEL_ARCHS
#: Packed rows (``max_query_len * num_heads``) from which the 64-row tile is taken: half a tile.
#: At 16 heads and q_len 2 the tile computes 32 padded rows, but the cache is read once instead
#: of twice, and at 16 heads the step is bound by the cache read (prediction, not yet measured).
PACK_MIN_ROWS = 32


@dataclass(frozen=True)
class MlaProblem:
    """What the MLA decode policy needs to know.

    Attributes:
        num_heads: query heads (``num_q_heads``; MLA has one latent KV "head").
        head_dim_k: query / cache width (latent + rope).
        kv_lora_rank: latent width (= output / value width).
        elem_size: bytes per query / cache element.
        num_tokens: query tokens per launch (an upper bound for a metadata builder).
        max_context: an upper bound on any sequence's context length.
        max_query_len: an upper bound on any sequence's query tokens (1: plain decode); decides
            row packing (`PACK_QUERY_ROWS`).
        gathers: the launch's cache rows are gathered (``page_indices``, or pages that are not a
            multiple of 64 tokens), not read as 64-row runs of one page; decides
            `SM90_GATHER_WIDE`.
    """

    num_heads: int
    head_dim_k: int
    kv_lora_rank: int
    elem_size: int
    num_tokens: int
    max_context: int
    max_query_len: int = 1
    gathers: bool = False


@dataclass(frozen=True)
class MlaTiles:
    """Frozen tiles for one MLA decode launch (and the workspaces sized from it).

    Attributes:
        block_h: heads per program (the dot's M), >= ``target.mma_min_rows``.
        padded_heads: ``num_heads`` rounded up to a multiple of ``block_h``.
        block_n: context tokens per KV tile.
        block_dv: latent / value tile width, ``next_pow2(kv_lora_rank)``.
        block_dpe: rope tile width, ``next_pow2(head_dim_k - kv_lora_rank)``, 0 without rope.
        num_kv_splits: context splits (1: no partial results, no reduce kernel).
        options: launch options of the attention kernel.
        reduce_options: launch options of the split-KV reduce kernel.
        smem_bytes: `mla_smem_bytes` of these tiles (<= the target's limit).
        v_reload: load the latent tile a second time for PV (one shared-memory use per load,
            so Triton's pipeliner may multi-buffer both; the reload hits L2). A bench variant;
            the policy leaves it off until measured.
        prefetch_rows: compute tile i+1's row offsets (its block-table loads) during tile i, so
            the latent load's address no longer depends on a load of the same iteration and the
            pipeliner can give it ``num_stages - 1`` buffers (bench/NOTES.md attempt 2).
        tma: load whole tiles that lie inside one page through tensor descriptors (the bulk
            copy engine: one asynchronous copy per tile part instead of a per-thread gather); the
            launch falls back to the gather where the cache or the tiles do not allow it
            (`portattn.kernels.mla_decode`), and the partial last tile of a split is gathered.
        sm90_kernel: run the wide tile with the Hopper kernel (`portattn.kernels.mla_decode_sm90`,
            explicit copy/MMA schedule) where its requirements hold, else the portable kernel.
        packed: a program's ``block_h`` rows are (query token, head) pairs of one sequence
            (`PACK_QUERY_ROWS`); its grid has `mla_row_groups` programs per sequence and split.
            The workspaces keep ``padded_heads`` rows per token; only real heads are written.
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
    v_reload: bool = False
    prefetch_rows: bool = False
    tma: bool = False
    sm90_kernel: bool = False
    packed: bool = False

    @property
    def head_groups(self) -> int:
        """Programs per query token and split along the head axis."""
        return self.padded_heads // self.block_h


def mla_row_groups(tiles: MlaTiles, num_heads: int, max_query_len: int) -> int:
    """Programs per sequence (packed tiles) or per query token (else) and split: the one place
    the launch grid and the policy's split count take it from.

    Packed: ``cdiv(max_query_len * num_heads, block_h)`` (16 heads, q_len 4, 64 rows -> 1);
    else ``head_groups``.
    """
    if tiles.packed:
        return max(1, -(-max_query_len * num_heads // tiles.block_h))
    return tiles.head_groups


def mla_smem_bytes(
    block_h: int,
    block_n: int,
    block_dv: int,
    block_dpe: int,
    num_stages: int,
    elem_size: int,
    prefetch_rows: bool = False,
) -> int:
    """The shared-memory estimate of the module docstring, in bytes.

    Example: sm_90, 576/512 bf16, H16 N64, 3 stages, prefetched rows (2 latent buffers) ->
    ``2*64*576*2 + 16*576*2 + 16*64*2 = 147456 + 18432 + 2048 = 167936`` (the compiled figure).
    """
    # fp32 tiles get num_stages buffers even with prefetched rows (the descriptor loop of the
    # bulk-copy path allocates 3 at 3 stages: 320/256 H16 N64 compiles to 266256 B on sm_90).
    prefetched = prefetch_rows and elem_size < 4
    buffers = max(1, num_stages - 1) if prefetched else num_stages
    kv = block_n * (block_dv + block_dpe) * elem_size * buffers
    q = block_h * (block_dv + block_dpe) * elem_size
    p = block_h * block_n * elem_size
    return kv + q + p


def mla_reg_estimate(
    block_h: int,
    block_n: int,
    block_dv: int,
    block_dpe: int,
    num_warps: int,
    elem_size: int,
    warp_size: int = 32,
) -> int:
    """32-bit registers per thread for the accumulator and one latent + rope tile (module doc)."""
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
    """Context splits for ``num_tokens x head_groups`` programs on ``target`` (module doc).

    The most splits whose programs fit one wave of ``programs_per_sm * num_sms`` resident
    slots, at most ``max_context // MIN_TOKENS_PER_SPLIT`` and `MAX_KV_SPLITS`, at least 1.

    Example: sm_90 (132 SMs), 64 tokens, 1 head group, 2 programs per SM -> ``264 // 64 = 4``.
    """
    base = max(1, num_tokens * head_groups)
    want = programs_per_sm * target.num_sms // base
    by_context = max(1, max_context // MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, by_context, MAX_KV_SPLITS))


def mla_programs_per_sm(
    target: Target, block_h: int, smem_bytes: int, sm90_kernel: bool = False
) -> int:
    """Resident programs per SM the split count aims at (module doc, Split-KV).

    HIP: `PROGRAMS_PER_SM`; the Hopper kernel: 1 (230788 B of shared memory, one wave measured
    best); the wide CUDA tile: `PROGRAMS_PER_SM_WIDE`; the narrow CUDA tile: as many as its
    shared-memory estimate lets reside (``max_shared_mem // smem_bytes``, >= 1).
    """
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
        if getattr(p, name) < 1:
            errors.append(f"{name} must be >= 1; got {getattr(p, name)}")
    if p.num_tokens < 0:
        errors.append(f"num_tokens must be >= 0; got {p.num_tokens}")
    if p.kv_lora_rank > p.head_dim_k:
        errors.append(f"kv_lora_rank must be <= head_dim_k; got {p.kv_lora_rank} > {p.head_dim_k}")
    return errors


def mla_decode_tiles(target: Target, problem: MlaProblem) -> MlaTiles:
    """The tiles for ``problem`` on ``target``: pure, deterministic, within the smem budget.

    Raises:
        ValueError: an invalid problem, or no tile fits the target's shared memory (e.g. a
            fp32 cache with ``kv_lora_rank`` 512 on a 64 KB part).
    """
    errors = _problem_errors(problem)
    if errors:
        raise ValueError("mla_decode_tiles: " + "; ".join(errors))
    block_dv = next_pow2(problem.kv_lora_rank)
    rope = problem.head_dim_k - problem.kv_lora_rank
    block_dpe = next_pow2(rope) if rope > 0 else 0
    elem = problem.elem_size
    top = min(MAX_STAGES, target.max_num_stages)

    def fits(
        block_h: int, block_n: int, stages: int, warps: int, prefetch: bool = False
    ) -> int | None:
        """The shared-memory estimate when both budgets hold, else None."""
        regs = mla_reg_estimate(block_h, block_n, block_dv, block_dpe, warps, elem, 32)
        smem = mla_smem_bytes(block_h, block_n, block_dv, block_dpe, stages, elem, prefetch)
        return smem if regs <= REG_BUDGET and smem <= target.max_shared_mem else None

    fp32 = elem >= 4
    block_ns = (FP32_BLOCK_N,) if fp32 else BLOCK_N_CANDIDATES
    warp_counts = (FP32_NUM_WARPS,) if fp32 else NUM_WARPS
    choice = None
    # Row packing (PACK_QUERY_ROWS): a sequence's query tokens share the wide tile's rows.
    pack = (
        target.arch in PACK_ARCHS
        and elem == 2
        and block_dv <= 512
        and problem.max_query_len > 1
        and problem.num_heads < WIDE_BLOCK_H
        and problem.max_query_len * problem.num_heads >= PACK_MIN_ROWS
    )
    gather_wide = (
        problem.gathers and target.arch in SM90_KERNEL_ARCHS and elem == 2 and block_dv <= 512
    )
    wide = problem.num_heads >= WIDE_BLOCK_H or pack or gather_wide
    if target.arch in WIDE_ARCHS and wide and not fp32:
        for block_n in BLOCK_N_CANDIDATES:
            smem = fits(WIDE_BLOCK_H, block_n, top, WIDE_NUM_WARPS)
            if smem is not None and block_n >= 32:
                choice = (WIDE_BLOCK_H, block_n, top, WIDE_NUM_WARPS, smem)
                break
    if choice is None:
        pack = False
        block_h = target.mma_min_rows
        # The longest KV tile that pipelines (>= 2 stages) within both budgets at the fewest
        # warps, then the deepest pipeline; a single stage, then the register budget waived,
        # only when nothing else fits.
        order = [(n, s) for n in block_ns for s in range(top, 1, -1)]
        order += [(n, 1) for n in block_ns]
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
        raise ValueError(
            f"mla_decode_tiles: no tile fits {target.arch}'s {target.max_shared_mem} B of shared "
            f"memory for kv_lora_rank={problem.kv_lora_rank}, head_dim_k={problem.head_dim_k}, "
            f"{problem.elem_size}-byte elements (the smallest needs {smallest} B); use a 2-byte "
            "dtype"
        )
    block_h, block_n, stages, warps, smem = choice
    # Narrow NVIDIA tiles prefetch the next tile's block-table rows, which lets Triton give the
    # latent tile PREFETCH_STAGES - 1 shared-memory buffers (bench/NOTES.md attempt 2). Measured on
    # an H200, 16 heads, batch 64: 4k 137.1 -> 124.5 us, 16k 456.8 -> 408.2 us (N32 w4 x16).
    # Taken where the estimate with two latent buffers fits both budgets.
    # Not for fp32: its H16 N16 w8 tiles compile spill-free at 2 stages, but spill at 3 stages
    # with prefetched rows (sm_90 320/256: 324 B; 576/512 at 128 heads: 1644 B).
    prefetch = False
    if not target.is_hip and block_h < WIDE_BLOCK_H and stages >= 2 and not fp32:
        deeper = fits(block_h, block_n, PREFETCH_STAGES, warps, prefetch=True)
        if deeper is not None and target.max_num_stages >= PREFETCH_STAGES:
            stages, smem, prefetch = PREFETCH_STAGES, deeper, True
    # Not for fp32 either: its descriptor loop spills (sm_90 320/256 H16 N16 w8 page 64: 340 B).
    tma = not target.is_hip and target.capability >= TMA_MIN_CAPABILITY and not fp32
    # The Hopper kernel takes the wide H64 N64 tile of 16-bit caches on sm_90.
    sm90 = (
        target.arch in SM90_KERNEL_ARCHS
        and (block_h, block_n, elem) == (WIDE_BLOCK_H, 64, 2)
        and block_dv <= 512
    )
    per_sm = mla_programs_per_sm(target, block_h, smem, sm90)
    padded_heads = -(-problem.num_heads // block_h) * block_h
    if pack:  # programs: sequences (num_tokens / max_query_len) x row groups
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
        options=launch_options(target, warps, stages),
        reduce_options=launch_options(target, REDUCE_NUM_WARPS, 1),
        smem_bytes=smem,
        prefetch_rows=prefetch,
        tma=tma,
        sm90_kernel=sm90,
        packed=pack,
    )
