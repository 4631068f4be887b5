"""Run rendered cell Jobs on a cluster: create -> watch -> stream logs -> results -> cleanup.

Uses the official ``kubernetes`` client and only what ``k8s/setup/rbac.yaml`` grants (jobs
create/get/list/watch/delete, pods get/list/watch, pods/log get, events list/watch).

* Names are deterministic (:func:`kubematrix.render.job_name`: the commit, the cell and a digest
  of the rendered Job), so a 409 on create means "this very Job (same cell, commit, image,
  arguments) already exists". The launcher reads that Job: one still running (or
  created by this launcher run, whose create response was lost) is attached to; one being
  deleted is waited for; one that finished and is not this run's is deleted. In the last two
  cases a fresh Job is created, so a stale Job's result is never reported as this run's. Each
  launcher run marks its Jobs with the annotation ``portattn.dev/launcher-run``.
* The pod is watched with a server-side ``timeout_seconds`` and a client-side
  ``_request_timeout``; a 410 (history compacted) or a dropped stream resumes by listing again.
* Logs are followed with ``timestamps=true``; after a cut connection, or no output for
  ``log_idle_s``, the launcher checks the pod, reads the log again and skips what it already
  printed, matched line by line (timestamp and text), never by comparing clocks: a node whose
  clock steps back loses no line. Reconnects that bring no new line back off, and after
  ``log_reconnects`` of them in a row the cell is an error saying so.
* A Job or pod deleted by someone else is reported as such at once, whether its pod was
  pending or running; a container killed for memory is reported as ``OOMKilled``.
* A cell that printed no JUnit report never passes: exit 0 without one is an error.
* An answer that is not JSON (a login page of a proxy in front of the API server) is an error
  naming what answered; it is never taken as a success, of a create or of a delete.
* It fails fast on image-pull errors and on pods still pending after ``pending_s``, quoting the
  scheduler's event (``0/4 nodes are available: 4 Insufficient amd.com/gpu.``).
* An evicted pod is not a test failure (the Job's pod failure policy ignores disruptions): the
  launcher follows the replacement pod.
* The JUnit report and the compile cache's counters come back inside the log (see
  :mod:`kubematrix.cell`).
* 429, 5xx and dropped connections are retried ``retries`` times with backoff, waiting what
  ``Retry-After`` asks (capped at ``retry_after_max_s``); 403/404/422 are not retried. The sleep
  is injectable (``Launcher(sleep=...)``).
* The Job is deleted with ``propagationPolicy=Foreground`` (its pods go with it) on every exit:
  success, failure, timeout, an infrastructure error and Ctrl-C; a Job whose create surely did
  not happen (refused by the server, or never sent) is not. Cleanup is best effort per
  Job: a delete that still fails after its retries (or a 403) is logged with the Job's name and
  the ``kubectl`` command that removes it, kept in :attr:`Launcher.leftovers`, and never
  replaces the cell's result or the KeyboardInterrupt. A second Ctrl-C during cleanup stops it,
  reports every Job not yet deleted the same way, and propagates.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from kubematrix.cachestats import CacheStats
from kubematrix.cell import BEGIN, CACHE, END, decode_cache, decode_results
from kubematrix.render import CELL_CONTAINER

RETRYABLE = frozenset({429, 500, 502, 503, 504})
IMAGE_ERRORS = frozenset(
    {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}
)
CONFIG_ERRORS = frozenset(
    {"CreateContainerConfigError", "CreateContainerError", "RunContainerError"}
)
#: Job conditions after which its outcome is decided (its pods may still be terminating).
FINISHED_CONDITIONS = frozenset({"Complete", "Failed", "FailureTarget", "SuccessCriteriaMet"})
#: The annotation that marks a Job as created by one launcher run (:attr:`Launcher.run_id`).
RUN_ANNOTATION = "portattn.dev/launcher-run"
#: Error answers after which a create may still have been carried out (a gateway timed out).
_MAYBE_PROCESSED = frozenset({500, 502, 504})
_NET_ERRORS = (urllib3.exceptions.ProtocolError, urllib3.exceptions.TimeoutError)
_NET_ERRORS_RETRY = (*_NET_ERRORS, urllib3.exceptions.MaxRetryError)
#: Bytes read from a log response at a time.
_LOG_CHUNK = 65536


@dataclass(frozen=True)
class Timeouts:
    """Every wait of the launcher, in seconds (tests shrink them).

    Attributes:
        pending_s: a pod not running after this long fails the cell (unschedulable, pulls); also
            how long a stale Job of the same name may take to disappear.
        watch_s: server-side ``timeout_seconds`` of each watch request.
        request_s: client-side read timeout of plain requests (watches get ``watch_s`` + 5).
        log_idle_s: client-side read timeout of the log stream; on expiry the pod is checked.
        overall_s: give up on the cell after this long; ``None``: the Job's deadline + 60.
        retries: attempts after the first for 429/5xx/connection errors.
        backoff_s: first retry delay (doubled each time, capped at ``max_backoff_s``).
        connect_s: connect timeout of every request.
        max_backoff_s: the longest backoff between two attempts.
        retry_after_max_s: the longest ``Retry-After`` the launcher waits; a longer one is cut
            to this.
        log_reconnects: log connections in a row that end (cut, or closed while the pod runs)
            without a new line before the cell is an error; they back off like retries.
    """

    pending_s: float = 600.0
    watch_s: int = 60
    request_s: float = 30.0
    log_idle_s: float = 300.0
    overall_s: float | None = None
    retries: int = 5
    backoff_s: float = 0.5
    connect_s: float = 10.0
    max_backoff_s: float = 10.0
    retry_after_max_s: float = 60.0
    log_reconnects: int = 10


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
        cache: the Triton compile cache's counters the cell printed, if any.
        attached: the Job already existed (409) and the launcher followed it.
        evictions: pods lost to disruptions and replaced by the Job.
        cleanup: ``None`` when the Job was deleted; otherwise why it was not, and the
            ``kubectl`` command that removes it. It does not change ``outcome``.
        termination: the kubelet's reason for the test container's end (``OOMKilled``), if
            it gave one.
    """

    name: str
    outcome: str
    exit_code: int | None
    message: str
    junit: bytes | None = None
    cache: CacheStats | None = None
    attached: bool = False
    evictions: list[str] = field(default_factory=list)
    cleanup: str | None = None
    termination: str = ""


