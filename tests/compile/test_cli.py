"""``python -m portattn.compile`` as a command: what it checks before compiling (no compiling)."""

from __future__ import annotations

import sys

import pytest

import portattn.compile.__main__ as cli
from portattn.compile import CellResult, LaunchResult, evaluate
from portattn.platform import TARGETS

pytestmark = pytest.mark.compile


def _passing_cell() -> CellResult:
    t = TARGETS["sm_90"]
    cell = CellResult("paged_attention", "hd128 case", "sm_90", t.vendor, t.max_shared_mem)
    cell.launches = [LaunchResult("k", "_k", True, shared=1024, regs=64, spills=0)]
    return evaluate(cell)


def test_a_missing_matplotlib_is_said_before_compiling_and_only_skips_the_heatmap(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails here
    said_before: list[str] = []

    def run_matrix(cases, targets, **kwargs):
        said_before.append(capsys.readouterr().err)  # what was printed before compiling
        return [_passing_cell()]

    monkeypatch.setattr(cli, "run_matrix", run_matrix)
    argv = ["--targets", "sm_90", "--kernels", "paged_attention", "--out", str(tmp_path)]
    assert cli.main(argv) == 0  # every cell passed: the missing heatmap is no failure
    assert said_before[0].startswith("warning: matplotlib not installed: no heatmap")
    assert (tmp_path / "compile_matrix.json").is_file()
    assert (tmp_path / "compile_matrix.md").is_file()
    assert not (tmp_path / "compile_matrix.png").exists()
    assert "reports in" in capsys.readouterr().out


def test_no_png_asks_for_no_heatmap_and_no_warning(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(cli, "run_matrix", lambda *a, **k: [_passing_cell()])
    argv = ["--targets", "sm_90", "--kernels", "paged_attention", "--out", str(tmp_path)]
    assert cli.main([*argv, "--no-png"]) == 0
    assert "warning" not in capsys.readouterr().err
