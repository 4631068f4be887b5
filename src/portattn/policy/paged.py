"""Tile policy for `portattn.kernels.paged_attention` (DESIGN.md §3): `paged_tiles` picks the
portable kernel's tiles, `paged_config` the kernel for the prefill part of a batch (the sm_90
Gluon kernel's `PrefillConfig`, or ``None``: the portable one). Pure functions of (target,
`PagedProblem`); the measurements behind the constants are in docs/decisions.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import NamedTuple

from portattn.platform import Target, is_int
from portattn.policy.common import LaunchOptions, launch_options, next_pow2

MAX_HEAD_DIM = 256
# The fewest rows/columns a tl.dot operand may have (every backend).
MIN_DOT_DIM = 16
# Largest M tile of the narrow ladder: 4 warps x 16 MMA rows (MFMA: 4 wavefronts).
MAX_BLOCK_M = 64
# The wide prefill tile (flash-attention's forward tile): 128 rows x 64 tokens, 8 warps.
WIDE_BLOCK_M = 128
WIDE_BLOCK_N = 64
# Only where the MMA reads Q and P from shared memory without spilling (tcgen05); sm_90's 64-row
# 4-warp tile is faster.
WIDE_TILE_ARCHS = ("sm_100",)
# 8-warp register estimate up to which the wide tile is taken: head_dim 128 in 16-bit.
WIDE_MAX_REGS = 112
# Context-token tiles, largest first; 16 is tl.dot's smallest K.
BLOCK_N_LADDER = (64, 32, 16)
# Pipeline depth asked for before the target caps it: 3 stages are slower.
PREFERRED_STAGES = 2
# Warps per program: the smaller count unless the register budget needs the larger.
NUM_WARPS = (4, 8)
MAX_REGS_PER_THREAD = 64
# wgmma reads K, V and P from shared memory, so a >= 64-row 4-warp tile may use more registers.
SMEM_MMA_ARCHS = ("sm_90",)
SMEM_MMA_MIN_ROWS = 64
MAX_REGS_4_WARPS_SMEM_MMA = 128
# sm_90's wgmma gives each warpgroup 64 rows: an 8-warp tile of 64 rows splits every dot's N
# between its warpgroups (QK^T as m64n16 at 32 tokens). Where the 64-row tile needs 8 warps and
# the batch has the rows, 128 rows x 32 tokens at 8 warps, 64 rows a warpgroup (its evidence:
# docs/decisions.md).
SMEM_MMA_8_WARP_ROWS = 128
SMEM_MMA_8_WARP_BLOCK_N = 32
# The 8-warp estimate a non-wide tile may reach: head_dim 256 at block_n 64 spills above it.
MAX_REGS_8_WARPS = 96
# The same bound in words per program, so 64-lane wavefronts get NVIDIA's budget, not twice it.
MAX_WORDS_8_WARPS = MAX_REGS_8_WARPS * 8 * 32
# Extra words per gathered K/V element on SHUFFLE caches (the split token/dim addressing).
SHUFFLE_ADDR_WORDS = 1
# fp32 on NVIDIA (`_fma_dots`): exact fp32 dots are FMA loops with register operands; any larger
# row tile spills on some head dim, and hd128 SHUFFLE 16 x 32 (10752 words) is the first to spill.
FP32_BLOCK_M = 16
FP32_NUM_WARPS = 8
FP32_MAX_WORDS = 40 * FP32_NUM_WARPS * 32
# Element sizes whose SHUFFLE address words count in the warp count (16-bit loads are vectors).
SHUFFLE_WARPS_ELEM_BYTES = (4,)
# Split-KV: the fewest tokens a split walks, the most splits, and programs per SM to aim for.
MIN_SPLIT_TOKENS = 1024
MAX_SPLITS = 16
SPLIT_PROGRAMS_PER_SM = 2

# -- SHUFFLE caches read in the cache's own order (whole 128-byte lines a warp) ----------------
#: The compilers that build those reads well and right (others scalarize or spill them).
SHUFFLE_LINES_ARCHS = ("sm_90",)
#: Cache-order decode tiles (at most 16 rows) take at most 32 tokens: 64 cost 142 registers.
SHUFFLE_NARROW_BLOCK_N = 32
SHUFFLE_NARROW_MAX_M = 16
#: ... except at head_dim 128: NHD's 64-token, 4-warp tile under a 128-register cap keeps
#: enough bytes in flight at 4 programs per SM.
SHUFFLE_REG_CAP = 128
SHUFFLE_REG_CAP_BLOCK_D = (128,)
SHUFFLE_REG_CAP_BLOCK_N = 64
SHUFFLE_REG_CAP_WARPS = 4
#: ... and at head_dim 64 NHD's tile as it is, uncapped: the 32-token tile keeps half of NHD's
#: bytes in flight (evidence in docs/decisions.md).
SHUFFLE_FULL_BLOCK_D = (64,)
#: Runs (block_d // x) -> the most tokens a cache-order tile may take: the shapes a GPU ran
#: right (Triton 3.6 builds 4 runs x 64 tokens wrong on sm_90).
SHUFFLE_LINES_MAX_N = {4: 32, 8: 64, 16: 64, 32: 32}

# -- the sm_90 prefill kernel (`portattn.kernels.paged_prefill_sm90`) --------------------------
#: Rows (query tokens x group) the longest sequence must fill: one 128-row tile; shorter
#: verification batches stay on the portable kernel's smaller tiles.
SM90_PREFILL_MIN_ROWS = 128
#: Context tokens per K/V tile.
SM90_PREFILL_BLOCK_N = 128
#: Stages of a tile of turns whose query cannot come by TMA: it runs sequentially (turns
#: without the query by TMA were not faster and spill at GQA 5:1).
SM90_PREFILL_NO_TMA_STAGES = 2
#: Page boxes a tile at which a 2-stage sequential tile takes 3 stages with a late release
#: (the copies land later in the tile period, away from the MMAs).
SM90_PREFILL_LATE_RELEASE_BOXES = (2, 4)
#: Fewest page boxes a tile for V to arrive a page box a copy (fewer copies; slower at 4).
SM90_PREFILL_V_PAGES_MIN_BOXES = 8
#: Smallest TMA box (rows of one page): pages must be a multiple of it.
SM90_PREFILL_MIN_BOX = 16
#: Registers per thread (``setmaxnreg``) of the worker consumer warpgroup and the producer warp
#: in the two-warpgroup tiles.
SM90_PREFILL_REGS = (216, 64)
#: 32-bit registers of an sm_90 SM.
SM90_REGISTERS = 65536


class Sm90Tile(NamedTuple):
    """A head_dim's tile on the sm_90 prefill kernel: its stages and turns, the stages and K/V
    tokens of its sequential tile where the turns cannot take the query by TMA, K/V tokens a
    tile, the setmaxnreg counts and the consumer warpgroups of its turns (the sequential tile
    takes two, at ``no_tma_regs``), whether its row sums are quad partials
    (`PrefillConfig.quad_sums`), whether its running max is lazy (`PrefillConfig.lazy_max`) and
    whether its turns free K and V buffers apart (`PrefillConfig.split_release`; its sequential
    tile frees each stage whole)."""

    stages: int
    turns: bool
    no_tma_stages: int = SM90_PREFILL_NO_TMA_STAGES
    block_n: int = SM90_PREFILL_BLOCK_N
    regs: tuple[int, int] = SM90_PREFILL_REGS
    warpgroups: int = 2
    quad_sums: bool = True
    lazy_max: bool = True
    no_tma_block_n: int = SM90_PREFILL_BLOCK_N
    no_tma_regs: tuple[int, int] = SM90_PREFILL_REGS
    split_release: bool = False


#: head_dim -> its tile: head_dim 64 and 128 take turns among three warpgroups at 160 registers
#: (head_dim 64's on 128-token tiles at 3 stages, with plain row sums and an exact running max,
#: its sequential tile at 3 stages; head_dim 128's on 64-token tiles at 4 stages, its
#: sequential tile on 128 tokens); head_dim 256's 64-row output needs 128 registers a thread,
#: so its two consumer warpgroups take 240 and two 64-token stages fit (its sequential tile
#: the same); its turns free K and V buffers apart, which lets them run on two stages (at
#: head_dims 64 and 128 the split was slower, and in head_dim 256's sequential loop no faster).
SM90_PREFILL_TILES = {
    64: Sm90Tile(
        3, True, no_tma_stages=3, regs=(160, 32), warpgroups=3, quad_sums=False, lazy_max=False
    ),
    128: Sm90Tile(4, True, block_n=64, regs=(160, 32), warpgroups=3),
    256: Sm90Tile(
        2,
        True,
        block_n=64,
        regs=(240, 24),
        no_tma_block_n=64,
        no_tma_regs=(240, 24),
        split_release=True,
    ),
}
#: Ring slots past the stages: the producer runs at most ``stages + 1`` items ahead.
SM90_PREFILL_RING_EXTRA = 2
#: 32-bit words of a ring slot: the item's step and what the consumers need of it.
SM90_PREFILL_RING_WORDS = 8


@dataclass(frozen=True)
class PagedProblem:
    """What the policy may look at.

    Attributes:
        num_q_heads: query heads.
        num_kv_heads: KV heads (``num_q_heads % num_kv_heads == 0``).
        head_dim: head dimension (<= 256).
        elem_bytes: bytes per Q/K/V element (2 for fp16/bf16, 4 for fp32).
        max_query_len: the longest ``q_len_i`` of the batch (1 for pure decode).
        block_size: the cache's tokens per block (the portable tiles never depend on it; the
            sm_90 kernel's page boxes do).
        num_seqs: sequences in the batch (split-KV sizing).
        max_seq_len: the longest ``seq_lens[i]`` (split-KV sizing); ``None``: unknown, no split.
        shuffled: the KV cache is in the SHUFFLE layout.
        query_rows_aligned: the query's rows are contiguous with 16-byte aligned strides and
            base (TMA can load them).
        out_rows_aligned: the same of the output's rows (TMA can store them); a call without
            ``out`` makes a contiguous one.
        kv_head_stride: the caches' KV-head stride in elements (V by page boxes needs a
            multiple of 64; 0: one head's memory seen as every head, a broadcast view);
            ``None``: ``num_kv_heads``-packed rows of ``head_dim``.
    """

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    elem_bytes: int
    max_query_len: int
    block_size: int = 16
    num_seqs: int = 1
    max_seq_len: int | None = None
    shuffled: bool = False
    query_rows_aligned: bool = True
    kv_head_stride: int | None = None
    out_rows_aligned: bool = True

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads


@dataclass(frozen=True)
class RowTile:
    """The M tile's packing: ``block_q`` query tokens x ``head_tile`` heads in ``block_m`` rows."""

    block_m: int
    block_q: int
    head_tile: int


