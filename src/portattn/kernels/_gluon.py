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
    when ``TRACE`` is off. Both sm_90 kernels' traces (their ops' ``trace`` argument).
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


# -- lazy rescale (the sm_90 MLA kernel's online softmax) -----------------------------------------
#: Lazy running max: the reference max moves only when a row's tile max exceeds it by more than
#: this (log2 units), so P <= 2^LAZY_T; exact otherwise.
LAZY_T = gl.constexpr(8.0)


def rescale_asm(n: int) -> tuple[str, str]:
    """PTX and constraints for `lazy_rescale`: one thread's ``n`` accumulator registers (outputs
    tied to the inputs ``$n .. $2n-1``) times their row factors (``$2n .. $3n-1``), skipped with
    one branch when the thread's factors are exactly 1.

    A thread of a 64-row wgmma accumulator (one warpgroup) holds two rows (r, r + 8); the factors
    tested are elements 0-3 and n/2 .. n/2+3, which cover both rows whether the thread's elements
    run in column pairs per row (the NVMMA order), alternate rows, or run row by row. Testing
    every element is not folded by ptxas (n FSETP a rescale: no cheaper than the multiplies)."""
    probes = [0, 1, 2, 3] + [n // 2 + i for i in range(4)]
    lines = ["{", ".reg .pred %lz;", f"setp.neu.f32 %lz, ${2 * n + probes[0]}, 0f3F800000;"]
    lines += [f"setp.neu.or.f32 %lz, ${2 * n + i}, 0f3F800000, %lz;" for i in probes[1:]]
    lines.append("@!%lz bra lazy_skip_${:uid};")
    lines += [f"mul.f32 ${i}, ${i}, ${2 * n + i};" for i in range(n)]
    lines += ["lazy_skip_${:uid}:", "}"]
    constraints = ",".join(["=r"] * n + [str(i) for i in range(n)] + ["r"] * n)
    return "\n\t".join(lines), constraints


#: `rescale_asm` by values a thread: a warpgroup's 64-row accumulator of 32 to 256 columns (MLA's
#: 64 x 256: 128).
RESCALE_ASM = {n: rescale_asm(n) for n in (16, 32, 64, 128)}


@gluon.constexpr_function
def _rescale_parts(n):
    if n not in RESCALE_ASM:
        raise ValueError(
            f"lazy_rescale: {n} accumulator values a thread, not in {list(RESCALE_ASM)}"
        )
    return RESCALE_ASM[n]


@gluon.jit
def lazy_rescale(acc, factor, LAZY: gl.constexpr):
    """``acc * factor[:, None]`` (``acc``: one warpgroup's wgmma accumulator; ``factor`` in its
    row layout); LAZY: a thread whose factors are all exactly 1 skips its multiplies
    (`rescale_asm`)."""
    if LAZY:
        N: gl.constexpr = acc.shape[0] * acc.shape[1] // 128  # values a thread (RESCALE_ASM's)
        parts: gl.constexpr = _rescale_parts(N)
        return gl.inline_asm_elementwise(parts[0], parts[1], [acc, factor[:, None]],
                                         dtype=gl.float32, is_pure=True, pack=N)  # fmt: skip
    else:
        return acc * factor[:, None]
