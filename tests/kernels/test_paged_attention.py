"""paged_attention against the fp64 oracle: block sizes, GQA, mixed batches, strided caches.

CPU runs go through Triton's interpreter (fp32/fp16, small shapes); `gpu` tests use bf16/fp16 at
serving shapes. Caches are filled with NaN wherever the kernel must not read (unused blocks, the
tail of each sequence's last block, Mamba state, the gaps of a sliced buffer), so a wrong address
shows up as a non-finite output.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from portattn import reference
from portattn.kernels._launch import run_all
from portattn.kernels.paged_attention import paged_attention, plan_paged_attention
from portattn.layout import empty_kv_cache, make_hybrid_cache, shuffle_x, token_view
from portattn.platform import get_target
from portattn.policy.paged import PagedProblem, paged_tiles
from tests.helpers import Opaque, assert_low_precision_close

pytestmark = pytest.mark.paged

BLOCK_SIZES = (1, 16, 80, 544, 2048)
CPU_DTYPES = (torch.float32, torch.float16)
# (num_q_heads, num_kv_heads): MHA, GQA 5:1, GQA 8:1, MQA
HEADS = ((3, 3), (10, 2), (16, 2), (6, 1))
CACHE_KINDS = ("contiguous", "slice", "permuted", "hybrid")
LAYOUTS = ("NHD", "SHUFFLE")
# (seq_len, q_len): decode, seq_len 1, chunked prefill, pure prefill, an idle (q_len 0) slot
MIXED = ((19, 1), (1, 1), (23, 6), (9, 9), (5, 0))
NAN = float("nan")
FP32_FLOOR = 1e-6  # fp32: the kernel's few-ulp differences from torch's own fp32 error (~1e-7)


# -- batch builder ------------------------------------------------------------------------------


@dataclass
class Batch:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    layout: str

    def args(self):
        return (
            self.query,
            self.key_cache,
            self.value_cache,
            self.block_table,
            self.seq_lens,
            self.query_start_loc,
        )


def _caches(kind, layout, num_blocks, block_size, hkv, d, dtype, device, state_bytes=48):
    """(key_cache, value_cache) of ``kind``, every byte NaN; returns views in ``layout``."""
    if kind == "hybrid":
        hc = make_hybrid_cache(
            num_blocks,
            block_size,
            hkv,
            d,
            mamba_state_bytes=state_bytes,
            layout=layout,
            dtype=dtype,
            device=device,
        )
        hc.buffer.fill_(NAN)
        return hc.key_cache, hc.value_cache
    if kind == "contiguous":
        k, v = empty_kv_cache(
            num_blocks, block_size, hkv, d, layout=layout, dtype=dtype, device=device
        )
        k.fill_(NAN), v.fill_(NAN)
        return k, v
    if kind == "wide":  # NHD heads 64 columns further apart than head_dim (padding: NaN)
        wk, wv = empty_kv_cache(num_blocks, block_size, hkv, d + 64, layout=layout, dtype=dtype,
                                device=device)  # fmt: skip
        wk.fill_(NAN), wv.fill_(NAN)
        return wk[..., :d], wv[..., :d]
    if kind == "slice":  # every other block, one head more, (NHD) a wider head_dim
        wide_d = d + 8 if layout == "NHD" else d
        wk, wv = empty_kv_cache(
            2 * num_blocks, block_size, hkv + 1, wide_d, layout=layout, dtype=dtype, device=device
        )
        wk.fill_(NAN), wv.fill_(NAN)
        if layout == "NHD":
            return wk[1::2, :, 1:, :d], wv[1::2, :, 1:, :d]
        return wk[1::2, 1:], wv[1::2, 1:]
    # "permuted": the same logical layout stored in another axis order
    if layout == "NHD":  # stored [num_blocks, num_kv_heads, block_size, head_dim] (HND)
        shape = (num_blocks, hkv, block_size, d)
        k = torch.full(shape, NAN, dtype=dtype, device=device).permute(0, 2, 1, 3)
        v = torch.full(shape, NAN, dtype=dtype, device=device).permute(0, 2, 1, 3)
        return k, v
    # SHUFFLE stored heads-outermost: [num_kv_heads, num_blocks, ...]
    x = shuffle_x(dtype)
    k = torch.full((hkv, num_blocks, d // x, block_size, x), NAN, dtype=dtype, device=device)
    v = torch.full((hkv, num_blocks, block_size // x, d, x), NAN, dtype=dtype, device=device)
    return k.transpose(0, 1), v.transpose(0, 1)


def make_batch(
    seqs,
    *,
    block_size,
    heads,
    head_dim,
    dtype,
    kind="contiguous",
    layout="NHD",
    device="cpu",
    seed=0,
    strided_query=False,
    table_dtype=torch.int32,
    table_pad=-1,
    spare_blocks=2,
    state_bytes=48,
) -> Batch:
    """A batch of ``seqs`` = ((seq_len, q_len), ...) over a randomly permuted paged cache."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    nblk = [-(-s // block_size) for s, _ in seqs]
    num_blocks = sum(nblk) + spare_blocks
    k, v = _caches(kind, layout, num_blocks, block_size, hkv, head_dim, dtype, device, state_bytes)
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(nblk, default=0) + 1
    table = torch.full((len(seqs), max_blocks), table_pad, dtype=torch.int64)
    first = 0
    for i, ((s, _), n) in enumerate(zip(seqs, nblk, strict=True)):
        table[i, :n] = perm[first : first + n]
        first += n
        for b in table[i, :n].tolist():  # real data in used blocks ...
            k[b].copy_(torch.randn(k[b].shape, generator=g).to(dtype))
            v[b].copy_(torch.randn(v[b].shape, generator=g).to(dtype))
        if n:  # ... but NaN past the sequence's end in its last block
            last = int(table[i, n - 1])
            for t in range(s - (n - 1) * block_size, block_size):
                token_view(k, layout, "key", last, t).fill_(NAN)
                token_view(v, layout, "value", last, t).fill_(NAN)
    q_lens = [q for _, q in seqs]
    qsl = torch.tensor([0, *torch.tensor(q_lens, dtype=torch.int64).cumsum(0).tolist()])
    num_tokens = int(qsl[-1])
    q = torch.randn((num_tokens, hq, head_dim), generator=g).to(dtype).to(device)
    if strided_query:  # a slice of a wider [num_tokens, hq + 1, head_dim + 8] buffer
        wide = torch.full((num_tokens, hq + 1, head_dim + 8), NAN, dtype=dtype, device=device)
        wide[:, 1:, :head_dim] = q
        q = wide[:, 1:, :head_dim]
    return Batch(
        query=q,
        key_cache=k,
        value_cache=v,
        block_table=table.to(table_dtype).to(device),
        seq_lens=torch.tensor([s for s, _ in seqs], dtype=torch.int32, device=device),
        query_start_loc=qsl.to(torch.int32).to(device),
        layout=layout,
    )