@dataclass(frozen=True)
class PagedTiles:
    """Tiles and launch options for one paged-attention launch.

    Attributes:
        block_m: rows of the M tile (a power of two >= 16).
        block_q: query tokens per program (``block_q * head_tile <= block_m``).
        head_tile: query heads per program, all of one KV head (``<= group``).
        block_n: context tokens per KV tile (a power of two >= 16, independent of block_size).
        block_d: padded head dimension (next power of two >= head_dim, >= 16).
        options: num_warps, num_stages and, on HIP only, waves_per_eu.
        shared_mem_bytes: `estimate_shared_mem` of this choice (<= target.max_shared_mem).
        decode: a second, smaller row tile for the sequences with ``q_len <= decode.block_q`` of
            a mixed batch; ``None``: every sequence uses the tile above.
        num_splits: KV splits per sequence (decode only); > 1 adds a reduce launch.
    """

    block_m: int
    block_q: int
    head_tile: int
    block_n: int
    block_d: int
    options: LaunchOptions
    shared_mem_bytes: int
    decode: RowTile | None = None
    num_splits: int = 1

    @property
    def num_warps(self) -> int:
        return self.options.num_warps

    @property
    def num_stages(self) -> int:
        return self.options.num_stages

    @property
    def waves_per_eu(self) -> int | None:
        return self.options.waves_per_eu


