"""The launcher against a loopback Kubernetes API (tests/ci/kube_stub.py), over real HTTP."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from kubematrix import k8s
from kubematrix.cell import encode_results
from kubematrix.launcher import Launcher, Timeouts, classify_pod
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
JUNIT = b'<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="1"/></testsuites>'
LOG = [f"line {i}" for i in range(10)]


def _job(suite: str = "mla", commit: str = "abc1234", vendor: str = "rocm") -> dict:
    return render_job(
        vendor=vendor, suite=suite, image="registry.test/portattn-ci:rocm", commit=commit
    )


def _report(job: dict, exit_code: int) -> list[str]:
    return encode_results(JUNIT, results_token(job["metadata"]["name"]), exit_code)


def _run(scenario, job=None, timeouts=FAST, setup=None):
    job = job or _job()
    out: list[str] = []
    with KubeStub(scenario) as stub:
        if setup:
            setup(stub, job)
        launcher = Launcher(stub.api_client(), "portattn-ci", timeouts=timeouts, emit=out.append)
        result = launcher.run(job)
    return result, out, stub


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
    assert "forbidden: the launcher needs the Role in k8s/base/rbac.yaml" in result.message
    assert len([m for m, _, _ in stub.requests if m == "POST"]) == 1


def test_409_attaches_to_the_running_job():
    def setup(k: KubeStub, job: dict) -> None:
        k.create_job(job)  # launched earlier, e.g. by a retried CI step

    result, out, stub = _run(_completes(0), setup=setup)
    assert result.attached and result.outcome == "passed"
    assert _log_lines(out) == LOG
    assert any("already exists; attaching" in line for line in out)


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


def test_classify_pod_states():
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


def test_exit_status_propagates_the_first_failing_code():
    from kubematrix.launcher import CellResult

    ok = CellResult("a", "passed", 0, "")
    assert k8s.exit_status([ok]) == 0
    assert k8s.exit_status([ok, CellResult("b", "failed", 2, "")]) == 2
    assert k8s.exit_status([ok, CellResult("c", "error", None, "")]) == k8s.EXIT_INFRA
