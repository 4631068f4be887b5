"""Run cells as Kubernetes Jobs from this machine: ``python -m kubematrix.k8s`` (``nox -s k8s``).

Cluster access is the kubeconfig's current context (or ``--context``), or the in-cluster
service account when running inside a pod. With neither, or when one request to the cluster
fails (unreachable, credentials rejected, the Role missing), it says so before creating anything
and exits 2: a run without a cluster is never reported green.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import yaml

from kubematrix import CI_EXTRA_HINT, checkout, report
from kubematrix.images import default_image, image_arg, nonempty_arg
from kubematrix.matrix import Cell
from kubematrix.render import (
    DEFAULT_NAMESPACE,
    DNS_LABEL_RULE,
    INT64_MAX,
    MAX_GID,
    VENDORS,
    is_dns_label,
    render_job,
)
from kubematrix.signals import interrupted_exit, sigterm_interrupts

try:
    from kubernetes import client, config

    from kubematrix.launcher import CellError, CellResult, Launcher, Timeouts
except ModuleNotFoundError as exc:  # an optional dependency (the `ci` extra)
    if __name__ != "__main__":
        raise
    sys.stderr.write(
        f"kubematrix.k8s: the Kubernetes client is not installed ({exc}); {CI_EXTRA_HINT}; "
        "nothing was created\n"
    )
    sys.exit(2)

EXIT_INFRA = 3
EXIT_NO_CLUSTER = 2
#: Every cell exited 0 but some ran no passing test (all skipped, or none collected): as
#: ``kubematrix matrix`` exits when nothing was tested, never a green step.
EXIT_NOTHING_TESTED = 4
NAMESPACE_ENV = "KUBEMATRIX_NAMESPACE"
KERNEL_SUITES = ("paged", "mla", "hybrid", "specdec")

HELP = """\
Run kernel-suite cells as Kubernetes Jobs and report each cell's result.

Cluster access: the kubeconfig's current context (or --context), or the pod's service
account. Without a usable cluster nothing is created and the exit status is 2.

Exit status: 0 when every cell passed; the first failing cell's test exit code; 3 when a
cell hit an infrastructure error (no JUnit report, image pull, scheduling, API); 4 when every
cell exited 0 but one passed no test; 130 on Ctrl-C and 143 on SIGTERM (the Jobs deleted).

examples:
  python -m kubematrix.k8s --vendor rocm --suite mla --image ghcr.io/me/portattn-ci:rocm-abc
  python -m kubematrix.k8s --vendor cuda --vendor rocm --suite paged --suite mla -- -x
"""


class NoCluster(RuntimeError):
    """No usable cluster: none configured, or the configured one does not answer as it must."""


def load_api_client(context: str | None = None) -> client.ApiClient:
    """An API client for the in-cluster config or the kubeconfig's (current) context.

    Raises:
        NoCluster: neither is configured.
    """
    cfg = client.Configuration()
    # no urllib3 retries under the launcher's own (429/5xx/connection backoff): stacked, they
    # multiply the wait on a server that accepts and never answers
    cfg.retries = False
    if os.environ.get("KUBERNETES_SERVICE_HOST") and context is None:
        try:
            config.load_incluster_config(client_configuration=cfg)
            return client.ApiClient(cfg)
        except config.ConfigException as exc:
            raise NoCluster(f"in-cluster configuration failed: {exc}") from exc
    try:
        config.load_kube_config(context=context, client_configuration=cfg)
    except Exception as exc:  # the client raises whatever its parsing of a bad file meets
        where = os.environ.get("KUBECONFIG", "~/.kube/config")
        raise NoCluster(
            f"no cluster configured: not in a pod, and {where} gives no usable context "
            f"({_kubeconfig_problem(exc)}). Point KUBECONFIG at a cluster or pass --context."
        ) from exc
    return client.ApiClient(cfg)


def _kubeconfig_problem(exc: Exception) -> str:
    """What is wrong with the kubeconfig, in one line, from the client's exception."""
    if isinstance(exc, config.ConfigException):
        return " ".join(str(exc).split())
    if isinstance(exc, IsADirectoryError):
        return "it is a folder, not a file"
    if isinstance(exc, OSError):
        return f"cannot read it: {exc.strerror}"
    if isinstance(exc, UnicodeDecodeError):
        return "it is not UTF-8 text"
    if isinstance(exc, yaml.YAMLError):
        return f"it is not valid YAML: {' '.join(str(exc).split())}"
    return "it is not a kubeconfig: a YAML mapping of clusters, users and contexts"


