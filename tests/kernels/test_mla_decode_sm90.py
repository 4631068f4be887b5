"""The sm_90 MLA kernel on a CPU: which launches it takes, and its compile for sm_90 (shared
memory within the estimate, no spills). Its numerics run on the GPU (test_mla_decode.py,
``-k sm90``): Triton's interpreter cannot run Gluon."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from portattn.compile import default_cases
from portattn.compile.worker import compile_kernel
from portattn.kernels._launch import rows_aligned
from portattn.kernels.mla_decode import plan_mla_decode
from portattn.kernels.mla_decode_sm90 import (
    sm90_errors,
    sm90_gathers,
    sm90_smem_bytes,
    trace_elements,
)
from portattn.platform import get_target
from portattn.policy.mla import MlaConfig
from tests.helpers import compile_in_spawned_workers, in_spawned_workers, target_compile

SM90 = get_target("sm_90")


def _cache(pages=4, block_size=64, width=576, dtype=torch.bfloat16):
    return torch.empty(pages, block_size, width, dtype=dtype, device="meta")


def test_takes_the_deepseek_shape():
    assert sm90_errors(_cache(), 512, 64, 64, SM90, paged_slots=False) == []
    assert sm90_errors(_cache(width=320), 256, 64, 64, SM90, paged_slots=False) == []


@pytest.mark.parametrize(
    ("kwargs", "rank", "tile", "target", "slots", "why"),
    [
        ({}, 512, (64, 64), get_target("sm_80"), False, "target sm_80 is not sm_90"),
        ({"dtype": torch.float32}, 512, (64, 64), SM90, False, "is not fp16/bf16"),
        ({}, 512, (16, 64), SM90, False, "tile H16 N64 is not H64 N64"),
        ({"width": 128}, 64, (64, 64), SM90, False, "kv_lora_rank 64 not in 128/256/512"),
        ({"width": 560}, 512, (64, 64), SM90, False, "rope width 48"),
        ({"width": 640}, 512, (64, 64), SM90, False, "shared memory"),
        ({"pages": 2**25, "block_size": 64}, 512, (64, 64), SM90, False, "cache rows >= 2^31"),
        ({"pages": 2**31, "block_size": 1}, 512, (64, 64), SM90, True, "cache rows >= 2^31"),
    ],
)
def test_refuses_what_it_cannot_run(kwargs, rank, tile, target, slots, why):
    errors = sm90_errors(_cache(**kwargs), rank, *tile, target, paged_slots=slots)
    assert any(why in e for e in errors), errors


@pytest.mark.parametrize(
    ("block_size", "slots", "gathers"),
    [(64, False, False), (128, False, False), (1, False, True), (16, False, True),
     (32, False, True), (1, True, True), (64, True, True)],
)  # fmt: skip
def test_gather_takes_what_tma_cannot(block_size, slots, gathers):
    """Pages that are not a multiple of 64 tokens and page_indices load by row gather, pages
    of a multiple of 64 tokens by TMA, except under the heads as N, which always gather: the
    kernel takes both."""
    cache = _cache(pages=4096 // block_size, block_size=block_size)
    assert sm90_gathers(cache, slots, False) is gathers
    assert sm90_gathers(cache, slots, True)
    assert sm90_errors(cache, 512, 64, 64, SM90, paged_slots=slots) == []


def _plan(block_size, slots, heads=128, ctx=4096, seqs=4, **more):
    meta = dict(device="meta")
    q = torch.empty(seqs, heads, 576, dtype=torch.bfloat16, **meta)
    cache = _cache(pages=seqs * ctx // block_size + 1, block_size=block_size)
    sl = torch.empty(seqs, dtype=torch.int32, **meta)
    kw = dict(kv_lora_rank=512, scale=0.05, target=SM90, **more)
    if slots:
        pages = (torch.empty(seqs + 1, dtype=torch.int32, **meta),
                 torch.empty(seqs * ctx, dtype=torch.int32, **meta))  # fmt: skip
        return plan_mla_decode(q, cache, None, sl, page_indices=pages, **kw)
    bt = torch.empty(seqs, ctx // block_size, dtype=torch.int32, **meta)
    return plan_mla_decode(q, cache, bt, sl, **kw)


@pytest.mark.parametrize(("block_size", "slots"), [(1, True), (1, False), (16, False), (64, True)])
def test_launcher_picks_the_gather(block_size, slots):
    """The wide tile runs the Hopper kernel in gather mode at page size 1 (both index forms)
    and 16-token pages; 64-token block tables keep TMA."""
    main = _plan(block_size, slots)[0]
    assert (main.name, main.args["GATHER"], main.args["PAGE_INDICES"]) == (
        "mla_decode_sm90",
        True,
        slots,
    )
    assert main.args["stride_kv_row"] == 576
    assert _plan(64, False)[0].args["GATHER"] is False


@pytest.mark.parametrize(("block_size", "slots"), [(1, True), (1, False), (64, False)])
def test_sixteen_heads_run_the_hopper_kernel(block_size, slots):
    """16 heads of one token take the Hopper kernel through the planner at any page size,
    with the heads as N, and gather their rows, 64-token pages included."""
    main = _plan(block_size, slots, heads=16, seqs=64)[0]
    assert main.name == "mla_decode_sm90"
    assert main.args["GATHER"] and main.args["HEADS_N"] and main.args["NUM_SPLITS"] == 2


def test_sixteen_heads_on_a_cache_it_cannot_run_keep_the_narrow_tile():
    """A cache the Hopper kernel refuses (pages not one after another) plans the portable
    kernel's narrow tile below 64 heads (`MlaProblem.sm90_ready`), not the wide one."""
    q = torch.empty(64, 16, 576, dtype=torch.bfloat16, device="meta")
    # page stride 576: the rows of one page lie 4097 rows apart
    cache = torch.empty(128, 4097, 576, dtype=torch.bfloat16, device="meta").transpose(0, 1)
    sl = torch.empty(64, dtype=torch.int32, device="meta")
    bt = torch.empty(64, 64, dtype=torch.int32, device="meta")
    assert sm90_errors(cache, 512, 64, 64, SM90, False)
    main = plan_mla_decode(q, cache, bt, sl, kv_lora_rank=512, scale=0.05, target=SM90)[0]
    assert main.name == "mla_decode" and main.args["BLOCK_H"] == 16


