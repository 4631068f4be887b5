"""Shared test helpers: the tolerance rule and input builders."""

from __future__ import annotations

import pytest
import torch

#: A test that compiles for a target it names and runs nothing on a device: the CPU cells and the
#: gate run it, GPU cells deselect it (marker ``cpu``), since a device adds nothing to a compile.
target_compile = pytest.mark.cpu


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64 (NaN-propagating)."""
    x, ref = x.double().cpu(), ref.double().cpu()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def assert_low_precision_close(out, oracle, torch_lowp, *, factor: float = 2.0, floor: float = 0.0):
    """design §5: kernel error vs the fp64 oracle <= factor x torch's error in the low precision.

    ``floor`` absorbs fp32 cases where torch's own error is ~1e-7 and the kernel's is a few ulps
    more (it is never larger than 1e-5 and is stated by the caller).
    """
    assert torch.isfinite(out).all(), "output has NaN/Inf"
    e_kernel, e_torch = rel_err(out, oracle), rel_err(torch_lowp, oracle)
    assert e_kernel <= factor * e_torch + floor, (
        f"kernel error {e_kernel:.3e} > {factor} x torch low-precision error {e_torch:.3e}"
        f" + {floor:.1e}"
    )


def in_spawned_workers(fn, jobs, workers: int = 2) -> dict:
    """``{job: fn(*job)}`` computed in spawned processes under the compile matrix's worker
    environment (`portattn.compile.matrix._worker_env`): for tests that compile kernels for
    other targets, which must not touch this process's Triton state. ``fn``: a module-level
    function; ``jobs``: tuples of its arguments."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from portattn.compile.matrix import _worker_env

    with _worker_env(None):
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            futures = {job: pool.submit(fn, *job) for job in jobs}
            return {job: f.result() for job, f in futures.items()}
