"""MLA metadata builder: workspaces from the launch's own tiles (lesson 2), per-step state in the
metadata (lesson 5), two builders side by side, CUDA-graph capture (gpu)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from portattn.kernels._checks import reads_contents
from portattn.kernels.mla_decode import mla_decode, plan_mla_decode
from portattn.mla_metadata import MlaMetadata, MlaMetadataBuilder
from portattn.platform import get_target
from portattn.policy.mla import MlaProblem, mla_decode_tiles
from tests.kernels.test_mla_decode import check, make_inputs

pytestmark = [pytest.mark.mla, pytest.mark.specdec]

SM90 = get_target("sm_90")


def builder(
    heads=3,
    dk=192,
    r=128,
    *,
    max_batch=2,
    max_query_len=1,
    max_seq_len=2048,
    dtype=torch.float32,
    device="cpu",
    target=SM90,
) -> MlaMetadataBuilder:
    return MlaMetadataBuilder(
        target,
        max_batch=max_batch,
        num_heads=heads,
        kv_lora_rank=r,
        head_dim_k=dk,
        dtype=dtype,
        device=device,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
    )


@pytest.mark.parametrize(
    ("heads", "padded"), [(1, 16), (3, 16), (4, 16), (8, 16), (20, 32), (128, 128)]
)
@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
def test_workspaces_sized_with_padded_heads(heads, padded, arch):
    """Heads padded to the tile's rows: 16 on gfx942, the sm_90 kernel's 64 below 64 heads."""
    target = get_target(arch)
    padded = max(padded, 64) if arch == "sm_90" else padded
    b = builder(
        heads,
        576,
        512,
        max_batch=8,  # 8 single-token sequences: packed verification rows have their own test
        max_query_len=1,  # (tests/kernels/test_mla_packed.py)
        max_seq_len=32768,
        dtype=torch.bfloat16,
        device="meta",
        target=target,
    )
    groups = padded // b.tiles.block_h
    splits = b.tiles.num_kv_splits
    assert splits > 1
    assert (
        splits == mla_decode_tiles(target, MlaProblem(heads, 576, 512, 2, 8, 32768)).num_kv_splits
    )
    assert splits * groups * 8 <= 8 * target.num_sms  # whole waves (policy docstring)
    assert b.tiles.padded_heads == padded
    md = b.build(torch.zeros(4, dtype=torch.int32, device="meta"))
    assert md.tiles is b.tiles
    assert md.partial_out.shape == (8, splits, padded, 512)
    assert md.partial_lse.shape == (8, splits, padded)
    assert md.partial_out.dtype == md.partial_lse.dtype == torch.float32


def test_no_workspace_without_splits():
    b = builder(128, max_batch=64, max_seq_len=300)  # 64 tokens x 8 head groups: no split
    assert b.tiles.num_kv_splits == 1
    md = b.build(torch.ones(64, dtype=torch.int32))
    assert md.partial_out.numel() == 0 and md.partial_lse.numel() == 0


def test_launch_consumes_the_metadata_tiles():
    b = builder(3)
    q, cache, bt, sl, _ = make_inputs(192, 128, 3, 16, None, (5, 30), torch.float32, "cpu")
    md = b.build(sl)
    (main, reduce) = plan_mla_decode(q, cache, bt, sl, kv_lora_rank=128, scale=0.1, metadata=md)
    t = b.tiles
    assert main.args["BLOCK_H"] == t.block_h and main.args["NUM_SPLITS"] == t.num_kv_splits > 1
    assert main.args["BLOCK_N"] == t.block_n and main.options == t.options
    assert main.grid == (2 * t.head_groups * t.num_kv_splits,)
    assert (
        main.args["part_out_ptr"] is md.partial_out
        and reduce.args["part_lse_ptr"] is md.partial_lse
    )
    assert main.args["VARLEN"] is False  # single-token metadata: token i is sequence i


def test_workspace_that_disagrees_with_tiles_is_refused():
    b = builder(3)
    q, cache, bt, sl, _ = make_inputs(192, 128, 3, 16, None, (5, 30), torch.float32, "cpu")
    md = b.build(sl)
    unpadded = dataclasses.replace(md, partial_out=md.partial_out[:, :, :3])  # num_heads rows
    with pytest.raises(
        ValueError,
        match=r"metadata.partial_out must be fp32 \(2, 8, 16, 128\) "
        r"\(from its tiles\); got torch.float32 \(2, 8, 3, 128\)",
    ):
        plan_mla_decode(q, cache, bt, sl, kv_lora_rank=128, scale=0.1, metadata=unpadded)
    bad_lse = dataclasses.replace(md, partial_lse=md.partial_lse.double())
    with pytest.raises(ValueError, match=r"metadata.partial_lse must be fp32 \(2, 8, 16\)"):
        plan_mla_decode(q, cache, bt, sl, kv_lora_rank=128, scale=0.1, metadata=bad_lse)


def test_single_token_metadata_only_when_max_query_len_is_1():
    b = builder(max_batch=3, max_query_len=4)
    sl = torch.tensor([5, 9, 3], dtype=torch.int32)
    assert b.build(sl).decode
    ones = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    assert b.build(sl, ones).decode  # max_query_len read from the offsets: 1
    mixed = torch.tensor([0, 1, 4, 5], dtype=torch.int32)
    md = b.build(sl, mixed)
    assert not md.decode and md.max_query_len == 3
    assert not b.build(sl, ones, max_query_len=2).decode  # the caller's bound is trusted


def test_builder_keeps_no_per_step_state():
    b = builder(max_batch=3, max_query_len=4)
    before = {k: getattr(b, k) for k in MlaMetadataBuilder.__slots__}
    m1 = b.build(torch.tensor([5, 9, 3], dtype=torch.int32))
    m2 = b.build(torch.tensor([5, 9], dtype=torch.int32), torch.tensor([0, 4, 6]))
    after = {k: getattr(b, k) for k in MlaMetadataBuilder.__slots__}
    assert all(before[k] is after[k] for k in before)
    assert (m1.num_seqs, m1.max_query_len) == (3, 1) and (m2.num_seqs, m2.max_query_len) == (2, 4)
    with pytest.raises(AttributeError):
        b.last_metadata = m1  # type: ignore[attr-defined]


def test_two_builders_used_alternately(device):
    """A target model's verification builder and a draft-like decode builder, interleaved."""
    a = builder(3, 192, 128, max_batch=2, max_query_len=1, max_seq_len=768, device=device)
    b = builder(16, 288, 256, max_batch=2, max_query_len=4, max_seq_len=512, device=device)
    assert a.tiles.num_kv_splits > 1 and b.tiles.num_kv_splits > 1
    assert (
        a.build(torch.ones(1, dtype=torch.int32)).partial_out.data_ptr()
        != b.build(torch.ones(1, dtype=torch.int32)).partial_out.data_ptr()
    )
    ia = make_inputs(192, 128, 3, 16, None, (7, 33), torch.float32, device, seed=1)
    ib = make_inputs(288, 256, 16, 1, (4, 2), (4, 21), torch.float32, device, seed=2)
    md_a = a.build(ia[3])
    md_b = b.build(ib[3], ib[4])
    for inputs, md, r in ((ia, md_a, 128), (ib, md_b, 256), (ia, md_a, 128)):
        q, cache, bt, sl, qsl = inputs
        out, lse = mla_decode(
            q,
            cache,
            bt,
            sl,
            kv_lora_rank=r,
            scale=0.08,
            query_start_loc=qsl,
            return_lse=True,
            metadata=md,
        )
        check(out, lse, q, cache, bt, sl, qsl, r, 0.08, torch.float32)


