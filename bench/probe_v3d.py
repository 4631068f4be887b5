"""Feasibility probe (not a product path): can a 3-D TMA descriptor with non-monotonic strides
(halves of a 128-wide row as the outer dimension) load a page's [16, 128] V block in one copy, in
the [2][16][64] order of a [16, 128] NVMMA tile, and does a wgmma read it as that tile?"""

import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.jit
def probe(desc, out_ptr, row0, col0):
    L3: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
    L2: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    buf = gl.allocate_shared_memory(gl.bfloat16, [2, 16, 64], L3)
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    fence_async_shared()
    mbarrier.expect(bar.index(0), 2 * 16 * 64 * 2)
    tma.async_copy_global_to_shared(desc, [col0 // 64, row0, 0], bar.index(0), buf)
    mbarrier.wait(bar.index(0), 0)
    v = buf._reinterpret(gl.bfloat16, [16, 128], L2)
    PV: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16]
    )
    PA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=PV, k_width=2)
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, PV))
    k = gl.arange(0, 16, layout=gl.SliceLayout(0, PV))
    p = gl.where((r % 16)[:, None] == k[None, :], 1.0, 0.0).to(gl.bfloat16)
    acc = gl.zeros([64, 128], gl.float32, layout=PV)
    acc = warpgroup_mma(gl.convert_layout(p, PA), v, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    c = gl.arange(0, 128, layout=gl.SliceLayout(0, PV))
    gl.store(out_ptr + r[:, None] * 128 + c[None, :], acc)


def main():
    rows, heads, d = 256, 8, 128
    cache = torch.randn(rows, heads * d, device="cuda").to(torch.bfloat16)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
    desc = TensorDescriptor(
        cache, [heads * d // 64, rows, 64], [64, cache.stride(0), 1], [2, 16, 64], layout
    )
    out = torch.empty(64, 128, device="cuda", dtype=torch.float32)
    row0, head = 48, 3
    probe[(1,)](desc, out, row0, head * d, num_warps=4)
    torch.cuda.synchronize()
    want = cache[row0 : row0 + 16, head * d : (head + 1) * d].float().repeat(4, 1)
    ok = torch.equal(out, want)
    print(
        "3-D non-monotonic TMA box + wgmma:",
        "ok" if ok else "WRONG",
        f"max err {(out - want).abs().max().item():.3g}",
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
