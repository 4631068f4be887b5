"""The device-side metadata check (`portattn.kernels.metadata_summary`) against the host checks
the ops run (`_check_contents` of paged_attention and mla_decode, built on `_checks`): on any
metadata -- valid, or with one rule broken, laid out as strided views with junk around them, in
int32 or int64 -- the summary calls the metadata broken exactly when the host checks raise, and
otherwise finds the same maxima. On the CPU the kernel runs under the interpreter; in the GPU
cells (`device` fixture) it runs compiled, as an unbounded call runs it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from portattn.kernels import mla_decode as mla_mod
from portattn.kernels import paged_attention as paged_mod
from portattn.kernels._checks import POSITIONS32_LIMIT
from portattn.kernels.metadata_summary import read_metadata_summary
from tests.kernels.test_metadata_properties import _SETTINGS, _offsets, paged_metadata, placed

EXAMPLES = 60
BREAKS = (
    "none",
    "none",
    "first offset",
    "tokens +1",
    "tokens -1",
    "decrease",
    "short seq_len",
    "negative seq_len",
    "over capacity",
    "huge seq_len",
    "block id past the cache",
    "negative block id",
    "garbage in unused columns",
)


@st.composite
def metadata(draw):
    """(block_size, num_blocks, num_tokens, qsl, seq_lens, table, index dtype, what broke):
    a valid batch with at most one rule broken, as CPU int64 tensors."""
    block_size, sl, ql, table, num_blocks = draw(paged_metadata(min_q=0))
    dtype = draw(st.sampled_from((torch.int32, torch.int64)))
    qsl = _offsets(ql)
    num_tokens = int(qsl[-1])
    what = draw(st.sampled_from(BREAKS))
    n, cols = table.shape
    i = draw(st.integers(0, n - 1))
    used = -(-int(sl[i]) // block_size)
    if what == "first offset":
        qsl = qsl + 1
        num_tokens += 1
    elif what == "tokens +1":
        num_tokens += 1  # MLA: rows past query_start_loc's end are padding, so still valid
    elif what == "tokens -1" and num_tokens > 0:
        num_tokens -= 1
    elif what == "decrease" and n > 1 and int(qsl[i + 1]) > 0:
        qsl[i + 1] = int(qsl[i]) - 1
    elif what == "short seq_len" and int(ql[i]) > 0:
        sl[i] = int(ql[i]) - 1
    elif what == "negative seq_len":
        sl[i] = -1
    elif what == "over capacity":
        sl[i] = cols * block_size + 1
    elif what == "huge seq_len":
        top = [POSITIONS32_LIMIT, 2**31 - 1] if dtype == torch.int32 else [2**63 - 1]
        sl[i] = draw(st.sampled_from(top))
    elif what == "block id past the cache" and used:
        table[i, draw(st.integers(0, used - 1))] = num_blocks
    elif what == "negative block id" and used:
        table[i, draw(st.integers(0, used - 1))] = -1
    elif what == "garbage in unused columns" and used < cols:
        table[i, used:] = 10**6
    return block_size, num_blocks, num_tokens, qsl, sl, table, dtype, what


def _host_paged(block_size, num_blocks, num_tokens, qsl, sl, table):
    """paged_attention's host verdict: (longest q_len, longest seq_len), or ``None``."""
    query = torch.empty((num_tokens, 1, 1))
    k = SimpleNamespace(block_size=block_size, num_blocks=num_blocks)
    try:
        return paged_mod._check_contents(query, k, table, sl, qsl, None, None)
    except ValueError:
        return None


def _host_mla(block_size, num_blocks, num_tokens, qsl, sl, table):
    """mla_decode's host verdict: the longest q_len (1 without query_start_loc), or ``None``."""
    query = torch.empty((num_tokens, 1, 1))
    cache = torch.empty((num_blocks, block_size, 1))
    try:
        return mla_mod._check_contents(query, cache, table, sl, qsl, None, None)
    except ValueError:
        return None


@pytest.mark.paged
@settings(max_examples=EXAMPLES, **_SETTINGS)
@given(data=st.data())
def test_summary_agrees_with_paged_checks(data, device):
    bs, nb, tokens, qsl, sl, table, dtype, what = data.draw(metadata())
    want = _host_paged(bs, nb, tokens, qsl, sl, table)
    views = [data.draw(placed(t, device, dtypes=(dtype,))) for t in (qsl, sl, table)]
    got = read_metadata_summary(
        *views, num_tokens=tokens, block_size=bs, num_blocks=nb, end_at_most=False,
        max_len=POSITIONS32_LIMIT - 1,
    )  # fmt: skip
    assert (None if got is None else (got.max_q_len, got.max_seq_len)) == want, what
    assert got is None or got.tokens == tokens


