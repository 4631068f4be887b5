"""The matrix as data, what each runner can run, and the local runner end to end."""

from __future__ import annotations

import fnmatch
import glob
import io
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from kubernetes.config import kube_config
from nox.project import load_toml  # tomllib is 3.11+; the project supports 3.10

from kubematrix import matrix, report
from kubematrix.__main__ import main
from kubematrix.local import cell_command, run_local
from kubematrix.matrix import BACKENDS, SUITES, Host, all_cells, get_cell, select_cells

pytestmark = pytest.mark.ci

ROOT = Path(__file__).resolve().parents[2]
# docs/design.md §3's architectures (the CI layer may not import portattn.platform).
KNOWN_ARCHS = {"sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120", "gfx90a", "gfx942", "gfx950"}
NO_GPU = Host(device_nodes=frozenset(), gpu_arch={}, compile_module=True)
H100 = Host(frozenset({"/dev/nvidia[0-9]*"}), {"cuda": "sm_90"}, compile_module=True)
A100 = Host(frozenset({"/dev/nvidia[0-9]*"}), {"cuda": "sm_80"}, compile_module=True)
MI300_UNKNOWN_ARCH = Host(frozenset({"/dev/kfd"}), {"rocm": None}, compile_module=True)


def test_every_suite_is_a_registered_marker():
    markers = load_toml(ROOT / "pyproject.toml")["tool"]["pytest"]["ini_options"]
    registered = {m.split(":")[0] for m in markers["markers"]}
    assert set(SUITES) <= registered


def test_cells_cover_suite_x_backend_x_target():
    names = [c.name for c in all_cells()]
    assert len(names) == len(set(names))
    expected = {
        (s.name, b, t)
        for s in SUITES.values()
        for b in s.backends
        for t in (BACKENDS[b].targets or (None,))
    }
    assert {(c.suite, c.backend, c.target) for c in all_cells()} == expected
    # The kernel suites run on every backend; policy and compile gain nothing from a GPU.
    for suite in ("paged", "mla", "hybrid", "specdec"):
        assert set(SUITES[suite].backends) == set(BACKENDS)
    for suite in ("policy", "compile"):
        assert SUITES[suite].backends == ("cpu-interpreter",)


def test_cell_names_are_buildkite_keys_and_targets_are_known_archs():
    for cell in all_cells():
        assert re.fullmatch(r"[a-z0-9_\-]+", cell.name), cell.name
        assert (cell.target is None) == (not cell.spec.is_gpu)
        if cell.target:
            assert cell.target in KNOWN_ARCHS


def test_experimental_cells_are_rocm_hybrid_and_the_pools_not_yet_run():
    experimental = {c.name for c in all_cells() if c.experimental}
    new_pools = {c.name for c in all_cells() if c.target in ("sm_100", "gfx950")}
    assert len(new_pools) == 8
    assert experimental == {"hybrid-rocm-gfx942"} | new_pools


def test_gpu_cells_name_their_architecture_in_the_environment():
    for cell in all_cells():
        if cell.spec.is_gpu:
            assert cell.env[matrix.ARCH_ENV] == cell.target
        else:
            assert matrix.ARCH_ENV not in cell.env
    assert [a.name for a in BACKENDS["cuda"].archs] == ["sm_90", "sm_100"]
    assert [a.name for a in BACKENDS["rocm"].archs] == ["gfx942", "gfx950"]


def test_each_cell_knows_its_nox_command_markers_env_and_gpu_resource():
    cpu, gpu, comp = (
        get_cell("mla-cpu-interpreter"),
        get_cell("mla-rocm-gfx942"),
        get_cell("compile-cpu-interpreter"),
    )
    junit = "--junitxml=r/mla-cpu-interpreter.xml"
    assert cpu.nox_command("r") == ["nox", "-s", "mla", "--", junit]
    assert cpu.pytest_args("r")[1:3] == ["-m", "mla and not gpu"]
    assert cpu.env == {"TRITON_INTERPRET": "1"}
    assert gpu.pytest_args("r")[1:3] == ["-m", "mla and not cpu"]
    assert gpu.spec.gpu_resource == "amd.com/gpu" and gpu.env == {matrix.ARCH_ENV: "gfx942"}
    assert get_cell("mla-cuda-sm_90").spec.gpu_resource == "nvidia.com/gpu"
    assert comp.nox_command("r") == ["nox", "-s", "compile", "--", "--out", "r/compile"]
    assert gpu.nox_args() == []  # a Kubernetes Job's JUnit path is the launcher's


