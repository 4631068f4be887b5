"""The launcher against a loopback Kubernetes API (tests/ci/kube_stub.py), over real HTTP."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.config import kube_config

from kubematrix import k8s
from kubematrix.cachestats import CacheStats
from kubematrix.cell import CACHE, encode_results
from kubematrix.launcher import RUN_ANNOTATION, Launcher, Timeouts, classify_pod
from kubematrix.render import render_job, results_token
from tests.ci.kube_stub import KubeStub

pytestmark = pytest.mark.ci

FAST = Timeouts(
    pending_s=1.0,
    watch_s=1,
    request_s=5.0,
    log_idle_s=3.0,
    overall_s=20.0,
    retries=3,
    backoff_s=0.02,
    connect_s=2.0,
)
JUNIT = (
    b'<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="1">'
    b'<testcase classname="t" name="test_one"/></testsuite></testsuites>'
)
#: A report whose only test was skipped (``-k`` matching a skip, a GPU test off its GPU).
SKIPPED_JUNIT = (
    b'<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="1">'
    b'<testcase classname="t" name="test_one"><skipped message="no"/></testcase>'
    b"</testsuite></testsuites>"
)
LOG = [f"line {i}" for i in range(10)]


@pytest.fixture(autouse=True, scope="module")
def _warm_client():
    """The first CoreV1Api/BatchV1Api of a process costs ~0.6 s (the client builds its API
    classes lazily): pay it once, outside the time bounds of the tests."""
    Launcher(client.ApiClient(client.Configuration()), "warm-up")


def _job(suite: str = "mla", commit: str = "abc1234", vendor: str = "rocm") -> dict:
    return render_job(
        vendor=vendor, suite=suite, image="registry.test/portattn-ci:rocm", commit=commit
    )


def _report(job: dict, exit_code: int) -> list[str]:
    return encode_results(JUNIT, results_token(job["metadata"]["name"]), exit_code)


def _run(scenario, job=None, timeouts=FAST, setup=None, sleep=None):
    job = job or _job()
    out: list[str] = []
    with KubeStub(scenario) as stub:
        if setup:
            setup(stub, job)
        launcher = Launcher(
            stub.api_client(), "portattn-ci", timeouts=timeouts, emit=out.append, sleep=sleep
        )
        result = launcher.run(job)
    return result, out, stub


def _fast(**changes) -> Timeouts:
    return dataclasses.replace(FAST, **changes)


def _kubectl(name: str) -> str:
    return f"kubectl -n portattn-ci delete job {name} --cascade=foreground"


def _requests(stub: KubeStub, method: str, suffix: str, watch: bool | None = None) -> int:
    return sum(
        1
        for m, p, q in stub.requests
        if m == method and p.endswith(suffix) and (watch is None or bool(q.get("watch")) == watch)
    )


def _completes(exit_code: int, log=LOG):
    def scenario(k: KubeStub, job: dict) -> None:
        pod = k.add_pod(job)
        time.sleep(0.05)
        k.start(pod)
        k.log(pod, *log)
        k.log(pod, *_report(job, exit_code))
        k.finish(pod, exit_code)

    return scenario


def _log_lines(out: list[str]) -> list[str]:
    return [line for line in out if not line.startswith("kubematrix:")]


def test_success_streams_log_returns_junit_and_deletes_with_foreground():
    result, out, stub = _run(_completes(0))
    assert (result.outcome, result.exit_code, result.junit) == ("passed", 0, JUNIT)
    assert _log_lines(out) == LOG  # once each; the encoded report is not echoed
    assert stub.deletes == [(result.name, "Foreground")]
    assert not stub.pods


def test_a_cells_cache_counters_come_back_with_its_result_and_are_not_echoed():
    stats = CacheStats(local=40, remote=5, compiled=3, compile_s=12.0)

    def scenario(k: KubeStub, job: dict) -> None:
        token = results_token(job["metadata"]["name"])
        pod = k.add_pod(job)
        k.start(pod)
        k.log(pod, *LOG, "kubematrix.cell: Triton cache: 94% hits of 48 lookups")
        k.log(pod, f"{CACHE} {token} " + json.dumps(stats.to_dict()))
        k.log(pod, *_report(job, 0))
        k.finish(pod, 0)

    result, out, _ = _run(scenario)
    assert result.outcome == "passed" and result.cache == stats
    assert not [line for line in out if line.startswith(CACHE)]
    assert "kubematrix.cell: Triton cache: 94% hits of 48 lookups" in out  # for people


def test_a_cell_that_printed_no_counters_has_none():
    result, _, _ = _run(_completes(0))
    assert result.outcome == "passed" and result.cache is None


def test_failing_tests_propagate_the_exit_code():
    result, _, stub = _run(_completes(1))
    assert (result.outcome, result.exit_code, result.junit) == ("failed", 1, JUNIT)
    assert stub.deletes == [(result.name, "Foreground")]


def test_image_pull_error_fails_fast_with_the_kubelet_message():
    def scenario(k: KubeStub, job: dict) -> None:
        pod = k.add_pod(job)
        k.waiting(pod, "ImagePullBackOff", 'Back-off pulling image "registry.test/nope"')

    start = time.monotonic()
    result, _, stub = _run(scenario, timeouts=Timeouts(**{**FAST.__dict__, "pending_s": 30.0}))
    assert time.monotonic() - start < 10
    assert result.outcome == "error" and result.exit_code is None
    assert "cannot pull its image: ImagePullBackOff" in result.message
    assert "registry.test/nope" in result.message
    assert stub.deletes == [(result.name, "Foreground")]


def test_unschedulable_past_pending_timeout_quotes_the_scheduler():
    message = "0/3 nodes are available: 3 Insufficient amd.com/gpu."

    def scenario(k: KubeStub, job: dict) -> None:
        k.unschedulable(k.add_pod(job), message)

    result, _, stub = _run(scenario)
    assert result.outcome == "error"
    assert "unschedulable after 1 s" in result.message
    assert f"FailedScheduling: {message}" in result.message
    assert stub.deletes == [(result.name, "Foreground")]


def test_eviction_follows_the_replacement_pod():
    def scenario(k: KubeStub, job: dict) -> None:
        first = k.add_pod(job, "aaaaa")
        k.start(first)
        k.log(first, "before eviction")
        k.evict(first)
        second = k.add_pod(job, "bbbbb")
        k.start(second)
        k.log(second, "after eviction", *_report(job, 0))
        k.finish(second, 0)

    result, out, _ = _run(scenario)
    assert result.outcome == "passed" and result.junit == JUNIT
    assert result.evictions == [f"{result.name}-aaaaa"]
    assert _log_lines(out) == ["before eviction", "after eviction"]
    assert any("was evicted" in line for line in out)


def test_watch_resumes_after_410_by_listing_again():
    def scenario(k: KubeStub, job: dict) -> None:
        pod = k.add_pod(job)
        deadline = time.monotonic() + 5
        while not any(q.get("watch") for _, p, q in k.requests if p.endswith("/pods")):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.1)
        k.compact()  # the open watch gets ERROR 410
        k.start(pod)
        k.log(pod, *LOG, *_report(job, 0))
        k.finish(pod, 0)

    result, out, stub = _run(scenario)
    lists = [q for m, p, q in stub.requests if p.endswith("/pods") and not q.get("watch")]
    assert result.outcome == "passed"
    assert len(lists) >= 2  # listed again after the 410
    assert _log_lines(out) == LOG


def test_log_stream_cut_mid_line_reconnects_without_duplicates():
    def scenario(k: KubeStub, job: dict) -> None:
        pod = k.add_pod(job)
        k.cut_log(pod, after_lines=4)
        k.start(pod)
        k.log(pod, *LOG[:6])
        k.wait_log_readers(pod, 2)
        k.log(pod, *LOG[6:], *_report(job, 0))
        k.finish(pod, 0)

    result, out, stub = _run(scenario)
    assert result.outcome == "passed" and result.junit == JUNIT
    assert _log_lines(out) == LOG  # no line twice, none half
    assert sum(1 for _, p, _ in stub.requests if p.endswith("/log")) >= 2


def test_api_429_and_500_are_retried():
    def setup(k: KubeStub, job: dict) -> None:
        k.fail_next("POST jobs", 429, headers={"Retry-After": "0"})
        k.fail_next("GET pods", 500, times=2)
        k.fail_next("GET log", 503)
        k.fail_next("DELETE job", 500)

    result, out, stub = _run(_completes(0), setup=setup)
    posts = [p for m, p, _ in stub.requests if m == "POST"]
    assert result.outcome == "passed" and _log_lines(out) == LOG
    assert len(posts) == 2
    assert stub.deletes == [(result.name, "Foreground")]


def test_non_retryable_api_error_is_reported_with_the_role_hint():
    result, _, stub = _run(None, setup=lambda k, job: k.fail_next("POST jobs", 403, times=9))
    assert result.outcome == "error"
    assert "forbidden: the launcher needs the Role in k8s/setup/rbac.yaml" in result.message
    assert len([m for m, _, _ in stub.requests if m == "POST"]) == 1


def test_409_attaches_to_the_running_job():
    def scenario(k: KubeStub, job: dict) -> None:
        pod = k.add_pod(job)
        k.start(pod)
        name = job["metadata"]["name"]
        _wait_for(lambda: _requests(k, "GET", f"/jobs/{name}") >= 1)  # the launcher read it
        k.log(pod, *LOG, *_report(job, 0))
        k.finish(pod, 0)

    def setup(k: KubeStub, job: dict) -> None:
        k.create_job(job)  # launched earlier, e.g. by a retried CI step, and still running

    result, out, stub = _run(scenario, setup=setup)
    assert result.attached and result.outcome == "passed"
    assert _log_lines(out) == LOG
    assert any("already exists; attaching" in line for line in out)
    assert _requests(stub, "POST", "/jobs") == 1


def _forever(k: KubeStub, job: dict) -> None:
    pod = k.add_pod(job)
    k.start(pod)
    while pod in k.pods:
        k.log(pod, "working")
        time.sleep(0.02)


def _interrupt_main_after(seconds: float) -> threading.Timer:
    main = threading.main_thread().ident
    assert main is not None
    timer = threading.Timer(seconds, signal.pthread_kill, args=(main, signal.SIGINT))
    timer.start()
    return timer


@pytest.fixture
def sigint_raises():
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("SIGINT can only be delivered to the main thread")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_deletes_the_job_and_its_pods(sigint_raises):
    job = _job()
    with KubeStub(_forever) as stub:
        launcher = Launcher(stub.api_client(), "portattn-ci", timeouts=FAST, emit=lambda _: None)
        _interrupt_main_after(0.5)
        with pytest.raises(KeyboardInterrupt):
            launcher.run(job)
        assert stub.deletes == [(job["metadata"]["name"], "Foreground")]
        assert not stub.pods and not stub.jobs


def test_fan_out_is_bounded_and_ordered():
    jobs = [_job(suite=s) for s in ("paged", "mla", "hybrid", "specdec")]
    alive: list[int] = []

    def scenario(k: KubeStub, job: dict) -> None:
        with k.cond:
            alive.append(len(k.jobs))
        _completes(0)(k, job)

    with KubeStub(scenario) as stub:
        launcher = Launcher(stub.api_client(), "portattn-ci", timeouts=FAST, emit=lambda _: None)
        results = launcher.run_many(jobs, max_parallel=2)
    assert [r.name for r in results] == [j["metadata"]["name"] for j in jobs]
    assert all(r.outcome == "passed" for r in results)
    assert max(alive) <= 2
    assert sorted(n for n, _ in stub.deletes) == sorted(r.name for r in results)


def test_fan_out_ctrl_c_deletes_every_launched_job(sigint_raises):
    jobs = [_job(suite=s) for s in ("paged", "mla", "hybrid")]
    with KubeStub(_forever) as stub:
        launcher = Launcher(stub.api_client(), "portattn-ci", timeouts=FAST, emit=lambda _: None)
        _interrupt_main_after(0.5)
        with pytest.raises(KeyboardInterrupt):
            launcher.run_many(jobs, max_parallel=2)
        assert not stub.jobs and not stub.pods
        assert {n for n, p in stub.deletes if p == "Foreground"} >= {
            j["metadata"]["name"] for j in jobs[:2]
        }


def test_run_many_rejects_a_bad_bound():
    with pytest.raises(ValueError, match="run_many: max_parallel must be >= 1; got 0"):
        Launcher(KubeStub().api_client(), "ns").run_many([], max_parallel=0)


def test_a_pod_is_classified_as_pending_failed_to_start_running_or_terminated():
    waiting = {
        "status": {
            "phase": "Pending",
            "containerStatuses": [
                {"name": "cell", "state": {"waiting": {"reason": "ContainerCreating"}}}
            ],
        }
    }
    assert classify_pod(waiting) == ("pending", "Pending")
    config = {
        "status": {
            "phase": "Pending",
            "containerStatuses": [
                {
                    "name": "cell",
                    "state": {
                        "waiting": {"reason": "CreateContainerConfigError", "message": "no secret"}
                    },
                }
            ],
        }
    }
    assert classify_pod(config) == ("config-error", "CreateContainerConfigError: no secret")


def test_no_cluster_says_so_and_exits_non_zero(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(k8s.NoCluster, match="no cluster configured"):
        k8s.load_api_client()
    assert k8s.main(["--vendor", "rocm", "--suite", "mla"]) == k8s.EXIT_NO_CLUSTER
    assert "no cluster configured" in capsys.readouterr().err


def test_a_repeated_vendor_or_suite_makes_one_job(monkeypatch, tmp_path):
    """``--vendor cuda --vendor cuda --suite paged --suite paged``: one Job (two of one name
    would collide at create)."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    made: list[dict] = []

    def no_cluster(namespace, context=None, timeouts=None, say=None):
        raise k8s.NoCluster("no cluster configured")

    real_render = k8s.render_job
    monkeypatch.setattr(k8s, "render_job", lambda **kw: made.append(kw) or real_render(**kw))
    monkeypatch.setattr(k8s, "connect", no_cluster)
    argv = ["--vendor", "cuda", "--vendor", "cuda", "--suite", "paged", "--suite", "paged",
            "--commit", "0123456789ab"]  # fmt: skip
    assert k8s.main(argv) == k8s.EXIT_NO_CLUSTER
    assert [(kw["vendor"], kw["suite"]) for kw in made] == [("cuda", "paged")]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-parallel", "0"], "--max-parallel must be >= 1; got 0"),
        (["--pending-timeout", "nan"], "--pending-timeout must be a finite number of seconds > 0"),
        (["--pending-timeout", "inf"], "--pending-timeout must be a finite number of seconds > 0"),
        (["--deadline", "600"], "--deadline must be > 600 s"),
        # int64 fields: past them the API server, not the launcher, would have refused
        (["--deadline", str(2**63)], "and <= 2**63 - 1 (the Job's int64 field); got 9223372"),
        (["--namespace", "Bad_NS"], "namespace must be a DNS-1123 label: at most 63 characters"),
        (["--commit", "a b"], "commit must make the image tag <vendor>-<commit> a Docker tag"),
    ],
)
def test_usage_errors_come_before_the_cluster_is_asked(
    argv, message, monkeypatch, tmp_path, capsys
):
    """No cluster is configured here: a bad argument is reported as such, not as that."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    assert k8s.main(["--vendor", "rocm", "--suite", "mla", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "nothing was created" in err and "no cluster" not in err, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--supplemental-groups", "abc"],
         "argument --supplemental-groups: must be comma-separated integer GIDs in "
         "[0, 4294967294], e.g. 44,109; got 'abc'"),
        (["--supplemental-groups", "44,-1"], "GIDs in [0, 4294967294], e.g. 44,109; got '44,-1'"),
        (["--supplemental-groups", f"44,{2**32 - 1}"], "GIDs in [0, 4294967294]"),
        # the KUBEMATRIX_IMAGE_<VENDOR> rule, which --image skipped (it checked only spaces)
        (["--image", "x y"], "argument --image: must be an image reference"),
        (["--image", "UPPER/Repo:x"], "argument --image: must be an image reference"),
        (["--image", ""], "argument --image: must not be empty"),
        (["--commit", ""], "argument --commit: must not be empty"),
        (["--namespace", ""], "argument --namespace: must not be empty"),
        (["--context", ""], "argument --context: must not be empty"),
        (["--results", ""], "argument --results: must not be empty"),
    ],
)  # fmt: skip
def test_bad_and_empty_arguments_are_refused_by_name(argv, message, capsys):
    """`--image ""` used to run the default image; `--supplemental-groups abc` said only
    `invalid <lambda> value`."""
    with pytest.raises(SystemExit) as exit_:
        k8s.main(["--vendor", "rocm", "--suite", "mla", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("env", "value", "message"),
    [
        ("KUBEMATRIX_NAMESPACE", "Bad_NS", "KUBEMATRIX_NAMESPACE must be a DNS-1123 label: at"),
        ("KUBEMATRIX_NAMESPACE", "n" * 64, "KUBEMATRIX_NAMESPACE must be a DNS-1123 label: at"),
        ("KUBEMATRIX_KUEUE_QUEUE", "q" * 100,
         "KUBEMATRIX_KUEUE_QUEUE must be a Kueue LocalQueue name usable as a label value"),
    ],
)  # fmt: skip
def test_settings_that_become_names_or_labels_are_named_before_the_cluster_is_asked(
    env, value, message, monkeypatch, tmp_path, capsys
):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.setenv(env, value)
    assert k8s.main(["--vendor", "rocm", "--suite", "mla", "--commit", "abc1234"]) == 2
    err = capsys.readouterr().err
    assert message in err and "nothing was created" in err and "no cluster" not in err, err


def test_a_results_folder_that_cannot_be_made_is_named_before_the_cluster_is_asked(
    monkeypatch, tmp_path, capsys
):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    (tmp_path / "a-file").write_text("")
    results = tmp_path / "a-file" / "results"
    argv = ["--vendor", "rocm", "--suite", "mla", "--commit", "abc1234", "--results", str(results)]
    assert k8s.main(argv) == 2
    err = capsys.readouterr().err
    assert f"--results {results}: cannot create it: {tmp_path / 'a-file'} is not a folder" in err
    assert "nothing was created" in err and not results.exists()


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"apiVersion: v1\nclusters: [\n", "it is not valid YAML: while parsing"),
        (b"\x7fELF\x02\x01\x01\x00\xd0\xff\n", "it is not UTF-8 text"),
        (None, "it is a folder, not a file"),
        (b"[]\n", "it is not a kubeconfig: a YAML mapping of clusters, users and contexts"),
        (b"hello\n", "it is not a kubeconfig: a YAML mapping of clusters, users and contexts"),
    ],
)
def test_a_kubeconfig_that_is_no_kubeconfig_is_no_cluster(tmp_path, content, problem):
    """Bad YAML, a binary file, a folder or a list used to end in the client's traceback (the
    client reads $KUBECONFIG at import, hence a fresh process)."""
    kubeconfig = tmp_path / "kubeconfig"
    if content is None:
        kubeconfig.mkdir()
    else:
        kubeconfig.write_bytes(content)
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    cmd = [sys.executable, "-m", "kubematrix.k8s", "--vendor", "cuda", "--suite", "mla"]
    proc = subprocess.run(
        [*cmd, "--commit", "abc1234", "--results", str(tmp_path / "results")],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == k8s.EXIT_NO_CLUSTER, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(
        f"kubematrix.k8s: no cluster configured: not in a pod, and "
        f"{kubeconfig} gives no usable context ({problem}"
    )


def _launch_one_cell(command: str, server: str, tmp_path: Path) -> subprocess.Popen:
    """``command`` (``kubematrix.k8s`` or ``kubematrix matrix --runner k8s``) started on the
    mla cuda cell, in a fresh process whose kubeconfig points at ``server``."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: s, cluster: {{server: '{server}'}}}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: s, user: u, namespace: portattn-ci}}]\n"
    )
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "KUBEMATRIX_KUSTOMIZE": "builtin"}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    argv = {
        "kubematrix.k8s": ["--vendor", "cuda", "--suite", "mla", "--commit", "abc1234",
                           "--results", str(tmp_path / "r")],
        "kubematrix": ["matrix", "--runner", "k8s", "--cell", "mla-cuda-sm_90",
                       "--results", str(tmp_path / "r")],
    }[command]  # fmt: skip
    return subprocess.Popen([sys.executable, "-m", command, *argv], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=Path(__file__).resolve().parents[2])  # fmt: skip


