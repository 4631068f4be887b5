"""The plan cache (kernels/_plans.py): a cached plan is never stale.

The rule under test: two calls with the same key get the same plan except for the tensors that
fill its pointer slots. On the CPU this is checked plan by plan (`Plan.bind` of one call's plan
with another call's tensors against that call's own fresh plan, argument by argument, TMA
descriptors included, from meta tensors), key by key (every property a plan depends on changes
the key), and by running cached plans through the interpreter against the fp64 oracle. On a GPU
the public ops run their cached plans through the compiled kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import os
import re
import types
import weakref

import pytest
import torch

from portattn import reference
from portattn.kernels import _plans
from portattn.kernels import mla_decode as mla_module
from portattn.kernels._checks import Disjoint, reads_contents, tensor_reads_contents
from portattn.kernels._launch import Launch
from portattn.kernels._plans import (
    PLANS,
    CheckMemo,
    Plan,
    PlanCache,
    Uncacheable,
    call_key,
    describe,
    present,
)
from portattn.kernels.kv_cache import (
    gather_kv_cache,
    plan_gather_kv_cache,
    plan_write_kv_cache,
    write_kv_cache,
)
from portattn.kernels.mla_decode import _metadata_key, mla_decode, plan_mla_decode
from portattn.kernels.paged_attention import paged_attention, plan_paged_attention
from portattn.layout import empty_kv_cache
from portattn.mla_metadata import MlaMetadataBuilder
from portattn.platform import get_target, set_target_override, target_override
from portattn.policy.mla import MlaConfig
from tests.kernels.test_mla_decode import check as mla_check
from tests.kernels.test_mla_decode import make_inputs
from tests.kernels.test_paged_attention import check, make_batch

pytestmark = [pytest.mark.paged, pytest.mark.mla]

SEQS = ((37, 1), (21, 4), (9, 2))


def _assert_same_plan(bound, fresh, inputs) -> None:
    """``bound`` (from `Plan.bind`) equals the ``fresh`` launches: input tensors by identity,
    allocated buffers by shape/dtype/strides (one buffer stays one buffer across launches),
    descriptors field by field, everything else by type and value."""
    ids = {id(t) for t in inputs if t is not None}
    allocs: dict[int, int] = {}

    def same(a, b, where):
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor), where
            if id(b) in ids or b.numel() == 0:
                assert a is b or (b.numel() == 0 and a.numel() == 0), where
            else:
                assert id(a) not in ids, f"{where}: an input reused as a buffer"
                meta = lambda t: (t.shape, t.dtype, t.stride(), t.device)  # noqa: E731
                assert meta(a) == meta(b), where
                assert allocs.setdefault(id(b), id(a)) == id(a), f"{where}: buffers mixed up"
        elif dataclasses.is_dataclass(b) and isinstance(getattr(b, "base", None), torch.Tensor):
            assert type(a) is type(b), where
            for f in dataclasses.fields(b):
                if f.name == "base":
                    same(a.base, b.base, f"{where}.base")
                else:
                    assert getattr(a, f.name) == getattr(b, f.name), f"{where}.{f.name}"
        else:
            assert type(a) is type(b) and a == b, f"{where}: {a!r} != {b!r}"

    lists, _ = bound
    assert len(lists) == len(fresh)
    for args, launch in zip(lists, fresh, strict=True):
        names = [n for n, _ in launch._params()]
        assert len(args) == len(names)
        for name, a in zip(names, args, strict=True):
            same(a, launch.args[name], f"{launch.name}.{name}")


def _replayed(plan_fn, call_a, call_b):
    """(Plan of call A bound to call B's inputs, call B's fresh launches, B's inputs)."""
    inputs_a, launches_a = call_a(plan_fn)
    inputs_b, launches_b = call_b(plan_fn)
    assert describe(inputs_a) == describe(inputs_b)  # the same description: the same key
    return Plan(launches_a, inputs_a).bind(inputs_b), launches_b, inputs_b


# -- Plan.bind == a fresh plan, op by op -----------------------------------------------------


def _paged_call(seed, *, out=False, layout="NHD", **kw):
    b = make_batch(SEQS, block_size=8, heads=(8, 2), head_dim=32, dtype=torch.float32,
                   layout=layout, seed=seed)  # fmt: skip
    o = torch.empty_like(b.query) if out else None

    def call(plan_fn):
        inputs = (*b.args(), o)
        launches = plan_fn(*b.args(), layout=layout, out=o, check_contents=False, **kw)
        return inputs, launches

    return call


@pytest.mark.parametrize(
    "kw",
    [
        dict(max_query_len=4),
        dict(max_query_len=4, out=True),
        dict(max_query_len=4, layout="SHUFFLE"),
        dict(max_query_len=1, max_seq_len=40),  # decode bound: split-KV, reduce, workspaces
        dict(max_query_len=4, target=get_target("gfx942")),
    ],
    ids=["nhd", "out", "shuffle", "split", "gfx942"],
)
def test_paged_plan_replays_exactly(kw):
    if kw.get("max_seq_len"):  # one sequence, long bound: the policy splits it
        b1 = make_batch(((37, 1),), block_size=8, heads=(8, 2), head_dim=32, dtype=torch.float32)
        b2 = make_batch(((37, 1),), block_size=8, heads=(8, 2), head_dim=32, dtype=torch.float32,
                        seed=5)  # fmt: skip
        kw = dict(kw, max_seq_len=1 << 16)

        def mk(b):
            return lambda f: ((*b.args(), None), f(*b.args(), check_contents=False, **kw))

        bound, fresh, inputs = _replayed(plan_paged_attention, mk(b1), mk(b2))
        assert [x.name for x in fresh] == ["paged_attention", "paged_attention:reduce"]
    else:
        bound, fresh, inputs = _replayed(
            plan_paged_attention, _paged_call(0, **kw), _paged_call(1, **kw)
        )
    _assert_same_plan(bound, fresh, inputs)


def _sm90_prefill_call(seed):
    """A prefill batch for sm_90's Gluon kernel (meta tensors): its TMA descriptors are the
    caches' and, with the query by TMA, the query's."""
    b = make_batch(((300, 100), (50, 1), (200, 64)), block_size=16, heads=(32, 8), head_dim=128,
                   dtype=torch.bfloat16, seed=seed)  # fmt: skip
    args = tuple(t.to("meta") for t in b.args())

    def call(plan_fn):
        launches = plan_fn(*args, target=get_target("sm_90"), max_query_len=100,
                           max_seq_len=300, check_contents=False)  # fmt: skip
        return (*args, None), launches

    return call


def test_sm90_prefill_plan_rebuilds_the_query_descriptor():
    """A cached plan of the sm_90 prefill kernel bound to a later call's tensors: the query's
    TMA descriptor (the producer loads the query rows) is rebuilt around the new query, as the
    caches' are; a plan that kept the first call's would read a freed query."""
    bound, fresh, inputs = _replayed(
        plan_paged_attention, _sm90_prefill_call(0), _sm90_prefill_call(1)
    )
    (main,) = [x for x in fresh if x.name == "paged_prefill_sm90"]
    assert main.args["Q_TMA"] is True and main.args["q_desc"].base is inputs[0]
    _assert_same_plan(bound, fresh, inputs)


def _mla_call(seed, device="cpu", *, heads=16, metadata=False, page_indices=False, out=False,
              lse=False, arch="sm_90"):  # fmt: skip
    dk, r, bs = 320, 256, 64
    q, cache, bt, sl, qsl = make_inputs(dk, r, heads, bs, (1, 3), (200, 90), torch.float16, "cpu",
                                        seed=seed)  # fmt: skip
    if device == "meta":
        q, cache, bt, sl, qsl = (t.to("meta") for t in (q, cache, bt, sl, qsl))
    md = None
    target = get_target(arch)
    if metadata:
        builder = MlaMetadataBuilder(target, max_batch=4, num_heads=heads, kv_lora_rank=r,
                                     head_dim_k=dk, dtype=q.dtype, device=device,
                                     max_query_len=4, max_seq_len=4096)  # fmt: skip
        md = builder.build(sl, qsl, max_query_len=3)
    pages = None
    if page_indices:
        indptr, indices = reference.expand_page_indices(bt, sl, bs)
        pages = (indptr.to(torch.int32), indices.to(torch.int32))
        bt = None
    o = torch.empty(q.shape[0], heads, r, dtype=q.dtype, device=q.device) if out else None

    def call(plan_fn):
        launches = plan_fn(q, cache, bt, sl, kv_lora_rank=r, scale=0.1, query_start_loc=qsl,
                           out=o, return_lse=lse, page_indices=pages, metadata=md,
                           target=target, check_contents=False)  # fmt: skip
        work = (md.partial_out, md.partial_lse) if md is not None else (None, None)
        indptr, indices = pages if pages is not None else (None, None)
        return (q, cache, bt, sl, qsl, o, indptr, indices, *work), launches

    return call


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(metadata=True, lse=True),
        dict(page_indices=True, out=True),
        # bulk-copy tiles: Triton's TMA descriptors are rebuilt (sm_100: 16 heads x 3 tokens
        # would pack into sm_90's 64-row tile)
        dict(device="meta", arch="sm_100"),
        dict(device="meta", heads=64),  # sm_90's Gluon kernel, its own descriptors
        dict(device="meta", heads=64, metadata=True, lse=True),
        dict(device="meta", packed=True),  # 3 tokens x 16 heads packed: sm_90's Gluon kernel
    ],
    ids=[
        "block_table", "metadata_lse", "pages_out", "meta_tma", "meta_sm90", "meta_sm90_md",
        "meta_sm90_packed",
    ],
)  # fmt: skip
def test_mla_plan_replays_exactly(kw):
    packed = kw.pop("packed", False)
    bound, fresh, inputs = _replayed(plan_mla_decode, _mla_call(0, **kw), _mla_call(1, **kw))
    if kw.get("device") == "meta":
        want = "mla_decode_sm90" if kw.get("heads") == 64 or packed else "mla_decode"
        assert fresh[0].name == want
        assert sum(hasattr(v, "base") for v in fresh[0].args.values()) == 2  # descriptors
    _assert_same_plan(bound, fresh, inputs)


