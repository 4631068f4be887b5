"""bench/diag_clock.py and `_common.ClockSampler` on a CPU: the sampler's thread collects what
its reader returns while the block runs, trims the ends and raises a reader's failure; the
summary splits a time ratio into cycles and clock; bad arguments stop the script, naming them."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(_BENCH))  # the script imports _common and bench_prefill from there
import _common  # noqa: E402
import diag_clock  # noqa: E402


def test_sampler_collects_while_the_block_runs_and_trims_the_ends():
    ticks = iter(range(10**6))
    with _common.ClockSampler(lambda: (float(next(ticks)), 1.0), ms=1, trim=2) as s:
        time.sleep(0.2)
    got = [mhz for mhz, _ in s.samples]
    assert len(got) >= 10  # ~1 ms apart over 0.2 s (a loaded machine takes fewer)
    assert got == list(range(2, 2 + len(got)))  # in order, the first two left out
    assert next(ticks) == got[-1] + 3  # ... and the last two


def test_sampler_raises_what_its_reader_raised():
    def read():
        raise OSError("libnvidia-ml.so.1: cannot open")

    with (
        pytest.raises(RuntimeError, match="read failed: libnvidia-ml"),
        _common.ClockSampler(read, ms=1),
    ):
        time.sleep(0.05)


@pytest.mark.parametrize("kw", [dict(ms=0), dict(trim=-1)])
def test_sampler_refuses_bad_arguments(kw):
    with pytest.raises(ValueError, match="ClockSampler: ms must be > 0 and trim >= 0"):
        _common.ClockSampler(lambda: (0.0, 0.0), **kw)


def test_summary_splits_time_into_cycles_and_clock():
    """Block 16 5% slower at a 3% lower clock: cycles 1.05 x 0.97; rounds' medians."""
    rows = [
        dict(point="p", block_size=2048, us=[100.0, 90.0, 101.0], mhz=[1800.0] * 3),
        dict(point="p", block_size=16, us=[105.0, 104.0, 200.0], mhz=[1746.0, 1700.0, 1800.0]),
        dict(point="q", block_size=544, us=[50.0], mhz=[1500.0]),
        dict(point="q", block_size=2048, us=[40.0], mhz=[1600.0]),
    ]
    got = {(s["point"], s["block_size"]): s for s in diag_clock.summarize(rows)}
    assert set(got) == {("p", 16), ("q", 544)}
    p = got[("p", 16)]
    assert p["against"] == 2048
    assert p["time"] == pytest.approx(1.05)
    assert p["clock"] == pytest.approx(1746 / 1800)
    assert p["cycles"] == pytest.approx(1.05 * 1746 / 1800)
    assert got[("q", 544)]["cycles"] == pytest.approx(50 * 1500 / (40 * 1600))


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--points", "nope"], "--points ['nope'] not among"),
        (["--seconds", "0"], "--seconds must be > 0 and --rounds >= 1"),
        (["--rounds", "0"], "--seconds must be > 0 and --rounds >= 1"),
        (["--blocks", "16,x"], "diag_clock: --blocks must be positive integers"),
        (["--blocks", "0"], "diag_clock: --blocks must be positive integers"),
        (["--blocks", ""], "diag_clock: --blocks names no block size"),
    ],
)
def test_bad_arguments_stop_the_script_naming_them(argv, words):
    with pytest.raises(SystemExit, match=words.replace("[", r"\[").replace("]", r"\]")):
        diag_clock.main(argv)
