"""Metadata content checks (`portattn.kernels._checks`): every bad index value a user can
pass on the CPU is a clear ValueError before anything runs, the same message from every op, and
valid input with garbage in the entries no sequence uses still works.

Cases that crashed (SIGSEGV) or could crash the process before the checks -- a read through a
bad block id, slot or past a block-table row -- run in a child process (`_in_child`): a
regression then fails its test instead of killing the test run. On a GPU (marker ``gpu``): the
checks run when the caller gives no bounds, and a call given its bounds makes no host sync.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import portattn
from portattn import reference
from portattn.kernels._checks import reads_contents
from portattn.kernels.kv_cache import gather_kv_cache, write_kv_cache
from portattn.kernels.mla_decode import mla_decode, plan_mla_decode
from portattn.kernels.page_indices import expand_page_indices
from portattn.kernels.paged_attention import paged_attention
from portattn.layout import empty_kv_cache
from portattn.mla_metadata import MlaMetadataBuilder
from portattn.platform import get_target
from tests.helpers import Opaque, assert_low_precision_close

# MLA geometry: small, and one the interpreter runs quickly (latent 128 + rope 64).
DK, R, HEADS, BS = 192, 128, 2, 4
SCALE = 0.07
Q_LENS, SEQ_LENS = (2, 1), (6, 9)  # one verification step, one decode
MAX_BLOCKS = 4  # columns per block-table row: 16 tokens; sequences use 2 and 3 of them
NUM_BLOCKS = 8
GARBAGE = (10**9, -1)  # what unused block-table columns may hold


def _i32(*xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32)


def _block_table(device="cpu") -> torch.Tensor:
    """Rows [[5, 2, G, G], [7, 0, 3, G]] with G garbage in the columns no sequence uses."""
    bt = torch.tensor([[5, 2, 0, 0], [7, 0, 3, 0]], dtype=torch.int32)
    used = torch.arange(MAX_BLOCKS)[None, :] < torch.tensor([[2], [3]])
    garbage = torch.tensor(GARBAGE * MAX_BLOCKS, dtype=torch.int32)[:MAX_BLOCKS].expand(2, -1)
    return torch.where(used, bt, garbage).to(device)


def _mla_inputs(device="cpu", *, q_lens=Q_LENS, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(NUM_BLOCKS, BS, DK, generator=g).to(device)
    num_tokens = len(SEQ_LENS) if q_lens is None else sum(q_lens)
    q = torch.randn(num_tokens, HEADS, DK, generator=g).to(device)
    qsl = None if q_lens is None else _i32(0, *torch.tensor(q_lens).cumsum(0).tolist()).to(device)
    return dict(
        query=q,
        kv_cache=cache,
        block_table=_block_table(device),
        seq_lens=_i32(*SEQ_LENS).to(device),
        kv_lora_rank=R,
        scale=SCALE,
        query_start_loc=qsl,
    )


def _pages(a) -> tuple[torch.Tensor, torch.Tensor]:
    return reference.expand_page_indices(a["block_table"].cpu(), a["seq_lens"].cpu(), BS)


def _mla(**over):
    """`mla_decode` on the valid inputs with ``over`` applied (``page_indices`` replaces the
    block table); returns the output."""
    a = _mla_inputs(q_lens=over.pop("q_lens", Q_LENS))
    if "page_indices" in over:
        a["block_table"] = None
    a.update(over)
    return mla_decode(**a)


def _with(t: torch.Tensor, index, value) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


# -- the bad inputs: name -> (call, message regex, suite, in a child process) -------------------


def _mla_page_minus_one():
    bt = _with(_block_table(), (1, 1), -1)  # expand_page_indices turns it into -1 slots
    return _mla(page_indices=expand_page_indices(bt, _i32(*SEQ_LENS), BS))


def _expand_fed_to_mla():
    bt, sl = _block_table(), _i32(*SEQ_LENS)
    pages = expand_page_indices(bt, sl, BS, num_indices=sum(SEQ_LENS) + 8)
    return _mla(page_indices=pages)


_USED = r"block_table entries of used blocks must be in \[0, num_blocks=8\); got range "
CASES: dict[str, tuple] = {
    # mla_decode, block table
    "mla-block-id-past-cache": (
        lambda: _mla(block_table=_with(_block_table(), (0, 1), 10**6)),
        _USED + r"\[0, 1000000\], first at block_table\[0, 1\]=1000000 \(1 entries\)",
        "mla",
        True,
    ),
    "mla-block-id-minus-one": (
        lambda: _mla(block_table=_with(_block_table(), (1, 2), -1)),
        _USED + r"\[-1, 7\], first at block_table\[1, 2\]=-1",
        "mla",
        True,
    ),
    "mla-seq-lens-past-capacity": (
        lambda: _mla(seq_lens=_i32(6, 17)),
        r"block_table must have a column per block of each sequence; got seq_lens\[1\]=17 "
        r"needing 5 blocks of 4 but max_blocks=4",
        "mla",
        True,
    ),
    "mla-seq-lens-below-q-len": (
        lambda: _mla(seq_lens=_i32(1, 9)),
        r"seq_lens must be >= each sequence's q_len; got seq_lens\[0\]=1 < q_len 2",
        "mla",
        False,
    ),
    "mla-seq-lens-zero": (
        lambda: _mla(q_lens=None, seq_lens=_i32(6, 0)),
        r"seq_lens must be >= each sequence's q_len; got seq_lens\[1\]=0 < q_len 1",
        "mla",
        False,
    ),
    "mla-qsl-decreasing": (
        lambda: _mla(query_start_loc=_i32(0, 3, 2)),
        r"query_start_loc must be non-decreasing; got a decrease at index 2 \(3 -> 2\)",
        "mla",
        False,
    ),
    "mla-qsl-past-num-tokens": (
        lambda: _mla(query_start_loc=_i32(1, 2, 5)),
        r"query_start_loc must start at 0 and end at <= num_tokens=3; got first 1, last 5",
        "mla",
        False,
    ),
    # mla_decode, page indices
    "mla-page-indices-disagree": (
        lambda: _mla(page_indices=_pages(_mla_inputs()), seq_lens=_i32(6, 12)),
        r"page_indices\[0\] \(indptr\) must give each sequence seq_lens\[i\] slots; got "
        r"indptr\[2\] - indptr\[1\] = 9 but seq_lens\[1\]=12",
        "mla",
        True,
    ),
    "mla-page-slot-past-cache": (
        lambda: _mla(
            page_indices=(_pages(_mla_inputs())[0], _with(_pages(_mla_inputs())[1], 7, 10**7))
        ),
        r"page_indices\[1\] must be in \[0, num_blocks \* block_size = 32\); got range "
        r"\[\d+, 10000000\], first at page_indices\[1\]\[7\]=10000000",
        "mla",
        True,
    ),
    "mla-page-minus-one": (
        _mla_page_minus_one,
        r"page_indices\[1\] must be in \[0, num_blocks \* block_size = 32\); got range \[-1, ",
        "mla",
        True,
    ),
    # expand_page_indices
    "expand-num-indices-smaller": (
        lambda: expand_page_indices(_block_table(), _i32(*SEQ_LENS), BS, num_indices=14),
        r"^expand_page_indices: num_indices must equal sum\(seq_lens\)=15; got 14",
        "specdec",
        False,
    ),
    "expand-num-indices-larger": (
        lambda: expand_page_indices(_block_table(), _i32(*SEQ_LENS), BS, num_indices=23),
        r"^expand_page_indices: num_indices must equal sum\(seq_lens\)=15; got 23",
        "specdec",
        False,
    ),
    "expand-num-indices-fed-to-mla": (
        _expand_fed_to_mla,
        r"^expand_page_indices: num_indices must equal sum\(seq_lens\)=15; got 23",
        "specdec",
        True,
    ),
}


def _in_child(name: str) -> dict:
    """Run ``CASES[name]`` in a fresh interpreter; return what it raised (or that it did not)."""
    src = Path(portattn.__file__).resolve().parents[1]  # the portattn this test imported
    root = Path(__file__).resolve().parents[2]
    code = (
        "import json\n"
        "from tests.kernels.test_metadata_checks import CASES\n"
        "try:\n"
        f"    CASES[{name!r}][0]()\n"
        "except ValueError as e:\n"
        "    print(json.dumps({'raised': 'ValueError', 'message': str(e)}))\n"
        "else:\n"
        "    print(json.dumps({'raised': None}))\n"
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


@pytest.mark.cpu
@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=getattr(pytest.mark, c[2])) for n, c in CASES.items()],
)
def test_bad_metadata_is_a_clear_error(name):
    call, match, _, child = CASES[name]
    if child:
        got = _in_child(name)
        assert got["raised"] == "ValueError", f"{name}: no ValueError; the call ran"
        assert re.search(match, got["message"]), f"{match!r} not in {got['message']!r}"
    else:
        with pytest.raises(ValueError, match=match):
            call()


# -- every reason at once; nothing written by a rejected call -----------------------------------


@pytest.mark.cpu
@pytest.mark.mla
def test_mla_lists_every_content_reason():
    bt = _with(_block_table(), (0, 0), 99)
    with pytest.raises(
        ValueError, match=r"non-decreasing.*; seq_lens must .*; block_table entries"
    ):
        _mla(query_start_loc=_i32(0, 3, 2), seq_lens=_i32(1, 9), block_table=bt)


@pytest.mark.cpu
@pytest.mark.mla
def test_rejected_mla_leaves_out_untouched():
    out = torch.full((3, HEADS, R), -7.0)
    with pytest.raises(ValueError, match="block_table entries of used blocks"):
        _mla(block_table=_with(_block_table(), (0, 0), 8), out=out)
    assert (out == -7.0).all()


@pytest.mark.cpu
@pytest.mark.paged
def test_rejected_write_leaves_caches_bit_identical():
    k_cache, v_cache = empty_kv_cache(4, 4, 2, 16, dtype=torch.float32)
    k_cache.copy_(torch.randn_like(k_cache))
    v_cache.copy_(torch.randn_like(v_cache))
    before = k_cache.clone(), v_cache.clone()
    key = torch.randn(3, 2, 16)
    with pytest.raises(
        ValueError,
        match=r"slot_mapping must be < num_blocks \* block_size = 16 .* got max 16, "
        r"first at slot_mapping\[2\]=16",
    ):
        write_kv_cache(key, key.clone(), k_cache, v_cache, torch.tensor([0, 5, 16]))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


@pytest.mark.cpu
@pytest.mark.paged
def test_rejected_gather_and_paged_leave_out_untouched():
    k_cache, v_cache = empty_kv_cache(NUM_BLOCKS, BS, 2, 16, dtype=torch.float32)
    bt = _with(_block_table(), (1, 0), NUM_BLOCKS)
    k_out = torch.full((15, 2, 16), -7.0)
    v_out = k_out.clone()
    with pytest.raises(ValueError, match=r"gather_kv_cache: block_table entries of used blocks"):
        gather_kv_cache(k_cache, v_cache, bt, _i32(0, 6, 15), out=(k_out, v_out))
    q = torch.randn(3, 4, 16)
    out = torch.full_like(q, -7.0)
    with pytest.raises(ValueError, match=r"paged_attention: block_table entries of used blocks"):
        paged_attention(q, k_cache, v_cache, bt, _i32(*SEQ_LENS), _i32(0, 2, 3), out=out)
    assert (k_out == -7.0).all() and (v_out == -7.0).all() and (out == -7.0).all()


# -- valid input: garbage in unused entries is ignored everywhere ------------------------------


@pytest.mark.paged
@pytest.mark.parametrize("with_out", [False, True], ids=["read-total", "out-given"])
def test_gather_ignores_unused_block_table_columns(with_out, device):
    """CPU used to reject this (block_table.max() over every column); the GPU never read them."""
    k_cache, v_cache = empty_kv_cache(NUM_BLOCKS, BS, 2, 16, dtype=torch.float32, device=device)
    k_cache.copy_(torch.randn_like(k_cache))
    v_cache.copy_(torch.randn_like(v_cache))
    bt, cu = _block_table(device), _i32(0, *torch.tensor(SEQ_LENS).cumsum(0).tolist()).to(device)
    out = None
    if with_out:
        out = (torch.empty(15, 2, 16, device=device), torch.empty(15, 2, 16, device=device))
    k, v = gather_kv_cache(k_cache, v_cache, bt, cu, out=out)
    rk, rv = reference.gather_kv_cache(k_cache.cpu(), v_cache.cpu(), bt.cpu(), cu.cpu())
    assert torch.equal(k.cpu(), rk) and torch.equal(v.cpu(), rv)


@pytest.mark.mla
def test_mla_ignores_unused_entries(device):
    """Garbage in unused block-table columns and in page indices past indptr[-1] is never read:
    both forms accept it and agree with the oracle."""
    a = _mla_inputs(device)
    by_table = mla_decode(**a)
    indptr, indices = (t.to(device) for t in _pages(a))
    tail = torch.tensor([10**9, -1], device=device)
    pages = (indptr, torch.cat([indices, tail]))
    by_pages = mla_decode(**{**a, "block_table": None}, page_indices=pages)
    assert torch.equal(by_table, by_pages)
    oracle, _ = reference.mla_decode(
        a["query"].cpu(), a["kv_cache"].cpu(), a["block_table"].cpu(), a["seq_lens"].cpu(),
        kv_lora_rank=R, scale=SCALE, query_start_loc=a["query_start_loc"].cpu(),
    )  # fmt: skip
    lowp, _ = reference.mla_decode(
        a["query"].cpu(), a["kv_cache"].cpu(), a["block_table"].cpu(), a["seq_lens"].cpu(),
        kv_lora_rank=R, scale=SCALE, query_start_loc=a["query_start_loc"].cpu(),
        compute_dtype=torch.float32,
    )  # fmt: skip
    assert_low_precision_close(by_table, oracle, lowp, floor=1e-6)


@pytest.mark.paged
@pytest.mark.specdec
def test_expand_page_indices_ignores_unused_columns(device):
    bt, sl = _block_table(device), _i32(*SEQ_LENS).to(device)
    for num_indices in (None, sum(SEQ_LENS)):
        indptr, indices = expand_page_indices(bt, sl, BS, num_indices=num_indices)
        r_indptr, r_indices = reference.expand_page_indices(bt.cpu(), sl.cpu(), BS)
        assert torch.equal(indptr.cpu(), r_indptr) and torch.equal(indices.cpu(), r_indices)


# -- where the checks run: the caller's bounds vouch on a GPU ----------------------------------


@pytest.mark.paged
@pytest.mark.mla
def test_reads_contents_rule():
    cpu, gpu, meta = torch.device("cpu"), torch.device("cuda", 0), torch.device("meta")
    assert reads_contents(cpu, vouched=True) and reads_contents(cpu, vouched=False)
    assert reads_contents(gpu, vouched=False) and not reads_contents(gpu, vouched=True)
    assert not reads_contents(meta, vouched=False)


@pytest.mark.cpu
@pytest.mark.mla
@pytest.mark.specdec
@pytest.mark.parametrize("form", ["block_table", "page_indices"])
def test_mla_plan_reads_nothing_with_metadata(form):
    """With metadata (the CUDA-graph path) and the content check off, as on a GPU, the plan
    reads no index tensor's contents; without metadata it reads them (and says so here)."""
    a = _mla_inputs()
    if form == "page_indices":
        a["page_indices"] = tuple(t.as_subclass(Opaque) for t in _pages(a))
        a["block_table"] = None
    for key in ("block_table", "seq_lens", "query_start_loc"):
        if a[key] is not None:
            a[key] = a[key].as_subclass(Opaque)
    builder = MlaMetadataBuilder(
        get_target("sm_90"), max_batch=2, num_heads=HEADS, kv_lora_rank=R, head_dim_k=DK,
        dtype=torch.float32, device="cpu", max_query_len=2, max_seq_len=16,
    )  # fmt: skip
    md = builder.build(_i32(*SEQ_LENS), _i32(0, 2, 3), max_query_len=2)
    plan_mla_decode(**a, metadata=md, target=md.target, check_contents=False)
    with pytest.raises(RuntimeError, match=r"Opaque: the plan read"):
        plan_mla_decode(**a)