@pytest.mark.parametrize("layout", ["NHD", "SHUFFLE"])
def test_kv_cache_plans_replay_exactly(layout):
    def write(seed):
        g = torch.Generator().manual_seed(seed)
        kc, vc = empty_kv_cache(6, 8, 2, 16, layout=layout, dtype=torch.float16)
        k, v = (torch.randn(5, 2, 16, generator=g).half() for _ in range(2))
        slots = torch.randperm(48, generator=g)[:5]
        return lambda f: ((k, v, kc, vc, slots), f(k, v, kc, vc, slots, layout=layout))

    _assert_same_plan(*_replayed(plan_write_kv_cache, write(0), write(1)))

    def gather(seed):
        kc, vc = empty_kv_cache(6, 8, 2, 16, layout=layout, dtype=torch.float16)
        table = torch.randperm(6, generator=torch.Generator().manual_seed(seed)).view(2, 3)
        cu = torch.tensor([0, 10, 17])
        out = (torch.empty(17, 2, 16, dtype=torch.float16), torch.empty(17, 2, 16).half())
        return lambda f: ((kc, vc, table, cu, *out), f(kc, vc, table, cu, layout=layout, out=out))

    _assert_same_plan(*_replayed(plan_gather_kv_cache, gather(0), gather(1)))


# -- the direct launch == Triton's launcher, argument by argument -----------------------------


class _Recorder:
    """A stand-in for Triton's C launcher: a callable that is no Python function (as the C
    launcher is not), recording each call's arguments."""

    def __init__(self):
        self.calls: list[tuple] = []

    def __call__(self, *args):
        self.calls.append(args)


class _StandIn:
    """A compiled kernel's stand-in around Triton's real `CudaLauncher` Python (its ``__call__``
    and, with TMA descriptors, its descriptor wrapper, passing them decomposed) and a
    `_Recorder` where the C launcher would be."""

    def __init__(self, launch, recorder):
        from triton.backends.nvidia.driver import CudaLauncher, wrap_handle_tensordesc

        names = [n for n, _ in launch._params()]
        sig = {i: "tensordesc<fp32[16, 16]>" if hasattr(launch.args[n], "base") else "*fp32"
               for i, n in enumerate(names)}  # fmt: skip
        run = object.__new__(CudaLauncher)
        run.launch = wrap_handle_tensordesc(recorder, sig, None)
        run.num_ctas = 1
        run.global_scratch_size = run.profile_scratch_size = 0
        run.global_scratch_align = run.profile_scratch_align = 1
        run.launch_cooperative_grid, run.launch_pdl = False, True
        self.run = run
        self.function = 12345
        self.packed_metadata = (4, 1, 1024)


def _direct_vs_triton(call_a, call_b, plan_fn, monkeypatch):
    """Plan of call A run for call B's inputs twice, each time into the recorder where Triton's C
    launcher would be: directly (`_DirectLaunch`) and through `CompiledKernel.run` (Triton's
    `CudaLauncher`), on the same buffers and stream; the two calls must be equal, tensors as
    their addresses in the direct one. (`Plan.bind` == a fresh plan is checked above.)"""
    inputs_a, launches_a = call_a(plan_fn)
    inputs_b, launches_b = call_b(plan_fn)
    assert describe(inputs_a) == describe(inputs_b)
    plan = Plan(launches_a, inputs_a)
    _assert_same_plan(plan.bind(inputs_b), launches_b, inputs_b)
    recorder = _Recorder()
    plan.keep_compiled([_StandIn(launch, recorder) for launch in launches_a])
    assert plan._direct is not None and len(plan._direct) == len(launches_a)
    allocs = plan._allocate()
    monkeypatch.setattr(plan, "_allocate", lambda: allocs)
    monkeypatch.setattr(_plans._Bound, "stream", lambda device: 777)
    outs_direct = plan.run(inputs_b)
    direct, recorder.calls = recorder.calls, []
    # the addresses a probe read, handed over: the same argument lists
    ptrs = tuple(None if t is None else t.data_ptr() for t in inputs_b)
    assert all(a is b for a, b in zip(plan.run(inputs_b, ptrs), outs_direct, strict=True))
    assert recorder.calls == direct
    recorder.calls = []
    outs_triton = plan._run_compiled(inputs_b, allocs)
    triton_calls = recorder.calls
    assert all(a is b for a, b in zip(outs_direct, outs_triton, strict=True))
    assert len(direct) == len(triton_calls) == len(launches_a)
    for got, want in zip(direct, triton_calls, strict=True):
        assert len(got) == len(want)
        assert got[3] == 777  # the stream
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            if isinstance(b, torch.Tensor):
                if b.numel() == 0:  # a zero-size placeholder: a constant of the plan
                    assert a is b, i
                else:
                    assert type(a) is int and a == b.data_ptr(), i
            else:
                assert type(a) is type(b) and a == b, f"{i}: {a!r} != {b!r}"
    return direct


@pytest.mark.parametrize("case", ["nhd", "out", "split", "shuffle"])
def test_paged_direct_launch_equals_triton(case, monkeypatch):
    if case == "split":
        kw = dict(max_query_len=1, max_seq_len=1 << 16)

        def mk(seed):
            b = make_batch(((37, 1),), block_size=8, heads=(8, 2), head_dim=32,
                           dtype=torch.float32, seed=seed)  # fmt: skip
            return lambda f: ((*b.args(), None), f(*b.args(), check_contents=False, **kw))

        a, b = mk(0), mk(5)
    else:
        kw = dict(
            max_query_len=4, out=case == "out", layout="SHUFFLE" if case == "shuffle" else "NHD"
        )
        a, b = _paged_call(0, **kw), _paged_call(1, **kw)
    calls = _direct_vs_triton(a, b, plan_paged_attention, monkeypatch)
    assert len(calls) == (2 if case == "split" else 1)  # split-KV: the reduce launched directly too


@pytest.mark.parametrize(
    "kw",
    [
        dict(metadata=True, lse=True),  # split over the kv splits: main + reduce
        dict(page_indices=True, out=True),
        dict(device="meta"),  # TMA descriptors (passed decomposed by the stand-in)
        dict(device="meta", heads=64, metadata=True, lse=True),  # sm_90's Gluon kernel
    ],
    ids=["metadata_lse", "pages_out", "meta_tma", "meta_sm90_md"],
)
def test_mla_direct_launch_equals_triton(kw, monkeypatch):
    _direct_vs_triton(_mla_call(0, **kw), _mla_call(1, **kw), plan_mla_decode, monkeypatch)


def test_direct_launch_refuses_other_launchers():
    b = make_batch(SEQS, block_size=8, heads=(8, 2), head_dim=32, dtype=torch.float32)
    launches = plan_paged_attention(*b.args(), max_query_len=4, check_contents=False)
    plan = Plan(launches, (*b.args(), None))
    (replay,) = plan._replays
    good = _StandIn(launches[0], _Recorder())
    assert isinstance(_plans._DirectLaunch(replay, good), _plans._DirectLaunch)
    wrapped = _StandIn(launches[0], _Recorder())
    wrapped.run.launch = lambda *args: None  # a Python wrapper: unknown work per launch
    scratch = _StandIn(launches[0], _Recorder())
    scratch.run.global_scratch_size = 64  # Triton allocates per launch
    other = _StandIn(launches[0], _Recorder())
    other.run = types.SimpleNamespace(**vars(other.run))  # not a CudaLauncher (HIP's, say)
    for kernel in (wrapped, scratch, other):
        with pytest.raises(Uncacheable):
            _plans._DirectLaunch(replay, kernel)
        plan.keep_compiled([kernel])
        assert plan._direct is None  # launched through CompiledKernel.run instead
    plan.keep_compiled([None])  # interpreted
    assert plan._direct is None


def test_allocations_keep_their_shapes():
    plan = Plan([], ())
    plan._allocs = [
        _plans._empty((), torch.float32, torch.device("cpu")),
        _plans._empty((2, 3), torch.int32, torch.device("meta")),
    ]
    a, b = plan._allocate()
    assert (a.shape, a.dtype, a.device.type) == ((), torch.float32, "cpu")
    assert (b.shape, b.dtype, b.device.type) == ((2, 3), torch.int32, "meta")


# -- the key: every property a plan depends on changes it --------------------------------------


def test_key_changes_with_everything_a_plan_reads():
    b = make_batch(SEQS, block_size=8, heads=(8, 2), head_dim=32, dtype=torch.float32)
    t = b.args()

    def key(*tensors, scale=None, layout="NHD", target=None, mql=4, msl=None):
        return call_key("paged_attention", *tensors, None, scale, layout, target, mql, msl)

    base = key(*t)
    same = make_batch(SEQS, block_size=8, heads=(8, 2), head_dim=32, dtype=torch.float32, seed=9)
    assert key(*same.args()) == base  # other values, same description: the same plan
    q = t[0]
    wide = torch.empty(q.shape[0], q.shape[1], q.shape[2] + 8)[:, :, :32]
    flat = torch.empty(q.numel() + 1)
    variants = {
        "shape": (q[:-1],) + t[1:],
        "strides": (wide,) + t[1:],
        "dtype": (q.half(),) + t[1:],
        "device": (q.to("meta"),) + t[1:],
        "alignment": (flat[1:].view(q.shape),) + t[1:],
        "table dtype": t[:3] + (t[3].long(),) + t[4:],
        "table strides": t[:3] + (t[3].t().contiguous().t(),) + t[4:],
    }
    keys = {name: key(*args) for name, args in variants.items()}
    keys["scale"] = key(*t, scale=0.5)
    keys["scale 1 vs 1.0"] = key(*t, scale=1)
    assert key(*t, scale=1) != key(*t, scale=1.0)
    keys["layout"] = key(*t, layout="SHUFFLE")
    keys["target"] = key(*t, target=get_target("gfx942"))
    keys["max_query_len True vs 1"] = key(*t, mql=True)
    assert key(*t, mql=1) != key(*t, mql=True)
    keys["max_seq_len"] = key(*t, msl=64)
    set_target_override("gfx950")
    try:
        keys["override"] = key(*t)
    finally:
        set_target_override(None)
    for name, k in keys.items():
        assert k is not None and k != base, name
    assert len(set(keys.values())) == len(keys)


