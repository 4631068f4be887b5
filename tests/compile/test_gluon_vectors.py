"""Issues 18/19 on a CPU: the sm_90 Gluon kernels' warpgroups move rows in vectors.

A `gl.warp_specialize` partition does not see the launch's alignment of its arguments, so its
global accesses went element by element: the MLA kernel's second warpgroup stored its output 2
bytes at a time (10-13 us of a 146 us call on an H100), and one prefill warpgroup loaded its
query and stored its output the same way. The launchers now tell the kernels which rows are
aligned (`kernels._launch.rows_aligned`). Here the planned launches are compiled for sm_90 (no
GPU; in spawned processes, as the compile matrix does) and their PTX's global accesses counted:
aligned rows give no 16-bit element accesses outside the MLA query's rope part, and rows that
are not aligned still compile, to element accesses (the fallback the count must see).
"""

from __future__ import annotations

import re

import pytest

from tests.helpers import in_spawned_workers

pytestmark = pytest.mark.compile

_NARROW_LOAD = re.compile(r"ld\.global(?:\.\w+)*\.(?:b|u|s|f)16\b")
_NARROW_STORE = re.compile(r"st\.global(?:\.\w+)*\.(?:b|u|s|f)16\b")
_VECTOR_STORE = re.compile(r"st\.global(?:\.\w+)*\.v[24]\.b32\b")


def _mla(aligned: bool, block_size: int = 64, heads: int = 128):
    """The bench's point (128 heads, batch 64: one split, the kernel writes the bf16 output);
    ``block_size`` 1: the page-1 cache, whose rows the kernel gathers; ``heads`` 16: the
    16-head point (two splits: the kernel writes fp32 partials)."""
    import torch

    from portattn.kernels.mla_decode import plan_mla_decode
    from portattn.platform import get_target

    meta = dict(device="meta")
    q = torch.empty(64, heads, 576, dtype=torch.bfloat16, **meta)
    pages = 4096 // block_size
    cache = torch.empty(64 * pages + 1, block_size, 576, dtype=torch.bfloat16, **meta)
    bt = torch.empty(64, pages, dtype=torch.int32, **meta)
    sl = torch.empty(64, dtype=torch.int32, **meta)
    out = None if aligned else torch.empty(64, heads, 520, dtype=torch.bfloat16, **meta)[..., 1:513]
    launches = plan_mla_decode(
        q, cache, bt, sl, kv_lora_rank=512, scale=0.05, out=out, target=get_target("sm_90")
    )
    (main,) = [launch for launch in launches if launch.name == "mla_decode_sm90"]
    assert main.args["NUM_SPLITS"] == (1 if heads > 16 else 2) and main.args["OUT_VEC"] is aligned
    return main


def _prefill(aligned: bool, block_size: int = 16, two_warpgroups: bool = False):
    """A mixed batch's prefill part (32 q / 8 KV heads, head_dim 128, 16-token pages) on the
    policy's config, or with ``two_warpgroups`` on the two-warpgroup turns on 128-token tiles at
    3 stages (V by page boxes at 8 boxes a tile, as the policy's rule takes them)."""
    import dataclasses

    import torch

    from portattn.kernels.paged_attention import plan_paged_attention
    from portattn.platform import get_target
    from portattn.policy.paged import PagedConfig, PagedProblem, prefill_config
    from tests.helpers import tile_128

    config = None
    if two_warpgroups:
        target = get_target("sm_90")
        cfg = prefill_config(target, PagedProblem(32, 8, 128, 2, 512, block_size, 64, 4096))
        config = PagedConfig(prefill=dataclasses.replace(cfg, **tile_128(block_size)))
    meta = dict(device="meta")
    tokens = 8 * 512 + 56
    width = 128 if aligned else 129  # a head stride of 129 elements: rows not 16-byte aligned
    q = torch.empty(tokens, 32, width, dtype=torch.bfloat16, **meta)[..., :128]
    out = torch.empty(tokens, 32, width, dtype=torch.bfloat16, **meta)[..., :128]
    pages = 4096 // block_size
    cache = torch.empty(64 * pages + 1, block_size, 8, 128, dtype=torch.bfloat16, **meta)
    bt = torch.empty(64, pages, dtype=torch.int32, **meta)
    sl = torch.empty(64, dtype=torch.int32, **meta)
    qsl = torch.empty(65, dtype=torch.int32, **meta)
    launches = plan_paged_attention(
        q, cache, cache, bt, sl, qsl, out=out, target=get_target("sm_90"), max_query_len=512,
        max_seq_len=4096, config=config,
    )  # fmt: skip
    (main,) = [launch for launch in launches if launch.name == "paged_prefill_sm90"]
    assert (main.args["Q_VEC"], main.args["O_VEC"]) == (aligned, aligned)
    return main