def test_every_cell_session_exists_in_the_noxfile():
    out = subprocess.run(
        [sys.executable, "-m", "nox", "--list"], cwd=ROOT, capture_output=True, text=True
    ).stdout
    sessions = set(re.findall(r"^[*-] (\S+)", out, flags=re.M))
    assert {c.nox_session for c in all_cells()} <= sessions
    assert {"matrix", "pipeline", "report"} <= sessions


def test_local_runner_runs_cpu_cells_and_says_why_not_gpu_cells():
    cpu, gpu = get_cell("paged-cpu-interpreter"), get_cell("paged-cuda-sm_90")
    assert matrix.why_not_runnable(cpu, "local", NO_GPU) is None
    assert matrix.why_not_runnable(gpu, "local", NO_GPU) == (
        "no GPU (cuda): none of /dev/nvidia[0-9]* on this machine"
    )
    assert matrix.why_not_runnable(gpu, "local", H100) is None
    assert matrix.why_not_runnable(gpu, "local", A100) == (
        "local cuda GPU is sm_80, the cell targets sm_90"
    )
    # An arch the vendor tool cannot tell does not stop the cell.
    assert matrix.why_not_runnable(get_cell("mla-rocm-gfx942"), "local", MI300_UNKNOWN_ARCH) is None
    assert matrix.why_not_runnable(get_cell("mla-rocm-gfx942"), "local", H100).startswith(
        "no GPU (rocm)"
    )


def test_k8s_runner_runs_gpu_cells_and_nobody_runs_a_missing_compile_module():
    no_compile = Host(frozenset(), {}, compile_module=False)
    assert matrix.why_not_runnable(get_cell("mla-cuda-sm_90"), "k8s", NO_GPU) is None
    for runner in matrix.RUNNERS:
        why = matrix.why_not_runnable(get_cell("compile-cpu-interpreter"), runner, no_compile)
        assert why == "portattn.compile not available"
    with pytest.raises(ValueError, match=r"why_not_runnable: runner must be one of .*; got 'ssh'"):
        matrix.why_not_runnable(get_cell("mla-cuda-sm_90"), "ssh", NO_GPU)


def test_a_pytest_cell_that_runs_here_needs_pytest_here():
    """`list` called a CPU cell "runs here" on a plain install; `matrix` then failed it with
    "No module named pytest"."""
    bare = Host(frozenset({"/dev/nvidia[0-9]*"}), {"cuda": "sm_90"}, True, pytest=False)
    why = "pytest and pytest-xdist are not installed here (pip install 'portattn[test]')"
    for runner in matrix.RUNNERS:  # the k8s runner runs the CPU cells here too
        assert matrix.why_not_runnable(get_cell("paged-cpu-interpreter"), runner, bare) == why
        assert matrix.why_not_runnable(get_cell("compile-cpu-interpreter"), runner, bare) is None
    assert matrix.why_not_runnable(get_cell("mla-cuda-sm_90"), "local", bare) == why
    assert matrix.why_not_runnable(get_cell("mla-cuda-sm_90"), "k8s", bare) is None  # in its pod
    assert matrix.why_not_runnable(get_cell("mla-cuda-sm_90"), "local", NO_GPU).startswith("no GPU")
    assert Host.probe().pytest  # this process runs pytest


def test_compile_module_is_found_on_disk_without_importing_portattn():
    assert matrix.compile_module_available() == (ROOT / "src/portattn/compile").is_dir()


