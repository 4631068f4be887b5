"""write_kv_cache / gather_kv_cache against the references, on every cache shape we promise.

Caches are built as strided views of one flat buffer, so a test can poison the whole buffer
(NaN, and a byte pattern in a hybrid cache's Mamba state), run the kernel on it and the reference
on a clone, and compare the two buffers bit for bit: that checks the written slots, that negative
slots are skipped and that no other byte (padding, state, the other tensor) was touched.
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from portattn import reference
from portattn.kernels.kv_cache import (
    _unbounded_outputs,
    gather_kv_cache,
    plan_gather_kv_cache,
    plan_write_kv_cache,
    write_kv_cache,
)
from portattn.layout import make_hybrid_cache, shuffle_x

pytestmark = pytest.mark.paged

BLOCK_SIZES = (1, 16, 80, 544, 2048)
DTYPES = (torch.float32, torch.float16)
LAYOUTS = ("NHD", "SHUFFLE")
CACHE_KINDS = ("contiguous", "wide_view", "hybrid")
NUM_KV_HEADS = 2
HEAD_DIM = 16
MAMBA_STATE_BYTES = 37  # not a multiple of any element size: the page has padding bytes
NUM_TOKENS = 40


def _num_blocks(block_size: int) -> int:
    return 3 if block_size >= 544 else 6


def _valid(layout: str, dtype: torch.dtype, block_size: int) -> bool:
    return layout == "NHD" or block_size % shuffle_x(dtype) == 0


CASES = [
    pytest.param(layout, dtype, bs, kind, id=f"{layout}-{str(dtype)[6:]}-bs{bs}-{kind}")
    for layout, dtype, bs, kind in itertools.product(LAYOUTS, DTYPES, BLOCK_SIZES, CACHE_KINDS)
    if _valid(layout, dtype, bs)
]


class Cache:
    """A (key_cache, value_cache) pair that are views of ``buffer`` (storage offset 0)."""

    def __init__(self, buffer, k, v, state=None):
        self.buffer, self.k, self.v, self.state = buffer, k, v, state

    def clone(self) -> Cache:
        buf = self.buffer.clone()
        rebind = lambda t: buf.as_strided(t.shape, t.stride(), t.storage_offset())  # noqa: E731
        return Cache(buf, rebind(self.k), rebind(self.v))

    def bits(self) -> torch.Tensor:
        return self.buffer.view(torch.uint8)


def _shapes(layout, nb, bs, h, d, x):
    if layout == "NHD":
        return (nb, bs, h, d), (nb, bs, h, d)
    return (nb, h, d // x, bs, x), (nb, h, bs // x, d, x)


def make_cache(kind, layout, dtype, nb, bs, h=NUM_KV_HEADS, d=HEAD_DIM, device="cpu") -> Cache:
    """A poisoned cache (NaN everywhere; a byte pattern in hybrid state) of the given kind."""
    x = shuffle_x(dtype)
    if kind == "hybrid":
        hc = make_hybrid_cache(
            nb,
            bs,
            h,
            d,
            mamba_state_bytes=MAMBA_STATE_BYTES,
            layout=layout,
            dtype=dtype,
            device=device,
        )
        cache = Cache(hc.buffer, hc.key_cache, hc.value_cache, hc.mamba_state)
        cache.buffer.fill_(float("nan"))
        pattern = torch.arange(hc.mamba_state.numel(), device=device) % 251
        cache.state.copy_(pattern.to(torch.uint8).view(hc.mamba_state.shape))
        return cache
    kshape, vshape = _shapes(layout, nb, bs, h, d, x)
    if kind == "contiguous":
        n = torch.Size(kshape).numel()
        buf = torch.full((2 * n,), float("nan"), dtype=dtype, device=device)
        return Cache(buf, buf[:n].view(kshape), buf[n:].view(vshape))
    # wide_view: every other block of a buffer with an extra head and padded inner dims, so
    # neither cache is block-contiguous and every stride differs from the contiguous one.
    kw, vw = _padded(kshape), _padded(vshape)
    nk = torch.Size(kw).numel()
    buf = torch.full((nk + torch.Size(vw).numel(),), float("nan"), dtype=dtype, device=device)
    return Cache(buf, _crop(buf[:nk].view(kw), kshape), _crop(buf[nk:].view(vw), vshape))


def _padded(shape):
    return (2 * shape[0], shape[1] + 1, *[n + 2 for n in shape[2:]])


def _crop(t, shape):
    return t[(slice(None, None, 2), slice(1, None), *[slice(1, n + 1) for n in shape[2:]])]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (NaN payloads compared exactly)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def make_tokens(n, dtype, device="cpu", h=NUM_KV_HEADS, d=HEAD_DIM, seed=0):
    """key as a transposed view, value as a slice of a wider tensor: both non-contiguous."""
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(n, d, h, generator=g).to(dtype).to(device).transpose(1, 2)
    value = torch.randn(n, h + 1, d + 3, generator=g).to(dtype).to(device)[:, 1:, 2 : d + 2]
    return key, value


def make_slots(n, num_slots, seed=0, dtype=torch.int64):
    """Distinct random slots including the first and last slot, with a few negative ones."""
    g = torch.Generator().manual_seed(seed)
    # drawn from 1..num_slots-2 so that pinning the first and last slot creates no duplicate
    # (two tokens to one slot is a race on a GPU, and would make the comparison meaningless)
    slots = 1 + torch.randperm(num_slots - 2, generator=g)[:n]
    slots[0], slots[-1] = 0, num_slots - 1
    if n > 4:
        slots[1], slots[n // 2] = -1, -5
    return slots.to(dtype)


# -- write -------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout, dtype, block_size, kind", CASES)
def test_write_matches_reference_bitwise(layout, dtype, block_size, kind, device):
    nb = _num_blocks(block_size)
    cache = make_cache(kind, layout, dtype, nb, block_size, device=device)
    expect = cache.clone()
    n = min(NUM_TOKENS, nb * block_size)
    key, value = make_tokens(n, dtype, device)
    slots = make_slots(n, nb * block_size).to(device)
    state_before = None if cache.state is None else cache.state.clone()

    write_kv_cache(key, value, cache.k, cache.v, slots, layout=layout)
    reference.write_kv_cache(key, value, expect.k, expect.v, slots, layout=layout)

    assert torch.equal(cache.bits(), expect.bits())
    if state_before is not None:
        assert torch.equal(cache.state, state_before)  # Mamba state bytes untouched


@pytest.mark.parametrize("slot_dtype", (torch.int32, torch.int64))
def test_write_int32_slots_and_padded_token_rows(slot_dtype, device):
    """int32 slot_mapping works; key rows past len(slot_mapping) (CUDA-graph padding) are
    ignored, and all-negative slots write nothing."""
    cache = make_cache("contiguous", "NHD", torch.float32, 4, 16, device=device)
    expect = cache.clone()
    key, value = make_tokens(12, torch.float32, device)
    slots = make_slots(8, 64, dtype=slot_dtype).to(device)
    write_kv_cache(key, value, cache.k, cache.v, slots)
    reference.write_kv_cache(key[:8], value[:8], expect.k, expect.v, slots)
    assert torch.equal(cache.bits(), expect.bits())

    untouched = cache.clone()
    write_kv_cache(
        key, value, cache.k, cache.v, torch.full((12,), -1, dtype=slot_dtype, device=device)
    )
    assert torch.equal(cache.bits(), untouched.bits())


def test_write_empty_is_a_no_op(device):
    cache = make_cache("hybrid", "NHD", torch.float16, 2, 16, device=device)
    before = cache.clone()
    key, value = make_tokens(0, torch.float16, device)
    write_kv_cache(key, value, cache.k, cache.v, torch.empty(0, dtype=torch.int64, device=device))
    assert torch.equal(cache.bits(), before.bits())


# -- gather ------------------------------------------------------------------------------------


def _seq_lens(block_size: int) -> list[int]:
    """A partial last block, an empty sequence, a single token, exactly one full block (small
    blocks only: the interpreter pays per token, and 2048 more tokens test nothing new)."""
    return [block_size + block_size // 2 + 1, 0, 1] + ([block_size] if block_size <= 80 else [])


def _block_table(num_seqs, max_blocks, nb, seed=0, dtype=torch.int32):
    g = torch.Generator().manual_seed(seed)
    # A column slice of a wider table: row stride != max_blocks.
    wide = torch.randint(0, nb, (num_seqs, max_blocks + 3), generator=g, dtype=torch.int64)
    return wide.to(dtype)[:, 1 : max_blocks + 1]


@pytest.mark.parametrize("layout, dtype, block_size, kind", CASES)
def test_gather_matches_reference_bitwise(layout, dtype, block_size, kind, device):
    nb = _num_blocks(block_size)
    cache = make_cache(kind, layout, dtype, nb, block_size, device=device)
    g = torch.Generator().manual_seed(1)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g).to(dtype))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g).to(dtype))
    lens = _seq_lens(block_size)
    cu = torch.tensor([0, *itertools.accumulate(lens)], device=device)
    table = _block_table(len(lens), 2, nb).to(device)

    k, v = gather_kv_cache(cache.k, cache.v, table, cu, layout=layout)
    rk, rv = reference.gather_kv_cache(cache.k, cache.v, table, cu, layout=layout)

    assert k.is_contiguous() and v.is_contiguous()
    assert k.shape == (sum(lens), NUM_KV_HEADS, HEAD_DIM)
    assert torch.equal(k, rk) and torch.equal(v, rv)


def test_gather_into_strided_out(device):
    """``out`` views into a wider buffer are written in place and returned; nothing else is."""
    dtype = torch.float16
    cache = make_cache("hybrid", "SHUFFLE", dtype, 4, 16, device=device)
    cache.buffer.copy_(torch.randn(cache.buffer.shape).to(dtype))
    cu = torch.tensor([0, 20, 33], dtype=torch.int64, device=device)
    table = torch.tensor([[3, 1], [0, 2]], dtype=torch.int64, device=device)
    wide = torch.full((2, 33, NUM_KV_HEADS + 1, HEAD_DIM), 7.0, dtype=dtype, device=device)
    out = (wide[0, :, 1:], wide[1, :, :-1])

    k, v = gather_kv_cache(cache.k, cache.v, table, cu, layout="SHUFFLE", out=out)
    rk, rv = reference.gather_kv_cache(cache.k, cache.v, table, cu, layout="SHUFFLE")

    assert k is out[0] and v is out[1]
    assert torch.equal(k, rk) and torch.equal(v, rv)
    assert (wide[0, :, 0] == 7).all() and (wide[1, :, -1] == 7).all()


def test_gather_negative_block_entries_give_zeros(device):
    cache = make_cache("contiguous", "NHD", torch.float32, 3, 4, device=device)
    cache.buffer.copy_(torch.randn(cache.buffer.shape))
    table = torch.tensor([[2, -1]], device=device)
    k, v = gather_kv_cache(cache.k, cache.v, table, torch.tensor([0, 7], device=device))
    assert torch.equal(k[:4], cache.k[2]) and torch.equal(v[:4], cache.v[2])
    assert (k[4:] == 0).all() and (v[4:] == 0).all()


def test_gather_no_sequences(device):
    cache = make_cache("contiguous", "NHD", torch.float32, 2, 4, device=device)
    table = torch.empty((0, 1), dtype=torch.int32, device=device)
    k, v = gather_kv_cache(
        cache.k, cache.v, table, torch.zeros(1, dtype=torch.int32, device=device)
    )
    assert k.shape == v.shape == (0, NUM_KV_HEADS, HEAD_DIM)


def test_unbounded_gather_checks_each_calls_indices_its_arguments_once(device):
    """A call without ``out`` checks its arguments once per description and its indices every
    call, then runs as the call given outputs of ``cu_seq_lens[-1]`` rows: the same description
    with other contents gives their answer, and broken contents after good calls are named as
    the planner names them, before anything is written."""
    cache = make_cache("contiguous", "NHD", torch.float32, 3, 4, device=device)
    cache.buffer.copy_(torch.randn(cache.buffer.shape))
    table = torch.tensor([[0, 2], [1, 0]], device=device)
    for cu in ([0, 5, 8], [0, 3, 7], [0, 8, 8], [0, 0, 0]):
        cu_t = torch.tensor(cu, device=device)
        k, v = gather_kv_cache(cache.k, cache.v, table, cu_t)
        rk, rv = reference.gather_kv_cache(cache.k, cache.v, table, cu_t)
        assert k.shape == (cu[-1], NUM_KV_HEADS, HEAD_DIM) and k.is_contiguous()
        assert torch.equal(k, rk) and torch.equal(v, rv)
    for over, exc, msg in GATHER_ERRORS:
        if "out" in over or any(isinstance(t, torch.Tensor) and t.is_meta for t in over.values()):
            continue  # (the bounded and the meta-device cases: not this path)
        args = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                for k, v in _gather_args(**over).items()}  # fmt: skip
        with pytest.raises(exc, match=msg):
            gather_kv_cache(**args)
        with pytest.raises(exc, match=msg):  # (a GPU call's path; on a CPU the planner's)
            _unbounded_outputs(*args.values(), "NHD")
        good = {k: v.to(device) for k, v in _gather_args().items()}
        assert _unbounded_outputs(*good.values(), "NHD")[0].shape == (8, NUM_KV_HEADS, HEAD_DIM)


# -- write -> gather round trip over random strides, interleavings and layouts ----------------


@st.composite
def round_trip_cases(draw):
    layout = draw(st.sampled_from(LAYOUTS))
    dtype = draw(st.sampled_from(DTYPES))
    x = shuffle_x(dtype)
    unit = 1 if layout == "NHD" else x
    block_size = unit * draw(st.integers(1, 6))
    nb = draw(st.integers(1, 4))
    h = draw(st.integers(1, 3))
    d = x * draw(st.integers(1, 3)) if layout == "SHUFFLE" else draw(st.integers(1, 20))
    kind = draw(st.sampled_from(CACHE_KINDS))
    n = draw(st.integers(0, nb * block_size))
    seed = draw(st.integers(0, 2**16))
    return layout, dtype, block_size, nb, h, d, kind, n, seed


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=round_trip_cases())
def test_write_gather_round_trip(case, device):
    layout, dtype, block_size, nb, h, d, kind, n, seed = case
    cache = make_cache(kind, layout, dtype, nb, block_size, h=h, d=d, device=device)
    before = cache.clone()
    key, value = make_tokens(n, dtype, device, h=h, d=d, seed=seed)
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(nb * block_size, generator=g)[:n]
    skip = torch.rand(n, generator=g) < 0.2
    slots[skip] = -1
    write_kv_cache(key, value, cache.k, cache.v, slots.to(device), layout=layout)

    # One sequence over every block, in order: gathered row s is slot s.
    table = torch.arange(nb, device=device)[None, :]
    cu = torch.tensor([0, nb * block_size], device=device)
    k, v = gather_kv_cache(cache.k, cache.v, table, cu, layout=layout)
    live = slots >= 0
    assert torch.equal(k[slots[live]], key[live]) and torch.equal(v[slots[live]], value[live])
    # Every slot not written still holds the poison, bit for bit.
    rk, rv = reference.gather_kv_cache(before.k, before.v, table, cu, layout=layout)
    unwritten = torch.ones(nb * block_size, dtype=torch.bool)
    unwritten[slots[live]] = False
    assert torch.equal(_bits(k[unwritten]), _bits(rk[unwritten]))
    assert torch.equal(_bits(v[unwritten]), _bits(rv[unwritten]))


# -- one shared contiguity predicate -----------------------------------------------------------


@pytest.mark.parametrize(
    "kind, layout, k_flat, v_flat",
    [
        ("contiguous", "NHD", True, True),
        ("wide_view", "NHD", False, False),
        ("hybrid", "NHD", False, False),
        ("contiguous", "SHUFFLE", False, False),  # K: token stride x; V: split token axis
    ],
)
def test_write_and_gather_take_flat_path_from_the_same_predicate(kind, layout, k_flat, v_flat):
    cache = make_cache(kind, layout, torch.float16, 4, 16, device="meta")
    key, value = make_tokens(3, torch.float16, "meta")
    (w,) = plan_write_kv_cache(
        key,
        value,
        cache.k,
        cache.v,
        torch.zeros(3, dtype=torch.int64, device="meta"),
        layout=layout,
    )
    (g,) = plan_gather_kv_cache(
        cache.k,
        cache.v,
        torch.zeros((1, 1), dtype=torch.int32, device="meta"),
        torch.zeros(2, dtype=torch.int32, device="meta"),
        layout=layout,
        out=(key, value),
    )
    for launch in (w, g):
        c = launch.args
        assert (c["K_FLAT_SLOTS"], c["V_FLAT_SLOTS"]) == (k_flat, v_flat)


def test_tiles_do_not_depend_on_block_size():
    """Lesson 3: a 2048-token block gets the tile a 16-token block gets."""
    tiles = set()
    for bs in (16, 544, 2048):
        cache = make_cache("hybrid", "NHD", torch.float16, 2, bs, device="meta")
        key, value = make_tokens(64, torch.float16, "meta")
        slots = torch.zeros(64, dtype=torch.int64, device="meta")
        (w,) = plan_write_kv_cache(key, value, cache.k, cache.v, slots)
        tiles.add((w.args["BLOCK_T"], w.args["BLOCK_D"], w.grid))
    assert len(tiles) == 1


# -- validation --------------------------------------------------------------------------------


def _write_args(**over):
    cache = make_cache("contiguous", "NHD", torch.float32, 2, 4)
    key, value = make_tokens(3, torch.float32)
    args = dict(
        key=key,
        value=value,
        key_cache=cache.k,
        value_cache=cache.v,
        slot_mapping=torch.tensor([0, 1, 2]),
    )
    args.update(over)
    return args


WRITE_ERRORS = [
    (dict(key="k"), TypeError, "write_kv_cache: key must be a torch.Tensor; got str"),
    (
        dict(value=torch.zeros(3, 2, 16, dtype=torch.float16)),
        TypeError,
        "write_kv_cache: value dtype must match the cache dtype torch.float32; got torch.float16",
    ),
    (
        dict(slot_mapping=torch.zeros(3)),
        TypeError,
        "write_kv_cache: slot_mapping dtype must be int32 or int64; got torch.float32",
    ),
    (
        dict(slot_mapping=[0, 1, 2]),
        TypeError,
        "write_kv_cache: slot_mapping must be a torch.Tensor; got list",
    ),
    (
        dict(slot_mapping=torch.zeros(3, 1, dtype=torch.int64)),
        ValueError,
        r"slot_mapping must be 1-D; got shape \(3, 1\)",
    ),
    (
        dict(key=torch.zeros(3, 2, 8)),
        ValueError,
        r"key must be \[num_tokens, 2, 16\] \(the cache's num_kv_heads, head_dim\); got shape "
        r"\(3, 2, 8\)",
    ),
    (dict(value=torch.zeros(2, 16)), ValueError, r"value must be \[num_tokens, 2, 16\]"),
    (
        dict(value=torch.zeros(4, 2, 16)),
        ValueError,
        "key and value must have the same num_tokens; got 3 and 4",
    ),
    (
        dict(slot_mapping=torch.arange(4)),
        ValueError,
        "slot_mapping must have at most num_tokens=3 entries; got 4",
    ),
    (
        dict(slot_mapping=torch.tensor([0, 8, -1])),
        ValueError,
        r"slot_mapping must be < num_blocks \* block_size = 8 \(or negative to skip\); got max 8",
    ),
    (
        dict(slot_mapping=torch.zeros(3, dtype=torch.int64, device="meta")),
        ValueError,
        "slot_mapping must be on the cache's device cpu; got meta",
    ),
]


@pytest.mark.parametrize("over, exc, msg", WRITE_ERRORS)
def test_write_validation(over, exc, msg):
    with pytest.raises(exc, match=msg):
        write_kv_cache(**_write_args(**over))


def test_write_validation_collects_every_reason_and_checks_the_layout():
    with pytest.raises(ValueError, match=r"key must be .*; value must be .*; slot_mapping must"):
        write_kv_cache(
            **_write_args(
                key=torch.zeros(3, 1, 16), value=torch.zeros(3, 1, 16), slot_mapping=torch.arange(5)
            )
        )
    with pytest.raises(ValueError, match="write_kv_cache: layout must be one of"):
        write_kv_cache(**_write_args(), layout="HND")
    with pytest.raises(TypeError, match="write_kv_cache: layout must be a str, one of"):
        write_kv_cache(**_write_args(), layout=None)


def _gather_args(**over):
    cache = make_cache("contiguous", "NHD", torch.float32, 3, 4)
    args = dict(
        key_cache=cache.k,
        value_cache=cache.v,
        block_table=torch.tensor([[0, 2], [1, 0]]),
        cu_seq_lens=torch.tensor([0, 5, 8]),
    )
    args.update(over)
    return args


_OUT = torch.zeros(8, 2, 16)
GATHER_ERRORS = [
    (
        dict(block_table=torch.zeros(2, 2)),
        TypeError,
        "gather_kv_cache: block_table dtype must be int32 or int64; got torch.float32",
    ),
    (
        dict(cu_seq_lens=(0, 5, 8)),
        TypeError,
        "gather_kv_cache: cu_seq_lens must be a torch.Tensor; got tuple",
    ),
    (
        dict(block_table=torch.tensor([0, 2])),
        ValueError,
        r"block_table must be 2-D; got shape \(2,\)",
    ),
    (
        dict(cu_seq_lens=torch.tensor([0, 8])),
        ValueError,
        "cu_seq_lens must have num_seqs \\+ 1 = 3 entries; got 2",
    ),
    (
        dict(block_table=torch.zeros(2, 2, dtype=torch.int64, device="meta")),
        ValueError,
        "block_table must be on the cache's device cpu; got meta",
    ),
    (dict(out=_OUT), TypeError, "gather_kv_cache: out must be a \\(key_out, value_out\\) pair"),
    (dict(out=(_OUT, "v")), TypeError, r"gather_kv_cache: out\[1\] must be a torch.Tensor"),
    (
        dict(out=(_OUT, _OUT.half())),
        TypeError,
        r"out\[1\] dtype must match the cache dtype torch.float32; got torch.float16",
    ),
    (
        dict(out=(_OUT, torch.zeros(8, 2, 8))),
        ValueError,
        r"out\[1\] must be \[total_tokens, 2, 16\]; got shape \(8, 2, 8\)",
    ),
    (
        dict(out=(_OUT, torch.zeros(7, 2, 16))),
        ValueError,
        r"out\[0\] and out\[1\] must have the same total_tokens; got 8 and 7",
    ),
    (
        dict(out=(_OUT, torch.zeros(8, 2, 16, device="meta"))),
        ValueError,
        r"out\[1\] must be on the cache's device cpu; got meta",
    ),
    (
        dict(cu_seq_lens=torch.tensor([1, 5, 8])),
        ValueError,
        "cu_seq_lens must start at 0 and end at total_tokens=8; got first 1, last 8",
    ),
    (
        dict(cu_seq_lens=torch.tensor([0, 5, 4])),
        ValueError,
        r"cu_seq_lens must be non-decreasing; got a decrease at index 2 \(5 -> 4\)",
    ),
    (
        dict(out=(_OUT[:7], _OUT[:7].clone())),
        ValueError,
        "cu_seq_lens must start at 0 and end at out's total_tokens=7; got first 0, last 8",
    ),
    (
        dict(cu_seq_lens=torch.tensor([0, 9, 9])),
        ValueError,
        r"block_table must have a column per block of each sequence; got cu_seq_lens\[1\] - "
        r"cu_seq_lens\[0\]=9 needing 3 blocks of 4 but max_blocks=2",
    ),
    (
        dict(block_table=torch.tensor([[0, 3], [1, 0]])),
        ValueError,
        r"block_table entries of used blocks must be < num_blocks=3 \(negative: padding\); got "
        r"max 3, first at block_table\[0, 1\]=3",
    ),
]


@pytest.mark.parametrize("over, exc, msg", GATHER_ERRORS)
def test_gather_validation(over, exc, msg):
    with pytest.raises(exc, match=msg):
        gather_kv_cache(**_gather_args(**over))


def test_gather_meta_needs_out():
    cache = make_cache("contiguous", "NHD", torch.float32, 3, 4, device="meta")
    with pytest.raises(ValueError, match=re.escape("gather_kv_cache: out must be given for meta")):
        plan_gather_kv_cache(
            cache.k,
            cache.v,
            torch.zeros((1, 1), dtype=torch.int32, device="meta"),
            torch.zeros(2, dtype=torch.int32, device="meta"),
        )


def test_a_cache_past_the_grids_head_limit_is_refused_by_name():
    """One launch grid row a KV head: past CUDA's 65535 a launch failed with the driver's
    "invalid argument" instead of an error naming the cache."""
    meta = dict(dtype=torch.float16, device="meta")
    cache = torch.empty(2, 16, 65536, 8, **meta)
    rows = torch.empty(3, 65536, 8, **meta)
    rule = "key_cache must have at most 65535 KV heads (one launch grid row a head); got 65536"
    with pytest.raises(ValueError, match=re.escape(f"write_kv_cache: {rule}")):
        plan_write_kv_cache(rows, rows, cache, cache.clone(),
                            torch.empty(3, dtype=torch.int64, device="meta"))  # fmt: skip
    index = dict(dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match=re.escape(f"gather_kv_cache: {rule}")):
        plan_gather_kv_cache(cache, cache.clone(), torch.empty((1, 1), **index),
                             torch.empty(2, **index), out=(rows, rows.clone()))  # fmt: skip
    fits = torch.empty(2, 16, 65535, 8, **meta)
    assert plan_write_kv_cache(rows[:, :65535], rows[:, :65535], fits, fits.clone(),
                               torch.empty(3, dtype=torch.int64, device="meta"))  # fmt: skip


# -- GPU: real shapes, bf16/fp16, exact -------------------------------------------------------

GPU_TOKENS = 16384
GPU_HEADS = 8
GPU_HEAD_DIM = 128


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("block_size", (16, 2048))
@pytest.mark.parametrize(
    "layout, kind",
    [("NHD", "contiguous"), ("NHD", "hybrid"), ("SHUFFLE", "contiguous"), ("SHUFFLE", "hybrid")],
)
def test_gpu_write_gather_exact(dtype, block_size, layout, kind):
    dev = "cuda"
    nb = 2 * GPU_TOKENS // block_size
    cache = make_cache(kind, layout, dtype, nb, block_size, GPU_HEADS, GPU_HEAD_DIM, device=dev)
    expect = cache.clone()
    key, value = make_tokens(GPU_TOKENS, dtype, dev, GPU_HEADS, GPU_HEAD_DIM)
    slots = make_slots(GPU_TOKENS, nb * block_size).to(dev)

    write_kv_cache(key, value, cache.k, cache.v, slots, layout=layout)
    reference.write_kv_cache(key, value, expect.k, expect.v, slots, layout=layout)
    torch.cuda.synchronize()
    assert torch.equal(cache.bits(), expect.bits())

    lens = [GPU_TOKENS // 2 + 3, 1, block_size, GPU_TOKENS // 3]
    cu = torch.tensor([0, *itertools.accumulate(lens)], device=dev)
    table = _block_table(len(lens), nb, nb).to(dev)
    k, v = gather_kv_cache(cache.k, cache.v, table, cu, layout=layout)
    rk, rv = reference.gather_kv_cache(cache.k, cache.v, table, cu, layout=layout)
    assert torch.equal(_bits(k), _bits(rk)) and torch.equal(_bits(v), _bits(rv))
