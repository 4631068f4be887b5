"""MLA verification on the HIP targets: the packed tiles are in the compile matrix and compile
clean there.

`portattn.compile.cases.hip_verify_cases`: 576/512 (the widest latent), q_len 1/2/4/8 x heads
1/16/128, 64-token pages by block table and 1-token pages by page_indices, and two rank-256
tiles, planned through `MlaMetadataBuilder` (the policy's tiles for exactly that q_len),
compiled for gfx90a, gfx942 and gfx950 only, with no spill allowance. Here: the
table, the tiles each case plans (the policy's, packed from q_len 2), and a compile of one case
per distinct packed tile on every HIP target (no VGPR spilled, no scratch, LDS within the
target's). The whole set runs in the matrix (``python -m portattn.compile --kernels mla_decode
--cases ' hip$' --targets gfx90a,gfx942,gfx950``).
"""

from __future__ import annotations

import pytest

from portattn.compile import default_cases, run_matrix
from portattn.compile.cases import HIP_VERIFY_HEADS, HIP_VERIFY_QUERY_LENS, hip_verify_cases
from portattn.platform import TARGETS, get_target
from portattn.policy.mla import MlaProblem, mla_decode_tiles, mla_row_groups
from tests.helpers import compile_in_spawned_workers

pytestmark = pytest.mark.compile

HIP_ARCHS = ("gfx90a", "gfx942", "gfx950")


def test_cases_cover_the_verification_axes_on_hip_only():
    assert HIP_VERIFY_QUERY_LENS == (1, 2, 4, 8) and HIP_VERIFY_HEADS == (1, 16, 128)
    cases = hip_verify_cases()
    assert len(cases) == 4 * 3 * 2 + 2  # and two rank-256 tiles
    ids = {c.id for c in default_cases(["mla_decode"])}
    for case in cases:
        assert case.id in ids
        assert case.vendors == ("hip",) and case.spill_allowance == (), case.id
        assert [a for a, t in TARGETS.items() if case.compiles_for(t)] == list(HIP_ARCHS)
    # a case compiled for no target of the run gives no cell
    assert run_matrix(cases[:1], ["sm_90"]) == []


@pytest.mark.parametrize("arch", HIP_ARCHS)
def test_cases_plan_the_policy_tiles(arch):
    """Each case launches the policy's tiles for its q_len: packed from q_len 2, unpacked at
    q_len 1; the grid covers each sequence's row groups."""
    target = get_target(arch)
    for case in hip_verify_cases():
        p = dict(case.params)
        heads, q_len, dk, r = p["num_q_heads"], p["q_len"], p["head_dim_k"], p["kv_lora_rank"]
        main = case.plan(target)[0]
        seqs = 4  # cases.NUM_SEQS
        want = mla_decode_tiles(target, MlaProblem(heads, dk, r, 2, seqs * q_len, 8192, q_len))
        a = main.args
        assert main.name == "mla_decode" and a["PACKED"] is (q_len > 1), case.id
        assert (a["BLOCK_H"], a["BLOCK_N"], a["NUM_SPLITS"]) == (
            want.block_h,
            want.block_n,
            want.num_kv_splits,
        ), case.id
        assert main.options == want.options
        assert a["PAGE_INDICES"] is (p["block_size"] == 1)
        if q_len > 1:
            groups = mla_row_groups(want, heads, q_len)
            assert main.grid == (seqs * groups * want.num_kv_splits,), case.id


def _distinct_packed_cases():
    """One case per distinct packed tile (rows, KV tile, stages), address form and whether it
    splits the context (one split stores the output itself): the compiled kernels differ only
    in the split count past that."""
    seen: dict[tuple, object] = {}
    for case in hip_verify_cases():
        p = dict(case.params)
        if p["q_len"] == 1:
            continue
        for arch in HIP_ARCHS:
            t = mla_decode_tiles(
                get_target(arch),
                MlaProblem(p["num_q_heads"], p["head_dim_k"], p["kv_lora_rank"], 2,
                           4 * p["q_len"], 8192, p["q_len"]),
            )  # fmt: skip
            key = (
                p["kv_lora_rank"],
                t.block_h,
                t.block_n,
                t.options.num_stages,
                p["block_size"],
                t.num_kv_splits == 1,
            )
            seen.setdefault(key, case)
    return list(dict.fromkeys(seen.values()))


def test_packed_tiles_compile_without_spills_within_lds():
    cases = _distinct_packed_cases()
    cells = compile_in_spawned_workers(cases, HIP_ARCHS)
    assert len(cells) == len(cases) * len(HIP_ARCHS)
    for c in cells:
        assert c.passed, (c.id, c.reasons)
        for r in c.launches:
            assert (r.spills, r.scratch) == (0, 0), (c.id, r.name, r.regs, r.spills)
            assert r.shared is not None and r.shared <= c.limit, (c.id, r.shared)


def test_plain_decode_tile_compiles_without_spills():
    """q_len 1 over the 512-wide latent: the unpacked narrow tile at the policy's 4 warps and one
    wave a SIMD (`HIP_LATENT_512_NUM_WARPS`, `HIP_ONE_WAVE_PER_EU`; at two waves it spilled
    VGPRs on gfx942), both address forms."""
    cases = [c for c in hip_verify_cases() if c.id.startswith("mla_decode/576/512 h16 q1 ")]
    assert len(cases) == 2
    cells = compile_in_spawned_workers(cases, HIP_ARCHS)
    assert len(cells) == 2 * len(HIP_ARCHS)
    for c in cells:
        assert c.passed, (c.id, c.reasons)
        main = c.launches[0]
        assert main.name == "mla_decode" and main.num_warps == 4, (c.id, main.num_warps)
        for r in c.launches:
            assert (r.spills, r.scratch) == (0, 0), (c.id, r.name, r.regs, r.spills)