def check(batch: Batch, out: torch.Tensor, *, scale=None) -> None:
    """The tolerance rule of docs/design.md §5 against reference.paged_attention."""
    kw = dict(scale=scale, layout=batch.layout)
    oracle = reference.paged_attention(*batch.args(), **kw)
    lowp = reference.paged_attention(*batch.args(), compute_dtype=batch.query.dtype, **kw)
    floor = FP32_FLOOR if batch.query.dtype == torch.float32 else 0.0
    assert out.dtype == batch.query.dtype and out.shape == batch.query.shape
    assert_low_precision_close(out.cpu(), oracle, lowp, floor=floor)


def _seqs_for(block_size):
    """Small contexts: > 1 block and a partial last block when blocks are small."""
    if block_size <= 16:
        return ((2 * block_size + 5, 1), (block_size + 3, 4))
    if block_size == 80:
        return ((block_size + 7, 1), (block_size + 5, 3))
    return ((37, 1), (29, 5))  # one partial block of 544 / 2048


# -- correctness (interpreter on CPU, or the GPU) -----------------------------------------------


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_block_sizes(device, block_size, dtype):
    b = make_batch(
        _seqs_for(block_size), block_size=block_size, heads=(4, 2), head_dim=64, dtype=dtype,
        device=device,
    )  # fmt: skip
    check(b, paged_attention(*b.args()))


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_gqa_mixed_batch(device, heads, dtype):
    """Decode, seq_len 1, chunked and pure prefill and an idle slot in one launch."""
    b = make_batch(MIXED, block_size=8, heads=heads, head_dim=32, dtype=dtype, device=device)
    check(b, paged_attention(*b.args()))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", CACHE_KINDS)
def test_cache_views(device, kind, layout):
    """Contiguous, sliced, permuted and hybrid-interleaved caches in both layouts (fp16)."""
    b = make_batch(
        ((40, 1), (21, 5)), block_size=16, heads=(4, 2), head_dim=64, dtype=torch.float16,
        kind=kind, layout=layout, device=device,
    )  # fmt: skip
    check(b, paged_attention(*b.args(), layout=layout))


def broadcast_kv_heads(b: Batch, num_kv_heads: int) -> Batch:
    """``b`` (one KV head) with that head's memory seen as ``num_kv_heads`` heads: a KV-head
    stride of 0 (an expanded view; for one head, a size-1 dim of stride 0)."""
    k, v = (
        c.expand(-1, -1, num_kv_heads, -1)
        if num_kv_heads > 1
        else c.as_strided(c.shape, (c.stride(0), c.stride(1), 0, c.stride(3)))
        for c in (b.key_cache, b.value_cache)
    )
    assert k.stride(2) == v.stride(2) == 0
    return dataclasses.replace(b, key_cache=k, value_cache=v)


@pytest.mark.parametrize("heads", [(4, 2), (6, 1)], ids=str)
def test_a_kv_head_stride_of_0_reads_one_head_as_every_head(device, heads):
    """A broadcast view (an MQA cache seen as GQA) was refused by the policy's kv_head_stride
    rule, with the policy's name."""
    b = make_batch(((40, 1), (21, 5)), block_size=16, heads=(heads[0], 1), head_dim=64,
                   dtype=torch.float16, device=device)  # fmt: skip
    b = broadcast_kv_heads(b, heads[1])
    check(b, paged_attention(*b.args()))