@dataclass(frozen=True)
class PrefillConfig:
    """How the sm_90 kernel runs the prefill part of a batch (64-row consumer warpgroups, a
    producer warp loading K/V by TMA page boxes).

    Attributes:
        block_n: context tokens per K/V tile (32, 64 or 128).
        stages: K/V tiles in flight (2..4; shared memory bounds it).
        warpgroups: consumer warpgroups (2 or 3), 64 rows each: an item is ``64 x warpgroups``
            rows of query tokens x heads.
        turns: the warpgroups take turns issuing their MMAs, round robin (needs 3 stages, or
            ``split_release``).
        query_by_tma: the producer loads each item's query rows by TMA (needs ``turns``).
        out_by_tma: a consumer warpgroup whose 64 rows are all real writes them by one TMA
            copy through its query buffer (others element by element).
        late_release: a stage is released just before the next tile's P V, not after its own
            (the sequential loop at 3 stages or more).
        box: rows per TMA box, a power of two >= 16 dividing ``block_size`` and ``block_n``.
        v_pages: V tiles arrive a page box a copy (2, 4 or 8 boxes a tile; head_dim 128/256).
        paging: how the producer finds a box's page: 0 a division a box, 1 a box a page
            (``box == block_size``), 2 one division a tile (pages of a tile or more).
        consumer_regs, producer_regs: registers per thread of the worker consumer warpgroups
            and of the producer warp (``setmaxnreg``: multiples of 8 in [24, 256]; the
            producer's warpgroup and the consumers' share the SM's 64 K registers).
        quad_sums: each row's softmax sum is kept as one partial sum a lane of the row's quad
            and finished in the epilogue (no shuffles a tile); else summed whole every tile.
        lazy_max: a row's running max moves only where a tile's passes it by more than a factor
            2^8, and a thread whose rows kept theirs skips the accumulator's rescale; else the
            max is exact every tile.
        split_release: a stage's K buffer is freed once its scores return and its V buffer once
            P V does, and the producer loads each as soon as it is free; else the whole stage is
            freed after P V.
    """

    block_n: int = SM90_PREFILL_BLOCK_N
    stages: int = 2
    warpgroups: int = 2
    turns: bool = False
    query_by_tma: bool = False
    out_by_tma: bool = False
    late_release: bool = False
    box: int = SM90_PREFILL_BLOCK_N
    v_pages: bool = False
    paging: int = 0
    consumer_regs: int = SM90_PREFILL_REGS[0]
    producer_regs: int = SM90_PREFILL_REGS[1]
    quad_sums: bool = False
    lazy_max: bool = False
    split_release: bool = False

    def __post_init__(self) -> None:
        """Fields of the right types (values are judged against a call by
        `prefill_config_errors`)."""
        errors = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            flag = isinstance(f.default, bool)
            if flag and not isinstance(v, bool):
                errors.append(f"{f.name} must be a bool; got {v!r}")
            elif not flag and not is_int(v):
                errors.append(f"{f.name} must be an int; got {v!r}")
        if errors:
            raise TypeError("PrefillConfig: " + "; ".join(errors))

    @property
    def boxes(self) -> int:
        """Page boxes a K/V tile."""
        return self.block_n // self.box


@dataclass(frozen=True)
class PagedConfig:
    """The kernel choices of one paged-attention call (`paged_config`'s, or a caller's).

    Attributes:
        prefill: the sm_90 kernel's configuration for the prefill part of the batch (its decode
            sequences run as items of the same launch); ``None``: the portable kernel serves
            every sequence.
    """

    prefill: PrefillConfig | None = None

    def __post_init__(self) -> None:
        if self.prefill is not None and not isinstance(self.prefill, PrefillConfig):
            raise TypeError(
                f"PagedConfig: prefill must be a PrefillConfig or None; got {self.prefill!r}"
            )


def estimate_shared_mem(
    block_m: int, block_n: int, block_d: int, elem_bytes: int, num_stages: int
) -> int:
    """Bytes of shared memory / LDS the portable kernel needs: K and V stages, Q, P.

    Example: gfx942, head_dim 128, fp16, 16 x 32, 2 stages -> ``32768 + 4096 + 1024 = 37888``.
    """
    kv = 2 * num_stages * block_n * block_d * elem_bytes
    q = block_m * block_d * elem_bytes
    p = block_m * block_n * elem_bytes
    return kv + q + p


def estimate_words(
    block_m: int, block_n: int, block_d: int, elem_bytes: int, shuffled: bool = False
) -> int:
    """32-bit words of live tile values per program: the accumulator, the scores, one K or V
    tile, and on SHUFFLE caches `SHUFFLE_ADDR_WORDS` a K/V element.

    Example: gfx950, head_dim 256, fp16, 64 x 32, SHUFFLE -> ``30720 > 24576``, so block_n 16.
    """
    words = block_m * block_d + block_m * block_n + block_n * block_d * elem_bytes // 4
    if shuffled:
        words += SHUFFLE_ADDR_WORDS * block_n * block_d
    return words


