"""Bad input never crashes, never answers wrong, never hides a problem.

* metadata strides: every op reads its index tensors through their strides, as its checks do;
* bf16 on the CPU: the interpreter's dots give the right answer;
* the softmax scale: one bound for every op (the kernels take ``scale * log2(e)`` in fp32);
* overlapping writes: an output, cache or workspace sharing memory with an input, with another
  write target or with itself is refused by name, on a cached plan's hit too;
* page expansion: slots that would leave int64 are refused;
* errors: one error lists every problem (type problems and value problems alike) and blames the
  right argument; meta tensors give their outputs' shapes.

Cases that crashed the process (SIGSEGV) run in a child (`_in_child`), as in
test_metadata_checks.py, so a regression fails its test instead of killing the run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import portattn
from portattn import reference
from portattn.kernels import _checks
from portattn.kernels._plans import PlanCache, call_key
from portattn.kernels.kv_cache import gather_kv_cache, write_kv_cache
from portattn.kernels.mla_decode import mla_decode, plan_mla_decode
from portattn.kernels.page_indices import expand_page_indices
from portattn.kernels.paged_attention import paged_attention, plan_paged_attention
from portattn.layout import empty_kv_cache, make_hybrid_cache
from tests.helpers import assert_low_precision_close, rel_err

BS, HQ, HKV, D, NUM_BLOCKS = 4, 4, 2, 16, 8
SEQ_LENS, Q_LENS = (6, 9), (2, 1)
DK, R = 80, 64  # MLA: latent 64 + rope 16


def _i32(*xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32)


def _paged(device="cpu", dtype=torch.float32, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(
        query=torch.randn(sum(Q_LENS), HQ, D, generator=g).to(device, dtype),
        key_cache=torch.randn(NUM_BLOCKS, BS, HKV, D, generator=g).to(device, dtype),
        value_cache=torch.randn(NUM_BLOCKS, BS, HKV, D, generator=g).to(device, dtype),
        block_table=torch.tensor([[5, 2, -1, -1], [7, 0, 3, -1]], dtype=torch.int32).to(device),
        seq_lens=_i32(*SEQ_LENS).to(device),
        query_start_loc=_i32(0, 2, 3).to(device),
    )


def _mla(device="cpu", dtype=torch.float32, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    a = _paged(device)
    return dict(
        query=torch.randn(sum(Q_LENS), 2, DK, generator=g).to(device, dtype),
        kv_cache=torch.randn(NUM_BLOCKS, BS, DK, generator=g).to(device, dtype),
        block_table=a["block_table"],
        seq_lens=a["seq_lens"],
        kv_lora_rank=R,
        scale=0.1,
        query_start_loc=a["query_start_loc"],
    )


def _column(values, neighbour: int) -> torch.Tensor:
    """``values`` as column 0 of a 2-column int32 tensor: a view of stride 2 whose neighbours
    in storage are ``neighbour``."""
    return torch.tensor([[v, neighbour] for v in values], dtype=torch.int32)[:, 0]


def _paged_reference(a: dict) -> torch.Tensor:
    return reference.paged_attention(*(t.cpu() for t in a.values()))


# -- crash-prone cases, each in a child process -------------------------------------------------


def _strided_seq_lens_far_neighbours() -> dict:
    """seq_lens a stride-2 view whose neighbours (5000) would send the kernel past the cache."""
    a = _paged()
    a["seq_lens"] = _column(SEQ_LENS, 5000)
    return {"error": rel_err(paged_attention(**a), _paged_reference(a))}


def _strided_query_start_loc_far_neighbours() -> dict:
    """query_start_loc a stride-2 view whose neighbours (99) would send it past the query."""
    a = _paged()
    a["query_start_loc"] = _column((0, 2, 3), 99)
    return {"error": rel_err(paged_attention(**a), _paged_reference(a))}


CHILD_CASES = {
    "seq_lens": _strided_seq_lens_far_neighbours,
    "query_start_loc": _strided_query_start_loc_far_neighbours,
}


def _in_child(name: str) -> dict:
    """Run ``CHILD_CASES[name]`` in a fresh interpreter; return its result."""
    src = Path(portattn.__file__).resolve().parents[1]  # the portattn this test imported
    root = Path(__file__).resolve().parents[2]
    code = (
        "import json\n"
        "from tests.kernels.test_input_contract import CHILD_CASES\n"
        f"print(json.dumps(CHILD_CASES[{name!r}]()))\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join((str(src), str(root))))
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, (
        f"child for {name!r} died with exit status {proc.returncode} "
        f"(negative: killed by signal {-proc.returncode})\nstderr tail:\n{proc.stderr[-2000:]}"
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- metadata strides -------------------------------------------------------------------------


@pytest.mark.cpu
@pytest.mark.paged
@pytest.mark.parametrize("name", list(CHILD_CASES))
def test_paged_attention_reads_strided_metadata_without_crashing(name):
    assert _in_child(name)["error"] < 1e-5


@pytest.mark.paged
def test_paged_attention_reads_seq_lens_through_its_stride(device):
    """Neighbours in storage that are valid lengths: read as seq_lens, a silently wrong answer."""
    a = _paged(device)
    a["seq_lens"] = _column(SEQ_LENS, 1).to(device)
    a["query_start_loc"] = _column((0, 2, 3), 0).to(device)
    assert rel_err(paged_attention(**a, max_query_len=2), _paged_reference(a)) < 1e-5


@pytest.mark.paged
def test_write_kv_cache_reads_slot_mapping_through_its_stride(device):
    k_cache, v_cache = (torch.zeros(NUM_BLOCKS, BS, HKV, D, device=device) for _ in range(2))
    key, value = (torch.randn(3, HKV, D, device=device) for _ in range(2))
    slots = torch.tensor([[9, 0], [2, 0], [30, 0]]).to(device)[:, 0]
    write_kv_cache(key, value, k_cache, v_cache, slots)
    want = [torch.zeros(NUM_BLOCKS, BS, HKV, D) for _ in range(2)]
    reference.write_kv_cache(key.cpu(), value.cpu(), *want, slots.cpu())
    assert torch.equal(k_cache.cpu(), want[0]) and torch.equal(v_cache.cpu(), want[1])


# -- bf16 ---------------------------------------------------------------------------------------


@pytest.mark.paged
def test_paged_attention_bf16_is_right(device):
    a = _paged(device, torch.bfloat16)
    out = paged_attention(**a)
    cpu = [t.cpu() for t in a.values()]
    oracle = reference.paged_attention(*cpu)
    lowp = reference.paged_attention(*cpu, compute_dtype=torch.bfloat16)
    assert_low_precision_close(out, oracle, lowp)


@pytest.mark.mla
def test_mla_decode_bf16_is_right(device):
    a = _mla(device, torch.bfloat16)
    out = mla_decode(**a)
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in a.items()}
    oracle, _ = reference.mla_decode(**cpu)
    lowp, _ = reference.mla_decode(**cpu, compute_dtype=torch.bfloat16)
    assert_low_precision_close(out, oracle, lowp)


# -- the softmax scale --------------------------------------------------------------------------

MAX_SCALE = torch.finfo(torch.float32).max / 1.4426950408889634  # scale * log2(e) fits fp32
_SCALE_RULE = re.escape(
    f"scale must be a finite float in (0, {MAX_SCALE:.4g}] (the kernels take scale * "
    "log2(e) in fp32)"
)


@pytest.mark.cpu
@pytest.mark.paged
@pytest.mark.mla
# an int or Fraction past float's range: OverflowError from math.isfinite before
@pytest.mark.parametrize("scale", [1e300, 2.4e38, float("inf"), 0.0, True, 10**400,
                                   Fraction(10**400, 3)])  # fmt: skip
def test_every_op_refuses_a_scale_past_fp32_by_one_rule(scale):
    kind = TypeError if isinstance(scale, bool) else ValueError  # a bool is no number
    rule = "scale must be a real number" if kind is TypeError else _SCALE_RULE
    with pytest.raises(kind, match=r"^paged_attention: " + rule):
        paged_attention(**_paged(), scale=scale)
    with pytest.raises(kind, match=r"^mla_decode: " + rule):
        mla_decode(**{**_mla(), "scale": scale})


@pytest.mark.paged
@pytest.mark.mla
def test_a_large_valid_scale_is_right(device):
    """A peaked softmax (scale 1e3): both ops agree with the fp64 reference."""
    a = _paged(device)
    out = paged_attention(**a, scale=1e3)
    assert rel_err(out, reference.paged_attention(*(t.cpu() for t in a.values()), scale=1e3)) < 1e-4
    m = {**_mla(device), "scale": 1e3}
    want, _ = reference.mla_decode(**{k: v.cpu() if isinstance(v, torch.Tensor) else v
                                      for k, v in m.items()})  # fmt: skip
    assert rel_err(mla_decode(**m), want) < 1e-4


# -- overlapping writes -------------------------------------------------------------------------


def _view_of(t: torch.Tensor, shape) -> torch.Tensor:
    """A contiguous ``shape`` view of ``t``'s first elements."""
    n = 1
    for s in shape:
        n *= s
    return t.reshape(-1)[:n].view(shape)


