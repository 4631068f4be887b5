"""Every way to run anything: locally, in a Buildkite step, or inside a Kubernetes Job.

Sessions are thin: they install from pyproject.toml and call into src/. ``nox -l`` lists them.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Callable

import nox
from nox.command import CommandFailed

nox.options.default_venv_backend = "uv|venv"  # uv where it is installed, else the stdlib venv
nox.options.sessions = ["lint", "tests", "compile"]
nox.options.reuse_existing_virtualenvs = True

PYPROJECT = nox.project.load_toml("pyproject.toml")
EXTRAS: dict[str, list[str]] = PYPROJECT["project"]["optional-dependencies"]

# Where torch comes from: an index URL added to the torch install (e.g. PyTorch's CPU or ROCm
# index); unset, pip's own configuration (PyPI, or a mirror / wheelhouse in pip.conf).
TORCH_INDEX_ENV = "PORTATTN_TORCH_INDEX"
# Set to 1 in the CI images: the image's environment is the one under test; install nothing.
IMAGE_ENV = "PORTATTN_IMAGE"
# A device-node glob per GPU backend (checked without importing torch into nox): a pod given one
# GPU of eight sees only that GPU's node (``/dev/nvidia6``), so any index counts.
DEVICE_NODES = {"cuda": "/dev/nvidia[0-9]*", "rocm": "/dev/kfd"}


def _backend() -> str:
    """``cuda`` or ``rocm`` where such a device is visible, else ``cpu``."""
    return next((b for b, node in DEVICE_NODES.items() if glob.glob(node)), "cpu")


def _has_gpu() -> bool:
    return _backend() != "cpu"


def _environment_as_is(session: nox.Session) -> bool:
    """A CI image (``$PORTATTN_IMAGE=1``) or ``--no-venv``: test this environment, install none.
    ``$PORTATTN_IMAGE`` is ``1`` or ``0`` (or unset): another value stops the session by name
    (``true`` read as "no image" tested a fresh venv instead of the image)."""
    value = os.environ.get(IMAGE_ENV, "")
    if value not in ("", "0", "1"):
        session.error(f"{IMAGE_ENV} must be 1 (a CI image: install nothing) or 0; got {value!r}")
    return value == "1" or session.venv_backend == "none"


def install_project(session: nox.Session, *extras: str) -> None:
    """Install portattn with ``extras`` under the backend's exact pins (constraints/<backend>.txt),
    torch first from ``$PORTATTN_TORCH_INDEX`` if set; in a CI image (``$PORTATTN_IMAGE=1``) or
    with ``--no-venv``, nothing: the image's torch, Triton and extras are what is tested."""
    if _environment_as_is(session):
        session.log(f"{IMAGE_ENV}=1 or --no-venv: testing this environment as it is (no install)")
        return
    backend = _backend()
    pins = ["-c", f"constraints/{backend}.txt"]
    index = os.environ.get(TORCH_INDEX_ENV, "").strip()
    if index and not re.fullmatch(r"(https?|file)://\S+", index):  # pip would only warn
        session.error(
            f"{TORCH_INDEX_ENV} must be one index URL (http://, https:// or file://, no spaces); "
            f"got {index!r}"
        )
    if backend == "rocm" and not index:  # PyPI's Linux torch is a CUDA build
        session.error(
            f"rocm: set {TORCH_INDEX_ENV} to PyTorch's ROCm wheel index for the torch in "
            "constraints/rocm.txt (e.g. https://download.pytorch.org/whl/rocm6.4), or run in the "
            f"ROCm image ({IMAGE_ENV}=1)"
        )
    if session.venv_backend == "uv":  # uv's venvs have no pip; tests/ci and tools/ call it
        session.install("pip")
    try:
        session.install(*pins, *(["--extra-index-url", index] if index else []), "torch")
    except CommandFailed:
        given = f" (it is {index})" if index else ""
        session.error(
            f"{backend}: no torch matching constraints/{backend}.txt on the configured indexes; "
            f"set {TORCH_INDEX_ENV} to the index that has it{given} (CPU build: "
            "https://download.pytorch.org/whl/cpu)"
        )
    spec = f".[{','.join(extras)}]" if extras else "."
    session.install(*pins, "-e", spec)


