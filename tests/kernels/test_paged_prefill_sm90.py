"""The sm_90 prefill kernel: which launches a plan takes and with which configuration (the
policy's or a caller's, checked), its work list (run by the interpreter on a CPU), its compile
for sm_90 (no spills, shared memory within the estimate), and, on an H100/H200, its numerics
against the fp64 oracle (`gpu`). Triton's interpreter cannot run Gluon."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from portattn.compile import default_cases
from portattn.kernels._launch import Launch
from portattn.kernels._plans import PLANS
from portattn.kernels.paged_attention import paged_attention, plan_paged_attention
from portattn.kernels.paged_prefill_sm90 import (
    _work_list_kernel,
    item_order,
    sm90_prefill_errors,
    trace_shape,
    work_list_layout,
)
from portattn.platform import get_target
from portattn.policy.common import LaunchOptions
from portattn.policy.paged import (
    SM90_PREFILL_TILES,
    PagedConfig,
    PagedProblem,
    box_rows,
    paged_config,
    paging_mode,
    prefill_config,
    prefill_config_errors,
    prefill_smem_bytes,
    sm90_prefill,
)
from tests.helpers import TILE_128, compile_in_spawned_workers, target_compile, tile_128
from tests.kernels.test_paged_attention import check, make_batch

pytestmark = pytest.mark.paged

SM90 = get_target("sm_90")
META = dict(device="meta")
PREFILL = "paged_prefill_sm90"


def _plan(*, heads=(32, 8), head_dim=128, block_size=16, dtype=torch.bfloat16, mql=512,
          seqs=64, ctx=4096, layout="NHD", cache=None, target=SM90, config=None,
          trace=None):  # fmt: skip
    hq, hkv = heads
    q = torch.empty(8 * mql + seqs - 8, hq, head_dim, dtype=dtype, **META)
    if cache is None:
        cache = torch.empty(seqs * ctx // block_size + 1, block_size, hkv, head_dim, dtype=dtype,
                            **META)  # fmt: skip
    bt = torch.empty(seqs, -(-ctx // cache.shape[1]), dtype=torch.int32, **META)
    sl = torch.empty(seqs, dtype=torch.int32, **META)
    qsl = torch.empty(seqs + 1, dtype=torch.int32, **META)
    return plan_paged_attention(q, cache, cache, bt, sl, qsl, target=target, layout=layout,
                                max_query_len=mql, max_seq_len=ctx, config=config,
                                trace=trace)  # fmt: skip


def _names(launches: list[Launch]) -> list[str]:
    return [launch.name for launch in launches]


def _main_args(**kw) -> dict:
    (launch,) = [x for x in _plan(**kw) if x.name == PREFILL]
    return launch.args


def _problem(heads=(32, 8), head_dim=128, block_size=16, mql=512, **kw) -> PagedProblem:
    return PagedProblem(heads[0], heads[1], head_dim, 2, mql, block_size, 64, 4096, **kw)


def _config(*, heads=(32, 8), head_dim=128, block_size=16, **changes) -> PagedConfig:
    """The policy's configuration of `_plan`'s batch with ``changes``."""
    cfg = prefill_config(SM90, _problem(heads, head_dim, block_size))
    return PagedConfig(prefill=dataclasses.replace(cfg, **changes))


def test_mixed_batch_runs_its_decodes_as_items_of_the_sm90_launch():
    """A mixed batch: the work list, then the sm_90 kernel, whose second list holds the decode
    tile's sequences (q_len <= 4 at GQA 4:1): no decode launch after it."""
    launches = _plan()
    assert _names(launches) == ["paged_attention:work_list", PREFILL]
    work, main = launches
    # the op's output is every launch's: the plan cache returns the first launch's outputs
    assert work.outputs == main.outputs
    assert main.grid == (SM90.num_sms,)
    # 192 rows (three warpgroups), GQA 4:1
    assert main.args["BLOCK_Q"] == 48 and main.args["HEAD_TILE"] == 4
    assert main.args["BOX"] == 16 and main.args["rows_per_page"] == 16
    assert work.args["q_len_lo"] == 4
    assert main.args["b_off"] == work.args["b_off"] == 2 + 64 * work.args["num_q_tiles"]
    assert main.args["counter"] == work.args["counter"] == 2 + 2 * 64 * work.args["num_q_tiles"]


@pytest.mark.parametrize(
    ("block_size", "box", "box128"), [(16, 16, 16), (80, 16, 16), (544, 32, 32), (2048, 64, 128)]
)
def test_boxes_never_cross_a_page(block_size, box, box128):
    """A box is the page's largest power of two, at most a tile: the turns' 64 tokens at head_dim
    128 (``box``), the sequential tile's 128 (GQA 5:1, ``box128``)."""
    assert box_rows(block_size, 64) == box and box_rows(block_size, 128) == box128
    assert _main_args(block_size=block_size)["BOX"] == box and block_size % box == 0
    assert _main_args(heads=(40, 8), block_size=block_size)["BOX"] == box128


@pytest.mark.parametrize(
    ("block_size", "want", "want128"),
    [(16, 1, 1), (32, 1, 1), (64, 1, 1), (128, 2, 1), (80, 2, 0), (48, 0, 0), (544, 2, 2),
     (2048, 2, 2)],
)  # fmt: skip
def test_paging_takes_no_division_a_box_where_it_can(block_size, want, want128):
    """The producer's page lookup: a box a page (pages up to the tile), pages of a tile or more
    (one division a tile), a division a box only for pages shorter than a tile in boxes of
    another size: ``want`` at head_dim 128's 64-token turns (48 = 3 boxes of 16), ``want128`` at
    the sequential tile's 128 tokens (GQA 5:1; 80 = 5 boxes of 16); a config may ask for a
    division a box anywhere."""
    assert _main_args(block_size=block_size)["PAGING"] == want
    assert paging_mode(block_size, box_rows(block_size, 64), 64) == want
    assert _main_args(heads=(40, 8), block_size=block_size)["PAGING"] == want128
    assert paging_mode(block_size, box_rows(block_size, 128), 128) == want128
    config = _config(block_size=block_size, paging=0)
    assert _main_args(block_size=block_size, config=config)["PAGING"] == 0


def test_pure_prefill_has_no_decode_list():
    # MHA: a 192-row tile (three warpgroups) is 192 tokens of one head; the decode tile serves
    # q_len <= 16
    work, main = _plan(heads=(16, 16), mql=4096, seqs=8)
    assert (work.name, main.name) == ("paged_attention:work_list", PREFILL)
    assert main.args["BLOCK_Q"] == 192 and main.args["HEAD_TILE"] == 1 and main.args["SLOTS"] == 16


@pytest.mark.parametrize(
    "kwargs",
    [
        {"target": get_target("sm_80")},
        {"target": get_target("sm_100")},
        {"dtype": torch.float32},
        {"head_dim": 96},
        {"mql": 8},  # 32 rows: a verification step stays on the portable tiles
        {"block_size": 1},
        {"block_size": 24},  # not a multiple of the 16-row box
    ],
)
def test_portable_kernel_serves_the_rest(kwargs):
    assert PREFILL not in _names(_plan(**kwargs))


def test_hnd_stored_cache_is_refused_with_its_reason():
    cache = torch.empty(256, 8, 16, 128, dtype=torch.bfloat16, **META).permute(0, 2, 1, 3)
    assert PREFILL not in _names(_plan(cache=cache))
    q = torch.empty(1, 32, 128, dtype=torch.bfloat16, **META)
    errors = sm90_prefill_errors(q, cache, cache)
    assert any("HND" in e for e in errors), errors
    # a caller's config for it is refused with the same reason, naming the config
    with pytest.raises(ValueError, match="config.prefill cannot run this call: .*HND"):
        _plan(cache=cache, config=_config())


