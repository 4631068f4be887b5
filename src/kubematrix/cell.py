"""Inside a cell's container: run the nox session, then print its results to the log.

The launcher may read pod logs (``pods/log get``) but has no way into the pod's filesystem, and
the Role grants nothing more. So the cell ends its log with what the launcher needs, each piece
marked with a per-Job token:

* the Triton compile cache's counters (:mod:`kubematrix.cachestats`), summed over the session's
  processes: a line for people, then ``KUBEMATRIX-CACHE <token> <json>`` for the launcher, whose
  summary shows the cell's compile time and hit rate as the local runner's does;
* the JUnit report, gzip-compressed and base64-encoded between two marker lines.

The launcher cuts both out of the streamed log. Standard library only (``cachestats`` is too):
this runs in the image before anything else.

Usage (the Job's command)::

    python -m kubematrix.cell --results /results/junit.xml --timeout 3300 -- nox -s mla -- -x

The exit status is the command's; 124 when ``--timeout`` interrupted it (SIGINT first, so pytest
still writes the partial report; SIGKILL after a grace period); 127 when the command cannot be
started; 1 when it exited 0 but left no report (nothing was tested).
"""

from __future__ import annotations

import argparse
import base64
import gzip
import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from kubematrix.cachestats import STATS_DIR_ENV, CacheStats, read_stats

BEGIN = "KUBEMATRIX-RESULTS-BEGIN"
END = "KUBEMATRIX-RESULTS-END"
CACHE = "KUBEMATRIX-CACHE"
TIMEOUT_EXIT = 124
NO_REPORT_EXIT = 1  # the command exited 0 without a report: never a passing cell
CANNOT_START_EXIT = 127  # as a shell reports a command it cannot find or execute
_WRAP = 76
_GRACE_S = 60.0


def encode_results(data: bytes, token: str, exit_code: int) -> list[str]:
    """Log lines carrying ``data``: a BEGIN marker, base64(gzip(data)) lines, an END marker."""
    payload = base64.b64encode(gzip.compress(data, mtime=0)).decode("ascii")
    body = [payload[i : i + _WRAP] for i in range(0, len(payload), _WRAP)]
    return [f"{BEGIN} {token}", *body, f"{END} {token} exit={exit_code}"]


def decode_results(lines: Iterable[str], token: str) -> tuple[bytes | None, int | None]:
    """The last complete report with ``token`` in ``lines``, and the exit status it names.

    Returns ``(None, None)`` when no complete BEGIN..END block is present (a cell killed before
    it could print). Lines may keep their trailing newline.
    """
    found: tuple[bytes | None, int | None] = (None, None)
    body: list[str] | None = None
    for raw in lines:
        line = raw.rstrip("\r\n")
        if line == f"{BEGIN} {token}":
            body = []
        elif body is not None and line.startswith(f"{END} {token} exit="):
            code = line.rsplit("=", 1)[1]
            found = (gzip.decompress(base64.b64decode("".join(body))), int(code))
            body = None
        elif body is not None:
            body.append(line.strip())
    return found


def cache_lines(stats_dir: str | os.PathLike[str] | None, token: str) -> list[str]:
    """Log lines with the compile cache's counters under ``stats_dir``: one for people, one
    for the launcher (:func:`decode_cache`). None when no process of the cell recorded any."""
    stats = read_stats(stats_dir) if stats_dir else None
    if stats is None:
        return []
    return [
        f"kubematrix.cell: Triton cache: {stats.describe()}",
        f"{CACHE} {token} {json.dumps(stats.to_dict(), sort_keys=True)}",
    ]


def decode_cache(lines: Iterable[str], token: str) -> CacheStats | None:
    """The last cache counters with ``token`` in ``lines``; ``None`` when there are none (or the
    line was cut short)."""
    found = None
    prefix = f"{CACHE} {token} "
    for raw in lines:
        line = raw.rstrip("\r\n")
        if line.startswith(prefix):
            try:
                found = CacheStats.from_dict(json.loads(line[len(prefix) :]))
            except (ValueError, TypeError, AttributeError):
                continue
    return found


def _interrupt(proc: subprocess.Popen) -> None:
    """SIGINT the command's process group (pytest then writes its report); SIGKILL if it hangs."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        proc.wait()


def run(command: Sequence[str], results: Path, token: str, timeout_s: float | None) -> int:
    """Run ``command``, print the report at ``results`` to stdout, return the exit status."""
    try:
        proc = subprocess.Popen(list(command), start_new_session=True)
    except OSError as exc:  # not found, not executable: said in the log, which the launcher reads
        print(f"kubematrix.cell: cannot start {command[0]}: {exc.strerror or exc}", flush=True)
        return CANNOT_START_EXIT
    # The kubelet stops a pod with SIGTERM: pass it on as SIGINT so the report is still written.
    signal.signal(signal.SIGTERM, lambda *_: _interrupt(proc))
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        sys.stdout.write(f"kubematrix.cell: {timeout_s:.0f} s elapsed; interrupting the session\n")
        sys.stdout.flush()
        _interrupt(proc)
        code = TIMEOUT_EXIT
    lines = cache_lines(os.environ.get(STATS_DIR_ENV), token)
    if results.is_file():
        lines += encode_results(results.read_bytes(), token, code)
    else:
        lines += [f"kubematrix.cell: no report at {results} (the session did not reach pytest)"]
        if code == 0:
            lines += [f"kubematrix.cell: exit status {NO_REPORT_EXIT}: no report, nothing tested"]
            code = NO_REPORT_EXIT
    sys.stdout.write("".join(f"{line}\n" for line in lines))
    sys.stdout.flush()
    return code


def _seconds(text: str) -> float:
    """``--timeout``: a finite number of seconds > 0 (0 or less would interrupt at once)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0; got {text!r}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kubematrix.cell", description=__doc__)
    parser.add_argument("--results", type=Path, required=True, help="the JUnit file to print")
    parser.add_argument(
        "--timeout", type=_seconds, default=None, help="seconds (> 0) before SIGINT"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("a command is required after --")
    token = os.environ.get("KUBEMATRIX_RESULTS_TOKEN", "manual")
    return run(command, args.results, token, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
