"""``python -m portattn.compile``: run the compile matrix and write its reports.

Exit status: 0 when every cell passes the gate, 1 when any fails, 2 on a usage error (a bad
argument, a Triton cache or report file that cannot be written: checked before compiling), 4
when every selected cell was refused by its op (nothing compiled), 130 on Ctrl-C and 143 on
SIGTERM (the reports written first, the cells without a result failed as stopped). The
heatmap is optional: without matplotlib the run says so before compiling and writes the other
reports.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone

from portattn.compile.cases import KERNELS, default_cases, select_cases
from portattn.compile.matrix import (
    CellResult,
    MatrixInterrupted,
    matrix_cells,
    parse_targets,
    run_matrix,
)
from portattn.compile.report import summary_table, write_heatmap, write_json, write_markdown
from portattn.platform import TARGETS

#: Exit status of a run in which every cell was refused by its op: nothing compiled (as
#: kubematrix's exit status of a matrix that tested nothing).
EXIT_NOTHING_COMPILED = 4
#: Exit statuses of a run stopped by Ctrl-C and by SIGTERM (as a shell reports them); the
#: reports are written first, the stopped cells failed.
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143
#: What the PNG heatmap needs beyond the compile matrix itself.
HEATMAP_MODULES = ("matplotlib", "numpy")


def _csv(s: str) -> list[str]:
    """A comma-separated list of at least one name (an empty one would select nothing and pass)."""
    names = [x.strip() for x in s.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"must name at least one, comma-separated; got {s!r}")
    return names


def missing_heatmap_modules() -> list[str]:
    """The modules of :data:`HEATMAP_MODULES` that cannot be imported here."""
    return [m for m in HEATMAP_MODULES if importlib.util.find_spec(m) is None]


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an int >= ``low`` (argparse reports the rule); the bench CLIs use it
    too."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = low - 1
        if n < low:
            raise argparse.ArgumentTypeError(f"must be an int >= {low}; got {text!r}")
        return n

    return parse


def _writable_folder(path: str) -> str | None:
    """Why ``path`` cannot be used as a folder to write files in (``None``: it can). A real
    file is written and removed: permission bits say nothing for root or a read-only mount."""
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".portattn-probe-")
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def check_cache_dir(cache_dir: str | None) -> str | None:
    """The error for a Triton cache the workers could not write (``None``: it is usable).

    Without the check every cell fails its compile with the same ``NotADirectoryError``, which
    reads as kernel failures. ``cache_dir`` is ``--cache-dir``; else Triton's own choice
    (``TRITON_CACHE_DIR``, else the default under ``TRITON_HOME`` or ``~``) is checked.
    """
    if cache_dir is not None:
        name, path = "--cache-dir", cache_dir
    else:
        from triton import knobs

        path = knobs.cache.dir
        name = "TRITON_CACHE_DIR" if "TRITON_CACHE_DIR" in os.environ else "Triton's cache"
    if not path:
        return f"{name} must name a folder; got {path!r}"
    why = _writable_folder(path)
    if why is not None:
        return f"{name} {path}: must be a folder this process can create and write in ({why})"
    return None


#: The reports a run writes into ``--out`` (the heatmap only with it).
REPORTS = ("compile_matrix.json", "compile_matrix.md", "compile_matrix.png")


def check_reports(out: str, png: bool) -> str | None:
    """The error for a report ``--out`` could not take (``None``: all can be written)."""
    why = _writable_folder(out)
    if why is not None:
        return f"cannot create the report folder --out {out} or write in it ({why})"
    for name in REPORTS if png else REPORTS[:2]:
        path = os.path.join(out, name)
        if os.path.lexists(path) and not os.path.isfile(path):
            return f"--out {out}: {name} exists and is not a file"
        if os.path.exists(path) and not os.access(path, os.W_OK):
            return f"--out {out}: {name} is not writable"
    return None


def _list(cases) -> int:
    """Print the case ids; a reader that stops early (``| head``) ends the listing quietly."""
    try:
        for c in cases:
            print(c.id)
        sys.stdout.flush()
    except BrokenPipeError:
        # the interpreter's last flush at exit would fail again: point stdout at /dev/null
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        # the console script's name where it was run as one, else the module form
        prog="portattn-compile"
        if sys.argv and os.path.basename(sys.argv[0]) == "portattn-compile"
        else "python -m portattn.compile",
        description="Compile every kernel x case x target with Triton's NVIDIA and AMD backends "
        "(no GPU needed) and gate shared memory, compile errors and spills.",
        epilog="Exit status: 0 every cell passed the gate; 1 a cell failed; 2 a usage error "
        "(nothing compiled); 4 every selected cell was refused by its op (nothing compiled); "
        "130 Ctrl-C, 143 SIGTERM (reports written, unfinished cells failed as stopped).",
    )
    p.add_argument(
        "--targets",
        type=_csv,
        default=None,
        help=f"comma-separated archs (default all: {','.join(TARGETS)})",
    )
    p.add_argument(
        "--kernels",
        type=_csv,
        default=None,
        help=f"comma-separated ops (default all: {','.join(KERNELS)})",
    )
    p.add_argument("--cases", default=None, help="regular expression on case ids")
    p.add_argument("--out", default="results/compile", help="report folder")
    p.add_argument(
        "--cache-dir",
        default=None,
        help="Triton cache for the workers (default: TRITON_CACHE_DIR or ~/.triton/cache)",
    )
    p.add_argument(
        "--jobs",
        "-j",
        type=at_least(1),
        default=None,
        help="worker processes (default: CPU count)",
    )
    p.add_argument("--no-png", action="store_true", help="skip the heatmap")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument(
        "--max-rows",
        type=at_least(0),
        default=None,
        help="rows of the terminal table (default all)",
    )
    return p


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[threading.Event]:
    """SIGTERM (a cancelled or timed-out CI job) raises KeyboardInterrupt in the main thread,
    as Ctrl-C does, and sets the event it yields; elsewhere nothing changes."""
    terminated = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield terminated
        return

    def interrupt(signum: int, frame: object) -> None:
        terminated.set()
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield terminated
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        targets = parse_targets(args.targets)
        cases = select_cases(default_cases(args.kernels), args.cases)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not cases:
        print("error: no case matches the filters", file=sys.stderr)
        return 2
    total = len(matrix_cells(cases, targets))
    if total == 0:
        vendors = sorted({v for c in cases for v in c.vendors})
        print(
            f"error: compile: no cell: the {len(cases)} cases matching the filters compile only "
            f"for {'/'.join(vendors)} targets, and --targets {','.join(targets)} has none",
            file=sys.stderr,
        )
        return 2
    if args.list:  # the cases with a cell on the targets: what a run of these filters compiles
        return _list([c for c in cases if matrix_cells([c], targets)])
    png = not args.no_png
    missing = missing_heatmap_modules() if png else []
    # before any compile: a cache or report folder that cannot be written stops the run here
    error = check_cache_dir(args.cache_dir) or check_reports(args.out, png and not missing)
    if error is not None:
        print(f"error: compile: {error}", file=sys.stderr)
        return 2
    if missing:  # said before compiling, not after: the heatmap is skipped, the rest is written
        print(
            f"warning: {', '.join(missing)} not installed: no heatmap (compile_matrix.png); "
            "install it, or pass --no-png to silence this",
            file=sys.stderr,
            flush=True,
        )
        png = False
    print(
        f"compile matrix: {len(cases)} cases x {len(targets)} targets: {total} cells, "
        f"jobs={args.jobs or os.cpu_count()}",
        file=sys.stderr,
    )
    step = max(1, total // 20)

    def progress(done: int, n: int, cell: CellResult) -> None:
        if done % step == 0 or done == n or not cell.passed:
            state = "ok" if cell.passed else "FAIL"
            print(f"  [{done}/{n}] {state} {cell.id}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    interrupted: int | None = None
    with _sigterm_interrupts() as terminated:
        try:
            cells = run_matrix(
                cases, targets, jobs=args.jobs, cache_dir=args.cache_dir, progress=progress
            )
        except MatrixInterrupted as stop:  # what finished is still reported
            cells = stop.cells
            interrupted = EXIT_TERMINATED if terminated.is_set() else EXIT_INTERRUPTED
    wall = time.perf_counter() - t0
    import triton

    meta = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "triton": triton.__version__,
        "wall_s": round(wall, 1),
        "jobs": args.jobs or os.cpu_count(),
        "compile_s_sum": round(sum(r.compile_s for c in cells for r in c.launches), 1),
    }
    try:  # checked up front; a folder changed during the run still ends in one line
        write_json(cells, os.path.join(args.out, "compile_matrix.json"), meta)
        write_markdown(cells, os.path.join(args.out, "compile_matrix.md"), meta)
        if png:
            write_heatmap(cells, os.path.join(args.out, "compile_matrix.png"))
    except OSError as exc:
        print(f"error: compile: cannot write {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    print(summary_table(cells, max_rows=args.max_rows))
    print(
        f"wall {wall:.1f} s; reports in {args.out}/compile_matrix.{{json,md"
        f"{',png' if png else ''}}}"
    )
    if interrupted is not None:
        print(
            f"compile: interrupted ({'SIGTERM' if interrupted == EXIT_TERMINATED else 'Ctrl-C'}):"
            f" {sum(c.crash is not None for c in cells)} cells stopped without a result; exit "
            f"status {interrupted}",
            file=sys.stderr,
        )
        return interrupted
    if all(c.passed for c in cells) and not any(c.launches for c in cells):
        # every cell refused by its op (no tile fits): nothing was compiled, so nothing passed
        print(
            f"compile: none of the {len(cells)} cells compiled a kernel (each refused by its op); "
            "exit status 4",
            file=sys.stderr,
        )
        return EXIT_NOTHING_COMPILED
    return 0 if all(c.passed for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
