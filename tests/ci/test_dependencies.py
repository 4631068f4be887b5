"""One dependency story per backend: ranges in pyproject.toml, exact pins per backend in
constraints/, torch from one configurable index, images tested as they are, one worker count."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from nox.command import CommandFailed
from nox.project import load_toml  # tomllib is 3.11+; the project supports 3.10
from packaging.requirements import Requirement

from kubematrix import local, matrix, report

pytestmark = pytest.mark.ci

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ("cpu", "cuda", "rocm")


def _pins(backend: str) -> dict[str, str]:
    """``name -> version`` of the exact pins in ``constraints/<backend>.txt``."""
    text = (ROOT / "constraints" / f"{backend}.txt").read_text()
    lines = [line.split("#")[0].strip() for line in text.splitlines()]
    pins = {}
    for line in filter(None, lines):
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line)
        if m:
            pins[m[1].lower()] = m[2]
    return pins


def test_the_library_declares_ranges_that_every_backends_pins_satisfy():
    deps = [Requirement(d) for d in load_toml(ROOT / "pyproject.toml")["project"]["dependencies"]]
    assert {d.name for d in deps} >= {"torch", "triton"}
    for dep in deps:
        assert dep.specifier, f"{dep} has no range"
        assert not any(s.operator in ("==", "===") for s in dep.specifier), f"{dep} is a pin"
    for backend in BACKENDS:
        pins = _pins(backend)
        for dep in deps:
            assert dep.name in pins, f"constraints/{backend}.txt pins no {dep.name}"
            assert dep.specifier.contains(pins[dep.name], prereleases=True), (backend, dep)


def test_cpu_pins_torchs_cpu_build_which_pypi_does_not_have():
    """PyPI's Linux torch is the CUDA build: a `+cpu` pin can only resolve to a CPU build."""
    assert _pins("cpu")["torch"].endswith("+cpu")


# -- the noxfile's install story, with a stand-in session ----------------------------------------


class FakeSession:
    def __init__(self, venv_backend: str = "venv", torch_missing: bool = False) -> None:
        self.venv_backend = venv_backend
        self.torch_missing = torch_missing
        self.installs: list[list[str]] = []
        self.runs: list[list[str]] = []
        self.posargs: list[str] = []

    def install(self, *args: str) -> None:
        self.installs.append(list(args))
        if self.torch_missing and args[-1] == "torch":
            raise CommandFailed("no matching distribution")

    def run(self, *args: str, silent: bool = False, **_: object) -> str | None:
        self.runs.append(list(args))
        return "-n 3 --dist worksteal\n" if silent else None

    def log(self, *_: object) -> None:
        pass

    def warn(self, *_: object) -> None:
        pass

    def error(self, message: str) -> None:
        raise RuntimeError(message)


