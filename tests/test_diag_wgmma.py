"""bench/diag_wgmma.py on a CPU: each mode compiles for sm_90 to the MMAs it says it times (their
shapes and counts), with no register spills (a spill's local-memory traffic in the loop would be
timed with the MMAs), and its MAC count is the one the rate is computed from."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.helpers import in_spawned_workers

pytestmark = pytest.mark.compile

_BENCH = Path(__file__).resolve().parents[1] / "bench"
_MMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)")


def _load():
    sys.path.insert(0, str(_BENCH))  # the script imports _common from there
    import diag_wgmma

    return diag_wgmma


def _compile(mode: str) -> tuple[dict, int]:
    """The MMA shapes in the mode's PTX (counted over both warpgroups' code) and its spills."""
    import collections

    import triton
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from portattn.compile.worker import _resources
    from portattn.platform import get_target

    d = _load()
    target = get_target("sm_90")
    sig = {"src_ptr": "*bf16", "out_ptr": "*fp32", "cyc_ptr": "*i64", "iters": "i32",
           "pos": "i32"}  # fmt: skip
    const = {
        "MODE": d.MODES[mode],
        "LAYOUT": gl.NVMMASharedLayout.get_default_for([64, 256], gl.bfloat16),
        "PE_LAYOUT": gl.NVMMASharedLayout.get_default_for([128, 64], gl.bfloat16),
        "P_LAYOUT": gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16),
    }
    sig.update({k: "constexpr" for k in const})
    compiled = triton.compile(
        GluonASTSource(d._kernel, sig, const), target=target.gpu_target(), options={"num_warps": 4}
    )
    _, spills, _ = _resources(compiled, target)
    return dict(collections.Counter(_MMA.findall(compiled.asm["ptx"]))), spills


@pytest.fixture(scope="module")
def compiled() -> dict:
    got = in_spawned_workers(_compile, [(mode,) for mode in _load().MODES])
    return {job[0]: result for job, result in got.items()}


# per warpgroup: the score MMA is 36 k-steps (512 latent from shared memory, 64 rope from
# registers), each PV 4 (64 tokens); both warpgroups' code is in the kernel
@pytest.mark.parametrize(
    ("mode", "mmas"),
    [
        ("pair", {"m64n64k16": 72, "m64n256k16": 16}),
        ("pair-preg", {"m64n64k16": 72, "m64n256k16": 16}),
        ("s", {"m64n64k16": 72}),
        ("pv", {"m64n256k16": 16}),
        ("pair-one", {"m64n64k16": 36, "m64n256k16": 8}),
        ("s128", {"m64n128k16": 72}),
        ("st-alone", {}),
        ("st-beside", {"m64n64k16": 36, "m64n256k16": 8}),  # warpgroup 1's pair
    ],
)
def test_each_mode_issues_its_mmas_without_spills(compiled, mode, mmas):
    got, spills = compiled[mode]
    assert got == mmas
    assert spills == 0


def test_mac_counts():
    d = _load()
    pair = 64 * 64 * 576 + 2 * 64 * 64 * 256  # one warpgroup's MMAs for one pair
    assert d.macs("pair") == d.macs("pair-preg") == 2 * pair
    assert d.macs("pair-one") == pair
    assert d.macs("s") + d.macs("pv") == d.macs("pair")
    assert d.macs("s128") == 2 * d.macs("s")
    # the kernel's pair at the tensor peak: 4352 cycles (bench/trace_mla.py)
    assert d.macs("pair") / d.PEAK_MACS == 4352
