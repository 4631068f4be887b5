"""The CI matrix as data: suite x backend x target, how each cell runs, and who can run it.

One definition feeds every runner — the local runner (``nox -s matrix``), the Kubernetes fan-out
(``--runner k8s``) and the generated Buildkite pipeline — so the lanes cannot drift apart.

| suite   | cpu-interpreter | cuda sm_90 | cuda sm_100 | rocm gfx942      | rocm gfx950 |
|---------|-----------------|------------|-------------|------------------|-------------|
| paged   | x               | x          | x (exp.)    | x                | x (exp.)    |
| mla     | x               | x          | x (exp.)    | x                | x (exp.)    |
| hybrid  | x               | x          | x (exp.)    | x (experimental) | x (exp.)    |
| specdec | x               | x          | x (exp.)    | x                | x (exp.)    |
| policy  | x               |            |             |                  |             |
| compile | x               |            |             |                  |             |

``policy`` is pure Python and ``compile`` cross-compiles for every target with Triton's own
backends, so neither gains anything from a GPU; they are CPU cells only. The kernel suites run on
CPU through Triton's interpreter (``TRITON_INTERPRET=1``, small fp32/fp16 shapes) and on each GPU
pool at real shapes. "Target" is the GPU architecture of a pool, and only GPU cells have one: a
GPU cell is placed on nodes of exactly its architecture (the ``k8s/overlays/<arch>`` node
selectors) and its first test checks that the live device is that architecture
(``ARCH_ENV``). sm_100 and gfx950 cells are experimental until a pool of that kind runs them.

This module is pure data plus a few file-system checks: it never imports triton, torch or portattn
(docs/design.md §1).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

RUNNERS = ("local", "k8s")
COMPILE_MODULE = "portattn.compile"
#: pytest-xdist workers a cell uses at most (each worker pays the imports and compiles again).
MAX_PYTEST_WORKERS = 8


def pytest_workers() -> int:
    """pytest-xdist workers per cell, for every runner: the usable cores, at most
    :data:`MAX_PYTEST_WORKERS`. The local runner passes it to pytest; the nox sessions (what a
    Buildkite step and a Kubernetes Job run) ask the installed kubematrix for it."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_PYTEST_WORKERS))


#: How xdist hands out tests: an idle worker takes half of a busy one's queue, so a cell does
#: not end with one worker running a suite's long tests while the others wait.
PYTEST_DIST = "worksteal"


def pytest_xdist_args(workers: int | None = None) -> list[str]:
    """pytest's xdist arguments for ``workers`` (default `pytest_workers`): none for one worker
    (the tests run in pytest's own process)."""
    n = pytest_workers() if workers is None else workers
    return ["-n", str(n), "--dist", PYTEST_DIST] if n > 1 else []


# The architecture a GPU cell must run on; tests/test_cell_arch.py compares the live device to it.
ARCH_ENV = "PORTATTN_CELL_ARCH"


@dataclass(frozen=True)
class GpuArch:
    """One GPU architecture of a backend's pools: a cell per (suite, arch).

    Attributes:
        name: the ``portattn.platform`` target name (``sm_90``, ``gfx942``), also the name of the
            ``k8s/overlays/<name>`` overlay that selects its nodes.
        build_arch: the architecture as the image's native builds spell it (``TORCH_CUDA_ARCH_LIST``
            ``9.0``; ``HIP_ARCHITECTURES`` ``gfx942``): the Mamba wheels are built for these.
        pool: the parts such a pool holds (documentation).
        experimental: why the cells on it may fail without blocking, or None.
    """

    name: str
    build_arch: str
    pool: str
    experimental: str | None = None