def _accesses(kernel: str, aligned: bool) -> dict:
    """Compile the launch (worker process) and count its global loads and stores by width.
    ``mla-gather``: the MLA launch at page size 1."""
    from portattn.compile.worker import _resources, compile_kernel
    from portattn.platform import get_target

    target = get_target("sm_90")
    if kernel == "mla":
        launch = _mla(aligned)
    elif kernel == "mla-gather":
        launch = _mla(aligned, block_size=1)
    elif kernel == "mla16":
        launch = _mla(aligned, heads=16)
    else:  # "prefill", or "prefill128": 128-token pages (one TMA box a K or V tile); "2wg":
        # the two-warpgroup turns on 128-token tiles
        launch = _prefill(aligned, 128 if kernel.endswith("128") else 16, "2wg" in kernel)
    compiled = compile_kernel(launch, target)
    ptx = compiled.asm["ptx"]
    _, spills, _ = _resources(compiled, target)
    return dict(
        narrow_loads=len(_NARROW_LOAD.findall(ptx)),
        narrow_stores=len(_NARROW_STORE.findall(ptx)),
        vector_stores=len(_VECTOR_STORE.findall(ptx)),
        fma=ptx.count("fma.rn.f32"),
        shuffles=ptx.count("shfl.sync"),
        lazy_branches=len(re.findall(r"bra lazy_skip_\d+;", ptx)),
        gathers=_gather_runs(ptx),
        spills=spills,
        mma_shapes=sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))),
    )


def _gather_runs(ptx: str) -> list[tuple[int, int]]:
    """Each run of ``cp.async`` copies in one basic block: (copies, bar.syncs between its first
    and its last copy)."""
    runs: list[tuple[int, int]] = []
    copies, bars, pending = 0, 0, 0  # pending: bar.syncs since the run's last copy

    def close() -> None:
        if copies:
            runs.append((copies, bars))

    for line in ptx.splitlines():
        if "cp.async.cg.shared.global" in line:
            bars += pending if copies else 0
            copies, pending = copies + 1, 0
        elif "bar.sync" in line:
            pending += 1
        elif line.startswith("$L__BB") or "cp.async.mbarrier.arrive" in line:
            close()
            copies, bars, pending = 0, 0, 0
    close()
    return runs


@pytest.fixture(scope="module")
def accesses() -> dict:
    jobs = [(kernel, aligned) for kernel in ("mla", "prefill") for aligned in (True, False)]
    jobs += [("prefill128", True), ("prefill-2wg", True), ("prefill-2wg128", True)]
    jobs += [("mla-gather", True), ("mla16", True)]
    return in_spawned_workers(_accesses, jobs)


def test_mla_output_goes_out_in_vectors(accesses):
    got = accesses["mla", True]
    # both warpgroups: 16 16-byte stores a thread through shared memory (rank 512)
    assert got["narrow_stores"] == 0 and got["vector_stores"] == 32, got
    # left alone: the query's rope part, read once a program into the score MMA's registers
    # (64 x 64 over a warpgroup: 32 elements a thread, in warpgroup 1 only)
    assert got["narrow_loads"] == 32, got
    assert got["spills"] == 0


def test_mla_16_heads_take_the_heads_as_the_mmas_n(accesses):
    """The 16-head launch (`MlaConfig.heads_n`): every MMA is 64 x 16 (tokens or latent columns
    by heads), none works on padded head rows; the partials go out in 16-byte stores."""
    got = accesses["mla16", True]
    assert got["mma_shapes"] == ["m64n16k16"], got
    assert got["narrow_stores"] == 0 and got["vector_stores"] > 0, got
    assert got["spills"] == 0, got
    # the 128-head launch keeps its 64-row tiles
    assert accesses["mla", True]["mma_shapes"] == ["m64n256k16", "m64n64k16"]


#: Spill bytes of the policy's head_dim-128 prefill build (three warpgroups at 160 registers):
#: the prologue parks the work list's pointer (8 B) and the high word of the output's 64-bit
#: token stride (4 B) for the partitions, reloaded at each partition's start and on the element
#: stores, never in the tile loop.
PREFILL_SPILLS = 12


