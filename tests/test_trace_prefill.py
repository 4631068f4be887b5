"""bench/trace_prefill.py's analysis on a synthetic trace (CPU): what a GPU run would print.

A device call is minutes of a budget: the analysis must not fail after the kernel ran, and its
steps must measure what they name. The trace here is built by hand with known step lengths.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

_BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(_BENCH))
_SPEC = importlib.util.spec_from_file_location("trace_prefill", _BENCH / "trace_prefill.py")
tp = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(tp)

#: consumer step lengths (cycles) from event 0: K, scores, softmax, V, P V, release, to next
STEP = [10, 500, 400, 20, 500, 30, 40]
PERIOD = sum(STEP)


def synthetic(programs=3, tiles=6, slots=8, passed=(1, 4)) -> np.ndarray:
    """Stamps ``[programs, 4, slots + 1, 10]``: warpgroups 0 and 1 compute ``tiles`` tiles
    (warpgroup 1 passes tiles ``passed`` on: events 0, 1, 4, 6 only), warpgroup 2 absent, the
    producer 100 cycles a tile, issuing 300 cycles before warpgroup 0 starts each tile."""
    st = np.full((programs, 4, slots + 1, 10), -1, dtype=np.int64)
    for p in range(programs):
        t0 = 1000 * (p + 1)
        for t in range(tiles):
            for wg in (0, 1):
                base = t0 + t * PERIOD + 7 * wg
                ev = np.cumsum([0] + STEP[:-1]) + base
                if wg == 1 and t in passed:
                    st[p, wg, t, [0, 1, 4, 6]] = ev[[0, 1, 4, 6]]
                else:
                    st[p, wg, t, :7] = ev
            st[p, 3, t, :3] = [t0 + t * PERIOD - 400, t0 + t * PERIOD - 350, t0 + t * PERIOD - 300]
        end = t0 + tiles * PERIOD + 100
        for part in (0, 1, 3):
            st[p, part, slots, :4] = [t0 - 500, 10 * (t0 - 500), end, 10 * end]
    return st


def test_steps_measure_what_they_name():
    lines: list[str] = []
    res = tp.analyse(synthetic(), out=lines.append)
    text = "\n".join(lines)
    for i, (name, _, _) in enumerate(tp.STEPS):
        assert res[(0, name)] == STEP[i], (name, text)
    assert res[(0, "period")] == PERIOD
    assert res[("producer", "block-table loads, stage free")] == 50
    assert res[("producer", "copies issued")] == 50
    assert res["copies issued before WG0 waits"] == 300
    assert res["release skew WG0/WG1"] == 7
    # the end is 100 cycles after the last tile's period; warpgroup 1 releases 7 cycles after 0
    assert res["last release to end"] == 100 + STEP[-1] - 7
    assert "warpgroup 1" in text and "passed on" in text
    assert "clock 0.100 GHz" in text  # 1 cycle per 10 ns in the synthetic timer
    assert res["programs past the buffer"] == 0 and "ran past" not in text


def test_programs_past_the_buffer_are_reported():
    lines: list[str] = []
    res = tp.analyse(synthetic(tiles=8, slots=8), out=lines.append)
    assert res["programs past the buffer"] == 3
    assert "3 programs ran past the trace's 8 tiles" in "\n".join(lines)


def test_three_warpgroups_count_in_the_peak():
    """A 3-warpgroup tile: the third warpgroup's steps are printed and the tensor peak counts
    its 64 rows."""
    st = synthetic()
    st[:, 2] = st[:, 0]
    lines: list[str] = []
    res = tp.analyse(st, warpgroups=3, out=lines.append)
    assert res[(2, "period")] == PERIOD
    ideal = tp.tile_macs(128, 128, 3) / tp.PEAK_MACS
    assert f"at the tensor peak {ideal:.0f}:" in "\n".join(lines)


def test_passed_on_tiles_are_not_steady_steps():
    """A tile warpgroup 1 only passed on has no score stamp: its steps stay out of the medians
    (its K wait would be a whole P V short)."""
    lines: list[str] = []
    res = tp.analyse(synthetic(passed=(2, 3, 4, 5)), out=lines.append)
    assert res.get((1, "S = Q K^T")) is None  # every steady tile of warpgroup 1 passed on
    assert "12 passed on" in "\n".join(lines)  # 4 tiles in each of 3 programs


def test_an_absent_partition_prints_nothing_for_it():
    st = synthetic()
    assert (st[:, 2] == -1).all()  # two consumer warpgroups: the third slot stays empty
    lines: list[str] = []
    tp.analyse(st, out=lines.append)
    assert not any("warpgroup 2" in line for line in lines)


def test_tile_argument_is_two_integers():
    """``--tile STAGES:LAG``: parsed to two integers, anything else refused with the rule."""
    import argparse

    assert tp._tile_arg("3:2") == (3, 2)
    for bad in ("3", "a:b", "3:2:1", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="STAGES:LAG, two integers"):
            tp._tile_arg(bad)


def test_item_boundaries_are_split_at_the_item_start():
    """Event 7 (an item's first tile, before its query load) splits the gap after the previous
    tile's release: epilogue and metadata before it, the query after; an item with no tile before
    it in the trace counts only in the second. The share is their sum over the span."""
    st = synthetic()
    for t in (0, 3):  # items of three tiles on warpgroup 0
        st[:, 0, t, 7] = st[:, 0, t, 0] - 15
    lines: list[str] = []
    res = tp.analyse(st, out=lines.append)
    assert res[(0, "item end to start")] == STEP[-1] - 15
    assert res[(0, "item start to first tile")] == 15
    span = 5 * PERIOD + sum(STEP[:6])
    assert res[(0, "item share")] == pytest.approx(STEP[-1] / span)
    assert (1, "item share") not in res  # warpgroup 1 stamped no item start
    assert "2.0 items a program" in "\n".join(lines)
    assert not any("(epilogue)" in line for line in lines)  # no events 8 and 9 stamped


def test_item_end_splits_into_epilogue_ring_and_metadata():
    """Events 8 (stores issued) and 9 (next step in hand) on an item's last tile split its end
    to the next item's start into three parts that add up to it."""
    st = synthetic()
    st[:, 0, 3, 7] = st[:, 0, 3, 0] - 15
    st[:, 0, 2, 8] = st[:, 0, 2, 6] + 10  # release + 10: stores issued
    st[:, 0, 2, 9] = st[:, 0, 2, 6] + 12  # + 2: the next step in hand
    lines: list[str] = []
    res = tp.analyse(st, out=lines.append)
    assert res[(0, "release to stores issued (epilogue)")] == 10
    assert res[(0, "stores to next step (ring)")] == 2
    assert res[(0, "next step to item start (metadata)")] == STEP[-1] - 15 - 12
    assert res[(0, "item end to start")] == STEP[-1] - 15
