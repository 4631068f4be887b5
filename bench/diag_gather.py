"""Diagnostic (issue 18, MLA page 1): three ways to bring 64 scattered cache rows into the MLA
kernel's swizzled shared-memory tiles on sm_90, timed with nothing else in the way.

Each program of a Gluon kernel (one warpgroup) loads tiles of 64 rows of a ``[rows, 576]`` bf16
cache (the MLA row: 512 latent + 64 rope) into two stages of NVMMA-swizzled buffers (two
``[64, 256]`` latent halves and a ``[64, 64]`` rope part, as the MLA kernel's), waits for each, and
sums a few of its elements (checked against torch). Modes:

- ``cp.async``: every thread copies 16-byte pieces of the rows it is given (the kernel's gather
  today, `_gather_part`), arriving on the stage's barrier once they land;
- ``tma-rows``: one thread issues a 1-row TMA box per row and part (9 a row: 4 + 4 latent, 1 rope;
  the swizzle is applied by the TMA unit from the row's shared-memory address), the row index
  read as a scalar;
- ``tma-pages``: the rows of a tile are one 64-row page, one box a part (the page-64 path's copies:
  the ceiling).

Reported: the cache's GB/s (bytes / median time) and the median cycles a tile the issuing code
takes (clock64 around the issue). If ``tma-rows`` issues a tile in far fewer cycles than
``cp.async`` at a similar rate, the MLA kernel's gather can move to it.

Usage (GPU machine, repository root)::

    python3 bench/diag_gather.py                      # contexts 4096 16384
"""

from __future__ import annotations

import argparse

import torch
from _common import save_record
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.testing import do_bench

from portattn.kernels._gluon import clock64

ROW = gl.constexpr(576)
HALF = gl.constexpr(256)
ROPE = gl.constexpr(64)
ROWS = gl.constexpr(64)
MODES = {"cp.async": 0, "tma-rows": 1, "tma-pages": 2}


@gluon.jit
def _issue(MODE: gl.constexpr, kv_ptr, idx_ptr, lat_desc, pe_desc, row_lat, row_pe, t, bar,
           lat0, lat1, pe_buf):  # fmt: skip
    """Tile t's copies into one stage (latent halves ``lat0``, ``lat1``: [64, 256] each;
    ``pe_buf``: [64, 64])."""
    if MODE == 0:
        L64: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        r = gl.load(idx_ptr + t * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L64)))
        r = r.to(gl.int64)
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, L64))
        for c in gl.static_range(9):
            ptrs = kv_ptr + r[:, None] * ROW + c * 64 + cols[None, :]
            if c < 4:
                async_copy.async_copy_global_to_shared(lat0.slice(c * 64, 64, dim=1), ptrs)
            elif c < 8:
                async_copy.async_copy_global_to_shared(lat1.slice((c - 4) * 64, 64, dim=1), ptrs)
            else:
                async_copy.async_copy_global_to_shared(pe_buf, ptrs)
        async_copy.mbarrier_arrive(bar, increment_count=False)
    elif MODE == 1:
        mbarrier.expect(bar, ROWS * ROW * 2)
        # each 64-column block of a swizzled [64, W] buffer is 64 rows of 128 bytes: viewed as
        # [W, 1, 64] its element (c * 64 + i) is row i of block c, where the TMA unit writes a
        # [1, 64] box swizzled by its shared-memory address
        R3: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
        v0 = lat0._reinterpret(lat0.dtype, [4 * ROWS, 1, 64], R3)
        v1 = lat1._reinterpret(lat1.dtype, [4 * ROWS, 1, 64], R3)
        vp = pe_buf._reinterpret(pe_buf.dtype, [ROWS, 1, 64], R3)
        for i in gl.static_range(ROWS):
            row = gl.load(idx_ptr + t * ROWS + i)
            for c in gl.static_range(4):
                tma.async_copy_global_to_shared(row_lat, [row, c * 64], bar, v0.index(c * ROWS + i))
                tma.async_copy_global_to_shared(
                    row_lat, [row, HALF + c * 64], bar, v1.index(c * ROWS + i)
                )
            tma.async_copy_global_to_shared(row_pe, [row, 2 * HALF], bar, vp.index(i))
    else:
        mbarrier.expect(bar, ROWS * ROW * 2)
        row = gl.load(idx_ptr + t * ROWS)
        tma.async_copy_global_to_shared(lat_desc, [row, 0], bar, lat0)
        tma.async_copy_global_to_shared(lat_desc, [row, HALF], bar, lat1)
        tma.async_copy_global_to_shared(pe_desc, [row, 2 * HALF], bar, pe_buf)