# -- errors -----------------------------------------------------------------------------------


def test_builder_errors():
    with pytest.raises(
        TypeError, match="MlaMetadataBuilder: target must be a portattn Target; got str"
    ):
        MlaMetadataBuilder(
            "sm_90",
            max_batch=1,
            num_heads=1,
            kv_lora_rank=1,
            head_dim_k=1,
            dtype=torch.float16,
            device="cpu",
            max_seq_len=1,
        )
    with pytest.raises(
        TypeError, match="dtype must be one of float16, bfloat16, float32; got torch.int8"
    ):
        builder(dtype=torch.int8)
    with pytest.raises(
        TypeError,  # a float among them: a type problem, so a TypeError listing both
        match=r"MlaMetadataBuilder: max_batch must be an int >= 1; got "
        r"0; max_seq_len must be an int >= 1; got 1.5",
    ):
        builder(max_batch=0, max_seq_len=1.5)
    with pytest.raises(ValueError, match=r"MlaMetadataBuilder: max_batch must be an int >= 1"):
        builder(max_batch=0)
    with pytest.raises(ValueError, match="kv_lora_rank must be <= head_dim_k; got 256 > 192"):
        builder(r=256)


def test_build_errors():
    b = builder(max_batch=2, max_query_len=2)
    sl = torch.tensor([3, 4], dtype=torch.int32)
    op = "MlaMetadataBuilder.build: "
    with pytest.raises(
        TypeError,
        match=op + "seq_lens must be an int32/int64 tensor; got tensor of dtype torch.float32",
    ):
        b.build(sl.float())
    with pytest.raises(
        TypeError, match=op + "query_start_loc must be None or an int32/int64 tensor; got list"
    ):
        b.build(sl, [0, 1, 2])
    with pytest.raises(ValueError, match=op + r"seq_lens must be 1-D; got shape \(1, 2\)"):
        b.build(sl[None])
    with pytest.raises(ValueError, match=op + "seq_lens must hold 1..max_batch=2 sequences; got 3"):
        b.build(torch.ones(3, dtype=torch.int32))
    with pytest.raises(
        ValueError,
        match=op + r"query_start_loc must have shape \(num_seqs \+ 1,\)"
        r" = \(3,\); got \(2,\)",
    ):
        b.build(sl, torch.tensor([0, 1]))
    with pytest.raises(
        ValueError, match=op + "max_query_len must be 1 without query_start_loc; got 2"
    ):
        b.build(sl, max_query_len=2)
    with pytest.raises(
        ValueError,
        match=op + r"the longest query in query_start_loc \(read, as max_query_len was not "
        r"given\) must be in 1..2 \(the builder's max_query_len\); got 3",
    ):
        b.build(sl, torch.tensor([0, 3, 4]))
    with pytest.raises(ValueError, match=op + r"the longest query .* must be in 1..2 .*got 0"):
        b.build(sl, torch.tensor([0, 0, 0]))
    for args in ((torch._neg_view(-sl),), (sl, torch._neg_view(-torch.tensor([0, 1, 2])))):
        name = "seq_lens" if len(args) == 1 else "query_start_loc"
        with pytest.raises(ValueError, match=op + name + " must not carry torch's lazy negation"):
            b.build(*args)
    for bad in (3, 0, True, 1.0):
        with pytest.raises(
            ValueError,
            match=op + r"max_query_len must be None or an int in 1..2 \(the "
            rf"builder's max_query_len\); got {bad!r}",
        ):
            b.build(sl, torch.tensor([0, 1, 2]), max_query_len=bad)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(device="gpu"), "device must be a torch.device or a device string; got 'gpu'"),
        (dict(device=1.5), "device must be a torch.device or a device string; got 1.5"),
        (dict(device=2**70), "device must be a torch.device or a device string"),
        (dict(device="cuda:64"), r"device must be one this process sees \(\d+ CUDA/HIP devices\); "
         "got cuda:64"),
        (dict(device="mps"), r"device must be a CUDA/HIP GPU, the CPU or meta \(the kernels' "
         r"devices\); got mps"),
        (dict(device="xpu:0"), r"device must be a CUDA/HIP GPU, the CPU or meta"),
        (dict(heads=2**63), r"num_heads must be < 2\*\*31; got 9223372036854775808"),
        (dict(max_batch=2**20, max_query_len=2**11),
         r"max_batch \* max_query_len \(the query rows a step may hold\) must be < 2\*\*31; "
         r"got 1048576 \* 2048"),
    ],
)  # fmt: skip
def test_builder_names_a_bad_device_or_too_many_rows(kwargs, message):
    with pytest.raises(ValueError, match="MlaMetadataBuilder: " + message):
        builder(**kwargs)


