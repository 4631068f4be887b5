"""``python -m kubematrix <command>``: the CI matrix from the command line.

Commands (``python -m kubematrix <command> --help`` for each):

- ``list``      the cells, how each runs, and whether this machine's runner can run it
- ``matrix``    run every cell the runner can run (alias ``run``) and print the summary
- ``pipeline``  print the generated Buildkite pipeline
- ``report``    rebuild the summary from a results folder (``--buildkite``: annotate the build)

A command is an entry of :data:`COMMANDS`: add one with :func:`register` (a name, a help line, a
function that adds its arguments, a function that runs it and returns the exit status).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kubematrix import CI_EXTRA_HINT, buildkite, cachestats, checkout, images, report, signals
from kubematrix.local import PROJECT_MARKER, find_project_root, run_local
from kubematrix.matrix import BACKENDS, RUNNERS, SUITES, Cell, Host, all_cells, select_cells
from kubematrix.matrix import why_not_runnable as _why_not
from kubematrix.signals import EXIT_TERMINATED, sigterm_interrupts

DEFAULT_RESULTS = "results/matrix"
EXIT_NO_CLUSTER = 2  # the k8s runner found no usable cluster: nothing was run
EXIT_NOTHING_TESTED = 4  # no selected cell ran a test here (none runnable, or all skipped)

#: What ``--help`` says (the module's doc string is for developers).
HELP = """\
The CI matrix: every suite x backend x target cell, run on this machine or as Kubernetes
Jobs, summarized as one report.

Run '%(prog)s COMMAND --help' for the options of a command.
"""


@dataclass(frozen=True)
class Command:
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    aliases: tuple[str, ...] = ()


COMMANDS: dict[str, Command] = {}


def register(
    name: str,
    help: str,
    configure: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
    aliases: Sequence[str] = (),
) -> None:
    """Add a subcommand (``configure`` adds its arguments; ``run`` returns the exit status)."""
    COMMANDS[name] = Command(help, configure, run, tuple(aliases))


# -- shared arguments ---------------------------------------------------------------------------


def _add_cell_filters(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--suite",
        action="append",
        default=[],
        choices=list(SUITES),
        help="only this suite (repeatable)",
    )
    p.add_argument(
        "--backend",
        action="append",
        default=[],
        choices=list(BACKENDS),
        help="only this backend (repeatable)",
    )
    p.add_argument(
        "--cell",
        action="append",
        default=[],
        metavar="NAME",
        help="only this cell, e.g. paged-cpu-interpreter (repeatable)",
    )


def _cells(args: argparse.Namespace) -> list[Cell]:
    """The cells the filters select; filters that select none are a usage error (a summary of
    no cell would say nothing and pass)."""
    cells = select_cells(all_cells(), suites=args.suite, backends=args.backend, names=args.cell)
    if not cells:
        given = [f"--{k} {v}" for k in ("suite", "backend", "cell") for v in getattr(args, k)]
        raise ValueError(
            f"the filters {' '.join(given)} select no cell (`kubematrix list` shows the cells)"
        )
    return cells


# -- list ---------------------------------------------------------------------------------------


def _configure_list(p: argparse.ArgumentParser) -> None:
    _add_cell_filters(p)
    p.add_argument("--runner", choices=RUNNERS, default="local")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _run_list(args: argparse.Namespace) -> int:
    host = Host.probe()
    rows: list[dict[str, Any]] = []
    checkout_found: bool | None = None  # looked up once, for the first pytest cell run here
    for cell in _cells(args):
        why = _why_not(cell, args.runner, host)
        here = args.runner == "local" or not cell.spec.is_gpu  # as `matrix` runs it
        if why is None and here and cell.suite != "compile":
            if checkout_found is None:
                checkout_found = find_project_root()[0] is not None
            if not checkout_found:
                why = f"no checkout with the tests ({PROJECT_MARKER}) here or above"
        rows.append(
            {
                "cell": cell.name,
                "suite": cell.suite,
                "backend": cell.backend,
                "target": cell.target,
                "command": " ".join(cell.nox_command()),
                "experimental": cell.experimental,
                "runnable": why is None,
                "reason": why,
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max(len(r["cell"]) for r in rows)
    for r in rows:
        state = "runs here" if r["runnable"] else f"not run: {r['reason']}"
        flag = " [experimental]" if r["experimental"] else ""
        print(f"{r['cell']:<{width}}  {r['command']}{flag}\n{'':<{width}}  -> {state}")
    return 0


# -- matrix / run -------------------------------------------------------------------------------


def _configure_matrix(p: argparse.ArgumentParser) -> None:
    _add_cell_filters(p)
    p.add_argument(
        "--runner",
        choices=RUNNERS,
        default="local",
        help="local: this machine (default); k8s: Kubernetes Jobs via the launcher",
    )
    p.add_argument(
        "--results",
        type=images.nonempty_arg,
        default=DEFAULT_RESULTS,
        help=f"results folder ({DEFAULT_RESULTS})",
    )
    p.add_argument(
        "--workers",
        type=_workers,
        default=None,
        help="pytest-xdist workers per cell (default: the usable cores, at most 8)",
    )
    p.add_argument(
        "--compile-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="passed on to python -m portattn.compile (repeatable); e.g. "
        "--compile-arg=--targets --compile-arg=sm_90,gfx942 for a quicker local run",
    )


MAX_WORKERS = 1024  # pytest-xdist starts a process per worker: more is a typo, not a machine


def _workers(text: str) -> int:
    """``--workers``: an int from 1 to `MAX_WORKERS` (argparse reports the rule)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"must be an int from 1 to {MAX_WORKERS}; got {text!r}")
    return n