def test_hybrid_page_of_odd_state_size_is_refused():
    """K, V and a 48-byte state per page: the page stride is no multiple of the token stride,
    so no 2-D view addresses it (the portable kernel serves it); whole state rows are taken."""
    from portattn.layout import make_hybrid_cache

    q = torch.empty(1, 32, 128, dtype=torch.bfloat16, **META)
    odd = make_hybrid_cache(64, 544, 8, 128, mamba_state_bytes=48, dtype=torch.bfloat16, **META)
    errors = sm90_prefill_errors(q, odd.key_cache, odd.value_cache)
    assert any("page stride" in e for e in errors), errors
    whole = make_hybrid_cache(64, 544, 8, 128, mamba_state_bytes=3 * 2048, dtype=torch.bfloat16,
                              **META)  # fmt: skip
    assert sm90_prefill_errors(q, whole.key_cache, whole.value_cache) == []


def test_a_config_without_prefill_runs_the_portable_kernel():
    assert _names(_plan(config=PagedConfig())) == ["paged_attention"]


@pytest.mark.parametrize(
    ("kwargs", "changes", "why"),
    [
        ({}, dict(late_release=True), "late_release needs stages >= 3 and no turns"),
        ({}, dict(stages=2), "turns need stages >= 3 or split_release; got stages 2"),
        ({}, dict(turns=False, stages=3, late_release=True, query_by_tma=True),
         "query_by_tma needs turns"),
        ({"heads": (40, 8)}, dict(turns=True, stages=3, query_by_tma=True),
         "query_by_tma needs 16-byte aligned query rows"),
        ({"heads": (40, 8)}, dict(out_by_tma=True), "out_by_tma needs 16-byte aligned output"),
        ({"block_size": 2048}, dict(v_pages=True), "v_pages needs 2, 4 or 8 boxes a tile"),
        ({"block_size": 80}, dict(paging=1), "paging 1 needs box == block_size"),
        ({}, dict(box=32), "box 32 must divide block_size 16"),
        ({}, dict(box=0), "box must be a power of two >= 16; got 0"),  # was ZeroDivisionError
        ({"block_size": 2048}, dict(box=0, v_pages=True), "box must be a power of two"),
        # 2 x 4 stages of 128 x 128 (256 KB) beside two query buffers (32 KB)
        ({}, TILE_128 | dict(stages=4), "shared memory 296320 B > 232448"),
        ({}, dict(producer_regs=20), "producer_regs must be a multiple of 8 in"),
        ({}, dict(warpgroups=4), "warpgroups must be 2 or 3; got 4"),
        ({}, dict(consumer_regs=216, producer_regs=64),
         "3 consumer warpgroups at consumer_regs 216 and the producer's at producer_regs 64 "
         "need 91136 registers > 65536"),
        # a third query buffer (16 KB) beside 3 stages of 128 x 128 (192 KB)
        ({}, TILE_128 | dict(warpgroups=3, consumer_regs=160, producer_regs=32),
         "shared memory 247128 B > 232448"),
        ({"target": get_target("sm_100")}, {}, "needs an sm_90 target; got sm_100"),
        ({"head_dim": 96}, {}, r"needs head_dim in \(64, 128, 256\); got 96"),
        # head_dim 128's tile at head_dim 256: 4 stages of 64 x 256 (256 KB) beside 3 query
        # buffers (96 KB)
        ({"head_dim": 256}, {}, "shared memory 361880 B > 232448"),
    ],
)  # fmt: skip
def test_a_given_config_is_checked_against_the_target_and_the_call(kwargs, changes, why):
    """A caller's config that cannot run is refused, naming ``config`` and the rule (the
    policy's own choice never needs this: it gives way to the portable kernel)."""
    base = {k: v for k, v in kwargs.items() if k in ("heads", "block_size")}
    config = _config(**base, **changes)
    with pytest.raises(ValueError, match=r"^paged_attention: config.prefill cannot run .*" + why):
        _plan(**kwargs, config=config)


def test_config_and_trace_of_the_wrong_type_are_refused():
    with pytest.raises(TypeError, match="config must be a PagedConfig or None; got dict"):
        _plan(config={"turns": True})
    with pytest.raises(TypeError, match="trace must be a torch.Tensor or None; got list"):
        _plan(trace=[0])


def test_the_config_is_part_of_the_plan_cache_key(monkeypatch):
    """Two configs of one call are two plans; the same config again is a hit (meta tensors: the
    plans are made and kept, nothing runs)."""
    from portattn.kernels._plans import Plan

    monkeypatch.setattr(Launch, "run", lambda self: None)
    monkeypatch.setattr(Plan, "run", lambda self, inputs, ptrs=None: self.bind(inputs)[1])
    q = torch.empty(4 * 512, 32, 128, dtype=torch.bfloat16, **META)
    kc, vc = (torch.empty(1025, 16, 8, 128, dtype=torch.bfloat16, **META) for _ in "kv")
    bt = torch.empty(4, 256, dtype=torch.int32, **META)
    sl = torch.empty(4, dtype=torch.int32, **META)
    qsl = torch.empty(5, dtype=torch.int32, **META)
    PLANS.clear()
    configs = [None, _config(), _config(paging=0), PagedConfig()]
    for config in configs + configs:
        paged_attention(q, kc, vc, bt, sl, qsl, max_query_len=512, max_seq_len=4096,
                        config=config)  # fmt: skip
    # None and the policy's own config plan the same launches, but are two descriptions
    assert PLANS.misses == len(configs) and PLANS.hits == len(configs)
    PLANS.clear()


def test_policy_rule_is_pure():
    p = PagedProblem(num_q_heads=32, num_kv_heads=8, head_dim=128, elem_bytes=2,
                     max_query_len=512)  # fmt: skip
    assert sm90_prefill(SM90, p)
    assert not sm90_prefill(SM90, PagedProblem(32, 8, 128, 2, max_query_len=31))
    assert sm90_prefill(SM90, PagedProblem(32, 8, 128, 2, max_query_len=32))
    assert not sm90_prefill(SM90, PagedProblem(32, 8, 128, 2, 512, shuffled=True))
    assert not sm90_prefill(SM90, PagedProblem(32, 8, 128, 2, 512, block_size=24))
    assert not sm90_prefill(get_target("gfx942"), p)
    assert paged_config(get_target("gfx942"), p) == PagedConfig()


@pytest.mark.parametrize(
    ("problem", "want"),
    [
        # head_dim 128: turns on 64-token tiles at 4 stages with the query by TMA; no V pages
        # (at most 4 boxes a tile)
        (_problem(), (64, 4, True, True, False, False)),
        (_problem(block_size=544), (64, 4, True, True, False, False)),
        # GQA 5:1 / unaligned rows: the query cannot come by TMA, so the sequential 2-stage tile
        # on 128 tokens, V by page boxes at 16-row boxes (8 a tile), with 3 stages and the late
        # release at 2 or 4 boxes a tile
        (_problem(heads=(40, 8)), (128, 2, False, False, False, True)),
        (_problem(heads=(40, 8), block_size=544), (128, 3, False, False, True, False)),
        (_problem(heads=(40, 8), block_size=64), (128, 3, False, False, True, False)),
        (_problem(heads=(40, 8), block_size=2048), (128, 2, False, False, False, False)),
        (_problem(query_rows_aligned=False), (128, 2, False, False, False, True)),
        # KV heads 160 columns apart: V pages need 64-column groups
        (_problem(heads=(40, 8), kv_head_stride=160), (128, 2, False, False, False, False)),
        # head_dim 64: turns at 3 stages with the query by TMA, else sequential at 3 stages; one
        # 64-column group, no V pages
        (_problem(head_dim=64), (128, 3, True, True, False, False)),
        (_problem(heads=(40, 8), head_dim=64), (128, 3, False, False, False, False)),
        (_problem(heads=(40, 8), head_dim=64, block_size=544),
         (128, 3, False, False, False, False)),
    ],
)  # fmt: skip
def test_policy_config_by_shape(problem, want):
    """(block_n, stages, turns, query_by_tma, late_release, v_pages) of the policy's config; the
    box is the page's largest power of two, at most the tile."""
    cfg = prefill_config(SM90, problem)
    got = (cfg.block_n, cfg.stages, cfg.turns, cfg.query_by_tma, cfg.late_release, cfg.v_pages)
    assert got == want
    assert cfg.box == box_rows(problem.block_size, cfg.block_n)