def test_prefill_query_and_output_go_in_vectors(accesses):
    got = accesses["prefill", True]
    assert got["narrow_loads"] == 0 and got["narrow_stores"] == 0, got
    assert got["spills"] <= PREFILL_SPILLS, got


@pytest.mark.parametrize(
    ("kernel", "scores", "warpgroups"), [("prefill", 32, 3), ("prefill-2wg", 64, 2), ("mla", 32, 2)]
)
def test_scores_are_scaled_inside_the_exponent(accesses, kernel, scores, warpgroups):
    """Each score's exponent argument is one fma: ``scores`` a thread (a 64 x 64 / 64 x 128 /
    64 x 64 tile over a warpgroup) in each warpgroup's code (a warp-specialized partition each).
    Scaling the scores first (an FMUL each before the row max, then a subtraction) gave 4 fmas
    in either kernel."""
    got = accesses[kernel, True]
    assert got["fma"] >= warpgroups * scores, got


@pytest.mark.parametrize("kernel", ["mla", "prefill"])
def test_rows_that_are_not_aligned_fall_back_to_elements(accesses, kernel):
    """The count sees element accesses: rows the launcher cannot vouch for take them."""
    got = accesses[kernel, False]
    assert got["narrow_stores"] > 0, got
    if kernel == "prefill":  # the query too (MLA's unaligned case keeps an aligned query)
        assert got["narrow_loads"] > 0, got


@pytest.mark.parametrize(("kernel", "spills"), [("prefill-2wg", 0), ("prefill", PREFILL_SPILLS)])
def test_prefill_producer_picks_box_rows_without_shuffles(accesses, kernel, spills):
    """The producer warp issues a K and a V copy per box of ``BOX`` rows (on 128-token tiles 8
    boxes a tile on 16-token pages, on the policy's 64-token ones 4; 1 on 128-token pages), each
    at its own page's row. Those rows sit in every thread's registers, so picking one is a
    register move: the kernel has as many warp shuffles (the consumers' row reductions) with 8
    or 4 boxes as with 1. With one box per lane, each pick was a three-shuffle reduction (24
    more at 8 boxes), about 1200 cycles a tile in the producer on an H200: the producer, not the
    tensor cores, then set the pace at 16-token pages."""
    got, one_box = accesses[kernel, True], accesses[kernel + "128", True]
    assert got["shuffles"] == one_box["shuffles"], (got, one_box)
    assert got["spills"] <= spills, got


def test_mla_rescales_branch_around_their_multiplies(accesses):
    """The lazy rescale: each of the four rescales (two a warpgroup) is one branch a thread
    around its 128 multiplies, decided by 8 of its factors. The probes cover both of the thread's
    rows whether its elements run in column pairs per row, alternate rows or run row by row (a
    64-row wgmma accumulator gives each thread rows r and r + 8)."""
    from portattn.kernels._gluon import rescale_asm

    asm, constraints = rescale_asm(128)
    probes = [int(m) - 256 for m in re.findall(r"setp\.neu(?:\.or)?\.f32 %lz, \$(\d+)", asm)]
    assert probes == [0, 1, 2, 3, 64, 65, 66, 67]
    orders = {
        "pairs": [(i // 2) % 2 for i in range(128)],
        "alternating": [i % 2 for i in range(128)],
        "row by row": [i // 64 for i in range(128)],
    }
    for rows in orders.values():
        assert {rows[i] for i in probes} == {0, 1}
    assert len(re.findall(r"mul\.f32 \$(\d+), \$\1, ", asm)) == 128
    assert constraints.split(",")[128:256] == [str(i) for i in range(128)]  # tied in place
    lazy = accesses["mla", True]
    assert lazy["lazy_branches"] == 4 and lazy["spills"] == 0, lazy


def test_mla_gather_issues_its_copies_without_barriers(accesses):
    """At page size 1 each gathered buffer (a latent half, the rope part) is one ``cp.async``
    op, so a tile half's copies (20 a thread on the left with the rope part, 16 on the right)
    run with no ``bar.sync`` between them: the issuing warpgroup's four warps do not wait for
    one another mid-issue (one op per 64-column block got a barrier between blocks)."""
    one = accesses["mla-gather", True]
    assert {c for c, _ in one["gathers"]} == {16, 20}, one["gathers"]
    assert all(b == 0 for _, b in one["gathers"]), one["gathers"]
    assert one["spills"] == 0
