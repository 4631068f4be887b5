"""bench/bench_paged.py ``--shuffle-variants`` on a CPU: a variant plans the SHUFFLE cache at this
GPU's policy tiles with its own KV tile, stages, warps and splits (here the sm_90 policy, forced),
its launch is right against the fp64 oracle (interpreter), and a malformed spec is refused."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

_BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(_BENCH))  # bench_paged imports _common from there
_SPEC = importlib.util.spec_from_file_location("bench_paged", _BENCH / "bench_paged.py")
bp = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bp)


def _args():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 32, 128, generator=g).to(torch.float16)
    k = torch.randn(20, 16, 8, 128, generator=g).to(torch.float16)
    v = torch.randn(20, 16, 8, 128, generator=g).to(torch.float16)
    bt = torch.randperm(20, generator=g).to(torch.int32).view(2, 10)
    sl = torch.tensor([150, 37], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    return bp.to_shuffle((q, k, v, bt, sl, qsl))


@pytest.mark.cpu
def test_variant_takes_its_tiles_and_is_right(monkeypatch):
    monkeypatch.setenv("PORTATTN_TARGET", "sm_90")
    args = _args()
    policy = bp._tiles(bp.plan_paged_attention(*args, layout="SHUFFLE"))
    plan_fn = bp.shuffle_variant_plans(args, "32,3,4,2")
    got = bp._tiles(plan_fn(*args, layout="SHUFFLE"))
    assert got == (policy[0], 32, 4, 3, 2)  # (M, N, warps, stages, splits)
    ok, e_kernel, e_torch = bp.check_plan(plan_fn, args, n=2, layout="SHUFFLE")
    assert ok, (e_kernel, e_torch)


@pytest.mark.cpu
def test_variant_register_cap(monkeypatch):
    monkeypatch.setenv("PORTATTN_TARGET", "sm_90")
    args = _args()
    launch = bp.shuffle_variant_plans(args, "64,2,4,1,128")(*args, layout="SHUFFLE")[0]
    assert launch.options.maxnreg == 128
    assert (
        bp.shuffle_variant_plans(args, "64,2,4,1")(*args, layout="SHUFFLE")[0].options.maxnreg
        is None
    )


@pytest.mark.parametrize("spec", ["32,3,4", "32,3,4,x", "64,2,4,1,128,9"])
def test_malformed_variant_is_refused(spec, monkeypatch):
    monkeypatch.setenv("PORTATTN_TARGET", "sm_90")
    with pytest.raises(
        SystemExit, match=r"--shuffle-variants: want N,stages,warps,splits\[,maxnreg\]; got"
    ):
        bp.shuffle_variant_plans(_args(), spec)


def test_heads_option(monkeypatch):
    monkeypatch.setattr(bp, "HQ", bp.HQ)
    monkeypatch.setattr(bp, "HKV", bp.HKV)
    bp.set_heads("64:8")
    q, k, *_ = bp.make_inputs(((20, 1),), 16, torch.float16, device="cpu")
    assert q.shape[1] == 64 and k.shape[2] == 8
    for bad in ("8", "12:8", "0:1", "a:b"):
        with pytest.raises(SystemExit, match="--heads: want HQ:HKV, positive, HQ a multiple"):
            bp.set_heads(bad)


def test_plans_are_timed_in_turns_with_the_order_rotated(monkeypatch):
    """``--rounds``: every plan once a round, the round's order rotated (NHD SHUF, SHUF NHD,
    ...), and each plan's list holds its own timings in round order."""
    ran = []
    monkeypatch.setattr(bp, "run_all", ran.append)
    times = iter([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])  # ms, in the order the plans ran
    monkeypatch.setattr(bp, "do_bench", lambda fn: (fn(), next(times))[1])
    got = bp._timed_in_turns({"nhd": "P_NHD", "shuffle": "P_SHUF"}, 3)
    assert ran == ["P_NHD", "P_SHUF", "P_SHUF", "P_NHD", "P_NHD", "P_SHUF"]
    assert got == {"nhd": [1000.0, 4000.0, 5000.0], "shuffle": [2000.0, 3000.0, 6000.0]}