@pytest.mark.cpu
@pytest.mark.paged
def test_paged_out_in_the_cache_is_refused():
    a = _paged()
    before = a["key_cache"].clone()
    out = _view_of(a["key_cache"], a["query"].shape)
    with pytest.raises(ValueError, match=r"^paged_attention: out must not overlap key_cache"):
        paged_attention(**a, out=out)
    with pytest.raises(ValueError, match=r"out must not overlap query"):
        paged_attention(**a, out=a["query"])
    assert torch.equal(a["key_cache"], before)


@pytest.mark.cpu
@pytest.mark.paged
def test_paged_trace_in_an_input_is_refused():
    """The sm_90 prefill kernel stamps ``trace``: it was not held to the overlap rule of what an
    op writes (mla_decode's was), so a view of the block table was taken."""
    a = _paged()
    table = a["block_table"].to(torch.int64)
    a["block_table"] = table
    rule = r"^paged_attention: trace must not overlap block_table \(trace is written\)"
    with pytest.raises(ValueError, match=rule):
        paged_attention(**a, trace=table.reshape(-1))
    with pytest.raises(ValueError, match=r"trace must not overlap itself"):
        paged_attention(**a, trace=torch.zeros(1, dtype=torch.int64).expand(8))


@pytest.mark.cpu
@pytest.mark.mla
def test_mla_out_in_the_cache_is_refused():
    a = _mla()
    before = a["kv_cache"].clone()
    out = _view_of(a["kv_cache"], (3, 2, R))
    with pytest.raises(ValueError, match=r"^mla_decode: out must not overlap kv_cache"):
        mla_decode(**a, out=out)
    assert torch.equal(a["kv_cache"], before)