def _results_folder(path: str) -> Path:
    """The results folder, created; one that cannot be made is a usage error naming it."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--results {path}: cannot create the folder: {exc.strerror}") from exc
    return out


def _check_writable(out: Path, names: Sequence[str]) -> None:
    """A usage error, before anything is written, when ``out`` cannot take ``names``."""
    try:
        report.check_writable(out, [*report.SUMMARY_NAMES, *names])
    except report.UnwritableOutput as exc:
        raise ValueError(f"--results {out}: {exc}") from None


def _clear_cell_files(cells: Sequence[Cell], out: Path) -> None:
    """Forget earlier runs of these cells and the folder's summary, so a stale JUnit or summary
    is never reported as this run's (a run that stops early leaves no summary)."""
    for name in report.SUMMARY_NAMES:
        (out / name).unlink(missing_ok=True)
    for cell in cells:
        for suffix in (".xml", ".json", ".log"):
            (out / f"{cell.name}{suffix}").unlink(missing_ok=True)
        if cell.suite == "compile":
            shutil.rmtree(out / "compile", ignore_errors=True)


def _run_matrix(args: argparse.Namespace) -> int:
    cells = _cells(args)
    if args.compile_arg and not any(c.suite == "compile" for c in cells):
        raise ValueError("--compile-arg is for the compile cell, and no compile cell is selected")
    here = [c for c in cells if args.runner == "local" or not c.spec.is_gpu]
    root = _project_root(here)
    out = _results_folder(args.results)
    _check_writable(out, [f"{c.name}{x}" for c in cells for x in (".xml", ".json", ".log")])
    cachestats.cache_env(None)  # a malformed cache setting stops the run before anything
    _clear_cell_files(cells, out)
    tested = _tested(args.runner, root)  # the working tree when the run began
    start = time.monotonic()
    no_cluster = False
    if args.runner == "local":
        results = run_local(
            cells, out, workers=args.workers, compile_args=args.compile_arg, cwd=root
        )
    else:
        results, no_cluster = _run_k8s(cells, out, args, root)
    wall = time.monotonic() - start
    context = f"runner `{args.runner}`, {tested}, wall time {wall:.0f} s"
    files = report.write_summary(results, out, context=context)
    print()
    print(report.summary_table(results), end="")
    print(f"\nJUnit per cell in {out}/, merged: {files.junit}")
    print(f"report: {files.markdown}")
    if files.heatmap:
        print(f"compile heatmap: {files.heatmap}")
    status = report.overall_status(results)
    print(f"matrix: {status} (wall time {wall:.0f} s)")
    if no_cluster:
        return EXIT_NO_CLUSTER
    if status == "not run":  # asked to run cells and none tested anything: never a green step
        print(
            f"matrix: none of the {len(results)} selected cells ran a test here (the summary "
            "says why); exit status 4",
            file=sys.stderr,
        )
        return EXIT_NOTHING_TESTED
    return 1 if status == "failed" else 0