@pytest.mark.mla
@settings(max_examples=EXAMPLES, **_SETTINGS)
@given(data=st.data())
def test_summary_agrees_with_mla_checks(data, device):
    bs, nb, tokens, qsl, sl, table, dtype, what = data.draw(metadata())
    with_qsl = data.draw(st.booleans())
    want = _host_mla(bs, nb, tokens, qsl if with_qsl else None, sl, table)
    views = [data.draw(placed(t, device, dtypes=(dtype,))) for t in (qsl, sl, table)]
    got = read_metadata_summary(
        views[0] if with_qsl else None, *views[1:], num_tokens=tokens, block_size=bs,
        num_blocks=nb, end_at_most=True, max_len=mla_mod.longest_seq_len(dtype),
    )  # fmt: skip
    assert (None if got is None else max(1, got.max_q_len)) == want, what


def _host_gather(block_size, num_blocks, cu, table):
    """gather_kv_cache's host verdict without ``out``: the token count, or ``None``."""
    from portattn.kernels.kv_cache import _check_gather_indices

    addr = SimpleNamespace(block_size=block_size, num_blocks=num_blocks)
    cu_np, table_np = cu.numpy(), table.numpy()
    try:
        _check_gather_indices("gather_kv_cache", table_np, cu_np, addr, int(cu_np[-1]), False)
    except ValueError:
        return None
    return int(cu_np[-1])


@pytest.mark.paged
@settings(max_examples=EXAMPLES, **_SETTINGS)
@given(data=st.data())
def test_summary_agrees_with_gather_checks(data, device):
    """`gather_kv_cache` without ``out``: ``cu_seq_lens`` are the offsets and the lengths, a
    negative block id a sequence uses is padding (valid), and the summary gives the token
    count."""
    bs, nb, _, qsl, _, table, dtype, what = data.draw(metadata())
    i = data.draw(st.integers(0, table.shape[0] - 1))
    change = data.draw(st.sampled_from(("none", "over capacity", "padding")))
    if change == "over capacity":  # a sequence longer than its row
        qsl[i + 1 :] += table.shape[1] * bs + 1 - (qsl[i + 1] - qsl[i])
    elif change == "padding" and qsl[i + 1] > qsl[i]:  # in a block the sequence uses: valid
        table[i, 0] = -1
    what = f"{what}, {change}"
    want = _host_gather(bs, nb, qsl, table)
    cu, tab = (data.draw(placed(t, device, dtypes=(dtype,))) for t in (qsl, table))
    got = read_metadata_summary(cu, None, tab, num_tokens=2**63 - 1, block_size=bs,
                                num_blocks=nb, end_at_most=True, padding_ok=True)  # fmt: skip
    assert (None if got is None else got.tokens) == want, what
    if got is not None:
        assert got.max_q_len == got.max_seq_len == int((qsl[1:] - qsl[:-1]).max())


@pytest.mark.paged
def test_summary_reads_huge_seq_lens_without_overflow(device):
    """A seq_len near 2**63 needs more columns than any table has: broken, by both checks
    (ceil(seq_len / block_size) computed without the overflow of seq_len + block_size - 1)."""
    qsl = torch.tensor([0, 1])
    sl = torch.tensor([2**63 - 1])
    table = torch.zeros((1, 4), dtype=torch.int64)
    assert _host_paged(16, 4, 1, qsl, sl, table) is None
    on = [t.to(device) for t in (qsl, sl, table)]
    assert read_metadata_summary(*on, num_tokens=1, block_size=16, num_blocks=4,
                                 end_at_most=False) is None  # fmt: skip


@pytest.mark.paged
@pytest.mark.mla
def test_a_seq_len_past_32_bit_positions_is_broken_only_where_they_are_32_bit(device):
    """2**31 tokens fit a 2-column row of 2**31-token blocks: valid for MLA with int64 seq_lens
    (its kernels count them in 64 bits), broken for paged_attention (32-bit positions, a tile
    and a split past the end included) and for MLA's int32 seq_lens, by both checks."""
    qsl, sl = torch.tensor([0, 1]), torch.tensor([2**31])
    table = torch.zeros((1, 2), dtype=torch.int64)
    assert _host_paged(2**31, 1, 1, qsl, sl, table) is None
    assert _host_mla(2**31, 1, 1, qsl, sl, table) == 1
    on = [t.to(device) for t in (qsl, sl, table)]
    kw = dict(num_tokens=1, block_size=2**31, num_blocks=1, end_at_most=False)
    assert read_metadata_summary(*on, **kw, max_len=POSITIONS32_LIMIT - 1) is None
    assert read_metadata_summary(*on, **kw).max_seq_len == 2**31
    for n, ok in ((POSITIONS32_LIMIT - 1, True), (POSITIONS32_LIMIT, False)):
        sl32 = torch.tensor([n], dtype=torch.int32)
        assert (_host_paged(2**31, 1, 1, qsl, sl32, table) is not None) == ok
        assert (_host_mla(2**31, 1, 1, qsl, sl32, table) is not None) == ok
        limit = mla_mod.longest_seq_len(torch.int32)
        got = read_metadata_summary(on[0], sl32.to(device), on[2], **kw, max_len=limit)
        assert (got is not None) == ok


