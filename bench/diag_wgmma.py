"""Diagnostic (issue 19, MLA at 128 heads): how many cycles the sm_90 MLA kernel's MMAs take on
their own, with the kernel's shapes, operands and shared-memory layout, and nothing else.

Each program (one per SM, the MLA kernel's 230 KB of shared memory) fills the kernel's buffers
once (the query's latent halves, two 64-token tiles, two P tiles) and then runs ``--iters``
"pairs" in two warpgroups (`gl.warp_specialize`, as the kernel). A pair is, per warpgroup, the
MMAs the kernel issues for one pair of tiles, each waited before the next (as the kernel does):

* ``S``: the score MMA on its own tile, 64 x 64 x 576 (latent halves from shared memory, the
  rope part from registers);
* ``PV``: P V on tile A then on tile B, 64 x 256 x 64 each, P from shared memory.

There is no softmax, no copy, no hand-off: the cycles a pair takes here are what the kernel's
MMAs alone cost, the floor of its schedule (its measured pair period: 5490-5740 cycles with the
tiles in L2, 6000-6400 from DRAM; the tensor peak, 2048 bf16 MACs a cycle an SM: 4352).

Modes (``--modes``):

* ``pair``: S then both PVs, both warpgroups;
* ``pair-preg``: the same, each warpgroup's own-tile PV with P from registers (`SM90_P_REGS`);
* ``s`` / ``pv``: only the score MMA / only the two PVs, both warpgroups;
* ``pair-one``: ``pair`` in warpgroup 0 only (warpgroup 1 idles): one warpgroup's rate;
* ``s128``: the score MMA as 64 x 128 x 576 over both tiles at once (a 128-token score tile,
  which reads the query once per two tiles), both warpgroups: MACs twice ``s``'s;
* ``st-alone`` / ``st-beside``: warpgroup 0 stores and reads back one P tile (8 KB each way)
  an iteration through shared memory, then its barrier, as the kernel's hand-offs do; alone, or
  while warpgroup 1 runs ``pair``'s MMAs: how much the MMAs' operand reads slow the CUDA
  cores' shared-memory traffic.

Printed per mode: cycles an iteration (median over programs, ``%clock64``), MACs a cycle an SM
against the 2048 peak, and the ratio to the kernel's own MAC count for a pair where it applies.
Values are random; results are not checked (nothing is computed that a reference could check,
beyond the MMAs' sum, stored so that nothing is dead code).

Usage (GPU machine, repository root)::

    python3 bench/diag_wgmma.py [--iters 400] [--modes pair pair-preg s pv pair-one s128]
"""

from __future__ import annotations

import argparse

import torch
from _common import git_commit, save_record
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from portattn.kernels._gluon import clock64

H = 64  # heads a tile (rows)
N = 64  # tokens a tile
HALF = 256  # latent half (kv_lora_rank 512)
ROPE = 64
PEAK_MACS = 2048  # bf16 MACs a cycle an SM (H100 dense)
MODES = {"pair": 0, "pair-preg": 1, "s": 2, "pv": 3, "pair-one": 4, "s128": 5, "st-alone": 6,
         "st-beside": 7}  # fmt: skip


def macs(mode: str) -> int:
    """MACs one iteration issues in one program (both warpgroups unless ``pair-one``)."""
    s = H * N * (2 * HALF + ROPE)
    pv = 2 * H * N * HALF
    one = {"pair": s + pv, "pair-preg": s + pv, "s": s, "pv": pv, "pair-one": s + pv,
           "s128": 2 * s, "st-alone": 0, "st-beside": 0}[mode]  # fmt: skip
    return one if mode == "pair-one" else 2 * one


