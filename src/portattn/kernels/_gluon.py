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


# -- exp2 split between the MUFU and the FMA pipe ------------------------------------------------
#: ``2^f`` on ``f`` in [-0.5, 0.5]: ``1 + f (C1 + f (C2 + f C3))``, a degree-3 fit of the relative
#: error (at most 1.0e-4 evaluated in fp32: about a fortieth of a bf16 ulp, a fifth of an fp16
#: ulp).
EXP2_POLY_COEFFS = (0.6932829022407532, 0.2422109693288803, 0.055008936673402786)
#: Elements ``exp2_split`` takes at a time; ``poly`` of them go through the polynomial.
EXP2_PACK = 4
#: Inputs below this are raised to it (``2^-126``, the smallest normal fp32): the polynomial's
#: exponent arithmetic stays in range, and a masked score (-inf) gives ``2^-126``, not 0.
EXP2_POLY_FLOOR = -126.0
_MAGIC = 12582912.0  # 1.5 * 2^23: adding it rounds an fp32 in [-2^22, 2^22] to an integer


def _f32_hex(x: float) -> str:
    import struct

    (bits,) = struct.unpack("<I", struct.pack("<f", x))
    return f"0f{bits:08X}"


def exp2_poly_reference(x):
    """The polynomial path of `exp2_split`, step for step in fp32 on the CPU (numpy): what each
    PTX instruction of `exp2_split_asm` computes, for tests of the method's accuracy."""
    import numpy as np

    f32 = np.float32
    # fmax, as PTX's max: NaN gives the other operand
    x = np.fmax(np.asarray(x, dtype=f32), f32(EXP2_POLY_FLOOR))
    t = (x + f32(_MAGIC)).astype(f32)  # round to nearest: the integer part in the low bits
    r = (t - f32(_MAGIC)).astype(f32)
    f = (x - r).astype(f32)
    c1, c2, c3 = (np.float64(f32(c)) for c in EXP2_POLY_COEFFS)

    def fma(a, b, c):  # ``fma.rn.f32`` through fp64: the product is exact there, the sum is
        # rounded twice (to fp64, then fp32), which can differ from one rounding by an ulp, rarely
        return (a.astype(np.float64) * b + c).astype(f32)

    p = fma(f, c3, c2)
    p = fma(p, np.float64(f), c1)
    p = fma(p, np.float64(f), 1.0)
    e = (t.view(np.uint32) << np.uint32(23)).astype(np.uint32)
    return (p.view(np.uint32) + e).astype(np.uint32).view(f32)


def exp2_split_asm(poly: int) -> str:
    """The PTX of `exp2_split`: outputs ``$0 .. $3`` from inputs ``$4 .. $7``, the first ``poly``
    by the polynomial (`exp2_poly_reference`), the rest by ``ex2.approx.ftz.f32`` (one MUFU op).
    Registers are ``.b32`` (usable by the float and the integer instructions alike); every float
    op rounds explicitly (``.rn``), so ptxas does not fuse ``t - MAGIC`` back into ``x``."""
    if not 0 <= poly <= EXP2_PACK:
        raise ValueError(f"exp2_split: poly {poly} is not in [0, {EXP2_PACK}]")
    c1, c2, c3 = (_f32_hex(c) for c in EXP2_POLY_COEFFS)
    magic, floor, one = _f32_hex(_MAGIC), _f32_hex(EXP2_POLY_FLOOR), _f32_hex(1.0)
    lines = ["{", ".reg .b32 x, t, r, f, p, e;"]
    for i in range(EXP2_PACK):
        out, arg = f"${i}", f"${i + EXP2_PACK}"
        if i < poly:
            lines += [
                f"max.ftz.f32 x, {arg}, {floor};",
                f"add.rn.ftz.f32 t, x, {magic};",
                f"sub.rn.ftz.f32 r, t, {magic};",
                "sub.rn.ftz.f32 f, x, r;",
                f"fma.rn.ftz.f32 p, f, {c3}, {c2};",
                f"fma.rn.ftz.f32 p, p, f, {c1};",
                f"fma.rn.ftz.f32 p, p, f, {one};",
                "shl.b32 e, t, 23;",
                f"add.s32 {out}, p, e;",
            ]
        else:
            lines.append(f"ex2.approx.ftz.f32 {out}, {arg};")
    return "\n".join(lines + ["}"])