@pytest.mark.parametrize(
    ("problem", "want"),
    [(_problem(head_dim=64), (False, False)),
     (_problem(heads=(40, 8), head_dim=64), (False, False)), (_problem(), (True, True)),
     (_problem(heads=(40, 8)), (True, True)),
     (_problem(head_dim=256), (True, True))],
)  # fmt: skip
def test_softmax_form_by_head_dim(problem, want):
    """(quad_sums, lazy_max): head_dim 64 sums whole rows at an exact running max; 128 and 256,
    their sequential tiles too, keep quad partial sums at a lazy max."""
    cfg = prefill_config(SM90, problem)
    assert (cfg.quad_sums, cfg.lazy_max) == want
    a = _main_args(heads=(problem.num_q_heads, problem.num_kv_heads), head_dim=problem.head_dim,
                   block_size=problem.block_size)  # fmt: skip
    assert (a["QUAD_SUMS"], a["LAZY_MAX"]) == want


@pytest.mark.parametrize(
    ("heads", "head_dim", "want"),
    [((32, 8), 64, False), ((32, 8), 128, False), ((32, 8), 256, True),
     ((40, 8), 64, False), ((40, 8), 128, False), ((40, 8), 256, False)],
)  # fmt: skip
def test_split_release_at_head_dim_256_turns(heads, head_dim, want):
    """head_dim 256's turns (GQA 4:1: the query by TMA) free K and V buffers apart; its
    sequential tile (GQA 5:1) and the other head_dims free each stage whole. The split's second
    barrier a stage is in the shared-memory estimate."""
    problem = _problem(heads, head_dim)
    cfg = prefill_config(SM90, problem)
    assert cfg.split_release is want
    assert _main_args(heads=heads, head_dim=head_dim)["SPLIT"] is want
    other = dataclasses.replace(cfg, split_release=not want)
    diff = prefill_smem_bytes(cfg, head_dim) - prefill_smem_bytes(other, head_dim)
    assert diff == (8 if want else -8) * cfg.stages


@pytest.mark.parametrize(
    ("problem", "want"),
    [
        # head_dim 64 and 128 with the query by TMA: turns among three warpgroups, 48 tokens x 4
        # heads, 12 x 16, 192 x 1
        (_problem(head_dim=64), (3, 160, 32, 48, 4)),
        (_problem(heads=(64, 4), head_dim=64, block_size=2048), (3, 160, 32, 12, 16)),
        (_problem(heads=(8, 8), head_dim=64), (3, 160, 32, 192, 1)),
        (_problem(), (3, 160, 32, 48, 4)),
        # the sequential tile (GQA 5:1: no query by TMA) and head_dim 256: two
        (_problem(heads=(40, 8), head_dim=64), (2, 216, 64, 25, 5)),
        (_problem(heads=(40, 8)), (2, 216, 64, 25, 5)),
        (_problem(head_dim=256), (2, 240, 24, 32, 4)),
    ],
)
def test_turns_take_three_warpgroups(problem, want):
    """The policy's warpgroups and their registers, and the item's rows the launch packs
    (``64 x warpgroups`` rows of whole tokens of the head tile)."""
    cfg = prefill_config(SM90, problem)
    assert (cfg.warpgroups, cfg.consumer_regs, cfg.producer_regs) == want[:3]
    assert prefill_config_errors(SM90, problem, cfg) == []
    heads = (problem.num_q_heads, problem.num_kv_heads)
    a = _main_args(heads=heads, head_dim=problem.head_dim, block_size=problem.block_size)
    assert (a["WGS"], a["BLOCK_Q"], a["HEAD_TILE"]) == (want[0], *want[3:])


def test_late_release_only_where_three_stages_fit():
    small = dataclasses.replace(SM90, max_shared_mem=200 * 1024)
    cfg = prefill_config(small, _problem(heads=(40, 8), block_size=544))
    assert (cfg.stages, cfg.late_release) == (2, False)


@pytest.mark.parametrize("head_dim", sorted(SM90_PREFILL_TILES))
@pytest.mark.parametrize("heads", [(32, 8), (40, 8)])
def test_shared_memory_estimate_fits_the_h100(head_dim, heads):
    for bs in (16, 64, 544, 2048):
        cfg = prefill_config(SM90, _problem(heads, head_dim, bs))
        assert prefill_smem_bytes(cfg, head_dim) <= SM90.max_shared_mem