def test_cells_are_selected_by_suite_backend_and_name_and_unknown_ones_refused():
    assert [c.name for c in select_cells(all_cells(), suites=["policy"])] == [
        "policy-cpu-interpreter"
    ]
    rocm = select_cells(all_cells(), backends=["rocm"])
    assert {c.suite for c in rocm} == {"paged", "mla", "hybrid", "specdec"}
    with pytest.raises(
        ValueError,
        match=r"^--suite must be .*got \['attn'\]; --backend must be .*"
        r"got \['tpu'\]; --cell must be .*got \['x'\]",
    ):
        select_cells(all_cells(), suites=["attn"], backends=["tpu"], names=["x"])
    with pytest.raises(ValueError, match=r"get_cell: name must be one of .*; got 'mla-cuda'"):
        get_cell("mla-cuda")


# -- the local runner, end to end on a throwaway project ---------------------------------------

TOY_TESTS = {
    "pytest.ini": """
        [pytest]
        markers =
            policy: p
            mla: m
            specdec: s
            hybrid: h
            gpu: g
    """,
    "test_toy.py": """
        import os
        import pytest

        @pytest.mark.policy
        def test_policy_ok():
            assert os.environ["TRITON_INTERPRET"] == "1"

        @pytest.mark.policy
        @pytest.mark.skip(reason="not here")
        def test_policy_skipped():
            pass

        @pytest.mark.policy
        @pytest.mark.gpu
        def test_policy_needs_gpu():
            raise AssertionError("gpu tests are deselected on CPU cells")

        @pytest.mark.mla
        def test_mla_broken():
            assert 1 == 2, "the runner must report this"

        @pytest.mark.hybrid
        def test_hybrid_hangs():
            import time
            time.sleep(120)
    """,
}


@pytest.fixture
def toy_project(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # the toy needs no plugin: faster
    project = tmp_path / "project"
    project.mkdir()
    for name, text in TOY_TESTS.items():
        (project / name).write_text(textwrap.dedent(text))
    return project


def test_run_local_reports_pass_fail_empty_and_not_run(tmp_path, toy_project):
    cells = [
        get_cell("policy-cpu-interpreter"),
        get_cell("mla-cpu-interpreter"),
        get_cell("specdec-cpu-interpreter"),
        get_cell("mla-cuda-sm_90"),
        get_cell("compile-cpu-interpreter"),
    ]
    out, progress = tmp_path / "results", io.StringIO()
    host = Host(frozenset(), {}, compile_module=False)
    results = run_local(cells, out, workers=1, host=host, stream=progress, cwd=toy_project)
    by = {r.cell: r for r in results}

    policy = by["policy-cpu-interpreter"]
    assert (policy.status, policy.counts.passed, policy.counts.skipped) == ("passed", 1, 1)
    mla = by["mla-cpu-interpreter"]
    assert (mla.status, mla.counts.failed) == ("failed", 1)
    assert "test_mla_broken" in mla.counts.failures[0].test
    assert "the runner must report this" in mla.counts.failures[0].message
    assert by["specdec-cpu-interpreter"].status == "not run"
    assert by["specdec-cpu-interpreter"].reason == "no test matches -m 'specdec and not gpu'"
    assert by["mla-cuda-sm_90"].reason.startswith("no GPU (cuda)")
    assert by["compile-cpu-interpreter"].reason == "portattn.compile not available"
    assert not any(r.status == "passed" for r in results if r.cell != policy.cell)

    for cell in cells:  # a JUnit, a record and (for what ran) a log per cell
        assert (out / f"{cell.name}.xml").is_file() and (out / f"{cell.name}.json").is_file()
    assert (out / "mla-cpu-interpreter.log").read_text().startswith("$ ")
    text = progress.getvalue()
    assert "runner local runs 3" in text
    assert "[2/3] mla-cpu-interpreter: failed (0 passed, 1 failed, 0 skipped)" in text


def _no_kubeconfig(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    # The client reads $KUBECONFIG once, at import: point its default there instead.
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "missing"))


def test_k8s_runner_without_a_cluster_reports_errors_never_passes(tmp_path, monkeypatch, capsys):
    _no_kubeconfig(tmp_path, monkeypatch)
    args = ["matrix", "--runner", "k8s", "--suite", "mla", "--backend", "cuda"]
    assert main([*args, "--results", str(tmp_path / "r")]) == 2
    (record,) = report.collect([get_cell("mla-cuda-sm_90")], tmp_path / "r")
    assert record.status == "error" and "no cluster" in record.reason
    assert capsys.readouterr().out.splitlines()[-1].startswith("matrix: failed (wall time ")