@pytest.mark.parametrize("command", ["kubematrix.k8s", "kubematrix"])
def test_ctrl_c_while_the_cluster_is_checked_ends_without_a_traceback(tmp_path, command):
    """A server that accepts and never answers, and Ctrl-C during the access check (before any
    Job exists): both commands ended in the TLS handshake's KeyboardInterrupt traceback."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(server.accept()[0]), daemon=True).start()
    port = server.getsockname()[1]
    proc = _launch_one_cell(command, f"https://127.0.0.1:{port}", tmp_path)
    try:
        _wait_for(lambda: bool(accepted), timeout=60)
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        server.close()
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err and "interrupted" in err, err


@pytest.mark.parametrize("command", ["kubematrix.k8s", "kubematrix"])
def test_sigterm_deletes_the_running_job(tmp_path, command):
    """A cancelled CI job gets SIGTERM: both commands died at once, leaving the Job (and its
    GPU) on the cluster until its deadline. Now they clean up as on Ctrl-C, exit 143."""
    with KubeStub(_forever) as stub:
        proc = _launch_one_cell(command, f"http://127.0.0.1:{stub.server.server_port}", tmp_path)
        try:
            _wait_for(lambda: bool(stub.pods), timeout=60)
            time.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
        assert proc.returncode == 143, (out, err)
        assert "Traceback" not in err, err
        assert [how for _, how in stub.deletes] == ["Foreground"] and not stub.jobs


def test_exit_status_propagates_the_first_failing_code():
    from kubematrix.launcher import CellResult

    ok = CellResult("a", "passed", 0, "")
    assert k8s.exit_status([ok]) == 0
    assert k8s.exit_status([ok, CellResult("b", "failed", 2, "")]) == 2
    assert k8s.exit_status([ok, CellResult("c", "error", None, "")]) == k8s.EXIT_INFRA


# ---------------------------------------------------------------------- helpers for faults


def _wait_for(ready: Callable[[], bool], timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > end:
            raise TimeoutError("condition not reached")
        time.sleep(0.005)


def _interrupt_main_when(ready: Callable[[], bool]) -> threading.Thread:
    """Ctrl-C (a real SIGINT to the main thread) as soon as ``ready()``."""
    main = threading.main_thread().ident
    assert main is not None

    def fire() -> None:
        try:
            _wait_for(ready)
        except TimeoutError:
            return  # the test then fails: no KeyboardInterrupt
        signal.pthread_kill(main, signal.SIGINT)

    t = threading.Thread(target=fire, daemon=True)
    t.start()
    return t


def _recorder(sleeps: list[float], ctrl_c: bool = False) -> Callable[[float], None]:
    """A sleep that records the delay instead of sleeping; with ``ctrl_c`` a wait in the main
    thread is where the user presses Ctrl-C (again): a real SIGINT."""

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if ctrl_c and threading.current_thread() is threading.main_thread():
            signal.raise_signal(signal.SIGINT)

    return sleep


def _stale_pod(k: KubeStub, job: dict) -> None:
    """The pod of an earlier run of the same cell: it failed (exit 1) with its own report."""
    pod = k.add_pod(job, "stale")
    k.start(pod)
    k.log(pod, "stale line", *_report(job, 1))
    k.finish(pod, 1)


# ---------------------------------------------------------------------- cleanup failures


def test_delete_failing_with_5xx_is_retried_then_reported_and_the_result_kept():
    sleeps: list[float] = []
    setup = lambda k, job: k.fail_next("DELETE job", 503, times=99)  # noqa: E731
    result, out, stub = _run(_completes(0), setup=setup, sleep=_recorder(sleeps))
    assert (result.outcome, result.exit_code, result.junit) == ("passed", 0, JUNIT)
    assert stub.deletes == []  # every DELETE was refused before reaching the Job
    assert _requests(stub, "DELETE", result.name) == 4  # the first try and 3 retries
    assert sleeps == [0.02, 0.04, 0.08]
    assert result.cleanup is not None
    assert "API error 503" in result.cleanup and "gave up after 4 attempts" in result.cleanup
    assert _kubectl(result.name) in result.cleanup
    warning = [line for line in out if "WARNING" in line]
    assert len(warning) == 1 and result.name in warning[0] and _kubectl(result.name) in warning[0]
    assert result.name in stub.jobs


def test_delete_forbidden_is_reported_without_retries_and_the_failure_kept():
    sleeps: list[float] = []
    setup = lambda k, job: k.fail_next("DELETE job", 403, times=99)  # noqa: E731
    result, _, stub = _run(_completes(1), setup=setup, sleep=_recorder(sleeps))
    assert (result.outcome, result.exit_code) == ("failed", 1)  # the cell's own outcome
    assert _requests(stub, "DELETE", result.name) == 1 and sleeps == []
    assert result.cleanup is not None
    assert "forbidden: the launcher needs the Role" in result.cleanup
    assert _kubectl(result.name) in result.cleanup


def test_ctrl_c_with_a_failing_delete_raises_the_interrupt_and_reports_the_job(sigint_raises):
    job = _job()
    name = job["metadata"]["name"]
    out: list[str] = []
    sleeps: list[float] = []
    with KubeStub(_forever) as stub:
        stub.fail_next("DELETE job", 500, times=99)
        launcher = Launcher(
            stub.api_client(),
            "portattn-ci",
            timeouts=FAST,
            emit=out.append,
            sleep=_recorder(sleeps),
        )
        fired = _interrupt_main_when(lambda: _requests(stub, "GET", f"{name}-x1/log") >= 1)
        with pytest.raises(KeyboardInterrupt):
            launcher.run(job)
        fired.join()
        assert _requests(stub, "DELETE", name) == 4 and sleeps == [0.02, 0.04, 0.08]
        assert name in stub.jobs
    assert set(launcher.leftovers) == {name}
    assert _kubectl(name) in launcher.leftovers[name]
    assert any("WARNING" in line and _kubectl(name) in line for line in out)


def test_second_ctrl_c_during_cleanup_reports_the_job_and_propagates(sigint_raises):
    job = _job()
    name = job["metadata"]["name"]
    out: list[str] = []
    sleeps: list[float] = []
    with KubeStub(_forever) as stub:
        stub.fail_next("DELETE job", 503, times=99, headers={"Retry-After": "5"})
        launcher = Launcher(
            stub.api_client(),
            "portattn-ci",
            timeouts=FAST,
            emit=out.append,
            sleep=_recorder(sleeps, ctrl_c=True),  # Ctrl-C again while waiting to retry
        )
        fired = _interrupt_main_when(lambda: _requests(stub, "GET", f"{name}-x1/log") >= 1)
        with pytest.raises(KeyboardInterrupt):
            launcher.run(job)
        fired.join()
        assert _requests(stub, "DELETE", name) == 1 and sleeps == [5.0]
    assert launcher.leftovers[name].startswith("interrupted while deleting it")
    assert any(name in line and _kubectl(name) in line for line in out)


def test_fan_out_deletes_every_job_when_one_delete_fails():
    jobs = [_job(suite=s) for s in ("paged", "mla", "hybrid")]
    names = [j["metadata"]["name"] for j in jobs]
    with KubeStub(_completes(0)) as stub:
        stub.fail_next("DELETE job", 403, times=99, name=names[0])
        launcher = Launcher(stub.api_client(), "portattn-ci", timeouts=FAST, emit=lambda _: None)
        results = launcher.run_many(jobs, max_parallel=3)
    assert [r.outcome for r in results] == ["passed"] * 3
    assert results[0].cleanup is not None and _kubectl(names[0]) in results[0].cleanup
    assert results[1].cleanup is None and results[2].cleanup is None
    assert set(stub.jobs) == {names[0]}
    assert set(launcher.leftovers) == {names[0]}


def test_fan_out_ctrl_c_tries_every_job_when_one_delete_fails(sigint_raises):
    jobs = [_job(suite=s) for s in ("paged", "mla", "hybrid")]
    names = [j["metadata"]["name"] for j in jobs]
    out: list[str] = []
    with KubeStub(_forever) as stub:
        stub.fail_next("DELETE job", 403, times=99, name=names[0])
        launcher = Launcher(stub.api_client(), "portattn-ci", timeouts=FAST, emit=out.append)
        fired = _interrupt_main_when(
            lambda: all(_requests(stub, "GET", f"{n}-x1/log") >= 1 for n in names)
        )
        with pytest.raises(KeyboardInterrupt):
            launcher.run_many(jobs, max_parallel=3)
        fired.join()
        assert set(stub.jobs) == {names[0]}  # the other two were deleted, with their pods
        assert not [p for p in stub.pods if not p.startswith(names[0])]
    assert set(launcher.leftovers) == {names[0]}
    assert any("WARNING" in line and _kubectl(names[0]) in line for line in out)


def test_fan_out_second_ctrl_c_reports_every_job_left_and_propagates(sigint_raises):
    jobs = [_job(suite=s) for s in ("paged", "mla")]
    names = [j["metadata"]["name"] for j in jobs]
    out: list[str] = []
    sleeps: list[float] = []
    with KubeStub(_forever) as stub:
        stub.fail_next("DELETE job", 503, times=999, headers={"Retry-After": "1"})
        launcher = Launcher(
            stub.api_client(),
            "portattn-ci",
            timeouts=FAST,
            emit=out.append,
            sleep=_recorder(sleeps, ctrl_c=True),
        )
        fired = _interrupt_main_when(
            lambda: all(_requests(stub, "GET", f"{n}-x1/log") >= 1 for n in names)
        )
        with pytest.raises(KeyboardInterrupt):
            launcher.run_many(jobs, max_parallel=2)
        fired.join()
        leftovers = dict(launcher.leftovers)  # as the interrupt propagated
        assert set(stub.jobs) == set(names)
    assert set(leftovers) == set(names)
    for name in names:
        assert _kubectl(name) in leftovers[name]
        assert any("WARNING" in line and _kubectl(name) in line for line in out)


def test_cli_reports_a_job_it_could_not_delete(tmp_path, monkeypatch, capsys):
    with KubeStub(_completes(0)) as stub:
        stub.fail_next("DELETE job", 403, times=9)
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: stub\n"
            f"clusters: [{{name: stub, cluster: {{server: 'http://127.0.0.1:{stub.server.server_port}'}}}}]\n"
            "users: [{name: stub, user: {token: t}}]\n"
            "contexts: [{name: stub, context: {cluster: stub, user: stub}}]\n"
        )
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        # The client reads $KUBECONFIG once, at import: point its default there instead.
        monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
        argv = ["--vendor", "rocm", "--suite", "mla", "--commit", "abc1234"]
        code = k8s.main([*argv, "--image", "registry.test/x:1", "--results", str(tmp_path)])
    err = capsys.readouterr().err
    (name,) = stub.jobs
    assert code == 0  # the cell passed; the leftover Job is reported, not a failure
    assert f"job {name} was not deleted: forbidden" in err and _kubectl(name) in err


# ---------------------------------------------------------------------- watch faults


def test_watch_dropped_without_410_lists_again():
    def scenario(k: KubeStub, job: dict) -> None:
        pod = k.add_pod(job)
        _wait_for(lambda: _requests(k, "GET", "/pods", watch=True) >= 1)
        k.start(pod)  # this event is cut mid-line, then the connection breaks
        k.log(pod, *LOG, *_report(job, 0))
        k.finish(pod, 0)

    start = time.monotonic()
    result, out, stub = _run(
        scenario,
        setup=lambda k, job: k.drop_watch(after_events=0),
        timeouts=_fast(watch_s=30, pending_s=30.0),
    )
    assert result.outcome == "passed" and _log_lines(out) == LOG
    assert _requests(stub, "GET", "/pods", watch=False) >= 2  # listed again after the drop
    assert time.monotonic() - start < 10  # at once, not when the 30 s watch would have ended


def test_watch_5xx_is_retried_honouring_retry_after():
    sleeps: list[float] = []
    setup = lambda k, job: k.fail_next(  # noqa: E731
        "GET pods watch", 503, times=2, headers={"Retry-After": "2"}
    )
    result, _, stub = _run(_completes(0), setup=setup, sleep=_recorder(sleeps))
    assert result.outcome == "passed"
    assert sleeps == [2.0, 2.0]
    assert _requests(stub, "GET", "/pods", watch=True) >= 3


def test_watch_5xx_until_the_retries_run_out_fails_the_cell():
    sleeps: list[float] = []
    setup = lambda k, job: k.fail_next("GET pods watch", 500, times=99)  # noqa: E731
    result, _, stub = _run(_completes(0), setup=setup, sleep=_recorder(sleeps))
    assert (result.outcome, result.exit_code) == ("error", None)
    assert result.message.startswith(f"watching the pods of job {result.name}: API error 500")
    assert result.message.endswith("gave up after 4 attempts")
    assert _requests(stub, "GET", "/pods", watch=True) == 4 and sleeps == [0.02, 0.04, 0.08]
    assert stub.deletes == [(result.name, "Foreground")]


# ---------------------------------------------------------------------- retries and Retry-After


def test_retries_running_out_on_create_is_an_error_naming_the_request():
    setup = lambda k, job: k.fail_next("POST jobs", 503, times=99)  # noqa: E731
    result, _, stub = _run(None, setup=setup, sleep=_recorder([]))
    assert result.outcome == "error"
    assert result.message.startswith("create namespaced job: API error 503")
    assert result.message.endswith("gave up after 4 attempts")
    assert _requests(stub, "POST", "/jobs") == 4


def test_retries_running_out_on_dropped_connections_is_an_error():
    setup = lambda k, job: k.lose_response("GET pods", times=99)  # noqa: E731
    result, _, stub = _run(_completes(0), setup=setup, sleep=_recorder([]))
    assert result.outcome == "error"
    assert result.message.startswith("list namespaced pod: the API server is unreachable")
    assert result.message.endswith("gave up after 4 attempts")
    assert _requests(stub, "GET", "/pods", watch=False) == 4
    assert stub.deletes == [(result.name, "Foreground")]


def test_retry_after_is_honoured_and_capped():
    sleeps: list[float] = []

    def setup(k: KubeStub, job: dict) -> None:
        k.fail_next("POST jobs", 429, headers={"Retry-After": "3"})
        k.fail_next("GET pods", 500, headers={"Retry-After": "0"})  # 0: the backoff instead
        k.fail_next("GET log", 503, headers={"Retry-After": "600"})  # cut to the cap
        k.fail_next("DELETE job", 503, headers={"Retry-After": "7"})

    timeouts = _fast(retry_after_max_s=30.0)
    result, out, _ = _run(_completes(0), setup=setup, timeouts=timeouts, sleep=_recorder(sleeps))
    assert result.outcome == "passed" and _log_lines(out) == LOG
    assert sleeps == [3.0, 0.02, 30.0, 7.0]


# ---------------------------------------------------------------------- deadlines


def test_overall_deadline_while_the_log_keeps_streaming():
    start = time.monotonic()
    result, _, stub = _run(_forever, timeouts=_fast(overall_s=0.3))
    assert time.monotonic() - start < 2.0  # the log never ends: only the deadline stops it
    assert result.outcome == "error"
    assert result.message == (
        f"launcher deadline (0.3 s): pod {result.name}-x1 was still writing its log"
    )
    assert stub.deletes == [(result.name, "Foreground")] and not stub.pods


def test_overall_deadline_while_the_pod_is_pending():
    def scenario(k: KubeStub, job: dict) -> None:
        k.add_pod(job)

    def hold(k: KubeStub, job: dict) -> None:
        k.watch_hold_s = 30.0  # the watch outlives its 1 s timeoutSeconds: only the client cuts it

    start = time.monotonic()
    result, _, stub = _run(scenario, setup=hold, timeouts=_fast(overall_s=0.3, pending_s=30.0))
    assert time.monotonic() - start < 3.0  # the client cut the watch at the 0.3 s deadline
    assert result.outcome == "error"
    assert result.message == (
        f"launcher deadline (0.3 s): job {result.name} still had no running pod "
        f"({result.name}-x1 pending)"
    )
    assert stub.deletes == [(result.name, "Foreground")]


def test_idle_log_checks_the_pod_and_reads_again():
    def scenario(k: KubeStub, job: dict) -> None:
        pod = k.add_pod(job)
        k.start(pod)
        k.log(pod, *LOG[:5])
        k.wait_log_readers(pod, 2)  # silent until the launcher's idle timeout reconnects
        k.log(pod, *LOG[5:], *_report(job, 0))
        k.finish(pod, 0)

    result, out, stub = _run(scenario, timeouts=_fast(log_idle_s=0.2))
    assert result.outcome == "passed" and result.junit == JUNIT
    assert _log_lines(out) == LOG  # nothing twice after the reconnect
    assert f"kubematrix: no log output from {result.name}-x1 for 0.2 s (pod running); " in "".join(
        out
    )


# ---------------------------------------------------------------------- 409 on a stale Job


def test_409_on_a_job_being_deleted_waits_for_it_and_creates_a_fresh_one():
    sleeps: list[float] = []

    def setup(k: KubeStub, job: dict) -> None:
        k.seed_job(job, annotations={RUN_ANNOTATION: "an-earlier-run"})
        _stale_pod(k, job)
        k.mark_terminating(job["metadata"]["name"], gets=3)

    result, out, stub = _run(_completes(0), setup=setup, sleep=_recorder(sleeps))
    assert (result.outcome, result.exit_code, result.attached) == ("passed", 0, False)
    assert _log_lines(out) == LOG  # nothing of the stale pod
    assert any("is being deleted" in line for line in out)
    assert _requests(stub, "POST", "/jobs") == 2
    assert sleeps == [0.02, 0.04]  # read 3 times (409, then polled) until it was gone
    assert stub.deletes == [(result.name, "Foreground")]  # only this run's Job, at the end


def test_409_on_a_job_finished_in_another_run_replaces_it():
    def setup(k: KubeStub, job: dict) -> None:
        k.seed_job(job)  # e.g. applied by hand with kubectl: no launcher-run annotation
        _stale_pod(k, job)  # finished: the Job's condition is Failed
        k.delete_linger_gets = 1  # a foreground delete takes a moment

    result, out, stub = _run(_completes(0), setup=setup, sleep=_recorder([]))
    assert (result.outcome, result.exit_code, result.attached) == ("passed", 0, False)
    assert result.junit == JUNIT and _log_lines(out) == LOG
    assert any("finished (Failed) in another run (launcher run none)" in line for line in out)
    assert stub.deletes == [(result.name, "Foreground")] * 2  # the stale Job, then this one
    assert _requests(stub, "POST", "/jobs") == 2


def test_409_on_this_runs_own_job_after_a_lost_response_follows_it():
    sleeps: list[float] = []
    setup = lambda k, job: k.lose_response("POST jobs")  # noqa: E731
    result, out, stub = _run(_completes(0), setup=setup, sleep=_recorder(sleeps))
    assert (result.outcome, result.attached) == ("passed", False)
    assert _log_lines(out) == LOG
    assert any("was created by this run; following it" in line for line in out)
    assert _requests(stub, "POST", "/jobs") == 2 and sleeps == [0.02]
    assert stub.deletes == [(result.name, "Foreground")]  # not replaced: it is ours


def test_409_on_a_job_stuck_terminating_fails_naming_the_job():
    def setup(k: KubeStub, job: dict) -> None:
        k.seed_job(job, annotations={RUN_ANNOTATION: "an-earlier-run"})
        k.mark_terminating(job["metadata"]["name"], gets=10**9)

    result, _, stub = _run(None, setup=setup, timeouts=_fast(pending_s=0.1))
    assert result.outcome == "error"
    assert result.message.startswith(f"job {result.name} is still being deleted (since ")
    assert f"a finalizer may hold it: kubectl -n portattn-ci get job {result.name} -o yaml" in (
        result.message
    )
    assert _requests(stub, "POST", "/jobs") == 1


def _ctrl_c_now(launcher: Launcher) -> Callable[[], None]:
    """Ctrl-C (a real SIGINT to the main thread), returning once the main thread has set the
    launcher's cancel and had time to shut the open streams down: run by the stub while a
    request waits for its answer, it puts the Ctrl-C between the request and its response."""
    main = threading.main_thread().ident
    assert main is not None

    def press() -> None:
        signal.pthread_kill(main, signal.SIGINT)
        _wait_for(launcher.cancel.is_set, timeout=5.0)
        time.sleep(0.2)  # _abort_streams has run: the response about to open was not in it

    return press


@pytest.mark.parametrize("route", ["GET log", "GET pods watch"])
def test_fan_out_ctrl_c_while_a_stream_is_being_opened_does_not_wait_for_it(sigint_raises, route):
    """The Ctrl-C lands between a stream's request and its response (the abort's snapshot
    cannot see the response yet). The stub keeps stream connections alive, as an API server
    does: a response left open would also hold up the cleanup's next request on its socket."""

    def silent(k: KubeStub, job: dict) -> None:
        k.start(k.add_pod(job))  # runs, prints nothing

    job = _job()
    name = job["metadata"]["name"]
    slow = _fast(log_idle_s=30.0, watch_s=30, pending_s=30.0, overall_s=60.0)
    with KubeStub(silent if route == "GET log" else None) as stub:
        stub.keep_alive_streams = True
        if route == "GET log":  # the Job stays (403): its pod's log is never closed
            stub.fail_next("DELETE job", 403, times=99, name=name)
        launcher = Launcher(stub.api_client(), "portattn-ci", timeouts=slow, emit=lambda _: None)
        stub.before_answering(route, _ctrl_c_now(launcher))
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            launcher.run_many([job], max_parallel=1)
        # Not the 30 s read timeout of the stream opened after the abort's snapshot, nor the
        # 5 s request timeout of a DELETE sent into that stream's connection.
        assert time.monotonic() - start < 3.0
        if route == "GET log":
            assert set(stub.jobs) == {name} and set(launcher.leftovers) == {name}
        else:
            assert not stub.jobs and not launcher.leftovers
            assert set(stub.deletes) == {(name, "Foreground")}