@pytest.mark.cpu
@pytest.mark.paged
def test_gather_outputs_that_overlap_are_refused():
    k_cache, v_cache = (torch.randn(NUM_BLOCKS, BS, HKV, D) for _ in range(2))
    before = k_cache.clone()
    table, cu = _paged()["block_table"], _i32(0, 6, 15)
    own = torch.empty(15, HKV, D)
    cases = {
        r"out\[0\] must not overlap key_cache": (_view_of(k_cache, (15, HKV, D)), own),
        r"out\[0\] must not overlap out\[1\]": (own, own),
        r"out\[1\] must not overlap itself": (own, torch.empty(HKV, D).expand(15, HKV, D)),
    }
    for match, out in cases.items():
        with pytest.raises(ValueError, match=r"^gather_kv_cache: " + match):
            gather_kv_cache(k_cache, v_cache, table, cu, out=out)
    assert torch.equal(k_cache, before)


@pytest.mark.cpu
@pytest.mark.paged
def test_write_targets_that_overlap_are_refused():
    """key_cache is value_cache (K would be lost), K/V views of one buffer that share
    blocks, a stride-0 cache, and a cache that holds the tokens it is given."""
    key, value = (torch.randn(3, HKV, D) for _ in range(2))
    slots = torch.tensor([0, 5, 9])
    cache = torch.randn(NUM_BLOCKS, BS, HKV, D)
    buf = torch.randn(NUM_BLOCKS + 2, BS, HKV, D)
    one_block = torch.randn(1, BS, HKV, D).expand(NUM_BLOCKS, -1, -1, -1)
    cases = [
        ((cache, cache), "key_cache must not overlap value_cache"),
        ((buf[:NUM_BLOCKS], buf[2:]), "key_cache must not overlap value_cache"),
        ((one_block, cache), r"key_cache must not overlap itself \(it is written\); got shape "
                             r"\(8, 4, 2, 16\), strides \(0, 32, 16, 1\)"),
        ((cache, torch.randn(NUM_BLOCKS, BS, HKV, D)), None),  # fine
    ]  # fmt: skip
    for (kc, vc), match in cases:
        before = kc.clone(), vc.clone()
        if match is None:
            write_kv_cache(key, value, kc, vc, slots)
            continue
        with pytest.raises(ValueError, match=r"^write_kv_cache: " + match):
            write_kv_cache(key, value, kc, vc, slots)
        assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
    tokens = _view_of(cache, (3, HKV, D))
    with pytest.raises(ValueError, match=r"key_cache must not overlap key"):
        write_kv_cache(tokens, value, cache, torch.randn_like(cache), slots)


@pytest.mark.paged
@pytest.mark.parametrize("layout", ["NHD", "SHUFFLE"])
def test_interleaved_caches_are_not_overlaps(layout, device):
    """A hybrid model's K and V pages interleaved in one buffer, and query/out as halves of one
    row: they share a buffer but no element, and are accepted."""
    h = make_hybrid_cache(
        NUM_BLOCKS, BS * 2, HKV, D, layout=layout, dtype=torch.float16, device=device,
        mamba_state_bytes=64,
    )  # fmt: skip
    kc, vc = h.key_cache, h.value_cache
    assert _checks.overlap_errors([("key_cache", kc), ("value_cache", vc)], []) == []
    key, value = (torch.randn(3, HKV, D, device=device).half() for _ in range(2))
    write_kv_cache(key, value, kc, vc, torch.tensor([0, 9, 17], device=device), layout=layout)
    row = torch.randn(3, 2 * HQ, D, device=device).half()
    query, out = row[:, :HQ], row[:, HQ:]
    assert _checks.overlap_errors([("out", out)], [("query", query)]) == []
    assert _checks.overlap_errors([("out", row[:, 1 : HQ + 1])], [("query", query)]) != []


@pytest.mark.cpu
@pytest.mark.paged
def test_overlap_rule():
    """`_checks.disjoint`/`overlaps_itself`: ranges, periods, strides."""
    buf = torch.zeros(64)
    assert _checks.disjoint(buf[:32], buf[32:]) and not _checks.disjoint(buf[:33], buf[32:])
    pages = buf.view(4, 16)
    assert _checks.disjoint(pages[:, :8], pages[:, 8:])  # interleaved halves of each page
    assert not _checks.disjoint(pages[:, :9], pages[:, 8:])
    assert _checks.disjoint(pages[:, ::2], pages[:, 1::2])  # even and odd elements
    assert not _checks.disjoint(pages[:, ::2], pages[:, 2::2])
    assert _checks.overlaps_itself(torch.zeros(4).expand(3, 4))
    assert _checks.overlaps_itself(buf.as_strided((4, 4), (3, 1)))
    assert not _checks.overlaps_itself(buf.as_strided((4, 4), (1, 4)))
    assert not _checks.overlaps_itself(pages.t())
    assert _checks.disjoint(torch.zeros(0), buf) and _checks.disjoint(buf, torch.zeros(4))


def _bytes_of(t: torch.Tensor) -> set[int]:
    """Every byte address ``t``'s elements cover."""
    es, base = t.element_size(), t.data_ptr()
    idx = torch.zeros((), dtype=torch.int64)
    for n, stride in zip(t.shape, t.stride(), strict=True):
        idx = idx.unsqueeze(-1) + torch.arange(n) * stride
    return {base + es * int(i) + b for i in idx.flatten().tolist() for b in range(es)}


_VIEW = st.tuples(
    st.integers(0, 40),  # storage offset
    st.lists(st.tuples(st.integers(1, 4), st.integers(0, 24)), min_size=1, max_size=3),
)


