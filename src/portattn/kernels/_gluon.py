"""Helpers shared by the Gluon (sm_90) kernels."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def row_ptrs(base, rows, cols, stride_dim, ALIGNED: gl.constexpr, VEC: gl.constexpr):
    """``base + rows[:, None] + cols[None, :] * stride_dim``: a tile of row pointers (``rows``:
    each row's offset; ``cols``: ``VEC`` or fewer consecutive columns a thread).

    ``ALIGNED``: the launcher found the rows contiguous and 16-byte aligned
    (`portattn.kernels._launch.rows_aligned`), so the pointers are said to be ``VEC``-element runs
    that start 16 bytes apart. A `gl.warp_specialize` partition cannot see the launch's alignment
    itself, and without the hint its loads and stores go element by element. The hint only
    holds on the op that makes the pointers, which is why they are made here.
    """
    ptrs = base + rows[:, None] + cols[None, :] * stride_dim
    if ALIGNED:
        ptrs = gl.max_contiguous(gl.multiple_of(ptrs, [1, 16]), [1, VEC])
    return ptrs


@gluon.jit
def clock64():
    """This SM's cycle counter (``%clock64``): the diagnostics' stamps and timings."""
    return gl.inline_asm_elementwise(
        "mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1
    )


@gluon.jit
def clock_stamp(tr, slot, k: gl.constexpr, TRACE: gl.constexpr, SLOTS: gl.constexpr,
                EVENTS: gl.constexpr, GLOBAL: gl.constexpr = False):  # fmt: skip
    """Diagnostic (``TRACE``): this SM's clock (``GLOBAL``: the global timer, ns) at event ``k``
    of slot ``slot`` in one partition's trace (``tr``: the int64 buffer and the partition's first
    element; ``EVENTS`` stamps a slot). Slots ``0 .. SLOTS - 1`` are the kernel's steps (pairs,
    tiles), slot ``SLOTS`` the kernel's own events; anything past it is dropped. Compiled out
    when ``TRACE`` is off. Both sm_90 kernels' traces (bench/trace_mla.py, bench/trace_prefill.py).
    """
    if TRACE:
        trace_ptr, base = tr
        if GLOBAL:
            now = gl.inline_asm_elementwise(
                "mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1
            )
        else:
            now = clock64()
        gl.store(trace_ptr + base + slot * EVENTS + k, now, mask=slot <= SLOTS)


@gluon.jit
def trace_slot(step, TRACE: gl.constexpr, SLOTS: gl.constexpr):
    """The trace slot of step ``step``: itself, or past the buffer's (dropped) from ``SLOTS`` on."""
    if TRACE:
        step = gl.where(step < SLOTS, step, SLOTS + 1)
    return step