def test_fan_out_ctrl_c_does_not_wait_for_silent_logs(sigint_raises):
    def silent(k: KubeStub, job: dict) -> None:
        k.start(k.add_pod(job))  # runs, prints nothing: the launcher blocks reading its log

    jobs = [_job(suite=s) for s in ("paged", "mla")]
    names = [j["metadata"]["name"] for j in jobs]
    with KubeStub(silent) as stub:
        stub.fail_next("DELETE job", 403, times=99, name=names[0])  # its log is never closed
        launcher = Launcher(
            stub.api_client(), "portattn-ci", timeouts=_fast(log_idle_s=30.0), emit=lambda _: None
        )
        fired = _interrupt_main_when(
            lambda: all(_requests(stub, "GET", f"{n}-x1/log") >= 1 for n in names)
        )
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            launcher.run_many(jobs, max_parallel=2)
        fired.join()
        assert time.monotonic() - start < 2.0  # not the 30 s read timeout of the silent log
        assert set(stub.jobs) == {names[0]}
    assert set(launcher.leftovers) == {names[0]}


# ---------------------------------------------------------------------- a node clock steps back


def test_log_lines_stamped_before_earlier_ones_are_kept():
    def scenario(k: KubeStub, job: dict) -> None:
        pod = k.add_pod(job)
        k.start(pod)
        k.log(pod, *LOG[:5])
        k.step_clock(-3600)  # the node's clock is set back an hour
        k.log(pod, *LOG[5:], *_report(job, 0))
        k.finish(pod, 0)

    result, out, _ = _run(scenario)
    assert (result.outcome, result.junit) == ("passed", JUNIT)
    assert _log_lines(out) == LOG