@gluon.jit
def _wg(WG: gl.constexpr, q_smem, lat_smem, pe_smem, p_smem, out_ptr, cyc_ptr, iters, pos,
        MODE: gl.constexpr):  # fmt: skip
    dtype: gl.constexpr = q_smem.dtype
    QK: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]
    )
    QK2: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16]
    )
    PV: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]
    )
    QPE: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=QK, k_width=2)
    QPE2: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=QK2, k_width=2)
    PA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=PV, k_width=2)
    active = ((MODE != 4) and (MODE != 6)) or (WG == 0)
    # each accumulator is carried (use_acc) so that no MMA is dead code; registers as the kernel
    t0 = clock64()
    if (MODE == 6 or MODE == 7) and WG == 0:
        # shared-memory stores and loads from the CUDA cores, as the kernel's P hand-off: one P
        # tile (8 KB) read and written an iteration, then the warpgroup's barrier; alone
        # (st-alone) or while warpgroup 1 runs the pair's MMAs (st-beside)
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        x = p_smem.index(0).load(LD)
        opaque = (pos < 0).to(gl.int32)
        for i in range(iters):
            z = (i & 1) | opaque
            p_smem.index(z).store(x)
            gl.thread_barrier()
            x = p_smem.index(1 - z).load(LD)
        total = gl.sum(gl.sum(x.to(gl.float32), 1), 0)
    elif MODE == 5:
        q_pe2 = gl.full([64, 64], 0.01, dtype, QPE2)
        lat2 = lat_smem._reinterpret(dtype, [2, 128, 256], lat_smem.layout)
        s2 = gl.zeros([64, 128], gl.float32, QK2)
        for _ in range(iters):
            # both tiles' rows as one 128-row operand (values do not matter here)
            s2 = warpgroup_mma(q_smem.index(0), lat2.index(0).permute((1, 0)), s2, is_async=True)
            s2 = warpgroup_mma(q_smem.index(1), lat2.index(1).permute((1, 0)), s2, is_async=True)
            s2 = warpgroup_mma(q_pe2, pe_smem.permute((1, 0)), s2, is_async=True)
            s2 = warpgroup_mma_wait(num_outstanding=0, deps=[s2])
        total = gl.sum(gl.sum(s2, 1), 0)
    else:
        q_pe = gl.full([64, 64], 0.01, dtype, QPE)
        p_reg = gl.full([64, 64], 0.02, dtype, PA)
        acc = gl.zeros([64, 256], gl.float32, PV)
        s = gl.zeros([64, 64], gl.float32, QK)
        opaque = (pos < 0).to(gl.int32)  # 0, unknown to ptxas (as the kernel's buffer indices)
        if active:
            for i in range(iters):
                z = (i & 1) & opaque  # keeps the MMA descriptors in the loop (no spills)
                if MODE != 3:  # the score MMA on this warpgroup's tile (tile WG)
                    kl = lat_smem.index(2 * WG + z).permute((1, 0))
                    kr = lat_smem.index(2 * WG + 1 + z).permute((1, 0))
                    kpe = pe_smem.slice(WG * 64, 64, dim=0).permute((1, 0))
                    s = warpgroup_mma(q_smem.index(z), kl, s, is_async=True)
                    s = warpgroup_mma(q_smem.index(1 - z), kr, s, is_async=True)
                    s = warpgroup_mma(q_pe, kpe, s, is_async=True)
                    s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
                if MODE != 2:
                    for b in gl.static_range(2):
                        v = lat_smem.index(2 * b + WG + z)  # this warpgroup's half of tile b
                        if MODE == 1 and b == WG:
                            acc = warpgroup_mma(p_reg, v, acc, is_async=True)
                        else:
                            acc = warpgroup_mma(p_smem.index(b + z), v, acc, is_async=True)
                        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        total = gl.sum(gl.sum(acc, 1), 0) + gl.sum(gl.sum(s, 1), 0)
    t1 = clock64()
    pid = gl.program_id(0)
    gl.store(cyc_ptr + pid * 2 + WG, t1 - t0)
    gl.store(out_ptr + pid * 2 + WG, total)