@pytest.mark.parametrize(
    "head_dim,layout,dtype",
    [(80, "NHD", torch.float32), (96, "SHUFFLE", torch.float16), (128, "NHD", torch.float16)],
)
def test_head_dims(device, head_dim, layout, dtype):
    b = make_batch(
        ((13, 1), (11, 4)), block_size=16, heads=(2, 1), head_dim=head_dim, dtype=dtype,
        layout=layout, device=device,
    )  # fmt: skip
    check(b, paged_attention(*b.args(), layout=layout))


def test_strided_query_out_and_table(device):
    """Non-contiguous query, out and int64 block table (with junk past each sequence); scale."""
    b = make_batch(
        ((30, 1), (17, 6)), block_size=16, heads=(4, 2), head_dim=64, dtype=torch.float32,
        device=device, strided_query=True, table_dtype=torch.int64, table_pad=123456,
    )  # fmt: skip
    assert not b.query.is_contiguous()
    n, m = b.block_table.shape
    wide_table = torch.full((n, 2 * m), 999, dtype=torch.int64, device=device)
    wide_table[:, ::2] = b.block_table
    b.block_table = wide_table[:, ::2]  # column stride 2, junk in between
    wide = torch.full((b.query.shape[0], b.query.shape[2], 2 * b.query.shape[1]), NAN)
    out = wide.to(device).transpose(1, 2)[:, ::2]  # [tokens, heads, dim], head stride 2*dim
    got = paged_attention(*b.args(), scale=0.3, out=out)
    assert got is out
    check(b, out, scale=0.3)


def test_out_contiguous_given(device):
    b = make_batch(((9, 2),), block_size=4, heads=(2, 2), head_dim=16, dtype=torch.float16,
                   device=device)  # fmt: skip
    out = torch.empty_like(b.query)
    assert paged_attention(*b.args(), out=out) is out
    check(b, out)


def test_empty_batch(device):
    b = make_batch(((4, 0), (7, 0)), block_size=4, heads=(2, 2), head_dim=16,
                   dtype=torch.float32, device=device)  # fmt: skip
    assert paged_attention(*b.args()).shape == (0, 2, 16)


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    kind=st.sampled_from(CACHE_KINDS),
    layout=st.sampled_from(LAYOUTS),
    block_size=st.sampled_from((8, 16, 24, 40)),
    heads=st.sampled_from(((2, 2), (4, 1), (5, 1), (6, 2))),
    head_dim=st.sampled_from((16, 32, 48)),
    seqs=st.lists(
        st.integers(1, 40).flatmap(lambda s: st.tuples(st.just(s), st.integers(0, min(s, 7)))),
        min_size=1,
        max_size=3,
    ),
    state_bytes=st.sampled_from((0, 6, 64)),
    seed=st.integers(0, 2**16),
)
def test_layout_fuzz(device, kind, layout, block_size, heads, head_dim, seqs, state_bytes, seed):
    """Random strides / interleavings / layouts vs the reference (fp16: SHUFFLE needs x=8)."""
    b = make_batch(
        seqs, block_size=block_size, heads=heads, head_dim=head_dim, dtype=torch.float16,
        kind=kind, layout=layout, device=device, seed=seed, state_bytes=state_bytes,
    )  # fmt: skip
    if b.query.shape[0] == 0:
        return
    check(b, paged_attention(*b.args(), layout=layout))


# SHUFFLE through the unmasked loop (full KV tiles) as well as the masked one: a tile spans
# several blocks (block_size 16, 8 = x for fp16), a run of x tokens never straddles one; fp32
# (x = 4); hybrid pages whose stride keeps runs 8-aligned (48 B of state), 2-aligned (4 B) or
# unaligned (6 B), i.e. vector widths 8, 2 and 1 (the strides the kernel rewrites with `_aligned`).
# (block_size, block_n, kind, state_bytes, dtype, (K_VEC, V_VEC))
SHUFFLE_FULL_TILES = [
    (16, 64, "contiguous", 48, torch.float16, (8, 8)),
    (8, 64, "contiguous", 48, torch.float16, (8, 8)),
    (8, 16, "hybrid", 48, torch.float16, (8, 8)),
    (16, 32, "hybrid", 4, torch.float16, (2, 2)),
    (16, 64, "hybrid", 6, torch.float16, (1, 1)),
    (16, 32, "permuted", 48, torch.float32, (4, 4)),
    (80, 64, "slice", 48, torch.float16, (8, 8)),
]


