"""layout.py: cache validation, logical views, the contiguity predicate, hybrid page geometry."""

from __future__ import annotations

import re

import pytest
import torch

from portattn.layout import (
    LAYOUTS,
    describe_kv_cache,
    empty_kv_cache,
    from_logical,
    is_block_contiguous,
    make_hybrid_cache,
    shuffle_x,
    to_logical,
    token_view,
    vector_width,
)

pytestmark = pytest.mark.paged

OP = "some_op"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _nhd(nb=2, bs=4, h=2, d=8, dtype=torch.float16):
    return torch.zeros(nb, bs, h, d, dtype=dtype)


# -- describe_kv_cache errors ------------------------------------------------------------------

_K = _nhd()
_S8 = torch.zeros(2, 2, 1, 8, 8, dtype=torch.float16)  # SHUFFLE fp16: x = 8
DESCRIBE_ERRORS = [
    ((_K, _K, "HND"), ValueError, f"{OP}: layout must be one of \\('NHD', 'SHUFFLE'\\); got 'HND'"),
    # a layout that is no str was a ValueError: a wrong type is a TypeError, as everywhere else
    ((_K, _K, None), TypeError, f"{OP}: layout must be a str, one of .*; got None"),
    (("k", _K, "NHD"), TypeError, f"{OP}: key_cache must be a torch.Tensor; got str"),
    (
        (_K, _K.int(), "NHD"),
        TypeError,
        f"{OP}: value_cache dtype must be one of float16, bfloat16, float32; got torch.int32",
    ),
    (
        (_K, _K.float(), "NHD"),
        TypeError,
        f"{OP}: key_cache and value_cache must share a dtype; got torch.float16 and torch.float32",
    ),
    (
        (_K, _K.to("meta"), "NHD"),
        ValueError,
        f"{OP}: key_cache and value_cache must be on one device; got cpu and meta",
    ),
    (
        (_K[0], _K[0], "NHD"),
        ValueError,
        f"{OP}: key_cache must be 4-D for layout NHD; got shape \\(4, 2, 8\\); value_cache must be",
    ),
    ((_K, _K, "SHUFFLE"), ValueError, "key_cache must be 5-D for layout SHUFFLE"),
    (
        (_S8[..., :4], _S8, "SHUFFLE"),
        ValueError,
        "key_cache last dim must be x=16/element_size=8 for SHUFFLE; got shape \\(2, 2, 1, 8, 4\\)",
    ),
    (
        (_S8, _S8[..., :4], "SHUFFLE"),
        ValueError,
        "value_cache last dim must be x=16/element_size=8",
    ),
    (
        (_K, _nhd(bs=5), "NHD"),
        ValueError,
        "key_cache and value_cache must agree on block_size; got 4 and 5",
    ),
    (
        (_K, _nhd(nb=3, h=1), "NHD"),
        ValueError,
        "must agree on num_blocks; got 2 and 3 .*; key_cache and value_cache must agree on "
        "num_kv_heads; got 2 and 1",
    ),
    # the tensor's shape, not the addressing object, is what the message shows
    (
        (_nhd(bs=0), _nhd(bs=0), "NHD"),
        ValueError,
        r"key_cache must have non-empty dims; got shape \(2, 0, 2, 8\); value_cache must",
    ),
]


@pytest.mark.parametrize("args, exc, msg", DESCRIBE_ERRORS)
def test_a_cache_that_is_not_a_valid_layout_is_refused_naming_the_rule(args, exc, msg):
    with pytest.raises(exc, match=msg):
        describe_kv_cache(OP, *args)


def test_a_shuffle_cache_is_described_with_its_split_axes_and_unit_strides():
    k, v = empty_kv_cache(3, 16, 2, 32, layout="SHUFFLE", dtype=torch.float32)
    ka, va = describe_kv_cache(OP, k, v, "SHUFFLE")
    assert (ka.num_blocks, ka.block_size, ka.num_kv_heads, ka.head_dim) == (3, 16, 2, 32)
    assert (ka.tok_split, ka.dim_split, va.tok_split, va.dim_split) == (1, 4, 4, 1)
    assert ka.kernel_args("kc")["stride_kc_dim_lo"] == 1
    assert va.kernel_args("vc")["stride_vc_tok_lo"] == 1


