"""The sm_90 prefill kernel (issue 19): which launches a plan takes, its work list (run by the
interpreter on a CPU), its compile for sm_90 (no spills, shared memory within the estimate), and,
on an H100, its numerics against the fp64 oracle (`gpu`). Triton's interpreter cannot run Gluon."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from portattn.compile import default_cases, run_matrix
from portattn.kernels._launch import Launch
from portattn.kernels.paged_attention import paged_attention, plan_paged_attention
from portattn.kernels.paged_prefill_sm90 import (
    _work_list_kernel,
    box_rows,
    launch_tile,
    paging,
    program_items,
    sm90_prefill_errors,
    smem_bytes,
    split_short,
    v_pages,
    work_list_layout,
)
from portattn.platform import get_target
from portattn.policy import paged as paged_policy
from portattn.policy.common import LaunchOptions
from portattn.policy.paged import SM90_PREFILL_TILES, PagedProblem, sm90_prefill
from tests.kernels.test_paged_attention import check, make_batch

pytestmark = pytest.mark.paged

SM90 = get_target("sm_90")
META = dict(device="meta")


def _plan(*, heads=(32, 8), head_dim=128, block_size=16, dtype=torch.bfloat16, mql=512,
          seqs=64, ctx=4096, layout="NHD", cache=None, target=SM90):  # fmt: skip
    hq, hkv = heads
    q = torch.empty(8 * mql + seqs - 8, hq, head_dim, dtype=dtype, **META)
    if cache is None:
        cache = torch.empty(seqs * ctx // block_size + 1, block_size, hkv, head_dim, dtype=dtype,
                            **META)  # fmt: skip
    bt = torch.empty(seqs, -(-ctx // block_size), dtype=torch.int32, **META)
    sl = torch.empty(seqs, dtype=torch.int32, **META)
    qsl = torch.empty(seqs + 1, dtype=torch.int32, **META)
    return plan_paged_attention(q, cache, cache, bt, sl, qsl, target=target, layout=layout,
                                max_query_len=mql, max_seq_len=ctx)  # fmt: skip


def _names(launches: list[Launch]) -> list[str]:
    return [launch.name for launch in launches]


@pytest.fixture
def sequential_tile(monkeypatch):
    """Head_dim 128's tile as before the sixteenth session (sequential, 2 stages): for the rules
    of the loop without turns (late release, V pages, the trace's stamps)."""
    tiles = dict(paged_policy.SM90_PREFILL_TILES)
    tiles[128] = paged_policy.Sm90PrefillTile(block_n=128, stages=2)
    monkeypatch.setattr(paged_policy, "SM90_PREFILL_TILES", tiles)


MIXED = ["paged_attention:work_list", "paged_prefill_sm90", "paged_attention:decode"]


def test_mixed_batch_takes_the_sm90_kernel_and_the_decode_tile(monkeypatch):
    monkeypatch.setattr(paged_policy, "SM90_PREFILL_FUSE_DECODE", False)
    launches = _plan()
    assert _names(launches) == MIXED
    work, main, dec = launches
    # the op's output is every launch's: the plan cache returns the first launch's outputs
    assert work.outputs == main.outputs == dec.outputs
    assert main.grid == (SM90.num_sms,)
    assert main.args["BLOCK_Q"] == 32 and main.args["HEAD_TILE"] == 4  # 128 rows, GQA 4:1
    assert main.args["BOX"] == 16 and main.args["rows_per_page"] == 16
    # the decode launch serves the decode row tile alone: no main-tile program
    assert dec.args["num_q_tiles"] == 0 and dec.args["DECODE_ROLE"]
    assert dec.grid == (8 * 64,)
    # sequences the decode tile serves are left out of the work list
    assert work.args["q_len_lo"] == work.args["q_len_min"] == dec.args["DEC_BLOCK_Q"]


def test_fused_decode_has_no_decode_launch(monkeypatch):
    monkeypatch.setattr(paged_policy, "SM90_PREFILL_FUSE_DECODE", True)
    launches = _plan()
    assert _names(launches) == MIXED[:2]
    work, main = launches
    # the decode tile's sequences (q_len <= 4) form the work list's second list
    assert work.args["q_len_lo"] == 4 and work.args["q_len_min"] == 0
    assert main.args["b_off"] == work.args["b_off"] == 2 + 64 * work.args["num_q_tiles"]
    assert main.args["counter"] == work.args["counter"] == 2 + 2 * 64 * work.args["num_q_tiles"]


@pytest.mark.parametrize(("block_size", "box"), [(16, 16), (80, 16), (544, 32), (2048, 128)])
def test_boxes_never_cross_a_page(block_size, box):
    assert box_rows(block_size, 128) == box
    (main,) = [launch for launch in _plan(block_size=block_size) if "sm90" in launch.name]
    assert main.args["BOX"] == box and block_size % box == 0


@pytest.mark.parametrize(
    ("block_size", "want"), [(16, 1), (32, 1), (128, 1), (80, 0), (48, 0), (544, 2), (2048, 2)]
)
def test_paging_takes_no_division_a_box_where_it_can(block_size, want, monkeypatch):
    """The producer's page lookup (`paging`): a box a page (16-128-token pages), pages of a tile
    or more (one division a tile), a division a box only for pages shorter than a tile in boxes
    of another size (80 = 5 boxes of 16); switched off, a division a box everywhere."""
    (main,) = [launch for launch in _plan(block_size=block_size) if "sm90" in launch.name]
    assert main.args["PAGING"] == want
    assert paging(block_size, main.args["BOX"], main.args["BLOCK_N"]) == want
    monkeypatch.setattr(paged_policy, "SM90_PREFILL_PAGING", False)
    (main,) = [launch for launch in _plan(block_size=block_size) if "sm90" in launch.name]
    assert main.args["PAGING"] == 0


def test_pure_prefill_has_no_decode_launch():
    # MHA: a 128-row tile is 128 tokens of one head; the decode tile serves q_len <= 16
    launches = _plan(heads=(16, 16), mql=4096, seqs=8)
    assert _names(launches)[:2] == MIXED[:2]
    main = launches[1]
    assert main.args["BLOCK_Q"] == 128 and main.args["HEAD_TILE"] == 1 and main.args["SLOTS"] == 16


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"target": get_target("sm_80")}, None),
        ({"target": get_target("sm_100")}, None),
        ({"dtype": torch.float32}, None),
        ({"head_dim": 256}, None),
        ({"mql": 8}, None),  # 32 rows: a verification step stays on the portable tiles
        ({"block_size": 1}, "block_size 1 is not a multiple of 16"),
        ({"block_size": 24}, "block_size 24 is not a multiple of 16"),
    ],
)
def test_portable_kernel_serves_the_rest(kwargs, why):
    launches = _plan(**kwargs)
    assert "paged_prefill_sm90" not in _names(launches)
    if why is not None:
        q = torch.empty(1, 32, 128, dtype=torch.bfloat16, **META)
        bs = kwargs["block_size"]
        cache = torch.empty(4, bs, 8, 128, dtype=torch.bfloat16, **META)
        assert any(why in e for e in sm90_prefill_errors(q, cache, cache, "NHD", SM90))


def test_hnd_stored_cache_is_refused_with_its_reason():
    cache = torch.empty(256, 8, 16, 128, dtype=torch.bfloat16, **META).permute(0, 2, 1, 3)
    launches = _plan(cache=cache)
    assert "paged_prefill_sm90" not in _names(launches)
    q = torch.empty(1, 32, 128, dtype=torch.bfloat16, **META)
    errors = sm90_prefill_errors(q, cache, cache, "NHD", SM90)
    assert any("HND" in e for e in errors), errors


def test_hybrid_page_of_odd_state_size_is_refused():
    """K, V and a 48-byte state per page: the page stride is no multiple of the token stride,
    so no 2-D view addresses it (the portable kernel serves it); whole state rows are taken."""
    from portattn.layout import make_hybrid_cache

    q = torch.empty(1, 32, 128, dtype=torch.bfloat16, **META)
    odd = make_hybrid_cache(64, 544, 8, 128, mamba_state_bytes=48, dtype=torch.bfloat16, **META)
    errors = sm90_prefill_errors(q, odd.key_cache, odd.value_cache, "NHD", SM90)
    assert any("page stride" in e for e in errors), errors
    whole = make_hybrid_cache(64, 544, 8, 128, mamba_state_bytes=3 * 2048, dtype=torch.bfloat16,
                              **META)  # fmt: skip
    assert sm90_prefill_errors(q, whole.key_cache, whole.value_cache, "NHD", SM90) == []


