"""Bad arguments, missing or malformed inputs and unwritable outputs of `python -m kubematrix`
and `python -m kubematrix.cell`: one line naming what is wrong, a non-zero exit, no traceback,
never a green run that tested nothing, never a summary half rewritten."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kubematrix import report
from kubematrix.__main__ import main
from kubematrix.local import find_project_root
from kubematrix.matrix import get_cell

pytestmark = pytest.mark.ci

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
PAGED, MLA = get_cell("paged-cpu-interpreter"), get_cell("mla-cpu-interpreter")


def _kubematrix(*argv: str, cwd: Path, env: dict[str, str] | None = None):
    """The real command in a fresh process (kubematrix found on PYTHONPATH)."""
    env = {**os.environ, "PYTHONPATH": str(SRC), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", *argv], cwd=cwd, env=env, capture_output=True, text=True
    )


@pytest.fixture
def results_dir(tmp_path) -> Path:
    """Two cells' JUnits (paged passes, mla fails), as a build leaves them."""
    out = tmp_path / "r"
    out.mkdir()
    for cell in (PAGED, MLA):
        shutil.copy(DATA / f"{cell.name}.xml", out)
    return out


def test_usage_names_the_command_as_it_was_run(tmp_path):
    """The console script's usage said `python -m kubematrix`."""
    script = tmp_path / "kubematrix"  # what pip writes for the console script
    script.write_text("import sys\nfrom kubematrix.__main__ import main\nsys.exit(main())\n")
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    as_script = subprocess.run([sys.executable, str(script), "--help"], cwd=tmp_path, env=env,
                               capture_output=True, text=True)  # fmt: skip
    assert as_script.stdout.startswith("usage: kubematrix "), as_script.stdout[:200]
    assert "Run 'kubematrix COMMAND --help'" in as_script.stdout  # said the module form
    as_module = _kubematrix("kubematrix", "--help", cwd=tmp_path)
    assert as_module.stdout.startswith("usage: python -m kubematrix "), as_module.stdout[:200]
    assert "Run 'python -m kubematrix COMMAND --help'" in as_module.stdout
    compile_script = tmp_path / "portattn-compile"
    compile_script.write_text(
        "import sys\nfrom portattn.compile.__main__ import main\nsys.exit(main())\n"
    )
    wrong = subprocess.run([sys.executable, str(compile_script), "--jobs", "0"], cwd=tmp_path,
                           env=env, capture_output=True, text=True)  # fmt: skip
    assert wrong.returncode == 2 and wrong.stderr.startswith("usage: portattn-compile "), (
        wrong.stderr
    )