@pytest.mark.cpu
@pytest.mark.paged
@settings(max_examples=400, deadline=None)
@given(_VIEW, _VIEW)
def test_overlap_rule_against_the_bytes(a, b):
    """`disjoint` never calls views that share a byte disjoint, and `overlaps_itself` never
    misses a shared byte, for any sizes and strides (0 included) of views of one buffer."""
    buf = torch.zeros(512)
    va, vb = (
        buf.as_strided([n for n, _ in dims], [s for _, s in dims], offset)
        for offset, dims in (a, b)
    )
    if _checks.disjoint(va, vb):
        assert not _bytes_of(va) & _bytes_of(vb)
    for v in (va, vb):
        if not _checks.overlaps_itself(v):
            assert len(_bytes_of(v)) == v.numel() * v.element_size()


@pytest.mark.cpu
@pytest.mark.paged
def test_a_cached_plan_refuses_an_overlapping_call():
    """The plan cache skips validation on a hit: an ``out`` that is a view of the cache, of the
    first call's description, must still be refused (key lookup and probe alike)."""
    cache = PlanCache()
    a = _paged()

    def call(out):
        inputs = (*a.values(), out)
        key = call_key("paged_attention", *inputs, None, "NHD", None, 2, None)
        scalars = ("guard", "paged_attention")
        plan = lambda: plan_paged_attention(  # noqa: E731
            *a.values(), out=out, max_query_len=2, check_contents=False
        )
        return cache.call(key, inputs, plan, (scalars, inputs)), scalars, inputs

    (out,), scalars, _ = call(torch.empty_like(a["query"]))
    assert rel_err(out, _paged_reference(a)) < 1e-5
    (out,), _, _ = call(torch.empty_like(a["query"]))  # a hit
    assert cache.hits == 1
    before = a["key_cache"].clone()
    inside = _view_of(a["key_cache"], a["query"].shape)
    assert cache.probe(scalars, (*a.values(), inside), (*a.values(), inside)) is None
    with pytest.raises(ValueError, match=r"^paged_attention: out must not overlap key_cache"):
        call(inside)
    assert torch.equal(a["key_cache"], before) and cache.hits == 1


@pytest.mark.gpu
@pytest.mark.paged
def test_gpu_cached_call_refuses_an_overlapping_out():
    a = _paged("cuda", torch.float16)
    for _ in range(3):  # planned, then hits
        paged_attention(**a, out=torch.empty_like(a["query"]), max_query_len=2)
    inside = _view_of(a["key_cache"], a["query"].shape)
    before = a["key_cache"].clone()
    with pytest.raises(ValueError, match=r"out must not overlap key_cache"):
        paged_attention(**a, out=inside, max_query_len=2)
    assert torch.equal(a["key_cache"], before)


# -- page expansion: slots stay in int64 --------------------------------------------------------


@pytest.mark.cpu
@pytest.mark.paged
@pytest.mark.specdec
@pytest.mark.parametrize("num_indices", [None, 3])
def test_expand_refuses_slots_past_int64(num_indices):
    table = torch.tensor([[2**62]], dtype=torch.int64)
    limit = 2**63 // 4
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"expand_page_indices: block_table entries of used blocks must be < 2**63 // "
            f"block_size = {limit}"
        ),
    ):
        expand_page_indices(table, torch.tensor([3]), 4, num_indices=num_indices)
    # the largest block id that fits: its last slot is 2**63 - 1
    top = torch.tensor([[limit - 1]], dtype=torch.int64)
    _, indices = expand_page_indices(top, torch.tensor([4]), 4)
    assert indices.tolist() == [(limit - 1) * 4 + t for t in range(4)]
    assert indices.tolist()[-1] == 2**63 - 1
    # a 2**62-token block: block 1 holds slots 2**62 .. 2**63 - 1
    _, indices = expand_page_indices(torch.tensor([[1]]), torch.tensor([3]), 2**62)
    assert indices.tolist() == [2**62, 2**62 + 1, 2**62 + 2]


@pytest.mark.cpu
@pytest.mark.paged
@pytest.mark.specdec
@pytest.mark.parametrize("num_indices", [None, 0])
@pytest.mark.parametrize("num_seqs", [2, 4])
def test_expand_refuses_a_total_past_int64(num_seqs, num_indices):
    """Each length fits its row, but their sum does not fit int64 (numpy's sum wraps to a
    negative or zero total)."""
    table = torch.zeros(num_seqs, 1, dtype=torch.int64)
    lens = torch.full((num_seqs,), 2**62)
    total = num_seqs * 2**62
    rule = (
        f"sum(seq_lens) must be <= 2**63 - 1 (int64 offsets); got {total}"
        if num_indices is None
        else f"num_indices must equal sum(seq_lens)={total}; got 0"
    )
    with pytest.raises(ValueError, match=re.escape(f"expand_page_indices: {rule}")):
        expand_page_indices(table, lens, 2**62, num_indices=num_indices)


@pytest.mark.cpu
@pytest.mark.paged
@pytest.mark.mla
@pytest.mark.parametrize("target", ["sm_90", ["sm_90"], 90])
@pytest.mark.parametrize(
    "op", ["paged_attention", "mla_decode", "write_kv_cache", "gather_kv_cache",
           "expand_page_indices"],
)  # fmt: skip
def test_a_target_that_is_not_a_target_is_named(op, target):
    """An arch name or anything else where a `Target` belongs: a TypeError naming the op and
    the argument (an AttributeError from deep in a policy before)."""
    a, m = _paged(), _mla()
    kc, vc = a["key_cache"], a["value_cache"]
    calls = {
        "paged_attention": lambda: paged_attention(**a, target=target),
        "mla_decode": lambda: mla_decode(**m, target=target),
        "write_kv_cache": lambda: write_kv_cache(
            torch.randn(1, HKV, D), torch.randn(1, HKV, D), kc, vc, _i32(0), target=target
        ),
        "gather_kv_cache": lambda: gather_kv_cache(
            kc, vc, a["block_table"], _i32(0, 6, 15), target=target
        ),  # fmt: skip
        "expand_page_indices": lambda: expand_page_indices(
            a["block_table"], a["seq_lens"], BS, target=target
        ),
    }
    with pytest.raises(TypeError, match=rf"^{op}: target must be a portattn Target or None"):
        calls[op]()