def test_key_follows_the_target_variable(monkeypatch):
    t = make_batch(SEQS, block_size=8, heads=(8, 2), head_dim=32, dtype=torch.float32).args()
    monkeypatch.delenv("PORTATTN_TARGET", raising=False)
    base = call_key("paged_attention", *t, None, None, "NHD", None, 4, None)
    keys = []
    for arch in ("gfx942", "sm_90", "gfx942"):
        monkeypatch.setenv("PORTATTN_TARGET", arch)
        assert target_override() == arch
        keys.append(call_key("paged_attention", *t, None, None, "NHD", None, 4, None))
    assert base not in keys and keys[0] != keys[1] and keys[0] == keys[2]
    set_target_override("gfx942")  # the override wins over the variable, as in current_target
    try:
        assert call_key("paged_attention", *t, None, None, "NHD", None, 4, None) not in keys
    finally:
        set_target_override(None)
    monkeypatch.delenv("PORTATTN_TARGET")
    assert call_key("paged_attention", *t, None, None, "NHD", None, 4, None) == base
    monkeypatch.setattr(os, "environ", {"PORTATTN_TARGET": "gfx942"})  # a replaced mapping
    assert target_override() == "gfx942"
    assert call_key("paged_attention", *t, None, None, "NHD", None, 4, None) not in (base, *keys)


def test_unhashable_keys_run_uncached():
    cache = PlanCache()
    key = call_key("op", torch.zeros(2), exact=([1],))  # described, but a list in ``exact``
    assert key is not None
    runs = []
    for _ in range(2):
        cache.call(key, (), lambda: runs.append(1) or [])
    assert len(runs) == 2 and len(cache) == 0


def test_tensor_reads_contents_rule():
    for device in ("cpu", "meta"):
        t = torch.empty(1, device=device)
        for vouched in (True, False):
            assert tensor_reads_contents(t, vouched) == reads_contents(t.device, vouched)


def test_undescribable_arguments_are_not_cached():
    assert call_key("op", object()) is None
    assert call_key("op", [torch.zeros(1), {"a": 1}]) is None
    with pytest.raises(Exception, match="cannot describe"):
        describe({1: 2})


# -- running cached plans (interpreter on CPU) --------------------------------------------------


@pytest.mark.cpu
def test_cached_plans_run_correctly_on_new_tensors():
    cache = PlanCache()

    def run(b, **kw):
        inputs = (*b.args(), None)
        key = call_key("paged_attention", *inputs, None, b.layout, None, 4, None)
        plan = lambda: plan_paged_attention(*b.args(), layout=b.layout, max_query_len=4)  # noqa: E731
        (out,) = cache.call(key, inputs, plan)
        check(b, out)
        return out

    b1 = make_batch(SEQS, block_size=8, heads=(8, 2), head_dim=32, dtype=torch.float32)
    out1 = run(b1)
    assert (cache.hits, cache.misses, len(cache)) == (0, 1, 1)
    b2 = make_batch(SEQS, block_size=8, heads=(8, 2), head_dim=32, dtype=torch.float32, seed=3)
    out2 = run(b2)  # hit: b2's tensors, a fresh output buffer
    assert (cache.hits, cache.misses) == (1, 1) and out2.data_ptr() != out1.data_ptr()
    b3 = make_batch(SEQS, block_size=8, heads=(8, 2), head_dim=32, dtype=torch.float32, seed=4,
                    strided_query=True, kind="slice")  # fmt: skip
    run(b3)  # other strides: a miss, planned afresh
    assert (cache.hits, cache.misses, len(cache)) == (1, 2, 2)


@pytest.mark.cpu
def test_failing_calls_are_not_cached():
    cache = PlanCache()

    def bad():
        raise ValueError("op: query must be ...")

    for _ in range(2):
        with pytest.raises(ValueError, match="query must be"):
            cache.call(("k",), (), bad)
    assert len(cache) == 0 and cache.misses == 2


def test_plan_keeps_no_input_alive():
    b = make_batch(SEQS, block_size=8, heads=(8, 2), head_dim=32, dtype=torch.float32)
    launches = plan_paged_attention(*b.args(), max_query_len=1, max_seq_len=1 << 16,
                                    check_contents=False)  # fmt: skip
    plan = Plan(launches, (*b.args(), None))
    refs = [weakref.ref(t) for t in (*b.args(), launches[0].outputs[0])]
    del b, launches
    gc.collect()
    assert all(r() is None for r in refs) and plan is not None


def test_oldest_plan_dropped():
    cache = PlanCache(max_plans=2)
    for k in "abac":
        cache.call((k,), (), lambda: [])
    assert list(cache._plans) == [("b",), ("c",)] and (cache.hits, cache.misses) == (1, 3)


# -- MLA's metadata in the key: numbered once per object, checked every call --------------------


def test_exact_id_numbers_values(monkeypatch):
    monkeypatch.setattr(_plans, "_EXACT", {})
    a = _plans.exact_id((1, "x", torch.float16))
    assert _plans.exact_id((1, "x", torch.float16)) == a  # equal values, equal numbers
    b = _plans.exact_id((2, "x", torch.float16))
    assert b != a
    assert _plans.exact_id(([1],)) is None  # unhashable: not cached
    monkeypatch.setattr(_plans, "MAX_EXACT", 2)
    c = _plans.exact_id((3,))  # the table is emptied; numbers are never given again
    assert _plans.exact_id((1, "x", torch.float16)) not in (a, b, c)


def test_plan_cache_hit_only_runs_replayable_plans():
    cache = PlanCache()
    assert cache.hit(None, ()) is None and cache.hit(("k",), ()) is None  # no key; none yet
    assert cache.hit(([1],), ()) is None  # unhashable
    cache.call(("k",), (), lambda: [])
    assert cache.hit(("k",), ()) == () and cache.hits == 1  # an empty plan: nothing launched
    cache._plans[("u",)] = None  # known not to be replayable: the caller plans afresh
    assert cache.hit(("u",), ()) is None and cache.hits == 1
    off = PlanCache(enabled=False)
    off.call(("k",), (), lambda: [])
    assert off.hit(("k",), ()) is None and len(off) == 0


def _meta_mla(max_seq_len, seqs=4):
    """An MLA decode step on meta tensors (cacheable: nothing to read) and its builder."""
    dk, r, heads, bs = 576, 512, 16, 64
    cache = torch.empty(seqs * 64, bs, dk, dtype=torch.bfloat16, device="meta")
    table = torch.empty(seqs, 64, dtype=torch.int32, device="meta")
    builder = MlaMetadataBuilder(get_target("sm_90"), max_batch=seqs, num_heads=heads,
                                 kv_lora_rank=r, head_dim_k=dk, dtype=torch.bfloat16,
                                 device="meta", max_seq_len=max_seq_len)  # fmt: skip

    def call(md, n=seqs, **kw):
        q = torch.empty(n, heads, dk, dtype=torch.bfloat16, device="meta")
        sl = torch.empty(n, dtype=torch.int32, device="meta")
        return mla_decode(q, cache, table[:n], sl, kv_lora_rank=r, scale=0.05, metadata=md, **kw)

    def build(n=seqs):
        return builder.build(torch.empty(n, dtype=torch.int32, device="meta"))

    return call, build


@pytest.fixture
def no_launch(monkeypatch):
    """Plans built and replayed, nothing launched (meta tensors)."""
    monkeypatch.setattr(Launch, "run", lambda self: None)
    monkeypatch.setattr(Plan, "run", lambda self, inputs, ptrs=None: self.bind(inputs)[1])
    PLANS.clear()
    yield
    PLANS.clear()


@pytest.mark.parametrize("max_seq_len", [256, 4096], ids=["one_split", "split"])
def test_mla_metadata_hits_by_value(max_seq_len, no_launch):
    call, build = _meta_mla(max_seq_len)
    md = build()
    split = md.tiles.num_kv_splits > 1
    assert split == (max_seq_len == 4096)
    exact, po, pl = _metadata_key(md)
    # one split: the plan never reads the workspaces, so they are not described
    assert (po, pl) == ((md.partial_out, md.partial_lse) if split else (None, None))
    call(md)
    call(md)
    assert (PLANS.hits, PLANS.misses) == (1, 1)
    md2 = build()  # a new object with the same values: same number, a hit
    assert md2 is not md and _metadata_key(md2)[0] == exact
    call(md2)
    assert (PLANS.hits, PLANS.misses) == (2, 1)
    md3 = build(3)  # other values (3 sequences): another number, a miss
    assert _metadata_key(md3)[0] != exact
    call(md3, 3)
    assert (PLANS.hits, PLANS.misses) == (2, 2)
    # the same values with other tiles (a 2-split variant): a miss, and its own workspaces
    tiles = dataclasses.replace(md.tiles, num_kv_splits=2 if not split else 1)
    md4 = dataclasses.replace(md, tiles=tiles)
    assert _metadata_key(md4)[0] != exact
    assert (_metadata_key(md4)[1] is None) == split


