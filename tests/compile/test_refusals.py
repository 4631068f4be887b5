"""Which compile-matrix cells the ops refuse, pinned; and the fp32 MLA seeds are in the table.

The compile gate lets a cell pass whose op refuses the problem with the policy's clear
"no tile fits" ValueError (the public API does not accept it on that target). So that a policy
change cannot turn an accepted problem into a refusal unnoticed, every case of the table is
planned here for every target (meta tensors, no compile) and the refusals must be exactly these.
"""

from __future__ import annotations

import pytest

from portattn.compile import default_cases
from portattn.compile.cases import api_dtypes
from portattn.compile.matrix import REFUSAL
from portattn.platform import TARGETS
from tests.helpers import compile_in_spawned_workers

pytestmark = pytest.mark.compile

# fp32 MLA 576/512 on the 64 KB AMD parts: H16 N16 at one stage needs 36864 B of latent + rope
# tile, 36864 B of query tile and 1024 B of P (74752 B > 65536 B).
EXPECTED_REFUSALS = {
    f"mla_decode/{name}@{arch}"
    for arch in ("gfx90a", "gfx942")
    for name in [
        *(f"576/512 h{h} page{bs} fp32" for h in (1, 4, 16, 128) for bs in (16, 64)),
        "576/512 h4 q2 page64 fp32",
    ]
}
# The two cells that overflowed sm_90's shared memory on an H100 (OutOfResources: 266256 and
# 239632 B > 232448 B), now seeds of the table.
H100_SEEDS = ("mla_decode/320/256 h16 page64 fp32", "mla_decode/288/256 h4 q2 page64 fp32")


def test_every_accepted_dtype_is_in_the_table():
    ids = {c.id for c in default_cases()}
    for kernel in ("mla_decode", "paged_attention", "write_kv_cache", "gather_kv_cache"):
        dtypes = api_dtypes(kernel)
        assert set(dtypes) == {"float16", "bfloat16", "float32"}
        for tag in ("fp16", "fp32"):
            assert any(i.startswith(kernel + "/") and i.endswith(" " + tag) for i in ids), tag
    assert set(H100_SEEDS) <= ids


def test_refusals_are_exactly_the_pinned_ones():
    refused = set()
    for case in default_cases():
        for arch, target in TARGETS.items():
            try:
                case.plan(target)
            except ValueError as e:
                assert REFUSAL in str(e), f"{case.id}@{arch}: {e}"
                refused.add(f"{case.id}@{arch}")
    assert refused == EXPECTED_REFUSALS


def test_h100_fp32_mla_seeds_compile_within_sm90_shared_memory():
    """Regression: on an H100 these two fp32 MLA shapes raised OutOfResources (shared memory);
    the compile matrix now holds them, and they pass there (no spills, within 232448 B)."""
    by_id = {c.id: c for c in default_cases()}
    cells = compile_in_spawned_workers([by_id[i] for i in H100_SEEDS], ["sm_90"])
    for c in cells:
        assert c.passed, (c.id, c.reasons)
        assert c.shared is not None and c.shared <= c.limit
        assert all(r.spills == 0 for r in c.launches), c.id