@pytest.mark.cpu
@pytest.mark.paged
def test_a_lazily_negated_tensor_is_refused_not_read_unnegated():
    """``z.conj().imag`` is a real tensor whose memory holds ``+imag`` under torch's negation
    bit: a kernel would read the values un-negated. Refused by name, and never a cache key."""
    z = torch.complex(torch.randn(3, HKV, D), torch.randn(3, HKV, D))
    neg = z.conj().imag
    assert neg.is_neg()
    kc, vc = (torch.zeros(NUM_BLOCKS, BS, HKV, D) for _ in range(2))
    ok = torch.randn(3, HKV, D)
    write_kv_cache(ok, ok, kc, vc, _i32(0, 1, 2))  # the description is planned and cached
    with pytest.raises(ValueError, match=r"^write_kv_cache: key must not carry torch's lazy "
                       r"negation or conjugation bit"):  # fmt: skip
        write_kv_cache(neg, ok, kc, vc, _i32(0, 1, 2))
    assert call_key("write_kv_cache", neg) is None
    write_kv_cache(neg.resolve_neg(), ok, kc, vc, _i32(0, 1, 2))
    assert torch.equal(kc[0, :3], -z.imag)
    # index tensors too (only torch's private _neg_view sets the bit on ints): their values are
    # read for the checks (numpy refused the bit: a RuntimeError before), then the launch refuses
    a = _paged()
    a["seq_lens"] = torch._neg_view(-a["seq_lens"])
    with pytest.raises(ValueError, match=r"^paged_attention: seq_lens must not carry torch's"):
        paged_attention(**a)