def _project_root(cells: Sequence[Cell]) -> Path | None:
    """Where the pytest cells among ``cells`` run (the checkout with the tests); None when none
    of them is a pytest cell. No such checkout is a usage error that says where it looked."""
    if all(c.suite == "compile" for c in cells):
        return None
    root, looked = find_project_root()
    if root is None:
        raise ValueError(
            f"no tests folder for the pytest cells: looked for {PROJECT_MARKER} in "
            f"{', '.join(map(str, looked))}; run from the project's checkout"
        )
    return root


def _tested(runner: str, root: Path | None = None) -> str:
    """What the summary says was tested: the working tree's commit (`checkout.describe`, marked
    where the tree differs from ``HEAD``); under the k8s runner, whose Jobs check out ``HEAD``,
    both where they differ."""
    where = root or "."
    tree, head = checkout.describe(where), checkout.describe(where, dirty=False)
    if runner == "local" or tree == head:
        return f"commit `{tree}`"
    return f"commit `{head}` (GPU Jobs), this machine's cells `{tree}`"


def _run_k8s(
    cells: Sequence[Cell], out: Path, args: argparse.Namespace, root: Path | None
) -> tuple[list[report.CellResult], bool]:
    """GPU cells as Kubernetes Jobs through the launcher, CPU cells on this machine meanwhile.

    The cluster is checked first (configured, reachable, credentials and Role accepted): without
    one nothing runs, the first line says why, and every cell is recorded (the GPU cells as
    errors). The launcher runs in the main thread (it owns Ctrl-C and cleans its Jobs up); the
    CPU cells run in a thread that a Ctrl-C stops too.

    Returns:
        the results in the order of ``cells``, and whether the run stopped for want of a cluster.
    """
    gpu = [c for c in cells if c.spec.is_gpu]
    cpu = [c for c in cells if not c.spec.is_gpu]
    api: Any = None
    jobs: list[dict] = []
    if gpu:
        try:
            # Imported here: the kubernetes client is an optional dependency (the `ci` extra),
            # which `list`, `pipeline` and the local runner do without.
            from kubematrix import k8s

            namespace = k8s.namespace_setting()  # a bad value names its variable
        except ModuleNotFoundError as exc:
            why = f"the Kubernetes client is not installed ({exc}); {CI_EXTRA_HINT}"
        else:
            # a setting no Job can be made with is a usage error, named before a cluster is asked
            where = root or find_project_root()[0] or "."  # the checkout whose HEAD Jobs run
            jobs = k8s.render_cells(gpu, namespace=namespace, commit=k8s.git_commit(where))
            try:
                api = k8s.connect(namespace, say=lambda m: print(f"matrix: {m}", flush=True))
            except Exception as exc:  # k8s.NoCluster: configured nowhere, or unusable
                why = str(exc)
        if api is None:
            print(f"matrix: {len(cells)} cells; runner k8s: {why}; nothing run", flush=True)
            refused = [
                report.not_run(c, why, status="error")
                if c.spec.is_gpu
                else report.not_run(c, "not started: the k8s runner has no usable cluster")
                for c in cells
            ]
            for r in refused:
                report.write_cell_record(r, out)
            return refused, True
        where = f"in namespace {namespace} at {api.configuration.host}"
        print(
            f"matrix: {len(cells)} cells; runner k8s: {len(gpu)} GPU cells as Jobs {where}, "
            f"{len(cpu)} CPU cells here; results in {out}",
            flush=True,
        )
    else:
        print(f"matrix: {len(cells)} cells; runner k8s: no GPU cell, all run here", flush=True)
    stop = threading.Event()
    local: list[report.CellResult] = []
    failed: list[BaseException] = []

    def run_here() -> None:
        try:
            local.extend(run_local(cpu, out, workers=args.workers, stop=stop,
                                   compile_args=args.compile_arg, heading="CPU cells here",
                                   cwd=root))  # fmt: skip
        except BaseException as exc:  # handed to the main thread: its cells become errors
            failed.append(exc)

    thread = threading.Thread(target=run_here, name="kubematrix-local")
    if cpu:
        thread.start()
    results: dict[str, report.CellResult] = {}
    try:
        launched = list(k8s.run_cells(gpu, out, api=api, jobs=jobs)) if gpu else []
    finally:
        if cpu:
            if sys.exc_info()[0] is not None:
                stop.set()
            thread.join()
    if failed:  # the CPU cells' thread stopped: each cell it did not finish is an error
        why = f"the CPU cells' run stopped: {type(failed[0]).__name__}: {failed[0]}"
        print(f"matrix: {why}", file=sys.stderr, flush=True)
        done = {r.cell for r in local}
        lost = [report.not_run(c, why, status="error") for c in cpu if c.name not in done]
        for r in lost:
            report.write_cell_record(r, out)
        local.extend(lost)
    for r in [*local, *launched]:
        results[r.cell] = r
    for r in launched:
        report.write_cell_record(r, out)
    return [results[c.name] for c in cells], False