def test_single_token_metadata_needs_one_token_a_sequence(device):
    """Single-token metadata runs token i as sequence i and reads no offsets: offsets with an
    empty sequence ([0, 0, 1]: row 0 is sequence 1, row 1 padding) ran row 0 as sequence 0 and
    wrote the padding row. Refused by the builder that reads them, and by the op's check where
    the op reads the offsets (a CPU call; a GPU call given metadata takes the caller's word)."""
    q, cache, bt, sl, _ = make_inputs(192, 128, 3, 16, (1, 1), (5, 9), torch.float32, device)
    b = builder(device=device)
    empty_first = torch.tensor([0, 0, 1], device=device)
    with pytest.raises(ValueError, match=r"^MlaMetadataBuilder.build: query_start_loc gives a "
                       r"sequence 0 tokens and none more than 1"):  # fmt: skip
        b.build(sl, empty_first)
    md = b.build(sl, empty_first, max_query_len=1)  # not read: the caller's word
    rule = r"^mla_decode: query_start_loc must give every sequence one token with single-token"
    if reads_contents(q.device, vouched=True):
        with pytest.raises(ValueError, match=rule + r" metadata .*got query_start_loc\[1\]=0"):
            mla_decode(q, cache, bt, sl, kv_lora_rank=128, scale=0.1,
                       query_start_loc=empty_first, metadata=md)  # fmt: skip
    one_each = torch.tensor([0, 1, 2], device=device)
    out, lse = mla_decode(q, cache, bt, sl, kv_lora_rank=128, scale=0.1, query_start_loc=one_each,
                          metadata=b.build(sl, one_each), return_lse=True)  # fmt: skip
    check(out, lse, q, cache, bt, sl, one_each, 128, 0.1, torch.float32)