def test_launch_tells_the_kernel_which_rows_are_aligned():
    """Q_VEC / O_VEC (`rows_aligned`): 16-byte query loads and 4-byte output stores only on
    rows the launcher found contiguous and aligned; anything else element by element (and the
    query not by TMA: the sequential tile)."""
    a = _main_args()
    assert (a["Q_VEC"], a["O_VEC"], a["Q_TMA"]) == (True, True, True)
    cache = torch.empty(64 * 4096 // 16 + 1, 16, 8, 128, dtype=torch.bfloat16, **META)
    bt = torch.empty(64, 256, dtype=torch.int32, **META)
    sl = torch.empty(64, dtype=torch.int32, **META)
    qsl = torch.empty(65, dtype=torch.int32, **META)
    tokens = 8 * 512 + 56
    q = torch.empty(tokens, 32, 129, dtype=torch.bfloat16, **META)[..., :128]  # head stride 129
    out = torch.empty(tokens, 32, 256, dtype=torch.bfloat16, **META)[..., ::2]
    launches = plan_paged_attention(q, cache, cache, bt, sl, qsl, target=SM90, out=out,
                                    max_query_len=512, max_seq_len=4096)  # fmt: skip
    (main,) = [launch for launch in launches if launch.name == PREFILL]
    assert (main.args["Q_VEC"], main.args["O_VEC"], main.args["Q_TMA"]) == (False, False, False)
    assert (main.args["PINGPONG"], main.args["STAGES"]) == (False, 2)


@pytest.mark.parametrize(
    ("problem", "want"),
    [
        (_problem(), True),
        (_problem(head_dim=64), True),
        (_problem(head_dim=256), True),  # (the sequential loop: its warpgroups load the query)
        (_problem(heads=(16, 16)), True),  # MHA: 64 tokens of one head
        (_problem(query_rows_aligned=False), True),  # (the output's rows decide)
        (_problem(out_rows_aligned=False), False),
        (_problem(heads=(40, 8)), False),  # GQA 5:1: 64 rows are no whole tokens
        (_problem(heads=(256, 2)), False),  # GQA 128:1: a token's heads pass 64 rows
    ],
)
def test_policy_stores_the_output_by_tma_where_a_box_holds_a_warpgroups_rows(problem, want):
    assert prefill_config(SM90, problem).out_by_tma is want


def test_output_by_tma_descriptor_is_a_warpgroups_rows():
    """The output's descriptor views it as the query's does ([column groups, tokens, heads,
    64]); an unaligned output keeps element stores, and a caller's config cannot ask for TMA
    there."""
    a = _main_args()
    assert a["O_TMA"] is True
    assert list(a["o_desc"].block_shape) == [2, 16, 4, 64]
    assert list(a["o_desc"].strides) == [64, 32 * 128, 128, 1]
    assert a["o_desc"].base is a["out_ptr"]
    cache = torch.empty(64 * 4096 // 16 + 1, 16, 8, 128, dtype=torch.bfloat16, **META)
    bt = torch.empty(64, 256, dtype=torch.int32, **META)
    sl = torch.empty(64, dtype=torch.int32, **META)
    qsl = torch.empty(65, dtype=torch.int32, **META)
    q = torch.empty(8 * 512 + 56, 32, 128, dtype=torch.bfloat16, **META)
    out = torch.empty(8 * 512 + 56, 32, 129, dtype=torch.bfloat16, **META)[..., :128]
    kw = dict(target=SM90, out=out, max_query_len=512, max_seq_len=4096)
    (main,) = [x for x in plan_paged_attention(q, cache, cache, bt, sl, qsl, **kw)
               if x.name == PREFILL]  # fmt: skip
    assert (main.args["O_TMA"], main.args["Q_TMA"], main.args["O_VEC"]) == (False, True, False)
    with pytest.raises(ValueError, match="out_by_tma needs 16-byte aligned output rows"):
        plan_paged_attention(q, cache, cache, bt, sl, qsl, config=_config(), **kw)


def test_query_by_tma_descriptor_is_a_warpgroups_rows():
    a = _main_args()
    assert list(a["q_desc"].block_shape) == [2, 16, 4, 64]  # [halves, tokens, heads, 64]
    assert list(a["q_desc"].strides) == [64, 32 * 128, 128, 1]
    # head_dim 64: one 64-column group a box; a caller's sequential config loads no query
    assert list(_main_args(heads=(64, 8), head_dim=64)["q_desc"].block_shape) == [1, 8, 8, 64]
    config = _config(heads=(64, 8), head_dim=64, turns=False, query_by_tma=False)
    assert _main_args(heads=(64, 8), head_dim=64, config=config)["Q_TMA"] is False


@pytest.mark.parametrize(
    ("block_size", "head_dim", "stride_pad", "want"),
    [
        (16, 128, 0, 8),
        (32, 128, 0, 4),
        (544, 128, 0, 4),  # 32-row boxes
        (64, 128, 0, 2),
        (16, 128, 32, 1),  # KV heads 160 columns apart: not in 64-column groups
    ],
)
def test_v_pages_where_a_page_box_is_shorter_than_the_tile(block_size, head_dim, stride_pad,
                                                          want):  # fmt: skip
    """V tiles as one-copy page boxes where a tile spans several boxes and the head dim has
    64-column groups to join (asked for at every box count, on 128-token tiles: `TILE_128`);
    the descriptor is then the 3-D view, one box a page."""
    config = _config(block_size=block_size, **(tile_128(block_size) | dict(v_pages=True)))
    heads = 8 * (head_dim + stride_pad)
    base = torch.empty(64, block_size, heads, dtype=torch.bfloat16, **META)
    cache = base.view(64, block_size, 8, head_dim + stride_pad)[..., :head_dim]
    if want == 1:
        with pytest.raises(ValueError, match="v_pages needs"):
            _plan(cache=cache, config=config)
        return
    a = _main_args(cache=cache, config=config)
    assert a["V_PAGES"] == want
    assert a["v_desc"].block_shape == [head_dim // 64, block_size & -block_size, 64]
    assert a["v_desc"].strides == [64, cache.stride(1), 1]


@pytest.mark.parametrize(
    ("heads", "block_size", "want"),
    [((40, 8), 16, 8), ((40, 8), 48, 8), ((40, 8), 80, 8), ((40, 8), 32, 1), ((40, 8), 544, 1),
     ((40, 8), 64, 1), ((32, 8), 16, 1), ((32, 8), 48, 1)],
)  # fmt: skip
def test_v_pages_by_default_at_sixteen_row_boxes(heads, block_size, want):
    """The policy takes V pages where a tile has 8 boxes (16-row boxes on the sequential tile's
    128 tokens, GQA 5:1) and not at 2 or 4 (head_dim 128's turns: 4 at most a 64-token tile)."""
    a = _main_args(heads=heads, block_size=block_size)
    assert a["V_PAGES"] == want
    assert len(a["v_desc"].block_shape) == (3 if want > 1 else 2)


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


# -- the work list, on the interpreter ------------------------------------------------------------


def _work_list(q_lens, q_len_lo, block_q, device, max_query_len=None):
    """The prefill list's (sequence, q tile) entries, ``num_q_tiles``, and the decode list's."""
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
            num_q_tiles=num_q_tiles,
            BLOCK_Q=block_q,
            BLOCK_S=4,
        ),  # fmt: skip
        options=LaunchOptions(4, 1),
        target=SM90,
    ).run()
    work = work.cpu()
    assert (work[size:] == -7).all(), "written past the list"
    assert work[size - 1] == 0, "the item counter not zeroed"
    n_a, n_b, b_off = int(work[0]), int(work[1]), layout.b_off
    main = [divmod(int(e), num_q_tiles) for e in work[2 : 2 + n_a]]
    second = [divmod(int(e), num_q_tiles) for e in work[b_off : b_off + n_b]]
    return main, num_q_tiles, second


@pytest.mark.parametrize(
    ("q_lens", "q_len_lo", "block_q"),
    [
        ((512, 1, 1, 3, 512, 0, 1), 2, 32),  # decode-tile sequences and an idle slot apart
        ((1, 1, 1), 2, 32),  # decodes only
        ((33, 32, 31, 65, 1, 100, 7, 9, 200, 2, 128), 0, 32),  # > BLOCK_S sequences
        ((4096,) * 3, 4, 128),
        ((512, 1, 1, 3, 512, 0, 2, 40, 4, 5), 4, 32),
    ],
)
def test_work_list_lists_each_tile_once_heaviest_first(q_lens, q_len_lo, block_q, device):
    """Prefill sequences (q_len > q_len_lo) in the first list, heaviest q tile first; the decode
    tile's (0 < q_len <= q_len_lo) in the second; idle slots in neither."""
    entries, _, second = _work_list(list(q_lens), q_len_lo, block_q, device)
    expect = [
        (seq, t)
        for seq, q in enumerate(q_lens)
        if q > q_len_lo
        for t in reversed(range(-(-q // block_q)))
    ]
    assert entries == expect
    assert second == [(s, 0) for s, q in enumerate(q_lens) if 0 < q <= q_len_lo]


def test_work_list_stays_in_its_bounds_when_a_q_len_exceeds_the_maximum(device):
    """A caller that vouches max_query_len 64 but sends a 200-token chunk: the list keeps the
    chunk's first two q tiles (what the grid was sized for) and writes nothing past its end."""
    entries, num_q_tiles, second = _work_list([200, 3, 64, 1], 4, 32, device, max_query_len=64)
    assert num_q_tiles == 2
    assert entries == [(0, 1), (0, 0), (2, 1), (2, 0)]
    assert second == [(1, 0), (3, 0)]


@pytest.mark.parametrize(
    ("n_a", "n_b"), [(4096, 448), (1024, 448), (448, 4096), (0, 448), (100, 0), (5, 3), (131, 1)]
)
def test_item_order_runs_each_item_once_with_the_decodes_spread(n_a, n_b):
    """`item_order` (the kernel's `_item_counts` / `_item_at`): every item of both lists once,
    each list in its order (heaviest q tiles of a sequence first), and any stretch of the order
    holds its share of decode items, within one."""
    order = item_order(n_a, n_b)
    assert sorted(order) == [(False, j) for j in range(n_a)] + [(True, j) for j in range(n_b)]
    assert [j for second, j in order if not second] == list(range(n_a))
    assert [j for second, j in order if second] == list(range(n_b))
    n = n_a + n_b
    window = min(400, n)
    for start in range(0, n - window + 1, 97):
        got = sum(second for second, _ in order[start : start + window])
        assert abs(got - window * n_b / n) <= 1, (start, got)


# -- compile for sm_90 (no GPU) ------------------------------------------------------------------


def _compiled_main(block_size: int, changes: dict, trace: bool = False):
    """(the launch, its sm_90 build, its ptxas spill bytes) of the mixed batch's sm_90 prefill
    launch at ``block_size``, the policy's config with ``changes`` (``trace``: a traced build):
    for the compile jobs below, run in spawned workers (`tests.helpers.in_spawned_workers`; a
    Gluon kernel compiled in a process that has run the interpreter can fail to build)."""
    from portattn.compile.worker import _nvidia_resources, compile_kernel

    buf = None
    if trace:
        buf = torch.empty(math.prod(trace_shape(SM90.num_sms)), dtype=torch.int64, **META)
    config = _config(block_size=block_size, **changes)
    (launch,) = [x for x in _plan(block_size=block_size, config=config, trace=buf)
                 if x.name == PREFILL]  # fmt: skip
    compiled = compile_kernel(launch, SM90)
    return launch, compiled, _nvidia_resources(compiled, 90)[1]


@pytest.mark.parametrize("case_id", ["bs16", "bs544", "bs2048"])
@target_compile
def test_compiles_for_sm90_without_spills(case_id):
    """The long GQA 4:1 prefill cases of the compile matrix: the sm_90 kernel within its
    estimate (and the target's shared memory), spills within the compile gate's 16 B."""
    case = {c.id: c for c in default_cases()}[
        f"paged_attention/hd128 gqa4 {case_id} NHD prefill q512 long"
    ]
    (cell,) = compile_in_spawned_workers([case], ["sm_90"])
    (r,) = [launch for launch in cell.launches if launch.name == PREFILL]
    assert r.ok, r.error
    # the launch the cell compiled: the policy's turns among three warpgroups at 4 stages of 64
    # tokens, the query by TMA, one item counter (an atomic before the producer's loop and one
    # at each item's end)
    (main,) = [x for x in case.plan(SM90) if x.name == PREFILL]
    a = main.args
    got = (a["WGS"], a["BLOCK_N"], a["STAGES"], a["LATE_RELEASE"], a["PINGPONG"], a["Q_TMA"])
    assert got == (3, 64, 4, False, True, True)
    cfg = prefill_config(SM90, _problem(block_size=int(case_id[2:])))
    assert r.shared <= prefill_smem_bytes(cfg, 128)
    # (12 B at each block size: the prologue parks the work list's pointer and the output's
    # token stride, reloaded at each partition's start and on the element stores, not a tile)
    assert r.spills <= 16, r.spills


@target_compile
def test_head_dim_256_compiles_for_sm90_within_its_estimate_and_allowance():
    """The compile matrix's head_dim-256 GQA 8:1 and 5:1 cases on sm_90: the sm_90 kernel in
    the plan, shared memory within `prefill_smem_bytes` (and the target), spills within the
    gate plus the cases' stated allowance."""
    by_id = {c.id: c for c in default_cases()}
    cases = [
        by_id[f"paged_attention/hd256 {name} NHD prefill"] for name in ("gqa8 bs16", "gqa5 bs544")
    ]
    cells = compile_in_spawned_workers(cases, ["sm_90"])
    for case, cell in zip(cases, cells, strict=True):
        assert cell.passed, (cell.id, cell.reasons)
        (r,) = [launch for launch in cell.launches if launch.name == PREFILL]
        p = dict(case.params)
        problem = _problem((p["num_q_heads"], p["num_kv_heads"]), 256, p["block_size"], mql=64)
        cfg = prefill_config(SM90, problem)
        assert cfg.block_n == 64 and r.shared <= prefill_smem_bytes(cfg, 256), (cell.id, r.shared)
        assert r.spills <= 16 + case.allowance("cuda", "sm_90"), (cell.id, r.spills)


def _query_copies(q_tma: bool, block_size: int) -> tuple[bool, int, int, int, int, int]:
    """(the Q_TMA arg, spills, shared bytes, TMA copies, global loads, atomics) of the mixed
    batch's sm_90 launch taking the policy's turns with the query by TMA or not, compiled for
    sm_90 (a spawned worker)."""
    # (the output by element stores on both sides: only the query's path differs)
    launch, compiled, spills = _compiled_main(
        block_size, dict(query_by_tma=q_tma, out_by_tma=False)
    )
    ptx = compiled.asm["ptx"]
    return (launch.args["Q_TMA"], spills, compiled.metadata.shared,
            ptx.count("cp.async.bulk.tensor"), ptx.count("ld.global"),
            ptx.count("atom.global"))  # fmt: skip


@target_compile
def test_query_by_tma_compiles_for_sm90_without_spills():
    """The producer's query copies in the policy's turns, against the same loop without them:
    more TMA copies, fewer global loads (the warpgroups' query reads gone), shared memory within
    `prefill_smem_bytes`, spills within the compile gate's 16 B either way, and the item
    counter's two atomics."""
    from tests.helpers import in_spawned_workers

    jobs = [(on, bs) for on in (True, False) for bs in (16, 544, 2048)]
    got = in_spawned_workers(_query_copies, jobs)
    for bs in (16, 544, 2048):
        on, spills, shared, copies, loads, atomics = got[(True, bs)]
        off = got[(False, bs)]
        assert on is True and off[0] is False
        assert spills <= 16 and off[1] <= 16, bs
        cfg = prefill_config(SM90, _problem(block_size=bs))
        assert shared <= prefill_smem_bytes(cfg, 128), (bs, shared)
        assert copies > off[3], bs  # (ptxas may duplicate the loop's copies: not a count)
        assert loads < off[4], bs
        assert atomics == off[5] == 2


def _output_stores(o_tma: bool) -> tuple[bool, int, int, int | None]:
    """(the O_TMA arg, TMA stores, their waits, spills) of the mixed batch's sm_90 launch at
    block 16 with the output by TMA through the query buffer or not, compiled for sm_90 (a
    spawned worker)."""
    launch, compiled, spills = _compiled_main(16, dict(out_by_tma=o_tma))
    ptx = compiled.asm["ptx"]
    stores = ptx.count("cp.async.bulk.tensor.4d.global.shared::cta")
    return launch.args["O_TMA"], stores, ptx.count("cp.async.bulk.wait_group.read"), spills


@target_compile
def test_output_by_tma_compiles_to_a_bulk_store_a_warpgroup():
    """With the output by TMA each consumer warpgroup's epilogue has its bulk tensor store and
    a wait for TMA to have read the buffer; without, none; spills within the compile gate's
    16 B either way."""
    from tests.helpers import in_spawned_workers

    got = in_spawned_workers(_output_stores, [(True,), (False,)])
    on, off = got[(True,)], got[(False,)]
    assert on[0] is True
    assert on[1] >= 2 and on[2] >= 2, on  # (ptxas may duplicate a path: not an exact count)
    assert on[3] <= 16, on
    assert off[0] is False and off[1] == off[2] == 0, off
    assert off[3] <= 16, off


def _warpgroups_build(warpgroups: int, block_size: int) -> tuple[int, int, int, int, list[int]]:
    """(the WGS arg, threads a program, shared bytes, spills, setmaxnreg counts) of the
    mixed batch's sm_90 launch at head_dim 64 with the policy's config at ``warpgroups``
    (two: the 2-warpgroup turns' registers), compiled for sm_90 (a spawned worker)."""
    import re

    from portattn.compile.worker import _nvidia_resources, compile_kernel
    from portattn.policy.paged import SM90_PREFILL_REGS

    regs = dict(zip(("consumer_regs", "producer_regs"), SM90_PREFILL_REGS, strict=True))
    changes = {} if warpgroups == 3 else dict(warpgroups=2, **regs)
    config = _config(head_dim=64, block_size=block_size, **changes)
    (launch,) = [x for x in _plan(head_dim=64, block_size=block_size, config=config)
                 if x.name == PREFILL]  # fmt: skip
    compiled = compile_kernel(launch, SM90)
    ptx = compiled.asm["ptx"]
    threads = int(re.search(r"\.reqntid (\d+)", ptx).group(1))
    counts = [int(n) for n in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+);", ptx)]
    spills = _nvidia_resources(compiled, 90)[1]
    return launch.args["WGS"], threads, compiled.metadata.shared, spills, sorted(set(counts))


@target_compile
def test_head_dim_64_compiles_three_consumer_warpgroups_for_sm90():
    """The policy's head_dim-64 turns build four warpgroups a program (three consumers at 160
    registers, the producer's warp), shared memory within `prefill_smem_bytes` (the third query
    buffer), spills within the case allowance (`SM90_HD64_SPILL_ALLOWANCE`); the two-warpgroup
    build of the same call three warpgroups without spills."""
    from portattn.compile.cases import SM90_HD64_SPILL_ALLOWANCE
    from tests.helpers import in_spawned_workers

    jobs = [(3, 16), (3, 80), (2, 16)]
    got = in_spawned_workers(_warpgroups_build, jobs)
    allowance = dict(SM90_HD64_SPILL_ALLOWANCE)["sm_90"]
    for bs in (16, 80):
        wgs, threads, shared, spills, counts = got[(3, bs)]
        assert (wgs, threads) == (3, 512), bs
        assert 160 in counts and not any(160 < c < 256 for c in counts), counts
        cfg = prefill_config(SM90, _problem(head_dim=64, block_size=bs))
        assert shared <= prefill_smem_bytes(cfg, 64), (bs, shared)
        assert spills <= 16 + allowance, (bs, spills)
    wgs, threads, shared, spills, _ = got[(2, 16)]
    assert (wgs, threads, spills) == (2, 384, 0)
    assert shared < got[(3, 16)][2]


def _pv_groups(v_pages: bool, block_size: int) -> tuple[int, int, int, int]:
    """(the V_PAGES arg, wgmma fences, commit groups, spills) of the mixed batch's sm_90 launch
    at ``block_size`` on `TILE_128` with V pages or not, compiled for sm_90 (a spawned
    worker)."""
    changes = tile_128(block_size) | dict(v_pages=v_pages)
    launch, compiled, spills = _compiled_main(block_size, changes)
    ptx = compiled.asm["ptx"]
    fences, commits = ptx.count("wgmma.fence"), ptx.count("wgmma.commit_group")
    return launch.args["V_PAGES"], fences, commits, spills


@target_compile
def test_v_pages_keep_p_v_one_commit_group():
    """With V pages (on 128-token tiles: 8 boxes of 16 rows at block 16, 4 of 32 at block 544)
    P V reads the tile through one shared layout of its boxes: the build has as many wgmma fences
    and commit groups as the same launch reading V as one tile, and spills within the compile
    gate's 16 B."""
    from tests.helpers import in_spawned_workers

    jobs = [(on, bs) for on in (True, False) for bs in (16, 544)]
    got = in_spawned_workers(_pv_groups, jobs)
    for bs, boxes in ((16, 8), (544, 4)):
        on, off = got[(True, bs)], got[(False, bs)]
        assert (on[0], off[0]) == (boxes, 1), bs
        assert on[1:3] == off[1:3], (bs, on, off)
        assert on[3] <= 16, bs


def test_trace_builds_traced_launches_only_when_given():
    """The diagnostic trace is a launch argument: given, the launch stamps into the buffer;
    otherwise the kernel is built without the stamps."""
    assert _main_args()["TRACE"] is False
    buf = torch.empty(math.prod(trace_shape(SM90.num_sms)), dtype=torch.int64, **META)
    a = _main_args(trace=buf)
    assert a["TRACE"] is True and a["trace_ptr"] is buf


_TRACE_RULE = "^paged_attention: trace must be a contiguous int64 tensor on meta of at least"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(trace=torch.empty(16, dtype=torch.int64, **META)),
         _TRACE_RULE),
        (dict(trace=torch.empty(1 << 24, dtype=torch.int32, **META)),
         _TRACE_RULE),
        # stamped flat from its first element: an expanded view took them past its own
        (dict(trace=torch.empty(1, dtype=torch.int64, **META).expand(1 << 24)),
         _TRACE_RULE + r".* strides \(0,\)"),
        (dict(mql=8, trace=torch.empty(1 << 24, dtype=torch.int64, **META)),
         "trace needs the sm_90 prefill kernel"),
    ],
)  # fmt: skip
def test_trace_refuses_what_it_cannot_stamp(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _plan(**kwargs)


def _traced_ptx_counts(turns: bool) -> tuple[int, int, int, int | None]:
    """(consumer warpgroups, global timer reads, clock reads, ptxas spill bytes) of the traced
    launch compiled for sm_90: the policy's sequential tile (two warpgroups on 128 tokens at 2
    stages, as where the query cannot come by TMA), or with ``turns`` the policy's (three
    warpgroups at 4 stages of 64 tokens, the query by TMA). Run in a spawned process
    (`_compiled_main`)."""
    changes = (
        {}
        if turns
        else TILE_128 | dict(turns=False, query_by_tma=False, stages=2, box=128,
                             v_pages=False)
    )  # fmt: skip
    main, compiled, spills = _compiled_main(2048, changes, trace=True)
    assert main.args["PINGPONG"] is main.args["Q_TMA"] is turns
    ptx = compiled.asm["ptx"]
    return main.args["WGS"], ptx.count("%globaltimer"), ptx.count("%clock64"), spills


@target_compile
def test_traced_kernel_compiles_for_sm90_within_the_spill_gate():
    """The traced build stamps in every partition (CPU compile, sm_90 PTX): the clock at each of
    the consumers' and the producer's steps, the global timer at their ends, in the sequential
    loop (two consumer warpgroups) and in the policy's turns (three). Spills within 24 B (a
    diagnostic build: ptxas parks 8-20 B of the values the partitions share in the prologue,
    reloaded once a partition or an item, beside the stamps; the gate's 16 B holds the untraced
    builds)."""
    from tests.helpers import in_spawned_workers

    got = in_spawned_workers(_traced_ptx_counts, [(False,), (True,)])
    # the global timer at both ends of each partition (the warpgroups' and the producer's); the
    # clock at both ends, and: warpgroup 0 at 7 steps a tile, an item's start and end (stores
    # issued, next step in hand: 2) (with turns, 7 more for the item's last tile, outside the
    # loop); each other warpgroup the same, and 4 on the path that passes a decode item's tiles
    # on (warpgroup 0 never takes it); the producer 3 a tile
    for turns, last, wgs in ((False, 0, 2), (True, 7, 3)):
        got_wgs, timer, clock, spills = got[(turns,)]
        assert (got_wgs, timer) == (wgs, 2 * (wgs + 1)), turns
        first = 2 + 7 + last + 1 + 2
        assert clock == first + (wgs - 1) * (first + 4) + (2 + 3), turns
        assert spills <= 24, (turns, spills)


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
    ((64, 4), 64, 2048, "contiguous", torch.bfloat16, 0),  # GQA 16:1: 12 tokens x 16 heads
    ((32, 8), 64, 16, "contiguous", torch.bfloat16, 0),  # 3 warpgroups: 48 tokens x 4 heads
    ((32, 8), 256, 16, "contiguous", torch.bfloat16, 0),  # head_dim 256: 64-token tiles
    ((40, 8), 256, 544, "hybrid", torch.float16, 8 * 256 * 2),
    ((16, 16), 256, 80, "slice", torch.bfloat16, 0),
    # groups that do not divide 64: a warpgroup's rows end inside a token, and a token's heads
    # may span two warpgroups
    ((24, 8), 128, 16, "contiguous", torch.bfloat16, 0),  # GQA 3:1: 42 tokens x 3 heads
    ((28, 4), 64, 2048, "contiguous", torch.float16, 0),  # GQA 7:1: 18 tokens x 7 heads
    ((48, 8), 256, 16, "contiguous", torch.bfloat16, 0),  # GQA 6:1 at head_dim 256
    ((24, 2), 128, 544, "hybrid", torch.bfloat16, 3 * 2 * 128 * 2),  # GQA 12:1
    ((96, 1), 128, 16, "contiguous", torch.bfloat16, 0),  # one KV head of 96: 1 token x 96
    ((128, 1), 64, 80, "slice", torch.bfloat16, 0),  # one KV head of 128
    ((66, 1), 256, 16, "contiguous", torch.float16, 0),  # one KV head of 66
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
    assert PREFILL in _names(launches), sm90_prefill_errors(b.query, b.key_cache, b.value_cache)
    out = paged_attention(*b.args(), max_query_len=mql, max_seq_len=msl)
    torch.cuda.synchronize()
    check(b, out)
    out2 = paged_attention(*b.args())  # the bounds read from the metadata
    torch.cuda.synchronize()
    check(b, out2)


@pytest.mark.gpu
@pytest.mark.parametrize("q_tma", [False, True], ids=["query loads", "query by TMA"])
@pytest.mark.parametrize("form", ["aligned", "padded", "odd head stride", "dim stride 2"])
def test_gpu_sm90_prefill_query_and_output_forms(form, q_tma):
    """A query and an output of the same form: aligned rows (16-byte query loads, whole
    warpgroups' rows stored by TMA, others in 4 bytes), padded rows (8 elements of NaN a row:
    still aligned, and left untouched), rows
    whose head stride is not a multiple of 8 elements, or a head dim of stride 2 (both element
    by element); each against the oracle. The policy's config sends the aligned forms' query by
    TMA (the NaN padding never read) and their output through the query buffer; the other
    config takes `TILE_128`'s turns with the warpgroups reading their rows."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm_90 kernel needs an sm_90 GPU")
    b = make_batch(GPU_SEQS, block_size=16, heads=(32, 8), head_dim=128, dtype=torch.bfloat16,
                   device="cuda")  # fmt: skip
    aligned = form in ("aligned", "padded")

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
    loads = dict(query_by_tma=False, out_by_tma=aligned)
    config = None if q_tma else _config(**(tile_128(16) | loads))
    mql, msl = max(q for _, q in GPU_SEQS), max(s for s, _ in GPU_SEQS)
    kw = dict(max_query_len=mql, max_seq_len=msl, out=out, config=config)
    (main,) = [x for x in plan_paged_attention(*b.args(), **kw) if x.name == PREFILL]
    assert main.args["Q_VEC"] is main.args["O_VEC"] is aligned
    assert main.args["O_TMA"] is aligned
    assert main.args["Q_TMA"] is (q_tma and aligned)
    got = paged_attention(*b.args(), **kw)
    torch.cuda.synchronize()
    assert got is out
    check(b, out)
    if form == "padded":  # nothing written past the rows
        assert torch.isnan(out._base[..., 128:]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(32, 8), (24, 8)], ids=["GQA 4:1", "GQA 3:1"])
@pytest.mark.parametrize("broadcast", ["tokens", "heads"])
def test_gpu_sm90_prefill_broadcast_query(broadcast, heads):
    """A query broadcast over its tokens (token stride 0) or its heads (head stride 0), as
    ``expand`` makes it: aligned rows, so the policy may load it by TMA, whose descriptor then
    holds a stride of 0; against the oracle on the same (materialized) query."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm_90 kernel needs an sm_90 GPU")
    b = make_batch(GPU_SEQS, block_size=16, heads=heads, head_dim=128, dtype=torch.bfloat16,
                   device="cuda")  # fmt: skip
    n, h, d = b.query.shape
    one = b.query[:1] if broadcast == "tokens" else b.query[:, :1]
    b.query = one.expand(n, h, d)
    assert b.query.stride(0 if broadcast == "tokens" else 1) == 0
    mql, msl = max(q for _, q in GPU_SEQS), max(s for s, _ in GPU_SEQS)
    kw = dict(max_query_len=mql, max_seq_len=msl)
    assert PREFILL in _names(plan_paged_attention(*b.args(), **kw))
    out = paged_attention(*b.args(), **kw)
    torch.cuda.synchronize()
    check(b, out)


GPU_CONFIGS = {
    "policy": {},
    "sequential": dict(turns=False, query_by_tma=False, stages=2),
    "sequential, 3 stages": dict(turns=False, query_by_tma=False, stages=3),
    "late release": dict(turns=False, query_by_tma=False, stages=3, late_release=True),
    "turns, query loads": dict(turns=True, query_by_tma=False, stages=3),
    # (`TILE_128`: 8, 4 and 2 boxes a tile at 16-, 32- and 64-token pages, the policy's box)
    "v pages": TILE_128 | dict(v_pages=True),
    "paging 0": dict(paging=0),
    "output stores": dict(out_by_tma=False),
    "sequential, output stores": dict(turns=False, query_by_tma=False, stages=2, out_by_tma=False),
    "two warpgroups": dict(warpgroups=2, consumer_regs=216, producer_regs=64),
    # the softmax's other forms than each head_dim's policy (64: exact max, whole row sums)
    "exact max, whole sums": dict(lazy_max=False, quad_sums=False),
    "lazy max, quad sums": dict(lazy_max=True, quad_sums=True),
    # K and V freed apart: under the policy's turns, turns at 2 stages (which need it), the
    # sequential loop and its late release
    "split release": dict(split_release=True),
    "split release, turns at 2 stages": dict(split_release=True, stages=2),
    "split release, sequential": dict(split_release=True, turns=False, query_by_tma=False),
    "split release, late release": dict(
        split_release=True, turns=False, query_by_tma=False, stages=3, late_release=True
    ),
    "three warpgroups, 64 tokens": dict(
        warpgroups=3,
        block_n=64,
        box=16,
        paging=0,
        v_pages=False,
        consumer_regs=160,
        producer_regs=32,
    ),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_gpu_sm90_prefill_configs(name):
    """The kernel's loops under other configurations than the policy's, on a mixed batch of the
    GPU cases (head_dim 128 GQA 4:1 and 64 GQA 16:1, V pages also at 2 and 4 boxes a tile and
    on KV heads 192 columns apart, a hybrid cache) against the fp64 oracle."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm_90 kernel needs an sm_90 GPU")
    changes = GPU_CONFIGS[name]
    cases = [((32, 8), 128, 16, "contiguous"), ((64, 4), 64, 2048, "contiguous"),
             ((32, 8), 128, 80, "hybrid")]  # fmt: skip
    if name == "v pages":
        cases = [((32, 8), 128, bs, "contiguous") for bs in (16, 32, 64)]
        cases.append(((32, 8), 128, 16, "wide"))
    for heads, head_dim, block_size, kind in cases:
        if name == "v pages" or head_dim == 64:
            changes = {k: v for k, v in changes.items() if k != "v_pages"} | (
                dict(v_pages=True) if head_dim == 128 else {}
            )
        if name == "paging 0" or block_size == 80:
            changes = {k: v for k, v in changes.items() if k != "paging"} | dict(paging=0)
        b = make_batch(GPU_SEQS, block_size=block_size, heads=heads, head_dim=head_dim,
                       dtype=torch.bfloat16, device="cuda", kind=kind,
                       state_bytes=3 * 8 * 128 * 2)  # fmt: skip
        config = _config(heads=heads, head_dim=head_dim, block_size=block_size, **changes)
        mql, msl = max(q for _, q in GPU_SEQS), max(s for s, _ in GPU_SEQS)
        kw = dict(max_query_len=mql, max_seq_len=msl, config=config)
        (main,) = [x for x in plan_paged_attention(*b.args(), **kw) if x.name == PREFILL]
        assert main.args["PINGPONG"] is config.prefill.turns
        p = config.prefill
        assert main.args["O_TMA"] is p.out_by_tma
        out = paged_attention(*b.args(), **kw)
        torch.cuda.synchronize()
        check(b, out)


# head_dim 256 at 32-token K/V tiles: turns with the query by TMA (3 stages) or by the
# warpgroups' loads (GQA 5:1), and the sequential loop at 2 stages; at the policy's 64-token
# tile, the sequential loop freeing K and V apart
HD256_CONFIGS = {
    "64 tokens, sequential, split release": ((32, 8), 16, "contiguous",
                                             dict(turns=False, query_by_tma=False,
                                                  split_release=True)),
    "32 tokens, turns": ((32, 8), 16, "contiguous",
                         dict(block_n=32, stages=3, turns=True, query_by_tma=True)),
    "32 tokens, turns, query loads": ((40, 8), 544, "hybrid",
                                      dict(block_n=32, stages=3, turns=True)),
    "32 tokens, sequential": ((32, 8), 80, "slice",
                              dict(block_n=32, stages=2, turns=False, query_by_tma=False)),
}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(HD256_CONFIGS))
def test_gpu_sm90_prefill_head_dim_256_configs(name):
    """Configs a caller may give at head_dim 256 besides the policy's, against the fp64 oracle."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm_90 kernel needs an sm_90 GPU")
    heads, block_size, kind, changes = HD256_CONFIGS[name]
    b = make_batch(GPU_SEQS, block_size=block_size, heads=heads, head_dim=256,
                   dtype=torch.bfloat16, device="cuda", kind=kind,
                   state_bytes=8 * 256 * 2)  # fmt: skip
    config = _config(heads=heads, head_dim=256, block_size=block_size, **changes)
    mql, msl = max(q for _, q in GPU_SEQS), max(s for s, _ in GPU_SEQS)
    kw = dict(max_query_len=mql, max_seq_len=msl, config=config)
    (main,) = [x for x in plan_paged_attention(*b.args(), **kw) if x.name == PREFILL]
    want = (config.prefill.block_n, changes.get("turns", False), config.prefill.split_release)
    assert (main.args["BLOCK_N"], main.args["PINGPONG"], main.args["SPLIT"]) == want
    out = paged_attention(*b.args(), **kw)
    torch.cuda.synchronize()
    check(b, out)


@pytest.mark.gpu
def test_gpu_sm90_prefill_graph_replay_with_new_lengths():
    """Captured with the maxima given (the work list is built on the device), replayed after the
    batch's lengths change in place: other sequences prefill, others decode. Each replay's
    work-list launch zeroes the item counter again (else a replay would find every item taken
    and write nothing)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm_90 kernel needs an sm_90 GPU")
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


@pytest.mark.gpu
def test_gpu_sm90_prefill_cached_calls_read_each_calls_query():
    """Three calls of one description, each with new tensors (query, caches, metadata): the plan
    cache's hits rebuild the query's TMA descriptor around each call's query (the producer
    loads it), so each output matches its own batch."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm_90 kernel needs an sm_90 GPU")
    PLANS.clear()
    mql, msl = max(q for _, q in GPU_SEQS), max(s for s, _ in GPU_SEQS)
    hits = PLANS.hits
    for seed in range(3):
        b = make_batch(GPU_SEQS, block_size=16, heads=(32, 8), head_dim=128,
                       dtype=torch.bfloat16, device="cuda", seed=seed)  # fmt: skip
        if seed == 0:
            launches = plan_paged_attention(*b.args(), max_query_len=mql, max_seq_len=msl)
            (main,) = [x for x in launches if x.name == PREFILL]
            assert main.args["Q_TMA"] is True
        out = paged_attention(*b.args(), max_query_len=mql, max_seq_len=msl)
        torch.cuda.synchronize()
        check(b, out)
    assert PLANS.hits - hits >= 2
    PLANS.clear()


