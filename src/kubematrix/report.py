"""Matrix results: per-cell JUnit in, one summary out (table, merged JUnit, Markdown, JSON).

Every runner leaves the same thing in the results folder (``results/matrix/`` by default):
``<cell>.xml`` (pytest's JUnit), optionally ``<cell>.json`` (what the runner knows beyond the JUnit:
exit status, wall time, why a cell did not run) and ``<cell>.log``; the compile cell adds
``compile/`` with the heatmap. ``<cell>.cache/`` holds the counters of the cell's Triton compile
cache (:mod:`kubematrix.cachestats`): the summary's compile time and hit rate per cell.
:func:`collect` rebuilds the results from such a folder — a local run, or the artifacts a
Buildkite build downloaded — and :func:`write_summary` writes the merged ``junit.xml``,
``report.md``, ``summary.txt`` and ``results.json`` beside them.

A cell is ``passed`` only when its JUnit shows at least one passing test and no failure or
error; a cell with only skipped tests is ``skipped``, one that never produced a JUnit is
``not run`` with the reason. Nothing that did not run is ever counted as passed.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kubematrix.cachestats import CacheStats, read_stats
from kubematrix.matrix import Cell

STATUSES = ("passed", "failed", "error", "skipped", "not run")
_ICON = {"passed": "✅", "failed": "❌", "error": "💥", "skipped": "⏭️", "not run": "⚪"}
MAX_FAILURES_LISTED = 10
# The JUnit test-case property in which a GPU cell records the architecture it ran on.
GPU_ARCH_PROPERTY = "gpu_arch"


@dataclass(frozen=True)
class Failure:
    """One failing or erroring test case: its id and the first line of its message."""

    test: str
    message: str


@dataclass(frozen=True)
class JunitCounts:
    """What one JUnit file says, summed over its test suites."""

    tests: int = 0
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    seconds: float = 0.0
    failures: tuple[Failure, ...] = ()
    gpu_arch: str | None = None  # the device the tests found (tests/test_cell_arch.py records it)


@dataclass(frozen=True)
class CellResult:
    """The outcome of one cell (a row of the summary)."""

    cell: str
    suite: str
    backend: str
    target: str | None
    status: str
    reason: str = ""
    seconds: float = 0.0
    experimental: bool = False
    counts: JunitCounts = field(default_factory=JunitCounts)
    cache: CacheStats | None = None  # the cell's Triton cache counters (None: none recorded)

    @property
    def ran_on(self) -> str:
        """Where the cell actually ran: the GPU architecture its tests found, ``cpu`` for a CPU
        cell, ``-`` when nothing ran or the report does not say."""
        if self.counts.gpu_arch:
            return self.counts.gpu_arch
        return "cpu" if self.target is None and self.status != "not run" else "-"

    @property
    def blocking_failure(self) -> bool:
        """Failed or errored, and not a cell declared experimental."""
        return self.status in ("failed", "error") and not self.experimental


# -- JUnit in -----------------------------------------------------------------------------------


def _first_line(text: str | None) -> str:
    return (text or "").strip().splitlines()[0][:200] if (text or "").strip() else ""


class UnreadableReport(ValueError):
    """A cell's JUnit or record that cannot be read (truncated, empty, not a report)."""


def _seconds(value: str | None, where: str) -> float:
    try:
        seconds = float(value or 0.0)
    except ValueError:
        raise UnreadableReport(f"{where} has time={value!r}, not a number") from None
    if not math.isfinite(seconds) or seconds < 0:  # inf, nan, 1e999 would break the summary
        raise UnreadableReport(f"{where} has time={value!r}, not a finite number >= 0")
    return seconds