@pytest.mark.parametrize(
    "block_size,block_n,kind,state_bytes,dtype,vec",
    SHUFFLE_FULL_TILES,
    ids=[f"bs{c[0]}-n{c[1]}-{c[2]}{c[3]}-{str(c[4])[6:]}" for c in SHUFFLE_FULL_TILES],
)
def test_shuffle_full_tiles(device, block_size, block_n, kind, state_bytes, dtype, vec):
    """SHUFFLE over contexts of several full KV tiles (unmasked loop), then a partial one: decode
    and chunked prefill, then a decode batch split over 2 KV ranges; NaN past each sequence."""
    from portattn.platform import compile_arch
    from portattn.policy import paged as paged_policy

    x = 16 // dtype.itemsize
    problem = PagedProblem(4, 2, 32, dtype.itemsize, max_query_len=20, shuffled=True)
    tiles = dataclasses.replace(paged_tiles(get_target("sm_90"), problem), block_n=block_n)
    split = dataclasses.replace(tiles, num_splits=2, decode=None)
    # (150, 20): the tail run [144, 150) is past the causal limit of the chunk's first 14 rows
    mixed = ((200, 1), (150, 20), (2 * block_n, 1), (block_n + 9, 3))
    decode = ((200, 1), (3 * block_n + 1, 1), (2 * block_n, 1))
    for seqs, t in ((mixed, tiles), (decode, split)):
        b = make_batch(
            seqs, block_size=block_size, heads=(4, 2), head_dim=32, dtype=dtype, kind=kind,
            layout="SHUFFLE", device=device, state_bytes=state_bytes,
        )  # fmt: skip
        launches = plan_paged_attention(*b.args(), layout="SHUFFLE", tiles=t)
        a = launches[0].args
        assert (a["BLOCK_N"], a["V_TOK_SPLIT"], a["K_VEC"], a["V_VEC"]) == (block_n, x, *vec)
        # 16-bit caches with aligned runs read K and V in the cache's order where the compiling
        # arch takes them (sm_90; the interpreter's target), on the tiles Triton builds right
        # (4 runs: up to 32 tokens)
        arch_ok = paged_policy.shuffle_lines(compile_arch(b.query, get_target("sm_90")))
        lines = arch_ok and dtype != torch.float32 and vec == (x, x) and block_n <= 32
        assert a["LINES"] == lines
        run_all(launches)
        check(b, launches[0].outputs[0])


@pytest.mark.parametrize(
    ("arch", "dtype", "head_dim", "lines"),
    [
        ("sm_90", torch.bfloat16, 128, True),
        ("sm_120", torch.float16, 64, False),  # not run on such a GPU: earlier reads
        ("sm_86", torch.float16, 128, False),  # ptxas spills there
        ("gfx942", torch.bfloat16, 128, False),  # AMD compile: Triton scalarizes them
        ("sm_90", torch.float32, 128, False),  # fp32 keeps its held code
        ("sm_90", torch.bfloat16, 80, False),  # head_dim < BLOCK_D: masked dims
    ],
)
def test_shuffle_reads_in_cache_order_where_it_can(arch, dtype, head_dim, lines):
    """`SHUFFLE_LINES_ARCHS`: the K and V tiles read as [runs, tokens * x] / [runs, head_dim * x]
    (whole lines per warp) on sm_90 (the arch checked on a GPU), 16-bit, head_dim == BLOCK_D,
    aligned runs; NHD never."""
    for layout in ("SHUFFLE", "NHD"):
        k, v = empty_kv_cache(64, 16, 8, head_dim, layout=layout, dtype=dtype, device="meta")
        q = torch.empty(4, 32, head_dim, dtype=dtype, device="meta")
        bt = torch.empty(4, 16, dtype=torch.int32, device="meta")
        sl = torch.empty(4, dtype=torch.int32, device="meta")
        qsl = torch.empty(5, dtype=torch.int32, device="meta")
        launches = plan_paged_attention(q, k, v, bt, sl, qsl, layout=layout,
                                        target=get_target(arch), max_query_len=1)  # fmt: skip
        assert launches[0].args["LINES"] == (lines and layout == "SHUFFLE")


def test_shuffle_cache_order_follows_the_compiling_backend():
    """A HIP policy forced on tensors an NVIDIA compiler runs (here the interpreter's sm_90)
    keeps the cache-order reads: the AMD limit is the backend's, not the tiles'."""
    k, v = empty_kv_cache(64, 16, 8, 128, layout="SHUFFLE", dtype=torch.float16, device="cpu")
    q = torch.empty(4, 32, 128, dtype=torch.float16)
    bt = torch.zeros(4, 16, dtype=torch.int32)
    sl = torch.ones(4, dtype=torch.int32)
    qsl = torch.arange(5, dtype=torch.int32)
    [launch] = plan_paged_attention(q, k, v, bt, sl, qsl, layout="SHUFFLE",
                                    target=get_target("gfx942"), max_query_len=1)  # fmt: skip
    assert launch.args["LINES"] and launch.target.arch == "gfx942"


# -- the plan -----------------------------------------------------------------------------------


def test_plan_on_meta_tensors_needs_no_data():
    """The compile matrix plans from meta tensors: no metadata read, max_query_len given."""
    k, v = empty_kv_cache(4, 2048, 8, 128, dtype=torch.bfloat16, device="meta")
    q = torch.empty(600, 32, 128, dtype=torch.bfloat16, device="meta")
    bt = torch.empty(3, 4, dtype=torch.int32, device="meta")
    sl = torch.empty(3, dtype=torch.int32, device="meta")
    qsl = torch.empty(4, dtype=torch.int32, device="meta")
    target = get_target("gfx942")
    [launch] = plan_paged_attention(q, k, v, bt, sl, qsl, target=target, max_query_len=512)
    a = launch.args  # (Launch.constexprs() needs a compiled JITFunction, not the interpreter's)
    assert (a["BLOCK_M"], a["BLOCK_Q"], a["HEAD_TILE"], a["BLOCK_N"]) == (64, 16, 4, 32)
    assert (a["DECODE_ROLE"], a["DEC_BLOCK_M"], a["DEC_BLOCK_Q"], a["DEC_HEAD_TILE"]) == (
        True,
        16,
        4,
        4,
    )
    assert (a["K_DIM_SPLIT"], a["V_TOK_SPLIT"], a["block_size"], a["NUM_SPLITS"]) == (1, 1, 2048, 1)
    # 1-D grid: 32 q tiles x 8 KV heads x 3 sequences (prefill role), then 8 x 3 (decode role)
    assert launch.grid == (math.ceil(512 / 16) * 8 * 3 + 8 * 3,)
    assert launch.options.kwargs(target) == {"num_warps": 4, "num_stages": 2, "waves_per_eu": 2}