@pytest.mark.gpu
def test_gpu_sm90_prefill_cached_calls_write_each_calls_output():
    """Two calls of one description, each given its own output (NaN before the call): the plan
    cache's hit rebuilds the output's TMA descriptor around the second call's ``out`` (the
    warpgroups store by it), so each output holds its call's result."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm_90 kernel needs an sm_90 GPU")
    PLANS.clear()
    mql, msl = max(q for _, q in GPU_SEQS), max(s for s, _ in GPU_SEQS)
    b = make_batch(GPU_SEQS, block_size=16, heads=(32, 8), head_dim=128, dtype=torch.bfloat16,
                   device="cuda")  # fmt: skip
    outs = [torch.full_like(b.query, float("nan")) for _ in range(2)]
    (main,) = [x for x in plan_paged_attention(*b.args(), max_query_len=mql, max_seq_len=msl,
                                               out=outs[0]) if x.name == PREFILL]  # fmt: skip
    assert main.args["O_TMA"] is True  # (through the query buffer)
    hits = PLANS.hits
    for out in outs:
        paged_attention(*b.args(), max_query_len=mql, max_seq_len=msl, out=out)
    torch.cuda.synchronize()
    assert PLANS.hits - hits >= 1
    for out in outs:  # (a stale descriptor would leave the second output NaN)
        check(b, out)
    PLANS.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("q_tma", [False, True], ids=["query loads", "query by TMA"])
def test_gpu_sm90_prefill_many_items_a_program(q_tma):
    """About 12 items a program, many of one or two tiles (GQA 16:1: 12-token q tiles of a
    4096-token prefill), so the item ring (`STAGES + 2` slots) wraps and its producer runs as far
    ahead as the stages let it; a chunk and a decode beside them. With the query by TMA (and
    turns, which it needs), the query buffers' barriers turn over once an item."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm_90 kernel needs an sm_90 GPU")
    seqs = ((4096, 4096), (1500, 600), (2000, 1))
    b = make_batch(seqs, block_size=16, heads=(64, 4), head_dim=64, dtype=torch.bfloat16,
                   device="cuda")  # fmt: skip
    config = _config(heads=(64, 4), head_dim=64, turns=q_tma, query_by_tma=q_tma)
    kw = dict(max_query_len=4096, max_seq_len=4096, config=config)
    (main,) = [x for x in plan_paged_attention(*b.args(), **kw) if x.name == PREFILL]
    assert main.args["Q_TMA"] is q_tma
    items = main.args["SLOTS"] * sum(-(-q // main.args["BLOCK_Q"]) for _, q in seqs if q > 1)
    assert items > 2 * (main.args["STAGES"] + 2) * SM90.num_sms  # the ring wraps twice or more
    out = paged_attention(*b.args(), **kw)
    torch.cuda.synchronize()
    check(b, out)


@pytest.mark.gpu
def test_gpu_sm90_prefill_trace_stamps_every_program():
    """A traced call runs the same math (checked against the oracle) and stamps each program's
    start and end in every partition."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm_90 kernel needs an sm_90 GPU")
    b = make_batch(GPU_SEQS, block_size=16, heads=(32, 8), head_dim=128, dtype=torch.bfloat16,
                   device="cuda")  # fmt: skip
    shape = trace_shape(torch.cuda.get_device_properties(0).multi_processor_count)
    trace = torch.zeros(math.prod(shape), dtype=torch.int64, device="cuda")
    out = paged_attention(*b.args(), max_query_len=400, max_seq_len=2100, trace=trace)
    torch.cuda.synchronize()
    check(b, out)
    ends = trace.view(shape)[:, :, -1, :4]  # the three warpgroups and the producer
    assert (ends[..., 2] >= ends[..., 0]).all() and (ends[..., 0] > 0).all()


@pytest.mark.parametrize("block_size", [16, 80, 544, 2048])
def test_head_dim_256_takes_64_token_tiles_at_240_registers(block_size):
    """A warpgroup's 64 x 256 fp32 output is 128 registers a thread: the consumers take 240 and
    the producer 24, and two 64-token K/V stages fit beside the query (three do not). The two
    warpgroups take turns with the query by TMA; where it cannot come by TMA (GQA 5:1) they run
    sequentially on the same tile and registers."""
    problem = _problem((32, 8), 256, block_size)
    cfg = prefill_config(SM90, problem)
    assert (cfg.block_n, cfg.stages, cfg.turns, cfg.query_by_tma) == (64, 2, True, True)
    assert (cfg.warpgroups, cfg.late_release, cfg.split_release) == (2, False, True)
    assert (cfg.consumer_regs, cfg.producer_regs) == (240, 24)
    assert prefill_smem_bytes(cfg, 256) <= SM90.max_shared_mem
    three = dataclasses.replace(cfg, stages=3)
    assert prefill_smem_bytes(three, 256) > SM90.max_shared_mem
    assert prefill_config_errors(SM90, problem, cfg) == []
    gqa5 = _problem((40, 8), 256, block_size)
    seq = prefill_config(SM90, gqa5)
    assert (seq.block_n, seq.stages, seq.turns, seq.query_by_tma) == (64, 2, False, False)
    assert (seq.consumer_regs, seq.producer_regs, seq.split_release) == (240, 24, False)
    assert prefill_config_errors(SM90, gqa5, seq) == []