@dataclass(frozen=True)
class Backend:
    """Where a cell runs: the CPU interpreter or one vendor's GPU pool.

    Attributes:
        name: ``"cpu-interpreter"``, ``"cuda"`` or ``"rocm"``.
        vendor: the Kubernetes vendor overlay (``"cuda"``, ``"rocm"``); ``None`` on CPU.
        archs: the GPU architectures of the backend's pools (one cell per arch), empty on CPU.
        device_nodes: device-node globs, any match meaning "this machine has such a GPU" (a pod
            given one GPU of eight sees only that GPU's node, e.g. ``/dev/nvidia6``).
        gpu_resource: the Kubernetes extended resource a pod asks for, ``None`` on CPU.
        queue: the Buildkite agent queue of the lane.
        env: environment the cell's tests run with.
        paths: changed files (globs) that concern every cell of this backend.
        timeout_minutes: the step / Job deadline for a cell of this backend.
    """

    name: str
    vendor: str | None
    archs: tuple[GpuArch, ...]
    device_nodes: tuple[str, ...]
    gpu_resource: str | None
    queue: str
    env: Mapping[str, str] = field(default_factory=dict)
    paths: tuple[str, ...] = ()
    timeout_minutes: int = 30

    @property
    def is_gpu(self) -> bool:
        return self.vendor is not None

    @property
    def targets(self) -> tuple[str, ...]:
        """The architectures' names, in cell order."""
        return tuple(a.name for a in self.archs)

    def arch(self, name: str) -> GpuArch:
        """The architecture called ``name``; ValueError naming the valid ones otherwise."""
        for a in self.archs:
            if a.name == name:
                return a
        raise ValueError(f"Backend.arch: name must be one of {self.targets}; got {name!r}")


@dataclass(frozen=True)
class Suite:
    """A pytest marker (registered in pyproject.toml) and the files that concern it.

    ``paths`` are ``fnmatch`` globs over repository-relative paths in which ``*`` also crosses
    ``/``: ``src/portattn/*mla*`` matches ``src/portattn/kernels/mla_decode.py``.
    """

    name: str
    description: str
    backends: tuple[str, ...]
    paths: tuple[str, ...]
    experimental_on: Mapping[str, str] = field(default_factory=dict)  # backend -> why


_NO_POOL = "no pool of this architecture has run the matrix yet"

# The Kubernetes templates (package data; the repository's k8s/ is a symlink to them).
_MANIFESTS = "src/kubematrix/manifests"

BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend(
            name="cpu-interpreter",
            vendor=None,
            archs=(),
            device_nodes=(),
            gpu_resource=None,
            queue="cpu",
            env={"TRITON_INTERPRET": "1"},
            paths=("constraints/cpu.txt",),  # the CPU sessions' torch and Triton pins
            timeout_minutes=30,
        ),
        Backend(
            name="cuda",
            vendor="cuda",
            archs=(
                GpuArch("sm_90", "9.0", "H100 / H200"),
                GpuArch("sm_100", "10.0", "B200 / GB200", experimental=_NO_POOL),
            ),
            device_nodes=("/dev/nvidia[0-9]*",),
            gpu_resource="nvidia.com/gpu",
            queue="gpu-cuda",
            paths=(
                f"{_MANIFESTS}/setup/*",  # the namespace's Pod Security and the RBAC
                f"{_MANIFESTS}/base/*",
                f"{_MANIFESTS}/overlays/cuda/*",
                f"{_MANIFESTS}/overlays/sm_*/*",  # the overlays of its architectures
            ),
            timeout_minutes=45,
        ),
        Backend(
            name="rocm",
            vendor="rocm",
            archs=(
                GpuArch("gfx942", "gfx942", "MI300X / MI325X"),
                GpuArch("gfx950", "gfx950", "MI350X / MI355X", experimental=_NO_POOL),
            ),
            device_nodes=("/dev/kfd",),
            gpu_resource="amd.com/gpu",
            queue="gpu-rocm",
            paths=(
                f"{_MANIFESTS}/setup/*",  # the namespace's Pod Security and the RBAC
                f"{_MANIFESTS}/base/*",
                f"{_MANIFESTS}/overlays/rocm/*",
                f"{_MANIFESTS}/overlays/gfx*/*",  # the overlays of its architectures
            ),
            timeout_minutes=45,
        ),
    )
}