@pytest.mark.paged
def test_a_decrease_whose_difference_wraps_is_broken(device):
    """Offsets ``[0, 2**63 - 1, -5, 4]`` decrease at index 2, though ``-5 - (2**63 - 1)``
    wraps to a positive int64: both checks compare the offsets instead of subtracting (block
    size 2**62, so only that rule is broken)."""
    cu = torch.tensor([0, 2**63 - 1, -5, 4])
    table = torch.zeros((3, 2), dtype=torch.int64)
    assert _host_gather(2**62, 1, cu, table) is None
    got = read_metadata_summary(cu.to(device), None, table.to(device), num_tokens=2**63 - 1,
                                block_size=2**62, num_blocks=1, end_at_most=True,
                                padding_ok=True)  # fmt: skip
    assert got is None


@pytest.mark.paged
def test_summary_leaves_its_running_maxima_zero(device):
    """The last program hands the totals over and zeroes the running maxima, so a call after a
    longer one reads its own maxima, and a valid call after a broken one is not broken."""
    from portattn.kernels.metadata_summary import _buffers

    table = torch.arange(8, dtype=torch.int64).reshape(2, 4).to(device)
    calls = [
        (torch.tensor([0, 3, 5]), torch.tensor([40, 9]), (3, 40)),
        (torch.tensor([0, 1, 2]), torch.tensor([1, 2]), (1, 2)),
        (torch.tensor([0, 1, 2]), torch.tensor([1, 99]), None),  # past the table's columns
        (torch.tensor([0, 2, 2]), torch.tensor([5, 0]), (2, 5)),
    ]
    for qsl, sl, want in calls:
        got = read_metadata_summary(qsl.to(device), sl.to(device), table,
                                    num_tokens=int(qsl[-1]), block_size=16, num_blocks=8,
                                    end_at_most=False)  # fmt: skip
        assert (None if got is None else got[:2]) == want
        assert _buffers(table.device).running.tolist() == [0] * 5


@pytest.mark.gpu
@pytest.mark.paged
def test_summary_on_two_streams():
    """Each stream keeps its own running maxima and totals: summaries queued on a side stream
    and on the default stream, alternately, each read their own maxima."""
    from portattn.kernels.metadata_summary import _buffers

    table = torch.arange(64, dtype=torch.int32, device="cuda").reshape(4, 16)
    side = torch.cuda.Stream()
    for n in range(1, 9):
        sl = torch.full((4,), 16 * n, dtype=torch.int32, device="cuda")
        qsl = torch.arange(0, 5 * n, n, dtype=torch.int32, device="cuda")
        kw = dict(num_tokens=4 * n, block_size=16, num_blocks=64, end_at_most=False)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            got_side = read_metadata_summary(qsl, sl + 16, table, **kw)
        got = read_metadata_summary(qsl, sl, table, **kw)
        assert got == (n, 16 * n, 4 * n)
        assert got_side == (n, 16 * n + 16, 4 * n)
    for stream in (side, torch.cuda.current_stream()):
        with torch.cuda.stream(stream):
            assert _buffers(table.device).running.tolist() == [0] * 5
            # the kernel writes the totals into pinned host memory itself: no copy is queued
            assert _buffers(table.device).totals.is_pinned()


def test_summary_buffers_are_kept_per_thread_and_bounded(device, monkeypatch):
    """Each thread reads its own totals; past `MAX_BUFFERS` sets the oldest is dropped, and a
    thread whose set was dropped gets a new, zeroed one."""
    import threading

    from portattn.kernels import metadata_summary as ms

    monkeypatch.setattr(ms, "_BUFFERS", {})
    monkeypatch.setattr(ms, "MAX_BUFFERS", 2)
    table = torch.arange(8, dtype=torch.int64).reshape(2, 4).to(device)
    got = {}

    def call(n):
        qsl = torch.tensor([0, n, 2 * n]).to(device)
        got[n] = read_metadata_summary(qsl, torch.tensor([16 * n, 16]).to(device), table,
                                       num_tokens=2 * n, block_size=16, num_blocks=8,
                                       end_at_most=False)  # fmt: skip

    release = threading.Event()

    def live(n, done):  # each thread stays alive until the last has called (distinct idents)
        call(n)
        done.set()
        release.wait()

    threads = []
    for n in (1, 2, 3):  # one call at a time
        done = threading.Event()
        threads.append(threading.Thread(target=live, args=(n, done), daemon=True))
        threads[-1].start()
        assert done.wait(120), f"call {n} did not finish"
    release.set()
    for t in threads:
        t.join()
    assert got == {n: (n, 16 * n, 2 * n) for n in (1, 2, 3)}
    assert len(ms._BUFFERS) == 2
    assert all(b.running.tolist() == [0] * 5 for b in ms._BUFFERS.values())
