"""The sm_90 kernels' softmax helpers (kernels/_gluon.py).

`exp2_split`: the softmax's exponentials shared between the MUFU and a polynomial on the FMA pipe
(issue 19, the sm_90 prefill kernel's `SM90_PREFILL_EXP2_POLY`). On a CPU: the polynomial's
method step for step in fp32 (`exp2_poly_reference`) against fp64, the PTX each share emits, the
switch reaching the prefill kernel's PTX, and the launcher's check of the switch. On an sm_90 GPU
(`gpu`): the inline PTX itself against torch's exp2.

`lazy_rescale`: its PTX exists for the accumulators the kernels hold, and any other is refused
by name when the kernel compiles (its numerics: the MLA and prefill kernels' GPU tests).

`row_max` / `row_sum` (`SM90_PREFILL_TREE_REDUCE`): in the prefill kernel's sm_90
PTX the same ``max.f32`` / ``add.f32`` ops and shuffles as ``gl.max`` / ``gl.sum``, with the
longest chain of dependent ops cut from a thread's columns a row to a tree's depth (their
numerics: the kernels' GPU tests with the switches on)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from portattn.compile.worker import compile_kernel
from portattn.kernels._gluon import (
    EXP2_PACK,
    EXP2_POLY_FLOOR,
    EXP2_SPLIT_ASM,
    RESCALE_ASM,
    exp2_poly_reference,
    exp2_split,
    exp2_split_asm,
    lazy_rescale,
)
from portattn.kernels._launch import Launch
from portattn.policy import mla as mla_policy
from portattn.policy import paged as paged_policy
from portattn.policy.common import LaunchOptions
from tests.helpers import in_spawned_workers
from tests.kernels.test_paged_prefill_sm90 import SM90, _plan

pytestmark = pytest.mark.paged

#: The fit's bound (1.0e-4 measured in fp32, module doc of _gluon.py), with room for rounding.
POLY_REL = 1.1e-4
TINY = 2.0**EXP2_POLY_FLOOR


def test_polynomial_is_within_its_bound_down_to_the_floor():
    x = np.concatenate(
        [np.linspace(-126, 0, 1_000_001, dtype=np.float32), np.float32([-0.5, 0.5, -125.5])]
    )
    got = exp2_poly_reference(x).astype(np.float64)
    rel = np.abs(got / np.exp2(x.astype(np.float64)) - 1)
    assert rel.max() <= POLY_REL
    # whole numbers come out exact: 2^k is the polynomial's 1 shifted into the exponent
    k = np.arange(-126, 1, dtype=np.float32)
    assert np.array_equal(exp2_poly_reference(k), np.exp2(k))


def test_polynomial_below_the_floor_gives_the_floor_not_garbage():
    """Masked scores (-inf), NaN and anything under -126 come out 2^-126 (positive, finite): the
    exponent arithmetic never wraps into the sign bit."""
    x = np.float32([-np.inf, -1e30, -200.0, -126.4, -127.0, np.nan])
    got = exp2_poly_reference(x)  # NaN too: PTX's max returns the other operand
    assert np.all(got > 0) and np.all(got <= np.float32(TINY) * (1 + POLY_REL))


@pytest.mark.parametrize("poly", range(EXP2_PACK + 1))
def test_asm_takes_poly_of_every_four_through_the_polynomial(poly):
    asm = exp2_split_asm(poly)
    assert asm == EXP2_SPLIT_ASM[poly]
    assert asm.count("ex2.approx.ftz.f32") == EXP2_PACK - poly
    assert asm.count("fma.rn.ftz.f32") == 3 * poly
    # every output is written once, from its own input
    for i in range(EXP2_PACK):
        src = f"${i + EXP2_PACK}"
        assert sum(line.split()[1].rstrip(",") == f"${i}" for line in asm.splitlines()
                   if len(line.split()) > 1) == 1  # fmt: skip
        assert src in asm


@pytest.mark.parametrize("poly", [-1, EXP2_PACK + 1])
def test_asm_refuses_a_share_out_of_range(poly):
    with pytest.raises(ValueError, match=f"poly {poly} is not in"):
        exp2_split_asm(poly)


@pytest.mark.parametrize("value", [5, -1, 1.0, True, "1"])
def test_launcher_refuses_a_bad_switch(value, monkeypatch):
    monkeypatch.setattr(paged_policy, "SM90_PREFILL_EXP2_POLY", value)
    with pytest.raises(ValueError, match="SM90_PREFILL_EXP2_POLY .* is not an int in"):
        _plan()


def _kernel_ptx(kind: str, switches: tuple, heads=(32, 8), head_dim=128) -> tuple[dict, str]:
    """The sm_90 launch of ``kind`` ("prefill": `_plan`'s mixed batch, on the sequential tile;
    "mla": the compile matrix's 128-head page-64 case) planned under ``switches`` ((module,
    name, value): module "paged" or "mla" of `portattn.policy`): its softmax switches' args and
    its PTX. Run in a spawned process without the interpreter
    (`tests.helpers.in_spawned_workers`): a Gluon kernel compiled in a process that has run the
    interpreter can fail to build."""
    policies = {"paged": paged_policy, "mla": mla_policy}
    for module, name, value in switches:
        setattr(policies[module], name, value)
    if kind == "prefill":
        # the sequential loop's counts (head_dim 128's policy tile takes turns: a second softmax
        # site, the last tile's)
        tiles = dict(paged_policy.SM90_PREFILL_TILES)
        tiles[128] = paged_policy.Sm90PrefillTile(block_n=128, stages=2)
        paged_policy.SM90_PREFILL_TILES = tiles
        (launch,) = [x for x in _plan(heads=heads, head_dim=head_dim)
                     if x.name == "paged_prefill_sm90"]  # fmt: skip
    else:
        from portattn.compile.cases import default_cases

        case = {c.id: c for c in default_cases()}["mla_decode/576/512 h128 page64"]
        (launch,) = [x for x in case.plan(SM90) if x.name == "mla_decode_sm90"]
    args = {k: launch.args[k] for k in ("EXP2_POLY", "LAZY", "TREE") if k in launch.args}
    return args, compile_kernel(launch, SM90).asm["ptx"]


def test_switch_reaches_the_prefill_kernel():
    """The launch carries the switch, and the sm_90 PTX has that share of ``ex2`` ops fewer (64
    exponentials a thread a tile, in each of the two consumer partitions; 4 of the row rescales'
    stay on the MUFU)."""
    jobs = [("prefill", (("paged", "SM90_PREFILL_EXP2_POLY", poly),)) for poly in (0, 2)]
    got = in_spawned_workers(_kernel_ptx, jobs)
    counts = {}
    for (_, ((_, _, poly),)), (args, ptx) in got.items():
        assert args["EXP2_POLY"] == poly
        counts[poly] = ptx.count("ex2.approx")
    assert counts[0] - counts[2] == 2 * 64 * 2 // EXP2_PACK


@pytest.mark.parametrize(("head_dim", "heads"), [(128, (32, 8)), (64, (40, 8))])
def test_lazy_rescale_reaches_the_prefill_kernel(head_dim, heads):
    """`SM90_PREFILL_LAZY_RESCALE`: the launch carries it, and the sm_90 PTX has one skippable
    rescale a consumer warpgroup (the sequential loop's; 64 / 32 accumulator values a thread at
    head_dim 128 / 64), or none when off."""
    jobs = [("prefill", (("paged", "SM90_PREFILL_LAZY_RESCALE", lazy),), heads, head_dim)
            for lazy in (True, False)]  # fmt: skip
    for (_, ((_, _, lazy),), _, _), (args, ptx) in in_spawned_workers(_kernel_ptx, jobs).items():
        assert args["LAZY"] is lazy
        assert ptx.count("bra lazy_skip_") == (2 if lazy else 0)


@gluon.jit
def _exp2_kernel(x_ptr, y_ptr, n, POLY: gl.constexpr, BLOCK: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([EXP2_PACK_K], [32], [4], [0])
    offs = gl.program_id(0) * BLOCK + gl.arange(0, BLOCK, layout=layout)
    m = offs < n
    x = gl.load(x_ptr + offs, mask=m, other=0.0)
    gl.store(y_ptr + offs, exp2_split(x, POLY), mask=m)


EXP2_PACK_K = gl.constexpr(EXP2_PACK)


@pytest.mark.gpu
@pytest.mark.parametrize("poly", range(EXP2_PACK + 1))
def test_gpu_exp2_split_matches_exp2(poly):
    """Each thread's 4 consecutive elements go through one asm block: with ``poly`` of them on
    the polynomial, every element is within its bound of fp64's 2^x, and below the floor (-inf
    included) every output is in [0, 2^-126]."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the inline PTX is built for sm_90 (an NVIDIA GPU)")
    g = torch.Generator().manual_seed(0)
    x = torch.cat(
        [
            torch.linspace(-126, 0, 200_003),
            -126 * torch.rand(100_000, generator=g),
            torch.tensor([-0.5, 0.5, -125.5, 0.0]),
        ]  # fmt: skip
    ).float()
    low = torch.tensor([float("-inf"), -1e30, -200.0, -126.4, -127.0, -150.0, -1e4, -130.0])
    x = torch.cat([x, low]).cuda()
    y = torch.empty_like(x)
    n = x.numel()
    _exp2_kernel[(triton.cdiv(n, 512),)](x, y, n, POLY=poly, BLOCK=512, num_warps=4)
    torch.cuda.synchronize()
    want = torch.exp2(x.double())
    ok = x >= EXP2_POLY_FLOOR
    rel = (y[ok].double() / want[ok] - 1).abs()
    assert rel.max().item() <= POLY_REL
    below = y[~ok].double()
    assert bool(((below >= 0) & (below <= TINY * (1 + POLY_REL))).all())
    # the polynomial's elements (the first ``poly`` of every 4) are the CPU reference's, to an
    # ulp (the reference rounds each FMA through fp64)
    idx = torch.arange(n, device="cuda")
    on_poly = (idx % EXP2_PACK) < poly
    ref = torch.from_numpy(exp2_poly_reference(x.cpu().numpy())).cuda()
    diff = (y[on_poly].double() / ref[on_poly].double() - 1).abs()
    assert diff.numel() == 0 or diff.max().item() <= 2.0**-22


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
    messages (in a spawned process, as `_kernel_ptx`)."""
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


def test_lazy_rescale_ptx_exists_or_is_refused_by_name():
    """A warpgroup's 64 x ``cols`` accumulator holds ``cols / 2`` values a thread: 64, 128 and
    256 columns (the prefill kernel at head_dim 64 / 128, MLA's rank-512 half) compile with one
    skip branch around exactly that many multiplies (one rescale PTX for every width multiplied
    padding lanes and tested unwritten registers below 256 columns); 16 columns has no PTX in
    `RESCALE_ASM` and the compile says so."""
    assert {32, 64, 128} <= set(RESCALE_ASM) and 8 not in RESCALE_ASM
    got = in_spawned_workers(_rescale_ptx, [(64,), (128,), (256,), (16,)])
    for cols in (64, 128, 256):
        assert got[(cols,)].count("bra lazy_skip_") == 1
        assert len(re.findall(r"^\s*mul\.f32\s", got[(cols,)], re.M)) == cols // 2
    assert "lazy_rescale: 8 accumulator values a thread, not in" in got[(16,)]


def _chain(ptx: str, op: str) -> tuple[int, int]:
    """``(longest chain of dependent ``op`` ops, ops)`` in ``ptx`` (virtual registers are
    written once, so a register's depth is fixed where it is written)."""
    depth: dict[str, int] = {}
    pat = rf"^\s*{op}\s+(%\w+),\s*(%\w+),\s*(%\w+);"
    for dst, a, b in re.findall(pat, ptx, re.M):
        depth[dst] = 1 + max(depth.get(a, 0), depth.get(b, 0))
    return max(depth.values(), default=0), len(re.findall(rf"^\s*{op}\s", ptx, re.M))


@pytest.mark.parametrize(
    ("kind", "module", "switch", "columns"),
    [
        ("prefill", "paged", "SM90_PREFILL_TREE_REDUCE", 32),  # a 64 x 128 tile
    ],
)
def test_tree_reduce_cuts_the_dependent_chain(kind, module, switch, columns):
    jobs = [(kind, ((module, switch, tree),)) for tree in (False, True)]
    got = {}
    for (_, ((_, _, tree),)), (args, ptx) in in_spawned_workers(_kernel_ptx, jobs).items():
        assert args["TREE"] is tree
        moves = (ptx.count("shfl.sync"), ptx.count("st.shared"), ptx.count("ld.shared"))
        got[tree] = (_chain(ptx, r"max\.f32"), _chain(ptx, r"add\.f32"), moves)
    (max_chain, max_ops), (add_chain, add_ops), shuffles = got[False]
    # gl.max / gl.sum: one op after another over a thread's columns of a row (+1: the running
    # max / the scaled sum joins it)
    assert max_chain >= columns and add_chain >= columns
    (max_tree, max_ops_t), (add_tree, add_ops_t), shuffles_t = got[True]
    # the same ops, and no data moved for the halving: the same shuffles and shared traffic
    assert (max_ops_t, add_ops_t, shuffles_t) == (max_ops, add_ops, shuffles)
    levels = (columns // 2).bit_length() - 1  # halvings down to 2 columns a thread
    assert max_tree <= levels + 4 and add_tree <= levels + 4


@pytest.mark.parametrize("loop", ["overlap", "pingpong"])
def test_softmax_switches_compile_in_the_other_loops(loop):
    """All three softmax switches on in the overlapped and the ping-pong loops (the policy says
    they cover both): the kernel builds for sm_90 with fewer ``ex2``, the lazy rescale's skip
    branches and the trees' short chains."""
    on = (("paged", "SM90_PREFILL_EXP2_POLY", 2), ("paged", "SM90_PREFILL_LAZY_RESCALE", True),
          ("paged", "SM90_PREFILL_TREE_REDUCE", True))  # fmt: skip
    schedule = (("paged", "SM90_PREFILL_OVERLAP", loop == "overlap"),
                ("paged", "SM90_PREFILL_PINGPONG", loop == "pingpong"))  # fmt: skip
    jobs = [("prefill", schedule), ("prefill", schedule + on)]
    got = in_spawned_workers(_kernel_ptx, jobs)
    (_, off), (args, ptx) = got[jobs[0]], got[jobs[1]]
    assert args == {"EXP2_POLY": 2, "LAZY": True, "TREE": True}
    assert ptx.count("ex2.approx") < off.count("ex2.approx")
    assert ptx.count("bra lazy_skip_") >= 2
    assert _chain(ptx, r"max\.f32")[0] < 16 and _chain(ptx, r"add\.f32")[0] < 16
