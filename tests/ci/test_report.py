"""The summary, merged JUnit and Markdown report, from sample JUnit files (tests/ci/data)."""

from __future__ import annotations

import json
import os
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kubematrix import buildkite, report
from kubematrix.__main__ import main
from kubematrix.matrix import all_cells, get_cell

pytestmark = pytest.mark.ci

DATA = Path(__file__).parent / "data"
PAGED, MLA, POLICY = (
    get_cell("paged-cpu-interpreter"),
    get_cell("mla-cpu-interpreter"),
    get_cell("policy-cpu-interpreter"),
)


def test_read_junit_counts_test_cases():
    c = report.read_junit(DATA / "paged-cpu-interpreter.xml")
    assert (c.tests, c.passed, c.failed, c.errors, c.skipped, c.seconds) == (4, 3, 0, 0, 1, 12.5)
    m = report.read_junit(DATA / "mla-cpu-interpreter.xml")
    assert (m.tests, m.passed, m.failed, m.errors) == (3, 1, 1, 1)
    assert m.failures[0] == report.Failure(
        "tests.kernels.test_mla_decode::test_decode[320-256]",
        "AssertionError: kernel error 3.1e-02 > 2.0 x torch low-precision error 1.2e-03",
    )
    assert m.failures[1].message == 'failed on setup with "RuntimeError: out of memory"'


def test_status_is_passed_only_with_a_passing_test_and_no_failure():
    assert report.result_from_junit(PAGED, DATA / "paged-cpu-interpreter.xml").status == "passed"
    assert report.result_from_junit(MLA, DATA / "mla-cpu-interpreter.xml").status == "failed"
    assert report.result_from_junit(POLICY, DATA / "policy-cpu-interpreter.xml").status == "skipped"
    crashed = report.result_from_junit(PAGED, DATA / "paged-cpu-interpreter.xml", exit_code=139)
    assert (crashed.status, crashed.reason) == ("error", "exit status 139 despite a clean JUnit")
    with pytest.raises(ValueError, match=r"not_run: status must be 'not run' or 'error'; got 'ok'"):
        report.not_run(PAGED, "x", status="ok")


EMPTY_JUNIT = (
    '<?xml version="1.0"?><testsuites><testsuite name="pytest" errors="0" failures="0" '
    'skipped="0" tests="0"/></testsuites>'
)


@pytest.mark.parametrize(
    ("exit_code", "note", "status", "reason"),
    [
        (None, "", "not run", "the JUnit holds no test case (no test matches the suite's marker)"),
        (5, "", "not run", "the JUnit holds no test case (no test matches the suite's marker)"),
        (3, "", "error", "exit status 3 with a JUnit that holds no test case"),
        (2, "", "error", "exit status 2 with a JUnit that holds no test case"),
        (
            137,
            "OOMKilled",
            "error",
            "exit status 137 (OOMKilled) with a JUnit that holds no test case",
        ),
    ],
)
def test_a_session_aborted_before_its_tests_is_an_error_not_a_cell_that_did_not_run(
    tmp_path, exit_code, note, status, reason
):
    """pytest.exit(), a KeyboardInterrupt in collection or a killed session leave a JUnit with
    no test case and a non-zero exit: only 5 (nothing collected) means nothing was to run."""
    junit = tmp_path / "paged-cpu-interpreter.xml"
    junit.write_text(EMPTY_JUNIT)
    r = report.result_from_junit(PAGED, junit, exit_code=exit_code, exit_note=note)
    assert (r.status, r.reason) == (status, reason)
    if status == "error":
        assert report.overall_status([r]) == "failed"


def test_an_exit_note_names_why_a_clean_junit_is_an_error():
    r = report.result_from_junit(
        PAGED, DATA / "paged-cpu-interpreter.xml", exit_code=137, exit_note="OOMKilled: over"
    )
    assert r.status == "error"
    assert r.reason == "exit status 137 (OOMKilled: over) despite a clean JUnit"


