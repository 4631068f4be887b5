"""A loopback Kubernetes API server for the launcher's tests: real HTTP, real wire format.

It serves the few endpoints the launcher's Role allows (jobs, pods, pods/log, events) with the
API server's JSON, watch streams as chunked JSON lines (``ERROR`` events with a ``Status`` for
410), and followed logs as chunked ``timestamps=true`` lines. Tests script a Job's life
(pending, unschedulable, image pull, running, logs, exit, OOM kill, eviction) and inject faults
(429/5xx/403 answers with headers, for one route or one Job; 200 answers that are an HTML page; a
log stream cut mid-line, once or every time; a node clock that steps back; a compacted watch
history; a watch cut mid-event without a 410; a request processed whose response is lost; a Job
left by an earlier run, finished or being deleted; a Job or pod deleted by someone else;
foreground deletes that take a while). The real
``kubernetes`` client talks to it through ``Configuration(host="http://127.0.0.1:<port>")``.

Why not kmock: these tests need exact control of stream cuts and in-stream 410 events; a server
of ~300 lines that speaks the wire format is simpler to audit than adapting a general mock.
"""

from __future__ import annotations

import copy
import io
import json
import re
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from kubernetes import client

JOB_LABEL = "batch.kubernetes.io/job-name"
_T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)

Scenario = Callable[["KubeStub", dict], None]


def _cs(state: dict, ready: bool = False) -> list[dict]:
    """containerStatuses as the kubelet reports them (every required field present)."""
    return [
        {
            "name": "cell",
            "image": "registry.test/portattn-ci:rocm",
            "imageID": "",
            "ready": ready,
            "restartCount": 0,
            "state": state,
        }
    ]