# -- no host reads on the hot path ----------------------------------------------------------------


def test_opaque_tensor_refuses_content_reads():
    t = torch.arange(4).as_subclass(Opaque)
    assert t.shape == (4,) and t.stride() == (1,) and t.dtype == torch.int64
    for read in (t.item, t.tolist, lambda: t.to("cpu", torch.int64), lambda: int(t[0])):
        with pytest.raises(RuntimeError, match=r"Opaque: the plan read"):
            read()


def test_plan_reads_no_contents_when_maxima_given():
    """With max_query_len/max_seq_len given (and the CPU's content check off, as on a GPU) the
    plan touches only shapes and strides, and equals the plan made from the real values."""
    b = make_batch(MIXED, block_size=8, heads=(8, 2), head_dim=32, dtype=torch.float32)
    real = plan_paged_attention(*b.args(), max_query_len=9, max_seq_len=23)
    opaque = [t.as_subclass(Opaque) for t in (b.block_table, b.seq_lens, b.query_start_loc)]
    args = (b.query, b.key_cache, b.value_cache, *opaque)
    [launch] = plan_paged_attention(*args, max_query_len=9, max_seq_len=23, check_contents=False)
    assert launch.grid == real[0].grid
    scalars = lambda a: {k: v for k, v in a.items() if not isinstance(v, torch.Tensor)}  # noqa: E731
    assert scalars(launch.args) == scalars(real[0].args)
    # without the maxima the plan must read the metadata, and says so by raising here
    with pytest.raises(RuntimeError, match=r"Opaque: the plan read"):
        plan_paged_attention(*args)


def test_maxima_given_give_identical_results(device):
    """The serving path (maxima given, no host reads on a GPU) computes bit-identical output."""
    b = make_batch(MIXED, block_size=8, heads=(8, 2), head_dim=32, dtype=torch.float16,
                   device=device)  # fmt: skip
    read = paged_attention(*b.args())
    given = paged_attention(*b.args(), max_query_len=9, max_seq_len=23)
    loose = paged_attention(*b.args(), max_query_len=40, max_seq_len=4000)  # bounds, not exact
    assert torch.equal(read, given) and torch.equal(read, loose)
    check(b, given)


def test_decode_role_boundary(device):
    """Mixed batch with the decode row tile: q_len == its block_q (decode role) and one more
    (prefill role) next to a decode, a chunk and an idle slot."""
    seqs = ((70, 1), (9, 4), (130, 5), (40, 2), (9, 0))
    b = make_batch(seqs, block_size=16, heads=(8, 2), head_dim=32, dtype=torch.float16,
                   device=device)  # fmt: skip
    [launch] = plan_paged_attention(*b.args())
    assert launch.args["DECODE_ROLE"] and launch.args["DEC_BLOCK_Q"] == 4
    check(b, paged_attention(*b.args()))


def test_split_kv(device):
    """Decode split over 4 KV ranges (forced: CPU contexts are too short for the policy to split)
    with a reduce launch; a split past a short sequence's end stays empty."""
    b = make_batch(((150, 1), (5, 1), (70, 1)), block_size=16, heads=(8, 2), head_dim=32,
                   dtype=torch.float32, device=device)  # fmt: skip
    policy = plan_paged_attention(*b.args(), max_query_len=1, max_seq_len=150)[0]
    base = paged_tiles(get_target("sm_90"), PagedProblem(8, 2, 32, 4, max_query_len=1))
    tiles = dataclasses.replace(base, num_splits=4, block_n=16)
    launches = plan_paged_attention(*b.args(), tiles=tiles)
    assert [x.name for x in launches] == ["paged_attention", "paged_attention:reduce"]
    assert launches[0].grid == (4 * 2 * 3,) and policy.args["NUM_SPLITS"] == 1
    run_all(launches)
    check(b, launches[0].outputs[0])


# -- validation: every message ------------------------------------------------------------------


def _valid():
    return make_batch(((10, 1), (6, 3)), block_size=4, heads=(4, 2), head_dim=16,
                      dtype=torch.float32)  # fmt: skip


def _call(b: Batch, **over):
    args = dict(
        query=b.query,
        key_cache=b.key_cache,
        value_cache=b.value_cache,
        block_table=b.block_table,
        seq_lens=b.seq_lens,
        query_start_loc=b.query_start_loc,
    )
    keys = ("scale", "layout", "out", "max_query_len", "max_seq_len")
    kw = {k: over.pop(k) for k in keys if k in over}
    args.update(over)
    return paged_attention(*args.values(), **kw)


def _i32(*xs):
    return torch.tensor(xs, dtype=torch.int32)