def test_k8s_runner_checks_the_cluster_before_running_any_cell(tmp_path, monkeypatch, capsys):
    _no_kubeconfig(tmp_path, monkeypatch)
    out = tmp_path / "r"
    cells = ["--cell", "policy-cpu-interpreter", "--cell", "mla-cuda-sm_90"]
    start = time.monotonic()
    code = main(["matrix", "--runner", "k8s", *cells, "--results", str(out)])
    assert time.monotonic() - start < 10  # no CPU cell ran first
    assert code == 2
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("matrix: 2 cells; runner k8s: no cluster configured")
    assert first.endswith("; nothing run")
    assert not (out / "policy-cpu-interpreter.log").exists()  # the local runner never started
    cpu, gpu = report.collect([get_cell("policy-cpu-interpreter"), get_cell("mla-cuda-sm_90")], out)
    assert (cpu.status, cpu.reason) == (
        "not run",
        "not started: the k8s runner has no usable cluster",
    )
    assert gpu.status == "error" and gpu.reason.startswith("no cluster configured")


def test_k8s_runner_with_an_unusable_cluster_runs_nothing(tmp_path, monkeypatch, capsys):
    from tests.ci.kube_stub import KubeStub

    with KubeStub() as stub:
        stub.fail_next("GET jobs", 403, times=99)  # the Role is missing in the namespace
        _stub_kubeconfig(stub, tmp_path, monkeypatch)
        code = main(
            ["matrix", "--runner", "k8s", "--cell", "mla-cuda-sm_90", "--results", str(tmp_path)]
        )
    assert code == 2
    said, first = capsys.readouterr().out.splitlines()[:2]
    host = f"http://127.0.0.1:{stub.server.server_port}"
    assert said == f"matrix: checking the cluster at {host} (namespace portattn-ci) ..."
    assert first.startswith(
        f"matrix: 1 cells; runner k8s: the cluster at {host} "
        "cannot run cells: forbidden: the launcher needs the Role"
    )
    assert not stub.jobs and not [r for r in stub.requests if r[0] == "POST"]


def test_k8s_runner_says_in_its_first_line_what_runs_where(tmp_path, monkeypatch, capsys):
    from kubematrix.cell import encode_results
    from kubematrix.render import results_token
    from tests.ci.kube_stub import KubeStub

    def scenario(k: KubeStub, job: dict) -> None:
        pod = k.add_pod(job)
        k.start(pod)
        junit = b'<testsuites><testsuite name="t"><testcase name="ok"/></testsuite></testsuites>'
        k.log(pod, *encode_results(junit, results_token(job["metadata"]["name"]), 0))
        k.finish(pod, 0)

    with KubeStub(scenario) as stub:
        _stub_kubeconfig(stub, tmp_path, monkeypatch)
        code = main(
            ["matrix", "--runner", "k8s", "--cell", "mla-cuda-sm_90", "--results", str(tmp_path)]
        )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("matrix: checking the cluster at http://127.0.0.1:")
    assert lines[1] == (
        "matrix: 1 cells; runner k8s: 1 GPU cells as Jobs in namespace portattn-ci at "
        f"http://127.0.0.1:{stub.server.server_port}, 0 CPU cells here; results in {tmp_path}"
    )
    assert code == 0 and lines[-1].startswith("matrix: passed")