# -- logical views -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ("NHD", "SHUFFLE"))
def test_token_view_and_to_logical_agree(layout, dtype):
    """Writing token (b, t) through token_view puts it at logical [b, t] for K and V."""
    nb, bs, h, d = 2, 16, 3, 16
    logical = torch.randn(2, nb, bs, h, d).to(dtype)
    caches = empty_kv_cache(nb, bs, h, d, layout=layout, dtype=dtype)
    for kind, cache, src in zip(("key", "value"), caches, logical, strict=True):
        for b in range(nb):
            for t in range(bs):
                view = token_view(cache, layout, kind, b, t)
                view.copy_(src[b, t].reshape(view.shape))
        assert torch.equal(to_logical(cache, layout, kind), src)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ("NHD", "SHUFFLE"))
def test_from_logical_inverts_to_logical(layout, dtype):
    logical = torch.randn(3, 16, 2, 32).to(dtype)
    for kind in ("key", "value"):
        cache = from_logical(logical, layout, kind)
        assert cache.is_contiguous()
        assert torch.equal(to_logical(cache, layout, kind), logical)
    k, v = (from_logical(logical, layout, kind) for kind in ("key", "value"))
    ka, va = describe_kv_cache(OP, k, v, layout)  # a valid pair of the layout
    assert (ka.num_blocks, ka.block_size, ka.num_kv_heads, ka.head_dim) == (3, 16, 2, 32)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda k, v: to_logical(k, "SHUFFLE", "kye"), ValueError,
         "to_logical: kind must be 'key' or 'value'; got 'kye'"),  # was read as V, silently
        (lambda k, v: to_logical(k, "shuffle", "key"), ValueError,
         "to_logical: layout must be one of ('NHD', 'SHUFFLE'); got 'shuffle'"),
        (lambda k, v: to_logical(k, 5, "key"), TypeError,
         "to_logical: layout must be a str, one of ('NHD', 'SHUFFLE'); got 5"),
        (lambda k, v: to_logical(k[0], "SHUFFLE", "key"), TypeError,
         "to_logical: cache must be a 5-D tensor (a SHUFFLE cache); got (2, 2, 16, 8)"),
        (lambda k, v: from_logical(to_logical(k, "SHUFFLE", "key"), "SHUFFLE", "keys"),
         ValueError, "from_logical: kind must be 'key' or 'value'; got 'keys'"),
        (lambda k, v: from_logical(torch.zeros(2, 16, 16), "NHD", "key"), TypeError,
         "from_logical: logical must be a 4-D tensor ([num_blocks, block_size, num_kv_heads, "
         "head_dim]); got (2, 16, 16)"),  # was returned as an NHD cache
        (lambda k, v: from_logical(torch.zeros(2, 16, 1, 12, dtype=torch.float16), "SHUFFLE",
                                   "key"), ValueError,
         "from_logical: head_dim must be a multiple of x=8 for a SHUFFLE key cache; got 12"),
        (lambda k, v: from_logical(torch.zeros(2, 12, 1, 16, dtype=torch.float16), "SHUFFLE",
                                   "value"), ValueError,
         "from_logical: block_size must be a multiple of x=8 for a SHUFFLE value cache; got 12"),
    ],
)  # fmt: skip
def test_the_logical_views_refuse_a_bad_kind_layout_or_shape_by_name(call, error, message):
    k, v = empty_kv_cache(2, 16, 2, 16, layout="SHUFFLE", dtype=torch.float16)
    with pytest.raises(error, match=re.escape(message)):
        call(k, v)


def test_to_logical_is_a_copy():
    k = _nhd()
    to_logical(k, "NHD", "key").fill_(1)
    assert (k == 0).all()


# -- the block-contiguity predicate ------------------------------------------------------------


def _hybrid_pair(num_blocks):
    hc = make_hybrid_cache(num_blocks, 16, 2, 8, mamba_state_bytes=10)
    return hc.key_cache, hc.value_cache


@pytest.mark.parametrize(
    "name, make, expect_k, expect_v",
    [
        ("contiguous NHD", lambda: empty_kv_cache(4, 16, 2, 8), True, True),
        ("head-sliced NHD", lambda: [_nhd(4, 16, 3, 8)[:, :, 1:]] * 2, True, True),
        ("every other block", lambda: [_nhd(8, 16, 2, 8)[::2]] * 2, False, False),
        (
            "hybrid NHD",
            lambda: _hybrid_pair(4),
            False,
            False,
        ),
        ("SHUFFLE", lambda: empty_kv_cache(4, 16, 2, 8, layout="SHUFFLE"), False, False),
        (
            "single-block hybrid",
            lambda: _hybrid_pair(1),
            True,
            True,
        ),
        # One block: K's flat slot t * x is right; V's token axis is still split.
        (
            "single-block SHUFFLE",
            lambda: empty_kv_cache(1, 16, 2, 8, layout="SHUFFLE"),
            True,
            False,
        ),
    ],
)
def test_flat_slots_are_used_only_where_tokens_are_evenly_strided(name, make, expect_k, expect_v):
    """Flat slots are only safe when tokens are evenly strided across blocks. Multi-block SHUFFLE
    never is (here, with 2 heads):
    K's token stride is x and a block spans heads in between; V splits the token axis."""
    k, v = make()
    layout = "SHUFFLE" if k.dim() == 5 else "NHD"
    ka, va = describe_kv_cache(OP, k, v, layout)
    assert (is_block_contiguous(ka), is_block_contiguous(va)) == (expect_k, expect_v), name
    assert ka.block_contiguous == expect_k