@pytest.fixture
def results_dir(tmp_path) -> Path:
    """A results folder as a Buildkite build leaves it: JUnits, the compile report, no records."""
    for name in ("paged-cpu-interpreter.xml", "mla-cpu-interpreter.xml"):
        shutil.copy(DATA / name, tmp_path / name)
    (tmp_path / "compile").mkdir()
    shutil.copy(DATA / "compile_matrix.json", tmp_path / report.COMPILE_JSON)
    (tmp_path / "compile" / "compile_matrix.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    return tmp_path


CELLS = [PAGED, MLA, get_cell("mla-cuda-sm_90"), get_cell("compile-cpu-interpreter")]


def test_collect_rebuilds_results_and_never_passes_a_cell_without_results(results_dir):
    results = {r.cell: r for r in report.collect(CELLS, results_dir)}
    assert results["paged-cpu-interpreter"].status == "passed"
    assert results["mla-cpu-interpreter"].status == "failed"
    missing = results["mla-cuda-sm_90"]
    assert missing.status == "not run" and missing.reason.startswith("no result in ")
    # The compile cell's JUnit comes from the compile matrix's own report: one case per cell.
    comp = results["compile-cpu-interpreter"]
    assert (comp.status, comp.counts.tests, comp.counts.failed) == ("failed", 2, 1)
    assert comp.counts.failures[0] == report.Failure(
        "compile-cpu-interpreter.mla_decode::d576_r512_h16@gfx942",
        "shared memory 98304 B > gfx942 limit 65536 B",
    )


def test_a_runner_record_wins_over_the_junit(results_dir):
    record = report.not_run(PAGED, "timed out after 30 min", status="error", seconds=1800.0)
    report.write_cell_record(record, results_dir)
    (got,) = report.collect([PAGED], results_dir)
    assert got == record


def test_the_summary_table_lists_every_cell_with_its_counts_time_and_reason(results_dir):
    table = report.summary_table(report.collect(CELLS, results_dir)).splitlines()
    assert table[0].split() == [
        "cell", "result", "ran", "on", "passed", "failed", "skipped", "time", "compile", "cache",
        "note",
    ]  # fmt: skip
    assert table[2].split() == [
        "paged-cpu-interpreter", "passed", "cpu", "3", "0", "1", "12.5s", "-", "-"
    ]  # fmt: skip
    assert table[3].split()[:7] == ["mla-cpu-interpreter", "failed", "cpu", "1", "2", "0", "8.2s"]
    assert table[4].split()[:7] == ["mla-cuda-sm_90", "not", "run", "-", "-", "-", "-"]
    assert table[-1] == "4 cells: 1 passed, 2 failed, 1 not run (cell time 1m02s)"


def test_the_summary_is_written_as_merged_junit_markdown_text_and_json(results_dir):
    results = report.collect(CELLS, results_dir)
    files = report.write_summary(results, results_dir, context="runner `local`")
    assert files.heatmap == results_dir / "compile" / "compile_matrix.png"

    md = files.markdown.read_text()
    assert md.startswith("## portattn matrix: failed\n\nrunner `local`\n")
    assert "| `paged-cpu-interpreter` | ✅ passed | cpu | 3 | 0 | 1 | 12.5s |" in md
    assert "| `mla-cuda-sm_90` | ⚪ not run | - | - | - | - | - |" in md
    assert "  - `tests.kernels.test_mla_decode::test_decode[320-256]`: AssertionError" in md
    assert "### Not run\n\n- `mla-cuda-sm_90`: no result in" in md
    assert md.endswith("![compile heatmap](compile/compile_matrix.png)\n")

    payload = json.loads(files.json.read_text())
    assert payload["status"] == "failed"
    assert payload["tally"] == {"passed": 1, "failed": 2, "error": 0, "skipped": 0, "not run": 1}
    assert [report.result_from_dict(d) for d in payload["cells"]] == results


def test_merged_junit_has_a_suite_per_cell_and_not_run_cells_as_skipped(results_dir):
    results = report.collect(CELLS, results_dir)
    root = ET.parse(report.write_summary(results, results_dir).junit).getroot()
    suites = {s.get("name"): s for s in root.iter("testsuite")}
    assert list(suites) == [c.name for c in CELLS]
    attrs = ("tests", "failures", "errors", "skipped")
    assert [suites["paged-cpu-interpreter"].get(a) for a in attrs] == ["4", "0", "0", "1"]
    assert [suites["mla-cpu-interpreter"].get(a) for a in attrs] == ["3", "1", "1", "0"]
    assert [suites["mla-cuda-sm_90"].get(a) for a in attrs] == ["1", "0", "0", "1"]
    (case,) = suites["mla-cuda-sm_90"].iter("testcase")
    assert case.find("skipped").get("message").startswith("not run: no result in")
    first = next(suites["paged-cpu-interpreter"].iter("testcase"))
    assert first.get("classname") == "paged-cpu-interpreter.tests.kernels.test_paged_attention"
    # Counted again from the merged file, the totals agree with the per-cell results.
    merged = report.read_junit(results_dir / "junit.xml")
    assert merged.failed == sum(r.counts.failed for r in results)


def test_an_error_after_a_clean_junit_stays_an_error_in_the_merged_file(tmp_path):
    shutil.copy(DATA / "paged-cpu-interpreter.xml", tmp_path)
    crashed = report.result_from_junit(PAGED, tmp_path / "paged-cpu-interpreter.xml", exit_code=1)
    merged = report.read_junit(report.write_summary([crashed], tmp_path).junit)
    assert merged.errors == 1 and report.status_from_counts(merged) == "error"


def test_overall_status_ignores_experimental_failures():
    bad_rocm = report.not_run(get_cell("hybrid-rocm-gfx942"), "GPU hang", status="error")
    ok = report.result_from_junit(PAGED, DATA / "paged-cpu-interpreter.xml")
    assert bad_rocm.experimental and not bad_rocm.blocking_failure
    assert report.overall_status([ok, bad_rocm]) == "passed"
    assert report.overall_status([report.not_run(PAGED, "no GPU")]) == "not run"
    # where nothing passed, an experimental cell's failure is what the run tested: not "not run"
    assert report.overall_status([bad_rocm, report.not_run(PAGED, "no GPU")]) == "failed"


def test_report_fails_an_experimental_cell_that_ran_alone_and_failed(tmp_path, capsys):
    """`--cell` naming only an experimental cell whose tests failed exited 4 saying it had no
    test result; it exits 1, as any run whose only tests failed."""
    cell = get_cell("mla-cuda-sm_100")
    assert cell.experimental
    shutil.copy(DATA / "mla-cpu-interpreter.xml", tmp_path / f"{cell.name}.xml")
    assert main(["report", "--results", str(tmp_path), "--cell", cell.name]) == 1
    captured = capsys.readouterr()
    assert "no test result" not in captured.err and "failed (experimental)" in captured.out


def test_report_command_rebuilds_the_summary_and_fails_on_a_failed_cell(results_dir, capsys):
    code = main(
        [
            "report",
            "--results",
            str(results_dir),
            "--cell",
            "paged-cpu-interpreter",
            "--cell",
            "mla-cpu-interpreter",
        ]
    )
    out = capsys.readouterr().out
    assert code == 1  # a failed cell
    assert out.splitlines()[-1] == "2 cells: 1 passed, 1 failed (cell time 20.8s)"
    assert (results_dir / "report.md").is_file() and (results_dir / "junit.xml").is_file()


def test_report_marks_cells_the_change_did_not_select(results_dir, monkeypatch, capsys):
    monkeypatch.setenv("KUBEMATRIX_NOT_SELECTED", "mla-cuda-sm_90")
    main(["report", "--results", str(results_dir), "--cell", "mla-cuda-sm_90"])
    assert (
        "not selected by the changed files (unblock its step to run it)" in capsys.readouterr().out
    )


FAKE_AGENT = """#!/bin/sh
# buildkite-agent stand-in (the real one needs a Buildkite job): records its calls.
echo "$@" >> "$AGENT_LOG"
if [ "$1" = annotate ]; then cat > "$AGENT_LOG.annotation"; fi
if [ "$1 $2" = "artifact download" ]; then exit 1; fi  # nothing to download: already here
if [ "$1 $2 $3 $4" = "step get outcome --step" ]; then  # outcomes listed as "key outcome" lines
  outcome=$(sed -n "s/^$5 //p" "$AGENT_LOG.outcomes" 2>/dev/null)
  if [ "$outcome" = "?" ]; then echo "fatal: no such step" >&2; exit 1; fi
  echo "${outcome:-passed}"
fi
"""


def _fake_agent(tmp_path, monkeypatch) -> Path:
    """`FAKE_AGENT` first on PATH; returns the log it writes its calls to."""
    agent = tmp_path / "bin" / "buildkite-agent"
    agent.parent.mkdir()
    agent.write_text(FAKE_AGENT)
    agent.chmod(0o755)
    log = tmp_path / "agent.log"
    monkeypatch.setenv("PATH", f"{agent.parent}:{os.environ['PATH']}")
    monkeypatch.setenv("AGENT_LOG", str(log))
    return log


def test_buildkite_mode_annotates_the_build(results_dir, tmp_path, monkeypatch, capsys):
    log = _fake_agent(tmp_path, monkeypatch)
    monkeypatch.setenv("BUILDKITE_COMMIT", "0123456789abcdef")
    monkeypatch.setenv("BUILDKITE_BUILD_NUMBER", "42")
    monkeypatch.chdir(results_dir.parent)
    args = ["report", "--buildkite", "--results", results_dir.name]
    assert (
        main([*args, "--cell", "paged-cpu-interpreter", "--cell", "compile-cpu-interpreter"]) == 0
    )
    calls = log.read_text().splitlines()
    name = results_dir.name
    # the passing cell's step is asked for its outcome; the failed compile cell needs no asking
    assert [c for c in calls if c.startswith("step ")] == [
        "step get outcome --step paged-cpu-interpreter"
    ]
    calls = [c for c in calls if not c.startswith("step ")]
    assert calls[:3] == [
        f"artifact download {name}/*.xml .",
        f"artifact download {name}/compile/* .",
        f"artifact download {name}/*.cache/*.jsonl .",  # what each cell step uploads
    ]
    uploaded = {p for cell in all_cells() for p in buildkite.artifact_paths(cell, name)}
    assert {f"{name}/paged-cpu-interpreter.cache/*.jsonl", f"{name}/compile/*"} <= uploaded
    assert calls[3] == "annotate --style error --context matrix"
    assert calls[4] == f"artifact upload {name}/junit.xml;{name}/report.md;{name}/results.json"
    annotation = Path(f"{log}.annotation").read_text()
    assert annotation.startswith("## portattn matrix: failed\n\nbuild 42, commit `0123456789ab`")
    assert f"![compile heatmap](artifact://{name}/compile/compile_matrix.png)" in annotation
    capsys.readouterr()


def test_buildkite_mode_calls_a_selected_cell_without_a_result_lost(
    results_dir, tmp_path, monkeypatch, capsys
):
    """A build whose GPU steps never ran (their image step failed) was annotated green, "passed",
    from the one cell that reported: a selected cell without a result is an error; one the
    change did not select stays "not run"."""
    log = _fake_agent(tmp_path, monkeypatch)
    monkeypatch.chdir(results_dir.parent)
    args = ["report", "--buildkite", "--results", results_dir.name,
            "--cell", "paged-cpu-interpreter", "--cell", "mla-cuda-sm_90"]  # fmt: skip
    assert not (results_dir / "mla-cuda-sm_90.xml").exists()
    assert main(args) == 0  # the cells' own steps carry the build's verdict
    assert "annotate --style error --context matrix" in log.read_text().splitlines()
    annotation = Path(f"{log}.annotation").read_text()
    assert annotation.startswith("## portattn matrix: failed")
    assert "selected for this build, but no result came back" in annotation
    log.unlink()
    monkeypatch.setenv("KUBEMATRIX_NOT_SELECTED", "mla-cuda-sm_90")
    assert main(args) == 0
    assert "annotate --style success --context matrix" in log.read_text().splitlines()
    assert "not selected by the changed files" in Path(f"{log}.annotation").read_text()
    capsys.readouterr()


def test_buildkite_mode_judges_a_cell_by_its_steps_outcome_too(
    results_dir, tmp_path, monkeypatch, capsys
):
    """A step that failed after writing a clean JUnit (a crash at exit, a timeout) was annotated
    as a pass from its JUnit alone: the step's own outcome overrules the file."""
    log = _fake_agent(tmp_path, monkeypatch)
    monkeypatch.chdir(results_dir.parent)
    args = [
        "report",
        "--buildkite",
        "--results",
        results_dir.name,
        "--cell",
        "paged-cpu-interpreter",
    ]
    Path(f"{log}.outcomes").write_text("paged-cpu-interpreter hard_failed\n")
    assert main(args) == 0  # the step itself carries the build's verdict
    assert "annotate --style error --context matrix" in log.read_text().splitlines()
    annotation = Path(f"{log}.annotation").read_text()
    assert annotation.startswith("## portattn matrix: failed")
    assert "its step's outcome is hard_failed, though its JUnit holds no failure" in annotation
    # An agent that cannot tell leaves the JUnit's verdict, and says so.
    log.unlink()
    Path(f"{log}.outcomes").write_text("paged-cpu-interpreter ?\n")
    assert main(args) == 0
    assert "annotate --style success --context matrix" in log.read_text().splitlines()
    err = capsys.readouterr().err
    assert (
        "gave no outcome (exit status 1: fatal: no such step); the cell is judged by its JUnit"
        in err
    )


def test_buildkite_mode_refuses_a_results_path_the_agent_would_split(tmp_path, capsys):
    assert main(["report", "--buildkite", "--results", str(tmp_path / "w;x")]) == 2
    assert "--results " in capsys.readouterr().err


def test_a_gpu_cell_reports_the_architecture_its_tests_found(tmp_path):
    # tests/test_cell_arch.py records the live device's arch as a JUnit test-case property.
    cell = get_cell("mla-cuda-sm_90")
    junit = tmp_path / f"{cell.name}.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest" time="3.0">'
        '<testcase classname="tests.test_cell_arch" name="test_the_live_gpu" time="0.1">'
        f'<properties><property name="{report.GPU_ARCH_PROPERTY}" value="sm_90"/></properties>'
        "</testcase>"
        '<testcase classname="tests.kernels.test_mla_decode" name="test_decode" time="2.9"/>'
        "</testsuite></testsuites>"
    )
    result = report.result_from_junit(cell, junit)
    assert (result.status, result.ran_on, result.counts.passed) == ("passed", "sm_90", 2)
    assert "| `mla-cuda-sm_90` | ✅ passed | sm_90 | 2 |" in report.markdown_report([result])
    # The record keeps it (a runner's record wins over the JUnit in collect).
    assert report.result_from_dict(report.result_to_dict(result)).ran_on == "sm_90"