_KERNEL_BACKENDS = ("cpu-interpreter", "cuda", "rocm")
# Files every suite depends on: the packaging, the sessions, the test harness, the targets.
_COMMON = (
    "pyproject.toml",
    "noxfile.py",
    "tests/conftest.py",
    "tests/helpers.py",
    "src/portattn/__init__.py",
    "src/portattn/platform.py",
)
# ... and the kernel suites on the shared kernel foundations.
_KERNEL_COMMON = (
    *_COMMON,
    "src/portattn/layout.py",
    "src/portattn/reference.py",
    "src/portattn/kernels/_launch.py",
    "src/portattn/kernels/__init__.py",
    "src/portattn/policy/common.py",
    "src/portattn/policy/__init__.py",
)
# Files that change how every cell runs: a change here reruns the whole matrix (the code only:
# a vendor's Kubernetes template concerns that vendor's cells, through Backend.paths).
MATRIX_PATHS = ("src/kubematrix/*.py", ".buildkite/*")


# What a vendor's CI image runs at build time besides its Dockerfile and constraints.
IMAGE_TOOLS = ("tools/mamba_wheels.py", "tools/check_image.py")


def image_inputs(vendor: str) -> tuple[str, ...]:
    """The files ``vendor``'s CI image is built from: Dockerfile, constraints, build tools
    (`kubematrix.images` hashes them into the image's content key)."""
    return (f"Dockerfile.{vendor}", f"constraints/{vendor}.txt", *IMAGE_TOOLS)


def _image_paths(backend: Backend) -> tuple[str, ...]:
    """What a GPU backend's cells run in: its image's inputs and the build context's filter
    (the cell layer's COPYs)."""
    return () if backend.vendor is None else (*image_inputs(backend.vendor), ".dockerignore")


SUITES: dict[str, Suite] = {
    s.name: s
    for s in (
        Suite(
            "paged",
            "paged attention, KV-cache write/gather, page indices",
            _KERNEL_BACKENDS,
            ("src/portattn/*paged*", "src/portattn/*kv_cache*", "tests/*paged*", "tests/*kv*"),
        ),
        Suite(
            "mla",
            "MLA decode",
            _KERNEL_BACKENDS,
            ("src/portattn/*mla*", "tests/*mla*"),
        ),
        Suite(
            "hybrid",
            "hybrid (Mamba + attention) models and interleaved caches",
            _KERNEL_BACKENDS,
            (
                "src/portattn/*hybrid*",
                "src/portattn/*paged*",
                "src/portattn/*kv_cache*",
                "tests/*hybrid*",
            ),
            # mamba-ssm / causal-conv1d ROCm builds trail the CUDA ones; a red cell there is
            # reported (soft fail) without blocking the merge.
            experimental_on={"rocm": "mamba-ssm/causal-conv1d ROCm builds are not yet stable"},
        ),
        Suite(
            "specdec",
            "speculative decoding: block-size negotiation, verification steps, metadata",
            _KERNEL_BACKENDS,
            (
                "src/portattn/blocksize.py",
                "src/portattn/*specdec*",
                "src/portattn/*mla*",
                "src/portattn/*page_indices*",
                "src/portattn/*metadata*",
                "tests/*specdec*",
            ),
        ),
        Suite(
            "policy",
            "pure tile-policy tests",
            ("cpu-interpreter",),
            ("src/portattn/policy/*", "tests/policy/*"),
        ),
        Suite(
            "compile",
            "cross-target compile matrix (Triton's NVIDIA and AMD backends, no GPU)",
            ("cpu-interpreter",),
            (
                "src/portattn/kernels/*",
                "src/portattn/policy/*",
                "src/portattn/compile*",
                "tests/compile/*",
            ),
        ),
    )
}


