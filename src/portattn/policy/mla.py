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

    (BLOCK_N * BLOCK_DV + BLOCK_N * BLOCK_DPE) * elem * num_stages    latent + rope tiles, pipelined
  + BLOCK_H * (BLOCK_DV + BLOCK_DPE) * elem                            query tiles (dot operands)
  + BLOCK_H * BLOCK_N * elem                                           P (the PV dot's A operand)

Worked numbers for 576/512 in bf16 (BLOCK_H 16): BLOCK_N 64 x 2 stages = 167936 B fits sm_90's
232448 B but not sm_80's 166912 B (-> 32 x 3 stages = 130048 B); the 99 KB parts (101376 B) get
32 x 2 = 93184 B; 64 KB AMD parts (65536 B, 2 stages at most) get 16 x 2 = 55808 B.

Split-KV: with few (token, head-group) programs the GPU idles, so the context is split into
``num_kv_splits`` chunks whose partial results a reduce kernel merges. The count aims at
``PROGRAMS_PER_SM`` programs per multiprocessor, never gives a split fewer than
``MIN_TOKENS_PER_SPLIT`` context tokens, and is capped at ``MAX_KV_SPLITS``.
"""

from __future__ import annotations

from dataclasses import dataclass

from portattn.platform import Target
from portattn.policy.common import LaunchOptions, launch_options, next_pow2

#: KV tile lengths tried, largest first (>= 16: the PV dot's K dimension).
BLOCK_N_CANDIDATES: tuple[int, ...] = (64, 32, 16)
#: Programs per multiprocessor the split count aims at (two hide one program's gather latency).
PROGRAMS_PER_SM = 2
#: A split covers at least this many context tokens, so its partial result is worth the reduce.
MIN_TOKENS_PER_SPLIT = 256
#: Upper bound on splits (workspace size, reduce-kernel loop length).
MAX_KV_SPLITS = 32
#: Warps per program: BLOCK_H 16 x BLOCK_DV 512 fp32 accumulator = 64 registers/thread at 4 warps.
NUM_WARPS = 4
#: The deepest pipeline the policy asks for (a target may cap it lower).
MAX_STAGES = 3


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
    """

    num_heads: int
    head_dim_k: int
    kv_lora_rank: int
    elem_size: int
    num_tokens: int
    max_context: int


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

    @property
    def head_groups(self) -> int:
        """Programs per query token and split along the head axis."""
        return self.padded_heads // self.block_h


def mla_smem_bytes(
    block_h: int, block_n: int, block_dv: int, block_dpe: int, num_stages: int, elem_size: int
) -> int:
    """The shared-memory estimate of the module docstring, in bytes."""
    kv = block_n * (block_dv + block_dpe) * elem_size * num_stages
    q = block_h * (block_dv + block_dpe) * elem_size
    p = block_h * block_n * elem_size
    return kv + q + p


def mla_num_kv_splits(target: Target, num_tokens: int, head_groups: int, max_context: int) -> int:
    """Context splits for ``num_tokens x head_groups`` programs on ``target`` (see module doc)."""
    base = max(1, num_tokens * head_groups)
    want = -(-PROGRAMS_PER_SM * target.num_sms // base)
    by_context = max(1, max_context // MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, by_context, MAX_KV_SPLITS))


def _problem_errors(p: MlaProblem) -> list[str]:
    errors = []
    for name in ("num_heads", "head_dim_k", "kv_lora_rank", "elem_size", "max_context"):
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
    block_h = target.mma_min_rows
    padded_heads = -(-problem.num_heads // block_h) * block_h
    block_dv = next_pow2(problem.kv_lora_rank)
    rope = problem.head_dim_k - problem.kv_lora_rank
    block_dpe = next_pow2(rope) if rope > 0 else 0
    top = min(MAX_STAGES, target.max_num_stages)
    # Prefer the longest KV tile that still pipelines (>= 2 stages), then the deepest pipeline;
    # a single stage only when nothing pipelined fits.
    order = [(n, s) for n in BLOCK_N_CANDIDATES for s in range(top, 1, -1)]
    order += [(n, 1) for n in BLOCK_N_CANDIDATES]
    for block_n, stages in order:
        smem = mla_smem_bytes(block_h, block_n, block_dv, block_dpe, stages, problem.elem_size)
        if smem <= target.max_shared_mem:
            break
    else:
        smallest = mla_smem_bytes(block_h, 16, block_dv, block_dpe, 1, problem.elem_size)
        raise ValueError(
            f"mla_decode_tiles: no tile fits {target.arch}'s {target.max_shared_mem} B of shared "
            f"memory for kv_lora_rank={problem.kv_lora_rank}, head_dim_k={problem.head_dim_k}, "
            f"{problem.elem_size}-byte elements (the smallest needs {smallest} B); use a 2-byte "
            "dtype"
        )
    splits = mla_num_kv_splits(
        target, problem.num_tokens, padded_heads // block_h, problem.max_context
    )
    return MlaTiles(
        block_h=block_h,
        padded_heads=padded_heads,
        block_n=block_n,
        block_dv=block_dv,
        block_dpe=block_dpe,
        num_kv_splits=splits,
        options=launch_options(target, NUM_WARPS, stages),
        reduce_options=launch_options(target, NUM_WARPS, 1),
        smem_bytes=smem,
    )