#: `exp2_split_asm` for each ``poly`` (a kernel reads a global's value, not a Python call), and
#: the asm's constraints and pack, as the kernel reads them.
EXP2_SPLIT_ASM = tuple(exp2_split_asm(k) for k in range(EXP2_PACK + 1))
_EXP2_CONSTRAINTS = gl.constexpr(",".join(["=r"] * EXP2_PACK + ["r"] * EXP2_PACK))
_EXP2_PACK = gl.constexpr(EXP2_PACK)


@gluon.constexpr_function
def _split_asm(poly):
    return EXP2_SPLIT_ASM[poly]


@gluon.jit
def exp2_split(x, POLY: gl.constexpr):
    """``2^x`` (fp32), ``POLY`` of every `EXP2_PACK` elements of a thread by a polynomial on the
    FMA pipe (`exp2_split_asm`), the rest on the MUFU (one ``ex2`` an element, 16 results a cycle
    an SM by the CUDA guide; the polynomial's 9 PTX ops an element, 8 after ptxas, run on 128 FMA
    lanes). Meant for a softmax bound by the MUFU; the sm_90 prefill kernel's is not
    (bench/NOTES.md, twelfth session: slower at every share), so its switch is off. ``POLY`` 0
    is ``gl.exp2``. Inputs
    below `EXP2_POLY_FLOOR` (-inf included) give at least ``2^-126`` on the polynomial path;
    NaN gives ``2^-126`` there too (``max`` drops it). Inputs above 127 overflow the exponent
    field there (a softmax's are at most 0, or `LAZY_T` with the lazy max)."""
    if POLY == 0:
        y = gl.exp2(x)
    else:
        y = gl.inline_asm_elementwise(
            _split_asm(POLY),
            _EXP2_CONSTRAINTS,
            [x],
            dtype=gl.float32,
            is_pure=True,
            pack=_EXP2_PACK,
        )
    return y


# -- lazy rescale (both sm_90 kernels' online softmax) -------------------------------------------
#: Lazy running max (`portattn.policy.mla.SM90_LAZY_RESCALE`, `portattn.policy.paged.
#: SM90_PREFILL_LAZY_RESCALE`): the reference max moves only when a row's tile max exceeds it by
#: more than this (log2 units), so P <= 2^LAZY_T; exact otherwise.
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


#: `rescale_asm` by values a thread: a warpgroup's 64-row accumulator of 32 to 256 columns (the
#: prefill kernel at head_dim 64 / 128: 32 / 64; MLA's 64 x 256: 128).
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


# -- row reductions of a wgmma tile ---------------------------------------------------------------
@gluon.jit
def halves(x):
    """``x``'s left and right halves of columns, split in registers (reshape, permute, split: no
    data moves where each thread holds columns of both halves, as in a wgmma tile)."""
    ROWS: gl.constexpr = x.shape[0]
    W: gl.constexpr = x.shape[1]
    return gl.split(gl.permute(gl.reshape(x, [ROWS, 2, W // 2]), (0, 2, 1)))


#: Columns a row keeps before `row_max` / `row_sum` hand over to ``gl.max`` / ``gl.sum``: a wgmma
#: tile's 8-column group, which the 4 threads of a row hold 2 each.
TREE_MIN_COLS = gl.constexpr(8)


@gluon.jit
def _tree(x, MAX: gl.constexpr):
    """``x`` halved down to `TREE_MIN_COLS` columns, the halves combined element by element."""
    LEVELS: gl.constexpr = (x.shape[1] // TREE_MIN_COLS).bit_length() - 1
    for _ in gl.static_range(LEVELS):
        left, right = halves(x)
        if MAX:  # noqa: SIM108 (a constexpr branch)
            x = gl.maximum(left, right)
        else:
            x = left + right
    return x


@gluon.jit
def row_max(x, TREE: gl.constexpr):
    """``gl.max(x, 1)``. TREE: as a tree, halves combined first (depth log2 of a thread's columns
    a row), where ``gl.max`` folds a thread's 32 columns a row (a 128-column wgmma tile) one after
    another, each op waiting on the last."""
    if TREE:
        m = gl.convert_layout(gl.max(_tree(x, True), 1), gl.SliceLayout(1, x.type.layout))
    else:
        m = gl.max(x, 1)
    return m


@gluon.jit
def row_sum(x, TREE: gl.constexpr):
    """``gl.sum(x, 1)``; TREE: as a tree (`row_max`; the sum's rounding order changes)."""
    if TREE:
        s = gl.convert_layout(gl.sum(_tree(x, False), 1), gl.SliceLayout(1, x.type.layout))
    else:
        s = gl.sum(x, 1)
    return s
