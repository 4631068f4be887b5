"""bench/bench_mla.py on a CPU: the rounds' medians (verification and page points) and the
arguments' checks.

The GPU timings cannot run here; `_verify_rounds` is fed stand-in calls and a stubbed timer, so
what is checked is the bookkeeping a verdict rests on: each row's median over its rounds, taken
in turns, and every figure derived from the time recomputed from that median.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(_BENCH))  # bench_mla imports _common from there
_SPEC = importlib.util.spec_from_file_location("bench_mla", _BENCH / "bench_mla.py")
bm = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bm)


def test_verify_rounds_keep_each_rows_median_taken_in_turns(monkeypatch):
    order = []
    times = iter([9.0, 1.0, 3.0, 2.0])  # ms: rounds 2 and 3, in the order the calls ran

    def timer(fn, return_mode):
        order.append(fn())
        return next(times)

    monkeypatch.setattr(bm, "do_bench_cudagraph", timer)
    rows = [dict(us_graph=5000.0, roof_us=1000.0), dict(us_graph=4000.0, roof_us=2000.0)]
    timings = [(lambda: "a", 3e9), (lambda: "b", 6e9)]  # (call, roofline bytes)
    bm._verify_rounds(rows, timings, 3, copy_gbs=3000.0)
    assert order == ["b", "a", "a", "b"]  # in turns, the order rotated each round
    assert rows[0]["us_rounds"] == [5000.0, 1000.0, 3000.0]
    assert rows[1]["us_rounds"] == [4000.0, 9000.0, 2000.0]
    assert rows[0]["us_graph"] == 3000.0 and rows[1]["us_graph"] == 4000.0
    assert rows[0]["x_roofline"] == pytest.approx(3.0) and rows[1]["x_roofline"] == 2.0
    assert rows[1]["gb_per_s"] == pytest.approx(6e9 / 4000e-6 / 1e9)
    assert rows[1]["pct_of_copy"] == pytest.approx(100 * 1500.0 / 3000.0)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rounds", "0"], "--rounds must be >= 1; got 0"),
    ],
)
def test_bad_rounds_are_refused_with_the_rule(argv, message):
    with pytest.raises(SystemExit, match=message):
        bm.main(argv)


def test_page_rounds_keep_medians_and_the_rounds_matmul_rate(monkeypatch):
    """Page points: each policy row's call timed again in turns (the order rotated each round),
    a matmul rate before each round; the median time, its derived figures, the ratio at the
    point's rate and at the rounds' median rate all follow from it."""
    order = []
    # ms: rounds 2-4 in the order the calls ran (b a, a b, b a): a 4, 2, 6 and b 1, 3, 2.5
    times = iter([1.0, 4.0, 2.0, 3.0, 2.5, 6.0])
    rates = iter([500.0, 700.0, 600.0])  # TFLOP/s before rounds 2, 3 and 4

    def timer(fn, return_mode):
        order.append(fn())
        return next(times)

    monkeypatch.setattr(bm, "do_bench_cudagraph", timer)
    monkeypatch.setattr(bm, "matmul_rate", lambda: (next(rates), 1.0))
    # 1 ms of bytes at 3 TB/s; flops: 4 ms at the run's 750 TFLOP/s, 5 ms at 600
    roof = dict(roof_bytes=3e9, roof_flops=3e12, roof_us_roof=4000.0)
    rows = [
        dict(us_graph=9000.0, us_events=None, mm_point=600.0, **roof),
        dict(us_graph=2000.0, us_events=1500.0, mm_point=600.0, **roof),
    ]
    rates_seen = bm._page_rounds([(rows[0], lambda: "a"), (rows[1], lambda: "b")], 4,
                                 copy_gbs=3000.0, mm_run=750.0)  # fmt: skip
    assert rates_seen == [500.0, 700.0, 600.0]
    assert order == ["b", "a", "a", "b", "b", "a"]  # in turns, rotated each round
    assert rows[0]["us_rounds"] == [9000.0, 4000.0, 2000.0, 6000.0]
    assert rows[1]["us_rounds"] == [2000.0, 1000.0, 3000.0, 2500.0]
    a, b = rows
    assert a["us_graph"] == 5000.0 and b["us_graph"] == 2250.0  # medians
    assert b["gb_per_s"] == pytest.approx(3e9 / 1500e-6 / 1e9)  # events time the faster
    assert a["x_roofline"] == pytest.approx(1.25) and b["x_roofline"] == pytest.approx(0.375)
    assert a["mm_turns"] == 600.0 and a["x_roof_turns"] == pytest.approx(1.0)  # 5 ms / 5 ms
    assert a["x_roofline_point"] == pytest.approx(1.0)  # the point's 600 TFLOP/s: 5 ms
    assert b["x_roof_turns"] == pytest.approx(0.3)