class CellError(Exception):
    """An infrastructure failure of one cell (the message is shown to the user)."""


class RetriesExhausted(CellError):
    """429/5xx or connection errors on every attempt of one request."""


class DeadlinePassed(CellError):
    """The launcher's overall deadline for the cell passed (the message says where)."""


class NotJson(CellError):
    """A 2xx answer whose body is not JSON (a proxy's login page, say)."""


class JobDeleted(CellError):
    """The cell's Job was deleted by someone other than this launcher."""


class Cancelled(Exception):
    """The run was cancelled (Ctrl-C in a fan-out)."""


class _LogCursor:
    """What has been printed of one pod's log: a fingerprint of each line, in order.

    Every connection reads the log from its start. :meth:`admit` matches the lines of a new
    connection against those printed, one by one (timestamp and text together), and admits only
    what comes after them; no clock is compared, so a timestamp that goes back is just a line.
    A connection whose first line is not the first printed (the kubelet rotated the log while
    the launcher was away) is aligned where that line was printed. When a connection does not
    match what was printed (rotated past it), its lines are admitted from there and
    :attr:`gaps` counts it: lines may be missing in between.
    """

    def __init__(self) -> None:
        self._seen: list[int] = []
        self._first: dict[int, int] = {}  # fingerprint -> its first position in _seen
        self._pos: int | None = 0  # where the next line should match; None: not aligned yet
        self.gaps = 0

    def reconnect(self) -> None:
        self._pos = 0 if not self._seen else None

    @property
    def printed(self) -> int:
        return len(self._seen)

    def admit(self, stamp: str, text: str) -> bool:
        key = hash((stamp, text))
        if self._pos is None:  # the first line of a connection: find where it starts
            start = self._first.get(key)
            if start is None:
                self.gaps += 1
                self._pos = len(self._seen)
            else:
                self._pos = start
        if self._pos < len(self._seen):
            if self._seen[self._pos] == key:
                self._pos += 1
                return False
            self.gaps += 1  # it differs from what was printed here: new from now on
        self._first.setdefault(key, len(self._seen))
        self._seen.append(key)
        self._pos = len(self._seen)
        return True


class _Backoff:
    """Delays between the attempts of one request: ``retries`` of them, then ``None``.

    Each delay is the exponential backoff, or the server's ``Retry-After`` when it gives one
    (> 0, capped at ``retry_after_max_s``).
    """

    def __init__(self, t: Timeouts) -> None:
        self.t = t
        self.failures = 0
        self._delay = t.backoff_s

    @property
    def attempts(self) -> int:
        return self.failures

    def reset(self) -> None:
        self.failures = 0
        self._delay = self.t.backoff_s

    def next_delay(self, exc: BaseException) -> float | None:
        """Seconds to wait before the next attempt after ``exc``; ``None``: retries ran out."""
        self.failures += 1
        if self.failures > self.t.retries:
            return None
        wait = self._delay
        asked = _retry_after(exc) if isinstance(exc, ApiException) else None
        if asked is not None and asked > 0:
            wait = min(asked, self.t.retry_after_max_s)
        self._delay = min(self._delay * 2, self.t.max_backoff_s)
        return wait


def _gave_up(what: str, exc: BaseException, attempts: int, namespace: str) -> RetriesExhausted:
    if isinstance(exc, ApiException):
        why = _describe_api_error(exc, namespace)
    else:
        why = f"the API server is unreachable ({exc})"
    return RetriesExhausted(f"{what}: {why}; gave up after {attempts} attempts")