def _lazy(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values under torch's negation bit: the memory holds ``-t``."""
    return torch._neg_view(-t)


#: The ops `_lazy_calls` calls, each tensor argument in turn replaced.
TENSOR_OPS = ["paged_attention", "mla_decode", "write_kv_cache", "gather_kv_cache",
              "expand_page_indices"]  # fmt: skip


def _lazy_calls() -> dict:
    """Per op, its tensor arguments by name and a call taking them (``out`` as a pair for
    gather)."""
    a, m = _paged(), _mla()
    kc, vc = a["key_cache"], a["value_cache"]
    return {
        "paged_attention": (
            {**a, "out": torch.empty_like(a["query"])},
            lambda t: paged_attention(**t),
        ),
        "mla_decode": (
            {k: v for k, v in m.items() if isinstance(v, torch.Tensor)},
            lambda t: mla_decode(**t, kv_lora_rank=R, scale=0.1),
        ),
        "write_kv_cache": (
            dict(
                key=torch.randn(2, HKV, D),
                value=torch.randn(2, HKV, D),
                key_cache=kc.clone(),
                value_cache=vc.clone(),
                slot_mapping=_i32(0, 1),
            ),
            lambda t: write_kv_cache(**t),
        ),  # fmt: skip
        "gather_kv_cache": (
            dict(
                key_cache=kc,
                value_cache=vc,
                block_table=a["block_table"],
                cu_seq_lens=_i32(0, 6, 15),
                out0=torch.empty(15, HKV, D),
                out1=torch.empty(15, HKV, D),
            ),
            lambda t: gather_kv_cache(
                t["key_cache"],
                t["value_cache"],
                t["block_table"],
                t["cu_seq_lens"],
                out=(t["out0"], t["out1"]),
            ),
        ),  # fmt: skip
        "expand_page_indices": (
            dict(block_table=a["block_table"], seq_lens=a["seq_lens"]),
            lambda t: expand_page_indices(t["block_table"], t["seq_lens"], BS),
        ),
    }


@pytest.mark.cpu
@pytest.mark.paged
@pytest.mark.mla
@pytest.mark.parametrize("op", TENSOR_OPS)
def test_every_tensor_argument_under_a_lazy_bit_is_refused_by_its_name(op):
    """Each op, each tensor argument in turn under the negation bit (same values, the memory
    negated): a ValueError naming that argument, before anything runs; the call without the
    bit runs."""
    tensors, call = _lazy_calls()[op]
    call(tensors)
    for name in tensors:
        shown = {"out0": "out[0]", "out1": "out[1]"}.get(name, name)
        with pytest.raises(ValueError, match=rf"^{op}: .*{re.escape(shown)} must not carry "
                           r"torch's lazy negation"):  # fmt: skip
            call({**tensors, name: _lazy(tensors[name])})


@pytest.mark.cpu
@pytest.mark.paged
@pytest.mark.mla
@pytest.mark.parametrize("op", TENSOR_OPS)
def test_every_tensor_argument_that_is_not_strided_is_refused_by_its_name(op):
    """Each op, each tensor argument in turn as a sparse tensor (no strides, no storage: the
    checks and kernels could not read it): a TypeError naming that argument and its layout,
    before anything runs, with the plan of the strided call cached."""
    tensors, call = _lazy_calls()[op]
    call(tensors)
    for name in tensors:
        shown = {"out0": "out[0]", "out1": "out[1]"}.get(name, name)
        t = tensors[name]
        for sparse in (t.to_sparse(), *([t.to_sparse_csr()] if t.dim() == 2 else [])):
            with pytest.raises(TypeError, match=rf"^{op}: {re.escape(shown)} must be a strided "
                               rf"\(dense\) tensor; got layout {sparse.layout}$"):  # fmt: skip
                call({**tensors, name: sparse})


@pytest.mark.cpu
@pytest.mark.mla
def test_the_builder_refuses_a_sparse_seq_lens():
    from portattn.mla_metadata import MlaMetadataBuilder
    from portattn.platform import get_target

    builder = MlaMetadataBuilder(get_target("sm_90"), max_batch=2, num_heads=HQ, kv_lora_rank=R,
                                 head_dim_k=DK, dtype=torch.float32, device="cpu",
                                 max_seq_len=16)  # fmt: skip
    with pytest.raises(TypeError, match=r"^MlaMetadataBuilder.build: seq_lens must be a strided"):
        builder.build(_i32(*SEQ_LENS).to_sparse())


# -- errors: every problem at once, the right argument, meta tensors ----------------------------


@pytest.mark.cpu
@pytest.mark.paged
@pytest.mark.mla
def test_one_error_lists_type_and_value_problems():
    a = _paged()
    with pytest.raises(TypeError) as info:
        paged_attention(**{**a, "query": [1.0], "seq_lens": _i32(6)}, scale=-1.0, out="x")
    msg = str(info.value)
    for part in ("query must be a torch.Tensor", "out must be a torch.Tensor or None",
                 "seq_lens must be 1-D [num_seqs=2]", "scale must be a finite float"):  # fmt: skip
        assert part in msg, msg
    m = _mla()
    with pytest.raises(TypeError) as info:
        mla_decode(**{**m, "seq_lens": m["seq_lens"].float(), "kv_lora_rank": 999})
    assert "seq_lens must be an int32/int64" in str(info.value)
    assert "kv_lora_rank must be in 1..head_dim_k=80; got 999" in str(info.value)
    kc, vc = empty_kv_cache(NUM_BLOCKS, BS, HKV, D, dtype=torch.float32)
    with pytest.raises(TypeError) as info:
        write_kv_cache([0], torch.zeros(3, HKV, 8), kc, vc, torch.zeros(3, 1))
    msg = str(info.value)
    parts = ("key must be a torch.Tensor; got list", "value must be [num_tokens, 2, 16]",
             "slot_mapping dtype must be int32 or int64", "slot_mapping must be 1-D")  # fmt: skip
    for part in parts:
        assert part in msg, msg
    with pytest.raises(TypeError) as info:
        gather_kv_cache(kc, vc, a["block_table"].float(), _i32(0, 6), out=(None, kc))
    msg = str(info.value)
    for part in (
        "block_table dtype must be int32 or int64",
        "cu_seq_lens must have num_seqs + 1",
        "out[0] must be a torch.Tensor; got NoneType",
        "out[1] must be [total_tokens",
    ):
        assert part in msg, msg
    with pytest.raises(TypeError) as info:
        expand_page_indices(a["block_table"], [6, 9], 0, num_indices=-1)
    msg = str(info.value)
    for part in ("seq_lens must be a torch.Tensor; got list", "block_size must be an int in [1, ",
                 "num_indices must be in [0, "):  # fmt: skip
        assert part in msg, msg


@pytest.mark.cpu
@pytest.mark.mla
def test_mla_names_itself_when_no_tile_fits_the_call():
    """fp32 at a 512-wide latent fits no gfx942 tile: the op's name leads the policy's reason
    (it led with the policy's own name); fp16 at that width plans; a latent past 512 is refused
    the same way."""
    gfx942 = portattn.platform.get_target("gfx942")
    meta = dict(device="meta")
    table = torch.empty(1, 1, dtype=torch.int32, **meta)
    lens = torch.empty(1, dtype=torch.int32, **meta)
    q, cache = torch.empty(1, 1, 576, **meta), torch.empty(2, 2, 576, **meta)
    with pytest.raises(ValueError, match=r"^mla_decode: mla_decode_tiles: no tile fits gfx942's "
                       r".*kv_lora_rank=512, head_dim_k=576, 4-byte elements.*use a 2-byte "
                       r"dtype$"):  # fmt: skip
        mla_decode(q, cache, table, lens, kv_lora_rank=512, scale=0.1, target=gfx942)
    out = mla_decode(q.half(), cache.half(), table, lens, kv_lora_rank=512, scale=0.1,
                     target=gfx942)  # fmt: skip
    assert out.shape == (1, 1, 512)
    wide = torch.empty(2, 2, 2048, **meta, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"^mla_decode: mla_decode_tiles: kv_lora_rank must be "
                       r"<= 512 .*; got 2048$"):  # fmt: skip
        mla_decode(torch.empty(1, 1, 2048, **meta, dtype=torch.float16), wide, table, lens,
                   kv_lora_rank=2048, scale=0.1, target=gfx942)  # fmt: skip


@pytest.mark.cpu
@pytest.mark.mla
def test_mla_refuses_an_empty_batch_by_seq_lens_alone():
    """A [0, n] block table agrees with an empty batch: it was blamed too, with a rule its
    shape met ("must be [num_seqs=0, ...]; got shape (0, 1)")."""
    m = _mla()
    empty = dict(query=m["query"][:0], block_table=m["block_table"][:0], seq_lens=m["seq_lens"][:0],
                 query_start_loc=m["query_start_loc"][:1])  # fmt: skip
    with pytest.raises(ValueError, match=r"^mla_decode: seq_lens must be 1-D with >= 1 sequence; "
                       r"got shape \(0,\)$"):  # fmt: skip
        mla_decode(**{**m, **empty})


@pytest.mark.cpu
@pytest.mark.mla
def test_mla_blames_a_short_seq_lens():
    m = _mla()
    with pytest.raises(ValueError) as info:
        mla_decode(**{**m, "seq_lens": m["seq_lens"][:1]})
    msg = str(info.value)
    assert "seq_lens must have one entry per sequence (num_seqs=2); got shape (1,)" in msg
    assert "block_table must" not in msg and "query_start_loc must" not in msg, msg


@pytest.mark.cpu
@pytest.mark.paged
@pytest.mark.mla
@pytest.mark.specdec
def test_meta_tensors_give_their_outputs_shapes():
    meta = lambda d: {k: v.to("meta") if isinstance(v, torch.Tensor) else v  # noqa: E731
                      for k, v in d.items()}  # fmt: skip
    out = paged_attention(**meta(_paged()))
    assert out.is_meta and out.shape == (3, HQ, D)
    out = mla_decode(**meta(_mla()))
    assert out.is_meta and out.shape == (3, 2, R)
    kc, vc = empty_kv_cache(NUM_BLOCKS, BS, HKV, D, dtype=torch.float32, device="meta")
    k = torch.empty(3, HKV, D, device="meta")
    write_kv_cache(k, k, kc, vc, torch.zeros(3, dtype=torch.int64, device="meta"))
    table, cu = _paged("meta")["block_table"], _i32(0, 6, 15).to("meta")
    outs = (torch.empty(15, HKV, D, device="meta"), torch.empty(15, HKV, D, device="meta"))
    assert gather_kv_cache(kc, vc, table, cu, out=outs)[0] is outs[0]
    indptr, indices = expand_page_indices(table, _i32(6, 9).to("meta"), BS, num_indices=15)
    assert indptr.is_meta and indices.shape == (15,)


# -- 32-bit offsets and positions ---------------------------------------------------------------


def _strided(t: torch.Tensor, dim: int, stride: int) -> torch.Tensor:
    """A meta tensor of ``t``'s shape and dtype whose ``dim`` has ``stride`` (no memory: the
    checks read shapes and strides only)."""
    strides = list(t.stride())
    strides[dim] = stride
    return torch.empty_strided(t.shape, strides, dtype=t.dtype, device="meta")


#: (op, argument, dim, stride): a view whose offsets along ``dim`` pass 2**31 elements (seq_lens
#: has two entries here, so no stride below 2**31 takes it there).
REACH_CASES = [
    ("paged_attention", "query", 2, 2**28),
    ("paged_attention", "out", 2, 2**28),
    ("paged_attention", "key_cache", 1, 2**30),
    ("paged_attention", "value_cache", 3, 2**28),
    ("paged_attention", "block_table", 1, 2**30),
    ("paged_attention", "query_start_loc", 0, 2**30),
    ("mla_decode", "query", 1, 2**31 - 1),
    ("mla_decode", "out", 2, 2**26),
    ("mla_decode", "kv_cache", 2, 2**28),
    ("mla_decode", "block_table", 1, 2**30),
    ("mla_decode", "query_start_loc", 0, 2**30),
]


@pytest.mark.cpu
@pytest.mark.paged
@pytest.mark.mla
@pytest.mark.parametrize(("op", "name", "dim", "stride"), REACH_CASES)
def test_a_view_past_32_bit_offsets_is_refused_by_name(op, name, dim, stride):
    """The kernels compute these offsets as 32-bit index x stride products: a view reaching
    2**31 elements there is refused (it wrapped, and the kernel read or wrote outside the
    tensor), before anything runs."""
    a = _paged("meta") if op == "paged_attention" else _mla("meta")
    a = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in a.items()}
    if name == "out":
        shape = (3, HQ, D) if op == "paged_attention" else (3, 2, R)
        a["out"] = torch.empty(shape, device="meta")
    a[name] = _strided(a[name], dim, stride)
    fn = paged_attention if op == "paged_attention" else mla_decode
    with pytest.raises(ValueError, match=re.escape(f"{op}: {name}'s elements along ")) as err:
        fn(**a)
    assert "within 2**31 - 1 elements of the first (the kernels offset them in 32 bits)" in str(
        err.value
    )