@pytest.mark.parametrize(
    ("stages", "lag", "switch", "why"),
    [
        (3, 1, None, None),
        (3, 2, None, None),
        (3, 3, None, "release_lag 3 not in (0, 1, 2)"),
        (2, 1, None, "release_lag 1 needs stages >= 3, got 2"),
        (3, 2, "SM90_PREFILL_PINGPONG", "release_lag 2 is for the sequential schedule"),
        (3, 1, "SM90_PREFILL_OVERLAP", "release_lag 1 is for the sequential schedule"),
    ],
)
def test_release_lag_needs_three_stages_and_the_sequential_loop(stages, lag, switch, why,
                                                                 monkeypatch):  # fmt: skip
    """A stage released in the next tile: the tile after next must have a stage of its own, and
    only the sequential loop releases late; otherwise the launch goes to the portable kernel
    with the reason."""
    tiles = dict(SM90_PREFILL_TILES)
    tiles[128] = paged_policy.Sm90PrefillTile(block_n=128, stages=stages, release_lag=lag)
    monkeypatch.setattr(paged_policy, "SM90_PREFILL_TILES", tiles)
    if switch is not None:
        monkeypatch.setattr(paged_policy, switch, True)
    q = torch.empty(1, 32, 128, dtype=torch.bfloat16, **META)
    cache = torch.empty(4, 16, 8, 128, dtype=torch.bfloat16, **META)
    errors = sm90_prefill_errors(q, cache, cache, "NHD", SM90)
    names = _names(_plan())
    if why is None:
        assert errors == [] and "paged_prefill_sm90" in names
        main = [x for x in _plan() if x.name == "paged_prefill_sm90"][0]
        assert (main.args["STAGES"], main.args["RELEASE_LAG"]) == (stages, lag)
    else:
        assert any(why in e for e in errors), errors
        assert "paged_prefill_sm90" not in names


def test_switch_off_sends_it_back(monkeypatch):
    monkeypatch.setattr(paged_policy, "SM90_PREFILL", False)
    assert _names(_plan()) == ["paged_attention"]


def test_policy_rule_is_pure():
    p = PagedProblem(num_q_heads=32, num_kv_heads=8, head_dim=128, elem_bytes=2,
                     max_query_len=512)  # fmt: skip
    assert sm90_prefill(SM90, p)
    assert not sm90_prefill(SM90, PagedProblem(32, 8, 128, 2, max_query_len=31))
    assert sm90_prefill(SM90, PagedProblem(32, 8, 128, 2, max_query_len=32))
    assert not sm90_prefill(SM90, PagedProblem(32, 8, 128, 2, 512, shuffled=True))
    assert not sm90_prefill(get_target("gfx942"), p)


@pytest.mark.parametrize("head_dim", sorted(SM90_PREFILL_TILES))
def test_shared_memory_estimate_fits_the_h100(head_dim, monkeypatch):
    tile = SM90_PREFILL_TILES[head_dim]
    assert smem_bytes(tile, head_dim) <= SM90.max_shared_mem
    # short items on both warpgroups (off by default): the merge buffer fits beside the tiles
    assert not split_short(tile, head_dim, 2, SM90)
    monkeypatch.setattr(paged_policy, "SM90_PREFILL_SPLIT_SHORT", True)
    fits = smem_bytes(tile, head_dim, split=True) <= SM90.max_shared_mem
    assert split_short(tile, head_dim, 2, SM90) is fits
    assert fits is (head_dim == 64)  # 128: 3 stages, 224 KB + 33 KB of merge buffer
    assert split_short(paged_policy.Sm90PrefillTile(128, 2), 128, 2, SM90)  # 160 KB + 33


# -- the work list, on the interpreter ------------------------------------------------------------


