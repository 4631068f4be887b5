"""bench/bench_mla.py on a CPU: the verification rounds' medians and the arguments' checks.

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
    times = iter([9.0, 1.0, 3.0, 2.0])  # ms: rounds 2 and 3 of rows a and b, in turns

    def timer(fn, return_mode):
        order.append(fn())
        return next(times)

    monkeypatch.setattr(bm, "do_bench_cudagraph", timer)
    rows = [dict(us_graph=5000.0, roof_us=1000.0), dict(us_graph=4000.0, roof_us=2000.0)]
    timings = [(lambda: "a", 3e9), (lambda: "b", 6e9)]  # (call, roofline bytes)
    bm._verify_rounds(rows, timings, 3, copy_gbs=3000.0)
    assert order == ["a", "b", "a", "b"]
    assert rows[0]["us_rounds"] == [5000.0, 9000.0, 3000.0]
    assert rows[1]["us_rounds"] == [4000.0, 1000.0, 2000.0]
    assert rows[0]["us_graph"] == 5000.0 and rows[1]["us_graph"] == 2000.0
    assert rows[0]["x_roofline"] == pytest.approx(5.0) and rows[1]["x_roofline"] == 1.0
    assert rows[1]["gb_per_s"] == pytest.approx(6e9 / 2000e-6 / 1e9)
    assert rows[1]["pct_of_copy"] == pytest.approx(100 * 3000.0 / 3000.0)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rounds", "0"], "--rounds must be >= 1; got 0"),
        (["--rounds", "2"], "--rounds times verification points; give --q-len too"),
    ],
)
def test_bad_rounds_are_refused_with_the_rule(argv, message):
    with pytest.raises(SystemExit, match=message):
        bm.main(argv)