def namespace_setting() -> str:
    """``$KUBEMATRIX_NAMESPACE`` (unset or empty: :data:`DEFAULT_NAMESPACE`).

    Raises:
        ValueError: naming the variable, when it is no namespace name.
    """
    value = os.environ.get(NAMESPACE_ENV) or DEFAULT_NAMESPACE
    if not is_dns_label(value):
        raise ValueError(f"{NAMESPACE_ENV} must be {DNS_LABEL_RULE}; got {value!r}")
    return value


def _gids(text: str) -> list[int]:
    """``--supplemental-groups``: comma-separated GIDs (ints in [0, MAX_GID]); argparse
    reports the rule."""
    try:
        gids = [int(g) for g in text.split(",")]
    except ValueError:
        gids = [-1]
    if any(not 0 <= g <= MAX_GID for g in gids):
        raise argparse.ArgumentTypeError(
            f"must be comma-separated integer GIDs in [0, {MAX_GID}], e.g. 44,109; got {text!r}"
        )
    return gids


def _check_results_folder(path: Path) -> None:
    """Refuse up front a ``--results`` folder the cells' JUnit reports could not be written to
    (they are written as the cells finish); nothing is created here.

    Raises:
        ValueError: naming the option and the part of the path that stops it.
    """
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"--results {path}: cannot create it: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--results {path}: cannot create it: {existing} is not writable")


def git_commit(root: str | os.PathLike[str] = ".") -> str:
    """HEAD of the repository at ``root``: the commit the Jobs check out and whose image they run.

    Raises:
        ValueError: ``root`` is no git checkout (a Job of commit "unknown" would pull an image
            that does not exist, under a name every such run shares).
    """
    head = checkout.head(root)
    if head is None:
        raise ValueError(
            f"no commit for the Jobs: {Path(root).resolve()} is not a git checkout (the Jobs "
            "check out a commit and run its image); run from the project's checkout, or give "
            "the commit (python -m kubematrix.k8s --commit)"
        )
    return head


def exit_status(results: Sequence[CellResult]) -> int:
    """One cell: its test exit code (or 3 for an infrastructure error). Several: the first
    failing cell's exit code, else 3 if any cell did not pass, else 0."""
    for r in results:
        if r.outcome == "failed" and r.exit_code:
            return r.exit_code
    return 0 if all(r.outcome == "passed" for r in results) else EXIT_INFRA


#: The access check's budget: a few short attempts before a silent server is named (a cell's
#: requests keep the launcher's full `Timeouts`).
CHECK_REQUEST_S = 15.0
CHECK_RETRIES = 2


def connect(
    namespace: str,
    context: str | None = None,
    timeouts: Timeouts | None = None,
    say: Callable[[str], None] | None = None,
) -> client.ApiClient:
    """An API client whose cluster answered one request (list Jobs in ``namespace``), within
    `CHECK_RETRIES` retries of `CHECK_REQUEST_S` each at most; ``say``: told which server is
    asked before the wait.

    Raises:
        NoCluster: no cluster configured, or it cannot be used (the message says why).
    """
    api = load_api_client(context)
    host = api.configuration.host
    t = timeouts or Timeouts()
    t = replace(t, request_s=min(t.request_s, CHECK_REQUEST_S),
                retries=min(t.retries, CHECK_RETRIES))  # fmt: skip
    if say is not None:
        say(f"checking the cluster at {host} (namespace {namespace}) ...")
    try:
        Launcher(api, namespace, timeouts=t, emit=lambda _: None).check_access()
    except CellError as exc:
        raise NoCluster(f"the cluster at {host} cannot run cells: {exc}") from exc
    return api