def _xdist(session: nox.Session) -> list[str]:
    """The installed kubematrix's xdist arguments (worker count and distribution), the local
    runner's too: one setting everywhere."""
    code = "from kubematrix.matrix import pytest_xdist_args; print(*pytest_xdist_args())"
    out = session.run("python", "-c", code, silent=True)
    return str(out).strip().splitlines()[-1].split() if out else []


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check, ruff format --check and mypy on src/ (with ``--no-venv`` or in a CI image,
    the tools this environment has)."""
    if not _environment_as_is(session):
        session.install(*EXTRAS["lint"], *EXTRAS["ci"], "types-PyYAML")
    session.run("ruff", "check", "src", "tests", "noxfile.py", "bench", "tools")
    session.run("ruff", "format", "--check", "src", "tests", "noxfile.py", "bench", "tools")
    session.run("mypy", "src")


def _marked(session: nox.Session, marker: str) -> list[str]:
    """``-m`` for the session's ``marker`` ANDed with any ``-m``/``--markexpr`` among the
    session's arguments, then the rest of them: pytest keeps only the last ``-m``, so a user's
    ``-m`` replaced the session's selection (``nox -s paged -- -m mla`` ran mla's tests)."""
    rest: list[str] = []
    extra: list[str] = []
    args = iter(session.posargs)
    for arg in args:
        if arg in ("-m", "--markexpr"):
            value = next(args, None)
            if value is None:
                session.error(f"{arg} needs a marker expression")
            extra.append(str(value))
        elif arg.startswith("--markexpr="):
            extra.append(arg.split("=", 1)[1])
        elif arg.startswith("-m") and not arg.startswith("--"):
            extra.append(arg[2:])
        else:
            rest.append(arg)
    expr = " and ".join(f"({m})" for m in (marker, *extra)) if extra else marker
    return ["-m", expr, *rest]


@nox.session
def tests(session: nox.Session) -> None:
    """The CPU gate: policies, every kernel under TRITON_INTERPRET=1, compile matrix, CI layer."""
    install_project(session, "test", "ci", "hybrid")
    env = {"TRITON_INTERPRET": "1"}
    session.run("pytest", *_xdist(session), *_marked(session, "not gpu"), env=env)


@nox.session(name="compile")
def compile_matrix(session: nox.Session) -> None:
    """Cross-target compile matrix (no GPU): every kernel x case x target, reports in results/."""
    install_project(session, "ci")  # matplotlib draws the heatmap
    # Triton's persistent cache (TRITON_CACHE_DIR, default ~/.triton/cache) makes re-runs fast.
    session.run("python", "-m", "portattn.compile", "--out", "results/compile", *session.posargs)


@nox.session(default=False)
def gpu(session: nox.Session) -> None:
    """The GPU suites (bf16/fp16 at real shapes); needs a CUDA or ROCm device."""
    if not _has_gpu():
        nodes = " or ".join(DEVICE_NODES.values())
        session.error(f"gpu: no CUDA/HIP device node ({nodes}) on this machine")
    install_project(session, "test")
    # tests/ci needs the `ci` extra and holds no `gpu` tests (as in the suite sessions below).
    session.run("pytest", "--ignore=tests/ci", *_xdist(session), *_marked(session, "gpu"))


# One session per kernel suite (pytest marker): what a matrix cell runs in a Buildkite step or a
# Kubernetes Job (src/kubematrix/matrix.py). No GPU, or TRITON_INTERPRET=1 (a CPU cell): the
# interpreter and the CPU-sized tests; a GPU: the whole suite on it, but the tests marked `cpu`.
# `compile` has its own session.
MATRIX_SUITES = ("paged", "mla", "hybrid", "specdec", "policy")


MAMBA_EXTENSIONS: list[str] = PYPROJECT["tool"]["portattn"]["mamba-extensions"]
WHEELHOUSE = os.environ.get("PORTATTN_WHEELHOUSE", "/opt/wheels")


def _mamba_extensions(session: nox.Session) -> None:
    """mamba-ssm / causal-conv1d: the GPU image's prebuilt wheels; on a CPU machine, none."""
    if _environment_as_is(session):  # the images install them from /opt/wheels
        return
    if not _has_gpu():
        session.log(
            "hybrid: CPU machine: mamba-ssm and causal-conv1d are CUDA/HIP extensions and do not "
            "apply here; running the CPU tests (their tests skip, with the reason, in the summary)"
        )
        return
    if not os.path.isdir(WHEELHOUSE):
        session.warn(
            f"hybrid: no wheelhouse at {WHEELHOUSE} (PORTATTN_WHEELHOUSE): mamba-ssm and "
            "causal-conv1d are source-only CUDA/HIP builds made in the GPU images; their tests skip"
        )
        return
    # As the images install them: the wheels without their declared requirements (build tools,
    # optional kernels, a second Triton), then what they import, under the backend's pins.
    session.install("--no-index", "--no-deps", "--find-links", WHEELHOUSE, *MAMBA_EXTENSIONS)
    session.install("-c", f"constraints/{_backend()}.txt", *_mamba_runtime_requirements())


def _mamba_runtime_requirements() -> list[str]:
    """tools/mamba_wheels.py's `RUNTIME_REQUIREMENTS` (what the images install too)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mamba_wheels", "tools/mamba_wheels.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.RUNTIME_REQUIREMENTS)


#: Set by every runner of a GPU cell to the architecture it must run on (kubematrix.matrix).
CELL_ARCH_ENV = "PORTATTN_CELL_ARCH"
#: The values Triton reads as "on" in a boolean variable (lowercased), as its own knobs do
#: (``triton.knobs``; tests/ci holds this to them): TRITON_INTERPRET=true is the interpreter too.
TRITON_TRUE = ("1", "true", "yes", "on", "y")


def triton_interpret() -> bool:
    """Whether TRITON_INTERPRET asks for Triton's interpreter, read as Triton reads it."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in TRITON_TRUE


