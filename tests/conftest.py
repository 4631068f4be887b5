"""Test configuration: device selection and the `gpu` marker."""

from __future__ import annotations

import functools
import os
import re

import pytest

#: TRITON_INTERPRET read as Triton reads a boolean (noxfile.TRITON_TRUE; tests/ci checks both
#: against Triton's knobs): "true" runs the interpreter as "1" does.
TRITON_TRUE = ("1", "true", "yes", "on", "y")
INTERPRET = os.environ.get("TRITON_INTERPRET", "").lower() in TRITON_TRUE


@functools.cache
def has_gpu() -> bool:
    """Whether torch sees a GPU. Asked only where tests are collected or run: the xdist controller
    of a cell never imports torch (a few seconds of every cell's start on a GPU host)."""
    import torch

    return torch.cuda.is_available()


def _is_xdist_controller(config) -> bool:
    """The process that only hands tests to pytest-xdist workers (it collects and runs none)."""
    return "PYTEST_XDIST_WORKER" not in os.environ and bool(
        getattr(config.option, "numprocesses", None)
    )


# Runs first in a GPU cell: the check that the cell's GPU is the architecture it targets.
FIRST = "test_cell_arch.py::test_the_live_gpu_is_the_cells_architecture"
#: Set by every runner of a GPU cell to the architecture it targets (kubematrix.matrix.ARCH_ENV).
ARCH_ENV = "PORTATTN_CELL_ARCH"


def pytest_configure(config):
    """Under pytest-xdist, each worker's torch takes its share of the cores: host references in
    N workers at every core's thread each oversubscribe the machine N times over. On a GPU the
    references run on the device, and torch's low-precision baseline keeps full-precision
    reductions there (as on a CPU), so the tolerance rule's yardstick is the same on both."""
    if _is_xdist_controller(config):
        return
    import torch

    if has_gpu():
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(max(1, (cores or 1) // workers))


#: The markers a matrix cell selects (``-m "<suite> and not cpu|gpu"``: kubematrix's pytest suites).
SUITE_MARKERS = ("policy", "paged", "mla", "hybrid", "specdec")
_SUITE_RUN = re.compile(rf"\s*({'|'.join(SUITE_MARKERS)})(?:\s+and\s+not\s+(?:cpu|gpu))?\s*")


def pytest_ignore_collect(collection_path, config):
    """A suite's run (every matrix cell) does not import the test modules that never write the
    suite's marker (``mark.<suite>``): none of their tests could be selected, and importing them
    is most of a cell's start. tests/test_suite_collection.py holds every test to that rule."""
    m = _SUITE_RUN.fullmatch(config.option.markexpr or "")
    if m is None or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    return None if f"mark.{m.group(1)}" in collection_path.read_text() else True


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: not item.nodeid.endswith(FIRST))  # stable: the rest keep order
    skip = pytest.mark.skip(reason="needs a CUDA/HIP device (marker gpu)")
    cpu_only = pytest.mark.skip(reason="CPU-cell test (marker cpu): runs with TRITON_INTERPRET=1")
    if os.environ.get(ARCH_ENV) and not has_gpu():
        # A GPU cell whose torch sees no GPU: its first test fails saying why; nothing else
        # runs, so the host-only tests cannot make the cell pass without its GPU.
        unusable = pytest.mark.skip(reason=f"this GPU cell's device is not usable: see {FIRST}")
        for item in items:
            if not item.nodeid.endswith(FIRST):
                item.add_marker(unusable)
        return
    for item in items:
        if "gpu" in item.keywords and not has_gpu():
            item.add_marker(skip)
        if item.get_closest_marker("cpu") and not INTERPRET:
            item.add_marker(cpu_only)


@pytest.fixture
def device() -> str:
    """The one place that decides where a kernel test's tensors live: 'cpu' under
    TRITON_INTERPRET=1, else the GPU. Every tensor a case hands to an op (caches, block tables,
    slot mappings, seq_lens, query_start_loc) is made on it, so a test that passes on the CPU
    runs unchanged in a GPU cell; tests that need CPU tensors by design are marked ``cpu``."""
    if INTERPRET or not has_gpu():
        if not INTERPRET:
            pytest.skip("kernel tests need TRITON_INTERPRET=1 (CPU) or a GPU")
        return "cpu"
    return "cuda"