def test_mla_config_is_part_of_the_key(no_launch):
    """A passed `MlaConfig` is described by value: it is in the key, equal configs share a plan
    (the probe's too), another config or none is another plan."""
    assert describe(MlaConfig(store_smem=True)) == MlaConfig(store_smem=True)
    call, build = _meta_mla(4096)
    md = build()
    call(md)
    call(md)
    assert (PLANS.hits, PLANS.misses) == (1, 1)
    call(md, config=MlaConfig(store_smem=True))
    call(md, config=MlaConfig(store_smem=True))  # an equal object: a hit
    assert (PLANS.hits, PLANS.misses) == (2, 2)
    call(md, config=MlaConfig(store_smem=False))
    assert (PLANS.hits, PLANS.misses) == (2, 3)
    keys = list(PLANS._plans)
    assert [MlaConfig(store_smem=True) in k for k in keys] == [False, True, False]
    assert [MlaConfig(store_smem=False) in k for k in keys] == [False, False, True]


def test_mla_metadata_memo_checks_values(no_launch):
    call, build = _meta_mla(4096)
    md = build()
    exact = _metadata_key(md)[0]
    # an object whose id a collected metadata had, with other values: numbered afresh
    stale = (("other",), exact + 1000, False)
    mla_module._METADATA_MEMO[id(md)] = stale
    assert _metadata_key(md) == (exact, md.partial_out, md.partial_lse)
    # a field changed behind the frozen dataclass: the values are compared on every call
    object.__setattr__(md, "num_seqs", 3)
    assert _metadata_key(md)[0] != exact
    object.__setattr__(md, "num_seqs", 4)
    assert _metadata_key(md)[0] == exact


def test_mla_split_workspaces_stay_in_the_key(no_launch):
    call, build = _meta_mla(4096)
    md = build()
    call(md)
    t = md.tiles
    bad = torch.empty(md.max_tokens, t.num_kv_splits, t.padded_heads, t.block_dv + 1,
                      dtype=torch.float32, device="meta")  # fmt: skip
    with pytest.raises(ValueError, match="metadata.partial_out must be fp32"):
        call(dataclasses.replace(md, partial_out=bad))  # another shape: planned, validated
    md.partial_lse.as_strided_(md.partial_lse.shape, (1, 1, 1))  # changed in place: a miss
    call(md)
    assert (PLANS.hits, PLANS.misses) == (0, 3) and len(PLANS) == 2


# -- the public ops on a GPU: compiled kernels launched from cached plans -----------------------


@pytest.mark.gpu
def test_gpu_paged_attention_cached_calls():
    PLANS.clear()
    for layout in ("NHD", "SHUFFLE"):
        outs = []
        for seed in range(3):
            b = make_batch(SEQS, block_size=16, heads=(8, 2), head_dim=64, dtype=torch.bfloat16,
                           layout=layout, device="cuda", seed=seed)  # fmt: skip
            out = paged_attention(*b.args(), layout=layout, max_query_len=4)
            check(b, out)
            outs.append(out.data_ptr())
        assert len(set(outs)) == 3  # a fresh output per call, never the previous one
        b = make_batch(SEQS, block_size=16, heads=(8, 2), head_dim=64, dtype=torch.bfloat16,
                       layout=layout, device="cuda", seed=7, strided_query=True)  # fmt: skip
        given = torch.empty_like(b.query)
        assert paged_attention(*b.args(), layout=layout, max_query_len=4, out=given) is given
        check(b, given)
    assert PLANS.hits >= 4 and PLANS.misses == 4
    # a profiler's launch hook still sees cached launches
    from triton import knobs

    seen = []
    hook = lambda meta: seen.append(meta.get()["name"])  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        check(b, paged_attention(*b.args(), layout="SHUFFLE", max_query_len=4, out=given))
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert seen == ["_paged_attention_kernel"]
    # a split-KV decode (two launches, fp32 workspaces) cached
    for seed in range(2):
        b = make_batch(((3000, 1),), block_size=16, heads=(8, 2), head_dim=64,
                       dtype=torch.bfloat16, device="cuda", seed=seed)  # fmt: skip
        check(b, paged_attention(*b.args(), max_query_len=1, max_seq_len=4096))


def test_unbounded_call_plans_as_the_call_bounded_by_what_it_read(device):
    """A call without maxima launches exactly what the call bounded by its metadata's maxima
    (`unbounded_maxima`: the longest q_len, `plan_max_seq_len` of the longest seq_len) does, so a
    GPU's unbounded call can take that call's cached plan."""
    from portattn.kernels.paged_attention import unbounded_maxima

    for seqs in (SEQS, ((3000, 1), (17, 1)), ((5, 5), (1100, 1))):
        b = make_batch(seqs, block_size=16, heads=(8, 2), head_dim=64, dtype=torch.float32,
                       device=device)  # fmt: skip
        mql, msl, _ = unbounded_maxima(*b.args(), None, None, "NHD", None, None)
        assert mql == max(q for _, q in seqs) and msl >= max(n for n, _ in seqs)
        for target in ("sm_90", "gfx942"):
            t = get_target(target)
            free = plan_paged_attention(*b.args(), target=t)
            bound = plan_paged_attention(*b.args(), target=t, max_query_len=mql,
                                         max_seq_len=msl, check_contents=False)  # fmt: skip
            assert [(a.kernel, a.grid, a.options) for a in free] == [
                (a.kernel, a.grid, a.options) for a in bound
            ]
            for a, c in zip(free, bound, strict=True):
                scalars = {k: v for k, v in a.args.items() if not isinstance(v, torch.Tensor)}
                assert scalars == {
                    k: v for k, v in c.args.items() if not isinstance(v, torch.Tensor)
                }
    # the values are checked as ever: a bad entry is named
    b = make_batch(SEQS, block_size=16, heads=(8, 2), head_dim=64, dtype=torch.float32,
                   device=device)  # fmt: skip
    b.block_table[0, 0] = 10**6
    with pytest.raises(ValueError, match=r"block_table entries of used blocks must be in"):
        unbounded_maxima(*b.args(), None, None, "NHD", None, None)


def test_prepare_launches_only_when_called(device):
    """`PlanCache.prepare`: the guarded plan made ready for a call's inputs (buffers, argument
    lists), launched only when the callable is called; ``None`` where `probe` would find none
    (another description, an overlapping write)."""
    kw = dict(block_size=8, heads=(8, 2), head_dim=32, dtype=torch.float32, device=device)
    bounds = dict(max_query_len=4, max_seq_len=40)
    b = make_batch(SEQS, **kw)
    out = torch.empty_like(b.query)
    inputs = (*b.args(), out)
    launches = plan_paged_attention(*b.args(), out=out, check_contents=False, **bounds)
    plan = Plan(launches, inputs)
    plan.keep_compiled([launch.run() for launch in launches])
    cache = PlanCache()
    guard = ("paged", 4, 40)
    cache._keep_guard((guard, inputs), inputs, plan)
    b2 = make_batch(SEQS, seed=7, **kw)
    out2 = torch.full_like(b2.query, 7.0)
    inputs2 = (*b2.args(), out2)
    hits = cache.hits
    ready = cache.prepare(guard, inputs2, inputs2)
    assert ready is not None and cache.hits == hits + 1
    assert bool((out2 == 7.0).all())  # nothing launched yet
    (got,) = ready()
    assert got is out2
    check(b2, out2)
    assert cache.prepare(("paged", 4, 41), inputs2, inputs2) is None  # another description
    over = (*b2.args(), b2.query)  # out is the query: the plan's validation would refuse it
    assert cache.prepare(guard, over, over) is None


@pytest.mark.parametrize("op", ["paged_attention", "mla_decode"])
def test_unbounded_prepares_for_the_last_calls_bounds(op, device, monkeypatch):
    """An unbounded call asks ``prepare`` for the bounds its description's last call read, before
    its wait, and hands that back only when its own bounds are the same; a call with other bounds,
    and broken metadata, get nothing back (the latter still raises by name)."""
    from portattn.kernels import mla_decode as mla_mod
    from portattn.kernels import paged_attention as paged_mod
    from portattn.policy.paged import plan_max_seq_len

    asked = []

    def prepare(bounds):
        asked.append(bounds)
        return ("ready", bounds)

    if op == "paged_attention":  # one description; the metadata's values change in place
        monkeypatch.setattr(paged_mod, "_CHECKED", CheckMemo())
        b = make_batch(((3000, 1), (40, 1)), block_size=16, heads=(8, 2), head_dim=64,
                       dtype=torch.float32, device=device)  # fmt: skip
        values, table = b.seq_lens, b.block_table
        steps = [(300, 40), (301, 41), (3000, 40), (2999, 40)]
        bounds = [(1, plan_max_seq_len(n)) for n in (300, 301, 3000, 2999)]

        def call():
            got = paged_mod.unbounded_maxima(*b.args(), None, None, "NHD", None, None, prepare)
            return got.ready, tuple(got[:2])
    else:
        monkeypatch.setattr(mla_mod, "_CHECKED", CheckMemo())
        q, cache, table, sl, values = make_inputs(576, 512, 2, 64, (2, 2), (300, 40),
                                                  torch.float32, device)  # fmt: skip
        steps = [(0, 2, 4), (0, 2, 4), (0, 3, 4), (0, 1, 4)]  # query_start_loc
        bounds = [2, 2, 3, 3]

        def call():
            return tuple(reversed(mla_mod.unbounded_query_len(
                q, cache, table, sl, 512, 0.07, values, None, None, False, None, prepare
            )))  # fmt: skip

    assert bounds[0] == bounds[1] and bounds[2] == bounds[3] != bounds[1]
    for i, step in enumerate(steps):
        values.copy_(torch.tensor(step))
        ready, got = call()
        assert got == bounds[i]
        assert asked == bounds[:i]  # the last call's bounds, asked for from the second on
        assert ready == (None if i in (0, 2) else ("ready", bounds[i]))
    table[0, 0] = 10**6
    with pytest.raises(ValueError, match=r"block_table entries of used blocks must be in"):
        call()
    assert asked[-1] == bounds[-1] and len(asked) == len(steps)