def test_k8s_runner_summary_shows_a_job_cells_compile_time_and_hit_rate(
    tmp_path, monkeypatch, capsys
):
    # The pod runs the real entry point (kubematrix.cell) with the rendered Job's environment:
    # its test processes compile through the layered cache (real Triton compiles for sm_90, the
    # local layer only), and the counters reach the summary through the log alone.

    from kubematrix.cachestats import REDIS_ENV, STATS_DIR_ENV
    from kubematrix.render import CELL_CONTAINER
    from tests.ci.kube_stub import KubeStub

    monkeypatch.setenv(REDIS_ENV, "")  # no triton-cache Service here
    probe = ROOT / "tests" / "ci" / "cache_probe.py"
    junit = tmp_path / "pod" / "junit.xml"
    session = tmp_path / "session.py"
    session.write_text(
        textwrap.dedent(
            f"""
            import subprocess, sys
            subprocess.run([sys.executable, {str(probe)!r}, "16", "32"], check=True)
            subprocess.run([sys.executable, {str(probe)!r}, "16"], check=True)  # a local hit
            open({str(junit)!r}, "w").write(
                '<testsuites><testsuite name="t" time="4.5"><testcase name="ok"/>'
                '</testsuite></testsuites>'
            )
            """
        )
    )

    def scenario(k: KubeStub, job: dict) -> None:
        pod = k.add_pod(job)
        k.start(pod)
        (container,) = [
            c for c in job["spec"]["template"]["spec"]["containers"] if c["name"] == CELL_CONTAINER
        ]
        env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
        # The Job's Triton, cache and result settings (its paths under /home and /results are
        # the pod's: moved below into tmp_path).
        job_env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        env.update({n: v for n, v in job_env.items() if n.startswith(("TRITON_", "KUBEMATRIX_"))})
        env.update(
            {
                STATS_DIR_ENV: str(tmp_path / "pod" / "cache"),
                "TRITON_CACHE_DIR": str(tmp_path / "pod" / "triton"),
                "TRITON_HOME": str(tmp_path / "pod" / "home"),
                "PYTHONPATH": str(ROOT / "src"),
            }
        )
        cell = subprocess.run(
            [sys.executable, "-m", "kubematrix.cell", "--results", str(junit), "--"]
            + [sys.executable, str(session)],
            env=env,
            capture_output=True,
            text=True,
        )
        k.log(pod, *cell.stdout.splitlines())
        k.finish(pod, cell.returncode)

    (tmp_path / "pod").mkdir()
    with KubeStub(scenario) as stub:
        _stub_kubeconfig(stub, tmp_path, monkeypatch)
        code = main(
            ["matrix", "--runner", "k8s", "--cell", "mla-cuda-sm_90", "--results", str(tmp_path)]
        )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "kubematrix.cell: Triton cache: 33% hits of 3 lookups (1 local, 0 remote" in out
    row = next(line for line in out.splitlines() if line.startswith("mla-cuda-sm_90 "))
    cols = re.split(r"\s{2,}", row)
    header = re.split(r"\s{2,}", next(x for x in out.splitlines() if x.startswith("cell ")))
    got = dict(zip(header, cols, strict=False))
    assert got["result"] == "passed"
    assert got["time"] == "4.5s"  # the tests' time, from the JUnit
    assert got["compile"] != "-" and got["cache"] == "33% of 3"
    (result,) = report.collect([get_cell("mla-cuda-sm_90")], tmp_path)
    assert result.cache is not None
    assert (result.cache.local, result.cache.compiled) == (1, 2) and result.cache.compile_s > 0


def _stub_kubeconfig(stub, tmp_path, monkeypatch) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: stub\n"
        f"clusters: [{{name: stub, cluster: {{server: 'http://127.0.0.1:{stub.server.server_port}'}}}}]\n"
        "users: [{name: stub, user: {token: t}}]\n"
        "contexts: [{name: stub, context: {cluster: stub, user: stub}}]\n"
    )
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))


