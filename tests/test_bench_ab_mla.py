"""bench/ab_mla.py on a CPU: the configurations' parsing, and the bookkeeping of the rounds in
turns (each timing under its own configuration's switches, the ratio to the first taken round by
round). The GPU timings cannot run here: a stand-in timer records what it was asked to time."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from portattn.policy import mla as mla_policy

_BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(_BENCH))  # ab_mla imports _common and bench_mla from there
_SPEC = importlib.util.spec_from_file_location("ab_mla", _BENCH / "ab_mla.py")
ab = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(ab)


def test_configs_parse_to_the_policys_switches():
    assert ab.parse_config("") == {}
    assert ab.parse_config("SM90_LAZY_RESCALE=0  SM90_TREE_REDUCE=1") == {
        "SM90_LAZY_RESCALE": False,
        "SM90_TREE_REDUCE": True,
    }


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("SM90_LAZY_RESCALE", "SWITCH=0 or SWITCH=1"),
        ("SM90_LAZY_RESCALE=2", "SWITCH=0 or SWITCH=1"),
        ("SM90_NO_SUCH=1", "SM90_NO_SUCH: not a boolean switch"),
        ("SM90_BLOCK_N=1", "SM90_BLOCK_N: not a boolean switch"),  # an int, not a switch
    ],
)
def test_bad_configs_are_refused_with_the_rule(text, message):
    with pytest.raises(SystemExit, match=message):
        ab.parse_config(text)


def test_rounds_run_in_turns_under_each_configurations_switches():
    configs = [{}, {"SM90_TREE_REDUCE": True}]
    seen = []
    times = iter([2.0, 1.0, 4.0, 3.0, 6.0, 2.0, 5.0, 4.0])  # ms, in the order they are asked for

    def timer(call):
        seen.append((call(), mla_policy.SM90_TREE_REDUCE))
        return next(times)

    before = mla_policy.SM90_TREE_REDUCE
    points = [
        [(dict(us_rounds=[10.0]), lambda: "p0 a"), (dict(us_rounds=[20.0]), lambda: "p0 b")],
        [(dict(us_rounds=[30.0]), lambda: "p1 a"), (dict(us_rounds=[40.0]), lambda: "p1 b")],
    ]
    rates = ab.time_in_turns(points, configs, 3, rate=lambda: len(seen), timer=timer)
    assert rates == [0, 4]  # measured before each round
    assert mla_policy.SM90_TREE_REDUCE is before  # restored
    assert seen == [("p0 a", before), ("p0 b", True), ("p1 a", before), ("p1 b", True)] * 2
    assert [r["us_rounds"] for r, _ in points[0]] == [
        [10.0, 2000.0, 6000.0],
        [20.0, 1000.0, 2000.0],
    ]


def test_summary_takes_the_ratio_round_by_round():
    roof = dict(roof_bytes=3e9, roof_flops=2e12)  # 1 ms at 3000 GB/s, 2 ms at 1000 TFLOP/s
    rows = [dict(us_rounds=[1000.0, 3000.0, 2000.0], **roof),
            dict(us_rounds=[900.0, 3300.0, 1900.0], **roof)]  # fmt: skip
    ab.summarize(rows, copy_gbs=3000.0, mm_run=1000.0, mm_turns=500.0)
    assert rows[0]["us_median"] == 2000.0 and rows[1]["us_median"] == 1900.0
    assert rows[0]["vs_first"] == 1.0
    # ratios 0.9, 1.1, 0.95: their median, not the medians' ratio (0.95)
    assert rows[1]["vs_first"] == pytest.approx(0.95)
    assert rows[1]["x_roof_run"] == pytest.approx(1900.0 / 2000.0)
    assert rows[1]["x_roof_turns"] == pytest.approx(1900.0 / 4000.0)
