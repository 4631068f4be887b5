"""Every way to run anything: locally, in a Buildkite step, or inside a Kubernetes Job.

Sessions are thin: they install from pyproject.toml and call into src/. ``nox -l`` lists them.
"""

from __future__ import annotations

import os

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True

PYPROJECT = nox.project.load_toml("pyproject.toml")
CPU_TORCH: str = PYPROJECT["tool"]["portattn"]["cpu-torch"]
EXTRAS: dict[str, list[str]] = PYPROJECT["project"]["optional-dependencies"]


def _has_gpu() -> bool:
    """A CUDA/HIP device is visible (checked without importing torch into nox)."""
    return any(os.path.exists(p) for p in ("/dev/nvidia0", "/dev/kfd"))


def install_project(session: nox.Session, *extras: str) -> None:
    """Install portattn with ``extras``; on a CPU machine pin torch's CPU build first."""
    if not _has_gpu():
        session.install(CPU_TORCH)
    spec = f".[{','.join(extras)}]" if extras else "."
    session.install("-e", spec)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check, ruff format --check and mypy on src/."""
    session.install(*EXTRAS["lint"], *EXTRAS["ci"], "types-PyYAML")
    session.run("ruff", "check", "src", "tests", "noxfile.py", "bench")
    session.run("ruff", "format", "--check", "src", "tests", "noxfile.py", "bench")
    session.run("mypy", "src")


@nox.session
def tests(session: nox.Session) -> None:
    """The CPU gate: policies, every kernel under TRITON_INTERPRET=1, compile matrix, CI layer."""
    install_project(session, "test", "ci")
    env = {"TRITON_INTERPRET": "1"}
    session.run("pytest", "-n", "2", "-m", "not gpu", *session.posargs, env=env)


@nox.session(default=False)
def gpu(session: nox.Session) -> None:
    """The GPU suites (bf16/fp16 at real shapes); needs a CUDA or ROCm device."""
    if not _has_gpu():
        session.error("gpu: no CUDA/HIP device node (/dev/nvidia0 or /dev/kfd) on this machine")
    install_project(session, "test")
    session.run("pytest", "-m", "gpu", *session.posargs)
