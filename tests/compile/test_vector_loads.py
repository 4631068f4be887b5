"""Issue 18 on a CPU: paged attention loads a SHUFFLE cache with vectors as wide as NHD's.

SHUFFLE decode once ran 3.5x slower than NHD on an H100: every K and V element was a scalar
16-bit load (``ld.global.b16``; ``buffer_load_ushort`` on gfx942), which also kept the loads out
of the software pipeline (``cp.async`` moves 4, 8 or 16 bytes). The kernel now states what Triton
cannot see -- SHUFFLE's x-element runs (16 bytes) start on multiples of x -- and loads them as
16-byte vectors. Here the planned launches of both layouts are compiled for sm_90 and gfx942 (no
GPU; in a spawned process, as the compile matrix does) and their global loads counted: no 16-bit
loads, and as many 16-byte ones as NHD at the same tiles.
"""

from __future__ import annotations

import re

import pytest

from portattn.policy.paged import (
    SHUFFLE_NARROW_BLOCK_N,
    SHUFFLE_NARROW_MAX_M,
    SHUFFLE_REG_CAP,
    SHUFFLE_REG_CAP_BLOCK_D,
)
from tests.helpers import in_spawned_workers

pytestmark = pytest.mark.compile

# The bench's decode point (bench/paged.py: 32 q heads, 8 KV heads, head_dim 128, block 16)
# and a chunked prefill of the same heads.
SHAPE = dict(head_dim=128, num_q_heads=32, num_kv_heads=8, block_size=16)
CASES = [("sm_90", 1), ("sm_90", 64), ("gfx942", 1)]

# NVIDIA: 16-byte global loads are `cp.async ... 16` into shared memory (pipelined) or
# `ld.global.v4.b32` into registers; 16-bit ones `ld.global(.nc).b16`.
_PTX_WIDE = re.compile(
    r"cp\.async\.c[ag]\.shared\.global(?:\.\w+)*\s+\[[^\]]*\],\s*\[[^\]]*\],\s*(?:0x10|16)\b"
    r"|ld\.global(?:\.\w+)*\.v4\.(?:b|u|f)32"
)
_PTX_NARROW = re.compile(r"ld\.global(?:\.\w+)*\.(?:b|u|f)16\b")
# AMD: 16-byte buffer/global loads vs 16-bit ones.
_GCN_WIDE = re.compile(r"\b(?:buffer|global)_load_dwordx4\b")
_GCN_NARROW = re.compile(r"\b(?:buffer|global)_load_(?:ushort|short_d16(?:_hi)?)\b")


def _hybrid_launch(target, layout: str, max_query_len: int):
    """A hybrid model's interleaved cache (meta tensors): 48 B of Mamba state a page make the page
    stride a multiple of 8 elements but not of 16, which Triton does not see by itself."""
    import torch

    from portattn.compile.cases import META, NUM_SEQS
    from portattn.kernels.paged_attention import plan_paged_attention
    from portattn.layout import make_hybrid_cache

    hd, hq, hkv, bs = (SHAPE[k] for k in ("head_dim", "num_q_heads", "num_kv_heads", "block_size"))
    hc = make_hybrid_cache(
        64, bs, hkv, hd, mamba_state_bytes=48, layout=layout, dtype=torch.bfloat16, device=META
    )
    q = torch.empty((NUM_SEQS * max_query_len, hq, hd), dtype=torch.bfloat16, device=META)
    meta = dict(dtype=torch.int32, device=META)
    table, lens = torch.empty((NUM_SEQS, 8), **meta), torch.empty((NUM_SEQS,), **meta)
    qsl = torch.empty((NUM_SEQS + 1,), **meta)
    return plan_paged_attention(
        q, hc.key_cache, hc.value_cache, table, lens, qsl, layout=layout, target=target,
        max_query_len=max_query_len,
    )  # fmt: skip


