"""Run rendered cell Jobs on a cluster: create -> watch -> stream logs -> results -> cleanup.

Uses the official ``kubernetes`` client and only what ``k8s/base/rbac.yaml`` grants (jobs
create/get/list/watch/delete, pods get/list/watch, pods/log get, events list/watch).

* Names are deterministic (:func:`kubematrix.render.job_name`), so a 409 on create means "this
  cell of this commit is already running": the launcher attaches to it instead of failing.
* The pod is watched with a server-side ``timeout_seconds`` and a client-side
  ``_request_timeout``; a 410 (history compacted) or a dropped stream resumes by listing again.
* Logs are followed with ``timestamps=true``; after a cut connection the launcher reads the log
  again and skips what it already printed (same timestamp and ordinal), so no line is duplicated.
* It fails fast on image-pull errors and on pods still pending after ``pending_s``, quoting the
  scheduler's event (``0/4 nodes are available: 4 Insufficient amd.com/gpu.``).
* An evicted pod is not a test failure (the Job's pod failure policy ignores disruptions): the
  launcher follows the replacement pod.
* The JUnit report comes back inside the log (see :mod:`kubematrix.cell`).
* 429 and 5xx are retried with backoff (``Retry-After`` honoured); 403/404/422 are not.
* The Job is deleted with ``propagationPolicy=Foreground`` (its pods go with it) on every exit:
  success, failure, timeout, an infrastructure error and Ctrl-C.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from kubematrix.cell import decode_results
from kubematrix.render import CELL_CONTAINER

RETRYABLE = frozenset({429, 500, 502, 503, 504})
IMAGE_ERRORS = frozenset(
    {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}
)
CONFIG_ERRORS = frozenset(
    {"CreateContainerConfigError", "CreateContainerError", "RunContainerError"}
)
_NET_ERRORS = (urllib3.exceptions.ProtocolError, urllib3.exceptions.TimeoutError)
_NET_ERRORS_RETRY = (*_NET_ERRORS, urllib3.exceptions.MaxRetryError)


@dataclass(frozen=True)
class Timeouts:
    """Every wait of the launcher, in seconds (tests shrink them).

    Attributes:
        pending_s: a pod not running after this long fails the cell (unschedulable, pulls).
        watch_s: server-side ``timeout_seconds`` of each watch request.
        request_s: client-side read timeout of plain requests (watches get ``watch_s`` + 5).
        log_idle_s: client-side read timeout of the log stream; on expiry the pod is checked.
        overall_s: give up on the cell after this long; ``None``: the Job's deadline + 60.
        retries: attempts after the first for 429/5xx/connection errors.
        backoff_s: first retry delay (doubled each time, capped at 10 s).
        connect_s: connect timeout of every request.
    """

    pending_s: float = 600.0
    watch_s: int = 60
    request_s: float = 30.0
    log_idle_s: float = 300.0
    overall_s: float | None = None
    retries: int = 5
    backoff_s: float = 0.5
    connect_s: float = 10.0


@dataclass
class CellResult:
    """How one cell ended.

    Attributes:
        name: the Job name.
        outcome: ``"passed"``, ``"failed"`` (the tests failed: a red cell) or ``"error"`` (the
            infrastructure failed: image pull, scheduling, timeout, API; worth a retry).
        exit_code: the test container's exit status, ``None`` when it never ran to the end.
        message: one line for a summary.
        junit: the JUnit XML the cell printed, if any.
        attached: the Job already existed (409) and the launcher followed it.
        evictions: pods lost to disruptions and replaced by the Job.
    """

    name: str
    outcome: str
    exit_code: int | None
    message: str
    junit: bytes | None = None
    attached: bool = False
    evictions: list[str] = field(default_factory=list)


class CellError(Exception):
    """An infrastructure failure of one cell (the message is shown to the user)."""


class Cancelled(Exception):
    """The run was cancelled (Ctrl-C in a fan-out)."""


def _ts_key(stamp: str) -> str:
    """RFC 3339 timestamp -> a string that sorts by time (fraction padded to nanoseconds)."""
    base, _, frac = stamp.rstrip("Z").partition(".")
    return f"{base}.{frac:0<9}"


class _LogCursor:
    """What has been printed of one pod's log: the newest timestamp and how many lines had it.

    Call :meth:`reconnect` before reading the log again from its start; :meth:`admit` then
    rejects every line printed before, by (timestamp, ordinal among equal timestamps).
    """

    def __init__(self) -> None:
        self.last = ""
        self.count = 0
        self._replayed = 0

    def reconnect(self) -> None:
        self._replayed = 0

    def admit(self, stamp: str) -> bool:
        key = _ts_key(stamp)
        if key < self.last:
            return False
        if key == self.last:
            self._replayed += 1
            if self._replayed <= self.count:
                return False
            self.count += 1
            return True
        self.last, self.count, self._replayed = key, 1, 1
        return True


class Launcher:
    """Runs cell Jobs in one namespace.

    Args:
        api: a configured ``kubernetes.client.ApiClient``.
        namespace: where Jobs are created.
        timeouts: every wait (see :class:`Timeouts`).
        emit: receives each output line (log lines prefixed by the cell when fanning out).
        results_dir: where each cell's JUnit report is written as ``<job name>.xml``.
    """

    def __init__(
        self,
        api: client.ApiClient,
        namespace: str,
        *,
        timeouts: Timeouts | None = None,
        emit: Callable[[str], None] | None = None,
        results_dir: Path | None = None,
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.t = timeouts or Timeouts()
        self.core = client.CoreV1Api(api)
        self.batch = client.BatchV1Api(api)
        self._emit = emit or _print
        self.results_dir = results_dir
        self.cancel = threading.Event()
        self._lock = threading.Lock()
        self._launched: set[str] = set()

    # ------------------------------------------------------------------ plumbing

    def _say(self, prefix: str, line: str) -> None:
        self._emit(f"{prefix}{line}")

    def _check_cancel(self) -> None:
        if self.cancel.is_set():
            raise Cancelled("cancelled")

    def _sleep(self, seconds: float) -> None:
        if self.cancel.wait(seconds):
            raise Cancelled("cancelled")

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn`` with retries on 429/5xx and dropped connections; JSON-decoded response."""
        kwargs.setdefault("_request_timeout", (self.t.connect_s, self.t.request_s))
        kwargs["_preload_content"] = False
        delay = self.t.backoff_s
        for attempt in range(self.t.retries + 1):
            self._check_cancel()
            try:
                resp = fn(*args, **kwargs)
                return json.loads(resp.data or b"{}")
            except ApiException as exc:
                if exc.status not in RETRYABLE or attempt == self.t.retries:
                    raise
                wait = _retry_after(exc) or delay
            except _NET_ERRORS_RETRY:
                if attempt == self.t.retries:
                    raise
                wait = delay
            self._sleep(min(wait, 10.0))
            delay = min(delay * 2, 10.0)
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ one cell

    def run(self, job: dict, *, prefix: str = "") -> CellResult:
        """Create ``job`` (or attach to it), follow it to the end, delete it, return the result.

        Raises:
            KeyboardInterrupt: after deleting the Job, when the user pressed Ctrl-C.
        """
        name = job["metadata"]["name"]
        token = _env(job, "KUBEMATRIX_RESULTS_TOKEN") or "manual"
        deadline = time.monotonic() + (
            self.t.overall_s
            if self.t.overall_s is not None
            else job["spec"].get("activeDeadlineSeconds", 3600) + 60
        )
        attached = False
        try:
            attached = self._create(job, prefix)
            result = self._follow(name, token, deadline, prefix)
        except CellError as exc:
            result = CellResult(name, "error", None, str(exc))
        except ApiException as exc:
            result = CellResult(name, "error", None, _describe_api_error(exc, self.namespace))
        except Cancelled:
            result = CellResult(name, "error", None, "cancelled")
        finally:
            self.delete(name, prefix)
        result.attached = attached
        if result.junit is not None and self.results_dir is not None:
            self.results_dir.mkdir(parents=True, exist_ok=True)
            (self.results_dir / f"{name}.xml").write_bytes(result.junit)
        self._say(prefix, f"kubematrix: {name}: {result.outcome}: {result.message}")
        return result

    def _create(self, job: dict, prefix: str) -> bool:
        name = job["metadata"]["name"]
        body = client.V1Job.from_dict(job)
        with self._lock:
            self._launched.add(name)
        try:
            self._call(self.batch.create_namespaced_job, self.namespace, body)
        except ApiException as exc:
            if exc.status == 409:
                self._say(prefix, f"kubematrix: job {name} already exists; attaching to it")
                return True
            raise
        self._say(prefix, f"kubematrix: created job {self.namespace}/{name}")
        return False

    def delete(self, name: str, prefix: str = "") -> None:
        """Delete the Job and, through foreground propagation, its pods (404 is fine)."""
        try:
            # Not self._call: cleanup must run even after a cancel.
            for attempt in range(self.t.retries + 1):
                try:
                    self.batch.delete_namespaced_job(
                        name,
                        self.namespace,
                        propagation_policy="Foreground",
                        _request_timeout=(self.t.connect_s, self.t.request_s),
                    )
                    self._say(prefix, f"kubematrix: deleted job {name} (foreground propagation)")
                    break
                except ApiException as exc:
                    if exc.status == 404:
                        break
                    if exc.status not in RETRYABLE or attempt == self.t.retries:
                        raise
                except _NET_ERRORS_RETRY:
                    if attempt == self.t.retries:
                        raise
                time.sleep(min(self.t.backoff_s * 2**attempt, 10.0))
        finally:
            with self._lock:
                self._launched.discard(name)

    def _follow(self, name: str, token: str, deadline: float, prefix: str) -> CellResult:
        evicted: list[str] = []
        lines: list[str] = []
        while True:
            pod = self._wait_for_pod(name, deadline, set(evicted), prefix)
            pod_name = pod["metadata"]["name"]
            self._stream_logs(pod_name, deadline, lines, prefix)
            pod = self._call(self.core.read_namespaced_pod, pod_name, self.namespace)
            state, detail = classify_pod(pod)
            if state == "evicted":
                evicted.append(pod_name)
                self._say(
                    prefix,
                    f"kubematrix: pod {pod_name} was evicted ({detail}); "
                    "the Job replaces it, following the new pod",
                )
                continue
            if state != "terminated":
                raise CellError(f"pod {pod_name} ended its log while {state}: {detail}")
            code = int(detail)
            junit, _ = decode_results(lines, token)
            outcome = "passed" if code == 0 else "failed"
            message = f"exit code {code}" + ("" if junit else "; no JUnit report in the log")
            return CellResult(name, outcome, code, message, junit, evictions=evicted)

    # ------------------------------------------------------------------ watching the pod

    def _wait_for_pod(self, name: str, deadline: float, skip: set[str], prefix: str) -> dict:
        """Watch the Job's pods until one (not in ``skip``) runs or has terminated."""
        start = time.monotonic()
        waiting: dict[str, tuple[float, str, str]] = {}  # pod -> (first seen, state, detail)
        for pod in self._watch_pods(name, deadline):
            now = time.monotonic()
            if pod is not None and pod["metadata"]["name"] not in skip:
                pod_name = pod["metadata"]["name"]
                state, detail = classify_pod(pod)
                if state in ("running", "terminated", "evicted"):
                    return pod
                if state == "image-error":
                    raise CellError(f"pod {pod_name} cannot pull its image: {detail}")
                if state == "config-error":
                    raise CellError(f"pod {pod_name} cannot start its container: {detail}")
                since = waiting.get(pod_name, (now, "", ""))[0]
                waiting[pod_name] = (since, state, detail)
            for pod_name, (since, state, detail) in waiting.items():
                if now - since > self.t.pending_s:
                    event = self._scheduler_event(pod_name)
                    what = "unschedulable" if state == "unschedulable" else f"still {state}"
                    raise CellError(
                        f"pod {pod_name} {what} after {self.t.pending_s:g} s: {event or detail}"
                    )
            if not waiting and now - start > self.t.pending_s:
                raise CellError(
                    f"no pod for job {name} after {self.t.pending_s:g} s "
                    f"({self._job_condition(name)})"
                )
        raise CellError(f"job {name}: gave up waiting for a running pod (launcher deadline)")

    def _watch_pods(self, name: str, deadline: float) -> Iterator[dict | None]:
        """Every observed state of the Job's pods; ``None`` ticks at least every ``watch_s``.

        Lists, then watches from the list's resourceVersion; on 410 Gone or a broken stream it
        lists again (nothing is missed: the list carries the current state). Events are
        deserialized by the client (its ``deserialize=False`` path cannot handle an in-stream
        ERROR event in kubernetes 37.0.2); the launcher reads their ``raw_object``.
        """
        selector = f"batch.kubernetes.io/job-name={name}"
        rv: str | None = None
        while time.monotonic() < deadline:
            self._check_cancel()
            if rv is None:
                listing = self._call(
                    self.core.list_namespaced_pod, self.namespace, label_selector=selector
                )
                rv = listing["metadata"]["resourceVersion"]
                yield from listing["items"]
                yield None
            remaining = deadline - time.monotonic()
            server_timeout = max(1, int(min(self.t.watch_s, remaining, self.t.pending_s)))
            w = watch.Watch()
            try:
                for event in w.stream(
                    self.core.list_namespaced_pod,
                    self.namespace,
                    label_selector=selector,
                    resource_version=rv,
                    allow_watch_bookmarks=True,
                    timeout_seconds=server_timeout,
                    _request_timeout=(self.t.connect_s, server_timeout + 5),
                ):
                    self._check_cancel()
                    rv = w.resource_version or rv
                    if event["type"] in ("ADDED", "MODIFIED"):
                        yield event["raw_object"]  # the API's JSON, as lists give it
                    elif event["type"] == "DELETED":
                        yield None
            except ApiException as exc:
                if exc.status == 410:
                    rv = None  # history compacted: list again
                elif exc.status in RETRYABLE:
                    self._sleep(_retry_after(exc) or self.t.backoff_s)
                else:
                    raise
            except _NET_ERRORS:
                rv = None
            finally:
                w.stop()
            yield None

    def _scheduler_event(self, pod_name: str) -> str:
        """The newest warning event about ``pod_name`` (FailedScheduling first), or ''."""
        try:
            events = self._call(
                self.core.list_namespaced_event,
                self.namespace,
                field_selector=f"involvedObject.kind=Pod,involvedObject.name={pod_name}",
            )
        except ApiException:
            return ""
        warnings = [e for e in events.get("items", []) if e.get("type") == "Warning"]
        warnings.sort(key=lambda e: (e.get("reason") == "FailedScheduling", _event_time(e)))
        if not warnings:
            return ""
        event = warnings[-1]
        return f"{event.get('reason')}: {event.get('message', '').strip()}"

    def _job_condition(self, name: str) -> str:
        job = self._call(self.batch.read_namespaced_job, name, self.namespace)
        conditions = job.get("status", {}).get("conditions") or []
        if not conditions:
            return "the Job controller created none"
        c = conditions[-1]
        return f"job condition {c.get('type')}: {c.get('reason')}: {c.get('message', '')}"

    # ------------------------------------------------------------------ logs

    def _stream_logs(self, pod: str, deadline: float, lines: list[str], prefix: str) -> None:
        """Print ``pod``'s log until its container has terminated, reconnecting as needed."""
        cursor = _LogCursor()
        inside_report = False
        delay = self.t.backoff_s
        while time.monotonic() < deadline:
            self._check_cancel()
            clean = False
            cursor.reconnect()
            try:
                resp: Any = self.core.read_namespaced_pod_log(
                    pod,
                    self.namespace,
                    container=CELL_CONTAINER,
                    follow=True,
                    timestamps=True,
                    _preload_content=False,
                    _request_timeout=(self.t.connect_s, self.t.log_idle_s),
                )
                try:
                    for stamp, text in _iter_log(resp):
                        self._check_cancel()
                        if not cursor.admit(stamp):
                            continue
                        lines.append(text)
                        if text.startswith("KUBEMATRIX-RESULTS-BEGIN"):
                            inside_report = True
                        if not inside_report:
                            self._say(prefix, text)
                        if text.startswith("KUBEMATRIX-RESULTS-END"):
                            inside_report = False
                    clean = True
                finally:
                    resp.release_conn()
            except ApiException as exc:
                if exc.status == 404:
                    return  # the pod is gone; the caller reads why
                if exc.status not in RETRYABLE and exc.status != 400:
                    raise  # 400: "container ... is waiting to start": retry below
                self._sleep(_retry_after(exc) or delay)
                delay = min(delay * 2, 10.0)
                continue
            except _NET_ERRORS:
                pass  # cut mid-stream or idle too long: check the pod, then read again
            state, _ = classify_pod(self._call(self.core.read_namespaced_pod, pod, self.namespace))
            if state in ("terminated", "evicted") and clean:
                return
            if state not in ("running", "terminated", "evicted"):
                return
            self._say(prefix, f"kubematrix: log stream of {pod} ended early; reconnecting")
        raise CellError(f"pod {pod}: gave up following the log (launcher deadline)")

    # ------------------------------------------------------------------ many cells

    def run_many(self, jobs: Sequence[dict], *, max_parallel: int = 4) -> list[CellResult]:
        """Run ``jobs`` concurrently, at most ``max_parallel`` at a time, in input order.

        On Ctrl-C every launched Job is deleted before KeyboardInterrupt propagates.
        """
        if max_parallel < 1:
            raise ValueError(f"run_many: max_parallel must be >= 1; got {max_parallel}")
        pool = ThreadPoolExecutor(max_workers=max_parallel, thread_name_prefix="kubematrix")
        futures = []
        try:
            futures = [pool.submit(self.run, job, prefix=f"[{_cell(job)}] ") for job in jobs]
            return [f.result() for f in futures]
        except KeyboardInterrupt:
            self.cancel.set()
            for f in futures:
                f.cancel()
            with self._lock:
                launched = sorted(self._launched)
            for name in launched:
                self.delete(name)
            raise
        finally:
            pool.shutdown(wait=True)


