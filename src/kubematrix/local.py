"""The local runner: every cell this machine can run, one after another, as subprocesses.

Each kernel-suite cell is
``python -m pytest -n <workers> --dist worksteal -m "<suite> and not gpu"``
(CPU, with ``TRITON_INTERPRET=1``) or ``-m "<suite> and not cpu"`` (GPU), the arguments that
``nox -s <suite>`` passes in CI, writing ``<cell>.xml`` and ``<cell>.log`` to the results folder.
The compile cell runs ``python -m portattn.compile --out <results>/compile``.

Cells run in sequence: each one already spreads over every core through pytest-xdist, so running
two at once would only oversubscribe a small machine (the CPU gate runs on 2 cores). The runner
never imports portattn, torch or triton: a cell is a process, and its verdict comes from the
process's exit status and its JUnit.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

from kubematrix.cachestats import cache_env, read_stats
from kubematrix.matrix import COMPILE_MODULE, Cell, Host, pytest_xdist_args, why_not_runnable
from kubematrix.matrix import pytest_workers as default_workers
from kubematrix.report import (
    COMPILE_JSON,
    PYTEST_NOTHING_COLLECTED,
    CellResult,
    UnreadableReport,
    cache_dir,
    junit_from_compile_json,
    not_run,
    result_from_junit,
    write_cell_record,
)

HEARTBEAT_SECONDS = 30.0
LOG_TAIL_LINES = 25
# What marks the project's checkout: the pytest cells run there (pytest's rootdir, `tests/`).
PROJECT_MARKER = "tests/conftest.py"


def find_project_root(start: str | os.PathLike[str] = ".") -> tuple[Path | None, list[Path]]:
    """The checkout the pytest cells run in, and the folders looked in.

    The first of ``start``, its parents, then the checkout this package was loaded from (an
    editable install), that holds :data:`PROJECT_MARKER` and a ``pyproject.toml``; None where
    none does (an installed package run outside a checkout).
    """
    here = Path(start).resolve()
    looked = [here, *here.parents]
    package_checkout = Path(__file__).resolve().parents[2]  # <checkout>/src/kubematrix/local.py
    if package_checkout not in looked:
        looked.append(package_checkout)
    for folder in looked:
        if (folder / PROJECT_MARKER).is_file() and (folder / "pyproject.toml").is_file():
            return folder, looked
    return None, looked


def cell_command(
    cell: Cell, results_dir: Path, workers: int, compile_args: Sequence[str] = ()
) -> list[str]:
    """The subprocess that runs ``cell`` here (in the current Python environment).

    ``compile_args`` go to the compile module after the cell's own (e.g. ``--targets``).
    """
    if cell.suite == "compile":
        return [
            sys.executable,
            "-m",
            COMPILE_MODULE,
            *cell.compile_args(results_dir),
            *compile_args,
        ]
    xdist = pytest_xdist_args(workers)
    return [
        sys.executable,
        "-m",
        "pytest",
        *xdist,
        "-p",
        "no:cacheprovider",
        *cell.pytest_args(results_dir),
    ]


def _marker(cell: Cell) -> str:
    args = cell.pytest_args(".")
    return args[args.index("-m") + 1]


def _tail(path: Path, n: int = LOG_TAIL_LINES) -> str:
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(lines[-n:])


def _last_progress_line(log: Path) -> str:
    """The log's last line that looks like progress (``[12/1440] ...``, pytest's ``[ 40%]``)."""
    try:
        with open(log, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        line = line.strip()
        if re.search(r"\[\s*\d+(/\d+|%)\]", line):
            return f" — {line[:90]}"
    return ""


def _write_exit_status_junit(cell: Cell, junit: Path, exit_code: int, log: Path) -> None:
    """A one-case failing JUnit for the compile module that exited non-zero without a report."""
    suite = ET.Element("testsuite", name=cell.name, tests="1", failures="1")
    case = ET.SubElement(suite, "testcase", classname=cell.name, name=COMPILE_MODULE)
    node = ET.SubElement(case, "failure", message=f"{COMPILE_MODULE} exited with {exit_code}")
    node.text = _tail(log)
    root = ET.Element("testsuites")
    root.append(suite)
    ET.ElementTree(root).write(junit, encoding="utf-8", xml_declaration=True)


def _stop(proc: subprocess.Popen) -> None:
    """Stop a cell's whole process group (pytest-xdist workers included)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def run_cell(cell: Cell, results_dir: Path, **kwargs) -> CellResult:
    """Run one cell (:func:`_run_cell`) with its Triton compiles through the shared cache.

    The cache is Triton's own folder (``TRITON_CACHE_DIR``, default ``~/.triton/cache``), with
    ``$KUBEMATRIX_TRITON_REDIS`` behind it when set; the result carries the cell's counters.
    """
    stats = cache_dir(cell.name, results_dir)
    shutil.rmtree(stats, ignore_errors=True)
    result = _run_cell(cell, results_dir, cache=cache_env(stats), **kwargs)
    return dataclasses.replace(result, cache=read_stats(stats))