def _counters(folder: Path, *events: tuple[str, float]) -> None:
    folder.mkdir(parents=True)
    lines = [json.dumps({"event": e, "compile_s": s}) for e, s in events]
    (folder / "123.jsonl").write_text("\n".join(lines) + "\n")


def test_the_summary_shows_compile_time_and_cache_hit_rate_per_cell(results_dir):
    compile_cell = "compile-cpu-interpreter"
    _counters(
        report.cache_dir(compile_cell, results_dir),
        ("compiled", 50.0),
        ("compiled", 25.0),
        ("remote", 0),
        *[("local", 0)] * 5,
        ("warning:redis", 0),
    )
    results = report.collect(CELLS, results_dir)
    comp = next(r for r in results if r.cell == compile_cell)
    assert comp.cache is not None and comp.cache.hit_rate == 0.75
    table = report.summary_table(results).splitlines()
    row = next(line for line in table if line.startswith(compile_cell))
    assert "1m15s" in row and "75% of 8 !redis" in row
    assert table[-2] == (
        "Triton cache: 75% hits of 8 lookups (5 local, 1 remote, 2 compiled in 1m15s)"
    )
    md = report.markdown_report(results)
    assert f"| `{compile_cell}` | ❌ failed | cpu | 1 | 1 | 0 |" in md
    assert "| 1m15s | 75% of 8 !redis |" in md
    # The record keeps the counters (a later `report` over the folder shows the same).
    report.write_cell_record(comp, results_dir)
    assert report.collect([CELLS[-1]], results_dir)[0].cache == comp.cache
    # a miss before each of the 3 compiles, and 2 misses whose compiles stored nothing:
    # lookups, not compiles, and said so
    events = [("missed", 0)] * 5 + [("compiled", 1.0)]
    (report.cache_dir(compile_cell, results_dir) / "124.jsonl").write_text(
        "".join(json.dumps({"event": e, "compile_s": t}) + "\n" for e, t in events)
    )
    (results_dir / f"{compile_cell}.json").unlink(missing_ok=True)  # counted again, not kept
    results = report.collect(CELLS, results_dir)
    assert report.summary_table(results).splitlines()[-2] == (
        "Triton cache: 55% hits of 11 lookups (5 local, 1 remote, 3 compiled in 1m16s); "
        "2 compiles failed or were stopped"
    )