def read_junit(path: str | os.PathLike[str]) -> JunitCounts:
    """Count a JUnit file's test cases (pytest's format: ``<testsuites><testsuite><testcase>``).

    Counts come from the test cases, not from the suites' attributes, so a merged or hand-written
    file is counted the same way.

    Raises:
        UnreadableReport: the file cannot be read or parsed (a killed cell's truncated or empty
            file), its root is neither ``testsuites`` nor ``testsuite``, or a time is no number.
    """
    try:
        root = ET.parse(path).getroot()
    except (ET.ParseError, OSError) as exc:
        raise UnreadableReport(f"JUnit {path} is unreadable ({exc})") from None
    if root.tag not in ("testsuites", "testsuite"):
        raise UnreadableReport(f"{path} is no JUnit report (its root is <{root.tag}>)")
    cases = list(root.iter("testcase"))
    failed = errors = skipped = 0
    failures: list[Failure] = []
    seconds = 0.0
    for case in cases:
        test = "::".join(p for p in (case.get("classname"), case.get("name")) if p)
        seconds += _seconds(case.get("time"), f"{path}: test case {test}")
        if (node := case.find("failure")) is not None:
            failed += 1
            failures.append(Failure(test, _first_line(node.get("message") or node.text)))
        elif (node := case.find("error")) is not None:
            errors += 1
            failures.append(Failure(test, _first_line(node.get("message") or node.text)))
        elif case.find("skipped") is not None:
            skipped += 1
    archs = {
        p.get("value")
        for p in root.iter("property")
        if p.get("name") == GPU_ARCH_PROPERTY and p.get("value")
    }
    suite_times = [_seconds(s.get("time"), f"{path}: a test suite") for s in root.iter("testsuite")]
    _check_declared(path, root)
    return JunitCounts(
        tests=len(cases),
        passed=len(cases) - failed - errors - skipped,
        failed=failed,
        errors=errors,
        skipped=skipped,
        seconds=sum(suite_times) or seconds,
        failures=tuple(failures),
        gpu_arch=",".join(sorted(a for a in archs if a)) or None,
    )


def _check_declared(path: str | os.PathLike[str], root: ET.Element) -> None:
    """A suite's declared ``failures`` and ``errors`` must be carried by its test cases: more
    declared than carried is a file cut short, or a tool's suite-level error (a setup or
    teardown failure) that counting the cases alone would pass.

    Raises:
        UnreadableReport: naming the suite and the counts, or an attribute that is no count.
    """
    for suite in root.iter("testsuite"):  # (the root itself too, where it is one)
        name = suite.get("name") or "(unnamed)"
        try:
            declared = sum(int(suite.get(k) or 0) for k in ("failures", "errors"))
        except ValueError:
            raise UnreadableReport(
                f"JUnit {path}: suite {name}'s failures/errors are no counts "
                f"({suite.get('failures')!r}, {suite.get('errors')!r})"
            ) from None
        carried = sum(
            c.find("failure") is not None or c.find("error") is not None
            for c in suite.iter("testcase")
        )
        if declared > carried:
            raise UnreadableReport(
                f"JUnit {path}: suite {name} declares {declared} failures and errors, and its "
                f"test cases carry {carried} (a file cut short, or an error outside any test)"
            )


PYTEST_NOTHING_COLLECTED = 5  # pytest's exit status when no test was collected


def status_from_counts(counts: JunitCounts) -> str:
    if counts.failed:
        return "failed"
    if counts.errors:
        return "error"
    if counts.passed:
        return "passed"
    return "skipped" if counts.skipped else "not run"


def result_from_junit(
    cell: Cell,
    junit: str | os.PathLike[str],
    *,
    seconds: float | None = None,
    exit_code: int | None = None,
    exit_note: str = "",
) -> CellResult:
    """A cell's result from its JUnit (and, when the runner knows it, the exit status and
    ``exit_note``, e.g. the kubelet's ``OOMKilled``).

    A non-zero exit with a clean JUnit (a crash after the report, a timeout) is an ``error``: the
    process is the judge of last resort, never the file alone. So is a non-zero exit with a JUnit
    that holds no test case (pytest stopped before its tests ran), except pytest's 5 (nothing
    collected: not run). So is a JUnit that cannot be read: the cell's row says why, and the
    other cells' rows are unaffected.
    """
    exit_text = f"exit status {exit_code}" + (f" ({exit_note})" if exit_note else "")
    try:
        counts = read_junit(junit)
    except UnreadableReport as exc:
        status_note = f", {exit_text}" if exit_code is not None else ""
        return not_run(cell, f"{exc}{status_note}", status="error", seconds=seconds or 0.0)
    status = status_from_counts(counts)
    reason = ""
    if status == "not run":
        reason = "the JUnit holds no test case (no test matches the suite's marker)"
    if exit_code not in (None, 0) and status in ("passed", "skipped"):
        status, reason = "error", f"{exit_text} despite a clean JUnit"
    elif exit_code not in (None, 0, PYTEST_NOTHING_COLLECTED) and status == "not run":
        status, reason = "error", f"{exit_text} with a JUnit that holds no test case"
    if status in ("failed", "error") and counts.failures and not reason:
        reason = f"{len(counts.failures)} failing: {counts.failures[0].test}"
    return CellResult(
        cell=cell.name,
        suite=cell.suite,
        backend=cell.backend,
        target=cell.target,
        status=status,
        reason=reason,
        seconds=counts.seconds if seconds is None else seconds,
        experimental=cell.experimental is not None,
        counts=counts,
    )