class Launcher:
    """Runs cell Jobs in one namespace.

    Args:
        api: a configured ``kubernetes.client.ApiClient``.
        namespace: where Jobs are created.
        timeouts: every wait (see :class:`Timeouts`).
        emit: receives each output line (log lines prefixed by the cell when fanning out).
        results_dir: where each cell's JUnit report is written as ``<job name>.xml``.
        sleep: waits between retries and polls (default: :func:`time.sleep`, or a wait that a
            cancelled fan-out cuts short); tests pass a function that records the delays.
        run_id: marks the Jobs this launcher creates (annotation ``portattn.dev/launcher-run``);
            a random one by default.

    Attributes:
        leftovers: Jobs whose deletion failed or was interrupted -> why, with the ``kubectl``
            command that removes them.
    """

    def __init__(
        self,
        api: client.ApiClient,
        namespace: str,
        *,
        timeouts: Timeouts | None = None,
        emit: Callable[[str], None] | None = None,
        results_dir: Path | None = None,
        sleep: Callable[[float], object] | None = None,
        run_id: str | None = None,
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.t = timeouts or Timeouts()
        self.core = client.CoreV1Api(api)
        self.batch = client.BatchV1Api(api)
        self._emit = emit or _print
        self.results_dir = results_dir
        self.run_id = run_id or uuid.uuid4().hex[:16]
        self.cancel = threading.Event()
        self._sleep_fn = sleep
        self._hurry = threading.Event()  # a second Ctrl-C: no more retries in cleanup
        self._lock = threading.Lock()
        self._launched: set[str] = set()  # created (or attached) and not yet deleted
        self._deleting: set[str] = set()
        self._streams: set[Any] = set()  # open log and watch responses (see _abort_streams)
        self.leftovers: dict[str, str] = {}

    # ------------------------------------------------------------------ plumbing

    def _say(self, prefix: str, line: str) -> None:
        self._emit(f"{prefix}{line}")

    def _check_cancel(self) -> None:
        if self.cancel.is_set():
            raise Cancelled("cancelled")

    def _sleep(self, seconds: float) -> None:
        """Wait during a run; a cancel (fan-out Ctrl-C) ends the wait with :class:`Cancelled`."""
        self._check_cancel()
        if self._sleep_fn is None:
            self.cancel.wait(seconds)
        else:
            self._sleep_fn(seconds)
        self._check_cancel()

    def _pause(self, seconds: float) -> None:
        """Wait during cleanup (not cut short by a cancel: the cancel is why we clean up)."""
        (self._sleep_fn or time.sleep)(seconds)

    def _abort_streams(self) -> None:
        """Unblock every worker reading a log or a watch (on cancel): shut the sockets down.

        Called after :attr:`cancel` is set; a response opened after this snapshot is caught
        by :meth:`_track`, which checks the cancel after registering it.
        """
        with self._lock:
            streams = list(self._streams)
        for resp in streams:
            # Already released or closed (or an older urllib3): nothing to wake.
            with contextlib.suppress(AttributeError, ValueError, RuntimeError, OSError):
                resp.shutdown()  # urllib3 >= 2.3: wakes a read blocked in another thread

    def _track(self, resp: Any) -> None:
        """Register an open streaming response for :meth:`_abort_streams`, then check the cancel.

        Registering first closes the race with a Ctrl-C that arrives while the request is in
        flight: either the abort's snapshot sees the response, or the cancel was set before
        the registration and is seen here (raises :class:`Cancelled`; the caller's
        :meth:`_release` closes the response). A Ctrl-C while the request still waits for its
        response headers has no response to shut down yet: that wait runs its course (at most
        the request's read timeout), then this check ends the worker.
        """
        with self._lock:
            self._streams.add(resp)
        self._check_cancel()

    def _tracked(self, fn: Callable[..., Any], opened: list[Any]) -> Callable[..., Any]:
        """``fn`` (a streaming API call) whose responses are appended to ``opened`` and
        :meth:`_track`-ed as soon as they open; its doc string is kept (the Watch reads it)."""

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            resp = fn(*args, **kwargs)
            opened.append(resp)
            self._track(resp)
            return resp

        return call

    def _release(self, resp: Any, read_to_end: bool) -> None:
        """Unregister a streaming response and give its connection back. One not read to its end
        is closed first: its server is still streaming on that connection (HTTP keep-alive),
        and a request reusing it from the pool (the cleanup's DELETE, say) would wait out its
        read timeout."""
        with self._lock:
            self._streams.discard(resp)
        if not read_to_end:
            with contextlib.suppress(AttributeError, ValueError, RuntimeError, OSError):
                resp.close()
        resp.release_conn()

    def check_access(self) -> None:
        """One request before anything is created: list the namespace's Jobs (at most one).

        It proves that the API server answers (in JSON), the credentials are accepted and the
        Role lets the launcher read Jobs in :attr:`namespace`.

        Raises:
            CellError: why the cluster cannot be used (unreachable, 401, 403, not JSON, ...).
        """
        try:
            self._call(self.batch.list_namespaced_job, self.namespace, limit=1)
        except ApiException as exc:
            raise CellError(_describe_api_error(exc, self.namespace)) from exc

    def kubectl_delete(self, name: str) -> str:
        """The command that removes Job ``name`` and its pods by hand."""
        return f"kubectl -n {self.namespace} delete job {name} --cascade=foreground"

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn`` with retries on 429/5xx and dropped connections; JSON-decoded response.

        Raises:
            ApiException: a status that is not retried (403, 404, 409, 422, ...).
            RetriesExhausted: the retries ran out.
            NotJson: the answer is not JSON (not retried: a proxy's page does not change).
        """
        kwargs.setdefault("_request_timeout", (self.t.connect_s, self.t.request_s))
        kwargs["_preload_content"] = False
        backoff = _Backoff(self.t)
        while True:
            self._check_cancel()
            try:
                resp = fn(*args, **kwargs)
                return _json_body(resp, _what(fn))
            except ApiException as exc:
                if exc.status not in RETRYABLE:
                    raise
                self._wait_or_give_up(backoff, exc, _what(fn))
            except _NET_ERRORS_RETRY as exc:
                self._wait_or_give_up(backoff, exc, _what(fn))

    def _wait_or_give_up(self, backoff: _Backoff, exc: BaseException, what: str) -> None:
        """Sleep the backoff's next delay before a retry of ``what``, or raise RetriesExhausted."""
        wait = backoff.next_delay(exc)
        if wait is None:
            raise _gave_up(what, exc, backoff.attempts, self.namespace) from exc
        self._sleep(wait)

    # ------------------------------------------------------------------ one cell

    def run(self, job: dict, *, prefix: str = "") -> CellResult:
        """Create ``job`` (or attach to it), follow it to the end, delete it, return the result.

        The result is the cell's own outcome even when deleting the Job fails (that is logged
        and kept in ``result.cleanup`` and :attr:`leftovers`).

        Raises:
            KeyboardInterrupt: after trying to delete the Job, when the user pressed Ctrl-C.
        """
        name = job["metadata"]["name"]
        token = _env(job, "KUBEMATRIX_RESULTS_TOKEN") or "manual"
        budget = (
            self.t.overall_s
            if self.t.overall_s is not None
            else job["spec"].get("activeDeadlineSeconds", 3600) + 60
        )
        deadline = time.monotonic() + budget
        attached = False
        try:
            attached = self._create(job, prefix)
            result = self._follow(name, token, deadline, prefix)
        except DeadlinePassed as exc:
            result = CellResult(name, "error", None, f"launcher deadline ({budget:g} s): {exc}")
        except CellError as exc:
            result = CellResult(name, "error", None, str(exc))
        except ApiException as exc:
            result = CellResult(name, "error", None, _describe_api_error(exc, self.namespace))
        except Cancelled:
            result = CellResult(name, "error", None, "cancelled")
        except Exception as exc:  # a launcher bug must not cost the other cells or the cleanup
            what = f"{type(exc).__name__}: {exc}"
            result = CellResult(name, "error", None, f"the launcher failed unexpectedly ({what})")
        finally:
            with self._lock:
                created = name in self._launched
            if created:  # not when the create surely did not happen: there is nothing to delete
                self.delete(name, prefix)
        result.attached = attached
        with self._lock:
            result.cleanup = self.leftovers.get(name)
        if result.junit is not None and self.results_dir is not None:
            self.results_dir.mkdir(parents=True, exist_ok=True)
            (self.results_dir / f"{name}.xml").write_bytes(result.junit)
        self._say(prefix, f"kubematrix: {name}: {result.outcome}: {result.message}")
        return result

    def _create(self, job: dict, prefix: str) -> bool:
        """Create the Job; on 409 attach to it or replace a stale one. True: attached."""
        name = job["metadata"]["name"]
        manifest = copy.deepcopy(job)
        manifest["metadata"].setdefault("annotations", {})[RUN_ANNOTATION] = self.run_id
        body = client.V1Job.from_dict(manifest)
        with self._lock:
            self._launched.add(name)  # from now until proven otherwise, it may exist
        reached: list[bool] = []  # one entry per attempt that may have created the Job

        @functools.wraps(self.batch.create_namespaced_job)
        def create(*args: Any, **kwargs: Any) -> Any:
            try:
                return self.batch.create_namespaced_job(*args, **kwargs)
            except ApiException as exc:
                if exc.status in _MAYBE_PROCESSED:
                    reached.append(True)
                raise
            except BaseException as exc:
                if not _never_sent(exc):
                    reached.append(True)
                raise

        for attempt in range(3):  # a stale Job replaced, or one that vanished between 409 and read
            try:
                self._call(create, self.namespace, body)
            except ApiException as exc:
                if exc.status != 409:
                    self._forget_if_never_created(name, attempt, reached)
                    raise
            except RetriesExhausted:
                self._forget_if_never_created(name, attempt, reached)
                raise
            else:
                self._say(prefix, f"kubematrix: created job {self.namespace}/{name}")
                return False
            existing = self._read_job(name)
            if existing is None:
                continue  # deleted since the 409: create it again
            meta = existing.get("metadata") or {}
            deleting = meta.get("deletionTimestamp")
            ours = (meta.get("annotations") or {}).get(RUN_ANNOTATION) == self.run_id
            finished = _finished(existing)
            if deleting:
                self._say(
                    prefix,
                    f"kubematrix: job {name} already exists but is being deleted (since "
                    f"{deleting}); waiting for it to go, then creating a fresh one",
                )
                self._wait_gone(name, f"is still being deleted (since {deleting})")
                continue
            if ours:  # our create went through but its response was lost
                self._say(prefix, f"kubematrix: job {name} was created by this run; following it")
                return False
            if finished is not None:
                run = (meta.get("annotations") or {}).get(RUN_ANNOTATION, "none")
                self._say(
                    prefix,
                    f"kubematrix: job {name} already exists and finished ({finished}) in "
                    f"another run (launcher run {run}); deleting it and creating a fresh one",
                )
                self._delete_stale(name)
                continue
            self._say(prefix, f"kubematrix: job {name} already exists; attaching to it")
            return True
        raise CellError(
            f"job {name} keeps reappearing after being replaced; is another launcher creating "
            f"it? Check with: kubectl -n {self.namespace} get job {name} -o yaml"
        )

    def _forget_if_never_created(self, name: str, attempt: int, reached: list[bool]) -> None:
        """The first create of ``name`` failed: when no attempt can have reached the API server
        (refused, or never sent), there is no Job to delete and none to report as left."""
        if attempt == 0 and not reached:
            with self._lock:
                self._launched.discard(name)

    def _read_job(self, name: str) -> dict | None:
        try:
            job: dict = self._call(self.batch.read_namespaced_job, name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return job

    def _delete_stale(self, name: str) -> None:
        """Delete a finished Job of another run and wait until it is gone."""
        try:
            self._call(
                self.batch.delete_namespaced_job,
                name,
                self.namespace,
                propagation_policy="Foreground",
            )
        except ApiException as exc:
            if exc.status != 404:
                raise CellError(
                    f"job {name} is a finished Job of another run and could not be deleted "
                    f"({_describe_api_error(exc, self.namespace)}); remove it with: "
                    f"{self.kubectl_delete(name)}"
                ) from exc
        self._wait_gone(name, "is still being deleted")

    def _wait_gone(self, name: str, what: str) -> None:
        """Poll until Job ``name`` is gone, at most ``pending_s``."""
        end = time.monotonic() + self.t.pending_s
        delay = self.t.backoff_s
        while self._read_job(name) is not None:
            if time.monotonic() >= end:
                raise CellError(
                    f"job {name} {what} after {self.t.pending_s:g} s; a finalizer may hold it: "
                    f"kubectl -n {self.namespace} get job {name} -o yaml"
                )
            self._sleep(delay)
            delay = min(delay * 2, self.t.max_backoff_s)

    def delete(self, name: str, prefix: str = "") -> bool:
        """Delete the Job and, through foreground propagation, its pods; best effort.

        429/5xx and dropped connections are retried (``Retry-After`` honoured); 404 means it is
        already gone. A Job that still could not be deleted (retries ran out, 403, ...) is
        logged with the ``kubectl`` command that removes it and kept in :attr:`leftovers`; no
        API error escapes. A KeyboardInterrupt during the delete is reported the same way and
        re-raised.

        Returns:
            True when the Job is gone; False when it was left behind, or when another thread
            is deleting it right now (that thread reports it).
        """
        with self._lock:
            if name in self._deleting:
                return False
            self._deleting.add(name)
        try:
            problem = self._try_delete(name, prefix)
        except KeyboardInterrupt:
            self._left_behind(name, "interrupted while deleting it", prefix)
            raise
        finally:
            with self._lock:
                self._deleting.discard(name)
        if problem is not None:
            self._left_behind(name, problem, prefix)
            return False
        with self._lock:
            self._launched.discard(name)
            self.leftovers.pop(name, None)
        return True

    def _try_delete(self, name: str, prefix: str) -> str | None:
        """One delete with retries; None when the Job is gone, else why it is not."""
        backoff = _Backoff(self.t)
        while True:
            # Not self._call: cleanup must run even after a cancel.
            try:
                resp = self.batch.delete_namespaced_job(
                    name,
                    self.namespace,
                    propagation_policy="Foreground",
                    _request_timeout=(self.t.connect_s, self.t.request_s),
                    _preload_content=False,
                )
                try:
                    _json_body(resp, "delete")  # a proxy's page is not a deletion
                except NotJson as exc:
                    return f"{exc}; the Job may still exist"
                self._say(prefix, f"kubematrix: deleted job {name} (foreground propagation)")
                return None
            except ApiException as exc:
                if exc.status == 404:
                    return None
                if exc.status not in RETRYABLE:
                    return _describe_api_error(exc, self.namespace)
                wait = backoff.next_delay(exc)
                error: BaseException = exc
            except _NET_ERRORS_RETRY as exc:
                wait = backoff.next_delay(exc)
                error = exc
            if wait is None or self._hurry.is_set():
                return str(_gave_up("delete", error, backoff.attempts, self.namespace))
            self._pause(wait)

    def _left_behind(self, name: str, why: str, prefix: str = "") -> None:
        note = f"{why}; remove it with: {self.kubectl_delete(name)}"
        with self._lock:
            self.leftovers[name] = note
        self._say(prefix, f"kubematrix: WARNING: job {name} was not deleted: {note}")

    def _follow(self, name: str, token: str, deadline: float, prefix: str) -> CellResult:
        evicted: list[str] = []
        replaced: list[str] = []  # pods deleted by someone else while their Job lived on
        while True:
            pod = self._wait_for_pod(name, deadline, {*evicted, *replaced}, prefix)
            pod_name = pod["metadata"]["name"]
            # Only this pod's log judges it: a replaced pod's partial report is not its result.
            lines: list[str] = []
            self._stream_logs(pod_name, deadline, lines, prefix, token)
            current = self._read_pod(pod_name)
            gone = current is None or bool(current["metadata"].get("deletionTimestamp"))
            finished = (
                current is not None
                and classify_pod(current)[0] == "terminated"
                and decode_results(lines, token)[0] is not None
            )
            if gone and not finished:  # deleted before it finished: by whom, and what now?
                self._check_job_alive(name, f"its pod {pod_name} was running")
            if current is None:
                self._say(
                    prefix,
                    f"kubematrix: pod {pod_name} was deleted (not by this launcher); "
                    "following the Job's next pod",
                )
                replaced.append(pod_name)
                continue
            state, detail = classify_pod(current)
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
            why = _termination_reason(current)
            message = f"exit code {code}" + (f" ({why})" if why else "")
            if junit is None:
                message += "; no JUnit report in the log"
                # Whatever the exit code says, the tests' results were not seen: never a pass.
                outcome = "error" if code == 0 else "failed"
            else:
                outcome = "passed" if code == 0 else "failed"
            cache = decode_cache(lines, token)
            return CellResult(
                name, outcome, code, message, junit, cache, evictions=evicted, termination=why
            )

    def _read_pod(self, pod_name: str) -> dict | None:
        """The pod, or ``None`` when it no longer exists."""
        try:
            pod: dict = self._call(self.core.read_namespaced_pod, pod_name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return pod

    def _check_job_alive(self, name: str, when: str) -> dict:
        """The Job, when it still exists and is not being deleted.

        Raises:
            JobDeleted: someone else deleted it (this launcher deletes only after following).
            Cancelled: this run is being cancelled (its cleanup deletes the Jobs).
        """
        job = self._read_job(name)
        self._check_cancel()
        with self._lock:
            ours = name in self._deleting or name not in self._launched
        if ours:
            raise Cancelled("cancelled")
        if job is None:
            raise JobDeleted(
                f"job {name} was deleted by someone else (not this launcher) while {when}; "
                "its result is lost"
            )
        deleting = (job.get("metadata") or {}).get("deletionTimestamp")
        if deleting:
            raise JobDeleted(
                f"job {name} is being deleted by someone else (not this launcher, since "
                f"{deleting}) while {when}; its result is lost"
            )
        return job

    # ------------------------------------------------------------------ watching the pod

    def _wait_for_pod(self, name: str, deadline: float, skip: set[str], prefix: str) -> dict:
        """Watch the Job's pods until one (not in ``skip``) runs or has terminated.

        A pod deleted meanwhile makes the launcher read the Job: gone (or going) is reported
        at once; one that failed is reported with its condition; otherwise the watch goes on
        for the Job's next pod. The Job is also read every ``watch_s`` while no pod shows up.
        """
        start = last_check = time.monotonic()
        waiting: dict[str, tuple[float, str, str]] = {}  # pod -> (first seen, state, detail)
        for kind, pod in self._watch_pods(name, deadline):
            now = time.monotonic()
            if now >= deadline:
                break
            if kind == "DELETED" and pod is not None:
                pod_name = pod["metadata"]["name"]
                before = waiting.pop(pod_name, (now, "pending", ""))[1]
                if pod_name not in skip:
                    job = self._check_job_alive(name, f"its pod {pod_name} was {before}")
                    finished = _finished(job)
                    if finished is not None:
                        raise CellError(
                            f"pod {pod_name} was deleted (not by this launcher) and job {name} "
                            f"ended: {_condition_text(job)}"
                        )
                    last_check = now
            elif pod is not None and pod["metadata"]["name"] not in skip:
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
            elif pod is None and not waiting and now - last_check >= self.t.watch_s:
                last_check = now
                self._check_job_alive(name, "no pod of it had started")
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
        states = ", ".join(f"{p} {s}" for p, (_, s, _) in waiting.items()) or "no pod yet"
        raise DeadlinePassed(f"job {name} still had no running pod ({states})")

    def _watch_pods(self, name: str, deadline: float) -> Iterator[tuple[str, dict | None]]:
        """Every observed state of the Job's pods as ``(event type, pod)``: ``ADDED``,
        ``MODIFIED`` (a listed pod is ``ADDED``), ``DELETED``; ``("TICK", None)`` at least
        every ``watch_s``.

        Lists, then watches from the list's resourceVersion; on 410 Gone or a broken stream it
        lists again (nothing is missed: the list carries the current state). A 429/5xx on the
        watch request is retried like any request (``RetriesExhausted`` when they run out).
        Events are deserialized by the client (its ``deserialize=False`` path cannot handle an
        in-stream ERROR event in kubernetes 37.0.2); the launcher reads their ``raw_object``.
        """
        selector = f"batch.kubernetes.io/job-name={name}"
        rv: str | None = None
        backoff = _Backoff(self.t)
        while time.monotonic() < deadline:
            self._check_cancel()
            if rv is None:
                listing = self._call(
                    self.core.list_namespaced_pod, self.namespace, label_selector=selector
                )
                rv = listing["metadata"]["resourceVersion"]
                for item in listing["items"]:
                    yield "ADDED", item
                yield "TICK", None
            remaining = deadline - time.monotonic()
            server_timeout = max(1, int(min(self.t.watch_s, remaining, self.t.pending_s)))
            # The client stops reading at the deadline even when the server would go on.
            read_timeout = min(server_timeout + 5, max(remaining, 0.05))
            w = watch.Watch()
            opened: list[Any] = []
            try:
                for event in w.stream(
                    self._tracked(self.core.list_namespaced_pod, opened),
                    self.namespace,
                    label_selector=selector,
                    resource_version=rv,
                    allow_watch_bookmarks=True,
                    timeout_seconds=server_timeout,
                    _request_timeout=(self.t.connect_s, read_timeout),
                ):
                    self._check_cancel()
                    backoff.reset()
                    rv = w.resource_version or rv
                    if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        yield event["type"], event["raw_object"]  # the API's JSON, as lists
                backoff.reset()  # the server ended the watch at its timeout: all is well
            except ApiException as exc:
                if exc.status == 410:
                    rv = None  # history compacted: list again
                elif exc.status in RETRYABLE:
                    wait = backoff.next_delay(exc)
                    if wait is None:
                        what = f"watching the pods of job {name}"
                        raise _gave_up(what, exc, backoff.attempts, self.namespace) from exc
                    self._sleep(wait)
                else:
                    raise
            except _NET_ERRORS:
                rv = None  # dropped without a 410: list again (the list retries its own errors)
            except json.JSONDecodeError as exc:  # the client could not decode an event
                raise NotJson(
                    f"watching the pods of job {name}: an event is not JSON ({exc}); is a proxy "
                    "in front of the API server?"
                ) from None
            finally:
                for resp in opened:
                    # (the Watch closes a response it read to its end: closing again is a no-op)
                    self._release(resp, read_to_end=False)
                w.stop()
            yield "TICK", None

    def _scheduler_event(self, pod_name: str) -> str:
        """The newest warning event about ``pod_name`` (FailedScheduling first), or ''."""
        try:
            events = self._call(
                self.core.list_namespaced_event,
                self.namespace,
                field_selector=f"involvedObject.kind=Pod,involvedObject.name={pod_name}",
            )
        except (ApiException, RetriesExhausted):
            return ""
        warnings = [e for e in events.get("items", []) if e.get("type") == "Warning"]
        warnings.sort(key=lambda e: (e.get("reason") == "FailedScheduling", _event_time(e)))
        if not warnings:
            return ""
        event = warnings[-1]
        return f"{event.get('reason')}: {event.get('message', '').strip()}"

    def _job_condition(self, name: str) -> str:
        return _condition_text(self._check_job_alive(name, "no pod of it had started"))

    # ------------------------------------------------------------------ logs

    def _stream_logs(
        self, pod: str, deadline: float, lines: list[str], prefix: str, token: str
    ) -> None:
        """Print ``pod``'s log until its container has terminated, reconnecting as needed.

        The cell's report (the block marked with ``token``) is kept in ``lines``, not printed;
        a test's output that looks like a marker is printed like any other line.

        The read timeout is ``log_idle_s``: a log silent that long is not an error, the pod
        is checked and the log read again. 429/5xx (and a 400 "container is waiting to
        start") are retried ``retries`` times in a row, then raise :class:`RetriesExhausted`.
        A connection that ends (cut, or closed while the pod runs) without a new line is
        followed by a backoff; ``log_reconnects`` of them in a row raise :class:`CellError`.
        Returns early when the pod is gone (the caller finds out why).
        """
        cursor = _LogCursor()
        inside_report = False
        backoff = _Backoff(self.t)
        fruitless = 0  # connections in a row that ended without a new line
        delay = self.t.backoff_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlinePassed(f"pod {pod} was still running (its log was followed)")
            self._check_cancel()
            clean = idle = False
            cursor.reconnect()
            printed, gaps = cursor.printed, cursor.gaps
            try:
                resp: Any = self.core.read_namespaced_pod_log(
                    pod,
                    self.namespace,
                    container=CELL_CONTAINER,
                    follow=True,
                    timestamps=True,
                    _preload_content=False,
                    _request_timeout=(self.t.connect_s, min(self.t.log_idle_s, remaining)),
                )
                backoff.reset()
                try:
                    self._track(resp)
                    for stamp, text in _iter_log(resp):
                        self._check_cancel()
                        if time.monotonic() >= deadline:
                            raise DeadlinePassed(f"pod {pod} was still writing its log")
                        if not cursor.admit(stamp, text):
                            continue
                        if cursor.gaps != gaps:
                            gaps = cursor.gaps
                            self._say(
                                prefix,
                                f"kubematrix: the log of {pod} read again does not continue "
                                "what was printed (rotated by the kubelet?); lines may be "
                                "missing before this one",
                            )
                        lines.append(text)
                        if text == f"{BEGIN} {token}":
                            inside_report = True
                        if not inside_report and not text.startswith(f"{CACHE} {token} "):
                            self._say(prefix, text)
                        if inside_report and text.startswith(f"{END} {token} "):
                            inside_report = False
                    clean = True
                finally:
                    self._release(resp, read_to_end=clean)
            except ApiException as exc:
                if exc.status == 404:
                    return  # the pod is gone; the caller reads why
                if exc.status not in RETRYABLE and exc.status != 400:
                    raise  # 400: "container ... is waiting to start": retry below
                self._wait_or_give_up(backoff, exc, f"reading the log of pod {pod}")
                continue
            except urllib3.exceptions.ReadTimeoutError:
                idle = True  # no output for log_idle_s: check the pod, then read again
            except _NET_ERRORS:
                pass  # cut mid-stream: check the pod, then read again
            except urllib3.exceptions.MaxRetryError as exc:
                self._wait_or_give_up(backoff, exc, f"reading the log of pod {pod}")
                continue
            current = self._read_pod(pod)
            if current is None:
                return  # the pod is gone; the caller reads why
            state, _ = classify_pod(current)
            if state in ("terminated", "evicted") and clean:
                return
            if state not in ("running", "terminated", "evicted"):
                return
            if time.monotonic() >= deadline:
                continue  # raises DeadlinePassed above
            if idle:
                self._say(
                    prefix,
                    f"kubematrix: no log output from {pod} for {self.t.log_idle_s:g} s "
                    f"(pod {state}); reading the log again",
                )
                continue
            if cursor.printed > printed:
                fruitless, delay = 0, self.t.backoff_s  # it made progress: reconnect at once
                self._say(prefix, f"kubematrix: log stream of {pod} ended early; reconnecting")
                continue
            fruitless += 1
            if fruitless >= self.t.log_reconnects:
                raise CellError(
                    f"the log stream of pod {pod} ended {fruitless} times in a row without a "
                    f"new line (pod {state}); giving up: is a proxy cutting long requests?"
                )
            self._say(
                prefix,
                f"kubematrix: log stream of {pod} ended early without a new line "
                f"({fruitless} in a row); reconnecting in {delay:g} s",
            )
            self._sleep(delay)
            delay = min(delay * 2, self.t.max_backoff_s)

    # ------------------------------------------------------------------ many cells

    def run_many(self, jobs: Sequence[dict], *, max_parallel: int = 4) -> list[CellResult]:
        """Run ``jobs`` concurrently, at most ``max_parallel`` at a time, in input order.

        Each cell deletes its own Job (best effort, see :meth:`delete`). On Ctrl-C the workers
        are cancelled (their open log and watch streams shut down, so none waits out a read
        timeout) and every launched Job's deletion is attempted, one failure not stopping the
        others, before KeyboardInterrupt propagates. A second Ctrl-C stops the cleanup,
        logs each Job not yet deleted with its ``kubectl`` command (also in :attr:`leftovers`)
        and propagates.
        """
        if max_parallel < 1:
            raise ValueError(f"run_many: max_parallel must be >= 1; got {max_parallel}")
        pool = ThreadPoolExecutor(max_workers=max_parallel, thread_name_prefix="kubematrix")
        futures = []
        wait = True
        try:
            futures = [pool.submit(self.run, job, prefix=f"[{_cell(job)}] ") for job in jobs]
            return [f.result() for f in futures]
        except KeyboardInterrupt:
            self.cancel.set()
            self._abort_streams()
            for f in futures:
                f.cancel()
            try:
                self._delete_launched()
                pool.shutdown(wait=True)  # the cancelled workers delete their own Jobs too
            except KeyboardInterrupt:
                wait = False
                self._abandon_cleanup()
            raise
        finally:
            pool.shutdown(wait=wait, cancel_futures=True)

    def _delete_launched(self) -> None:
        """Try to delete every launched Job not yet deleted or reported as left behind."""
        with self._lock:
            names = sorted(self._launched - set(self.leftovers))
        for name in names:
            self.delete(name)

    def _abandon_cleanup(self) -> None:
        """A second Ctrl-C: stop retrying, report every Job that may still exist."""
        self._hurry.set()
        with self._lock:
            names = sorted(self._launched - set(self.leftovers))
        for name in names:
            self._left_behind(name, "cleanup interrupted by a second Ctrl-C")


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
    Linear in the log's size: each chunk is split once, and the pieces of a line longer than a
    chunk are joined once, when its end arrives.
    """
    pending: list[bytes] = []  # the pieces of the line being read
    for chunk in resp.stream(_LOG_CHUNK, decode_content=True):
        *complete, rest = chunk.split(b"\n")
        for piece in complete:
            pending.append(piece)
            yield _split_line(b"".join(pending))
            pending.clear()
        if rest:
            pending.append(rest)
    if pending:  # the stream ended cleanly without a final newline
        yield _split_line(b"".join(pending))


def _split_line(raw: bytes) -> tuple[str, str]:
    stamp, _, text = raw.decode("utf-8", "replace").partition(" ")
    return stamp, text.rstrip("\r")


def _termination_reason(pod: dict) -> str:
    """Why the cell's container ended when the kubelet says more than its exit code, else ''."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") != CELL_CONTAINER:
            continue
        ended = (cs.get("state") or {}).get("terminated") or {}
        reason = ended.get("reason") or ""
        if reason == "OOMKilled":
            return "OOMKilled: the container went over its memory limit"
        if reason and reason not in ("Completed", "Error"):
            message = (ended.get("message") or "").strip()
            return f"{reason}: {message}" if message else reason
    return ""


def _condition_text(job: dict) -> str:
    conditions = (job.get("status") or {}).get("conditions") or []
    if not conditions:
        return "the Job controller created none"
    c = conditions[-1]
    return f"job condition {c.get('type')}: {c.get('reason')}: {c.get('message', '')}"


def _json_body(resp: Any, what: str) -> Any:
    """The JSON of a response read with ``_preload_content=False``.

    Raises:
        NotJson: the body is not JSON; the message quotes its type and its start.
    """
    data = resp.data or b"{}"
    try:
        return json.loads(data)
    except ValueError:
        kind = (resp.headers or {}).get("Content-Type", "no content type")
        start = " ".join(data[:120].decode("utf-8", "replace").split())
        raise NotJson(
            f"{what}: the API server's answer is not JSON (HTTP {resp.status}, {kind}: "
            f"{start!r}); is a proxy or a login page in front of it? Check the kubeconfig's "
            "server and credentials"
        ) from None


def _never_sent(exc: BaseException) -> bool:
    """The request failed before it reached the server: no connection could be made."""
    if isinstance(exc, urllib3.exceptions.MaxRetryError):
        exc = exc.reason or exc
    return isinstance(exc, urllib3.exceptions.ConnectTimeoutError)  # NewConnectionError too


def _retry_after(exc: ApiException) -> float | None:
    """The ``Retry-After`` of an API error in seconds (an HTTP date is not used), or None."""
    headers = exc.headers or {}
    value = headers.get("Retry-After") or headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def _describe_api_error(exc: ApiException, namespace: str) -> str:
    try:
        message = json.loads(exc.body or "{}").get("message", "")
    except (ValueError, AttributeError):
        message = ""
    hint = {
        401: "the kubeconfig's credentials were rejected",
        403: f"forbidden: the launcher needs the Role in k8s/setup/rbac.yaml in {namespace!r}",
        404: f"not found: does namespace {namespace!r} exist? (kubectl apply -k k8s/setup)",
        422: "the API server rejected the Job as invalid",
    }.get(exc.status or 0, f"API error {exc.status} {exc.reason}")
    return f"{hint}: {message}" if message else hint


def _finished(job: dict) -> str | None:
    """``"<condition> at <time>"`` when the Job's outcome is decided, else ``None``."""
    for c in (job.get("status") or {}).get("conditions") or []:
        if c.get("type") in FINISHED_CONDITIONS and c.get("status") == "True":
            when = c.get("lastTransitionTime")
            return f"{c['type']} at {when}" if when else str(c["type"])
    return None


def _what(fn: Callable[..., Any]) -> str:
    """``create_namespaced_job`` -> ``create namespaced job``, for messages."""
    return getattr(fn, "__name__", "request").replace("_", " ")


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
