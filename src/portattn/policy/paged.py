"""Tile policy for `portattn.kernels.paged_attention`: ``paged_tiles(target, problem)``.

The paged-attention kernel runs one program per (query tile of a sequence, q-head tile of one KV
head, sequence[, KV split]). Its M dimension packs ``block_q`` query tokens x ``head_tile`` query
heads that share one KV head (GQA/MQA), so a decode step with 4 or 8 heads per KV head still gives
``tl.dot`` its 16 rows. Its N dimension is ``block_n`` context tokens, gathered through the block
table one token at a time (block and in-block offset addressed separately): **the KV tile never
depends on the cache's ``block_size``** (upstream lesson 3: a tile taken from block_size 2048 asks
for 262144 B of LDS on a 65536 B MI300-class part).

Two row tiles in one launch (mixed batches). A tile sized for the longest query (a 512-token
prefill chunk: 64 or 128 rows) would make every decode sequence of the same batch run 16-32x the
matrix work it needs (4 useful rows of 64). When ``max_query_len`` exceeds what one decode tile
holds, the policy adds a ``decode`` row tile: sequences with ``q_len <= decode.block_q`` are served
by decode-sized programs, the others by the prefill-sized ones, in one launch (prefill programs
first, so the long programs start first and the short decode programs fill the tail). The two row
tiles share ``block_n``, the pipeline depth and ``num_warps``; the decode tile has fewer rows, so
its shared memory is below the prefill tile's and the budget is the prefill tile's.

Wide prefill tiles: with >= 128 rows of work (a prefill chunk, or MQA with 128 heads) the M tile
is 128 (flash-attention's 128 x 64 x 8 warps) where the target's shared memory holds it at
``block_n`` 64 with >= 2 stages and the 8-warp register estimate is <= `WIDE_MAX_REGS`; halves the
K/V traffic per FLOP of the 64-row tile. Only on `WIDE_TILE_ARCHS` (sm_100: its MMA reads Q and
P from shared memory), at head_dim <= 128 in 16-bit; elsewhere the compile matrix shows the 128-row
tile spilling. sm_90 left it: on an H100 (bench/sweep_paged.py, RESULTS.md 2026-11-22) the 64-row
tile at 4 warps beat it on every prefill-carrying point (mixed 512@8k + 63x4k: 633.9 vs 812.9 us
at block 16, 611.1 vs 760.9 at block 2048; pure prefill 4 x 2048@8k: 3373.9 vs 3791.1 us).

Split-KV (decode only): when ``num_seqs * num_kv_heads * head tiles`` programs cannot fill the
GPU (`Target.num_sms`) and the context is long, each sequence's context is cut into
``num_splits`` ranges whose partial results a second (reduce) launch combines. ``num_splits`` is a
pure function of (target, num_seqs, heads, max_seq_len) -- `split_count`; the caller passes
``max_seq_len`` (serving engines know it), so the grid is fixed without reading the device.

Shared-memory budget (`estimate_shared_mem`, bytes, ``e`` = element size of Q/K/V):

    K and V tiles, one buffer each per pipeline stage:  2 * num_stages * block_n * block_d * e
    Q tile (dot operand, staged once):                  block_m * block_d * e
    P tile (softmax probabilities, the second dot's A): block_m * block_n * e

Register budget (`estimate_registers`, 32-bit registers per thread): the fp32 accumulator
(``block_m * block_d``), the fp32 scores (``block_m * block_n``) and one K or V tile
(``block_n * block_d * e / 4``) spread over ``num_warps * warp_size`` threads. 4 warps when that is
<= 64 (what is left of the 255/256-register file holds Q, pointers and the softmax state), else 8.
The threshold is the compile matrix's finding: 4-warp tiles estimated at 68 compile without
spills, at 76 (gfx942) and 104-128 (sm_86/sm_90 16-row tiles) they spill; at 8 warps those do
not. Exception, `SMEM_MMA_ARCHS` (sm_90): a tile of >= 64 rows at 4 warps is one warpgroup whose
MMA (wgmma) reads K, V and P from shared memory, so its 4-warp budget is `MAX_REGS_4_WARPS_SMEM_MMA`
(128): sm_90 compiles of head_dim 128 bf16 GQA 4:1 64 x 64 (estimate 128) and 64 x 32 (96) use 218
and 152 registers without spills, and measured 1.5x faster than at 8 warps on an H100 (mixed
batch: 633.9 vs 1034.5 us; 629.2 vs 930.9 us at block_n 32). Past
`MAX_REGS_8_WARPS` at 8 warps (head_dim 256, block_n 64: 112) the ladder moves to a narrower
``block_n`` (the wide tile has its own bound, `WIDE_MAX_REGS`). That 8-warp bound is a budget of
words per program (`MAX_WORDS_8_WARPS`, 96 x 8 x 32): a 64-lane wavefront spreads the tiles over
twice the threads but does not hold twice the live values (gfx950, below).

fp32 on NVIDIA (`FP32_BLOCK_M`): the dots run in exact fp32 (``input_precision="ieee"``), which
compiles to FMA loops with both operands in registers, not to MMA, so the model above does not
hold there; under it 77 of the 108 fp32 cells of the compile matrix on sm_80 .. sm_120 spilled
past the gate's 16 B (up to 37008 B: head_dim 128 prefill, 64 x 64 x 8 warps on sm_100). Such
tiles take 16 rows and 8 warps, and the longest ``block_n`` whose `estimate_words` is <=
`FP32_MAX_WORDS` (40 words per thread; block_n 16 always passes). The compile matrix measured
those without spills for every fp32 case on every NVIDIA target but one, where ptxas parks 8 B
(sm_86/sm_89, head_dim 128 NHD, 48 registers; inside the gate's 16 B); numbers at the
constants. AMD keeps the model above: MFMA has fp32 instructions and its fp32 cells compile
without spills.

SHUFFLE caches (``PagedProblem.shuffled``). Since issue 18 the kernel addresses a SHUFFLE cache
as it does NHD: a token term plus a dim term, each on its own vector, with the x-element runs
(16 bytes) stated aligned, so K and V load as 16-byte vectors through the same pipelined path
(sm_90 decode, before the cache-order reads below: 64 ``cp.async`` of 16 B, no 16-bit loads,
110 registers against NHD's 123). In 16-bit a SHUFFLE cache therefore takes NHD's warp count;
on sm_90 its decode tiles, read in the cache's order (`SHUFFLE_LINES`), keep NHD's 64 tokens
under a 128-register cap at head_dim 128 (`SHUFFLE_REG_CAP`) and take 32 tokens at the other
head dims (`SHUFFLE_LINES_NARROW`). `SHUFFLE_ADDR_WORDS` (1 word per
gathered K/V element, the old per-element offsets) still counts in the per-program words bound
(`MAX_WORDS_8_WARPS`), which halves block_n at head_dim 256 only: at NHD's 16 x 64 decode tile,
8 warps, ptxas parks 16-28 B at 128 registers on sm_80-sm_100 (NHD uses 155 there); prefill
keeps its former 64 x 16 (64 x 32 compiled clean in 16-bit too: headroom not taken yet). fp32
on AMD keeps the term in the warp count too (`SHUFFLE_WARPS_ELEM_BYTES`); fp32 on NVIDIA takes
`FP32_NUM_WARPS` (above).
SHUFFLE never takes the wide tile (`_wide_fits`).
Before issue 18 the term was in every estimate, and without it the compile matrix spilled on
SHUFFLE only (per-element offsets): gfx950 head_dim 128 prefill (64 x 64, 4 warps: 87-91 VGPRs),
head_dim 256 decode (16 x 64, 4 warps: 174-176); sm_90/sm_100 head_dim 128 MHA decode (16 x 64,
4 warps: 20 B); sm_80 head_dim 256 GQA 5:1 prefill (64 x 32, 8 warps: 32 B).

The policy walks a preference ladder (largest ``block_n`` first, then deeper pipelines, then smaller
``block_m``) and takes the first rung whose estimate fits ``target.max_shared_mem``. The last rung,
16 x 16 x 256 in fp32 with one stage, needs 50176 B, so every target (smallest: 65536 B) is served.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from portattn.platform import Target
from portattn.policy.common import LaunchOptions, launch_options, next_pow2

MAX_HEAD_DIM = 256
# The fewest rows/columns a tl.dot operand may have (every backend).
MIN_DOT_DIM = 16
# Largest M tile of the narrow ladder: 64 rows = 4 warps x 16 mma rows on NVIDIA; a 64-row tile is
# also what AMD's MFMA 16x16 / 32x32 instructions fill with 4 wavefronts.
MAX_BLOCK_M = 64
# The wide prefill tile (flash-attention's forward tile): 128 rows x 64 context tokens, 8 warps.
WIDE_BLOCK_M = 128
WIDE_BLOCK_N = 64
# Targets whose matrix instructions read the A operand (Q, then P) from shared memory: Hopper's
# wgmma and Blackwell's tcgen05. On mma.sync (sm_80-sm_89, sm_120) and MFMA parts the 128-row Q
# operand sits in registers next to the accumulators and the compile matrix shows spills (sm_80
# hd128 GQA: 128 rows x 8 warps spilled; gfx950 likewise), so they keep <= 64 rows.
WIDE_TILE_ARCHS = ("sm_100",)
# 8-warp register estimate up to which the wide tile is taken: 112 is head_dim 128 in 16-bit
# ((128*128 + 128*64 + 64*128*2/4) / 256); head_dim 256 (192) or fp32 at 128 (128) stay at 64 rows.
WIDE_MAX_REGS = 112
# SHUFFLE caches never take it: with their address words (`SHUFFLE_ADDR_WORDS`) sm_100 hd64 GQA 8:1
# spilled 24 B at 128 x 64 x 8 warps (estimate 80) while 64 x 64 x 8 warps compiles at 101 regs,
# 0 B; the wide tile was measured (H200) on NHD only.
# Context-token tiles tried, largest first. 64 keeps the two dots square-ish at head_dim 64-128;
# 16 is the floor of tl.dot's K dimension (the P @ V dot reduces over block_n).
BLOCK_N_LADDER = (64, 32, 16)
# Pipelining depth asked for before the target caps it (HIP targets cap at 2). Measured on an
# H200 (bench/sweep_paged.py, bench/RESULTS.md 2026-11-22): decode 64x4k, M16 N64 w4: 2 stages
# 249.6 us, 3 stages 348.3 us; mixed batch, wide tile: N128 w8 s2 652 us, N64 w8 s3 794 us. The
# wide tile at 4 warps measured 645 us but spills 240-1100 B in the compile matrix, so it keeps 8.
PREFERRED_STAGES = 2
# Warps per program: the smaller count unless the register budget needs the larger.
NUM_WARPS = (4, 8)
MAX_REGS_PER_THREAD = 64
# Targets whose >= 64-row, 4-warp tiles use warpgroup MMA with shared-memory operands, and the
# 4-warp estimate they may reach (module docstring).
SMEM_MMA_ARCHS = ("sm_90",)
SMEM_MMA_MIN_ROWS = 64
MAX_REGS_4_WARPS_SMEM_MMA = 128
# The 8-warp estimate a (non-wide) tile may reach: 64-row tiles at head_dim 256 with block_n 64
# (112) spilled 76-644 B on sm_90 in the compile matrix; block_n 32 (88) does not.
MAX_REGS_8_WARPS = 96
# The same bound in words per program (96 x 8 warps x 32 lanes = 24576), what the ladder checks so
# that 64-lane wavefronts get the budget NVIDIA measured, not twice it: gfx950 head_dim 256
# SHUFFLE prefill at 64 x 32 (30720 words, 60 per thread of 512) spilled 20-27 VGPRs at 8 warps;
# 64 x 16 (27648 words; block_n 16 is always allowed) compiles at 177 VGPRs, no spills. The NHD
# choices of the compile matrix are unchanged (gfx950 head_dim 256 NHD, 64 x 32: 22528 words).
MAX_WORDS_8_WARPS = MAX_REGS_8_WARPS * 8 * 32
# Extra words per gathered K/V element on SHUFFLE caches (module docstring). Before issue 18
# they were its per-element in-block offset (the token/dim div-mod split) and mask, counted in
# every estimate (Triton 3.6, spills before -> after the term: sm_90/sm_100 hd128 MHA decode
# 16 x 64, 4 warps 20 B -> 8 warps 0 B; gfx950 hd256 decode 16 x 64: 4 warps 174-176 VGPRs ->
# 16 x 32, 0; gfx950 hd256 prefill 64 x 32: 8 warps 20-27 VGPRs -> 64 x 16, 0). Since, the loads
# are vectors and the term bounds only the words per program (block_n), and the warp count of
# the element sizes in SHUFFLE_WARPS_ELEM_BYTES: 16-bit SHUFFLE compiles at NHD's warp count
# with no spills over the gate's 16 B (compile matrix, 567 SHUFFLE cells), fp32 keeps its tiles.
SHUFFLE_ADDR_WORDS = 1
# 4-byte (fp32) elements on NVIDIA (`_fma_dots`): the kernel's dots run in exact fp32
# (``input_precision="ieee"``), which no NVIDIA tensor core does, so both dots compile to FMA
# loops whose operands are held in registers, and the 16-bit model above (MMA operands read from
# shared memory) does not hold: with it 77 of the 108 fp32 paged cells of the compile matrix on
# sm_80 .. sm_120 spilled past the gate's 16 B (Triton 3.6, GQA 5:1; worst per case: hd128 NHD
# prefill 64 x 64 x 8 warps 37008 B (sm_100; sm_90 36032 B at 32 registers), hd256 NHD prefill
# 64 x 16 x 8 warps 23420 B (sm_90), hd64 SHUFFLE prefill 64 x 64 x 4 warps 21128 B (sm_90), hd128
# SHUFFLE decode 16 x 64 x 8 warps 5744 B (sm_90)). AMD keeps the model above: MFMA has fp32
# instructions, and its fp32 cells compile without spills.
# So fp32 on NVIDIA takes 16 rows (prefill included: no row tile above 16 compiles clean for
# every head dim; at 8 warps, 2 stages, sm_90: hd128 NHD 32 x 16 spills 32 B, 32 x 32 768 B;
# hd256 NHD 32 x 32 25320 B; hd64 SHUFFLE 32 x 32 40 B; hd128 SHUFFLE 64 x 16 604 B), 8 warps,
# and the longest ``block_n`` whose `estimate_words` is <= `FP32_MAX_WORDS` (block_n 16 always
# passes). Compiled with Triton 3.6 on a CPU, GQA 5:1, prefill and decode, at 16 rows, 8 warps,
# 2 stages (registers, spill bytes on sm_80 / sm_86 / sm_89 / sm_90 / sm_100 / sm_120):
#   hd64 NHD     16 x 64 ( 6144 words): 52/46/46/90/40/92 registers, no spills
#   hd64 SHUFFLE 16 x 64 (10240):      122/123/123/127/127/125, no spills
#   hd128 NHD    16 x 32 ( 6656):       60/48/48/62/62/62, 0/8/8/0/0/0 B (sm_86/sm_89: ptxas
#                stops at 48 registers and parks two words; 16 x 16 does the same, 4 B; inside
#                the gate's 16 B threshold); 16 x 64 (11264, past the budget; on the 99 KB
#                parts past their shared memory too) 95/-/-/95/96/91, no spills
#   hd128 SHUFFLE 16 x 16 ( 6400):     155/162/162/155/156/155, none; 16 x 32 (10752): 72-112 B
#                on every target
#   hd256 NHD    16 x 16 ( 8448):       80/80/80/79/75/78, none; 16 x 32 (12800): sm_100 28 B
#   hd256 SHUFFLE 16 x 16 (12544):     228/185/185/225/204/209, none; 16 x 32 (20992): 164-276 B
# 4 warps are no better (hd64 NHD 16 x 64: 8-12 B on sm_90/sm_100/sm_120; hd256 SHUFFLE 16 x 16:
# 96-184 B on sm_80/sm_86/sm_90/sm_100/sm_120). The cap is the hd128 SHUFFLE 16 x 32 step: the
# budget must stop below its 10752 words; hd64 SHUFFLE 16 x 64 (10240) is the largest tile under it.
FP32_BLOCK_M = 16
FP32_NUM_WARPS = 8
FP32_MAX_WORDS = 40 * FP32_NUM_WARPS * 32
SHUFFLE_WARPS_ELEM_BYTES = (4,)
# Split-KV: the fewest context tokens one split walks (shorter splits cost more in the reduce and
# in per-program set-up than they win in parallelism), the most splits, and how many programs per
# multiprocessor a split grid aims for (2: one program's gathers overlap the other's math).
MIN_SPLIT_TOKENS = 1024
MAX_SPLITS = 16
SPLIT_PROGRAMS_PER_SM = 2

#: SHUFFLE caches (16-bit, head_dim == BLOCK_D, 16-byte aligned runs): K and V tiles are read in
#: the cache's own order, [runs, tokens * x] and [runs, head_dim * x], so that a warp's 16-byte
#: copies cover whole 128-byte lines (issue 18: the [BLOCK_D, BLOCK_N] tile put a warp's threads
#: across the runs of two tokens, one 32-byte sector per line: 6.8x NHD's L2 requests for the
#: same bytes, L2-bound at 93%, SHUFFLE 1.5x NHD; bench/NOTES.md). Read at planning.
SHUFFLE_LINES = True
#: The compilers that build those reads well, and right: sm_90 only. Triton 3.6's AMD backend
#: scalarizes their K loads (72 16-bit loads in the gfx942 decode tile), and on sm_86 / sm_89
#: ptxas spills 24 B at 128 registers (hd128 MHA decode; sm_80 8 B), where the old reads spill
#: none (compile matrix). sm_100 / sm_120 build them without spills, but no such GPU has run
#: them, and Triton 3.6 was found to build one tile shape of them wrong on sm_90
#: (`shuffle_lines_tile`): the reads are kept to the arch whose results were checked on a GPU.
SHUFFLE_LINES_ARCHS = ("sm_90",)


#: SHUFFLE problems that take the cache-order reads (16-bit, head_dim == BLOCK_D, `shuffle_lines`
#: on the policy's target) use KV tiles of at most 32 tokens. On the H100 the reads cost 142
#: registers at the sm_90 policy's 64-token tile (3 programs per SM: 1.21-1.25x NHD) and 96 at
#: 32 tokens: 1.02-1.04x NHD at every sm_90-policy point of bench_paged --shuffle (GQA 4:1;
#: bench/RESULTS.md 2026-11-26, second session). NHD keeps its 64-token tile; so do row tiles
#: above 16 rows (prefill, mixed batches, and decode of GQA groups above 16, e.g. MQA: not
#: measured with 32-token tiles).
SHUFFLE_LINES_NARROW = True
SHUFFLE_NARROW_BLOCK_N = 32
SHUFFLE_NARROW_MAX_M = 16
#: ... except at head_dim 128, where the decode row tile keeps NHD's 64 tokens and 4 warps and
#: the compiler is held to `SHUFFLE_REG_CAP` registers (`LaunchOptions.maxnreg`): 4 programs per
#: SM, as NHD's 123-register tile, with the same 32 KB of K/V in flight per program (ptxas: 128
#: registers, 0-4 B of spills). On an H200 the 32-token tile kept too few bytes in flight
#: (1.20-1.25x NHD) and 64 tokens at 142 registers ran 3 programs per SM (1.37-1.55x); capped:
#: 1.01-1.02x (bench/RESULTS.md, eleventh session). Off (None): the narrow tile above.
SHUFFLE_REG_CAP: int | None = 128
SHUFFLE_REG_CAP_BLOCK_D = (128,)
SHUFFLE_REG_CAP_BLOCK_N = 64
SHUFFLE_REG_CAP_WARPS = 4


#: The cache-order K tile is [block_d // x runs, block_n * x]. With 4 runs (head_dim 32, x 8) and
#: 64 tokens, Triton 3.6's sm_90 build of it returns garbage (error 1349x torch's on an H200,
#: 2026-11-26; the interpreter is right): a miscompile of the run permute, found by the paged
#: matrix cell. Checked right on the GPU (bench/diag_shuffle_lines.py, the GPU test
#: test_gpu_shuffle_lines_tiles): 8 and 16 runs (head_dim 64, 128) at 16-64 tokens; 4 and 32
#: runs (head_dim 32, 256) at 16 and 32 tokens. Only those shapes take the cache-order reads; the
#: rest keep the earlier ones. By number of runs: the most tokens a KV tile may take with them.
SHUFFLE_LINES_MAX_N = {4: 32, 8: 64, 16: 64, 32: 32}


def shuffle_lines_tile(block_d: int, block_n: int, x: int) -> bool:
    """Whether the cache-order reads were checked right on a GPU for a ``block_d x block_n`` tile
    of a SHUFFLE cache with ``x``-element runs (see SHUFFLE_LINES_MAX_N)."""
    return block_n <= SHUFFLE_LINES_MAX_N.get(block_d // x, 0)


def shuffle_lines(compile_arch: str) -> bool:
    """Whether a SHUFFLE launch compiled for ``compile_arch`` (the compiler's arch, not the
    forced policy's: `portattn.platform.compile_arch`) reads K and V in the cache's order."""
    return SHUFFLE_LINES and compile_arch in SHUFFLE_LINES_ARCHS


def cache_order_reads(
    compile_arch: str, head_dim: int, block_d: int, block_n: int, elem_bytes: int
) -> bool:
    """Whether a 16-bit SHUFFLE launch of these tiles reads K and V in the cache's order: the
    one rule the policy (`SHUFFLE_LINES_NARROW`) and the launcher use; the launcher adds what
    only tensors tell (16-byte aligned runs)."""
    return (
        shuffle_lines(compile_arch)
        and elem_bytes == 2
        and head_dim == block_d
        and shuffle_lines_tile(block_d, block_n, 16 // elem_bytes)
    )


# -- sm_90 prefill kernel (issue 19, `portattn.kernels.paged_prefill_sm90`) ----------------------
# On sm_90 the prefill part of a batch (sequences with more query tokens than the decode row tile
# holds) runs on a Gluon kernel: 128-row tiles on two warpgroups (wgmma), K/V by TMA page boxes
# from a producer warp. The portable kernel's 64-row tile reached about 200-285 TFLOP/s on an
# H100 (bench/RESULTS.md: prefill 4 x 2048@8k 3373.9 us); issue 19 asks >= 450.
SM90_PREFILL = True
#: Query tokens x group rows the longest sequence must fill before the kernel is taken: one of
#: its 128-row tiles (shorter verification batches stay on the portable kernel's smaller tiles).
SM90_PREFILL_MIN_ROWS = 128
#: The kernel's schedule (`portattn.kernels.paged_prefill_sm90`, module doc): scores of tile t
#: issued with P V of tile t-1 (OVERLAP), and the two warpgroups issuing their MMAs in turns
#: (PINGPONG; in either loop: sequential, a turn issues P V of tile t with the scores of t+1).
#: Both off: each warpgroup scores, softmaxes and accumulates one tile at a time, unless the
#: head_dim's tile takes turns itself (`Sm90PrefillTile.pingpong`: head_dim 128 does). PINGPONG
#: on makes every two-warpgroup tile take turns.
SM90_PREFILL_OVERLAP = False
SM90_PREFILL_PINGPONG = False
#: The decode sequences of a mixed batch (those of the portable kernel's decode row tile) as
#: items of the sm_90 kernel's persistent loop, spread among the prefill items so that their
#: memory-bound cache reads run beside the prefill's matrix math (one warpgroup each: the other's
#: rows are padding and it only passes the tiles on), instead of a decode launch after it.
#: On: measured faster on the mixed 8x512 point in two H100 runs (1.15-1.19x its roofline against
#: 1.25-1.31x with the decode launch; bench/RESULTS.md 2026-11-26), level to 8% either way on
#: 8x2048 (the runs disagree); the separate decode launch stays behind this switch.
SM90_PREFILL_FUSE_DECODE = True
#: An item whose real rows all lie in warpgroup 0's 64 (a decode item, a short last q tile) runs on
#: both warpgroups, each on half of every K/V tile, merged at the item's end (sequential schedule).
#: Off: the merge buffer (+33 KB at head_dim 128) makes ptxas spill 24-52 B in the consumer
#: warpgroups (compile matrix, sm_90), and the H100 run measured it slower on mixed 8x512
#: (781-857 us against 768-796 us with the decodes on one warpgroup).
SM90_PREFILL_SPLIT_SHORT = False
#: V tiles of pages shorter than the 128-token tile arrive one TMA copy a page box (a 3-D view
#: of the cache puts both 64-column halves of a box's rows in one copy) into per-box tiles, and
#: P V reads them through one shared layout of the boxes, one MMA (an MMA a box until the
#: seventeenth session); off, each box is two copies (one per 64-column half, the 128-byte
#: swizzle's width). Taken where a tile has at least `SM90_PREFILL_V_PAGES_MIN_BOXES` boxes. At
#: 16-token pages a tile's copies go from 32 to 24 (bench/NOTES.md: the kernel's tile period
#: grows with its copy count). H100, medians of 9-11 rounds in turns (bench/RESULTS.md, sixth
#: session): 16-row boxes 1.5-4.3% faster, 32-row boxes (block 544) 1.2-1.5% slower (H200,
#: seventeenth session, with one P V MMA and in turns: still 0.5-2.5% slower). Like the
#: other switches here, read at planning and not in the plan cache's key.
SM90_PREFILL_V_PAGES = True
SM90_PREFILL_V_PAGES_MIN_BOXES = 8
#: Box counts a tile (``block_n`` over the pages' box rows) at which a two-stage tile runs 3
#: stages with each stage released just before the next tile's P V (`Sm90PrefillTile.release_lag`
#: 2; `portattn.kernels.paged_prefill_sm90.launch_tile`). H100, four runs (bench/RESULTS.md,
#: sixth session): block 544 (4 boxes of 32 rows) 1-5% faster in all of them; block 2048 (1 box)
#: level; block 16 (8 boxes, V pages) 1-1.5% slower. 2 boxes (64-row boxes) is not measured.
#: Not with the short items' split (its merge buffer does not fit beside 3 stages). Read at
#: planning.
SM90_PREFILL_LATE_RELEASE_BOXES = (2, 4)
#: Exponentials of every 4 of the softmax (P's) taken by a degree-3 polynomial on the FMA pipe
#: instead of the MUFU (`portattn.kernels._gluon.exp2_split`; 0: all on the MUFU). The idea: both
#: consumer warpgroups run their softmax at once, 16 384 exponentials a 128 x 128 tile, 1024
#: cycles at the MUFU's 16 a cycle an SM, against the traces' 1200-1300 cycle softmax step.
#: Measured slower (H200, bench/RESULTS.md twelfth session, 3 rounds in turns): 1 of 4 +3-6% at
#: blocks 16 and 544 (level at 2048), 2 of 4 +7-13%; so the step is not bound by the MUFU. Off;
#: kept as a bench variant (`bench_prefill.py --schedules`, "exp2 poly K"). Read at planning.
SM90_PREFILL_EXP2_POLY = 0
#: A lazy running max in the softmax (as the MLA kernel's, `portattn.policy.mla.SM90_LAZY_RESCALE`):
#: a row's reference max moves only when a tile's passes it by more than 8 (log2 units; P <=
#: 256, exact), and a thread whose rescale factors are exactly 1 skips its accumulator's
#: multiplies (64 a tile at head_dim 128). Measured level (H200, bench/RESULTS.md twelfth
#: session, 3 rounds in turns, on / off): block 16 0.7-1.2% faster, block 544 1.4-2.5% slower,
#: block 2048 0.3-1.0% faster. Off; kept as a bench variant ("lazy rescale"). Both switches
#: cover the sequential, ping-pong and overlapped loops, not the split short items (exact form).
#: Read at planning.
SM90_PREFILL_LAZY_RESCALE = False
#: The softmax's row maxima and sums as trees (`portattn.kernels._gluon.row_max`, `row_sum`):
#: ``gl.max`` / ``gl.sum`` fold a thread's 32 values a row (a 128-column tile) in a chain of 32
#: dependent ops, each waiting on the last, in both warpgroups at once; halving first makes it 4
#: levels of independent ops, then 1 op and the 2 shuffles. Same op count; the sum's rounding
#: order changes. Measured (H200, bench/RESULTS.md thirteenth session, 3 rounds in turns): level
#: at block 16 (0.0-0.3%), 1.4-3.8% slower at blocks 544 and 2048; so the softmax step is not
#: bound by these chains either. Off; kept as a bench variant ("tree reduce"). Read at planning.
SM90_PREFILL_TREE_REDUCE = False
#: How the persistent programs get their items (`portattn.kernels.paged_prefill_sm90`). Off:
#: dealt round-robin when the launch starts (`program_items`), so a program's share is fixed
#: whatever its items cost. On: each program's producer takes the next item from a counter in
#: global memory (one atomic an item; the launch's order is `program_items` of one program:
#: heaviest q tiles first within a sequence, the decode items spread evenly) once it has
#: issued its previous item's copies, and hands it to its warpgroups. Model
#: (`bench/model_deal.py`: tiles an item, a guess for a decode item): the last program ends
#: after the mean by 2.7% (pure prefill 8x4096), 2.2-2.7% (mixed 8x2048) and 4.1-6.6% (mixed
#: 8x512) with the fixed deal; by 0.1%, 0.7-1.5% and 5.1-6.0% taken from a counter (the
#: decodes, spread to the order's end, keep 8x512 uneven). Nsight Compute saw the SMs idle
#: 4.4-5.6% of the pure-prefill launch. Measured (H200, bench/RESULTS.md thirteenth session, 3
#: rounds in turns, on / off): block 16 2.0-2.8% faster, block 2048 1.6-2.5%, block 544 level
#: (0.1-0.2%, not explained: the model predicts a gain there too); mixed 8x2048 at block 16
#: from 1.33 to 1.29 of its roofline, the block-size spreads from 1.039-1.043 to 1.014-1.023.
#: On. Read at planning. (Handing each item's values to the warpgroups in the ring slot too,
#: `SM90_PREFILL_RING_ITEMS` from 3227fdb, measured 1-9% slower on the H200 and was removed:
#: bench/NOTES.md, fourteenth session.)
SM90_PREFILL_DYNAMIC = True
#: Each item's query rows loaded by the producer warp, one TMA copy a consumer warpgroup into its
#: query buffer (`portattn.kernels.paged_prefill_sm90`, ``Q_TMA``): after the copies of the item's
#: tile ``STAGES - 1`` (or its last), once the warpgroup's last score MMA of its previous item has
#: returned. Off, each warpgroup reads its rows from global memory at the item's start, after the
#: item's metadata, while the tensor cores idle. The clock trace (bench/trace_prefill.py) put
#: that load at 1900-2350 cycles an item, about 62 items a program at pure prefill 8x4096. Taken
#: where the query's rows are 16-byte aligned (`portattn.kernels._launch.rows_aligned`),
#: head_dim a multiple of 64, a warpgroup's 64 rows whole tokens of the head tile (``64 %
#: HEAD_TILE == 0``) and the short items' split off, and only in launches that take ping-pong
#: turns (`portattn.kernels.paged_prefill_sm90.takes_turns`). Measured (H200, bench/RESULTS.md
#: sixteenth session, 3 rounds in turns, against the same turns at 3 stages without it): pure
#: prefill 8x4096 2.5-4.5% faster (call 3; 1.5-5.0% with the first build, call 2), mixed 8x2048
#: 1.3-2.5% (2.6-5.3%), 8x512 level (-0.9 to +2.3%); the query wait fell to ~250 cycles. In the
#: sequential loop it was level to 8% slower (the first build's producer waited for the freed
#: buffer at the item's first tile: its copies ran less far ahead, the score step got slower),
#: so it is taken with turns only (the kernel asserts it). On. Read at planning.
SM90_PREFILL_Q_TMA = True
#: Each consumer warpgroup takes its next item (the ring's step and the item's metadata reads)
#: before the current item's epilogue instead of after it (`portattn.kernels.paged_prefill_sm90`,
#: ``AHEAD``, `_next_item`), so the two dependent rounds of global reads run under the output's
#: stores. The trace (bench/trace_prefill.py, sixteenth session) put an item's release-to-start
#: gap (epilogue, hand-over, metadata) at 4500-6750 cycles a warpgroup under turns, 12-14% of
#: the span at pure prefill 8x4096. Prepared, not measured on a GPU: off. Read at planning.
SM90_PREFILL_ITEM_AHEAD = False
#: Under turns, each K buffer is freed as soon as its tile's scores have returned (a barrier of its
#: own) and the producer copies K a tile ahead of V within an item: on a stage's release it issues
#: V of tile t, then K of tile t+1 (`portattn.kernels.paged_prefill_sm90`, ``K_AHEAD``). Box by
#: box, both land with the stage's last copy: at block 16 (8 boxes, 24 copies a tile) the
#: warpgroups' wait for V of tile t and K of t+1 was 297-491 cycles, at block 2048 (4 copies)
#: 173-218, though the copies were issued ~4200 cycles ahead; the same with pages in order, so
#: the copies' count, not the pages' scatter. Measured (H200, bench/RESULTS.md eighteenth
#: session, call 5, rounds in turns): 1.006-1.040x the policy (the control 0.985-1.001), the
#: wait at block 16 longer (355-561 cycles): off. A tile's K boxes before its V boxes (K_FIRST,
#: call 1) measured 0.988-1.021x and was removed. Read at planning.
SM90_PREFILL_K_AHEAD = False
#: The producer finds a tile's pages without a division a box where it can
#: (`portattn.kernels.paged_prefill_sm90.paging`): a box a page (16-128-token pages), or pages of
#: a tile or more (one division a tile). Block 16's extra time was cycles, not the clock (the
#: card at its power limit ran block 16 2.7-3.7% faster), and its SASS differed from block
#: 2048's only in the producer's loop. Measured (H200, bench/RESULTS.md twentieth session, 3
#: rounds in turns, off over on): block 16 1.030-1.035x, blocks 544 and 2048 0.986-1.010x (the
#: control 0.983-1.002); block 16's tile period 3069 -> 2887 cycles (2048: 2809), the block-size
#: spreads 1.034-1.046 off, 1.007-1.014 on. On. Read at planning.
SM90_PREFILL_PAGING = True


@dataclass(frozen=True)
class Sm90PrefillTile:
    """The sm_90 prefill kernel's tile for one head_dim: ``warpgroups`` consumer warpgroups of
    64 rows each (2 or 3), ``block_n`` context tokens per K/V tile, ``stages`` of them in flight
    (shared memory: Q 64 x warpgroups x d + 2 x stages x block_n x d)."""

    block_n: int
    stages: int
    warpgroups: int = 2
    #: When each consumer warpgroup releases a tile's stage to the producer (sequential schedule
    #: only; needs ``stages >= 3``): 0 after the tile's P V (the producer then loads tile t +
    #: stages at once), 1 after the next tile's scores, 2 just before the next tile's P V. A
    #: later release moves the producer's copies of a tile later in the consumers' tile period
    #: (bench/NOTES.md: copies that land during the MMAs slow them).
    release_lag: int = 0
    #: The two warpgroups take turns issuing their MMAs (the sequential loop's ping-pong, as
    #: ``SM90_PREFILL_PINGPONG`` makes every two-warpgroup tile do): one turn issues P V of tile t
    #: and the scores of tile t+1, whose stage the lagging warpgroup frees half a tile period
    #: after the leading one would need it at 2 stages, so turns want ``stages >= 3``.
    pingpong: bool = False


#: head_dim -> tile (bf16/fp16). 128: 32 KB Q + 3 x 64 KB K/V stages = 224 KB of the H100's 227,
#: ping-pong turns, the query by TMA (`SM90_PREFILL_Q_TMA`; where it cannot come so, the launch
#: takes `SM90_PREFILL_NO_TMA_TILES`'). H200, bench/RESULTS.md sixteenth session (3 rounds in
#: turns, against the sequential 2-stage tile before it in the same run, calls 2-4): pure
#: prefill 8x4096 1.8-6.0% faster, mixed 8x2048 1.5-4.3%, mixed 8x512 -0.3 to +6.4%. The turns
#: at 2 stages were 1-3% slower (the producer starved: the trace's tile period stayed at ~3100
#: cycles); at 3 stages without the query by TMA, -1 to +2.6%. The sequential tile at 3 stages
#: measured the same as at 2 (2026-11-25). 64: the sequential loop, not measured with turns.
SM90_PREFILL_TILES = {
    64: Sm90PrefillTile(block_n=128, stages=3),
    128: Sm90PrefillTile(block_n=128, stages=3, pingpong=True),
}
#: head_dim -> the tile a launch runs instead of its `SM90_PREFILL_TILES` tile where that takes
#: turns but the query cannot come by TMA (`SM90_PREFILL_Q_TMA` off, or rows `q_tma` refuses:
#: GQA 5:1, unaligned rows): the sequential tile, as before the sixteenth session. The turns
#: without the query by TMA spill 56 B at GQA 5:1 (compile matrix), and were not faster
#: than this tile in every run (bench/RESULTS.md sixteenth session, calls 1-3).
SM90_PREFILL_NO_TMA_TILES = {
    128: Sm90PrefillTile(block_n=128, stages=2),
}


@dataclass(frozen=True)
class PagedProblem:
    """What the policy may look at.

    Attributes:
        num_q_heads: query heads.
        num_kv_heads: KV heads (``num_q_heads % num_kv_heads == 0``).
        head_dim: head dimension (<= 256).
        elem_bytes: bytes per Q/K/V element (2 for fp16/bf16, 4 for fp32).
        max_query_len: the longest ``q_len_i`` of the batch (1 for pure decode).
        block_size: the cache's tokens per block. Recorded for the compile matrix and reports;
            the tiles are deliberately independent of it.
        num_seqs: sequences in the batch (split-KV sizing).
        max_seq_len: the longest ``seq_lens[i]`` (split-KV sizing); ``None`` when unknown, which
            means no split.
        shuffled: the KV cache is in the SHUFFLE layout (split token/dim addressing): the words
            bound (and in fp32 the warp count) counts `SHUFFLE_ADDR_WORDS`; no wide tile.
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
            a mixed batch (module docstring); ``None``: every sequence uses the tile above.
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


def estimate_shared_mem(
    block_m: int, block_n: int, block_d: int, elem_bytes: int, num_stages: int
) -> int:
    """Bytes of shared memory / LDS the kernel needs for these tiles (see module docstring).

    ``2 * num_stages * block_n * block_d * e + block_m * block_d * e + block_m * block_n * e``.

    Example: gfx942, head_dim 128, fp16, block_m 16, block_n 32, 2 stages ->
    ``2*2*32*128*2 + 16*128*2 + 16*32*2 = 32768 + 4096 + 1024 = 37888 <= 65536``.
    """
    kv = 2 * num_stages * block_n * block_d * elem_bytes
    q = block_m * block_d * elem_bytes
    p = block_m * block_n * elem_bytes
    return kv + q + p


def estimate_words(
    block_m: int, block_n: int, block_d: int, elem_bytes: int, shuffled: bool = False
) -> int:
    """32-bit words of live tile values per program (see module docstring).

    ``block_m*block_d + block_m*block_n + block_n*block_d*e/4``, plus
    ``SHUFFLE_ADDR_WORDS * block_n*block_d`` on SHUFFLE caches.

    Example: gfx950, head_dim 256, fp16, 64 x 32, SHUFFLE ->
    ``16384 + 2048 + 4096 + 8192 = 30720 > MAX_WORDS_8_WARPS (24576)``, so block_n 16.
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
    """32-bit registers per thread for the big tiles (see module docstring), rounded up.

    `estimate_words` over ``num_warps * warp_size`` threads.

    Example: sm_90, head_dim 128, fp16, block_m 64, block_n 64, 4 warps ->
    ``(8192 + 4096 + 4096) / 128 = 128 > 64``, so 8 warps (64). The same tile on a SHUFFLE cache:
    ``(8192 + 4096 + 4096 + 8192) / 128 = 192`` at 4 warps, 96 at 8.
    """
    words = estimate_words(block_m, block_n, block_d, elem_bytes, shuffled)
    threads = num_warps * warp_size
    return -(-words // threads)


def _fma_dots(target: Target, elem_bytes: int) -> bool:
    """The kernel's dots compile to register-operand FMA loops: fp32 on NVIDIA (`FP32_BLOCK_M`)."""
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


def _rows(block_m: int, group: int) -> RowTile:
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


def paged_tiles(target: Target, problem: PagedProblem) -> PagedTiles:
    """Choose the paged-attention tiles for ``problem`` on ``target`` (pure; no device access).

    Rules:
      * ``block_d = max(16, next_pow2(head_dim))`` (masked beyond head_dim).
      * rows = ``max_query_len * group``. With >= 128 rows, the wide tile (128 x 64, 8 warps) if
        the target holds it and the cache is not SHUFFLE (module docstring). Otherwise
        ``block_m``: enough rows for ``max_query_len`` tokens of the whole GQA group, at least
        ``target.mma_min_rows`` and 16, at most 64. ``head_tile = min(group, block_m)``,
        ``block_q = block_m // head_tile`` (decode with GQA 8:1 -> 16 rows, 8 heads, 2 tokens).
      * ``(block_n, num_stages)`` from `_ladder`, first that fits the shared-memory budget and
        `estimate_words` <= `MAX_WORDS_8_WARPS` (block_n 16 always passes the latter);
        if none fits, ``block_m`` halves (down to 16) and the ladder is walked again.
      * ``num_warps`` 4, or 8 where `estimate_registers` at 4 exceeds 64 (128 for >= 64-row
        tiles on `SMEM_MMA_ARCHS`). `estimate_words` counts the SHUFFLE address words when
        ``shuffled``; `estimate_registers` for the warp count only in fp32
        (`SHUFFLE_WARPS_ELEM_BYTES`).
      * fp32 on NVIDIA (FMA dots, module docstring): ``block_m`` `FP32_BLOCK_M` (16, so no
        decode tile), `FP32_NUM_WARPS` (8), and `FP32_MAX_WORDS` in place of
        `MAX_WORDS_8_WARPS` on the ladder.
      * ``decode``: the row tile a ``max_query_len == 1`` problem would get, when it differs from
        the chosen one and ``max_query_len`` exceeds its ``block_q`` (mixed batches).
      * ``num_splits`` from `split_count`.

    Raises:
        ValueError: a problem the kernel cannot serve (head_dim > 256, heads not divisible,
            non-positive sizes), or (never for head_dim <= 256 on a known target) no tile fits.
    """
    p = problem
    errors = []
    if p.num_q_heads < 1 or p.num_kv_heads < 1 or p.num_q_heads % p.num_kv_heads:
        errors.append(
            f"num_q_heads must be a positive multiple of num_kv_heads; got {p.num_q_heads} and "
            f"{p.num_kv_heads}"
        )
    if not 1 <= p.head_dim <= MAX_HEAD_DIM:
        errors.append(f"head_dim must be in [1, {MAX_HEAD_DIM}]; got {p.head_dim}")
    if p.elem_bytes not in (2, 4):
        errors.append(f"elem_bytes must be 2 or 4; got {p.elem_bytes}")
    if p.max_query_len < 1:
        errors.append(f"max_query_len must be >= 1; got {p.max_query_len}")
    if p.max_seq_len is not None and p.max_seq_len < 1:
        errors.append(f"max_seq_len must be >= 1 or None; got {p.max_seq_len}")
    if errors:
        raise ValueError("paged_tiles: " + "; ".join(errors))

    block_d = max(MIN_DOT_DIM, next_pow2(p.head_dim))
    tiles = _main_tiles(target, p, block_d)
    if p.max_query_len > 1:
        dec_m = _block_m(target, p.group, block_d, p.elem_bytes, tiles.block_m, p.shuffled)
        dec = _rows(dec_m, p.group)
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
        SHUFFLE_LINES_NARROW
        and p.shuffled
        and block_m <= SHUFFLE_NARROW_MAX_M
        and cache_order_reads(
            target.arch, p.head_dim, block_d, SHUFFLE_NARROW_BLOCK_N, p.elem_bytes
        )
    )
    if (
        narrow
        and SHUFFLE_REG_CAP is not None
        and block_d in SHUFFLE_REG_CAP_BLOCK_D
        and cache_order_reads(
            target.arch, p.head_dim, block_d, SHUFFLE_REG_CAP_BLOCK_N, p.elem_bytes
        )
    ):
        wide = _ladder_tiles(target, p, block_m, block_d, max_stages, max_words, False)
        if wide.block_n == SHUFFLE_REG_CAP_BLOCK_N and wide.num_warps == SHUFFLE_REG_CAP_WARPS:
            opts = wide.options
            capped = launch_options(target, opts.num_warps, opts.num_stages, SHUFFLE_REG_CAP)
            return replace(wide, options=capped)
    return _ladder_tiles(target, p, block_m, block_d, max_stages, max_words, narrow)


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
                row_tile = _rows(block_m, p.group)
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


def sm90_prefill(target: Target, problem: PagedProblem) -> bool:
    """Whether the prefill part of ``problem`` runs on the sm_90 Gluon kernel (pure; the launcher
    adds what only the tensors tell: strides, alignment, block size, `paged_prefill_sm90`).

    Yes on sm_90 with `SM90_PREFILL` on, 16-bit NHD caches, a head_dim of `SM90_PREFILL_TILES`,
    and ``max_query_len * group >= SM90_PREFILL_MIN_ROWS``.

    Example: sm_90, 32/8 heads x 128, bf16, max_query_len 512 -> True; max_query_len 8 -> False.
    """
    p = problem
    return (
        SM90_PREFILL
        and target.arch == "sm_90"
        and p.elem_bytes == 2
        and not p.shuffled
        and p.head_dim in SM90_PREFILL_TILES
        and p.max_query_len * p.group >= SM90_PREFILL_MIN_ROWS
    )