def _status(code: int, reason: str, message: str) -> dict:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class KubeStub:
    """The server plus the cluster state it serves. Use as a context manager."""

    def __init__(self, scenario: Scenario | None = None) -> None:
        self.scenario = scenario
        self.cond = threading.Condition()
        self.rv = 1
        self.compacted_epoch = 0
        self.min_rv = 0
        self.jobs: dict[str, dict] = {}
        self.pods: dict[str, dict] = {}
        self.logs: dict[str, list[tuple[str, str]]] = {}
        self.log_closed: set[str] = set()
        self.events: list[dict] = []
        self.history: list[tuple[int, str, dict]] = []  # (rv, type, pod)
        self.faults: dict[str, list[tuple[int, dict, str | None, bytes | None]]] = {}
        self.log_cuts: dict[str, list[int]] = {}
        self.log_cut_always: dict[str, int] = {}
        self.watch_drops: list[int] = []
        self.lost: dict[str, int] = {}
        self.before: dict[str, Callable[[], None]] = {}
        self.watch_hold_s: float | None = None  # None: a watch ends at its timeoutSeconds
        # False: a log or watch response ends its connection (Connection: close). True: as a real
        # API server, it keeps it alive: a client that reuses it before the stream ended
        # writes its next request into a socket the server is still streaming on.
        self.keep_alive_streams = False
        self.closed = False  # set on exit: held watches end
        self.terminating: dict[str, int] = {}  # job -> GETs it survives while being deleted
        self.delete_linger_gets = 0
        self.requests: list[tuple[str, str, dict]] = []
        self.deletes: list[tuple[str, str]] = []
        self.threads: list[threading.Thread] = []
        self._clock = 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> KubeStub:
        # A short poll interval: shutdown() waits for it (0.5 s by default, per test).
        threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        ).start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self.cond:
            self.closed = True
            self.log_closed.update(self.logs)
            self.cond.notify_all()
        self.server.shutdown()
        self.server.server_close()

    def api_client(self) -> client.ApiClient:
        cfg = client.Configuration(host=f"http://127.0.0.1:{self.server.server_port}")
        cfg.retries = False  # the launcher does its own retries
        return client.ApiClient(cfg)

    # -- fault injection -------------------------------------------------------------------

    def fail_next(
        self,
        route: str,
        code: int,
        times: int = 1,
        headers: dict | None = None,
        name: str | None = None,
    ) -> None:
        """The next ``times`` requests to ``route`` (e.g. ``"POST jobs"``, ``"GET pods watch"``,
        ``"DELETE job"``) answer ``code`` with ``headers``; with ``name``, only requests for the
        object of that name (e.g. one Job's DELETE)."""
        self.faults.setdefault(route, []).extend([(code, headers or {}, name, None)] * times)

    def answer_html(self, route: str, times: int = 1) -> None:
        """The next ``times`` requests to ``route`` get ``200 OK`` with an HTML page, as from an
        authenticating proxy in front of the API server; nothing is carried out."""
        page = b"<!DOCTYPE html><html><head><title>Sign in</title></head><body>SSO</body></html>"
        self.faults.setdefault(route, []).extend(
            [(200, {"Content-Type": "text/html; charset=utf-8"}, None, page)] * times
        )

    def drop_watch(self, after_events: int = 0) -> None:
        """The next pod watch sends ``after_events`` events, then half of the next one, and
        breaks the connection: no 410, no final chunk."""
        self.watch_drops.append(after_events)

    def before_answering(self, route: str, action: Callable[[], None]) -> None:
        """The next request to ``route`` runs ``action`` (in the server's thread) after it is
        recorded and before any of its response is sent: the client is waiting for headers."""
        self.before[route] = action

    def lose_response(self, route: str, times: int = 1) -> None:
        """The next ``times`` requests to ``route`` are carried out, but the connection is closed
        before the response is sent (the client sees a dropped connection)."""
        self.lost[route] = self.lost.get(route, 0) + times

    def cut_log(self, pod: str, after_lines: int) -> None:
        """The next log connection to ``pod`` breaks after ``after_lines`` lines, mid-line."""
        self.log_cuts.setdefault(pod, []).append(after_lines)

    def cut_log_always(self, pod: str, after_lines: int = 0) -> None:
        """Every log connection to ``pod`` breaks after ``after_lines`` lines, mid-line (a proxy
        that cuts each streamed response)."""
        self.log_cut_always[pod] = after_lines

    def step_clock(self, seconds: int) -> None:
        """The node's clock jumps by ``seconds`` (negative: back): later log lines carry
        timestamps older than earlier ones."""
        with self.cond:
            self._clock += 3 * seconds

    def compact(self) -> None:
        """Drop the watch history: open watches get an in-stream 410 and old versions expire."""
        with self.cond:
            self.compacted_epoch += 1
            self.min_rv = self.rv
            self.history.clear()
            self.cond.notify_all()

    # -- Jobs left by earlier runs ----------------------------------------------------------

    def seed_job(self, job: dict, *, annotations: dict | None = None, status: dict | None = None):
        """A Job that exists before the test (no scenario runs for it)."""
        job = copy.deepcopy(job)
        job["metadata"]["annotations"] = {**job["metadata"].get("annotations", {})}
        job["metadata"]["annotations"].update(annotations or {})
        job["metadata"]["uid"] = "uid-seeded"
        job["status"] = status or {}
        with self.cond:
            self.jobs[job["metadata"]["name"]] = job
        return job

    def mark_terminating(self, name: str, gets: int) -> None:
        """Job ``name`` gets a deletionTimestamp and survives ``gets`` more GETs, then it and its
        pods are gone (as a foreground delete waits for the pods)."""
        with self.cond:
            self.jobs[name]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
            self.terminating[name] = gets

    def _remove_job(self, name: str) -> dict:
        job = self.jobs.pop(name)
        self.terminating.pop(name, None)
        for pod_name in [
            p for p, v in self.pods.items() if v["metadata"]["labels"].get(JOB_LABEL) == name
        ]:
            pod = self.pods.pop(pod_name)
            self.log_closed.add(pod_name)
            self._publish("DELETED", pod)
        return job

    def read_job(self, name: str) -> dict | None:
        with self.cond:
            job = self.jobs.get(name)
            if job is None:
                return None
            if name in self.terminating:
                if self.terminating[name] <= 0:
                    self._remove_job(name)
                    return None
                self.terminating[name] -= 1
            return copy.deepcopy(job)

    # -- scripting a Job's pods -------------------------------------------------------------

    def _stamp(self) -> str:
        # Three lines per second-resolution stamp: the launcher's dedup must use ordinals too.
        self._clock += 1
        return (_T0 + timedelta(seconds=self._clock // 3)).strftime("%Y-%m-%dT%H:%M:%SZ")

    def _publish(self, kind: str, pod: dict) -> None:
        self.rv += 1
        pod["metadata"]["resourceVersion"] = str(self.rv)
        self.history.append((self.rv, kind, copy.deepcopy(pod)))
        self.cond.notify_all()

    def add_pod(self, job: dict, suffix: str = "x1") -> str:
        name = f"{job['metadata']['name']}-{suffix}"
        labels = {
            **job["spec"]["template"]["metadata"].get("labels", {}),
            JOB_LABEL: job["metadata"]["name"],
            "job-name": job["metadata"]["name"],
        }
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": job["metadata"]["namespace"], "labels": labels},
            "spec": copy.deepcopy(job["spec"]["template"]["spec"]),
            "status": {"phase": "Pending", "conditions": []},
        }
        with self.cond:
            self.pods[name] = pod
            self.logs[name] = []
            self._publish("ADDED", pod)
        return name

    def set_status(self, pod: str, **status: object) -> None:
        with self.cond:
            if pod not in self.pods:
                return
            self.pods[pod]["status"].update(copy.deepcopy(status))
            self._publish("MODIFIED", self.pods[pod])

    def unschedulable(self, pod: str, message: str) -> None:
        with self.cond:
            self.events.append(
                {
                    "type": "Warning",
                    "reason": "FailedScheduling",
                    "message": message,
                    "lastTimestamp": self._stamp(),
                    "involvedObject": {"kind": "Pod", "name": pod},
                }
            )
        self.set_status(
            pod,
            conditions=[
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": message,
                }
            ],
        )

    def waiting(self, pod: str, reason: str, message: str) -> None:
        self.set_status(
            pod, containerStatuses=_cs({"waiting": {"reason": reason, "message": message}})
        )

    def start(self, pod: str) -> None:
        self.set_status(
            pod,
            phase="Running",
            containerStatuses=_cs({"running": {"startedAt": self._stamp()}}, True),
        )

    def log(self, pod: str, *lines: str) -> None:
        with self.cond:
            self.logs[pod].extend((self._stamp(), line) for line in lines)
            self.cond.notify_all()

    def delete_pod(self, pod: str) -> None:
        """Someone deletes the pod (``kubectl delete pod``); its Job stays."""
        with self.cond:
            if pod in self.pods:
                self.log_closed.add(pod)
                self._publish("DELETED", self.pods.pop(pod))

    def finish(self, pod: str, exit_code: int, reason: str | None = None) -> None:
        with self.cond:
            if pod not in self.pods:
                return  # deleted meanwhile (the launcher gave up on it)
            self.log_closed.add(pod)
            job = self.jobs.get(self.pods[pod]["metadata"]["labels"][JOB_LABEL])
            if job is not None:
                kind = "Complete" if exit_code == 0 else "Failed"
                job["status"] = {"conditions": [{"type": kind, "status": "True"}]}
        reason = reason or ("Completed" if exit_code == 0 else "Error")
        self.set_status(
            pod,
            phase="Succeeded" if exit_code == 0 else "Failed",
            containerStatuses=_cs({"terminated": {"exitCode": exit_code, "reason": reason}}),
        )

    def evict(self, pod: str) -> None:
        with self.cond:
            self.log_closed.add(pod)
        self.set_status(
            pod,
            phase="Failed",
            reason="Evicted",
            message="node drained",
            conditions=[
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": "EvictionByEvictionAPI",
                    "message": "Eviction API: evicting",
                }
            ],
            containerStatuses=_cs({"terminated": {"exitCode": 137, "reason": "Error"}}),
        )

    def wait_log_readers(self, pod: str, count: int, timeout: float = 10.0) -> None:
        """Block until ``count`` log requests for ``pod`` have arrived."""
        end = time.monotonic() + timeout
        path = f"/pods/{pod}/log"
        while time.monotonic() < end:
            if sum(1 for _, p, _ in self.requests if p.endswith(path)) >= count:
                return
            time.sleep(0.01)
        raise TimeoutError(f"no log reader for {pod}")

    # -- API semantics ----------------------------------------------------------------------

    def create_job(self, job: dict) -> tuple[int, dict]:
        name = job["metadata"]["name"]
        with self.cond:
            if name in self.jobs:
                return 409, _status(409, "AlreadyExists", f'jobs.batch "{name}" already exists')
            job = copy.deepcopy(job)
            job["metadata"]["uid"] = f"uid-{name}"
            job["status"] = {}
            self.jobs[name] = job
        if self.scenario is not None:
            t = threading.Thread(target=self.scenario, args=(self, job), daemon=True)
            self.threads.append(t)
            t.start()
        return 201, job

    def delete_job(self, name: str, policy: str) -> tuple[int, dict]:
        with self.cond:
            self.deletes.append((name, policy))
            if name not in self.jobs:
                return 404, _status(404, "NotFound", f'jobs.batch "{name}" not found')
            if policy == "Orphan":
                return 200, self.jobs.pop(name)
            if self.delete_linger_gets and name not in self.terminating:
                self.mark_terminating(name, self.delete_linger_gets)
            if name in self.terminating:
                return 200, copy.deepcopy(self.jobs[name])
            return 200, self._remove_job(name)