@pytest.mark.cpu
@pytest.mark.paged
def test_32_bit_reach_boundary():
    """A block-table row reaching 2**31 - 1 elements is taken; one more element is refused."""
    a = {k: v.to("meta") for k, v in _paged().items()}
    a["block_table"] = torch.empty_strided((2, 2), (1, 2**31 - 1), dtype=torch.int32,
                                           device="meta")  # fmt: skip
    assert paged_attention(**a).shape == (3, HQ, D)
    a["block_table"] = torch.empty_strided((2, 2), (1, 2**31), dtype=torch.int32, device="meta")
    assert paged_attention(**a).shape == (3, HQ, D)  # a stride past int32 is passed as 64-bit
    a["block_table"] = torch.empty_strided((2, 3), (1, 2**30), dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match=re.escape("got shape (2, 3), strides (1, 1073741824): "
                                                   "2147483648 elements")):  # fmt: skip
        paged_attention(**a)


@pytest.mark.cpu
@pytest.mark.mla
def test_mla_takes_one_page_past_2_31_elements():
    """mla_decode's kernels offset a cache row by its block and token in 64 bits: one page of
    2**22 tokens x 576 (past 2**31 elements) is taken; only a row's dim term is bounded."""
    cache = torch.empty(1, 2**22, 576, dtype=torch.float16, device="meta")
    q = torch.empty(2, 16, 576, dtype=torch.float16, device="meta")
    table = torch.zeros(2, 1, dtype=torch.int32, device="meta")
    lens = torch.empty(2, dtype=torch.int32, device="meta")
    out = mla_decode(q, cache, table, lens, kv_lora_rank=512, scale=0.05)
    assert out.shape == (2, 16, 512)