# -- pipeline -----------------------------------------------------------------------------------


def _configure_pipeline(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lanes",
        choices=buildkite.LANES,
        default="queues",
        help="GPU lanes on their own agent queues, or via agent-stack-k8s podSpecs",
    )
    # An explicitly empty value is refused (nonempty_arg), never read as "not given".
    sel = p.add_mutually_exclusive_group()
    sel.add_argument(
        "--changed-since",
        type=images.nonempty_arg,
        metavar="REF",
        help="select cells by the files changed since REF (git diff REF...HEAD)",
    )
    sel.add_argument(
        "--changed-files",
        type=images.nonempty_arg,
        nargs="*",
        metavar="PATH",
        help="select cells by these changed files",
    )
    p.add_argument(
        "--commit",
        type=images.nonempty_arg,
        default=None,
        help="commit the GPU images are pinned to (default: $BUILDKITE_COMMIT, else HEAD)",
    )
    p.add_argument(
        "--root",
        type=images.nonempty_arg,
        default=".",
        help="the checkout whose image inputs key the images (default: the current folder)",
    )
    p.add_argument("--format", choices=("yaml", "json"), default="yaml")
    p.add_argument(
        "--output", "-o", type=images.nonempty_arg, default=None, help="write here, not stdout"
    )


def _run_pipeline(args: argparse.Namespace) -> int:
    changed = args.changed_files
    if changed is not None:
        changed = buildkite.checkout_paths(changed, args.root)
        if not changed:
            print(
                "kubematrix pipeline: warning: --changed-files names no file, so every cell is "
                "behind a block step (a `$(git diff ...)` that expanded to nothing? "
                "--changed-since REF diffs for you)",
                file=sys.stderr,
            )
    if args.changed_since is not None:
        changed = buildkite.changed_files_since(args.changed_since, cwd=args.root)
    pipeline = buildkite.generate(
        changed_files=changed, lanes=args.lanes, commit=args.commit, root=args.root
    )
    text = (
        json.dumps(pipeline, indent=2) + "\n"
        if args.format == "json"
        else buildkite.to_yaml(pipeline)
    )
    if args.output is not None:
        out = Path(args.output)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
        except OSError as exc:
            raise ValueError(f"--output {out}: cannot write it: {exc}") from None
    else:
        sys.stdout.write(text)
    return 0


# -- report -------------------------------------------------------------------------------------


def _configure_report(p: argparse.ArgumentParser) -> None:
    _add_cell_filters(p)
    p.add_argument(
        "--results",
        type=images.nonempty_arg,
        default=DEFAULT_RESULTS,
        help=f"results folder ({DEFAULT_RESULTS})",
    )
    p.add_argument(
        "--buildkite",
        action="store_true",
        help="in a Buildkite step: download the cells' artifacts, annotate the build (exit "
        "status 0 whatever the cells did: their own steps carry the verdict; 1 when the "
        "annotation or the upload fails; 2 when buildkite-agent is not on the PATH)",
    )


AGENT = "buildkite-agent"