@pytest.mark.parametrize(
    "argv",
    [
        ["kubematrix"],
        ["kubematrix", "matrix"],
        ["kubematrix", "list"],
        ["kubematrix", "report"],
        ["kubematrix", "pipeline"],
        ["kubematrix.k8s"],
        ["portattn.compile"],
    ],
)
def test_help_is_for_users_not_developers(argv, capsys):
    import importlib

    entry = {"kubematrix": "kubematrix.__main__", "portattn.compile": "portattn.compile.__main__"}
    module = importlib.import_module(entry.get(argv[0], argv[0]))
    with pytest.raises(SystemExit) as done:
        module.main([*argv[1:], "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: python -m ")
    for markup in (":data:", ":func:", ":mod:", ":class:", "``", "register("):
        assert markup not in text, f"{markup!r} in {' '.join(argv)} --help"


def test_stopping_the_runner_stops_the_cell_and_skips_the_rest(tmp_path, toy_project):
    cells = [get_cell("hybrid-cpu-interpreter"), get_cell("policy-cpu-interpreter")]
    stop = threading.Event()
    threading.Timer(3.0, stop.set).start()
    start = time.monotonic()
    hung, rest = run_local(
        cells,
        tmp_path / "r",
        workers=1,
        host=NO_GPU,
        stream=io.StringIO(),
        cwd=toy_project,
        stop=stop,
    )
    assert time.monotonic() - start < 30  # the 120 s test was killed, not waited for
    assert (hung.status, hung.reason) == ("error", "interrupted")
    assert (rest.status, rest.reason) == ("not run", "interrupted before it started")


def test_compile_args_reach_the_compile_module():
    cmd = cell_command(
        get_cell("compile-cpu-interpreter"), Path("r"), 2, ["--targets", "sm_90,gfx942"]
    )
    assert cmd[1:] == ["-m", "portattn.compile", "--out", "r/compile", "--targets", "sm_90,gfx942"]


def test_suite_cells_share_their_workers_queues():
    """A suite cell runs under xdist with work stealing (an idle worker takes half a busy one's
    queue), one worker without xdist at all."""
    cell = get_cell("mla-cpu-interpreter")
    cmd = cell_command(cell, Path("r"), 4)
    assert cmd[cmd.index("-n") : cmd.index("-n") + 4] == ["-n", "4", "--dist", "worksteal"]
    one = cell_command(cell, Path("r"), 1)
    assert "-n" not in one and "--dist" not in one


@pytest.mark.skipif(bool(glob.glob("/dev/nvidia[0-9]*")), reason="a CUDA device is visible here")
def test_a_matrix_that_tests_nothing_is_no_green_step(tmp_path, capsys):
    """``--backend cuda`` where there is no CUDA device: every cell is not run, and the command
    says so and exits 4 (it exited 0, a green Buildkite step that tested nothing)."""
    code = main(["matrix", "--backend", "cuda", "--suite", "mla", "--results", str(tmp_path)])
    out = capsys.readouterr()
    assert code == 4
    assert out.out.splitlines()[-1].startswith("matrix: not run (wall time ")
    assert "none of the 2 selected cells ran a test here" in out.err
    assert {r.status for r in report.collect(all_cells(), tmp_path) if "mla-cuda" in r.cell} == {
        "not run"
    }


def test_a_gpu_of_any_index_is_a_gpu(monkeypatch):
    """A pod given one GPU of eight sees only that GPU's node (``/dev/nvidia6``, no
    ``/dev/nvidia0``): the host still has a CUDA GPU; ``/dev/nvidiactl`` alone is none."""
    seen = {"/dev/nvidia[0-9]*": ["/dev/nvidia6"], "/dev/kfd": []}
    monkeypatch.setattr(matrix.glob, "glob", lambda pattern: seen.get(pattern, []))
    monkeypatch.setattr(matrix, "local_gpu_arch", lambda vendor: "sm_90")
    host = Host.probe()
    assert host.device_nodes == {"/dev/nvidia[0-9]*"} and host.gpu_arch == {"cuda": "sm_90"}
    assert matrix.why_not_runnable(get_cell("mla-cuda-sm_90"), "local", host) is None
    for node, gpu in (("/dev/nvidia6", True), ("/dev/nvidia12", True), ("/dev/nvidiactl", False),
                      ("/dev/nvidia-uvm", False), ("/dev/nvidia-modeset", False)):  # fmt: skip
        assert fnmatch.fnmatch(node, "/dev/nvidia[0-9]*") == gpu, node


def test_k8s_runner_names_a_bad_setting_before_asking_for_a_cluster(tmp_path, monkeypatch, capsys):
    """Not 'no cluster configured' (or, with one, an error after the CPU cells started)."""
    _no_kubeconfig(tmp_path, monkeypatch)
    monkeypatch.setenv("KUBEMATRIX_REGISTRY", "https://registry.example")
    code = main(
        ["matrix", "--runner", "k8s", "--cell", "mla-cuda-sm_90", "--results", str(tmp_path)]
    )
    err = capsys.readouterr().err
    assert code == 2 and "kubematrix matrix: KUBEMATRIX_REGISTRY must be a registry" in err, err
    assert "no cluster" not in err


def test_a_bad_cache_setting_stops_the_matrix_before_it_clears_or_runs(tmp_path, monkeypatch,
                                                                       capsys):  # fmt: skip
    """Checked before any cell starts (it was checked by the first cell, after the folder's
    summary of the last run had been kept and the run begun)."""
    monkeypatch.setenv("KUBEMATRIX_TRITON_REDIS", "nohost")
    code = main(["matrix", "--cell", "policy-cpu-interpreter", "--results", str(tmp_path)])
    out = capsys.readouterr()
    assert code == 2 and "KUBEMATRIX_TRITON_REDIS must be host:port" in out.err
    assert "policy-cpu-interpreter" not in out.out


def test_a_run_that_stops_leaves_no_earlier_summary(tmp_path, monkeypatch, toy_project):
    """A summary in the folder is the last run's own: removed when a run starts, so a run that
    stops early leaves none saying the earlier run's 'passed'."""
    from kubematrix import __main__ as cli

    for name in report.SUMMARY_NAMES:
        (tmp_path / name).write_text("passed\n")

    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run_local", stop)
    monkeypatch.setattr(cli, "find_project_root", lambda: (toy_project, [toy_project]))
    # (Ctrl-C ends the command with 130 and one line, no traceback)
    assert main(["matrix", "--cell", "policy-cpu-interpreter", "--results", str(tmp_path)]) == 130
    assert not any((tmp_path / name).exists() for name in report.SUMMARY_NAMES)


def test_k8s_runner_records_the_cpu_cells_of_a_thread_that_failed(tmp_path, monkeypatch, capsys,
                                                                    toy_project):  # fmt: skip
    """The CPU cells' thread raising: its cells are errors naming why and the summary is
    written (it was a thread traceback, then a KeyError in the main thread)."""
    from kubematrix import __main__ as cli

    def broken(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(cli, "run_local", broken)
    monkeypatch.setattr(cli, "find_project_root", lambda: (toy_project, [toy_project]))
    code = main(["matrix", "--runner", "k8s", "--cell", "policy-cpu-interpreter", "--results",
                 str(tmp_path)])  # fmt: skip
    out = capsys.readouterr()
    assert code == 1 and "the CPU cells' run stopped: RuntimeError: disk full" in out.err
    (record,) = report.collect([get_cell("policy-cpu-interpreter")], tmp_path)
    assert record.status == "error" and "disk full" in record.reason
    assert (tmp_path / "results.json").is_file()


def test_a_cluster_that_never_answers_is_named_within_the_checks_budget(tmp_path, monkeypatch):
    """A server that accepts connections and never answers: the access check gives up after
    its own attempts (no urllib3 retries stacked under the launcher's), naming the host. The
    server counts the connections, so the budget is checked without timing a loaded machine."""
    from kubematrix import k8s
    from kubematrix.launcher import Timeouts
    from tests.ci.test_compile_cache import _silent_server

    port, held, stop = _silent_server(None)  # accepts, counts, never answers
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: s, cluster: {{server: 'http://127.0.0.1:{port}'}}}}]\n"
        "contexts: [{name: c, context: {cluster: s, user: u}}]\nusers: [{name: u, user: {}}]\n"
    )
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
    fast = Timeouts(request_s=0.5, connect_s=0.5, retries=1, backoff_s=0.05, max_backoff_s=0.1)
    assert k8s.load_api_client().configuration.retries is False
    try:
        with pytest.raises(k8s.NoCluster, match=f"127.0.0.1:{port}"):
            k8s.connect("portattn-ci", timeouts=fast)
    finally:
        stop()
    # one attempt and one retry (urllib3's own three retries of each would make it 8)
    assert 1 <= len(held) <= 2, len(held)
