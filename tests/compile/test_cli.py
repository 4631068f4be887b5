"""``python -m portattn.compile`` as a command: what it checks before compiling (no compiling)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
    assert "error: compile: cannot create the report folder --out" in capsys.readouterr().err


ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str, env: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
    """``python -m portattn.compile ARGS`` in a child process, as a user runs it."""
    env = dict(os.environ if env is None else env, PYTHONPATH=str(ROOT / "src"))
    cmd = [sys.executable, "-m", "portattn.compile", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, text=True, timeout=120, **kw)


ONE = ["--kernels", "metadata_summary", "--targets", "sm_90", "--no-png"]


@pytest.mark.parametrize(
    ("where", "value", "message"),
    [
        ("flag", "{file}", "--cache-dir {file}: must be a folder this process can create and "
                           "write in (File exists)"),
        ("flag", "{file}/sub", "--cache-dir {file}/sub: must be a folder"),
        ("env", "{file}", "TRITON_CACHE_DIR {file}: must be a folder"),
        ("env", "", "TRITON_CACHE_DIR must name a folder; got ''"),
    ],
)  # fmt: skip
def test_a_triton_cache_that_cannot_be_written_is_one_usage_error(where, value, message, tmp_path):
    """Not a compile failure in every cell (each worker's cache write fails the same way)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    value = value.format(file=blocker)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
    args = [*ONE, "--out", str(tmp_path / "out")]
    if where == "flag":
        args += ["--cache-dir", value]
    else:
        env["TRITON_CACHE_DIR"] = value
    proc = _cli(*args, env=env, capture_output=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"error: compile: {message.format(file=blocker)}")
    assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert not (tmp_path / "out" / "compile_matrix.json").exists()


@pytest.mark.parametrize("report", ["compile_matrix.json", "compile_matrix.md",
                                    "compile_matrix.png"])  # fmt: skip
def test_a_report_path_that_is_a_folder_stops_before_compiling(report, tmp_path, monkeypatch,
                                                               capsys):  # fmt: skip
    """Instead of compiling for minutes and failing on the last write, with only some reports."""
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(cli, "run_matrix", _must_not_compile)
    (tmp_path / report).mkdir()
    argv = ["--targets", "sm_90", "--kernels", "paged_attention", "--out", str(tmp_path)]
    assert cli.main(argv) == 2
    assert f"--out {tmp_path}: {report} exists and is not a file" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == [report]


def test_a_report_folder_is_fine_when_the_heatmap_is_not_asked_for(tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "run_matrix", lambda *a, **k: [_passing_cell()])
    (tmp_path / "compile_matrix.png").mkdir()
    argv = ["--targets", "sm_90", "--kernels", "paged_attention", "--out", str(tmp_path)]
    assert cli.main([*argv, "--no-png"]) == 0


def test_list_into_a_closed_pipe_ends_quietly():
    """``--list | head``: the reader is gone before the listing ends; no BrokenPipeError."""
    read, write = os.pipe()
    os.close(read)  # every write of the child fails with EPIPE
    try:
        proc = _cli("--list", stdout=write, stderr=subprocess.PIPE)
    finally:
        os.close(write)
    assert proc.returncode == 0 and proc.stderr == ""


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