@dataclass(frozen=True)
class Cell:
    """One cell of the matrix: a suite on a backend (and a GPU target where it matters)."""

    suite: str
    backend: str
    target: str | None = None
    experimental: str | None = None  # why the cell is allowed to fail, or None

    @property
    def name(self) -> str:
        """``paged-cpu-interpreter``, ``mla-cuda-sm_90`` ... (a valid Buildkite step key)."""
        parts = [self.suite, self.backend] + ([self.target] if self.target else [])
        return "-".join(parts)

    @property
    def spec(self) -> Backend:
        return BACKENDS[self.backend]

    @property
    def label(self) -> str:
        where = self.backend + (f" {self.target}" if self.target else "")
        return f"{self.suite} · {where}"

    @property
    def timeout_minutes(self) -> int:
        return self.spec.timeout_minutes

    @property
    def env(self) -> dict[str, str]:
        """The cell's environment: the backend's, plus the architecture a GPU cell must find."""
        env = dict(self.spec.env)
        if self.target is not None:
            env[ARCH_ENV] = self.target
        return env

    @property
    def paths(self) -> tuple[str, ...]:
        """Changed-file globs that select this cell."""
        suite = SUITES[self.suite]
        common = _COMMON if self.suite == "policy" else _KERNEL_COMMON
        return (*suite.paths, *common, *self.spec.paths, *_image_paths(self.spec), *MATRIX_PATHS)

    def junit_path(self, results_dir: str | os.PathLike[str]) -> Path:
        return Path(results_dir) / f"{self.name}.xml"

    @property
    def nox_session(self) -> str:
        """The nox session of the suite (``nox -s paged`` ...): ``pytest -m <suite>`` under
        ``TRITON_INTERPRET=1`` without a GPU, on the device with one; ``compile`` runs the
        compile matrix module."""
        return self.suite

    def nox_args(self, results_dir: str | os.PathLike[str] | None = None) -> list[str]:
        """The session's arguments; with ``results_dir``, where the JUnit / compile report go."""
        if self.suite == "compile":
            return [] if results_dir is None else self.compile_args(results_dir)
        return [] if results_dir is None else [f"--junitxml={self.junit_path(results_dir)}"]

    def nox_command(self, results_dir: str | os.PathLike[str] = "results/matrix") -> list[str]:
        """How a CI step runs the cell: ``nox -s <suite> -- <args>``."""
        return ["nox", "-s", self.nox_session, "--", *self.nox_args(results_dir)]

    def pytest_args(self, results_dir: str | os.PathLike[str]) -> list[str]:
        """What the suite's nox session passes to pytest, for the local runner (same env).

        CPU cells deselect ``gpu`` tests; GPU cells run the whole suite on the device (the
        CPU-sized tests too: they are fast there and catch target-specific miscompiles) except
        the tests marked ``cpu`` (CPU tensors through the interpreter by design).
        """
        marker = f"{self.suite} and not {'cpu' if self.spec.is_gpu else 'gpu'}"
        # tests/ci holds only `ci`-marked tests: not collected (as in the suite sessions).
        return ["--ignore=tests/ci", "-m", marker, f"--junitxml={self.junit_path(results_dir)}"]

    def compile_args(self, results_dir: str | os.PathLike[str]) -> list[str]:
        """Arguments of ``python -m portattn.compile`` for the compile cell."""
        return ["--out", str(Path(results_dir) / "compile")]


def all_cells() -> list[Cell]:
    """Every cell, in report order: suites in definition order, CPU lane first."""
    cells = []
    for suite in SUITES.values():
        for backend_name in suite.backends:
            backend = BACKENDS[backend_name]
            why = suite.experimental_on.get(backend_name)
            if not backend.archs:
                cells.append(Cell(suite.name, backend_name, None, why))
            for arch in backend.archs:
                cells.append(Cell(suite.name, backend_name, arch.name, why or arch.experimental))
    return cells


def get_cell(name: str) -> Cell:
    """The cell called ``name``; ValueError listing the valid names otherwise."""
    for cell in all_cells():
        if cell.name == name:
            return cell
    names = ", ".join(c.name for c in all_cells())
    raise ValueError(f"get_cell: name must be one of {names}; got {name!r}")