def test_a_cell_named_without_a_result_is_no_pass(results_dir, capsys):
    """`report --cell A --cell B` where B's result is missing (a lost artifact): exit 4 naming
    B, not 'passed' because A passed; a folder where a result belongs makes its cell an error."""
    args = ["report", "--results", str(results_dir), "--cell", "paged-cpu-interpreter"]
    assert main(args) == 0
    capsys.readouterr()
    assert main([*args, "--cell", "mla-cuda-sm_90"]) == 4
    err = capsys.readouterr().err
    assert "mla-cuda-sm_90 (named with --cell) has no test result in" in err
    # the files agree with the exit status: they said "passed" while it said 4
    written = json.loads((results_dir / "results.json").read_text())
    assert written["status"] == "failed"
    (lost,) = [c for c in written["cells"] if c["cell"] == "mla-cuda-sm_90"]
    assert lost["status"] == "error" and lost["reason"].startswith("named with --cell, but")
    assert (results_dir / "report.md").read_text().startswith("## portattn matrix: failed")
    (results_dir / "mla-cuda-sm_90.xml").mkdir()
    (result,) = report.collect([get_cell("mla-cuda-sm_90")], results_dir)
    assert result.status == "error" and result.reason.endswith("mla-cuda-sm_90.xml is not a file")


