"""The long prefill shapes on a CPU: their HIP prefill tiles compile clean in the compile matrix.

The shapes are paged attention with 32 query heads / 8 KV heads (GQA 4:1), head_dim 128, bf16:
mixed batches with 512- and 2048-token prefill chunks and pure prefill of 4096 tokens, at block
sizes 16, 544 and 2048. The matrix's other axes have GQA 1:1, 5:1 and 8:1 only, and
``HEAD_TILE`` / ``BLOCK_Q`` are constexprs, so the 4:1 kernel would be compiled nowhere. Here the
cases are in the table, plan the policy's tiles on gfx942 and gfx950 (one kernel per
target: the tiles do not depend on max_query_len past 64 rows, nor on block_size), and compile
without spills within the target's LDS.
"""

from __future__ import annotations

import pytest

from portattn.compile import default_cases
from portattn.compile.cases import LONG_PREFILL_BLOCK_SIZES, LONG_PREFILL_QUERY_LENS
from portattn.platform import get_target
from portattn.policy.paged import PagedProblem, paged_tiles
from tests.helpers import compile_in_spawned_workers

pytestmark = pytest.mark.compile

TARGETS = ("gfx942", "gfx950")
IDS = [
    f"paged_attention/hd128 gqa4 bs{bs} NHD prefill q{q} long"
    for q in LONG_PREFILL_QUERY_LENS
    for bs in LONG_PREFILL_BLOCK_SIZES
]


def _cases():
    by_id = {c.id: c for c in default_cases(["paged_attention"])}
    return [by_id[i] for i in IDS]


def test_long_prefill_cases_are_in_the_table():
    assert LONG_PREFILL_QUERY_LENS == (512, 2048, 4096)
    assert LONG_PREFILL_BLOCK_SIZES == (16, 544, 2048)
    for case in _cases():
        p = dict(case.params)
        assert (p["num_q_heads"], p["num_kv_heads"], p["head_dim"]) == (32, 8, 128)
        assert p["layout"] == "NHD" and p.get("dtype", "bfloat16") == "bfloat16"


@pytest.mark.parametrize("arch", TARGETS)
def test_long_prefill_cases_plan_the_policy_tile(arch):
    """Every case launches ``paged_tiles`` of its problem, and it is one tile per target."""
    target = get_target(arch)
    seen = set()
    for case in _cases():
        p = dict(case.params)
        (launch,) = case.plan(target)
        a = launch.args
        problem = PagedProblem(32, 8, 128, 2, p["max_query_len"], p["block_size"], 4)
        t = paged_tiles(target, problem)
        got = (a["BLOCK_M"], a["BLOCK_Q"], a["HEAD_TILE"], a["BLOCK_N"], a["DEC_BLOCK_M"])
        assert got == (t.block_m, t.block_q, t.head_tile, t.block_n, t.decode.block_m)
        assert launch.options == t.options
        seen.add((got, t.options))
    assert len(seen) == 1, seen


def test_long_prefill_tiles_compile_without_spills_within_lds():
    cells = compile_in_spawned_workers(_cases(), TARGETS)
    assert len(cells) == len(IDS) * len(TARGETS)
    for c in cells:
        assert c.passed, (c.id, c.reasons)
        (result,) = c.launches
        assert (result.spills, result.scratch) == (0, 0), (c.id, result.regs, result.spills)
        assert result.shared is not None and result.shared <= c.limit, (c.id, result.shared)
    # one kernel per target: the block sizes and query lengths share it
    for arch in TARGETS:
        assert len({c.launches[0].hash for c in cells if c.arch == arch}) == 1, arch