# (case id, overrides(batch) -> dict, exception, match)
INVALID = [
    ("query-type", lambda b: dict(query=b.query.tolist()), TypeError,
     r"query must be a torch\.Tensor; got list"),
    ("out-type", lambda b: dict(out=3), TypeError, r"out must be a torch\.Tensor or None; got int"),
    ("query-dtype", lambda b: dict(query=b.query.to(torch.int32)), TypeError,
     r"query dtype must be one of float16, bfloat16, float32; got torch\.int32"),
    ("table-dtype", lambda b: dict(block_table=b.block_table.float()), TypeError,
     r"block_table dtype must be int32 or int64; got torch\.float32"),
    ("seq_lens-dtype", lambda b: dict(seq_lens=b.seq_lens.float()), TypeError,
     r"seq_lens dtype must be int32 or int64; got torch\.float32"),
    ("qsl-dtype", lambda b: dict(query_start_loc=b.query_start_loc.to(torch.int16)), TypeError,
     r"query_start_loc dtype must be int32 or int64; got torch\.int16"),
    ("out-dtype", lambda b: dict(out=torch.empty_like(b.query, dtype=torch.float16)), TypeError,
     r"out dtype must equal query dtype torch\.float32; got torch\.float16"),
    ("cache-dtype", lambda b: dict(query=b.query.half()), TypeError,
     r"key_cache and value_cache dtype must equal query dtype torch\.float16; got torch\.float32"),
    ("cache-pair-dtype", lambda b: dict(value_cache=b.value_cache.half()), TypeError,
     r"key_cache and value_cache must share a dtype"),
    ("layout", lambda b: dict(layout="HND"), ValueError,
     r"layout must be one of \('NHD', 'SHUFFLE'\); got 'HND'"),
    ("cache-dims", lambda b: dict(key_cache=b.key_cache[0], value_cache=b.value_cache[0]),
     ValueError, r"key_cache must be 4-D for layout NHD"),
    ("query-dims", lambda b: dict(query=b.query[0]), ValueError,
     r"query must be 3-D \[num_tokens, num_q_heads, head_dim\]; got shape \(4, 16\)"),
    ("head_dim", lambda b: dict(query=b.query[..., :8]), ValueError,
     r"query head_dim must equal the cache's head_dim 16; got 8"),
    ("heads", lambda b: dict(query=b.query[:, :3]), ValueError,
     r"num_q_heads must be a positive multiple of num_kv_heads 2; got 3"),
    ("out-shape", lambda b: dict(out=b.query[:2].clone()), ValueError,
     r"out shape must equal query shape \(4, 4, 16\); got \(2, 4, 16\)"),
    ("table-dims", lambda b: dict(block_table=b.block_table[0]), ValueError,
     r"block_table must be 2-D \[num_seqs, max_blocks\]; got shape \(4,\)"),
    ("seq_lens-len", lambda b: dict(seq_lens=_i32(10, 6, 1)), ValueError,
     r"seq_lens must be 1-D \[num_seqs=2\]; got shape \(3,\)"),
    ("qsl-len", lambda b: dict(query_start_loc=_i32(0, 4)), ValueError,
     r"query_start_loc must be 1-D \[num_seqs\+1=3\]; got shape \(2,\)"),
    ("device", lambda b: dict(seq_lens=b.seq_lens.to("meta")), ValueError,
     r"seq_lens must be on query's device cpu; got meta"),
    ("scale", lambda b: dict(scale=float("inf")), ValueError,
     r"scale must be a finite float in \(0, 2\.359e\+38\] .* or None; got inf"),
    ("qsl-ends", lambda b: dict(query_start_loc=_i32(0, 1, 3)), ValueError,
     r"query_start_loc must start at 0 and end at num_tokens=4; got first 0, last 3"),
    ("qsl-monotonic", lambda b: dict(query_start_loc=_i32(0, 5, 4)), ValueError,
     r"query_start_loc must be non-decreasing; got a decrease at index 2"),
    ("seq_lens-short", lambda b: dict(seq_lens=_i32(10, 2)), ValueError,
     r"seq_lens must be >= each sequence's q_len; got seq_lens\[1\]=2 < q_len 3"),
    ("table-narrow", lambda b: dict(seq_lens=_i32(20, 6)), ValueError,
     r"block_table must have a column per block .* seq_lens\[0\]=20 needing 5 blocks"),
    ("table-range", lambda b: dict(block_table=b.block_table.clone().fill_(9)), ValueError,
     r"block_table entries of used blocks must be in \[0, num_blocks=7\); got range \[9, 9\]"),
    ("max_query_len-type", lambda b: dict(max_query_len=2.0), TypeError,
     r"max_query_len must be a non-negative int or None; got float 2\.0"),
    ("max_seq_len-type", lambda b: dict(max_seq_len="9"), TypeError,
     r"max_seq_len must be a non-negative int or None; got str '9'"),
    ("scale-type", lambda b: dict(scale="0.1"), TypeError,
     r"scale must be a real number or None; got str"),
    ("scale-bool", lambda b: dict(scale=True), TypeError,
     r"scale must be a real number or None; got bool"),
    ("max_seq_len-negative", lambda b: dict(max_seq_len=-1), ValueError,
     r"max_seq_len must be a non-negative int or None; got -1"),
    ("max_query_len-short", lambda b: dict(max_query_len=2), ValueError,
     r"max_query_len must be >= the longest q_len 3; got 2"),
    ("max_seq_len-short", lambda b: dict(max_seq_len=9), ValueError,
     r"max_seq_len must be >= the longest seq_len 10; got 9"),
]  # fmt: skip