def test_check_memo_matches_description_scalars_and_overlap():
    """`CheckMemo` stands in for the argument checks only where they would pass again: the same
    scalars, tensors with the same dtype, device, sizes and strides, and a write that overlaps
    no input at this call's addresses."""
    memo = CheckMemo()
    a, out = torch.zeros(4, 8), torch.empty(4, 8)
    inputs = (a, None, out)
    mask, tensors = present(inputs)
    memo.keep(("x", mask), tensors, inputs, (2,), "checked")
    b, out2 = torch.ones(4, 8), torch.empty(4, 8)
    assert memo.get(("x", mask), (b, out2), (b, None, out2)) == "checked"  # new tensors, same kind
    assert memo.get(("y", mask), (b, out2), (b, None, out2)) is None  # other scalars
    wide = torch.ones(4, 16)[:, :8]  # other strides
    assert memo.get(("x", mask), (wide, out2), (wide, None, out2)) is None
    assert memo.get(("x", mask), (b.half(), out2), (b.half(), None, out2)) is None  # dtype
    assert memo.get(("x", mask), (b, b), (b, None, b)) is None  # the write is the input now
    assert memo.get(([],), (b, out2), (b, None, out2)) is None  # an unhashable scalar: no memo


def test_unbounded_checks_run_again_for_an_overlapping_out(device, monkeypatch):
    """An unbounded call checks a description's arguments once (`CheckMemo`), yet is still
    refused when its ``out`` overlaps an input at this call's addresses, by the same message."""
    from portattn.kernels import paged_attention as paged_module

    checks = []
    real = paged_module._check_call
    monkeypatch.setattr(paged_module, "_check_call", lambda *a: checks.append(1) or real(*a))
    monkeypatch.setattr(paged_module, "_CHECKED", CheckMemo())
    unbounded_maxima = paged_module.unbounded_maxima
    b = make_batch(SEQS, block_size=16, heads=(8, 2), head_dim=64, dtype=torch.float32,
                   device=device)  # fmt: skip
    for _ in range(3):
        out = torch.empty_like(b.query)
        unbounded_maxima(*b.args(), out, None, "NHD", None, None)
    assert len(checks) == 1
    with pytest.raises(ValueError, match=r"out must not overlap query"):
        unbounded_maxima(*b.args(), b.query, None, "NHD", None, None)
    with pytest.raises(ValueError, match=r"out must not overlap query"):
        paged_attention(*b.args(), out=b.query)


@pytest.mark.parametrize("q_lens", [None, (1, 3, 2), (4, 4)])
@pytest.mark.parametrize("form", ["block_table", "page_indices"])
def test_unbounded_mla_call_plans_as_the_call_of_the_query_len_it_read(q_lens, form, device):
    """`mla_decode` without metadata launches exactly what the plan for the longest q_len it read
    (`unbounded_query_len`, no further read) launches, so a GPU's such call can be cached under
    that length; bad values are still named."""
    from portattn.kernels.mla_decode import unbounded_query_len
    from portattn.kernels.page_indices import expand_page_indices

    seq_lens = (300, 40, 90)[: 3 if q_lens is None else len(q_lens)]
    cases = ((torch.float16, "sm_90"), (torch.float16, "gfx942"), (torch.float32, "sm_80"))
    for dtype, arch in cases:
        q, cache, bt, sl, qsl = make_inputs(576, 512, 16, 64, q_lens, seq_lens, dtype, device)
        kw = dict(kv_lora_rank=512, scale=0.07, query_start_loc=qsl, target=get_target(arch))
        if form == "page_indices":
            kw["page_indices"] = expand_page_indices(bt, sl, 64)
            bt = None
        longest, _ = unbounded_query_len(q, cache, bt, sl, 512, 0.07, qsl, None,
                                         kw.get("page_indices"), False, None)  # fmt: skip
        assert longest == (1 if q_lens is None else max(q_lens))
        free = plan_mla_decode(q, cache, bt, sl, **kw)
        bound = plan_mla_decode(q, cache, bt, sl, **kw, check_contents=False, query_len=longest)
        assert [(a.kernel, a.grid, a.options) for a in free] == [
            (a.kernel, a.grid, a.options) for a in bound
        ]
        for a, c in zip(free, bound, strict=True):
            scalars = {k: v for k, v in a.args.items() if not isinstance(v, torch.Tensor)}
            assert scalars == {k: v for k, v in c.args.items() if not isinstance(v, torch.Tensor)}
    sl[0] = -5
    with pytest.raises(ValueError, match=r"seq_lens must be >= each sequence's q_len"):
        unbounded_query_len(q, cache, bt, sl, 512, 0.07, qsl, None, kw.get("page_indices"),
                            False, None)  # fmt: skip


@pytest.mark.gpu
def test_gpu_unbounded_mla_calls_take_the_cached_plan():
    """Unbounded GPU MLA calls: checked, then cached under the longest q_len they read."""
    PLANS.clear()
    for seed in range(3):
        q, cache, bt, sl, qsl = make_inputs(576, 512, 16, 64, (1, 3), (700 + seed, 90),
                                            torch.bfloat16, "cuda", seed=seed)  # fmt: skip
        out, lse = mla_decode(q, cache, bt, sl, kv_lora_rank=512, scale=0.07,
                              query_start_loc=qsl, return_lse=True)  # fmt: skip
        mla_check(out, lse, q, cache, bt, sl, qsl, 512, 0.07, torch.bfloat16)
    assert PLANS.misses == 2 and PLANS.hits >= 4  # the metadata summary's plan and the op's
    sl[1] = -5
    with pytest.raises(ValueError, match=r"seq_lens must be >= each sequence's q_len"):
        mla_decode(q, cache, bt, sl, kv_lora_rank=512, scale=0.07, query_start_loc=qsl)


@pytest.mark.gpu
def test_gpu_unbounded_calls_take_the_cached_plan():
    """Unbounded GPU calls: checked (a bad value still raises by name) and then cached; a decode
    loop whose contexts grow by a token a step plans once per band."""
    PLANS.clear()
    for n in range(3000, 3004):  # one band of plan_max_seq_len
        b = make_batch(((n, 1), (40, 1)), block_size=16, heads=(8, 2), head_dim=64,
                       dtype=torch.bfloat16, device="cuda", seed=n)  # fmt: skip
        check(b, paged_attention(*b.args()))
    assert PLANS.misses == 2 and PLANS.hits >= 6  # the metadata summary's plan and the op's
    b.block_table[0, 0] = 10**6
    with pytest.raises(ValueError, match=r"block_table entries of used blocks must be in"):
        paged_attention(*b.args())


@pytest.mark.gpu
@pytest.mark.parametrize("given_out", [True, False])
def test_gpu_unbounded_calls_launch_what_they_prepared(given_out):
    """Unbounded GPU calls of one description: from the second on, the launches made ready
    while the device checked run (no second plan-cache lookup), with the right result; a call
    whose bounds moved to another band runs its own plan; broken metadata raises by name and
    leaves ``out`` untouched (nothing launched before the verdict)."""
    from portattn.kernels import paged_attention as paged_mod

    PLANS.clear()
    # built at the longest lens the loop sets (41 for the second): only written cache is read
    b = make_batch(((3000, 1), (41, 1)), block_size=16, heads=(8, 2), head_dim=64,
                   dtype=torch.bfloat16, device="cuda")  # fmt: skip
    full = b.seq_lens.clone()
    probes = []
    real_probe = PLANS.probe
    for lens in ((300, 40), (301, 41), (302, 40), (3000, 40), (2999, 39)):
        b.seq_lens.copy_(torch.tensor(lens))
        out = torch.empty_like(b.query)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(PLANS, "probe", lambda *a: probes.append(a[0][0]) or real_probe(*a))
            got = paged_attention(*b.args(), out=out if given_out else None)
        assert (got is out) == given_out
        check(b, got)
    # the op probed only where nothing was prepared: the first call and the band change
    assert probes.count(paged_mod.OP) == 2
    b.seq_lens.copy_(full)
    b.block_table[0, 0] = 10**6
    out = torch.full_like(b.query, 3.0)
    with pytest.raises(ValueError, match=r"block_table entries of used blocks must be in"):
        paged_attention(*b.args(), out=out)
    assert bool((out == 3.0).all())


@pytest.mark.gpu
def test_gpu_unbounded_mla_calls_launch_what_they_prepared():
    """The same for `mla_decode` without metadata: the launches made ready for the last call's
    longest q_len run when this call's is the same; another longest q_len runs its own plan."""
    PLANS.clear()
    q, cache, bt, sl, qsl = make_inputs(576, 512, 16, 64, (1, 3), (700, 90), torch.bfloat16,
                                        "cuda")  # fmt: skip
    probes = []
    real_probe = PLANS.probe
    for offsets in ((0, 1, 4), (0, 3, 4), (0, 2, 4), (0, 2, 4)):  # longest 3, 3, 2, 2
        qsl.copy_(torch.tensor(offsets))
        with pytest.MonkeyPatch.context() as m:
            m.setattr(PLANS, "probe", lambda *a: probes.append(a[0][0]) or real_probe(*a))
            out, lse = mla_decode(q, cache, bt, sl, kv_lora_rank=512, scale=0.07,
                                  query_start_loc=qsl, return_lse=True)  # fmt: skip
        mla_check(out, lse, q, cache, bt, sl, qsl, 512, 0.07, torch.bfloat16)
    assert probes.count("mla_decode") == 2  # the first call and the change of longest q_len


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["paged_attention", "mla_decode", "gather_kv_cache",
                                "expand_page_indices", "MlaMetadataBuilder.build"])  # fmt: skip