def test_a_reconnect_after_a_clock_step_neither_repeats_nor_drops_lines():
    def scenario(k: KubeStub, job: dict) -> None:
        pod = k.add_pod(job)
        k.cut_log(pod, after_lines=7)  # the first connection breaks after the step
        k.start(pod)
        k.log(pod, *LOG[:3])
        k.step_clock(-3600)
        k.log(pod, *LOG[3:], *_report(job, 0))
        k.finish(pod, 0)

    result, out, stub = _run(scenario)
    assert (result.outcome, result.junit) == ("passed", JUNIT)
    assert _log_lines(out) == LOG  # each line once, whatever its stamp
    assert _requests(stub, "GET", "/log") == 2


def test_exit_0_without_a_junit_report_is_an_error_not_a_pass():
    def scenario(k: KubeStub, job: dict) -> None:
        pod = k.add_pod(job)
        k.start(pod)
        k.log(pod, *LOG)  # no report: the session never reached pytest, or it was lost
        k.finish(pod, 0)

    result, _, _ = _run(scenario)
    assert (result.outcome, result.exit_code, result.junit) == ("error", 0, None)
    assert result.message == "exit code 0; no JUnit report in the log"
    assert k8s.exit_status([result]) == k8s.EXIT_INFRA


def _stub_kubeconfig(stub: KubeStub, tmp_path, monkeypatch) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: stub\n"
        f"clusters: [{{name: stub, cluster: {{server: 'http://127.0.0.1:{stub.server.server_port}'}}}}]\n"
        "users: [{name: stub, user: {token: t}}]\n"
        "contexts: [{name: stub, context: {cluster: stub, user: stub}}]\n"
    )
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    # The client reads $KUBECONFIG once, at import: point its default there instead.
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))