def test_refuses_interleaved_pages():
    cache = torch.empty(64, 4, 576, dtype=torch.bfloat16, device="meta").transpose(0, 1)
    assert any(
        "not pages one after another" in e for e in sm90_errors(cache, 512, 64, 64, SM90, False)
    )


@pytest.mark.parametrize(
    "name",
    [
        "576/512 h128 page64",  # split partial results (fp32)
        "576/512 h128 page64 b64",  # one split: the output through shared memory
        "576/512 h128 page1 b64",
        "576/512 h16 q8 page64 b64",  # packed rows, one split
        "320/256 h128 page64 b64",  # one split at rank 256: the output from the accumulators
    ],
)
@target_compile
def test_compiles_for_sm90_within_its_estimate_without_spills(name):
    """Shared memory at most `sm90_smem_bytes` (and the target's), and no spills: ptxas spilled
    260 B when the loop's shared-memory descriptors were loop-invariant (module doc)."""
    case = {c.id: c for c in default_cases()}[f"mla_decode/{name}"]
    (cell,) = compile_in_spawned_workers([case], ["sm_90"])  # spawned workers: no interpreter
    (r,) = [launch for launch in cell.launches if launch.name == "mla_decode_sm90"]
    assert r.ok, r.error
    assert r.shared <= sm90_smem_bytes(512, 64) <= SM90.max_shared_mem
    assert r.spills == 0


@pytest.mark.parametrize("form", ["table", "slots"])
@target_compile
def test_gather_compiles_for_sm90_without_spills(form):
    """Page size 1 by row gather (1-token block table, page_indices): within the estimate, no
    spills (block_size 1 is a Triton constant, so the opaque zero comes from the row stride)."""
    case = {c.id: c for c in default_cases()}[f"mla_decode/576/512 h128 page1 {form}"]
    (cell,) = compile_in_spawned_workers([case], ["sm_90"])
    (r,) = [launch for launch in cell.launches if launch.name == "mla_decode_sm90"]
    assert r.ok, r.error
    assert r.shared <= sm90_smem_bytes(512, 64) <= SM90.max_shared_mem
    assert r.spills == 0