# ---------------------------------------------------------------------- pure helpers


def classify_pod(pod: dict) -> tuple[str, str]:
    """``(state, detail)`` of a pod dict from the API.

    States: ``evicted`` (a disruption; detail: why), ``terminated`` (detail: the exit code),
    ``image-error``/``config-error`` (detail: the kubelet's message), ``running``,
    ``unschedulable`` (detail: the scheduler's condition message), ``pending``.
    """
    status = pod.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    disruption = conditions.get("DisruptionTarget", {})
    if status.get("phase") == "Failed" and (
        disruption.get("status") == "True" or status.get("reason") == "Evicted"
    ):
        return "evicted", disruption.get("message") or status.get("message") or "evicted"
    for cs in status.get("containerStatuses") or []:
        if cs.get("name") != CELL_CONTAINER:
            continue
        state = cs.get("state") or {}
        if "terminated" in state:
            return "terminated", str(state["terminated"].get("exitCode"))
        waiting = state.get("waiting") or {}
        reason = waiting.get("reason", "")
        if reason in IMAGE_ERRORS:
            return "image-error", f"{reason}: {waiting.get('message', '')}".strip()
        if reason in CONFIG_ERRORS:
            return "config-error", f"{reason}: {waiting.get('message', '')}".strip()
        if "running" in state:
            return "running", ""
    scheduled = conditions.get("PodScheduled", {})
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        return "unschedulable", scheduled.get("message", "")
    return "pending", status.get("phase", "Pending")