def test_an_unknown_cell_names_the_option(capsys):
    assert main(["list", "--cell", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kubematrix list: --cell must be one of ['compile-cpu-interpreter', ")
    assert err.rstrip().endswith("; got ['nope']")


# -- a compile cell that compiled nothing -------------------------------------------------------


def test_a_compile_cell_that_compiled_nothing_is_not_run(tmp_path, capsys):
    """`--compile-arg=--list` makes the compile module list its cases and exit 0: the cell was
    reported as passed (1 test) and the matrix exited 0."""
    out = tmp_path / "r"
    args = ["matrix", "--cell", "compile-cpu-interpreter", "--compile-arg=--list"]
    assert main([*args, "--results", str(out)]) == 4
    (cell,) = report.collect([get_cell("compile-cpu-interpreter")], out)
    assert cell.status == "not run" and "exited 0 without a report" in cell.reason, cell.reason
    printed = capsys.readouterr().out
    assert "nothing compiled" in printed
    assert "runner local runs 1, 0 not run here" in printed  # no pytest runs: no "pytest -n"


def test_compile_args_without_a_compile_cell_are_refused(tmp_path, capsys):
    code = main(["matrix", "--suite", "policy", "--compile-arg=--list", "--results", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "--compile-arg is for the compile cell, and no compile cell is selected" in err
    assert not list(tmp_path.iterdir())  # refused before the results folder was touched


# -- a report of nothing ------------------------------------------------------------------------

EMPTY_RESULTS = {
    "an empty folder": {},
    "an empty JUnit": {"paged-cpu-interpreter.xml": "<testsuites/>"},
    "an all-skipped JUnit": {
        "paged-cpu-interpreter.xml": '<testsuites><testsuite><testcase name="a">'
        '<skipped message="no"/></testcase></testsuite></testsuites>'
    },
}


@pytest.mark.parametrize("kind", list(EMPTY_RESULTS))
def test_a_report_in_which_nothing_was_tested_exits_4_as_the_matrix_does(kind, tmp_path, capsys):
    for name, text in EMPTY_RESULTS[kind].items():
        (tmp_path / name).write_text(text)
    assert main(["report", "--results", str(tmp_path)]) == 4
    assert "none of the 22 selected cells has a test result" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["report", "matrix"])
def test_an_empty_results_name_is_refused(command, tmp_path, monkeypatch, capsys):
    """``--results ""`` read and wrote the current folder."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as done:
        main([command, "--results", "", "--suite", "policy"])
    assert done.value.code == 2
    assert "argument --results: must not be empty" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


# -- filters that select no cell ----------------------------------------------------------------


@pytest.mark.parametrize(
    "argv", [["list"], ["list", "--json"], ["matrix"], ["report"]], ids=" ".join
)
def test_filters_that_select_no_cell_are_a_usage_error(argv, results_dir, capsys):
    before = {p.name: p.read_bytes() for p in results_dir.iterdir()}
    results = [] if argv[0] == "list" else ["--results", str(results_dir)]
    code = main([*argv, "--suite", "policy", "--backend", "cuda", *results])
    out = capsys.readouterr()
    assert code == 2 and out.out == ""
    assert "the filters --suite policy --backend cuda select no cell" in out.err, out.err
    assert {p.name: p.read_bytes() for p in results_dir.iterdir()} == before  # nothing written


# -- records and JUnit numbers that no runner writes --------------------------------------------


def _record(**changes) -> str:
    d = report.result_to_dict(report.result_from_junit(PAGED, DATA / "paged-cpu-interpreter.xml"))
    for key, value in changes.items():
        target, _, field = key.rpartition("__")
        (d[target] if target else d)[field] = value
    return json.dumps(d)


BAD_RECORDS = {
    "another cell's": (_record(cell="mla-cpu-interpreter"), "cell is 'mla-cpu-interpreter'"),
    "passed without a pass": (
        _record(counts__passed=0, counts__tests=1),
        "status is 'passed', but its counts say 'skipped'",
    ),
    "negative seconds": (_record(seconds=-5), "seconds is -5, not a finite number >= 0"),
    "unknown status": (_record(status="bogus"), "status is 'bogus', not one of"),
    "null seconds": (_record(seconds=None), "seconds is None, not a number"),
    "null reason": (_record(reason=None), "reason is None, not a string"),
    "int reason": (_record(reason=3), "reason is 3, not a string"),
    "infinite seconds": (_record(seconds=float("inf")), "seconds is inf, not a finite number"),
    "text seconds": (_record(seconds="abc"), "seconds is 'abc', not a number"),
    "bad count": (_record(counts__failed=-1), "counts.failed is -1, not an int >= 0"),
    "bad cache": (
        _record(cache={"compiled": 1, "compile_s": float("nan")}),
        "cache.compile_s is nan",
    ),
}


@pytest.mark.parametrize("kind", list(BAD_RECORDS))
def test_a_record_no_runner_writes_makes_that_cell_an_error(kind, results_dir, capsys):
    text, why = BAD_RECORDS[kind]
    record = results_dir / "paged-cpu-interpreter.json"
    record.write_text(text)
    assert main(["report", "--results", str(results_dir)]) == 1
    results = {
        r["cell"]: r for r in json.loads((results_dir / "results.json").read_text())["cells"]
    }
    paged = results["paged-cpu-interpreter"]
    assert paged["status"] == "error" and f"its record {record} is malformed: " in paged["reason"]
    assert why in paged["reason"], paged["reason"]
    assert results["mla-cpu-interpreter"]["status"] == "failed"  # every other cell is reported
    assert "`paged-cpu-interpreter`: its record" in (results_dir / "report.md").read_text()
    capsys.readouterr()


@pytest.mark.parametrize("time", ["inf", "1e999", "nan", "-1"])
def test_a_junit_time_that_is_no_finite_number_makes_that_cell_an_error(time, results_dir, capsys):
    junit = results_dir / "paged-cpu-interpreter.xml"
    junit.write_text(
        f'<testsuites><testsuite time="{time}"><testcase name="a"/></testsuite></testsuites>'
    )
    assert main(["report", "--results", str(results_dir)]) == 1
    results = {r.cell: r for r in report.collect([PAGED, MLA], results_dir)}
    assert results["paged-cpu-interpreter"].status == "error"
    assert f"{junit}: a test suite has time='{time}'" in results["paged-cpu-interpreter"].reason
    assert results["mla-cpu-interpreter"].status == "failed"
    md = (results_dir / "report.md").read_text()  # the summary is whole
    assert "`paged-cpu-interpreter`" in md and "`mla-cpu-interpreter`" in md
    capsys.readouterr()


# -- outputs that cannot be written -------------------------------------------------------------


@pytest.mark.parametrize("name", ["junit.xml", "report.md", "results.json"])
def test_a_summary_file_that_is_a_folder_stops_the_report_before_anything_is_written(
    name, results_dir, capsys
):
    (results_dir / name).mkdir()
    before = sorted(p.name for p in results_dir.iterdir())
    assert main(["report", "--results", str(results_dir)]) == 2
    assert capsys.readouterr().err.startswith(
        f"kubematrix report: --results {results_dir}: cannot write "
        f"{results_dir / name}: it exists and is not a file"
    )
    assert sorted(p.name for p in results_dir.iterdir()) == before


def test_a_cell_file_that_is_a_folder_stops_the_matrix_before_any_cell_runs(tmp_path, capsys):
    (tmp_path / "policy-cpu-interpreter.log").mkdir()
    assert main(["matrix", "--cell", "policy-cpu-interpreter", "--results", str(tmp_path)]) == 2
    assert "policy-cpu-interpreter.log: it " in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["policy-cpu-interpreter.log"]


# root writes anywhere: as root, the command runs without the capability that allows it
_AS_USER = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"] if os.geteuid() == 0 else []


@pytest.mark.skipif(bool(_AS_USER) and not shutil.which("setpriv"), reason="root, no setpriv")
@pytest.mark.parametrize("command", ["report", "matrix"])
def test_a_read_only_results_folder_is_refused_by_name(command, results_dir):
    results_dir.chmod(0o555)
    try:
        res = subprocess.run(
            [*_AS_USER, sys.executable, "-m", "kubematrix", command, "--cell",
             "paged-cpu-interpreter", "--results", str(results_dir)],
            env={**os.environ, "PYTHONPATH": str(SRC)}, capture_output=True, text=True,
        )  # fmt: skip
    finally:
        results_dir.chmod(0o755)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert f"kubematrix {command}: --results {results_dir}: cannot write into {results_dir}: " in (
        res.stderr
    )
    assert sorted(p.name for p in results_dir.iterdir()) == [f"{c.name}.xml" for c in (MLA, PAGED)]


def test_a_failed_summary_write_replaces_no_file(results_dir):
    """Each file goes to a temporary first: a write that fails leaves the old summary whole."""
    results = report.collect([PAGED, MLA], results_dir)
    first = report.write_summary(results, results_dir)
    old = first.markdown.read_bytes()
    (results_dir / ".results.json.tmp").mkdir()  # the last temporary cannot be written
    with pytest.raises(report.UnwritableOutput, match="cannot write the summary in"):
        report.write_summary(results[:1], results_dir)
    assert first.markdown.read_bytes() == old
    assert not (results_dir / ".junit.xml.tmp").exists()


# -- Buildkite annotation -----------------------------------------------------------------------


def test_buildkite_mode_without_the_agent_is_refused_by_name(results_dir, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(results_dir / "no-bin"))
    assert main(["report", "--buildkite", "--results", str(results_dir)]) == 2
    assert "--buildkite: buildkite-agent is not on PATH" in capsys.readouterr().err


def test_a_failed_annotation_fails_the_report_step_by_name(results_dir, tmp_path, monkeypatch,
                                                            capsys):  # fmt: skip
    agent = tmp_path / "bin" / "buildkite-agent"
    agent.parent.mkdir()
    agent.write_text('#!/bin/sh\nif [ "$1" = annotate ]; then cat >/dev/null; exit 3; fi\n')
    agent.chmod(0o755)
    monkeypatch.setenv("PATH", f"{agent.parent}:{os.environ['PATH']}")
    assert main(["report", "--buildkite", "--results", str(results_dir)]) == 1
    assert "report: `buildkite-agent annotate` failed with exit status 3" in capsys.readouterr().err


# -- kubematrix.cell ----------------------------------------------------------------------------


def test_the_cell_entry_names_a_command_it_cannot_start(tmp_path):
    res = _kubematrix("kubematrix.cell", "--results", "x.xml", "--", "no-such-command-here",
                      cwd=tmp_path)  # fmt: skip
    assert res.returncode == 127
    assert "kubematrix.cell: cannot start no-such-command-here: No such file or directory" in (
        res.stdout
    )
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("timeout", ["-1", "0", "nan", "soon"])
def test_the_cell_entry_refuses_a_timeout_that_is_no_positive_number(timeout, tmp_path):
    res = _kubematrix("kubematrix.cell", "--results", "x.xml", "--timeout", timeout, "--",
                      sys.executable, "-c", "pass", cwd=tmp_path)  # fmt: skip
    assert res.returncode == 2
    assert f"argument --timeout: must be a number of seconds > 0; got '{timeout}'" in res.stderr


def test_the_cell_entry_fails_a_clean_exit_without_a_report(tmp_path):
    res = _kubematrix("kubematrix.cell", "--results", "x.xml", "--", sys.executable, "-c", "pass",
                      cwd=tmp_path)  # fmt: skip
    assert res.returncode == 1
    assert "kubematrix.cell: exit status 1: no report, nothing tested" in res.stdout


# -- where the pytest cells run -----------------------------------------------------------------


def test_the_project_root_is_the_checkout_around_the_current_folder_or_the_package(tmp_path):
    assert find_project_root(ROOT / "src" / "kubematrix")[0] == ROOT
    root, looked = find_project_root(tmp_path)
    assert root == ROOT and looked[0] == tmp_path.resolve()  # the package's own checkout


def test_a_cell_run_from_outside_the_checkout_runs_the_checkout_tests(tmp_path):
    """It was `not run — no test matches ...` (exit 4): pytest ran in the current folder."""
    res = _kubematrix("kubematrix", "matrix", "--cell", "policy-cpu-interpreter", "--workers",
                      "1", "--results", "r", cwd=tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (policy,) = report.collect([get_cell("policy-cpu-interpreter")], tmp_path / "r")
    assert policy.status == "passed" and policy.counts.passed > 100


def test_an_installed_package_outside_a_checkout_says_where_it_looked(tmp_path):
    site = tmp_path / "site"
    shutil.copytree(SRC / "kubematrix", site / "kubematrix")  # as a wheel installs it
    res = _kubematrix("kubematrix", "matrix", "--cell", "policy-cpu-interpreter", "--results",
                      "r", cwd=tmp_path, env={"PYTHONPATH": str(site)})  # fmt: skip
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "no tests folder for the pytest cells: looked for tests/conftest.py in " in res.stderr
    assert str(tmp_path) in res.stderr and not (tmp_path / "r").exists()


def test_list_outside_a_checkout_does_not_promise_the_pytest_cells(tmp_path):
    """`list` said "runs here" for the CPU cells that `matrix` then refused: no tests folder."""
    site = tmp_path / "site"
    shutil.copytree(SRC / "kubematrix", site / "kubematrix")  # as a wheel installs it
    res = _kubematrix("kubematrix", "list", "--json", "--backend", "cpu-interpreter",
                      cwd=tmp_path, env={"PYTHONPATH": str(site)})  # fmt: skip
    assert res.returncode == 0, res.stderr
    rows = {r["cell"]: r for r in json.loads(res.stdout)}
    policy = rows["policy-cpu-interpreter"]
    assert not policy["runnable"] and "no checkout with the tests" in policy["reason"]
    inside = _kubematrix("kubematrix", "list", "--json", "--cell", "policy-cpu-interpreter",
                         cwd=ROOT)  # fmt: skip
    assert json.loads(inside.stdout)[0]["runnable"], inside.stdout


# -- a reader that leaves -----------------------------------------------------------------------


def test_a_closed_pipe_ends_the_command_quietly(tmp_path):
    """`kubematrix list | head -1`: the reader is gone before the command writes."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.Popen([sys.executable, "-m", "kubematrix", "list"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait() == 141 and err == "", err


def test_sigterm_stops_the_running_cell_and_still_writes_the_summary(tmp_path):
    """A cancelled or timed-out CI job gets SIGTERM: the matrix used to die at once, leaving no
    summary and the cell's pytest running on (its own process group), whose JUnit then made a
    later `report` call the cancelled cell passed. Now it ends as Ctrl-C does."""
    out, pid_file = tmp_path / "r", tmp_path / "test.pid"
    project = _toy_project(
        tmp_path / "p",
        f"pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid()))\ntime.sleep(120)",
    )
    env = {**os.environ, "PYTHONPATH": str(SRC), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    argv = ["matrix", "--cell", "paged-cpu-interpreter", "--workers", "1", "--results", str(out)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kubematrix", *argv],
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not pid_file.is_file() or not pid_file.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 143, output
    assert "kubematrix matrix: terminated (SIGTERM)" in output
    record = json.loads((out / "paged-cpu-interpreter.json").read_text())
    assert (record["status"], record["reason"]) == ("error", "interrupted")
    assert json.loads((out / "results.json").read_text())["status"] == "failed"
    assert not _running(int(pid_file.read_text()))  # the cell's pytest was stopped, not left


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its parent's reaper does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _toy_project(root: Path, test_body: str) -> Path:
    """A project the local runner accepts, with one `paged` test running ``test_body``."""
    (root / "tests").mkdir(parents=True)
    (root / "pyproject.toml").write_text(
        '[tool.pytest.ini_options]\nmarkers = ["paged: p", "gpu: g", "cpu: c"]\n'
    )
    (root / "tests" / "conftest.py").write_text("")
    body = "".join(f"    {line}\n" for line in test_body.splitlines())
    (root / "tests" / "test_toy.py").write_text(
        f"import os, pathlib, time, pytest\n\n@pytest.mark.paged\ndef test_toy():\n{body}"
    )
    return root


def test_a_results_write_that_fails_mid_run_is_one_line_not_a_traceback(tmp_path):
    """A results folder that fills up or turns read-only while cells run ended in an OSError
    traceback and a zero-byte record; now one line naming the path, exit 1, no half record."""
    out = tmp_path / "r"
    project = _toy_project(
        tmp_path / "p", f"pathlib.Path({str(out / 'paged-cpu-interpreter.json')!r}).mkdir()"
    )
    done = _kubematrix(
        "kubematrix", "matrix", "--cell", "paged-cpu-interpreter", "--workers", "1",
        "--results", str(out), cwd=project, env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "kubematrix matrix: stopped: [Errno 21] Is a directory" in done.stderr
    assert "paged-cpu-interpreter.json" in done.stderr
    assert not list(out.glob(".*.partial"))


@pytest.mark.parametrize(
    ("module", "argv", "says"),
    [
        (
            "kubematrix.k8s",
            ["--vendor", "cuda", "--suite", "mla"],
            "kubematrix.k8s: the Kubernetes",
        ),
        (
            "kubematrix",
            ["matrix", "--runner", "k8s", "--cell", "mla-cuda-sm_90"],
            "runner k8s: the",
        ),
    ],
)
def test_without_the_kubernetes_client_the_launcher_says_what_to_install(
    tmp_path, module, argv, says
):
    """The client is the `ci` extra: `python -m kubematrix.k8s` ended in a traceback without it."""
    hide = tmp_path / "hide"
    hide.mkdir()  # a `kubernetes` that is not there, as on a plain install
    (hide / "kubernetes.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'kubernetes'\", name='kubernetes')\n"
    )
    env = {"PYTHONPATH": f"{hide}{os.pathsep}{SRC}"}
    res = _kubematrix(module, *argv, "--results", str(tmp_path / "r"), cwd=ROOT, env=env)
    output = res.stdout + res.stderr
    assert res.returncode == 2 and "Traceback" not in output, output
    assert says in output
    assert "not installed (No module named 'kubernetes'); install it with: pip install " in output
    assert "'portattn[ci]'" in output