@pytest.mark.parametrize(
    ("width", "view", "ok"),
    [
        (576, lambda t: t, True),
        (1152, lambda t: t[..., ::2], False),  # head dim not contiguous
        (577, lambda t: t[..., :576], False),  # head stride 1154 B: not 16-byte aligned
        (584, lambda t: t[..., :576], True),  # head stride 1168 B
        (576, lambda t: t[:, 1:], True),  # base offset 1152 B
    ],
)
def test_rows_aligned_needs_contiguous_16_byte_rows(width, view, ok):
    q = view(torch.empty(4, 17, width, dtype=torch.bfloat16))
    assert rows_aligned(q) is ok


def _policy_tiles(q, kv_lora_rank=512):
    """The policy's sm_90 tiles for ``q`` (tokens x heads x head dim) at 4k context."""
    from portattn.policy.mla import MlaProblem, mla_decode_tiles

    problem = MlaProblem(q.shape[1], q.shape[2], kv_lora_rank, 2, q.shape[0], 4096)
    return mla_decode_tiles(SM90, problem)


def test_launch_takes_the_config_and_the_output_alignment():
    """16-byte output stores only into aligned rows (``OUT_VEC``, the one-split output or the
    partial results); the output through shared memory as the config says (the policy's:
    `mla_config`, or the one passed)."""
    meta = dict(device="meta")
    cache = _cache(pages=65, block_size=64)
    sl = torch.empty(4, dtype=torch.int32, **meta)
    bt = torch.empty(4, 16, dtype=torch.int32, **meta)
    kw = dict(kv_lora_rank=512, scale=0.05, target=SM90)
    q = torch.empty(4, 128, 576, dtype=torch.bfloat16, **meta)
    main = plan_mla_decode(q, cache, bt, sl, **kw)[0]
    assert main.args["NUM_SPLITS"] > 1
    assert (main.args["STORE_SMEM"], main.args["OUT_VEC"]) == (True, True)
    one = dict(kw, tiles=dataclasses.replace(_policy_tiles(q), num_kv_splits=1))
    odd_out = torch.empty(4, 128, 520, dtype=torch.bfloat16, **meta)[..., 1:513]
    assert plan_mla_decode(q, cache, bt, sl, out=odd_out, **one)[0].args["OUT_VEC"] is False
    assert plan_mla_decode(q, cache, bt, sl, **one)[0].args["OUT_VEC"] is True
    off = plan_mla_decode(q, cache, bt, sl, config=MlaConfig(store_smem=False), **one)[0]
    assert off.args["STORE_SMEM"] is False


def test_heads_as_n_is_refused_where_the_launch_cannot_take_it():
    """A config asking for the heads as the MMAs' N is refused, naming the rule, where the
    launch has more than 16 heads or packs a verification step's (token, head) rows."""
    meta = dict(device="meta")
    cache = _cache(pages=65, block_size=64)
    sl = torch.empty(4, dtype=torch.int32, **meta)
    bt = torch.empty(4, 16, dtype=torch.int32, **meta)
    kw = dict(kv_lora_rank=512, scale=0.05, target=SM90, config=MlaConfig(heads_n=True))
    q = torch.empty(4, 32, 576, dtype=torch.bfloat16, **meta)
    with pytest.raises(ValueError, match=r"config.heads_n must be False at 32 heads"):
        plan_mla_decode(q, cache, bt, sl, **kw)
    q = torch.empty(16, 16, 576, dtype=torch.bfloat16, **meta)
    qsl = torch.empty(5, dtype=torch.int32, **meta)
    with pytest.raises(ValueError, match=r"config.heads_n must be False where the launch packs"):
        plan_mla_decode(q, cache, bt, sl, query_start_loc=qsl, **kw)
    q = torch.empty(4, 16, 576, dtype=torch.bfloat16, **meta)
    main = plan_mla_decode(q, cache, bt, sl, **kw)[0]
    assert (main.args["HEADS_N"], main.args["BLOCK_H"]) == (True, 16)