@pytest.mark.parametrize("over,exc,match", [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_arguments(over, exc, match):
    b = _valid()
    with pytest.raises(exc, match=r"^paged_attention: .*" + match):
        _call(b, **over(b))


def test_head_dim_above_256():
    k, v = empty_kv_cache(2, 4, 1, 288, dtype=torch.float32)
    q = torch.zeros(1, 1, 288)
    with pytest.raises(ValueError, match=r"head_dim must be <= 256; got 288"):
        paged_attention(q, k, v, _i32(0).view(1, 1), _i32(1), _i32(0, 1))


def test_every_reason_is_listed():
    b = _valid()
    with pytest.raises(ValueError, match=r"query head_dim must .*; .*out shape must .*; .*scale"):
        _call(b, query=b.query[..., :8], out=b.query[:1].clone(), scale=-1.0)
    with pytest.raises(ValueError, match=r"start at 0 .*; .*non-decreasing"):
        _call(b, query_start_loc=_i32(1, 0, 4))


# -- GPU: serving shapes, bf16/fp16 ---------------------------------------------------------------

GPU_DTYPES = (torch.bfloat16, torch.float16)
# decode at 16k, a 128-token chunk at 9k, pure prefill, seq_len 1, odd lengths
GPU_SEQS = ((16384, 1), (9000, 128), (700, 700), (1, 1), (4097, 1), (3001, 37))
GPU_CACHES = [(16, "contiguous", "NHD"), (2048, "contiguous", "NHD"), (2048, "hybrid", "NHD"),
              (544, "hybrid", "SHUFFLE"), (16, "slice", "SHUFFLE")]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(
    "head_dim,block_n",
    [(hd, n) for hd in (32, 64, 128, 256) for n in (16, 32, 64) if (hd, n) != (256, 64)],
)
def test_gpu_shuffle_lines_tiles(head_dim, block_n):
    """The SHUFFLE cache-order reads on the GPU's own build at every head dim x KV tile width they
    may take (a mixed batch on the prefill tile, a decode batch split over 2 KV ranges): Triton
    3.6 built head_dim 32 x 64 tokens wrong on sm_90 (error 1349x torch's), which
    `shuffle_lines_tile` routes to the earlier reads; every other shape here reads in cache
    order where the GPU's arch takes the reads (sm_90) and must be right."""
    from portattn.platform import compile_arch
    from portattn.policy import paged as paged_policy

    problem = PagedProblem(4, 2, head_dim, 2, max_query_len=20, shuffled=True)
    tiles = dataclasses.replace(paged_tiles(get_target("sm_90"), problem), block_n=block_n)
    split = dataclasses.replace(tiles, num_splits=2, decode=None)
    mixed = ((200, 1), (150, 20), (2 * block_n, 1), (block_n + 9, 3))
    decode = ((200, 1), (3 * block_n + 1, 1), (2 * block_n, 1))
    for seqs, t in ((mixed, tiles), (decode, split)):
        b = make_batch(seqs, block_size=16, heads=(4, 2), head_dim=head_dim, dtype=torch.float16,
                       layout="SHUFFLE", device="cuda")  # fmt: skip
        launches = plan_paged_attention(*b.args(), layout="SHUFFLE", tiles=t)
        if paged_policy.shuffle_lines(compile_arch(b.query, None)):
            assert launches[0].args["LINES"] == ((head_dim, block_n) != (32, 64))
        run_all(launches)
        check(b, launches[0].outputs[0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("block_size,kind,layout", GPU_CACHES)
def test_gpu_serving_shapes(block_size, kind, layout, dtype):
    b = make_batch(
        GPU_SEQS, block_size=block_size, heads=(32, 8), head_dim=128, dtype=dtype, kind=kind,
        layout=layout, device="cuda",
    )  # fmt: skip
    out = paged_attention(*b.args(), layout=layout)
    torch.cuda.synchronize()
    check(b, out)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 2048])
def test_gpu_a_kv_head_stride_of_0(block_size):
    """A broadcast KV head on the serving shapes: the sm_90 prefill kernel's boxes (K and, by
    page boxes, V at head_dim 128) at a head column of 0 for every head."""
    b = make_batch(GPU_SEQS, block_size=block_size, heads=(32, 1), head_dim=128,
                   dtype=torch.bfloat16, device="cuda")  # fmt: skip
    b = broadcast_kv_heads(b, 8)
    out = paged_attention(*b.args())
    torch.cuda.synchronize()
    check(b, out)


@pytest.mark.gpu
def test_gpu_offsets_past_int32():
    """A cache whose last blocks sit beyond 2^31 elements: offsets must be 64-bit."""
    block_size, hkv, d = 16, 8, 128
    per_block = block_size * hkv * d
    num_blocks = (2**31) // per_block + 64
    k = torch.empty((num_blocks, block_size, hkv, d), dtype=torch.float16, device="cuda")
    v = torch.empty_like(k)
    seqs = ((300, 1), (100, 20))
    g = torch.Generator(device="cuda").manual_seed(0)
    table = torch.full((2, 32), -1, dtype=torch.int32, device="cuda")
    first = num_blocks - 40  # every block past the 2^31-element mark
    for i, (s, _) in enumerate(seqs):
        n = -(-s // block_size)
        table[i, :n] = torch.arange(first, first + n, device="cuda")
        first += n
    used = table[table >= 0].long()
    k[used] = torch.randn(k[used].shape, generator=g, device="cuda").half()
    v[used] = torch.randn(v[used].shape, generator=g, device="cuda").half()
    q = torch.randn((21, 32, d), generator=g, device="cuda").half()
    b = Batch(
        query=q, key_cache=k, value_cache=v, block_table=table,
        seq_lens=torch.tensor([300, 100], dtype=torch.int32, device="cuda"),
        query_start_loc=torch.tensor([0, 1, 21], dtype=torch.int32, device="cuda"), layout="NHD",
    )  # fmt: skip
    check(b, paged_attention(*b.args()))


# (name, seqs, block_size): split-KV decode (batch 4 x 8 KV heads at 16k: 16 splits on an H100/
# H200), the mixed batch of bench_paged (prefill and decode row tiles), a speculative step
GPU_SERVING = [
    ("decode 4x16k split", ((16384, 1), (16000, 1), (9001, 1), (300, 1)), 16),
    ("mixed 512@8k + decodes", ((8192, 512), (4096, 1), (4001, 1), (77, 1), (2048, 3)), 2048),
    ("verify q_len 4", ((5000, 4), (3000, 4), (17, 4)), 16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("name,seqs,block_size", GPU_SERVING, ids=[c[0] for c in GPU_SERVING])
def test_gpu_maxima_given(name, seqs, block_size):
    """The serving path: maxima given, no host reads; the policy's split / row tiles in use."""
    b = make_batch(seqs, block_size=block_size, heads=(32, 8), head_dim=128,
                   dtype=torch.bfloat16, device="cuda")  # fmt: skip
    mql, msl = max(q for _, q in seqs), max(s for s, _ in seqs)
    launches = plan_paged_attention(*b.args(), max_query_len=mql, max_seq_len=msl)
    if name.endswith("split"):
        assert launches[0].args["NUM_SPLITS"] > 1 and len(launches) == 2
    run_all(launches)
    torch.cuda.synchronize()
    check(b, launches[0].outputs[0])


@pytest.mark.gpu
@pytest.mark.parametrize("max_seq_len", (None, 16384), ids=("one-pass", "split"))
def test_gpu_cuda_graph_capture_and_replay(max_seq_len):
    """paged_attention with the maxima given is captured in a CUDA graph (a host read would
    raise during capture) and replays correctly after the metadata's VALUES change in place."""
    seqs = ((16384, 1), (9000, 1), (4097, 1), (1, 1))
    b = make_batch(seqs, block_size=16, heads=(32, 8), head_dim=128, dtype=torch.bfloat16,
                   device="cuda")  # fmt: skip
    out = torch.empty_like(b.query)
    kwargs = dict(max_query_len=1, max_seq_len=max_seq_len, out=out)
    paged_attention(*b.args(), **kwargs)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(*b.args(), **kwargs)
    graph.replay()
    torch.cuda.synchronize()
    check(b, out)
    # the next step: other lengths per slot (the sequences permuted), new query values
    perm = torch.tensor([3, 0, 2, 1], device="cuda")
    b.seq_lens.copy_(b.seq_lens[perm].clone())
    b.block_table.copy_(b.block_table[perm].clone())
    b.query.copy_(0.5 * b.query[perm])
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check(b, out)


def test_compile_arch_is_the_compilers_not_the_forced_policys(monkeypatch):
    """`platform.compile_arch`: meta tensors compile for the target asked; CPU tensors (the
    interpreter) for the default target or PORTATTN_TARGET's."""
    from portattn import platform

    meta = torch.empty(1, device="meta")
    assert platform.compile_arch(meta, get_target("gfx942")) == "gfx942"
    assert platform.compile_arch(meta, get_target("sm_86")) == "sm_86"
    cpu = torch.empty(1)
    assert platform.compile_arch(cpu, get_target("gfx942")) == "sm_90"  # the default
    monkeypatch.setenv("PORTATTN_TARGET", "gfx950")
    assert platform.compile_arch(cpu, get_target("sm_90")) == "gfx950"


def test_query_heads_past_the_grids_limit_are_refused_by_name():
    """The split-KV reduce launches one grid row a query head: past CUDA's 65535 a launch
    failed with the driver's "invalid argument" instead of an error naming the query."""
    meta = dict(dtype=torch.float16, device="meta")
    k = torch.empty(4, 16, 1, 8, **meta)
    index = dict(dtype=torch.int32, device="meta")
    args = (k, k.clone(), torch.empty((1, 4), **index), torch.empty(1, **index),
            torch.empty(2, **index))  # fmt: skip
    with pytest.raises(ValueError, match=re.escape(
        "paged_attention: num_q_heads must be <= 65535 (a launch grid's limit); got 65536"
    )):  # fmt: skip
        plan_paged_attention(torch.empty(1, 65536, 8, **meta), *args, max_query_len=1)
    assert plan_paged_attention(torch.empty(1, 65535, 8, **meta), *args, max_query_len=1)