@pytest.fixture(scope="module")
def noxfile():
    cwd = os.getcwd()
    os.chdir(ROOT)  # the noxfile reads pyproject.toml relative to itself, as nox runs it
    try:
        spec = importlib.util.spec_from_file_location("portattn_noxfile", ROOT / "noxfile.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        os.chdir(cwd)
    return module


@pytest.fixture
def machine(noxfile, monkeypatch):
    """Pretend a backend's device is (not) there; no index, not in an image."""
    monkeypatch.delenv(noxfile.TORCH_INDEX_ENV, raising=False)
    monkeypatch.delenv(noxfile.IMAGE_ENV, raising=False)

    def use(backend: str) -> None:
        monkeypatch.setattr(noxfile, "_backend", lambda: backend)

    use("cpu")
    return use


def test_a_cpu_session_installs_torch_then_the_project_under_the_cpu_pins(noxfile, machine):
    session = FakeSession()
    noxfile.tests(session)
    pins = ["-c", "constraints/cpu.txt"]
    assert session.installs == [[*pins, "torch"], [*pins, "-e", ".[test,ci,hybrid]"]]
    pytest_run = next(r for r in session.runs if r[0] == "pytest")
    # the installed kubematrix's xdist arguments
    assert pytest_run[:5] == ["pytest", "-n", "3", "--dist", "worksteal"]


def test_the_torch_index_variable_adds_an_index_to_the_torch_install_only(
    noxfile, machine, monkeypatch
):
    monkeypatch.setenv(noxfile.TORCH_INDEX_ENV, "https://download.pytorch.org/whl/cpu")
    session = FakeSession()
    noxfile.install_project(session, "test")
    torch, project = session.installs
    assert torch == [
        "-c",
        "constraints/cpu.txt",
        "--extra-index-url",
        "https://download.pytorch.org/whl/cpu",
        "torch",
    ]
    assert "--extra-index-url" not in project


def test_a_missing_cpu_build_stops_naming_the_index_variable(noxfile, machine):
    with pytest.raises(RuntimeError, match="set PORTATTN_TORCH_INDEX .*whl/cpu"):
        noxfile.install_project(FakeSession(torch_missing=True), "test")


def test_rocm_outside_its_image_needs_a_torch_index(noxfile, machine, monkeypatch):
    machine("rocm")
    with pytest.raises(RuntimeError, match="rocm: set PORTATTN_TORCH_INDEX"):
        noxfile.install_project(FakeSession(), "test")
    monkeypatch.setenv(noxfile.TORCH_INDEX_ENV, "https://download.pytorch.org/whl/rocm6.4")
    session = FakeSession()
    noxfile.install_project(session, "test")
    assert session.installs[0][:2] == ["-c", "constraints/rocm.txt"]


@pytest.mark.parametrize("how", ["image", "no-venv"])
def test_a_gpu_image_session_tests_the_environment_as_it_is(noxfile, machine, monkeypatch, how):
    machine("cuda")
    if how == "image":
        monkeypatch.setenv(noxfile.IMAGE_ENV, "1")
    session = FakeSession(venv_backend="none" if how == "no-venv" else "venv")
    noxfile.install_project(session, "test", "hybrid")
    noxfile._mamba_extensions(session)
    assert session.installs == []


@pytest.mark.parametrize("how", ["image", "no-venv"])
def test_the_ci_layers_sessions_install_nothing_in_an_image_or_without_a_venv(
    noxfile, machine, monkeypatch, how
):
    """README: in the images and under ``nox --no-venv`` sessions install nothing. pipeline,
    report, k8s(...) and lint installed anyway (nox refuses an install without a venv: a
    traceback)."""
    if how == "image":
        monkeypatch.setenv(noxfile.IMAGE_ENV, "1")
    session = FakeSession(venv_backend="none" if how == "no-venv" else "venv")
    noxfile._install_ci_layer(session)
    noxfile.lint(session)
    assert session.installs == [] and session.runs[0][:2] == ["ruff", "check"]


def test_nox_without_a_venv_runs_the_pipeline_session_in_this_environment(tmp_path):
    """Real nox, as a Buildkite step in an image runs it: ``--no-venv -s pipeline`` ended in
    nox's ValueError (no session.install() without a virtualenv) before kubematrix ran."""
    proc = subprocess.run(
        [sys.executable, "-m", "nox", "--no-venv", "-f", str(ROOT / "noxfile.py"), "-s",
         "pipeline", "--", "--help"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "usage:" in out and "Session pipeline was successful" in out, out


def test_a_gpu_session_outside_the_image_installs_the_mamba_wheels_as_the_image_does(
    noxfile, machine, monkeypatch, tmp_path
):
    """The wheelhouse holds only the two wheels: their declared requirements (ninja, tilelang,
    a PyPI Triton, ...) could not install from it; what they import comes from the index."""
    machine("cuda")
    monkeypatch.setattr(noxfile, "_has_gpu", lambda: True)
    monkeypatch.setattr(noxfile, "WHEELHOUSE", str(tmp_path))
    session = FakeSession()
    monkeypatch.chdir(ROOT)
    noxfile._mamba_extensions(session)
    wheels, runtime = session.installs
    assert wheels[:4] == ["--no-index", "--no-deps", "--find-links", str(tmp_path)]
    assert runtime[:2] == ["-c", "constraints/cuda.txt"]
    assert "einops" in runtime and not {"ninja", "tilelang", "triton"} & set(runtime)


@pytest.mark.parametrize(
    ("env", "value", "rule"),
    [
        ("TORCH_INDEX_ENV", "download.pytorch.org/whl/cpu", "must be one index URL"),
        ("TORCH_INDEX_ENV", "https://a/simple https://b/simple", "must be one index URL"),
        ("TORCH_INDEX_ENV", "--pre", "must be one index URL"),
        ("IMAGE_ENV", "true", "must be 1 (a CI image: install nothing) or 0; got 'true'"),
        ("IMAGE_ENV", " 1", "must be 1 (a CI image: install nothing) or 0; got ' 1'"),
    ],
)  # fmt: skip
def test_a_malformed_install_setting_stops_naming_it(noxfile, machine, monkeypatch, env, value,
                                                     rule):  # fmt: skip
    """pip only warned about an index without a scheme (and torch came from PyPI); an image
    marked ``true`` got a fresh venv instead of the image's torch."""
    machine("cuda")
    monkeypatch.setenv(getattr(noxfile, env), value)
    with pytest.raises(RuntimeError, match=re.escape(f"{getattr(noxfile, env)} {rule}")):
        noxfile.install_project(FakeSession(), "test")


def test_uv_environments_get_pip_for_the_tools_that_call_it(noxfile, machine):
    session = FakeSession(venv_backend="uv")
    noxfile.install_project(session, "test")
    assert session.installs[0] == ["pip"]


def test_nox_prefers_uv_and_falls_back_to_venv(noxfile):
    assert noxfile.nox.options.default_venv_backend == "uv|venv"


@pytest.mark.skipif(
    bool(glob.glob("/dev/nvidia[0-9]*") or glob.glob("/dev/kfd")), reason="a GPU is visible here"
)
@pytest.mark.parametrize("suite", ["mla", "hybrid"])
def test_a_gpu_cell_without_its_gpu_stops_instead_of_testing_the_cpu(suite, tmp_path):
    """Real nox on this CPU machine, as a GPU step or pod would run the session: with the cell's
    architecture set and no device node, the session stops, naming both, before installing or
    running anything (it ran the CPU variant of the suite, and passed)."""
    # a GPU cell's environment: its architecture, no interpreter (the gate's pytest has one)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env[matrix.ARCH_ENV] = "sm_90"
    proc = subprocess.run(
        [sys.executable, "-m", "nox", "--no-venv", "-f", str(ROOT / "noxfile.py"), "-s", suite],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert f"{suite}: this cell targets sm_90 (PORTATTN_CELL_ARCH) but no GPU device node" in out
    assert "pytest" not in out.split("aborted")[0].split("Running session")[-1], out


def test_a_gpu_cell_whose_torch_sees_no_gpu_fails_its_first_test(tmp_path):
    """The device node is there but torch sees no GPU (a driver older than the image's CUDA, a
    container toolkit that hid the device): the cell's pytest, as its session runs it, fails its
    first test with torch's reason and runs nothing else. It passed on the host-only tests (111
    passed, 49 skipped for specdec)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("torch sees a GPU here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env[matrix.ARCH_ENV] = "sm_90"
    junit = tmp_path / "cell.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-m",
         "specdec and not cpu", f"--junitxml={junit}", "tests/test_cell_arch.py",
         "tests/specdec/test_metadata.py"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-2000:]
    counts = report.read_junit(junit)
    assert (counts.passed, counts.failed) == (0, 1) and counts.skipped >= 5
    assert counts.failures[0].test.endswith("test_the_live_gpu_is_the_cells_architecture")
    assert "this cell targets sm_90 but torch sees no GPU: " in counts.failures[0].message


@pytest.mark.parametrize(
    ("backend", "interpret", "marker"),
    [("cuda", False, "mla and not cpu"), ("cuda", True, "mla and not gpu"),
     ("rocm", True, "mla and not gpu"), ("cpu", False, "mla and not gpu")],
)  # fmt: skip
def test_a_cpu_cell_runs_the_interpreter_variant_even_where_a_gpu_is(
    noxfile, machine, monkeypatch, backend, interpret, marker
):
    """A CPU cell (``TRITON_INTERPRET=1``, as every runner sets it) on an agent that happens to
    have a GPU ran the GPU variant under the interpreter; it asks for the CPU variant."""
    machine(backend)
    monkeypatch.setenv(noxfile.IMAGE_ENV, "1")  # as in the CI images: nothing to install
    monkeypatch.delenv(noxfile.CELL_ARCH_ENV, raising=False)
    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    session = FakeSession()
    noxfile.SUITE_SESSIONS["mla"](session)
    (pytest_run,) = [r for r in session.runs if r[0] == "pytest"]
    assert pytest_run[pytest_run.index("-m") + 1] == marker


@pytest.mark.parametrize("value", ["1", "true", "ON", "y"])
def test_a_gpu_cell_under_the_interpreter_is_refused(noxfile, machine, monkeypatch, value):
    """Any value Triton reads as on (``true`` got past a check for ``1``)."""
    machine("cuda")
    monkeypatch.setenv(noxfile.CELL_ARCH_ENV, "sm_90")
    monkeypatch.setenv("TRITON_INTERPRET", value)
    with pytest.raises(
        RuntimeError, match=f"targets sm_90 .* but TRITON_INTERPRET={value} asks for the CPU"
    ):
        noxfile.SUITE_SESSIONS["specdec"](FakeSession())


def test_triton_interpret_is_read_as_triton_reads_it(noxfile, monkeypatch):
    """The noxfile's and conftest's reading of TRITON_INTERPRET agree with Triton's own knob
    (asked of Triton in a fresh process)."""
    import subprocess
    import sys

    from tests import conftest

    values = ["1", "true", "TRUE", "yes", "on", "On", "y", "Y", "0", "false", "2", " 1", "t", ""]
    # one process: Triton's knob reads the variable on every access
    code = (
        "import json, os, sys, triton\n"
        "out = []\n"
        "for v in json.loads(sys.argv[1]):\n"
        "    os.environ['TRITON_INTERPRET'] = v\n"
        "    out.append(bool(triton.knobs.runtime.interpret))\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(values)], capture_output=True,
                          text=True, check=True)  # fmt: skip
    for value, triton_on in zip(values, json.loads(proc.stdout), strict=True):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert noxfile.triton_interpret() == triton_on, value
        assert (value.lower() in noxfile.TRITON_TRUE) == triton_on, value
    assert conftest.TRITON_TRUE == noxfile.TRITON_TRUE


def test_the_sessions_see_a_gpu_of_any_index(noxfile, monkeypatch):
    """A pod given the seventh GPU of a node has ``/dev/nvidia6`` and no ``/dev/nvidia0``: its
    GPU suite must run (it ran the CPU variant)."""
    seen = {"/dev/nvidia[0-9]*": ["/dev/nvidia6"]}
    monkeypatch.setattr(noxfile.glob, "glob", lambda pattern: seen.get(pattern, []))
    assert noxfile._backend() == "cuda"
    seen = {"/dev/kfd": ["/dev/kfd"]}
    assert noxfile._backend() == "rocm"
    seen = {}
    assert noxfile._backend() == "cpu"


# -- one pytest worker count ----------------------------------------------------------------------


def test_pytest_workers_are_the_usable_cores_at_most_the_cap(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(64)), raising=False)
    assert matrix.pytest_workers() == matrix.MAX_PYTEST_WORKERS == 8
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1}, raising=False)
    assert matrix.pytest_workers() == 2
    assert matrix.pytest_xdist_args() == ["-n", "2", "--dist", "worksteal"]
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0}, raising=False)
    assert matrix.pytest_xdist_args() == []  # one core: pytest's own process, no xdist


def test_the_local_runner_and_the_sessions_use_one_worker_count(noxfile, machine):
    assert local.default_workers is matrix.pytest_workers
    session = FakeSession()
    noxfile.tests(session)
    (probe,) = [r for r in session.runs if r[:2] == ["python", "-c"]]
    assert "from kubematrix.matrix import pytest_xdist_args" in probe[2]
    for suite, backend in (("mla", "cpu"), ("mla", "cuda")):
        machine(backend)
        session = FakeSession()
        noxfile.nox.registry.get()[suite](session)  # the suite's session, as `nox -s mla` runs
        pytest_run = next(r for r in session.runs if r[0] == "pytest")
        assert pytest_run[pytest_run.index("-n") + 1] == "3", (suite, backend)


@pytest.mark.parametrize(
    ("posargs", "marker", "rest"),
    [
        ([], "policy and not gpu", []),
        (["-m", "slow"], "(policy and not gpu) and (slow)", []),
        (["-x", "-mslow", "-k", "t"], "(policy and not gpu) and (slow)", ["-x", "-k", "t"]),
        (["--markexpr=a or b", "-m", "c"], "(policy and not gpu) and (a or b) and (c)", []),
    ],
)  # fmt: skip
def test_a_given_marker_narrows_the_sessions_selection(noxfile, machine, posargs, marker, rest):
    """pytest keeps the last -m: ``nox -s paged -- -m mla`` ran mla's tests in the paged
    session, and ``nox -s tests -- -m gpu`` replaced the gate's ``not gpu``."""
    session = FakeSession()
    session.posargs = posargs
    noxfile.SUITE_SESSIONS["policy"](session)
    (pytest_run,) = [r for r in session.runs if r[0] == "pytest"]
    at = pytest_run.index("-m")
    assert pytest_run[at + 1] == marker and pytest_run[at + 2 :] == rest
    assert pytest_run.count("-m") == 1


def test_a_k8s_session_is_one_cell(noxfile, monkeypatch):
    """``-- --vendor rocm`` added a second cell to the session named for one."""
    session = FakeSession()
    session.posargs = ["--namespace", "ci", "--vendor=rocm"]
    with pytest.raises(
        RuntimeError, match=r"k8s\(cuda, paged\) runs that one cell; got \['--vendor=rocm'\]"
    ):
        noxfile.k8s.func(session, vendor="cuda", suite="paged")