@gluon.jit
def _kernel(src_ptr, out_ptr, cyc_ptr, iters, pos, MODE: gl.constexpr, LAYOUT: gl.constexpr,
            PE_LAYOUT: gl.constexpr, P_LAYOUT: gl.constexpr):  # fmt: skip
    dtype: gl.constexpr = src_ptr.dtype.element_ty
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    # query halves (2), the tiles' latent halves (tile b's half h at 2 * b + h), rope parts
    # (both tiles' rows), both P tiles: the MLA kernel's buffers (bench/NOTES.md, ninth session)
    q_smem = gl.allocate_shared_memory(dtype, [2, 64, 256], LAYOUT)
    lat_smem = gl.allocate_shared_memory(dtype, [4, 64, 256], LAYOUT)
    pe_smem = gl.allocate_shared_memory(dtype, [128, 64], PE_LAYOUT)
    p_smem = gl.allocate_shared_memory(dtype, [2, 64, 64], P_LAYOUT)
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, LOAD))
    cols = gl.arange(0, 256, layout=gl.SliceLayout(0, LOAD))
    x = gl.load(src_ptr + rows[:, None] * 256 + cols[None, :])
    for i in gl.static_range(2):
        q_smem.index(i).store(x)
    for i in gl.static_range(4):
        lat_smem.index(i).store(x)
    LPE: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    r2 = gl.arange(0, 128, layout=gl.SliceLayout(1, LPE))
    c2 = gl.arange(0, 64, layout=gl.SliceLayout(0, LPE))
    pe_smem.store(gl.load(src_ptr + r2[:, None] * 64 + c2[None, :]))
    for i in gl.static_range(2):
        p_smem.index(i).store(gl.load(src_ptr + rows[:, None] * 64 + c2[None, :] % 64))
    fence_async_shared()
    gl.thread_barrier()
    gl.warp_specialize(
        [
            (_wg, (0, q_smem, lat_smem, pe_smem, p_smem, out_ptr, cyc_ptr, iters, pos, MODE)),
            (_wg, (1, q_smem, lat_smem, pe_smem, p_smem, out_ptr, cyc_ptr, iters, pos, MODE)),
        ],
        [4],
        [256],
    )


def run_mode(mode: str, iters: int, programs: int) -> dict:
    dtype = torch.bfloat16
    src = torch.randn(64 * 256, device="cuda", dtype=dtype) * 0.1
    out = torch.empty(programs * 2, device="cuda", dtype=torch.float32)
    cyc = torch.zeros(programs * 2, device="cuda", dtype=torch.int64)
    layout = gl.NVMMASharedLayout.get_default_for([64, 256], gl.bfloat16)
    pe_layout = gl.NVMMASharedLayout.get_default_for([128, 64], gl.bfloat16)
    p_layout = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    args = (src, out, cyc, iters, 7, MODES[mode], layout, pe_layout, p_layout)
    _kernel[(programs,)](*args, num_warps=4)  # compile, warm
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    _kernel[(programs,)](*args, num_warps=4)
    ev[1].record()
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), f"{mode}: non-finite MMA sums"
    per = cyc.view(programs, 2)[:, 0].double() / iters  # warpgroup 0's loop
    cycles = float(per.median())
    m = macs(mode)
    if m == 0:  # st-alone / st-beside: 16 KB of shared-memory traffic an iteration
        return {"mode": mode, "cycles_per_iter": round(cycles, 1),
                "bytes_per_clk": round(2 * 64 * 64 * 2 / cycles, 1)}  # fmt: skip
    return {
        "mode": mode,
        "cycles_per_iter": round(cycles, 1),
        "macs_per_clk_sm": round(m / cycles, 1),
        "of_peak": round(m / cycles / PEAK_MACS, 3),
        "ms": round(ev[0].elapsed_time(ev[1]), 3),
        "clock_ghz": round(float(per.median()) * iters / (ev[0].elapsed_time(ev[1]) * 1e6), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    a = ap.parse_args()
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, {programs} programs (one an SM), iters {a.iters}")
    print(f"{'mode':10} {'cycles/iter':>12} {'MAC/clk/SM':>11} {'of peak':>8} {'GHz':>6}")
    rows = []
    for mode in a.modes:
        r = run_mode(mode, a.iters, programs)
        rows.append(r)
        if "bytes_per_clk" in r:
            print(f"{mode:10} {r['cycles_per_iter']:12.1f}   ({r['bytes_per_clk']} B/clk of "
                  "shared-memory stores and loads)")  # fmt: skip
            continue
        print(f"{mode:10} {r['cycles_per_iter']:12.1f} {r['macs_per_clk_sm']:11.1f} "
              f"{r['of_peak']:8.3f} {r['clock_ghz']:6.3f}")  # fmt: skip
    save_record("diag_wgmma", commit=git_commit(), iters=a.iters, rows=rows)


if __name__ == "__main__":
    main()
