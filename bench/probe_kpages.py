"""Feasibility probe (not a product path; issue 19, block 16): can one TMA copy lay a 16-row
page of K down as [8-row groups, 64-column groups, 8, 64] (a 4-D view of the cache's rows), and
does the score MMA read eight such pages as one [128, 128] K tile, a stage of a three-stage
buffer allocated in a shared linear layout (8-row groups 2048 bytes apart, the column groups
1024 apart inside them)? Today a page of K takes two copies (one a 64-column group), 16 a tile
at block 16.

Usage (GPU machine, repository root): ``python3 bench/probe_kpages.py`` (prints ok / WRONG);
``--compile`` compiles for sm_90 only (no GPU needed) and prints the PTX's copies and MMAs.
"""

import sys

sys.path.insert(0, "src")

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

PAGES, BOX, D, HKV, BLOCK_N, M = 32, 16, 128, 8, 128, 64


@gluon.constexpr_function
def k_pages_layout(block_n, head_d):
    """[block_n, head_d] 16-bit: 64 columns a 128-byte row, rows 0-7 under the 128-byte swizzle,
    then the 64-column groups, then the 8-row groups."""
    bases = [[0, 1 << i] for i in range(6)]
    bases += [[1 << i, 8 << i] for i in range(3)]
    bases += [[0, 64 << i] for i in range((head_d // 64).bit_length() - 1)]
    bases += [[8 << i, 0] for i in range((block_n // 8).bit_length() - 1)]
    return gl.SharedLinearLayout(offset_bases=bases, alignment=1024)


@gluon.jit
def probe(
    k_desc,
    q_ptr,
    table_ptr,
    out_ptr,
    kcol,
    BOX: gl.constexpr,
    D: gl.constexpr,
    BLOCK_N: gl.constexpr,
    M: gl.constexpr,
):
    L2: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    L4: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
    NB: gl.constexpr = BLOCK_N // BOX
    # three stages in the linear layout, as the kernel allocates them; stage 1 used
    KL: gl.constexpr = k_pages_layout(BLOCK_N, D)
    k_buf = gl.allocate_shared_memory(gl.bfloat16, [3, BLOCK_N, D], KL).index(1)
    q_buf = gl.allocate_shared_memory(gl.bfloat16, [M, D], L2)
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    fence_async_shared()
    mbarrier.expect(bar.index(0), BLOCK_N * D * 2)
    for b in gl.static_range(NB):
        row = gl.load(table_ptr + b) * BOX
        page = k_buf._reinterpret(gl.bfloat16, [NB, BOX, D], L2).index(b)
        page = page._reinterpret(gl.bfloat16, [BOX // 8, D // 64, 8, 64], L4)
        tma.async_copy_global_to_shared(k_desc, [row // 8, kcol // 64, 0, 0], bar.index(0), page)
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    qr = gl.arange(0, M, layout=gl.SliceLayout(1, LOAD))
    qc = gl.arange(0, D, layout=gl.SliceLayout(0, LOAD))
    q_buf.store(gl.load(q_ptr + qr[:, None] * D + qc[None, :]))
    fence_async_shared()
    mbarrier.wait(bar.index(0), 0)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    acc = gl.zeros([M, BLOCK_N], gl.float32, layout=MMA)
    acc = warpgroup_mma(q_buf, k_buf.permute((1, 0)), acc, use_acc=False, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    r = gl.arange(0, M, layout=gl.SliceLayout(1, MMA))
    c = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
    gl.store(out_ptr + r[:, None] * BLOCK_N + c[None, :], acc)


def descriptor(cache):
    """The key cache's rows as [rows / 8, 64-column groups, 8, 64], box [BOX / 8, D / 64, 8, 64]."""
    ts = cache.stride(1)
    rows = cache.shape[0] * cache.shape[1]
    cols = cache.shape[2] * cache.shape[3]
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
    return TensorDescriptor(
        cache,
        [rows // 8, cols // 64, 8, 64],
        [8 * ts, 64, ts, 1],
        [BOX // 8, D // 64, 8, 64],
        layout,
    )


def launch(device, cache=None, q=None, table=None, head=0):
    from portattn.kernels._launch import Launch, LaunchOptions
    from portattn.platform import get_target

    if device == "meta":
        cache = torch.empty(PAGES, BOX, HKV, D, dtype=torch.bfloat16, device="meta")
        q = torch.empty(M, D, dtype=torch.bfloat16, device="meta")
        table = torch.empty(BLOCK_N // BOX, dtype=torch.int32, device="meta")
    out = torch.empty(M, BLOCK_N, device=device, dtype=torch.float32)
    args = dict(
        k_desc=descriptor(cache),
        q_ptr=q,
        table_ptr=table,
        out_ptr=out,
        kcol=head * D,
        BOX=BOX,
        D=D,
        BLOCK_N=BLOCK_N,
        M=M,
    )
    return Launch(
        kernel=probe,
        grid=(1,),
        args=args,
        options=LaunchOptions(4, 1),
        target=get_target("sm_90"),
        name="probe_kpages",
    )


def main():
    if "--compile" in sys.argv:
        from portattn.compile.worker import compile_kernel
        from portattn.platform import get_target

        ptx = compile_kernel(launch("meta"), get_target("sm_90")).asm["ptx"]
        print(
            "tma copies", ptx.count("cp.async.bulk.tensor"), "wgmma", ptx.count("wgmma.mma_async")
        )
        return 0
    g = torch.Generator(device="cuda").manual_seed(0)
    cache = torch.randn(PAGES, BOX, HKV, D, device="cuda", generator=g).to(torch.bfloat16)
    q = torch.randn(M, D, device="cuda", generator=g).to(torch.bfloat16)
    table = torch.randperm(PAGES, device="cuda", generator=g)[: BLOCK_N // BOX].to(torch.int32)
    head = 3
    run = launch("cuda", cache, q, table, head)
    run.run()
    out = run.args["out_ptr"]
    torch.cuda.synchronize()
    k = cache[table.long(), :, head].reshape(BLOCK_N, D)
    want = q.double() @ k.double().T
    err = (out.double() - want).abs().max().item()
    ok = err < 1e-2
    print(
        "4-D K page boxes + wgmma through the linear layout:",
        "ok" if ok else "WRONG",
        f"max err {err:.3g}",
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