def not_run(
    cell: Cell, reason: str, *, status: str = "not run", seconds: float = 0.0
) -> CellResult:
    """A cell without test results: not run (with why), or an ``error`` before any JUnit."""
    if status not in ("not run", "error"):
        raise ValueError(f"not_run: status must be 'not run' or 'error'; got {status!r}")
    return CellResult(
        cell=cell.name,
        suite=cell.suite,
        backend=cell.backend,
        target=cell.target,
        status=status,
        reason=reason,
        seconds=seconds,
        experimental=cell.experimental is not None,
    )


# -- per-cell records ---------------------------------------------------------------------------


def result_to_dict(result: CellResult) -> dict:
    d = asdict(result)
    d["counts"]["failures"] = [asdict(f) for f in result.counts.failures]
    d["cache"] = result.cache.to_dict() if result.cache else None
    return d


def _count(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UnreadableReport(f"{name} is {value!r}, not an int >= 0")
    return value


def _finite(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UnreadableReport(f"{name} is {value!r}, not a number")
    if not math.isfinite(value) or value < 0:
        raise UnreadableReport(f"{name} is {value!r}, not a finite number >= 0")
    return float(value)


def _text(value: object, name: str, *, optional: bool = False) -> None:
    if not isinstance(value, str) and not (optional and value is None):
        raise UnreadableReport(f"{name} is {value!r}, not a string")


def _check_record(d: dict, cell: Cell | None) -> None:
    """Raise `UnreadableReport` naming the first field of a record that a runner cannot have
    written: another cell's name, an unknown status, a bad number, counts that contradict the
    status (a ``passed`` record without a passing test)."""
    if not isinstance(d, dict):
        raise UnreadableReport(f"it is a JSON {type(d).__name__}, not an object")
    if cell is not None:
        for key, want in (("cell", cell.name), ("suite", cell.suite), ("backend", cell.backend),
                          ("target", cell.target)):  # fmt: skip
            if d.get(key) != want:
                raise UnreadableReport(f"{key} is {d.get(key)!r}, not {want!r}")
    if d.get("status") not in STATUSES:
        raise UnreadableReport(f"status is {d.get('status')!r}, not one of {STATUSES}")
    _text(d.get("reason", ""), "reason")
    _finite(d.get("seconds", 0.0), "seconds")
    counts = d.get("counts") or {}
    if not isinstance(counts, dict):
        raise UnreadableReport(f"counts is {counts!r}, not an object")
    n = {k: _count(counts.get(k, 0), f"counts.{k}") for k in ("tests", "passed", "failed",
                                                               "errors", "skipped")}  # fmt: skip
    if n["tests"] != n["passed"] + n["failed"] + n["errors"] + n["skipped"]:
        raise UnreadableReport(f"counts.tests is {n['tests']}, not passed+failed+errors+skipped")
    _finite(counts.get("seconds", 0.0), "counts.seconds")
    _text(counts.get("gpu_arch"), "counts.gpu_arch", optional=True)
    failures = counts.get("failures", [])
    if not isinstance(failures, list) or not all(isinstance(f, dict) for f in failures):
        raise UnreadableReport(f"counts.failures is {failures!r}, not a list of objects")
    for f in failures:
        _text(f.get("test"), "counts.failures[].test")
        _text(f.get("message"), "counts.failures[].message")
    status = d["status"]
    implied = status_from_counts(
        JunitCounts(
            passed=n["passed"], failed=n["failed"], errors=n["errors"], skipped=n["skipped"]
        )
    )
    if status in ("passed", "skipped") and implied != status:
        raise UnreadableReport(
            f"status is {status!r}, but its counts say {implied!r} ({n['passed']} passed, "
            f"{n['failed']} failed, {n['errors']} errors, {n['skipped']} skipped)"
        )
    cache = d.get("cache")
    if cache is not None:
        if not isinstance(cache, dict):
            raise UnreadableReport(f"cache is {cache!r}, not an object")
        for k in ("local", "remote", "compiled", "corrupt", "repeated", "failed"):
            _count(cache.get(k, 0), f"cache.{k}")
        _finite(cache.get("compile_s", 0.0), "cache.compile_s")
        warnings = cache.get("warnings", [])
        if not isinstance(warnings, list) or not all(isinstance(w, str) for w in warnings):
            raise UnreadableReport(f"cache.warnings is {warnings!r}, not a list of strings")


def result_from_dict(d: dict, cell: Cell | None = None) -> CellResult:
    """A `CellResult` from its record (`result_to_dict`); with ``cell``, the record must be that
    cell's.

    Raises:
        UnreadableReport: a field no runner writes (the message names it).
        TypeError: a field missing or unknown.
    """
    _check_record(d, cell)
    counts = dict(d.get("counts") or {})
    counts["failures"] = tuple(Failure(**f) for f in counts.get("failures", ()))
    cache = CacheStats.from_dict(d["cache"]) if d.get("cache") else None
    return CellResult(**{**d, "counts": JunitCounts(**counts), "cache": cache})


def cache_dir(cell_name: str, results_dir: str | os.PathLike[str]) -> Path:
    """Where a cell's processes leave their Triton cache counters (``<cell>.cache/``)."""
    return Path(results_dir) / f"{cell_name}.cache"


def write_cell_record(result: CellResult, results_dir: str | os.PathLike[str]) -> Path:
    """``<cell>.json``, plus a one-case JUnit for a cell that produced none (never a pass)."""
    out = Path(results_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{result.cell}.json"
    # whole or not at all: a write cut short (a full disk) leaves no half record behind
    partial = path.with_name(f".{path.name}.partial")
    try:
        partial.write_text(json.dumps(result_to_dict(result), indent=2) + "\n")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    junit = out / f"{result.cell}.xml"
    if result.status in ("not run", "error") and not junit.exists():
        _write_placeholder_junit(result, junit)
    return path


def _write_placeholder_junit(result: CellResult, path: Path) -> None:
    suite = ET.Element("testsuite", name=result.cell, tests="1", time="0")
    case = ET.SubElement(suite, "testcase", classname=result.cell, name="cell", time="0")
    if result.status == "not run":
        suite.set("skipped", "1")
        ET.SubElement(case, "skipped", message=f"not run: {result.reason}")
    else:
        suite.set("errors", "1")
        ET.SubElement(case, "error", message=result.reason)
    root = ET.Element("testsuites")
    root.append(suite)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


COMPILE_JSON = "compile/compile_matrix.json"


def junit_from_compile_json(
    json_path: str | os.PathLike[str], junit_path: str | os.PathLike[str], cell_name: str
) -> Path:
    """The compile matrix's report (``compile_matrix.json``) as JUnit: a test case per
    kernel/case x target, failing with the gate's reasons.

    Raises:
        UnreadableReport: the report is not the compile matrix's JSON (unparsable, no cells).
    """
    try:
        data = json.loads(Path(json_path).read_text())
        cells = data["cells"]
        if not isinstance(cells, list):
            raise TypeError(f"cells is a {type(cells).__name__}")
        if not cells:  # the compile command refuses filters that leave no cell
            raise ValueError("it holds no cell (no kernel case was compiled for any target)")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UnreadableReport(
            f"compile report {json_path} is unreadable ({type(exc).__name__}: {exc})"
        ) from None
    suite = ET.Element("testsuite", name=cell_name)
    failures = 0
    try:
        for i, c in enumerate(cells):
            # a verdict is a bool and the names strings: "false" is no pass
            if not isinstance(c["passed"], bool):
                raise TypeError(f"cells[{i}].passed is {c['passed']!r}, not a bool")
            named = {k: c[k] for k in ("kernel", "case", "arch")}
            wrong = [k for k, v in named.items() if not isinstance(v, str)]
            if wrong:
                raise TypeError(f"cells[{i}].{wrong[0]} is {named[wrong[0]]!r}, not a string")
            case = ET.SubElement(
                suite,
                "testcase",
                classname=f"{cell_name}.{c['kernel']}",
                name=f"{c['case']}@{c['arch']}",
                time=f"{float(c.get('wall_s') or 0.0):.3f}",
            )
            if not c["passed"]:
                failures += 1
                reasons = "; ".join(c.get("reasons") or []) or "failed the gate"
                ET.SubElement(case, "failure", message=reasons[:500]).text = reasons
        wall = float((data.get("meta") or {}).get("wall_s") or 0.0)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UnreadableReport(
            f"compile report {json_path} has a malformed cell ({type(exc).__name__}: {exc})"
        ) from None
    suite.set("tests", str(len(cells)))
    suite.set("failures", str(failures))
    suite.set("time", f"{wall:.3f}")
    root = ET.Element("testsuites")
    root.append(suite)
    ET.ElementTree(root).write(junit_path, encoding="utf-8", xml_declaration=True)
    return Path(junit_path)


def collect(cells: Sequence[Cell], results_dir: str | os.PathLike[str]) -> list[CellResult]:
    """Each cell's result from a results folder: its record, else its JUnit, else not run.

    The compile cell's JUnit is derived from the compile matrix's own report when absent (a
    Buildkite step uploads ``compile/`` only).
    """
    out = Path(results_dir)
    results = []
    for cell in cells:
        record, junit = out / f"{cell.name}.json", out / f"{cell.name}.xml"
        if cell.suite == "compile" and not junit.is_file() and (out / COMPILE_JSON).is_file():
            try:
                junit_from_compile_json(out / COMPILE_JSON, junit, cell.name)
            except UnreadableReport as exc:
                results.append(not_run(cell, str(exc), status="error"))
                continue
        if record.is_file():
            try:
                results.append(result_from_dict(json.loads(record.read_text()), cell))
            except UnreadableReport as exc:
                results.append(
                    not_run(cell, f"its record {record} is malformed: {exc}", status="error")
                )
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                why = f"its record {record} is unreadable ({type(exc).__name__}: {exc})"
                results.append(not_run(cell, why, status="error"))
        elif junit.is_file():
            cache = read_stats(cache_dir(cell.name, out))
            results.append(replace(result_from_junit(cell, junit), cache=cache))
        elif junit.exists() or record.exists():  # a folder where its result belongs
            where = junit if junit.exists() else record
            results.append(not_run(cell, f"its result {where} is not a file", status="error"))
        else:
            results.append(not_run(cell, f"no result in {out} (not selected, skipped or lost)"))
    return results


# -- summary out --------------------------------------------------------------------------------


def _fmt_seconds(s: float) -> str:
    return f"{s:.1f}s" if s < 60 else f"{int(s // 60)}m{int(s % 60):02d}s"


def _status_text(r: CellResult) -> str:
    return r.status + (" (experimental)" if r.experimental and r.status != "passed" else "")


def summary_table(results: Sequence[CellResult]) -> str:
    """A plain-text table: cell, result, where it ran, passed/failed/skipped, time, note."""
    header = (
        "cell",
        "result",
        "ran on",
        "passed",
        "failed",
        "skipped",
        "time",
        "compile",
        "cache",
        "note",
    )
    rows = [header]
    for r in results:
        c = r.counts
        ran = r.status != "not run"
        rows.append(
            (
                r.cell,
                _status_text(r),
                r.ran_on,
                str(c.passed) if ran else "-",
                str(c.failed + c.errors) if ran else "-",
                str(c.skipped) if ran else "-",
                _fmt_seconds(r.seconds) if ran else "-",
                _compile_text(r),
                _cache_text(r),
                r.reason,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines = []
    for i, row in enumerate(rows):
        lines.append(
            "  ".join(v.ljust(w) for v, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1]
        )
        if i == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 4)
    totals = totals_line(results)
    body = "\n".join(line.rstrip() for line in lines)
    return body + "\n" + cache_line(results) + "\n" + totals + "\n"


def _compile_text(r: CellResult) -> str:
    """Seconds Triton spent compiling (summed over the cell's processes); ``-`` if none looked."""
    return _fmt_seconds(r.cache.compile_s) if r.cache and r.cache.lookups else "-"


def _cache_text(r: CellResult) -> str:
    """Hit rate over lookups, e.g. ``96% of 120`` (``!`` when the remote layer was down)."""
    if r.cache is None or r.cache.hit_rate is None:
        return "-"
    down = " !" + ",".join(r.cache.warnings) if r.cache.warnings else ""
    return f"{r.cache.hit_rate:.0%} of {r.cache.lookups}{down}"


def cache_line(results: Sequence[CellResult]) -> str:
    """The whole matrix's Triton compiles: compile time, lookups, hits local / remote."""
    stats = [r.cache for r in results if r.cache and r.cache.lookups]
    if not stats:
        return "Triton cache: no compile recorded"
    local, remote = sum(s.local for s in stats), sum(s.remote for s in stats)
    lookups = sum(s.lookups for s in stats)
    compile_s = sum(s.compile_s for s in stats)
    compiled = sum(s.compiled for s in stats)
    repeated = sum(s.repeated for s in stats)
    failed = sum(s.failed for s in stats)
    again = f"; {repeated} of them compiled a kernel again" if repeated else ""
    again += f"; {failed} compiles failed or were stopped" if failed else ""
    return (
        f"Triton cache: {(local + remote) / lookups:.0%} hits of {lookups} lookups "
        f"({local} local, {remote} remote, {compiled} compiled in "
        f"{_fmt_seconds(compile_s)}){again}"
    )


def tally(results: Iterable[CellResult]) -> dict[str, int]:
    counts = dict.fromkeys(STATUSES, 0)
    for r in results:
        counts[r.status] += 1
    return counts


def totals_line(results: Sequence[CellResult]) -> str:
    t = tally(results)
    wall = sum(r.seconds for r in results)
    parts = [f"{n} {s}" for s, n in t.items() if n]
    return f"{len(results)} cells: " + ", ".join(parts) + f" (cell time {_fmt_seconds(wall)})"


def overall_status(results: Sequence[CellResult]) -> str:
    """``failed`` if a non-experimental cell failed or errored, else ``passed`` if any cell
    passed; else ``failed`` if an experimental cell failed or errored (its failure is all the
    run tested), else ``not run``."""
    if any(r.blocking_failure for r in results):
        return "failed"
    if any(r.status == "passed" for r in results):
        return "passed"
    if any(r.status in ("failed", "error") for r in results):
        return "failed"
    return "not run"


def find_heatmap(results_dir: str | os.PathLike[str]) -> Path | None:
    """The compile matrix's heatmap image (``compile/*.png``), if the compile cell made one."""
    pngs = sorted((Path(results_dir) / "compile").glob("*.png"))
    return pngs[0] if pngs else None


def markdown_report(
    results: Sequence[CellResult],
    *,
    title: str = "portattn matrix",
    context: str = "",
    heatmap: str | None = None,
) -> str:
    """The Markdown summary (also the Buildkite annotation): table, failures, not-run reasons."""
    lines = [f"## {title}: {overall_status(results)}", ""]
    if context:
        lines += [context, ""]
    lines += [totals_line(results), "", cache_line(results), ""]
    lines += [
        "| cell | result | ran on | passed | failed | skipped | time | compile | cache |",
        "|------|--------|--------|-------:|-------:|--------:|-----:|--------:|------:|",
    ]
    for r in results:
        c, ran = r.counts, r.status != "not run"
        cols = (
            [str(c.passed), str(c.failed + c.errors), str(c.skipped), _fmt_seconds(r.seconds)]
            if ran
            else ["-"] * 4
        ) + [_compile_text(r), _cache_text(r)]
        lines.append(
            f"| `{r.cell}` | {_ICON[r.status]} {_status_text(r)} | {r.ran_on} | "
            + " | ".join(cols)
            + " |"
        )
    bad = [r for r in results if r.status in ("failed", "error")]
    if bad:
        lines += ["", "### Failures", ""]
        for r in bad:
            lines.append(f"- `{r.cell}`: {r.reason}")
            for f in r.counts.failures[:MAX_FAILURES_LISTED]:
                lines.append(f"  - `{f.test}`: {f.message}")
            if len(r.counts.failures) > MAX_FAILURES_LISTED:
                lines.append(f"  - ... and {len(r.counts.failures) - MAX_FAILURES_LISTED} more")
    skipped = [r for r in results if r.status == "not run"]
    if skipped:
        lines += ["", "### Not run", ""]
        lines += [f"- `{r.cell}`: {r.reason}" for r in skipped]
    if heatmap:
        lines += ["", "### Compile matrix", "", f"![compile heatmap]({heatmap})"]
    return "\n".join(lines) + "\n"


def _merged_junit(results: Sequence[CellResult], results_dir: str | os.PathLike[str]) -> ET.Element:
    """One JUnit with a ``<testsuite>`` per cell (named after it); not-run cells as skipped."""
    root = ET.Element("testsuites", name="portattn matrix")
    src = Path(results_dir)
    for r in results:
        suite = ET.SubElement(root, "testsuite", name=r.cell, time=f"{r.seconds:.3f}")
        junit = src / f"{r.cell}.xml"
        try:  # an unreadable JUnit already made its cell an error: its reason stands in for it
            cases = list(ET.parse(junit).getroot().iter("testcase")) if junit.is_file() else []
        except (ET.ParseError, OSError):
            cases = []
        if not cases:
            case = ET.SubElement(suite, "testcase", classname=r.cell, name="cell", time="0")
            tag = "error" if r.status == "error" else "skipped"
            ET.SubElement(case, tag, message=f"{r.status}: {r.reason}")
            cases_for_count = [case]
        else:
            for case in cases:
                case.set("classname", f"{r.cell}.{case.get('classname', '')}".rstrip("."))
                suite.append(case)
            cases_for_count = cases
            if r.status == "error" and not any(
                c.find("failure") is not None or c.find("error") is not None for c in cases
            ):
                case = ET.SubElement(suite, "testcase", classname=r.cell, name="cell", time="0")
                ET.SubElement(case, "error", message=r.reason)
                cases_for_count = [*cases, case]
        suite.set("tests", str(len(cases_for_count)))
        for attr, tag in (("failures", "failure"), ("errors", "error"), ("skipped", "skipped")):
            suite.set(attr, str(sum(c.find(tag) is not None for c in cases_for_count)))
    return root


@dataclass(frozen=True)
class SummaryFiles:
    junit: Path
    markdown: Path
    text: Path
    json: Path
    heatmap: Path | None


#: What `write_summary` writes into the results folder.
SUMMARY_NAMES = ("junit.xml", "report.md", "summary.txt", "results.json")


class UnwritableOutput(ValueError):
    """A results folder (or a file in it) that the summary cannot be written to."""


def check_writable(
    results_dir: str | os.PathLike[str], names: Iterable[str] = SUMMARY_NAMES
) -> None:
    """Refuse, before anything is written, a results folder that cannot take ``names``.

    Raises:
        UnwritableOutput: one of ``names`` exists and is no file (a folder), or the folder does
            not let a file be created in it; the message names which.
    """
    out = Path(results_dir)
    for name in names:
        path = out / name
        if (path.exists() or path.is_symlink()) and not path.is_file():
            raise UnwritableOutput(f"cannot write {path}: it exists and is not a file")
    try:  # the one sure test: create (and remove) a file there
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise UnwritableOutput(f"cannot write into {out}: {exc.strerror or exc}") from None


def write_summary(
    results: Sequence[CellResult],
    results_dir: str | os.PathLike[str],
    *,
    title: str = "portattn matrix",
    context: str = "",
) -> SummaryFiles:
    """Write ``junit.xml``, ``report.md``, ``summary.txt`` and ``results.json`` to the folder.

    Every text is made first and each file goes to a temporary beside it before all are moved
    into place, so a failure never leaves a new summary beside an old one.

    Raises:
        UnwritableOutput: a file could not be written (nothing was replaced).
    """
    out = Path(results_dir)
    out.mkdir(parents=True, exist_ok=True)
    heatmap = find_heatmap(out)
    rel_heatmap = heatmap.relative_to(out).as_posix() if heatmap else None
    payload = {
        "status": overall_status(results),
        "tally": tally(results),
        "cells": [result_to_dict(r) for r in results],
    }
    texts = dict(
        zip(
            SUMMARY_NAMES,
            (
                ET.tostring(_merged_junit(results, out), encoding="utf-8", xml_declaration=True),
                markdown_report(
                    results, title=title, context=context, heatmap=rel_heatmap
                ).encode(),
                summary_table(results).encode(),
                (json.dumps(payload, indent=2) + "\n").encode(),
            ),
            strict=True,
        )
    )
    check_writable(out)
    temps: list[Path] = []
    try:
        for name, data in texts.items():
            (out / f".{name}.tmp").write_bytes(data)
            temps.append(out / f".{name}.tmp")
        for name in SUMMARY_NAMES:
            os.replace(out / f".{name}.tmp", out / name)
    except OSError as exc:
        raise UnwritableOutput(f"cannot write the summary in {out}: {exc}") from None
    finally:
        for tmp in temps:
            tmp.unlink(missing_ok=True)
    junit, md, txt, js = (out / name for name in SUMMARY_NAMES)
    return SummaryFiles(junit, md, txt, js, heatmap)