def test_gpu_calls_that_read_refuse_a_capturing_stream(op):
    """A call that would read its metadata to the host (no bound given) raises by name while
    the current stream captures a CUDA graph, planned or not, before queueing anything: the
    sync would fail and invalidate the graph. The bounded call then captures and replays."""
    from portattn.kernels.page_indices import expand_page_indices
    from portattn.platform import current_target

    PLANS.clear()
    b = make_batch(((300, 2), (40, 1)), block_size=16, heads=(8, 2), head_dim=64,
                   dtype=torch.bfloat16, device="cuda")  # fmt: skip
    q, cache, bt, sl, qsl = make_inputs(576, 512, 16, 64, (1, 3), (700, 90), torch.bfloat16,
                                        "cuda")  # fmt: skip
    cu = torch.tensor([0, 300, 340], dtype=torch.int32, device="cuda")
    builder = MlaMetadataBuilder(current_target(), max_batch=4, num_heads=16, kv_lora_rank=512,
                                 head_dim_k=576, dtype=torch.bfloat16, device="cuda",
                                 max_query_len=4, max_seq_len=8192)  # fmt: skip
    unbounded, bound = {
        "paged_attention": (lambda: paged_attention(*b.args()), "max_query_len"),
        "mla_decode": (
            lambda: mla_decode(
                q, cache, bt, sl, kv_lora_rank=512, scale=0.07, query_start_loc=qsl
            ),  # fmt: skip
            "metadata",
        ),
        "gather_kv_cache": (
            lambda: gather_kv_cache(b.key_cache, b.value_cache, b.block_table, cu),
            "out",
        ),
        "expand_page_indices": (
            lambda: expand_page_indices(b.block_table, b.seq_lens, 16),
            "num_indices",
        ),
        "MlaMetadataBuilder.build": (lambda: builder.build(sl, qsl), "max_query_len"),
    }[op]
    message = rf"^{re.escape(op)}: {bound} must be given while the current stream captures"
    for planned in (False, True):
        if planned:
            unbounded()  # outside a capture: checked, planned and cached
            torch.cuda.synchronize()
        launches = PLANS.misses + PLANS.hits
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(ValueError, match=message), torch.cuda.graph(graph):
            unbounded()
        assert PLANS.misses + PLANS.hits == launches  # nothing planned or launched
    # the stream is sound: a bounded call captures and replays
    out = torch.full_like(b.query, 3.0)
    bounded = dict(out=out, max_query_len=2, max_seq_len=300)
    paged_attention(*b.args(), **bounded)  # compiled outside the capture
    torch.cuda.synchronize()
    out.fill_(3.0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(*b.args(), **bounded)
    graph.replay()
    torch.cuda.synchronize()
    check(b, out)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])  # sm_90: 16 bulk-copy tiles, 128 the Gluon kernel