@pytest.mark.cpu
@pytest.mark.mla
def test_mla_reads_a_cache_of_2_31_blocks_or_tokens_right():
    """The descriptor (TMA) path's shape and coordinates are 32-bit: on a cache of 2**31 blocks
    it read the wrong rows (relative error 0.65, no error raised) even for small block ids, and
    a page of 2**31 tokens failed inside Triton. Such caches take the gather path, whose block
    and token terms are 64-bit. Stride-0 views: every block holds the same values, so the fp64
    reference reads a 100-block copy."""
    torch.manual_seed(0)
    bs, dk, r = 64, 80, 64
    page = torch.randn(1, bs, dk).half()
    q = torch.randn(2, 2, dk).half()
    table, lens = torch.tensor([[5, 7], [60, 0]]), torch.tensor([70, 30])
    want, _ = reference.mla_decode(q, page.expand(100, bs, dk), table, lens, kv_lora_rank=r,
                                   scale=0.1)  # fmt: skip
    for blocks, tma in ((2**31 - 1, True), (2**31, False), (2**32 + 5, False)):
        a = dict(query=q, kv_cache=page.expand(blocks, bs, dk), block_table=table,
                 seq_lens=lens, kv_lora_rank=r, scale=0.1)  # fmt: skip
        assert plan_mla_decode(**a)[0].args["TMA"] is tma, blocks
        got = mla_decode(**a)
        assert ((got.double() - want).norm() / want.norm()).item() < 2e-3, blocks
    row = torch.randn(1, 1, dk).half()
    long = row.expand(2, 2**31, dk)  # one page of 2**31 tokens
    want, _ = reference.mla_decode(q, row.expand(2, 128, dk), torch.tensor([[0], [1]]), lens,
                                   kv_lora_rank=r, scale=0.1)  # fmt: skip
    got = mla_decode(q, long, torch.tensor([[0], [1]]), lens, kv_lora_rank=r, scale=0.1)
    assert ((got.double() - want).norm() / want.norm()).item() < 2e-3


@pytest.mark.cpu
@pytest.mark.paged
def test_paged_refuses_seq_lens_and_blocks_past_32_bit_positions():
    """paged_attention's kernels hold positions in 32 bits: a seq_len of 2**31 (which fits a
    2-column row of 2**31-token blocks) and a block of 2**31 tokens are refused by name."""
    k = torch.empty_strided((2, 2**31, HKV, D), (D * HKV, 0, D, 1), device="meta")
    a = dict(query=torch.empty(1, HQ, D), key_cache=k, value_cache=k,
             block_table=torch.zeros(1, 2, dtype=torch.int64),
             seq_lens=torch.tensor([2**31]), query_start_loc=torch.tensor([0, 1]))  # fmt: skip
    with pytest.raises(ValueError, match=re.escape("block_size must be < 2**31")):
        paged_attention(**{n: t.to("meta") for n, t in a.items()})
    k = torch.zeros(2, 1, HKV, D).expand(2, 2**30, HKV, D)
    a.update(key_cache=k, value_cache=k, block_table=torch.zeros(1, 3, dtype=torch.int64))
    rule = "seq_lens must be < 2**31 - 2**16 = 2147418112 (the kernel counts positions in 32 bits"
    whole = f"{rule}, up to 2**16 past a sequence's end); got seq_lens[0]=2147483648"
    with pytest.raises(ValueError, match=re.escape(whole)):
        paged_attention(**a)
    # Just below 2**31 the kernels' arithmetic past the end wrapped: NaN, not an error.
    for dtype in (torch.int32, torch.int64):
        a.update(seq_lens=torch.tensor([2**31 - 2**16], dtype=dtype))
        with pytest.raises(ValueError, match=re.escape(f"{rule}, up to 2**16 past")):
            paged_attention(**a)
        with pytest.raises(ValueError, match=re.escape("max_seq_len must be < 2**31 - 2**16")):
            paged_attention(**a, max_query_len=1, max_seq_len=2**31 - 1)


@pytest.mark.cpu
@pytest.mark.mla
def test_mla_refuses_int32_seq_lens_whose_positions_would_wrap():
    """mla_decode counts positions in the seq_lens' dtype: int32 seq_lens within 2**16 of 2**31
    came out as zeros with lse -inf (every split empty); int64 ones are counted in 64 bits."""
    cache = torch.zeros(1, 1, 576).expand(2**15, 2**16, 576)  # 2**31 tokens of one row
    q = torch.zeros(1, 16, 576)
    table = torch.zeros(1, 2**15, dtype=torch.int32)
    lens = torch.tensor([2**31 - 31], dtype=torch.int32)
    with pytest.raises(ValueError, match=re.escape(
        "seq_lens must be < 2**31 - 2**16 = 2147418112 (the kernel counts positions in 32 bits, "
        "up to 2**16 past a sequence's end); got seq_lens[0]=2147483617"
    )):  # fmt: skip
        mla_decode(q, cache, table, lens, kv_lora_rank=512, scale=0.05)