def test_a_report_of_a_missing_results_folder_is_refused(tmp_path, capsys):
    """Not a summary calling every cell "not run" (and no folder made to hold it)."""
    missing = tmp_path / "no-such-run"
    assert main(["report", "--results", str(missing)]) == 2
    assert f"kubematrix report: --results {missing}: no such folder" in capsys.readouterr().err
    assert not missing.exists()


@pytest.mark.parametrize("workers", ["0", "-3", "1.5", "x", "1025", "99999999999999999999"])
def test_the_matrix_refuses_a_worker_count_out_of_range(workers, capsys):
    """A huge count reached pytest-xdist and failed the cell with an OverflowError in its log."""
    with pytest.raises(SystemExit) as info:
        main(["matrix", "--suite", "policy", "--workers", workers])
    assert info.value.code == 2
    assert f"--workers: must be an int from 1 to 1024; got {workers!r}" in capsys.readouterr().err


def test_a_results_folder_that_cannot_be_made_stops_the_matrix_by_name(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["matrix", "--suite", "policy", "--results", str(blocker / "results")]) == 2
    err = capsys.readouterr().err
    assert f"kubematrix matrix: --results {blocker / 'results'}: cannot create the folder: " in err


BROKEN_JUNITS = {
    "truncated": ('<testsuites><testsuite name="x" tests="3"><testcase', "is unreadable"),
    "empty": ("", "is unreadable"),
    "not junit": ("<html><body/></html>", "is no JUnit report (its root is <html>)"),
    "bad time": (
        '<testsuites><testsuite time="soon"><testcase name="a"/></testsuite></testsuites>',
        "a test suite has time='soon', not a number",
    ),
    "suite-level error": (  # a setup error no test case carries: not a pass
        '<testsuites><testsuite name="p" tests="1" errors="1"><testcase classname="a" name="b"/>'
        "</testsuite></testsuites>",
        "suite p declares 1 failures and errors, and its test cases carry 0",
    ),
    "declared failures, no cases": (  # cut short after the suite's attributes: not 'not run'
        '<testsuites><testsuite name="p" tests="3" failures="2" errors="1"/></testsuites>',
        "suite p declares 3 failures and errors, and its test cases carry 0",
    ),
    "counts that are no counts": (
        '<testsuite name="p" failures="x"><testcase name="a"/></testsuite>',
        "suite p's failures/errors are no counts ('x', None)",
    ),
}


