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


def _must_not_compile(*args, **kwargs):
    raise AssertionError("compiled despite a usage error")


def test_a_report_folder_that_cannot_be_made_stops_before_compiling(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "run_matrix", _must_not_compile)
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cli.main(["--targets", "sm_90", "--out", str(blocker / "out")]) == 2
    assert "error: compile: cannot create the report folder" in capsys.readouterr().err


def test_a_cases_pattern_that_is_no_regular_expression_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setattr(cli, "run_matrix", _must_not_compile)
    assert cli.main(["--cases", "hd128 ["]) == 2
    assert "compile: cases must be a regular expression; got 'hd128 ['" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "value", "low"),
    [("--jobs", "0", 1), ("-j", "-2", 1), ("--max-rows", "-1", 0), ("--jobs", "x", 1)],
)
def test_counts_below_their_floor_are_usage_errors(option, value, low, monkeypatch, capsys):
    monkeypatch.setattr(cli, "run_matrix", _must_not_compile)
    with pytest.raises(SystemExit) as info:
        cli.main([option, value])
    assert info.value.code == 2
    assert f"must be an int >= {low}; got {value!r}" in capsys.readouterr().err


@pytest.mark.parametrize(("option", "value"), [("--targets", ""), ("--kernels", " , ")])
def test_an_empty_list_selects_nothing_and_is_a_usage_error(option, value, monkeypatch, capsys):
    """An empty ``--targets "$TARGETS"`` would otherwise compile no cell and pass."""
    monkeypatch.setattr(cli, "run_matrix", _must_not_compile)
    with pytest.raises(SystemExit) as info:
        cli.main([option, value])
    assert info.value.code == 2
    assert f"must name at least one, comma-separated; got {value!r}" in capsys.readouterr().err