@gluon.jit
def _kernel(kv_ptr, idx_ptr, out_ptr, cyc_ptr, lat_desc, pe_desc, row_lat, row_pe, tiles_per,
            MODE: gl.constexpr, LAYOUT: gl.constexpr, PE_LAYOUT: gl.constexpr):  # fmt: skip
    pid = gl.program_id(0)
    dtype: gl.constexpr = kv_ptr.dtype.element_ty
    lat0 = gl.allocate_shared_memory(dtype, [2, ROWS, HALF], LAYOUT)  # latent half 0, by stage
    lat1 = gl.allocate_shared_memory(dtype, [2, ROWS, HALF], LAYOUT)
    pe = gl.allocate_shared_memory(dtype, [2, ROWS, ROPE], PE_LAYOUT)
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(2):
        mbarrier.init(bars.index(b), count=128 if MODE == 0 else 1)
    fence_async_shared()
    gl.thread_barrier()
    L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    acc = gl.zeros([ROWS, 64], gl.float32, L)
    t0 = pid * tiles_per
    issue = gl.to_tensor(0).to(gl.int64)
    _issue(MODE, kv_ptr, idx_ptr, lat_desc, pe_desc, row_lat, row_pe, t0, bars.index(0),
           lat0.index(0), lat1.index(0), pe.index(0))  # fmt: skip
    for i in range(tiles_per):
        s = i % 2
        if i + 1 < tiles_per:
            c0 = clock64()
            nxt = 1 - s
            _issue(MODE, kv_ptr, idx_ptr, lat_desc, pe_desc, row_lat, row_pe, t0 + i + 1,
                   bars.index(nxt), lat0.index(nxt), lat1.index(nxt), pe.index(nxt))  # fmt: skip
            issue += clock64() - c0
        mbarrier.wait(bars.index(s), (i // 2) & 1)
        fence_async_shared()
        x = lat0.index(s).slice(0, 64, dim=1).load(L).to(gl.float32)
        x += lat1.index(s).slice(192, 64, dim=1).load(L).to(gl.float32)
        x += pe.index(s).load(L).to(gl.float32)
        acc += x * (gl.arange(0, 64, layout=gl.SliceLayout(0, L)) + 1).to(gl.float32)[None, :]
        gl.thread_barrier()  # every thread has read the stage before it is refilled
    gl.store(out_ptr + pid, gl.sum(gl.sum(acc, axis=1), axis=0))
    gl.store(cyc_ptr + pid, issue // gl.maximum(tiles_per - 1, 1))


# host-side values of the kernel's constants
ROW_, HALF_, ROPE_, ROWS_ = ROW.value, HALF.value, ROPE.value, ROWS.value


def layouts():
    lat = gl.NVMMASharedLayout.get_default_for([ROWS_, HALF_], gl.bfloat16)
    pe = gl.NVMMASharedLayout.get_default_for([ROWS_, ROPE_], gl.bfloat16)
    return lat, pe


def descriptors(cache: torch.Tensor):
    lat, pe = layouts()
    row = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    shape, strides = list(cache.shape), list(cache.stride())
    return (
        TensorDescriptor(cache, shape, strides, [ROWS_, HALF_], lat),
        TensorDescriptor(cache, shape, strides, [ROWS_, ROPE_], pe),
        TensorDescriptor(cache, shape, strides, [1, 64], row),
        TensorDescriptor(cache, shape, strides, [1, 64], row),
    )


def reference(cache: torch.Tensor, idx: torch.Tensor, programs: int, tiles_per: int):
    """What each program sums: per tile, latent columns 0-63 and 448-511 and the rope part."""
    t = cache[idx.long()].float().view(programs, tiles_per, ROWS_, ROW_)
    w = torch.arange(1, 65, device=cache.device, dtype=torch.float32)  # column weights
    return ((t[..., 0:64] + t[..., 448:512] + t[..., 512:576]) * w).sum(dim=(1, 2, 3))


def run(mode: str, cache: torch.Tensor, idx: torch.Tensor, tiles_per: int) -> dict:
    programs = idx.numel() // (ROWS_ * tiles_per)
    out = torch.empty(programs, device="cuda", dtype=torch.float32)
    cyc = torch.zeros(programs, device="cuda", dtype=torch.int64)
    lat, pe = layouts()
    args = (cache, idx, out, cyc, *descriptors(cache), tiles_per, MODES[mode], lat, pe)
    k = _kernel[(programs,)](*args, num_warps=4)
    torch.cuda.synchronize()
    ref = reference(cache, idx, programs, tiles_per)
    ok_unpatched = None
    if mode == "tma-rows":
        # the kernel sees the 1-row boxes unswizzled (Triton's TMA lowering wants 8 rows under
        # a swizzle); their tensor maps are encoded with the 128-byte swizzle instead, which the
        # TMA unit applies from each row's shared-memory address (what this mode checks)
        ok_unpatched = bool(torch.allclose(out, ref, rtol=1e-3, atol=1e-2))
        for meta in k.metadata.tensordesc_meta[2:]:
            meta["swizzle"] = 3
        out.zero_()
        _kernel[(programs,)](*args, num_warps=4)
        torch.cuda.synchronize()
    ok = torch.allclose(out, ref, rtol=1e-3, atol=1e-2)
    ms = do_bench(lambda: _kernel[(programs,)](*args, num_warps=4), warmup=5, rep=50)
    return {
        "mode": mode,
        "ok": bool(ok),
        "ok_unswizzled": ok_unpatched,
        "gb_s": round(idx.numel() * ROW_ * 2 / ms / 1e6, 1),
        "issue_cycles_per_tile": int(cyc.median()),
        "us": round(ms * 1e3, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--tiles-per", type=int, default=8, help="tiles a program loads")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for ctx in args.contexts:
        n = args.seqs * ctx
        cache = (torch.randn(n, ROW_, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
        shuffled = torch.randperm(n, device="cuda", generator=g).to(torch.int32)
        pages = torch.randperm(n // ROWS_, device="cuda", generator=g).to(torch.int32)
        paged = (pages[:, None] * ROWS_ + torch.arange(ROWS_, device="cuda")).flatten().int()
        for mode in MODES:
            idx = paged if mode == "tma-pages" else shuffled
            r = run(mode, cache, idx, args.tiles_per) | {"context": ctx}
            print(r, flush=True)
            rows.append(r)
        # cp.async on pages too: the same copies on the same rows as tma-pages
        r = run("cp.async", cache, paged, args.tiles_per) | {"context": ctx, "order": "pages"}
        print(r, flush=True)
        rows.append(r)
    save_record("diag_gather", rows=rows)


if __name__ == "__main__":
    main()
