"""bench/ncu_stalls.py: the stall summary of an Nsight Compute source page (CSV)."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "ncu_stalls", Path(__file__).resolve().parents[1] / "bench" / "ncu_stalls.py"
)
ncu_stalls = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(ncu_stalls)

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_barrier",
          "stall_long_sb", "stall_barrier (Not Issued)"]  # fmt: skip


def _write(path: Path, rows: list[list[str]]) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "k"])  # ncu's first line names the kernel
        w.writerow(HEADER)
        w.writerows(rows)
    return path


def test_stretches_and_reasons(tmp_path, capsys):
    rows = [
        ["0x0", "  IADD3 R1, R2, R3", "10", "0", "0", "0"],
        ["0x10", "  SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4]", "30", "0", "30", "0"],
        ["0x20", "  FMUL R4, R4, R5", "20", "0", "0", "0"],
        ["0x30", "  BAR.SYNC.DEFER_BLOCKING 0x0", "40", "40", "0", "40"],
        ["0x40", "  EXIT", "", "", "", ""],  # empty cells count as 0
    ]
    assert ncu_stalls.main([str(_write(tmp_path / "s.csv", rows))]) == 0
    out = capsys.readouterr().out
    assert out.startswith("100 samples")
    assert "barrier             40.0%" in out and "long_sb             30.0%" in out
    assert "(Not Issued)" not in out  # the not-issued copies are not counted twice
    # stretches end at the mbarrier wait (10 + 30) and at the barrier (20 + 40)
    assert "    0-    1  40.0%  SYNCS.PHASECHK" in out
    assert "    2-    3  60.0%  BAR.SYNC" in out


def test_rejects_a_csv_without_samples(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("Address,Source\n0x0,EXIT\n")
    with pytest.raises(SystemExit, match="no 'Warp Stall Sampling"):
        ncu_stalls.main([str(path)])