def _agent(*argv: str, stdin: str | None = None) -> None:
    subprocess.run([AGENT, *argv], input=stdin, text=True, check=True)


def _step_outcome(key: str) -> str | None:
    """The outcome Buildkite gives the step ``key`` (``passed``, ``hard_failed``,
    ``soft_failed``, ...), or ``None`` (said on stderr) when the agent cannot tell."""
    argv = [AGENT, "step", "get", "outcome", "--step", key]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
    except OSError as exc:
        print(f"report: `{' '.join(argv)}` could not run: {exc}", file=sys.stderr)
        return None
    outcome = done.stdout.strip()
    if done.returncode != 0 or not outcome:
        why = done.stderr.strip().splitlines()
        print(
            f"report: `{' '.join(argv)}` gave no outcome (exit status {done.returncode}"
            f"{': ' + why[-1] if why else ''}); the cell is judged by its JUnit alone",
            file=sys.stderr,
        )
        return None
    return outcome


def _judged_with_its_step(r: report.CellResult) -> report.CellResult:
    """A cell's result from its JUnit, overruled by its step's outcome where they disagree: a
    step that failed after a clean JUnit (a crash at exit, a timeout, a cancel) is no pass."""
    if r.status not in ("passed", "skipped", "not run"):
        return r
    outcome = _step_outcome(r.cell)
    if outcome is None or outcome == "passed":
        return r
    what = "its JUnit holds no failure" if r.status != "not run" else "its JUnit holds no test"
    return replace(r, status="error", reason=f"its step's outcome is {outcome}, though {what}")


def _run_report(args: argparse.Namespace) -> int:
    out = Path(args.results)
    cells = _cells(args)
    # the compile cell's JUnit is made from its report when absent: written here too
    derived = [f"{c.name}.xml" for c in cells if c.suite == "compile"]
    if args.buildkite:
        if ";" in args.results:  # the agent splits an upload's paths on ';'
            raise ValueError(f"--results {args.results}: must not hold ';' with --buildkite")
        if shutil.which(AGENT) is None:
            raise ValueError(f"--buildkite: {AGENT} is not on PATH (it annotates the build)")
        _results_folder(args.results)
        # A query that matches nothing fails the download: a build without such results. The
        # cells' Triton cache counters (`buildkite.artifact_paths`) give the summary's compile
        # time and hit rate.
        queries = (f"{out.as_posix()}/*.xml", f"{out.as_posix()}/compile/*",
                   f"{out.as_posix()}/*.cache/*.jsonl")  # fmt: skip
        for query in queries:
            try:
                _agent("artifact", "download", query, ".")
            except subprocess.CalledProcessError:
                print(f"report: no artifacts match {query} in this build", file=sys.stderr)
    elif not out.is_dir():  # a summary of nothing would call every cell "not run"
        raise ValueError(
            f"--results {out}: no such folder (run `kubematrix matrix` first, or give --results)"
        )
    _check_writable(out, derived)
    results = report.collect(cells, out)
    not_selected = set(filter(None, os.environ.get(buildkite.NOT_SELECTED_ENV, "").split(",")))
    by_name = {c.name: c for c in cells}
    named = set(args.cell)
    missing = [r.cell for r in results if r.cell in named and r.status == "not run"]

    def unrun(r: report.CellResult) -> report.CellResult:
        """A cell without a result: not selected by the change, or (in a build, where every
        other cell had a step) lost."""
        if r.status != "not run":
            return r
        if r.cell in not_selected:
            why = "not selected by the changed files (unblock its step to run it)"
            return report.not_run(by_name[r.cell], why)
        if args.buildkite:
            why = (
                "selected for this build, but no result came back (its step stopped before "
                "its tests reported, e.g. on a failed image step, or its artifacts were lost)"
            )
            return report.not_run(by_name[r.cell], why, status="error")
        if r.cell in named:  # asked for by name: lost, not passed (the files say so too)
            why = f"named with --cell, but without a test result ({r.reason})"
            return report.not_run(by_name[r.cell], why, status="error")
        return r

    results = [unrun(r) for r in results]
    if args.buildkite:  # the steps' outcomes, not only the files they uploaded
        results = [r if r.cell in not_selected else _judged_with_its_step(r) for r in results]
    context = ""
    if args.buildkite:
        context = (
            f"build {os.environ.get('BUILDKITE_BUILD_NUMBER', '?')}, commit "
            f"`{os.environ.get('BUILDKITE_COMMIT', '?')[:12]}`"
        )
    files = report.write_summary(results, out, context=context)
    print(report.summary_table(results), end="")
    status = report.overall_status(results)
    if args.buildkite:
        md = files.markdown.read_text()
        if files.heatmap:
            md = md.replace(
                f"]({files.heatmap.relative_to(out).as_posix()})",
                f"](artifact://{files.heatmap.as_posix()})",
            )
        style = {"passed": "success", "failed": "error"}.get(status, "warning")
        for what, argv, stdin in (
            ("annotate", ["--style", style, "--context", "matrix"], md),
            ("artifact upload", [f"{files.junit};{files.markdown};{files.json}"], None),
        ):
            try:
                _agent(*what.split(), *argv, stdin=stdin)
            except subprocess.CalledProcessError as exc:  # the step exists to annotate: fail it
                why = f"`{AGENT} {what}` failed with exit status {exc.returncode}"
                print(f"report: {why}", file=sys.stderr)
                return 1
        return 0  # the cells' own steps carry the verdict
    if status == "not run":  # as `matrix`: a summary in which no cell tested anything is no pass
        print(
            f"report: none of the {len(results)} selected cells has a test result in {out}; "
            "exit status 4",
            file=sys.stderr,
        )
        return EXIT_NOTHING_TESTED
    # a cell asked for by name whose result is missing: lost, not passed
    if missing and not any(r.blocking_failure for r in results if r.cell not in missing):
        verb = "has" if len(missing) == 1 else "have"
        print(
            f"report: {', '.join(missing)} (named with --cell) {verb} no test result in {out}; "
            "exit status 4",
            file=sys.stderr,
        )
        return EXIT_NOTHING_TESTED
    return 1 if status == "failed" else 0