def _selected(pod: dict, selector: str) -> bool:
    labels = pod["metadata"].get("labels", {})
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


_ROUTES = [
    ("jobs", re.compile(r"^/apis/batch/v1/namespaces/([^/]+)/jobs$")),
    ("job", re.compile(r"^/apis/batch/v1/namespaces/([^/]+)/jobs/([^/]+)$")),
    ("pods", re.compile(r"^/api/v1/namespaces/([^/]+)/pods$")),
    ("pod", re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)$")),
    ("log", re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)/log$")),
    ("events", re.compile(r"^/api/v1/namespaces/([^/]+)/events$")),
]


def _handler(stub: KubeStub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms stalls

        def log_message(self, *args: object) -> None:  # quiet
            pass

        # -- plumbing -------------------------------------------------------------------
        def _json(self, code: int, body: dict, headers: dict | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def _start_chunked(self, content_type: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Transfer-Encoding", "chunked")
            if not stub.keep_alive_streams:
                self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = not stub.keep_alive_streams

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def _end_chunked(self) -> None:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

        def _route(self, method: str) -> None:
            url = urlparse(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            body = b""
            if int(self.headers.get("Content-Length") or 0):
                body = self.rfile.read(int(self.headers["Content-Length"]))
            found = [(k, m) for k, p in _ROUTES if (m := p.match(url.path))]
            if not found:
                self._json(404, _status(404, "NotFound", url.path))
                return
            kind, m = found[0]
            watching = query.get("watch") in ("true", "True", "1")
            route = f"{method} {kind}" + (" watch" if watching else "")
            obj_name = m.groups()[1] if len(m.groups()) > 1 else None
            with stub.cond:
                stub.requests.append((method, url.path, query))
                faults = stub.faults.get(route, [])
                hit = [i for i, f in enumerate(faults) if f[2] is None or f[2] == obj_name]
                injected = faults.pop(hit[0]) if hit else None
                lose = stub.lost.get(route, 0) > 0
                if lose:
                    stub.lost[route] -= 1
                action = stub.before.pop(route, None)
            if action is not None:
                action()
            if injected:
                code, headers, _, page = injected
                if page is not None:
                    self.send_response(code)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(page)))
                    self.end_headers()
                    self.wfile.write(page)
                    return
                self._json(code, _status(code, "Injected", f"injected {code}"), headers)
                return
            if lose:
                self.wfile = io.BytesIO()  # carried out; the response goes nowhere
                getattr(self, f"_{kind}")(method, m.groups(), query, body, watching)
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
                return
            getattr(self, f"_{kind}")(method, m.groups(), query, body, watching)

        def do_GET(self) -> None:
            self._route("GET")

        def do_POST(self) -> None:
            self._route("POST")

        def do_DELETE(self) -> None:
            self._route("DELETE")

        # -- endpoints ------------------------------------------------------------------
        def _jobs(self, method, groups, query, body, watching) -> None:
            if method == "GET":  # a list (the launcher's access check asks for one item)
                with stub.cond:
                    items = [copy.deepcopy(j) for j in stub.jobs.values()]
                    rv = stub.rv
                limit = int(query.get("limit") or 0)
                self._json(
                    200,
                    {
                        "kind": "JobList",
                        "apiVersion": "batch/v1",
                        "metadata": {"resourceVersion": str(rv)},
                        "items": items[:limit] if limit else items,
                    },
                )
                return
            code, obj = stub.create_job(json.loads(body))
            self._json(code, obj)

        def _job(self, method, groups, query, body, watching) -> None:
            name = groups[1]
            if method == "DELETE":
                policy = query.get("propagationPolicy", "")
                if body:
                    policy = json.loads(body).get("propagationPolicy", policy)
                code, obj = stub.delete_job(name, policy)
                self._json(code, obj)
            elif (job := stub.read_job(name)) is not None:
                self._json(200, job)
            else:
                self._json(404, _status(404, "NotFound", f'jobs.batch "{name}" not found'))

        def _pod(self, method, groups, query, body, watching) -> None:
            with stub.cond:
                pod = copy.deepcopy(stub.pods.get(groups[1]))
            if pod is None:
                self._json(404, _status(404, "NotFound", f'pods "{groups[1]}" not found'))
            else:
                self._json(200, pod)

        def _events(self, method, groups, query, body, watching) -> None:
            fields = dict(t.split("=", 1) for t in query.get("fieldSelector", "").split(",") if t)
            with stub.cond:
                items = [
                    e
                    for e in stub.events
                    if all(
                        e["involvedObject"].get(k.split(".", 1)[1]) == v for k, v in fields.items()
                    )
                ]
            self._json(
                200,
                {
                    "kind": "EventList",
                    "apiVersion": "v1",
                    "metadata": {"resourceVersion": str(stub.rv)},
                    "items": items,
                },
            )

        def _pods(self, method, groups, query, body, watching) -> None:
            selector = query.get("labelSelector", "")
            if not watching:
                with stub.cond:
                    items = [copy.deepcopy(p) for p in stub.pods.values() if _selected(p, selector)]
                    rv = stub.rv
                self._json(
                    200,
                    {
                        "kind": "PodList",
                        "apiVersion": "v1",
                        "metadata": {"resourceVersion": str(rv)},
                        "items": items,
                    },
                )
                return
            since = int(query.get("resourceVersion") or 0)
            # A server (or a proxy in front of it) may hold a watch past its timeoutSeconds.
            hold = stub.watch_hold_s or float(query.get("timeoutSeconds") or 30)
            end = time.monotonic() + hold
            self._start_chunked("application/json")
            with stub.cond:
                epoch = stub.compacted_epoch
                drop = stub.watch_drops.pop(0) if stub.watch_drops else None
            try:
                while True:
                    with stub.cond:
                        if stub.compacted_epoch != epoch or since < stub.min_rv:
                            gone = {
                                "type": "ERROR",
                                "object": _status(410, "Expired", "too old resource version"),
                            }
                            self._chunk(json.dumps(gone).encode() + b"\n")
                            break
                        new = [
                            (rv, t, p)
                            for rv, t, p in stub.history
                            if rv > since and _selected(p, selector)
                        ]
                        if not new:
                            remaining = end - time.monotonic()
                            if remaining <= 0 or stub.closed:
                                break
                            stub.cond.wait(min(remaining, 0.2))
                            continue
                    for rv, kind, pod in new:
                        event = json.dumps({"type": kind, "object": pod}).encode() + b"\n"
                        if drop is not None and drop == 0:
                            half = event[: len(event) // 2]  # a chunk longer than what follows
                            self.wfile.write(f"{len(event):x}\r\n".encode() + half)
                            self.wfile.flush()
                            self.connection.shutdown(socket.SHUT_RDWR)
                            return
                        self._chunk(event)
                        since = rv
                        if drop is not None:
                            drop -= 1
                self._end_chunked()
            except (BrokenPipeError, ConnectionResetError):
                pass

        def _log(self, method, groups, query, body, watching) -> None:
            pod = groups[1]
            if pod not in stub.logs:
                self._json(404, _status(404, "NotFound", f'pods "{pod}" not found'))
                return
            follow = query.get("follow") in ("true", "True")
            stamps = query.get("timestamps") in ("true", "True")
            with stub.cond:
                cuts = stub.log_cuts.get(pod)
                cut = cuts.pop(0) if cuts else stub.log_cut_always.get(pod)
            self._start_chunked("text/plain")
            sent = 0
            try:
                while True:
                    with stub.cond:
                        lines = stub.logs[pod][sent:]
                        closed = pod in stub.log_closed
                        if not lines and not closed and follow:
                            stub.cond.wait(0.2)
                            continue
                    for stamp, text in lines:
                        if cut is not None and sent == cut:
                            self._chunk(f"{stamp} {text[: len(text) // 2]}".encode())
                            self.wfile.flush()
                            self.connection.shutdown(2)  # mid-line, no final chunk
                            return
                        self._chunk(((f"{stamp} " if stamps else "") + text + "\n").encode())
                        sent += 1
                    if (closed or not follow) and sent >= len(stub.logs[pod]):
                        break
                self._end_chunked()
            except (BrokenPipeError, ConnectionResetError, OSError):
                pass

    return Handler