def _loads(arch: str, layout: str, max_query_len: int, hybrid: bool = False) -> dict:
    """Compile the planned launch (worker process) and count its wide and narrow global loads."""
    from portattn.compile.cases import build_paged_attention
    from portattn.compile.worker import _resources, compile_kernel
    from portattn.platform import get_target
    from portattn.policy.paged import PagedConfig

    # the portable kernel's loads: NHD prefill on sm_90 would otherwise take the Gluon prefill
    # kernel, whose K/V come by TMA
    target = get_target(arch)
    if hybrid:
        [launch] = _hybrid_launch(target, layout, max_query_len)
    else:
        [launch] = build_paged_attention(
            target, layout=layout, max_query_len=max_query_len, config=PagedConfig(), **SHAPE
        )
    compiled = compile_kernel(launch, target)
    if target.vendor == "cuda":
        asm, wide, narrow = compiled.asm["ptx"], _PTX_WIDE, _PTX_NARROW
    else:
        asm, wide, narrow = compiled.asm["amdgcn"], _GCN_WIDE, _GCN_NARROW
    regs, spills, _ = _resources(compiled, target)
    a = launch.args
    ttgir = compiled.asm.get("ttgir", "")
    layouts = dict(re.findall(r"^(#blocked\d*) = #ttg\.blocked<\{(.*)\}>", ttgir, re.MULTILINE))
    copy = re.compile(
        r"ttg\.async_copy_global_to_local .*: tensor<([0-9x]+)x!tt\.ptr<\w+>, (#blocked\d*)>"
    )
    copies = sorted({(shape, layouts.get(layout, "")) for shape, layout in copy.findall(ttgir)})
    return dict(
        copies=copies,
        lines=a.get("LINES"),
        wide=len(wide.findall(asm)),
        narrow=len(narrow.findall(asm)),
        regs=regs,
        spills=spills,
        maxnreg=launch.options.maxnreg,
        tiles=(a["BLOCK_M"], a["BLOCK_N"], launch.options.num_warps, launch.options.num_stages),
        vec=(a["K_VEC"], a["V_VEC"]),
        row=(a["K_ROW"], a["V_ROW"]),
    )


@pytest.fixture(scope="module")
def loads() -> dict:
    jobs = [(arch, layout, mql) for arch, mql in CASES for layout in ("NHD", "SHUFFLE")]
    jobs += [("sm_90", "SHUFFLE", 1, True), ("sm_90", "NHD", 1, True), ("gfx942", "NHD", 1, True)]
    return in_spawned_workers(_loads, jobs)


@pytest.mark.parametrize("arch,max_query_len", CASES, ids=[f"{a}-q{q}" for a, q in CASES])
def test_shuffle_loads_are_as_wide_as_nhd(loads, arch, max_query_len):
    nhd = loads[arch, "NHD", max_query_len]
    shuffle = loads[arch, "SHUFFLE", max_query_len]
    assert shuffle["vec"] == (8, 8) and nhd["vec"] == (1, 1)
    # the same tiles (the policy's SHUFFLE register term is 0 since the loads are vectors); the
    # cache-order reads' decode tile at head_dim 128 is held to SHUFFLE_REG_CAP registers (elsewhere
    # it is the narrower KV tile, `SHUFFLE_NARROW_BLOCK_N`)
    want = nhd["tiles"]
    if shuffle["lines"] and want[0] <= SHUFFLE_NARROW_MAX_M:
        if SHAPE["head_dim"] in SHUFFLE_REG_CAP_BLOCK_D:
            assert shuffle["maxnreg"] == SHUFFLE_REG_CAP
            assert nhd["regs"] <= shuffle["regs"] <= SHUFFLE_REG_CAP, (shuffle, nhd)
        else:
            want = (want[0], min(want[1], SHUFFLE_NARROW_BLOCK_N), *want[2:])
    else:
        assert shuffle["maxnreg"] is None
    assert shuffle["tiles"] == want
    assert nhd["narrow"] == 0 and nhd["wide"] > 0
    # no 16-bit K/V element loads, and (on the same tile) every 16-byte load NHD has (SHUFFLE's
    # tail step adds some); the narrower tile's loads are pinned by the copy-shape test below
    assert shuffle["narrow"] == 0 and shuffle["wide"] > 0, shuffle
    if shuffle["tiles"] == nhd["tiles"]:
        assert shuffle["wide"] >= nhd["wide"], (shuffle, nhd)
    # held to 128 registers, ptxas parks one word (4 B) of the capped tile (the gate allows 16)
    assert shuffle["spills"] <= (4 if shuffle["maxnreg"] else 0), shuffle