# -- hybrid caches -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", (torch.float16, torch.float32))
@pytest.mark.parametrize("layout", ("NHD", "SHUFFLE"))
@pytest.mark.parametrize("state_bytes", (0, 37, 64))
def test_hybrid_regions_are_disjoint_and_cover_the_buffer(layout, dtype, state_bytes):
    nb, bs, h, d = 3, 16, 2, 8
    hc = make_hybrid_cache(nb, bs, h, d, mamba_state_bytes=state_bytes, layout=layout, dtype=dtype)
    esize = hc.buffer.element_size()
    blk = bs * h * d
    state_elems = -(-state_bytes // esize)
    assert hc.page_elems == 2 * blk + state_elems
    assert hc.buffer.numel() == nb * hc.page_elems
    assert hc.mamba_state.shape == (nb, state_bytes) and hc.mamba_state.dtype == torch.uint8

    nbytes = hc.buffer.numel() * esize
    byte_ids = []
    for view in (hc.key_cache, hc.value_cache):  # element views -> the bytes they cover
        elems = torch.arange(hc.buffer.numel()).as_strided(
            view.shape, view.stride(), view.storage_offset()
        )
        byte_ids.append((elems.flatten()[:, None] * esize + torch.arange(esize)).flatten())
    s = hc.mamba_state
    byte_ids.append(torch.arange(nbytes).as_strided(s.shape, s.stride(), s.storage_offset()))
    counts = torch.bincount(torch.cat([b.flatten() for b in byte_ids]), minlength=nbytes)
    assert counts.max() <= 1  # K, V and state never overlap
    # Every byte is K, V or state, except the state's rounding to whole elements in each page.
    uncovered = (counts == 0).nonzero().flatten()
    assert uncovered.numel() == nb * (state_elems * esize - state_bytes)
    page_bytes = hc.page_elems * esize
    assert ((uncovered % page_bytes) >= 2 * blk * esize + state_bytes).all()
    # Page b holds K block b then V block b then state b.
    assert hc.key_cache[1].storage_offset() == hc.page_elems
    assert hc.value_cache[1].storage_offset() == hc.page_elems + blk


HYBRID_ERRORS = [
    (dict(mamba_state_bytes=-1), "make_hybrid_cache: mamba_state_bytes must be >= 0; got -1"),
    (dict(mamba_state_bytes=8, layout="HND"), "make_hybrid_cache: layout must be one of"),
    (
        dict(mamba_state_bytes=8, layout="SHUFFLE", head_dim=12),
        "make_hybrid_cache: SHUFFLE needs head_dim and block_size divisible by x=8; got "
        "head_dim=12, block_size=16",
    ),
]


@pytest.mark.parametrize("kwargs, msg", HYBRID_ERRORS)
def test_a_bad_hybrid_cache_request_is_refused_naming_the_argument(kwargs, msg):
    head_dim = kwargs.pop("head_dim", 8)
    with pytest.raises(ValueError, match=msg):
        make_hybrid_cache(2, 16, 2, head_dim, **kwargs)


CACHE_ERRORS = [
    # a layout that is not NHD was built as SHUFFLE
    (dict(layout="nhd"), ValueError, r"empty_kv_cache: layout must be one of \('NHD', 'SHUFFLE'\)"),
    (dict(layout=["NHD"]), TypeError, r"empty_kv_cache: layout must be a str, one of .*\['NHD'\]"),
    (dict(block_size=0), ValueError, "empty_kv_cache: block_size must be >= 1; got 0"),
    (dict(num_blocks=-1), ValueError, "num_blocks must be >= 0; got -1"),
    (dict(head_dim=64.0), TypeError, "head_dim must be an int >= 1; got float"),
    (dict(num_kv_heads=True), TypeError, "num_kv_heads must be an int >= 1; got bool"),
    (dict(dtype=torch.int8), TypeError, "dtype must be one of .*; got torch.int8"),
    # torch's own "Storage size calculation overflowed" named no argument
    (dict(num_blocks=2**31, head_dim=2**31), ValueError, "bytes must be < 2\\*\\*63"),
    # elements within int64 whose bytes are not (torch's overflow, a RuntimeError, before)
    (
        dict(num_blocks=2**29, block_size=2**30, num_kv_heads=1, head_dim=2, dtype=torch.float32),
        ValueError,
        "the cache's 92233720\\d+ bytes must be < 2\\*\\*63",
    ),
    # no blocks: a block's strides still leave int64 (torch's overflow errors, before)
    (dict(num_blocks=0, block_size=2**64), ValueError, r"one block's \(its strides span one\) "),
    (dict(num_blocks=0, block_size=2**62, num_kv_heads=2**62), ValueError, "one block's"),
    (dict(device="16"), ValueError, "device must be a torch.device or a device string; got '16'"),
    (dict(device=2**64), ValueError, "device must be a torch.device or a device string; got 1844"),
    (
        dict(device="cuda:64"),
        ValueError,
        r"device must be one this process sees \(\d+ CUDA/HIP devices\); got cuda:64",
    ),
    # every problem at once
    (dict(block_size=0, layout="HND"), ValueError, "block_size must be >= 1; got 0; layout must"),
]


@pytest.mark.parametrize("kwargs, exc, msg", CACHE_ERRORS)
def test_a_bad_cache_request_is_refused_naming_the_argument(kwargs, exc, msg):
    args = dict(num_blocks=2, block_size=16, num_kv_heads=2, head_dim=8) | kwargs
    with pytest.raises(exc, match=msg):
        empty_kv_cache(**args)
    hybrid = {k: v for k, v in args.items()} | dict(mamba_state_bytes=8)
    with pytest.raises(exc, match=msg.replace("empty_kv_cache", "make_hybrid_cache")):
        make_hybrid_cache(**hybrid)


def test_a_hybrid_state_past_int64_once_rounded_to_elements_is_refused():
    """The state passed the byte check, then was rounded up to whole elements past it (torch's
    "Storage size calculation overflowed"); with no blocks, a huge state likewise."""
    with pytest.raises(ValueError, match=r"make_hybrid_cache: the cache's 9223372036854775808 "):
        make_hybrid_cache(1, 1, 1, 1, mamba_state_bytes=2**63 - 9, dtype=torch.float32,
                          device="meta")  # fmt: skip
    with pytest.raises(ValueError, match=r"one block's \(its strides span one\)"):
        make_hybrid_cache(0, 16, 2, 64, mamba_state_bytes=2**70, device="meta")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["key", "value"])