@pytest.mark.parametrize(
    ("offsets", "rule"),
    [
        ([0, 3, 1], r"never decrease; got a sequence of -2 tokens"),
        ([0, 1, 0], r"never decrease; got a sequence of -1 tokens"),  # (blamed the builder's size)
        ([2, 3, 5], r"start at 0; got query_start_loc\[0\]=2"),
        ([1, 0, 2], r"start at 0; got query_start_loc\[0\]=1 and never decrease"),
    ],
)
def test_build_refuses_offsets_that_break_the_ops_rules(device, offsets, rule):
    """The offsets build reads: decreasing ones made metadata (max_query_len 3) that a GPU call
    given it never checks; a decode builder blamed its own size instead of the offsets."""
    sl = torch.tensor([8, 8], device=device)
    for b in (builder(device=device, max_query_len=4), builder(device=device)):
        with pytest.raises(ValueError, match=r"^MlaMetadataBuilder.build: query_start_loc must "
                           + rule):  # fmt: skip
            b.build(sl, torch.tensor(offsets, device=device))


def test_build_names_int32_offsets_that_fall_past_int32(device):
    """int32 offsets were subtracted in int32: a fall of 2**31 - 4 wrapped to a longest query
    of 2147483644, so the error blamed the builder's size instead of the decreasing offsets."""
    sl = torch.tensor([8, 8], device=device)
    offsets = torch.tensor([0, 5, -(2**31) + 1], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"query_start_loc must never decrease; got a sequence "
                       r"of -2147483652 tokens"):  # fmt: skip
        builder(device=device, max_query_len=4).build(sl, offsets)


def test_build_from_meta_offsets_needs_max_query_len():
    b = builder(max_query_len=4)
    meta = torch.tensor([0, 2, 3], device="meta")
    with pytest.raises(ValueError, match=r"^MlaMetadataBuilder.build: max_query_len must be given "
                       r"for meta tensors"):  # fmt: skip
        b.build(torch.tensor([10, 20]), meta)
    assert b.build(torch.tensor([10, 20]), meta, max_query_len=2).max_query_len == 2


def _md_args(md=None, **kw):
    q, cache, bt, sl, qsl = make_inputs(192, 128, 3, 16, (2, 1), (5, 9), torch.float32, "cpu")
    a = dict(
        query=q,
        kv_cache=cache,
        block_table=bt,
        seq_lens=sl,
        kv_lora_rank=128,
        scale=0.1,
        query_start_loc=qsl,
        metadata=md,
    )
    a.update(kw)
    return a