@pytest.mark.parametrize("kind", list(BROKEN_JUNITS))
def test_an_unreadable_junit_makes_its_cell_an_error_and_hides_no_other(kind, results_dir, capsys):
    """What a killed cell or a cut-off upload leaves: that row says why, the report still comes
    out with every other cell's result, and the matrix fails."""
    text, why = BROKEN_JUNITS[kind]
    (results_dir / "mla-cpu-interpreter.xml").write_text(text)
    results = {r.cell: r for r in report.collect(CELLS, results_dir)}
    mla = results["mla-cpu-interpreter"]
    assert mla.status == "error" and why in mla.reason, mla.reason
    assert results["paged-cpu-interpreter"].status == "passed"
    assert results["compile-cpu-interpreter"].counts.tests > 0
    files = report.write_summary(list(results.values()), results_dir)
    merged = report.read_junit(files.junit)
    assert merged.errors >= 1 and merged.passed >= 3
    assert main(["report", "--results", str(results_dir)]) == 1
    assert why in capsys.readouterr().out


def test_a_runner_sees_an_unreadable_junit_as_an_error_with_its_exit_status(tmp_path):
    junit = tmp_path / "paged-cpu-interpreter.xml"
    junit.write_text("<testsuites><testsuite><testcase name='a'")
    r = report.result_from_junit(PAGED, junit, seconds=3.0, exit_code=-9)
    assert (r.status, r.seconds) == ("error", 3.0)
    assert r.reason.endswith(", exit status -9") and "is unreadable" in r.reason