def test_shuffle_hybrid_pages_load_vectors_too(loads):
    """Page stride 32792 elements (two 16384-element blocks + 24 of state): a multiple of 8, not
    of 16. Only `layout.vector_width` (8) stated with tl.multiple_of makes the runs provably
    16-byte aligned; the loads are then as wide as on a contiguous cache."""
    hybrid = loads["sm_90", "SHUFFLE", 1, True]
    contiguous = loads["sm_90", "SHUFFLE", 1]
    assert hybrid["vec"] == (8, 8)
    assert hybrid["narrow"] == 0 and hybrid["wide"] == contiguous["wide"], (hybrid, contiguous)


@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
def test_nhd_hybrid_pages_load_vectors_too(loads, arch):
    """The same page stride on an NHD cache: Triton saw no alignment of a row's start, so every
    K/V element was a 16-bit load (sm_90: 256 of them, 320 B spilled). The kernel re-expresses
    the strides in units of `layout.row_vector_elems` (8), and the loads are as wide as on a
    contiguous cache, whose strides claim nothing."""
    hybrid = loads[arch, "NHD", 1, True]
    contiguous = loads[arch, "NHD", 1]
    assert hybrid["row"] == (8, 8) and contiguous["row"] == (1, 1)
    assert hybrid["narrow"] == 0 and hybrid["wide"] == contiguous["wide"], (hybrid, contiguous)
    assert hybrid["spills"] == contiguous["spills"] == 0


def _copy_accesses(arch: str, state_bytes: int) -> dict:
    """`write_kv_cache` and `gather_kv_cache` on an NHD hybrid cache with ``state_bytes`` of state
    a page (meta tensors), compiled: their 16-bit and 16-byte global accesses."""
    import torch

    from portattn.compile.worker import _resources, compile_kernel
    from portattn.kernels.kv_cache import plan_gather_kv_cache, plan_write_kv_cache
    from portattn.layout import make_hybrid_cache
    from portattn.platform import get_target

    target, meta = get_target(arch), "meta"
    hc = make_hybrid_cache(64, 16, 8, 128, mamba_state_bytes=state_bytes, layout="NHD",
                           dtype=torch.bfloat16, device=meta)  # fmt: skip
    rows = torch.empty(100, 8, 128, dtype=torch.bfloat16, device=meta)
    index = dict(dtype=torch.int32, device=meta)
    plans = {
        "write": plan_write_kv_cache(rows, rows.clone(), hc.key_cache, hc.value_cache,
                                     torch.empty(100, dtype=torch.int64, device=meta),
                                     target=target),
        "gather": plan_gather_kv_cache(hc.key_cache, hc.value_cache, torch.empty((4, 8), **index),
                                       torch.empty(5, **index), out=(rows, rows.clone()),
                                       target=target),
    }  # fmt: skip
    got = {}
    for op, [launch] in plans.items():
        compiled = compile_kernel(launch, target)
        ptx = compiled.asm["ptx"]
        got[op] = dict(
            narrow=len(re.findall(r"(?:ld|st)\.global(?:\.\w+)*\.b16\b", ptx)),
            wide=len(re.findall(r"(?:ld|st)\.global(?:\.\w+)*\.v4\.b32", ptx)),
            spills=_resources(compiled, target)[1],
            row=(launch.args["K_ROW"], launch.args["V_ROW"]),
        )
    return got