def test_launch_metadata_errors():
    verify = builder(max_batch=2, max_query_len=2).build(
        torch.tensor([5, 9], dtype=torch.int32), torch.tensor([0, 2, 3])
    )
    decode = builder(max_batch=2).build(torch.tensor([5, 9], dtype=torch.int32))
    cases = [
        (
            _md_args(builder(4).build(torch.ones(2, dtype=torch.int32))),
            r"metadata must be built for \(num_heads, head_dim_k, kv_lora_rank, dtype\) = "
            r"\(3, 192, 128, torch.float32\); got \(4, 192, 128, torch.float32\)",
        ),
        (
            _md_args(
                builder(max_batch=3, max_query_len=2).build(
                    torch.ones(3, dtype=torch.int32), torch.tensor([0, 1, 2, 3])
                )
            ),
            "metadata must be built for this step's 2 sequences; got 3",
        ),
        (
            _md_args(builder(max_batch=2).build(torch.ones(2, dtype=torch.int32))),
            "query must have <= metadata.max_tokens=2 tokens; got 3",
        ),
        (
            _md_args(decode, query_start_loc=None),
            "query must have one token per sequence with single-token",
        ),
        (
            _md_args(verify, query_start_loc=None),
            "query_start_loc must be given with metadata of max_query_len=2; got None",
        ),
        (
            _md_args(
                builder(max_batch=2, max_query_len=2, device="meta").build(
                    torch.ones(2, dtype=torch.int32),
                    max_query_len=None,
                    query_start_loc=torch.tensor([0, 2, 3]),
                )
            ),
            "metadata workspaces must be on query's device cpu; got meta",
        ),
        (
            _md_args(verify, tiles=verify.tiles),
            r"tiles must not be given with metadata \(the launch uses metadata.tiles\)",
        ),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match="^mla_decode: .*" + match):
            plan_mla_decode(**args)
    with pytest.raises(ValueError, match="target must be the metadata's target sm_90; got gfx942"):
        plan_mla_decode(**_md_args(verify, target=get_target("gfx942")))


def test_metadata_is_frozen():
    md = builder().build(torch.ones(1, dtype=torch.int32))
    assert isinstance(md, MlaMetadata)
    with pytest.raises(dataclasses.FrozenInstanceError):
        md.max_query_len = 2  # type: ignore[misc]


# -- GPU: CUDA-graph capture ------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_cuda_graph_capture_and_replay(heads):
    from portattn.platform import current_target

    dk, r, bs, batch = 576, 512, 64, 8
    b = builder(
        heads,
        dk,
        r,
        max_batch=batch,
        max_query_len=1,
        max_seq_len=8192,
        dtype=torch.bfloat16,
        device="cuda",
        target=current_target(),
    )
    q, cache, bt, sl, _ = make_inputs(
        dk, r, heads, bs, None, [8192] * batch, torch.bfloat16, "cuda"
    )
    sl.fill_(100)
    md = b.build(sl)
    out = torch.empty(batch, heads, r, dtype=torch.bfloat16, device="cuda")
    kw = dict(kv_lora_rank=r, scale=dk**-0.5, out=out, metadata=md)
    mla_decode(q, cache, bt, sl, **kw)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode(q, cache, bt, sl, **kw)
    for step_lens in ([1, 77, 8192, 4000, 5, 64, 65, 2048], [300] * batch):
        sl.copy_(torch.tensor(step_lens, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        graph.replay()
        eager = mla_decode(q, cache, bt, sl, kv_lora_rank=r, scale=dk**-0.5, metadata=md)
        torch.testing.assert_close(out, eager, rtol=0, atol=0)


def test_a_builder_no_tile_can_serve_names_itself():
    """The policy's reason, under the name of what the caller called."""
    with pytest.raises(ValueError, match=r"^MlaMetadataBuilder: mla_decode_tiles: no tile fits"):
        builder(dk=2**20, target=get_target("gfx942"))