@pytest.mark.parametrize(
    ("record", "why"),
    [
        ("[1, 2]", "is malformed: it is a JSON list, not an object"),
        ("{not json", "is unreadable (JSONDecodeError"),
        ('{"cell": "x"}', "is malformed: cell is 'x', not 'paged-cpu-interpreter'"),
        (
            '{"cell": "paged-cpu-interpreter", "suite": "paged", "backend": "cpu-interpreter", '
            '"target": null, "status": "not run", "color": "red"}',
            "is unreadable (TypeError",
        ),
    ],
)
def test_an_unreadable_record_makes_its_cell_an_error(record, why, results_dir):
    (results_dir / "paged-cpu-interpreter.json").write_text(record)
    results = {r.cell: r for r in report.collect(CELLS, results_dir)}
    paged = results["paged-cpu-interpreter"]
    assert paged.status == "error" and why in paged.reason, paged.reason
    assert results["mla-cpu-interpreter"].status == "failed"  # its own JUnit, as before


_COMPILE_CELL = '"kernel": "k", "case": "c", "arch": "sm_90"'


@pytest.mark.parametrize("data", ['{"cells": {}}', "[]", '{"cells": [{"kernel": "k"}]}', "{",
                                  '{"cells": []}',
                                  f'{{"cells": [{{{_COMPILE_CELL}, "passed": "false"}}]}}',
                                  f'{{"cells": [{{{_COMPILE_CELL}, "passed": 0}}]}}',
                                  '{"cells": [{"kernel": 1, "case": "c", "arch": "sm_90", '
                                  '"passed": true}]}'])  # fmt: skip
def test_a_malformed_compile_report_makes_the_compile_cell_an_error(data, results_dir):
    (results_dir / report.COMPILE_JSON).write_text(data)
    results = {r.cell: r for r in report.collect(CELLS, results_dir)}
    compiled = results["compile-cpu-interpreter"]
    assert compiled.status == "error" and "compile report" in compiled.reason, compiled.reason
    assert results["paged-cpu-interpreter"].status == "passed"