@pytest.mark.parametrize("step_q_len", [1, 4])
def test_a_builders_packed_tiles_keep_the_64_row_schedule(step_q_len):
    """A metadata builder sized for verification (max_query_len 8) packs its tiles; a step of
    one token a sequence then runs those tiles, so the policy's config keeps the heads off the
    MMAs' N (the kernel has no packed heads-as-N schedule), and a config asking for it is
    refused by name."""
    from portattn.mla_metadata import MlaMetadataBuilder

    meta = dict(device="meta")
    builder = MlaMetadataBuilder(
        SM90, max_batch=8, num_heads=16, kv_lora_rank=512, head_dim_k=576,
        dtype=torch.bfloat16, max_query_len=8, max_seq_len=32768, **meta,
    )  # fmt: skip
    sl = torch.empty(4, dtype=torch.int32, **meta)
    qsl = torch.empty(5, dtype=torch.int32, **meta)
    md = builder.build(sl, qsl, max_query_len=step_q_len)
    assert md.tiles.packed and md.decode is (step_q_len == 1)
    q = torch.empty(4 * step_q_len, 16, 576, dtype=torch.bfloat16, **meta)
    bt = torch.empty(4, 16, dtype=torch.int32, **meta)
    kw = dict(kv_lora_rank=512, scale=0.05, query_start_loc=qsl, metadata=md, target=SM90)
    main = plan_mla_decode(q, _cache(pages=65), bt, sl, **kw)[0]
    assert main.name == "mla_decode_sm90"
    assert (main.args["PACKED"], main.args["HEADS_N"], main.args["BLOCK_H"]) == (True, False, 64)
    with pytest.raises(ValueError, match=r"config.heads_n must be False where the launch packs"):
        plan_mla_decode(q, _cache(pages=65), bt, sl, config=MlaConfig(heads_n=True), **kw)


@pytest.mark.parametrize(("dtype", "dk", "rank"), [(torch.bfloat16, 576, 512),
                                                   (torch.float16, 320, 256)])  # fmt: skip
