"""Shared test helpers: the tolerance rule and input builders."""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import pytest
import torch

#: A test that compiles for a target it names and runs nothing on a device: the CPU cells and the
#: gate run it, GPU cells deselect it (marker ``cpu``), since a device adds nothing to a compile.
target_compile = pytest.mark.cpu


#: The sm_90 prefill's two-warpgroup turns on 128-token tiles at 3 stages (a caller's config at
#: head_dim 128, whose policy tile takes three warpgroups on 64-token tiles): the tile whose
#: 16-row boxes are 8 a tile (V pages).
TILE_128 = dict(block_n=128, stages=3, warpgroups=2, consumer_regs=216, producer_regs=64)


def tile_128(block_size: int = 16) -> dict:
    """`PrefillConfig` changes to `TILE_128` at ``block_size`` (its box and paging), with V by
    page boxes at 8 boxes a tile (the policy's rule)."""
    from portattn.policy.paged import SM90_PREFILL_V_PAGES_MIN_BOXES, box_rows, paging_mode

    box = box_rows(block_size, 128)
    return TILE_128 | dict(box=box, paging=paging_mode(block_size, box, 128),
                           v_pages=128 // box >= SM90_PREFILL_V_PAGES_MIN_BOXES)  # fmt: skip


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


def _no_interpreter() -> None:
    """A spawned worker's first step: clear ``TRITON_INTERPRET`` (inherited from the test process)
    before any kernel module is imported, so its kernels compile."""
    os.environ.pop("TRITON_INTERPRET", None)


_POOL: ProcessPoolExecutor | None = None


def spawned_pool() -> ProcessPoolExecutor:
    """Two spawned worker processes without Triton's interpreter, started at the first call and
    kept for the rest of this test process: tests that compile kernels for named targets (which
    must not touch this process's Triton state) share them instead of each spawning its own,
    about 1.7 s of imports a process."""
    global _POOL
    if _POOL is None:
        ctx = multiprocessing.get_context("spawn")
        _POOL = ProcessPoolExecutor(max_workers=2, mp_context=ctx, initializer=_no_interpreter)
        atexit.register(_POOL.shutdown)
    return _POOL


@contextlib.contextmanager
def _shared_pool() -> Iterator[ProcessPoolExecutor]:
    """`spawned_pool`; a worker that died takes the pool with it, so the next user starts a
    fresh one."""
    global _POOL
    try:
        yield spawned_pool()
    except BrokenProcessPool:
        _POOL = None
        raise


def in_spawned_workers(fn, jobs) -> dict:
    """``{job: fn(*job)}`` computed in the shared spawned workers (`spawned_pool`). ``fn``: a
    module-level function; ``jobs``: tuples of its arguments."""
    with _shared_pool() as pool:
        futures = {job: pool.submit(fn, *job) for job in jobs}
        return {job: f.result() for job, f in futures.items()}


def compile_in_spawned_workers(cases, targets, **kwargs) -> list:
    """`portattn.compile.matrix.run_matrix` on the shared spawned workers (`spawned_pool`)."""
    from portattn.compile.matrix import run_matrix

    with _shared_pool() as pool:
        return run_matrix(cases, targets, executor=pool, **kwargs)


#: What a tensor may expose without its contents being read: shape, strides, dtype, device,
#: address and view flags.
_METADATA = frozenset(
    ("shape", "dtype", "device", "dim", "stride", "size", "element_size", "is_contiguous",
     "numel", "__len__", "data_ptr", "storage_offset", "ndim", "layout", "is_cuda", "is_meta",
     "is_neg", "is_conj")
)  # fmt: skip


class Opaque(torch.Tensor):
    """A tensor whose shape, strides, dtype and device may be read but not its contents:
    ``.item()``, ``.tolist()``, ``.to("cpu")``, comparisons, indexing ... raise."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name == "__get__":  # a property: Tensor.shape.__get__ ...
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if name not in _METADATA:
            raise RuntimeError(f"Opaque: the plan read a tensor's contents ({name})")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))
