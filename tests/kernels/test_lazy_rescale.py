"""`portattn.kernels._gluon.lazy_rescale` (the sm_90 MLA kernel's rescale): its PTX exists for
the accumulators a warpgroup holds, and any other is refused by name when the kernel compiles
(its numerics: the MLA kernel's GPU tests)."""

from __future__ import annotations

import re

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from portattn.compile.worker import compile_kernel
from portattn.kernels._gluon import RESCALE_ASM, lazy_rescale
from portattn.kernels._launch import Launch
from portattn.platform import get_target
from portattn.policy.common import LaunchOptions
from tests.helpers import in_spawned_workers, target_compile

SM90 = get_target("sm_90")


@gluon.jit
def _rescale_kernel(out_ptr, COLS: gl.constexpr):
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, COLS, 16]
    )
    rows: gl.constexpr = gl.SliceLayout(1, layout)
    acc = gl.full([64, COLS], 2.0, gl.float32, layout=layout)
    acc = lazy_rescale(acc, gl.full([64], 1.0, gl.float32, layout=rows), True)
    gl.store(out_ptr + gl.arange(0, 64, layout=rows), gl.sum(acc, 1))


def _rescale_ptx(cols: int) -> str:
    """`_rescale_kernel`'s sm_90 PTX at ``cols`` columns, or its compile error's chain of
    messages (in a spawned process: `tests.helpers.in_spawned_workers`)."""
    out = torch.empty(64, device="meta")
    launch = Launch(_rescale_kernel, (1,), dict(out_ptr=out, COLS=cols), LaunchOptions(4, 1), SM90,
                    name="lazy_rescale")  # fmt: skip
    try:
        return compile_kernel(launch, SM90).asm["ptx"]
    except Exception as err:  # Triton wraps the helper's ValueError in a CompilationError
        chain, e = [], err
        while e is not None:
            chain.append(str(e))
            e = e.__cause__
        return "\n".join(chain)


@target_compile
def test_lazy_rescale_ptx_exists_or_is_refused_by_name():
    """A warpgroup's 64 x ``cols`` accumulator holds ``cols / 2`` values a thread: 64, 128 and
    256 columns (MLA's rank-512 half) compile with one
    skip branch around exactly that many multiplies (one rescale PTX for every width multiplied
    padding lanes and tested unwritten registers below 256 columns); 16 columns has no PTX in
    `RESCALE_ASM` and the compile says so."""
    assert {32, 64, 128} <= set(RESCALE_ASM) and 8 not in RESCALE_ASM
    got = in_spawned_workers(_rescale_ptx, [(64,), (128,), (256,), (16,)])
    for cols in (64, 128, 256):
        assert got[(cols,)].count("bra lazy_skip_") == 1
        assert len(re.findall(r"^\s*mul\.f32\s", got[(cols,)], re.M)) == cols // 2
    assert "lazy_rescale: 8 accumulator values a thread, not in" in got[(16,)]