register("list", "the cells and whether this machine can run them", _configure_list, _run_list)
register(
    "matrix",
    "run the cells the runner can run; print the summary",
    _configure_matrix,
    _run_matrix,
    aliases=("run",),
)
register("pipeline", "print the generated Buildkite pipeline", _configure_pipeline, _run_pipeline)
register("report", "summary from a results folder (JUnit per cell)", _configure_report, _run_report)
register(
    "image",
    "the CI images: content key, references, build script, base pin",
    images.configure_cli,
    images.run_cli,
)


def build_parser() -> argparse.ArgumentParser:
    # the console script's name where it was run as one, else the module form
    command = os.path.basename(sys.argv[0]) if sys.argv else ""
    parser = argparse.ArgumentParser(
        prog="kubematrix" if command == "kubematrix" else "python -m kubematrix",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, aliases=list(cmd.aliases), description=cmd.help)
        cmd.configure(p)
        p.set_defaults(_run=cmd.run)
    return parser


EXIT_BROKEN_PIPE = 141  # as a shell reports a process that SIGPIPE ended


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with sigterm_interrupts():  # a cancelled CI job cleans up as on Ctrl-C
            code = args._run(args)
    except ValueError as exc:  # a bad cell name, suite ... : a usage error, not a traceback
        print(f"kubematrix {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # what a command leaves behind it says itself (the launcher's Jobs)
        if not signals.terminated.is_set():  # Ctrl-C (SIGTERM is said below)
            print(f"kubematrix {args.command}: interrupted", file=sys.stderr)
            return 130
        code = EXIT_TERMINATED
    except BrokenPipeError:  # e.g. `kubematrix list | head -1`: the reader left, quietly stop
        # Python flushes stdout at exit: point it at devnull so that flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except OSError as exc:  # a results folder that fills up or turns read-only mid-run
        print(f"kubematrix {args.command}: stopped: {exc}", file=sys.stderr)
        return 1
    if signals.terminated.is_set():  # also where the local runner caught it for its summary
        print(f"kubematrix {args.command}: terminated (SIGTERM)", file=sys.stderr)
        return EXIT_TERMINATED
    return code


if __name__ == "__main__":
    sys.exit(main())
