"""The compile matrix's cases: each kernel at the shapes that broke upstream, on meta tensors.

A `Case` names a kernel, a short label and a *builder*: a module-level function
``build(target, **params) -> list[Launch]`` that calls the op's real ``plan_<op>`` on tensors of
the ``meta`` device (shapes, strides and dtypes, no memory), so the launches compiled are exactly
those the op would run on that target, with that target's policy tiles and launch options.
Builders are plain functions so that worker processes can receive them by reference.

| kernel          | axes                                                                         |
|-----------------|------------------------------------------------------------------------------|
| mla_decode      | head_dim_k/kv_lora_rank 576/512, 320/256, 288/256; num_q_heads 1 .. 128      |
|                 | HIP only: 576/512 verification, q_len 1/2/4/8 x heads 1/16/128, pages 64, 1  |
| paged_attention | head_dim 64/128/256; GQA 1:1, 5:1, 8:1; block_size 16, 80, 544, 2048;        |
|                 | NHD and SHUFFLE; chunked prefill (max_query_len 64); decode at block_size 16 |
|                 | long prefill: GQA 4:1 hd128 NHD, max_query_len 512/2048/4096                 |
| write_kv_cache  | head_dim 64/128/256; block_size 16, 80, 544, 2048; NHD and SHUFFLE           |
| gather_kv_cache | as write_kv_cache                                                            |
| metadata_summary| int32 and int64 metadata; with query_start_loc (paged) and without (MLA);    |
|                 | 8 and 4096 block-table columns (the narrowest and the widest column step)    |

Each kernel also gets one case whose cache is larger than 2 GiB: AMD's backend specialises
pointers into buffers under 2 GiB (``tt.pointer_range`` 32, buffer loads), so both code paths are
compiled. Caches are bf16 (the serving dtype; the CPU interpreter's bf16 limits do not apply to a
compile).

`policy_estimate(launch)` is the op's policy's own shared-memory figure for the tiles a launch
actually carries (recomputed from its constexprs, so injected tiles are estimated too).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from portattn.kernels._launch import Launch
from portattn.platform import Target, get_target
from portattn.policy.paged import PagedConfig, PagedProblem, prefill_config, sm90_prefill

META = torch.device("meta")
# The serving dtype every axis below is compiled in; the other dtypes an op accepts (`api_dtypes`)
# are compiled at the seeds' shapes (`dtype_cases`).
DTYPE = torch.bfloat16
DTYPE_NAME = "bfloat16"

MLA_SHAPES: tuple[tuple[int, int], ...] = ((576, 512), (320, 256), (288, 256))
MLA_HEADS: tuple[int, ...] = (1, 4, 8, 16, 32, 128)
# HIP verification (`hip_verify_cases`): query tokens a sequence and heads, the extremes of 1-8
# and 1-128.
HIP_VERIFY_QUERY_LENS: tuple[int, ...] = (1, 2, 4, 8)
HIP_VERIFY_HEADS: tuple[int, ...] = (1, 16, 128)
PAGED_HEAD_DIMS: tuple[int, ...] = (64, 128, 256)
# (num_q_heads, num_kv_heads): MHA 1:1, GQA 5:1 (an awkward, non-power-of-two group), GQA 8:1.
PAGED_GQA: tuple[tuple[int, int], ...] = ((8, 8), (40, 8), (32, 4))
BLOCK_SIZES: tuple[int, ...] = (16, 80, 544, 2048)
LAYOUTS: tuple[str, ...] = ("NHD", "SHUFFLE")
CACHE_HEAD_DIMS: tuple[int, ...] = (64, 128, 256)
CACHE_KV_HEADS = 8
NUM_SEQS = 4
PREFILL_CHUNK = 64  # max_query_len of the chunked-prefill cases: the widest M tile (64 rows)
CONTEXT_BLOCKS = 8  # blocks per sequence in the paged / cache cases' block tables
# MLA decode context (tokens per sequence): long enough that the policy splits the context, so
# the split-KV reduce kernel is compiled too.
MLA_CONTEXT = 8192
# A cache past 2 GiB: AMD compiles such pointers without the 32-bit buffer-range specialisation.
BIG_CACHE_BYTES = 3 << 30
# Long prefill problems: 32 query heads / 8 KV heads (GQA 4:1, a group the axes above do not
# have), head_dim 128, bf16, NHD; mixed batches with 512- and 2048-token chunks and pure prefill
# of 4096 tokens, at block sizes 16, 544 and 2048 (on sm_90: the Gluon prefill kernel). The tiles
# depend on (max_query_len, group, head_dim, dtype, layout), not on the batch's sequence count or
# context (no split-KV above max_query_len 1), so the builder's 4 sequences compile the kernel
# those batches launch.
LONG_PREFILL_QUERY_LENS: tuple[int, ...] = (512, 2048, 4096)
LONG_PREFILL_BLOCK_SIZES: tuple[int, ...] = (16, 544, 2048)


@dataclass(frozen=True)
class Case:
    """One kernel at one problem shape; compiled for every target of the matrix.

    Attributes:
        kernel: the op (``"paged_attention"`` ...), what ``--kernels`` filters on.
        name: a short label, unique within the kernel (``"hd128 gqa5 bs544 NHD prefill"``).
        build: ``build(target, **params) -> list[Launch]`` (a module-level function).
        params: the builder's keyword arguments, as sorted pairs (hashable, picklable).
        spill_allowance: extra spills this case may have before the gate fails it, per vendor
            or per arch (an arch's entry wins) in the backend's unit (``(("cuda", bytes),
            ("hip", VGPRs))``, ``(("sm_90", bytes),)``), added to
            `portattn.compile.matrix.SPILL_THRESHOLD`, with the reason in ``spill_reason``.
        shared_only: compile only through LLVM-IR lowering, where shared memory is allocated
            (`portattn.compile.worker.shared_memory_only`): for tiles whose full backend compile
            takes minutes and whose verdict is the shared-memory figure (a naive rule's tiles).
        vendors: the vendors whose targets compile the case (a case about one vendor's tiles).
        expect: free text for reports (e.g. why a naive case should fail).
    """

    kernel: str
    name: str
    build: Callable[..., list[Launch]]
    params: tuple[tuple[str, Any], ...] = ()
    spill_allowance: tuple[tuple[str, int], ...] = ()
    spill_reason: str = ""
    shared_only: bool = False
    vendors: tuple[str, ...] = ("cuda", "hip")
    expect: str = field(default="", compare=False)

    @property
    def id(self) -> str:
        return f"{self.kernel}/{self.name}"

    def allowance(self, vendor: str, arch: str = "") -> int:
        """Extra spills allowed on ``arch`` of ``vendor``: the arch's entry, else the vendor's,
        else 0."""
        table = dict(self.spill_allowance)
        return table.get(arch, table.get(vendor, 0))

    def compiles_for(self, target: Target) -> bool:
        """Whether the matrix compiles this case for ``target`` (its vendor is one of
        ``vendors``)."""
        return target.vendor in self.vendors

    def plan(self, target: Target) -> list[Launch]:
        return self.build(target, **dict(self.params))


def make_case(kernel: str, name: str, build: Callable[..., list[Launch]], **params: Any) -> Case:
    """A `Case` with ``params`` given as keyword arguments."""
    return Case(kernel, name, build, tuple(sorted(params.items())))


# -- builders -------------------------------------------------------------------------------------


def _blocks_for(head_dim: int, block_size: int, num_kv_heads: int, big: bool) -> int:
    """Enough blocks for the block tables; past 2 GiB per cache when ``big`` (bf16)."""
    base = NUM_SEQS * CONTEXT_BLOCKS + 1
    if not big:
        return base
    per_block = block_size * num_kv_heads * head_dim * DTYPE.itemsize
    return max(base, -(-BIG_CACHE_BYTES // per_block))


def _caches(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, layout: str, dt
) -> tuple[torch.Tensor, torch.Tensor]:
    from portattn.layout import empty_kv_cache

    return empty_kv_cache(
        num_blocks, block_size, num_kv_heads, head_dim, layout=layout, dtype=dt, device=META
    )


def build_paged_attention(
    target: Target,
    *,
    head_dim: int,
    num_q_heads: int,
    num_kv_heads: int,
    block_size: int,
    layout: str,
    max_query_len: int,
    big_cache: bool = False,
    dtype: str = DTYPE_NAME,
    config: PagedConfig | None = None,
) -> list[Launch]:
    """The launches of one paged-attention problem on meta tensors (``config``: the kernel
    choices; ``None``: the policy's)."""
    from portattn.kernels.paged_attention import plan_paged_attention

    dt = getattr(torch, dtype)
    num_blocks = _blocks_for(head_dim, block_size, num_kv_heads, big_cache)
    k, v = _caches(num_blocks, block_size, num_kv_heads, head_dim, layout, dt)
    num_tokens = NUM_SEQS * max_query_len
    query = torch.empty((num_tokens, num_q_heads, head_dim), dtype=dt, device=META)
    block_table = torch.empty((NUM_SEQS, CONTEXT_BLOCKS), dtype=torch.int32, device=META)
    seq_lens = torch.empty((NUM_SEQS,), dtype=torch.int32, device=META)
    qsl = torch.empty((NUM_SEQS + 1,), dtype=torch.int32, device=META)
    return plan_paged_attention(
        query,
        k,
        v,
        block_table,
        seq_lens,
        qsl,
        layout=layout,
        target=target,
        max_query_len=max_query_len,
        config=config,
    )


def build_write_kv_cache(
    target: Target,
    *,
    head_dim: int,
    block_size: int,
    layout: str,
    big_cache: bool = False,
    dtype: str = DTYPE_NAME,
) -> list[Launch]:
    from portattn.kernels.kv_cache import plan_write_kv_cache

    dt = getattr(torch, dtype)
    num_blocks = _blocks_for(head_dim, block_size, CACHE_KV_HEADS, big_cache)
    k_cache, v_cache = _caches(num_blocks, block_size, CACHE_KV_HEADS, head_dim, layout, dt)
    num_tokens = NUM_SEQS * PREFILL_CHUNK
    key = torch.empty((num_tokens, CACHE_KV_HEADS, head_dim), dtype=dt, device=META)
    value = torch.empty_like(key)
    slots = torch.empty((num_tokens,), dtype=torch.int64, device=META)
    return plan_write_kv_cache(key, value, k_cache, v_cache, slots, layout=layout, target=target)


def build_gather_kv_cache(
    target: Target,
    *,
    head_dim: int,
    block_size: int,
    layout: str,
    big_cache: bool = False,
    dtype: str = DTYPE_NAME,
) -> list[Launch]:
    from portattn.kernels.kv_cache import plan_gather_kv_cache

    dt = getattr(torch, dtype)
    num_blocks = _blocks_for(head_dim, block_size, CACHE_KV_HEADS, big_cache)
    k_cache, v_cache = _caches(num_blocks, block_size, CACHE_KV_HEADS, head_dim, layout, dt)
    block_table = torch.empty((NUM_SEQS, CONTEXT_BLOCKS), dtype=torch.int32, device=META)
    cu = torch.empty((NUM_SEQS + 1,), dtype=torch.int32, device=META)
    total = NUM_SEQS * CONTEXT_BLOCKS * block_size
    k_out = torch.empty((total, CACHE_KV_HEADS, head_dim), dtype=dt, device=META)
    out = (k_out, torch.empty_like(k_out))
    return plan_gather_kv_cache(
        k_cache, v_cache, block_table, cu, layout=layout, out=out, target=target
    )


def build_metadata_summary(
    target: Target, *, index_dtype: str, form: str, max_blocks: int
) -> list[Launch]:
    """The unbounded calls' metadata check (`portattn.kernels.metadata_summary`), in the form of
    the op that runs it: ``"qsl"`` (`paged_attention`, MLA with query_start_loc), ``"no qsl"``
    (MLA's one query a sequence), ``"gather"`` (`gather_kv_cache`: the offsets are the lengths,
    negative block ids are padding)."""
    from portattn.kernels.metadata_summary import plan_metadata_summary

    dt = getattr(torch, index_dtype)
    qsl = torch.empty((NUM_SEQS + 1,), dtype=dt, device=META) if form != "no qsl" else None
    seq_lens = torch.empty((NUM_SEQS,), dtype=dt, device=META) if form != "gather" else None
    block_table = torch.empty((NUM_SEQS, max_blocks), dtype=dt, device=META)
    running = torch.empty((5,), dtype=torch.int64, device=META)
    totals = torch.empty((4,), dtype=torch.int64, device=META)
    return plan_metadata_summary(
        qsl, seq_lens, block_table, running, totals,
        num_tokens=2**63 - 1 if form == "gather" else NUM_SEQS * PREFILL_CHUNK, block_size=16,
        num_blocks=NUM_SEQS * max_blocks, end_at_most=form != "qsl", padding_ok=form == "gather",
        target=target,
    )  # fmt: skip


def summary_cases() -> list[Case]:
    return [
        make_case(
            "metadata_summary",
            f"{dtype} {form} cols{cols}",
            build_metadata_summary,
            index_dtype=dtype,
            form=form,
            max_blocks=cols,
        )
        for dtype in ("int32", "int64")
        for form in ("qsl", "no qsl", "gather")
        for cols in (CONTEXT_BLOCKS, 4096)
    ]


def build_mla_decode(
    target: Target,
    *,
    head_dim_k: int,
    kv_lora_rank: int,
    num_q_heads: int,
    block_size: int = 16,
    q_len: int = 1,
    tiles: Any = None,
    dtype: str = DTYPE_NAME,
    page_indices: bool = False,
    num_seqs: int = NUM_SEQS,
    metadata: bool = False,
) -> list[Launch]:
    """The launches of one MLA decode problem on meta tensors. ``metadata``: through
    `MlaMetadataBuilder` as a serving engine calls it, so the tiles are the policy's for exactly
    ``q_len`` tokens a sequence (without it a meta plan reads no ``query_start_loc`` and bounds
    the longest query by the token count)."""
    from portattn.kernels.mla_decode import plan_mla_decode
    from portattn.mla_metadata import MlaMetadataBuilder

    dt = getattr(torch, dtype)
    blocks_per_seq = -(-MLA_CONTEXT // block_size)
    num_blocks = num_seqs * blocks_per_seq + 1
    num_tokens = num_seqs * q_len
    query = torch.empty((num_tokens, num_q_heads, head_dim_k), dtype=dt, device=META)
    kv_cache = torch.empty((num_blocks, block_size, head_dim_k), dtype=dt, device=META)
    block_table = torch.empty((num_seqs, blocks_per_seq), dtype=torch.int32, device=META)
    seq_lens = torch.empty((num_seqs,), dtype=torch.int32, device=META)
    kwargs: dict[str, Any] = {"target": target}
    if q_len > 1:
        kwargs["query_start_loc"] = torch.empty((num_seqs + 1,), dtype=torch.int32, device=META)
    if tiles is not None:
        kwargs["tiles"] = tiles
    if metadata:
        builder = MlaMetadataBuilder(
            target, max_batch=num_seqs, num_heads=num_q_heads, kv_lora_rank=kv_lora_rank,
            head_dim_k=head_dim_k, dtype=dt, device=META, max_query_len=q_len,
            max_seq_len=MLA_CONTEXT,
        )  # fmt: skip
        qsl = kwargs.get("query_start_loc")
        kwargs["metadata"] = builder.build(seq_lens, qsl, max_query_len=q_len)
        del kwargs["target"]  # the metadata's
    if page_indices:  # flat slots (expand_page_indices) instead of the block table
        kwargs["page_indices"] = (
            torch.empty((num_seqs + 1,), dtype=torch.int32, device=META),
            torch.empty((num_seqs * MLA_CONTEXT,), dtype=torch.int32, device=META),
        )
    return plan_mla_decode(
        query,
        kv_cache,
        None if page_indices else block_table,
        seq_lens,
        kv_lora_rank=kv_lora_rank,
        scale=head_dim_k**-0.5,
        **kwargs,
    )


# -- the table ------------------------------------------------------------------------------------

GQA_NAMES = {1: "mha", 4: "gqa4", 5: "gqa5", 8: "gqa8"}


# The 512-wide latent tiles of MLA 576/512 spill a little on NVIDIA where the tile is widest:
# measured with Triton 3.6, up to 44 B of spill stores on sm_80's 64-head tile (255 registers at
# 8 warps) and 8 B on sm_86/sm_89's narrow one (threshold: the gate's 16 B + 48). Stated, not
# hidden: the gate fails anything beyond it. The HIP tiles have none (one wave a SIMD over this
# latent: `portattn.policy.mla.HIP_ONE_WAVE_PER_EU`), nor do fp32's on either vendor.
MLA_512_SPILL_ALLOWANCE: tuple[tuple[str, int], ...] = (("cuda", 48),)
MLA_512_SPILL_REASON = "512-wide latent accumulator + tile on NVIDIA (see MLA_512_SPILL_ALLOWANCE)"


# The sm_90 prefill kernel at head_dim 256 (16-bit NHD prefill) holds a 64 x 256 fp32 output a
# consumer warpgroup, 128 registers a thread, under setmaxnreg 240: ptxas spills 72-252 B
# (Triton 3.6, the cases below), outside the tile loop's MMAs at GQA 4:1 (one load among them at
# 5:1). Stated for sm_90 alone: every other target compiles these cases without spills.
SM90_HD256_SPILL_ALLOWANCE: tuple[tuple[str, int], ...] = (("sm_90", 256),)
SM90_HD256_SPILL_REASON = "sm_90 prefill kernel's head_dim-256 output (SM90_HD256_SPILL_ALLOWANCE)"

# At head_dim 64 its turns run three consumer warpgroups: 160 registers a consumer thread and 32 a
# producer's fill the SM's 64 K, so ptxas parks an item's values (the consumers, outside the tile
# loop's MMAs) and, where each box needs a division (paging 0), some of the producer's per tile.
# Stated for sm_90 alone.
SM90_HD64_SPILL_ALLOWANCE: tuple[tuple[str, int], ...] = (("sm_90", 160),)
SM90_HD64_SPILL_REASON = (
    "sm_90 prefill kernel's three warpgroups at head_dim 64 (SM90_HD64_SPILL_ALLOWANCE)"
)


def _paged_allowance(case: Case) -> Case:
    """``case`` with the sm_90 prefill kernel's allowance where that kernel serves it (the
    policy's `sm90_prefill` on the case's problem): at head_dim 256
    (`SM90_HD256_SPILL_ALLOWANCE`), and at head_dim 64 where its config takes three warpgroups
    (`SM90_HD64_SPILL_ALLOWANCE`)."""
    p = dict(case.params)
    elem = getattr(torch, p["dtype"]).itemsize if "dtype" in p else DTYPE.itemsize
    problem = PagedProblem(p["num_q_heads"], p["num_kv_heads"], p["head_dim"], elem,
                           p["max_query_len"], p["block_size"],
                           shuffled=p["layout"] == "SHUFFLE")  # fmt: skip
    sm90 = get_target("sm_90")
    if p["head_dim"] not in (64, 256) or not sm90_prefill(sm90, problem):
        return case
    if p["head_dim"] == 256:
        allowance, reason = SM90_HD256_SPILL_ALLOWANCE, SM90_HD256_SPILL_REASON
    elif prefill_config(sm90, problem).warpgroups == 3:
        allowance, reason = SM90_HD64_SPILL_ALLOWANCE, SM90_HD64_SPILL_REASON
    else:
        return case
    return dataclasses.replace(case, spill_allowance=allowance, spill_reason=reason)


def _mla_case(name: str, dk: int, dv: int, **params: Any) -> Case:
    case = make_case("mla_decode", name, build_mla_decode, head_dim_k=dk, kv_lora_rank=dv, **params)
    if dv < 512 or params.get("dtype") == "float32":  # fp32's narrow tiles compile clean
        return case
    allowance, reason = MLA_512_SPILL_ALLOWANCE, MLA_512_SPILL_REASON
    return dataclasses.replace(case, spill_allowance=allowance, spill_reason=reason)


def mla_cases() -> list[Case]:
    cases = [
        _mla_case(f"{dk}/{dv} h{h}", dk, dv, num_q_heads=h)
        for dk, dv in MLA_SHAPES
        for h in MLA_HEADS
    ]
    # Speculative verification: 3 query tokens per sequence.
    cases.append(_mla_case("576/512 h16 q3", 576, 512, num_q_heads=16, q_len=3))
    # 64-token pages (DeepSeek's): whole tiles come through tensor descriptors on sm_90+ (16 heads
    # of one token: gathered, under the heads as N).
    cases += [
        _mla_case(f"576/512 h{h} page64", 576, 512, num_q_heads=h, block_size=64) for h in (16, 128)
    ]
    # Page size 1 (speculative decoding): 1-token pages by block table and by page_indices; on
    # sm_90 the wide tile's Hopper kernel gathers their rows (policy.mla.sm90_gathers).
    cases += [
        _mla_case(
            f"576/512 h{h} page1 {form}",
            576,
            512,
            num_q_heads=h,
            block_size=1,
            page_indices=form == "slots",
        )
        for h in (16, 128)
        for form in ("table", "slots")
    ]
    # Verification with packed rows (MlaTiles.packed): 4 tokens x 16 heads fill the sm_90 kernel's
    # tile.
    cases.append(
        _mla_case("576/512 h16 q4 page64", 576, 512, num_q_heads=16, q_len=4, block_size=64)
    )
    # A batch that fills the GPU (bench/mla.py's batch of 64): one split, so the sm_90 kernel
    # writes the output itself (bf16, through shared memory) instead of fp32 partial results.
    cases += [
        _mla_case(f"576/512 h128 page{bs} b64", 576, 512, num_q_heads=128, block_size=bs,
                  num_seqs=64)
        for bs in (64, 1)
    ]  # fmt: skip
    cases.append(
        _mla_case("576/512 h16 q8 page64 b64", 576, 512, num_q_heads=16, q_len=8, block_size=64,
                  num_seqs=64)
    )  # fmt: skip
    # rank 256, one split: the output straight from the accumulators (SM90_STORE_SMEM_RANKS)
    cases.append(_mla_case("320/256 h128 page64 b64", 320, 256, num_q_heads=128, block_size=64,
                           num_seqs=64))  # fmt: skip
    # Shapes the Hopper kernel does not take, which the portable kernel runs on sm_90 too: a
    # rank outside its ranks (the portable wide tile), a rope that pads to 128 (also through a
    # metadata builder's tiles), a 32-wide rope and none (the register estimate's rope floor
    # over a 512-wide latent), and ropes of 8 and 24 columns, whose rows (520, 536, 264
    # elements) are no multiple of 16 elements (the kernel addresses them in units of 8).
    cases += [
        _mla_case("448/384 h128 page64", 448, 384, num_q_heads=128, block_size=64),
        _mla_case("600/512 h128 page64", 600, 512, num_q_heads=128, block_size=64),
        _mla_case("600/512 h3 q4 page16", 600, 512, num_q_heads=3, q_len=4, metadata=True),
        _mla_case("544/512 h16", 544, 512, num_q_heads=16),
        _mla_case("512/512 h16", 512, 512, num_q_heads=16),
        _mla_case("520/512 h16", 520, 512, num_q_heads=16),
        _mla_case("536/512 h128 page1", 536, 512, num_q_heads=128, block_size=1),
        _mla_case("264/256 h16 q4 page64", 264, 256, num_q_heads=16, q_len=4, block_size=64),
    ]
    return cases + hip_verify_cases()


def _hip_verify_case(dk: int, dv: int, h: int, q: int, bs: int) -> Case:
    case = make_case(
        "mla_decode",
        f"{dk}/{dv} h{h} q{q} page{bs}{' slots' if bs == 1 else ''} hip",
        build_mla_decode,
        head_dim_k=dk,
        kv_lora_rank=dv,
        num_q_heads=h,
        q_len=q,
        block_size=bs,
        page_indices=bs == 1,
        metadata=True,
    )
    return dataclasses.replace(case, vendors=("hip",))


def hip_verify_cases() -> list[Case]:
    """The HIP targets' verification tiles (packed rows, `portattn.policy.mla`) at 576/512, the
    widest latent: q_len `HIP_VERIFY_QUERY_LENS` x heads `HIP_VERIFY_HEADS` on 64-token pages
    (block table) and 1-token pages (page_indices slots, speculative decoding's form); and the
    rank-256 shapes' 64-row tiles. Compiled for HIP only (the CUDA tiles of these problems are
    in the cases above); none has a spill allowance, q_len 1 (plain decode, the unpacked tile)
    included."""
    cases = [
        _hip_verify_case(576, 512, h, q, bs)
        for h in HIP_VERIFY_HEADS
        for q in HIP_VERIFY_QUERY_LENS
        for bs in (64, 1)
    ]
    return cases + [_hip_verify_case(320, 256, 16, 4, 64), _hip_verify_case(288, 256, 128, 8, 1)]


def paged_cases() -> list[Case]:
    out = []
    for hd in PAGED_HEAD_DIMS:
        for nq, nkv in PAGED_GQA:
            g = GQA_NAMES[nq // nkv]
            for layout in LAYOUTS:
                for bs in BLOCK_SIZES:
                    out.append(
                        make_case(
                            "paged_attention",
                            f"hd{hd} {g} bs{bs} {layout} prefill",
                            build_paged_attention,
                            head_dim=hd,
                            num_q_heads=nq,
                            num_kv_heads=nkv,
                            block_size=bs,
                            layout=layout,
                            max_query_len=PREFILL_CHUNK,
                        )
                    )
                out.append(
                    make_case(
                        "paged_attention",
                        f"hd{hd} {g} bs16 {layout} decode",
                        build_paged_attention,
                        head_dim=hd,
                        num_q_heads=nq,
                        num_kv_heads=nkv,
                        block_size=16,
                        layout=layout,
                        max_query_len=1,
                    )
                )
    out.append(
        make_case(
            "paged_attention",
            "hd128 gqa8 bs16 NHD prefill cache>2GiB",
            build_paged_attention,
            head_dim=128,
            num_q_heads=32,
            num_kv_heads=4,
            block_size=16,
            layout="NHD",
            max_query_len=PREFILL_CHUNK,
            big_cache=True,
        )
    )
    out += [
        make_case(
            "paged_attention",
            f"hd128 gqa4 bs{bs} NHD prefill q{q} long",
            build_paged_attention,
            head_dim=128,
            num_q_heads=32,
            num_kv_heads=8,
            block_size=bs,
            layout="NHD",
            max_query_len=q,
        )
        for q in LONG_PREFILL_QUERY_LENS
        for bs in LONG_PREFILL_BLOCK_SIZES
    ]
    return out


def cache_cases() -> list[Case]:
    out = []
    for kernel, build in (
        ("write_kv_cache", build_write_kv_cache),
        ("gather_kv_cache", build_gather_kv_cache),
    ):
        for hd in CACHE_HEAD_DIMS:
            for layout in LAYOUTS:
                for bs in BLOCK_SIZES:
                    out.append(
                        make_case(
                            kernel,
                            f"hd{hd} bs{bs} {layout}",
                            build,
                            head_dim=hd,
                            block_size=bs,
                            layout=layout,
                        )
                    )
        out.append(
            make_case(
                kernel,
                "hd128 bs16 NHD cache>2GiB",
                build,
                head_dim=128,
                block_size=16,
                layout="NHD",
                big_cache=True,
            )
        )
    return out


# -- every dtype the public ops accept ------------------------------------------------------------

# Where each op declares the floating dtypes it accepts (the constants its validation checks).
_API_DTYPES: dict[str, tuple[str, str]] = {
    "mla_decode": ("portattn.kernels.mla_decode", "FLOAT_DTYPES"),
    "paged_attention": ("portattn.kernels.paged_attention", "_FLOAT_DTYPES"),
    "write_kv_cache": ("portattn.layout", "CACHE_DTYPES"),
    "gather_kv_cache": ("portattn.layout", "CACHE_DTYPES"),
}
# The seeds' shapes at which the non-serving dtypes are compiled (bf16 runs every axis above).
# MLA: every shape at 1, 4, 16 and 128 heads, 16- and 64-token pages (the bulk-copy path), and the
# verification step of 4 heads x 2 tokens on 64-token pages: the two cells that overflowed sm_90's
# shared memory in fp32 on an H100 (320/256 h16 page 64, 288/256 h4 q2 page 64).
EXTRA_MLA_HEADS: tuple[int, ...] = (1, 4, 16, 128)
EXTRA_MLA_PAGES: tuple[int, ...] = (16, 64)
# Paged: GQA 5:1 at every head dim, both layouts, the smallest and the hybrid block, prefill and
# decode. Caches: the narrowest and widest head dims, both layouts, a power-of-two and a hybrid
# block.
EXTRA_PAGED_BLOCKS: tuple[int, ...] = (16, 2048)
EXTRA_CACHE_HEAD_DIMS: tuple[int, ...] = (64, 256)
EXTRA_CACHE_BLOCKS: tuple[int, ...] = (16, 544)
_SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def api_dtypes(kernel: str) -> tuple[str, ...]:
    """The floating dtypes (torch names) the public op ``kernel`` accepts, from its own checks."""
    import importlib

    module, attr = _API_DTYPES[kernel]
    accepted = getattr(importlib.import_module(module), attr)
    return tuple(str(d).removeprefix("torch.") for d in accepted)


def dtype_cases(kernel: str) -> list[Case]:
    """``kernel`` in every dtype it accepts besides bf16, at the seeds' shapes (above)."""
    out: list[Case] = []
    for dtype in api_dtypes(kernel):
        if dtype == DTYPE_NAME:
            continue
        tag = _SHORT[dtype]
        if kernel == "mla_decode":
            for dk, dv in MLA_SHAPES:
                for h in EXTRA_MLA_HEADS:
                    for bs in EXTRA_MLA_PAGES:
                        name = f"{dk}/{dv} h{h} page{bs} {tag}"
                        out.append(
                            _mla_case(name, dk, dv, num_q_heads=h, block_size=bs, dtype=dtype)
                        )
                name = f"{dk}/{dv} h4 q2 page64 {tag}"
                out.append(
                    _mla_case(name, dk, dv, num_q_heads=4, q_len=2, block_size=64, dtype=dtype)
                )
        elif kernel == "paged_attention":
            for hd in PAGED_HEAD_DIMS:
                for layout in LAYOUTS:
                    shapes = [(bs, PREFILL_CHUNK, "prefill") for bs in EXTRA_PAGED_BLOCKS]
                    for bs, q, kind in [*shapes, (16, 1, "decode")]:
                        out.append(
                            make_case(
                                kernel,
                                f"hd{hd} gqa5 bs{bs} {layout} {kind} {tag}",
                                build_paged_attention,
                                head_dim=hd,
                                num_q_heads=40,
                                num_kv_heads=8,
                                block_size=bs,
                                layout=layout,
                                max_query_len=q,
                                dtype=dtype,
                            )
                        )
        else:
            build = build_write_kv_cache if kernel == "write_kv_cache" else build_gather_kv_cache
            for hd in EXTRA_CACHE_HEAD_DIMS:
                for layout in LAYOUTS:
                    for bs in EXTRA_CACHE_BLOCKS:
                        out.append(
                            make_case(
                                kernel,
                                f"hd{hd} bs{bs} {layout} {tag}",
                                build,
                                head_dim=hd,
                                block_size=bs,
                                layout=layout,
                                dtype=dtype,
                            )
                        )
    return out


KERNELS: dict[str, Callable[[], list[Case]]] = {
    "mla_decode": lambda: mla_cases() + dtype_cases("mla_decode"),
    "paged_attention": lambda: [
        _paged_allowance(c) for c in paged_cases() + dtype_cases("paged_attention")
    ],
    "write_kv_cache": lambda: cache_cases() + dtype_cases("write_kv_cache"),
    "gather_kv_cache": lambda: cache_cases() + dtype_cases("gather_kv_cache"),
    "metadata_summary": summary_cases,
}


def default_cases(kernels: Sequence[str] | None = None) -> list[Case]:
    """The matrix's case table, optionally only for ``kernels`` (op names, see `KERNELS`)."""
    names = list(KERNELS) if kernels is None else list(kernels)
    unknown = [k for k in names if k not in KERNELS]
    if unknown:
        raise ValueError(f"compile: kernels must be among {sorted(KERNELS)}; got {unknown}")
    seen: dict[str, Case] = {}
    for name in dict.fromkeys(names):
        for case in KERNELS[name]():
            if case.kernel in names:
                seen.setdefault(case.id, case)
    return list(seen.values())


def select_cases(cases: Sequence[Case], pattern: str | None) -> list[Case]:
    """Cases whose id matches the regular expression ``pattern`` (all when ``None``)."""
    if not pattern:
        return list(cases)
    try:
        rx = re.compile(pattern)
    except re.error as exc:
        msg = f"compile: cases must be a regular expression; got {pattern!r} ({exc})"
        raise ValueError(msg) from exc
    return [c for c in cases if rx.search(c.id)]


# -- the policies' own shared-memory estimates ---------------------------------------------------


def _estimate_paged(launch: Launch) -> int:
    from portattn.policy.paged import estimate_shared_mem

    a = launch.args
    return estimate_shared_mem(
        a["BLOCK_M"],
        a["BLOCK_N"],
        a["BLOCK_D"],
        a["q_ptr"].element_size(),
        launch.options.num_stages,
    )


def _estimate_copy(launch: Launch) -> int:
    from portattn.policy.cache import (
        CacheCopyProblem,
        gather_kv_cache_tiles,
        write_kv_cache_tiles,
    )

    a = launch.args
    fn = write_kv_cache_tiles if launch.name == "write_kv_cache" else gather_kv_cache_tiles
    tokens = int(a["num_tokens"] if "num_tokens" in a else a["total_tokens"])
    problem = CacheCopyProblem(
        tokens, launch.grid[1], a["head_dim"], a["key_cache_ptr"].element_size()
    )
    return fn(launch.target, problem).shared_mem_bytes


def _estimate_mla(launch: Launch) -> int | None:
    from portattn.policy.mla import mla_hip_packed_lds_bytes, mla_smem_bytes

    a = launch.args
    if "BLOCK_DV" not in a or "BLOCK_N" not in a:
        return None  # the split-KV reduce: no tiles through shared memory in the policy's model
    if a.get("PACKED") and launch.target.is_hip:  # the packed HIP tile's own LDS model
        return mla_hip_packed_lds_bytes(
            a["BLOCK_H"], a["BLOCK_N"], a["BLOCK_DV"], a["BLOCK_DPE"], a["q_ptr"].element_size()
        )
    return mla_smem_bytes(
        a["BLOCK_H"],
        a["BLOCK_N"],
        a["BLOCK_DV"],
        a["BLOCK_DPE"],
        launch.options.num_stages,
        a["q_ptr"].element_size(),
        prefetch_rows=bool(a.get("PREFETCH_ROWS", False)),  # as the policy counts its buffers
    )


def _estimate_summary(launch: Launch) -> int:
    from portattn.policy.cache import metadata_summary_tiles

    return metadata_summary_tiles(launch.target, launch.args["max_blocks"]).shared_mem_bytes


_ESTIMATORS: dict[str, Callable[[Launch], int | None]] = {
    "paged_attention": _estimate_paged,
    "write_kv_cache": _estimate_copy,
    "gather_kv_cache": _estimate_copy,
    "mla_decode": _estimate_mla,
    "metadata_summary": _estimate_summary,
}


def policy_estimate(launch: Launch) -> int | None:
    """The policy's shared-memory estimate for the tiles ``launch`` carries (``None``: none)."""
    tiles = getattr(launch, "tiles", None)
    for attr in ("shared_mem_bytes", "smem_bytes"):
        if tiles is not None and hasattr(tiles, attr):
            return int(getattr(tiles, attr))
    fn = _ESTIMATORS.get(launch.name.split(":")[0])
    return None if fn is None else fn(launch)
