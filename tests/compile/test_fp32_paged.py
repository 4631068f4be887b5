"""fp32 paged attention compiles without spills on NVIDIA, with no allowance in the case table.

fp32 runs both dots in exact fp32 (FMA loops, operands in registers). Under the 16-bit register
model these cells spilled up to 37008 B (hd128 GQA 5:1 NHD prefill, 64 x 64 x 8 warps) and the
table held them at their measured figures; the paged policy's fp32 rule (`FP32_BLOCK_M`,
`FP32_NUM_WARPS`, `FP32_MAX_WORDS` in `portattn.policy.paged`) closed that. Here the worst former
cells are compiled through the real compiler for an mma.sync part and a wgmma part.
"""

from __future__ import annotations

import itertools

import pytest

from portattn.compile import default_cases
from portattn.platform import get_target
from portattn.policy.paged import FP32_BLOCK_M, FP32_NUM_WARPS
from tests.helpers import compile_in_spawned_workers

pytestmark = pytest.mark.compile

TARGETS = ("sm_80", "sm_90")
# Former spills (sm_80 / sm_90): NHD prefill 72 / 36032 B (64 x 16 / 64 x 64 rows x block_n);
# SHUFFLE decode 5736 / 5744 B (16 x 64); SHUFFLE prefill at head_dim 256, the most registers of
# the new tiles (228 / 224 at 16 x 16), 1876 / 14492 B (64 x 16).
CASES = (
    "paged_attention/hd128 gqa5 bs16 NHD prefill fp32",
    "paged_attention/hd128 gqa5 bs16 SHUFFLE decode fp32",
    "paged_attention/hd256 gqa5 bs16 SHUFFLE prefill fp32",
)


def test_no_paged_case_has_a_spill_allowance():
    paged = [c for c in default_cases(["paged_attention"]) if c.id.endswith(" fp32")]
    assert len(paged) == 18
    assert all(c.spill_allowance == () and c.spill_reason == "" for c in paged)


def test_worst_former_fp32_cells_compile_without_spills():
    by_id = {c.id: c for c in default_cases(["paged_attention"])}
    cases = [by_id[i] for i in CASES]
    for case, arch in itertools.product(cases, TARGETS):  # the fp32 rule's tiles (no compile)
        (launch,) = case.plan(get_target(arch))
        assert launch.args["BLOCK_M"] == FP32_BLOCK_M and not launch.args["DECODE_ROLE"]
        assert launch.options.num_warps == FP32_NUM_WARPS
    cells = compile_in_spawned_workers(cases, TARGETS)
    assert len(cells) == len(CASES) * len(TARGETS)
    for c in cells:
        assert c.passed, (c.id, c.reasons)
        assert c.shared is not None and c.shared <= c.limit, c.id
        (result,) = c.launches
        assert (result.spills, result.scratch) == (0, 0), (c.id, result.regs, result.spills)