@pytest.mark.cpu
@pytest.mark.mla
@pytest.mark.specdec
def test_mla_metadata_max_query_len_bounds_the_queries():
    """Single-token metadata with a 2-token query: the kernel would take token i as sequence i."""
    builder = MlaMetadataBuilder(
        get_target("sm_90"), max_batch=2, num_heads=HEADS, kv_lora_rank=R, head_dim_k=DK,
        dtype=torch.float32, device="cpu", max_query_len=2, max_seq_len=16,
    )  # fmt: skip
    md = builder.build(_i32(*SEQ_LENS), _i32(0, 2, 2), max_query_len=1)
    q = _mla_inputs(q_lens=None)["query"]
    with pytest.raises(
        ValueError, match=r"metadata\.max_query_len must be >= the longest q_len 2; got 1"
    ):
        _mla(q_lens=None, query=q, query_start_loc=_i32(0, 2, 2), metadata=md)


# -- GPU: checks without bounds, no host sync with them ----------------------------------------


def _gpu_calls(bounds: bool, bad: bool):
    """Per op, a call on CUDA tensors with (``bounds``) or without the caller's bounds, on valid
    metadata or (``bad``) with a used block id / seq_len past the cache."""
    dev = "cuda"
    bt = _with(_block_table(dev), (1, 1), NUM_BLOCKS) if bad else _block_table(dev)
    sl = _i32(*SEQ_LENS).to(dev)
    cu = _i32(0, 6, 15).to(dev)
    k_cache, v_cache = empty_kv_cache(NUM_BLOCKS, BS, 2, 16, dtype=torch.float16, device=dev)
    q = torch.randn(3, 4, 16, dtype=torch.float16, device=dev)
    qsl = _i32(0, 2, 3).to(dev)
    a = _mla_inputs(dev)
    a["block_table"] = bt
    md = None
    if bounds:
        builder = MlaMetadataBuilder(
            get_target("sm_90"), max_batch=2, num_heads=HEADS, kv_lora_rank=R, head_dim_k=DK,
            dtype=torch.float32, device=dev, max_query_len=2, max_seq_len=16,
        )  # fmt: skip
        md = builder.build(sl, a["query_start_loc"], max_query_len=2)
    gather_out = tuple(torch.empty(15, 2, 16, dtype=torch.float16, device=dev) for _ in "kv")
    exp_sl = _i32(6, 17).to(dev) if bad else sl  # expand knows no num_blocks: past the row
    return {
        "mla_decode": lambda: mla_decode(**a, metadata=md, target=md.target if md else None),
        "paged_attention": lambda: paged_attention(
            q, k_cache, v_cache, bt, sl, qsl, **(dict(max_query_len=2) if bounds else {})
        ),
        "gather_kv_cache": lambda: gather_kv_cache(
            k_cache, v_cache, bt, cu, out=gather_out if bounds else None
        ),
        "expand_page_indices": lambda: expand_page_indices(
            bt, exp_sl, BS, num_indices=15 if bounds else None
        ),
    }


_GPU_OPS = [
    pytest.param("mla_decode", marks=pytest.mark.mla),
    pytest.param("paged_attention", marks=pytest.mark.paged),
    pytest.param("gather_kv_cache", marks=pytest.mark.paged),
    pytest.param("expand_page_indices", marks=pytest.mark.paged),
]


@pytest.mark.gpu
@pytest.mark.parametrize("op", _GPU_OPS)
def test_gpu_checks_run_without_bounds(op):
    with pytest.raises(ValueError, match=f"^{op}: "):
        _gpu_calls(bounds=False, bad=True)[op]()
    _gpu_calls(bounds=False, bad=False)[op]()


@pytest.mark.gpu
@pytest.mark.parametrize("op", _GPU_OPS)
def test_gpu_bounds_given_no_host_sync(op):
    """With the bounds given the call reads nothing on the host: no device sync (a CUDA-graph
    capture would fail on one)."""
    call = _gpu_calls(bounds=True, bad=False)[op]
    call()  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