def render_cells(cells: Sequence[Cell], *, namespace: str, commit: str) -> list[dict]:
    """The Jobs of matrix GPU ``cells`` (no cluster asked): what `run_cells` launches.

    Raises:
        ValueError: a CPU cell, or a setting or argument no Job can be made with (naming it).
    """
    cpu = [c.name for c in cells if c.spec.vendor is None]
    if cpu:
        raise ValueError(f"run_cells: cells must be GPU cells; got CPU cells {cpu}")
    return [
        render_job(
            vendor=c.spec.vendor or "",
            suite=c.suite,
            session=c.nox_session,
            image=default_image(c.spec.vendor or "", commit),
            commit=commit,
            cell=c.name,
            arch=c.target,
            namespace=namespace,
        )
        for c in cells
    ]


def run_cells(
    cells: Sequence[Cell],
    results_dir: Path | str,
    *,
    api: client.ApiClient | None = None,
    namespace: str | None = None,
    commit: str | None = None,
    max_parallel: int = 4,
    timeouts: Timeouts | None = None,
    jobs: list[dict] | None = None,
) -> list[report.CellResult]:
    """Matrix GPU cells as Jobs -> their results, as the local runner reports them.

    ``jobs``: the cells' Jobs if the caller already rendered them (`render_cells`).

    The JUnit report of each cell is written to ``cell.junit_path(results_dir)``. Without a
    cluster every cell is reported as an error saying so.

    Raises:
        ValueError: as `render_cells`, before any cluster is asked.
    """
    out = Path(results_dir)
    namespace = namespace or namespace_setting()
    if jobs is None:
        jobs = render_cells(cells, namespace=namespace, commit=commit or git_commit())
    try:
        api = api or connect(namespace, timeouts=timeouts)
    except NoCluster as exc:
        return [report.not_run(c, str(exc), status="error") for c in cells]
    launcher = Launcher(api, namespace, timeouts=timeouts)
    results = []
    for cell, r in zip(cells, launcher.run_many(jobs, max_parallel=max_parallel), strict=True):
        if r.junit is not None:
            path = cell.junit_path(out)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(r.junit)
            result = report.result_from_junit(
                cell, path, exit_code=r.exit_code, exit_note=r.termination
            )
        else:
            result = report.not_run(cell, r.message, status="error")
        # Compile time and hit rate, as the local runner reads them from the cell's counters.
        results.append(replace(result, cache=r.cache))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    with sigterm_interrupts():  # a cancelled CI job deletes its Jobs as on Ctrl-C
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kubematrix.k8s",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--vendor", action="append", choices=VENDORS, required=True)
    parser.add_argument("--suite", action="append", choices=KERNEL_SUITES, required=True)
    parser.add_argument(
        "--image", type=image_arg, help="image for every cell (default: per vendor, see docs)"
    )
    parser.add_argument(
        "--commit", type=nonempty_arg, help="commit the Job names and images use (default: HEAD)"
    )
    parser.add_argument(
        "--namespace",
        type=nonempty_arg,
        help=f"where the Jobs run (default: ${NAMESPACE_ENV}, else {DEFAULT_NAMESPACE})",
    )
    parser.add_argument(
        "--context", type=nonempty_arg, help="kubeconfig context (default: the current one)"
    )
    parser.add_argument("--max-parallel", type=int, default=4)
    parser.add_argument(
        "--pending-timeout",
        type=float,
        default=600.0,
        help="seconds a pod may stay unscheduled or pulling (default 600)",
    )
    parser.add_argument(
        "--deadline",
        type=int,
        default=3600,
        help="Job activeDeadlineSeconds, > 600 (the cell stops 300 s before it; a test may take "
        "min(900, deadline - 600) s)",
    )
    parser.add_argument(
        "--supplemental-groups",
        type=_gids,
        help="AMD: the node's video,render GIDs, e.g. 44,109 (default: the overlay's)",
    )
    parser.add_argument(
        "--results", type=lambda text: Path(nonempty_arg(text)), default=Path("results/k8s")
    )
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="-- then pytest args")
    args = parser.parse_args(argv)
    extra = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    # Usage errors first, before any cluster is asked: the Jobs are rendered from the templates.
    try:
        commit = args.commit if args.commit is not None else git_commit()
        namespace = args.namespace if args.namespace is not None else namespace_setting()
        if args.max_parallel < 1:
            raise ValueError(f"--max-parallel must be >= 1; got {args.max_parallel}")
        if not 600 < args.deadline <= INT64_MAX:
            raise ValueError(
                f"--deadline must be > 600 s (the cell stops 300 s before it, and a test may "
                f"take min(900, deadline - 600) s) and <= 2**63 - 1 (the Job's int64 field); got "
                f"{args.deadline}"
            )
        if not 0 < args.pending_timeout < float("inf"):
            raise ValueError(
                f"--pending-timeout must be a finite number of seconds > 0; got "
                f"{args.pending_timeout}"
            )
        jobs = [
            render_job(
                vendor=vendor,
                suite=suite,
                image=args.image if args.image is not None else default_image(vendor, commit),
                commit=commit,
                nox_args=extra,
                namespace=namespace,
                cell=f"{suite}-{vendor}",
                active_deadline_s=args.deadline,
                cell_timeout_s=args.deadline - 300,
                test_timeout_s=min(900, args.deadline - 600),
                supplemental_groups=args.supplemental_groups if vendor == "rocm" else None,
            )
            # a repeated --vendor or --suite names its cell once (two Jobs of one name collide)
            for vendor in dict.fromkeys(args.vendor)
            for suite in dict.fromkeys(args.suite)
        ]
        _check_results_folder(args.results)
    except ValueError as exc:
        sys.stderr.write(f"kubematrix.k8s: {exc}; nothing was created\n")
        return 2
    except KeyboardInterrupt:  # rendering (kubectl kustomize) before any Job exists
        sys.stderr.write("kubematrix.k8s: interrupted; nothing was created\n")
        return interrupted_exit()
    try:
        api = connect(namespace, args.context)
    except NoCluster as exc:
        sys.stderr.write(f"kubematrix.k8s: {exc}; nothing was created\n")
        return EXIT_NO_CLUSTER
    except KeyboardInterrupt:  # while the cluster is checked: no Job was created yet
        sys.stderr.write("kubematrix.k8s: interrupted; nothing was created\n")
        return interrupted_exit()
    launcher = Launcher(
        api,
        namespace,
        timeouts=Timeouts(pending_s=args.pending_timeout),
        results_dir=args.results,
    )
    try:
        results = launcher.run_many(jobs, max_parallel=args.max_parallel)
    except KeyboardInterrupt:
        if launcher.leftovers:
            sys.stderr.write("kubematrix.k8s: interrupted; some Jobs may be left behind:\n")
        else:
            sys.stderr.write("kubematrix.k8s: interrupted; the launched Jobs were deleted\n")
        _report_leftovers(launcher)
        return interrupted_exit()
    untested = []
    for r in results:
        cache = f"; Triton cache: {r.cache.describe()}" if r.cache else ""
        outcome = r.outcome
        if outcome == "passed" and _passed_tests(args.results / f"{r.name}.xml") == 0:
            outcome = "no test passed (all skipped)"  # the matrix runner's "skipped"
            untested.append(r.name)
        sys.stdout.write(f"{r.name}: {outcome} ({r.message}{cache})\n")
    _report_leftovers(launcher)
    status = exit_status(results)
    if status == 0 and untested:
        sys.stderr.write(f"kubematrix.k8s: {', '.join(untested)} passed no test; exit status "
                         f"{EXIT_NOTHING_TESTED}\n")  # fmt: skip
        return EXIT_NOTHING_TESTED
    return status


def _passed_tests(junit: Path) -> int | None:
    """The passed test cases of a cell's JUnit report (``None``: unreadable, which the
    launcher's outcome already judged)."""
    try:
        return report.read_junit(junit).passed
    except report.UnreadableReport:
        return None


def _report_leftovers(launcher: Launcher) -> None:
    """One line per Job the launcher could not delete, with the command that removes it."""
    for name, note in sorted(launcher.leftovers.items()):
        sys.stderr.write(f"kubematrix.k8s: job {name} was not deleted: {note}\n")


if __name__ == "__main__":
    sys.exit(main())