#: The suite sessions by name (tests call them with a stand-in session).
SUITE_SESSIONS: dict[str, Callable[[nox.Session], None]] = {}


def _suite_session(suite: str) -> None:
    def run(session: nox.Session) -> None:
        arch = os.environ.get(CELL_ARCH_ENV)
        # A CPU cell sets TRITON_INTERPRET=1: it asks for the interpreter variant, GPU or not
        # (a CPU queue's agent may have one; the GPU variant under the interpreter is no cell).
        interpret = triton_interpret()
        if arch and interpret:
            session.error(
                f"{suite}: this cell targets {arch} ({CELL_ARCH_ENV}) but TRITON_INTERPRET="
                f"{os.environ['TRITON_INTERPRET']} asks for the CPU interpreter; a GPU cell runs "
                "without it"
            )
        if arch and not _has_gpu():
            # A GPU cell on a machine without the device (a pod without its GPU, a mislabelled
            # agent) would run the CPU variant of the suite and pass, testing nothing on arch.
            session.error(
                f"{suite}: this cell targets {arch} ({CELL_ARCH_ENV}) but no GPU device node is "
                f"visible ({', '.join(DEVICE_NODES.values())}); its tests would run on the CPU "
                "interpreter instead of the GPU"
            )
        # The hybrid suite builds real models' configs with transformers (the `hybrid` extra).
        install_project(session, "test", *(["hybrid"] if suite == "hybrid" else []))
        if suite == "hybrid":
            _mamba_extensions(session)
        # tests/ci needs the `ci` extra and holds only `ci`-marked tests: not collected here.
        skip_ci = "--ignore=tests/ci"
        xdist = _xdist(session)
        if _has_gpu() and not interpret:  # the whole suite on the device, but the `cpu` tests
            marker = f"{suite} and not cpu"
            session.run("pytest", skip_ci, *xdist, *_marked(session, marker))
        else:
            marker = f"{suite} and not gpu"
            env = {"TRITON_INTERPRET": "1"}
            session.run("pytest", skip_ci, *xdist, *_marked(session, marker), env=env)

    run.__doc__ = f"Matrix suite {suite}: pytest -m {suite} (TRITON_INTERPRET=1 without a GPU)."
    SUITE_SESSIONS[suite] = run
    nox.session(name=suite, default=False)(run)


for _suite in MATRIX_SUITES:
    _suite_session(_suite)


@nox.session(default=False)
def matrix(session: nox.Session) -> None:
    """The whole matrix this machine can run, then one summary (`-- --runner k8s`: Kubernetes)."""
    install_project(session, "test", "ci", "hybrid")  # what the CPU gate installs
    session.run("python", "-m", "kubematrix", "matrix", *session.posargs)


def _install_ci_layer(session: nox.Session) -> None:
    """kubematrix without torch/triton (the CI layer never imports them): a fast bootstrap step;
    in a CI image or with ``--no-venv``, nothing (`_environment_as_is`)."""
    if _environment_as_is(session):
        session.log(f"{IMAGE_ENV}=1 or --no-venv: running in this environment as it is")
        return
    needs = [*PYPROJECT["project"]["dependencies"], *EXTRAS["ci"]]
    session.install(*(r for r in needs if r.startswith(("pyyaml", "kubernetes="))))
    session.install("--no-deps", "-e", ".")


@nox.session(default=False)
def pipeline(session: nox.Session) -> None:
    """Print the generated Buildkite pipeline (`-- --help` for selection and lanes)."""
    _install_ci_layer(session)
    session.run("python", "-m", "kubematrix", "pipeline", *session.posargs)


@nox.session(default=False)
def report(session: nox.Session) -> None:
    """Matrix summary from results/matrix (`-- --buildkite`: annotate the Buildkite build)."""
    _install_ci_layer(session)
    session.run("python", "-m", "kubematrix", "report", *session.posargs)


@nox.session(default=False)
@nox.parametrize("suite", ["paged", "mla", "hybrid", "specdec"])
@nox.parametrize("vendor", ["cuda", "rocm"])
def k8s(session: nox.Session, vendor: str, suite: str) -> None:
    """One cell as a Kubernetes Job (kubeconfig context or in-cluster; `-- --namespace NS`)."""
    # the session is one cell: a --vendor or --suite among its arguments would add another
    named = [a for a in session.posargs if a.split("=")[0] in ("--vendor", "--suite")]
    if named:
        session.error(f"k8s({vendor}, {suite}) runs that one cell; got {named} (name another "
                      "session, or run python -m kubematrix.k8s)")  # fmt: skip
    _install_ci_layer(session)
    args = ["--vendor", vendor, "--suite", suite, *session.posargs]
    session.run("python", "-m", "kubematrix.k8s", *args)