def select_cells(
    cells: Iterable[Cell],
    *,
    suites: Iterable[str] = (),
    backends: Iterable[str] = (),
    names: Iterable[str] = (),
) -> list[Cell]:
    """Cells filtered by suite, backend and exact name (an empty filter keeps everything); an
    unknown value is a ValueError naming the CLI option that gives it."""
    suites, backends, names = set(suites), set(backends), set(names)
    errors = []
    if unknown := suites - set(SUITES):
        errors.append(f"--suite must be one of {sorted(SUITES)}; got {sorted(unknown)}")
    if unknown := backends - set(BACKENDS):
        errors.append(f"--backend must be one of {sorted(BACKENDS)}; got {sorted(unknown)}")
    all_names = {c.name for c in all_cells()}
    if unknown := names - all_names:
        errors.append(f"--cell must be one of {sorted(all_names)}; got {sorted(unknown)}")
    if errors:
        raise ValueError("; ".join(errors))
    return [
        c
        for c in cells
        if (not suites or c.suite in suites)
        and (not backends or c.backend in backends)
        and (not names or c.name in names)
    ]


# -- what a runner can run ---------------------------------------------------------------------


def compile_module_available() -> bool:
    """``portattn.compile`` exists, checked on disk (importing portattn would import triton)."""
    spec = importlib.util.find_spec("portattn")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(
        (Path(loc) / "compile.py").is_file() or (Path(loc) / "compile" / "__init__.py").is_file()
        for loc in spec.submodule_search_locations
    )


def local_gpu_arch(vendor: str) -> str | None:
    """The architecture of the local GPU as its vendor tool reports it, or None if unknown."""
    try:
        if vendor == "cuda" and shutil.which("nvidia-smi"):
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout.split()
            return "sm_" + out[0].replace(".", "") if out else None
        if vendor == "rocm" and shutil.which("rocminfo"):
            info = subprocess.run(
                ["rocminfo"], capture_output=True, text=True, timeout=30, check=True
            ).stdout
            names = [w for w in info.split() if w.startswith("gfx") and w[3:].isalnum()]
            return names[0] if names else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None
    return None


@dataclass(frozen=True)
class Host:
    """What the local machine offers, gathered once (injectable for tests)."""

    device_nodes: frozenset[str]
    gpu_arch: Mapping[str, str | None]  # vendor -> arch, None when it cannot be told
    compile_module: bool
    pytest: bool = True  # pytest and pytest-xdist importable: what the pytest cells run with

    @classmethod
    def probe(cls) -> Host:
        nodes = frozenset(n for b in BACKENDS.values() for n in b.device_nodes if glob.glob(n))
        arch = {
            b.vendor: local_gpu_arch(b.vendor)
            for b in BACKENDS.values()
            if b.vendor and any(n in nodes for n in b.device_nodes)
        }
        tools = all(importlib.util.find_spec(m) is not None for m in ("pytest", "xdist"))
        return cls(nodes, arch, compile_module_available(), tools)


def why_not_runnable(cell: Cell, runner: str, host: Host | None = None) -> str | None:
    """Why ``runner`` cannot run ``cell`` here, or None when it can.

    ``local`` runs CPU cells always and GPU cells when a device of the cell's vendor and target is
    present; ``k8s`` runs every cell (each pool brings its GPUs), given the compile module.
    """
    if runner not in RUNNERS:
        raise ValueError(f"why_not_runnable: runner must be one of {RUNNERS}; got {runner!r}")
    host = host or Host.probe()
    if cell.suite == "compile" and not host.compile_module:
        return f"{COMPILE_MODULE} not available"
    if runner == "local" and cell.spec.is_gpu:
        backend = cell.spec
        if not any(n in host.device_nodes for n in backend.device_nodes):
            nodes = ", ".join(backend.device_nodes)
            return f"no GPU ({backend.name}): none of {nodes} on this machine"
        arch = host.gpu_arch.get(backend.vendor or "")
        if arch is not None and cell.target is not None and arch != cell.target:
            return f"local {backend.name} GPU is {arch}, the cell targets {cell.target}"
    runs_here = runner == "local" or not cell.spec.is_gpu  # the k8s runner runs CPU cells here
    if runs_here and cell.suite != "compile" and not host.pytest:
        return "pytest and pytest-xdist are not installed here (pip install 'portattn[test]')"
    return None