def test_cli_does_not_exit_0_for_a_cell_without_a_junit_report(tmp_path, monkeypatch, capsys):
    def scenario(k: KubeStub, job: dict) -> None:
        pod = k.add_pod(job)
        k.start(pod)
        k.log(pod, "collected 0 items / the report went missing")
        k.finish(pod, 0)

    with KubeStub(scenario) as stub:
        _stub_kubeconfig(stub, tmp_path, monkeypatch)
        argv = ["--vendor", "rocm", "--suite", "mla", "--commit", "abc1234"]
        code = k8s.main([*argv, "--image", "registry.test/x:1", "--results", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == k8s.EXIT_INFRA
    assert ": error (exit code 0; no JUnit report in the log)" in out


def test_cli_does_not_exit_0_for_a_cell_whose_tests_were_all_skipped(tmp_path, monkeypatch,
                                                                     capsys):  # fmt: skip
    """Exit code 0 with a JUnit report of skipped tests only was printed "passed", exit 0,
    where the matrix runner calls the same run skipped: nothing was tested."""

    def scenario(k: KubeStub, job: dict) -> None:
        pod = k.add_pod(job)
        k.start(pod)
        k.log(pod, *encode_results(SKIPPED_JUNIT, results_token(job["metadata"]["name"]), 0))
        k.finish(pod, 0)

    with KubeStub(scenario) as stub:
        _stub_kubeconfig(stub, tmp_path, monkeypatch)
        argv = ["--vendor", "rocm", "--suite", "mla", "--commit", "abc1234"]
        code = k8s.main([*argv, "--image", "registry.test/x:1", "--results", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == k8s.EXIT_NOTHING_TESTED
    assert ": no test passed (all skipped) (exit code 0" in captured.out
    assert "passed no test; exit status 4" in captured.err


def test_exit_status_is_never_0_unless_every_cell_passed():
    from kubematrix.launcher import CellResult

    assert k8s.exit_status([CellResult("a", "failed", None, "")]) != 0
    assert k8s.exit_status([CellResult("a", "failed", 0, "")]) != 0
    assert k8s.exit_status([CellResult("a", "passed", 0, ""), CellResult("b", "x", 0, "")]) != 0


# ---------------------------------------------------------------------- answers that are not JSON


def test_an_html_page_instead_of_json_is_an_error_and_no_delete_is_claimed():
    def setup(k: KubeStub, job: dict) -> None:
        k.answer_html("POST jobs", times=99)  # an authenticating proxy answers everything
        k.answer_html("DELETE job", times=99)

    result, out, stub = _run(None, setup=setup, sleep=_recorder([]))
    assert (result.outcome, result.exit_code) == ("error", None)
    assert result.message.startswith(
        "create namespaced job: the API server's answer is not JSON (HTTP 200, text/html"
    )
    assert "Sign in" in result.message and "proxy" in result.message
    assert _requests(stub, "POST", "/jobs") == 1  # a page does not change: no retries
    assert not any("deleted job" in line for line in out)
    assert result.cleanup is not None and "may still exist" in result.cleanup
    assert _kubectl(result.name) in result.cleanup


def test_an_html_page_on_a_read_is_an_error_and_the_job_is_deleted():
    setup = lambda k, job: k.answer_html("GET pods", times=99)  # noqa: E731
    result, out, stub = _run(_completes(0), setup=setup)
    assert result.outcome == "error"
    assert result.message.startswith("list namespaced pod: the API server's answer is not JSON")
    assert stub.deletes == [(result.name, "Foreground")] and result.cleanup is None


# ---------------------------------------------------------------------- a log cut every time


def test_a_log_cut_every_time_backs_off_and_gives_up_after_the_budget():
    def scenario(k: KubeStub, job: dict) -> None:
        pod = k.add_pod(job)
        k.cut_log_always(pod, after_lines=0)
        k.start(pod)
        k.log(pod, *LOG)

    sleeps: list[float] = []
    start = time.monotonic()
    timeouts = _fast(log_reconnects=4, max_backoff_s=0.05, overall_s=5.0)
    result, out, stub = _run(scenario, timeouts=timeouts, sleep=_recorder(sleeps))
    assert time.monotonic() - start < 3.0
    assert result.outcome == "error"
    assert result.message == (
        f"the log stream of pod {result.name}-x1 ended 4 times in a row without a new line "
        "(pod running); giving up: is a proxy cutting long requests?"
    )
    assert _requests(stub, "GET", "/log") == 4
    assert sleeps == [0.02, 0.04, 0.05]  # backoff between the reconnects, capped
    assert stub.deletes == [(result.name, "Foreground")]


def test_log_cuts_that_bring_new_lines_do_not_use_up_the_budget():
    def scenario(k: KubeStub, job: dict) -> None:
        pod = k.add_pod(job)
        for n in range(1, 6):  # five connections, each cut after one more line
            k.cut_log(pod, after_lines=n)
        k.start(pod)
        k.log(pod, *LOG, *_report(job, 0))
        k.finish(pod, 0)

    sleeps: list[float] = []
    result, out, stub = _run(scenario, timeouts=_fast(log_reconnects=2), sleep=_recorder(sleeps))
    assert (result.outcome, result.junit) == ("passed", JUNIT)
    assert _log_lines(out) == LOG
    assert _requests(stub, "GET", "/log") == 6 and sleeps == []


# ---------------------------------------------------------------------- deleted by someone else


def test_a_job_deleted_by_someone_else_while_running_says_so():
    def scenario(k: KubeStub, job: dict) -> None:
        pod = k.add_pod(job)
        k.start(pod)
        k.log(pod, *LOG[:3])
        k.wait_log_readers(pod, 1)
        k.delete_job(job["metadata"]["name"], "Background")  # kubectl delete job

    result, out, stub = _run(scenario)
    assert (result.outcome, result.exit_code) == ("error", None)
    assert result.message == (
        f"job {result.name} was deleted by someone else (not this launcher) while its pod "
        f"{result.name}-x1 was running; its result is lost"
    )
    assert _log_lines(out) == LOG[:3] and result.cleanup is None


def test_a_job_deleted_by_someone_else_while_pending_says_so_at_once():
    def scenario(k: KubeStub, job: dict) -> None:
        k.add_pod(job)
        _wait_for(lambda: _requests(k, "GET", "/pods", watch=True) >= 1)
        k.delete_job(job["metadata"]["name"], "Background")

    start = time.monotonic()
    result, _, _ = _run(scenario, timeouts=_fast(pending_s=30.0, watch_s=30))
    assert time.monotonic() - start < 3.0  # not the 30 s pending timeout
    assert result.outcome == "error"
    assert result.message == (
        f"job {result.name} was deleted by someone else (not this launcher) while its pod "
        f"{result.name}-x1 was pending; its result is lost"
    )


def test_a_job_deleted_before_its_pod_appeared_is_noticed_within_a_watch_period():
    def scenario(k: KubeStub, job: dict) -> None:
        _wait_for(lambda: _requests(k, "GET", "/pods", watch=True) >= 1)
        k.delete_job(job["metadata"]["name"], "Background")  # the controller made no pod yet

    start = time.monotonic()
    result, _, _ = _run(scenario, timeouts=_fast(pending_s=30.0, watch_s=1))
    assert time.monotonic() - start < 5.0
    assert result.message == (
        f"job {result.name} was deleted by someone else (not this launcher) while no pod of it "
        "had started; its result is lost"
    )


def test_a_pod_deleted_by_someone_else_is_replaced_and_followed():
    def scenario(k: KubeStub, job: dict) -> None:
        first = k.add_pod(job, "aaaaa")
        k.start(first)
        k.log(first, "first pod")
        k.wait_log_readers(first, 1)
        time.sleep(0.1)
        k.delete_pod(first)  # kubectl delete pod: the Job makes another
        second = k.add_pod(job, "bbbbb")
        k.start(second)
        k.log(second, "second pod", *_report(job, 0))
        k.finish(second, 0)

    result, out, _ = _run(scenario)
    assert (result.outcome, result.junit) == ("passed", JUNIT)
    assert _log_lines(out) == ["first pod", "second pod"]
    assert any(f"pod {result.name}-aaaaa was deleted (not by this launcher)" in x for x in out)


PARTIAL_JUNIT = (
    b'<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="3">'
    + b"".join(b'<testcase classname="t" name="early%d"/>' % i for i in range(3))
    + b"</testsuite></testsuites>"
)


def _evicted_after_a_partial_report(k: KubeStub, job: dict) -> str:
    """The first pod is evicted after printing a partial report (pytest interrupted by the
    SIGTERM writes one); returns the Job's replacement pod, started."""
    first = k.add_pod(job, "aaaaa")
    k.start(first)
    k.log(first, *encode_results(PARTIAL_JUNIT, results_token(job["metadata"]["name"]), 2))
    k.evict(first)
    second = k.add_pod(job, "bbbbb")
    k.start(second)
    return second


@pytest.mark.parametrize(("code", "reason"), [(0, None), (137, "OOMKilled")])
def test_a_replaced_pods_report_is_never_the_cells_result(code, reason):
    """The replacement pod's own report judges the cell: one that printed none (killed, or its
    log lost) is no pass, whatever the evicted pod printed before."""

    def scenario(k: KubeStub, job: dict) -> None:
        second = _evicted_after_a_partial_report(k, job)
        k.log(second, "running")
        k.finish(second, code, reason=reason)

    result, _, _ = _run(scenario)
    assert result.junit is None and result.outcome in ("error", "failed")
    assert result.message.endswith("no JUnit report in the log")
    if reason:
        assert result.termination.startswith("OOMKilled")


def test_the_replacement_pods_report_is_the_cells_result():
    def scenario(k: KubeStub, job: dict) -> None:
        second = _evicted_after_a_partial_report(k, job)
        k.log(second, *_report(job, 0))
        k.finish(second, 0)

    result, _, _ = _run(scenario)
    assert (result.outcome, result.junit) == ("passed", JUNIT)


def test_test_output_that_looks_like_a_report_marker_is_printed():
    """Only the Job's own token opens the report block that is kept out of the echo."""
    shown = ["KUBEMATRIX-RESULTS-BEGIN manual", "FAILED t::test_kernel", "KUBEMATRIX-CACHE x {}"]
    result, out, _ = _run(_completes(0, log=shown))
    assert result.outcome == "passed"
    assert _log_lines(out) == shown


def test_oom_killed_is_reported_with_its_reason():
    def scenario(k: KubeStub, job: dict) -> None:
        pod = k.add_pod(job)
        k.start(pod)
        k.log(pod, *LOG[:2])
        k.finish(pod, 137, reason="OOMKilled")

    result, _, _ = _run(scenario)
    assert (result.outcome, result.exit_code) == ("failed", 137)
    assert result.message == (
        "exit code 137 (OOMKilled: the container went over its memory limit); "
        "no JUnit report in the log"
    )


# ---------------------------------------------------------------------- a create that never was


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_api_server_is_an_error_and_no_job_is_reported_left():
    cfg = client.Configuration(host=f"http://127.0.0.1:{_closed_port()}")
    cfg.retries = False
    out: list[str] = []
    launcher = Launcher(
        client.ApiClient(cfg), "portattn-ci", timeouts=FAST, emit=out.append, sleep=_recorder([])
    )
    result = launcher.run(_job())
    assert result.outcome == "error"
    assert result.message.startswith("create namespaced job: the API server is unreachable")
    assert result.message.endswith("gave up after 4 attempts")
    assert result.cleanup is None and not launcher.leftovers
    assert not any("WARNING" in line or "not deleted" in line for line in out)


@pytest.mark.parametrize("code", [401, 403])
def test_a_refused_create_deletes_nothing_and_warns_of_nothing(code):
    setup = lambda k, job: k.fail_next("POST jobs", code, times=9)  # noqa: E731
    result, out, stub = _run(None, setup=setup)
    assert result.outcome == "error"
    assert _requests(stub, "DELETE", result.name) == 0
    assert result.cleanup is None
    assert not any("WARNING" in line for line in out)


def test_a_create_whose_answer_was_lost_is_still_cleaned_up():
    def setup(k: KubeStub, job: dict) -> None:
        k.lose_response("POST jobs", times=99)  # carried out every time, never answered

    result, _, stub = _run(None, setup=setup, sleep=_recorder([]))
    assert result.outcome == "error"
    assert stub.deletes == [(result.name, "Foreground")] and not stub.jobs


# ---------------------------------------------------------------------- huge lines


def test_a_20_mb_log_line_is_read_in_linear_time():
    huge = "x" * (20 << 20)

    def scenario(k: KubeStub, job: dict) -> None:
        pod = k.add_pod(job)
        k.start(pod)
        k.log(pod, "before", huge, "after", *_report(job, 0))
        k.finish(pod, 0)

    start = time.monotonic()
    result, out, _ = _run(scenario)
    assert time.monotonic() - start < 4.0  # quadratic reading took 8 s
    assert (result.outcome, result.junit) == ("passed", JUNIT)
    assert _log_lines(out) == ["before", huge, "after"]


def test_log_cursor_aligns_a_rotated_log_and_counts_a_gap():
    from kubematrix.launcher import _LogCursor

    cursor = _LogCursor()
    lines = [(f"2026-01-01T00:00:0{i}Z", f"l{i}") for i in range(6)]
    assert [cursor.admit(*x) for x in lines[:4]] == [True] * 4
    cursor.reconnect()  # the kubelet rotated the file: the log now starts at l2
    assert [cursor.admit(*x) for x in lines[2:]] == [False, False, True, True]
    assert cursor.gaps == 0
    cursor.reconnect()  # rotated past everything printed: new lines, and a gap is counted
    assert cursor.admit("2026-01-01T00:00:09Z", "l9") and cursor.gaps == 1