def test_an_empty_cache_has_a_logical_view(layout, kind):
    """A cache of no blocks, as `empty_kv_cache` and `make_hybrid_cache` build it: SHUFFLE's
    reshape by -1 could not size it."""
    k, v = empty_kv_cache(0, 16, 2, 64, layout=layout)
    hc = make_hybrid_cache(0, 16, 2, 64, mamba_state_bytes=8, layout=layout)
    for cache in (k if kind == "key" else v, hc.key_cache if kind == "key" else hc.value_cache):
        assert to_logical(cache, layout, kind).shape == (0, 16, 2, 64)


@pytest.mark.parametrize("kind", ["key", "value"])
def test_a_shuffle_cache_of_another_x_is_refused(kind):
    """An fp32 cache laid out with fp16's x=8 read back silently in another order (and its
    round trip changed shape); `describe_kv_cache` already refused it."""
    logical = torch.randn(2, 8, 1, 16)
    cache = from_logical(logical.half(), "SHUFFLE", kind).float()
    rule = "cache last dim must be x=16/element_size=4 for SHUFFLE; got shape "
    with pytest.raises(ValueError, match=re.escape(f"to_logical: {rule}")):
        to_logical(cache, "SHUFFLE", kind)
    with pytest.raises(ValueError, match=re.escape(f"token_view: {rule}")):
        token_view(cache, "SHUFFLE", kind, 0, 0)


def test_a_hybrid_cache_state_size_must_be_an_int():
    with pytest.raises(TypeError, match="make_hybrid_cache: mamba_state_bytes must be an int >= 0"):
        make_hybrid_cache(2, 16, 2, 8, mamba_state_bytes=8.0)