def _iter_log(resp: Any) -> Iterator[tuple[str, str]]:
    """``(timestamp, text)`` per complete line of a ``timestamps=true`` log response.

    A line cut by a broken connection is never yielded (its bytes come again on reconnect).
    """
    buffer = b""
    for chunk in resp.stream(8192, decode_content=True):
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        for raw in complete:
            stamp, _, text = raw.decode("utf-8", "replace").partition(" ")
            yield stamp, text.rstrip("\r")
    if buffer:  # the stream ended cleanly without a final newline
        stamp, _, text = buffer.decode("utf-8", "replace").partition(" ")
        yield stamp, text.rstrip("\r")


def _retry_after(exc: ApiException) -> float | None:
    headers = exc.headers or {}
    value = headers.get("Retry-After") or headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _describe_api_error(exc: ApiException, namespace: str) -> str:
    try:
        message = json.loads(exc.body or "{}").get("message", "")
    except (ValueError, AttributeError):
        message = ""
    hint = {
        401: "the kubeconfig's credentials were rejected",
        403: f"forbidden: the launcher needs the Role in k8s/base/rbac.yaml in {namespace!r}",
        404: f"not found: does namespace {namespace!r} exist? (kubectl apply -k k8s/base)",
        422: "the API server rejected the Job as invalid",
    }.get(exc.status or 0, f"API error {exc.status} {exc.reason}")
    return f"{hint}: {message}" if message else hint


def _event_time(event: dict) -> str:
    return str(
        event.get("lastTimestamp")
        or event.get("eventTime")
        or event.get("metadata", {}).get("creationTimestamp")
        or ""
    )


def _env(job: dict, name: str) -> str | None:
    for container in job["spec"]["template"]["spec"]["containers"]:
        for item in container.get("env", []):
            if item["name"] == name:
                return item.get("value")
    return None


def _cell(job: dict) -> str:
    return job["metadata"].get("annotations", {}).get("portattn.dev/cell", job["metadata"]["name"])


_print_lock = threading.Lock()


def _print(line: str) -> None:
    with _print_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def run_cells(cells: Sequence[Any], results_dir: Path | str, **kwargs: Any) -> list[Any]:
    """Matrix cells as Jobs (see :func:`kubematrix.k8s.run_cells`); the matrix runner's hook."""
    from kubematrix.k8s import run_cells as _run_cells

    return _run_cells(cells, results_dir, **kwargs)