def test_the_cache_copies_move_hybrid_nhd_rows_as_vectors():
    """`write_kv_cache` stored each element of a hybrid NHD page (32 16-bit stores on sm_90,
    8 B spilled) and `gather_kv_cache` loaded each (32 16-bit loads); with the strides said in
    units of 8 (`K_ROW`, `V_ROW`) both move 16-byte vectors, as on a cache without state."""
    got = in_spawned_workers(_copy_accesses, [("sm_90", 48), ("sm_90", 0)])
    hybrid, plain = got["sm_90", 48], got["sm_90", 0]
    for op in ("write", "gather"):
        assert hybrid[op]["row"] == (8, 8) and plain[op]["row"] == (1, 1)
        assert hybrid[op]["narrow"] == 0 and hybrid[op]["wide"] == plain[op]["wide"] > 0, got
        assert hybrid[op]["spills"] == 0, got


def _mla_loads(arch: str, head_dim_k: int) -> dict:
    """The MLA decode launch (16 heads, 16-token pages) compiled; its global loads counted."""
    from portattn.compile.cases import build_mla_decode
    from portattn.compile.worker import _resources, compile_kernel
    from portattn.platform import get_target

    target = get_target(arch)
    launch = build_mla_decode(target, head_dim_k=head_dim_k, kv_lora_rank=512, num_q_heads=16)[0]
    compiled = compile_kernel(launch, target)
    if target.vendor == "cuda":
        asm, narrow = compiled.asm["ptx"], _PTX_NARROW
    else:
        asm, narrow = compiled.asm["amdgcn"], _GCN_NARROW
    return dict(narrow=len(narrow.findall(asm)), spills=_resources(compiled, target)[1],
                vec=launch.args["KV_VEC"])  # fmt: skip


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "gfx942"])
def test_mla_rows_of_520_elements_load_vectors(arch):
    """A 520-wide MLA cache (a rope of 8 over a 512 latent) has rows that start on multiples of
    8 elements, not 16: every latent element was a 16-bit load (133 on sm_90, which spilled
    796 B). Its strides, re-expressed in units of 8 (`KV_VEC`), make them 16-byte loads; the
    16-bit loads left are the query's rope part (16 x 16 elements, one a thread)."""
    [got] = in_spawned_workers(_mla_loads, [(arch, 520)]).values()
    assert got["vec"] == 8 and got["narrow"] <= 4 and got["spills"] == 0, got


def test_shuffle_copies_read_whole_lines_on_sm90(loads):
    """The SHUFFLE decode's pipelined K/V copies (sm_90, `SHUFFLE_LINES_ARCHS`) are tiles in the
    cache's own order, K [runs, tokens * x] and V [runs, head_dim * x], with a warp's 32 threads
    along one run (16 bytes each: 512 contiguous bytes), not across the runs of two tokens (one
    32-byte sector per line: the L2-request bound an H100 profile showed)."""
    shuffle = loads["sm_90", "SHUFFLE", 1]
    assert shuffle["lines"] is True
    block_n = shuffle["tiles"][1]
    runs_k, runs_v, x = SHAPE["head_dim"] // 8, block_n // 8, 8
    want = {f"{runs_k}x{block_n * x}", f"{runs_v}x{SHAPE['head_dim'] * x}"}
    assert {shape for shape, _ in shuffle["copies"]} == want, shuffle["copies"]
    for _, layout in shuffle["copies"]:
        assert "sizePerThread = [1, 8]" in layout and "threadsPerWarp = [1, 32]" in layout, layout
    # gfx942 keeps the earlier reads (Triton's AMD backend scalarizes the cache-order K loads)
    assert loads["gfx942", "SHUFFLE", 1]["lines"] is False