def test_a_shuffle_cache_whose_sizes_are_not_multiples_of_x_is_refused():
    with pytest.raises(
        ValueError,
        match="empty_kv_cache: SHUFFLE needs head_dim and block_size "
        "divisible by x=4; got head_dim=8, block_size=6",
    ):
        empty_kv_cache(2, 6, 1, 8, layout="SHUFFLE", dtype=torch.float32)


@pytest.mark.parametrize("dtype, x", [(torch.float32, 4), (torch.float16, 8), (torch.bfloat16, 8)])
def test_shuffle_x_is_16_bytes_of_elements(dtype, x):
    assert shuffle_x(dtype) == x
    with pytest.raises(TypeError, match="^shuffle_x: dtype must be a torch.dtype"):
        shuffle_x(str(dtype).removeprefix("torch."))


@pytest.mark.parametrize(
    "args, msg",
    [
        (("BOGUS", "key", 0, 0), r"layout must be one of \('NHD', 'SHUFFLE'\); got 'BOGUS'$"),
        (("SHUFFLE", "kee", 0, 3), "kind must be 'key' or 'value'; got 'kee'"),  # was V, silently
        (("NHD", "key", -1, 0), r"block must be an int in \[0, 2\); got -1"),  # was the last block
        (("SHUFFLE", "value", 0, 16), r"offset must be an int in \[0, 16\); got 16"),
        (("NHD", "value", 0, 2.0), r"offset must be an int in \[0, 16\); got 2.0"),
        (("NHD", "value", True, 0), r"block must be an int in \[0, 2\); got True"),
    ],
)
def test_token_view_names_a_bad_argument(args, msg):
    """A value out of range is a ValueError; an index that is no int a TypeError."""
    layout = args[0] if args[0] in ("NHD", "SHUFFLE") else "NHD"
    k, _ = empty_kv_cache(2, 16, 1, 16, layout=layout, dtype=torch.float32)
    kind = TypeError if any(type(a) in (float, bool) for a in args[2:]) else ValueError
    with pytest.raises(kind, match="^token_view: " + msg):
        token_view(k, *args)


# -- vector width (what a kernel may load as one vector) ---------------------------------------


def _pair(k, v, layout="SHUFFLE"):
    return tuple(vector_width(a) for a in describe_kv_cache(OP, k, v, layout))


def test_vector_width_is_claimed_only_for_aligned_contiguous_runs():
    # NHD: nothing claimed (Triton sees the unit head-dim stride itself)
    assert _pair(*empty_kv_cache(2, 16, 2, 32, dtype=torch.float16), "NHD") == (1, 1)
    # contiguous SHUFFLE: x-element runs (16 bytes)
    assert _pair(*empty_kv_cache(2, 16, 2, 32, layout="SHUFFLE", dtype=torch.float16)) == (8, 8)
    assert _pair(*empty_kv_cache(2, 16, 2, 32, layout="SHUFFLE", dtype=torch.float32)) == (4, 4)
    # hybrid pages: the page stride decides (48 B of state = 24 fp16 elements: runs of 8 stay
    # 8-aligned; 6 B = 3 elements: pages start anywhere, no vector claimed)
    for state, want in ((48, (8, 8)), (6, (1, 1)), (4, (2, 2))):
        hc = make_hybrid_cache(
            2, 16, 2, 32, mamba_state_bytes=state, layout="SHUFFLE", dtype=torch.float16
        )
        assert _pair(hc.key_cache, hc.value_cache) == want, state
    # a run whose elements are not adjacent (x axis strided): none
    k, v = empty_kv_cache(2, 16, 2, 32, layout="SHUFFLE", dtype=torch.float16)
    wide_k = torch.zeros(2, 2, 4, 16, 16, dtype=torch.float16)[..., ::2]
    wide_v = torch.zeros(2, 2, 2, 32, 16, dtype=torch.float16)[..., ::2]
    assert _pair(wide_k, wide_v) == (1, 1)
    assert _pair(wide_k, v) == (1, 8)


@pytest.mark.parametrize("build", ["empty_kv_cache", "make_hybrid_cache"])
def test_an_allocation_the_device_cannot_hold_names_the_builder_and_the_bytes(build):
    """2**49 bytes, past any 47-bit address space: torch's allocator refuses; the error keeps
    torch's type and words, with what was asked for in front."""
    import portattn.layout as layout

    kw = dict(mamba_state_bytes=64) if build == "make_hybrid_cache" else {}
    with pytest.raises(
        RuntimeError, match=rf"^{build}: cannot allocate \d+ bytes on cpu for sizes "
    ):
        getattr(layout, build)(2**31, 16, 8, 1024, **kw)