def _work_list(q_lens, q_len_lo, block_q, device, max_query_len=None, q_len_min=None):
    """The main list's (sequence, q tile) entries, ``num_q_tiles``, and the second list's."""
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
    qsl = qsl.to(device)
    mql = max(q_lens, default=1) if max_query_len is None else max_query_len
    num_q_tiles = max(1, -(-mql // block_q))
    layout = work_list_layout(len(q_lens), num_q_tiles)  # the launcher's
    size = layout.size  # 8 sentinels past it stay
    assert (layout.b_off, layout.counter) == (2 + len(q_lens) * num_q_tiles, size - 1)
    work = torch.full((size + 8,), -7, dtype=torch.int32, device=device)
    Launch(
        kernel=_work_list_kernel,
        grid=(len(q_lens),),
        args=dict(
            qsl_ptr=qsl,
            work_ptr=work,
            b_off=layout.b_off,
            counter=layout.counter,
            num_seqs=len(q_lens),
            q_len_lo=q_len_lo,
            q_len_min=q_len_lo if q_len_min is None else q_len_min,
            num_q_tiles=num_q_tiles,
            BLOCK_Q=block_q,
            BLOCK_S=4,
        ),  # fmt: skip
        options=LaunchOptions(4, 1),
        target=SM90,
    ).run()
    work = work.cpu()
    assert (work[size:] == -7).all(), "written past the list"
    assert work[size - 1] == 0, "the dynamic deal's counter not zeroed"
    n_a, n_b, b_off = int(work[0]), int(work[1]), layout.b_off
    main = [divmod(int(e), num_q_tiles) for e in work[2 : 2 + n_a]]
    second = [divmod(int(e), num_q_tiles) for e in work[b_off : b_off + n_b]]
    if q_len_min is None:
        assert second == []
    return main, num_q_tiles, second


@pytest.mark.parametrize(
    ("q_lens", "q_len_lo", "block_q"),
    [
        ((512, 1, 1, 3, 512, 0, 1), 2, 32),  # decode-tile sequences and an idle slot left out
        ((1, 1, 1), 2, 32),  # nothing for this kernel
        ((33, 32, 31, 65, 1, 100, 7, 9, 200, 2, 128), 0, 32),  # > BLOCK_S sequences
        ((4096,) * 3, 4, 128),
    ],
)
def test_work_list_lists_each_prefill_tile_once_heaviest_first(q_lens, q_len_lo, block_q, device):
    entries, _, _ = _work_list(list(q_lens), q_len_lo, block_q, device)
    expect = [
        (seq, t)
        for seq, q in enumerate(q_lens)
        if q > q_len_lo
        for t in reversed(range(-(-q // block_q)))
    ]
    assert entries == expect


def test_work_list_stays_in_its_bounds_when_a_q_len_exceeds_the_maximum(device):
    """A caller that vouches max_query_len 64 but sends a 200-token chunk: the list keeps the
    chunk's first two q tiles (what the grid was sized for) and writes nothing past its end."""
    entries, num_q_tiles, second = _work_list([200, 3, 64, 1], 4, 32, device, max_query_len=64,
                                              q_len_min=0)  # fmt: skip
    assert num_q_tiles == 2
    assert entries == [(0, 1), (0, 0), (2, 1), (2, 0)]
    assert second == [(1, 0), (3, 0)]


@pytest.mark.parametrize("q_len_min", [0, 1])
def test_work_list_second_list_holds_the_fused_decodes(q_len_min, device):
    """Fused decodes: the sequences with q_len_min < q_len <= q_len_lo (idle slots never)."""
    q_lens = (512, 1, 1, 3, 512, 0, 2, 40, 4, 5)
    main, _, second = _work_list(list(q_lens), 4, 32, device, q_len_min=q_len_min)
    assert main == [
        (s, t) for s, q in enumerate(q_lens) if q > 4 for t in reversed(range(-(-q // 32)))
    ]
    assert second == [(s, 0) for s, q in enumerate(q_lens) if q_len_min < q <= 4]


@pytest.mark.parametrize(
    ("nprog", "n_a", "n_b"),
    [(132, 4096, 448), (132, 1024, 448), (132, 448, 4096), (132, 0, 448), (132, 100, 0), (7, 5, 3),
     (132, 131, 1), (132, 133, 131), (7, 12, 9)],
)  # fmt: skip
def test_each_item_runs_once_and_decodes_are_spread(nprog, n_a, n_b):
    """`program_items` (the kernel's `_share` / `_item`): every item of both lists on exactly
    one program, the main list dealt as before (program p: p, p + nprog, ... in order), each
    program's decode count within one of the others', and at every step few programs on
    decodes at once (not all of them, as a decode list placed before or after would do)."""
    per = [program_items(p, nprog, n_a, n_b) for p in range(nprog)]
    flat = [x for items in per for x in items]
    assert sorted(flat) == [(False, j) for j in range(n_a)] + [(True, j) for j in range(n_b)]
    for p, items in enumerate(per):
        assert [j for second, j in items if not second] == list(range(p, n_a, nprog))
    counts = [sum(second for second, _ in items) for items in per]
    assert max(counts) - min(counts) <= 1
    # the second list is dealt from the last program: a program with one main item more than
    # others gets no decode item more unless the two lists' remainders overlap
    lengths = [len(items) for items in per]
    if n_a % nprog + n_b % nprog <= nprog:
        assert max(lengths) - min(lengths) <= 1, (max(lengths), min(lengths))
    if n_a >= nprog and n_b:
        share = n_b / (n_a + n_b)
        for step in range(min(len(items) for items in per)):
            busy = sum(items[step][0] for items in per)
            assert busy <= share * nprog + max(counts) + 1, (step, busy)


def test_dynamic_deal_orders_the_launch_as_one_program():
    """`SM90_PREFILL_DYNAMIC`: the launch's steps are `program_items` of one program (what
    `_share` / `_item` compute with DYNAMIC): every item once, the main list in its order
    (heaviest q tiles of a sequence first), the decodes spread evenly over the whole order."""
    n_a, n_b = 4096, 448
    order = program_items(0, 1, n_a, n_b)
    assert sorted(order) == [(False, j) for j in range(n_a)] + [(True, j) for j in range(n_b)]
    assert [j for second, j in order if not second] == list(range(n_a))
    assert [j for second, j in order if second] == list(range(n_b))
    window = 400  # any stretch of the order holds its share of decodes, within one
    for start in range(0, n_a + n_b - window, 97):
        got = sum(second for second, _ in order[start : start + window])
        assert abs(got - window * n_b / (n_a + n_b)) <= 1, (start, got)


def _compiled_main(block_size: int, **switches):
    """(the launch, its sm_90 build, its ptxas spill bytes) of the mixed batch's sm_90 prefill
    launch at ``block_size`` with ``switches`` (names of `portattn.policy.paged`) set: for the
    compile jobs below, run in spawned workers (`tests.helpers.in_spawned_workers`; a job sets
    every switch it relies on, a worker may have run another job)."""
    from portattn.compile.worker import _nvidia_resources, compile_kernel

    for name, value in switches.items():
        setattr(paged_policy, name, value)
    (launch,) = [x for x in _plan(block_size=block_size) if x.name == "paged_prefill_sm90"]
    compiled = compile_kernel(launch, SM90)
    return launch, compiled, _nvidia_resources(compiled, 90)[1]


def _dynamic_compile(deal: str, block_size: int) -> tuple[bool, int, int, int]:
    """(the DYNAMIC arg, spills, shared bytes, atomics in the PTX) of the mixed batch's sm_90
    launch planned with the deal ``deal`` ("dealt", "dynamic"), compiled for sm_90 (a spawned
    worker: `tests.helpers.in_spawned_workers`)."""
    launch, compiled, spills = _compiled_main(block_size, SM90_PREFILL_DYNAMIC=deal != "dealt")
    atomics = compiled.asm["ptx"].count("atom.global")
    return launch.args["DYNAMIC"], spills, compiled.metadata.shared, atomics


def test_dynamic_deal_compiles_for_sm90_without_spills():
    """With the dynamic deal the producer takes each item by an atomic increment (one before its
    loop, one at each item's end) and hands it over through shared memory: no spills, shared
    memory within `smem_bytes`; the fixed deal has no atomic."""
    from tests.helpers import in_spawned_workers

    jobs = [(deal, bs) for deal in ("dynamic", "dealt") for bs in (16, 544)]
    got = in_spawned_workers(_dynamic_compile, jobs)
    for (deal, bs), (dynamic, spills, shared, atomics) in got.items():
        assert dynamic == (deal != "dealt")
        assert spills <= (16 if bs == 544 else 0), (deal, bs)  # the turns' 16 B at four boxes
        tile = launch_tile(SM90_PREFILL_TILES[128], box_rows(bs, 128), 128, 2, SM90)
        assert shared <= smem_bytes(tile, 128), (deal, bs, shared)
        assert atomics == (0 if deal == "dealt" else 2)


def _main_args(**kw) -> dict:
    (launch,) = [x for x in _plan(**kw) if x.name == "paged_prefill_sm90"]
    return launch.args


def test_query_by_tma_where_the_producer_can_address_it(monkeypatch):
    """The policy's head_dim-128 tile takes turns at 3 stages with the query by TMA
    (``SM90_PREFILL_Q_TMA``) where TMA can address a warpgroup's 64 rows as one box (aligned
    rows, whole 64-column groups, whole tokens of the head tile); elsewhere, and with the switch
    off, the launch runs `SM90_PREFILL_NO_TMA_TILES`' sequential tile and the warpgroups read
    their rows. Head_dim 64's tile takes no turns, so no query by TMA. The descriptor's box is
    a warpgroup's rows."""
    from portattn.kernels.paged_prefill_sm90 import q_tma

    a = _main_args()
    assert (a["Q_TMA"], a["PINGPONG"], a["STAGES"], a["HEAD_TILE"]) == (True, True, 3, 4)
    assert list(a["q_desc"].block_shape) == [2, 16, 4, 64]  # [halves, tokens, heads, 64]
    assert list(a["q_desc"].strides) == [64, 32 * 128, 128, 1]
    a = _main_args(heads=(40, 8))  # GQA 5:1: 64 rows are 12.8 tokens
    assert (a["Q_TMA"], a["PINGPONG"], a["STAGES"]) == (False, False, 2)
    assert _main_args(heads=(64, 8), head_dim=64)["Q_TMA"] is False  # no turns at head_dim 64
    monkeypatch.setattr(paged_policy, "SM90_PREFILL_PINGPONG", True)  # every tile takes turns
    assert _main_args(heads=(64, 8), head_dim=64)["Q_TMA"] is True  # GQA 8:1, one half
    monkeypatch.setattr(paged_policy, "SM90_PREFILL_PINGPONG", False)
    monkeypatch.setattr(paged_policy, "SM90_PREFILL_Q_TMA", False)
    a = _main_args()
    assert (a["Q_TMA"], a["PINGPONG"], a["STAGES"]) == (False, False, 2)
    monkeypatch.setattr(paged_policy, "SM90_PREFILL_Q_TMA", True)
    q = torch.empty(100, 32, 129, dtype=torch.bfloat16, **META)[..., :128]  # head stride 129
    assert q_tma(q, 128, 4) is False
    q = torch.empty(100, 32, 128, dtype=torch.bfloat16, **META)
    assert q_tma(q, 128, 4) is True
    assert q_tma(q, 96, 4) is False  # not whole 64-column groups
    assert q_tma(q, 128, 128) is False  # a warpgroup's rows: part of one token


def test_the_fallback_tile_sets_the_launch_rows(monkeypatch):
    """Where a tile of turns gives way to `SM90_PREFILL_NO_TMA_TILES`' (the query cannot come by
    TMA), the launch's rows, q tiles and page boxes are the fallback's: a policy tile of turns
    with another shape (here 64-token tiles, 4 stages) must not leave its q tile or its box on
    the 2-warpgroup, 128-token fallback."""
    tiles = dict(SM90_PREFILL_TILES)
    tiles[128] = paged_policy.Sm90PrefillTile(block_n=64, stages=4, pingpong=True)
    monkeypatch.setattr(paged_policy, "SM90_PREFILL_TILES", tiles)
    a = _main_args(heads=(32, 8))  # the query by TMA: the policy's tile
    assert (a["BLOCK_N"], a["STAGES"], a["PINGPONG"], a["Q_TMA"]) == (64, 4, True, True)
    a = _main_args(heads=(40, 8), block_size=2048)  # GQA 5:1: the fallback, sequential
    assert (a["BLOCK_N"], a["STAGES"], a["PINGPONG"], a["Q_TMA"]) == (128, 2, False, False)
    assert a["BLOCK_Q"] == 64 * a["NUM_WG"] // a["HEAD_TILE"] and a["BOX"] == 128
    # a fallback tile the target cannot run refuses the kernel, with the reason
    monkeypatch.setattr(
        paged_policy,
        "SM90_PREFILL_NO_TMA_TILES",
        {128: paged_policy.Sm90PrefillTile(block_n=128, stages=2, release_lag=1)},
    )
    q = torch.empty(1, 32, 128, dtype=torch.bfloat16, **META)
    cache = torch.empty(4, 16, 8, 128, dtype=torch.bfloat16, **META)
    errors = sm90_prefill_errors(q, cache, cache, "NHD", SM90)
    assert any("fallback tile release_lag 1 needs stages >= 3" in e for e in errors), errors


def _ahead_compile(ahead: bool, block_size: int) -> tuple[bool, int]:
    """(the AHEAD arg, spills) of the mixed batch's sm_90 launch (the policy's tile) with
    ``SM90_PREFILL_ITEM_AHEAD`` at ``ahead``, compiled for sm_90 (a spawned worker)."""
    launch, _, spills = _compiled_main(block_size, SM90_PREFILL_ITEM_AHEAD=ahead)
    return launch.args["AHEAD"], spills


def test_item_ahead_compiles_for_sm90_with_the_same_spills():
    """``SM90_PREFILL_ITEM_AHEAD`` (off by default): the launch carries it, and taking the next
    item before the epilogue costs no spills beyond the policy's own (0 at blocks 16 and 2048,
    the gate's 16 B at 544)."""
    from tests.helpers import in_spawned_workers

    assert _main_args()["AHEAD"] is False
    jobs = [(on, bs) for on in (True, False) for bs in (16, 544, 2048)]
    got = in_spawned_workers(_ahead_compile, jobs)
    for bs in (16, 544, 2048):
        (on, spills), (off, spills_off) = got[(True, bs)], got[(False, bs)]
        assert on is True and off is False
        assert spills <= spills_off <= 16, bs


def _copy_order(k_ahead: bool, block_size: int) -> tuple[bool, int, int, str]:
    """(the K_AHEAD arg, the producer's registers, spills, the dimensions of the PTX's tensor
    copies in program order: 2 for a K box or a 2-D V box, 3 for a V page box, 4 for a query box)
    of the mixed batch's sm_90 launch with ``SM90_PREFILL_K_AHEAD`` at ``k_ahead``, compiled
    for sm_90 (a spawned worker)."""
    import re

    launch, compiled, spills = _compiled_main(block_size, SM90_PREFILL_K_AHEAD=k_ahead)
    dims = "".join(re.findall(r"cp\.async\.bulk\.tensor\.(\d)d", compiled.asm["ptx"]))
    return launch.args["K_AHEAD"], launch.args["PRODUCER_REGS"], spills, dims


def test_k_ahead_copies_v_of_a_tile_then_k_of_the_next():
    """``SM90_PREFILL_K_AHEAD`` (off): at block 16 (8 boxes a tile: 16 K copies, two 64-column
    halves a box, and 8 V page copies) the producer copies K K V, K K V, ... a tile by default;
    with it, an item's first K tile alone (16 copies), then on each stage's release V of the tile
    (8) and K of the next (16), the query's two between them (K of tile 3 waits for the buffer
    that the item's first scores free, which need the query). With it no spills at blocks 16 (8
    more producer registers), 544 and 2048 (one box a tile; 16 more)."""
    from tests.helpers import in_spawned_workers

    assert _main_args()["K_AHEAD"] is False
    jobs = [(on, bs) for on in (True, False) for bs in (16, 544, 2048)]
    got = in_spawned_workers(_copy_order, jobs)
    (on, regs_on, _, dims_on), (off, regs_off, _, dims_off) = got[(True, 16)], got[(False, 16)]
    assert on is True and off is False
    assert dims_off == "223" * 8 + "44"
    assert dims_on == "2" * 16 + "3" * 8 + "44" + "2" * 16
    assert (regs_on, regs_off, got[(True, 544)][1]) == (72, 64, 80)
    assert got[(True, 2048)][3] == "22" + "22" + "44" + "22"  # (V one 2-D box of two halves)
    for bs in (16, 544, 2048):
        # (off, block 544 spills 16 B: the compile gate's limit)
        assert got[(True, bs)][2] == 0 and got[(False, bs)][2] <= 16, bs


def test_k_ahead_only_where_the_tile_takes_turns(monkeypatch):
    """The launch takes K_AHEAD only with turns (the loop that frees K buffers at the scores):
    not on the sequential tile, with OVERLAP, or with the short items' split."""
    monkeypatch.setattr(paged_policy, "SM90_PREFILL_K_AHEAD", True)
    assert _main_args()["K_AHEAD"] is True
    seq = dict(paged_policy.SM90_PREFILL_TILES)
    seq[128] = paged_policy.Sm90PrefillTile(block_n=128, stages=2)
    monkeypatch.setattr(paged_policy, "SM90_PREFILL_TILES", seq)
    assert _main_args()["K_AHEAD"] is False
    monkeypatch.undo()
    monkeypatch.setattr(paged_policy, "SM90_PREFILL_K_AHEAD", True)
    monkeypatch.setattr(paged_policy, "SM90_PREFILL_OVERLAP", True)
    assert _main_args()["K_AHEAD"] is False


def _q_tma_compile(q_tma: bool, block_size: int) -> tuple[bool, int, int, int, int]:
    """(the Q_TMA arg, spills, shared bytes, TMA copies and global loads in the PTX) of the
    mixed batch's sm_90 launch taking turns at 3 stages with ``SM90_PREFILL_Q_TMA`` at
    ``q_tma`` (the same loop either way: the turns by the switch, not the tile's flag, which
    would fall back to the sequential tile without the query by TMA), compiled for sm_90 (a
    spawned worker)."""
    tiles = dict(paged_policy.SM90_PREFILL_TILES)
    tiles[128] = paged_policy.Sm90PrefillTile(block_n=128, stages=3)
    launch, compiled, spills = _compiled_main(
        block_size, SM90_PREFILL_TILES=tiles, SM90_PREFILL_PINGPONG=True, SM90_PREFILL_Q_TMA=q_tma
    )
    ptx = compiled.asm["ptx"]
    copies = ptx.count("cp.async.bulk.tensor")
    loads = ptx.count("ld.global")
    return launch.args["Q_TMA"], spills, compiled.metadata.shared, copies, loads


def test_query_by_tma_compiles_for_sm90_without_spills():
    """The producer's query copies in the turns at 3 stages, against the same loop without them:
    more TMA copies, fewer global loads (the warpgroups' query reads gone), shared memory within
    `smem_bytes`; spills within the compile gate's 16 B either way."""
    from tests.helpers import in_spawned_workers

    jobs = [(on, bs) for on in (True, False) for bs in (16, 544, 2048)]
    got = in_spawned_workers(_q_tma_compile, jobs)
    for bs in (16, 544, 2048):
        on, spills, shared, copies, loads = got[(True, bs)]
        off = got[(False, bs)]
        assert on is True and off[0] is False
        # (the compile gate's 16 B: ptxas parks 16 B with 4 boxes a tile, block 544, and 8 B at
        # block 16 in the turns without the query copies, a build no policy takes)
        assert spills <= 16 and off[1] <= 16, bs
        tile = paged_policy.Sm90PrefillTile(block_n=128, stages=3)
        assert shared <= smem_bytes(tile, 128), (bs, shared)
        assert copies > off[3], bs  # (ptxas may duplicate the loop's copies: not a count)
        assert loads < off[4], bs


# -- compile for sm_90 (no GPU) ------------------------------------------------------------------


@pytest.mark.parametrize("case_id", ["bs16", "bs544", "bs2048"])
def test_compiles_for_sm90_without_spills(case_id):
    """The issue-19 prefill cases of the compile matrix: the sm_90 kernel within its estimate
    (and the target's shared memory), spills within the compile gate's 16 B (ptxas spilled
    4-132 B when the producer warp had 24 registers; the overlapped schedule parks 4 B)."""
    case = {c.id: c for c in default_cases()}[
        f"paged_attention/hd128 gqa4 {case_id} NHD prefill q512 issue19"
    ]
    (cell,) = run_matrix([case], ["sm_90"])
    (r,) = [launch for launch in cell.launches if launch.name == "paged_prefill_sm90"]
    assert r.ok, r.error
    # the launch the cell compiled: the policy's turns at 3 stages, no late release, the query
    # by TMA
    (main,) = [x for x in case.plan(SM90) if x.name == "paged_prefill_sm90"]
    a = main.args
    assert (a["STAGES"], a["RELEASE_LAG"], a["PINGPONG"], a["Q_TMA"]) == (3, 0, True, True)
    tile = SM90_PREFILL_TILES[128]
    tile = launch_tile(tile, box_rows(int(case_id[2:]), tile.block_n), 128, 2, SM90)
    assert r.shared <= smem_bytes(tile, 128, split=split_short(tile, 128, 2, SM90))
    assert r.spills <= 16  # (16 B at block 544: four boxes a tile, the turns and the query copy)


def test_trace_buffer_builds_traced_launches_only_while_set(monkeypatch):
    """The diagnostic trace (bench/trace_prefill.py) is a launch argument read at planning: set,
    the launch stamps into the buffer; unset, the kernel is built without the stamps."""
    import portattn.kernels.paged_prefill_sm90 as sm90

    (main,) = [launch for launch in _plan() if launch.name == "paged_prefill_sm90"]
    assert main.args["TRACE"] is False
    need = math.prod(sm90.trace_shape(SM90.num_sms))
    buf = torch.empty(need, dtype=torch.int64, device="meta")
    monkeypatch.setattr(sm90, "TRACE_BUFFER", buf)
    (main,) = [launch for launch in _plan() if launch.name == "paged_prefill_sm90"]
    assert main.args["TRACE"] is True and main.args["trace_ptr"] is buf


@pytest.mark.parametrize(
    ("size", "switch", "match"),
    [
        (16, None, "TRACE_BUFFER must be an int64 tensor on meta of at least"),
        (None, "SM90_PREFILL_OVERLAP", "the trace stamps the sequential schedule only"),
    ],
)
def test_trace_buffer_refuses_what_it_cannot_stamp(monkeypatch, size, switch, match):
    import portattn.kernels.paged_prefill_sm90 as sm90

    size = size or math.prod(sm90.trace_shape(SM90.num_sms))
    monkeypatch.setattr(sm90, "TRACE_BUFFER", torch.empty(size, dtype=torch.int64, device="meta"))
    if switch:
        monkeypatch.setattr(paged_policy, switch, True)
    with pytest.raises(ValueError, match=match):
        _plan()


def _traced_ptx_counts(turns: bool = False) -> tuple[int, int, int | None]:
    """(global timer reads, clock reads, ptxas spill bytes) of the traced launch compiled for
    sm_90: the sequential tile, or with ``turns`` the policy's (turns at 3 stages, the query by
    TMA). Run in a spawned process without the interpreter (as the compile matrix compiles):
    a Gluon kernel compiled in a process that has run the interpreter can fail to build."""
    import portattn.kernels.paged_prefill_sm90 as sm90
    from portattn.compile.worker import _resources, compile_kernel

    need = math.prod(sm90.trace_shape(SM90.num_sms))
    sm90.TRACE_BUFFER = torch.empty(need, dtype=torch.int64, device="meta")
    tiles = dict(SM90_PREFILL_TILES)  # the policy's (the worker may have run another job)
    if not turns:  # the sequential loop's stamps
        tiles[128] = paged_policy.Sm90PrefillTile(block_n=128, stages=2)
    paged_policy.SM90_PREFILL_TILES = tiles
    (main,) = [launch for launch in _plan(block_size=2048) if launch.name == "paged_prefill_sm90"]
    assert main.args["PINGPONG"] is main.args["Q_TMA"] is turns
    compiled = compile_kernel(main, SM90)
    ptx = compiled.asm["ptx"]
    return ptx.count("%globaltimer"), ptx.count("%clock64"), _resources(compiled, SM90)[1]


def test_traced_kernel_compiles_for_sm90_within_the_spill_gate():
    """The traced build stamps in all three partitions (CPU compile, sm_90 PTX): the clock at
    each of the consumers' and the producer's steps, the global timer at their ends, in the
    sequential loop and in the policy's turns. Spills within the compile gate's 16 B (a
    diagnostic build: ptxas parks 8-16 B beside the stamps)."""
    from tests.helpers import in_spawned_workers

    got = in_spawned_workers(_traced_ptx_counts, [(False,), (True,)], workers=1)
    # the global timer at both ends of the 3 partitions; the clock at both ends, and: warpgroup
    # 0 at 7 steps a tile, an item's start and end (stores issued, next step in hand: 2) (with
    # turns, 7 more for the item's last tile, outside the loop); warpgroup 1 the same, and 4
    # on the path that passes a decode item's tiles on (warpgroup 0 never takes it); the
    # producer 3 a tile
    for turns, last in ((False, 0), (True, 7)):
        timer, clock, spills = got[(turns,)]
        assert timer == 6
        assert clock == (2 + 7 + last + 1 + 2) + (2 + 7 + last + 1 + 2 + 4) + (2 + 3), turns
        assert spills <= 16, turns


# -- GPU: numerics against the fp64 oracle ------------------------------------------------------

# (seq_len, q_len): chunks at odd offsets, a chunk ending on a tile edge, pure prefill, decodes,
# a short verification step, an idle slot
GPU_SEQS = ((2100, 300), (1, 1), (400, 400), (1000, 37), (128, 128), (777, 1), (300, 4),
            (5, 0), (257, 129))  # fmt: skip
# A hybrid page here holds K, V and a Mamba state of a whole number of token rows (page stride a
# multiple of the token stride, as engines pad pages to one size): the kernel's 2-D TMA view
# addresses it; a state of any other size sends the batch to the portable kernel (below).
GPU_CASES = [
    # (heads, head_dim, block_size, kind, dtype, state bytes of a hybrid page)
    ((32, 8), 128, 16, "contiguous", torch.bfloat16, 0),
    ((32, 8), 128, 544, "hybrid", torch.bfloat16, 3 * 8 * 128 * 2),
    ((32, 8), 128, 2048, "contiguous", torch.float16, 0),
    ((32, 8), 128, 80, "slice", torch.bfloat16, 0),
    ((16, 16), 128, 32, "contiguous", torch.bfloat16, 0),  # MHA: 128 tokens x 1 head
    ((40, 8), 64, 16, "hybrid", torch.float16, 8 * 64 * 2),  # GQA 5:1: 25 tokens x 5 heads
    ((64, 4), 64, 2048, "contiguous", torch.bfloat16, 0),  # GQA 16:1: 8 tokens x 16 heads
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("heads", "head_dim", "block_size", "kind", "dtype", "state_bytes"),
    GPU_CASES,
    ids=[f"{h[0]}q{h[1]}kv-d{d}-bs{b}-{k}-{str(t)[6:]}" for h, d, b, k, t, _ in GPU_CASES],
)
def test_gpu_sm90_prefill(heads, head_dim, block_size, kind, dtype, state_bytes):
    """The public op with and without the maxima; the sm_90 kernel is in the plan, the caches
    are NaN wherever the kernel must not read (past each sequence, unused blocks, gaps)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm_90 kernel needs an sm_90 GPU")
    b = make_batch(GPU_SEQS, block_size=block_size, heads=heads, head_dim=head_dim, dtype=dtype,
                   kind=kind, device="cuda", state_bytes=state_bytes or 48)  # fmt: skip
    mql, msl = max(q for _, q in GPU_SEQS), max(s for s, _ in GPU_SEQS)
    launches = plan_paged_attention(*b.args(), max_query_len=mql, max_seq_len=msl)
    assert "paged_prefill_sm90" in _names(launches), sm90_prefill_errors(
        b.query, b.key_cache, b.value_cache, "NHD", get_target("sm_90")
    )
    out = paged_attention(*b.args(), max_query_len=mql, max_seq_len=msl)
    torch.cuda.synchronize()
    check(b, out)
    out2 = paged_attention(*b.args())  # the bounds read from the metadata
    torch.cuda.synchronize()
    check(b, out2)


@pytest.mark.parametrize(
    ("overlap", "pingpong"), [(False, False), (False, True), (True, False), (True, True)]
)
def test_pingpong_is_passed_to_either_loop(monkeypatch, overlap, pingpong, sequential_tile):
    """The turns exist in both loops (the sequential one takes a turn for P V of tile t with the
    scores of tile t+1): PINGPONG reaches the launch whatever OVERLAP is."""
    monkeypatch.setattr(paged_policy, "SM90_PREFILL_OVERLAP", overlap)
    monkeypatch.setattr(paged_policy, "SM90_PREFILL_PINGPONG", pingpong)
    (main,) = [launch for launch in _plan() if launch.name == "paged_prefill_sm90"]
    assert (main.args["OVERLAP"], main.args["PINGPONG"]) == (overlap, pingpong)
    # 3 warpgroups take no turns (the turn barriers are a pair)
    tiles = dict(paged_policy.SM90_PREFILL_TILES)
    tiles[128] = paged_policy.Sm90PrefillTile(block_n=64, stages=4, warpgroups=3)
    monkeypatch.setattr(paged_policy, "SM90_PREFILL_TILES", tiles)
    (main,) = [launch for launch in _plan() if launch.name == "paged_prefill_sm90"]
    assert main.args["NUM_WG"] == 3 and main.args["PINGPONG"] is False


@pytest.mark.parametrize(
    ("block_size", "head_dim", "stride_pad", "switches", "want"),
    [
        (16, 128, 0, {}, 8),
        (32, 128, 0, {}, 4),
        (544, 128, 0, {}, 4),  # 32-row boxes
        (64, 128, 0, {}, 2),
        (128, 128, 0, {}, 1),  # one box a tile already
        (2048, 128, 0, {}, 1),
        (16, 64, 0, {}, 1),  # one 64-column group: nothing to join
        (16, 128, 32, {}, 1),  # KV heads 160 columns apart: not in 64-column groups
        (16, 128, 0, {"SM90_PREFILL_V_PAGES": False}, 1),
        (16, 128, 0, {"SM90_PREFILL_PINGPONG": True}, 8),  # the turns read V pages too
        (16, 128, 0, {"SM90_PREFILL_OVERLAP": True}, 1),
        (16, 128, 0, {"SM90_PREFILL_SPLIT_SHORT": True}, 1),
    ],
)
def test_v_pages_where_a_page_box_is_shorter_than_the_tile(block_size, head_dim, stride_pad,
                                                          switches, want, monkeypatch,
                                                          sequential_tile):  # fmt: skip
    """V tiles as one-copy page boxes (V_PAGES) where a tile spans several boxes, the head dim
    has 64-column groups to join, and the sequential loop reads V, with or without turns (not
    the overlapped loop or the short items' split); the descriptor is then the 3-D view, one box
    a page."""
    monkeypatch.setattr(paged_policy, "SM90_PREFILL_V_PAGES", True)
    monkeypatch.setattr(paged_policy, "SM90_PREFILL_V_PAGES_MIN_BOXES", 2)
    for k, v in switches.items():
        monkeypatch.setattr(paged_policy, k, v)
    heads = 8 * (head_dim + stride_pad)
    base = torch.empty(64, block_size, heads, dtype=torch.bfloat16, **META)
    cache = base.view(64, block_size, 8, head_dim + stride_pad)[..., :head_dim]
    launches = _plan(cache=cache, head_dim=head_dim)
    (main,) = [launch for launch in launches if launch.name == "paged_prefill_sm90"]
    assert main.args["V_PAGES"] == want
    desc = main.args["v_desc"]
    if want > 1:
        assert desc.block_shape == [head_dim // 64, block_size & -block_size, 64]
        assert desc.strides == [64, cache.stride(1), 1]
    else:
        assert len(desc.block_shape) == 2


@pytest.mark.parametrize(("head_dim", "want"), [(128, 8), (256, 8), (192, 1), (64, 1)])
def test_v_pages_need_a_power_of_two_of_column_groups(head_dim, want):
    """The page boxes' shared layout (`_pages_layout`) holds 2, 4, ... 64-column groups a row:
    3 (head_dim 192) reads V as one tile instead of failing at the compile."""
    cache = torch.empty(64, 16, 8, head_dim, dtype=torch.bfloat16, **META)
    tile = paged_policy.Sm90PrefillTile(block_n=128, stages=3)
    assert v_pages(tile, 16, cache, split=False) == want


@pytest.mark.parametrize(("block_size", "want"), [(16, 8), (48, 8), (32, 1), (544, 1), (64, 1)])
def test_v_pages_by_default_at_sixteen_row_boxes(block_size, want):
    """The default takes V pages where a tile has 8 boxes (16-row boxes: measured faster) and
    not at 2 or 4 (32-row boxes measured slower)."""
    cache = torch.empty(64, block_size, 8, 128, dtype=torch.bfloat16, **META)
    (main,) = [x for x in _plan(cache=cache) if x.name == "paged_prefill_sm90"]
    assert main.args["V_PAGES"] == want


@pytest.mark.parametrize(("block_n", "head_d", "nb"), [(128, 128, 8), (128, 128, 4),
                                                       (128, 128, 2), (128, 256, 8)])  # fmt: skip
def test_pages_layout_is_where_the_page_copies_put_each_element(block_n, head_d, nb):
    """`_pages_layout` (the shared layout P V reads a V tile of page boxes through) maps each
    offset to the element the page copies put there: box ``p`` at ``p x box x head_d``, as
    ``[column groups, box rows, 64]`` under the 128-byte swizzle (a 16-byte piece of 128-byte
    line ``L`` at piece index XOR ``L mod 8``), every element once."""
    from portattn.kernels.paged_prefill_sm90 import _pages_layout

    bases = _pages_layout(block_n, head_d, nb).offset_bases
    assert 1 << len(bases) == block_n * head_d
    box = block_n // nb
    for o in range(block_n * head_d):
        r = c = 0
        for i, (br, bc) in enumerate(bases):
            if o >> i & 1:
                r, c = r ^ br, c ^ bc
        p, rr, g, cc = r // box, r % box, c // 64, c % 64
        line = g * box + rr
        want = p * box * head_d + line * 64 + ((cc // 8) ^ (line % 8)) * 8 + cc % 8
        assert want == o, (o, r, c)


@pytest.mark.parametrize(("block_n", "head_d", "nb"), [(128, 192, 8), (128, 128, 16),
                                                       (96, 128, 2)])  # fmt: skip
def test_pages_layout_refuses_what_it_cannot_describe(block_n, head_d, nb):
    """3 column groups, 8-row boxes (a k-step across two boxes), 48-row boxes: refused, with the
    rule."""
    from portattn.kernels.paged_prefill_sm90 import _pages_layout

    with pytest.raises(ValueError, match="must each be a whole power of two; got block_n"):
        _pages_layout(block_n, head_d, nb)


def _pv_groups(v_pages: bool, block_size: int, min_boxes: int) -> tuple[int, int, int, int]:
    """(the V_PAGES arg, wgmma fences, commit groups, spills) of the mixed batch's sm_90 launch
    at ``block_size`` with V pages on or off (taken from ``min_boxes`` boxes a tile), compiled
    for sm_90 (a spawned worker)."""
    launch, compiled, spills = _compiled_main(
        block_size, SM90_PREFILL_V_PAGES=v_pages, SM90_PREFILL_V_PAGES_MIN_BOXES=min_boxes
    )
    ptx = compiled.asm["ptx"]
    fences, commits = ptx.count("wgmma.fence"), ptx.count("wgmma.commit_group")
    return launch.args["V_PAGES"], fences, commits, spills


def test_v_pages_keep_p_v_one_commit_group():
    """With V pages (8 boxes of 16 rows at block 16, 4 of 32 at block 544 when taken from 4)
    P V reads the tile through one shared layout of its boxes: the build has as many wgmma
    fences and commit groups as the same launch reading V as one tile (an MMA a box had made
    each of block 16's k-steps a group of its own: 36 fences against 8), and spills within the
    compile gate's 16 B. (The numbers against the fp64 oracle: the GPU tests at block 16.)"""
    from tests.helpers import in_spawned_workers

    jobs = [(on, bs, boxes) for on in (True, False) for bs, boxes in ((16, 8), (544, 4))]
    got = in_spawned_workers(_pv_groups, jobs)
    for bs, boxes in ((16, 8), (544, 4)):
        on, off = got[(True, bs, boxes)], got[(False, bs, boxes)]
        assert (on[0], off[0]) == (boxes, 1), bs
        assert on[1:3] == off[1:3], (bs, on, off)
        assert on[3] <= 16, bs


@pytest.mark.parametrize(
    ("block_size", "switch", "want"),
    [
        (16, None, (2, 0)),  # 8 boxes a tile
        (544, None, (3, 2)),  # 4 boxes of 32 rows
        (64, None, (3, 2)),  # 2 boxes
        (2048, None, (2, 0)),  # 1 box
        (544, "SM90_PREFILL_PINGPONG", (2, 0)),
        (544, "SM90_PREFILL_OVERLAP", (2, 0)),
        (544, "SM90_PREFILL_SPLIT_SHORT", (2, 0)),  # its merge buffer does not fit 3 stages
    ],
)
def test_late_release_at_two_to_four_boxes_a_tile(block_size, switch, want, monkeypatch,
                                                  sequential_tile):  # fmt: skip
    """The launch's tile (a sequential 2-stage tile): 3 stages released late where a tile has 2
    or 4 page boxes and the schedule is sequential; otherwise the policy's two stages."""
    if switch is not None:
        monkeypatch.setattr(paged_policy, switch, True)
    cache = torch.empty(64, block_size, 8, 128, dtype=torch.bfloat16, **META)
    (main,) = [x for x in _plan(cache=cache) if x.name == "paged_prefill_sm90"]
    assert (main.args["STAGES"], main.args["RELEASE_LAG"]) == want
    assert main.args["SPLIT"] is (switch == "SM90_PREFILL_SPLIT_SHORT")
    if want == (3, 2):  # where it is taken, not where 3 stages do not fit
        small = dataclasses.replace(SM90, max_shared_mem=200 * 1024)
        tile = paged_policy.SM90_PREFILL_TILES[128]
        tile = launch_tile(tile, box_rows(block_size, 128), 128, 2, small)
        assert (tile.stages, tile.release_lag) == (2, 0)


def test_launch_tells_the_kernel_which_rows_are_aligned():
    """Q_VEC / O_VEC (`rows_aligned`): 16-byte query loads and 4-byte output stores only on
    rows the launcher found contiguous and aligned; anything else element by element."""
    (main,) = [launch for launch in _plan() if launch.name == "paged_prefill_sm90"]
    assert (main.args["Q_VEC"], main.args["O_VEC"]) == (True, True)
    cache = torch.empty(64 * 4096 // 16 + 1, 16, 8, 128, dtype=torch.bfloat16, **META)
    bt = torch.empty(64, 256, dtype=torch.int32, **META)
    sl = torch.empty(64, dtype=torch.int32, **META)
    qsl = torch.empty(65, dtype=torch.int32, **META)
    tokens = 8 * 512 + 56
    q = torch.empty(tokens, 32, 129, dtype=torch.bfloat16, **META)[..., :128]  # head stride 129
    out = torch.empty(tokens, 32, 256, dtype=torch.bfloat16, **META)[..., ::2]
    launches = plan_paged_attention(q, cache, cache, bt, sl, qsl, target=SM90, out=out,
                                    max_query_len=512, max_seq_len=4096)  # fmt: skip
    (main,) = [launch for launch in launches if launch.name == "paged_prefill_sm90"]
    assert (main.args["Q_VEC"], main.args["O_VEC"]) == (False, False)


@pytest.mark.gpu
@pytest.mark.parametrize("q_tma", [False, True], ids=["query loads", "query by TMA"])
@pytest.mark.parametrize("form", ["aligned", "padded", "odd head stride", "dim stride 2"])
def test_gpu_sm90_prefill_query_and_output_forms(form, q_tma, monkeypatch):
    """A query and an output of the same form: aligned rows (16-byte query loads, 4-byte
    stores), padded rows (8 elements of NaN a row: still aligned, and left untouched), rows
    whose head stride is not a multiple of 8 elements, or a head dim of stride 2 (both element
    by element); each against the oracle. With ``SM90_PREFILL_Q_TMA`` the aligned forms' query
    comes by TMA from the producer (the NaN padding never read), the others as before."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm_90 kernel needs an sm_90 GPU")
    from portattn.kernels._plans import PLANS

    monkeypatch.setattr(paged_policy, "SM90_PREFILL_Q_TMA", q_tma)
    PLANS.clear()  # the switches are not in a plan's key
    b = make_batch(GPU_SEQS, block_size=16, heads=(32, 8), head_dim=128, dtype=torch.bfloat16,
                   device="cuda")  # fmt: skip

    def restride(t):
        if form == "aligned":
            return t
        n, h, d = t.shape
        width = {"padded": d + 8, "odd head stride": d + 1, "dim stride 2": 2 * d}[form]
        wide = torch.full((n, h, width), float("nan"), dtype=t.dtype, device=t.device)
        view = wide[..., ::2] if form == "dim stride 2" else wide[..., :d]
        view.copy_(t)
        return view

    b.query = restride(b.query)
    out = restride(torch.zeros_like(b.query))
    mql, msl = max(q for _, q in GPU_SEQS), max(s for s, _ in GPU_SEQS)
    launches = plan_paged_attention(*b.args(), max_query_len=mql, max_seq_len=msl, out=out)
    (main,) = [launch for launch in launches if launch.name == "paged_prefill_sm90"]
    assert main.args["Q_VEC"] is main.args["O_VEC"] is (form in ("aligned", "padded"))
    assert main.args["Q_TMA"] is (q_tma and form in ("aligned", "padded"))
    got = paged_attention(*b.args(), max_query_len=mql, max_seq_len=msl, out=out)
    torch.cuda.synchronize()
    assert got is out
    check(b, out)
    if form == "padded":  # nothing written past the rows
        assert torch.isnan(out._base[..., 128:]).all()
    PLANS.clear()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "schedule",
    [
        "overlap",
        "overlap+pingpong",
        "pingpong",
        "pingpong, 3 stages",
        "q tma",
        "q tma, pingpong, 3 stages",
        "q tma, overlap+pingpong",
        "q tma, fused decode, one warpgroup",
        "q tma, dealt, v pages",
        "fused+pingpong",
        "3 warpgroups",
        "fused decode",
        "fused decode, one warpgroup",
        "fused+overlap",
        "release 1",
        "release 2",
        "v pages",
        "exp2 poly 4",
        "lazy rescale",
        "tree reduce",
        "overlap, softmax switches",
        "pingpong, softmax switches",
        "dealt, fused decode, one warpgroup",
        "dealt, fused decode",
        "dealt, overlap+pingpong",
        "dealt, 3 warpgroups",
        "dealt, release 2",
    ],
)
def test_gpu_sm90_prefill_other_schedules(schedule, monkeypatch):
    """The kernel's other schedules (policy switches, bench_prefill --schedules) on a mixed batch
    of the GPU cases: 192-row tiles of three warpgroups, the overlapped loop, ping-pong turns,
    the decode sequences as items of the kernel (alone and with the overlapped loop)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm_90 kernel needs an sm_90 GPU")
    from portattn.kernels._plans import PLANS

    # the query rows by TMA from the producer ("q tma, "; where `q_tma` takes them: not GQA 5:1;
    # without it, head_dim 128's turns give way to the sequential tile, as before the switch)
    q_tma = schedule.startswith("q tma")
    schedule = schedule.removeprefix("q tma").removeprefix(", ") or "policy"
    monkeypatch.setattr(paged_policy, "SM90_PREFILL_Q_TMA", q_tma)
    # the items taken from a counter (the default), or dealt when the launch starts ("dealt, ")
    dynamic = not schedule.startswith("dealt, ")
    schedule = schedule.removeprefix("dealt, ")
    if schedule.endswith(", 3 stages"):  # a third stage for the schedule (fused decodes)
        schedule = schedule.removesuffix(", 3 stages")
        tiles = {d: dataclasses.replace(t, stages=3, pingpong=False)  # (the switch's turns)
                 for d, t in paged_policy.SM90_PREFILL_TILES.items()}  # fmt: skip
        monkeypatch.setattr(paged_policy, "SM90_PREFILL_TILES", tiles)
        three = True
    else:
        three = False
    monkeypatch.setattr(paged_policy, "SM90_PREFILL_DYNAMIC", dynamic)
    if schedule == "3 warpgroups":
        tiles = dict(paged_policy.SM90_PREFILL_TILES)
        tiles[128] = paged_policy.Sm90PrefillTile(block_n=64, stages=4, warpgroups=3)
        tiles[64] = paged_policy.Sm90PrefillTile(block_n=64, stages=4, warpgroups=3)
        monkeypatch.setattr(paged_policy, "SM90_PREFILL_TILES", tiles)
        monkeypatch.setattr(paged_policy, "SM90_PREFILL_FUSE_DECODE", False)
    elif schedule.startswith("release"):  # 3 stages, each released later (fused decodes)
        lag = int(schedule.split()[1])
        tiles = {d: dataclasses.replace(t, stages=3, release_lag=lag, pingpong=False)
                 for d, t in paged_policy.SM90_PREFILL_TILES.items()}  # fmt: skip
        monkeypatch.setattr(paged_policy, "SM90_PREFILL_TILES", tiles)
        monkeypatch.setattr(paged_policy, "SM90_PREFILL_FUSE_DECODE", True)
    elif schedule == "v pages":  # at every box count (the default takes 8 boxes a tile only)
        monkeypatch.setattr(paged_policy, "SM90_PREFILL_V_PAGES", True)
        monkeypatch.setattr(paged_policy, "SM90_PREFILL_V_PAGES_MIN_BOXES", 2)
        monkeypatch.setattr(paged_policy, "SM90_PREFILL_FUSE_DECODE", True)
    elif schedule.endswith("softmax switches"):  # all three on, in another loop
        monkeypatch.setattr(paged_policy, "SM90_PREFILL_EXP2_POLY", 2)
        monkeypatch.setattr(paged_policy, "SM90_PREFILL_LAZY_RESCALE", True)
        monkeypatch.setattr(paged_policy, "SM90_PREFILL_TREE_REDUCE", True)
        monkeypatch.setattr(paged_policy, "SM90_PREFILL_OVERLAP", schedule.startswith("overlap"))
        monkeypatch.setattr(paged_policy, "SM90_PREFILL_PINGPONG", schedule.startswith("pingpong"))
    elif schedule == "tree reduce":  # the row maxima and sums by trees
        monkeypatch.setattr(paged_policy, "SM90_PREFILL_TREE_REDUCE", True)
    elif schedule == "lazy rescale":  # the running max moved only past 8, rescales skipped at 1
        monkeypatch.setattr(paged_policy, "SM90_PREFILL_LAZY_RESCALE", True)
    elif schedule.startswith("exp2 poly"):  # all of P's exponentials on the polynomial
        monkeypatch.setattr(paged_policy, "SM90_PREFILL_EXP2_POLY", int(schedule.split()[-1]))
    elif schedule.startswith("fused decode"):
        monkeypatch.setattr(paged_policy, "SM90_PREFILL_FUSE_DECODE", True)
        monkeypatch.setattr(paged_policy, "SM90_PREFILL_SPLIT_SHORT", "one" not in schedule)
    elif schedule == "policy":  # the policy's switches, as they are
        pass
    else:
        monkeypatch.setattr(paged_policy, "SM90_PREFILL_OVERLAP", "overlap" in schedule)
        monkeypatch.setattr(paged_policy, "SM90_PREFILL_PINGPONG", schedule.endswith("pingpong"))
        monkeypatch.setattr(paged_policy, "SM90_PREFILL_FUSE_DECODE", schedule.startswith("fused"))
    if three:
        monkeypatch.setattr(paged_policy, "SM90_PREFILL_FUSE_DECODE", True)
    PLANS.clear()  # the switches are not in a plan's key
    cases = [((32, 8), 128, 16, "contiguous"), ((40, 8), 64, 2048, "contiguous")]
    if schedule == "v pages":  # 2 and 4 boxes a tile (8 above); heads 192 columns apart; hybrid
        cases += [((32, 8), 128, 32, "contiguous"), ((32, 8), 128, 64, "contiguous"),
                  ((32, 8), 128, 16, "wide"), ((32, 8), 128, 80, "hybrid")]  # fmt: skip
    for heads, head_dim, block_size, kind in cases:
        state = 3 * 8 * 128 * 2  # hybrid: a state of three token rows a page
        b = make_batch(GPU_SEQS, block_size=block_size, heads=heads, head_dim=head_dim,
                       dtype=torch.bfloat16, device="cuda", kind=kind,
                       state_bytes=state)  # fmt: skip
        mql, msl = max(q for _, q in GPU_SEQS), max(s for s, _ in GPU_SEQS)
        launches = plan_paged_attention(*b.args(), max_query_len=mql, max_seq_len=msl)
        (main,) = [launch for launch in launches if launch.name == "paged_prefill_sm90"]
        if schedule == "3 warpgroups":
            assert main.args["NUM_WG"] == 3
        if schedule.startswith("release"):
            assert (main.args["STAGES"], main.args["RELEASE_LAG"]) == (3, lag)
        if three:
            assert (main.args["STAGES"], main.args["PINGPONG"]) == (3, True)
        if schedule == "v pages":
            want = 128 // box_rows(block_size, 128) if head_dim == 128 else 1
            assert main.args["V_PAGES"] == want
        if schedule.startswith("exp2 poly"):
            assert main.args["EXP2_POLY"] == int(schedule.split()[-1])
        all_on = schedule.endswith("softmax switches")
        assert main.args["LAZY"] == (schedule == "lazy rescale" or all_on)
        assert main.args["TREE"] == (schedule == "tree reduce" or all_on)
        if all_on:
            assert main.args["EXP2_POLY"] == 2
        assert main.args["SPLIT"] == (schedule in ("fused decode",))
        assert main.args["DYNAMIC"] is dynamic
        # (only with turns: head_dim 128's tile, or the PINGPONG switch)
        assert main.args["Q_TMA"] is (q_tma and heads == (32, 8) and main.args["PINGPONG"])
        if schedule == "policy":  # the policy's tile: turns, 3 stages, the query by TMA
            assert main.args["PINGPONG"] is (head_dim == 128)
        # the decodes fused: no decode launch
        assert (len(launches) == 2) == paged_policy.SM90_PREFILL_FUSE_DECODE
        out = paged_attention(*b.args(), max_query_len=mql, max_seq_len=msl)
        torch.cuda.synchronize()
        check(b, out)
    PLANS.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("dynamic", [False, True], ids=["dealt", "dynamic"])
@pytest.mark.parametrize("fuse", [False, True], ids=["decode launch", "fused decode"])
def test_gpu_sm90_prefill_graph_replay_with_new_lengths(fuse, dynamic, monkeypatch):
    """Captured with the maxima given (the work list is built on the device), replayed after the
    batch's lengths change in place: other sequences prefill, others decode. Dynamic: each
    replay's work-list launch zeroes the counter again (else a replay would find every item
    taken and write nothing)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm_90 kernel needs an sm_90 GPU")
    from portattn.kernels._plans import PLANS

    monkeypatch.setattr(paged_policy, "SM90_PREFILL_FUSE_DECODE", fuse)
    monkeypatch.setattr(paged_policy, "SM90_PREFILL_DYNAMIC", dynamic)
    PLANS.clear()  # the switches are not in a plan's key
    seqs = ((3000, 300), (2000, 1), (999, 1), (1500, 250))
    b = make_batch(seqs, block_size=16, heads=(32, 8), head_dim=128, dtype=torch.bfloat16,
                   device="cuda")  # fmt: skip
    out = torch.empty_like(b.query)
    kw = dict(max_query_len=300, max_seq_len=3000, out=out)
    paged_attention(*b.args(), **kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(*b.args(), **kw)
    graph.replay()
    torch.cuda.synchronize()
    check(b, out)
    # the same 552 query rows split otherwise: sequence 1 now prefills 300, 0 decodes
    b.query_start_loc.copy_(torch.tensor([0, 1, 301, 302, 552], device="cuda"))
    b.seq_lens.copy_(torch.tensor([2500, 1900, 999, 1500], device="cuda"))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check(b, out)
    PLANS.clear()


@pytest.mark.gpu
def test_gpu_sm90_prefill_cached_calls_read_each_calls_query():
    """Three calls of one description, each with new tensors (query, caches, metadata): the plan
    cache's hits rebuild the query's TMA descriptor around each call's query (the producer
    loads it), so each output matches its own batch."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm_90 kernel needs an sm_90 GPU")
    from portattn.kernels._plans import PLANS

    PLANS.clear()
    mql, msl = max(q for _, q in GPU_SEQS), max(s for s, _ in GPU_SEQS)
    hits = PLANS.hits
    for seed in range(3):
        b = make_batch(GPU_SEQS, block_size=16, heads=(32, 8), head_dim=128,
                       dtype=torch.bfloat16, device="cuda", seed=seed)  # fmt: skip
        if seed == 0:
            launches = plan_paged_attention(*b.args(), max_query_len=mql, max_seq_len=msl)
            (main,) = [x for x in launches if x.name == "paged_prefill_sm90"]
            assert main.args["Q_TMA"] is True
        out = paged_attention(*b.args(), max_query_len=mql, max_seq_len=msl)
        torch.cuda.synchronize()
        check(b, out)
    assert PLANS.hits - hits >= 2
    PLANS.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("q_tma", [False, True], ids=["query loads", "query by TMA"])
@pytest.mark.parametrize("deal", ["dynamic", "dealt"])
def test_gpu_sm90_prefill_many_items_a_program(deal, q_tma, monkeypatch):
    """About 14 items a program, many of one or two tiles (GQA 16:1: 8-token q tiles of a
    3072-token prefill), so the dynamic deal's ring (`STAGES + 2` slots) wraps and its producer
    runs as far ahead as the stages let it; a chunk and a decode beside them. With the query by
    TMA (and turns, which it needs), the query buffers' barriers turn over once an item, many
    times a program."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm_90 kernel needs an sm_90 GPU")
    from portattn.kernels._plans import PLANS

    monkeypatch.setattr(paged_policy, "SM90_PREFILL_DYNAMIC", deal != "dealt")
    monkeypatch.setattr(paged_policy, "SM90_PREFILL_Q_TMA", q_tma)
    monkeypatch.setattr(paged_policy, "SM90_PREFILL_PINGPONG", q_tma)  # (head_dim 64: no turns)
    PLANS.clear()  # the switches are not in a plan's key
    seqs = ((3072, 3072), (1500, 600), (2000, 1))
    b = make_batch(seqs, block_size=16, heads=(64, 4), head_dim=64, dtype=torch.bfloat16,
                   device="cuda")  # fmt: skip
    launches = plan_paged_attention(*b.args(), max_query_len=3072, max_seq_len=3072)
    (main,) = [launch for launch in launches if launch.name == "paged_prefill_sm90"]
    assert main.args["DYNAMIC"] is (deal != "dealt")
    assert main.args["Q_TMA"] is q_tma
    items = main.args["SLOTS"] * sum(-(-q // main.args["BLOCK_Q"]) for _, q in seqs if q > 1)
    assert items > 2 * (main.args["STAGES"] + 2) * SM90.num_sms  # the ring wraps twice or more
    out = paged_attention(*b.args(), max_query_len=3072, max_seq_len=3072)
    torch.cuda.synchronize()
    check(b, out)
    PLANS.clear()


def _gpu_checked_main(seqs, *, block_size, heads, head_dim) -> dict:
    """Builds a bf16 batch of ``seqs`` on the GPU, runs the public op on it and checks the
    output against the fp64 oracle; returns the args of its plan's sm_90 prefill launch."""
    b = make_batch(seqs, block_size=block_size, heads=heads, head_dim=head_dim,
                   dtype=torch.bfloat16, device="cuda")  # fmt: skip
    mql, msl = max(q for _, q in seqs), max(s for s, _ in seqs)
    launches = plan_paged_attention(*b.args(), max_query_len=mql, max_seq_len=msl)
    (main,) = [x for x in launches if x.name == "paged_prefill_sm90"]
    out = paged_attention(*b.args(), max_query_len=mql, max_seq_len=msl)
    torch.cuda.synchronize()
    check(b, out)
    return main.args


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["policy", "dealt", "q by the warpgroups"])
def test_gpu_sm90_prefill_k_ahead(schedule, monkeypatch):
    """``SM90_PREFILL_K_AHEAD``: K buffers freed at the scores and K copied a tile ahead of V,
    under the policy's turns (the dynamic and the fixed deal; the query by TMA and by the
    warpgroups), at 16-row boxes (V pages), 32-row boxes, 544 (rows by divisions) and one box a
    tile, with the decode items' idle warpgroup passing tiles on, and on a batch of many short
    items (items of 1-2 tiles: K of an item's first tile waits on a buffer freed in an earlier
    item), against the fp64 oracle."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm_90 kernel needs an sm_90 GPU")
    from portattn.kernels._plans import PLANS

    monkeypatch.setattr(paged_policy, "SM90_PREFILL_K_AHEAD", True)
    monkeypatch.setattr(paged_policy, "SM90_PREFILL_DYNAMIC", schedule != "dealt")
    monkeypatch.setattr(paged_policy, "SM90_PREFILL_Q_TMA", schedule != "q by the warpgroups")
    if schedule == "q by the warpgroups":  # (the turns at 3 stages with the query not by TMA)
        tiles = dict(paged_policy.SM90_PREFILL_TILES)
        tiles[128] = paged_policy.Sm90PrefillTile(block_n=128, stages=3, pingpong=True)
        monkeypatch.setattr(paged_policy, "SM90_PREFILL_NO_TMA_TILES", tiles)
    PLANS.clear()  # the switches are not in a plan's key
    many = tuple((n, n) for n in (130, 70, 256, 129, 3, 200) * 6)
    cases = [(GPU_SEQS, b) for b in (16, 32, 544, 2048)] + [(many, 16)]
    for seqs, block_size in cases:
        args = _gpu_checked_main(seqs, block_size=block_size, heads=(32, 8), head_dim=128)
        assert args["K_AHEAD"] is True and args["PINGPONG"] is True
        assert args["Q_TMA"] is (schedule != "q by the warpgroups")
    PLANS.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["policy", "sequential", "split", "dealt"])
def test_gpu_sm90_prefill_item_ahead(schedule, monkeypatch):
    """``SM90_PREFILL_ITEM_AHEAD`` (prepared, off): each warpgroup takes its next item before its
    epilogue, in every branch (computing, passing tiles on, the split short items), under the
    policy's turns, the sequential tile, the split and the fixed deal; on the GPU cases and on a
    batch of many short items (the ring wraps, the last step's read is past the list)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm_90 kernel needs an sm_90 GPU")
    from portattn.kernels._plans import PLANS

    monkeypatch.setattr(paged_policy, "SM90_PREFILL_ITEM_AHEAD", True)
    if schedule in ("sequential", "split"):
        tiles = dict(paged_policy.SM90_PREFILL_TILES)
        tiles[128] = paged_policy.Sm90PrefillTile(block_n=128, stages=2)
        monkeypatch.setattr(paged_policy, "SM90_PREFILL_TILES", tiles)
    monkeypatch.setattr(paged_policy, "SM90_PREFILL_SPLIT_SHORT", schedule == "split")
    monkeypatch.setattr(paged_policy, "SM90_PREFILL_DYNAMIC", schedule != "dealt")
    PLANS.clear()  # the switches are not in a plan's key
    cases = [(GPU_SEQS, (32, 8), 128, 16), (GPU_SEQS, (40, 8), 64, 2048),
             (((3072, 3072), (1500, 600), (2000, 1)), (64, 4), 64, 16)]  # fmt: skip
    for seqs, heads, head_dim, block_size in cases:
        args = _gpu_checked_main(seqs, block_size=block_size, heads=heads, head_dim=head_dim)
        assert args["AHEAD"] is True
        if head_dim == 128:
            assert args["PINGPONG"] is (schedule in ("policy", "dealt"))
            assert args["SPLIT"] is (schedule == "split")
    PLANS.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "eager"])
@pytest.mark.parametrize("q_scale", [1.0, 4.0, 40.0])
@pytest.mark.parametrize("block_size", [16, 2048])
def test_gpu_sm90_prefill_lazy_rescale(lazy, q_scale, block_size, monkeypatch):
    """The lazy running max against the fp64 oracle where the maxima move little (random
    scores: P up to 2^8 against a stale max, rescales mostly skipped) and where they jump by far
    more than its 8 (a query scaled 4x and 40x: rescales taken, P near one-hot)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm_90 kernel needs an sm_90 GPU")
    from portattn.kernels._plans import PLANS

    monkeypatch.setattr(paged_policy, "SM90_PREFILL_LAZY_RESCALE", lazy)
    PLANS.clear()  # the switches are not in a plan's key
    b = make_batch(GPU_SEQS, block_size=block_size, heads=(32, 8), head_dim=128,
                   dtype=torch.bfloat16, device="cuda")  # fmt: skip
    b.query.mul_(q_scale)
    mql, msl = max(q for _, q in GPU_SEQS), max(s for s, _ in GPU_SEQS)
    launches = plan_paged_attention(*b.args(), max_query_len=mql, max_seq_len=msl)
    (main,) = [launch for launch in launches if launch.name == "paged_prefill_sm90"]
    assert main.args["LAZY"] is lazy
    out = paged_attention(*b.args(), max_query_len=mql, max_seq_len=msl)
    torch.cuda.synchronize()
    check(b, out)
    PLANS.clear()
