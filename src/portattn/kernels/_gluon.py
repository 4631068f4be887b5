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