def test_launch_layouts_are_the_default_ones_for_its_widths(dtype, dk, rank):
    """The shared layouts a launch carries (built once per dtype and widths) are Gluon's defaults
    for its latent half, rope, query half, P and query rope tiles, whichever launch asked first;
    16 heads take the heads-as-N tiles (16 query rows, P as 64 tokens x 16 heads)."""
    from triton.experimental.gluon import language as gl

    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]

    def want(bh: int, p: list[int]) -> dict:
        return {
            "Q_LAYOUT": gl.NVMMASharedLayout.get_default_for([bh, rank // 2], gl_dtype),
            "P_LAYOUT": gl.NVMMASharedLayout.get_default_for(p, gl_dtype),
            "QPE_LAYOUT": gl.NVMMASharedLayout.get_default_for([bh, dk - rank], gl_dtype),
            "BLOCK_H": bh,
            "HEADS_N": bh == 16,
        }

    lat = gl.NVMMASharedLayout.get_default_for([64, rank // 2], gl_dtype)
    pe = gl.NVMMASharedLayout.get_default_for([64, dk - rank], gl_dtype)
    for heads, expect in ((16, want(16, [64, 16])), (128, want(64, [64, 64]))):
        q = torch.empty(4, heads, dk, dtype=dtype, device="meta")
        bt = torch.empty(4, 16, dtype=torch.int32, device="meta")
        sl = torch.empty(4, dtype=torch.int32, device="meta")
        cache = _cache(pages=65, width=dk, dtype=dtype)
        main = plan_mla_decode(q, cache, bt, sl, kv_lora_rank=rank, scale=0.05, target=SM90)[0]
        assert main.name == "mla_decode_sm90"
        assert {k: main.args[k] for k in expect} == expect
        assert (main.args["lat_desc"].layout, main.args["pe_desc"].layout) == (lat, pe)
        assert main.args["lat_desc"].block_shape == [64, rank // 2]


@pytest.mark.parametrize(
    ("config", "error", "match"),
    [
        ({"store_smem": True}, TypeError, r"mla_decode: config must be None or an MlaConfig; got"),
        (MlaConfig(store_smem=True), ValueError,
         r"mla_decode: config.store_smem must be False at kv_lora_rank 256 \(the shared-memory "
         r"store is built for ranks \(512,\)\); got True"),
    ],
)  # fmt: skip
def test_config_is_validated(config, error, match):
    meta = dict(device="meta")
    q = torch.empty(4, 128, 320, dtype=torch.bfloat16, **meta)
    bt = torch.empty(4, 16, dtype=torch.int32, **meta)
    sl = torch.empty(4, dtype=torch.int32, **meta)
    with pytest.raises(error, match=match):
        plan_mla_decode(q, _cache(pages=65, width=320), bt, sl, kv_lora_rank=256, scale=0.05,
                        target=SM90, config=config)  # fmt: skip
    with pytest.raises(TypeError, match="MlaConfig: store_smem must be a bool; got int"):
        MlaConfig(store_smem=1)  # type: ignore[arg-type]


def test_trace_builds_traced_launches_only_when_given():
    """The diagnostic trace is a launch option: given, the launch stamps into the buffer;
    without it, the kernel is built without the stamps."""
    main = _plan(64, False)[0]
    assert main.args["TRACE"] is False
    buf = torch.empty(trace_elements(main.grid[0]), dtype=torch.int64, device="meta")
    main = _plan(64, False, trace=buf)[0]
    assert main.args["TRACE"] is True and main.args["trace_ptr"] is buf


def test_output_through_shared_memory_only_at_the_rank_a_gpu_ran():
    """`SM90_STORE_SMEM_RANKS`: rank 512 writes through shared memory, rank 256 from the
    accumulators (its read-back layout never ran on a GPU)."""
    meta = dict(device="meta")
    sl = torch.empty(4, dtype=torch.int32, **meta)
    bt = torch.empty(4, 16, dtype=torch.int32, **meta)
    for dk, rank, smem in ((576, 512, True), (320, 256, False)):
        q = torch.empty(4, 128, dk, dtype=torch.bfloat16, **meta)
        cache = _cache(pages=65, block_size=64, width=dk)
        tiles = dataclasses.replace(_policy_tiles(q, rank), num_kv_splits=1)
        main = plan_mla_decode(q, cache, bt, sl, kv_lora_rank=rank, scale=0.05, target=SM90,
                               tiles=tiles)[0]  # fmt: skip
        assert (main.name, main.args["STORE_SMEM"]) == ("mla_decode_sm90", smem)


@pytest.mark.parametrize(
    ("trace", "heads", "error", "match"),
    [
        (torch.empty(16, dtype=torch.int64, device="meta"), 128, ValueError,
         "mla_decode: trace must be a contiguous int64 tensor on meta of at least 1052672 "
         "elements"),
        # stamped flat from its first element: an expanded view took them past its own
        (torch.empty(1, dtype=torch.int64, device="meta").expand(1 << 24), 128, ValueError,
         "mla_decode: trace must be a contiguous int64 tensor on meta .* strides \\(0,\\)"),
        (torch.empty(16, dtype=torch.int32, device="meta"), 128, TypeError,
         "mla_decode: trace must be None or an int64 tensor; got tensor of dtype torch.int32"),
        (torch.empty(16, dtype=torch.int64), 128, ValueError,
         "mla_decode: trace must be on query's device meta; got cpu"),
        (torch.empty(1 << 24, dtype=torch.int64, device="meta"), 16, ValueError,
         "mla_decode: trace must be None where the launch runs the portable kernel"),
    ],
)  # fmt: skip
def test_trace_is_validated(trace, heads, error, match):
    """16 heads: the narrow tile of a cache the Hopper kernel cannot run, passed as the tiles."""
    from portattn.policy.mla import MlaProblem, mla_decode_tiles

    more = {}
    if heads == 16:
        narrow = MlaProblem(16, 576, 512, 2, 64, 4096, sm90_ready=False)
        more["tiles"] = mla_decode_tiles(SM90, narrow)
    with pytest.raises(error, match=match):
        _plan(64, False, heads=heads, seqs=64 if heads == 16 else 4, trace=trace, **more)


def _case_ptx(name: str) -> str:
    """The PTX of the compile matrix case ``name``'s sm_90 launch (in a spawned worker: no
    interpreter)."""
    case = {c.id: c for c in default_cases()}[f"mla_decode/{name}"]
    (launch,) = [x for x in case.plan(SM90) if x.name == "mla_decode_sm90"]
    return compile_kernel(launch, SM90).asm["ptx"]


def _events(ptx: str) -> str:
    """The PTX's steps in order, one letter each, runs of S V C M X merged: "S" a 64x64 score
    MMA, "V" a 64x256 PV MMA, "G" a wgmma commit, "C" a TMA copy, "P" a bulk L2 prefetch, "M" a
    -inf select (the score masks), "W" an mbarrier wait, "X" a shuffle (row max or sum), "L" a
    lazy rescale's skip branch, "B" another predicated branch."""
    kinds = [("S", "wgmma.mma_async.sync.aligned.m64n64k16"),
             ("V", "wgmma.mma_async.sync.aligned.m64n256k16"), ("C", "cp.async.bulk.tensor"),
             ("G", "wgmma.commit_group"), ("M", "0fFF800000"), ("W", "mbarrier.try_wait"),
             ("P", "cp.async.bulk.prefetch.L2"),
             ("X", "shfl.sync.bfly"), ("L", "bra lazy_skip")]  # fmt: skip
    out = []
    for line in ptx.splitlines():
        kind = next((k for k, pat in kinds if pat in line), None)
        if kind is None and re.match(r"\s*@%p\d+ bra\s", line):
            kind = "B"
        if kind and not (kind in "SVCMX" and out and out[-1] == kind):
            out.append(kind)
    return "".join(out)


def _after_scores(ev: str) -> list[str]:
    """Each warpgroup's steps from its last score commit (the rope part's, after the two latent
    halves') to its first PV MMA."""
    return [ev[i + 4 : ev.index("V", i)] for i in range(len(ev) - 4)
            if ev[i : i + 4] == "SGSG" and ev[i + 4] != "S"]  # fmt: skip


@target_compile
def test_only_the_last_tile_is_masked():
    """Each warpgroup, once its scores are in, prefetches its next tile into L2, then branches
    before its mask selects (a full tile skips them). Then warpgroup 0 (its code comes first)
    takes its row max and sum and rescales, warpgroup 1 waits for m_A first."""
    ptx = in_spawned_workers(_case_ptx, [("576/512 h128 page64",)])[("576/512 h128 page64",)]
    assert _after_scores(_events(ptx)) == ["PBMXLB", "PBMWXWLB"]
    assert ptx.count("cp.async.bulk.prefetch.L2.global") == 2  # those two, no other


@target_compile
def test_gathered_rows_prefetch_nothing():
    """The L2 prefetch is the TMA path's (one a warpgroup, `test_only_the_last_tile_is_masked`);
    gathered rows (page size 1) issue none."""
    got = in_spawned_workers(_case_ptx, [("576/512 h128 page1 table",)])
    assert "cp.async.bulk.prefetch" not in got[("576/512 h128 page1 table",)]


@pytest.mark.parametrize("metadata", [True, False])
def test_a_cache_the_hopper_kernel_cannot_read_runs_the_portable_wide_tile_at_32_tokens(metadata):
    """A builder plans the Hopper kernel's 64 x 64 tile before it sees the cache; on a cache
    whose pages are not back to back (one row of padding a page) that kernel cannot run, and
    the portable kernel ran the 64 x 64 tile, which spilled 232 B on sm_90: it runs 32 tokens,
    with the workspaces the builder sized."""
    from portattn.mla_metadata import MlaMetadataBuilder

    meta = dict(device="meta")
    padded = torch.empty(65, 65, 576, dtype=torch.bfloat16, **meta)[:, :64]
    assert sm90_errors(padded, 512, 64, 64, SM90, paged_slots=False)
    sl = torch.empty(4, dtype=torch.int32, **meta)
    q = torch.empty(4, 128, 576, dtype=torch.bfloat16, **meta)
    bt = torch.empty(4, 16, dtype=torch.int32, **meta)
    kw: dict = dict(kv_lora_rank=512, scale=0.05, target=SM90)
    if metadata:
        builder = MlaMetadataBuilder(
            SM90, max_batch=8, num_heads=128, kv_lora_rank=512, head_dim_k=576,
            dtype=torch.bfloat16, max_seq_len=32768, **meta,
        )  # fmt: skip
        kw["metadata"] = md = builder.build(sl)
        assert (md.tiles.block_n, md.tiles.sm90_kernel) == (64, True)
    main = plan_mla_decode(q, padded, bt, sl, **kw)[0]
    assert main.name == "mla_decode"
    assert (main.args["BLOCK_H"], main.args["BLOCK_N"]) == (64, 32)
    assert plan_mla_decode(q, _cache(pages=65), bt, sl, **kw)[0].name == "mla_decode_sm90"