@pytest.mark.parametrize("form", ["block_table", "page_indices"])
def test_gpu_mla_decode_cached_calls(form, heads):
    from portattn.platform import current_target

    PLANS.clear()
    dk, r, bs = 576, 512, 64
    builder = MlaMetadataBuilder(current_target(), max_batch=4, num_heads=heads, kv_lora_rank=r,
                                 head_dim_k=dk, dtype=torch.bfloat16, device="cuda",
                                 max_query_len=4, max_seq_len=8192)  # fmt: skip
    for seed in range(3):
        q, cache, bt, sl, qsl = make_inputs(dk, r, heads, bs, (1, 3), (5000, 700),
                                            torch.bfloat16, "cuda", seed=seed)  # fmt: skip
        md = builder.build(sl, qsl, max_query_len=3)
        kw = dict(kv_lora_rank=r, scale=1 / math.sqrt(dk), query_start_loc=qsl, metadata=md)
        if form == "page_indices":
            pages = tuple(t.cuda() for t in reference.expand_page_indices(bt.cpu(), sl.cpu(), bs))
            out, lse = mla_decode(q, cache, None, sl, page_indices=pages, return_lse=True, **kw)
        else:
            out, lse = mla_decode(q, cache, bt, sl, return_lse=True, **kw)
        oracle, lse_ref = reference.mla_decode(
            q.cpu(), cache.cpu(), bt.cpu(), sl.cpu(), kv_lora_rank=r, scale=kw["scale"],
            query_start_loc=qsl.cpu(),
        )  # fmt: skip
        torch.testing.assert_close(out.double().cpu(), oracle, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(lse.double().cpu(), lse_ref, rtol=1e-3, atol=1e-3)
    assert PLANS.hits == 2 and PLANS.misses == 1
    if form == "block_table" and current_target().arch == "sm_90":  # descriptors, pre-encoded
        (plan,) = PLANS._plans.values()
        direct = plan._replays[0].direct if plan is not None else None
        assert direct is not None and direct.launches == 2  # both hits skipped the re-encoding


@pytest.mark.gpu
def test_gpu_hits_launch_directly():
    """On NVIDIA a hit's launches (split-KV reduce included) go through `_DirectLaunch`: a
    silent fallback to `CompiledKernel.run` would cost host time, not correctness."""
    if getattr(torch.version, "hip", None):
        pytest.skip("HIP plans launch through CompiledKernel.run")
    PLANS.clear()
    for seed in range(3):
        b = make_batch(((3000, 1),), block_size=16, heads=(8, 2), head_dim=64,
                       dtype=torch.bfloat16, device="cuda", seed=seed)  # fmt: skip
        check(b, paged_attention(*b.args(), max_query_len=1, max_seq_len=4096))
    (plan,) = PLANS._plans.values()
    assert plan is not None and plan._direct is not None
    assert len(plan._replays) == 2  # the split's reduce too (as in the cached-calls test above)
    assert [d.launches for d in plan._direct] == [2, 2]  # both hits, directly


@pytest.mark.gpu
def test_gpu_mla_decode_one_split_cached_calls():
    """bench_host's MLA decode (4 x 256 tokens: one split, no reduce): a new metadata per step
    hits the plan, whose key leaves the unread workspaces out; every hit is exact and launches
    directly; a longer context (a split, the workspaces read) is another plan."""
    from portattn.platform import current_target

    PLANS.clear()
    dk, r, bs, heads = 576, 512, 64, 16
    for max_seq_len in (256, 4096):
        builder = MlaMetadataBuilder(current_target(), max_batch=4, num_heads=heads,
                                     kv_lora_rank=r, head_dim_k=dk, dtype=torch.bfloat16,
                                     device="cuda", max_seq_len=max_seq_len)  # fmt: skip
        for seed in range(3):
            ctx = (max_seq_len, max_seq_len - 7, 100, max_seq_len)
            q, cache, bt, sl, _ = make_inputs(dk, r, heads, bs, (1, 1, 1, 1), ctx,
                                              torch.bfloat16, "cuda", seed=seed)  # fmt: skip
            md = builder.build(sl)
            assert (_metadata_key(md)[1] is None) == (md.tiles.num_kv_splits == 1)
            out = mla_decode(q, cache, bt, sl, kv_lora_rank=r, scale=0.05, metadata=md)
            oracle, _ = reference.mla_decode(
                q.cpu(), cache.cpu(), bt.cpu(), sl.cpu(), kv_lora_rank=r, scale=0.05
            )
            torch.testing.assert_close(out.double().cpu(), oracle, rtol=2e-2, atol=2e-2)
    assert (PLANS.hits, PLANS.misses) == (4, 2)
    if not getattr(torch.version, "hip", None):
        for plan in PLANS._plans.values():
            assert plan is not None and plan._direct is not None
            assert all(d.launches == 2 for d in plan._direct)


@pytest.mark.gpu
def test_gpu_tensor_reads_contents_rule():
    t = torch.empty(1, device="cuda")
    for vouched in (True, False):
        assert tensor_reads_contents(t, vouched) == reads_contents(t.device, vouched)
    assert _plans._current_device() == torch.cuda.current_device()


@pytest.mark.gpu
def test_gpu_kv_cache_cached_calls():
    kc, vc = empty_kv_cache(8, 16, 2, 64, dtype=torch.bfloat16, device="cuda")
    kc.zero_(), vc.zero_()
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        k, v = (torch.randn(6, 2, 64, generator=g).bfloat16().cuda() for _ in range(2))
        slots = torch.randperm(128, generator=g)[:6].cuda()
        write_kv_cache(k, v, kc, vc, slots)
        for i, s in enumerate(slots.tolist()):
            assert torch.equal(kc[s // 16, s % 16], k[i]) and torch.equal(vc[s // 16, s % 16], v[i])
        table = slots.view(2, 3) // 16
        cu = torch.tensor([0, 40, 48], device="cuda")
        out = tuple(torch.empty(48, 2, 64, dtype=torch.bfloat16, device="cuda") for _ in "kv")
        ko, vo = gather_kv_cache(kc, vc, table, cu, out=out)
        assert ko is out[0] and vo is out[1]
        ref_k, ref_v = reference.gather_kv_cache(kc.cpu(), vc.cpu(), table.cpu(), cu.cpu())
        assert torch.equal(ko.cpu(), ref_k) and torch.equal(vo.cpu(), ref_v)


# -- the guarded probe (`PlanCache.probe`): the key's plan or none --------------------------------


class _Marker:
    """A stand-in plan: `run` returns its name; it writes no input (`Plan.disjoint`)."""

    disjoint = Disjoint((), ())

    def __init__(self, name):
        self.name = name

    def run(self, inputs, ptrs=None):
        return self.name


def _probe(cache, guard, inputs):
    """`PlanCache.probe` as `mla_decode` calls it: which inputs are ``None`` in the guard."""
    mask, tensors = _plans.present(inputs)
    return cache.probe((guard, mask), tensors, inputs)


def _keep(cache, guard, inputs, plan):
    mask, tensors = _plans.present(inputs)
    cache._keep_guard(((guard, mask), tensors), inputs, plan)


def test_probe_fits_only_the_same_description():
    cache = PlanCache()
    a = torch.empty(4, 8, 16)
    b = torch.empty(6, dtype=torch.int32)
    guard = ("op", None, None, float, 0.5)
    assert _probe(cache, guard, (a, None, b)) is None  # nothing kept yet
    _keep(cache, guard, (a, None, b), _Marker("plan"))
    same = (torch.empty(4, 8, 16), None, torch.empty(6, dtype=torch.int32))
    assert _probe(cache, guard, same) == "plan"
    wide = torch.empty(4, 8, 24)[:, :, :16]
    flat = torch.empty(a.numel() + 1)
    sub = torch.nn.Parameter(torch.empty(4, 8, 16), requires_grad=False)
    variants = {
        "shape": ((a[:3], None, b), guard),
        "strides": ((wide, None, b), guard),
        "dtype": ((a.half(), None, b), guard),
        "device": ((a.to("meta"), None, b), guard),
        "alignment": ((flat[1:].view(a.shape), None, b), guard),
        "second tensor": ((a, None, b.long()), guard),
        "a tensor where None was": ((a, b, b), guard),
        "None where a tensor was": ((a, None, None), guard),
        "fewer inputs": ((a, None), guard),
        "not a tensor": ((a, None, [1, 2]), guard),
        "a subclass": ((sub, None, b), guard),
        "requires_grad": ((a.clone().requires_grad_(), None, b), guard),
        "scalar": ((a, None, b), ("op", None, None, float, 0.25)),
        "scalar type": ((a, None, b), ("op", None, None, int, 0.5)),
        "op": ((a, None, b), ("other", None, None, float, 0.5)),
        "unhashable": ((a, None, b), ("op", None, None, list, [0.5])),
    }
    for name, (inputs, g) in variants.items():
        assert _probe(cache, g, inputs) is None, name
    # fewer tensors under the same guard (an op's mistake): the count is part of the entry
    assert cache.probe((guard, _plans.present((a, None, b))[0]), (a,), (a, None, b)) is None
    assert cache.hits == 1
    for off in (PlanCache(guards=False), PlanCache(enabled=False)):
        _keep(off, guard, (a, None, b), _Marker("plan"))
        assert _probe(off, guard, (a, None, b)) is None
    assert _probe(cache, guard, (a, None, b)) == "plan"
    cache.clear()
    assert _probe(cache, guard, (a, None, b)) is None


def test_probe_keeps_recent_plans_and_no_tensor():
    cache = PlanCache()
    guard = ("op",)
    shapes = [(n, 16) for n in range(1, _plans.MAX_GUARDS + 2)]
    refs = []
    for n, shape in enumerate(shapes):
        t = torch.empty(shape)
        refs.append(weakref.ref(t))
        _keep(cache, guard, (t,), _Marker(n))
        del t
    gc.collect()
    assert all(r() is None for r in refs)  # the guards keep no tensor alive
    assert _probe(cache, guard, (torch.empty(shapes[0]),)) is None  # the oldest, dropped
    for n, shape in enumerate(shapes[1:], 1):
        assert _probe(cache, guard, (torch.empty(shape),)) == n
    misaligned = torch.empty(17)[1:]
    _keep(cache, ("x",), (misaligned,), _Marker("x"))  # not aligned: never guarded
    assert _probe(cache, ("x",), (torch.empty(17)[1:],)) is None


def _meta_paged(**kw):
    b = make_batch(SEQS, block_size=8, heads=(8, 2), head_dim=32, dtype=torch.float32, **kw)
    return tuple(t.to("meta") for t in b.args())


def test_paged_probe_runs_the_keys_plan(no_launch, monkeypatch):
    t = _meta_paged()
    paged_attention(*t, max_query_len=4)
    paged_attention(*t, max_query_len=4)  # a hit by the key: kept for the probe
    assert (PLANS.hits, PLANS.misses) == (1, 1) and len(PLANS._guarded) == 1
    keys = []
    real_key = call_key
    monkeypatch.setattr(
        "portattn.kernels.paged_attention.call_key", lambda *a: keys.append(a) or real_key(*a)
    )
    out = paged_attention(*_meta_paged(seed=5), max_query_len=4)  # other tensors, same form
    assert (PLANS.hits, PLANS.misses, keys) == (2, 1, [])  # the probe's hit: no key built
    assert out.shape == t[0].shape
    q = t[0]
    flat = torch.empty(q.numel() + 1, device="meta")
    variants = {
        "shape": ((q[:-1],) + t[1:], {}),
        "alignment": ((flat[1:].view(q.shape),) + t[1:], {}),
        "table dtype": (t[:3] + (t[3].long(),) + t[4:], {}),
        "scale": (t, {"scale": 0.5}),
        "max_query_len": (t, {"max_query_len": 1}),
        "max_seq_len": (t, {"max_seq_len": 64}),
        "out": (t, {"out": torch.empty_like(q)}),
        "target": (t, {"target": get_target("gfx942")}),
    }
    for name, (args, kw) in variants.items():
        hits, misses = PLANS.hits, PLANS.misses
        kw = {"max_query_len": 4, **kw}
        paged_attention(*args, **kw)
        assert (PLANS.hits, PLANS.misses) == (hits, misses + 1), name
        paged_attention(*args, **kw)  # now a hit, by the probe or (a target) by the key
        assert (PLANS.hits, PLANS.misses) == (hits + 1, misses + 1), name
    set_target_override("gfx950")
    try:
        hits, misses = PLANS.hits, PLANS.misses
        paged_attention(*t, max_query_len=4)
        assert (PLANS.hits, PLANS.misses) == (hits, misses + 1)
    finally:
        set_target_override(None)
    # a probe never skips validation: a query of another dtype, a value cache on another
    # device are still reported
    with pytest.raises(TypeError, match="key_cache and value_cache dtype must equal"):
        paged_attention(q.half(), *t[1:], max_query_len=4)
    with pytest.raises(ValueError, match="value_cache"):
        paged_attention(t[0], t[1], torch.empty(t[2].shape), *t[3:], max_query_len=4)
    with pytest.raises(TypeError, match="max_query_len must be a non-negative int"):
        paged_attention(*t, max_query_len=True)  # True, after 1 was guarded


@pytest.mark.parametrize("layout", ["NHD", "SHUFFLE"])
def test_kv_cache_probes_run_the_keys_plan(layout, no_launch, monkeypatch):
    """write_kv_cache and gather_kv_cache (``out`` given) on a device whose contents are not
    read: the second call of a description keeps its plan for the probe, the third finds it
    without building a key, and any change of what a plan reads plans afresh."""
    meta = dict(device="meta", dtype=torch.float16)

    def tensors(tokens=5, total=17, slot_dtype=torch.int64):
        kc, vc = empty_kv_cache(6, 8, 2, 16, layout=layout, **meta)
        k, v = torch.empty(tokens, 2, 16, **meta), torch.empty(tokens, 2, 16, **meta)
        slots = torch.empty(tokens, dtype=slot_dtype, device="meta")
        table = torch.empty(2, 3, dtype=torch.int32, device="meta")
        cu = torch.empty(3, dtype=torch.int32, device="meta")
        out = (torch.empty(total, 2, 16, **meta), torch.empty(total, 2, 16, **meta))
        return (k, v, kc, vc, slots), (kc, vc, table, cu), out

    keys = []
    real_key = call_key
    monkeypatch.setattr(
        "portattn.kernels.kv_cache.call_key", lambda *a: keys.append(a[0]) or real_key(*a)
    )
    w, g, out = tensors()
    for _ in range(3):
        write_kv_cache(*w, layout=layout)
        ko, vo = gather_kv_cache(*g, layout=layout, out=out)
        assert ko is out[0] and vo is out[1]
    # a miss each, which keeps its plan for the probe too; then the probe's hits, no key built
    assert (PLANS.hits, PLANS.misses, len(PLANS._guarded)) == (4, 2, 2)
    assert keys == ["write_kv_cache", "gather_kv_cache"]
    w2, g2, out2 = tensors()  # other tensors of the same description: the probe's hits
    write_kv_cache(*w2, layout=layout)
    assert gather_kv_cache(*g2, layout=layout, out=out2)[1] is out2[1]
    assert (PLANS.hits, PLANS.misses, len(keys)) == (6, 2, 2)
    variants = {
        "tokens": lambda: write_kv_cache(*tensors(tokens=4)[0], layout=layout),
        "slot dtype": lambda: write_kv_cache(*tensors(slot_dtype=torch.int32)[0], layout=layout),
        "out rows": lambda: gather_kv_cache(*g, layout=layout, out=tensors(total=16)[2]),
        "out as a list": lambda: gather_kv_cache(*g, layout=layout, out=list(out)),
        "target": lambda: write_kv_cache(*w, layout=layout, target=get_target("gfx942")),
    }
    for name, call in variants.items():
        misses = PLANS.misses
        call()
        assert PLANS.misses == misses + 1, name
    set_target_override("gfx950")
    try:
        misses = PLANS.misses
        write_kv_cache(*w, layout=layout)
        assert PLANS.misses == misses + 1
    finally:
        set_target_override(None)
    # validation is never skipped: a value cache of another dtype is still reported
    with pytest.raises(TypeError, match="value_cache"):
        write_kv_cache(w[0], w[1], w[2], torch.empty(w[3].shape, device="meta"), w[4])


def test_mla_probe_follows_the_metadata(no_launch):
    call, build = _meta_mla(256)
    md = build()
    call(md)
    call(md)
    assert (PLANS.hits, PLANS.misses) == (1, 1) and len(PLANS._guarded) == 1
    call(md)
    call(build())  # equal values: the same number, the probe's hit
    assert (PLANS.hits, PLANS.misses) == (3, 1)
    call(build(3), 3)  # other values (and shapes): a miss
    assert (PLANS.hits, PLANS.misses) == (3, 2)
    tiles = dataclasses.replace(md.tiles, num_kv_splits=2)  # other tiles, same tensors: a miss
    md2 = dataclasses.replace(md, tiles=tiles)
    assert _metadata_key(md2)[0] != _metadata_key(md)[0]
    with pytest.raises(ValueError):  # planned afresh: validated (the workspaces are too small)
        call(md2)
    assert PLANS.hits == 3


def test_mla_probe_with_and_without_out(no_launch):
    """The decode shortcut (no optional tensor) and `present` (``out`` given) keep their
    plans apart."""
    _, build = _meta_mla(256)
    md = build()
    dk, r, heads = 576, 512, 16
    cache = torch.empty(4 * 64, 64, dk, dtype=torch.bfloat16, device="meta")
    table = torch.empty(4, 64, dtype=torch.int32, device="meta")
    q = torch.empty(4, heads, dk, dtype=torch.bfloat16, device="meta")
    sl = torch.empty(4, dtype=torch.int32, device="meta")
    out = torch.empty(4, heads, r, dtype=torch.bfloat16, device="meta")

    def go(**kw):
        return mla_decode(q, cache, table, sl, kv_lora_rank=r, scale=0.05, metadata=md, **kw)

    assert go(out=out) is out
    assert go(out=out) is out  # a hit by the key, kept for the probe
    assert go(out=out) is out and (PLANS.hits, PLANS.misses) == (2, 1)  # the probe's
    mine = go()  # no out: another description, a miss
    assert mine is not out and (PLANS.hits, PLANS.misses) == (2, 2)
    go()
    assert go() is not out and (PLANS.hits, PLANS.misses) == (4, 2)
    assert go(out=out) is out and (PLANS.hits, PLANS.misses) == (5, 2)
    assert len(PLANS._guarded) == 2


def test_a_tensor_passed_twice_is_not_planned(no_launch):
    """key_cache is value_cache: a plan could not tell the two slots apart, and a later call of
    the same description with two tensors would read its keys from the value cache."""
    q, kc, vc, *rest = _meta_paged()
    twice = (q, kc, kc, *rest, None)
    with pytest.raises(Uncacheable, match="passed as two inputs"):
        Plan(plan_paged_attention(*twice[:6], max_query_len=4), twice)
    paged_attention(*twice[:6], max_query_len=4)
    assert (len(PLANS), PLANS.misses, len(PLANS._guarded)) == (0, 1, 0)  # run, nothing kept
    paged_attention(q, kc, vc, *rest, max_query_len=4)  # two tensors: planned now
    paged_attention(q, kc, vc, *rest, max_query_len=4)
    assert (len(PLANS), PLANS.hits, PLANS.misses) == (1, 1, 2)
    inputs = (q, kc, vc, *rest, None)
    key = call_key("paged_attention", *inputs, None, "NHD", None, 4, None, None)
    fresh = plan_paged_attention(q, kc, vc, *rest, max_query_len=4)
    _assert_same_plan(PLANS._plans[key].bind(inputs), fresh, inputs)
    paged_attention(*twice[:6], max_query_len=4)  # one tensor twice on a kept plan: a hit
    lists, _ = PLANS._plans[key].bind(twice)
    _assert_same_plan((lists, ()), plan_paged_attention(*twice[:6], max_query_len=4), twice)


def test_zero_size_outputs_are_new_on_every_hit(no_launch):
    """An empty step's output is still the caller's own tensor: a hit returns a new one, so a
    caller that reshapes or resizes what it got changes no later call's output."""
    q, kc, vc, bt, sl, qsl = (t[:0] if i == 0 else t for i, t in enumerate(_meta_paged()))
    sl, qsl = sl[:1].zero_(), qsl[:2].zero_()

    def paged():
        return paged_attention(q, kc, vc, bt[:1], sl, qsl, max_query_len=0)

    first, second = paged(), paged()
    assert PLANS.hits == 1 and first is not second
    second.resize_(3, 8, 32)
    assert paged().shape == (0, 8, 32)

    builder = MlaMetadataBuilder(get_target("sm_90"), max_batch=2, num_heads=16,
                                 kv_lora_rank=512, head_dim_k=576, dtype=torch.float16,
                                 device="meta", max_query_len=2, max_seq_len=256)  # fmt: skip
    mq = torch.empty(0, 16, 576, dtype=torch.float16, device="meta")
    cache = torch.empty(4, 64, 576, dtype=torch.float16, device="meta")
    mbt, msl = torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    mqsl = torch.zeros(2, dtype=torch.int32)
    mbt, msl, mqsl = (t.to("meta") for t in (mbt, msl, mqsl))

    def mla():
        md = builder.build(msl, mqsl, max_query_len=2)
        return mla_decode(mq, cache, mbt, msl, kv_lora_rank=512, scale=0.1,
                          query_start_loc=mqsl, metadata=md, return_lse=True)  # fmt: skip

    (o1, l1), (o2, l2) = mla(), mla()
    assert PLANS.hits > 1 and o1 is not o2 and l1 is not l2
    l2.unsqueeze_(0)
    o2.resize_(5, 16, 512)
    o3, l3 = mla()
    assert (o3.shape, l3.shape) == ((0, 16, 512), (0, 16))


class _TakenMeanwhile:
    """A key whose hashing removes it from its table first: the table as another thread leaves
    it when it evicts the same oldest entry between this thread's lookup and its removal."""

    def __init__(self, table: dict):
        self.table = table
        self.armed = False

    def __hash__(self) -> int:
        if self.armed:
            self.armed = False
            del self.table[self]
        return 0


def test_eviction_tolerates_another_threads_eviction():
    """The caches are shared by threads without a lock: an eviction that finds its oldest entry
    gone, or the table empty, raises nothing out of the op call that triggered it."""
    table: dict = {}
    key = _TakenMeanwhile(table)
    table[key] = 1
    table["newer"] = 2
    key.armed = True
    _plans.evict_oldest(table, 1)
    assert table == {"newer": 2}
    _plans.evict_oldest(table, 0)
    assert table == {}


def test_caches_evict_safely_from_many_threads():
    """Eight threads planning new descriptions into a one-plan cache: no call raises (each
    finds the cache full and evicts, in the same few lines)."""
    import sys
    import threading

    cache = PlanCache(max_plans=1)
    errors: list[BaseException] = []
    keys = iter(range(10**9))

    def work():
        try:
            for _ in range(3000):
                cache.call(("op", next(keys)), (), lambda: [])
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        threads = [threading.Thread(target=work) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[:3]
    assert len(cache) <= 1


def test_fast_allocations_equal_torch_empty(monkeypatch):
    """A buffer from torch's C allocation is what `torch.empty` gives; where the C function
    gives something else, `torch.empty` is kept."""
    assert "cpu" in _plans._FAST_EMPTY  # this torch has it: the CPU route below is the fast one
    for shape in [(), (0, 3), (2, 3), (4, 1, 5, 2)]:
        for dtype in (torch.float32, torch.bfloat16, torch.int32):
            alloc = _plans._empty(shape, dtype, torch.device("cpu"))
            assert isinstance(alloc, functools.partial) and alloc.func is not torch.empty
            a, b = alloc(), torch.empty(shape, dtype=dtype)
            assert (a.shape, a.stride(), a.dtype, a.device, a.requires_grad) == (
                b.shape, b.stride(), b.dtype, b.device, b.requires_grad
            )  # fmt: skip
            assert alloc().data_ptr() != a.data_ptr() or a.numel() == 0  # a new buffer each
    assert _plans._empty((2, 3), torch.int32, torch.device("meta")).func is torch.empty
    monkeypatch.setitem(_plans._FAST_EMPTY, "cpu", lambda *a: torch.empty(3))  # not the same
    assert _plans._empty((2, 3), torch.int32, torch.device("cpu")).func is torch.empty


@pytest.mark.gpu
def test_gpu_fast_allocations_equal_torch_empty():
    dev = torch.device("cuda", torch.cuda.current_device())
    alloc = _plans._empty((4, 32, 128), torch.bfloat16, dev)
    assert alloc.func is _plans._FAST_EMPTY["cuda"]  # the C route on this device
    a, b = alloc(), torch.empty(4, 32, 128, dtype=torch.bfloat16, device=dev)
    assert (a.shape, a.stride(), a.dtype, a.device) == (b.shape, b.stride(), b.dtype, b.device)
    assert a.data_ptr() % 256 == 0
    if torch.cuda.device_count() > 1:  # a buffer on another device: torch.empty
        other = torch.device("cuda", (dev.index + 1) % torch.cuda.device_count())
        assert _plans._empty((2,), torch.float32, other).func is torch.empty


@pytest.mark.gpu
def test_gpu_probe_hits_run_correctly(monkeypatch):
    """On a GPU a repeated call is a probe's hit (no key built), runs the compiled kernel
    directly on the new tensors, and a misaligned query or another device's override is not
    taken for it."""
    PLANS.clear()
    kw = dict(block_size=16, heads=(8, 2), head_dim=64, dtype=torch.bfloat16, device="cuda")
    for seed in range(2):
        b = make_batch(SEQS, seed=seed, **kw)
        check(b, paged_attention(*b.args(), max_query_len=4))
    keys = []
    real_key = call_key
    monkeypatch.setattr(
        "portattn.kernels.paged_attention.call_key", lambda *a: keys.append(a) or real_key(*a)
    )
    hits = PLANS.hits
    for seed in range(2, 5):
        b = make_batch(SEQS, seed=seed, **kw)
        check(b, paged_attention(*b.args(), max_query_len=4))
    assert keys == [] and PLANS.hits == hits + 3  # probe hits only
    b = make_batch(SEQS, seed=9, **kw)
    q = b.query
    flat = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")
    shifted = flat[1:].view(q.shape)  # 2 bytes off 16: another specialization
    shifted.copy_(q)
    b.query = shifted
    misses = PLANS.misses
    check(b, paged_attention(*b.args(), max_query_len=4))
    assert len(keys) == 1 and PLANS.misses == misses + 1


def test_guards_follow_the_torch_build(monkeypatch):
    """The probe's guards are on where torch has dynamo's C guards, and cannot be asked for
    where it has not (a torch without them: every call builds its key)."""
    assert PlanCache().guarded(("op",), ()) is None
    monkeypatch.setattr(_plans, "_TensorGuards", None)
    cache = PlanCache()
    a = torch.empty(4)
    _keep(cache, ("op",), (a,), _Marker("plan"))
    assert _probe(cache, ("op",), (a,)) is None
    with pytest.raises(ValueError, match="PlanCache: guards must be False on a torch without"):
        PlanCache(guards=True)
