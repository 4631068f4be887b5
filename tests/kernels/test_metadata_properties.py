"""The metadata contract as properties (hypothesis), for every op that takes index metadata.

* Valid metadata, laid out anyhow (each index tensor a strided view with a storage offset, its
  neighbours in storage holding junk; int32 or int64; unused block-table columns garbage), gives
  the fp64 reference's answer (`portattn.reference`). These run on the CPU under the
  interpreter and unchanged in the GPU cells (`device` fixture), where the ops take the bounded
  path (``max_query_len``, ``metadata``, ``out``, ``num_indices``: no host read of the metadata).
* Invalid metadata (one rule broken, drawn from each op's rules) gives a ValueError naming the
  op and the argument, before anything runs (marker ``cpu``: the checks read host copies).

Every example is small; the counts are bounded (`VALID`, `INVALID` examples per op and run) and
derandomized, so a gate run draws the same examples every time.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from portattn import reference
from portattn.kernels.kv_cache import gather_kv_cache, write_kv_cache
from portattn.kernels.mla_decode import mla_decode
from portattn.kernels.page_indices import expand_page_indices
from portattn.kernels.paged_attention import paged_attention
from portattn.layout import empty_kv_cache
from portattn.mla_metadata import MlaMetadataBuilder
from portattn.platform import get_target, target_for_tensor
from tests.helpers import rel_err

#: Examples per op and gate run: valid metadata (each runs the kernel), invalid (each raises).
VALID, INVALID = 20, 50
_SETTINGS = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
JUNK = (-1, 7, 10**6)  # what a strided view's neighbours in storage hold
GARBAGE = (-1, 10**6)  # what unused block-table columns hold


@st.composite
def placed(draw, values: torch.Tensor, device: str = "cpu", dtypes=(torch.int32, torch.int64)):
    """``values`` (a CPU int tensor, 1-D or 2-D) as a view with drawn strides, storage offset
    and index dtype (of ``dtypes``), its storage neighbours junk, on ``device``."""
    dtype = draw(st.sampled_from(dtypes))
    offset = draw(st.integers(0, 3))
    step = draw(st.integers(1, 3))
    if values.dim() == 1:
        shape, strides = values.shape, (step,)
    else:
        rows, cols = values.shape
        pad = draw(st.integers(0, 2))
        row_major = draw(st.booleans())  # rows apart, columns `step` apart; or column-major
        strides = (cols * step + pad, step) if row_major else (step, rows * step + pad)
        shape = values.shape
    size = offset + sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + 1
    buf = torch.full((max(size, 1),), draw(st.sampled_from(JUNK)), dtype=dtype)
    view = buf.as_strided(shape, strides, offset)
    view.copy_(values)
    buf = buf.to(device)
    return buf.as_strided(shape, strides, offset)


@st.composite
def paged_metadata(draw, *, max_seqs=3, q_max=3, ctx_max=9, min_q=0):
    """(block_size, seq_lens, q_lens, block_table, num_blocks) of a valid batch, as CPU
    int64 tensors; unused block-table columns hold garbage."""
    block_size = draw(st.sampled_from((1, 2, 3, 4, 8, 16)))
    n = draw(st.integers(1, max_seqs))
    q_lens = [draw(st.integers(min_q, q_max)) for _ in range(n)]
    seq_lens = [q + draw(st.integers(0, ctx_max)) for q in q_lens]
    blocks = [-(-s // block_size) for s in seq_lens]
    spare = draw(st.integers(0, 2))
    num_blocks = max(1, sum(blocks) + spare)
    perm = torch.randperm(
        num_blocks, generator=torch.Generator().manual_seed(draw(st.integers(0, 99)))
    )
    cols = max(blocks) + draw(st.integers(0, 2))
    table = torch.full((n, max(cols, 1)), draw(st.sampled_from(GARBAGE)), dtype=torch.int64)
    at = 0
    for i, b in enumerate(blocks):
        table[i, :b] = perm[at : at + b]
        at += b
    return (
        block_size,
        torch.tensor(seq_lens, dtype=torch.int64),
        torch.tensor(q_lens, dtype=torch.int64),
        table,
        num_blocks,
    )


def _offsets(lens: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])


def _same_values(views, copies) -> None:
    """The ops read their metadata, never write it (nor its neighbours)."""
    for v, c in zip(views, copies, strict=True):
        assert torch.equal(v.cpu().long(), c.long()), "an op changed its metadata"


# -- paged_attention -----------------------------------------------------------------------------

HQ, HKV, D = 4, 2, 16


@st.composite
def paged_case(draw, device="cpu"):
    block_size, sl, ql, table, num_blocks = draw(paged_metadata(min_q=0))
    g = torch.Generator().manual_seed(draw(st.integers(0, 99)))
    num_tokens = int(ql.sum())
    return dict(
        query=torch.randn(num_tokens, HQ, D, generator=g).to(device),
        key_cache=torch.randn(num_blocks, block_size, HKV, D, generator=g).to(device),
        value_cache=torch.randn(num_blocks, block_size, HKV, D, generator=g).to(device),
        block_table=draw(placed(table, device)),
        seq_lens=draw(placed(sl, device)),
        query_start_loc=draw(placed(_offsets(ql), device)),
    ), int(ql.max())


@pytest.mark.paged
@settings(max_examples=VALID, **_SETTINGS)
@given(data=st.data())
def test_paged_attention_valid_metadata_matches_reference(data, device):
    a, longest = data.draw(paged_case(device))
    # the GPU's bounded path (no host read); on the CPU with or without the bound
    bound = device != "cpu" or data.draw(st.booleans())
    extra = dict(max_query_len=longest + data.draw(st.integers(0, 2))) if bound else {}
    meta = [a[k] for k in ("block_table", "seq_lens", "query_start_loc")]
    copies = [t.cpu().clone() for t in meta]
    out = paged_attention(**a, **extra)
    want = reference.paged_attention(*(t.cpu() for t in a.values()))
    if want.numel():
        assert rel_err(out, want) < 1e-5
    _same_values(meta, copies)


@pytest.mark.paged
@settings(max_examples=INVALID, **_SETTINGS)
@given(data=st.data())
def test_paged_unbounded_plan_is_the_bounded_plan_of_what_it_read(data):
    """A GPU's unbounded call runs the plan of the call bounded by its metadata's maxima
    (`unbounded_maxima`); for any valid metadata (strided, garbage in unused columns) both plan
    the same launches on every kind of target (planning only, CPU tensors)."""
    from portattn.kernels.paged_attention import plan_paged_attention, unbounded_maxima

    a, longest = data.draw(paged_case("cpu"))
    mql, msl, _ = unbounded_maxima(*a.values(), None, None, "NHD", None, None)
    assert mql == longest
    for arch in ("sm_80", "sm_90", "gfx942"):
        t = get_target(arch)
        free = plan_paged_attention(**a, target=t)
        bound = plan_paged_attention(**a, target=t, max_query_len=mql, max_seq_len=msl,
                                     check_contents=False)  # fmt: skip
        assert len(free) == len(bound)
        for f, b in zip(free, bound, strict=True):
            assert (f.kernel, f.grid, f.options) == (b.kernel, b.grid, b.options)
            scalars = lambda launch: {  # noqa: E731
                k: v for k, v in launch.args.items() if not isinstance(v, torch.Tensor)
            }
            assert scalars(f) == scalars(b)


# -- mla_decode ----------------------------------------------------------------------------------

MLA_DK, MLA_R, MLA_HEADS, MLA_SCALE = 80, 64, 2, 0.1


@st.composite
def mla_case(draw, device="cpu"):
    block_size, sl, ql, table, num_blocks = draw(paged_metadata(q_max=2, min_q=1))
    g = torch.Generator().manual_seed(draw(st.integers(0, 99)))
    num_tokens = int(ql.sum())
    a = dict(
        query=torch.randn(num_tokens, MLA_HEADS, MLA_DK, generator=g).to(device),
        kv_cache=torch.randn(num_blocks, block_size, MLA_DK, generator=g).to(device),
        block_table=draw(placed(table, device)),
        seq_lens=draw(placed(sl, device)),
        kv_lora_rank=MLA_R,
        scale=MLA_SCALE,
        query_start_loc=draw(placed(_offsets(ql), device)),
    )
    return a, table, sl, ql


def _mla_metadata(a, ql, device):
    """The builder's metadata for the step (the GPU's bounded path)."""
    q = a["query"]
    target = target_for_tensor(q) if device != "cpu" else get_target("sm_90")
    builder = MlaMetadataBuilder(
        target, max_batch=a["seq_lens"].shape[0], num_heads=MLA_HEADS, kv_lora_rank=MLA_R,
        head_dim_k=MLA_DK, dtype=q.dtype, device=device, max_query_len=2, max_seq_len=64,
    )  # fmt: skip
    return builder.build(a["seq_lens"], a["query_start_loc"], max_query_len=int(ql.max()))


@pytest.mark.mla
@settings(max_examples=VALID, **_SETTINGS)
@given(data=st.data())
def test_mla_decode_valid_metadata_matches_reference(data, device):
    a, table, sl, ql = data.draw(mla_case(device))
    want, _ = reference.mla_decode(
        a["query"].cpu(), a["kv_cache"].cpu(), table, sl, kv_lora_rank=MLA_R, scale=MLA_SCALE,
        query_start_loc=_offsets(ql),
    )  # fmt: skip
    if data.draw(st.booleans()):  # page indices instead of the block table
        indptr, indices = reference.expand_page_indices(table, sl, a["kv_cache"].shape[1])
        a["page_indices"] = (data.draw(placed(indptr, device)), data.draw(placed(indices, device)))
        a["block_table"] = None
    if device != "cpu" or data.draw(st.booleans()):
        a["metadata"] = _mla_metadata(a, ql, device)
    meta = [t for k in ("block_table", "seq_lens", "query_start_loc") if (t := a[k]) is not None]
    meta += list(a.get("page_indices", ()))
    copies = [t.cpu().clone() for t in meta]
    out = mla_decode(**a)
    assert rel_err(out, want) < 1e-5
    _same_values(meta, copies)


# -- write_kv_cache / gather_kv_cache ----------------------------------------------------------


@st.composite
def write_case(draw, device="cpu"):
    block_size = draw(st.sampled_from((1, 2, 4, 5, 16)))
    num_blocks = draw(st.integers(1, 4))
    num_slots = num_blocks * block_size
    num_tokens = draw(st.integers(1, min(6, num_slots)))
    n = draw(st.integers(0, num_tokens))  # rows past n are graph padding
    seed = draw(st.integers(0, 99))
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed))[:n]
    pad = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    slots = torch.where(torch.tensor(pad, dtype=torch.bool), -1, slots)
    g = torch.Generator().manual_seed(seed + 1)
    k_cache, v_cache = empty_kv_cache(num_blocks, block_size, HKV, D, dtype=torch.float32)
    k_cache.copy_(torch.randn(k_cache.shape, generator=g))
    v_cache.copy_(torch.randn(v_cache.shape, generator=g))
    key = torch.randn(num_tokens, HKV, D, generator=g)
    value = torch.randn(num_tokens, HKV, D, generator=g)
    return dict(
        key=key.to(device),
        value=value.to(device),
        key_cache=k_cache.to(device),
        value_cache=v_cache.to(device),
        slot_mapping=draw(placed(slots.to(torch.int64), device)),
    )


@pytest.mark.paged
@settings(max_examples=VALID, **_SETTINGS)
@given(data=st.data())
def test_write_kv_cache_valid_metadata_matches_reference(data, device):
    a = data.draw(write_case(device))
    want = {k: t.cpu().clone() for k, t in a.items()}
    reference.write_kv_cache(**want)
    copy = a["slot_mapping"].cpu().clone()
    write_kv_cache(**a)
    assert torch.equal(a["key_cache"].cpu(), want["key_cache"])
    assert torch.equal(a["value_cache"].cpu(), want["value_cache"])
    _same_values([a["slot_mapping"]], [copy])


@st.composite
def gather_case(draw, device="cpu"):
    block_size, sl, _, table, num_blocks = draw(paged_metadata(min_q=0, q_max=0))
    g = torch.Generator().manual_seed(draw(st.integers(0, 99)))
    k_cache = torch.randn(num_blocks, block_size, HKV, D, generator=g)
    v_cache = torch.randn(num_blocks, block_size, HKV, D, generator=g)
    return dict(
        key_cache=k_cache.to(device),
        value_cache=v_cache.to(device),
        block_table=draw(placed(table, device)),
        cu_seq_lens=draw(placed(_offsets(sl), device)),
    ), int(sl.sum())


@pytest.mark.paged
@settings(max_examples=VALID, **_SETTINGS)
@given(data=st.data())
def test_gather_kv_cache_valid_metadata_matches_reference(data, device):
    a, total = data.draw(gather_case(device))
    if device != "cpu" or data.draw(st.booleans()):  # `out` given: the bounded path
        a["out"] = tuple(torch.empty(total, HKV, D, device=device) for _ in range(2))
    copies = [a["block_table"].cpu().clone(), a["cu_seq_lens"].cpu().clone()]
    k, v = gather_kv_cache(**a)
    names = ("key_cache", "value_cache", "block_table", "cu_seq_lens")
    rk, rv = reference.gather_kv_cache(*(a[n].cpu() for n in names))
    assert torch.equal(k.cpu(), rk) and torch.equal(v.cpu(), rv)
    _same_values([a["block_table"], a["cu_seq_lens"]], copies)


# -- expand_page_indices -------------------------------------------------------------------------


@pytest.mark.paged
@pytest.mark.specdec
@settings(max_examples=VALID, **_SETTINGS)
@given(data=st.data())
def test_expand_page_indices_valid_metadata_matches_reference(data, device):
    block_size, sl, _, table, _ = data.draw(paged_metadata(min_q=0, q_max=0))
    bt, lens = data.draw(placed(table, device)), data.draw(placed(sl, device))
    bound = device != "cpu" or data.draw(st.booleans())
    indptr, indices = expand_page_indices(
        bt, lens, block_size, num_indices=int(sl.sum()) if bound else None
    )
    r_indptr, r_indices = reference.expand_page_indices(table, sl, block_size)
    assert torch.equal(indptr.cpu(), r_indptr) and torch.equal(indices.cpu(), r_indices)
    _same_values([bt, lens], [table, sl])


# -- invalid metadata: a ValueError naming the argument, before anything runs -------------------


def _set(t: torch.Tensor, index, value) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


@st.composite
def broken_paged(draw, *, min_q):
    """A valid batch's metadata with one rule broken: (mutated tensors, the argument the error
    must name)."""
    block_size, sl, ql, table, num_blocks = draw(paged_metadata(min_q=min_q))
    qsl = _offsets(ql)
    n = sl.shape[0]
    i = draw(st.integers(0, n - 1))
    used = -(-sl[i] // block_size)
    rules = ["seq_lens-short", "capacity", "qsl-start", "qsl-end"]
    if used:
        rules += ["block-id-high", "block-id-negative"]
    if n > 1:
        rules.append("qsl-decreasing")
    rule = draw(st.sampled_from(rules))
    if rule == "seq_lens-short":  # below the sequence's q_len (negative without queries)
        sl, name = _set(sl, i, int(ql[i]) - draw(st.integers(1, 3))), "seq_lens"
    elif rule == "capacity":  # more tokens than the row has blocks for
        sl, name = _set(sl, i, table.shape[1] * block_size + 1), "block_table"
    elif rule == "block-id-high":
        c = draw(st.integers(0, int(used) - 1))
        table, name = _set(table, (i, c), num_blocks + draw(st.integers(0, 10**6))), "block_table"
    elif rule == "block-id-negative":
        c = draw(st.integers(0, int(used) - 1))
        table, name = _set(table, (i, c), -draw(st.integers(1, 5))), "block_table"
    elif rule == "qsl-start":
        qsl, name = _set(qsl, 0, draw(st.integers(1, 3))), "query_start_loc"
    elif rule == "qsl-end":
        qsl, name = _set(qsl, n, int(qsl[n]) + draw(st.integers(1, 3))), "query_start_loc"
    else:  # an interior offset above the next one
        j = draw(st.integers(1, n - 1))
        qsl, name = _set(qsl, j, int(qsl[j + 1]) + 1), "query_start_loc"
    return block_size, sl, ql, qsl, table, num_blocks, rule, name


def _raises_naming(op: str, name: str, call) -> None:
    with pytest.raises(ValueError) as info:
        call()
    msg = str(info.value)
    assert msg.startswith(f"{op}: ") and name in msg, msg


@pytest.mark.cpu
@pytest.mark.paged
@settings(max_examples=INVALID, **_SETTINGS)
@given(data=st.data())
def test_paged_attention_invalid_metadata_is_named(data):
    block_size, sl, ql, qsl, table, num_blocks, rule, name = data.draw(broken_paged(min_q=0))
    tokens = int(_offsets(ql)[-1])
    q = torch.randn(tokens, HQ, D)
    k_cache, v_cache = empty_kv_cache(num_blocks, block_size, HKV, D, dtype=torch.float32)
    bt, lens, starts = (data.draw(placed(t)) for t in (table, sl, qsl))
    _raises_naming(
        "paged_attention", name, lambda: paged_attention(q, k_cache, v_cache, bt, lens, starts)
    )


@pytest.mark.cpu
@pytest.mark.mla
@settings(max_examples=INVALID, **_SETTINGS)
@given(data=st.data())
def test_mla_decode_invalid_metadata_is_named(data):
    block_size, sl, ql, qsl, table, num_blocks, rule, name = data.draw(broken_paged(min_q=1))
    tokens = int(_offsets(ql)[-1])
    q = torch.randn(tokens, MLA_HEADS, MLA_DK)
    cache = torch.zeros(num_blocks, block_size, MLA_DK)
    bt = data.draw(placed(table))
    if data.draw(st.booleans()):  # page indices instead: a slot outside the cache, or a count
        block_size, sl, ql, table, num_blocks = data.draw(paged_metadata(q_max=2, min_q=1))
        qsl = _offsets(ql)
        tokens = int(qsl[-1])
        q = torch.randn(tokens, MLA_HEADS, MLA_DK)
        cache = torch.zeros(num_blocks, block_size, MLA_DK)
        indptr, indices = reference.expand_page_indices(table, sl, block_size)
        k = data.draw(st.integers(0, indices.shape[0] - 1))
        rule = data.draw(st.sampled_from(("slot-high", "slot-negative", "count")))
        if rule == "count":  # indptr gives sequence i fewer slots than seq_lens[i]
            i = data.draw(st.integers(0, sl.shape[0] - 1))
            sl, name = _set(sl, i, int(sl[i]) + 1), "page_indices[0] (indptr)"
        else:
            bad = num_blocks * block_size + data.draw(st.integers(0, 99))
            indices = _set(indices, k, bad if rule == "slot-high" else -1)
            name = "page_indices[1]"
        pages = (data.draw(placed(indptr)), data.draw(placed(indices)))
        bt = None
    a = dict(kv_lora_rank=MLA_R, scale=MLA_SCALE, query_start_loc=data.draw(placed(qsl)))
    if bt is None:
        a["page_indices"] = pages
    lens = data.draw(placed(sl))
    _raises_naming("mla_decode", name, lambda: mla_decode(q, cache, bt, lens, **a))


@pytest.mark.cpu
@pytest.mark.paged
@settings(max_examples=INVALID, **_SETTINGS)
@given(data=st.data())
def test_write_kv_cache_invalid_slots_are_named(data):
    a = data.draw(write_case())
    slots = a["slot_mapping"].cpu().to(torch.int64)
    num_slots = a["key_cache"].shape[0] * a["key_cache"].shape[1]
    if slots.numel() == 0:  # (there is at least one token)
        slots = torch.zeros(1, dtype=torch.int64)
    i = data.draw(st.integers(0, slots.shape[0] - 1))
    slots = _set(slots, i, num_slots + data.draw(st.integers(0, 10**6)))
    a["slot_mapping"] = data.draw(placed(slots))
    before = a["key_cache"].clone(), a["value_cache"].clone()
    _raises_naming("write_kv_cache", "slot_mapping", lambda: write_kv_cache(**a))
    assert torch.equal(a["key_cache"], before[0]) and torch.equal(a["value_cache"], before[1])


@pytest.mark.cpu
@pytest.mark.paged
@settings(max_examples=INVALID, **_SETTINGS)
@given(data=st.data())
def test_gather_kv_cache_invalid_metadata_is_named(data):
    block_size, sl, _, table, num_blocks = data.draw(paged_metadata(min_q=0, q_max=0))
    cu = _offsets(sl)
    n = sl.shape[0]
    i = data.draw(st.integers(0, n - 1))
    used = int(-(-sl[i] // block_size))
    rules = ["cu-start", "capacity", "cu-decreasing"] + (["block-id-high"] if used else [])
    rule = data.draw(st.sampled_from(rules))
    if rule == "cu-start":
        cu, name = _set(cu, 0, data.draw(st.integers(1, 3))), "cu_seq_lens"
    elif rule == "cu-decreasing":
        cu, name = _set(cu, i + 1, int(cu[i]) - 1), "cu_seq_lens"
    elif rule == "capacity":
        cu = cu.clone()
        cu[i + 1 :] += table.shape[1] * block_size + 1 - int(sl[i])
        name = "block_table"
    else:
        c = data.draw(st.integers(0, used - 1))
        table, name = _set(table, (i, c), num_blocks + data.draw(st.integers(0, 99))), "block_table"
    k_cache, v_cache = empty_kv_cache(num_blocks, block_size, HKV, D, dtype=torch.float32)
    bt, cus = data.draw(placed(table)), data.draw(placed(cu))
    _raises_naming("gather_kv_cache", name, lambda: gather_kv_cache(k_cache, v_cache, bt, cus))


@pytest.mark.cpu
@pytest.mark.paged
@pytest.mark.specdec
@settings(max_examples=INVALID, **_SETTINGS)
@given(data=st.data())
def test_expand_page_indices_invalid_metadata_is_named(data):
    block_size, sl, _, table, _ = data.draw(paged_metadata(min_q=0, q_max=0))
    n = sl.shape[0]
    i = data.draw(st.integers(0, n - 1))
    used = int(-(-sl[i] // block_size))
    num_indices = None
    # (at block_size 1 every int64 block id's slot fits int64: no id overflows)
    overflow = ["slot-overflow"] if used and block_size > 1 else []
    rules = ["seq_lens<0", "capacity", "num_indices", *overflow]
    rule = data.draw(st.sampled_from(rules))
    if rule == "seq_lens<0":
        sl, name = _set(sl, i, -data.draw(st.integers(1, 5))), "seq_lens"
    elif rule == "capacity":
        sl, name = _set(sl, i, table.shape[1] * block_size + 1), "block_table"
    elif rule == "num_indices":  # not sum(seq_lens)
        num_indices = int(sl.sum()) + data.draw(st.sampled_from((-1, 1, 7)))
        num_indices, name = num_indices if num_indices >= 0 else 1, "num_indices"
    else:  # block * block_size + offset past int64
        c = data.draw(st.integers(0, used - 1))
        big = 2**63 // block_size + data.draw(st.integers(0, 3))
        table, name = _set(table, (i, c), min(big, 2**63 - 1)), "block_table"
    wide = (torch.int64,) if rule == "slot-overflow" else (torch.int32, torch.int64)
    bt, lens = data.draw(placed(table, dtypes=wide)), data.draw(placed(sl))
    _raises_naming(
        "expand_page_indices",
        name,
        lambda: expand_page_indices(bt, lens, block_size, num_indices=num_indices),
    )