def _run_cell(
    cell: Cell,
    results_dir: Path,
    *,
    workers: int,
    say: Callable[[str], None],
    heartbeat: float = HEARTBEAT_SECONDS,
    cwd: str | os.PathLike[str] | None = None,
    stop: threading.Event | None = None,
    compile_args: Sequence[str] = (),
    cache: dict[str, str] | None = None,
) -> CellResult:
    """Run one cell to completion (or its timeout) and return its result.

    ``cwd`` is where pytest runs (its rootdir and ``testpaths``); the current directory by default.
    Setting ``stop`` (from another thread) stops the cell as Ctrl-C would.
    """
    junit, log = cell.junit_path(results_dir), results_dir / f"{cell.name}.log"
    junit.unlink(missing_ok=True)
    if cell.suite == "compile":  # an earlier run's report must not stand in for this one's
        (results_dir / COMPILE_JSON).unlink(missing_ok=True)
    env = {**os.environ, **(cache or {}), **cell.env}
    if cell.spec.is_gpu:  # a GPU cell runs on the device even from a shell that exported it
        env.pop("TRITON_INTERPRET", None)
    cmd = cell_command(cell, results_dir, workers, compile_args)
    start = time.monotonic()
    deadline = start + cell.timeout_minutes * 60
    last_said = start
    with open(log, "w") as log_file:
        log_file.write("$ " + shlex.join(cmd) + "\n")
        log_file.flush()
        proc = subprocess.Popen(
            cmd,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
        try:
            while True:
                try:
                    wait = min(heartbeat, deadline - time.monotonic(), 1.0 if stop else heartbeat)
                    proc.wait(timeout=max(0.1, wait))
                    break
                except subprocess.TimeoutExpired:
                    if stop is not None and stop.is_set():
                        raise KeyboardInterrupt from None
                    if time.monotonic() >= deadline:
                        _stop(proc)
                        elapsed = time.monotonic() - start
                        return not_run(
                            cell,
                            f"timed out after {cell.timeout_minutes} min (log: {log})",
                            status="error",
                            seconds=elapsed,
                        )
                    if time.monotonic() - last_said >= heartbeat:
                        last_said = time.monotonic()
                        said = f"      {cell.name}: running, {last_said - start:.0f}s"
                        say(said + _last_progress_line(log))
        except BaseException:  # Ctrl-C or the like: leave no process behind, then go on raising
            _stop(proc)
            raise
    elapsed = time.monotonic() - start
    code = proc.returncode
    if cell.suite == "compile" and not junit.exists():
        report_json = results_dir / COMPILE_JSON
        if report_json.is_file():
            try:
                junit_from_compile_json(report_json, junit, cell.name)
            except UnreadableReport as exc:
                return not_run(cell, f"{exc} (log: {log})", status="error", seconds=elapsed)
        elif code == 0:  # e.g. --compile-arg=--list: a clean exit that compiled nothing
            why = f"{COMPILE_MODULE} exited 0 without a report at {report_json}: nothing compiled"
            return not_run(cell, f"{why} (log: {log})", seconds=elapsed)
        else:
            _write_exit_status_junit(cell, junit, code, log)
    if code == PYTEST_NOTHING_COLLECTED and not junit.exists():
        return not_run(cell, f"no test matches -m {_marker(cell)!r}")
    if not junit.exists():
        return not_run(
            cell, f"exit status {code}, no JUnit (log: {log})", status="error", seconds=elapsed
        )
    result = result_from_junit(cell, junit, seconds=elapsed, exit_code=code)
    if code == PYTEST_NOTHING_COLLECTED:
        reason = f"no test matches -m {_marker(cell)!r}"
        return not_run(cell, reason, seconds=elapsed)
    return result


def run_local(
    cells: Sequence[Cell],
    results_dir: str | os.PathLike[str],
    *,
    workers: int | None = None,
    host: Host | None = None,
    stream: TextIO | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stop: threading.Event | None = None,
    compile_args: Sequence[str] = (),
    heading: str = "matrix",
) -> list[CellResult]:
    """Run every cell the local machine can run; the others become ``not run`` with the reason.

    ``heading`` begins the first line (the k8s runner's CPU part says so: it is not the matrix).

    Progress goes to ``stream`` (stdout by default) one line per cell. On Ctrl-C the running cell
    is stopped and recorded as an error, the remaining cells as not run, and the results so far
    are returned (so the summary is still written); setting ``stop`` from another thread does the
    same (the Kubernetes runner runs the CPU cells in a thread beside the launcher).
    """
    out = Path(results_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    stream = stream or sys.stdout
    host = host or Host.probe()
    workers = workers or default_workers()

    def say(line: str) -> None:
        print(line, file=stream, flush=True)

    plan = [(cell, why_not_runnable(cell, "local", host)) for cell in cells]
    runnable = [c for c, why in plan if why is None]
    xdist = f" (pytest -n {workers})" if any(c.suite != "compile" for c in runnable) else ""
    say(
        f"{heading}: {len(cells)} cells; runner local runs {len(runnable)}{xdist}, "
        f"{len(cells) - len(runnable)} not run here; results in {out}"
    )
    results: list[CellResult] = []
    index = 0
    interrupted = False
    for cell, why in plan:
        interrupted = interrupted or (stop is not None and stop.is_set())
        if why is not None or interrupted:
            result = not_run(cell, why or "interrupted before it started")
        else:
            index += 1
            say(f"[{index}/{len(runnable)}] {cell.name} ...")
            started = time.monotonic()
            try:
                result = run_cell(
                    cell,
                    out,
                    workers=workers,
                    say=say,
                    cwd=cwd,
                    stop=stop,
                    compile_args=compile_args,
                )
            except KeyboardInterrupt:
                interrupted = True
                elapsed = time.monotonic() - started
                result = not_run(cell, "interrupted", status="error", seconds=elapsed)
            c = result.counts
            counts = (
                f" ({c.passed} passed, {c.failed + c.errors} failed, {c.skipped} skipped)"
                if c.tests
                else ""
            )
            say(
                f"[{index}/{len(runnable)}] {cell.name}: {result.status}{counts} "
                f"in {result.seconds:.1f}s" + (f" — {result.reason}" if result.reason else "")
            )
            log = out / f"{cell.name}.log"
            if result.status in ("failed", "error") and log.exists():
                say(f"      last lines of {log}:\n" + _tail(log, 15))
        write_cell_record(result, out)
        results.append(result)
    return results