def estimate_registers(
    block_m: int,
    block_n: int,
    block_d: int,
    elem_bytes: int,
    num_warps: int,
    warp_size: int,
    shuffled: bool = False,
) -> int:
    """32-bit registers per thread for the big tiles, rounded up: `estimate_words` over
    ``num_warps * warp_size`` threads. Example: sm_90, head_dim 128, fp16, 64 x 64, 4 warps ->
    ``(8192 + 4096 + 4096) / 128 = 128 > 64``, so 8 warps (64)."""
    words = estimate_words(block_m, block_n, block_d, elem_bytes, shuffled)
    threads = num_warps * warp_size
    return -(-words // threads)


def _fma_dots(target: Target, elem_bytes: int) -> bool:
    """The kernel's dots compile to register-operand FMA loops: fp32 on NVIDIA."""
    return elem_bytes == 4 and not target.is_hip


def _num_warps(
    target: Target, block_m: int, block_n: int, block_d: int, elem_bytes: int, shuffled: bool
) -> int:
    if _fma_dots(target, elem_bytes):
        return FP32_NUM_WARPS
    smem_mma = target.arch in SMEM_MMA_ARCHS and block_m >= SMEM_MMA_MIN_ROWS
    shuffled = shuffled and elem_bytes in SHUFFLE_WARPS_ELEM_BYTES  # (16-bit: vector loads)
    for warps in NUM_WARPS:
        regs = estimate_registers(
            block_m, block_n, block_d, elem_bytes, warps, target.warp_size, shuffled
        )
        budget = MAX_REGS_4_WARPS_SMEM_MMA if smem_mma and warps == 4 else MAX_REGS_PER_THREAD
        if regs <= budget:
            return warps
    return NUM_WARPS[-1]


def _ladder(max_stages: int) -> list[tuple[int, int]]:
    """(block_n, num_stages) in preference order: wide tiles first, pipelined (>= 2) before not."""
    rungs = [(n, s) for n in BLOCK_N_LADDER for s in range(max_stages, 1, -1)]
    rungs += [(n, 1) for n in BLOCK_N_LADDER]
    return rungs


def _row_tile(block_m: int, group: int) -> RowTile:
    """``block_m`` rows as whole heads of one group (``head_tile``) times query tokens."""
    head_tile = min(group, block_m)
    return RowTile(block_m, block_m // head_tile, head_tile)


def split_count(target: Target, problem: PagedProblem, head_tile: int) -> int:
    """KV splits per sequence: pure in (target, num_seqs, heads, max_query_len, max_seq_len).

    1 unless this is a decode batch (``max_query_len == 1``) with a known ``max_seq_len`` whose
    ``num_seqs * num_kv_heads * ceil(group / head_tile)`` programs fill fewer than
    ``SPLIT_PROGRAMS_PER_SM * num_sms``. Then the smallest power of two that fills it, at most
    `MAX_SPLITS` and at most ``max_seq_len // MIN_SPLIT_TOKENS``.

    Example: sm_90 (132 SMs), batch 4 x 8 KV heads (32 programs), 16k context ->
    ``264 / 32 -> 16`` (the next power of two >= 8.25), cap ``16384 // 1024 = 16`` -> 16.
    """
    p = problem
    if p.max_query_len != 1 or p.max_seq_len is None:
        return 1
    programs = p.num_seqs * p.num_kv_heads * -(-p.group // head_tile)
    want = SPLIT_PROGRAMS_PER_SM * target.num_sms
    if programs <= 0 or programs >= want:
        return 1
    splits = 1
    while splits * programs < want and splits < MAX_SPLITS:
        splits *= 2
    while splits > 1 and splits * MIN_SPLIT_TOKENS > p.max_seq_len:
        splits //= 2
    return splits


def plan_max_seq_len(max_seq_len: int) -> int:
    """The one ``max_seq_len`` that stands for every length of its `MIN_SPLIT_TOKENS` band: the
    band's last. The policy reads ``max_seq_len`` only in `split_count`'s ``splits *
    MIN_SPLIT_TOKENS > max_seq_len``, so all lengths of a band plan alike, and a caller's plans
    keyed by this value are shared across a decode loop's growing contexts (0 stays 0)."""
    if max_seq_len <= 0:
        return max_seq_len
    return max_seq_len // MIN_SPLIT_TOKENS * MIN_SPLIT_TOKENS + MIN_SPLIT_TOKENS - 1


def _problem_errors(p: PagedProblem) -> list[str]:
    """What no policy can plan for: non-positive or non-int sizes, heads not divisible, a
    head_dim past `MAX_HEAD_DIM`, elements of neither 2 nor 4 bytes, flags that are not bools."""
    errors = []
    sizes = dict(num_q_heads=p.num_q_heads, num_kv_heads=p.num_kv_heads, head_dim=p.head_dim,
                 max_query_len=p.max_query_len, block_size=p.block_size)  # fmt: skip
    if p.max_seq_len is not None:
        sizes["max_seq_len"] = p.max_seq_len
    for name, v in sizes.items():
        if not is_int(v) or v < 1:
            errors.append(f"{name} must be an int >= 1{' or None' * (name == 'max_seq_len')}; "
                          f"got {v!r}")  # fmt: skip
    # 0: every KV head is one memory (a broadcast view), which the kernels read as it is
    if p.kv_head_stride is not None and (not is_int(p.kv_head_stride) or p.kv_head_stride < 0):
        errors.append(f"kv_head_stride must be an int >= 0 or None; got {p.kv_head_stride!r}")
    if not is_int(p.num_seqs) or p.num_seqs < 0:  # (an empty batch plans, and launches nothing)
        errors.append(f"num_seqs must be an int >= 0; got {p.num_seqs!r}")
    for name in ("shuffled", "query_rows_aligned", "out_rows_aligned"):
        if not isinstance(getattr(p, name), bool):
            errors.append(f"{name} must be a bool; got {getattr(p, name)!r}")
    if not errors and p.num_q_heads % p.num_kv_heads:
        errors.append(
            f"num_q_heads must be a positive multiple of num_kv_heads; got {p.num_q_heads} and "
            f"{p.num_kv_heads}"
        )
    if isinstance(p.head_dim, int) and p.head_dim > MAX_HEAD_DIM:
        errors.append(f"head_dim must be in [1, {MAX_HEAD_DIM}]; got {p.head_dim}")
    if p.elem_bytes not in (2, 4) or isinstance(p.elem_bytes, bool):
        errors.append(f"elem_bytes must be 2 or 4; got {p.elem_bytes!r}")
    return errors


def paged_tiles(target: Target, problem: PagedProblem) -> PagedTiles:
    """Choose the portable kernel's tiles for ``problem`` on ``target`` (pure; no device access).

    Rules:
      * ``block_d = max(16, next_pow2(head_dim))``; rows = ``max_query_len * group``.
      * >= 128 rows: the wide tile (128 x 64, 8 warps) where `_wide_fits` and not SHUFFLE; else
        ``block_m`` fits the rows in 16..64 (``head_tile = min(group, block_m)`` heads x
        ``block_q`` tokens; fp32 on NVIDIA: `FP32_BLOCK_M`).
      * ``(block_n, num_stages)``: the first rung of `_ladder` within shared memory and the words
        bound (`MAX_WORDS_8_WARPS`, fp32 on NVIDIA `FP32_MAX_WORDS`; block_n 16 always
        passes), ``block_m`` halved until one fits; warps by `_num_warps`.
      * sm_90, 16-bit NHD, a 64-row tile at 8 warps and >= 128 rows: `_warpgroup_rows`' 128 x 32
        tile, bounded by shared memory only (at head_dim 129-256 the words model says 160
        registers a thread against 96; it compiles to 243-250 without a spill, which
        tests/compile holds it to).
      * SHUFFLE decode tiles read in cache order take at most `SHUFFLE_NARROW_BLOCK_N` tokens,
        or at head_dim 128 NHD's tile under `SHUFFLE_REG_CAP`, or at head_dim 64 NHD's tile.
      * ``decode``: a ``max_query_len == 1`` problem's row tile where it differs and is exceeded;
        ``num_splits`` from `split_count`.

    Raises:
        ValueError: a problem the kernel cannot serve (head_dim > 256, heads not divisible,
            non-positive sizes), or (never for head_dim <= 256 on a known target) no tile fits.
    """
    errors = _problem_errors(problem)
    if errors:
        raise ValueError("paged_tiles: " + "; ".join(errors))
    p = problem
    block_d = max(MIN_DOT_DIM, next_pow2(p.head_dim))
    tiles = _main_tiles(target, p, block_d)
    if p.max_query_len > 1:
        dec_m = _block_m(target, p.group, block_d, p.elem_bytes, tiles.block_m, p.shuffled)
        dec = _row_tile(dec_m, p.group)
        main = RowTile(tiles.block_m, tiles.block_q, tiles.head_tile)
        if dec != main and p.max_query_len > dec.block_q:
            tiles = replace(tiles, decode=dec)
    splits = split_count(target, p, tiles.head_tile)
    return replace(tiles, num_splits=splits) if splits > 1 else tiles


def _block_m(
    target: Target, rows: int, block_d: int, elem_bytes: int, cap: int, shuffled: bool
) -> int:
    """The M tile for ``rows`` rows of work before the budget: wide, or 16..64 (<= ``cap``);
    `FP32_BLOCK_M` for FMA dots."""
    min_m = max(MIN_DOT_DIM, target.mma_min_rows)
    if _fma_dots(target, elem_bytes):
        return max(min_m, FP32_BLOCK_M)
    wide = not shuffled and _wide_fits(target, block_d, elem_bytes)
    if rows >= WIDE_BLOCK_M and cap >= WIDE_BLOCK_M and wide:
        return WIDE_BLOCK_M
    return min(MAX_BLOCK_M, cap, max(min_m, next_pow2(rows)))


def _wide_fits(target: Target, block_d: int, elem_bytes: int) -> bool:
    smem = estimate_shared_mem(WIDE_BLOCK_M, WIDE_BLOCK_N, block_d, elem_bytes, 2)
    regs = estimate_registers(WIDE_BLOCK_M, WIDE_BLOCK_N, block_d, elem_bytes, 8, target.warp_size)
    return (
        target.arch in WIDE_TILE_ARCHS
        and target.max_num_stages >= 2
        and smem <= target.max_shared_mem
        and regs <= WIDE_MAX_REGS
    )


def _main_tiles(target: Target, p: PagedProblem, block_d: int) -> PagedTiles:
    rows = p.max_query_len * p.group
    block_m = _block_m(target, rows, block_d, p.elem_bytes, WIDE_BLOCK_M, p.shuffled)
    max_stages = max(1, min(PREFERRED_STAGES, target.max_num_stages))
    max_words = FP32_MAX_WORDS if _fma_dots(target, p.elem_bytes) else MAX_WORDS_8_WARPS
    narrow = (
        p.shuffled
        and block_m <= SHUFFLE_NARROW_MAX_M
        and cache_order_reads(
            target.arch, p.head_dim, block_d, SHUFFLE_NARROW_BLOCK_N, p.elem_bytes
        )
    )
    # cache-order reads of NHD's 64-token tile: as it is at head_dim 64, under a cap at 128
    if (
        narrow
        and block_d in SHUFFLE_FULL_BLOCK_D + SHUFFLE_REG_CAP_BLOCK_D
        and cache_order_reads(
            target.arch, p.head_dim, block_d, SHUFFLE_REG_CAP_BLOCK_N, p.elem_bytes
        )
    ):
        nhd = _ladder_tiles(target, p, block_m, block_d, max_stages, max_words, False)
        if block_d in SHUFFLE_FULL_BLOCK_D and nhd.block_n <= SHUFFLE_REG_CAP_BLOCK_N:
            return nhd
        if (
            block_d in SHUFFLE_REG_CAP_BLOCK_D
            and nhd.block_n == SHUFFLE_REG_CAP_BLOCK_N
            and nhd.num_warps == SHUFFLE_REG_CAP_WARPS
        ):
            opts = nhd.options
            capped = launch_options(target, opts.num_warps, opts.num_stages, SHUFFLE_REG_CAP)
            return replace(nhd, options=capped)
    tiles = _ladder_tiles(target, p, block_m, block_d, max_stages, max_words, narrow)
    return _warpgroup_rows(target, p, rows, tiles) or tiles


def _warpgroup_rows(
    target: Target, p: PagedProblem, rows: int, tiles: PagedTiles
) -> PagedTiles | None:
    """sm_90's 128-row 8-warp tile in place of a 64-row one at 8 warps (`SMEM_MMA_8_WARP_ROWS`):
    16-bit NHD caches with at least 128 rows of work, where its shared memory fits."""
    if not (
        target.arch in SMEM_MMA_ARCHS
        and not p.shuffled
        and not _fma_dots(target, p.elem_bytes)
        and tiles.block_m == SMEM_MMA_MIN_ROWS
        and tiles.num_warps == 8
        and rows >= SMEM_MMA_8_WARP_ROWS
    ):
        return None
    m, n, stages = SMEM_MMA_8_WARP_ROWS, SMEM_MMA_8_WARP_BLOCK_N, tiles.options.num_stages
    smem = estimate_shared_mem(m, n, tiles.block_d, p.elem_bytes, stages)
    if smem > target.max_shared_mem:
        return None
    row_tile = _row_tile(m, p.group)
    return replace(
        tiles,
        block_m=m,
        block_q=row_tile.block_q,
        head_tile=row_tile.head_tile,
        block_n=n,
        shared_mem_bytes=smem,
    )


def _ladder_tiles(
    target: Target,
    p: PagedProblem,
    block_m: int,
    block_d: int,
    max_stages: int,
    max_words: int,
    narrow: bool,
) -> PagedTiles:
    """The first (KV tile, stages) of the ladder that fits at ``block_m`` rows (halved until one
    does); ``narrow``: KV tiles of at most `SHUFFLE_NARROW_BLOCK_N` tokens."""
    min_m = max(MIN_DOT_DIM, target.mma_min_rows)
    while True:
        ladder = _ladder(max_stages)
        if narrow:
            ladder = [(n, s) for n, s in ladder if n <= SHUFFLE_NARROW_BLOCK_N]
        if block_m == WIDE_BLOCK_M:  # the wide tile is 128 x 64, pipelined (see _wide_fits)
            ladder = [(n, s) for n, s in ladder if n == WIDE_BLOCK_N and s >= 2]
        for block_n, stages in ladder:
            smem = estimate_shared_mem(block_m, block_n, block_d, p.elem_bytes, stages)
            words = estimate_words(block_m, block_n, block_d, p.elem_bytes, p.shuffled)
            fits_regs = block_m == WIDE_BLOCK_M or words <= max_words or block_n == 16
            if smem <= target.max_shared_mem and fits_regs:
                row_tile = _row_tile(block_m, p.group)
                warps = _num_warps(target, block_m, block_n, block_d, p.elem_bytes, p.shuffled)
                return PagedTiles(
                    block_m=block_m,
                    block_q=row_tile.block_q,
                    head_tile=row_tile.head_tile,
                    block_n=block_n,
                    block_d=block_d,
                    options=launch_options(target, warps, stages),
                    shared_mem_bytes=smem,
                )
        if block_m <= min_m:
            raise ValueError(
                f"paged_tiles: no tile fits {target.arch}'s {target.max_shared_mem} B of shared "
                f"memory for head_dim {p.head_dim}, {p.elem_bytes}-byte elements"
            )
        block_m //= 2


def shuffle_lines_tile(block_d: int, block_n: int, x: int) -> bool:
    """Whether the cache-order reads were checked right on a GPU for a ``block_d x block_n`` tile
    of a SHUFFLE cache with ``x``-element runs (`SHUFFLE_LINES_MAX_N`)."""
    return block_n <= SHUFFLE_LINES_MAX_N.get(block_d // x, 0)


def shuffle_lines(compile_arch: str) -> bool:
    """Whether a SHUFFLE launch compiled for ``compile_arch`` (the compiler's arch, not the
    forced policy's: `portattn.platform.compile_arch`) reads K and V in the cache's order."""
    return compile_arch in SHUFFLE_LINES_ARCHS


def cache_order_reads(
    compile_arch: str, head_dim: int, block_d: int, block_n: int, elem_bytes: int
) -> bool:
    """Whether a 16-bit SHUFFLE launch of these tiles reads K and V in the cache's order: the
    one rule the policy and the launcher use; the launcher adds what only tensors tell (16-byte
    aligned runs)."""
    return (
        shuffle_lines(compile_arch)
        and elem_bytes == 2
        and head_dim == block_d
        and shuffle_lines_tile(block_d, block_n, 16 // elem_bytes)
    )


# -- the sm_90 prefill kernel's configuration -------------------------------------------------


def paged_config(target: Target, problem: PagedProblem) -> PagedConfig:
    """The kernel choices for ``problem`` on ``target``: `prefill_config`'s where `sm90_prefill`
    takes the batch, else the portable kernel for every sequence."""
    errors = _problem_errors(problem)
    if errors:
        raise ValueError("paged_config: " + "; ".join(errors))
    if not sm90_prefill(target, problem):
        return PagedConfig()
    return PagedConfig(prefill=prefill_config(target, problem))


def sm90_prefill(target: Target, problem: PagedProblem) -> bool:
    """Whether the prefill part of ``problem`` runs on the sm_90 kernel: 16-bit NHD caches, a
    head_dim of `SM90_PREFILL_TILES`, pages a multiple of `SM90_PREFILL_MIN_BOX` and one full
    128-row tile of work (the launcher adds what only the tensors tell)."""
    p = problem
    return (
        target.arch == "sm_90"
        and p.elem_bytes == 2
        and not p.shuffled
        and p.head_dim in SM90_PREFILL_TILES
        and p.block_size % SM90_PREFILL_MIN_BOX == 0
        and p.max_query_len * p.group >= SM90_PREFILL_MIN_ROWS
    )


def prefill_config(target: Target, problem: PagedProblem) -> PrefillConfig:
    """The sm_90 kernel's configuration for ``problem``: the head_dim's tile (turns, and
    head_dim 64's third warpgroup, only with the query by TMA), ``box`` and ``paging`` from the
    page size, the late release and V by page boxes at the box counts of their constants, where
    they fit.

    Raises:
        ValueError: a problem `sm90_prefill` does not give the sm_90 kernel.
    """
    p = problem
    errors = _problem_errors(p)
    if errors or not sm90_prefill(target, p):
        why = "; ".join(errors) or (
            f"sm90_prefill must take the problem (sm_90, 16-bit NHD, head_dim in "
            f"{tuple(SM90_PREFILL_TILES)}, pages a multiple of {SM90_PREFILL_MIN_BOX}, >= "
            f"{SM90_PREFILL_MIN_ROWS} rows of work); got {target.arch}, {p.elem_bytes}-byte, "
            f"shuffled {p.shuffled}, head_dim {p.head_dim}, block_size {p.block_size}, "
            f"{p.max_query_len * p.group} rows"
        )
        raise ValueError("prefill_config: " + why)
    tile = SM90_PREFILL_TILES[p.head_dim]
    stages, turns, block_n = tile.stages, tile.turns, tile.block_n
    warpgroups, regs = tile.warpgroups, tile.regs
    by_tma = query_by_tma_fits(p)
    if turns and not by_tma:
        stages, turns, block_n = tile.no_tma_stages, False, tile.no_tma_block_n
        warpgroups, regs = 2, tile.no_tma_regs
    box = box_rows(p.block_size, block_n)
    cfg = PrefillConfig(
        block_n=block_n,
        stages=stages,
        warpgroups=warpgroups,
        turns=turns,
        query_by_tma=turns and by_tma,
        out_by_tma=out_by_tma_fits(p),
        box=box,
        paging=paging_mode(p.block_size, box, block_n),
        consumer_regs=regs[0],
        producer_regs=regs[1],
        quad_sums=tile.quad_sums,
        lazy_max=tile.lazy_max,
        split_release=tile.split_release and turns,
    )
    late = replace(cfg, stages=3, late_release=True)
    if (
        cfg.boxes in SM90_PREFILL_LATE_RELEASE_BOXES
        and stages == 2
        and not turns
        and prefill_smem_bytes(late, p.head_dim, p.elem_bytes) <= target.max_shared_mem
    ):
        cfg = late
    if cfg.boxes >= SM90_PREFILL_V_PAGES_MIN_BOXES and v_pages_fit(p, cfg):
        cfg = replace(cfg, v_pages=True)
    return cfg


def box_rows(block_size: int, block_n: int) -> int:
    """Rows per TMA box: the largest power of two dividing ``block_size``, at most ``block_n``
    (a box never crosses a page)."""
    return min(block_n, block_size & -block_size)


def paging_mode(block_size: int, box: int, block_n: int) -> int:
    """The cheapest way the producer finds a tile's pages (`PrefillConfig.paging`): 1 where a box
    is a whole page, 2 where a page holds a tile or more, else 0 (a division a box)."""
    if box == block_size:
        return 1
    return 2 if block_size >= block_n else 0


def query_by_tma_fits(problem: PagedProblem) -> bool:
    """Whether TMA can load a warpgroup's 64 query rows as one box: aligned rows, whole
    64-column groups (the 128-byte swizzle's), 64 rows of whole tokens of the head tile."""
    return problem.query_rows_aligned and _box_of_rows(problem)


def out_by_tma_fits(problem: PagedProblem) -> bool:
    """Whether TMA can store a warpgroup's 64 output rows as one box (as `query_by_tma_fits`
    loads the query's)."""
    return problem.out_rows_aligned and _box_of_rows(problem)


def _box_of_rows(problem: PagedProblem) -> bool:
    """A warpgroup's 64 rows of ``[tokens, heads, head_dim]`` as one TMA box: whole 64-column
    groups (the 128-byte swizzle's), 64 rows of whole tokens of the head tile."""
    # an item's head tile is the whole group up to its 128 or 192 rows: 64 rows hold whole
    # tokens of it where the group divides 64
    return problem.head_dim % 64 == 0 and 64 % problem.group == 0


def v_pages_fit(problem: PagedProblem, cfg: PrefillConfig) -> bool:
    """Whether V tiles can arrive a page box a copy: 2, 4 or 8 boxes a tile (boxes of 16 rows at
    least), head_dim a power-of-two count of 64-column groups above one, KV heads a multiple of
    64 columns apart."""
    d = problem.head_dim
    stride = problem.kv_head_stride if problem.kv_head_stride is not None else d
    groups = d // 64
    return (
        cfg.boxes in (2, 4, 8)
        and d > 64
        and d % 64 == 0
        and groups & (groups - 1) == 0
        and stride % 64 == 0
    )


def prefill_smem_bytes(cfg: PrefillConfig, head_dim: int, elem: int = 2) -> int:
    """Shared memory the sm_90 kernel allocates, an upper bound: Q (64 rows a warpgroup), the K
    and V stages, the barriers (3 a stage: K and V landed, the stage freed, and a fourth with
    split_release: V freed apart; 3 a warpgroup: its turn and its query's two), the item ring
    (its words and a barrier a slot) and 1 KB for Triton's alignment."""
    q = cfg.warpgroups * 64 * head_dim * elem
    kv = 2 * cfg.stages * cfg.block_n * head_dim * elem
    ring = (cfg.stages + SM90_PREFILL_RING_EXTRA) * (SM90_PREFILL_RING_WORDS * 4 + 8)
    bars = (4 if cfg.split_release else 3) * cfg.stages + 3 * cfg.warpgroups
    return q + kv + bars * 8 + ring + 1024


def prefill_config_errors(target: Target, problem: PagedProblem, cfg: PrefillConfig) -> list[str]:
    """Why ``cfg`` cannot run ``problem`` on ``target`` (empty: it can), one rule a reason."""
    p = problem
    # the rules that divide by the box are read only for a box that passes its own rule
    box_ok = cfg.box >= SM90_PREFILL_MIN_BOX and cfg.box & (cfg.box - 1) == 0
    rules = [
        (target.arch == "sm_90", f"needs an sm_90 target; got {target.arch}"),
        (p.elem_bytes == 2, f"needs fp16/bf16; got {p.elem_bytes}-byte elements"),
        (not p.shuffled, "needs an NHD cache; got SHUFFLE"),
        (
            p.head_dim in SM90_PREFILL_TILES,
            f"needs head_dim in {tuple(SM90_PREFILL_TILES)}; got {p.head_dim}",
        ),
        (cfg.block_n in (32, 64, 128), f"block_n must be 32, 64 or 128; got {cfg.block_n}"),
        (2 <= cfg.stages <= 4, f"stages must be in [2, 4]; got {cfg.stages}"),
        (cfg.warpgroups in (2, 3), f"warpgroups must be 2 or 3; got {cfg.warpgroups}"),
        (
            not cfg.turns or cfg.stages >= 3 or cfg.split_release,
            f"turns need stages >= 3 or split_release; got stages {cfg.stages}",
        ),
        (not cfg.query_by_tma or cfg.turns, "query_by_tma needs turns"),
        (
            not cfg.query_by_tma or query_by_tma_fits(p),
            "query_by_tma needs 16-byte aligned query rows, head_dim a multiple of 64 and "
            f"64 rows of whole tokens (group {p.group})",
        ),
        (
            not cfg.out_by_tma or out_by_tma_fits(p),
            "out_by_tma needs 16-byte aligned output rows, head_dim a multiple of 64 and "
            f"64 rows of whole tokens (group {p.group})",
        ),
        (
            not cfg.late_release or (cfg.stages >= 3 and not cfg.turns),
            f"late_release needs stages >= 3 and no turns; got stages {cfg.stages}, turns "
            f"{cfg.turns}",
        ),
        (box_ok, f"box must be a power of two >= {SM90_PREFILL_MIN_BOX}; got {cfg.box}"),
        (
            not box_ok or (p.block_size % cfg.box == 0 and cfg.block_n % cfg.box == 0),
            f"box {cfg.box} must divide block_size {p.block_size} and block_n {cfg.block_n}",
        ),
        (not cfg.v_pages or not box_ok or v_pages_fit(p, cfg), _V_PAGES_RULE),
        (cfg.paging in (0, 1, 2), f"paging must be 0, 1 or 2; got {cfg.paging}"),
        (cfg.paging != 1 or cfg.box == p.block_size, "paging 1 needs box == block_size"),
        (cfg.paging != 2 or p.block_size >= cfg.block_n, "paging 2 needs block_size >= block_n"),
    ]
    for name in ("consumer_regs", "producer_regs"):
        regs = getattr(cfg, name)
        rules.append(
            (24 <= regs <= 256 and regs % 8 == 0, f"{name} must be a multiple of 8 in [24, 256]")
        )
    # warpgroup 0 takes what the workers leave (at least as many as they): the producer's
    # warpgroup and the consumers' 128 threads each within 64 K registers
    regs = 128 * (cfg.warpgroups * cfg.consumer_regs + cfg.producer_regs)
    rules.append(
        (
            regs <= SM90_REGISTERS,
            f"{cfg.warpgroups} consumer warpgroups at consumer_regs {cfg.consumer_regs} and the "
            f"producer's at producer_regs {cfg.producer_regs} need {regs} registers > "
            f"{SM90_REGISTERS}",
        )
    )
    smem = prefill_smem_bytes(cfg, p.head_dim, p.elem_bytes)
    rules.append(
        (smem <= target.max_shared_mem, f"shared memory {smem} B > {target.max_shared_mem}")
    )
    return [why for ok, why in rules if not ok]


_V_PAGES_RULE = (
    "v_pages needs 2, 4 or 8 boxes a tile, head_dim a power-of-two multiple of 64 above 64 and KV "
    "heads a multiple of 64 columns apart"
)
